//! The device backend interface: every numerical operation the GPT model and the
//! ZeRO engine need, written once against this trait.
//!
//! Buffers are flat and typed by role, and operations address tensors inside them by
//! [`Loc`] (offset + length), the way llm.c addresses a flat parameter block. That keeps
//! one parameter group = one buffer = one collective, and maps directly onto device
//! pointers in the CUDA backend.
//!
//! Three buffer roles, so a backend can pick precision per role:
//! - [`Backend::Buf`]: compute precision — parameters as used by forward/backward and activations
//!   (f32 on CPU, bf16 on CUDA);
//! - [`Backend::Grad`]: parameter gradients (accumulated across micro-batches, reduced across ranks);
//! - [`Backend::F32`]: always fp32 — master weights, AdamW moments, LayerNorm statistics,
//!   per-token losses, attention softmax state.
//!
//! Conventions: `N = B*T` rows; matrices are row-major; a weight of a linear layer is
//! `[out, in]` (PyTorch `nn.Linear` layout). Parameter-gradient outputs are *accumulated*
//! (`+=`) so gradient accumulation is free; activation-gradient outputs are *overwritten*
//! unless the doc says `+=`.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod meta;

use thiserror::Error;

/// Where a tensor lives inside a flat buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    pub off: usize,
    pub len: usize,
}

impl Loc {
    pub const fn new(off: usize, len: usize) -> Loc {
        Loc { off, len }
    }
    /// The whole of a buffer of `len` elements.
    pub const fn all(len: usize) -> Loc {
        Loc { off: 0, len }
    }
    pub fn end(&self) -> usize {
        self.off + self.len
    }
}

/// A backend failure (allocation, kernel launch, library call).
#[derive(Debug, Error)]
pub enum BackendError {
    #[error("out of memory on {device}: tried to allocate {bytes} bytes for {what}")]
    OutOfMemory { device: String, bytes: usize, what: String },
    #[error("{backend} backend is not available: {reason}")]
    Unavailable { backend: &'static str, reason: String },
    #[error("{0}")]
    Device(String),
}

pub type BResult<T> = Result<T, BackendError>;

/// Hyper-parameters of one AdamW update over a contiguous segment.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based optimizer step, for bias correction.
    pub t: u64,
    /// Multiplies the gradient before use (global-norm clipping factor).
    pub grad_scale: f32,
}

/// Shapes for one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
}

/// A compute device. Methods take `&self`; buffers are owned by the caller.
pub trait Backend {
    type Buf: Send;
    type Grad: Send;
    type F32: Send;
    /// Token ids (u32) on the device.
    type Tokens: Send;

    fn name(&self) -> String;
    /// Bytes per element of `Buf`, `Grad` and `F32`, for memory accounting.
    fn elem_bytes(&self) -> ElemBytes;

    // ---- allocation and transfer ----
    fn alloc_buf(&self, n: usize, what: &str) -> BResult<Self::Buf>;
    fn alloc_grad(&self, n: usize, what: &str) -> BResult<Self::Grad>;
    fn alloc_f32(&self, n: usize, what: &str) -> BResult<Self::F32>;
    fn alloc_tokens(&self, n: usize) -> BResult<Self::Tokens>;
    fn upload_tokens(&self, host: &[u32], dst: &mut Self::Tokens) -> BResult<()>;
    /// Host f32 → compute buffer at `off` (rounded to compute precision).
    fn upload_buf(&self, host: &[f32], dst: &mut Self::Buf, off: usize) -> BResult<()>;
    /// Host f32 → `F32` buffer at `off`.
    fn upload_f32(&self, host: &[f32], dst: &mut Self::F32, off: usize) -> BResult<()>;
    fn download_f32(&self, src: &Self::F32, at: Loc) -> BResult<Vec<f32>>;
    fn download_buf(&self, src: &Self::Buf, at: Loc) -> BResult<Vec<f32>>;
    fn download_grad(&self, src: &Self::Grad, at: Loc) -> BResult<Vec<f32>>;
    /// Round fp32 master values into the compute-precision buffer.
    fn cast_to_buf(&self, dst: &mut Self::Buf, doff: usize, src: &Self::F32, at: Loc) -> BResult<()>;
    fn zero_buf(&self, buf: &mut Self::Buf, at: Loc) -> BResult<()>;
    fn zero_grad(&self, buf: &mut Self::Grad, at: Loc) -> BResult<()>;
    /// `dst[doff..] += src[at]` (accumulating a reduced gradient shard).
    fn add_grad(&self, dst: &mut Self::Grad, doff: usize, src: &Self::Grad, at: Loc) -> BResult<()>;
    /// `Σ buf[at]²`, accumulated in f64, written as an [`F64Pair`] to `dst[2·slot..2·slot+2]`.
    /// The sum stays on the device: the engine reads every unit's pair with one download
    /// per step instead of waiting for the device once per unit.
    fn grad_sumsq_into(&self, buf: &Self::Grad, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()>;
    /// `Σ src[at]` (f64) added to the [`F64Pair`] at `dst[2·slot..2·slot+2]` (the loss of every
    /// micro-step summed on the device and read once per step).
    fn sum_into(&self, src: &Self::F32, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()>;
    /// Copy within compute buffers.
    fn copy_buf(&self, dst: &mut Self::Buf, doff: usize, src: &Self::Buf, at: Loc) -> BResult<()>;

    // ---- model operations ----
    /// `out[N,C] = wte[tokens] + wpe[t]`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> BResult<()>;
    /// `dwte[tokens] += dout`, `dwpe[t] += dout`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> BResult<()>;
    /// LayerNorm over the last dim; saves mean and 1/std per row.
    #[allow(clippy::too_many_arguments)]
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
    ) -> BResult<()>;
    /// `dinp += ..`, `dw += ..`, `db += ..`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> BResult<()>;
    /// `out[N,OC] = inp[N,C] · W[OC,C]ᵀ (+ bias)`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> BResult<()>;
    /// `dinp = dout · W` (overwritten), `dW += doutᵀ · inp`, `dbias += Σ dout`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> BResult<()>;
    /// The MLP's first layer: `pre = inp · Wᵀ + bias` and `out = GELU(pre)`, both written
    /// (`pre` is saved for backward, `out` feeds the next layer). Runs
    /// [`Backend::fused_matmul_gelu_fwd`] where the backend has it (CUDA: GELU in the GEMM
    /// epilogue), else the two ops.
    #[allow(clippy::too_many_arguments)]
    fn matmul_gelu_fwd(
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
    ) -> BResult<()> {
        if self.fused_matmul_gelu_fwd(pre, out, inp, params, w, bias, n, c, oc)? {
            return Ok(());
        }
        self.matmul_fwd(pre, inp, params, w, Some(bias), n, c, oc)?;
        self.gelu_fwd(out, pre, n * oc)
    }
    /// [`Backend::matmul_gelu_fwd`] as one fused operation where the backend has one for
    /// these shapes; `Ok(false)` (the default) runs the two operations instead.
    #[allow(clippy::too_many_arguments)]
    fn fused_matmul_gelu_fwd(
        &self,
        _pre: &mut Self::Buf,
        _out: &mut Self::Buf,
        _inp: &Self::Buf,
        _params: &Self::Buf,
        _w: Loc,
        _bias: Loc,
        _n: usize,
        _c: usize,
        _oc: usize,
    ) -> BResult<bool> {
        Ok(false)
    }
    /// Backward of a linear layer whose input is `act = GELU(pre)`, through the GELU:
    /// `dpre = (dout · W) ⊙ GELU'(pre)` (overwritten), `dW += doutᵀ · act`, `dbias += Σ dout`.
    /// `act` is clobbered. Runs [`Backend::fused_matmul_bwd_dgelu`] where the backend has it
    /// (CUDA: GELU' in the GEMM epilogue), else matmul_bwd and gelu_bwd.
    #[allow(clippy::too_many_arguments)]
    fn matmul_bwd_dgelu(
        &self,
        dpre: &mut Self::Buf,
        grads: &mut Self::Grad,
        dw: Loc,
        dbias: Loc,
        dout: &Self::Buf,
        act: &mut Self::Buf,
        pre: &Self::Buf,
        params: &Self::Buf,
        w: Loc,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<()> {
        if self.fused_matmul_bwd_dgelu(dpre, grads, dw, dbias, dout, act, pre, params, w, n, c, oc)? {
            return Ok(());
        }
        self.matmul_bwd(dpre, grads, dw, Some(dbias), dout, act, params, w, n, c, oc)?;
        // gelu_bwd may not write its input: go through `act`, which is free now.
        self.gelu_bwd(act, pre, dpre, n * c)?;
        self.copy_buf(dpre, 0, act, Loc::all(n * c))
    }
    /// [`Backend::matmul_bwd_dgelu`] as one fused operation where the backend has one for
    /// these shapes; `Ok(false)` (the default) runs matmul_bwd and gelu_bwd instead.
    #[allow(clippy::too_many_arguments)]
    fn fused_matmul_bwd_dgelu(
        &self,
        _dpre: &mut Self::Buf,
        _grads: &mut Self::Grad,
        _dw: Loc,
        _dbias: Loc,
        _dout: &Self::Buf,
        _act: &Self::Buf,
        _pre: &Self::Buf,
        _params: &Self::Buf,
        _w: Loc,
        _n: usize,
        _c: usize,
        _oc: usize,
    ) -> BResult<bool> {
        Ok(false)
    }
    /// fp32 elements of saved softmax state `attention_fwd` needs for backward.
    fn attention_saved_len(&self, s: AttnShape) -> usize;
    /// Causal multi-head self-attention: `qkv[N,3C]` → `out[N,C]`.
    fn attention_fwd(&self, out: &mut Self::Buf, saved: &mut Self::F32, qkv: &Self::Buf, s: AttnShape) -> BResult<()>;
    /// `dqkv` overwritten from `dout`.
    #[allow(clippy::too_many_arguments)]
    fn attention_bwd(
        &self,
        dqkv: &mut Self::Buf,
        dout: &Self::Buf,
        qkv: &Self::Buf,
        out: &Self::Buf,
        saved: &Self::F32,
        s: AttnShape,
    ) -> BResult<()>;
    /// GELU (tanh approximation).
    fn gelu_fwd(&self, out: &mut Self::Buf, inp: &Self::Buf, n: usize) -> BResult<()>;
    /// `dinp = gelu'(inp) · dout`.
    fn gelu_bwd(&self, dinp: &mut Self::Buf, inp: &Self::Buf, dout: &Self::Buf, n: usize) -> BResult<()>;
    /// `out = a + b`.
    fn residual_fwd(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf, n: usize) -> BResult<()>;
    /// Softmax cross-entropy over `logits[N,V]`: writes per-row losses, and overwrites
    /// `logits` with `dlogits = (softmax - onehot) · dloss_scale`.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_fwd_bwd(
        &self,
        logits: &mut Self::Buf,
        losses: &mut Self::F32,
        targets: &Self::Tokens,
        n: usize,
        v: usize,
        dloss_scale: f32,
    ) -> BResult<()>;
    /// AdamW over one contiguous segment: `master/m/v[moff..moff+len]` with gradient
    /// `grads[goff..]`; the rounded result also goes to `params[poff..]`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> BResult<()>;
    /// Wait until queued device work is done (a no-op on the CPU).
    fn synchronize(&self) -> BResult<()>;
    /// Device memory as the driver reports it, with the parts no ledger owns; `None` where
    /// there is no separate device memory (the CPU backend).
    fn device_memory(&self) -> Option<DeviceMemory> {
        None
    }
}

/// A device's memory as the driver reports it (cuMemGetInfo), and the parts of it that no
/// [`crate::zero::MemoryLedger`] owns, each measured by the backend. What remains,
/// `used − ledger − runtime`, is the untracked rest: allocator-pool bytes in use that
/// neither the ledger nor the backend's scratch explains (the pool's rounding of each
/// allocation, or a missed buffer).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct DeviceMemory {
    pub used: u64,
    pub total: u64,
    #[serde(default)]
    pub runtime: RuntimeMemory,
}

/// The measured parts of a device's memory outside the ledger, in bytes.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct RuntimeMemory {
    /// CUDA context, loaded kernels and library handles: what the process held on the
    /// device when the backend was ready, before any buffer.
    pub context: u64,
    /// The communication library (NCCL): what the device held outside the allocator pool
    /// grew by across the communicator's set-up.
    pub comm_library: u64,
    /// What the device held outside the allocator pool grew by since: kernels the libraries
    /// load on first use (cuBLASLt's GEMM kernels are loaded lazily), later NCCL connections.
    pub lazy_libraries: u64,
    /// The backend's own scratch (reduction partials, GEMM staging, the embedding plan) and
    /// the cuBLASLt workspace.
    pub scratch: u64,
    /// Memory the stream-ordered pool keeps reserved beyond live allocations (freed buffers
    /// kept for reuse instead of going back to the driver).
    pub pool_slack: u64,
}

impl RuntimeMemory {
    pub fn total(&self) -> u64 {
        self.context + self.comm_library + self.lazy_libraries + self.scratch + self.pool_slack
    }
}

impl DeviceMemory {
    /// Bytes the driver reports beyond the ledger's `tracked` total and the measured parts.
    pub fn untracked(&self, tracked: u64) -> i64 {
        self.used as i64 - (tracked + self.runtime.total()) as i64
    }
}

/// Element sizes of a backend's buffer roles.
#[derive(Debug, Clone, Copy)]
pub struct ElemBytes {
    pub buf: usize,
    pub grad: usize,
    pub f32: usize,
}

/// An f64 kept in an fp32 buffer as two words, `hi = x as f32` and `lo = x − hi`, so device
/// reductions keep f64 precision without an f64 buffer role.
pub struct F64Pair;

impl F64Pair {
    pub fn split(x: f64) -> [f32; 2] {
        let hi = x as f32;
        [hi, (x - hi as f64) as f32]
    }
    pub fn join(p: &[f32]) -> f64 {
        p[0] as f64 + p[1] as f64
    }
    /// Every pair of a downloaded slot buffer, in slot order.
    pub fn all(v: &[f32]) -> impl Iterator<Item = f64> + '_ {
        v.chunks_exact(2).map(F64Pair::join)
    }
}
