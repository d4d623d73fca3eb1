//! `[init]`: how random initial weights are drawn.

use super::{bad, ConfigError};
use serde::{Deserialize, Serialize};

/// How random initial weights are drawn (`train.init_from` starts from given ones instead).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct InitConfig {
    /// Moved to `train.init_from`; kept as a field only so that setting it is a clear error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<toml::Value>,
    /// The random initialisation's scales.
    pub scheme: InitScheme,
}

/// How random initial weights are scaled.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum InitScheme {
    /// GPT-2's: every matrix N(0, 0.02²), residual projections N(0, (0.02 / √(2L))²).
    #[default]
    Gpt2,
    /// Scaled with the width for large models (GPT-NeoX's "small init" and "wang init"):
    /// matrices N(0, 2 / (5C)), residual projections N(0, (2 / (L√C))²).
    Scaled,
}

impl InitConfig {
    /// The moved `init.from` is named.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(v) = &self.from {
            return Err(bad(
                "init.from",
                v,
                "moved to train.init_from (which also takes a Hugging Face model folder or a shardtrain checkpoint): \
                 write it under [train]",
            ));
        }
        Ok(())
    }
}
