//! FP8 linear layers on the GPU (`train.precision = "fp8"`; twin of the FP8 path of
//! `cpu/matmul.rs`, numerics in `backend/fp8.rs`): the operand workspace, the layers' kept
//! scales and cached weights, the casts of `fp8.cu`, and the three GEMMs of a linear layer
//! through cuBLASLt (`cublaslt/`).
//!
//! Hopper's FP8 GEMMs take A transposed and B not ("TN": both with the inner dimension
//! contiguous). With row-major `X[n, c]`, `W[oc, c]`, `dY[n, oc]` (see `matmul.rs`):
//! - forward `Yᵀ(oc×n) = W·Xᵀ`: A = W `[oc, c]`, B = X `[n, c]`, both as they are (e4m3 ×
//!   e4m3; sums promoted to fp32, never cuBLASLt's fast accumulation: at GPT-2 1.5B it was
//!   about 1% faster but lost the loss, +2.1% after 500 steps against bf16 where promoted
//!   sums gave -0.04%, BENCHMARKS.md run 17), bias, GELU (aux bf16) or residual (C) in the
//!   epilogue;
//! - `dXᵀ(c×n) = Wᵀ·dYᵀ`: A = Wᵀ `[c, oc]` (a transposed cast of the weight), B = dY
//!   `[n, oc]` (e4m3 × e5m2), GELU' in the epilogue where cuBLASLt has it;
//! - `dWᵀ(c×oc) = Xᵀ·dY`: A = Xᵀ `[c, n]`, B = dYᵀ `[oc, n]` (both transposed casts,
//!   e4m3 × e5m2), fp32 written or accumulated (beta 1) into the gradient.
//!
//! `Fp8Layers::backward` changes the backward: dY in e4m3 (`train.fp8_grad_format`: e4m3 ×
//! e4m3 GEMMs), or dW as the bf16 path's GEMM of the bf16 dY and X (`train.fp8_weight_grad`:
//! dY is then cast in its row layout only, and X not at all).
//!
//! Never e5m2 × e5m2 (cuBLASLt has no such GEMM). Each tensor is quantized per tensor with
//! its own current amax: an amax pass (`fp8_amax_bf16`), then a cast that writes the codes
//! and the inverse scale the GEMM reads (`fp8_cast_bf16`, or `fp8_cast_transpose_bf16`
//! for the transposed copies; dY's cast writes both of its layouts in one pass). Where the
//! op that wrote the tensor left its amax in the layer's slot (`AmaxSink`: the norms before
//! qkv and fc/gate_up, GELU (composed or recomputed) before fc2, SwiGLU before down, attention
//! before proj/o, GELU's and SwiGLU's backward before fc/gate_up's, the norms' backward before
//! proj/o's and fc2/down's, attention's backward before GPT-2's qkv),
//! there is no amax pass: the producer's kernel max-ed what it wrote into the slot
//! (`warp_amax_out` in common.cuh). The bias gradient sums the bf16 dY: as column sums of
//! dY's transposing cast, which reads dY anyway (per 128 rows, then the tiles in order), or,
//! where dY has no transposed cast (`fp8_weight_grad = "bf16"`), by the bias kernel.
//!
//! A layer with an `Fp8Layer` (the models' blocks) keeps state between ops, in slots and
//! buffers `prepare_fp8` reserved once (stable addresses, so CUDA graphs replay them):
//! - its input's slot: the forward (or a checkpointed block's recompute, which makes the
//!   same tensor) leaves the amax there, and the backward only casts `Xᵀ` with it, where the
//!   model says its input is the forward's (`Fp8Layer::input_from_forward`);
//! - for the first `Fp8Layers::cached_layers` layers (`train.fp8_weight_cache`), its weight's
//!   codes in both layouts and their slot, made by one amax pass and one cast at the weight's
//!   first use after the parameters change (`fp8_weights_changed`: a new version; the
//!   schedule calls it before the first forward after a step), then read by every forward,
//!   recompute and backward until the next change. The same codes as casting at each use:
//!   the same weight, the same amax. Keyed by the version alone, as the amax below;
//! - without the cache (layers past the cached ones), its weight's amax in
//!   its weight slot, found at the weight's first use in a parameter version and kept for
//!   the version's later uses (forward, recompute, backward, later micro-steps), which then
//!   only cast: one amax pass over each weight a step instead of one per use, the same
//!   scale, so the same codes. Keyed by the version alone, not the buffer: stage 3 gathers a
//!   unit into whichever pooled buffer is free, and within a version every gather of a
//!   layer holds the same values (a parameter change always starts a new version);
//! - cached or not, where the optimizer step that began the version wrote the whole weight,
//!   the step's AdamW left its amax in the weight slot (`fp8_step_amax_words`, `adamw.cu`),
//!   and the first use only casts (`fp8_weights_changed(by_step)` says so);
//! - its sinks are zeroed with the rest of its block's by the block's forward
//!   (`fp8_clear_sinks`, one memset), each producer then finding its own zeroed (`zeroed`).
//!
//! GPT-2's qkv and fc may apply their LayerNorm in their input's transposing cast
//! (`matmul_fwd_of_norm`: the norm's output is never written), as fc2 may apply GELU, and
//! fc's backward GELU' to the gradient fc2's backward wrote (`matmul_bwd_of_dgelu`).
//!
//! Those two GELU casts, and the casts that apply a norm (the norm's kernel then finds only
//! its statistics, no amax of the output it never writes),
//! *predict* their scale (`Cast::predicted`; `fp8.cu`:
//! `FP8_SCALE_PREDICTED`): no amax of what they make exists before they make it, so each casts
//! with the scale of a predicted amax (the tensor's last one, or for the gradient that times
//! how a reference amax of this step moved since), maxes the true amax into the slot as it
//! goes, and a check pass (`FP8_SCALE_CHECK`) casts again with the true scale where the two
//! differ: the codes of current scaling always, an amax pass (or a bf16 tensor written and
//! read) saved where the power-of-two scale held. The predictions and their right/wrong
//! counts persist in the workspace (`CudaFp8Workspace::prediction`). Llama's SwiGLU output
//! and input gradient are written, with their amaxes, as any producer's (casts that applied
//! SwiGLU with a predicted scale measured slower there: BENCHMARKS.md run 26).
//!
//! Here: the kernels' registration, the constants they share with `fp8.cu`, and the types
//! the pieces share (the workspace's state and pointers, one cast, its op and prediction,
//! a forward's epilogue). By idea:
//! - `workspace.rs`: whether the GPU runs FP8 GEMMs, `prepare_fp8`'s workspace, the
//!   parameter versions, a layer's cached weight and kept input codes;
//! - `step.rs`: what the optimizer step leaves (the cached weights' codes, the weights' amaxes);
//! - `amax.rs`: the amaxes and scales (per version, the sinks, the predictions, the passes);
//! - `cast.rs`: the casts of `fp8.cu`;
//! - `gemm.rs`: a linear layer's three GEMMs through cuBLASLt;
//! - `checks.rs`: the test and timing API (casts alone, slots and casts read back).

mod amax;
mod cast;
mod checks;
mod gemm;
mod step;
mod workspace;

pub use checks::{CachedWeightRead, CheckedPrediction, Fp8Cast, PredictedInput};

use cudarc::driver::CudaSlice;

use super::kernels::{no_big_smem, KernelFile};
use super::launch::bad;
use crate::backend::fp8::{CudaFp8KeptInputs, CudaFp8WeightCache, CudaFp8Workspace, ScaleSlot};
use crate::backend::{AmaxSink, BResult, Fp8Backward, Fp8Format, Fp8Layer, LinearExtent, MatShape};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "fp8",
    src: include_str!("../fp8.cu"),
    functions: &[
        "fp8_amax_bf16",
        "fp8_cast_bf16",
        "fp8_cast_transpose_bf16",
        "fp8_step_codes",
        "fp8_gather_pack",
        "fp8_gather_unpack",
    ],
    big_smem: no_big_smem,
    defines: fp8_defines,
};

/// The FP8 gathers' segment table size, shared with the kernels (`fp8_gather.rs`), and the
/// step codes' (`STEP_WEIGHTS`).
fn fp8_defines() -> Vec<(&'static str, String)> {
    vec![
        ("FP8G_SEGS", crate::backend::fp8_gather::MAX_SEGMENTS.to_string()),
        ("FP8_STEP_WEIGHTS", STEP_WEIGHTS.to_string()),
    ]
}

/// Columns and rows of the transposing cast's tile (`FP8_TILE_C`, `FP8_TILE_R` in fp8.cu,
/// whose 256 threads each take 4 rows × 8 columns).
const TILE_C: usize = 64;
const TILE_R: usize = 128;
/// The rows of one of the transposing cast's column sums (a tile's).
pub const COLSUM_ROWS: usize = TILE_R;
/// How the transposing cast finds its scale (`FP8_SCALE_*` in fp8.cu).
const SCALE_OF_AMAX: i32 = 0;
const SCALE_PREDICTED: i32 = 1;
const SCALE_CHECK: i32 = 2;
/// Weights one `fp8_step_codes` launch takes (a block's four, with room).
const STEP_WEIGHTS: usize = 8;
/// Rows of `fp8_step_codes`'s tile (`FP8_SC_TILE_R`; its columns: `TILE_C`).
const STEP_TILE_R: usize = 256;

/// The kernel's `Fp8StepCodes` (same layout: `repr(C)`, the same field order).
#[repr(C)]
#[derive(Clone, Copy)]
struct StepCodesTable {
    tile_start: [i64; STEP_WEIGHTS + 1],
    q: [u64; STEP_WEIGHTS],
    qt: [u64; STEP_WEIGHTS],
    x: [u64; STEP_WEIGHTS],
    slot: [u64; STEP_WEIGHTS],
    pred: [u64; STEP_WEIGHTS],
    rows: [i32; STEP_WEIGHTS],
    cols: [i32; STEP_WEIGHTS],
    n: i32,
}

// SAFETY: plain numbers in C layout, as the kernel declares them.
unsafe impl cudarc::driver::DeviceRepr for StepCodesTable {}

/// The FP8 layers' device state: the operand workspace (with the per-op and per-layer scale
/// slots), what it was sized for, and the cached weights.
pub(super) struct Fp8Ws {
    buf: CudaSlice<u8>,
    extent: LinearExtent,
    layout: CudaFp8Workspace,
    cache: Option<WeightCache>,
    /// The layers' kept input codes (`Fp8Layers::kept_inputs`; `None`: no layer keeps any).
    kept: Option<(CudaSlice<u8>, CudaFp8KeptInputs)>,
    /// Per layer, the parameter version whose weight's amax its weight slot holds (`None`:
    /// none yet): found by the layer's first use in the version, or left by the optimizer
    /// step that began it.
    weight_amax: Vec<Option<u64>>,
    /// Per layer, whether the last optimizer step left its weight's amax in its slot
    /// (`AdamWSegment::fp8_layer`), for the version `fp8_weights_changed(by_step)` begins.
    step_amax: Vec<bool>,
    /// Whether the optimizer step writes the cached weights' codes (`Fp8Layers::step_codes`).
    step_codes_on: bool,
    /// Per layer, whether the last optimizer step wrote its cached weight's codes (`adamw.rs`),
    /// for the version `fp8_weights_changed(by_step)` begins.
    step_codes: Vec<bool>,
    /// The parameter version: bumped by `fp8_weights_changed`.
    version: u64,
    /// How the layers' backward runs (`Fp8Layers::backward`).
    backward: Fp8Backward,
    /// Sink slots zeroed together (`fp8_clear_sinks`) and not written since: the next
    /// producer to max into one zeroes nothing. Host-side, in stream order; a CUDA graph's
    /// replay repeats the recording's zeroing and writes, so leaves it as the recording did.
    zeroed: std::collections::HashSet<u64>,
}

impl Fp8Ws {
    /// Byte offset of the slot `s` names, for a layer `prepare_fp8` reserved.
    fn sink_offset(&self, s: AmaxSink) -> BResult<usize> {
        let (AmaxSink::Input(i) | AmaxSink::Grad(i)) = s;
        if i >= self.layout.layers {
            return Err(bad(format!(
                "FP8 amax sink {s:?}, but prepare_fp8 reserved {} layers (a bug)",
                self.layout.layers
            )));
        }
        Ok(self.layout.sink(s))
    }
}

/// The cached FP8 weights (`Fp8Layers::cached_layers`: layers `0..weights.len()`).
struct WeightCache {
    buf: CudaSlice<u8>,
    layout: CudaFp8WeightCache,
    /// Each cached layer's weight `(inputs, outputs)`.
    weights: Vec<(usize, usize)>,
    /// Per cached layer: the parameter version its codes were made in (`None`: never made).
    /// The version alone: within one, every buffer holding the layer's weight holds the same
    /// values (ZeRO-3 gathers it into whichever pooled buffer is free).
    made: Vec<Option<u64>>,
}

/// Device pointers into the workspace.
#[derive(Debug, Clone, Copy)]
struct WsPtrs {
    base: u64,
    layout: CudaFp8Workspace,
    /// The layers' backward recipe (`Fp8Layers::backward`).
    backward: Fp8Backward,
}

impl WsPtrs {
    fn a(&self) -> u64 {
        self.base + self.layout.a as u64
    }
    fn gt(&self) -> u64 {
        self.base + self.layout.gt as u64
    }
    fn w(&self) -> u64 {
        self.base + self.layout.w as u64
    }
    /// A per-op slot's start: its inverse scale (what the GEMM reads), then its amax (what
    /// the casts take).
    fn slot(&self, s: ScaleSlot) -> u64 {
        self.base + self.layout.inv_scale(s) as u64
    }
    /// Where a layer's input scale lives: its own slot, kept from its forward for its
    /// backward, or (no layer) the per-op one.
    fn input_slot(&self, layer: Option<Fp8Layer>) -> BResult<u64> {
        match layer {
            None => Ok(self.slot(ScaleSlot::Input)),
            Some(l) if l.index < self.layout.layers => Ok(self.base + self.layout.layer_input(l.index) as u64),
            Some(l) => {
                Err(bad(format!("FP8 layer {} used, but prepare_fp8 reserved {} (a bug)", l.index, self.layout.layers)))
            }
        }
    }
    /// Where an uncached weight's scale lives: its layer's weight slot (its amax kept for
    /// the parameter version), or (no layer) the per-op one.
    fn weight_slot(&self, layer: Option<Fp8Layer>) -> u64 {
        match layer {
            Some(l) if l.index < self.layout.layers => self.base + self.layout.layer_weight(l.index) as u64,
            _ => self.slot(ScaleSlot::Weight),
        }
    }
    /// Where a layer's output gradient's scale lives: its own slot (where its producer may
    /// have left the amax), or (no layer) the per-op one.
    fn grad_slot(&self, layer: Option<Fp8Layer>) -> u64 {
        match layer {
            Some(l) if l.index < self.layout.layers => self.base + self.layout.layer_grad(l.index) as u64,
            _ => self.slot(ScaleSlot::Grad),
        }
    }
    /// Whether a layer of shape `s` fits the regions.
    fn fits(&self, s: MatShape, ext: LinearExtent) -> bool {
        s.n <= ext.rows && s.c <= ext.inputs && s.oc <= ext.outputs && s.c * s.oc <= ext.weight
    }
}

/// One cast: `rows × cols` bf16 at `x` to `fmt`, with the scale of the amax in `slot`, into
/// `dst` as laid out and/or `dst_t` transposed (`cols × rows`).
#[derive(Debug, Clone, Copy)]
struct Cast {
    x: u64,
    rows: usize,
    cols: usize,
    fmt: Fp8Format,
    slot: u64,
    dst: Option<u64>,
    dst_t: Option<u64>,
    /// What the cast makes of what it reads (`CastOp::None`: x itself; the others, and a
    /// norm, transposing casts only).
    op: CastOp,
    /// `x` is a LayerNorm's input: the values cast are its output rounded to bf16, as
    /// `layernorm_fwd` writes it (the slot holds their amax; transposing casts only).
    norm: Option<NormPtrs>,
    /// The scale is predicted (`fp8.cu`: `FP8_SCALE_PREDICTED`, then `FP8_SCALE_CHECK`): the
    /// slot's amax is zeroed and found by the cast itself (transposing casts only). `None`:
    /// the slot holds the amax.
    predicted: Option<Prediction>,
}

/// What a transposing cast makes of what it reads (`FP8_OP_*` in fp8.cu), each value rounded
/// to bf16 as the op named writes it; the slot holds the amax of those values, or the cast
/// predicts its scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum CastOp {
    /// The tensor read.
    #[default]
    None,
    /// GELU of a pre-activation (`gelu_fwd`'s outputs).
    Gelu,
    /// GELU'(pre)·x, x the gradient of GELU's output (`gelu_bwd`'s).
    Dgelu { pre: u64 },
}

impl CastOp {
    /// The kernel's `op` and `aux` arguments.
    fn args(self) -> (i32, u64) {
        match self {
            CastOp::None => (0, 0),
            CastOp::Gelu => (1, 0),
            CastOp::Dgelu { pre } => (2, pre),
        }
    }
}

/// Where a predicted cast's prediction lives (`CudaFp8Workspace::prediction`: the amax the
/// tensor had the last time, the counts, the reference's amax then) and the amax word of its
/// reference (0: none), an amax of this step the tensor's scales with.
#[derive(Debug, Clone, Copy)]
struct Prediction {
    at: u64,
    reference: u64,
}

/// A LayerNorm a cast applies as it reads its input: the rows' statistics (f32, `rows`
/// each) and the weight and bias (bf16, `cols` each).
#[derive(Debug, Clone, Copy)]
pub(super) struct NormPtrs {
    pub mean: u64,
    pub rstd: u64,
    pub w: u64,
    pub b: u64,
}

/// Where the optimizer step writes a cached weight's codes (`adamw.rs`): its two layouts'
/// regions, its weight slot and its prediction (`CudaFp8Workspace::weight_prediction`), and its
/// shape (`rows` = outputs, `cols` = inputs).
#[derive(Debug, Clone, Copy)]
pub(super) struct StepCodes {
    pub q: u64,
    pub qt: u64,
    pub slot: u64,
    pub pred: u64,
    pub rows: usize,
    pub cols: usize,
}

/// A layer's weight as its GEMM reads it: the codes (`[oc, c]` for the forward, `[c, oc]`
/// for the backward) and the slot whose inverse scale applies.
#[derive(Debug, Clone, Copy)]
struct WeightCodes {
    w: u64,
    wt: u64,
    slot: u64,
}

/// Which casts `CudaBackend::fp8_casts_only` runs (`gpu-timing fp8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Casts {
    /// The forward's, weights cast at each use: amax and cast of the input and the weight.
    Forward,
    /// The backward's, per use: the output gradient (amax, both layouts in one pass), the
    /// weight (amax, transposed) and the input (amax, transposed).
    Backward,
    /// The forward's with the weight cached: the input's amax and cast.
    ForwardCached,
    /// The backward's with the weight cached and the input's scale kept from the forward:
    /// the output gradient's amax and cast, the input's transposed cast.
    BackwardCached,
    /// Filling one layer's weight cache (once per parameter version): the weight's amax and
    /// one pass writing both layouts.
    WeightCache,
}

/// Where a linear forward's epilogue takes its extra operands. No GELU: an FP8 layer's
/// GELU and GELU' run as kernels of their own or in its casts (see `fused_matmul_gelu_fwd` in
/// matmul.rs).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct FwdEpilogue {
    pub bias: Option<u64>,
    /// Added to the product (cuBLASLt's C, beta 1).
    pub residual: Option<u64>,
    /// The input is what the layer's activation reads (a pre-activation whose GELU the layer
    /// multiplies): its cast applies it (`CastOp::Gelu`; the layer keeps its input's codes, and the amax of the activation's
    /// output was left in its input slot, or the cast predicts its scale). `CastOp::None`: the
    /// input is what the layer multiplies.
    pub input_op: CastOp,
    /// The input is a LayerNorm's input whose output the layer multiplies: its cast applies
    /// the norm (the layer keeps its input's codes, and the norm's output's amax was left in
    /// its input slot: `layernorm_stats`).
    pub norm: Option<NormPtrs>,
}
