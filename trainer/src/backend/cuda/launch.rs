//! What every op's launch code shares: bounds checks (an out-of-range `Loc` must be an
//! error, not a silent write past a buffer), integer conversions for kernel arguments,
//! launch geometry, and the one helper all element-wise kernels go through
//! (`launch_elementwise`, and `launch_elementwise_with` for those that also take `int`s,
//! such as SwiGLU's row width).

use cudarc::driver::{CudaFunction, DriverError, LaunchConfig, PushKernelArg};

use super::CudaBackend;
use crate::backend::{BResult, BackendError, Loc};

/// Threads per block of the element-wise (grid-stride) kernels.
pub(super) const BLOCK: u32 = 256;

pub(super) fn bad(msg: String) -> BackendError {
    BackendError::Device(msg)
}

/// `off..off+n` must lie inside a buffer of `len` elements.
pub(super) fn check(what: &str, len: usize, off: usize, n: usize) -> BResult<()> {
    match off.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(bad(format!("{what}: elements {off}..{} do not fit a buffer of {len}", off.saturating_add(n)))),
    }
}

pub(super) fn check_loc(what: &str, len: usize, at: Loc) -> BResult<()> {
    check(what, len, at.off, at.len)
}

/// A kernel's `int` argument, or an error naming it when it does not fit.
pub(super) fn to_i32(what: &str, x: usize) -> BResult<i32> {
    i32::try_from(x).map_err(|_| bad(format!("{what} = {x} is too large for the CUDA kernels (limit {})", i32::MAX)))
}

pub(super) fn cfg(grid: (u32, u32, u32), block: (u32, u32, u32), smem: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: block, shared_mem_bytes: smem as u32 }
}

impl CudaBackend {
    /// The loaded kernel `name`.
    pub(super) fn f(&self, name: &str) -> BResult<&CudaFunction> {
        self.kernels.get(name)
    }

    /// Blocks for a grid-stride loop over `work` items: enough to fill the GPU, no more.
    pub(super) fn grid_for(&self, work: usize) -> u32 {
        let want = work.div_ceil(BLOCK as usize).max(1);
        want.min(self.sm_count * 16).max(1) as u32
    }

    pub(super) fn launch_err(&self, kernel: &str, e: DriverError) -> BackendError {
        self.err(&format!("launching `{kernel}`"), e)
    }

    /// Launch the element-wise kernel `name(ptrs..., long long n)` over `n` elements, each
    /// thread handling `per_thread` consecutive ones per grid-stride turn (8 for the
    /// kernels that move 16-byte words of bf16).
    ///
    /// # Safety
    /// Every pointer must address at least `n` elements of the type the kernel expects.
    pub(super) unsafe fn launch_elementwise(
        &self,
        name: &str,
        ptrs: &[u64],
        n: usize,
        per_thread: usize,
    ) -> BResult<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.launch_elementwise_with(name, ptrs, n, per_thread, &[]) }
    }

    /// [`CudaBackend::launch_elementwise`] for a kernel with `int` arguments after `n`:
    /// `name(ptrs..., long long n, int ints...)` (e.g. a row width).
    ///
    /// # Safety
    /// Every pointer must address what the kernel reads and writes for `n` and `ints`.
    pub(super) unsafe fn launch_elementwise_with(
        &self,
        name: &str,
        ptrs: &[u64],
        n: usize,
        per_thread: usize,
        ints: &[i32],
    ) -> BResult<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.f(name)?;
        let ni = n as i64;
        let mut lb = self.stream.launch_builder(f);
        for p in ptrs {
            lb.arg(p);
        }
        lb.arg(&ni);
        for i in ints {
            lb.arg(i);
        }
        let grid = if per_thread > 1 { self.grid_for(n / per_thread + 1) } else { self.grid_for(n) };
        // SAFETY: the caller guarantees the pointers cover what the kernel touches.
        unsafe { lb.launch(cfg((grid, 1, 1), (BLOCK, 1, 1), 0)) }.map_err(|e| self.launch_err(name, e))?;
        Ok(())
    }
}
