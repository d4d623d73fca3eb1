//! Host ↔ device transfers on the CPU backend: the "device" is host memory, so the host
//! buffers are plain vectors, copies happen at once and there is nothing to wait for.

use super::{alloc, CpuBackend};
use crate::backend::{BResult, Loc, TransferOps};

impl TransferOps for CpuBackend {
    type HostF32 = Vec<f32>;
    type HostBuf = Vec<f32>;
    type Event = ();

    fn alloc_host_f32(&self, n: usize, what: &str) -> BResult<Vec<f32>> {
        alloc(n, what)
    }
    fn alloc_host_buf(&self, n: usize, what: &str) -> BResult<Vec<f32>> {
        alloc(n, what)
    }
    fn grad_to_host(&self, src: &Vec<f32>, at: Loc, dst: &mut Vec<f32>) -> BResult<()> {
        dst[..at.len].copy_from_slice(&src[at.off..at.end()]);
        Ok(())
    }
    fn f32_to_host(&self, src: &Vec<f32>, at: Loc, dst: &mut Vec<f32>, doff: usize) -> BResult<()> {
        dst[doff..doff + at.len].copy_from_slice(&src[at.off..at.end()]);
        Ok(())
    }
    fn buf_from_host(&self, src: &Vec<f32>, at: Loc, dst: &mut Vec<f32>, doff: usize) -> BResult<()> {
        dst[doff..doff + at.len].copy_from_slice(&src[at.off..at.end()]);
        Ok(())
    }
    fn wait_event(&self, _: &()) -> BResult<()> {
        Ok(())
    }
    fn order_compute_after(&self, _: &()) -> BResult<()> {
        Ok(())
    }
}
