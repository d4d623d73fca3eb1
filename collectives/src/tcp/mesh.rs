//! The TCP communicator's links: one `TcpStream` per peer, and the one message exchange
//! every collective is made of (`Mesh::exchange`: non-blocking pushes, a writer thread for
//! what does not fit, reads in turn), with the failure handling around it (links shut down
//! at once, the most telling error chosen, healthy peers told the culprit). It exists apart
//! from the collectives so the deadlock-freedom and failure rules live in one place.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::thread;
use std::time::Duration;

use super::wire::{code, Frame, Header, Outgoing, HEADER_LEN, MAX_ABORT_PAYLOAD};
use super::DEFAULT_IO_TIMEOUT;
use crate::CommError;

/// After a collective has failed, how long to wait for each remaining peer's message.
const FAILURE_PATIENCE: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub(super) struct Peer {
    pub(super) stream: TcpStream,
    pub(super) addr: SocketAddr,
}

/// The links and protocol state, separate from the scratch buffer so a collective can
/// receive into scratch while the mesh is borrowed.
#[derive(Debug)]
pub(super) struct Mesh {
    pub(super) rank: usize,
    pub(super) world: usize,
    /// Indexed by rank; `None` at this rank's own index.
    pub(super) peers: Vec<Option<Peer>>,
    pub(super) io_timeout: Duration,
    /// Number of message exchanges so far; travels in every header so a rank that
    /// skipped or repeated a collective is caught.
    seq: u64,
    /// Set after a communication failure: the message of the error that broke it.
    broken: Option<String>,
}

/// How serious a per-link failure is when choosing which one to report: a direct
/// observation beats a relayed one, and a failed read says more than a failed write
/// (a write usually fails because the other side already gave up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    Protocol,
    Read,
    Relayed,
    /// A peer that stayed silent for the short wait granted after an earlier failure.
    Impatient,
    Write,
    Local,
}

#[derive(Debug)]
struct Failure {
    class: Class,
    /// The link it happened on (its stream has been shut down).
    link: usize,
    err: CommError,
}

impl Mesh {
    pub(super) fn new(rank: usize, world: usize, peers: Vec<Option<Peer>>) -> Mesh {
        Mesh { rank, world, peers, io_timeout: DEFAULT_IO_TIMEOUT, seq: 0, broken: None }
    }

    /// Peers in the order this rank sends to them: starting after itself, so that not
    /// every rank writes to rank 0 first.
    pub(super) fn send_order(&self) -> impl Iterator<Item = usize> {
        let (r, w) = (self.rank, self.world);
        (1..w).map(move |k| (r + k) % w)
    }

    pub(super) fn check_usable(&self) -> Result<(), CommError> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(CommError::Other(format!(
                "the host communicator of rank {} failed earlier and cannot be used any more: {why}",
                self.rank
            ))),
        }
    }

    fn link(&self, peer: usize) -> Result<&Peer, CommError> {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| CommError::Other(format!("rank {} has no link to rank {peer}", self.rank)))
    }

    /// Shut a link down so that threads blocked on it, here and at the peer, return.
    fn shutdown(&self, peer: usize) {
        if let Ok(p) = self.link(peer) {
            let _ = p.stream.shutdown(Shutdown::Both);
        }
    }

    /// `patience`: the shortened read timeout in force, if any (see [`Mesh::recv`]).
    fn io_error(&self, peer: usize, doing: String, e: io::Error, patience: Option<Duration>) -> CommError {
        let source = match (e.kind(), patience) {
            (io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut, None) => io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no progress for {:?} (the io timeout): the rank is hung, slow, or in a collective that does not talk to this one",
                    self.io_timeout
                ),
            ),
            (io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut, Some(t)) => io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no progress for {t:?} (waited only that long: this collective had already failed)"),
            ),
            (io::ErrorKind::UnexpectedEof, _) => {
                io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by the peer")
            }
            _ => e,
        };
        let addr = self.link(peer).map(|p| p.addr.to_string()).unwrap_or_default();
        CommError::PeerIo { peer, context: format!("rank {} {doing} {addr}", self.rank), source }
    }

    fn write_failure(&self, peer: usize, frame: &Frame, seq: u64, e: io::Error) -> Failure {
        self.shutdown(peer);
        let err = self.io_error(peer, format!("sending {} to", frame.describe(seq)), e, None);
        Failure { class: Class::Write, link: peer, err }
    }

    /// Send as much of `msg` as the socket takes without blocking; returns how much.
    fn push(&self, peer: usize, msg: &Outgoing<'_>) -> io::Result<usize> {
        let stream = &self.link(peer).map_err(io::Error::other)?.stream;
        stream.set_nonblocking(true)?;
        let mut sent = 0;
        let pushed = loop {
            if sent == msg.len() {
                break Ok(sent);
            }
            let (a, b) = msg.rest(sent);
            match (&*stream).write_vectored(&[IoSlice::new(a), IoSlice::new(b)]) {
                Ok(0) => break Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(k) => sent += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Ok(sent),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        // Restore blocking mode even if the push failed; report the first error.
        let restored = stream.set_nonblocking(false);
        let sent = pushed?;
        restored?;
        Ok(sent)
    }

    /// Blocking write of what [`Mesh::push`] left of `msg`.
    fn write_rest(&self, peer: usize, msg: &Outgoing<'_>, sent: usize) -> io::Result<()> {
        let mut stream = &self.link(peer).map_err(io::Error::other)?.stream;
        let (a, b) = msg.rest(sent);
        stream.write_all(a)?;
        stream.write_all(b)
    }

    /// Receive one frame of `frame` from `peer` into `buf`, checking its header.
    /// With `patience`, wait at most that long for progress instead of the io timeout.
    fn recv(
        &self,
        peer: usize,
        frame: &Frame,
        seq: u64,
        buf: &mut [u8],
        patience: Option<Duration>,
    ) -> Result<(), Failure> {
        let r = match (patience, self.link(peer)) {
            (Some(t), Ok(p)) => match p.stream.set_read_timeout(Some(t)) {
                Ok(()) => self.recv_inner(peer, frame, seq, buf, patience),
                Err(e) => Err(Failure {
                    class: Class::Local,
                    link: peer,
                    err: self.io_error(peer, "setting a read timeout on the link to".into(), e, None),
                }),
            },
            _ => self.recv_inner(peer, frame, seq, buf, patience),
        };
        if r.is_err() {
            self.shutdown(peer);
        }
        r
    }

    fn recv_inner(
        &self,
        peer: usize,
        frame: &Frame,
        seq: u64,
        buf: &mut [u8],
        patience: Option<Duration>,
    ) -> Result<(), Failure> {
        let me = self.rank;
        let p = self.link(peer).map_err(|err| Failure { class: Class::Local, link: peer, err })?;
        let read_fail = |e: io::Error| {
            let timed_out = matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut);
            let class = if timed_out && patience.is_some() { Class::Impatient } else { Class::Read };
            let err = self.io_error(peer, format!("receiving {} from", frame.describe(seq)), e, patience);
            Failure { class, link: peer, err }
        };
        let protocol =
            |detail: String| Failure { class: Class::Protocol, link: peer, err: CommError::Protocol { peer, detail } };
        let mut hb = [0u8; HEADER_LEN];
        (&p.stream).read_exact(&mut hb).map_err(read_fail)?;
        let Some(h) = Header::decode(&hb) else {
            return Err(protocol(format!(
                "rank {me} expected the header of {} but got bytes without the frame magic (the stream is out of sync)",
                frame.describe(seq)
            )));
        };
        if h.frame.op == code::ABORT {
            return Err(self.relayed_abort(peer, &h, patience));
        }
        if h.from as usize != peer {
            return Err(protocol(format!(
                "the frame on rank {me}'s link to rank {peer} claims to come from rank {}",
                h.from
            )));
        }
        if h.frame != *frame || h.seq != seq {
            return Err(protocol(format!(
                "rank {peer} is in {} but rank {me} is in {}: the ranks called different collectives{}",
                h.frame.describe(h.seq),
                frame.describe(seq),
                if h.frame == *frame { " (one skipped or repeated a call)" } else { " or passed different sizes" }
            )));
        }
        if h.payload != buf.len() as u64 {
            return Err(protocol(format!(
                "rank {peer} sent {} bytes for {}, rank {me} expected {}",
                h.payload,
                frame.describe(seq),
                buf.len()
            )));
        }
        (&p.stream).read_exact(buf).map_err(read_fail)
    }

    /// Turn an abort notice from `peer` into the error it reports.
    fn relayed_abort(&self, peer: usize, h: &Header, patience: Option<Duration>) -> Failure {
        let me = self.rank;
        let protocol =
            |detail: String| Failure { class: Class::Protocol, link: peer, err: CommError::Protocol { peer, detail } };
        if h.payload > MAX_ABORT_PAYLOAD {
            return protocol(format!("abort notice from rank {peer} claims a {}-byte message", h.payload));
        }
        let mut msg = vec![0u8; h.payload as usize];
        if let Err(e) = self.link(peer).and_then(|p| {
            (&p.stream)
                .read_exact(&mut msg)
                .map_err(|e| self.io_error(peer, "reading an abort notice from".into(), e, patience))
        }) {
            return Failure { class: Class::Read, link: peer, err: e };
        }
        let msg = String::from_utf8_lossy(&msg);
        let culprit = h.frame.aux as usize;
        let err = if h.frame.reduce == code::ABORT_PROTOCOL {
            CommError::Protocol { peer: culprit, detail: format!("{msg} (reported to rank {me} by rank {peer})") }
        } else {
            CommError::PeerIo {
                peer: culprit,
                context: format!("reported to rank {me} by rank {peer}"),
                source: io::Error::new(io::ErrorKind::ConnectionAborted, msg.into_owned()),
            }
        };
        Failure { class: Class::Relayed, link: peer, err }
    }

    /// One message exchange of a collective: send `sends[i].1` to peer `sends[i].0`
    /// and receive exactly `recvs[i].1.len()` bytes from peer `recvs[i].0`, every
    /// message preceded by a header announcing `frame`.
    ///
    /// Deadlock freedom: this thread never blocks on a write. Each message is first
    /// pushed without blocking (small ones, the common case, go out whole and cost no
    /// thread); what does not fit is finished by a thread dedicated to that link. Then
    /// this thread reads the incoming messages one after the other. Every read
    /// finishes, because on the sending side that message is either already in the
    /// socket buffers or being written by a thread that waits for nothing but this
    /// read; so no two ranks can block each other on full socket buffers.
    pub(super) fn exchange(
        &mut self,
        frame: Frame,
        sends: &[(usize, &[u8])],
        recvs: Vec<(usize, &mut [u8])>,
    ) -> Result<(), CommError> {
        self.check_usable()?;
        let seq = self.seq;
        self.seq += 1;
        let mesh: &Mesh = self;
        let mut fails: Vec<Failure> = Vec::new();
        let mut unfinished = Vec::new();
        for &(p, payload) in sends {
            let header = Header { frame, from: mesh.rank as u32, seq, payload: payload.len() as u64 }.encode();
            let msg = Outgoing { header, payload };
            match mesh.push(p, &msg) {
                Ok(sent) if sent == msg.len() => {}
                Ok(sent) => unfinished.push((p, msg, sent)),
                Err(e) => fails.push(mesh.write_failure(p, &frame, seq, e)),
            }
        }
        thread::scope(|s| {
            let mut writers = Vec::with_capacity(unfinished.len());
            for (p, msg, sent) in unfinished {
                let spawned = thread::Builder::new()
                    .name(format!("tcp-comm-tx-{p}"))
                    .spawn_scoped(s, move || mesh.write_rest(p, &msg, sent));
                match spawned {
                    Ok(h) => writers.push((p, h)),
                    Err(e) => {
                        // The peer would wait for the rest forever: cut the link instead.
                        fails.push(mesh.write_failure(p, &frame, seq, e));
                    }
                }
            }
            // Links whose write failed are read all the same: what the peer sent is
            // still queued and usually says why (e.g. it is in another collective).
            for (p, buf) in recvs {
                // Once this collective has failed, keep draining the healthy peers (so
                // their writers are not left blocked on us) but give up on a silent one
                // quickly instead of after the full io timeout.
                let patience = (!fails.is_empty()).then(|| mesh.io_timeout.min(FAILURE_PATIENCE));
                if let Err(f) = mesh.recv(p, &frame, seq, buf, patience) {
                    fails.push(f);
                }
            }
            for (p, h) in writers {
                match h.join() {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => fails.push(mesh.write_failure(p, &frame, seq, e)),
                    Err(_) => {
                        mesh.shutdown(p);
                        let err = CommError::Other(format!("the thread sending to rank {p} panicked"));
                        fails.push(Failure { class: Class::Local, link: p, err });
                    }
                }
            }
        });
        if fails.is_empty() {
            return Ok(());
        }
        Err(self.break_down(fails))
    }

    /// Mark the communicator broken, tell the healthy peers why, and pick the error to
    /// report.
    fn break_down(&mut self, mut fails: Vec<Failure>) -> CommError {
        // Stable sort: within a class, the first failure observed wins.
        fails.sort_by_key(|f| f.class);
        let failed_links: Vec<usize> = fails.iter().map(|f| f.link).collect();
        let Some(first) = fails.into_iter().next() else {
            return CommError::Other("internal error: no failure to report".into());
        };
        let err = first.err;
        let (kind, culprit, msg) = match &err {
            CommError::Protocol { peer, detail } => (code::ABORT_PROTOCOL, *peer, detail.clone()),
            CommError::PeerIo { peer, context, source } => (code::ABORT_IO, *peer, format!("{context}: {source}")),
            other => (code::ABORT_IO, self.rank, other.to_string()),
        };
        let mut msg = msg.into_bytes();
        msg.truncate(MAX_ABORT_PAYLOAD as usize);
        let frame = Frame::new(code::ABORT, code::NO_DTYPE, kind, culprit, 0);
        let h = Header { frame, from: self.rank as u32, seq: self.seq, payload: msg.len() as u64 };
        for p in 0..self.world {
            if p == self.rank || failed_links.contains(&p) {
                continue;
            }
            // Best effort: the peer may be gone too, and the error we return matters more.
            if let Ok(peer) = self.link(p) {
                let _ = (&peer.stream).write_all(&h.encode()).and_then(|()| (&peer.stream).write_all(&msg));
            }
        }
        self.broken = Some(err.to_string());
        err
    }
}
