//! The device backend interface: every numerical operation the models and the ZeRO engine
//! need, split into groups that read the way a model reads, each group one file here:
//!
//! | group (file) | ops |
//! |---|---|
//! | [`MemoryOps`] (`memory.rs`) | allocation, host transfers, casts, copies, zeroing |
//! | [`EncoderOps`] (`encoder.rs`) | token (+ position) embedding, positions optionally within documents |
//! | [`LayerNormOps`] (`layernorm.rs`) | LayerNorm, RMSNorm |
//! | [`MatmulOps`] (`matmul.rs`) | linear layers (GEMMs) in bf16 or FP8 (`fp8.rs`: its numerics), with the fused-GELU hooks; the stored GEMM algorithm choices (`gemm_tuning.rs`) |
//! | [`Fp8GatherOps`] (`fp8_gather.rs`) | ZeRO-3's FP8 weight gathers: a rank's piece cast to FP8, the gathered pieces expanded |
//! | [`AttentionOps`] (`attention.rs`) | causal self-attention (multi-head, grouped-query), RoPE |
//! | [`ActivationOps`] (`activation.rs`) | GELU, SwiGLU, residual add |
//! | [`CrossEntropyOps`] (`cross_entropy.rs`) | softmax cross-entropy with its backward |
//! | [`ReduceOps`] (`reduce.rs`) | sums kept on the device (loss, gradient norm) |
//! | [`AdamWOps`] (`adamw.rs`) | the AdamW update |
//! | [`TransferOps`] (`transfer.rs`) | host ↔ device copies through page-locked memory (offload) |
//!
//! Each backend implements every group: `cpu/<group>.rs` (the f32 reference), `cuda/<group>.rs`
//! beside the kernels in `cuda/<group>.cu`, and `meta.rs` (no memory, no arithmetic: the
//! memory planner). [`Backend`] is all of them together.
//!
//! Buffers are flat and typed by role, and operations address tensors inside them by
//! [`Loc`] (offset + length), the way llm.c addresses a flat parameter block. That keeps
//! one parameter group = one buffer = one collective, and maps directly onto device
//! pointers in the CUDA backend. A layer's tensors inside a flat buffer travel as
//! [`Weights`] (parameters, read) and [`WeightGrads`] (their gradients, accumulated, or
//! written where the step's first micro-step meets an uncleared buffer).
//!
//! Three buffer roles, so a backend can pick precision per role:
//! - [`Device::Buf`]: compute precision — parameters as used by forward/backward and activations
//!   (f32 on CPU, bf16 on CUDA);
//! - [`Device::Grad`]: parameter gradients (accumulated across micro-batches, reduced across ranks);
//! - [`Device::F32`]: always fp32 — master weights, AdamW moments, LayerNorm statistics,
//!   per-token losses, attention softmax state.
//!
//! Conventions: `N = B*T` rows; matrices are row-major; a weight of a linear layer is
//! `[out, in]` (PyTorch `nn.Linear` layout). Parameter-gradient outputs are *accumulated*
//! (`+=`) so gradient accumulation is free, or written when [`WeightGrads::fresh`] (the
//! step's first micro-step: no pass that clears 4 bytes per parameter first, no GEMM that
//! reads them back); activation-gradient outputs are *overwritten* unless the doc says `+=`.

pub mod activation;
pub mod adamw;
pub mod attention;
pub mod cpu;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod encoder;
pub mod fp8;
pub mod fp8_gather;
pub mod gemm_tuning;
pub mod graph;
pub mod layernorm;
pub mod matmul;
pub mod memory;
pub mod meta;
pub mod reduce;
pub mod shape;
pub mod transfer;

pub use activation::ActivationOps;
pub use adamw::{AdamWOps, AdamWSegment, AdamWStep, AdamWTensors};
pub use attention::{
    check_doc_starts, doc_starts, rope_inv_freq, rope_table, AttentionOps, AttnInputs, AttnShape, RopeScaling,
};
pub use cross_entropy::{CrossEntropyOps, LossRows};
pub use encoder::{EmbedInputs, EmbedLocs, EncoderOps, SeqShape};
pub use fp8::{
    AmaxSink, Fp8Backward, Fp8Bytes, Fp8Format, Fp8GradFormat, Fp8Layer, Fp8Layers, Fp8WeightGrad, LinearExtent,
};
pub use fp8_gather::{Fp8GatherLayout, Fp8GatherOps};
pub use gemm_tuning::{GemmEnvironment, GemmTuningTable, OnMismatch};
pub use graph::GraphOps;
pub use layernorm::{LayerNormOps, LnSaved, LnStats, NormLocs, RmsSaved, Rows};
pub use matmul::{
    dgelu_then_bwd, dswiglu_then_bwd, matmul_bwd_or_kept, DgeluOf, DswigluOf, Fp8Predictions, GeluActs, GeluInput,
    GemmTuning, InputMadeInCast, LinearLocs, MatmulOps, NormOfInput, Precision, TunedGemm,
};
pub use memory::{MemoryOps, TokenRole};
pub use reduce::ReduceOps;
pub use shape::MatShape;
pub use transfer::{HostRead, HostValues, HostWait, HostWrite, TransferOps};

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

/// A compute device: its buffer types and what every group needs. Methods take `&self`;
/// buffers are owned by the caller (and own their memory: `'static`, so a model can be
/// held as a trait object).
pub trait Device: 'static {
    type Buf: Send + 'static;
    type Grad: Send + 'static;
    type F32: Send + 'static;
    /// Token ids (u32) on the device.
    type Tokens: Send + 'static;

    fn name(&self) -> String;
    /// Bytes per element of `Buf`, `Grad` and `F32`, for memory accounting.
    fn elem_bytes(&self) -> ElemBytes;
    /// Wait until queued device work is done (a no-op on the CPU).
    fn synchronize(&self) -> BResult<()>;
    /// Device memory as the driver reports it, with the parts no ledger owns; `None` where
    /// there is no separate device memory (the CPU backend).
    fn device_memory(&self) -> Option<DeviceMemory> {
        None
    }
}

/// Every op group: what the models and the engine are written against.
pub trait Backend:
    Device
    + MemoryOps
    + EncoderOps
    + LayerNormOps
    + MatmulOps
    + Fp8GatherOps
    + AttentionOps
    + ActivationOps
    + CrossEntropyOps
    + ReduceOps
    + AdamWOps
    + TransferOps
    + GraphOps
{
}

impl<T> Backend for T where
    T: Device
        + MemoryOps
        + EncoderOps
        + LayerNormOps
        + MatmulOps
        + Fp8GatherOps
        + AttentionOps
        + ActivationOps
        + CrossEntropyOps
        + ReduceOps
        + AdamWOps
        + TransferOps
        + GraphOps
{
}

/// A layer's parameters: the tensors at `at` (e.g. [`LinearLocs`]) inside the flat
/// compute buffer `buf`.
pub struct Weights<'a, B: Device + ?Sized, L> {
    pub buf: &'a B::Buf,
    pub at: L,
}

impl<'a, B: Device + ?Sized, L> Weights<'a, B, L> {
    pub fn new(buf: &'a B::Buf, at: L) -> Self {
        Weights { buf, at }
    }
}

impl<B: Device + ?Sized, L: Copy> Clone for Weights<'_, B, L> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Device + ?Sized, L: Copy> Copy for Weights<'_, B, L> {}

/// Where a layer's parameter gradients go: the tensors at `at` inside the flat gradient
/// buffer `buf`. They are added to (`+=`, see the module conventions) unless `fresh`: then
/// the tensors hold no gradient yet (nor zeros: the step's first micro-step into a buffer
/// nobody cleared) and the op writes them (`=`), as `+=` onto zeros would, without the
/// clearing pass and, for a GEMM, without reading the old values.
pub struct WeightGrads<'a, B: Device + ?Sized, L> {
    pub buf: &'a mut B::Grad,
    pub at: L,
    pub fresh: bool,
}

impl<'a, B: Device + ?Sized, L> WeightGrads<'a, B, L> {
    /// Add to what `buf` holds at `at`.
    pub fn new(buf: &'a mut B::Grad, at: L) -> Self {
        WeightGrads { buf, at, fresh: false }
    }
}

/// A unit's gradient buffer as one micro-step's backward receives it: `fresh` when nothing
/// of this step is in it yet and it was not cleared, so the first op to reach each tensor
/// writes it (see [`WeightGrads`]). The model must then write every element of the unit:
/// an element no op writes would keep the last step's value.
pub struct UnitGrads<'a, B: Device + ?Sized> {
    pub buf: &'a mut B::Grad,
    pub fresh: bool,
}

impl<B: Device + ?Sized> UnitGrads<'_, B> {
    /// The tensors at `at`, for the first op that reaches them in this micro-step.
    pub fn first<L>(&mut self, at: L) -> WeightGrads<'_, B, L> {
        WeightGrads { buf: &mut *self.buf, at, fresh: self.fresh }
    }
    /// The tensors at `at`, which an earlier op of this micro-step already wrote.
    pub fn again<L>(&mut self, at: L) -> WeightGrads<'_, B, L> {
        WeightGrads { buf: &mut *self.buf, at, fresh: false }
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
