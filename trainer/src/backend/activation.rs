//! Element-wise activations (GELU, SwiGLU) and the residual add.

use super::{AmaxSink, BResult, Device, Rows};

pub trait ActivationOps: Device {
    /// GELU (tanh approximation); the amax of `out` left in `amax` where set (for the FP8
    /// GEMM that reads it next).
    fn gelu_fwd(&self, out: &mut Self::Buf, inp: &Self::Buf, n: usize, amax: Option<AmaxSink>) -> BResult<()>;
    /// `d = gelu'(inp) · d`, in place: the gradient arrives in the buffer it leaves in (the
    /// MLP's composed backward writes `dout · W` there first), so no copy follows. Leaves
    /// the amax of the result in `amax` where set (for the FP8 GEMM whose output gradient
    /// it is).
    fn gelu_bwd(&self, d: &mut Self::Buf, inp: &Self::Buf, n: usize, amax: Option<AmaxSink>) -> BResult<()>;
    /// `out = a + b`.
    fn residual_fwd(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf, n: usize) -> BResult<()>;
    /// SwiGLU over rows `[gate | up]` of `inp[N, 2F]`: `out[N, F] = silu(gate) ⊙ up`,
    /// `silu(x) = x·sigmoid(x)` (`r.c` = F); the amax of `out` left in `amax` where set.
    fn swiglu_fwd(&self, out: &mut Self::Buf, inp: &Self::Buf, r: Rows, amax: Option<AmaxSink>) -> BResult<()>;
    /// `dinp[N, 2F]` overwritten: `dgate = dout·up·silu'(gate)`, `dup = dout·silu(gate)`;
    /// the amax of `dinp` left in `amax` where set.
    fn swiglu_bwd(
        &self,
        dinp: &mut Self::Buf,
        inp: &Self::Buf,
        dout: &Self::Buf,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()>;
}
