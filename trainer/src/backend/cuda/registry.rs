//! The list of every kernel file of the CUDA backend, each registered by the op module
//! beside it (`layernorm.rs` holds `layernorm.cu`'s [`KernelFile`]): the one file that
//! names every op, above them, so that `kernels.rs` (how a file is compiled, cached and
//! loaded) stays a leaf the ops import.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::kernels::{self, CompileResult, KernelFile, Kernels};
use crate::backend::BResult;

/// Every kernel file of the backend.
const FILES: &[&KernelFile] = &[
    &super::memory::KERNELS,
    &super::encoder::KERNELS,
    &super::layernorm::KERNELS,
    &super::matmul::KERNELS,
    &super::fp8::KERNELS,
    &super::attention::KERNELS,
    &super::attention::SIMT_KERNELS,
    &super::attention::MMA_KERNELS,
    &super::attention::WGMMA_KERNELS,
    &super::rope::KERNELS,
    &super::activation::KERNELS,
    &super::cross_entropy::KERNELS,
    &super::reduce::KERNELS,
    &super::adamw::KERNELS,
];

/// Compile (or fetch from the cache) and load every kernel for `ctx`'s device.
pub(super) fn load_all(ctx: &Arc<CudaContext>) -> BResult<Kernels> {
    kernels::load_all(ctx, FILES)
}

/// Compile every kernel file for `arch` (e.g. `"sm_90"`) with NVRTC alone, no GPU or
/// driver needed: each file's name with its CUBIN size, or the compiler's log. `Err` when
/// libnvrtc cannot be loaded. For checking kernels on a machine without a GPU.
pub fn compile_all(arch: &str) -> Result<Vec<CompileResult>, String> {
    kernels::compile_all(arch, FILES)
}
