//! Host ↔ device transfers through page-locked host memory, for optimizer and parameter
//! offload (gradient shards go to the host optimizer, updated parameters come back) and for
//! asynchronous checkpoints (the optimizer state is copied to the host at a step boundary).
//!
//! Copies are queued (on the CUDA backend: on a copy stream of their own, ordered after the
//! work already queued on the compute stream) and return an [`TransferOps::Event`]; the
//! host waits for it with [`TransferOps::wait_event`] before reading what arrived, the
//! device with [`TransferOps::order_compute_after`] before computing on it.

use super::{BResult, BackendError, Device, Loc};

/// Where the host optimizer writes the rounded copy of the new weights.
pub enum HostValues<'a> {
    /// bf16 bit patterns (round to nearest even), as the GPU computes with.
    Bf16(&'a mut [u16]),
    /// f32 (the CPU backend computes in f32: the copy is the master value).
    F32(&'a mut [f32]),
}

/// Host f32 memory read on any thread: the delayed host update reads gradients on a
/// thread of its own, which has no backend, and so does a background checkpoint writer.
pub trait HostRead: Send + 'static {
    /// The values (only after the copy into them was waited for).
    fn values(&self) -> Result<&[f32], String>;
    /// The values to write on the host (a checkpoint's copy of host optimizer state).
    fn writable(&mut self) -> Result<&mut [f32], String>;
}

/// Host compute-precision memory written on any thread (the delayed update's output).
pub trait HostWrite: Send + 'static {
    fn values_mut(&mut self) -> Result<HostValues<'_>, String>;
}

impl HostRead for Vec<f32> {
    fn values(&self) -> Result<&[f32], String> {
        Ok(self)
    }
    fn writable(&mut self) -> Result<&mut [f32], String> {
        Ok(self)
    }
}

impl HostWrite for Vec<f32> {
    fn values_mut(&mut self) -> Result<HostValues<'_>, String> {
        Ok(HostValues::F32(self))
    }
}

/// A queued copy's completion, waited for on any thread (the delayed update waits for the
/// upload that reads a unit's buffer before rewriting it).
pub trait HostWait: Send + Sync + 'static {
    fn wait_host(&self) -> Result<(), String>;
}

/// Backends whose copies complete when queued.
impl HostWait for () {
    fn wait_host(&self) -> Result<(), String> {
        Ok(())
    }
}

pub trait TransferOps: Device {
    /// Page-locked host memory of f32 (gradients on their way to the host optimizer).
    type HostF32: HostRead;
    /// Page-locked host memory of compute-precision values (parameters from the host).
    type HostBuf: HostWrite;
    /// The completion of a queued copy.
    type Event: HostWait;

    /// Whether buffers hold values. `false` for the meta backend, which only counts
    /// bytes: whoever computes on the host skips it (and allocates nothing that grows
    /// with the model).
    fn holds_values(&self) -> bool {
        true
    }
    fn alloc_host_f32(&self, n: usize, what: &str) -> BResult<Self::HostF32>;
    fn alloc_host_buf(&self, n: usize, what: &str) -> BResult<Self::HostBuf>;
    /// The values of a host f32 buffer (only after the copy into it was waited for).
    fn host_f32<'a>(&self, h: &'a Self::HostF32) -> BResult<&'a [f32]> {
        h.values().map_err(BackendError::Device)
    }
    /// The values of a host compute-precision buffer, to write.
    fn host_buf_mut<'a>(&self, h: &'a mut Self::HostBuf) -> BResult<HostValues<'a>> {
        h.values_mut().map_err(BackendError::Device)
    }
    /// Queue `dst[..at.len] = src[at]` (device → host).
    fn grad_to_host(&self, src: &Self::Grad, at: Loc, dst: &mut Self::HostF32) -> BResult<Self::Event>;
    /// Queue `dst[doff..doff + at.len] = src[at]` (device → host: optimizer state for a
    /// checkpoint), after the work already queued on the compute stream.
    fn f32_to_host(&self, src: &Self::F32, at: Loc, dst: &mut Self::HostF32, doff: usize) -> BResult<Self::Event>;
    /// Queue `dst[doff..doff + at.len] = src[at]` (host → device).
    fn buf_from_host(&self, src: &Self::HostBuf, at: Loc, dst: &mut Self::Buf, doff: usize) -> BResult<Self::Event>;
    /// Block the host until the copy is done.
    fn wait_event(&self, e: &Self::Event) -> BResult<()>;
    /// Make later compute wait for the copy (no host wait).
    fn order_compute_after(&self, e: &Self::Event) -> BResult<()>;
}
