//! GELU, tanh approximation (as GPT-2), on the CPU.

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
