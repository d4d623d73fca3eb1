//! Host ↔ device transfers on the GPU: page-locked host memory (not write-combined: the
//! host optimizer reads gradients from it) and asynchronous copies on a stream of their
//! own, so a copy overlaps the compute stream's work. Each copy first waits for the work
//! already queued on the compute stream (the gradient it reads is complete; the buffer it
//! writes is no longer read), and its completion event is what the host or the compute
//! stream waits for.

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};
use half::bf16;

use super::launch::{check, check_loc};
use super::CudaBackend;
use crate::backend::{BResult, HostRead, HostValues, HostWait, HostWrite, Loc, TransferOps};

impl CudaBackend {
    fn pinned_any<T: cudarc::driver::DeviceRepr>(&self, n: usize, what: &str) -> BResult<PinnedHostSlice<T>> {
        // SAFETY: the memory is uninitialised; callers write it (a copy or the host
        // optimizer) before reading it. Flags 0: not write-combined, the host reads it.
        unsafe { self.ctx.alloc_pinned_with_flags::<T>(n.max(1), 0) }.map_err(|e| {
            self.err(
                &format!(
                    "allocating {} bytes of page-locked host memory for {what} (check `ulimit -l` and free host memory)",
                    n * std::mem::size_of::<T>()
                ),
                e,
            )
        })
    }

    /// The copy stream, ordered after everything queued on the compute stream so far.
    fn copy_after_compute(&self, what: &str) -> BResult<()> {
        let ev = self.stream.record_event(None).map_err(|e| self.err(what, e))?;
        self.copy_stream.wait(&ev).map_err(|e| self.err(what, e))
    }
}

impl HostRead for PinnedHostSlice<f32> {
    fn values(&self) -> Result<&[f32], String> {
        self.as_slice().map_err(|e| format!("reading page-locked host memory: {e}"))
    }
    fn writable(&mut self) -> Result<&mut [f32], String> {
        self.as_mut_slice().map_err(|e| format!("writing page-locked host memory: {e}"))
    }
}

impl HostWrite for PinnedHostSlice<bf16> {
    fn values_mut(&mut self) -> Result<HostValues<'_>, String> {
        let s = self.as_mut_slice().map_err(|e| format!("writing page-locked parameters: {e}"))?;
        Ok(HostValues::Bf16(bytemuck::cast_slice_mut(s)))
    }
}

impl HostWait for CudaEvent {
    fn wait_host(&self) -> Result<(), String> {
        self.synchronize().map_err(|e| format!("waiting for a host transfer: {e}"))
    }
}

impl TransferOps for CudaBackend {
    type HostF32 = PinnedHostSlice<f32>;
    type HostBuf = PinnedHostSlice<bf16>;
    type Event = CudaEvent;

    fn alloc_host_f32(&self, n: usize, what: &str) -> BResult<Self::HostF32> {
        self.pinned_any(n, what)
    }
    fn alloc_host_buf(&self, n: usize, what: &str) -> BResult<Self::HostBuf> {
        self.pinned_any(n, what)
    }
    fn grad_to_host(&self, src: &CudaSlice<f32>, at: Loc, dst: &mut Self::HostF32) -> BResult<CudaEvent> {
        check_loc("grad_to_host source", src.len(), at)?;
        check("grad_to_host destination", dst.len(), 0, at.len)?;
        self.copy_after_compute("ordering a gradient download")?;
        let host = dst.as_mut_slice().map_err(|e| self.err("staging a gradient download", e))?;
        // SAFETY: the source range was checked; `host` is page-locked memory of at least
        // at.len floats that the caller leaves alone until the returned event completes.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut host[..at.len],
                self.ptr(src, at.off),
                self.copy_stream.cu_stream(),
            )
        }
        .map_err(|e| self.err("downloading a gradient shard", e))?;
        self.copy_stream.record_event(None).map_err(|e| self.err("recording a download", e))
    }
    fn f32_to_host(&self, src: &CudaSlice<f32>, at: Loc, dst: &mut Self::HostF32, doff: usize) -> BResult<CudaEvent> {
        check_loc("f32_to_host source", src.len(), at)?;
        check("f32_to_host destination", dst.len(), doff, at.len)?;
        self.copy_after_compute("ordering a download of optimizer state")?;
        let host = dst.as_mut_slice().map_err(|e| self.err("staging a download of optimizer state", e))?;
        // SAFETY: both ranges were checked; `host` is page-locked memory that the caller
        // leaves alone until the returned event completes, and the compute stream's writes
        // to `src` queued so far come first (copy_after_compute).
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut host[doff..doff + at.len],
                self.ptr(src, at.off),
                self.copy_stream.cu_stream(),
            )
        }
        .map_err(|e| self.err("downloading optimizer state", e))?;
        self.copy_stream.record_event(None).map_err(|e| self.err("recording a download", e))
    }
    fn buf_from_host(
        &self,
        src: &Self::HostBuf,
        at: Loc,
        dst: &mut CudaSlice<bf16>,
        doff: usize,
    ) -> BResult<CudaEvent> {
        check_loc("buf_from_host source", src.len(), at)?;
        check("buf_from_host destination", dst.len(), doff, at.len)?;
        self.copy_after_compute("ordering a parameter upload")?;
        let host = src.as_slice().map_err(|e| self.err("staging a parameter upload", e))?;
        // SAFETY: both ranges were checked; the page-locked source stays untouched by the
        // caller until the returned event completes, and earlier compute-stream readers of
        // `dst` come first (copy_after_compute).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                self.ptr_mut(dst, doff),
                &host[at.off..at.end()],
                self.copy_stream.cu_stream(),
            )
        }
        .map_err(|e| self.err("uploading parameters", e))?;
        self.copy_stream.record_event(None).map_err(|e| self.err("recording an upload", e))
    }
    fn wait_event(&self, e: &CudaEvent) -> BResult<()> {
        e.synchronize().map_err(|x| self.err("waiting for a host transfer", x))
    }
    fn order_compute_after(&self, e: &CudaEvent) -> BResult<()> {
        self.stream.wait(e).map_err(|x| self.err("ordering compute after a transfer", x))
    }
}
