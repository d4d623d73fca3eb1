//! Deterministic reductions on the GPU (twin of cpu/reduce.rs; kernels in reduce.cu): the
//! sums kept in `F64Pair` slots, and the ordered reduction of per-block partial column
//! sums that the LayerNorm and bias-gradient kernels write.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::kernels::{no_big_smem, KernelFile};
use super::launch::{cfg, check, check_loc, to_i32, BLOCK};
use super::CudaBackend;
use crate::backend::{BResult, Loc, ReduceOps};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "reduce",
    src: include_str!("reduce.cu"),
    functions: &["sum_partial", "sum_finish", "reduce_partials"],
    big_smem: no_big_smem,
    defines: || vec![("RP_ROWS", RP_ROWS.to_string())],
};

/// Threads per column in `reduce_partials` (each sums every RP_ROWS-th partial row): fixed,
/// so the summation order is the same on every GPU.
const RP_ROWS: usize = 32;

/// Blocks of the sum kernel: fixed, not derived from the GPU, so results are the same
/// bits on every GPU.
const SUM_BLOCKS: usize = 1024;

/// The two parts of a partial-sum reduction's destination (e.g. weight and bias gradient).
pub(super) struct Split {
    pub dst0: u64,
    pub dst1: u64,
    pub split: usize,
    /// Write the sums instead of adding them (a fresh gradient, `WeightGrads::fresh`).
    pub overwrite: bool,
}

impl CudaBackend {
    /// `dst0[j] += Σ_k partial[k][j]` for `j < split`, `dst1[j - split] += ..` beyond (`=`
    /// with `overwrite`).
    pub(super) fn reduce_partials(&self, s: Split, partial: u64, nchunks: usize, w: usize) -> BResult<()> {
        let f = self.f("reduce_partials")?;
        let (split, nchunks_i, w_i) = (to_i32("width", s.split)?, to_i32("chunks", nchunks)?, to_i32("width", w)?);
        let overwrite = s.overwrite as i32;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&s.dst0).arg(&s.dst1).arg(&split).arg(&partial).arg(&nchunks_i).arg(&w_i).arg(&overwrite);
        // SAFETY: partial holds nchunks*w floats; dst0/dst1 hold split and w-split.
        unsafe { lb.launch(cfg((w.div_ceil(32) as u32, 1, 1), (32, RP_ROWS as u32, 1), 0)) }
            .map_err(|e| self.launch_err("reduce_partials", e))?;
        Ok(())
    }

    /// Per-block f64 partial sums on the device, summed in block order by one warp.
    /// `dst[2·slot..+2]` (an `F64Pair`) = Σ `x[at]` (or of squares), plus the pair already
    /// there when `accumulate`. Nothing is read back to the host.
    fn sum_into_slot(
        &self,
        x: &CudaSlice<f32>,
        at: Loc,
        square: bool,
        dst: &mut CudaSlice<f32>,
        slot: usize,
        accumulate: bool,
    ) -> BResult<()> {
        check_loc("sum_into source", x.len(), at)?;
        check("sum_into destination", dst.len(), 2 * slot, 2)?;
        let blocks = at.len.div_ceil(BLOCK as usize).clamp(1, SUM_BLOCKS);
        let partial = self.scratch(&self.scratch_f64, blocks, "sum partials")?;
        let (xp, n, sq) = (self.ptr(x, at.off), at.len as i64, square as i32);
        let f = self.f("sum_partial")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&partial).arg(&xp).arg(&n).arg(&sq);
        // SAFETY: x range checked; partial holds `blocks` doubles.
        unsafe { lb.launch(cfg((blocks as u32, 1, 1), (BLOCK, 1, 1), 0)) }
            .map_err(|e| self.launch_err("sum_partial", e))?;
        let (d, nb, acc) = (self.ptr_mut(dst, 2 * slot), blocks as i32, accumulate as i32);
        let f = self.f("sum_finish")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&d).arg(&partial).arg(&nb).arg(&acc);
        // SAFETY: dst holds the pair at 2*slot (checked); partial holds nb doubles.
        unsafe { lb.launch(cfg((1, 1, 1), (32, 1, 1), 0)) }.map_err(|e| self.launch_err("sum_finish", e))?;
        Ok(())
    }
}

impl ReduceOps for CudaBackend {
    fn grad_sumsq_into(&self, buf: &Self::Grad, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()> {
        self.sum_into_slot(buf, at, true, dst, slot, false)
    }
    fn sum_into(&self, src: &Self::F32, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()> {
        self.sum_into_slot(src, at, false, dst, slot, true)
    }
}
