//! Which saved-activation set each block uses under activation checkpointing, shared by
//! every family: a block that is not checkpointed keeps a set of its own; checkpointed
//! blocks keep only their input and share one set, which the recompute before each one's
//! backward fills again.

use crate::config::ActivationCheckpointing;

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
