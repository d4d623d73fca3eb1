//! The loss: softmax cross-entropy, forward and backward in one pass over the logits.

use super::{BResult, Device};

/// `n` rows of logits over a vocabulary of `v`: rows `first .. first + n` of the
/// micro-batch (a chunk of the LM head's output; the losses and targets are the whole
/// micro-batch's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossRows {
    pub n: usize,
    pub v: usize,
    pub first: usize,
}

impl LossRows {
    /// All `n` rows of a micro-batch at once.
    pub fn all(n: usize, v: usize) -> LossRows {
        LossRows { n, v, first: 0 }
    }
}

pub trait CrossEntropyOps: Device {
    /// Softmax cross-entropy over `logits[n, v]`: writes the losses of rows `first..first+n`
    /// (against `targets[first..]`), and overwrites `logits` with
    /// `dlogits = (softmax - onehot) · dloss_scale`.
    fn cross_entropy_fwd_bwd(
        &self,
        logits: &mut Self::Buf,
        losses: &mut Self::F32,
        targets: &Self::Tokens,
        rows: LossRows,
        dloss_scale: f32,
    ) -> BResult<()>;
}
