//! Training configuration: the TOML schema, `--set section.key=value` overrides, and validation.
//!
//! Every field a user can set lives here, one file per section, each owning its struct, its
//! defaults and the checks on its own keys (`model.rs`, `train.rs`, `zero.rs`,
//! `checkpointing.rs`, `checkpoint.rs`, `init.rs`, `offload.rs`, `data.rs`, `output.rs`,
//! `watchdog.rs`); the checks that tie one section to another are in `rules.rs`, the model
//! family the config names in `family.rs` (`model/` builds it), reading a file and its
//! overrides in `load.rs`. Unknown keys and wrong types are rejected by serde
//! (`deny_unknown_fields`); impossible values are rejected by [`Config::validate`] with an
//! error that names the key and says how to fix it. `docs/reference/config.md` lists every
//! key, made from these structs' doc comments (`reference.rs`, a test, keeps it in step).
//!
//! This module imports nothing above `backend` (whose value types some keys take):
//! [`Config::load`], which reads `train.init_from`'s model, is defined in
//! `checkpoint::init` and passes that reader to [`Config::load_with`].

mod checkpoint;
mod checkpointing;
mod data;
mod family;
mod init;
mod load;
mod model;
mod offload;
mod output;
mod rules;
mod train;
mod watchdog;
mod zero;

#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

pub use checkpoint::CheckpointConfig;
pub use checkpointing::{ActivationCheckpointing, CheckpointingConfig, KeepGelu};
pub use data::{DataConfig, SourceConfig};
pub use family::ModelFamily;
pub use init::{InitConfig, InitScheme};
pub use load::{apply_override, ModelSource};
pub use model::ModelConfig;
pub use offload::OffloadConfig;
pub use output::OutputConfig;
pub use rules::MAX_LAYERS;
pub use train::{Fp8WeightCache, TrainConfig};
pub use watchdog::{WatchdogConfig, MAX_FLIGHT_RECORDS};
pub use zero::ZeroConfig;

use model::MODEL_KEYS;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use thiserror::Error;

/// A configuration problem, always naming the file/key and the fix.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("bad --set `{arg}`: {message}")]
    Override { arg: String, message: String },
    #[error("config key `{key}` = {value}: {message}")]
    Invalid { key: &'static str, value: String, message: String },
}

/// The whole configuration file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    #[serde(default)]
    pub train: TrainConfig,
    #[serde(default)]
    pub zero: ZeroConfig,
    #[serde(default)]
    pub checkpointing: CheckpointingConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub init: InitConfig,
    #[serde(default)]
    pub offload: OffloadConfig,
    #[serde(default)]
    pub data: DataConfig,
    #[serde(default)]
    pub output: OutputConfig,
    #[serde(default)]
    pub watchdog: WatchdogConfig,
}

impl Config {
    /// The directory checkpoints are written to and resumed from.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint.dir.clone().unwrap_or_else(|| self.output.dir.join("checkpoints"))
    }

    /// Reject impossible values with an error that names the key and the fix: each
    /// section's own checks in file order, then the rules across sections.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate()?;
        self.train.validate()?;
        self.zero.validate()?;
        self.init.validate()?;
        self.offload.validate()?;
        self.checkpointing.validate()?;
        self.checkpoint.validate()?;
        self.watchdog.validate()?;
        self.output.validate()?;
        self.data.validate()?;
        self.validate_across()
    }
}

/// A [`ConfigError::Invalid`] naming `key`.
fn bad(key: &'static str, value: impl ToString, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key, value: value.to_string(), message: message.into() }
}
