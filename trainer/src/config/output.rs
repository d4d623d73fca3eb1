//! `[output]`: the run directory.

use super::{bad, ConfigError};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where a run writes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OutputConfig {
    /// Run directory: rank logs, metrics.jsonl, built-in data cache.
    pub dir: PathBuf,
}

impl Default for OutputConfig {
    fn default() -> Self {
        OutputConfig { dir: PathBuf::from("runs/default") }
    }
}

impl OutputConfig {
    /// The directory is named.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.dir.as_os_str().is_empty() {
            return Err(bad("output.dir", "\"\"", "must name a directory"));
        }
        Ok(())
    }
}
