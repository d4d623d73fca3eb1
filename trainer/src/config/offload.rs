//! `[offload]`: the optimizer state and the parameters in host memory.

use super::{bad, ConfigError};
use serde::{Deserialize, Serialize};

/// CPU offload of the optimizer state and the parameters.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadConfig {
    /// fp32 master weights and AdamW moments in host memory, updated by the host AdamW.
    pub optimizer: bool,
    /// ZeRO-3: the rounded parameter shard in page-locked host memory too, fetched at
    /// gather time (needs `optimizer`).
    pub params: bool,
    /// Host threads for the host AdamW; 0 = this rank's share of the node's cores (less one
    /// with `delayed_update`, for the thread that drives the device meanwhile).
    pub cpu_threads: usize,
    /// ZeRO-Offload's one-step delayed update (needs `optimizer`): step t's host AdamW runs
    /// while step t+1's forward and backward run on the GPU, which therefore computes with
    /// weights one update older. Costs 6 bytes per held parameter of page-locked host
    /// memory (the step's gradient and its rounded update); evaluations and checkpoints
    /// first apply the update in flight.
    pub delayed_update: bool,
    /// Steps updated in order before the delay starts (the first steps move the weights
    /// most; ZeRO-Offload also starts its delayed update after a warm-up).
    pub delayed_update_after: usize,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        OffloadConfig {
            optimizer: false,
            params: false,
            cpu_threads: 0,
            delayed_update: false,
            delayed_update_after: 40,
        }
    }
}

impl OffloadConfig {
    /// What `params` and `delayed_update` need of the other keys of this section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.params && !self.optimizer {
            return Err(bad(
                "offload.params",
                true,
                "needs offload.optimizer = true (the host optimizer writes the offloaded parameters)",
            ));
        }
        if self.delayed_update && !self.optimizer {
            return Err(bad(
                "offload.delayed_update",
                true,
                "needs offload.optimizer = true (it delays the host optimizer's update)",
            ));
        }
        if self.delayed_update && self.params {
            return Err(bad(
                "offload.delayed_update",
                true,
                "cannot be combined with offload.params (the update in flight would rewrite the host \
                 parameter shard the running step fetches from); set one of them to false",
            ));
        }
        Ok(())
    }
}
