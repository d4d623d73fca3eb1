//! LayerNorm and RMSNorm on the GPU (twin of cpu/layernorm.rs; kernels in layernorm.cu).
//! The backwards write per-chunk partial weight (and bias) gradients that `reduce_partials`
//! adds in order, so the result is the same bits on every run. RMSNorm's backward is
//! LayerNorm's kernels with a template flag (no mean, no bias, one row sum instead of two),
//! picked and launched by the same code ([`CudaBackend::norm_bwd`]); its forward keeps each
//! row in registers (one read of x, one write).

use cudarc::driver::PushKernelArg;

use super::kernels::KernelFile;
use super::launch::{bad, cfg, check, check_loc, to_i32};
use super::reduce::Split;
use super::CudaBackend;
use crate::backend::cpu::LN_EPS;
use crate::backend::{
    AmaxSink, BResult, Device, LayerNormOps, LnSaved, LnStats, Loc, NormLocs, RmsSaved, Rows, WeightGrads, Weights,
};

/// Rows per block in the general backward. A constant (not derived from the GPU), so
/// results are the same bits on every GPU.
const LN_ROWS_PER_BLOCK: usize = 32;
/// The fast backwards (`layernorm_bwd_j{J}w{W}` and `rmsnorm_bwd_j{J}w{W}`: one template,
/// C % 8 == 0 and C <= LN_BWD_FAST_MAX_C, 16-byte aligned rows): W warps per block, J chunks
/// of 8 values a thread; the first instance whose 256·W·J columns hold the row runs.
const LN_BWD_FAST: [(&str, &str, usize, usize); 8] = [
    ("layernorm_bwd_j1w1", "rmsnorm_bwd_j1w1", 1, 1),
    ("layernorm_bwd_j1w2", "rmsnorm_bwd_j1w2", 1, 2),
    ("layernorm_bwd_j1w3", "rmsnorm_bwd_j1w3", 1, 3),
    ("layernorm_bwd_j1w4", "rmsnorm_bwd_j1w4", 1, 4),
    ("layernorm_bwd_j2w4", "rmsnorm_bwd_j2w4", 2, 4),
    ("layernorm_bwd_j2w8", "rmsnorm_bwd_j2w8", 2, 8),
    ("layernorm_bwd_j2w12", "rmsnorm_bwd_j2w12", 2, 12),
    ("layernorm_bwd_j2w16", "rmsnorm_bwd_j2w16", 2, 16),
];
const LN_BWD_FAST_MAX_C: usize = 8192;
/// Row slots in the fast backward's shared-memory ring: the pair of rows being worked on and
/// the next pair, whose copies are in flight meanwhile.
const LN_BWD_SLOTS: usize = 4;
/// The most rows one block of the fast backward runs (`ln_fast_rows_per_block`): its rows'
/// statistics are staged in shared memory.
const LN_BWD_MAX_ROWS: usize = 64;

/// Threads per block of the fast RMSNorm forward (`rmsnorm_fwd_j{J}w{W}`: W warps a row,
/// RMS_FWD_THREADS / 32W rows a block, J 16-byte chunks of the row a thread, held in
/// registers). C % 8 == 0, 16-byte aligned rows and weight; the first instance whose
/// 256·J·W columns hold the row runs; wider rows, other C and unaligned pointers take the
/// general `rmsnorm_fwd` (a warp a row, the row read twice).
const RMS_FWD_THREADS: usize = 256;
const RMS_FWD_FAST: [(&str, usize, usize); 9] = [
    ("rmsnorm_fwd_j1w1", 1, 1),
    ("rmsnorm_fwd_j2w1", 2, 1),
    ("rmsnorm_fwd_j4w1", 4, 1),
    ("rmsnorm_fwd_j8w1", 8, 1),
    ("rmsnorm_fwd_j6w2", 6, 2),
    ("rmsnorm_fwd_j8w2", 8, 2),
    ("rmsnorm_fwd_j6w4", 6, 4),
    ("rmsnorm_fwd_j8w4", 8, 4),
    ("rmsnorm_fwd_j8w8", 8, 8),
];

/// Rows per block of the fast backward: about 512 blocks (a partial dw/db row each, which
/// `reduce_partials` adds), 8 to 64 rows. From N alone, so the partial sums — and the
/// result's bits — are the same on every GPU.
fn ln_fast_rows_per_block(n: usize) -> usize {
    (n / 512).next_power_of_two().clamp(8, LN_BWD_MAX_ROWS)
}

/// The register-resident LayerNorm forwards (`layernorm_fwd_r{NV}`: aligned rows of up to
/// 256·NV values held in a warp's registers); wider or unaligned rows take `layernorm_fwd`.
const LN_FWD_REGS: [(&str, usize); 3] =
    [("layernorm_fwd_r4", 1024), ("layernorm_fwd_r8", 2048), ("layernorm_fwd_r16", 4096)];

const N_FUNCTIONS: usize = 4 + LN_FWD_REGS.len() + 2 * LN_BWD_FAST.len() + RMS_FWD_FAST.len();
const FUNCTIONS: [&str; N_FUNCTIONS] = {
    let mut f = ["layernorm_fwd"; N_FUNCTIONS];
    f[1] = "layernorm_bwd";
    f[2] = "rmsnorm_fwd";
    f[3] = "rmsnorm_bwd";
    let mut at = 4;
    let mut i = 0;
    while i < LN_FWD_REGS.len() {
        f[at] = LN_FWD_REGS[i].0;
        at += 1;
        i += 1;
    }
    let mut i = 0;
    while i < LN_BWD_FAST.len() {
        f[at] = LN_BWD_FAST[i].0;
        f[at + 1] = LN_BWD_FAST[i].1;
        at += 2;
        i += 1;
    }
    let mut i = 0;
    while i < RMS_FWD_FAST.len() {
        f[at] = RMS_FWD_FAST[i].0;
        at += 1;
        i += 1;
    }
    f
};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "layernorm",
    src: include_str!("layernorm.cu"),
    functions: &FUNCTIONS,
    // The general kernels' dw/db accumulators (C or 2C floats) and the fast ones' row rings
    // pass 48 KiB at the wider rows.
    big_smem: |f| f.starts_with("layernorm_bwd") || f.starts_with("rmsnorm_bwd"),
    defines: || {
        vec![
            ("LN_EPS", format!("{LN_EPS:?}f")),
            ("LN_BWD_SLOTS", LN_BWD_SLOTS.to_string()),
            ("LN_BWD_MAX_ROWS", LN_BWD_MAX_ROWS.to_string()),
            ("RMS_FWD_THREADS", RMS_FWD_THREADS.to_string()),
        ]
    },
};

/// Device pointers and shape of one norm backward, checked by its op: what LayerNorm's
/// and RMSNorm's share.
struct NormBwd {
    /// The op, for errors.
    op: &'static str,
    dx: u64,
    dy: u64,
    x: u64,
    w: u64,
    /// LayerNorm's row means; `None`: RMSNorm (the kernels get a null pointer).
    mean: Option<u64>,
    rstd: u64,
    dw: u64,
    /// LayerNorm's bias gradient (RMSNorm has none).
    db: Option<u64>,
    fresh: bool,
    r: Rows,
    /// Where the kernel leaves the amax of the dx it writes (`fp8_sink`; 0: nowhere).
    amax: u64,
}

impl CudaBackend {
    /// The backward's kernel (general or fast, LayerNorm's or RMSNorm's), then
    /// `reduce_partials` over its partial rows into dw (and db).
    fn norm_bwd(&self, a: NormBwd) -> BResult<()> {
        let Rows { n, c } = a.r;
        let rms = a.mean.is_none();
        if n == 0 {
            if a.fresh {
                // No rows: a fresh dw (db) is zero.
                // SAFETY: the op checked the gradients' ranges (C elements each).
                unsafe {
                    self.zero_f32(a.dw, c)?;
                    if let Some(db) = a.db {
                        self.zero_f32(db, c)?;
                    }
                }
            }
            return Ok(());
        }
        // A partial row per block: [dw | db] (LayerNorm) or [dw] (RMSNorm).
        let width = if rms { c } else { 2 * c };
        // RMSNorm's partial rows are C wide: every column goes to dst0, none reaches dst1.
        let s = Split { dst0: a.dw, dst1: a.db.unwrap_or(a.dw), split: c, overwrite: a.fresh };
        let aligned = c.is_multiple_of(8) && [a.dx, a.dy, a.x, a.w].iter().all(|p| p.is_multiple_of(16));
        // Every variant writes partial rows of rows_per_part rows each, which
        // reduce_partials then adds in order.
        let fast = LN_BWD_FAST.iter().find(|(_, _, j, w)| 256 * w * j >= c);
        let k = if let (true, Some(&(ln_name, rms_name, j, warps))) = (aligned && c <= LN_BWD_FAST_MAX_C, fast) {
            // Fast path: a block of warps per run of rows, two rows at a time, the next
            // two rows' copies in flight during their arithmetic; block k writes partial row k.
            let rows = ln_fast_rows_per_block(n);
            let threads = 32 * warps;
            let smem = LN_BWD_SLOTS * 3 * j * threads * 16;
            let name = if rms { rms_name } else { ln_name };
            // Static: the pair sums and the block's rows' statistics.
            LnBwdKernel { name, rows_per_part: rows, threads, smem, static_smem: 1024 }
        } else {
            // dw(/db) accumulators (C or 2C floats); static: a block reduction's 32 floats.
            LnBwdKernel {
                name: if rms { "rmsnorm_bwd" } else { "layernorm_bwd" },
                rows_per_part: LN_ROWS_PER_BLOCK,
                threads: 256,
                smem: width * 4,
                static_smem: 256,
            }
        };
        if k.smem + k.static_smem > self.kernels.max_smem {
            return Err(bad(format!(
                "{}: C = {c} needs {} bytes of shared memory ({}), more than the device's {}",
                a.op, k.smem, k.name, self.kernels.max_smem
            )));
        }
        let nparts = n.div_ceil(k.rows_per_part);
        let partial = self.scratch_f32(nparts * width)?;
        let (ni, ci, rpp) = (to_i32("N", n)?, to_i32("C", c)?, k.rows_per_part as i32);
        let mp = a.mean.unwrap_or(0);
        let f = self.f(k.name)?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&a.dx).arg(&partial).arg(&a.dy).arg(&a.x).arg(&a.w).arg(&mp).arg(&a.rstd).arg(&ni).arg(&ci).arg(&rpp);
        lb.arg(&a.amax);
        let blocks = nparts as u32;
        // SAFETY: the op checked every range (n rows of C, n statistics, C weights and
        // gradients) and, for the 16-byte variants, alignment was checked above; partial
        // holds nparts partial rows of `width` floats and each block writes only its own
        // row < nparts; RMSNorm's kernels do not read the null mean.
        unsafe { lb.launch(cfg((blocks, 1, 1), (k.threads as u32, 1, 1), k.smem)) }
            .map_err(|e| self.launch_err(k.name, e))?;
        self.reduce_partials(s, partial, nparts, width)
    }
}

impl LayerNormOps for CudaBackend {
    fn layernorm_fwd(
        &self,
        out: &mut Self::Buf,
        stats: LnStats<'_, Self>,
        inp: &Self::Buf,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        check("layernorm_fwd out", out.len(), 0, r.n * r.c)?;
        let o = self.ptr_mut(out, 0);
        self.ln_fwd(NormOut { o, amax }, stats, inp, p, r)
    }

    fn layernorm_stats(
        &self,
        stats: LnStats<'_, Self>,
        inp: &Self::Buf,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        // layernorm_fwd's kernel with no output: the statistics (and the amax) only.
        self.ln_fwd(NormOut { o: 0, amax }, stats, inp, p, r)
    }

    fn layernorm_bwd(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, NormLocs>,
        dout: &Self::Buf,
        saved: LnSaved<'_, Self>,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
        amax: Option<AmaxSink>,
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
        self.norm_bwd(NormBwd {
            op: "layernorm_bwd",
            dx: self.ptr_mut(dinp, 0),
            dy: self.ptr(dout, 0),
            x: self.ptr(inp, 0),
            w: self.ptr(params, w.off),
            mean: Some(self.ptr(mean, 0)),
            rstd: self.ptr(rstd, 0),
            dw: self.ptr_mut(grads, dw.off),
            db: Some(self.ptr_mut(grads, db.off)),
            fresh: g.fresh,
            r,
            amax: self.fp8_sink(amax)?,
        })
    }
    fn rmsnorm_fwd(
        &self,
        out: &mut Self::Buf,
        rstd: &mut Self::F32,
        inp: &Self::Buf,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        eps: f32,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        check("rmsnorm_fwd out", out.len(), 0, r.n * r.c)?;
        let o = self.ptr_mut(out, 0);
        self.rms_fwd(NormOut { o, amax }, rstd, inp, p, r, eps)
    }

    fn rmsnorm_stats(
        &self,
        rstd: &mut Self::F32,
        inp: &Self::Buf,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        eps: f32,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        // rmsnorm_fwd's kernels with no output: rstd (and the amax) only (a null output is
        // 16-byte aligned: the same kernel as with the output, so the same rstd).
        self.rms_fwd(NormOut { o: 0, amax }, rstd, inp, p, r, eps)
    }

    fn rmsnorm_bwd(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, Loc>,
        dout: &Self::Buf,
        saved: RmsSaved<'_, Self>,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let Rows { n, c } = r;
        let (grads, dw, (params, w)) = (g.buf, g.at, (p.buf, p.at));
        let RmsSaved { inp, rstd } = saved;
        check("rmsnorm_bwd dinp", dinp.len(), 0, n * c)?;
        check("rmsnorm_bwd dout", dout.len(), 0, n * c)?;
        check("rmsnorm_bwd inp", inp.len(), 0, n * c)?;
        check("rmsnorm_bwd rstd", rstd.len(), 0, n)?;
        check_loc("rmsnorm_bwd weight", params.len(), w)?;
        check_loc("rmsnorm_bwd dw", grads.len(), dw)?;
        if w.len != c || dw.len != c {
            return Err(bad(format!(
                "rmsnorm_bwd: the weight and its gradient must have C = {c} elements, have {} and {}",
                w.len, dw.len
            )));
        }
        self.norm_bwd(NormBwd {
            op: "rmsnorm_bwd",
            dx: self.ptr_mut(dinp, 0),
            dy: self.ptr(dout, 0),
            x: self.ptr(inp, 0),
            w: self.ptr(params, w.off),
            mean: None,
            rstd: self.ptr(rstd, 0),
            dw: self.ptr_mut(grads, dw.off),
            db: None,
            fresh: g.fresh,
            r,
            amax: self.fp8_sink(amax)?,
        })
    }
}

/// Where a norm's forward writes: its output's device address (0: none, only the row
/// statistics), and where the output's amax goes.
struct NormOut {
    o: u64,
    amax: Option<AmaxSink>,
}

/// Which norm backward kernel runs, and its launch shape.
struct LnBwdKernel {
    name: &'static str,
    /// Rows summed into one partial row: one block's rows (the kernel's last argument).
    rows_per_part: usize,
    threads: usize,
    /// Dynamic shared memory, and a bound on the kernel's static shared memory beside it.
    smem: usize,
    static_smem: usize,
}

impl CudaBackend {
    /// LayerNorm's forward into the output at `out.o` (0: none, only the statistics and the
    /// amax: `layernorm_stats`).
    fn ln_fwd(
        &self,
        out: NormOut,
        stats: LnStats<'_, Self>,
        inp: &<Self as Device>::Buf,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
    ) -> BResult<()> {
        let NormOut { o, amax } = out;
        let (Rows { n, c }, LnStats { mean, rstd }, (params, NormLocs { w, b: bias })) = (r, stats, (p.buf, p.at));
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
        let (mp, rp, x, wp, bp) = (
            self.ptr_mut(mean, 0),
            self.ptr_mut(rstd, 0),
            self.ptr(inp, 0),
            self.ptr(params, w.off),
            self.ptr(params, bias.off),
        );
        let (ni, ci) = (to_i32("N", n)?, to_i32("C", c)?);
        let am = self.fp8_sink(amax)?;
        // Aligned rows (no output counts as aligned) that fit a warp's registers take the
        // register-resident instance; the rest the general kernel.
        let aligned = c.is_multiple_of(8) && [o, x, wp, bp].iter().all(|p| p.is_multiple_of(16));
        let name = match LN_FWD_REGS.iter().find(|&&(_, max_c)| c <= max_c) {
            Some(&(name, _)) if aligned => name,
            _ => "layernorm_fwd",
        };
        let f = self.f(name)?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&mp).arg(&rp).arg(&x).arg(&wp).arg(&bp).arg(&ni).arg(&ci).arg(&am);
        // SAFETY: all ranges checked above; one warp per row, rows < n; the output (unless 0)
        // was checked by the caller to hold n·c.
        unsafe { lb.launch(cfg((n.div_ceil(8) as u32, 1, 1), (256, 1, 1), 0)) }
            .map_err(|e| self.launch_err(name, e))?;
        Ok(())
    }

    /// RMSNorm's forward into the output at `out.o` (0: none, only `rstd` and the amax), the
    /// kernel picked by the shape and alignment (the same with and without an output).
    fn rms_fwd(
        &self,
        out: NormOut,
        rstd: &mut <Self as Device>::F32,
        inp: &<Self as Device>::Buf,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        eps: f32,
    ) -> BResult<()> {
        let NormOut { o, amax } = out;
        let (Rows { n, c }, (params, w)) = (r, (p.buf, p.at));
        check("rmsnorm_fwd inp", inp.len(), 0, n * c)?;
        check("rmsnorm_fwd rstd", rstd.len(), 0, n)?;
        check_loc("rmsnorm_fwd weight", params.len(), w)?;
        if w.len != c {
            return Err(bad(format!("rmsnorm_fwd: the weight must have C = {c} elements, has {}", w.len)));
        }
        if n == 0 {
            return Ok(());
        }
        let (rp, x, wp) = (self.ptr_mut(rstd, 0), self.ptr(inp, 0), self.ptr(params, w.off));
        let aligned = c.is_multiple_of(8) && [o, x, wp].iter().all(|p| p.is_multiple_of(16));
        let fast = RMS_FWD_FAST.iter().find(|(_, j, w)| 256 * j * w >= c);
        // (kernel, rows per block of 256 threads)
        let (name, rows) = match (aligned, fast) {
            (true, Some(&(name, _, warps))) => (name, RMS_FWD_THREADS / (32 * warps)),
            _ => ("rmsnorm_fwd", 8),
        };
        let (ni, ci) = (to_i32("N", n)?, to_i32("C", c)?);
        let am = self.fp8_sink(amax)?;
        let f = self.f(name)?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&o).arg(&rp).arg(&x).arg(&wp).arg(&ni).arg(&ci).arg(&eps).arg(&am);
        // SAFETY: all ranges checked above (and, for the 16-byte variants, alignment); each
        // row's warps write only that row (< n) and its rstd.
        unsafe { lb.launch(cfg((n.div_ceil(rows) as u32, 1, 1), (RMS_FWD_THREADS as u32, 1, 1), 0)) }
            .map_err(|e| self.launch_err(name, e))?;
        Ok(())
    }
}
