//! Element-wise activations on the CPU: GELU, tanh approximation (as GPT-2), SwiGLU (as
//! Llama), and the residual add.

use super::CpuBackend;
use crate::backend::{ActivationOps, AmaxSink, BResult, Rows};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        let cube = 0.044715 * x * x * x;
        *o = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + cube)).tanh());
    }
}

/// `dinp = gelu'(inp) · dout` (overwrite).
/// `d = gelu'(inp) · d`, in place.
pub fn gelu_backward(d: &mut [f32], inp: &[f32]) {
    for (d, &x) in d.iter_mut().zip(inp) {
        let cube = 0.044715 * x * x * x;
        let arg = SQRT_2_OVER_PI * (x + cube);
        let th = arg.tanh();
        let sech2 = 1.0 - th * th;
        let local = 0.5 * (1.0 + th) + x * 0.5 * sech2 * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
        *d *= local;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `out[n, f] = silu(gate) · up` for rows `[gate | up]` of `inp[n, 2f]`.
pub fn swiglu_forward(out: &mut [f32], inp: &[f32], r: Rows) {
    let f = r.c;
    for (o, x) in out[..r.n * f].chunks_exact_mut(f).zip(inp.chunks_exact(2 * f)) {
        let (gate, up) = x.split_at(f);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = g * sigmoid(g) * u;
        }
    }
}

/// `dinp[n, 2f]` (overwritten) from `dout[n, f]`: `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))`.
pub fn swiglu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32], r: Rows) {
    let f = r.c;
    for ((d, x), dy) in
        dinp[..r.n * 2 * f].chunks_exact_mut(2 * f).zip(inp.chunks_exact(2 * f)).zip(dout.chunks_exact(f))
    {
        let (gate, up) = x.split_at(f);
        let (dg, du) = d.split_at_mut(f);
        for j in 0..f {
            let (g, s) = (gate[j], sigmoid(gate[j]));
            dg[j] = dy[j] * up[j] * s * (1.0 + g * (1.0 - s));
            du[j] = dy[j] * g * s;
        }
    }
}

impl ActivationOps for CpuBackend {
    fn gelu_fwd(&self, out: &mut Vec<f32>, inp: &Vec<f32>, n: usize, amax: Option<AmaxSink>) -> BResult<()> {
        gelu_forward(&mut out[..n], &inp[..n]);
        self.leave_amax(amax, &out[..n])
    }
    fn gelu_bwd(&self, d: &mut Vec<f32>, inp: &Vec<f32>, n: usize, amax: Option<AmaxSink>) -> BResult<()> {
        gelu_backward(&mut d[..n], &inp[..n]);
        self.leave_amax(amax, &d[..n])
    }
    fn residual_fwd(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>, n: usize) -> BResult<()> {
        for ((o, x), y) in out[..n].iter_mut().zip(&a[..n]).zip(&b[..n]) {
            *o = x + y;
        }
        Ok(())
    }
    fn swiglu_fwd(&self, out: &mut Vec<f32>, inp: &Vec<f32>, r: Rows, amax: Option<AmaxSink>) -> BResult<()> {
        swiglu_forward(out, &inp[..r.n * 2 * r.c], r);
        self.leave_amax(amax, &out[..r.n * r.c])
    }
    fn swiglu_bwd(
        &self,
        dinp: &mut Vec<f32>,
        inp: &Vec<f32>,
        dout: &Vec<f32>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        swiglu_backward(dinp, &inp[..r.n * 2 * r.c], &dout[..r.n * r.c], r);
        self.leave_amax(amax, &dinp[..r.n * 2 * r.c])
    }
}
