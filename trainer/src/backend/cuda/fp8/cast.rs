//! The FP8 casts of `fp8.cu`: `fp8_cast_bf16` as laid out, `fp8_cast_transpose_bf16`
//! (both layouts, an activation or a norm applied as it reads, column sums, a predicted
//! scale then its check).

use cudarc::driver::PushKernelArg;

use super::{Cast, CastOp, NormPtrs, Prediction, SCALE_CHECK, SCALE_OF_AMAX, SCALE_PREDICTED, TILE_C, TILE_R};
use crate::backend::cuda::launch::{bad, cfg, to_i32, BLOCK};
use crate::backend::cuda::CudaBackend;
use crate::backend::BResult;

impl CudaBackend {
    /// Cast `c.x` with the scale of the amax already in `c.slot` (see [`Cast`]).
    ///
    /// # Safety
    /// `x` holds `rows·cols` bf16; `dst` and `dst_t` (16-byte aligned) as many bytes; the
    /// slot holds the tensor's amax.
    pub(super) unsafe fn fp8_cast(&self, c: Cast) -> BResult<()> {
        // SAFETY: the caller's promises; no column sums.
        unsafe { self.fp8_cast_colsum(c, 0) }
    }

    /// [`CudaBackend::fp8_cast`], and for a transposing cast with `colsum` not 0 also the
    /// column sums of `c.x` per [`COLSUM_ROWS`] rows into `colsum` (f32,
    /// `[rows.div_ceil(COLSUM_ROWS), cols]`; see `fp8_cast_transpose_bf16`).
    ///
    /// # Safety
    /// As [`CudaBackend::fp8_cast`]; `colsum` (unless 0) holds that many floats.
    pub(super) unsafe fn fp8_cast_colsum(&self, c: Cast, colsum: u64) -> BResult<()> {
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
    pub(super) unsafe fn fp8_quantize(&self, c: Cast) -> BResult<()> {
        // SAFETY: the caller's promises, passed on.
        unsafe {
            self.fp8_amax(c.x, c.rows * c.cols, c.slot)?;
            self.fp8_cast(c)
        }
    }
}
