//! The CUDA backend: the same operations as the CPU reference (`backend::cpu`), on one
//! GPU, with bf16 compute buffers and fp32 gradients, master weights and statistics.
//!
//! - `Buf` = `CudaSlice<bf16>`: parameters as used by forward/backward, activations;
//! - `Grad` = `CudaSlice<f32>`: parameter gradients (fp32 accumulation and reduction);
//! - `F32` = `CudaSlice<f32>`: master weights, AdamW moments, LayerNorm statistics,
//!   per-token losses, the attention's saved log-sum-exp;
//! - `Tokens` = [`DeviceTokens`]: the ids on the device plus the host copy they came from.
//!
//! One kernel file per op beside its CPU twin's name (`encoder.cu` ↔ `cpu/encoder.rs`,
//! …), compiled by NVRTC at start-up and cached on disk (`kernels.rs`); the GEMMs are
//! cuBLASLt (`matmul.rs`); launch code for every op is in `ops.rs`. Every kernel runs in
//! order on one compute stream (`CudaBackend::stream`); the NCCL communicator orders its
//! own communication stream against it with explicit events, so cudarc's per-buffer event
//! tracking is switched off.
//! Every reduction (column sums, the embedding backward, the norm) has a fixed order:
//! the same inputs give the same bits on every run.
//!
//! The CUDA libraries are loaded at run time: this builds on machines without CUDA,
//! and [`CudaBackend::new`] answers [`BackendError::Unavailable`] where they are missing.

mod kernels;
mod matmul;
mod ops;

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use cudarc::driver::sys::cudaError_enum;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError, PinnedHostSlice,
    ValidAsZeroBits,
};
use half::bf16;

use super::{AdamWStep, AttnShape, BResult, Backend, BackendError, DeviceMemory, ElemBytes, Loc, RuntimeMemory};
use kernels::Kernels;
use matmul::Lt;

/// Which attention kernels run (see `attention.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionImpl {
    /// Tensor cores (mma.sync, bf16 operands, fp32 accumulation) where the head size is
    /// 64; the fp32 SIMT kernels otherwise. The default.
    TensorCore,
    /// fp32 SIMT kernels for every head size (32, 64, 128): the slower cross-check.
    Simt,
}

/// cuBLASLt workspace: NVIDIA's recommendation for Hopper.
const LT_WORKSPACE: usize = 32 << 20;

/// The CUDA backend on one device. Not `Sync` (scratch buffers and GEMM plans live in
/// `RefCell`s): one backend per rank thread.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    lt: Lt,
    device: String,
    sm_count: usize,
    /// Reused scratch (partial sums, the attention's D, the embedding plan). One op at a
    /// time uses each, in stream order, so sharing them is safe.
    scratch_f32: RefCell<Option<CudaSlice<f32>>>,
    scratch_f64: RefCell<Option<CudaSlice<f64>>>,
    scratch_u32: RefCell<Option<CudaSlice<u32>>>,
    /// Page-locked staging for the embedding plan: an upload from pageable memory may
    /// wait for the stream, a pinned one does not.
    plan_pinned: RefCell<Option<PinnedHostSlice<u32>>>,
    scratch_bf16: RefCell<Option<CudaSlice<bf16>>>,
    scratch_bf16_w: RefCell<Option<CudaSlice<bf16>>>,
    scratch_bias: RefCell<Option<CudaSlice<bf16>>>,
    attention: Cell<AttentionImpl>,
    /// Driver-used bytes outside the allocator pool once the backend was ready (context,
    /// kernels, cuBLASLt handle), and what a communication library added to that since.
    context_bytes: u64,
    comm_library_bytes: Cell<u64>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("device", &self.device).finish()
    }
}

/// A CUDA library cudarc would load, and whether it can be.
fn missing_libraries() -> Vec<String> {
    // SAFETY: each check only asks the dynamic loader whether the library opens.
    let present = unsafe {
        [
            (
                "cuda",
                "the NVIDIA driver's libcuda.so (installed with the driver)",
                cudarc::driver::sys::is_culib_present(),
            ),
            ("nvrtc", "libnvrtc.so (CUDA toolkit, e.g. /usr/local/cuda/lib64)", cudarc::nvrtc::sys::is_culib_present()),
            (
                "cublas",
                "libcublas.so (CUDA toolkit, e.g. /usr/local/cuda/lib64)",
                cudarc::cublas::sys::is_culib_present(),
            ),
            (
                "cublasLt",
                "libcublasLt.so (CUDA toolkit, e.g. /usr/local/cuda/lib64)",
                cudarc::cublaslt::sys::is_culib_present(),
            ),
        ]
    };
    present
        .into_iter()
        .filter(|(_, _, ok)| !ok)
        .map(|(lib, what, _)| format!("{what}; tried {:?}", cudarc::get_lib_name_candidates(lib)))
        .collect()
}

fn unavailable(reason: String) -> BackendError {
    BackendError::Unavailable { backend: "cuda", reason }
}

impl CudaBackend {
    /// Open device `ordinal`: check the libraries, make the context and stream, and
    /// compile (or load from the cache) every kernel. Fails if any kernel does not
    /// compile, with NVRTC's log.
    pub fn new(ordinal: usize) -> BResult<CudaBackend> {
        let be = Self::new_lenient(ordinal)?;
        let failed = be.kernels.failures();
        if !failed.is_empty() {
            return Err(BackendError::Device(format!("CUDA kernels failed to build:\n{}", failed.join("\n"))));
        }
        Ok(be)
    }

    /// Like [`CudaBackend::new`], but a kernel file that fails to compile only makes
    /// the ops that need it fail (see [`CudaBackend::kernel_failures`]). For checks
    /// that should report every op rather than stop at the first broken one.
    pub fn new_lenient(ordinal: usize) -> BResult<CudaBackend> {
        let missing = missing_libraries();
        if !missing.is_empty() {
            return Err(unavailable(format!(
                "missing CUDA libraries: {}. They are looked up on the loader path (ldconfig's cache and LD_LIBRARY_PATH)",
                missing.join("; ")
            )));
        }
        let n = CudaContext::device_count().map_err(|e| unavailable(format!("no usable CUDA device ({e})")))?;
        if ordinal >= n.max(0) as usize {
            return Err(unavailable(format!("device {ordinal} requested, but {n} CUDA device(s) are visible")));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| unavailable(format!("creating a context on device {ordinal}: {e}")))?;
        // One compute stream, in order: cudarc's per-buffer events would only add overhead.
        // Must precede every allocation (it applies to buffers made after it).
        // SAFETY: all kernels of this backend are enqueued on the one stream, so stream order
        // is enough; an NCCL communicator built on `stream()` orders its communication stream
        // against it with explicit events (collectives::nccl), and the engine waits for every
        // started collective before touching its buffers.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| BackendError::Device(format!("creating a stream: {e}")))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let device = format!("cuda:{ordinal} ({name})");
        keep_freed_memory_in_pool(&ctx);
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| BackendError::Device(format!("reading the SM count: {e}")))? as usize;
        let kernels = kernels::load_all(&ctx)?;
        let workspace = alloc_raw::<u8>(&stream, &device, LT_WORKSPACE, "cuBLASLt workspace")?;
        let ws_ptr = {
            let (p, _g) = workspace.device_ptr(&stream);
            p
        };
        let lt = Lt::new(workspace, ws_ptr)?;
        let context_bytes = outside_pool(&ctx).unwrap_or(0);
        Ok(CudaBackend {
            ctx,
            stream,
            kernels,
            lt,
            device,
            sm_count,
            scratch_f32: RefCell::new(None),
            scratch_f64: RefCell::new(None),
            scratch_u32: RefCell::new(None),
            plan_pinned: RefCell::new(None),
            scratch_bf16: RefCell::new(None),
            scratch_bf16_w: RefCell::new(None),
            scratch_bias: RefCell::new(None),
            attention: Cell::new(match std::env::var("SHARDTRAIN_ATTENTION").as_deref() {
                Ok("simt") => AttentionImpl::Simt,
                _ => AttentionImpl::TensorCore,
            }),
            context_bytes,
            comm_library_bytes: Cell::new(0),
        })
    }

    /// The stream every op (and the NCCL communicator, when built on it) runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context (device) of this backend.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Kernel files that failed to build (only with [`CudaBackend::new_lenient`]).
    pub fn kernel_failures(&self) -> Vec<String> {
        self.kernels.failures()
    }

    /// Choose the attention kernels (default: [`AttentionImpl::TensorCore`], or
    /// `SHARDTRAIN_ATTENTION=simt` in the environment). Both compute the same function
    /// and save the same state, so forward and backward may even use different ones.
    pub fn set_attention_impl(&self, which: AttentionImpl) {
        self.attention.set(which);
    }

    /// The attention kernels in use.
    pub fn attention_impl(&self) -> AttentionImpl {
        self.attention.get()
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    fn err(&self, what: &str, e: DriverError) -> BackendError {
        BackendError::Device(format!("{what} on {}: {e}", self.device))
    }

    fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize, what: &str) -> BResult<CudaSlice<T>> {
        let mut s = alloc_raw::<T>(&self.stream, &self.device, n, what)?;
        // Zeroed like the CPU backend's buffers, so no caller can see stale memory.
        self.stream.memset_zeros(&mut s).map_err(|e| self.err(&format!("zeroing {what}"), e))?;
        Ok(s)
    }

    fn ptr<T>(&self, s: &CudaSlice<T>, off: usize) -> u64 {
        // With event tracking off the guard does nothing when dropped.
        let (p, _g) = s.device_ptr(&self.stream);
        p + (off * std::mem::size_of::<T>()) as u64
    }

    fn ptr_mut<T>(&self, s: &mut CudaSlice<T>, off: usize) -> u64 {
        let (p, _g) = s.device_ptr_mut(&self.stream);
        p + (off * std::mem::size_of::<T>()) as u64
    }

    /// A scratch buffer of at least `n` elements (grown as needed), as a raw pointer.
    fn scratch<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        cell: &RefCell<Option<CudaSlice<T>>>,
        n: usize,
        what: &str,
    ) -> BResult<u64> {
        let mut c = cell.borrow_mut();
        if c.as_ref().is_none_or(|s| s.len() < n) {
            // The old buffer is freed in stream order: kernels queued on it finish first.
            *c = None;
            *c = Some(alloc_raw::<T>(&self.stream, &self.device, n.max(1024), what)?);
        }
        let s = c.as_ref().expect("allocated above");
        Ok(self.ptr(s, 0))
    }

    /// Page-locked host memory for uploads that must not stall the host.
    fn pinned(&self, n: usize, what: &str) -> BResult<PinnedHostSlice<u32>> {
        // SAFETY: the memory is uninitialised; callers write it before any copy. Flags 0
        // (not write-combined): the host also reads it back.
        unsafe { self.ctx.alloc_pinned_with_flags::<u32>(n.max(1), 0) }
            .map_err(|e| self.err(&format!("allocating {} bytes of pinned host memory for {what}", n * 4), e))
    }

    /// Driver-used bytes outside the allocator pool now (context, libraries). Around the
    /// set-up of a communicator the difference is what the library allocated for itself.
    pub fn outside_pool_bytes(&self) -> Option<u64> {
        outside_pool(&self.ctx)
    }

    /// Record what the communication library holds on this device (see `outside_pool_bytes`).
    pub fn set_comm_library_bytes(&self, bytes: u64) {
        self.comm_library_bytes.set(bytes);
    }

    /// Bytes of the backend's own device buffers: the scratch cells and the cuBLASLt workspace.
    fn scratch_bytes(&self) -> u64 {
        fn held<T>(c: &RefCell<Option<CudaSlice<T>>>) -> u64 {
            c.borrow().as_ref().map_or(0, |s| (s.len() * std::mem::size_of::<T>()) as u64)
        }
        LT_WORKSPACE as u64
            + held(&self.scratch_f32)
            + held(&self.scratch_f64)
            + held(&self.scratch_u32)
            + held(&self.scratch_bf16)
            + held(&self.scratch_bf16_w)
            + held(&self.scratch_bias)
    }

    fn scratch_f32(&self, n: usize) -> BResult<u64> {
        self.scratch(&self.scratch_f32, n, "fp32 scratch")
    }
}

/// Keep freed device memory in the stream-ordered pool instead of returning it to the
/// driver at every synchronisation (the default), so per-step allocations (ZeRO-3
/// gathers) do not go back to the driver each step. Best effort.
fn keep_freed_memory_in_pool(ctx: &Arc<CudaContext>) {
    use cudarc::driver::sys;
    // SAFETY: plain driver queries on the current device; the attribute is a u64.
    unsafe {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == cudaError_enum::CUDA_SUCCESS {
            let mut threshold: u64 = u64::MAX;
            let _ = sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            );
        }
    }
}

/// The device's default stream-ordered pool: (bytes reserved from the driver, bytes in use).
fn pool_usage(ctx: &Arc<CudaContext>) -> Option<(u64, u64)> {
    use cudarc::driver::sys;
    // SAFETY: driver queries on the current device; both attributes are u64.
    unsafe {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) != cudaError_enum::CUDA_SUCCESS {
            return None;
        }
        let get = |attr| {
            let mut v: u64 = 0;
            (sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void)
                == cudaError_enum::CUDA_SUCCESS)
                .then_some(v)
        };
        let reserved = get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let used = get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        Some((reserved, used))
    }
}

/// Driver-used bytes on `ctx`'s device that are not the allocator pool's.
fn outside_pool(ctx: &Arc<CudaContext>) -> Option<u64> {
    ctx.bind_to_thread().ok()?;
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    let (reserved, _) = pool_usage(ctx)?;
    Some(((total - free) as u64).saturating_sub(reserved))
}

fn alloc_raw<T: DeviceRepr>(stream: &Arc<CudaStream>, device: &str, n: usize, what: &str) -> BResult<CudaSlice<T>> {
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    // SAFETY: the memory is uninitialised; callers zero it or overwrite it before use.
    unsafe { stream.alloc::<T>(n) }.map_err(|e| {
        if e.0 == cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            BackendError::OutOfMemory { device: device.to_string(), bytes, what: what.to_string() }
        } else {
            BackendError::Device(format!("allocating {bytes} bytes for {what} on {device}: {e}"))
        }
    })
}

/// `off..off+n` must lie inside a buffer of `len` elements.
fn check(what: &str, len: usize, off: usize, n: usize) -> BResult<()> {
    match off.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(BackendError::Device(format!(
            "{what}: elements {off}..{} do not fit a buffer of {len}",
            off.saturating_add(n)
        ))),
    }
}

fn check_loc(what: &str, len: usize, at: Loc) -> BResult<()> {
    check(what, len, at.off, at.len)
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<bf16>;
    type Grad = CudaSlice<f32>;
    type F32 = CudaSlice<f32>;
    type Tokens = DeviceTokens;

    fn name(&self) -> String {
        self.device.clone()
    }
    fn elem_bytes(&self) -> ElemBytes {
        ElemBytes { buf: 2, grad: 4, f32: 4 }
    }

    fn alloc_buf(&self, n: usize, what: &str) -> BResult<Self::Buf> {
        self.alloc(n, what)
    }
    fn alloc_grad(&self, n: usize, what: &str) -> BResult<Self::Grad> {
        self.alloc(n, what)
    }
    fn alloc_f32(&self, n: usize, what: &str) -> BResult<Self::F32> {
        self.alloc(n, what)
    }
    fn alloc_tokens(&self, n: usize) -> BResult<Self::Tokens> {
        Ok(DeviceTokens { dev: self.alloc(n, "token ids")?, host: vec![0; n], pinned: self.pinned(n, "token ids")? })
    }
    fn upload_tokens(&self, host: &[u32], dst: &mut Self::Tokens) -> BResult<()> {
        check("upload_tokens", dst.dev.len(), 0, host.len())?;
        let n = host.len();
        dst.host[..n].copy_from_slice(host);
        // Waits only until this buffer's previous upload has left it (long done by now).
        let staged = dst.pinned.as_mut_slice().map_err(|e| self.err("staging token ids", e))?;
        staged[..n].copy_from_slice(host);
        if n == staged.len() {
            self.stream.memcpy_htod(&dst.pinned, &mut dst.dev).map_err(|e| self.err("uploading tokens", e))
        } else {
            self.stream.memcpy_htod(host, &mut dst.dev.slice_mut(0..n)).map_err(|e| self.err("uploading tokens", e))
        }
    }
    fn upload_buf(&self, host: &[f32], dst: &mut Self::Buf, off: usize) -> BResult<()> {
        check("upload_buf", dst.len(), off, host.len())?;
        let v: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
        self.stream
            .memcpy_htod(&v, &mut dst.slice_mut(off..off + host.len()))
            .map_err(|e| self.err("uploading a compute buffer", e))
    }
    fn upload_f32(&self, host: &[f32], dst: &mut Self::F32, off: usize) -> BResult<()> {
        check("upload_f32", dst.len(), off, host.len())?;
        self.stream
            .memcpy_htod(host, &mut dst.slice_mut(off..off + host.len()))
            .map_err(|e| self.err("uploading an fp32 buffer", e))
    }
    fn download_f32(&self, src: &Self::F32, at: Loc) -> BResult<Vec<f32>> {
        check_loc("download_f32", src.len(), at)?;
        self.stream.clone_dtoh(&src.slice(at.off..at.end())).map_err(|e| self.err("downloading an fp32 buffer", e))
    }
    fn download_buf(&self, src: &Self::Buf, at: Loc) -> BResult<Vec<f32>> {
        check_loc("download_buf", src.len(), at)?;
        let v = self
            .stream
            .clone_dtoh(&src.slice(at.off..at.end()))
            .map_err(|e| self.err("downloading a compute buffer", e))?;
        Ok(v.into_iter().map(|x| x.to_f32()).collect())
    }
    fn download_grad(&self, src: &Self::Grad, at: Loc) -> BResult<Vec<f32>> {
        check_loc("download_grad", src.len(), at)?;
        self.stream.clone_dtoh(&src.slice(at.off..at.end())).map_err(|e| self.err("downloading gradients", e))
    }
    fn cast_to_buf(&self, dst: &mut Self::Buf, doff: usize, src: &Self::F32, at: Loc) -> BResult<()> {
        self.op_cast_to_buf(dst, doff, src, at)
    }
    fn zero_buf(&self, buf: &mut Self::Buf, at: Loc) -> BResult<()> {
        check_loc("zero_buf", buf.len(), at)?;
        self.stream
            .memset_zeros(&mut buf.slice_mut(at.off..at.end()))
            .map_err(|e| self.err("zeroing a compute buffer", e))
    }
    fn zero_grad(&self, buf: &mut Self::Grad, at: Loc) -> BResult<()> {
        check_loc("zero_grad", buf.len(), at)?;
        self.stream.memset_zeros(&mut buf.slice_mut(at.off..at.end())).map_err(|e| self.err("zeroing gradients", e))
    }
    fn add_grad(&self, dst: &mut Self::Grad, doff: usize, src: &Self::Grad, at: Loc) -> BResult<()> {
        self.op_add_grad(dst, doff, src, at)
    }
    fn grad_sumsq_into(&self, buf: &Self::Grad, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()> {
        self.op_sum_into(buf, at, true, dst, slot, false)
    }
    fn sum_into(&self, src: &Self::F32, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()> {
        self.op_sum_into(src, at, false, dst, slot, true)
    }
    fn copy_buf(&self, dst: &mut Self::Buf, doff: usize, src: &Self::Buf, at: Loc) -> BResult<()> {
        check_loc("copy_buf source", src.len(), at)?;
        check("copy_buf destination", dst.len(), doff, at.len)?;
        self.stream
            .memcpy_dtod(&src.slice(at.off..at.end()), &mut dst.slice_mut(doff..doff + at.len))
            .map_err(|e| self.err("copying a compute buffer", e))
    }

    fn encoder_fwd(
        &self,
        out: &mut Self::Buf,
        tokens: &Self::Tokens,
        params: &Self::Buf,
        wte: Loc,
        wpe: Loc,
        b: usize,
        t: usize,
        c: usize,
    ) -> BResult<()> {
        self.op_encoder_fwd(out, &tokens.dev, params, wte, wpe, b, t, c)
    }
    fn encoder_bwd(
        &self,
        grads: &mut Self::Grad,
        dwte: Loc,
        dwpe: Loc,
        dout: &Self::Buf,
        tokens: &Self::Tokens,
        b: usize,
        t: usize,
        c: usize,
    ) -> BResult<()> {
        self.op_encoder_bwd(grads, dwte, dwpe, dout, &tokens.host, b, t, c)
    }
    fn layernorm_fwd(
        &self,
        out: &mut Self::Buf,
        mean: &mut Self::F32,
        rstd: &mut Self::F32,
        inp: &Self::Buf,
        params: &Self::Buf,
        w: Loc,
        bias: Loc,
        n: usize,
        c: usize,
    ) -> BResult<()> {
        self.op_layernorm_fwd(out, mean, rstd, inp, params, w, bias, n, c)
    }
    fn layernorm_bwd(
        &self,
        dinp: &mut Self::Buf,
        grads: &mut Self::Grad,
        dw: Loc,
        db: Loc,
        dout: &Self::Buf,
        inp: &Self::Buf,
        params: &Self::Buf,
        w: Loc,
        mean: &Self::F32,
        rstd: &Self::F32,
        n: usize,
        c: usize,
    ) -> BResult<()> {
        self.op_layernorm_bwd(dinp, grads, dw, db, dout, inp, params, w, mean, rstd, n, c)
    }
    fn matmul_fwd(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        params: &Self::Buf,
        w: Loc,
        bias: Option<Loc>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<()> {
        self.op_matmul_fwd(out, inp, params, w, bias, n, c, oc)
    }
    fn matmul_bwd(
        &self,
        dinp: &mut Self::Buf,
        grads: &mut Self::Grad,
        dw: Loc,
        dbias: Option<Loc>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        params: &Self::Buf,
        w: Loc,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<()> {
        self.op_matmul_bwd(dinp, grads, dw, dbias, dout, inp, params, w, n, c, oc, None)
    }
    /// Only the per-row log-sum-exp: `B * NH * T` floats (flash attention recomputes
    /// the probabilities in backward).
    fn fused_matmul_gelu_fwd(
        &self,
        pre: &mut Self::Buf,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        params: &Self::Buf,
        w: Loc,
        bias: Loc,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<bool> {
        self.op_matmul_gelu_fwd(pre, out, inp, params, w, bias, n, c, oc)
    }
    fn fused_matmul_bwd_dgelu(
        &self,
        dpre: &mut Self::Buf,
        grads: &mut Self::Grad,
        dw: Loc,
        dbias: Loc,
        dout: &Self::Buf,
        act: &Self::Buf,
        pre: &Self::Buf,
        params: &Self::Buf,
        w: Loc,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<bool> {
        self.op_matmul_bwd_dgelu(dpre, grads, dw, dbias, dout, act, pre, params, w, n, c, oc)
    }
    fn attention_saved_len(&self, s: AttnShape) -> usize {
        s.b * s.nh * s.t
    }
    fn attention_fwd(&self, out: &mut Self::Buf, saved: &mut Self::F32, qkv: &Self::Buf, s: AttnShape) -> BResult<()> {
        self.op_attention_fwd(out, saved, qkv, s)
    }
    fn attention_bwd(
        &self,
        dqkv: &mut Self::Buf,
        dout: &Self::Buf,
        qkv: &Self::Buf,
        out: &Self::Buf,
        saved: &Self::F32,
        s: AttnShape,
    ) -> BResult<()> {
        self.op_attention_bwd(dqkv, dout, qkv, out, saved, s)
    }
    fn gelu_fwd(&self, out: &mut Self::Buf, inp: &Self::Buf, n: usize) -> BResult<()> {
        self.op_gelu_fwd(out, inp, n)
    }
    fn gelu_bwd(&self, dinp: &mut Self::Buf, inp: &Self::Buf, dout: &Self::Buf, n: usize) -> BResult<()> {
        self.op_gelu_bwd(dinp, inp, dout, n)
    }
    fn residual_fwd(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf, n: usize) -> BResult<()> {
        self.op_residual_fwd(out, a, b, n)
    }
    fn cross_entropy_fwd_bwd(
        &self,
        logits: &mut Self::Buf,
        losses: &mut Self::F32,
        targets: &Self::Tokens,
        n: usize,
        v: usize,
        dloss_scale: f32,
    ) -> BResult<()> {
        self.op_cross_entropy(logits, losses, &targets.dev, n, v, dloss_scale)
    }
    fn adamw(
        &self,
        params: &mut Self::Buf,
        poff: usize,
        master: &mut Self::F32,
        m: &mut Self::F32,
        v: &mut Self::F32,
        moff: usize,
        grads: &Self::Grad,
        goff: usize,
        len: usize,
        h: AdamWStep,
    ) -> BResult<()> {
        self.op_adamw(params, poff, master, m, v, moff, grads, goff, len, h)
    }
    fn synchronize(&self) -> BResult<()> {
        self.stream.synchronize().map_err(|e| self.err("synchronizing", e))?;
        self.ctx.check_err().map_err(|e| self.err("a deferred CUDA error", e))
    }
    fn device_memory(&self) -> Option<DeviceMemory> {
        // Process-wide view of this device (context, library workspaces, NCCL, our buffers).
        self.ctx.bind_to_thread().ok()?;
        let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
        let (reserved, in_use) = pool_usage(&self.ctx).unwrap_or((0, 0));
        let used = (total - free) as u64;
        let outside = used.saturating_sub(reserved);
        Some(DeviceMemory {
            used,
            total: total as u64,
            runtime: RuntimeMemory {
                context: self.context_bytes,
                comm_library: self.comm_library_bytes.get(),
                lazy_libraries: outside.saturating_sub(self.context_bytes + self.comm_library_bytes.get()),
                scratch: self.scratch_bytes(),
                pool_slack: reserved.saturating_sub(in_use),
            },
        })
    }
}

/// Token ids on the device, plus the host copy they were uploaded from: the embedding
/// backward plans its deterministic grouping of rows by token from the host copy, so it
/// never reads ids back from the device (a wait for the GPU in the middle of every step).
pub struct DeviceTokens {
    dev: CudaSlice<u32>,
    host: Vec<u32>,
    /// Page-locked staging, so the upload does not wait for the stream.
    pinned: PinnedHostSlice<u32>,
}
