//! Sums that stay on the device: the loss of every micro-step and the per-unit sums of
//! squared gradients for the global norm. Each lands in an [`F64Pair`](super::F64Pair)
//! slot, and the engine reads all slots with one download per step instead of waiting for
//! the device once per unit.

use super::{BResult, Device, Loc};

pub trait ReduceOps: Device {
    /// `Σ buf[at]²`, accumulated in f64, written as an `F64Pair` to `dst[2·slot..2·slot+2]`.
    fn grad_sumsq_into(&self, buf: &Self::Grad, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()>;
    /// `Σ src[at]` (f64) added to the `F64Pair` at `dst[2·slot..2·slot+2]`.
    fn sum_into(&self, src: &Self::F32, at: Loc, dst: &mut Self::F32, slot: usize) -> BResult<()>;
}
