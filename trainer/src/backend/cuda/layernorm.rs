//! LayerNorm on the GPU (twin of cpu/layernorm.rs; kernels in layernorm.cu). The backward
//! writes per-chunk partial weight/bias gradients that `reduce_partials` adds in order,
//! so the result is the same bits on every run.

use cudarc::driver::PushKernelArg;

use super::kernels::KernelFile;
use super::launch::{bad, cfg, check, check_loc, to_i32};
use super::reduce::Split;
use super::CudaBackend;
use crate::backend::cpu::LN_EPS;
use crate::backend::{BResult, LayerNormOps, LnSaved, LnStats, Loc, NormLocs, RmsSaved, Rows, WeightGrads, Weights};

/// Rows per block in the general LayerNorm backward. A constant (not derived from the
/// GPU), so results are the same bits on every GPU.
const LN_ROWS_PER_BLOCK: usize = 32;
/// The fast backward (`layernorm_bwd_j{J}w{W}`, C % 8 == 0 and C <= LN_BWD_FAST_MAX_C,
/// 16-byte aligned rows): W warps per block, J chunks of 8 values a thread; the first
/// instance whose 256·W·J columns hold the row runs.
const LN_BWD_FAST: [(&str, usize, usize); 8] = [
    ("layernorm_bwd_j1w1", 1, 1),
    ("layernorm_bwd_j1w2", 1, 2),
    ("layernorm_bwd_j1w3", 1, 3),
    ("layernorm_bwd_j1w4", 1, 4),
    ("layernorm_bwd_j2w4", 2, 4),
    ("layernorm_bwd_j2w8", 2, 8),
    ("layernorm_bwd_j2w12", 2, 12),
    ("layernorm_bwd_j2w16", 2, 16),
];
const LN_BWD_FAST_MAX_C: usize = 8192;
/// Row slots in the fast backward's shared-memory ring: the pair of rows being worked on and
/// the next pair, whose copies are in flight meanwhile.
const LN_BWD_SLOTS: usize = 4;
/// The most rows one block of the fast backward runs (`ln_fast_rows_per_block`): its rows'
/// statistics are staged in shared memory.
const LN_BWD_MAX_ROWS: usize = 64;

/// Rows per block of the fast backward: about 512 blocks (a partial dw/db row each, which
/// `reduce_partials` adds), 8 to 64 rows. From N alone, so the partial sums — and the
/// result's bits — are the same on every GPU.
fn ln_fast_rows_per_block(n: usize) -> usize {
    (n / 512).next_power_of_two().clamp(8, LN_BWD_MAX_ROWS)
}

const FUNCTIONS: [&str; 10] = {
    let mut f = ["layernorm_fwd"; 10];
    f[1] = "layernorm_bwd";
    let mut i = 0;
    while i < 8 {
        f[2 + i] = LN_BWD_FAST[i].0;
        i += 1;
    }
    f
};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "layernorm",
    src: include_str!("layernorm.cu"),
    functions: &FUNCTIONS,
    // The general kernel's dw/db accumulators (2C floats) and the fast ones' row rings pass
    // 48 KiB at the wider rows.
    big_smem: |f| f.starts_with("layernorm_bwd"),
    defines: || {
        vec![
            ("LN_EPS", format!("{LN_EPS:?}f")),
            ("LN_BWD_SLOTS", LN_BWD_SLOTS.to_string()),
            ("LN_BWD_MAX_ROWS", LN_BWD_MAX_ROWS.to_string()),
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
            if g.fresh {
                // No rows: a fresh dw / db is zero.
                // SAFETY: both ranges checked above.
                unsafe {
                    self.zero_f32(self.ptr_mut(grads, dw.off), c)?;
                    self.zero_f32(self.ptr_mut(grads, db.off), c)?;
                }
            }
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
        let (dst0, dst1) = (self.ptr_mut(grads, dw.off), self.ptr_mut(grads, db.off));
        let s = Split { dst0, dst1, split: c, overwrite: g.fresh };
        let aligned = c.is_multiple_of(8) && [dx, dy, x, wp].iter().all(|p| p.is_multiple_of(16));
        // Every variant writes partial dw/db rows of rows_per_part rows each, which
        // reduce_partials then adds in order.
        let fast = LN_BWD_FAST.iter().find(|(_, j, w)| 256 * w * j >= c);
        let k = if let (true, Some(&(name, j, warps))) = (aligned && c <= LN_BWD_FAST_MAX_C, fast) {
            // Fast path: a block of warps per run of rows, two rows at a time, the next
            // two rows' copies in flight during their arithmetic; block k writes partial row k.
            let rows = ln_fast_rows_per_block(n);
            let threads = 32 * warps;
            let smem = LN_BWD_SLOTS * 3 * j * threads * 16;
            // Static: the pair sums and the block's rows' statistics.
            LnBwdKernel { name, rows_per_part: rows, threads, smem, static_smem: 1024 }
        } else {
            // dw/db accumulators (2C floats); static: a block reduction's 32 floats.
            LnBwdKernel {
                name: "layernorm_bwd",
                rows_per_part: LN_ROWS_PER_BLOCK,
                threads: 256,
                smem: 2 * c * 4,
                static_smem: 256,
            }
        };
        if k.smem + k.static_smem > self.kernels.max_smem {
            return Err(bad(format!(
                "layernorm_bwd: C = {c} needs {} bytes of shared memory ({}), more than the device's {}",
                k.smem, k.name, self.kernels.max_smem
            )));
        }
        let nparts = n.div_ceil(k.rows_per_part);
        let partial = self.scratch_f32(nparts * 2 * c)?;
        let (ni, ci, rpp) = (to_i32("N", n)?, to_i32("C", c)?, k.rows_per_part as i32);
        let f = self.f(k.name)?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&dx).arg(&partial).arg(&dy).arg(&x).arg(&wp).arg(&mp).arg(&rp).arg(&ni).arg(&ci).arg(&rpp);
        let blocks = nparts as u32;
        // SAFETY: ranges (and, for the 16-byte variants, alignment) checked above; partial
        // holds nparts*2C floats and each writer writes only its own partial row < nparts.
        unsafe { lb.launch(cfg((blocks, 1, 1), (k.threads as u32, 1, 1), k.smem)) }
            .map_err(|e| self.launch_err(k.name, e))?;
        self.reduce_partials(s, partial, nparts, 2 * c)
    }
    fn rmsnorm_fwd(
        &self,
        _out: &mut Self::Buf,
        _rstd: &mut Self::F32,
        _inp: &Self::Buf,
        _p: Weights<'_, Self, Loc>,
        _r: Rows,
        _eps: f32,
    ) -> BResult<()> {
        Err(bad("rmsnorm_fwd PENDING".into()))
    }
    fn rmsnorm_bwd(
        &self,
        _dinp: &mut Self::Buf,
        _g: WeightGrads<'_, Self, Loc>,
        _dout: &Self::Buf,
        _saved: RmsSaved<'_, Self>,
        _p: Weights<'_, Self, Loc>,
        _r: Rows,
    ) -> BResult<()> {
        Err(bad("rmsnorm_bwd PENDING".into()))
    }
}

/// Which LayerNorm backward kernel runs, and its launch shape.
struct LnBwdKernel {
    name: &'static str,
    /// Rows summed into one partial dw/db row: one block's rows (the kernel's last argument).
    rows_per_part: usize,
    threads: usize,
    /// Dynamic shared memory, and a bound on the kernel's static shared memory beside it.
    smem: usize,
    static_smem: usize,
}
