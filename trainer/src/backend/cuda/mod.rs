//! The CUDA backend: the same op groups as the CPU reference (`backend::cpu`), on one
//! GPU, with bf16 compute buffers and fp32 gradients, master weights and statistics.
//!
//! - `Buf` = `CudaSlice<bf16>`: parameters as used by forward/backward, activations;
//! - `Grad` = `CudaSlice<f32>`: parameter gradients (fp32 accumulation and reduction);
//! - `F32` = `CudaSlice<f32>`: master weights, AdamW moments, LayerNorm statistics,
//!   per-token losses, the attention's saved log-sum-exp;
//! - `Tokens` = [`DeviceTokens`]: the ids on the device plus the host copy they came from.
//!
//! One module per op group beside its kernels and its CPU twin's name: `layernorm.rs`
//! holds the launch code, the constants the kernel must agree with and the registration
//! of `layernorm.cu` (twin: `cpu/layernorm.rs`), and so on (one op has a pair of its own
//! inside its group: RoPE, `rope.rs` + `rope.cu`, of the attention group). `launch.rs` has what every
//! launch shares, `kernels.rs` compiles the `.cu` files with NVRTC at start-up (cached on
//! disk), `cublaslt/` wraps cuBLASLt for the GEMMs. Every kernel runs in order on one
//! compute stream (`CudaBackend::stream`); the NCCL communicator orders its own
//! communication stream against it with explicit events, so cudarc's per-buffer event
//! tracking is switched off.
//! Every reduction (column sums, the embedding backward, the norm) has a fixed order:
//! the same inputs give the same bits on every run.
//!
//! The CUDA libraries are loaded at run time: this builds on machines without CUDA,
//! and [`CudaBackend::new`] answers [`BackendError::Unavailable`] where they are missing.

mod activation;
mod adamw;
mod attention;
mod cross_entropy;
mod cublaslt;
mod encoder;
mod fp8;
mod fp8_gather;
mod graph;
mod kernels;
mod launch;
mod layernorm;
mod matmul;
mod memory;
mod reduce;
mod registry;
mod rope;
mod staging;
mod transfer;

pub use attention::AttentionImpl;
pub use cublaslt::{GemmSearch, GemmSweep};
pub use fp8::{CachedWeightRead, CheckedPrediction, Fp8Cast, Fp8Casts, PredictedInput, COLSUM_ROWS as FP8_COLSUM_ROWS};
pub use registry::compile_all;

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use cudarc::driver::sys::cudaError_enum;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError, PinnedHostSlice,
    ValidAsZeroBits,
};
use half::bf16;

use super::{BResult, BackendError, Device, DeviceMemory, ElemBytes, RuntimeMemory};
use cublaslt::Lt;
use kernels::Kernels;

/// cuBLASLt workspace: NVIDIA's recommendation for Hopper.
const LT_WORKSPACE: usize = 32 << 20;

/// The CUDA backend on one device. Not `Sync` (scratch buffers and GEMM plans live in
/// `RefCell`s): one backend per rank thread.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Host <-> device copies (offload), beside the compute stream (`transfer.rs`).
    copy_stream: Arc<CudaStream>,
    kernels: Kernels,
    lt: Lt,
    device: String,
    /// The GPU's name alone (`device` adds the ordinal): what stored GEMM choices match.
    gpu_name: String,
    sm_count: usize,
    /// (major, minor): FP8 GEMMs need 9.0 or later (`fp8.rs`).
    compute_capability: (i32, i32),
    /// The FP8 GEMMs' operands (`MatmulOps::prepare_fp8`; counted in the ledger, not in
    /// the scratch).
    fp8_ws: RefCell<Option<fp8::Fp8Ws>>,
    /// Reused scratch (partial sums, the attention's D, the embedding plan). One op at a
    /// time uses each, in stream order, so sharing them is safe.
    scratch_f32: RefCell<Option<CudaSlice<f32>>>,
    scratch_f64: RefCell<Option<CudaSlice<f64>>>,
    /// Device bytes of the token buffers' embedding-backward plans (`DeviceTokens::plan`),
    /// reported with the scratch.
    plan_bytes: Cell<u64>,
    scratch_bf16: RefCell<Option<CudaSlice<bf16>>>,
    scratch_bf16_w: RefCell<Option<CudaSlice<bf16>>>,
    scratch_bias: RefCell<Option<CudaSlice<bf16>>>,
    attention: Cell<AttentionImpl>,
    /// The SIMT fallback for a head size without tensor-core kernels was noted on stderr.
    attention_fallback_noted: Cell<bool>,
    /// Splits of the grouped-query dK/dV pass: `None` picks per shape (attention.rs).
    attention_dkv_split: Cell<Option<usize>>,
    /// Blocks per SM of each dK/dV kernel, asked of the driver once (before any graph
    /// capture, in the eager steps that precede it).
    attention_dkv_per_sm: RefCell<Vec<(&'static str, usize)>>,
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
        let copy_stream = ctx.new_stream().map_err(|e| BackendError::Device(format!("creating a copy stream: {e}")))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let device = format!("cuda:{ordinal} ({name})");
        keep_freed_memory_in_pool(&ctx);
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| BackendError::Device(format!("reading the SM count: {e}")))? as usize;
        let kernels = registry::load_all(&ctx)?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| BackendError::Device(format!("reading the compute capability: {e}")))?;
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
            copy_stream,
            kernels,
            lt,
            device,
            gpu_name: name,
            sm_count,
            compute_capability,
            fp8_ws: RefCell::new(None),
            scratch_f32: RefCell::new(None),
            scratch_f64: RefCell::new(None),
            plan_bytes: Cell::new(0),
            scratch_bf16: RefCell::new(None),
            scratch_bf16_w: RefCell::new(None),
            scratch_bias: RefCell::new(None),
            attention: Cell::new(AttentionImpl::TensorCore),
            attention_fallback_noted: Cell::new(false),
            attention_dkv_split: Cell::new(None),
            attention_dkv_per_sm: RefCell::new(Vec::new()),
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

    /// Choose the attention kernels (default: [`AttentionImpl::TensorCore`]; the others for
    /// tests and timing tools that compare the kernels against each other). All compute the
    /// same function and save the same state, so forward and backward may even use different
    /// ones.
    pub fn set_attention_impl(&self, which: AttentionImpl) {
        self.attention.set(which);
    }

    /// How many blocks share each (key tile, key/value head) of the grouped-query dK/dV pass
    /// (partial sums, then a fixed-order reduction): `None` (the default) picks per shape,
    /// `Some(s)` forces `s` (at most the group size; 1: never split), for tests and timing.
    /// Multi-head attention is never split. Each choice is deterministic; different choices
    /// add the same terms in a different order.
    pub fn set_attention_dkv_split(&self, splits: Option<usize>) {
        self.attention_dkv_split.set(splits);
    }

    /// Every GEMM this backend has run, timed again with each of cuBLASLt's first `count`
    /// heuristic algorithms (see `cublaslt::Lt::sweep`: it overwrites their outputs, so
    /// for timing tools only).
    pub fn gemm_sweep(&self, count: usize, reps: usize) -> BResult<Vec<GemmSweep>> {
        self.ctx.bind_to_thread().map_err(|e| BackendError::Device(format!("binding the context: {e}")))?;
        self.lt.sweep(self.stream.cu_stream() as _, count, reps)
    }

    /// Every FP8 GEMM run since the last sweep or search (its buffers still live) timed over
    /// cuBLASLt's algorithm space, at most `cap` configurations each (`Lt::search`; timing
    /// tools only: outputs are overwritten).
    pub fn fp8_gemm_search(&self, cap: usize) -> BResult<Vec<GemmSearch>> {
        self.ctx.bind_to_thread().map_err(|e| BackendError::Device(format!("binding the context: {e}")))?;
        self.lt.search(self.stream.cu_stream() as _, cap)
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
            + self.plan_bytes.get()
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

impl Device for CudaBackend {
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

/// Token ids on the device, plus the host copy they were uploaded from, plus the
/// embedding backward's plan: the deterministic grouping of rows by token, made on the host
/// at upload (never reading ids back from the device) and uploaded beside the ids, so the
/// backward itself is device work only (recordable in a CUDA graph). Layout:
/// `[nb | starts (nb + 1) | tokens (nb) | rows (n)]`, `nb` the distinct ids.
pub struct DeviceTokens {
    dev: CudaSlice<u32>,
    host: Vec<u32>,
    /// Page-locked staging, so the upload does not wait for the stream.
    pinned: staging::Staging,
    /// The embedding backward's grouping of these rows: by id (`TokenRole::Inputs`), or by
    /// position within the document (`TokenRole::DocStarts`: the `wpe` gradient); none
    /// for targets.
    plan: Option<EmbeddingPlan>,
    /// `TokenRole::DocStarts { seq_len }`: document starts for sequences of this length,
    /// checked at each upload (`check_doc_starts`), which attention and RoPE require.
    doc_seq_len: Option<usize>,
}

/// The embedding backward's grouping of a token buffer's ids, on the device, and its
/// page-locked staging.
pub struct EmbeddingPlan {
    dev: CudaSlice<u32>,
    staged: staging::Staging,
}
