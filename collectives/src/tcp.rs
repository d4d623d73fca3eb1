//! Host (CPU) communicator over TCP: one OS process or thread per rank, a full mesh
//! of `TcpStream`s, collectives on `[f32]` / `[f64]` host buffers.
//!
//! It exists so the ZeRO engine can run and be tested on machines without GPUs, with
//! the same determinism guarantees as the GPU path:
//! - reduce-scatter: rank j receives chunk j of every rank's buffer and reduces the W
//!   contributions strictly in rank order 0..W-1 (its own at its position), so the
//!   result does not depend on arrival order;
//! - all-reduce is reduce-scatter over chunks of `ceil(n/W)` elements (trailing chunks
//!   shorter or empty) followed by an all-gather, so every rank ends bit-identical.
//!
//! Wire format: every message is a 40-byte little-endian header (magic, op code, dtype,
//! reduce op, root, sender rank, sequence number, element count, payload length)
//! followed by the payload, the raw little-endian element bytes. Each side checks the
//! header against the collective it is running itself, so ranks that call different
//! collectives or pass different sizes get [`CommError::Protocol`] instead of a hang or
//! silently mixed-up data.
//!
//! Failure handling: a link that fails (EOF, reset, io timeout, bad frame) is shut down
//! at once so nothing on either side stays blocked on it; the collective then finishes
//! with the healthy peers, returns the error and marks the communicator broken. A broken
//! communicator sends every healthy peer a short abort notice naming the culprit rank,
//! so their next collective fails with the real cause instead of waiting for the io
//! timeout.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use crate::{CommError, Communicator, Group, ReduceOp};

// Frames are raw little-endian element bytes; a big-endian host would need byte swaps
// everywhere, and no supported platform is big-endian.
#[cfg(not(target_endian = "little"))]
compile_error!("collectives::tcp sends native element bytes and supports little-endian hosts only");

/// How long a rank waits without any progress on a link before it gives up on that
/// peer (see [`TcpComm::set_io_timeout`]).
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(300);

/// Rendezvous timeout used by [`TcpComm::local_group`].
const LOCAL_SETUP_TIMEOUT: Duration = Duration::from_secs(20);

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"STtc");
const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"STfr");
const PROTOCOL_VERSION: u32 = 1;
const HELLO_LEN: usize = 24;
const HEADER_LEN: usize = 40;
/// Abort notices carry a human-readable message; anything longer is a corrupt stream.
const MAX_ABORT_PAYLOAD: u64 = 64 * 1024;

/// Op codes on the wire.
mod code {
    pub const ALL_GATHER: u8 = 1;
    pub const REDUCE_SCATTER: u8 = 2;
    pub const ALL_REDUCE_REDUCE: u8 = 3;
    pub const ALL_REDUCE_GATHER: u8 = 4;
    pub const BROADCAST: u8 = 5;
    pub const BARRIER: u8 = 6;
    pub const ABORT: u8 = 0xff;

    pub const NO_DTYPE: u8 = 0;
    pub const F32: u8 = 1;
    pub const F64: u8 = 2;

    pub const NO_REDUCE: u8 = 0;
    pub const SUM: u8 = 1;
    pub const AVG: u8 = 2;
    pub const MAX: u8 = 3;

    /// `reduce` byte of an abort notice: what kind of failure the culprit caused.
    pub const ABORT_IO: u8 = 0;
    pub const ABORT_PROTOCOL: u8 = 1;
}

mod sealed {
    pub trait Sealed {}
}

/// Element types the TCP communicator can move and reduce (`f32`, `f64`).
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed {
    #[doc(hidden)]
    const DTYPE: u8;
    #[doc(hidden)]
    fn combine(acc: &mut [Self], x: &[Self], op: ReduceOp);
    #[doc(hidden)]
    fn divide(acc: &mut [Self], world: usize);
}

macro_rules! float_element {
    ($t:ty, $code:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: u8 = $code;
            fn combine(acc: &mut [Self], x: &[Self], op: ReduceOp) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(x).for_each(|(a, &b)| *a += b),
                    // NaN-propagating: a NaN on any rank must not be hidden by the others.
                    ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, &b)| {
                        if b > *a || b.is_nan() {
                            *a = b
                        }
                    }),
                }
            }
            fn divide(acc: &mut [Self], world: usize) {
                let w = world as $t;
                acc.iter_mut().for_each(|a| *a /= w);
            }
        }
    };
}
float_element!(f32, code::F32);
float_element!(f64, code::F64);

/// A listener bound for the rendezvous, waiting for the peer addresses.
#[derive(Debug)]
pub struct PendingComm {
    listener: TcpListener,
    addr: SocketAddr,
}

/// Host communicator: a full TCP mesh between `world` ranks.
///
/// After any communication error the communicator is broken and every later call fails;
/// size errors ([`CommError::BadSize`]) are caught before anything is sent and leave it
/// usable.
#[derive(Debug)]
pub struct TcpComm {
    mesh: Mesh,
    /// Receive space for reductions, reused across calls; `u64` words so that it is
    /// aligned for every element type.
    scratch: Vec<u64>,
}

#[derive(Debug)]
struct Peer {
    stream: TcpStream,
    addr: SocketAddr,
}

/// The links and protocol state, separate from the scratch buffer so a collective can
/// receive into scratch while the mesh is borrowed.
#[derive(Debug)]
struct Mesh {
    rank: usize,
    world: usize,
    /// Indexed by rank; `None` at this rank's own index.
    peers: Vec<Option<Peer>>,
    io_timeout: Duration,
    /// Number of message exchanges so far; travels in every header so a rank that
    /// skipped or repeated a collective is caught.
    seq: u64,
    /// Set after a communication failure: the message of the error that broke it.
    broken: Option<String>,
}

/// What a collective is, as announced in every header it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Frame {
    op: u8,
    dtype: u8,
    reduce: u8,
    /// Broadcast root; culprit rank in an abort notice.
    aux: u32,
    /// Element count (per rank for all-gather / reduce-scatter, total otherwise).
    count: u64,
}

#[derive(Debug, Clone, Copy)]
struct Header {
    frame: Frame,
    from: u32,
    seq: u64,
    payload: u64,
}

/// How serious a per-link failure is when choosing which one to report: a direct
/// observation beats a relayed one, and a failed read says more than a failed write
/// (a write usually fails because the other side already gave up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    Protocol,
    Read,
    Relayed,
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

impl TcpComm {
    /// Bind the listener this rank accepts its higher-ranked peers on, e.g.
    /// `"0.0.0.0:0"`; report [`PendingComm::local_addr`] to the rendezvous.
    pub fn bind(addr: &str) -> Result<PendingComm, CommError> {
        let listener = TcpListener::bind(addr).map_err(|e| CommError::Setup(format!("cannot bind {addr}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| CommError::Setup(format!("cannot read the address bound for {addr}: {e}")))?;
        Ok(PendingComm { listener, addr })
    }

    /// A whole group on 127.0.0.1 inside this process (one communicator per rank, to be
    /// moved to one thread each); for tests.
    pub fn local_group(world: usize) -> Result<Vec<TcpComm>, CommError> {
        if world == 0 {
            return Err(CommError::Setup("world size must be at least 1".into()));
        }
        let pending = (0..world).map(|_| TcpComm::bind("127.0.0.1:0")).collect::<Result<Vec<_>, _>>()?;
        let addrs: Vec<SocketAddr> = pending.iter().map(PendingComm::local_addr).collect();
        thread::scope(|s| {
            let mut handles = Vec::with_capacity(world);
            for (rank, p) in pending.into_iter().enumerate() {
                let addrs = &addrs;
                let h = thread::Builder::new()
                    .name(format!("tcp-comm-setup-{rank}"))
                    .spawn_scoped(s, move || p.connect(rank, world, addrs, LOCAL_SETUP_TIMEOUT))
                    .map_err(|e| CommError::Setup(format!("cannot start a setup thread: {e}")))?;
                handles.push(h);
            }
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| CommError::Setup("a rank's setup thread panicked".into()))?)
                .collect()
        })
    }

    /// A group of one: no sockets, collectives are copies.
    fn single() -> TcpComm {
        TcpComm { mesh: Mesh::new(0, 1, vec![None]), scratch: Vec::new() }
    }

    /// How long to wait without progress on a link before failing with
    /// [`CommError::PeerIo`] naming that peer (default [`DEFAULT_IO_TIMEOUT`]).
    pub fn set_io_timeout(&mut self, timeout: Duration) -> Result<(), CommError> {
        if timeout.is_zero() {
            return Err(CommError::Other("the io timeout must be positive".into()));
        }
        for (rank, peer) in self.mesh.peers.iter().enumerate() {
            if let Some(p) = peer {
                p.stream
                    .set_read_timeout(Some(timeout))
                    .and_then(|()| p.stream.set_write_timeout(Some(timeout)))
                    .map_err(|e| {
                        CommError::Other(format!("cannot set the io timeout on the link to rank {rank}: {e}"))
                    })?;
            }
        }
        self.mesh.io_timeout = timeout;
        Ok(())
    }

    /// The current io timeout.
    pub fn io_timeout(&self) -> Duration {
        self.mesh.io_timeout
    }
}

impl PendingComm {
    /// The address the listener is bound to (with the port filled in).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Join the mesh: `peers[j]` is rank j's listener address (this rank's own entry is
    /// not used). Rank i connects to every rank below it and accepts every rank above
    /// it; each connection starts with a handshake carrying the rank, world size and
    /// protocol version, so links are matched to ranks whatever order they arrive in.
    /// Connecting is retried until `timeout` (peers may not be listening yet).
    pub fn connect(
        self,
        rank: usize,
        world: usize,
        peers: &[SocketAddr],
        timeout: Duration,
    ) -> Result<TcpComm, CommError> {
        if world == 0 || rank >= world {
            return Err(CommError::Setup(format!("rank {rank} is not a rank of a world of size {world}")));
        }
        if peers.len() != world {
            return Err(CommError::Setup(format!(
                "rank {rank}: got {} peer addresses for a world of size {world}",
                peers.len()
            )));
        }
        // Ranks travel as u32 in frames.
        if u32::try_from(world).is_err() {
            return Err(CommError::Setup(format!("world size {world} is too large")));
        }
        if world == 1 {
            return Ok(TcpComm::single());
        }
        let deadline = Instant::now() + timeout;
        let mut links: Vec<Option<Peer>> = (0..world).map(|_| None).collect();
        for (j, &addr) in peers.iter().enumerate().take(rank) {
            links[j] = Some(connect_to(rank, world, j, addr, deadline, timeout)?);
        }
        accept_from(&self.listener, rank, world, peers, &mut links, deadline, timeout)?;
        let mut comm = TcpComm { mesh: Mesh::new(rank, world, links), scratch: Vec::new() };
        comm.set_io_timeout(DEFAULT_IO_TIMEOUT)?;
        Ok(comm)
    }
}

/// Time left before `deadline`, at least 1 ms (socket timeouts reject zero).
fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

fn encode_hello(rank: usize, world: usize) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b[8..16].copy_from_slice(&(rank as u64).to_le_bytes());
    b[16..24].copy_from_slice(&(world as u64).to_le_bytes());
    b
}

/// A decoded handshake: (magic, version, rank, world).
fn decode_hello(b: &[u8; HELLO_LEN]) -> (u32, u32, u64, u64) {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let u64_at = |i: usize| u64::from_le_bytes(std::array::from_fn(|k| b[i + k]));
    (u32_at(0), u32_at(4), u64_at(8), u64_at(16))
}

fn connect_to(
    rank: usize,
    world: usize,
    peer: usize,
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
) -> Result<Peer, CommError> {
    let fail = |what: String| CommError::Setup(format!("rank {rank}: connecting to rank {peer} at {addr}: {what}"));
    let stream = loop {
        match TcpStream::connect_timeout(&addr, remaining(deadline).min(Duration::from_secs(5))) {
            Ok(s) => break s,
            // The peer may not have bound yet: retry until the deadline.
            Err(e) if Instant::now() >= deadline => {
                return Err(fail(format!("no connection within {timeout:?} (last error: {e})")))
            }
            Err(_) => thread::sleep(Duration::from_millis(20).min(remaining(deadline))),
        }
    };
    let io = |e: io::Error| fail(format!("handshake failed: {e}"));
    stream.set_nodelay(true).map_err(io)?;
    stream.set_read_timeout(Some(remaining(deadline))).map_err(io)?;
    stream.set_write_timeout(Some(remaining(deadline))).map_err(io)?;
    (&stream).write_all(&encode_hello(rank, world)).map_err(io)?;
    let mut reply = [0u8; HELLO_LEN];
    (&stream).read_exact(&mut reply).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            fail(format!("the peer accepted the connection but did not answer the handshake within {timeout:?}"))
        }
        _ => fail(format!("no handshake reply: {e}")),
    })?;
    let (magic, version, r, w) = decode_hello(&reply);
    if magic != HELLO_MAGIC {
        return Err(fail("the process listening there is not a shardtrain host communicator".into()));
    }
    if version != PROTOCOL_VERSION {
        return Err(fail(format!("peer speaks protocol version {version}, this rank {PROTOCOL_VERSION}")));
    }
    if r != peer as u64 || w != world as u64 {
        return Err(fail(format!(
            "the peer answered as rank {r} of {w}, expected rank {peer} of {world}; are the addresses in rank order?"
        )));
    }
    Ok(Peer { stream, addr })
}

fn accept_from(
    listener: &TcpListener,
    rank: usize,
    world: usize,
    peers: &[SocketAddr],
    links: &mut [Option<Peer>],
    deadline: Instant,
    timeout: Duration,
) -> Result<(), CommError> {
    let fail = |what: String| CommError::Setup(format!("rank {rank}: accepting peers on {}: {what}", peers[rank]));
    // std has no accept timeout: poll a nonblocking listener until the deadline.
    listener.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
    let missing =
        |links: &[Option<Peer>]| -> Vec<usize> { (rank + 1..world).filter(|&j| links[j].is_none()).collect() };
    while !missing(links).is_empty() {
        let (stream, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                if Instant::now() >= deadline {
                    let who: Vec<String> =
                        missing(links).into_iter().map(|j| format!("rank {j} ({})", peers[j])).collect();
                    return Err(fail(format!("{} did not connect within {timeout:?}", who.join(", "))));
                }
                thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(fail(e.to_string())),
        };
        let io = |e: io::Error| fail(format!("handshake with {from}: {e}"));
        stream.set_nonblocking(false).map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        // A stray client that never speaks must not eat the whole rendezvous.
        stream.set_read_timeout(Some(remaining(deadline).min(Duration::from_secs(10)))).map_err(io)?;
        stream.set_write_timeout(Some(remaining(deadline))).map_err(io)?;
        let mut hello = [0u8; HELLO_LEN];
        if (&stream).read_exact(&mut hello).is_err() {
            continue; // not one of ours (port scanner, health check): ignore it
        }
        let (magic, version, r, w) = decode_hello(&hello);
        if magic != HELLO_MAGIC {
            continue;
        }
        if version != PROTOCOL_VERSION {
            return Err(fail(format!("{from} speaks protocol version {version}, this rank {PROTOCOL_VERSION}")));
        }
        if w != world as u64 {
            return Err(fail(format!("{from} claims rank {r} of a world of size {w}, but the world size is {world}")));
        }
        let j = match usize::try_from(r) {
            Ok(j) if j > rank && j < world => j,
            _ => {
                return Err(fail(format!(
                    "{from} claims rank {r}; only ranks {}..{world} connect to rank {rank}",
                    rank + 1
                )))
            }
        };
        if links[j].is_some() {
            return Err(fail(format!("rank {j} connected twice (again from {from})")));
        }
        (&stream).write_all(&encode_hello(rank, world)).map_err(io)?;
        links[j] = Some(Peer { stream, addr: from });
    }
    Ok(())
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let f = &self.frame;
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4] = f.op;
        b[5] = f.dtype;
        b[6] = f.reduce;
        b[8..12].copy_from_slice(&f.aux.to_le_bytes());
        b[12..16].copy_from_slice(&self.from.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&f.count.to_le_bytes());
        b[32..40].copy_from_slice(&self.payload.to_le_bytes());
        b
    }

    /// `None` if the bytes do not start with the frame magic.
    fn decode(b: &[u8; HEADER_LEN]) -> Option<Header> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from_le_bytes(std::array::from_fn(|k| b[i + k]));
        if u32_at(0) != FRAME_MAGIC {
            return None;
        }
        Some(Header {
            frame: Frame { op: b[4], dtype: b[5], reduce: b[6], aux: u32_at(8), count: u64_at(24) },
            from: u32_at(12),
            seq: u64_at(16),
            payload: u64_at(32),
        })
    }
}

fn reduce_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => code::SUM,
        ReduceOp::Avg => code::AVG,
        ReduceOp::Max => code::MAX,
    }
}

impl Frame {
    fn new(op: u8, dtype: u8, reduce: u8, aux: usize, count: usize) -> Frame {
        // aux is a rank (< world, checked to fit u32 at setup); usize -> u64 is lossless.
        Frame { op, dtype, reduce, aux: aux as u32, count: count as u64 }
    }

    /// Human-readable description for error messages, e.g.
    /// "`all_gather` #3 of 7 f32 per rank".
    fn describe(&self, seq: u64) -> String {
        let dtype = match self.dtype {
            code::F32 => "f32".to_string(),
            code::F64 => "f64".to_string(),
            code::NO_DTYPE => String::new(),
            other => format!("dtype#{other}"),
        };
        let reduce = match self.reduce {
            code::SUM => "Sum".to_string(),
            code::AVG => "Avg".to_string(),
            code::MAX => "Max".to_string(),
            other => format!("reduce#{other}"),
        };
        let n = self.count;
        match self.op {
            code::ALL_GATHER => format!("`all_gather` #{seq} of {n} {dtype} per rank"),
            code::REDUCE_SCATTER => format!("`reduce_scatter` #{seq} ({reduce}) of {n} {dtype} per rank"),
            code::ALL_REDUCE_REDUCE => format!("`all_reduce` #{seq} ({reduce}) of {n} {dtype} (reduce phase)"),
            code::ALL_REDUCE_GATHER => format!("`all_reduce` #{seq} ({reduce}) of {n} {dtype} (gather phase)"),
            code::BROADCAST => format!("`broadcast` #{seq} of {n} {dtype} from root {}", self.aux),
            code::BARRIER => format!("`barrier` #{seq}"),
            other => format!("unknown collective code {other} #{seq}"),
        }
    }
}

/// Split `s` into consecutive pieces of the given lengths (which must fit).
fn split_parts<T>(mut s: &mut [T], lens: impl IntoIterator<Item = usize>) -> Vec<&mut [T]> {
    let mut out = Vec::new();
    for len in lens {
        let (head, tail) = std::mem::take(&mut s).split_at_mut(len);
        out.push(head);
        s = tail;
    }
    out
}

/// `len` elements of `T` from the reusable scratch buffer.
fn scratch_slice<T: Element>(scratch: &mut Vec<u64>, len: usize) -> Result<&mut [T], CommError> {
    let too_big = || CommError::Other(format!("a scratch buffer of {len} elements does not fit in memory"));
    let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(too_big)?;
    let words = bytes.div_ceil(8);
    if scratch.len() < words {
        scratch.resize(words, 0);
    }
    // u64 words are aligned for f32 and f64, so this cast cannot fail.
    let all: &mut [T] = bytemuck::try_cast_slice_mut(&mut scratch[..words])
        .map_err(|e| CommError::Other(format!("scratch buffer cast failed: {e}")))?;
    Ok(&mut all[..len])
}

/// `dest = c0 ⊕ c1 ⊕ … ⊕ c(W-1)`, strictly left to right, then divide for Avg.
fn reduce_in_rank_order<T: Element>(dest: &mut [T], contribs: &[&mut [T]], op: ReduceOp, world: usize) {
    if let Some((first, rest)) = contribs.split_first() {
        dest.copy_from_slice(first);
        for c in rest {
            T::combine(dest, c, op);
        }
    }
    if op == ReduceOp::Avg {
        T::divide(dest, world);
    }
}

impl Mesh {
    fn new(rank: usize, world: usize, peers: Vec<Option<Peer>>) -> Mesh {
        Mesh { rank, world, peers, io_timeout: DEFAULT_IO_TIMEOUT, seq: 0, broken: None }
    }

    /// Peers in the order this rank sends to them: starting after itself, so that not
    /// every rank writes to rank 0 first.
    fn send_order(&self) -> impl Iterator<Item = usize> {
        let (r, w) = (self.rank, self.world);
        (1..w).map(move |k| (r + k) % w)
    }

    fn check_usable(&self) -> Result<(), CommError> {
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

    fn io_error(&self, peer: usize, doing: String, e: io::Error) -> CommError {
        let source = match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no progress for {:?} (the io timeout): the rank is hung, slow, or in a collective that does not talk to this one",
                    self.io_timeout
                ),
            ),
            io::ErrorKind::UnexpectedEof => io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by the peer"),
            _ => e,
        };
        let addr = self.link(peer).map(|p| p.addr.to_string()).unwrap_or_default();
        CommError::PeerIo { peer, context: format!("rank {} {doing} {addr}", self.rank), source }
    }

    fn write(&self, peer: usize, bytes: &[u8], frame: &Frame, seq: u64) -> Result<(), Failure> {
        let fail = |e: io::Error| {
            self.shutdown(peer);
            let err = self.io_error(peer, format!("sending {} to", frame.describe(seq)), e);
            Failure { class: Class::Write, link: peer, err }
        };
        let p = self.link(peer).map_err(|err| Failure { class: Class::Local, link: peer, err })?;
        (&p.stream).write_all(bytes).map_err(fail)
    }

    /// Receive one frame of `frame` from `peer` into `buf`, checking its header.
    fn recv(&self, peer: usize, frame: &Frame, seq: u64, buf: &mut [u8]) -> Result<(), Failure> {
        let r = self.recv_inner(peer, frame, seq, buf);
        if r.is_err() {
            self.shutdown(peer);
        }
        r
    }

    fn recv_inner(&self, peer: usize, frame: &Frame, seq: u64, buf: &mut [u8]) -> Result<(), Failure> {
        let me = self.rank;
        let p = self.link(peer).map_err(|err| Failure { class: Class::Local, link: peer, err })?;
        let read_fail = |e: io::Error| Failure {
            class: Class::Read,
            link: peer,
            err: self.io_error(peer, format!("receiving {} from", frame.describe(seq)), e),
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
            return Err(self.relayed_abort(peer, &h));
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
    fn relayed_abort(&self, peer: usize, h: &Header) -> Failure {
        let me = self.rank;
        let protocol =
            |detail: String| Failure { class: Class::Protocol, link: peer, err: CommError::Protocol { peer, detail } };
        if h.payload > MAX_ABORT_PAYLOAD {
            return protocol(format!("abort notice from rank {peer} claims a {}-byte message", h.payload));
        }
        let mut msg = vec![0u8; h.payload as usize];
        if let Err(e) = self.link(peer).and_then(|p| {
            (&p.stream).read_exact(&mut msg).map_err(|e| self.io_error(peer, "reading an abort notice from".into(), e))
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
    /// Deadlock freedom: all headers go out first (they are tiny, so they never block
    /// for long); then, if this rank sends any payload, every incoming link gets its
    /// own reader thread while this thread writes, so each link is always drained and
    /// no pair of ranks can block each other on full socket buffers. A rank that sends
    /// no payload and expects payload from at most one peer just reads on this thread:
    /// it drains its only payload source, and everything else it reads is headers
    /// already sent.
    fn exchange(
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
        let mut dead = vec![false; mesh.world];
        for &(p, payload) in sends {
            let h = Header { frame, from: mesh.rank as u32, seq, payload: payload.len() as u64 };
            if let Err(f) = mesh.write(p, &h.encode(), &frame, seq) {
                dead[p] = true;
                fails.push(f);
            }
        }
        let writes_payload = sends.iter().any(|(_, b)| !b.is_empty());
        let payload_sources = recvs.iter().filter(|(_, b)| !b.is_empty()).count();
        if !writes_payload && payload_sources <= 1 {
            for (p, buf) in recvs {
                if dead[p] {
                    continue;
                }
                if let Err(f) = mesh.recv(p, &frame, seq, buf) {
                    fails.push(f);
                    break; // nobody waits on our reads: no point reading the rest
                }
            }
        } else {
            thread::scope(|s| {
                let mut readers = Vec::with_capacity(recvs.len());
                for (p, buf) in recvs {
                    if dead[p] {
                        continue;
                    }
                    let spawned = thread::Builder::new()
                        .name(format!("tcp-comm-rx-{p}"))
                        .spawn_scoped(s, move || mesh.recv(p, &frame, seq, buf));
                    match spawned {
                        Ok(h) => readers.push((p, h)),
                        Err(e) => {
                            mesh.shutdown(p);
                            let err = CommError::Other(format!("cannot start a receive thread: {e}"));
                            fails.push(Failure { class: Class::Local, link: p, err });
                        }
                    }
                }
                for &(p, payload) in sends {
                    if dead[p] || payload.is_empty() {
                        continue;
                    }
                    if let Err(f) = mesh.write(p, payload, &frame, seq) {
                        fails.push(f);
                    }
                }
                for (p, h) in readers {
                    match h.join() {
                        Ok(Ok(())) => {}
                        Ok(Err(f)) => fails.push(f),
                        Err(_) => {
                            mesh.shutdown(p);
                            let err = CommError::Other(format!("the thread receiving from rank {p} panicked"));
                            fails.push(Failure { class: Class::Local, link: p, err });
                        }
                    }
                }
            });
        }
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

impl Group for TcpComm {
    fn rank(&self) -> usize {
        self.mesh.rank
    }

    fn world(&self) -> usize {
        self.mesh.world
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.mesh.check_usable()?;
        if self.mesh.world == 1 {
            return Ok(());
        }
        let frame = Frame::new(code::BARRIER, code::NO_DTYPE, code::NO_REDUCE, 0, 0);
        let sends: Vec<(usize, &[u8])> = self.mesh.send_order().map(|p| (p, &[][..])).collect();
        let recvs = (0..self.mesh.world).filter(|&p| p != self.mesh.rank).map(|p| (p, &mut [][..])).collect();
        self.mesh.exchange(frame, &sends, recvs)
    }
}

fn bad_size(op: &'static str, world: usize, detail: String) -> CommError {
    CommError::BadSize { op, world, detail }
}

impl<T: Element> Communicator<[T]> for TcpComm {
    fn all_gather(&mut self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let (r, w, n) = (self.mesh.rank, self.mesh.world, send.len());
        if n.checked_mul(w) != Some(recv.len()) {
            return Err(bad_size(
                "all_gather",
                w,
                format!("send has {n} elements, so recv needs {w} × {n}, but it has {}", recv.len()),
            ));
        }
        self.mesh.check_usable()?;
        recv[r * n..(r + 1) * n].copy_from_slice(send);
        if w == 1 {
            return Ok(());
        }
        let frame = Frame::new(code::ALL_GATHER, T::DTYPE, code::NO_REDUCE, 0, n);
        let bytes: &[u8] = bytemuck::cast_slice(send);
        let sends: Vec<(usize, &[u8])> = self.mesh.send_order().map(|p| (p, bytes)).collect();
        let size = std::mem::size_of_val(send);
        let parts = split_parts(bytemuck::cast_slice_mut::<T, u8>(recv), std::iter::repeat_n(size, w));
        let recvs = parts.into_iter().enumerate().filter(|&(q, _)| q != r).collect();
        self.mesh.exchange(frame, &sends, recvs)
    }

    fn reduce_scatter(&mut self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let (r, w, n) = (self.mesh.rank, self.mesh.world, recv.len());
        if n.checked_mul(w) != Some(send.len()) {
            return Err(bad_size(
                "reduce_scatter",
                w,
                format!("recv has {n} elements, so send needs {w} × {n}, but it has {}", send.len()),
            ));
        }
        self.mesh.check_usable()?;
        let chunk = |q: usize| &send[q * n..(q + 1) * n];
        if w == 1 {
            recv.copy_from_slice(send);
            if op == ReduceOp::Avg {
                T::divide(recv, 1);
            }
            return Ok(());
        }
        let frame = Frame::new(code::REDUCE_SCATTER, T::DTYPE, reduce_code(op), 0, n);
        let slots = scratch_slice::<T>(&mut self.scratch, w * n)?;
        let mut parts = split_parts(slots, std::iter::repeat_n(n, w));
        parts[r].copy_from_slice(chunk(r));
        let sends: Vec<(usize, &[u8])> =
            self.mesh.send_order().map(|p| (p, bytemuck::cast_slice::<T, u8>(chunk(p)))).collect();
        let recvs = parts
            .iter_mut()
            .enumerate()
            .filter(|&(q, _)| q != r)
            .map(|(q, s)| (q, bytemuck::cast_slice_mut::<T, u8>(s)))
            .collect();
        self.mesh.exchange(frame, &sends, recvs)?;
        reduce_in_rank_order(recv, &parts, op, w);
        Ok(())
    }

    fn all_reduce(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let (r, w, n) = (self.mesh.rank, self.mesh.world, buf.len());
        self.mesh.check_usable()?;
        if w == 1 {
            if op == ReduceOp::Avg {
                T::divide(buf, 1);
            }
            return Ok(());
        }
        // Chunk c is buf[c*k .. (c+1)*k] clipped to n: trailing chunks may be short or empty.
        let k = n.div_ceil(w);
        let range = |c: usize| (c * k).min(n)..((c + 1) * k).min(n);
        let own = range(r);
        let m = own.len();

        // Reduce phase: rank p gets everybody's chunk p and reduces it in rank order.
        let frame = Frame::new(code::ALL_REDUCE_REDUCE, T::DTYPE, reduce_code(op), 0, n);
        let slots = scratch_slice::<T>(&mut self.scratch, w * m)?;
        let mut parts = split_parts(slots, std::iter::repeat_n(m, w));
        parts[r].copy_from_slice(&buf[own.clone()]);
        {
            let sends: Vec<(usize, &[u8])> =
                self.mesh.send_order().map(|p| (p, bytemuck::cast_slice::<T, u8>(&buf[range(p)]))).collect();
            let recvs = parts
                .iter_mut()
                .enumerate()
                .filter(|&(q, _)| q != r)
                .map(|(q, s)| (q, bytemuck::cast_slice_mut::<T, u8>(s)))
                .collect();
            self.mesh.exchange(frame, &sends, recvs)?;
        }
        reduce_in_rank_order(&mut buf[own], &parts, op, w);

        // Gather phase: every rank gets every reduced chunk, byte for byte.
        let frame = Frame { op: code::ALL_REDUCE_GATHER, ..frame };
        let size = std::mem::size_of::<T>();
        let mut parts = split_parts(bytemuck::cast_slice_mut::<T, u8>(buf), (0..w).map(|c| range(c).len() * size));
        let mine: &[u8] = std::mem::take::<&mut [u8]>(&mut parts[r]);
        let sends: Vec<(usize, &[u8])> = self.mesh.send_order().map(|p| (p, mine)).collect();
        let recvs = parts.into_iter().enumerate().filter(|&(q, _)| q != r).collect();
        self.mesh.exchange(frame, &sends, recvs)
    }

    fn broadcast(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        let (r, w, n) = (self.mesh.rank, self.mesh.world, buf.len());
        if root >= w {
            return Err(bad_size("broadcast", w, format!("root {root} is not a rank (buffer of {n} elements)")));
        }
        self.mesh.check_usable()?;
        if w == 1 {
            return Ok(());
        }
        let frame = Frame::new(code::BROADCAST, T::DTYPE, code::NO_REDUCE, root, n);
        // Non-roots answer the root with an empty frame, so a root mismatch is caught
        // on both sides.
        if r == root {
            let bytes: &[u8] = bytemuck::cast_slice(buf);
            let sends: Vec<(usize, &[u8])> = self.mesh.send_order().map(|p| (p, bytes)).collect();
            let recvs = (0..w).filter(|&p| p != r).map(|p| (p, &mut [][..])).collect();
            self.mesh.exchange(frame, &sends, recvs)
        } else {
            let bytes = bytemuck::cast_slice_mut::<T, u8>(buf);
            self.mesh.exchange(frame, &[(root, &[][..])], vec![(root, bytes)])
        }
    }
}
