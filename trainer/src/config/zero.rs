//! `[zero]`: the ZeRO stage and what it gathers.

use super::{bad, ConfigError};
use serde::{Deserialize, Serialize};

/// ZeRO stage and communication sizing.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ZeroConfig {
    /// 0 = data parallel, 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters.
    pub stage: u8,
    /// Removed: gradients are reduced one unit (a whole block) at a time, which is the
    /// bucket. Kept as a field only so that setting it is a clear error, not an unknown key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket_mb: Option<toml::Value>,
    /// Stage 3: how many blocks ahead to all-gather parameters.
    pub prefetch_blocks: usize,
    /// Stage 3 with `train.precision = "fp8"` on several ranks: all-gather the blocks'
    /// linear weights as FP8 codes (one byte each, with their tensors' scales) instead of at
    /// compute precision (`backend/fp8_gather.rs`): the same bits, half the bytes. Off by
    /// default: within one NVLink node the gathers are hidden behind compute and the casts
    /// cost more than the bytes save (0.77× the step at GPT-2 1.5B on 2 H200s, BENCHMARKS.md
    /// run 18); for jobs whose gathers are exposed (slow links). Elsewhere it changes nothing.
    pub fp8_gather: bool,
}

impl Default for ZeroConfig {
    fn default() -> Self {
        ZeroConfig { stage: 0, bucket_mb: None, prefetch_blocks: 1, fp8_gather: false }
    }
}

impl ZeroConfig {
    /// The stage exists; the removed `bucket_mb` is named.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.stage > 3 {
            return Err(bad(
                "zero.stage",
                self.stage,
                "ZeRO stages are 0 (data parallel), 1 (optimizer), 2 (+gradients) and 3 (+parameters)",
            ));
        }
        if let Some(v) = &self.bucket_mb {
            return Err(bad(
                "zero.bucket_mb",
                v,
                "was removed: gradients are reduced one unit (a whole transformer block) at a time as its \
                 backward finishes, so the block is the bucket; delete the key",
            ));
        }
        Ok(())
    }
}
