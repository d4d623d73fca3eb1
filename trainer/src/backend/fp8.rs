//! FP8 numerics shared by every backend (`train.precision = "fp8"`): the two formats, their
//! rounding, the per-tensor "current" scale, which GEMM shapes run in FP8, and the size of
//! the operand workspace a backend reserves for them.
//!
//! The CPU reference quantizes with these functions; the CUDA kernels (`cuda/fp8.cu`) do the
//! same arithmetic on the device, so both backends feed the GEMMs the same FP8 values:
//!
//! - **amax** is the largest `|x|` of the tensor (a NaN anywhere makes it NaN);
//! - **scale** `s = 2^e`, the largest power of two with `amax·s ≤ FP8_MAX` (448 for e4m3,
//!   57344 for e5m2), so the largest element lands in the top binade and nothing saturates.
//!   A power of two makes `x·s` and the dequantization `q/s` exact: the FP8 value is a pure
//!   rounding of `x` (it costs at most one binade of range, half a bit on average, against
//!   `s = FP8_MAX/amax`). `amax = 0` gives `s = 1`; a non-finite amax gives NaN, so an
//!   overflow upstream reaches the loss instead of being flushed to zero;
//! - **rounding** to nearest, ties to even, saturating at ±FP8_MAX (what the hardware's
//!   `cvt.rn.satfinite` does), with the formats' subnormals.
//!
//! The GEMM then multiplies the FP8 codes and applies `1/s_a · 1/s_b` to the fp32 sum
//! (cuBLASLt's A/B scale pointers); the CPU multiplies the dequantized values `q/s` in f32.

use super::MatShape;

/// An 8-bit float format of the FP8 GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits (bias 7), 3 mantissa bits, no infinities, max 448: weights and
    /// activations (forward operands), where precision matters more than range.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits, max 57344: output gradients, whose range
    /// is wider.
    E5M2,
}

impl Fp8Format {
    /// (exponent bits, mantissa bits, bias).
    const fn bits(self) -> (i32, i32, i32) {
        match self {
            Fp8Format::E4M3 => (4, 3, 7),
            Fp8Format::E5M2 => (5, 2, 15),
        }
    }

    /// The largest finite value.
    pub const fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// The code of the largest finite value (without sign).
    const fn max_code(self) -> u8 {
        match self {
            Fp8Format::E4M3 => 0x7e,
            Fp8Format::E5M2 => 0x7b,
        }
    }

    /// The kernels' and cuBLASLt's name for the format (`FP8_E5M2` define: 0 or 1).
    pub fn is_e5m2(self) -> bool {
        self == Fp8Format::E5M2
    }

    /// `x` rounded to this format (nearest, ties to even; saturating at ±max; NaN stays NaN).
    pub fn round(self, x: f32) -> f32 {
        if x.is_nan() {
            return f32::NAN;
        }
        let (_, m, bias) = self.bits();
        let a = (x as f64).abs();
        if a >= self.max() as f64 {
            return self.max().copysign(x);
        }
        if a == 0.0 {
            return x;
        }
        // The spacing of the format's values around `a`: 2^(e - m) in a's binade, and the
        // subnormals' spacing below the smallest normal binade.
        let e = (ilog2_f64(a)).max(1 - bias);
        let quantum = 2f64.powi(e - m);
        let r = (a / quantum).round_ties_even() * quantum;
        (r.min(self.max() as f64) as f32).copysign(x)
    }

    /// The 8-bit code of `x` rounded to this format (the bits the GPU's cast writes; NaN as
    /// 0x7f, the sign kept).
    pub fn encode(self, x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        if x.is_nan() {
            return 0x7f;
        }
        let (_, m, bias) = self.bits();
        let r = self.round(x).abs() as f64;
        if r == 0.0 {
            return sign;
        }
        if r >= self.max() as f64 {
            return sign | self.max_code();
        }
        let e = ilog2_f64(r);
        let code = if e < 1 - bias {
            // Subnormal: exponent field 0, mantissa r / 2^(1 - bias - m).
            (r / 2f64.powi(1 - bias - m)) as u8
        } else {
            let field = (e + bias) as u8;
            let mant = ((r / 2f64.powi(e) - 1.0) * 2f64.powi(m)) as u8;
            (field << m) | mant
        };
        sign | code
    }

    /// The value of an 8-bit code.
    pub fn decode(self, code: u8) -> f32 {
        let (eb, m, bias) = self.bits();
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let field = ((code & 0x7f) >> m) as i32;
        let mant = (code & ((1 << m) - 1)) as i32;
        let top = (1 << eb) - 1;
        match self {
            Fp8Format::E4M3 if field == top && mant == (1 << m) - 1 => return f32::NAN,
            Fp8Format::E5M2 if field == top => return if mant == 0 { sign * f32::INFINITY } else { f32::NAN },
            _ => {}
        }
        let v = if field == 0 {
            mant as f64 * 2f64.powi(1 - bias - m)
        } else {
            (1.0 + mant as f64 / (1 << m) as f64) * 2f64.powi(field - bias)
        };
        sign * v as f32
    }

    /// The per-tensor scale for a tensor whose largest magnitude is `amax` (see the module
    /// doc): the largest `2^e`, `e` in −126..=126, with `amax·2^e ≤ max`; 1 for `amax = 0`,
    /// NaN for a non-finite amax. Integer arithmetic on the bits, as `fp8_scale` in
    /// `cuda/fp8.cu` does it.
    pub fn scale(self, amax: f32) -> f32 {
        if !amax.is_finite() {
            return f32::NAN;
        }
        if amax == 0.0 {
            return 1.0;
        }
        let (ea, ma) = exponent_and_mantissa(amax.abs());
        let (ef, mf) = exponent_and_mantissa(self.max());
        // amax·2^(ef − ea) = max · (1.ma / 1.mf): one binade less when ma > mf.
        let e = (ef - ea - i32::from(ma > mf)).clamp(-126, 126);
        f32::from_bits(((e + 127) as u32) << 23)
    }

    /// `x` quantized with `scale` and dequantized: `round(x·s) / s` (exact: `s` is a power
    /// of two), the value the FP8 GEMM multiplies.
    pub fn fake_quant(self, x: f32, scale: f32, inv_scale: f32) -> f32 {
        self.round(x * scale) * inv_scale
    }
}

/// `floor(log2(a))` of a positive finite f64.
fn ilog2_f64(a: f64) -> i32 {
    let field = ((a.to_bits() >> 52) & 0x7ff) as i32;
    if field == 0 {
        // Not reached for values that came from f32 (their f64 is normal); kept exact anyway.
        let m = a.to_bits() & ((1u64 << 52) - 1);
        return (63 - m.leading_zeros() as i32) - 1074;
    }
    field - 1023
}

/// `(floor(log2 a), the 23 fraction bits of a normalised)` of a positive finite f32,
/// subnormals included: the device's `fp8_scale` does the same on the bits.
fn exponent_and_mantissa(a: f32) -> (i32, u32) {
    let b = a.to_bits() & 0x7fff_ffff;
    let (field, m) = ((b >> 23) as i32, b & 0x7f_ffff);
    if field == 0 {
        let lz = m.leading_zeros() as i32 - 8;
        return (1 - lz - 127, (m << lz) & 0x7f_ffff);
    }
    (field - 127, m)
}

/// The largest `|x|` of `xs` (NaN if any is NaN: compared as bits, as the device does).
pub fn amax(xs: &[f32]) -> f32 {
    f32::from_bits(xs.iter().map(|x| x.to_bits() & 0x7fff_ffff).max().unwrap_or(0))
}

/// `xs` quantized per tensor to `fmt` and dequantized (the CPU reference's FP8 operand),
/// into `out`; returns the scale used.
pub fn fake_quant_into(out: &mut [f32], xs: &[f32], fmt: Fp8Format) -> f32 {
    let s = fmt.scale(amax(xs));
    let inv = 1.0 / s;
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = fmt.fake_quant(x, s, inv);
    }
    s
}

/// Whether a GEMM of shape `s` runs in FP8 when its layer asks for it: every dimension a
/// nonzero multiple of 16 (cuBLASLt's FP8 kernels want 16-byte aligned leading dimensions
/// and rows; other shapes run in bf16 on every backend alike).
pub fn eligible(s: MatShape) -> bool {
    [s.n, s.c, s.oc].iter().all(|&d| d > 0 && d.is_multiple_of(16))
}

/// The largest linear layer of a model, per dimension (they need not be the same layer):
/// what a backend's FP8 operand workspace is sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinearExtent {
    /// Rows of one micro-batch (B·T).
    pub rows: usize,
    /// The widest input.
    pub inputs: usize,
    /// The widest output.
    pub outputs: usize,
    /// The largest weight (inputs × outputs of one layer).
    pub weight: usize,
}

impl LinearExtent {
    /// The extent of layers `(inputs, outputs)` over `rows` rows.
    pub fn of(rows: usize, layers: &[(usize, usize)]) -> LinearExtent {
        let mut e = LinearExtent { rows, ..LinearExtent::default() };
        for &(c, oc) in layers {
            e.inputs = e.inputs.max(c);
            e.outputs = e.outputs.max(oc);
            e.weight = e.weight.max(c * oc);
        }
        e
    }
}

/// One linear layer's persistent FP8 state, by its index into what
/// [`MatmulOps::prepare_fp8`](super::MatmulOps::prepare_fp8) reserved ([`Fp8Layers`]): the
/// scale its forward found for its input, kept for its backward, and (where weights are
/// cached) its weight's FP8 codes. A layer without one quantizes every operand at every use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Layer {
    pub index: usize,
    /// The backward's input is, bit for bit, the tensor this layer's last forward (or
    /// recompute) quantized, so its scale is reused and the backward only casts. False
    /// where the model makes the backward's input again some other way (GPT-2's GELU output
    /// recomputed by the element-wise kernel, where the forward's came from the GEMM's
    /// epilogue): the backward then takes its own amax, as it does without a layer.
    pub input_from_forward: bool,
    /// The op that wrote the input left its amax in [`AmaxSink::Input`] of this layer, so
    /// the forward only casts (no amax pass of its own); in a backward whose input is not
    /// the forward's, the op that made it again (GPT-2's recomputed GELU) left it.
    pub input_amax_ready: bool,
    /// The op that wrote the backward's output gradient left its amax in
    /// [`AmaxSink::Grad`] of this layer, so the backward only casts it.
    pub grad_amax_ready: bool,
    /// The forward keeps its input's FP8 codes (e4m3, the forward's scale) for the backward's
    /// weight gradient, which reads them instead of casting its input again
    /// ([`Fp8Layers::kept_inputs`] reserved them): one pass over the input fewer, and the
    /// model need not keep the input itself for it. The model sets it where every backward
    /// of the layer follows a forward of the same micro-batch (blocks not checkpointed).
    pub keeps_input: bool,
}

impl Fp8Layer {
    /// Layer `index`, its backward's input the forward's, no amax left by a producer, its
    /// input not kept in FP8.
    pub const fn new(index: usize) -> Fp8Layer {
        Fp8Layer {
            index,
            input_from_forward: true,
            input_amax_ready: false,
            grad_amax_ready: false,
            keeps_input: false,
        }
    }
}

/// Where an op that writes a tensor an FP8 GEMM quantizes next leaves the tensor's amax
/// (the largest |x| of what it wrote, as `amax` finds it over the written buffer), so the
/// GEMM needs no amax pass of its own: the issue's "amax computed inside the kernels that
/// produce the tensor". The consumer says so with [`Fp8Layer::input_amax_ready`] or
/// [`Fp8Layer::grad_amax_ready`]; the CPU reference checks the value left is the amax of
/// what the consumer reads, and errors (naming the model bug) where it is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmaxSink {
    /// Layer `i`'s forward input `X`.
    Input(usize),
    /// Layer `i`'s backward output gradient `dY`.
    Grad(usize),
}

/// The output gradient's format in an FP8 layer's backward GEMMs (`train.fp8_grad_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8GradFormat {
    /// e5m2 (the default; Transformer Engine's HYBRID and torchao's recipes): range over
    /// precision, 2 mantissa bits.
    #[default]
    E5m2,
    /// e4m3: one more mantissa bit, 14 fewer binades below the tensor's largest value before
    /// values flush to zero (per-tensor scaling puts that value at 448).
    E4m3,
}

impl Fp8GradFormat {
    pub fn format(self) -> Fp8Format {
        match self {
            Fp8GradFormat::E5m2 => Fp8Format::E5M2,
            Fp8GradFormat::E4m3 => Fp8Format::E4M3,
        }
    }

    /// The config's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Fp8GradFormat::E5m2 => "e5m2",
            Fp8GradFormat::E4m3 => "e4m3",
        }
    }
}

/// The precision of an FP8 layer's weight-gradient GEMM (`train.fp8_weight_grad`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8WeightGrad {
    /// `dW = dYᵀ·X` from FP8 codes of both, as the other two GEMMs (the default).
    #[default]
    Fp8,
    /// `dW` from the unquantized bf16 `dY` and `X` (f32 on CPU ranks), the way torchao's
    /// `rowwise_with_gw_hp` recipe keeps it: the gradient the optimizer sees rounds neither
    /// operand to 8 bits. The backward then casts only `dY`, in one layout, and never the
    /// input; the dW GEMM runs at bf16 speed.
    Bf16,
}

impl Fp8WeightGrad {
    /// The config's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Fp8WeightGrad::Fp8 => "fp8",
            Fp8WeightGrad::Bf16 => "bf16",
        }
    }
}

/// How an FP8 layer's backward runs: its output gradient's format and its dW GEMM's
/// precision. The default is the e5m2, all-FP8 backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fp8Backward {
    pub grad: Fp8GradFormat,
    pub weight_grad: Fp8WeightGrad,
}

impl Fp8Backward {
    /// Every recipe but the default: e4m3 dY, dW from the unquantized operands, both (what
    /// the GPU tests and `gpu-timing fp8` run beside the default).
    pub const ALTERNATIVES: [Fp8Backward; 3] = [
        Fp8Backward { grad: Fp8GradFormat::E4m3, weight_grad: Fp8WeightGrad::Fp8 },
        Fp8Backward { grad: Fp8GradFormat::E5m2, weight_grad: Fp8WeightGrad::Bf16 },
        Fp8Backward { grad: Fp8GradFormat::E4m3, weight_grad: Fp8WeightGrad::Bf16 },
    ];

    /// The output gradient's FP8 format.
    pub fn grad_format(self) -> Fp8Format {
        self.grad.format()
    }

    /// Whether the dW GEMM reads FP8 operands (else the unquantized ones).
    pub fn weight_grad_in_fp8(self) -> bool {
        self.weight_grad == Fp8WeightGrad::Fp8
    }
}

/// What a model asks of a backend's FP8 GEMMs (`MatmulOps::prepare_fp8`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fp8Layers {
    /// The largest linear layer: the operand workspace is sized for it.
    pub largest: LinearExtent,
    /// Each layer's weight as `(inputs, outputs)`, by [`Fp8Layer::index`].
    pub weights: Vec<(usize, usize)>,
    /// Layers `0..cached_layers` keep their weight in FP8 from one parameter version to the
    /// next (`train.fp8_weight_cache`): cast once after the parameters change
    /// ([`MatmulOps::fp8_weights_changed`](super::MatmulOps::fp8_weights_changed)), then
    /// read by every forward, recompute and backward until they change again, whichever
    /// buffer holds the weight (ZeRO-3 gathers into pooled ones). The others cast at each use.
    pub cached_layers: usize,
    /// How every FP8 layer's backward runs.
    pub backward: Fp8Backward,
    /// Per layer (by [`Fp8Layer::index`]; missing: false): whether its forward keeps its
    /// input's FP8 codes for its backward ([`Fp8Layer::keeps_input`]): `rows × inputs`
    /// bytes each, activations.
    pub kept_inputs: Vec<bool>,
    /// Where an optimizer step writes a cached layer's whole weight (and leaves its amax:
    /// [`AdamWSegment::fp8_layer`](super::AdamWSegment::fp8_layer)), it writes the cache's
    /// codes too (CUDA: `adamw.rs`, with a predicted scale and a check; the CPU: its cache's
    /// values, checked against the weight at each use), and the version it begins casts that
    /// weight no more: the same codes. Nothing more to reserve.
    pub step_codes: bool,
}

impl Fp8Layers {
    /// `n_layer` blocks of the linear layers `(inputs, outputs)` over `rows` rows: layer
    /// `k` of block `l` is index `l · linears.len() + k`; the first `cached_blocks` blocks'
    /// weights cached.
    pub fn blocks(rows: usize, linears: &[(usize, usize)], n_layer: usize, cached_blocks: usize) -> Fp8Layers {
        let weights = (0..n_layer).flat_map(|_| linears.iter().copied()).collect();
        let cached_layers = cached_blocks.min(n_layer) * linears.len();
        Fp8Layers {
            largest: LinearExtent::of(rows, linears),
            weights,
            cached_layers,
            backward: Fp8Backward::default(),
            kept_inputs: Vec::new(),
            step_codes: false,
        }
    }

    /// These layers, the optimizer step writing the cached weights' codes where `on`
    /// ([`Fp8Layers::step_codes`]).
    pub fn with_step_codes(self, on: bool) -> Fp8Layers {
        Fp8Layers { step_codes: on, ..self }
    }

    /// These layers, those `kept` says keeping their input's codes (by index).
    pub fn with_kept_inputs(self, kept: Vec<bool>) -> Fp8Layers {
        Fp8Layers { kept_inputs: kept, ..self }
    }

    /// Whether layer `i` keeps its input's codes.
    pub fn keeps_input(&self, i: usize) -> bool {
        self.kept_inputs.get(i).copied().unwrap_or(false)
    }

    /// The kept inputs' sizes in codes (`rows × inputs`), by layer (0 where not kept).
    pub fn kept_input_codes(&self) -> Vec<usize> {
        self.kept_input_codes_at(self.largest.rows)
    }

    /// [`Fp8Layers::kept_input_codes`] for `rows` rows instead of the layers' own.
    pub fn kept_input_codes_at(&self, rows: usize) -> Vec<usize> {
        (0..self.weights.len()).map(|i| if self.keeps_input(i) { rows * self.weights[i].0 } else { 0 }).collect()
    }

    /// These layers with `backward`'s recipe.
    pub fn with_backward(self, backward: Fp8Backward) -> Fp8Layers {
        Fp8Layers { backward, ..self }
    }

    /// The cached layers' weights `(inputs, outputs)`.
    pub fn cached(&self) -> &[(usize, usize)] {
        &self.weights[..self.cached_layers.min(self.weights.len())]
    }

    /// Elements of all the layers' weights.
    pub fn weight_elements(&self) -> usize {
        self.weights.iter().map(|&(c, oc)| c * oc).sum()
    }

    /// Elements of the cached layers' weights.
    pub fn cached_elements(&self) -> usize {
        self.cached().iter().map(|&(c, oc)| c * oc).sum()
    }
}

/// Device bytes a backend reserved for FP8 GEMMs, by ledger category: the operand workspace
/// and scales (`Workspace`), the cached weights (`Params`: a copy of parameters), and the
/// inputs' codes kept from forward to backward (`Activations`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fp8Bytes {
    pub workspace: usize,
    pub weight_cache: usize,
    pub kept_inputs: usize,
}

/// Per-tensor scale slots of one linear op: one per operand role, each an amax (u32 bits)
/// and the inverse scale the GEMM applies (f32). Layers with an [`Fp8Layer`] keep their
/// input's and weight's slots in the per-layer part of the workspace instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleSlot {
    /// The layer's input (e4m3).
    Input = 0,
    /// The weight (e4m3).
    Weight = 1,
    /// The output gradient (e5m2).
    Grad = 2,
}

/// Bytes of a scale slot: the inverse scale (16-byte aligned, as cuBLASLt's scale
/// pointers are kept), then the amax, then the scale a predicted cast used.
const SLOT: usize = 16;

/// The CUDA backend's FP8 operand workspace, in bytes from its start (each region 256-byte
/// aligned). One linear op runs at a time, in stream order, so the operand regions serve
/// every layer:
///
/// - `scales`: the per-op [`ScaleSlot`]s, then two per [`Fp8Layer`] (its input's, kept
///   from forward to backward, and its output gradient's, where producers leave amaxes:
///   [`AmaxSink`]), then one per layer for its weight (adjacent, so an optimizer step that
///   leaves the weights' amaxes clears a block's in one go), 16 bytes each: the inverse
///   scale the GEMM reads (f32, 16-byte aligned, as cuBLASLt's scale pointers are kept),
///   then the amax (u32 bits), then the scale a predicted cast used (`fp8.cu`:
///   `FP8_SCALE_PREDICTED`); then two more per layer, never cleared, for its input's and
///   output gradient's predicted scales: the scale each had the last time (f32 bits), and how
///   often the prediction was right and wrong (u32 each); then one per layer, never cleared,
///   for its cached weight's codes as the optimizer step writes them (the same words);
/// - `a`: the input `X` (forward, `[n, c]` e4m3); in the backward first the output gradient
///   `dY` (`[n, oc]` e5m2, for dX), then — once dX's GEMM is queued — `Xᵀ` (`[c, n]`, for dW);
/// - `gt`: `dYᵀ` (`[oc, n]` e5m2, for dW);
/// - `w`: the weight (forward `[oc, c]`), or its transpose (backward `[c, oc]`), of a layer
///   whose weight is not cached.
///
/// Hopper's FP8 GEMMs take both operands with the inner dimension contiguous ("TN"), hence
/// the transposed copies for the backward's two GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaFp8Workspace {
    pub scales: usize,
    pub a: usize,
    pub gt: usize,
    pub w: usize,
    pub bytes: usize,
    /// Layers with persistent slots.
    pub layers: usize,
}

const ALIGN: usize = 256;

fn up(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

impl CudaFp8Workspace {
    /// The workspace for layers up to `e`, with slots for `layers` layers.
    pub fn new(e: LinearExtent, layers: usize) -> CudaFp8Workspace {
        let scales = 0;
        let a = up((3 + 6 * layers) * SLOT);
        let gt = a + up(e.rows * e.inputs.max(e.outputs));
        let w = gt + up(e.rows * e.outputs);
        let bytes = w + up(e.weight);
        CudaFp8Workspace { scales, a, gt, w, bytes, layers }
    }

    /// Byte offset of a per-op slot, which starts with its inverse scale.
    pub fn inv_scale(&self, slot: ScaleSlot) -> usize {
        self.scales + SLOT * slot as usize
    }

    /// Byte offset of a per-op slot's amax (after its inverse scale).
    pub fn amax(&self, slot: ScaleSlot) -> usize {
        self.inv_scale(slot) + 4
    }

    /// Byte offset of layer `i`'s input slot (kept from its forward for its backward).
    pub fn layer_input(&self, i: usize) -> usize {
        self.scales + SLOT * (3 + 2 * i)
    }

    /// Byte offset of layer `i`'s output gradient's slot.
    pub fn layer_grad(&self, i: usize) -> usize {
        self.layer_input(i) + SLOT
    }

    /// Byte offset of layer `i`'s weight's slot (cached, or its amax kept for the version);
    /// layer `i + 1`'s follows it.
    pub fn layer_weight(&self, i: usize) -> usize {
        self.scales + SLOT * (3 + 2 * self.layers + i)
    }

    /// Byte offset of the prediction of the scale of the tensor a sink names (layer `i`'s
    /// input or output gradient): the scale it had the last time, then the counts of right
    /// and wrong predictions. Never cleared (a new workspace starts with none: 0).
    pub fn prediction(&self, s: AmaxSink) -> usize {
        let (i, k) = match s {
            AmaxSink::Input(i) => (i, 0),
            AmaxSink::Grad(i) => (i, 1),
        };
        self.scales + SLOT * (3 + 3 * self.layers + 2 * i + k)
    }

    /// Byte offset of the prediction of layer `i`'s weight's scale, as the optimizer step
    /// that writes its cached codes uses it (the same words as [`CudaFp8Workspace::prediction`]'s),
    /// after the others.
    pub fn weight_prediction(&self, i: usize) -> usize {
        self.scales + SLOT * (3 + 5 * self.layers + i)
    }

    /// Byte offset of the slot a sink names.
    pub fn sink(&self, s: AmaxSink) -> usize {
        match s {
            AmaxSink::Input(i) => self.layer_input(i),
            AmaxSink::Grad(i) => self.layer_grad(i),
        }
    }
}

/// The CUDA backend's cached FP8 weights ([`Fp8Layers::cached_layers`]): per cached layer its
/// e4m3 codes as they are (`[oc, c]`, the forward's operand) and transposed (`[c, oc]`, the
/// backward's), each region 256-byte aligned: 2 bytes per parameter of the linear layers.
/// Their scale slots are the workspace's per-layer ones ([`CudaFp8Workspace::layer_weight`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaFp8WeightCache {
    /// Per layer, the byte offsets of `W` and of `Wᵀ`.
    pub regions: Vec<(usize, usize)>,
    pub bytes: usize,
}

impl CudaFp8WeightCache {
    pub fn new(weights: &[(usize, usize)]) -> CudaFp8WeightCache {
        let mut at = 0;
        let regions = weights
            .iter()
            .map(|&(c, oc)| {
                let w = at;
                at += 2 * up(c * oc);
                (w, w + up(c * oc))
            })
            .collect();
        CudaFp8WeightCache { regions, bytes: at }
    }

    /// What the CUDA backend reserves for `l`: the workspace, the cached layers' weight
    /// cache and the kept inputs' codes (what `MatmulOps::prepare_fp8` returns and the
    /// planner predicts).
    pub fn reserved(l: &Fp8Layers) -> Fp8Bytes {
        let workspace = CudaFp8Workspace::new(l.largest, l.weights.len()).bytes;
        let kept_inputs = CudaFp8KeptInputs::new(&l.kept_input_codes()).bytes;
        Fp8Bytes { workspace, weight_cache: CudaFp8WeightCache::new(l.cached()).bytes, kept_inputs }
    }
}

/// The CUDA backend's kept FP8 inputs ([`Fp8Layers::kept_inputs`]): per kept layer its
/// input's e4m3 codes transposed (`[c, n]`, what the backward's dW GEMM reads), written by
/// the forward's cast beside the row-major copy its own GEMM reads; each region 256-byte
/// aligned. Their scale is the layer's input slot ([`CudaFp8Workspace::layer_input`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaFp8KeptInputs {
    /// Per layer, the byte offset of its codes (`None`: not kept).
    pub regions: Vec<Option<usize>>,
    pub bytes: usize,
}

impl CudaFp8KeptInputs {
    /// Regions for layers of `codes` codes each (0: not kept).
    pub fn new(codes: &[usize]) -> CudaFp8KeptInputs {
        let mut at = 0;
        let regions = codes
            .iter()
            .map(|&n| {
                (n > 0).then(|| {
                    at += up(n);
                    at - up(n)
                })
            })
            .collect();
        CudaFp8KeptInputs { regions, bytes: at }
    }
}

/// What the CPU reference reserves for `l`: per layer its forward input's amax and the two
/// amaxes producers leave ([`AmaxSink`]), f32 each, each cached layer's dequantized weight
/// (f32, 4 bytes per parameter: the CPU multiplies values, not codes), and each kept input's
/// codes (a byte each, as on the GPU). Its operands' quantized copies are per-call scratch.
pub fn cpu_reserved(l: &Fp8Layers) -> Fp8Bytes {
    Fp8Bytes {
        workspace: 12 * l.weights.len(),
        weight_cache: 4 * l.cached_elements(),
        kept_inputs: l.kept_input_codes().iter().sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    #[test]
    fn every_code_decodes_and_encodes_back() {
        for f in FORMATS {
            for code in 0..=255u8 {
                let v = f.decode(code);
                if v.is_nan() || v.is_infinite() {
                    continue;
                }
                assert_eq!(f.round(v), v, "{f:?} {code:#04x} = {v} is representable");
                // -0 encodes with its sign; every other value to itself.
                assert_eq!(f.encode(v), code, "{f:?} {code:#04x} = {v}");
            }
        }
    }

    #[test]
    fn known_values_of_both_formats() {
        use Fp8Format::*;
        assert_eq!((E4M3.decode(0x7e), E4M3.decode(0x01), E4M3.decode(0x08)), (448.0, 2f32.powi(-9), 2f32.powi(-6)));
        assert!(E4M3.decode(0x7f).is_nan() && E4M3.decode(0xff).is_nan());
        assert_eq!(
            (E5M2.decode(0x7b), E5M2.decode(0x01), E5M2.decode(0x04)),
            (57344.0, 2f32.powi(-16), 2f32.powi(-14))
        );
        assert_eq!(E5M2.decode(0x7c), f32::INFINITY);
        assert_eq!(E4M3.decode(0x38), 1.0);
        assert_eq!(E5M2.decode(0x3c), 1.0);
        assert_eq!(E4M3.decode(0xb8), -1.0);
    }

    #[test]
    fn rounding_is_to_nearest_ties_to_even_and_saturates() {
        use Fp8Format::*;
        // e4m3 around 1: spacing 1/8. 1 + 1/16 is a tie between 1 (even) and 1.125.
        assert_eq!(E4M3.round(1.0625), 1.0);
        assert_eq!(E4M3.round(1.1875), 1.25); // tie between 1.125 and 1.25 (even)
        assert_eq!(E4M3.round(1.07), 1.125);
        assert_eq!(E4M3.round(-1.07), -1.125);
        // e5m2 around 1: spacing 1/4.
        assert_eq!(E5M2.round(1.125), 1.0);
        assert_eq!(E5M2.round(1.375), 1.5);
        // Saturation, infinities included (satfinite).
        assert_eq!(E4M3.round(460.0), 448.0);
        assert_eq!(E4M3.round(1e9), 448.0);
        assert_eq!(E4M3.round(f32::NEG_INFINITY), -448.0);
        assert_eq!(E5M2.round(6e4), 57344.0);
        assert!(E4M3.round(f32::NAN).is_nan());
        // Subnormals: e4m3's smallest is 2^-9; half of it is a tie to 0 (even).
        assert_eq!(E4M3.round(2f32.powi(-10)), 0.0);
        assert_eq!(E4M3.round(1.5 * 2f32.powi(-10)), 2f32.powi(-9));
        assert_eq!(E4M3.round(3.0 * 2f32.powi(-10)), 2.0 * 2f32.powi(-9)); // tie 1 vs 2 units: 2
        assert_eq!(E5M2.round(2f32.powi(-17)), 0.0);
        assert_eq!(E5M2.round(3.0 * 2f32.powi(-17)), 2.0 * 2f32.powi(-16));
    }

    /// Rounding agrees with the nearest of all the codes, checked by brute force.
    #[test]
    fn rounding_is_the_nearest_code() {
        for f in FORMATS {
            let mut vals: Vec<f32> = (0..=255u8).map(|c| f.decode(c)).filter(|v| v.is_finite() && *v >= 0.0).collect();
            vals.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
            let mut x = 1e-7f32;
            while x < f.max() * 1.1 {
                let r = f.round(x);
                let best = vals.iter().map(|&v| (v - x).abs()).fold(f32::INFINITY, f32::min);
                assert!((r - x).abs() <= best, "{f:?} {x}: {r} is not the nearest (off by {best})");
                x *= 1.0137;
            }
        }
    }

    #[test]
    fn scale_is_the_largest_power_of_two_that_fits() {
        use Fp8Format::*;
        for f in FORMATS {
            for &amax in &[1.0f32, 0.3, 448.0, 449.0, 1e-3, 7.5e4, 1e-30, 1e-40, 3.0e38, 0.999_999_94] {
                let s = f.scale(amax);
                assert_eq!(s.to_bits() & 0x7f_ffff, 0, "{f:?} {amax}: {s} is a power of two");
                let top = amax as f64 * s as f64;
                // Fits; twice the scale would not (unless clamped at the ends of the range).
                assert!(top <= f.max() as f64, "{f:?} {amax}: {top}");
                let clamped = s == 2f32.powi(126) || s == 2f32.powi(-126);
                assert!(clamped || top * 2.0 > f.max() as f64, "{f:?} {amax}: {top}");
            }
        }
        assert_eq!(E4M3.scale(448.0), 1.0);
        assert_eq!(E4M3.scale(448.5), 0.5);
        assert_eq!(E4M3.scale(1.0), 256.0);
        assert_eq!(E4M3.scale(1.75), 256.0);
        assert_eq!(E4M3.scale(1.76), 128.0);
        assert_eq!(E5M2.scale(1.0), 32768.0);
        assert_eq!(E4M3.scale(0.0), 1.0);
        assert!(E4M3.scale(f32::INFINITY).is_nan() && E5M2.scale(f32::NAN).is_nan());
    }

    #[test]
    fn amax_sees_signs_and_nans() {
        assert_eq!(amax(&[0.5, -3.0, 2.0]), 3.0);
        assert_eq!(amax(&[]), 0.0);
        assert!(amax(&[1.0, f32::NAN, 2.0]).is_nan());
    }

    #[test]
    fn fake_quant_keeps_the_largest_element_and_rounds_the_rest() {
        let xs = [0.3f32, -1.7, 0.001, 0.0];
        let mut q = [0.0; 4];
        let s = fake_quant_into(&mut q, &xs, Fp8Format::E4M3);
        // amax 1.7 < 1.75: 1.7·256 = 435.2 fits under 448.
        assert_eq!(s, 256.0);
        assert_eq!(q[1], -1.75); // -435.2 → -448 (spacing 32 in 256..512)
        assert!((q[0] - 0.3).abs() < 0.3 / 16.0);
        assert_eq!(q[3], 0.0);
    }

    #[test]
    fn only_shapes_of_multiples_of_16_are_eligible() {
        assert!(eligible(MatShape { n: 64, c: 768, oc: 2304 }));
        assert!(!eligible(MatShape { n: 37, c: 768, oc: 2304 }));
        assert!(!eligible(MatShape { n: 64, c: 768, oc: 50257 }));
        assert!(!eligible(MatShape { n: 0, c: 16, oc: 16 }));
    }

    #[test]
    fn workspace_regions_are_aligned_and_sized() {
        let e = LinearExtent::of(8192, &[(1600, 4800), (1600, 1600), (1600, 6400), (6400, 1600)]);
        assert_eq!(e, LinearExtent { rows: 8192, inputs: 6400, outputs: 6400, weight: 6400 * 1600 });
        let w = CudaFp8Workspace::new(e, 0);
        for off in [w.a, w.gt, w.w, w.bytes] {
            assert_eq!(off % 256, 0);
        }
        assert_eq!(w.bytes, 256 + 2 * 8192 * 6400 + 6400 * 1600);
        assert_eq!(w.inv_scale(ScaleSlot::Grad), 32);
        // 48 layers: 3 + 6·48 slots of 16 bytes (input, gradient, weight, three predictions),
        // rounded up to 256.
        let w48 = CudaFp8Workspace::new(e, 48);
        assert_eq!(w48.bytes - w.bytes, 4864 - 256);
        // Each layer's input and gradient slots side by side, then the weights' slots.
        assert_eq!((w48.layer_input(0), w48.layer_grad(0)), (48, 64));
        assert_eq!((w48.layer_input(47), w48.layer_grad(47)), (48 + 16 * 94, 48 + 16 * 95));
        assert_eq!((w48.layer_weight(0), w48.layer_weight(1)), (48 + 16 * 96, 48 + 16 * 97));
        assert_eq!(
            (w48.sink(AmaxSink::Input(5)), w48.sink(AmaxSink::Grad(5))),
            (w48.layer_input(5), w48.layer_grad(5))
        );
        // The predictions after the weights' slots, never inside a run a clear zeroes.
        assert_eq!(w48.prediction(AmaxSink::Input(0)), w48.layer_weight(47) + 16);
        assert_eq!(w48.prediction(AmaxSink::Grad(47)), 48 + 16 * (144 + 95));
        assert_eq!(w48.weight_prediction(0), w48.prediction(AmaxSink::Grad(47)) + 16);
        assert!(w48.weight_prediction(47) + 16 <= w48.a);
    }

    #[test]
    fn weight_cache_holds_both_layouts_of_every_layer() {
        let layers = Fp8Layers::blocks(8192, &[(1600, 4800), (1600, 1600)], 2, 2);
        assert_eq!(layers.weights.len(), 4);
        let c = CudaFp8WeightCache::new(&layers.weights);
        assert_eq!(c.bytes, 2 * 2 * (1600 * 4800 + 1600 * 1600));
        assert_eq!(c.regions[1], (2 * 1600 * 4800, 2 * 1600 * 4800 + 1600 * 1600));
        assert!(c.regions.iter().all(|&(w, wt)| w % 256 == 0 && wt % 256 == 0));
        // Odd sizes are padded per region.
        assert_eq!(CudaFp8WeightCache::new(&[(16, 17)]).bytes, 2 * 512);
        let off = Fp8Layers { cached_layers: 0, ..layers.clone() };
        assert_eq!(CudaFp8WeightCache::reserved(&off).weight_cache, 0);
        assert_eq!(
            cpu_reserved(&layers),
            Fp8Bytes { workspace: 48, weight_cache: 4 * layers.weight_elements(), kept_inputs: 0 }
        );
        // The first block cached: its two layers' weights, not the second block's.
        let first = Fp8Layers::blocks(8192, &[(1600, 4800), (1600, 1600)], 2, 1);
        assert_eq!((first.cached_layers, first.cached().len()), (2, 2));
        assert_eq!(CudaFp8WeightCache::reserved(&first).weight_cache, c.bytes / 2);
        assert_eq!(cpu_reserved(&first).weight_cache, 2 * layers.weight_elements());
        assert_eq!(Fp8Layers::blocks(8192, &[(1600, 4800)], 2, 5).cached_layers, 2, "at most every block");
    }

    #[test]
    fn kept_inputs_hold_the_codes_of_each_kept_layers_input() {
        // Two blocks of (qkv, fc2)-like layers, the second block's not kept, 48 rows.
        let layers = Fp8Layers::blocks(48, &[(16, 48), (64, 16)], 2, 0).with_kept_inputs(vec![true, true, false]);
        assert_eq!(layers.kept_input_codes(), vec![48 * 16, 48 * 64, 0, 0], "missing entries are not kept");
        let k = CudaFp8KeptInputs::new(&layers.kept_input_codes());
        assert_eq!(k.regions, vec![Some(0), Some(768), None, None]);
        assert_eq!(k.bytes, 768 + 3072);
        assert_eq!(CudaFp8KeptInputs::new(&[100, 0, 20]).regions, vec![Some(0), None, Some(256)]);
        assert_eq!(CudaFp8WeightCache::reserved(&layers).kept_inputs, k.bytes);
        assert_eq!(cpu_reserved(&layers).kept_inputs, 48 * 16 + 48 * 64);
        assert_eq!(CudaFp8WeightCache::reserved(&Fp8Layers::blocks(48, &[(16, 48)], 2, 0)).kept_inputs, 0);
    }
}
