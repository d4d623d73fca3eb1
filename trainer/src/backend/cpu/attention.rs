//! Causal multi-head self-attention on the CPU. Saves the softmax probabilities
//! `[B, NH, T, T]` for backward: fine for the reference, which is why the CUDA
//! backend uses a tiled (flash-style) kernel instead.

use super::CpuBackend;
use crate::backend::{AttentionOps, AttnShape, BResult};

/// `qkv[B,T,3C]` (q, k, v concatenated per row) → `out[B,T,C]`; `att[B,NH,T,T]` saved.
pub fn attention_forward(out: &mut [f32], att: &mut [f32], qkv: &[f32], s: AttnShape) {
    let AttnShape { b, t, c, nh } = s;
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    for bi in 0..b {
        for h in 0..nh {
            for ti in 0..t {
                let q = &qkv[(bi * t + ti) * c3 + h * hs..][..hs];
                let a = &mut att[((bi * nh + h) * t + ti) * t..][..t];
                let mut max = f32::NEG_INFINITY;
                for t2 in 0..=ti {
                    let k = &qkv[(bi * t + t2) * c3 + c + h * hs..][..hs];
                    let dot: f32 = q.iter().zip(k).map(|(x, y)| x * y).sum::<f32>() * scale;
                    a[t2] = dot;
                    max = max.max(dot);
                }
                let mut sum = 0.0f32;
                for x in a[..=ti].iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                let inv = 1.0 / sum;
                for x in a[..=ti].iter_mut() {
                    *x *= inv;
                }
                a[ti + 1..].fill(0.0);
                let o = &mut out[(bi * t + ti) * c + h * hs..][..hs];
                o.fill(0.0);
                for t2 in 0..=ti {
                    let v = &qkv[(bi * t + t2) * c3 + 2 * c + h * hs..][..hs];
                    let p = a[t2];
                    for (oo, vv) in o.iter_mut().zip(v) {
                        *oo += p * vv;
                    }
                }
            }
        }
    }
}

/// `dqkv` overwritten from `dout`, using the saved probabilities.
pub fn attention_backward(dqkv: &mut [f32], dout: &[f32], qkv: &[f32], att: &[f32], s: AttnShape) {
    let AttnShape { b, t, c, nh } = s;
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    dqkv.fill(0.0);
    let mut datt = vec![0.0f32; t];
    for bi in 0..b {
        for h in 0..nh {
            for ti in 0..t {
                let a = &att[((bi * nh + h) * t + ti) * t..][..t];
                let dy = &dout[(bi * t + ti) * c + h * hs..][..hs];
                // through out = Σ p·v
                for t2 in 0..=ti {
                    let voff = (bi * t + t2) * c3 + 2 * c + h * hs;
                    let v = &qkv[voff..][..hs];
                    datt[t2] = dy.iter().zip(v).map(|(x, y)| x * y).sum();
                    let p = a[t2];
                    for (dv, g) in dqkv[voff..voff + hs].iter_mut().zip(dy) {
                        *dv += p * g;
                    }
                }
                // through softmax
                let dot: f32 = (0..=ti).map(|t2| a[t2] * datt[t2]).sum();
                let qoff = (bi * t + ti) * c3 + h * hs;
                for t2 in 0..=ti {
                    let dpre = a[t2] * (datt[t2] - dot) * scale;
                    let koff = (bi * t + t2) * c3 + c + h * hs;
                    for j in 0..hs {
                        dqkv[qoff + j] += dpre * qkv[koff + j];
                        dqkv[koff + j] += dpre * qkv[qoff + j];
                    }
                }
            }
        }
    }
}

impl AttentionOps for CpuBackend {
    fn attention_saved_len(&self, s: AttnShape) -> usize {
        s.b * s.nh * s.t * s.t
    }
    fn attention_fwd(&self, out: &mut Vec<f32>, saved: &mut Vec<f32>, qkv: &Vec<f32>, s: AttnShape) -> BResult<()> {
        let n = s.b * s.t;
        attention_forward(&mut out[..n * s.c], &mut saved[..self.attention_saved_len(s)], &qkv[..n * 3 * s.c], s);
        Ok(())
    }
    fn attention_bwd(
        &self,
        dqkv: &mut Vec<f32>,
        dout: &Vec<f32>,
        qkv: &Vec<f32>,
        _out: &Vec<f32>,
        saved: &Vec<f32>,
        s: AttnShape,
    ) -> BResult<()> {
        let n = s.b * s.t;
        attention_backward(
            &mut dqkv[..n * 3 * s.c],
            &dout[..n * s.c],
            &qkv[..n * 3 * s.c],
            &saved[..self.attention_saved_len(s)],
            s,
        );
        Ok(())
    }
}
