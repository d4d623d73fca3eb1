//! Linear layer on the CPU: `out = inp · Wᵀ + b` and its backward, through matrixmultiply's sgemm.
//! The fused GELU variants run the trait's default composition.
//!
//! A layer in [`Precision::Fp8`](crate::backend::Precision) (and an eligible shape) is the
//! reference of the CUDA backend's FP8 GEMMs: its operands are quantized per tensor as
//! `backend/fp8.rs` says (e4m3 input and weight, the output gradient in `Fp8Backward`'s
//! format: e5m2 by default) and dequantized, in per-call scratch, and the GEMM multiplies
//! those values in f32; with `Fp8WeightGrad::Bf16` dW multiplies the unquantized ones. The
//! bias gradient sums the unquantized output gradient, as the GPU's does.
//!
//! A layer with an [`Fp8Layer`] keeps what the CUDA backend keeps, in [`Fp8State`]: its
//! forward's input amax, which its backward's scale comes from, and (for the cached layers) its
//! dequantized weight, made at the first use after [`MatmulOps::fp8_weights_changed`]. The
//! values are those of quantizing at every use; the structure is the GPU's, so the CPU runs
//! test it: a backward that reuses the forward's scale checks that its input has the
//! forward's amax, and a GEMM whose operand's amax a producer left ([`AmaxSink`]) checks
//! that one was left, for this tensor; each errors (naming the model bug) where not. A layer
//! that keeps its input's codes ([`Fp8Layer::keeps_input`]) keeps them as the GPU does (a byte
//! each, `Fp8Format::encode`) and its backward's dW reads them decoded; a backward that finds
//! none kept by a forward since the last one is an error too. A weight whose amax the
//! optimizer step left ([`AdamWSegment::fp8_layer`](crate::backend::AdamWSegment), in a
//! version begun `by_step`) is quantized with that amax, checked to be the weight's: a
//! stale one (the parameters written after the step without a version saying so) is an
//! error naming the bug. Where that step also wrote a cached layer's weight
//! ([`Fp8Layers::step_codes`]: on CUDA, the codes), the version takes it without a cast at
//! first use, checked the same way against the weight at each use.

use std::borrow::Cow;

use super::{at, two_mut, CpuBackend};
use crate::backend::fp8::{amax, cpu_reserved, fake_quant_into, Fp8Format};
use crate::backend::{dgelu_then_bwd, DgeluOf, WeightGrads, Weights};
use crate::backend::{
    AmaxSink, BResult, BackendError, Fp8Backward, Fp8Bytes, Fp8Layer, Fp8Layers, InputMadeInCast, LinearLocs, MatShape,
    MatmulOps, NormOfInput,
};

/// `xs` quantized per tensor to `fmt` and dequantized (the FP8 GEMM's operand values).
fn quantized(xs: &[f32], fmt: Fp8Format) -> Vec<f32> {
    let mut q = vec![0.0; xs.len()];
    fake_quant_into(&mut q, xs, fmt);
    q
}

/// `xs` quantized to `fmt` with a given scale and dequantized.
fn quantized_with(xs: &[f32], fmt: Fp8Format, scale: f32) -> Vec<f32> {
    let inv = 1.0 / scale;
    xs.iter().map(|&x| fmt.fake_quant(x, scale, inv)).collect()
}

/// A cached layer's weight: its dequantized values, and the parameter version they were made
/// in (`None`: never made). The version alone, as on the GPU: within one, every buffer
/// holding the weight holds the same values (ZeRO-3 gathers into pooled buffers).
type CachedWeight = (Vec<f32>, Option<u64>);

/// The CPU's FP8 layers (`MatmulOps::prepare_fp8`): per layer its input's scale and its
/// cached weight.
#[derive(Debug, Default, Clone)]
pub(super) struct Fp8State {
    /// Per layer, the amax of the input its last forward quantized.
    input_amax: Vec<f32>,
    /// Per cached layer (`Fp8Layers::cached_layers`, the first ones), its cached weight.
    weights: Vec<CachedWeight>,
    /// Per layer, the amaxes producers left for it ([`AmaxSink`]): its forward input's and
    /// its output gradient's, each taken by the GEMM that quantizes the tensor.
    sinks: Vec<[Option<f32>; 2]>,
    /// Per layer that keeps its input (`Fp8Layers::kept_inputs`): the codes its last forward
    /// kept, and whether a backward may still read them (one backward per forward).
    kept: Vec<Option<(Vec<u8>, bool)>>,
    /// Per layer, the amax of its weight the last optimizer step left
    /// (`AdamWSegment::fp8_layer`), for the version `fp8_weights_changed(by_step)` begins.
    step_amax: Vec<Option<f32>>,
    /// Per layer, the amax its weight has in a version (left by the step that began it).
    known_amax: Vec<Option<(f32, u64)>>,
    /// Whether the optimizer step writes the cached weights ([`Fp8Layers::step_codes`]).
    step_codes: bool,
    /// Per cached layer, whether the last optimizer step wrote its cached weight, for the
    /// version `fp8_weights_changed(by_step)` begins.
    step_coded: Vec<bool>,
    /// Per cached layer, whether its cached weight is the one the step that began the current
    /// version wrote (checked against the weight at each use).
    made_by_step: Vec<bool>,
    /// FP8 GEMMs that applied a norm to their input in its cast (`matmul_fwd_of_norm`), ever.
    norms_in_casts: usize,
    /// FP8 casts handed no amax, which make what they cast and find its amax themselves
    /// (GELU's output, `matmul_residual_fwd_of_gelu`; GELU's gradient,
    /// `matmul_bwd_of_dgelu`), ever: on CUDA the casts that predict their scale.
    casts_without_amax: usize,
    /// Bumped by `fp8_weights_changed`.
    version: u64,
    /// The backward's recipe (`Fp8Layers::backward`; the default before `prepare_fp8`).
    backward: Fp8Backward,
}

impl Fp8State {
    fn layer(&self, l: Fp8Layer) -> BResult<()> {
        if l.index < self.input_amax.len() {
            return Ok(());
        }
        Err(BackendError::Device(format!(
            "FP8 layer {} used, but prepare_fp8 reserved {} (a bug)",
            l.index,
            self.input_amax.len()
        )))
    }

    /// Take the amax a producer left in layer `l`'s sink `k` (0: input, 1: output gradient)
    /// for a tensor whose amax is `got`: an error (a model bug) where none was left or it
    /// is another tensor's.
    fn take_sink(&mut self, l: Fp8Layer, k: usize, got: f32) -> BResult<()> {
        let what = ["forward input", "output gradient"][k];
        match self.sinks.get_mut(l.index).and_then(|s| s[k].take()) {
            Some(left) if left.to_bits() == got.to_bits() => Ok(()),
            Some(left) => Err(BackendError::Device(format!(
                "FP8 layer {}: the amax its {what}'s producer left ({left:e}) is not the amax of the tensor it \
                 quantizes ({got:e}): a model bug (AmaxSink)",
                l.index
            ))),
            None => Err(BackendError::Device(format!(
                "FP8 layer {}: its {what}'s amax was to be left by the op that wrote it, but none was: a model bug \
                 (AmaxSink)",
                l.index
            ))),
        }
    }

    /// Layer `l`'s kept input codes (`len` of them), or what is wrong: a layer that
    /// `prepare_fp8` kept nothing for, or another size (each a bug).
    fn kept_codes(&mut self, l: Fp8Layer, len: usize) -> BResult<&mut (Vec<u8>, bool)> {
        match self.kept.get_mut(l.index).and_then(Option::as_mut) {
            Some(k) if k.0.len() == len => Ok(k),
            Some(k) => Err(BackendError::Device(format!(
                "FP8 layer {}: its kept input holds {} codes, the GEMM has {len} (a bug)",
                l.index,
                k.0.len()
            ))),
            None => Err(BackendError::Device(format!(
                "FP8 layer {} keeps its input, but prepare_fp8 reserved no codes for it (a bug)",
                l.index
            ))),
        }
    }

    /// Layer `l`'s weight `w` quantized: the cached copy where the layer's weight is cached
    /// (made now if the parameters changed since), else made for this call; with the amax
    /// the optimizer step left where it left one for this version, which must be `w`'s.
    fn weight(&mut self, l: Option<Fp8Layer>, w: &[f32]) -> BResult<Cow<'_, [f32]>> {
        let version = self.version;
        let left = l.and_then(|l| self.known_amax.get(l.index).copied().flatten()).filter(|k| k.1 == version);
        if let (Some((a, _)), Some(l)) = (left, l) {
            let got = amax(w);
            if got.to_bits() != a.to_bits() {
                return Err(BackendError::Device(format!(
                    "FP8 layer {}: the weight's amax the optimizer step left ({a:e}) is not the weight's ({got:e}): \
                     the parameters changed after the step without a new version saying so (a bug: \
                     MatmulOps::fp8_weights_changed)",
                    l.index
                )));
            }
        }
        let Some(i) = l.map(|l| l.index).filter(|&i| i < self.weights.len()) else {
            return Ok(Cow::Owned(quantized(w, Fp8Format::E4M3)));
        };
        let (cached, made) = &mut self.weights[i];
        if *made != Some(version) {
            fake_quant_into(cached, w, Fp8Format::E4M3);
            *made = Some(version);
            self.made_by_step[i] = false;
        } else if self.made_by_step[i] {
            let fresh = quantized(w, Fp8Format::E4M3);
            if fresh.iter().zip(cached.iter()).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(BackendError::Device(format!(
                    "FP8 layer {i}: the cached weight the optimizer step wrote is not the weight's: the parameters \
                     changed after the step without a new version saying so (a bug: MatmulOps::fp8_weights_changed)"
                )));
            }
        }
        Ok(Cow::Borrowed(&self.weights[i].0))
    }

    /// An optimizer step wrote layer `layer`'s whole weight `w` (the run of the parameters its
    /// segments make, `None` where they make none): where the step writes the cached weights
    /// ([`Fp8Layers::step_codes`]) and the layer is cached, its cache is made now, for the
    /// version `fp8_weights_changed(by_step)` begins.
    pub(super) fn leave_weight_codes(&mut self, layer: usize, w: Option<&[f32]>) {
        let Some(i) = (layer < self.weights.len()).then_some(layer) else { return };
        let coded = match w {
            Some(w) if self.step_codes && w.len() == self.weights[i].0.len() => {
                fake_quant_into(&mut self.weights[i].0, w, Fp8Format::E4M3);
                true
            }
            _ => false,
        };
        self.step_coded[i] = coded;
    }

    /// An optimizer step wrote layer `layer`'s whole weight, whose amax is `a`
    /// (`AdamWSegment::fp8_layer`): for the version `fp8_weights_changed(by_step)` begins.
    pub(super) fn leave_weight_amax(&mut self, layer: usize, a: f32) -> BResult<()> {
        let layers = self.step_amax.len();
        let slot = self.step_amax.get_mut(layer).ok_or_else(|| {
            BackendError::Device(format!(
                "an optimizer step leaves FP8 layer {layer}'s weight amax, but prepare_fp8 reserved {layers} (a bug)"
            ))
        })?;
        *slot = Some(a);
        Ok(())
    }
}

impl CpuBackend {
    /// How many FP8 layers' weights use, in the current parameter version, the amax the
    /// optimizer step that began it left (tests: the step's amaxes are used, not ignored).
    pub fn fp8_weight_amaxes_from_step(&self) -> usize {
        let st = self.fp8.borrow();
        st.known_amax.iter().filter(|k| k.is_some_and(|k| k.1 == st.version)).count()
    }

    /// How many cached FP8 weights are, in the current parameter version, those the optimizer
    /// step that began it wrote ([`Fp8Layers::step_codes`]; tests: the path runs, not ignored).
    pub fn fp8_weights_coded_by_step(&self) -> usize {
        let st = self.fp8.borrow();
        st.weights.iter().zip(&st.made_by_step).filter(|((_, made), &by)| by && *made == Some(st.version)).count()
    }

    /// How many FP8 GEMMs applied a LayerNorm in their input's cast (`matmul_fwd_of_norm`)
    /// on this backend (tests: the path runs, not ignored).
    pub fn fp8_norms_applied_in_casts(&self) -> usize {
        self.fp8.borrow().norms_in_casts
    }

    /// How many FP8 casts were handed no amax and made their input and its amax themselves
    /// (on CUDA: predicted their scale; tests: the path runs, not ignored).
    pub fn fp8_casts_without_amax(&self) -> usize {
        self.fp8.borrow().casts_without_amax
    }

    /// A producer's amax of what it wrote (`xs`) into `sink` (nothing where `None`), for
    /// the FP8 GEMM that quantizes it next.
    pub(super) fn leave_amax(&self, sink: Option<AmaxSink>, xs: &[f32]) -> BResult<()> {
        let Some(sink) = sink else { return Ok(()) };
        let (i, k) = match sink {
            AmaxSink::Input(i) => (i, 0),
            AmaxSink::Grad(i) => (i, 1),
        };
        let mut st = self.fp8.borrow_mut();
        let layers = st.sinks.len();
        let slot = st.sinks.get_mut(i).ok_or_else(|| {
            BackendError::Device(format!("an amax left for FP8 layer {i}, but prepare_fp8 reserved {layers} (a bug)"))
        })?;
        slot[k] = Some(amax(xs));
        Ok(())
    }
}

/// `out[n,oc] = inp[n,c] · w[oc,c]ᵀ + bias[oc]`.
pub fn matmul_forward(out: &mut [f32], inp: &[f32], w: &[f32], bias: Option<&[f32]>, n: usize, c: usize, oc: usize) {
    // SAFETY: the slices have exactly the lengths the strides address (checked below).
    assert!(out.len() == n * oc && inp.len() == n * c && w.len() == oc * c);
    unsafe {
        matrixmultiply::sgemm(
            n,
            c,
            oc,
            1.0,
            inp.as_ptr(),
            c as isize,
            1,
            w.as_ptr(),
            1,
            c as isize,
            0.0,
            out.as_mut_ptr(),
            oc as isize,
            1,
        );
    }
    if let Some(bias) = bias {
        for row in out.chunks_exact_mut(oc) {
            for (o, b) in row.iter_mut().zip(bias) {
                *o += b;
            }
        }
    }
}

/// `dinp = dout · w` (overwrite), `dw += doutᵀ · inp`, `dbias += Σ_rows dout`.
pub fn matmul_backward(
    dinp: &mut [f32],
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    s: MatShape,
) {
    backward_dinp(dinp, dout, w, s);
    backward_dw(dw, dout, inp, s);
    if let Some(db) = dbias {
        backward_dbias(db, dout, s.oc);
    }
}

/// `db += Σ dout` over its rows of `oc`.
fn backward_dbias(db: &mut [f32], dout: &[f32], oc: usize) {
    for row in dout.chunks_exact(oc) {
        for (d, g) in db.iter_mut().zip(row) {
            *d += g;
        }
    }
}

/// `dinp = dout · w` (overwrite).
fn backward_dinp(dinp: &mut [f32], dout: &[f32], w: &[f32], s: MatShape) {
    let MatShape { n, c, oc } = s;
    assert!(dinp.len() == n * c && dout.len() == n * oc && w.len() == oc * c);
    // SAFETY: lengths checked above match the strides.
    unsafe {
        matrixmultiply::sgemm(
            n,
            oc,
            c,
            1.0,
            dout.as_ptr(),
            oc as isize,
            1,
            w.as_ptr(),
            c as isize,
            1,
            0.0,
            dinp.as_mut_ptr(),
            c as isize,
            1,
        );
    }
}

/// `dw += doutᵀ · inp`.
fn backward_dw(dw: &mut [f32], dout: &[f32], inp: &[f32], s: MatShape) {
    let MatShape { n, c, oc } = s;
    assert!(dw.len() == oc * c && dout.len() == n * oc && inp.len() == n * c);
    // SAFETY: lengths checked above match the strides.
    unsafe {
        matrixmultiply::sgemm(
            oc,
            n,
            c,
            1.0,
            dout.as_ptr(),
            1,
            oc as isize,
            inp.as_ptr(),
            c as isize,
            1,
            1.0,
            dw.as_mut_ptr(),
            c as isize,
            1,
        );
    }
}

impl MatmulOps for CpuBackend {
    fn prepare_fp8(&self, layers: &Fp8Layers) -> BResult<Fp8Bytes> {
        let mut st = self.fp8.borrow_mut();
        st.input_amax = vec![0.0; layers.weights.len()];
        st.sinks = vec![[None; 2]; layers.weights.len()];
        st.weights = layers.cached().iter().map(|&(c, oc)| (vec![0.0; c * oc], None)).collect();
        st.kept = layers.kept_input_codes().into_iter().map(|n| (n > 0).then(|| (vec![0u8; n], false))).collect();
        st.step_amax = vec![None; layers.weights.len()];
        st.known_amax = vec![None; layers.weights.len()];
        st.step_codes = layers.step_codes;
        st.step_coded = vec![false; st.weights.len()];
        st.made_by_step = vec![false; st.weights.len()];
        st.backward = layers.backward;
        Ok(cpu_reserved(layers))
    }

    fn fp8_weights_changed(&self, by_step: bool) {
        let mut st = self.fp8.borrow_mut();
        st.version += 1;
        let version = st.version;
        let Fp8State { step_amax, known_amax, weights, step_coded, made_by_step, .. } = &mut *st;
        for (left, known) in step_amax.iter_mut().zip(known_amax.iter_mut()) {
            match (*left, by_step) {
                (_, false) => *left = None,
                (Some(a), true) => *known = Some((a, version)),
                (None, true) => {}
            }
        }
        // The cached weights the step wrote are this version's (nothing wrote the parameters since).
        for ((w, coded), by) in weights.iter_mut().zip(step_coded.iter_mut()).zip(made_by_step.iter_mut()) {
            if !by_step {
                *coded = false;
            }
            *by = *coded;
            if *coded {
                w.1 = Some(version);
            }
        }
    }

    fn fp8_amax_into(&self, x: &Vec<f32>, n: usize, sink: AmaxSink) -> BResult<()> {
        self.leave_amax(Some(sink), &x[..n])
    }

    fn matmul_fwd(
        &self,
        out: &mut Vec<f32>,
        inp: &Vec<f32>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        let (inp, w, bias) = (&inp[..n * c], at(p.buf, p.at.w), p.at.b.map(|b| at(p.buf, b)));
        if p.at.fp8(s) {
            let mut st = self.fp8.borrow_mut();
            let ax = amax(inp);
            let sx = Fp8Format::E4M3.scale(ax);
            if let Some(l) = p.at.fp8 {
                st.layer(l)?;
                if l.input_amax_ready {
                    st.take_sink(l, 0, ax)?;
                }
                st.input_amax[l.index] = ax;
                if l.keeps_input {
                    let kept = st.kept_codes(l, n * c)?;
                    for (k, &x) in kept.0.iter_mut().zip(inp) {
                        *k = Fp8Format::E4M3.encode(x * sx);
                    }
                    kept.1 = true;
                }
            }
            let (xq, wq) = (quantized_with(inp, Fp8Format::E4M3, sx), st.weight(p.at.fp8, w)?);
            matmul_forward(&mut out[..n * oc], &xq, &wq, bias, n, c, oc);
            return Ok(());
        }
        matmul_forward(&mut out[..n * oc], inp, w, bias, n, c, oc);
        Ok(())
    }
    fn matmul_bwd(
        &self,
        dinp: &mut Vec<f32>,
        g: WeightGrads<'_, Self, LinearLocs>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        self.linear_bwd(dinp, g, dout, Some(inp), p, s)
    }

    fn matmul_residual_fwd_of_gelu(
        &self,
        out: &mut Vec<f32>,
        res: &Vec<f32>,
        pre: &Vec<f32>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
        tmp: &mut Vec<f32>,
    ) -> BResult<()> {
        let MatShape { n, c, .. } = s;
        p.at.check_input_made_in_cast(s, InputMadeInCast::Gelu)?;
        if !p.at.fp8.is_some_and(|l| l.input_amax_ready) {
            self.fp8.borrow_mut().casts_without_amax += 1;
        }
        // The GPU never writes GELU's output; here it is per-call scratch, quantized (with
        // the amax its producer left, checked, or found here) as any FP8 input is.
        let mut act = vec![0.0; n * c];
        super::activation::gelu_forward(&mut act, &pre[..n * c]);
        self.matmul_residual_fwd(out, res, &act, p, s, tmp)
    }

    fn matmul_fwd_of_norm(
        &self,
        out: &mut Vec<f32>,
        x: &Vec<f32>,
        norm: NormOfInput<'_, Self>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let MatShape { n, c, .. } = s;
        p.at.check_input_made_in_cast(s, InputMadeInCast::Norm)?;
        // The GPU never writes the norm's output; here it is per-call scratch, made again
        // from the input (its statistics checked to be those given), and quantized (with the
        // amax its producer left, checked, or found here) as any FP8 input is.
        let (mut y, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        let same = match &norm {
            NormOfInput::LayerNorm { mean, rstd: given, at: locs } => {
                let mut m = vec![0.0; n];
                let (w, b) = (at(p.buf, locs.w), at(p.buf, locs.b));
                super::layernorm::layernorm_forward(&mut y, &mut m, &mut rstd, &x[..n * c], w, b);
                m[..] == mean[..n] && rstd[..] == given[..n]
            }
            NormOfInput::RmsNorm { rstd: given, w, eps } => {
                let w = at(p.buf, *w);
                super::layernorm::rmsnorm_forward(&mut y, &mut rstd, &x[..n * c], w, *eps);
                rstd[..] == given[..n]
            }
        };
        if !same {
            return Err(BackendError::Device(
                "matmul_fwd_of_norm: the statistics given are not those of the norm's input (a model bug)".into(),
            ));
        }
        self.fp8.borrow_mut().norms_in_casts += 1;
        self.matmul_fwd(out, &y, p, s)
    }

    fn matmul_bwd_of_dgelu(
        &self,
        dinp: &mut Vec<f32>,
        g: WeightGrads<'_, Self, LinearLocs>,
        dact: &mut Vec<f32>,
        x: DgeluOf<'_, Self>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        // The composition (GELU' written, its amax left) is what CUDA's cast computes.
        if p.at.fp8(s) && p.at.fp8.is_some() {
            self.fp8.borrow_mut().casts_without_amax += 1;
        }
        dgelu_then_bwd(self, dinp, g, dact, x, p, s)
    }

    fn matmul_bwd_kept(
        &self,
        dinp: &mut Vec<f32>,
        g: WeightGrads<'_, Self, LinearLocs>,
        dout: &Vec<f32>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        self.linear_bwd(dinp, g, dout, None, p, s)
    }
}

impl CpuBackend {
    /// `matmul_bwd`, or without its input (`None`) `matmul_bwd_kept`: an FP8 layer that
    /// kept its input's codes reads those for dW (the input, where given, is checked to be
    /// the forward's).
    fn linear_bwd(
        &self,
        dinp: &mut [f32],
        g: WeightGrads<'_, Self, LinearLocs>,
        dout: &[f32],
        inp: Option<&Vec<f32>>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        let kept = p.at.fp8.filter(|_| p.at.keeps_input(s));
        if inp.is_none() {
            p.at.check_kept_input(s)?;
        }
        let (dw, mut db) = match g.at.b {
            Some(b) => {
                let (dw, db) = two_mut(g.buf, g.at.w, b);
                (dw, Some(db))
            }
            None => (&mut g.buf[g.at.w.off..g.at.w.end()], None),
        };
        if g.fresh {
            // Written, not added to: `+=` onto zeros gives the same bits.
            dw.fill(0.0);
            db.iter_mut().for_each(|d| d.fill(0.0));
        }
        let (dout, inp, w) = (&dout[..n * oc], inp.map(|x| &x[..n * c]), at(p.buf, p.at.w));
        if p.at.fp8(s) {
            let mut st = self.fp8.borrow_mut();
            if let Some(l) = p.at.fp8.filter(|l| l.grad_amax_ready) {
                st.layer(l)?;
                st.take_sink(l, 1, amax(dout))?;
            }
            let backward = st.backward;
            let gq = quantized(dout, backward.grad_format());
            // The forward's scale where the input is the forward's tensor. The reference
            // checks that promise (an amax is cheap beside the GEMMs): a model whose backward
            // input differs from its forward's would make the GPU's dW wrong unseen.
            let ax = inp.map(amax);
            if let (Some(l), Some(ax)) = (p.at.fp8.filter(|l| !l.input_from_forward && l.input_amax_ready), ax) {
                // A recomputed input whose producer left its amax.
                st.layer(l)?;
                st.take_sink(l, 0, ax)?;
            }
            if let (Some(l), Some(ax)) = (p.at.fp8.filter(|l| l.input_from_forward), ax) {
                st.layer(l)?;
                if st.input_amax[l.index].to_bits() != ax.to_bits() {
                    return Err(BackendError::Device(format!(
                        "FP8 layer {}: the backward's input (amax {ax:e}) is not the tensor its forward \
                         quantized (amax {:e}): a model bug (LinearLocs::input_recomputed)",
                        l.index, st.input_amax[l.index]
                    )));
                }
            }
            backward_dinp(&mut dinp[..n * c], &gq, &st.weight(p.at.fp8, w)?, s);
            if !backward.weight_grad_in_fp8() {
                // `Fp8WeightGrad::Bf16`: dW from the unquantized operands (no layer keeps
                // its input under this recipe: the model asks for none).
                let inp = inp.ok_or_else(|| {
                    BackendError::Device("fp8_weight_grad = \"bf16\" needs the backward's input (a bug)".into())
                })?;
                backward_dw(dw, dout, inp, s);
            } else if let Some(l) = kept {
                st.layer(l)?;
                let inv = 1.0 / Fp8Format::E4M3.scale(st.input_amax[l.index]);
                let codes = st.kept_codes(l, n * c)?;
                if !std::mem::replace(&mut codes.1, false) {
                    return Err(BackendError::Device(format!(
                        "FP8 layer {}: its backward reads the input codes its forward keeps, but no forward \
                         kept any since its last backward (a model bug: Fp8Layer::keeps_input)",
                        l.index
                    )));
                }
                let xq: Vec<f32> = codes.0.iter().map(|&q| Fp8Format::E4M3.decode(q) * inv).collect();
                backward_dw(dw, &gq, &xq, s);
            } else {
                let inp =
                    inp.ok_or_else(|| BackendError::Device("an FP8 backward without its input (a bug)".into()))?;
                let xq = quantized_with(inp, Fp8Format::E4M3, Fp8Format::E4M3.scale(amax(inp)));
                backward_dw(dw, &gq, &xq, s);
            }
            if let Some(db) = db {
                backward_dbias(db, dout, oc);
            }
            return Ok(());
        }
        let inp = inp.ok_or_else(|| BackendError::Device("a bf16 linear backward without its input (a bug)".into()))?;
        matmul_backward(&mut dinp[..n * c], dw, db, dout, inp, w, s);
        Ok(())
    }
}
