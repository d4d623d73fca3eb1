//! Element-wise activations on the CPU: GELU, tanh approximation (as GPT-2), and the
//! residual add.

use super::CpuBackend;
use crate::backend::{ActivationOps, BResult};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        let cube = 0.044715 * x * x * x;
        *o = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + cube)).tanh());
    }
}

/// `dinp = gelu'(inp) · dout` (overwrite).
pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    for ((d, &x), &g) in dinp.iter_mut().zip(inp).zip(dout) {
        let cube = 0.044715 * x * x * x;
        let arg = SQRT_2_OVER_PI * (x + cube);
        let th = arg.tanh();
        let sech2 = 1.0 - th * th;
        let local = 0.5 * (1.0 + th) + x * 0.5 * sech2 * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
        *d = local * g;
    }
}

impl ActivationOps for CpuBackend {
    fn gelu_fwd(&self, out: &mut Vec<f32>, inp: &Vec<f32>, n: usize) -> BResult<()> {
        gelu_forward(&mut out[..n], &inp[..n]);
        Ok(())
    }
    fn gelu_bwd(&self, dinp: &mut Vec<f32>, inp: &Vec<f32>, dout: &Vec<f32>, n: usize) -> BResult<()> {
        gelu_backward(&mut dinp[..n], &inp[..n], &dout[..n]);
        Ok(())
    }
    fn residual_fwd(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>, n: usize) -> BResult<()> {
        for ((o, x), y) in out[..n].iter_mut().zip(&a[..n]).zip(&b[..n]) {
            *o = x + y;
        }
        Ok(())
    }
}
