//! Deterministic reductions on the GPU (twin of cpu/reduce.rs; kernels in reduce.cu): the
//! sums kept in `F64Pair` slots, and the ordered reduction of per-block partial column
//! sums that the LayerNorm and bias-gradient kernels write — one launch each, or, inside a
//! unit's backward (`ReduceOps::begin_deferred_sums`), held back with their partial sums in
//! regions of their own and launched together at the unit's end (`reduce_partials_batch`:
//! a GPT-2 block's six reductions, a few µs of work each, were six launches of ~4 µs).

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::kernels::{no_big_smem, KernelFile};
use super::launch::{bad, cfg, check, check_loc, to_i32, BLOCK};
use super::CudaBackend;
use crate::backend::{BResult, Loc, ReduceOps};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "reduce",
    src: include_str!("reduce.cu"),
    functions: &["sum_partial", "sum_finish", "reduce_partials", "reduce_partials_batch"],
    big_smem: no_big_smem,
    defines: || vec![("RP_ROWS", RP_ROWS.to_string()), ("RP_JOBS", RP_JOBS.to_string())],
};

/// Reductions one `reduce_partials_batch` launch takes (a GPT-2 block has six, a Llama
/// block four; more are launched in turn).
const RP_JOBS: usize = 8;

/// The kernel's `PartialSums` (same layout: `repr(C)`, the same field order).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PartialSumsTable {
    block_start: [i32; RP_JOBS + 1],
    dst0: [u64; RP_JOBS],
    dst1: [u64; RP_JOBS],
    partial: [u64; RP_JOBS],
    split: [i32; RP_JOBS],
    nchunks: [i32; RP_JOBS],
    w: [i32; RP_JOBS],
    overwrite: [i32; RP_JOBS],
    n: i32,
}

// SAFETY: plain numbers in C layout, as the kernel declares them.
unsafe impl cudarc::driver::DeviceRepr for PartialSumsTable {}

/// One held-back reduction: `reduce_partials`' arguments.
struct Job {
    s: Split,
    partial: u64,
    nchunks: usize,
    w: usize,
}

/// The reductions a unit's backward held back, and how much of the arena their partial sums
/// use (and asked for in all: what the arena grows to, so that later units fit whole).
#[derive(Default)]
pub(super) struct Deferred {
    jobs: Vec<Job>,
    used: usize,
    asked: usize,
}

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
    /// Where an op writes `n` floats of partial column sums for [`CudaBackend::reduce_partials`]:
    /// the shared scratch, or, while deferring, a region of the arena of their own that no
    /// op reuses before the held-back reduction has run (the arena grows, in stream order,
    /// after running what it holds).
    pub(super) fn partial_sums_buf(&self, n: usize) -> BResult<u64> {
        let mut cell = self.deferred.borrow_mut();
        let Some(d) = cell.as_mut() else {
            drop(cell);
            return self.scratch_f32(n);
        };
        // 64-float (256-byte) regions.
        let n = n.div_ceil(64) * 64;
        d.asked += n;
        let cap = self.sums_arena.borrow().as_ref().map_or(0, |a| a.len());
        if d.used + n > cap {
            let jobs = std::mem::take(&mut d.jobs);
            self.launch_partial_sums(&jobs)?;
            d.used = 0;
            // What this unit's backward asked for so far: after the first unit of each kind
            // the arena holds a whole one, and later ones launch their reductions together.
            let want = d.asked.max(n);
            if want > cap {
                // The old arena is freed in stream order: the reductions just queued read it first.
                self.scratch(&self.sums_arena, want, "deferred partial sums")?;
            }
        }
        let at = d.used;
        d.used += n;
        let arena = self.sums_arena.borrow();
        let a = arena.as_ref().expect("grown above to hold the region");
        Ok(self.ptr(a, at))
    }

    /// `dst0[j] += Σ_k partial[k][j]` for `j < split`, `dst1[j - split] += ..` beyond (`=`
    /// with `overwrite`): now, or, while deferring, held back (then `partial` must come from
    /// [`CudaBackend::partial_sums_buf`]).
    pub(super) fn reduce_partials(&self, s: Split, partial: u64, nchunks: usize, w: usize) -> BResult<()> {
        if let Some(d) = self.deferred.borrow_mut().as_mut() {
            d.jobs.push(Job { s, partial, nchunks, w });
            return Ok(());
        }
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

    /// Held-back reductions, RP_JOBS a launch, in the order they were asked for.
    fn launch_partial_sums(&self, jobs: &[Job]) -> BResult<()> {
        for chunk in jobs.chunks(RP_JOBS) {
            let mut t = PartialSumsTable { n: chunk.len() as i32, ..Default::default() };
            let mut blocks = 0usize;
            for (j, job) in chunk.iter().enumerate() {
                t.block_start[j] = to_i32("reduction blocks", blocks)?;
                t.dst0[j] = job.s.dst0;
                t.dst1[j] = job.s.dst1;
                t.partial[j] = job.partial;
                t.split[j] = to_i32("width", job.s.split)?;
                t.nchunks[j] = to_i32("chunks", job.nchunks)?;
                t.w[j] = to_i32("width", job.w)?;
                t.overwrite[j] = job.s.overwrite as i32;
                blocks += job.w.div_ceil(32);
            }
            t.block_start[chunk.len()] = to_i32("reduction blocks", blocks)?;
            if blocks == 0 {
                continue;
            }
            let f = self.f("reduce_partials_batch")?;
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&t);
            // SAFETY: each job's partial holds nchunks·w floats and its destinations split and
            // w - split (its op's checks, as for reduce_partials); the arena regions they read
            // are not reused before this launch in stream order.
            unsafe { lb.launch(cfg((blocks as u32, 1, 1), (32, RP_ROWS as u32, 1), 0)) }
                .map_err(|e| self.launch_err("reduce_partials_batch", e))?;
        }
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
    fn begin_deferred_sums(&self) -> BResult<()> {
        let mut cell = self.deferred.borrow_mut();
        if cell.is_some() {
            return Err(bad("partial sums deferred twice without running them (a bug)".into()));
        }
        *cell = Some(Deferred::default());
        Ok(())
    }
    fn end_deferred_sums(&self) -> BResult<()> {
        let d = self.deferred.borrow_mut().take();
        match d {
            Some(d) => self.launch_partial_sums(&d.jobs),
            None => Ok(()),
        }
    }
    fn grad_sumsq_into(&self, buf: &Self::Grad, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()> {
        self.sum_into_slot(buf, at, true, dst, slot, false)
    }
    fn sum_into(&self, src: &Self::F32, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()> {
        self.sum_into_slot(src, at, false, dst, slot, true)
    }
}
