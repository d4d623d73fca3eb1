//! Causal self-attention on the CPU, multi-head or grouped-query, and the rotary position
//! embedding. Saves the softmax probabilities `[B, NH, T, T]` for backward: fine for the
//! reference, which is why the CUDA backend uses a tiled (flash-style) kernel instead.

use super::CpuBackend;
use crate::backend::{AttentionOps, AttnShape, BResult};

/// `qkv[B,T,qkv_width]` (query heads, key heads, value heads per row) → `out[B,T,C]`;
/// `att[B,NH,T,T]` saved. Query head `h` reads key/value head `h / group`.
pub fn attention_forward(out: &mut [f32], att: &mut [f32], qkv: &[f32], s: AttnShape) {
    let AttnShape { b, t, c, nh, .. } = s;
    let (hs, w, g) = (s.hs(), s.qkv_width(), s.group());
    let scale = 1.0 / (hs as f32).sqrt();
    for bi in 0..b {
        for h in 0..nh {
            let (ko, vo) = (s.k_off() + (h / g) * hs, s.v_off() + (h / g) * hs);
            for ti in 0..t {
                let q = &qkv[(bi * t + ti) * w + h * hs..][..hs];
                let a = &mut att[((bi * nh + h) * t + ti) * t..][..t];
                let mut max = f32::NEG_INFINITY;
                for t2 in 0..=ti {
                    let k = &qkv[(bi * t + t2) * w + ko..][..hs];
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
                    let v = &qkv[(bi * t + t2) * w + vo..][..hs];
                    let p = a[t2];
                    for (oo, vv) in o.iter_mut().zip(v) {
                        *oo += p * vv;
                    }
                }
            }
        }
    }
}

/// `dqkv` overwritten from `dout`, using the saved probabilities; a key/value head's
/// gradient is the sum over its group's query heads, in head order.
pub fn attention_backward(dqkv: &mut [f32], dout: &[f32], qkv: &[f32], att: &[f32], s: AttnShape) {
    let AttnShape { b, t, c, nh, .. } = s;
    let (hs, w, g) = (s.hs(), s.qkv_width(), s.group());
    let scale = 1.0 / (hs as f32).sqrt();
    dqkv.fill(0.0);
    let mut datt = vec![0.0f32; t];
    for bi in 0..b {
        for h in 0..nh {
            let (ko, vo) = (s.k_off() + (h / g) * hs, s.v_off() + (h / g) * hs);
            for ti in 0..t {
                let a = &att[((bi * nh + h) * t + ti) * t..][..t];
                let dy = &dout[(bi * t + ti) * c + h * hs..][..hs];
                // through out = Σ p·v
                for t2 in 0..=ti {
                    let voff = (bi * t + t2) * w + vo;
                    let v = &qkv[voff..][..hs];
                    datt[t2] = dy.iter().zip(v).map(|(x, y)| x * y).sum();
                    let p = a[t2];
                    for (dv, g) in dqkv[voff..voff + hs].iter_mut().zip(dy) {
                        *dv += p * g;
                    }
                }
                // through softmax
                let dot: f32 = (0..=ti).map(|t2| a[t2] * datt[t2]).sum();
                let qoff = (bi * t + ti) * w + h * hs;
                for t2 in 0..=ti {
                    let dpre = a[t2] * (datt[t2] - dot) * scale;
                    let koff = (bi * t + t2) * w + ko;
                    for j in 0..hs {
                        dqkv[qoff + j] += dpre * qkv[koff + j];
                        dqkv[koff + j] += dpre * qkv[qoff + j];
                    }
                }
            }
        }
    }
}

/// Rotate the query and key heads of `qkv[B·T, qkv_width]` in place by the angles of
/// `table` ([`crate::backend::attention::rope_table`]); `inverse` rotates back (the
/// backward, applied to their gradients).
pub fn rope_rotate(qkv: &mut [f32], table: &[f32], s: AttnShape, inverse: bool) {
    let (hs, w, t) = (s.hs(), s.qkv_width(), s.t);
    let half = hs / 2;
    let (cos, sin) = table.split_at(t * half);
    for (row, x) in qkv.chunks_exact_mut(w).enumerate() {
        let p = row % t;
        let (cp, sp) = (&cos[p * half..][..half], &sin[p * half..][..half]);
        // Query heads, then key heads: contiguous at the start of the row.
        for head in x[..(s.nh + s.nkv) * hs].chunks_exact_mut(hs) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b, c) = (lo[i], hi[i], cp[i]);
                let sn = if inverse { -sp[i] } else { sp[i] };
                // transformers: q·cos + rotate_half(q)·sin, rotate_half(q) = [-q_hi, q_lo]
                lo[i] = a * c - b * sn;
                hi[i] = b * c + a * sn;
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
        attention_forward(&mut out[..n * s.c], &mut saved[..self.attention_saved_len(s)], &qkv[..n * s.qkv_width()], s);
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
        let (n, w) = (s.b * s.t, s.qkv_width());
        attention_backward(
            &mut dqkv[..n * w],
            &dout[..n * s.c],
            &qkv[..n * w],
            &saved[..self.attention_saved_len(s)],
            s,
        );
        Ok(())
    }
    fn rope_fwd(&self, qkv: &mut Vec<f32>, table: &Vec<f32>, s: AttnShape) -> BResult<()> {
        let n = s.b * s.t;
        rope_rotate(&mut qkv[..n * s.qkv_width()], &table[..s.t * s.hs()], s, false);
        Ok(())
    }
    fn rope_bwd(&self, dqkv: &mut Vec<f32>, table: &Vec<f32>, s: AttnShape) -> BResult<()> {
        let n = s.b * s.t;
        rope_rotate(&mut dqkv[..n * s.qkv_width()], &table[..s.t * s.hs()], s, true);
        Ok(())
    }
}
