//! LayerNorm on the CPU (forward saves mean and 1/std per row for backward).

pub const LN_EPS: f32 = 1e-5;

#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    w: &[f32],
    b: &[f32],
    n: usize,
    c: usize,
) {
    for i in 0..n {
        let x = &inp[i * c..(i + 1) * c];
        let m = x.iter().sum::<f32>() / c as f32;
        let var = x.iter().map(|&v| (v - m) * (v - m)).sum::<f32>() / c as f32;
        let s = 1.0 / (var + LN_EPS).sqrt();
        let o = &mut out[i * c..(i + 1) * c];
        for j in 0..c {
            o[j] = (x[j] - m) * s * w[j] + b[j];
        }
        mean[i] = m;
        rstd[i] = s;
    }
}

/// `dinp += ..`, `dw += ..`, `db += ..`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dinp: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    for i in 0..n {
        let x = &inp[i * c..(i + 1) * c];
        let dy = &dout[i * c..(i + 1) * c];
        let (m, s) = (mean[i], rstd[i]);
        let mut dnorm_mean = 0.0f32;
        let mut dnorm_norm_mean = 0.0f32;
        for j in 0..c {
            let norm = (x[j] - m) * s;
            let dnorm = w[j] * dy[j];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= c as f32;
        dnorm_norm_mean /= c as f32;
        let dx = &mut dinp[i * c..(i + 1) * c];
        for j in 0..c {
            let norm = (x[j] - m) * s;
            let dnorm = w[j] * dy[j];
            db[j] += dy[j];
            dw[j] += norm * dy[j];
            dx[j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    }
}
