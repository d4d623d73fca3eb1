//! The connection handshake of the TCP communicator: how a new link proves it belongs to
//! the group. Both ends send a fixed 32-byte `Hello` (magic, protocol version, rank, world
//! size, a fingerprint of the peer address list); a listener turns away anything that does
//! not match, with the reason, and keeps waiting for the ranks it expects. It exists apart
//! from the collectives because it runs once, at set-up, and has its own failure modes
//! (strays, recycled ports, ranks given different lists).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::mesh::{Mesh, Peer};
use super::{PendingComm, TcpComm, DEFAULT_IO_TIMEOUT};
use crate::CommError;

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"STtc");
const PROTOCOL_VERSION: u32 = 1;
const HELLO_LEN: usize = 32;

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
