//! The GEMMs of an FP8 linear layer through cuBLASLt: the forward (`fp8_fwd`: bias,
//! residual, GELU or a norm applied by the input's cast) and both backward GEMMs
//! (`fp8_bwd`: dX and dW, with the bias gradient from dY's cast's column sums).

use super::{Cast, CastOp, FwdEpilogue, COLSUM_ROWS};
use crate::backend::cuda::cublaslt::{Act, Fp8Gemm, Gemm, OutType};
use crate::backend::cuda::launch::bad;
use crate::backend::cuda::matmul::BwdPtrs;
use crate::backend::cuda::reduce::Split;
use crate::backend::cuda::CudaBackend;
use crate::backend::{AmaxSink, BResult, Fp8Format, Fp8Layer, MatShape};

impl CudaBackend {
    /// The forward `out = inp · Wᵀ` (+ the epilogue's bias or residual) in FP8, for an
    /// eligible shape (`fp8::eligible`), with `layer`'s state where it has one (its input's
    /// scale kept for its backward, its cached weight). `Ok(false)`, with nothing run but a
    /// stale cached weight's cast, where cuBLASLt has no FP8 algorithm for this epilogue
    /// (callers of a fused variant then compose it).
    pub(in crate::backend::cuda) fn fp8_fwd(
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
    pub(in crate::backend::cuda) fn fp8_bwd(&self, ptr: BwdPtrs, s: MatShape, layer: Option<Fp8Layer>) -> BResult<()> {
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
            self.lt.gemm(&crate::backend::cuda::matmul::dw_gemm(ptr.dw, ptr.inp, ptr.dout, s, oc, beta), stream)?;
        }
        if let (Some(db), None) = (ptr.dbias, fused_db) {
            self.bias_grad(db, ptr.dout, n, oc, ptr.fresh)?;
        }
        Ok(())
    }
}
