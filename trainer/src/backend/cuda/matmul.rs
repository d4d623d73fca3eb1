//! Linear layers on the GPU (twin of cpu/matmul.rs): the GEMMs are cuBLASLt
//! (`cublaslt/`), the bias gradient and the operand staging are kernels in matmul.cu.
//!
//! Row-major `X[r, c]` is column-major `Xᵀ` with leading dimension `c`, so with
//! `W[oc, c]`, `inp[n, c]`, `dout[n, oc]` (all row-major):
//! - forward  `outᵀ(oc×n) = (Wᵀ)ᵀ·inpᵀ`: A = W (stored c×oc), op T; B = inp (c×n), op N;
//! - `dinpᵀ(c×n) = Wᵀ(c×oc)·doutᵀ(oc×n)`: A = W (c×oc), op N; B = dout (oc×n), op N;
//! - `dWᵀ(c×oc) += inpᵀ(c×n)·dout(n×oc)`: A = inp (c×n), op N; B = dout (oc×n), op T.
//!
//! The MLP's GELU rides in the epilogues (`fused_matmul_gelu_fwd`: GELU_AUX_BIAS keeps
//! the pre-activation as aux; `fused_matmul_bwd_dgelu`: DGELU reads it back).
//!
//! A layer in FP8 with an eligible shape (`LinearLocs::fp8`) goes to `fp8.rs` at the top
//! of each op, after the same checks; the bf16 path below is untouched by it.

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::cublaslt::{Act, Gemm, OutType};
use super::fp8::{CastOp, FwdEpilogue, NormPtrs};
use super::kernels::{no_big_smem, no_defines, KernelFile};
use super::launch::{bad, cfg, check, check_loc, to_i32};
use super::reduce::Split;
use super::CudaBackend;
use crate::backend::{
    dgelu_then_bwd, AmaxSink, BResult, BackendError, DgeluOf, Fp8Bytes, Fp8Layers, Fp8Predictions, GeluActs,
    GemmEnvironment, GemmTuning, GemmTuningTable, InputMadeInCast, LinearLocs, Loc, MatShape, MatmulOps, NormOfInput,
    OnMismatch, TunedGemm, WeightGrads, Weights,
};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "matmul",
    src: include_str!("matmul.cu"),
    functions: &["bias_grad_partial", "copy_rows_bf16"],
    big_smem: no_big_smem,
    defines: no_defines,
};

/// Rows per chunk of the bias gradient's partial column sums (fixed: same bits on every GPU).
const BIAS_ROWS_PER_CHUNK: usize = 256;
/// A linear layer with an odd output size is staged through zero-padded buffers, the
/// activations in row chunks of at most this many bytes (see `stage_pad`).
const STAGE_BYTES: usize = 256 << 20;

/// `rows` rows of `src` (leading dimension `src_ld`, `cols` used) into `dst` (`dst_ld`),
/// zero-filling `dst` columns `cols..zero_to`.
struct RowCopy {
    dst: u64,
    dst_ld: usize,
    src: u64,
    src_ld: usize,
    rows: usize,
    cols: usize,
    zero_to: usize,
}

/// Device pointers of one linear backward, every range already checked.
pub(super) struct BwdPtrs {
    pub dinp: u64,
    pub dw: u64,
    pub dbias: Option<u64>,
    /// Write dW and dbias instead of adding to them (`WeightGrads::fresh`).
    pub fresh: bool,
    pub dout: u64,
    /// The layer's input; 0 where an FP8 layer kept its codes instead (`matmul_bwd_kept`).
    pub inp: u64,
    pub w: u64,
    /// An FP8 layer after an activation: dY is made by dY's cast (and never written) from
    /// `dout` and what this names: GELU'(pre)·dout (`matmul_bwd_of_dgelu`: `dout` is the
    /// gradient of GELU's output). `CastOp::None`: `dout` is dY.
    pub dy_op: CastOp,
    /// With `dy_op`: the sink holding an amax of this step dY's scales with (`scale_ref`),
    /// for its predicted scale.
    pub dy_ref: Option<AmaxSink>,
}

/// The padded output size and rows per chunk to stage a linear layer with `oc` outputs
/// through, or `None` to run it in place. cuBLASLt picks slow kernels when `oc` is odd:
/// the GPT-2 head (V = 50257) took 13.1 ms forward on an H100 against 1.8 ms for
/// V = 50304, and padding only the leading dimension did not help (17 ms). So the weight
/// is padded with zero rows and the activations with zero columns to a multiple of 64;
/// the results are the same. Small layers are not worth the copies.
/// A forward GEMM's parameters: the weight (OC·C elements) and the optional bias (OC) lie
/// inside `params_len`; errors name `op`. The labels are formatted only on failure.
fn check_linear(op: &str, params_len: usize, at: LinearLocs, s: MatShape) -> BResult<()> {
    let MatShape { c, oc, .. } = s;
    let fits = |what: &str, loc: Loc| match check_loc(what, params_len, loc) {
        Ok(()) => Ok(()),
        Err(_) => check_loc(&format!("{op} {what}"), params_len, loc),
    };
    fits("weight", at.w)?;
    if at.w.len != oc * c {
        return Err(bad(format!("{op}: weight has {} elements, expected OC*C = {}", at.w.len, oc * c)));
    }
    if let Some(bl) = at.b {
        fits("bias", bl)?;
        if bl.len != oc {
            return Err(bad(format!("{op}: bias has {} elements, expected OC = {oc}", bl.len)));
        }
    }
    Ok(())
}

fn stage_pad(n: usize, oc: usize) -> Option<(usize, usize)> {
    if oc.is_multiple_of(8) || n * oc < (1 << 20) {
        return None;
    }
    let padded = oc.div_ceil(64) * 64;
    let rows = (STAGE_BYTES / (padded * 2) / 64 * 64).clamp(64, 65_535);
    Some((padded, rows.min(n)))
}

/// `outᵀ(oc×n) = (Wᵀ)ᵀ·inpᵀ (+ bias)` into bf16, optionally `GELU(·)` with the
/// pre-activation kept in `gelu_pre` (the GELU_AUX epilogue).
fn fwd_gemm(w: u64, inp: u64, out: u64, s: MatShape, bias: Option<u64>, gelu_pre: Option<u64>) -> Gemm {
    let MatShape { n, c, oc } = s;
    Gemm {
        transa: true,
        transb: false,
        m: oc,
        n,
        k: c,
        a: w,
        lda: c,
        b: inp,
        ldb: c,
        d: out,
        ldd: oc,
        out: OutType::Bf16,
        beta: 0.0,
        c: None,
        bias,
        act: if gelu_pre.is_some() { Act::Gelu } else { Act::None },
        aux: gelu_pre,
        fp8: None,
    }
}

/// `dinpᵀ(c×n) = W(c×oc stored) · doutᵀ(oc×n)` with `ldb` the leading dimension of dout,
/// optionally `⊙ GELU'(pre)` in the epilogue.
fn dinp_gemm(dinp: u64, dout: u64, w: u64, s: MatShape, ldb: usize, dgelu_pre: Option<u64>) -> Gemm {
    let MatShape { n, c, oc } = s;
    Gemm {
        transa: false,
        transb: false,
        m: c,
        n,
        k: oc,
        a: w,
        lda: c,
        b: dout,
        ldb,
        d: dinp,
        ldd: c,
        out: OutType::Bf16,
        beta: 0.0,
        c: None,
        bias: None,
        act: if dgelu_pre.is_some() { Act::DGelu } else { Act::None },
        aux: dgelu_pre,
        fp8: None,
    }
}

/// `dWᵀ(c×oc) += inpᵀ(c×n) · dout(n×oc)` in fp32 (`beta` = 0 overwrites), with `ldb` the
/// leading dimension of dout.
pub(super) fn dw_gemm(dw: u64, inp: u64, dout: u64, s: MatShape, ldb: usize, beta: f32) -> Gemm {
    let MatShape { n, c, oc } = s;
    Gemm {
        transa: false,
        transb: true,
        m: c,
        n: oc,
        k: n,
        a: inp,
        lda: c,
        b: dout,
        ldb,
        d: dw,
        ldd: c,
        out: OutType::F32,
        beta,
        c: None,
        bias: None,
        act: Act::None,
        aux: None,
        fp8: None,
    }
}

impl CudaBackend {
    pub(super) fn lt_stream(&self) -> cudarc::cublaslt::sys::cudaStream_t {
        self.stream.cu_stream() as _
    }

    /// cuBLASLt uses the calling thread's current context, unlike cudarc's calls, which
    /// set it themselves: the backend may have moved threads since.
    pub(super) fn bind(&self) -> BResult<()> {
        self.ctx.bind_to_thread().map_err(|e| self.err("binding the context", e))
    }

    fn copy_rows(&self, r: RowCopy) -> BResult<()> {
        if r.rows == 0 || r.zero_to == 0 {
            return Ok(());
        }
        let f = self.f("copy_rows_bf16")?;
        let (dl, sl, ci, zi) =
            (r.dst_ld as i64, r.src_ld as i64, to_i32("columns", r.cols)?, to_i32("columns", r.zero_to)?);
        // A grid's y extent is at most 65535: go in slabs of rows.
        for r0 in (0..r.rows).step_by(65_535) {
            let nr = (r.rows - r0).min(65_535);
            let (d, s) = (r.dst + (r0 * r.dst_ld * 2) as u64, r.src + (r0 * r.src_ld * 2) as u64);
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&d).arg(&dl).arg(&s).arg(&sl).arg(&ci).arg(&zi);
            let grid = (r.zero_to.div_ceil(8 * 256) as u32, nr as u32, 1);
            // SAFETY: callers pass buffers holding `rows` rows of their leading dimension.
            unsafe { lb.launch(cfg(grid, (256, 1, 1), 0)) }.map_err(|e| self.launch_err("copy_rows_bf16", e))?;
        }
        Ok(())
    }

    /// A pointer to the bias `params[b]` that cuBLASLt's bias epilogue accepts: the bias
    /// itself when 16-byte aligned, else a copy in scratch (cuBLASLt's heuristic offers
    /// algorithms that then refuse a misaligned bias, seen for odd layer widths).
    pub(super) fn aligned_bias(&self, params: &CudaSlice<bf16>, b: Loc) -> BResult<u64> {
        let p = self.ptr(params, b.off);
        if p.is_multiple_of(16) {
            return Ok(p);
        }
        let dst = self.scratch(&self.scratch_bias, b.len, "bias staging")?;
        let mut cell = self.scratch_bias.borrow_mut();
        let s = cell.as_mut().expect("allocated by scratch()");
        self.stream
            .memcpy_dtod(&params.slice(b.off..b.end()), &mut s.slice_mut(0..b.len))
            .map_err(|e| self.err("staging a bias", e))?;
        Ok(dst)
    }

    /// The weight at `w` (`[oc, c]`, and the bias at `bias`, `[oc]`) padded with zero rows
    /// to `ocp`, in the weight-staging scratch: returns (weight, bias) pointers.
    fn padded_weight(&self, w: u64, bias: Option<u64>, s: MatShape, ocp: usize) -> BResult<(u64, Option<u64>)> {
        let MatShape { c, oc, .. } = s;
        let len = ocp * c + if bias.is_some() { ocp } else { 0 };
        let wp = self.scratch(&self.scratch_bf16_w, len, "padded weight")?;
        // Weight rows, then zero rows: one copy of rows of length c (aligned or not).
        self.copy_rows(RowCopy { dst: wp, dst_ld: c, src: w, src_ld: c, rows: oc, cols: c, zero_to: c })?;
        let zero = wp + (oc * c * 2) as u64;
        self.copy_rows(RowCopy { dst: zero, dst_ld: c, src: wp, src_ld: c, rows: ocp - oc, cols: 0, zero_to: c })?;
        let bp = match bias {
            Some(b) => {
                let bp = wp + (ocp * c * 2) as u64;
                self.copy_rows(RowCopy { dst: bp, dst_ld: ocp, src: b, src_ld: oc, rows: 1, cols: oc, zero_to: ocp })?;
                Some(bp)
            }
            None => None,
        };
        Ok((wp, bp))
    }

    /// Check a linear backward's operands and resolve them to pointers (`inp`: `None` where
    /// an FP8 layer kept its input's codes; the caller checked it did).
    fn bwd_ptrs(
        &self,
        dinp: &mut CudaSlice<bf16>,
        g: WeightGrads<'_, Self, LinearLocs>,
        dout: &CudaSlice<bf16>,
        inp: Option<&CudaSlice<bf16>>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<BwdPtrs> {
        let MatShape { n, c, oc } = s;
        let (grads, dw, dbias, params, w) = (g.buf, g.at.w, g.at.b, p.buf, p.at.w);
        check("matmul_bwd dinp", dinp.len(), 0, n * c)?;
        check("matmul_bwd dout", dout.len(), 0, n * oc)?;
        if let Some(inp) = inp {
            check("matmul_bwd inp", inp.len(), 0, n * c)?;
        }
        check_loc("matmul_bwd weight", params.len(), w)?;
        check_loc("matmul_bwd dw", grads.len(), dw)?;
        if w.len != oc * c || dw.len != oc * c {
            return Err(bad(format!("matmul_bwd: weight and its gradient must have OC*C = {} elements", oc * c)));
        }
        if let Some(bl) = dbias {
            check_loc("matmul_bwd dbias", grads.len(), bl)?;
            if bl.len != oc {
                return Err(bad(format!("matmul_bwd: bias gradient has {} elements, expected OC = {oc}", bl.len)));
            }
        }
        Ok(BwdPtrs {
            dinp: self.ptr_mut(dinp, 0),
            dw: self.ptr_mut(grads, dw.off),
            dbias: dbias.map(|b| self.ptr_mut(grads, b.off)),
            fresh: g.fresh,
            dout: self.ptr(dout, 0),
            inp: inp.map_or(0, |x| self.ptr(x, 0)),
            w: self.ptr(params, w.off),
            dy_op: CastOp::None,
            dy_ref: None,
        })
    }

    /// `matmul_residual_fwd_of_gelu` on checked buffers: `out = res +
    /// act(x) · Wᵀ + bias` in FP8, the activation `op` applied by the input's cast as it reads
    /// `x` (the residual in the GEMM's epilogue, or where cuBLASLt has no FP8 algorithm for
    /// that, the GEMM into `tmp` and the add).
    fn fp8_residual_fwd_of_act(
        &self,
        (out, res, x, tmp): (&mut CudaSlice<bf16>, &CudaSlice<bf16>, &CudaSlice<bf16>, &mut CudaSlice<bf16>),
        op: CastOp,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let (params, LinearLocs { w, b: bias, .. }) = (p.buf, p.at);
        self.bind()?;
        let b = match bias {
            Some(bl) => Some(self.aligned_bias(params, bl)?),
            None => None,
        };
        let (ip, wp) = (self.ptr(x, 0), self.ptr(params, w.off));
        let epi = FwdEpilogue { bias: b, residual: Some(self.ptr(res, 0)), input_op: op, norm: None };
        if self.fp8_fwd((self.ptr_mut(out, 0), ip, wp), s, epi, p.at.fp8)? {
            return Ok(());
        }
        // No FP8 algorithm with the residual in the epilogue: the GEMM, then the add.
        let epi = FwdEpilogue { residual: None, ..epi };
        self.fp8_fwd((self.ptr_mut(tmp, 0), ip, wp), s, epi, p.at.fp8)?;
        crate::backend::ActivationOps::residual_fwd(self, out, res, tmp, s.n * s.oc)
    }

    /// Whether a layer at shape `s` has dY made by its backward's cast
    /// (`matmul_bwd_of_dgelu`): an FP8 layer with its state whose dW is in
    /// FP8 (the cast alone applies the activation's backward; a bf16 dW would need dY written).
    fn fp8_dy_in_cast(&self, at: LinearLocs, s: MatShape) -> bool {
        at.fp8.is_some() && at.fp8(s) && self.fp8_weight_grad_in_fp8()
    }

    /// The backward of a layer whose dY its cast makes (never written in bf16) from `x` (read
    /// where dY would be) as `dy_op` says, its scale predicted with `dy_ref`
    /// (`fp8_dy_in_cast` holds); `inp` the layer's input, `None` where it kept its codes.
    fn fp8_bwd_of_act(
        &self,
        dinp: &mut CudaSlice<bf16>,
        g: WeightGrads<'_, Self, LinearLocs>,
        (x, dy_op, dy_ref): (&CudaSlice<bf16>, CastOp, Option<AmaxSink>),
        inp: Option<&CudaSlice<bf16>>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        if inp.is_none() {
            p.at.check_kept_input(s)?;
        }
        let layer = p.at.fp8;
        let ptr = BwdPtrs { dy_op, dy_ref, ..self.bwd_ptrs(dinp, g, x, inp, p, s)? };
        self.fp8_bwd(ptr, s, layer)
    }

    /// The linear backward on checked pointers, optionally with `dinp ⊙= GELU'(pre)` in the
    /// dinp GEMM's epilogue (`dgelu_pre`; only on the unpadded path, which the caller checked).
    fn linear_bwd(&self, ptr: BwdPtrs, s: MatShape, dgelu_pre: Option<u64>) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        if n == 0 || c == 0 {
            // No rows or no inputs: nothing to add, but a fresh dW / dbias is zero.
            if ptr.fresh {
                // SAFETY: dw holds oc*c floats and dbias oc (checked by bwd_ptrs).
                unsafe { self.zero_f32(ptr.dw, oc * c)? };
                if let Some(db) = ptr.dbias {
                    unsafe { self.zero_f32(db, oc)? };
                }
            }
            return Ok(());
        }
        self.bind()?;
        let stream = self.lt_stream();
        // dW's GEMM adds to it (beta 1), or writes it without reading (beta 0) when fresh.
        let dw_beta = if ptr.fresh { 0.0 } else { 1.0 };
        if oc == 0 {
            // dinp = dout·W with an empty inner dimension is zero.
            // SAFETY: dinp holds n*c bf16 (checked by bwd_ptrs).
            let r = unsafe { cudarc::driver::result::memset_d8_async(ptr.dinp, 0, n * c * 2, self.stream.cu_stream()) };
            return r.map_err(|e| self.err("zeroing dinp", e));
        }
        if let Some((ocp, rows)) = stage_pad(n, oc) {
            if dgelu_pre.is_some() {
                return Err(bad("matmul_bwd: the GELU epilogue needs the unpadded path".into()));
            }
            // Odd output size: dout chunks are copied with zero columns up to ocp, the
            // weight gets zero rows; dW accumulates into a padded fp32 buffer (chunks
            // in order) that is added to the gradient at the end.
            let (wp, _) = self.padded_weight(ptr.w, None, s, ocp)?;
            let tmp = self.scratch(&self.scratch_bf16, rows * ocp, "GEMM staging")?;
            let dwp = self.scratch_f32(ocp * c)?;
            for (i, r0) in (0..n).step_by(rows).enumerate() {
                let nr = rows.min(n - r0);
                let src = ptr.dout + (r0 * oc * 2) as u64;
                self.copy_rows(RowCopy { dst: tmp, dst_ld: ocp, src, src_ld: oc, rows: nr, cols: oc, zero_to: ocp })?;
                let chunk = MatShape { n: nr, c, oc: ocp };
                let dinp = ptr.dinp + (r0 * c * 2) as u64;
                self.lt.gemm(&dinp_gemm(dinp, tmp, wp, chunk, ocp, None), stream)?;
                let inp = ptr.inp + (r0 * c * 2) as u64;
                let beta = if i == 0 { 0.0 } else { 1.0 };
                self.lt.gemm(&dw_gemm(dwp, inp, tmp, chunk, ocp, beta), stream)?;
            }
            // dW (oc rows of c, contiguous) += (fresh: =) the first oc rows of the padded one.
            if ptr.fresh {
                // SAFETY: dw holds oc*c floats (checked by bwd_ptrs); dwp, scratch, ocp*c >= oc*c.
                unsafe { self.copy_f32(ptr.dw, dwp, oc * c)? };
            } else {
                // SAFETY: dw holds oc*c floats (checked by bwd_ptrs); dwp holds ocp*c >= oc*c.
                unsafe { self.add_f32(ptr.dw, dwp, oc * c)? };
            }
        } else {
            self.lt.gemm(&dinp_gemm(ptr.dinp, ptr.dout, ptr.w, s, oc, dgelu_pre), stream)?;
            self.lt.gemm(&dw_gemm(ptr.dw, ptr.inp, ptr.dout, s, oc, dw_beta), stream)?;
        }
        if let Some(db) = ptr.dbias {
            self.bias_grad(db, ptr.dout, n, oc, ptr.fresh)?;
        }
        Ok(())
    }

    /// `db (+)= Σ_rows dout` (`dout` n × oc bf16, checked by the caller), in a fixed order.
    pub(super) fn bias_grad(&self, db: u64, dout: u64, n: usize, oc: usize, fresh: bool) -> BResult<()> {
        let nchunks = n.div_ceil(BIAS_ROWS_PER_CHUNK);
        let partial = self.scratch_f32(nchunks * oc)?;
        let (ni, oci, rpc) = (to_i32("N", n)?, to_i32("OC", oc)?, BIAS_ROWS_PER_CHUNK as i32);
        let f = self.f("bias_grad_partial")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&partial).arg(&dout).arg(&ni).arg(&oci).arg(&rpc);
        // SAFETY: dout holds n*oc; partial holds nchunks*oc floats.
        unsafe { lb.launch(cfg((oc.div_ceil(64) as u32, nchunks as u32, 1), (64, 4, 1), 0)) }
            .map_err(|e| self.launch_err("bias_grad_partial", e))?;
        let split = Split { dst0: db, dst1: db, split: oc, overwrite: fresh };
        self.reduce_partials(split, partial, nchunks, oc)
    }
}

impl MatmulOps for CudaBackend {
    fn set_gemm_tuning(&self, tuning: GemmTuning) {
        self.lt.set_tuning(tuning);
    }

    fn gemm_tuning_report(&self) -> Vec<TunedGemm> {
        self.lt.tuned()
    }

    fn unfused_gemms(&self) -> Vec<String> {
        self.lt.unfused()
    }

    fn gemm_environment(&self) -> Option<GemmEnvironment> {
        let (major, minor) = self.compute_capability;
        Some(GemmEnvironment {
            device: self.gpu_name.clone(),
            compute_capability: [major.max(0) as u32, minor.max(0) as u32],
            cublaslt_version: self.lt.version(),
        })
    }

    fn gemm_choices(&self) -> Option<GemmTuningTable> {
        self.gemm_environment().map(|env| self.lt.choices(env))
    }

    fn use_gemm_choices(&self, table: &GemmTuningTable, origin: &str, on: OnMismatch) -> BResult<usize> {
        let Some(here) = self.gemm_environment() else { return Ok(0) };
        if !table.fits(&here, origin, on).map_err(|e| BackendError::Device(e.to_string()))? {
            return Ok(0);
        }
        self.bind()?;
        self.lt.use_choices(table, &here, origin, on)
    }

    fn prepare_fp8(&self, layers: &Fp8Layers) -> BResult<Fp8Bytes> {
        self.fp8_prepare(layers)
    }

    fn fp8_weights_changed(&self, by_step: bool) {
        self.fp8_new_version(by_step);
    }

    fn fp8_clear_sinks(&self, layers: std::ops::Range<usize>) -> BResult<()> {
        self.fp8_clear_layer_sinks(layers)
    }

    fn fp8_amax_into(&self, x: &Self::Buf, n: usize, sink: AmaxSink) -> BResult<()> {
        check("fp8_amax_into x", x.len(), 0, n)?;
        self.fp8_amax_into_sink(self.ptr(x, 0), n, sink)
    }

    fn fp8_support(&self) -> Result<(), String> {
        self.fp8_supported()
    }

    fn fp8_prediction_counts(&self) -> BResult<Option<Fp8Predictions>> {
        self.fp8_prediction_counts()
    }

    fn matmul_bwd_of_dgelu(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, LinearLocs>,
        dact: &mut Self::Buf,
        x: DgeluOf<'_, Self>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        // dY made by its transposing cast from dact and pre (GELU' applied as it reads them).
        if !self.fp8_dy_in_cast(p.at, s) {
            return dgelu_then_bwd(self, dinp, g, dact, x, p, s);
        }
        check("matmul_bwd_of_dgelu pre", x.pre.len(), 0, s.n * s.oc)?;
        let dy_op = CastOp::Dgelu { pre: self.ptr(x.pre, 0) };
        self.fp8_bwd_of_act(dinp, g, (dact, dy_op, x.scale_ref), x.inp, p, s)
    }

    fn matmul_fwd(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        let (params, LinearLocs { w, b: bias, .. }) = (p.buf, p.at);
        check("matmul_fwd out", out.len(), 0, n * oc)?;
        check("matmul_fwd inp", inp.len(), 0, n * c)?;
        check_linear("matmul_fwd", params.len(), p.at, s)?;
        if n == 0 || oc == 0 {
            return Ok(());
        }
        if c == 0 {
            return Err(bad("matmul_fwd: C = 0".into()));
        }
        if p.at.fp8(s) {
            let bias = bias.map(|bl| self.aligned_bias(params, bl)).transpose()?;
            let epi = FwdEpilogue { bias, ..FwdEpilogue::default() };
            let (op, ip, wp) = (self.ptr_mut(out, 0), self.ptr(inp, 0), self.ptr(params, w.off));
            if !self.fp8_fwd((op, ip, wp), s, epi, p.at.fp8)? {
                return Err(bad(format!("matmul_fwd N{n} C{c} OC{oc}: cuBLASLt has no FP8 GEMM for it")));
            }
            return Ok(());
        }
        self.bind()?;
        if let Some((ocp, rows)) = stage_pad(n, oc) {
            // Odd output size: GEMM with the padded weight into a padded buffer, then
            // copy the real columns out, a chunk of rows at a time.
            let (wp, bp) =
                self.padded_weight(self.ptr(params, w.off), bias.map(|b| self.ptr(params, b.off)), s, ocp)?;
            let tmp = self.scratch(&self.scratch_bf16, rows * ocp, "GEMM staging")?;
            let (ip, op) = (self.ptr(inp, 0), self.ptr_mut(out, 0));
            for r0 in (0..n).step_by(rows) {
                let nr = rows.min(n - r0);
                let g = fwd_gemm(wp, ip + (r0 * c * 2) as u64, tmp, MatShape { n: nr, c, oc: ocp }, bp, None);
                self.lt.gemm(&g, self.lt_stream())?;
                let dst = op + (r0 * oc * 2) as u64;
                self.copy_rows(RowCopy { dst, dst_ld: oc, src: tmp, src_ld: ocp, rows: nr, cols: oc, zero_to: oc })?;
            }
            return Ok(());
        }
        let bias = bias.map(|bl| self.aligned_bias(params, bl)).transpose()?;
        let g = fwd_gemm(self.ptr(params, w.off), self.ptr(inp, 0), self.ptr_mut(out, 0), s, bias, None);
        self.lt.gemm(&g, self.lt_stream())
    }

    fn matmul_bwd(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, LinearLocs>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let (fp8, layer) = (p.at.fp8(s), p.at.fp8);
        let ptr = self.bwd_ptrs(dinp, g, dout, Some(inp), p, s)?;
        if fp8 {
            self.fp8_bwd(ptr, s, layer)?;
            return Ok(());
        }
        self.linear_bwd(ptr, s, None)
    }

    fn matmul_bwd_kept(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, LinearLocs>,
        dout: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        p.at.check_kept_input(s)?;
        let layer = p.at.fp8;
        let ptr = self.bwd_ptrs(dinp, g, dout, None, p, s)?;
        self.fp8_bwd(ptr, s, layer)
    }

    /// `pre = inp·Wᵀ + bias`, `out = GELU(pre)` in one GEMM (GELU_AUX_BIAS epilogue).
    /// `Ok(false)` where that does not apply (padded shapes, no cuBLASLt algorithm).
    fn fused_matmul_gelu_fwd(
        &self,
        pre: &mut Self::Buf,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<bool> {
        let MatShape { n, c, oc } = s;
        let (params, w) = (p.buf, p.at.w);
        let Some(bias) = p.at.b else { return Ok(false) };
        check("matmul_gelu_fwd pre", pre.len(), 0, n * oc)?;
        check("matmul_gelu_fwd out", out.len(), 0, n * oc)?;
        check("matmul_gelu_fwd inp", inp.len(), 0, n * c)?;
        check_loc("matmul_gelu_fwd weight", params.len(), w)?;
        check_loc("matmul_gelu_fwd bias", params.len(), bias)?;
        if w.len != oc * c || bias.len != oc {
            return Err(bad(format!("matmul_gelu_fwd: weight must hold OC*C = {} and bias OC = {oc}", oc * c)));
        }
        // cuBLASLt's heuristic offers GELU epilogues it then refuses to run for aux rows
        // that are not a multiple of 8 elements (seen on H100): those take the two-op path.
        if n == 0 || c == 0 || oc == 0 || !oc.is_multiple_of(8) || stage_pad(n, oc).is_some() {
            return Ok(false);
        }
        // FP8: composed (the GEMM writes pre, gelu_fwd then leaves the output's amax for the
        // next FP8 GEMM, fc2, as it writes it). A GELU epilogue cannot leave that amax, so
        // fused it needs a pass of its own: at 1.5B's fc on an H100, 0.272 ms fused + that
        // pass against 0.189 ms for the plain FP8 GEMM + ~0.075 ms of gelu_fwd (run 19).
        if p.at.fp8(s) {
            return Ok(false);
        }
        self.bind()?;
        let (b, aux) = (Some(self.aligned_bias(params, bias)?), Some(self.ptr_mut(pre, 0)));
        let g = fwd_gemm(self.ptr(params, w.off), self.ptr(inp, 0), self.ptr_mut(out, 0), s, b, aux);
        if !self.lt.supports(&g) {
            return Ok(false);
        }
        self.lt.gemm(&g, self.lt_stream())?;
        Ok(true)
    }

    /// `matmul_residual_fwd` as one GEMM: the residual is cuBLASLt's C (beta = 1, D ≠ C),
    /// so the stream's sum is rounded to bf16 once instead of twice and no residual kernel
    /// runs. `Ok(false)` where the output needs the padded staging (odd OC).
    fn fused_matmul_residual_fwd(
        &self,
        out: &mut Self::Buf,
        res: &Self::Buf,
        inp: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<bool> {
        let MatShape { n, c, oc } = s;
        let (params, LinearLocs { w, b: bias, .. }) = (p.buf, p.at);
        check("matmul_residual_fwd out", out.len(), 0, n * oc)?;
        check("matmul_residual_fwd res", res.len(), 0, n * oc)?;
        check("matmul_residual_fwd inp", inp.len(), 0, n * c)?;
        check_linear("matmul_residual_fwd", params.len(), p.at, s)?;
        if n == 0 || c == 0 || oc == 0 || stage_pad(n, oc).is_some() {
            return Ok(false);
        }
        self.bind()?;
        let b = match bias {
            Some(bl) => Some(self.aligned_bias(params, bl)?),
            None => None,
        };
        if p.at.fp8(s) {
            let epi = FwdEpilogue { bias: b, residual: Some(self.ptr(res, 0)), ..FwdEpilogue::default() };
            return self.fp8_fwd((self.ptr_mut(out, 0), self.ptr(inp, 0), self.ptr(params, w.off)), s, epi, p.at.fp8);
        }
        let mut g = fwd_gemm(self.ptr(params, w.off), self.ptr(inp, 0), self.ptr_mut(out, 0), s, b, None);
        g.beta = 1.0;
        g.c = Some(self.ptr(res, 0));
        if !self.lt.supports(&g) {
            return Ok(false);
        }
        self.lt.gemm(&g, self.lt_stream())?;
        Ok(true)
    }

    fn matmul_residual_fwd_of_gelu(
        &self,
        out: &mut Self::Buf,
        res: &Self::Buf,
        pre: &Self::Buf,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
        tmp: &mut Self::Buf,
    ) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        check("matmul_residual_fwd_of_gelu out", out.len(), 0, n * oc)?;
        check("matmul_residual_fwd_of_gelu res", res.len(), 0, n * oc)?;
        check("matmul_residual_fwd_of_gelu pre", pre.len(), 0, n * c)?;
        check("matmul_residual_fwd_of_gelu tmp", tmp.len(), 0, n * oc)?;
        check_linear("matmul_residual_fwd_of_gelu", p.buf.len(), p.at, s)?;
        p.at.check_input_made_in_cast(s, InputMadeInCast::Gelu)?;
        self.fp8_residual_fwd_of_act((out, res, pre, tmp), CastOp::Gelu, p, s)
    }

    fn matmul_fwd_of_norm(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        norm: NormOfInput<'_, Self>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        let (params, LinearLocs { w, b: bias, .. }) = (p.buf, p.at);
        check("matmul_fwd_of_norm out", out.len(), 0, n * oc)?;
        check("matmul_fwd_of_norm x", x.len(), 0, n * c)?;
        check("matmul_fwd_of_norm rstd", norm.rstd().len(), 0, n)?;
        let (mean, nb) = match &norm {
            NormOfInput::LayerNorm { mean, at, .. } => {
                check("matmul_fwd_of_norm mean", mean.len(), 0, n)?;
                (self.ptr(mean, 0), Some(at.b))
            }
            NormOfInput::RmsNorm { .. } => (0, None),
        };
        for l in [Some(norm.weight()), nb].into_iter().flatten() {
            check_loc("matmul_fwd_of_norm norm parameters", params.len(), l)?;
            if l.len != c {
                return Err(bad(format!("matmul_fwd_of_norm: the norm's parameters must have C = {c} elements")));
            }
        }
        check_linear("matmul_fwd_of_norm", params.len(), p.at, s)?;
        p.at.check_input_made_in_cast(s, InputMadeInCast::Norm)?;
        self.bind()?;
        let b = match bias {
            Some(bl) => Some(self.aligned_bias(params, bl)?),
            None => None,
        };
        let np = NormPtrs {
            mean,
            rstd: self.ptr(norm.rstd(), 0),
            w: self.ptr(params, norm.weight().off),
            b: nb.map_or(0, |l| self.ptr(params, l.off)),
        };
        let epi = FwdEpilogue { bias: b, residual: None, input_op: CastOp::None, norm: Some(np) };
        self.fp8_fwd((self.ptr_mut(out, 0), self.ptr(x, 0), self.ptr(params, w.off)), s, epi, p.at.fp8)?;
        Ok(())
    }

    /// `matmul_bwd_dgelu` with GELU' in the dinp GEMM's epilogue (DGELU). `Ok(false)` where
    /// that does not apply.
    fn fused_matmul_bwd_dgelu(
        &self,
        dpre: &mut Self::Buf,
        g: WeightGrads<'_, Self, LinearLocs>,
        dout: &Self::Buf,
        x: GeluActs<'_, Self>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<bool> {
        let GeluActs { act, pre } = x;
        let MatShape { n, c, oc } = s;
        check("matmul_bwd_dgelu pre", pre.len(), 0, n * c)?;
        check("matmul_bwd_dgelu dpre", dpre.len(), 0, n * c)?;
        check_loc("matmul_bwd_dgelu weight", p.buf.len(), p.at.w)?;
        if n == 0 || c == 0 || oc == 0 || !c.is_multiple_of(8) || stage_pad(n, oc).is_some() || p.at.w.len != oc * c {
            return Ok(false);
        }
        // FP8: composed (matmul_bwd, then GELU' in place, which leaves dpre's amax for the
        // layer before). cuBLASLt does run an FP8 GEMM with the DGELU epilogue, but as the
        // GEMM and then a generic pass over its output (`cublasLt::globalKernel`): measured
        // on an H100 at GPT-2 1.5B's fc2 (8192 × 6400 ← 1600), 0.970 ms against 0.402 ms
        // for the plain FP8 dgrad and wgrad (gpu-timing fp8; BENCHMARKS.md run 19).
        if p.at.fp8(s) {
            return Ok(false);
        }
        self.bind()?;
        let pre_ptr = self.ptr(pre, 0);
        let probe =
            dinp_gemm(self.ptr_mut(dpre, 0), self.ptr(dout, 0), self.ptr(p.buf, p.at.w.off), s, oc, Some(pre_ptr));
        if !self.lt.supports(&probe) {
            return Ok(false);
        }
        let ptr = self.bwd_ptrs(dpre, g, dout, Some(act), p, s)?;
        self.linear_bwd(ptr, s, Some(pre_ptr))?;
        Ok(true)
    }
}
