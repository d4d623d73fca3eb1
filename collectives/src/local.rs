//! The communicator of a one-GPU job: every collective of one rank is a copy or nothing,
//! so no NCCL communicator is made (NCCL would reserve about 1 GiB of the GPU for its
//! channels and buffers, for nothing to talk to).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};

use crate::{AllGatherInPlace, CommError, Communicator, Group, Pending, ReduceOp};

/// Rank 0 of a world of 1, on `stream` (the compute stream: copies stay in its order).
pub struct LocalGpuComm {
    stream: Arc<CudaStream>,
}

impl LocalGpuComm {
    pub fn new(stream: Arc<CudaStream>) -> LocalGpuComm {
        LocalGpuComm { stream }
    }

    fn copy<T: DeviceRepr>(
        &self,
        op: &'static str,
        src: &CudaSlice<T>,
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CommError> {
        if src.len() != dst.len() {
            return Err(CommError::BadSize {
                op,
                world: 1,
                detail: format!("send has {} elements, recv {}", src.len(), dst.len()),
            });
        }
        if src.is_empty() {
            return Ok(());
        }
        self.stream.memcpy_dtod(src, dst).map_err(|e| CommError::Other(format!("{op} (one GPU): copy failed: {e}")))
    }
}

impl Group for LocalGpuComm {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        Ok(())
    }
}

impl<T: DeviceRepr> Communicator<CudaSlice<T>> for LocalGpuComm {
    fn all_gather(&mut self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>) -> Result<(), CommError> {
        self.copy("all_gather", send, recv)
    }
    /// One rank's sum, average and maximum are its own values.
    fn reduce_scatter(&mut self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>, _: ReduceOp) -> Result<(), CommError> {
        self.copy("reduce_scatter", send, recv)
    }
    fn all_reduce(&mut self, _: &mut CudaSlice<T>, _: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast(&mut self, _: &mut CudaSlice<T>, root: usize) -> Result<(), CommError> {
        check_root(root)
    }
}

impl<T: DeviceRepr> AllGatherInPlace<CudaSlice<T>> for LocalGpuComm {
    fn all_gather_in_place_start(&mut self, _: &mut CudaSlice<T>) -> Result<Pending, CommError> {
        Ok(Pending::DONE)
    }
}

impl Communicator<[f32]> for LocalGpuComm {
    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        if send.len() != recv.len() {
            let detail = format!("send has {} elements, recv {}", send.len(), recv.len());
            return Err(CommError::BadSize { op: "all_gather", world: 1, detail });
        }
        recv.copy_from_slice(send);
        Ok(())
    }
    fn reduce_scatter(&mut self, send: &[f32], recv: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        self.all_gather(send, recv)
    }
    fn all_reduce(&mut self, _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast(&mut self, _: &mut [f32], root: usize) -> Result<(), CommError> {
        check_root(root)
    }
}

fn check_root(root: usize) -> Result<(), CommError> {
    if root == 0 {
        Ok(())
    } else {
        Err(CommError::BadSize { op: "broadcast", world: 1, detail: format!("root {root} is not a rank") })
    }
}
