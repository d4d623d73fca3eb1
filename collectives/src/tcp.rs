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
//! Progress: a rank never blocks on a write. It pushes each outgoing message without
//! blocking (small ones go out whole, with no thread), hands any rest to a thread of
//! that link, and reads its incoming messages in turn; see `Mesh::exchange`.
//!
//! Failure handling: a link that fails (EOF, reset, io timeout, bad frame) is shut down
//! at once so nothing on either side stays blocked on it; the collective then finishes
//! with the healthy peers, returns the error and marks the communicator broken. A broken
//! communicator sends every healthy peer a short abort notice naming the culprit rank,
//! so their next collective fails with the real cause instead of waiting for the io
//! timeout.

use std::io::{self, IoSlice, Read, Write};
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
const HELLO_LEN: usize = 32;
const HEADER_LEN: usize = 40;
/// After a collective has failed, how long to wait for each remaining peer's message.
const FAILURE_PATIENCE: Duration = Duration::from_secs(1);
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

/// A header and its payload, sent as one message.
struct Outgoing<'a> {
    header: [u8; HEADER_LEN],
    payload: &'a [u8],
}

impl Outgoing<'_> {
    fn len(&self) -> usize {
        HEADER_LEN + self.payload.len()
    }

    /// What is left to send after the first `sent` bytes, as two slices.
    fn rest(&self, sent: usize) -> (&[u8], &[u8]) {
        match sent.checked_sub(HEADER_LEN) {
            None => (&self.header[sent..], self.payload),
            Some(k) => (&[], &self.payload[k.min(self.payload.len())..]),
        }
    }
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

    /// Join the mesh: `peers[j]` is rank j's listener address, and every rank must pass
    /// the same list (its own entry is not dialled, but the list identifies the group).
    /// Rank i connects to every rank below it and accepts every rank above it; each
    /// connection starts with a handshake carrying the rank, world size, protocol
    /// version and a fingerprint of `peers`, so links are matched to ranks whatever
    /// order they arrive in, and a process of another group that reaches this listener
    /// (say, through a recycled port) is turned away instead of being wired in.
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
        let me = Hello { version: PROTOCOL_VERSION, rank: rank as u64, world: world as u64, group: fingerprint(peers) };
        let deadline = Instant::now() + timeout;
        let mut links: Vec<Option<Peer>> = (0..world).map(|_| None).collect();
        for (j, &addr) in peers.iter().enumerate().take(rank) {
            links[j] = Some(connect_to(&me, j, addr, deadline, timeout)?);
        }
        accept_from(&self.listener, &me, peers, &mut links, deadline, timeout)?;
        let mut comm = TcpComm { mesh: Mesh::new(rank, world, links), scratch: Vec::new() };
        comm.set_io_timeout(DEFAULT_IO_TIMEOUT)?;
        Ok(comm)
    }
}

/// Time left before `deadline`, at least 1 ms (socket timeouts reject zero).
fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// FNV-1a over the peer list: identical on every rank of a group, stable across builds.
fn fingerprint(peers: &[SocketAddr]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for a in peers {
        for b in a.to_string().bytes().chain([b';']) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The handshake both ends of a new connection send. A rejection is a `Hello` with
/// `rank == REJECTED` and `world` = length of the UTF-8 reason that follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hello {
    version: u32,
    rank: u64,
    world: u64,
    group: u64,
}

const REJECTED: u64 = u64::MAX;
const MAX_REJECT_REASON: u64 = 4096;

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.version.to_le_bytes());
        b[8..16].copy_from_slice(&self.rank.to_le_bytes());
        b[16..24].copy_from_slice(&self.world.to_le_bytes());
        b[24..32].copy_from_slice(&self.group.to_le_bytes());
        b
    }

    /// `None` if the bytes do not start with the handshake magic.
    fn decode(b: &[u8; HELLO_LEN]) -> Option<Hello> {
        let u64_at = |i: usize| u64::from_le_bytes(std::array::from_fn(|k| b[i + k]));
        if b[0..4] != HELLO_MAGIC.to_le_bytes() {
            return None;
        }
        Some(Hello {
            version: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            rank: u64_at(8),
            world: u64_at(16),
            group: u64_at(24),
        })
    }

    /// Why a peer's `theirs` cannot join the group of `self`, if it cannot.
    fn mismatch(&self, theirs: &Hello) -> Option<String> {
        if theirs.version != self.version {
            return Some(format!("protocol version {} (this rank speaks {})", theirs.version, self.version));
        }
        if theirs.world != self.world {
            return Some(format!("a world of size {} (the world size here is {})", theirs.world, self.world));
        }
        if theirs.group != self.group {
            return Some(
                "a different peer address list (another group, or the ranks were given different lists)".into(),
            );
        }
        None
    }
}

fn connect_to(
    me: &Hello,
    peer: usize,
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
) -> Result<Peer, CommError> {
    let rank = me.rank;
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
    (&stream).write_all(&me.encode()).map_err(io)?;
    let mut reply = [0u8; HELLO_LEN];
    (&stream).read_exact(&mut reply).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            fail(format!("the peer accepted the connection but did not answer the handshake within {timeout:?}"))
        }
        _ => fail(format!("no handshake reply: {e}")),
    })?;
    let Some(theirs) = Hello::decode(&reply) else {
        return Err(fail("the process listening there is not a shardtrain host communicator".into()));
    };
    if theirs.rank == REJECTED {
        let mut reason = vec![0u8; theirs.world.min(MAX_REJECT_REASON) as usize];
        let reason = match (&stream).read_exact(&mut reason) {
            Ok(()) => String::from_utf8_lossy(&reason).into_owned(),
            Err(e) => format!("(reason unreadable: {e})"),
        };
        return Err(fail(format!("the peer rejected this rank: {reason}")));
    }
    if let Some(why) = me.mismatch(&theirs) {
        return Err(fail(format!("the peer is in {why}")));
    }
    if theirs.rank != peer as u64 {
        return Err(fail(format!(
            "the peer answered as rank {}, expected rank {peer}; are the addresses in rank order?",
            theirs.rank
        )));
    }
    Ok(Peer { stream, addr })
}

fn accept_from(
    listener: &TcpListener,
    me: &Hello,
    peers: &[SocketAddr],
    links: &mut [Option<Peer>],
    deadline: Instant,
    timeout: Duration,
) -> Result<(), CommError> {
    // Both fit usize: they came from usize values in `connect`.
    let (rank, world) = (me.rank as usize, me.world as usize);
    let fail = |what: String| CommError::Setup(format!("rank {rank}: accepting peers on {}: {what}", peers[rank]));
    // Connections turned away, reported if the wanted ranks then never arrive.
    let mut rejected: Vec<String> = Vec::new();
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
                    let mut msg = format!("{} did not connect within {timeout:?}", who.join(", "));
                    if !rejected.is_empty() {
                        msg += &format!("; turned away: {}", rejected.join("; "));
                    }
                    return Err(fail(msg));
                }
                thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(fail(e.to_string())),
        };
        // Per-connection trouble only turns that connection away: it may be a stray.
        let setup = (|| {
            stream.set_nonblocking(false)?;
            stream.set_nodelay(true)?;
            // A stray client that never speaks must not eat the whole rendezvous.
            stream.set_read_timeout(Some(remaining(deadline).min(Duration::from_secs(10))))?;
            stream.set_write_timeout(Some(remaining(deadline)))?;
            let mut hello = [0u8; HELLO_LEN];
            (&stream).read_exact(&mut hello)?;
            Ok::<_, io::Error>(Hello::decode(&hello))
        })();
        let theirs = match setup {
            Ok(Some(h)) => h,
            // Not one of ours (port scanner, health check): ignore it.
            Ok(None) => continue,
            Err(e) => {
                rejected.push(format!("{from}: handshake failed: {e}"));
                continue;
            }
        };
        let verdict = match me.mismatch(&theirs) {
            Some(why) => Err(format!("it is in {why}")),
            None => match usize::try_from(theirs.rank) {
                Ok(j) if j > rank && j < world && links[j].is_some() => Err(format!("rank {j} is already connected")),
                Ok(j) if j > rank && j < world => Ok(j),
                _ => Err(format!(
                    "it claims rank {}, but only ranks {}..{world} connect to rank {rank}",
                    theirs.rank,
                    rank + 1
                )),
            },
        };
        match verdict {
            Ok(j) => match (&stream).write_all(&me.encode()) {
                // Name it by its listener address, the one the rendezvous published.
                Ok(()) => links[j] = Some(Peer { stream, addr: peers[j] }),
                Err(e) => rejected.push(format!("{from} (rank {j}): handshake reply failed: {e}")),
            },
            Err(why) => {
                // Turn it away with the reason (its own error will show it) and keep
                // waiting for the ranks of this group.
                let reject = Hello { rank: REJECTED, world: why.len() as u64, ..*me };
                let _ = (&stream).write_all(&reject.encode()).and_then(|()| (&stream).write_all(why.as_bytes()));
                rejected.push(format!("{from}: {why}"));
            }
        }
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
