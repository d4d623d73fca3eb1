//! Linear layers: `out = inp · Wᵀ + bias` and its backward, plus the MLP's fused GELU
//! variants. The fusions are hooks whose default is the composition of plain ops (the CPU
//! reference runs that); a backend overrides a hook where it has a fused kernel for the
//! shapes (CUDA: GELU in the cuBLASLt epilogue) and answers `Ok(false)` otherwise.
//!
//! Each layer says the precision of its GEMMs ([`LinearLocs::precision`]): bf16, or FP8
//! (`train.precision = "fp8"`, numerics in `fp8.rs`), for which a backend first reserves its
//! operands ([`MatmulOps::prepare_fp8`]) and which a device without FP8 GEMMs refuses
//! ([`MatmulOps::fp8_support`]). A model's FP8 layers also carry an [`Fp8Layer`]: their
//! state between ops (the input's scale from forward to backward, the weight cast once per
//! parameter version, which [`MatmulOps::fp8_weights_changed`] ends).

use super::fp8::{AmaxSink, Fp8Bytes, Fp8Layer, Fp8Layers};
use super::gemm_tuning::{GemmEnvironment, GemmTuningTable, OnMismatch};
use super::{ActivationOps, BResult, Device, Loc, MatShape, MemoryOps, WeightGrads, Weights};

/// How a backend with a choice of GEMM algorithms picks one for each GEMM shape
/// (`train.gemm_tuning`). The CPU reference has one way to multiply and nothing to pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GemmTuning {
    /// cuBLASLt's heuristic's first choice: the same algorithm, so the same bits, on every run.
    Heuristic,
    /// At each shape's first call, time the heuristic's first candidates on the call itself
    /// (the call runs the heuristic's); the trainer then makes rank 0's picks every rank's
    /// ([`MatmulOps::use_gemm_choices`]) and stores them with the run (`gemm_tuning.rs`), so a
    /// rerun or resume given them runs the same algorithms and gets the same bits. Faster
    /// where the heuristic misjudges (it often does at GPT-2 shapes); two runs that both
    /// time may pick differently where candidates are within the timing noise.
    #[default]
    Timed,
    /// `Timed`, over a wider choice: beside the heuristic's first candidates, every tile,
    /// thread-block cluster shape, kernel option and CTA swizzle cuBLASLt accepts for the
    /// heuristic's algorithms (as many as a time budget per shape allows), each checked
    /// against the heuristic's result before it may be picked. The heuristic offers few
    /// FP8 configurations and misjudges some fused epilogues. The first step takes longer;
    /// picks are shared, stored and reused as with `Timed`.
    Searched,
}

impl GemmTuning {
    /// Whether GEMMs are timed in the first step (and the picks shared and stored).
    pub fn times(self) -> bool {
        self != GemmTuning::Heuristic
    }
}

/// The precision a linear layer's GEMMs run in (`train.precision`). Only the operands
/// change: accumulation is fp32, outputs, master weights, gradients and every other op keep
/// their precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// The compute precision of the backend's buffers: bf16 on CUDA, f32 on the CPU.
    #[default]
    Bf16,
    /// FP8 operands with per-tensor current scaling (`backend/fp8.rs`): e4m3 weights and
    /// activations, e5m2 output gradients; on CUDA, cuBLASLt's FP8 GEMMs (compute
    /// capability 9.0 and later), on the CPU the same rounding simulated in f32. Shapes that
    /// are not multiples of 16 (`fp8::eligible`) run in [`Precision::Bf16`].
    Fp8,
}

/// A linear layer as its ops see it: its weight `[oc, c]` and optional bias `[oc]` in a
/// flat buffer, the precision its GEMMs run in, and in FP8 its persistent state. Layouts
/// make every layer [`Precision::Bf16`] ([`LinearLocs::new`]); a model turns its blocks'
/// layers to `train.precision`, gives each its [`Fp8Layer`], and leaves the LM head in bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearLocs {
    pub w: Loc,
    pub b: Option<Loc>,
    pub precision: Precision,
    /// Where an FP8 layer keeps its input scale and cached weight (`None`: every operand
    /// quantized at every use).
    pub fp8: Option<Fp8Layer>,
}

impl LinearLocs {
    /// A layer at `w` (and `b`), in bf16.
    pub const fn new(w: Loc, b: Option<Loc>) -> LinearLocs {
        LinearLocs { w, b, precision: Precision::Bf16, fp8: None }
    }

    /// The same layer in precision `p`.
    pub const fn with_precision(self, p: Precision) -> LinearLocs {
        LinearLocs { precision: p, ..self }
    }

    /// The same layer with FP8 state `index` (of those `prepare_fp8` reserved), where it is
    /// in FP8.
    pub const fn with_fp8_index(self, index: usize) -> LinearLocs {
        let fp8 = match self.precision {
            Precision::Fp8 => Some(Fp8Layer::new(index)),
            Precision::Bf16 => None,
        };
        LinearLocs { fp8, ..self }
    }

    /// The same layer, its forward keeping its input's FP8 codes for its backward where
    /// `keep` and it has FP8 state ([`Fp8Layer::keeps_input`]; the model says so only for
    /// layers [`Fp8Layers::kept_inputs`] reserved).
    pub fn with_kept_input(self, keep: bool) -> LinearLocs {
        let fp8 = self.fp8.map(|f| Fp8Layer { keeps_input: keep, ..f });
        LinearLocs { fp8, ..self }
    }

    /// Whether the forward keeps this layer's input codes at shape `s` for its backward.
    pub fn keeps_input(&self, s: MatShape) -> bool {
        self.fp8(s) && self.fp8.is_some_and(|f| f.keeps_input)
    }

    /// `Ok` where a backward at shape `s` may run without the layer's input
    /// ([`MatmulOps::matmul_bwd_kept`]): it keeps its input's codes; else the model bug, named.
    pub fn check_kept_input(&self, s: MatShape) -> BResult<()> {
        if self.keeps_input(s) {
            return Ok(());
        }
        Err(super::BackendError::Device(format!(
            "a linear backward without its input, but its layer ({:?}) keeps no FP8 input (a model bug)",
            self.fp8.map(|f| f.index)
        )))
    }

    /// `Ok` where the layer at shape `s` may have its input made by the cast that quantizes it
    /// (GELU of fc's pre-activation: [`MatmulOps::matmul_residual_fwd_of_gelu`]; a norm of the
    /// norm's input: [`MatmulOps::matmul_fwd_of_norm`]): it keeps its input's codes (the amax of the
    /// input so made may have been left for it, or the op finds it: CUDA predicts the scale);
    /// else the model bug, named after `what`.
    pub fn check_input_made_in_cast(&self, s: MatShape, what: InputMadeInCast) -> BResult<()> {
        if self.keeps_input(s) {
            return Ok(());
        }
        let (of, from) = match what {
            InputMadeInCast::Gelu => ("GELU's output", "its pre-activation"),
            InputMadeInCast::Norm => ("the norm's output", "the norm's input"),
        };
        Err(super::BackendError::Device(format!(
            "an FP8 GEMM of {of} from {from}, but layer {:?} does not keep its input's codes (a model bug)",
            self.fp8.map(|f| f.index)
        )))
    }

    /// The same layer for a backward whose input the model made again otherwise than the
    /// forward did (see [`Fp8Layer::input_from_forward`]).
    pub fn input_recomputed(self) -> LinearLocs {
        let fp8 = self.fp8.map(|f| Fp8Layer { input_from_forward: false, ..f });
        LinearLocs { fp8, ..self }
    }

    /// Whether a GEMM of shape `s` of this layer runs in FP8.
    pub fn fp8(&self, s: MatShape) -> bool {
        self.precision == Precision::Fp8 && super::fp8::eligible(s)
    }

    /// Where the op writing this layer's forward input at shape `s` can leave its amax:
    /// where the layer runs in FP8 with state of its own (else `None`, and nothing to leave).
    pub fn input_sink(&self, s: MatShape) -> Option<AmaxSink> {
        self.fp8.filter(|_| self.fp8(s)).map(|l| AmaxSink::Input(l.index))
    }

    /// Where the op writing this layer's backward output gradient at shape `s` can leave
    /// its amax (as [`LinearLocs::input_sink`]).
    pub fn grad_sink(&self, s: MatShape) -> Option<AmaxSink> {
        self.fp8.filter(|_| self.fp8(s)).map(|l| AmaxSink::Grad(l.index))
    }

    /// The same layer, its forward input's amax left by its producer where `sink` is set
    /// (what [`LinearLocs::input_sink`] gave the producer).
    pub fn input_amax_from(self, sink: Option<AmaxSink>) -> LinearLocs {
        let fp8 = self.fp8.map(|f| Fp8Layer { input_amax_ready: sink.is_some(), ..f });
        LinearLocs { fp8, ..self }
    }

    /// The same layer, its output gradient's amax left by its producer where `sink` is set.
    pub fn grad_amax_from(self, sink: Option<AmaxSink>) -> LinearLocs {
        let fp8 = self.fp8.map(|f| Fp8Layer { grad_amax_ready: sink.is_some(), ..f });
        LinearLocs { fp8, ..self }
    }
}

/// How often FP8 casts predicted their scale right and wrong ([`MatmulOps::fp8_prediction_counts`]):
/// `(right, wrong)` for the layers' inputs' casts, for their output gradients', and for the
/// cached weights' codes the optimizer step wrote (`Fp8Layers::step_codes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fp8Predictions {
    pub inputs: (u64, u64),
    pub grads: (u64, u64),
    pub weights: (u64, u64),
}

/// One GEMM shape as timed tuning measured it (`MatmulOps::gemm_tuning_report`).
#[derive(Debug, Clone, PartialEq)]
pub struct TunedGemm {
    /// Its shape, transposes, output type and epilogue.
    pub gemm: String,
    /// Candidates timed (the heuristic's first ones, in its order).
    pub candidates: usize,
    /// `GemmTuning::Searched`: configurations found near them and timed briefly (the
    /// fastest few then as the candidates, numbered after them).
    pub searched: usize,
    /// Whether the fastest found configuration's output disagreed with the heuristic's
    /// (so it was not picked).
    pub disagreed: bool,
    /// The one picked (0 = the heuristic's first; `candidates` and on: found ones).
    pub chosen: usize,
    /// Mean ms of one call with the heuristic's first, and with the one kept.
    pub heuristic_ms: f64,
    pub chosen_ms: f64,
    /// Wall seconds this shape's timing took.
    pub seconds: f64,
}

/// What an FP8 layer's input cast makes of what it reads
/// ([`LinearLocs::check_input_made_in_cast`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputMadeInCast {
    /// GELU of the MLP's pre-activation (GPT-2's fc2).
    Gelu,
    /// A norm's output from the norm's input (qkv, GPT-2's fc, Llama's gate/up).
    Norm,
}

/// A norm's output as a linear layer's input, given as the norm's input and the statistics
/// [`LayerNormOps::layernorm_stats`](super::LayerNormOps::layernorm_stats) or
/// [`LayerNormOps::rmsnorm_stats`](super::LayerNormOps::rmsnorm_stats) saved
/// ([`MatmulOps::matmul_fwd_of_norm`]); the norm's parameters are in the linear layer's
/// parameter buffer.
pub enum NormOfInput<'a, B: Device + ?Sized> {
    /// `(x − mean)·rstd·w + b` per row (GPT-2).
    LayerNorm { mean: &'a B::F32, rstd: &'a B::F32, at: super::NormLocs },
    /// `x·rstd·w` per row, `rstd = 1/sqrt(mean(x²) + eps)` (Llama).
    RmsNorm { rstd: &'a B::F32, w: Loc, eps: f32 },
}

impl<B: Device + ?Sized> NormOfInput<'_, B> {
    /// The rows' `rstd`.
    pub fn rstd(&self) -> &B::F32 {
        match self {
            NormOfInput::LayerNorm { rstd, .. } | NormOfInput::RmsNorm { rstd, .. } => rstd,
        }
    }
    /// The norm's weight.
    pub fn weight(&self) -> Loc {
        match self {
            NormOfInput::LayerNorm { at, .. } => at.w,
            NormOfInput::RmsNorm { w, .. } => *w,
        }
    }
}

/// The input of a linear layer that follows a GELU: `act = GELU(pre)`, with `pre` kept
/// from the forward. Both are only read. `act` is `None` where the layer kept its input's
/// FP8 codes from the forward ([`LinearLocs::keeps_input`]), which its weight gradient reads
/// instead. `dpre_amax`: where the backward leaves the amax of the `dpre` it writes, for the
/// FP8 layer before the GELU.
pub struct GeluInput<'a, B: Device + ?Sized> {
    pub act: Option<&'a B::Buf>,
    pub pre: &'a B::Buf,
    pub dpre_amax: Option<AmaxSink>,
}

/// Both halves of a GELU a fused backward reads ([`MatmulOps::fused_matmul_bwd_dgelu`]): its
/// output `act` (the layer's input) and its input `pre`.
pub struct GeluActs<'a, B: Device + ?Sized> {
    pub act: &'a B::Buf,
    pub pre: &'a B::Buf,
}

impl<B: Device + ?Sized, L: Copy> WeightGrads<'_, B, L> {
    /// The same destination, borrowed again (to try a fused op, then fall back).
    pub fn reborrow(&mut self) -> WeightGrads<'_, B, L> {
        WeightGrads { buf: &mut *self.buf, at: self.at, fresh: self.fresh }
    }
}

pub trait MatmulOps: ActivationOps + MemoryOps {
    /// How GEMM algorithms are picked from here on (shapes already run keep theirs).
    /// A backend with one way to multiply (the CPU) has nothing to pick.
    fn set_gemm_tuning(&self, _tuning: GemmTuning) {}
    /// What timed tuning picked so far, one line per GEMM shape; empty where nothing was
    /// timed.
    fn gemm_tuning_report(&self) -> Vec<TunedGemm> {
        Vec::new()
    }
    /// The fused GEMMs (bias and GELU, residual, GELU' epilogues) that ran as their GEMM and
    /// a separate kernel so far because the library had no algorithm for the epilogue at
    /// that shape and precision, one line each; empty where every fused op ran fused (the
    /// CPU has no fused GEMMs to miss).
    fn unfused_gemms(&self) -> Vec<String> {
        Vec::new()
    }
    /// The device and library GEMM algorithms are picked for; `None` where there is no
    /// choice (the CPU).
    fn gemm_environment(&self) -> Option<GemmEnvironment> {
        None
    }
    /// What timed tuning picked so far, as a table to share and store (the picks are not in
    /// use until [`MatmulOps::use_gemm_choices`] is given them); `None` without a choice.
    fn gemm_choices(&self) -> Option<GemmTuningTable> {
        None
    }
    /// From here on run each GEMM shape the table holds with its stored algorithm (shapes
    /// already planned switch at once; others when first run), without timing. A table of
    /// another environment, or an algorithm cuBLASLt no longer offers, is refused or set
    /// aside as `on` says (`origin` names the table in messages). Returns how many stored
    /// algorithms are in use. The caller checks the environment first
    /// ([`GemmTuningTable::fits`]); a backend without a choice uses none.
    fn use_gemm_choices(&self, _table: &GemmTuningTable, _origin: &str, _on: OnMismatch) -> BResult<usize> {
        Ok(0)
    }

    /// Get ready for FP8 GEMMs (layers in [`Precision::Fp8`]) of `layers`: refuse where
    /// the device has none (CUDA below compute capability 9.0, with its name and capability),
    /// and reserve the operand workspace sized for the largest layer, each [`Fp8Layer`]'s
    /// scales and, for the first `layers.cached_layers`, its cached weight (`fp8::CudaFp8Workspace`,
    /// `fp8::CudaFp8WeightCache`; the CPU: `fp8::cpu_reserved`). Returns the bytes reserved
    /// in all, which the caller counts in its ledger. A later call replaces the layers'
    /// state (every cached weight is cast again at its next use) and grows the operand
    /// workspace where needed. The default: nothing to reserve.
    fn prepare_fp8(&self, _layers: &Fp8Layers) -> BResult<Fp8Bytes> {
        Ok(Fp8Bytes::default())
    }

    /// The compute parameters may have changed (an optimizer step, a load): a new parameter
    /// version, in which every cached FP8 weight is cast again at its next use and every
    /// weight's amax is found again, but where `by_step`: the last write of the parameters
    /// was the optimizer step whose AdamW left the amax of the weights it wrote whole
    /// ([`AdamWSegment::fp8_layer`](super::AdamWSegment::fp8_layer)), and those layers
    /// use it (no amax pass of their own). Without `by_step` what any step left is
    /// dropped: something else wrote the parameters after it (a load, a gather). The
    /// schedule calls it before the first forward after a change (`model::run_micro`); a
    /// CUDA graph recorded there records the casts with it. The default (no FP8 state):
    /// nothing to do.
    fn fp8_weights_changed(&self, _by_step: bool) {}

    /// The amax sinks of FP8 layers `layers` (their input's and output gradient's slots,
    /// [`AmaxSink`]) are zeroed now, together, for the producers of this forward and the
    /// backward after it, which then zero nothing of their own (each sink still zeroed
    /// once before each producer's write: one that writes again finds it written and zeroes
    /// it first). The model calls it at the start of a block's forward (not a recompute:
    /// the output gradients' sinks may hold amaxes by then). The default (no FP8 slots, or
    /// a backend whose producers need no zeroing): nothing.
    fn fp8_clear_sinks(&self, _layers: std::ops::Range<usize>) -> BResult<()> {
        Ok(())
    }

    /// The amax of the first `n` values of `x` into `sink`, as a pass of its own: for a
    /// producer that could not fuse it (a cuBLASLt epilogue), so the consumer finds it there.
    fn fp8_amax_into(&self, x: &Self::Buf, n: usize, sink: AmaxSink) -> BResult<()>;

    /// How often the FP8 casts that predict their scale (GPT-2's GELU casts, the casts that
    /// apply a norm) predicted it right and wrong so far, over every layer; `None`
    /// where no cast predicts (the CPU: its casts find every amax first).
    fn fp8_prediction_counts(&self) -> BResult<Option<Fp8Predictions>> {
        Ok(None)
    }

    /// Why this device cannot run FP8 GEMMs (naming it), or `Ok` where it can. Asked before
    /// training starts, so `train.precision = "fp8"` on an older GPU is a config error.
    fn fp8_support(&self) -> Result<(), String> {
        Ok(())
    }

    /// `out[N,OC] = inp[N,C] · W[OC,C]ᵀ (+ bias)`.
    fn matmul_fwd(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()>;
    /// `dinp = dout · W` (overwritten), `dW += doutᵀ · inp`, `dbias += Σ dout`.
    fn matmul_bwd(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, LinearLocs>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()>;

    /// [`MatmulOps::matmul_bwd`] of an FP8 layer whose forward kept its input's codes
    /// ([`LinearLocs::keeps_input`]): `dW` reads those, so the input is not needed. A layer
    /// that kept none is a model bug, and an error; the default (a backend that keeps no
    /// inputs) says so.
    fn matmul_bwd_kept(
        &self,
        _dinp: &mut Self::Buf,
        _g: WeightGrads<'_, Self, LinearLocs>,
        _dout: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        _s: MatShape,
    ) -> BResult<()> {
        Err(super::BackendError::Device(format!(
            "a linear backward without its input (layer {:?}), but this backend keeps no FP8 inputs (a bug)",
            p.at.fp8.map(|f| f.index)
        )))
    }

    /// The MLP's first layer: `pre = inp · Wᵀ + bias` and `out = GELU(pre)`, both written
    /// (`pre` is saved for backward, `out` feeds the next layer, whose FP8 GEMM finds the
    /// amax of `out` in `out_amax` where set).
    fn matmul_gelu_fwd(
        &self,
        pre: &mut Self::Buf,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
        out_amax: Option<AmaxSink>,
    ) -> BResult<()> {
        if self.fused_matmul_gelu_fwd(pre, out, inp, p, s)? {
            // GELU ran in the GEMM's epilogue, which cannot leave an amax: a pass of its own.
            if let Some(sink) = out_amax {
                self.fp8_amax_into(out, s.n * s.oc, sink)?;
            }
            return Ok(());
        }
        self.matmul_fwd(pre, inp, p, s)?;
        self.gelu_fwd(out, pre, s.n * s.oc, out_amax)
    }
    /// [`MatmulOps::matmul_gelu_fwd`] as one fused operation where the backend has one for
    /// these shapes; `Ok(false)` (the default) runs the two operations instead.
    fn fused_matmul_gelu_fwd(
        &self,
        _pre: &mut Self::Buf,
        _out: &mut Self::Buf,
        _inp: &Self::Buf,
        _p: Weights<'_, Self, LinearLocs>,
        _s: MatShape,
    ) -> BResult<bool> {
        Ok(false)
    }

    /// A linear layer whose output joins the residual stream: `out = res + inp · Wᵀ + bias`
    /// (`tmp`, n·oc, is scratch for backends that run it as two operations).
    fn matmul_residual_fwd(
        &self,
        out: &mut Self::Buf,
        res: &Self::Buf,
        inp: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
        tmp: &mut Self::Buf,
    ) -> BResult<()> {
        if self.fused_matmul_residual_fwd(out, res, inp, p, s)? {
            return Ok(());
        }
        self.matmul_fwd(tmp, inp, p, s)?;
        self.residual_fwd(out, res, tmp, s.n * s.oc)
    }
    /// The MLP's output layer from its first layer's pre-activation, in FP8:
    /// `out = res + GELU(pre) · Wᵀ + bias`, GELU applied by the cast that quantizes the
    /// layer's input as it reads `pre`, so GELU's output is never written (`tmp`, n·oc, is
    /// scratch where the residual cannot be fused). Only for a layer that keeps its input's
    /// codes ([`LinearLocs::keeps_input`]). Where GELU's amax was left (into
    /// [`LinearLocs::input_sink`]) the cast uses it; otherwise the op finds it (CUDA: the cast predicts its scale, see `cuda/fp8/`): the
    /// same bits. Otherwise, and on a backend without it (the default), an error: the model
    /// composes `gelu_fwd` and [`MatmulOps::matmul_residual_fwd`] instead.
    fn matmul_residual_fwd_of_gelu(
        &self,
        _out: &mut Self::Buf,
        _res: &Self::Buf,
        _pre: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        _s: MatShape,
        _tmp: &mut Self::Buf,
    ) -> BResult<()> {
        Err(super::BackendError::Device(format!(
            "an FP8 GEMM of GELU's output from its pre-activation (layer {:?}), which this backend does not run (a \
             bug)",
            p.at.fp8.map(|f| f.index)
        )))
    }

    /// A linear layer of a norm's output, in FP8: `out = norm(x) · Wᵀ + bias`, the norm
    /// applied by the cast that quantizes the layer's input as it reads `x`, with the
    /// statistics the norm's `*_stats` left and, where it left it too (into
    /// [`LinearLocs::input_sink`]: `input_amax_ready`), the output's amax, which otherwise the
    /// op finds (CUDA: the cast predicts its scale), so the norm's output is never written. The same bits as
    /// the norm's forward then [`MatmulOps::matmul_fwd`]. Only for a layer that keeps its
    /// input's codes ([`LinearLocs::check_input_made_in_cast`]); otherwise, and on a backend
    /// without it (the default), an error: the model composes the two instead.
    fn matmul_fwd_of_norm(
        &self,
        _out: &mut Self::Buf,
        _x: &Self::Buf,
        _norm: NormOfInput<'_, Self>,
        p: Weights<'_, Self, LinearLocs>,
        _s: MatShape,
    ) -> BResult<()> {
        Err(super::BackendError::Device(format!(
            "an FP8 GEMM of a norm's output from the norm's input (layer {:?}), which this backend does not run (a \
             bug)",
            p.at.fp8.map(|f| f.index)
        )))
    }

    /// [`MatmulOps::matmul_residual_fwd`] as one operation (the residual added in the GEMM's
    /// epilogue) where the backend has one for these shapes; `Ok(false)` (the default) runs
    /// the GEMM and the residual add instead.
    fn fused_matmul_residual_fwd(
        &self,
        _out: &mut Self::Buf,
        _res: &Self::Buf,
        _inp: &Self::Buf,
        _p: Weights<'_, Self, LinearLocs>,
        _s: MatShape,
    ) -> BResult<bool> {
        Ok(false)
    }

    /// Backward of a linear layer whose input is `act = GELU(pre)`, through the GELU:
    /// `dpre = (dout · W) ⊙ GELU'(pre)` (overwritten), `dW += doutᵀ · act`, `dbias += Σ dout`.
    fn matmul_bwd_dgelu(
        &self,
        dpre: &mut Self::Buf,
        mut g: WeightGrads<'_, Self, LinearLocs>,
        dout: &Self::Buf,
        x: GeluInput<'_, Self>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let Some(act) = x.act else {
            // The layer kept its input's FP8 codes: no fused variant reads those.
            self.matmul_bwd_kept(dpre, g, dout, p, s)?;
            return self.gelu_bwd(dpre, x.pre, s.n * s.c, x.dpre_amax);
        };
        if self.fused_matmul_bwd_dgelu(dpre, g.reborrow(), dout, GeluActs { act, pre: x.pre }, p, s)? {
            // GELU' ran in the GEMM's epilogue, which cannot leave an amax: a pass of its own.
            if let Some(sink) = x.dpre_amax {
                self.fp8_amax_into(dpre, s.n * s.c, sink)?;
            }
            return Ok(());
        }
        self.matmul_bwd(dpre, g, dout, act, p, s)?;
        self.gelu_bwd(dpre, x.pre, s.n * s.c, x.dpre_amax)
    }
    /// Backward of the MLP's first layer from the gradient of GELU's output `dact` (what the
    /// output layer's plain backward wrote) and the pre-activation `pre` this layer's forward
    /// wrote: `dpre = dact ⊙ GELU'(pre)`, then this layer's backward with `dout = dpre`
    /// (its input `inp`, or `None` where it kept its input's codes). `dact` may be
    /// overwritten. The default writes `dpre` over `dact` with `gelu_bwd` (its amax into the
    /// layer's [`LinearLocs::grad_sink`]) and runs the backward: [`dgelu_then_bwd`]. CUDA, for
    /// an FP8 layer, makes `dpre` in dY's transposing cast instead, with a predicted scale, so
    /// `dpre` is never written: the same bits.
    fn matmul_bwd_of_dgelu(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, LinearLocs>,
        dact: &mut Self::Buf,
        x: DgeluOf<'_, Self>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        dgelu_then_bwd(self, dinp, g, dact, x, p, s)
    }

    /// [`MatmulOps::matmul_bwd_dgelu`] as one fused operation where the backend has one for
    /// these shapes; `Ok(false)` (the default) runs matmul_bwd and gelu_bwd instead.
    fn fused_matmul_bwd_dgelu(
        &self,
        _dpre: &mut Self::Buf,
        _g: WeightGrads<'_, Self, LinearLocs>,
        _dout: &Self::Buf,
        _x: GeluActs<'_, Self>,
        _p: Weights<'_, Self, LinearLocs>,
        _s: MatShape,
    ) -> BResult<bool> {
        Ok(false)
    }
}

/// What [`MatmulOps::matmul_bwd_of_dgelu`] reads besides GELU's output gradient: the
/// pre-activation, the layer's input (`None` where it kept its input's codes), and where an
/// amax of this step lies that the gradient's scales with (`scale_ref`: the output layer's
/// output gradient's sink; a backend that predicts the gradient's scale predicts it from
/// how that one moved, and never reads it otherwise).
pub struct DgeluOf<'a, B: Device + ?Sized> {
    pub pre: &'a B::Buf,
    pub inp: Option<&'a B::Buf>,
    pub scale_ref: Option<AmaxSink>,
}

/// [`MatmulOps::matmul_bwd_of_dgelu`] composed: `gelu_bwd` over `dact` (leaving its amax for
/// the layer's backward where the layer has a sink), then `matmul_bwd` (or, without an
/// input, `matmul_bwd_kept`).
pub fn dgelu_then_bwd<B: MatmulOps + ?Sized>(
    be: &B,
    dinp: &mut B::Buf,
    g: WeightGrads<'_, B, LinearLocs>,
    dact: &mut B::Buf,
    x: DgeluOf<'_, B>,
    p: Weights<'_, B, LinearLocs>,
    s: MatShape,
) -> BResult<()> {
    let sink = p.at.grad_sink(s);
    be.gelu_bwd(dact, x.pre, s.n * s.oc, sink)?;
    matmul_bwd_or_kept(be, dinp, g, dact, x.inp, Weights::new(p.buf, p.at.grad_amax_from(sink)), s)
}

/// [`MatmulOps::matmul_bwd`] given the layer's input, or without it (`None`: the layer kept
/// its input's FP8 codes) [`MatmulOps::matmul_bwd_kept`].
pub fn matmul_bwd_or_kept<B: MatmulOps + ?Sized>(
    be: &B,
    dinp: &mut B::Buf,
    g: WeightGrads<'_, B, LinearLocs>,
    dout: &B::Buf,
    inp: Option<&B::Buf>,
    p: Weights<'_, B, LinearLocs>,
    s: MatShape,
) -> BResult<()> {
    match inp {
        Some(inp) => be.matmul_bwd(dinp, g, dout, inp, p, s),
        None => be.matmul_bwd_kept(dinp, g, dout, p, s),
    }
}

/// What [`dswiglu_then_bwd`] reads besides SwiGLU's output gradient: SwiGLU's input
/// (`[n, 2F]`, rows `[gate | up]`), the layer's input (`None` where it kept its input's
/// codes), and where it writes dY (`[n, 2F]`).
pub struct DswigluOf<'a, B: Device + ?Sized> {
    pub gate_up: &'a B::Buf,
    pub inp: Option<&'a B::Buf>,
    pub dy: &'a mut B::Buf,
}

/// Backward of Llama's gate/up layer from the gradient of SwiGLU's output `dact` (what
/// down's backward wrote) and SwiGLU's input `x.gate_up` (this layer's output):
/// `swiglu_bwd` writes `dY = [dgate | dup]` into `x.dy` (leaving its amax for the layer's
/// backward where the layer has a sink), then `matmul_bwd` (or, without an input,
/// `matmul_bwd_kept`) with `dout = dY`.
pub fn dswiglu_then_bwd<B: MatmulOps + ?Sized>(
    be: &B,
    dinp: &mut B::Buf,
    g: WeightGrads<'_, B, LinearLocs>,
    dact: &B::Buf,
    x: DswigluOf<'_, B>,
    p: Weights<'_, B, LinearLocs>,
    s: MatShape,
) -> BResult<()> {
    let sink = p.at.grad_sink(s);
    be.swiglu_bwd(x.dy, x.gate_up, dact, super::Rows { n: s.n, c: s.oc / 2 }, sink)?;
    matmul_bwd_or_kept(be, dinp, g, x.dy, x.inp, Weights::new(p.buf, p.at.grad_amax_from(sink)), s)
}
