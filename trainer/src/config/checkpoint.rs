//! `[checkpoint]`: when and where sharded training checkpoints are written.

use super::{bad, ConfigError};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Sharded training checkpoints.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Save every this many optimizer steps (0 = never).
    pub every: usize,
    /// Where checkpoints go; unset = `<output.dir>/checkpoints`.
    pub dir: Option<PathBuf>,
    /// Keep the newest `keep` checkpoints; older ones are removed after a new one is complete.
    pub keep: usize,
    /// Copy each rank's shard to page-locked host memory at the step boundary and write it on
    /// a background thread while training goes on (the next save, and the end of training,
    /// wait for the previous one). Costs the shard's size in host memory per rank.
    #[serde(rename = "async")]
    pub async_save: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { every: 0, dir: None, keep: 3, async_save: false }
    }
}

impl CheckpointConfig {
    /// `keep` and `async` need checkpoints to be written.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.every > 0 && self.keep == 0 {
            return Err(bad("checkpoint.keep", 0, "must be at least 1 when checkpoint.every > 0"));
        }
        if self.async_save && self.every == 0 {
            return Err(bad(
                "checkpoint.async",
                true,
                "writes checkpoints in the background, and checkpoint.every = 0 writes none: set checkpoint.every \
                 or drop checkpoint.async",
            ));
        }
        Ok(())
    }
}
