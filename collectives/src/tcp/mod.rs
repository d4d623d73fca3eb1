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
//!
//! Where things are: `handshake` (how a new connection proves it belongs to the group),
//! `wire` (the frame header and op codes), `mesh` (the links, non-blocking sends, failure
//! handling), `collectives` (the collectives themselves and their reductions); this file
//! holds the public types and their set-up.

mod collectives;
mod handshake;
mod mesh;
mod wire;

use std::net::{SocketAddr, TcpListener};
use std::thread;
use std::time::Duration;

use crate::CommError;
use mesh::Mesh;

pub use collectives::Element;

// Frames are raw little-endian element bytes; a big-endian host would need byte swaps
// everywhere, and no supported platform is big-endian.
#[cfg(not(target_endian = "little"))]
compile_error!("collectives::tcp sends native element bytes and supports little-endian hosts only");

/// How long a rank waits without any progress on a link before it gives up on that
/// peer (see [`TcpComm::set_io_timeout`]).
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(300);

/// Rendezvous timeout used by [`TcpComm::local_group`].
const LOCAL_SETUP_TIMEOUT: Duration = Duration::from_secs(20);

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
