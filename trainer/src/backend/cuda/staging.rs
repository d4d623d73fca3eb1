//! Page-locked staging for the small uploads the host rewrites every micro-step (token
//! ids, the embedding backward's plan). The host must not rewrite the staging while the
//! previous micro-step's copy out of it is still queued: with gradient accumulation the
//! host runs a whole micro-step ahead of the GPU, and an early rewrite hands the queued
//! copy the next micro-step's values. cudarc records its pinned buffers' completion events
//! only with its event tracking on (this backend turns it off), so the staging keeps its
//! own event and waits for it before each rewrite.

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};

use super::launch::check;
use super::CudaBackend;
use crate::backend::BResult;

pub struct Staging {
    buf: PinnedHostSlice<u32>,
    /// Completion of the last copy out of `buf`, on the compute stream.
    copied: Option<CudaEvent>,
}

impl Staging {
    pub fn new(be: &CudaBackend, n: usize, what: &str) -> BResult<Staging> {
        Ok(Staging { buf: be.pinned(n, what)?, copied: None })
    }

    /// Queue `dst[..values.len()] = values` on the compute stream through the staging,
    /// once its previous copy has left it (normally long done: the wait is a safeguard
    /// that costs nothing unless the host is a micro-step ahead).
    pub fn upload(&mut self, be: &CudaBackend, values: &[u32], dst: &mut CudaSlice<u32>, what: &str) -> BResult<()> {
        let n = values.len();
        check(what, self.buf.len(), 0, n)?;
        check(what, dst.len(), 0, n)?;
        if let Some(e) = self.copied.take() {
            e.synchronize().map_err(|x| be.err(&format!("waiting for the previous upload of {what}"), x))?;
        }
        let host = self.buf.as_mut_slice().map_err(|x| be.err(&format!("staging {what}"), x))?;
        host[..n].copy_from_slice(values);
        // SAFETY: both ranges were checked; the staging is not rewritten before `copied`
        // (recorded right after) completes.
        unsafe { cudarc::driver::result::memcpy_htod_async(be.ptr_mut(dst, 0), &host[..n], be.stream.cu_stream()) }
            .map_err(|x| be.err(&format!("uploading {what}"), x))?;
        self.copied =
            Some(be.stream.record_event(None).map_err(|x| be.err(&format!("recording the upload of {what}"), x))?);
        Ok(())
    }
}

impl Drop for Staging {
    /// Page-locked memory must outlive the copy reading it.
    fn drop(&mut self) {
        if let Some(e) = self.copied.take() {
            let _ = e.synchronize();
        }
    }
}
