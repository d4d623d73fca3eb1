//! AdamW with decoupled weight decay on the CPU (the fp32 master-weight update); a segment
//! that is an FP8 layer's whole weight leaves its amax, and where the step writes the cached
//! weights, the layer's cache, as the GPU's does (`cpu/matmul.rs`).

use super::CpuBackend;
use crate::backend::{AdamWOps, AdamWSegment, AdamWStep, AdamWTensors, BResult};

/// One segment's update; `weight_decay` is the decay this segment gets (0 for none).
pub fn adamw_segment(master: &mut [f32], m: &mut [f32], v: &mut [f32], grads: &[f32], h: AdamWStep, weight_decay: f32) {
    let (bc1, bc2) = h.bias_corrections();
    for i in 0..master.len() {
        let g = grads[i] * h.grad_scale;
        let mi = h.beta1 * m[i] + (1.0 - h.beta1) * g;
        let vi = h.beta2 * v[i] + (1.0 - h.beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        let mhat = mi / bc1;
        let vhat = vi / bc2;
        master[i] -= h.lr * (mhat / (vhat.sqrt() + h.eps) + weight_decay * master[i]);
    }
}

/// The larger of two amaxes, a NaN winning (as `fp8::amax` keeps it).
fn max_amax(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

impl AdamWOps for CpuBackend {
    fn adamw(&self, mut t: AdamWTensors<'_, Self>, segs: &[AdamWSegment], h: AdamWStep) -> BResult<()> {
        // Each FP8 weight's amax over its segments (a fused weight spans several tensors).
        let mut left: Vec<(usize, f32)> = Vec::new();
        for s in segs {
            let r = s.moff..s.moff + s.len;
            let wd = if s.decay { h.weight_decay } else { 0.0 };
            adamw_segment(
                &mut t.master[r.clone()],
                &mut t.m[r.clone()],
                &mut t.v[r.clone()],
                &t.grads[s.goff..s.goff + s.len],
                h,
                wd,
            );
            if let Some(p) = t.params.as_deref_mut() {
                let written = &mut p[s.poff..s.poff + s.len];
                written.copy_from_slice(&t.master[r]);
                if let Some(l) = s.fp8_layer {
                    let a = crate::backend::fp8::amax(written);
                    match left.iter_mut().find(|e| e.0 == l) {
                        Some(e) => e.1 = max_amax(e.1, a),
                        None => left.push((l, a)),
                    }
                }
            }
        }
        let mut st = self.fp8.borrow_mut();
        for (l, a) in left {
            st.leave_weight_amax(l, a)?;
            // The weight whole, where its segments are one run of the parameters (as on CUDA).
            let params = t.params.as_deref();
            let run = params.and_then(|p| {
                let len: usize = segs.iter().filter(|s| s.fp8_layer == Some(l)).map(|s| s.len).sum();
                AdamWSegment::fp8_weight_run(segs, l, len).map(|at| &p[at..at + len])
            });
            st.leave_weight_codes(l, run);
        }
        Ok(())
    }
}
