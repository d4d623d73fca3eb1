//! The FP8 path's test and timing API: the casts alone (`gpu-timing fp8`), the slots and
//! cached weights read back, and single casts read back for `tests/gpu_kernels.rs`.

use cudarc::driver::CudaSlice;

use super::{Cast, CastOp, Fp8Casts, Prediction, COLSUM_ROWS};
use crate::backend::cuda::launch::bad;
use crate::backend::cuda::CudaBackend;
use crate::backend::fp8::ScaleSlot;
use crate::backend::{AmaxSink, BResult, Fp8Format, MatShape};

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
        let check = crate::backend::cuda::launch::check;
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
    pub(super) fn fp8_slot_amax(&self, slot: usize) -> BResult<f32> {
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
        crate::backend::cuda::launch::check("fp8_cast_check x", x.len(), off, n)?;
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
        crate::backend::cuda::launch::check("fp8_predicted_cast_check x", x.len(), 0, n)?;
        if !(rows.is_multiple_of(16) && cols.is_multiple_of(16)) {
            return Err(bad(format!("fp8_predicted_cast_check: {rows} × {cols} is not a multiple of 16 both ways")));
        }
        let op = match made {
            PredictedInput::Plain => CastOp::None,
            PredictedInput::Gelu => CastOp::Gelu,
            PredictedInput::Dgelu(pre) => {
                crate::backend::cuda::launch::check("fp8_predicted_cast_check pre", pre.len(), 0, n)?;
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
