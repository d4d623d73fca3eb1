//! Collective communication for shardtrain.
//!
//! One interface, [`Communicator`], is what the ZeRO engine talks to: all-gather,
//! reduce-scatter, all-reduce, broadcast and barrier over equal-sized per-rank pieces.
//! It is generic over the buffer type so that the same engine code drives
//! host memory (`[f32]`, through [`tcp::TcpComm`]) and GPU memory (NCCL, in the
//! trainer's CUDA backend).
//!
//! Conventions shared by every implementation:
//! - `all_gather(send, recv)`: `recv.len() == world * send.len()`; rank r's `send`
//!   lands in `recv[r*n..(r+1)*n]`.
//! - `reduce_scatter(send, recv, op)`: `send.len() == world * recv.len()`; rank r
//!   receives the reduction of every rank's `send[r*n..(r+1)*n]`.
//! - Reductions are summed in rank order 0, 1, …, world-1 so results are
//!   bit-identical from run to run (determinism is a project rule).

pub mod flight;
#[cfg(feature = "nccl")]
pub mod local;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod progress;
pub mod tcp;

use thiserror::Error;

/// The reduction applied by reduce-scatter and all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the world size.
    Avg,
    /// Element-wise maximum.
    Max,
}

/// Errors from any communicator.
#[derive(Debug, Error)]
pub enum CommError {
    #[error("collective `{op}`: buffer sizes do not fit world size {world}: {detail}")]
    BadSize { op: &'static str, world: usize, detail: String },
    #[error("rank {peer} is unreachable ({context}): {source}. The rank probably died; check its log")]
    PeerIo {
        peer: usize,
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rendezvous of the host communicator failed: {0}")]
    Setup(String),
    #[error("peer {peer} sent a malformed frame: {detail}")]
    Protocol { peer: usize, detail: String },
    #[error("NCCL error in {op}: {detail}")]
    Nccl { op: &'static str, detail: String },
    #[error("{0}")]
    Other(String),
}

/// A collective that may still be running (see [`Communicator::all_gather_start`]).
/// Hand it to [`Group::wait`] before reading the collective's output.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "wait for a started collective before reading its output"]
pub struct Pending(pub u64);

impl Pending {
    /// A collective that already completed (synchronous implementations).
    pub const DONE: Pending = Pending(0);
}

/// Rank identity and synchronisation, independent of buffer type.
pub trait Group {
    /// This process's rank in `0..world()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world(&self) -> usize;
    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<(), CommError>;
    /// Order later work after the started collective `p` (on a GPU: the compute stream
    /// waits for the communication stream's event; no host wait). Synchronous
    /// implementations have nothing to wait for.
    fn wait(&mut self, p: Pending) -> Result<(), CommError> {
        let _ = p;
        Ok(())
    }
}

/// Collectives on buffers of type `B` (e.g. `[f32]` on the host, a device slice on GPU).
pub trait Communicator<B: ?Sized>: Group {
    /// Gather every rank's `send` into `recv`, in rank order.
    fn all_gather(&mut self, send: &B, recv: &mut B) -> Result<(), CommError>;
    /// Reduce `send` across ranks; rank r keeps chunk r of the result in `recv`.
    fn reduce_scatter(&mut self, send: &B, recv: &mut B, op: ReduceOp) -> Result<(), CommError>;
    /// Reduce `buf` across ranks in place; every rank gets the full result.
    fn all_reduce(&mut self, buf: &mut B, op: ReduceOp) -> Result<(), CommError>;
    /// Copy `root`'s `buf` to every rank.
    fn broadcast(&mut self, buf: &mut B, root: usize) -> Result<(), CommError>;
    /// Start an all-gather that may overlap later compute (the ZeRO-3 prefetch). `send`
    /// and `recv` must stay untouched until [`Group::wait`] on the result. Default: synchronous.
    fn all_gather_start(&mut self, send: &B, recv: &mut B) -> Result<Pending, CommError> {
        self.all_gather(send, recv)?;
        Ok(Pending::DONE)
    }
    /// Start a reduce-scatter that may overlap later compute (gradients of a finished
    /// block while backward continues). Default: synchronous.
    fn reduce_scatter_start(&mut self, send: &B, recv: &mut B, op: ReduceOp) -> Result<Pending, CommError> {
        self.reduce_scatter(send, recv, op)?;
        Ok(Pending::DONE)
    }
    /// Start an in-place all-reduce that may overlap later compute (a data-parallel
    /// gradient bucket while backward continues). Default: synchronous.
    fn all_reduce_start(&mut self, buf: &mut B, op: ReduceOp) -> Result<Pending, CommError> {
        self.all_reduce(buf, op)?;
        Ok(Pending::DONE)
    }
}

/// All-gather in place: this rank's piece is already at `buf[rank*n..(rank+1)*n]`
/// (`n = len / world`), and every other rank's piece lands beside it. The ZeRO engine
/// writes its updated piece straight into the full buffer (casting fp32 master weights to
/// compute precision there), so no separate send buffer has to be kept.
pub trait AllGatherInPlace<B: ?Sized>: Group {
    /// Start the in-place all-gather; `buf` must stay untouched until [`Group::wait`].
    fn all_gather_in_place_start(&mut self, buf: &mut B) -> Result<Pending, CommError>;
    /// The in-place all-gather, complete (for later work) when it returns.
    fn all_gather_in_place(&mut self, buf: &mut B) -> Result<(), CommError> {
        let p = self.all_gather_in_place_start(buf)?;
        self.wait(p)
    }
}
