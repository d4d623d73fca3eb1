//! Fused softmax + cross-entropy forward and backward on the CPU (llm.c's fused classifier).

use super::CpuBackend;
use crate::backend::{BResult, CrossEntropyOps, LossRows};

/// Per row: `loss = logsumexp(logits) - logits[target]`; then `logits` is overwritten with
/// `(softmax - onehot(target)) * dloss_scale`.
pub fn cross_entropy_forward_backward(
    logits: &mut [f32],
    losses: &mut [f32],
    targets: &[u32],
    n: usize,
    v: usize,
    dloss_scale: f32,
) {
    for i in 0..n {
        let row = &mut logits[i * v..(i + 1) * v];
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sum = 0.0f64;
        for x in row.iter() {
            sum += ((x - max) as f64).exp();
        }
        let tgt = targets[i] as usize;
        let lse = max as f64 + sum.ln();
        losses[i] = (lse - row[tgt] as f64) as f32;
        let inv = 1.0 / sum;
        for x in row.iter_mut() {
            *x = ((((*x - max) as f64).exp() * inv) as f32) * dloss_scale;
        }
        row[tgt] -= dloss_scale;
    }
}

impl CrossEntropyOps for CpuBackend {
    fn cross_entropy_fwd_bwd(
        &self,
        logits: &mut Vec<f32>,
        losses: &mut Vec<f32>,
        targets: &Vec<u32>,
        rows: LossRows,
        dloss_scale: f32,
    ) -> BResult<()> {
        let LossRows { n, v, first } = rows;
        let (losses, targets) = (&mut losses[first..first + n], &targets[first..first + n]);
        cross_entropy_forward_backward(&mut logits[..n * v], losses, targets, n, v, dloss_scale);
        Ok(())
    }
}
