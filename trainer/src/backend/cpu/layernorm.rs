//! LayerNorm on the CPU (forward saves mean and 1/std per row for backward).

use super::{at, two_mut, CpuBackend};
use crate::backend::{BResult, BackendError, LayerNormOps, LnSaved, LnStats, NormLocs, Rows, WeightGrads, Weights};

pub const LN_EPS: f32 = 1e-5;

/// `out[n, c]` from `inp[n, c]`; `n` is `mean.len()` and `c` is `w.len()`.
pub fn layernorm_forward(out: &mut [f32], mean: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], b: &[f32]) {
    let (n, c) = (mean.len(), w.len());
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

/// `dinp += ..`, `dw += ..`, `db += ..`; `saved` is what the forward of these rows kept.
pub fn layernorm_backward(
    dinp: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
    dout: &[f32],
    saved: LnSaved<'_, CpuBackend>,
    w: &[f32],
    r: Rows,
) {
    let Rows { n, c } = r;
    let (inp, mean, rstd) = (saved.inp, saved.mean, saved.rstd);
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

impl LayerNormOps for CpuBackend {
    fn layernorm_fwd(
        &self,
        out: &mut Vec<f32>,
        stats: LnStats<'_, Self>,
        inp: &Vec<f32>,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
    ) -> BResult<()> {
        let Rows { n, c } = r;
        let (w, b) = (at(p.buf, p.at.w), at(p.buf, p.at.b));
        if w.len() != c || b.len() != c {
            return Err(BackendError::Device(format!("layernorm_fwd: weight and bias must have C = {c} elements")));
        }
        layernorm_forward(&mut out[..n * c], &mut stats.mean[..n], &mut stats.rstd[..n], &inp[..n * c], w, b);
        Ok(())
    }
    fn layernorm_bwd(
        &self,
        dinp: &mut Vec<f32>,
        g: WeightGrads<'_, Self, NormLocs>,
        dout: &Vec<f32>,
        saved: LnSaved<'_, Self>,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
    ) -> BResult<()> {
        let Rows { n, c } = r;
        let (dw, db) = two_mut(g.buf, g.at.w, g.at.b);
        if g.fresh {
            // Written, not added to: `+=` onto zeros gives the same bits.
            dw.fill(0.0);
            db.fill(0.0);
        }
        layernorm_backward(&mut dinp[..n * c], dw, db, &dout[..n * c], saved, at(p.buf, p.at.w), r);
        Ok(())
    }
}
