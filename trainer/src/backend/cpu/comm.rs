//! Binds a host communicator to the CPU backend's buffer type (`Vec<f32>`), so the
//! engine's collectives on parameters, gradients and scalars all go through one object.

use collectives::{AllGatherInPlace, CommError, Communicator, Group, Pending, ReduceOp};

/// Wraps any `[f32]` communicator (e.g. `collectives::tcp::TcpComm`) for `Vec<f32>` buffers.
pub struct HostComm<C>(pub C);

impl<C: Group> Group for HostComm<C> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world(&self) -> usize {
        self.0.world()
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.0.barrier()
    }
}

impl<C: Communicator<[f32]>> Communicator<[f32]> for HostComm<C> {
    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        self.0.all_gather(send, recv)
    }
    fn reduce_scatter(&mut self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.0.reduce_scatter(send, recv, op)
    }
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.0.all_reduce(buf, op)
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.0.broadcast(buf, root)
    }
}

impl<C: Communicator<[f32]>> Communicator<Vec<f32>> for HostComm<C> {
    fn all_gather(&mut self, send: &Vec<f32>, recv: &mut Vec<f32>) -> Result<(), CommError> {
        self.0.all_gather(send, recv)
    }
    fn reduce_scatter(&mut self, send: &Vec<f32>, recv: &mut Vec<f32>, op: ReduceOp) -> Result<(), CommError> {
        self.0.reduce_scatter(send, recv, op)
    }
    fn all_reduce(&mut self, buf: &mut Vec<f32>, op: ReduceOp) -> Result<(), CommError> {
        self.0.all_reduce(buf, op)
    }
    fn broadcast(&mut self, buf: &mut Vec<f32>, root: usize) -> Result<(), CommError> {
        self.0.broadcast(buf, root)
    }
}

impl<C: Communicator<[f32]>> AllGatherInPlace<Vec<f32>> for HostComm<C> {
    /// The host communicator has no in-place form: this rank's piece is copied out and
    /// all-gathered back over the buffer (host memory, one piece).
    fn all_gather_in_place_start(&mut self, buf: &mut Vec<f32>) -> Result<Pending, CommError> {
        let world = self.0.world();
        let n = buf.len() / world;
        if n * world != buf.len() {
            let detail = format!("{} elements do not split into {world} equal pieces", buf.len());
            return Err(CommError::BadSize { op: "all_gather_in_place", world, detail });
        }
        let r = self.0.rank();
        let own = buf[r * n..(r + 1) * n].to_vec();
        self.0.all_gather(&own, buf)?;
        Ok(Pending::DONE)
    }
}
