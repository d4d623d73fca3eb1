//! The loss: softmax cross-entropy, forward and backward in one pass over the logits.

use super::{BResult, Device};

pub trait CrossEntropyOps: Device {
    /// Softmax cross-entropy over `logits[N,V]`: writes per-row losses, and overwrites
    /// `logits` with `dlogits = (softmax - onehot) · dloss_scale`.
    fn cross_entropy_fwd_bwd(
        &self,
        logits: &mut Self::Buf,
        losses: &mut Self::F32,
        targets: &Self::Tokens,
        n: usize,
        v: usize,
        dloss_scale: f32,
    ) -> BResult<()>;
}
