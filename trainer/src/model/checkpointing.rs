//! Activation checkpointing as every family does it. Which saved-activation set each block
//! uses ([`ActSlots`]): a block that is not checkpointed keeps a set of its own; checkpointed
//! blocks keep only their input and share one set, which the recompute before each one's
//! backward fills again. What a block's forward computes ([`Pass`]), and the attention
//! output and softmax state a checkpointed block may keep ([`KeptAttention`],
//! `checkpointing.keep_attention`) so its recompute skips the attention.

use crate::backend::{BResult, Backend, Device};
use crate::config::{ActivationCheckpointing, CheckpointingConfig};
use crate::zero::{Category, MemoryLedger};

/// What a block's forward computes.
pub enum Pass<'o, B: Device> {
    /// The whole block, into the next block's input.
    Full(&'o mut B::Buf),
    /// The recompute before a checkpointed block's backward: everything backward reads and
    /// nothing more (the MLP's last projection and residual add only make the block's
    /// output, which the next block's checkpoint holds); the attention forward too unless
    /// the block kept its output.
    Recompute { attention: bool },
}

impl<B: Device> Pass<'_, B> {
    /// Whether this pass runs the attention forward.
    pub fn runs_attention(&self) -> bool {
        !matches!(self, Pass::Recompute { attention: false })
    }
}

/// A checkpointed block's attention output and softmax state, kept from its forward: swapped
/// into the shared activation set for the block's forward and again for its recompute and
/// backward, so the recompute skips the attention forward.
pub struct KeptAttention<B: Device> {
    atty: B::Buf,
    saved: B::F32,
}

impl<B: Backend> KeptAttention<B> {
    /// Per block: its kept attention (`n · c` outputs, `saved_len` softmax state), for the
    /// checkpointed blocks when `keep_attention` is on; counted in `ledger`.
    pub fn for_blocks(
        be: &B,
        cfg: &CheckpointingConfig,
        n_layer: usize,
        out_len: usize,
        saved_len: usize,
        ledger: &mut MemoryLedger,
    ) -> BResult<Vec<Option<Self>>> {
        let sz = be.elem_bytes();
        (0..n_layer)
            .map(|layer| {
                if !(cfg.keep_attention && cfg.activations.is_checkpointed(layer)) {
                    return Ok(None);
                }
                ledger.alloc(Category::Activations, out_len * sz.buf + saved_len * sz.f32);
                Ok(Some(KeptAttention {
                    atty: be.alloc_buf(out_len, "kept attention output")?,
                    saved: be.alloc_f32(saved_len, "kept attention softmax state")?,
                }))
            })
            .collect()
    }
}

impl<B: Device> KeptAttention<B> {
    /// Exchange with the shared set's attention buffers (twice restores both).
    pub fn swap(kept: Option<&mut Self>, atty: &mut B::Buf, saved: &mut B::F32) {
        if let Some(k) = kept {
            std::mem::swap(&mut k.atty, atty);
            std::mem::swap(&mut k.saved, saved);
        }
    }
}

/// Block `l`'s set is `slot[l]`; `sets` sets in all, the last one shared by the
/// checkpointed blocks when there are any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActSlots {
    pub slot: Vec<usize>,
    pub sets: usize,
    pub shared: bool,
}

impl ActSlots {
    pub fn new(ckpt: ActivationCheckpointing, n_layer: usize) -> ActSlots {
        let own = (0..n_layer).filter(|&l| !ckpt.is_checkpointed(l)).count();
        let shared = own < n_layer;
        let mut next = 0;
        let slot = (0..n_layer)
            .map(|l| {
                if ckpt.is_checkpointed(l) {
                    own
                } else {
                    next += 1;
                    next - 1
                }
            })
            .collect();
        ActSlots { slot, sets: own + usize::from(shared), shared }
    }

    /// Whether set `set` is the checkpointed blocks' shared one.
    pub fn is_shared(&self, set: usize) -> bool {
        self.shared && set + 1 == self.sets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpointed_blocks_share_the_last_set() {
        let s = ActSlots::new(ActivationCheckpointing::Every(2), 5);
        assert_eq!(s.slot, vec![2, 0, 2, 1, 2]);
        assert_eq!(s.sets, 3);
        assert!(s.is_shared(2) && !s.is_shared(1));
        let s = ActSlots::new(ActivationCheckpointing::None, 3);
        assert_eq!((s.slot, s.sets, s.shared), (vec![0, 1, 2], 3, false));
        let s = ActSlots::new(ActivationCheckpointing::EveryLayer, 3);
        assert_eq!((s.slot, s.sets, s.shared), (vec![0, 0, 0], 1, true));
    }
}
