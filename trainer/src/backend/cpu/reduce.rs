//! Sums kept in `F64Pair` slots, on the CPU (twin of cuda/reduce.cu's `sum_partial`).

use super::CpuBackend;
use crate::backend::{BResult, F64Pair, Loc, ReduceOps};

impl ReduceOps for CpuBackend {
    fn grad_sumsq_into(&self, buf: &Vec<f32>, at: Loc, dst: &mut Vec<f32>, slot: usize) -> BResult<()> {
        let s: f64 = buf[at.off..at.end()].iter().map(|&x| (x as f64) * (x as f64)).sum();
        dst[2 * slot..2 * slot + 2].copy_from_slice(&F64Pair::split(s));
        Ok(())
    }
    fn sum_into(&self, src: &Vec<f32>, at: Loc, dst: &mut Vec<f32>, slot: usize) -> BResult<()> {
        let s: f64 = src[at.off..at.end()].iter().map(|&x| x as f64).sum();
        let prev = F64Pair::join(&dst[2 * slot..2 * slot + 2]);
        dst[2 * slot..2 * slot + 2].copy_from_slice(&F64Pair::split(prev + s));
        Ok(())
    }
}
