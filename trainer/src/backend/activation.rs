//! Element-wise activations and the residual add.

use super::{BResult, Device};

pub trait ActivationOps: Device {
    /// GELU (tanh approximation).
    fn gelu_fwd(&self, out: &mut Self::Buf, inp: &Self::Buf, n: usize) -> BResult<()>;
    /// `dinp = gelu'(inp) · dout`.
    fn gelu_bwd(&self, dinp: &mut Self::Buf, inp: &Self::Buf, dout: &Self::Buf, n: usize) -> BResult<()>;
    /// `out = a + b`.
    fn residual_fwd(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf, n: usize) -> BResult<()>;
}
