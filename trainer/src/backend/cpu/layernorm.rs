//! LayerNorm and RMSNorm on the CPU (forwards save 1/std per row, and LayerNorm the mean,
//! for the backward).

use super::{at, two_mut, CpuBackend};
use crate::backend::{
    AmaxSink, BResult, BackendError, LayerNormOps, LnSaved, LnStats, Loc, NormLocs, RmsSaved, Rows, WeightGrads,
    Weights,
};

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

/// RMSNorm forward over `n = rstd.len()` rows of `c = w.len()` values: the mean square
/// in f64 (the reference's sum is exact enough not to depend on the order).
pub fn rmsnorm_forward(out: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], eps: f32) {
    let c = w.len();
    for (i, r) in rstd.iter_mut().enumerate() {
        let x = &inp[i * c..(i + 1) * c];
        let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / c as f64;
        let s = (1.0 / (ms + eps as f64).sqrt()) as f32;
        for ((o, &xv), &wv) in out[i * c..(i + 1) * c].iter_mut().zip(x).zip(w) {
            *o = xv * s * wv;
        }
        *r = s;
    }
}

/// RMSNorm backward: with `xh = x·rstd` and `g = dy·w`, `dx += rstd·(g − xh·mean(g·xh))`
/// and `dw += Σ_rows dy·xh`.
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dw: &mut [f32],
    dout: &[f32],
    saved: RmsSaved<'_, CpuBackend>,
    w: &[f32],
    r: Rows,
) {
    let Rows { n, c } = r;
    for i in 0..n {
        let x = &saved.inp[i * c..(i + 1) * c];
        let dy = &dout[i * c..(i + 1) * c];
        let s = saved.rstd[i];
        let dot = (0..c).map(|j| (dy[j] * w[j]) as f64 * (x[j] * s) as f64).sum::<f64>() / c as f64;
        let dot = dot as f32;
        let dx = &mut dinp[i * c..(i + 1) * c];
        for j in 0..c {
            let xh = x[j] * s;
            dw[j] += dy[j] * xh;
            dx[j] += s * (dy[j] * w[j] - xh * dot);
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
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let Rows { n, c } = r;
        let (w, b) = (at(p.buf, p.at.w), at(p.buf, p.at.b));
        if w.len() != c || b.len() != c {
            return Err(BackendError::Device(format!("layernorm_fwd: weight and bias must have C = {c} elements")));
        }
        layernorm_forward(&mut out[..n * c], &mut stats.mean[..n], &mut stats.rstd[..n], &inp[..n * c], w, b);
        self.leave_amax(amax, &out[..n * c])
    }
    fn layernorm_stats(
        &self,
        stats: LnStats<'_, Self>,
        inp: &Vec<f32>,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        // The forward into scratch: the GPU writes no output, only its statistics (and amax).
        let mut out = vec![0.0; r.n * r.c];
        self.layernorm_fwd(&mut out, stats, inp, p, r, amax)
    }

    fn layernorm_bwd(
        &self,
        dinp: &mut Vec<f32>,
        g: WeightGrads<'_, Self, NormLocs>,
        dout: &Vec<f32>,
        saved: LnSaved<'_, Self>,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let Rows { n, c } = r;
        let (dw, db) = two_mut(g.buf, g.at.w, g.at.b);
        if g.fresh {
            // Written, not added to: `+=` onto zeros gives the same bits.
            dw.fill(0.0);
            db.fill(0.0);
        }
        layernorm_backward(&mut dinp[..n * c], dw, db, &dout[..n * c], saved, at(p.buf, p.at.w), r);
        self.leave_amax(amax, &dinp[..n * c])
    }
    fn rmsnorm_fwd(
        &self,
        out: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        inp: &Vec<f32>,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        eps: f32,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let Rows { n, c } = r;
        let w = at(p.buf, p.at);
        if w.len() != c {
            return Err(BackendError::Device(format!("rmsnorm_fwd: the weight must have C = {c} elements")));
        }
        rmsnorm_forward(&mut out[..n * c], &mut rstd[..n], &inp[..n * c], w, eps);
        self.leave_amax(amax, &out[..n * c])
    }
    fn rmsnorm_stats(
        &self,
        rstd: &mut Vec<f32>,
        inp: &Vec<f32>,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        eps: f32,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        // The forward into scratch: the GPU writes no output, only rstd (and the amax).
        let mut out = vec![0.0; r.n * r.c];
        self.rmsnorm_fwd(&mut out, rstd, inp, p, r, eps, amax)
    }

    fn rmsnorm_bwd(
        &self,
        dinp: &mut Vec<f32>,
        g: WeightGrads<'_, Self, Loc>,
        dout: &Vec<f32>,
        saved: RmsSaved<'_, Self>,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let Rows { n, c } = r;
        let dw = &mut g.buf[g.at.off..g.at.end()];
        if g.fresh {
            dw.fill(0.0);
        }
        rmsnorm_backward(&mut dinp[..n * c], dw, &dout[..n * c], saved, at(p.buf, p.at), r);
        self.leave_amax(amax, &dinp[..n * c])
    }
}
