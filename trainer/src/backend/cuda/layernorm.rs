//! LayerNorm on the GPU (twin of cpu/layernorm.rs; kernels in layernorm.cu). The backward
//! writes per-chunk partial weight/bias gradients that `reduce_partials` adds in order,
//! so the result is the same bits on every run.

use cudarc::driver::PushKernelArg;

use super::kernels::KernelFile;
use super::launch::{bad, cfg, check, check_loc, to_i32};
use super::reduce::Split;
use super::CudaBackend;
use crate::backend::cpu::LN_EPS;
use crate::backend::{BResult, LayerNormOps, LnSaved, LnStats, NormLocs, Rows, WeightGrads, Weights};

/// Rows per block in the general LayerNorm backward. A constant (not derived from the
/// GPU), so results are the same bits on every GPU.
const LN_ROWS_PER_BLOCK: usize = 32;
/// The warp backward: rows per warp, warps per block, and 16-byte chunks of 8 values
/// each lane holds per row (`LN_BWD_MAXJ` in the kernel), which bounds the row width.
const LN_ROWS_PER_WARP: usize = 8;
const LN_WARPS_PER_BLOCK: usize = 4;
const LN_BWD_MAXJ: usize = 8;
const LN_BWD_WARP_MAX_C: usize = LN_BWD_MAXJ * 8 * 32;
/// The wide backward (C > LN_BWD_WARP_MAX_C): warps per block (a block per row group, the
/// row's sums across its warps) and rows per block; it holds rows up to this width.
const LN_WIDE_WARPS: usize = 4;
const LN_WIDE_ROWS_PER_BLOCK: usize = 8;
const LN_BWD_WIDE_MAX_C: usize = LN_BWD_MAXJ * 8 * 32 * LN_WIDE_WARPS;

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "layernorm",
    src: include_str!("layernorm.cu"),
    functions: &["layernorm_fwd", "layernorm_bwd", "layernorm_bwd_warp", "layernorm_bwd_wide"],
    big_smem: |f| f == "layernorm_bwd",
    defines: || {
        vec![
            ("LN_EPS", format!("{LN_EPS:?}f")),
            ("LN_BWD_MAXJ", LN_BWD_MAXJ.to_string()),
            ("LN_WIDE_WARPS", LN_WIDE_WARPS.to_string()),
        ]
    },
};

impl LayerNormOps for CudaBackend {
    fn layernorm_fwd(
        &self,
        out: &mut Self::Buf,
        stats: LnStats<'_, Self>,
        inp: &Self::Buf,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
    ) -> BResult<()> {
        let (Rows { n, c }, LnStats { mean, rstd }, (params, NormLocs { w, b: bias })) = (r, stats, (p.buf, p.at));
        check("layernorm_fwd out", out.len(), 0, n * c)?;
        check("layernorm_fwd inp", inp.len(), 0, n * c)?;
        check("layernorm_fwd mean", mean.len(), 0, n)?;
        check("layernorm_fwd rstd", rstd.len(), 0, n)?;
        check_loc("layernorm_fwd weight", params.len(), w)?;
        check_loc("layernorm_fwd bias", params.len(), bias)?;
        if w.len != c || bias.len != c {
            return Err(bad(format!(
                "layernorm_fwd: weight and bias must have C = {c} elements, have {} and {}",
                w.len, bias.len
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let (o, mp, rp, x, wp, bp) = (
            self.ptr_mut(out, 0),
            self.ptr_mut(mean, 0),
            self.ptr_mut(rstd, 0),
            self.ptr(inp, 0),
            self.ptr(params, w.off),
            self.ptr(params, bias.off),
        );
        let (ni, ci) = (to_i32("N", n)?, to_i32("C", c)?);
        let f = self.f("layernorm_fwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&mp).arg(&rp).arg(&x).arg(&wp).arg(&bp).arg(&ni).arg(&ci);
        // SAFETY: all ranges checked above; one warp per row, rows < n.
        unsafe { lb.launch(cfg((n.div_ceil(8) as u32, 1, 1), (256, 1, 1), 0)) }
            .map_err(|e| self.launch_err("layernorm_fwd", e))?;
        Ok(())
    }

    fn layernorm_bwd(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, NormLocs>,
        dout: &Self::Buf,
        saved: LnSaved<'_, Self>,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
    ) -> BResult<()> {
        let Rows { n, c } = r;
        let (grads, NormLocs { w: dw, b: db }) = (g.buf, g.at);
        let (params, w) = (p.buf, p.at.w);
        let LnSaved { inp, mean, rstd } = saved;
        check("layernorm_bwd dinp", dinp.len(), 0, n * c)?;
        check("layernorm_bwd dout", dout.len(), 0, n * c)?;
        check("layernorm_bwd inp", inp.len(), 0, n * c)?;
        check("layernorm_bwd mean", mean.len(), 0, n)?;
        check("layernorm_bwd rstd", rstd.len(), 0, n)?;
        check_loc("layernorm_bwd weight", params.len(), w)?;
        check_loc("layernorm_bwd dw", grads.len(), dw)?;
        check_loc("layernorm_bwd db", grads.len(), db)?;
        if w.len != c || dw.len != c || db.len != c {
            return Err(bad(format!("layernorm_bwd: weight and gradients must have C = {c} elements")));
        }
        if n == 0 {
            return Ok(());
        }
        let (dx, dy, x, wp, mp, rp) = (
            self.ptr_mut(dinp, 0),
            self.ptr(dout, 0),
            self.ptr(inp, 0),
            self.ptr(params, w.off),
            self.ptr(mean, 0),
            self.ptr(rstd, 0),
        );
        let s = Split { dst0: self.ptr_mut(grads, dw.off), dst1: self.ptr_mut(grads, db.off), split: c };
        let aligned = c.is_multiple_of(8) && [dx, dy, x, wp].iter().all(|p| p.is_multiple_of(16));
        // Every variant writes partial dw/db rows of rows_per_part rows each, which
        // reduce_partials then adds in order.
        let k = if aligned && c <= LN_BWD_WARP_MAX_C {
            // Fast path: a warp per LN_ROWS_PER_WARP rows, 16-byte loads, no block barriers;
            // warp g writes partial row g (warps past the last row return before writing).
            LnBwdKernel {
                name: "layernorm_bwd_warp",
                rows_per_part: LN_ROWS_PER_WARP,
                parts_per_block: LN_WARPS_PER_BLOCK,
                threads: 32 * LN_WARPS_PER_BLOCK,
                smem: 0,
            }
        } else if aligned && c <= LN_BWD_WIDE_MAX_C {
            // Wide rows (GPT widths 2560 to 8192): a block of warps per LN_WIDE_ROWS_PER_BLOCK
            // rows, 16-byte loads, one barrier per row; block k writes partial row k.
            LnBwdKernel {
                name: "layernorm_bwd_wide",
                rows_per_part: LN_WIDE_ROWS_PER_BLOCK,
                parts_per_block: 1,
                threads: 32 * LN_WIDE_WARPS,
                smem: 0,
            }
        } else {
            let smem = 2 * c * 4;
            if smem + 256 > self.kernels.max_smem {
                return Err(bad(format!(
                    "layernorm_bwd: C = {c} needs {smem} bytes of shared memory, more than the device's {}",
                    self.kernels.max_smem
                )));
            }
            LnBwdKernel {
                name: "layernorm_bwd",
                rows_per_part: LN_ROWS_PER_BLOCK,
                parts_per_block: 1,
                threads: 256,
                smem,
            }
        };
        let nparts = n.div_ceil(k.rows_per_part);
        let partial = self.scratch_f32(nparts * 2 * c)?;
        let (ni, ci, rpp) = (to_i32("N", n)?, to_i32("C", c)?, k.rows_per_part as i32);
        let f = self.f(k.name)?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&dx).arg(&partial).arg(&dy).arg(&x).arg(&wp).arg(&mp).arg(&rp).arg(&ni).arg(&ci).arg(&rpp);
        let blocks = nparts.div_ceil(k.parts_per_block) as u32;
        // SAFETY: ranges (and, for the 16-byte variants, alignment) checked above; partial
        // holds nparts*2C floats and each writer writes only its own partial row < nparts.
        unsafe { lb.launch(cfg((blocks, 1, 1), (k.threads as u32, 1, 1), k.smem)) }
            .map_err(|e| self.launch_err(k.name, e))?;
        self.reduce_partials(s, partial, nparts, 2 * c)
    }
}

/// Which LayerNorm backward kernel runs, and its launch shape.
struct LnBwdKernel {
    name: &'static str,
    /// Rows summed into one partial dw/db row.
    rows_per_part: usize,
    /// Partial rows one block writes (one per warp for the warp kernel).
    parts_per_block: usize,
    threads: usize,
    smem: usize,
}
