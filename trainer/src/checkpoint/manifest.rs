//! The checkpoint manifest: what was saved, by whom, and how to check it.

use super::{io_err, CheckpointError};
use crate::config::ModelConfig;
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::Read;
use std::path::Path;

/// Bumped when the on-disk format changes incompatibly.
pub const FORMAT_VERSION: u32 = 1;

/// One unit's range `[lo, hi)` held by a shard file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub unit: usize,
    pub lo: usize,
    pub hi: usize,
}

/// One shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub rank: usize,
    pub bytes: u64,
    pub crc32: u32,
    pub segments: Vec<Segment>,
}

/// One parameter unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitEntry {
    pub name: String,
    pub numel: usize,
}

/// Everything needed to validate and reload a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    /// Optimizer steps completed; training resumes at this step.
    pub step: u64,
    pub world: usize,
    pub stage: u8,
    pub seed: u64,
    pub model: ModelConfig,
    /// The full configuration of the run that saved it, as TOML.
    pub config_toml: String,
    pub units: Vec<UnitEntry>,
    pub files: Vec<FileEntry>,
    /// The run that saved it (`run_id` of its run directory's `run.json`, see `owner.rs`);
    /// absent in checkpoints saved before run ids, which are taken as their directory owner's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// The loader's exact position (rows each data source has served) and what identifies
    /// the data; absent in checkpoints saved before it, whose data position was their step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<data::LoaderState>,
    /// The GEMM algorithms the run used (`train.gemm_tuning = "timed"` or `"searched"`, see `tuning.rs`): a
    /// resume runs the same ones. Absent for heuristic runs, CPU runs and older checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_tuning: Option<crate::backend::GemmTuningTable>,
}

/// The manifest's own checksum: the CRC-32 of manifest.json's bytes, in hex, in this file
/// next to it (written after it, inside the directory that is renamed into place). Absent in
/// checkpoints saved before it, whose manifest is then read unchecked.
pub const MANIFEST_CRC: &str = "manifest.json.crc32";

/// The contents of [`MANIFEST_CRC`] for manifest bytes `text`.
pub(crate) fn manifest_crc_line(text: &[u8]) -> String {
    format!("{:08x}\n", crc32fast::hash(text))
}

/// Size and CRC-32 of a file, streamed.
pub(crate) fn file_crc(path: &Path) -> Result<(u64, u32), CheckpointError> {
    let mut f = fs::File::open(path).map_err(io_err(path))?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        total += n as u64;
    }
    Ok((total, h.finalize()))
}
