//! FP8 linear layers on the GPU (`train.precision = "fp8"`; twin of the FP8 path of
//! `cpu/matmul.rs`, numerics in `backend/fp8.rs`): the operand workspace, the layers' kept
//! scales and cached weights, the casts of `fp8.cu`, and the three GEMMs of a linear layer
//! through cuBLASLt (`cublaslt.rs`).
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

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::cublaslt::{Act, Fp8Gemm, Gemm, OutType};
use super::kernels::{no_big_smem, KernelFile};
use super::launch::{bad, cfg, to_i32, BLOCK};
use super::matmul::BwdPtrs;
use super::reduce::Split;
use super::CudaBackend;
use crate::backend::fp8::{CudaFp8KeptInputs, CudaFp8WeightCache, CudaFp8Workspace, ScaleSlot};
use crate::backend::{
    AmaxSink, BResult, BackendError, Fp8Backward, Fp8Bytes, Fp8Format, Fp8Layer, Fp8Layers, Fp8Predictions,
    LinearExtent, MatShape,
};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "fp8",
    src: include_str!("fp8.cu"),
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

impl CudaBackend {
    /// Why this GPU cannot run FP8 GEMMs, or `Ok` where it can (compute capability 9.0 and
    /// later: Hopper's FP8 tensor cores, which cuBLASLt's TN FP8 GEMMs use).
    pub(super) fn fp8_supported(&self) -> Result<(), String> {
        let (major, minor) = self.compute_capability;
        if major >= 9 {
            return Ok(());
        }
        Err(format!(
            "FP8 GEMMs need a GPU of compute capability 9.0 (Hopper) or later; {} has compute capability \
             {major}.{minor}. Set train.precision = \"bf16\" on this GPU",
            self.device
        ))
    }

    /// `MatmulOps::prepare_fp8`: refuse an older GPU, hold a workspace for the largest layer
    /// (and for every extent asked before: the operand regions grow per dimension) with
    /// `layers`' slots, and their weight cache where asked (replacing the last call's).
    pub(super) fn fp8_prepare(&self, layers: &Fp8Layers) -> BResult<Fp8Bytes> {
        self.fp8_supported().map_err(|reason| BackendError::Unavailable { backend: "cuda", reason })?;
        let mut cell = self.fp8_ws.borrow_mut();
        let largest = layers.largest;
        let ext = match cell.as_ref() {
            Some(ws) => LinearExtent {
                rows: ws.extent.rows.max(largest.rows),
                inputs: ws.extent.inputs.max(largest.inputs),
                outputs: ws.extent.outputs.max(largest.outputs),
                weight: ws.extent.weight.max(largest.weight),
            },
            None => largest,
        };
        let version = cell.as_ref().map_or(0, |ws| ws.version);
        *cell = None; // freed in stream order
        let layout = CudaFp8Workspace::new(ext, layers.weights.len());
        let buf = self.alloc::<u8>(layout.bytes, "FP8 GEMM operands")?;
        let cached = layers.cached();
        let cache_layout = CudaFp8WeightCache::new(cached);
        // No cache where no cached layer has a weight (none cached, or every one of them kept
        // in bf16: `train.fp8_bf16_layers`).
        let cache = match cache_layout.bytes {
            0 => None,
            bytes => {
                let buf = self.alloc::<u8>(bytes, "cached FP8 weights")?;
                Some(WeightCache {
                    buf,
                    layout: cache_layout,
                    weights: cached.to_vec(),
                    made: vec![None; cached.len()],
                })
            }
        };
        let weight_cache = cache.as_ref().map_or(0, |c| c.layout.bytes);
        // Sized for the grown extent's rows: a model built later for fewer rows (an eval)
        // must not shrink what an earlier one's forward writes.
        let kept_layout = CudaFp8KeptInputs::new(&layers.kept_input_codes_at(ext.rows));
        let kept_inputs = kept_layout.bytes;
        let kept = match kept_inputs {
            0 => None,
            bytes => Some((self.alloc::<u8>(bytes, "kept FP8 inputs")?, kept_layout)),
        };
        // A new workspace holds no amax: every weight's is found again.
        let (weight_amax, step_amax) = (vec![None; layers.weights.len()], vec![false; layers.weights.len()]);
        let step_codes = vec![false; layers.weights.len()];
        let backward = layers.backward;
        let zeroed = Default::default();
        *cell = Some(Fp8Ws {
            buf,
            extent: ext,
            layout,
            cache,
            kept,
            weight_amax,
            step_amax,
            step_codes_on: layers.step_codes,
            step_codes,
            version,
            backward,
            zeroed,
        });
        Ok(Fp8Bytes { workspace: layout.bytes, weight_cache, kept_inputs })
    }

    /// `MatmulOps::fp8_weights_changed`: a new parameter version, whose weights' amaxes the
    /// last optimizer step left where `by_step` (else they are dropped).
    pub(super) fn fp8_new_version(&self, by_step: bool) {
        if let Some(ws) = self.fp8_ws.borrow_mut().as_mut() {
            ws.version += 1;
            for (known, left) in ws.weight_amax.iter_mut().zip(ws.step_amax.iter_mut()) {
                if !by_step {
                    *left = false;
                } else if *left {
                    *known = Some(ws.version);
                }
            }
            // The codes the step wrote are this version's (nothing wrote the parameters since).
            for (l, coded) in ws.step_codes.iter_mut().enumerate() {
                if !by_step {
                    *coded = false;
                } else if *coded {
                    if let Some(made) = ws.cache.as_mut().and_then(|c| c.made.get_mut(l)) {
                        *made = Some(ws.version);
                    }
                }
            }
        }
    }

    /// Where an optimizer step that writes layer `l`'s whole weight writes its cached codes
    /// (`adamw.rs`), or `None` where it does not: FP8 not prepared, the step's codes off
    /// (`Fp8Layers::step_codes`), or the layer not cached.
    pub(super) fn fp8_step_codes_target(&self, l: usize) -> BResult<Option<StepCodes>> {
        let cell = self.fp8_ws.borrow();
        let Some(ws) = cell.as_ref().filter(|ws| ws.step_codes_on) else { return Ok(None) };
        let Some(cache) = ws.cache.as_ref() else { return Ok(None) };
        let Some(&(c, oc)) = cache.weights.get(l) else { return Ok(None) };
        if l >= ws.layout.layers {
            return Err(bad(format!(
                "an optimizer step writes FP8 layer {l}, but prepare_fp8 reserved {} (a bug)",
                ws.layout.layers
            )));
        }
        if c * oc == 0 {
            return Ok(None);
        }
        let (base, cbase) = (self.ptr(&ws.buf, 0), self.ptr(&cache.buf, 0));
        let (rw, rwt) = cache.layout.regions[l];
        Ok(Some(StepCodes {
            q: cbase + rw as u64,
            qt: cbase + rwt as u64,
            slot: base + ws.layout.layer_weight(l) as u64,
            pred: base + ws.layout.weight_prediction(l) as u64,
            rows: oc,
            cols: c,
        }))
    }

    /// After an optimizer step wrote cached weights' codes as laid out with a predicted scale
    /// (`adamw.rs`; each weight's bf16 values at its `x`, its amax in its slot): for each, the
    /// check of the scale, and the transposed codes made from them where it held, else the
    /// weight cast again, both layouts (fp8.cu: `fp8_step_codes`, a few weights a launch); the
    /// inverse scale, the next prediction and a count written either way.
    ///
    /// # Safety
    /// Each `x` holds its `codes.rows · codes.cols` bf16; each `codes` is `fp8_step_codes_target`'s.
    pub(super) unsafe fn fp8_step_codes_check(&self, weights: &[(StepCodes, u64)]) -> BResult<()> {
        for group in weights.chunks(STEP_WEIGHTS) {
            let mut t = StepCodesTable {
                tile_start: [0; STEP_WEIGHTS + 1],
                q: [0; STEP_WEIGHTS],
                qt: [0; STEP_WEIGHTS],
                x: [0; STEP_WEIGHTS],
                slot: [0; STEP_WEIGHTS],
                pred: [0; STEP_WEIGHTS],
                rows: [0; STEP_WEIGHTS],
                cols: [0; STEP_WEIGHTS],
                n: group.len() as i32,
            };
            for (k, &(c, x)) in group.iter().enumerate() {
                let tiles = c.cols.div_ceil(TILE_C) * c.rows.div_ceil(STEP_TILE_R);
                t.tile_start[k + 1] = t.tile_start[k] + tiles as i64;
                (t.q[k], t.qt[k], t.x[k], t.slot[k], t.pred[k]) = (c.q, c.qt, x, c.slot, c.pred);
                (t.rows[k], t.cols[k]) = (to_i32("rows", c.rows)?, to_i32("columns", c.cols)?);
                if !(c.rows.is_multiple_of(16) && c.cols.is_multiple_of(16)) {
                    return Err(bad(format!(
                        "FP8 step codes of a {} × {} weight, not multiples of 16 (a bug)",
                        c.rows, c.cols
                    )));
                }
            }
            let tiles = u32::try_from(t.tile_start[group.len()])
                .map_err(|_| bad("FP8 step codes: too many tiles in one launch".into()))?;
            let f = self.f("fp8_step_codes")?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&t);
            // SAFETY: the caller's promises: each x holds rows·cols bf16, q and qt as many bytes
            // (the layer's cache regions), the slot and the prediction four words each.
            unsafe { lb.launch(cfg((tiles.max(1), 1, 1), (256, 1, 1), 0)) }
                .map_err(|e| self.launch_err("fp8_step_codes", e))?;
        }
        Ok(())
    }

    /// An optimizer step updated the weights of `layers` (`AdamWSegment::fp8_layer`), writing
    /// the cached codes of those marked true: for the version `fp8_weights_changed(by_step)`
    /// begins.
    pub(super) fn fp8_step_codes_written(&self, layers: &[(usize, bool)]) -> BResult<()> {
        let mut cell = self.fp8_ws.borrow_mut();
        let Some(ws) = cell.as_mut() else { return Ok(()) };
        for &(l, coded) in layers {
            let n = ws.step_codes.len();
            *ws.step_codes.get_mut(l).ok_or_else(|| {
                bad(format!("an optimizer step wrote FP8 layer {l}, but prepare_fp8 reserved {n} (a bug)"))
            })? = coded;
        }
        Ok(())
    }

    /// For an optimizer step that leaves the amax of each of `layers`' weights
    /// (`AdamWSegment::fp8_layer`): their weight slots zeroed in stream order (adjacent
    /// ones together) and recorded as left by the step; returns each one's amax word, in
    /// order, for the kernel to max into.
    pub(super) fn fp8_step_amax_words(&self, layers: &[usize]) -> BResult<Vec<u64>> {
        let mut cell = self.fp8_ws.borrow_mut();
        let ws = cell.as_mut().ok_or_else(|| {
            bad(format!("an optimizer step leaves FP8 layer amaxes ({layers:?}) before prepare_fp8 (a bug)"))
        })?;
        let base = self.ptr(&ws.buf, 0);
        let mut sorted = layers.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if let Some(&l) = sorted.last().filter(|&&l| l >= ws.layout.layers) {
            return Err(bad(format!(
                "an optimizer step leaves FP8 layer {l}'s amax, but prepare_fp8 reserved {} (a bug)",
                ws.layout.layers
            )));
        }
        // Runs of adjacent layers: one clear each.
        let mut k = 0;
        while k < sorted.len() {
            let mut e = k + 1;
            while e < sorted.len() && sorted[e] == sorted[e - 1] + 1 {
                e += 1;
            }
            self.fp8_clear(base + ws.layout.layer_weight(sorted[k]) as u64, e - k)?;
            k = e;
        }
        for &l in &sorted {
            ws.step_amax[l] = true;
        }
        Ok(layers.iter().map(|&l| base + ws.layout.layer_weight(l) as u64 + 4).collect())
    }

    /// Whether the FP8 layers' dW GEMMs read FP8 codes (`Fp8Layers::backward`; false
    /// before `prepare_fp8`).
    pub(super) fn fp8_weight_grad_in_fp8(&self) -> bool {
        self.fp8_ws.borrow().as_ref().is_some_and(|ws| ws.backward.weight_grad_in_fp8())
    }

    /// The workspace's pointers, checked to hold a layer of shape `s`.
    fn fp8_ws(&self, s: MatShape) -> BResult<WsPtrs> {
        let cell = self.fp8_ws.borrow();
        let Some(ws) = cell.as_ref() else {
            return Err(bad(format!(
                "an FP8 GEMM (N={} C={} OC={}) before MatmulOps::prepare_fp8 reserved its operands (a bug)",
                s.n, s.c, s.oc
            )));
        };
        let p = WsPtrs { base: self.ptr(&ws.buf, 0), layout: ws.layout, backward: ws.backward };
        if !p.fits(s, ws.extent) {
            return Err(bad(format!(
                "an FP8 GEMM N={} C={} OC={} is larger than the operands prepared for ({:?}) (a bug)",
                s.n, s.c, s.oc, ws.extent
            )));
        }
        Ok(p)
    }

    /// Layer `layer`'s cached weight (`w`: the bf16 weight, `[oc, c]` of `s`), cast now if
    /// the parameters changed since it was made or it was made from another buffer; `None`
    /// where weights are not cached (or there is no layer): the caller casts at this use.
    fn fp8_cached_weight(&self, layer: Option<Fp8Layer>, w: u64, s: MatShape) -> BResult<Option<WeightCodes>> {
        let Some(l) = layer else { return Ok(None) };
        let mut cell = self.fp8_ws.borrow_mut();
        let Some(ws) = cell.as_mut() else { return Ok(None) };
        let (version, layers) = (ws.version, ws.layout.layers);
        if l.index >= layers {
            return Err(bad(format!("FP8 layer {} used, but prepare_fp8 reserved {layers} (a bug)", l.index)));
        }
        let slot = self.ptr(&ws.buf, 0) + ws.layout.layer_weight(l.index) as u64;
        let amax_known = ws.weight_amax[l.index] == Some(version);
        let Some(cache) = ws.cache.as_mut() else { return Ok(None) };
        // Layers past the cached ones cast at each use.
        let Some(&reserved) = cache.weights.get(l.index) else { return Ok(None) };
        if reserved != (s.c, s.oc) {
            return Err(bad(format!(
                "FP8 layer {} used with a C{} × OC{} weight, but prepare_fp8 reserved {reserved:?} (a bug)",
                l.index, s.c, s.oc
            )));
        }
        let base = self.ptr(&cache.buf, 0);
        let (rw, rwt) = cache.layout.regions[l.index];
        let codes = WeightCodes { w: base + rw as u64, wt: base + rwt as u64, slot };
        if cache.made[l.index] != Some(version) {
            let cast = Cast {
                x: w,
                rows: s.oc,
                cols: s.c,
                fmt: Fp8Format::E4M3,
                slot,
                dst: Some(codes.w),
                dst_t: Some(codes.wt),
                op: CastOp::None,
                norm: None,
                predicted: None,
            };
            // SAFETY: the weight holds oc·c bf16 (the callers checked); the cache's regions
            // hold oc·c bytes each for this layer (its shape checked above); the slot is the
            // layer's, and holds this version's amax where `amax_known`.
            unsafe { self.fp8_cast_amax(cast, amax_known, 0)? };
            cache.made[l.index] = Some(version);
            ws.weight_amax[l.index] = Some(version);
        }
        Ok(Some(codes))
    }

    /// Where layer `layer` keeps its input's codes (`[c, n]` e4m3) where it keeps them
    /// (`Fp8Layer::keeps_input`), else `None`; a layer `prepare_fp8` reserved none for is
    /// an error (a bug).
    fn fp8_kept_input(&self, layer: Option<Fp8Layer>) -> BResult<Option<u64>> {
        let Some(l) = layer.filter(|l| l.keeps_input) else { return Ok(None) };
        let cell = self.fp8_ws.borrow();
        let region = cell.as_ref().and_then(|ws| ws.kept.as_ref()).and_then(|(buf, k)| {
            let at = k.regions.get(l.index).copied().flatten()?;
            Some(self.ptr(buf, 0) + at as u64)
        });
        match region {
            Some(r) => Ok(Some(r)),
            None => Err(bad(format!(
                "FP8 layer {} keeps its input, but prepare_fp8 reserved no codes for it (a bug)",
                l.index
            ))),
        }
    }

    /// The amax of an uncached weight (`n` bf16 at `w`) into `slot` (its
    /// `WsPtrs::weight_slot`), unless the slot already holds it: its layer's weight was
    /// measured in this parameter version by an earlier use, or the optimizer step that
    /// began the version left it.
    ///
    /// # Safety
    /// `w` holds `n` bf16; `slot` is a scale slot.
    unsafe fn fp8_weight_amax(&self, layer: Option<Fp8Layer>, w: u64, n: usize, slot: u64) -> BResult<()> {
        let current = {
            let mut cell = self.fp8_ws.borrow_mut();
            match (cell.as_mut(), layer) {
                (Some(ws), Some(l)) if l.index < ws.weight_amax.len() => {
                    let key = Some(ws.version);
                    // Recorded now, found below: the amax pass is queued before any later use.
                    std::mem::replace(&mut ws.weight_amax[l.index], key) == key
                }
                _ => false,
            }
        };
        if current {
            return Ok(());
        }
        // SAFETY: the caller's promises.
        unsafe { self.fp8_fresh_amax(w, n, slot) }
    }

    /// The amax word of the slot `sink` names, zeroed in stream order for a producer kernel
    /// to max into (by `fp8_clear_sinks` where it zeroed the slot and nothing wrote it since,
    /// else now); 0 (the kernels' "none") without a sink.
    pub(super) fn fp8_sink(&self, sink: Option<AmaxSink>) -> BResult<u64> {
        let Some(s) = sink else { return Ok(0) };
        let slot = self.fp8_sink_slot(s)?;
        let zeroed = self.fp8_ws.borrow_mut().as_mut().is_some_and(|ws| ws.zeroed.remove(&slot));
        if !zeroed {
            self.fp8_clear(slot, 1)?;
        }
        Ok(slot + 4)
    }

    /// For a cast that predicts its scale (`Cast::predicted`) into the slot `sink` names,
    /// scaling with the amax in `reference`'s slot where set: the slot zeroed in stream order
    /// (as for a producer: the cast maxes its amax into it), and where the prediction is.
    fn fp8_predict(&self, sink: AmaxSink, reference: Option<AmaxSink>) -> BResult<Prediction> {
        self.fp8_sink(Some(sink))?;
        let cell = self.fp8_ws.borrow();
        let ws = cell
            .as_ref()
            .ok_or_else(|| bad(format!("an FP8 predicted scale ({sink:?}) before prepare_fp8 (a bug)")))?;
        let base = self.ptr(&ws.buf, 0);
        ws.sink_offset(sink)?;
        let reference = match reference {
            Some(r) => base + ws.sink_offset(r)? as u64 + 4,
            None => 0,
        };
        Ok(Prediction { at: base + ws.layout.prediction(sink) as u64, reference })
    }

    /// How often the FP8 casts that predict their scale (`Cast::predicted`) predicted it
    /// right and wrong since `prepare_fp8`, over every layer, the layers' inputs' casts and
    /// their output gradients' apart (a device read: the stream waits); `None` without FP8
    /// layers.
    pub(super) fn fp8_prediction_counts(&self) -> BResult<Option<Fp8Predictions>> {
        let cell = self.fp8_ws.borrow();
        let Some(ws) = cell.as_ref() else { return Ok(None) };
        let layers = ws.layout.layers;
        if layers == 0 {
            return Ok(None);
        }
        let start = ws.layout.prediction(AmaxSink::Input(0));
        // The inputs' and gradients' predictions, then the weights' (adjacent).
        let words = 3 * layers * 4;
        let view = ws.buf.slice(start..start + 4 * words);
        let mut bytes = vec![0u8; 4 * words];
        self.stream.memcpy_dtoh(&view, &mut bytes).map_err(|e| self.err("reading FP8 prediction counts", e))?;
        self.stream.synchronize().map_err(|e| self.err("reading FP8 prediction counts", e))?;
        let word = |i: usize| {
            u64::from(u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]))
        };
        // Per layer its input's prediction, then its output gradient's; then each weight's.
        let mut counts = Fp8Predictions::default();
        for p in 0..3 * layers {
            let kind = match p {
                p if p >= 2 * layers => &mut counts.weights,
                p if p % 2 == 0 => &mut counts.inputs,
                _ => &mut counts.grads,
            };
            kind.0 += word(4 * p + 1);
            kind.1 += word(4 * p + 2);
        }
        Ok(Some(counts))
    }

    /// `MatmulOps::fp8_clear_sinks`: layers `layers`' input and output-gradient slots
    /// (adjacent: `CudaFp8Workspace::layer_input`) zeroed in one go and recorded as zeroed.
    pub(super) fn fp8_clear_layer_sinks(&self, layers: std::ops::Range<usize>) -> BResult<()> {
        let (first, count) = {
            let mut cell = self.fp8_ws.borrow_mut();
            let Some(ws) = cell.as_mut() else { return Ok(()) };
            if layers.is_empty() {
                return Ok(());
            }
            if layers.end > ws.layout.layers {
                return Err(bad(format!(
                    "FP8 sinks of layers {layers:?} zeroed, but prepare_fp8 reserved {} (a bug)",
                    ws.layout.layers
                )));
            }
            let base = self.ptr(&ws.buf, 0);
            for i in layers.clone() {
                ws.zeroed.insert(base + ws.layout.layer_input(i) as u64);
                ws.zeroed.insert(base + ws.layout.layer_grad(i) as u64);
            }
            (base + ws.layout.layer_input(layers.start) as u64, 2 * layers.len())
        };
        self.fp8_clear(first, count)
    }

    /// The device address of the slot `s` names.
    fn fp8_sink_slot(&self, s: AmaxSink) -> BResult<u64> {
        let cell = self.fp8_ws.borrow();
        let ws = cell.as_ref().ok_or_else(|| bad(format!("an FP8 amax sink ({s:?}) before prepare_fp8 (a bug)")))?;
        Ok(self.ptr(&ws.buf, 0) + ws.sink_offset(s)? as u64)
    }

    /// `MatmulOps::fp8_amax_into`: the amax pass over `n` bf16 at `x` into `sink`'s slot.
    pub(super) fn fp8_amax_into_sink(&self, x: u64, n: usize, sink: AmaxSink) -> BResult<()> {
        let slot = self.fp8_sink_slot(sink)?;
        // SAFETY: the caller checked x holds n bf16; the slot is the sink's.
        unsafe { self.fp8_fresh_amax(x, n, slot) }
    }

    /// The amax of `n` bf16 at `x` into `slot`, zeroed first.
    ///
    /// # Safety
    /// `x` holds `n` bf16; `slot` is a scale slot.
    unsafe fn fp8_fresh_amax(&self, x: u64, n: usize, slot: u64) -> BResult<()> {
        self.fp8_clear(slot, 1)?;
        // SAFETY: the caller's promises.
        unsafe { self.fp8_amax(x, n, slot) }
    }

    /// Cast `c` with its amax found now (the slot zeroed, an amax pass), or, where `known`,
    /// with the amax its slot already holds (the forward's, or the one its producer left);
    /// with its column sums into `colsum` unless 0 (see [`CudaBackend::fp8_cast_colsum`]).
    ///
    /// # Safety
    /// As [`CudaBackend::fp8_cast_colsum`].
    unsafe fn fp8_cast_amax(&self, c: Cast, known: bool, colsum: u64) -> BResult<()> {
        // SAFETY: the caller's promises.
        unsafe {
            // A predicted cast finds the amax itself.
            if !known && c.predicted.is_none() {
                self.fp8_fresh_amax(c.x, c.rows * c.cols, c.slot)?;
            }
            self.fp8_cast_colsum(c, colsum)
        }
    }

    /// Zero `count` adjacent scale slots from `slot` (their amax before an amax pass adds to
    /// it; the inverse scale too: each cast writes its own before its GEMM runs).
    fn fp8_clear(&self, slot: u64, count: usize) -> BResult<()> {
        // SAFETY: slots lie in the workspace's scale region, `count` of them from `slot`.
        let r = unsafe { cudarc::driver::result::memset_d8_async(slot, 0, 16 * count, self.stream.cu_stream()) };
        r.map_err(|e| self.err("zeroing FP8 scale slots", e))
    }

    /// The amax of `n` bf16 at `x` into `slot` (max-ed into its second word).
    ///
    /// # Safety
    /// `x` holds `n` bf16; `slot` is a scale slot.
    pub(super) unsafe fn fp8_amax(&self, x: u64, n: usize, slot: u64) -> BResult<()> {
        // The slot is written now: a producer after it must zero it again. (The weight cache's
        // fill calls this holding the state: its slot is a weight's, never a zeroed sink.)
        if let Ok(mut cell) = self.fp8_ws.try_borrow_mut() {
            if let Some(ws) = cell.as_mut() {
                ws.zeroed.remove(&slot);
            }
        }
        let ni = n as i64;
        let f = self.f("fp8_amax_bf16")?;
        let mut lb = self.stream.launch_builder(f);
        // The slot's second word is its amax (the first, the inverse scale, 16-byte aligned).
        let amax = slot + 4;
        lb.arg(&amax).arg(&x).arg(&ni);
        // SAFETY: x holds n bf16 (the caller's promise); the amax is the slot's second word.
        unsafe { lb.launch(cfg((self.grid_for(n / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("fp8_amax_bf16", e))?;
        Ok(())
    }

    /// Cast `c.x` with the scale of the amax already in `c.slot` (see [`Cast`]).
    ///
    /// # Safety
    /// `x` holds `rows·cols` bf16; `dst` and `dst_t` (16-byte aligned) as many bytes; the
    /// slot holds the tensor's amax.
    unsafe fn fp8_cast(&self, c: Cast) -> BResult<()> {
        // SAFETY: the caller's promises; no column sums.
        unsafe { self.fp8_cast_colsum(c, 0) }
    }

    /// [`CudaBackend::fp8_cast`], and for a transposing cast with `colsum` not 0 also the
    /// column sums of `c.x` per [`COLSUM_ROWS`] rows into `colsum` (f32,
    /// `[rows.div_ceil(COLSUM_ROWS), cols]`; see `fp8_cast_transpose_bf16`).
    ///
    /// # Safety
    /// As [`CudaBackend::fp8_cast`]; `colsum` (unless 0) holds that many floats.
    unsafe fn fp8_cast_colsum(&self, c: Cast, colsum: u64) -> BResult<()> {
        let Cast { x, rows, cols, fmt, slot, dst, dst_t, op, norm, predicted } = c;
        let n = rows * cols;
        let ni = n as i64;
        let fmt_i = i32::from(fmt.is_e5m2());
        match dst_t {
            None => {
                let q = dst.ok_or_else(|| bad("an FP8 cast without a destination (a bug)".into()))?;
                if op != CastOp::None || norm.is_some() || predicted.is_some() {
                    return Err(bad(
                        "an activation- or norm-applying or predicted FP8 cast without its transpose (a bug)".into(),
                    ));
                }
                if colsum != 0 {
                    return Err(bad("column sums asked of an FP8 cast without its transpose (a bug)".into()));
                }
                let f = self.f("fp8_cast_bf16")?;
                let mut lb = self.stream.launch_builder(f);
                lb.arg(&q).arg(&x).arg(&ni).arg(&slot).arg(&fmt_i);
                // SAFETY: q holds n bytes, x n bf16; the slot two words.
                unsafe { lb.launch(cfg((self.grid_for(n / 8 + 1), 1, 1), (BLOCK, 1, 1), 0)) }
                    .map_err(|e| self.launch_err("fp8_cast_bf16", e))?;
            }
            Some(qt) => {
                let q = dst.unwrap_or(0);
                let (ri, ci) = (to_i32("rows", rows)?, to_i32("columns", cols)?);
                let tiles = cols.div_ceil(TILE_C) * rows.div_ceil(TILE_R);
                let tiles = u32::try_from(tiles)
                    .map_err(|_| bad(format!("FP8 transposing cast: {rows} × {cols} has too many tiles")))?;
                let (op_i, aux) = op.args();
                let NormPtrs { mean, rstd, w, b } = norm.unwrap_or(NormPtrs { mean: 0, rstd: 0, w: 0, b: 0 });
                let Prediction { at: pred, reference } = predicted.unwrap_or(Prediction { at: 0, reference: 0 });
                // A predicted cast (one tile a block), then its check: most often it finds the
                // prediction right and every block returns at once, so it gets a grid of a few
                // blocks per SM, which loop over the tiles where the cast runs again.
                let passes: &[(i32, u32)] = match predicted {
                    None => &[(SCALE_OF_AMAX, tiles)],
                    Some(_) => &[(SCALE_PREDICTED, tiles), (SCALE_CHECK, tiles.min(8 * self.sm_count as u32).max(1))],
                };
                // The cast reads its tiles from the last (`reverse`): the kernels before it (a
                // GEMM, attention) wrote the last rows last, so those reads hit in L2 while the
                // rest streams (GPT-2 1.5B: 0.35-0.45 ms a step in two calls of three, BENCHMARKS.md
                // run 28). A check that casts again reads from the first: what the predicted pass
                // read last.
                for &(mode, grid) in passes {
                    let reverse: i32 = if mode == SCALE_CHECK { 0 } else { 1 };
                    let f = self.f("fp8_cast_transpose_bf16")?;
                    let mut lb = self.stream.launch_builder(f);
                    lb.arg(&q).arg(&qt).arg(&x).arg(&ri).arg(&ci).arg(&slot).arg(&fmt_i).arg(&colsum).arg(&op_i);
                    lb.arg(&mean).arg(&rstd).arg(&w).arg(&b).arg(&aux).arg(&mode).arg(&pred).arg(&reference);
                    lb.arg(&reverse);
                    // SAFETY: q (unless 0) and qt hold rows·cols bytes, x as many bf16, aux (a
                    // pre-activation, rows·cols) its bf16; the slot and the prediction four words;
                    // colsum (unless 0) a float per column and tile of rows; a norm's
                    // statistics a float per row, its weight and bias a bf16 per column.
                    unsafe { lb.launch(cfg((grid, 1, 1), (256, 1, 1), 0)) }
                        .map_err(|e| self.launch_err("fp8_cast_transpose_bf16", e))?;
                }
            }
        }
        Ok(())
    }

    /// Quantize with the tensor's current amax: the amax pass into `c.slot`, then the cast.
    ///
    /// # Safety
    /// As [`CudaBackend::fp8_cast`], with the slot's amax zero.
    unsafe fn fp8_quantize(&self, c: Cast) -> BResult<()> {
        // SAFETY: the caller's promises, passed on.
        unsafe {
            self.fp8_amax(c.x, c.rows * c.cols, c.slot)?;
            self.fp8_cast(c)
        }
    }

    /// The forward `out = inp · Wᵀ` (+ the epilogue's bias or residual) in FP8, for an
    /// eligible shape (`fp8::eligible`), with `layer`'s state where it has one (its input's
    /// scale kept for its backward, its cached weight). `Ok(false)`, with nothing run but a
    /// stale cached weight's cast, where cuBLASLt has no FP8 algorithm for this epilogue
    /// (callers of a fused variant then compose it).
    pub(super) fn fp8_fwd(
        &self,
        (out, inp, w): (u64, u64, u64),
        s: MatShape,
        epi: FwdEpilogue,
        layer: Option<Fp8Layer>,
    ) -> BResult<bool> {
        let MatShape { n, c, oc } = s;
        let ws = self.fp8_ws(s)?;
        let in_slot = ws.input_slot(layer)?;
        self.bind()?;
        let cached = self.fp8_cached_weight(layer, w, s)?;
        let (wq, w_slot) = match cached {
            Some(k) => (k.w, k.slot),
            None => (ws.w(), ws.weight_slot(layer)),
        };
        let g = Gemm {
            transa: true,
            transb: false,
            m: oc,
            n,
            k: c,
            a: wq,
            lda: c,
            b: ws.a(),
            ldb: c,
            d: out,
            ldd: oc,
            out: OutType::Bf16,
            beta: if epi.residual.is_some() { 1.0 } else { 0.0 },
            c: epi.residual,
            bias: epi.bias,
            act: Act::None,
            aux: None,
            fp8: Some(Fp8Gemm {
                a: Fp8Format::E4M3,
                b: Fp8Format::E4M3,
                a_scale: w_slot,
                b_scale: in_slot,
                fast_accum: false,
            }),
        };
        let fused = epi.residual.is_some();
        if fused && !self.lt.supports(&g) {
            return Ok(false);
        }
        // The op that wrote the input may have left its amax in the layer's input slot.
        let amax_left = layer.is_some_and(|l| l.input_amax_ready);
        // A layer that keeps its input's codes for its backward gets them transposed from
        // the same cast (the layout the backward's dW GEMM reads).
        let kept = self.fp8_kept_input(layer)?;
        // An activation or a norm applied in the cast with no amax of its output left: the cast
        // predicts its scale and finds the amax itself (the same codes: see `Cast::predicted`).
        let op = epi.input_op;
        let predicted = match layer {
            Some(l) if (op != CastOp::None || epi.norm.is_some()) && !amax_left && kept.is_some() => {
                Some(self.fp8_predict(AmaxSink::Input(l.index), None)?)
            }
            _ => None,
        };
        if (op != CastOp::None || epi.norm.is_some()) && (kept.is_none() || !(amax_left || predicted.is_some())) {
            return Err(bad(format!(
                "an FP8 GEMM that applies an activation or a norm to its input in its cast, but layer {:?} keeps no \
                 input codes or no amax of the applied input was left (a bug)",
                layer.map(|l| l.index)
            )));
        }
        let x = Cast {
            x: inp,
            rows: n,
            cols: c,
            fmt: Fp8Format::E4M3,
            slot: in_slot,
            dst: Some(ws.a()),
            dst_t: kept,
            op,
            norm: epi.norm,
            predicted,
        };
        // SAFETY: inp holds n·c and the weight oc·c bf16 (the callers checked); the
        // workspace's regions hold a layer of this shape (fp8_ws checked), a kept region the
        // layer's input (rows × inputs reserved); the input slot holds the amax its producer
        // left where that is said, or is zeroed for a predicted cast.
        unsafe {
            self.fp8_cast_amax(x, amax_left, 0)?;
            if cached.is_none() {
                self.fp8_weight_amax(layer, w, oc * c, w_slot)?;
                let wc = Cast {
                    x: w,
                    rows: oc,
                    cols: c,
                    slot: w_slot,
                    dst: Some(ws.w()),
                    dst_t: None,
                    op: CastOp::None,
                    norm: None,
                    predicted: None,
                    ..x
                };
                self.fp8_cast(wc)?;
            }
        }
        if fused {
            return self.lt.try_gemm(&g, self.lt_stream());
        }
        self.lt.gemm(&g, self.lt_stream())?;
        Ok(true)
    }

    /// The backward of a linear layer in FP8 for an eligible shape: `dinp = dout · W`,
    /// `dW (+)= doutᵀ · inp`, `dbias (+)= Σ dout`, with `layer`'s cached weight and, where its
    /// input is the forward's, the forward's input scale.
    pub(super) fn fp8_bwd(&self, ptr: BwdPtrs, s: MatShape, layer: Option<Fp8Layer>) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        let ws = self.fp8_ws(s)?;
        let in_slot = ws.input_slot(layer)?;
        // The input's amax is in its slot: the forward's (the same tensor), or left by the op
        // that made the input again (a recompute with an amax sink).
        let reuse_input = layer.is_some_and(|l| l.input_from_forward || l.input_amax_ready);
        self.bind()?;
        let cached = self.fp8_cached_weight(layer, ptr.w, s)?;
        let (wtq, w_slot) = match cached {
            Some(k) => (k.wt, k.slot),
            None => (ws.w(), ws.weight_slot(layer)),
        };
        // dY's format, and whether dW reads FP8 codes (else the bf16 dY and input).
        let (e4, gf, dw_fp8) = (Fp8Format::E4M3, ws.backward.grad_format(), ws.backward.weight_grad_in_fp8());
        // The op that wrote dY may have left its amax in the layer's gradient slot.
        let (g_slot, amax_left) = (ws.grad_slot(layer), layer.is_some_and(|l| l.grad_amax_ready));
        let dx = Gemm {
            transa: true,
            transb: false,
            m: c,
            n,
            k: oc,
            a: wtq,
            lda: oc,
            b: ws.a(),
            ldb: oc,
            d: ptr.dinp,
            ldd: c,
            out: OutType::Bf16,
            beta: 0.0,
            c: None,
            bias: None,
            act: Act::None,
            aux: None,
            fp8: Some(Fp8Gemm { a: e4, b: gf, a_scale: w_slot, b_scale: g_slot, fast_accum: false }),
        };
        let dw = Gemm {
            transa: true,
            transb: false,
            m: c,
            n: oc,
            k: n,
            a: ws.a(),
            lda: n,
            b: ws.gt(),
            ldb: n,
            d: ptr.dw,
            ldd: c,
            out: OutType::F32,
            beta: if ptr.fresh { 0.0 } else { 1.0 },
            c: None,
            bias: None,
            act: Act::None,
            aux: None,
            fp8: Some(Fp8Gemm { a: e4, b: gf, a_scale: in_slot, b_scale: g_slot, fast_accum: false }),
        };
        let stream = self.lt_stream();
        // dY's transposed codes only for an FP8 dW.
        let gt = dw_fp8.then(|| ws.gt());
        // dY made by its cast from an activation's output gradient (`BwdPtrs::dy_op`): only
        // where the cast is transposing (it alone applies GELU'), and with
        // its scale predicted where no amax of dY was left (there is no dY to take one of).
        let predicted = match (ptr.dy_op, layer) {
            (CastOp::None, _) => None,
            (_, Some(l)) if gt.is_some() => {
                (!amax_left).then(|| self.fp8_predict(AmaxSink::Grad(l.index), ptr.dy_ref)).transpose()?
            }
            (_, _) => {
                return Err(bad(format!(
                    "an FP8 backward that makes dY from an activation's output gradient in its cast, but layer {:?} \
                     has no FP8 state or dW is not in FP8 (a bug)",
                    layer.map(|l| l.index)
                )))
            }
        };
        let g = Cast {
            x: ptr.dout,
            rows: n,
            cols: oc,
            fmt: gf,
            slot: g_slot,
            dst: Some(ws.a()),
            dst_t: gt,
            op: ptr.dy_op,
            norm: None,
            predicted,
        };
        // The bias gradient from the column sums dY's transposing cast makes as it reads dY
        // (one pass over dY fewer); without that cast (dW in bf16), the bias kernel's pass.
        let fused_db = ptr.dbias.filter(|_| gt.is_some());
        let colsum = match fused_db {
            Some(_) => self.scratch_f32(n.div_ceil(COLSUM_ROWS) * oc)?,
            None => 0,
        };
        // The input's codes for dW: kept by the forward (no cast here), or cast now into
        // region a once the dX GEMM has read dY from it.
        let kept = match self.fp8_kept_input(layer)? {
            Some(k) if dw_fp8 => Some(k),
            _ => None,
        };
        if kept.is_none() && ptr.inp == 0 {
            return Err(bad(format!(
                "an FP8 backward without its input, but layer {:?} kept no codes for its dW (a bug)",
                layer.map(|l| l.index)
            )));
        }
        let x = Cast {
            x: ptr.inp,
            rows: n,
            cols: c,
            fmt: e4,
            slot: in_slot,
            dst: None,
            dst_t: Some(ws.a()),
            op: CastOp::None,
            norm: None,
            predicted: None,
        };
        // SAFETY: dout holds n·oc, the weight oc·c, inp n·c bf16 (bwd_ptrs checked); the
        // workspace's regions hold a layer of this shape (fp8_ws checked). The input's cast
        // overwrites region a (dY) only after the dX GEMM that reads it, in stream order. A
        // reused input slot holds the amax of this input (the forward's, the same tensor,
        // or its producer's); the gradient slot holds the amax dY's producer left where that
        // is said.
        unsafe {
            self.fp8_cast_amax(g, amax_left, colsum)?;
            if let Some(db) = fused_db {
                // Right after the cast: the scratch holds the sums until another op takes it.
                let split = Split { dst0: db, dst1: db, split: oc, overwrite: ptr.fresh };
                self.reduce_partials(split, colsum, n.div_ceil(COLSUM_ROWS), oc)?;
            }
            if cached.is_none() {
                let wc = Cast {
                    x: ptr.w,
                    rows: oc,
                    cols: c,
                    fmt: e4,
                    slot: w_slot,
                    dst: None,
                    dst_t: Some(ws.w()),
                    op: CastOp::None,
                    norm: None,
                    predicted: None,
                };
                self.fp8_weight_amax(layer, ptr.w, oc * c, w_slot)?;
                self.fp8_cast(wc)?;
            }
            self.lt.gemm(&dx, stream)?;
            if dw_fp8 && kept.is_none() {
                self.fp8_cast_amax(x, reuse_input, 0)?;
            }
        }
        if dw_fp8 {
            let a = kept.unwrap_or(ws.a());
            self.lt.gemm(&Gemm { a, ..dw }, stream)?;
        } else {
            // `Fp8WeightGrad::Bf16`: the bf16 path's dW GEMM on the unquantized operands
            // (an FP8-eligible shape needs no padded staging).
            let beta = if ptr.fresh { 0.0 } else { 1.0 };
            self.lt.gemm(&super::matmul::dw_gemm(ptr.dw, ptr.inp, ptr.dout, s, oc, beta), stream)?;
        }
        if let (Some(db), None) = (ptr.dbias, fused_db) {
            self.bias_grad(db, ptr.dout, n, oc, ptr.fresh)?;
        }
        Ok(())
    }
}

impl CudaBackend {
    /// The casts one linear layer's FP8 GEMMs need, alone, on the workspace
    /// (`prepare_fp8` first), as `which` says, for `gpu-timing fp8`'s split of the FP8 time
    /// into casts and GEMMs. `inp` holds n·c, `dout` n·oc and `params` from `w` oc·c bf16.
    /// The values written are not used (a kept input scale is whatever the slot holds: a
    /// cast's cost does not depend on its scale).
    pub fn fp8_casts_only(
        &self,
        inp: &CudaSlice<half::bf16>,
        dout: &CudaSlice<half::bf16>,
        (params, w): (&CudaSlice<half::bf16>, usize),
        s: MatShape,
        which: Fp8Casts,
    ) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        let check = super::launch::check;
        check("fp8_casts_only inp", inp.len(), 0, n * c)?;
        check("fp8_casts_only dout", dout.len(), 0, n * oc)?;
        check("fp8_casts_only weight", params.len(), w, oc * c)?;
        if !crate::backend::fp8::eligible(s) {
            return Err(bad(format!("fp8_casts_only: N{n} C{c} OC{oc} is not FP8-eligible")));
        }
        let ws = self.fp8_ws(s)?;
        let (x, g, wp) = (self.ptr(inp, 0), self.ptr(dout, 0), self.ptr(params, w));
        let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
        let slot = |k| ws.slot(k);
        let xs = Cast {
            x,
            rows: n,
            cols: c,
            fmt: e4,
            slot: slot(ScaleSlot::Input),
            dst: Some(ws.a()),
            dst_t: None,
            op: CastOp::None,
            norm: None,
            predicted: None,
        };
        let ws_ = Cast { x: wp, rows: oc, cols: c, slot: slot(ScaleSlot::Weight), dst: Some(ws.w()), ..xs };
        let gs = Cast {
            x: g,
            rows: n,
            cols: oc,
            fmt: e5,
            slot: slot(ScaleSlot::Grad),
            dst: Some(ws.a()),
            dst_t: Some(ws.gt()),
            op: CastOp::None,
            norm: None,
            predicted: None,
        };
        let xt = Cast { dst: None, dst_t: Some(ws.a()), ..xs };
        let wt = Cast { dst: None, dst_t: Some(ws.w()), ..ws_ };
        if which == Fp8Casts::WeightCache
            && !(oc * c <= ws.layout.gt - ws.layout.a && oc * c <= ws.layout.w - ws.layout.gt)
        {
            return Err(bad(format!("fp8_casts_only: a C{c} × OC{oc} weight's two layouts do not fit the workspace")));
        }
        let both = Cast { dst: Some(ws.a()), dst_t: Some(ws.gt()), ..ws_ };
        // SAFETY: the lengths are checked above, the workspace holds this shape (fp8_ws)
        // and, for the weight cache's two layouts, a weight in regions a and gt (checked).
        unsafe {
            match which {
                Fp8Casts::Forward => {
                    self.fp8_clear(slot(ScaleSlot::Input), 2)?;
                    self.fp8_quantize(xs)?;
                    self.fp8_quantize(ws_)
                }
                Fp8Casts::Backward => {
                    self.fp8_clear(slot(ScaleSlot::Input), 3)?;
                    self.fp8_quantize(gs)?;
                    self.fp8_quantize(wt)?;
                    self.fp8_quantize(xt)
                }
                Fp8Casts::ForwardCached => {
                    self.fp8_clear(slot(ScaleSlot::Input), 1)?;
                    self.fp8_quantize(xs)
                }
                Fp8Casts::BackwardCached => {
                    self.fp8_clear(slot(ScaleSlot::Grad), 1)?;
                    self.fp8_quantize(gs)?;
                    self.fp8_cast(xt)
                }
                Fp8Casts::WeightCache => {
                    self.fp8_clear(slot(ScaleSlot::Weight), 1)?;
                    self.fp8_quantize(both)
                }
            }
        }
    }
}

impl CudaBackend {
    /// `count` clears of layer 0's input sink (`prepare_fp8` first), each as a producer with
    /// a sink is preceded by: for `gpu-timing fp8`, what those 16-byte memsets cost (inside a
    /// CUDA graph, as a step runs them).
    pub fn fp8_sink_clears(&self, count: usize) -> BResult<()> {
        for _ in 0..count {
            self.fp8_sink(Some(AmaxSink::Input(0)))?;
        }
        Ok(())
    }

    /// The amax a producer left in `sink` (`prepare_fp8` first), read back: what
    /// `tests/gpu_kernels.rs` compares with the amax of the tensor the producer wrote.
    pub fn fp8_sink_amax(&self, sink: AmaxSink) -> BResult<f32> {
        let at = {
            let cell = self.fp8_ws.borrow();
            let Some(ws) = cell.as_ref() else { return Err(bad("fp8_sink_amax before prepare_fp8".into())) };
            ws.sink_offset(sink)?
        };
        self.fp8_slot_amax(at)
    }

    /// The amax in layer `layer`'s weight slot (`prepare_fp8` first), read back: what
    /// `tests/gpu_kernels.rs` compares with the amax of the weight an optimizer step wrote.
    pub fn fp8_weight_slot_amax(&self, layer: usize) -> BResult<f32> {
        let at = {
            let cell = self.fp8_ws.borrow();
            let Some(ws) = cell.as_ref() else { return Err(bad("fp8_weight_slot_amax before prepare_fp8".into())) };
            if layer >= ws.layout.layers {
                return Err(bad(format!("FP8 layer {layer}, but prepare_fp8 reserved {}", ws.layout.layers)));
            }
            ws.layout.layer_weight(layer)
        };
        self.fp8_slot_amax(at)
    }

    /// Layer `layer`'s cached weight as it stands (`prepare_fp8` first, the layer cached), read
    /// back: its codes in both layouts, its weight slot's inverse scale and amax, and whether
    /// they are the current parameter version's (made by a cast, or by the optimizer step
    /// that began it: `adamw.rs`). What `tests/gpu_kernels.rs` compares with a cast of the
    /// weight the step wrote.
    pub fn fp8_cached_weight_read(&self, layer: usize) -> BResult<CachedWeightRead> {
        let cell = self.fp8_ws.borrow();
        let Some(ws) = cell.as_ref() else { return Err(bad("fp8_cached_weight_read before prepare_fp8".into())) };
        let Some(cache) = ws.cache.as_ref().filter(|c| layer < c.weights.len()) else {
            return Err(bad(format!("FP8 layer {layer}'s weight is not cached")));
        };
        let (c, oc) = cache.weights[layer];
        let (rw, rwt) = cache.layout.regions[layer];
        let down = |at: usize, n: usize| {
            self.stream.clone_dtoh(&cache.buf.slice(at..at + n)).map_err(|e| self.err("reading cached FP8 codes", e))
        };
        let at = ws.layout.layer_weight(layer);
        let w = self.stream.clone_dtoh(&ws.buf.slice(at..at + 8)).map_err(|e| self.err("reading an FP8 slot", e))?;
        let word = |k: usize| f32::from_bits(u32::from_le_bytes([w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]]));
        Ok(CachedWeightRead {
            codes: down(rw, c * oc)?,
            codes_t: down(rwt, c * oc)?,
            inv_scale: word(0),
            amax: word(1),
            current: cache.made[layer] == Some(ws.version),
        })
    }

    /// The amax word of the slot at byte `slot` of the workspace, read back.
    fn fp8_slot_amax(&self, slot: usize) -> BResult<f32> {
        let cell = self.fp8_ws.borrow();
        let Some(ws) = cell.as_ref() else { return Err(bad("an FP8 slot read before prepare_fp8".into())) };
        let at = slot + 4;
        let words =
            self.stream.clone_dtoh(&ws.buf.slice(at..at + 4)).map_err(|e| self.err("reading an amax sink", e))?;
        Ok(f32::from_bits(u32::from_le_bytes([words[0], words[1], words[2], words[3]])))
    }
}

/// A cached FP8 weight read back (`CudaBackend::fp8_cached_weight_read`).
#[derive(Debug, Clone)]
pub struct CachedWeightRead {
    /// `[oc, c]` e4m3 codes, and `[c, oc]`.
    pub codes: Vec<u8>,
    pub codes_t: Vec<u8>,
    pub inv_scale: f32,
    pub amax: f32,
    /// Whether the codes are the current parameter version's.
    pub current: bool,
}

/// One tensor quantized by the kernels the FP8 GEMMs use, read back (`CudaBackend::fp8_cast_check`).
#[derive(Debug, Clone)]
pub struct Fp8Cast {
    /// The tensor's amax, as the amax kernel found it.
    pub amax: f32,
    /// The inverse scale the cast wrote for the GEMM (`1 / Fp8Format::scale(amax)`).
    pub inv_scale: f32,
    /// The codes, row-major as the input (`fp8_cast_bf16`).
    pub codes: Vec<u8>,
    /// The codes of the transposed tensor, `[cols, rows]` (`fp8_cast_transpose_bf16`).
    pub codes_t: Vec<u8>,
    /// The row-major codes the transposing cast wrote beside the transposed ones.
    pub codes_beside_t: Vec<u8>,
    /// The transposing cast's column sums, `[rows.div_ceil(COLSUM_ROWS), cols]`.
    pub col_sums: Vec<f32>,
}

impl CudaBackend {
    /// `rows × cols` bf16 of `x` from element `off`, quantized to `fmt` by the FP8 GEMMs'
    /// kernels (amax, then each cast), and read back: what `tests/gpu_kernels.rs` checks
    /// against `backend/fp8.rs`. `rows` and `cols` multiples of 16 (the transposing cast's
    /// requirement). Allocates its own buffers: for checks, not for the training path.
    pub fn fp8_cast_check(
        &self,
        x: &CudaSlice<half::bf16>,
        off: usize,
        rows: usize,
        cols: usize,
        fmt: Fp8Format,
    ) -> BResult<Fp8Cast> {
        let n = rows * cols;
        super::launch::check("fp8_cast_check x", x.len(), off, n)?;
        if !(rows.is_multiple_of(16) && cols.is_multiple_of(16)) {
            return Err(bad(format!("fp8_cast_check: {rows} × {cols} is not a multiple of 16 both ways")));
        }
        let mut slot = self.alloc::<u32>(4, "FP8 check slot")?;
        let mut sums = self.alloc::<f32>(rows.div_ceil(COLSUM_ROWS) * cols, "FP8 check column sums")?;
        let sums_p = self.ptr_mut(&mut sums, 0);
        let (mut q, mut qt, mut q2) =
            (self.alloc::<u8>(n, "FP8 check")?, self.alloc::<u8>(n, "FP8 check")?, self.alloc::<u8>(n, "FP8 check")?);
        let xp = self.ptr(x, off);
        let (sp, qp, qtp, q2p) =
            (self.ptr_mut(&mut slot, 0), self.ptr_mut(&mut q, 0), self.ptr_mut(&mut qt, 0), self.ptr_mut(&mut q2, 0));
        // SAFETY: x holds n bf16 from off (checked); q, qt, q2 n bytes each (256-byte
        // aligned allocations); the slot two zeroed words; sums a float per column and tile.
        unsafe {
            let c = Cast {
                x: xp,
                rows,
                cols,
                fmt,
                slot: sp,
                dst: Some(qp),
                dst_t: None,
                op: CastOp::None,
                norm: None,
                predicted: None,
            };
            self.fp8_quantize(c)?;
            let r = cudarc::driver::result::memset_d8_async(sp + 4, 0, 4, self.stream.cu_stream());
            r.map_err(|e| self.err("zeroing the check slot", e))?;
            let ct = Cast { dst: Some(q2p), dst_t: Some(qtp), ..c };
            self.fp8_amax(ct.x, n, ct.slot)?;
            self.fp8_cast_colsum(ct, sums_p)?;
        }
        let down = |b: &CudaSlice<u8>| self.stream.clone_dtoh(b).map_err(|e| self.err("reading FP8 codes", e));
        let words = self.stream.clone_dtoh(&slot).map_err(|e| self.err("reading the FP8 slot", e))?;
        Ok(Fp8Cast {
            amax: f32::from_bits(words[1]),
            inv_scale: f32::from_bits(words[0]),
            codes: down(&q)?,
            codes_t: down(&qt)?,
            codes_beside_t: down(&q2)?,
            col_sums: self.stream.clone_dtoh(&sums).map_err(|e| self.err("reading the column sums", e))?,
        })
    }

    /// `rows × cols` bf16 of `x` (from element 0) quantized to `fmt` by one transposing cast
    /// that predicts its scale (`Cast::predicted`: the predicted pass, then its check) as
    /// `prediction` says, of what `made` says (x itself, GELU of x, or GELU'(pre)·x), with
    /// column sums, and read back: the amax it found, the inverse scale, both layouts' codes
    /// (`codes_beside_t`, `codes_t`; `codes` empty) and the sums, then the prediction's four
    /// words after (the amax found, right count, wrong count, the reference's amax). What
    /// `tests/gpu_kernels.rs` compares with the GPU's own composition (the op writing the
    /// tensor, then the cast of its amax). Allocates its own buffers: for checks.
    pub fn fp8_predicted_cast_check(
        &self,
        x: &CudaSlice<half::bf16>,
        made: PredictedInput<'_>,
        (rows, cols): (usize, usize),
        fmt: Fp8Format,
        prediction: CheckedPrediction,
    ) -> BResult<(Fp8Cast, [u32; 4])> {
        let n = rows * cols;
        super::launch::check("fp8_predicted_cast_check x", x.len(), 0, n)?;
        if !(rows.is_multiple_of(16) && cols.is_multiple_of(16)) {
            return Err(bad(format!("fp8_predicted_cast_check: {rows} × {cols} is not a multiple of 16 both ways")));
        }
        let op = match made {
            PredictedInput::Plain => CastOp::None,
            PredictedInput::Gelu => CastOp::Gelu,
            PredictedInput::Dgelu(pre) => {
                super::launch::check("fp8_predicted_cast_check pre", pre.len(), 0, n)?;
                CastOp::Dgelu { pre: self.ptr(pre, 0) }
            }
        };
        let mut slot = self.alloc::<u32>(4, "FP8 check slot")?;
        let mut pred = self.alloc::<u32>(4, "FP8 check prediction")?;
        let mut ref_slot = self.alloc::<u32>(1, "FP8 check reference")?;
        let reference = match prediction.ref_now {
            Some(a) => {
                self.stream
                    .memcpy_htod(&[a.to_bits()], &mut ref_slot)
                    .map_err(|e| self.err("writing the reference amax", e))?;
                self.ptr_mut(&mut ref_slot, 0)
            }
            None => 0,
        };
        self.stream
            .memcpy_htod(&[prediction.last_amax.to_bits(), 0, 0, prediction.last_ref.to_bits()], &mut pred)
            .map_err(|e| self.err("writing the prediction", e))?;
        let mut sums = self.alloc::<f32>(rows.div_ceil(COLSUM_ROWS) * cols, "FP8 check column sums")?;
        let (mut q, mut qt) = (self.alloc::<u8>(n, "FP8 check")?, self.alloc::<u8>(n, "FP8 check")?);
        let c = Cast {
            x: self.ptr(x, 0),
            rows,
            cols,
            fmt,
            slot: self.ptr_mut(&mut slot, 0),
            dst: Some(self.ptr_mut(&mut q, 0)),
            dst_t: Some(self.ptr_mut(&mut qt, 0)),
            op,
            norm: None,
            predicted: Some(Prediction { at: self.ptr_mut(&mut pred, 0), reference }),
        };
        // SAFETY: x (and pre) hold n bf16 (checked); q and qt n bytes each (256-byte aligned
        // allocations); the slot and the prediction four zeroed or written words; sums a
        // float per column and tile.
        unsafe { self.fp8_cast_colsum(c, self.ptr_mut(&mut sums, 0))? };
        let down = |b: &CudaSlice<u8>| self.stream.clone_dtoh(b).map_err(|e| self.err("reading FP8 codes", e));
        let words = self.stream.clone_dtoh(&slot).map_err(|e| self.err("reading the FP8 slot", e))?;
        let after = self.stream.clone_dtoh(&pred).map_err(|e| self.err("reading the prediction", e))?;
        let cast = Fp8Cast {
            amax: f32::from_bits(words[1]),
            inv_scale: f32::from_bits(words[0]),
            codes: Vec::new(),
            codes_t: down(&qt)?,
            codes_beside_t: down(&q)?,
            col_sums: self.stream.clone_dtoh(&sums).map_err(|e| self.err("reading the column sums", e))?,
        };
        Ok((cast, [after[0], after[1], after[2], after[3]]))
    }
}

/// The prediction a predicted cast checked by [`CudaBackend::fp8_predicted_cast_check`]
/// starts from: the tensor's amax the last time (0: none), and where it scales with a
/// reference, the reference's amax then and now.
#[derive(Debug, Clone, Copy)]
pub struct CheckedPrediction {
    pub last_amax: f32,
    pub last_ref: f32,
    pub ref_now: Option<f32>,
}

/// What a predicted cast checked by [`CudaBackend::fp8_predicted_cast_check`] casts.
#[derive(Debug, Clone, Copy)]
pub enum PredictedInput<'a> {
    /// The tensor read.
    Plain,
    /// GELU of it (a pre-activation).
    Gelu,
    /// GELU'(pre)·it (the gradient of GELU's output), with the pre-activation.
    Dgelu(&'a CudaSlice<half::bf16>),
}
