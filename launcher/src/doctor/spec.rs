//! What every rank of a doctor run measures ([`Spec`]): node 0's launcher decides it from
//! the flags (`commands::doctor`), writes it beside the ranks' config, and each rank reads it
//! back ([`read_spec`]). A leaf of `doctor/`: the measurement and the report both read it.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// What every rank measures (the launcher writes it for its ranks; nodes must agree).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spec {
    /// All-reduce and all-gather sizes in bytes (all-gather: the gathered buffer).
    pub sizes: Vec<u64>,
    /// Bytes each way per pair in the link test.
    pub link_bytes: u64,
    pub expect_gbps: Option<f64>,
    pub threshold: f64,
    /// `--json FILE`: node 0 also writes its report there.
    pub json: Option<PathBuf>,
}

/// A rank's doctor plan, as its launcher wrote it.
pub fn read_spec(path: &std::path::Path) -> Result<Spec, String> {
    let text = std::fs::read(path).map_err(|e| format!("cannot read the doctor's plan {}: {e}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("the doctor's plan {} is unreadable: {e}", path.display()))
}
