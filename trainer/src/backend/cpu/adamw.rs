//! AdamW with decoupled weight decay on the CPU (the fp32 master-weight update).

use crate::backend::AdamWStep;

pub fn adamw_segment(master: &mut [f32], m: &mut [f32], v: &mut [f32], grads: &[f32], h: AdamWStep) {
    let bc1 = 1.0 - h.beta1.powi(h.t as i32);
    let bc2 = 1.0 - h.beta2.powi(h.t as i32);
    for i in 0..master.len() {
        let g = grads[i] * h.grad_scale;
        let mi = h.beta1 * m[i] + (1.0 - h.beta1) * g;
        let vi = h.beta2 * v[i] + (1.0 - h.beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        let mhat = mi / bc1;
        let vhat = vi / bc2;
        master[i] -= h.lr * (mhat / (vhat.sqrt() + h.eps) + h.weight_decay * master[i]);
    }
}
