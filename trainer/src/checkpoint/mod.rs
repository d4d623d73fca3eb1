//! Sharded checkpoints: every rank writes its own shard in parallel, rank 0 writes one
//! manifest last, and the whole directory appears atomically (written under a temporary
//! name, fsynced, renamed). Loading validates every file (presence, size, CRC-32, model
//! shape) before training starts and reshards on the fly: a checkpoint from N ranks at
//! stage s loads on M ranks at stage t, each rank reading only the byte ranges it needs.
//!
//! Layout of one checkpoint, `<checkpoint.dir>/step_000100/`:
//! - `manifest.json` — config, step, world size, stage, per-unit sizes, per-file size,
//!   CRC-32 and the unit ranges it holds, and the run that saved it (`owner.rs`);
//! - `rank00000.safetensors`, … — for each unit, this rank's range of the fp32 master
//!   weights, AdamW m and v (`h.3.master`, `h.3.m`, `h.3.v`).
//!
//! The manifest also holds the data loader's position — the rows each data source has
//! served, a count independent of the world size and batch shape — with what identifies
//! the data (shard names and token counts, weights, seq_len, seed), so a resume continues
//! at exactly the next row or is refused when the data changed ([`data::LoaderState`]),
//! and the GEMM algorithms the run used (`gemm_tuning`, `crate::tuning`), so the resumed
//! steps run the same ones. Initialisation is counter-based, so there is no other RNG state
//! to save.
//!
//! `save.rs` writes a checkpoint while every rank waits; `background.rs` (`checkpoint.async`)
//! copies each rank's shard to host memory at the step boundary and writes the same files on
//! a thread while training goes on.

pub mod background;
pub mod hf;
pub mod init;
pub mod load;
pub mod manifest;
pub mod owner;
pub mod save;
mod stream;

pub use load::{find_latest, find_latest_of, CheckpointReader};
pub use manifest::{FileEntry, Manifest, Segment, UnitEntry};
pub use save::{save, SaveMeta};

use std::path::PathBuf;
use thiserror::Error;

/// Checkpoint problems, always naming the file and what is wrong.
#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O on {}: {source}{}", path.display(), io_hint(source))]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {dir} is not usable: {problem}")]
    Invalid { dir: PathBuf, problem: String },
    #[error("no checkpoint to resume in {dir}: {detail}")]
    NoneFound { dir: PathBuf, detail: String },
    /// `train.init_from` (Hugging Face weights or a checkpoint) cannot be used.
    #[error("train.init_from = {}: {problem}", path.display())]
    Init { path: PathBuf, problem: String },
    /// A `checkpoint.async` save whose background write failed (a full disk): the error of
    /// that write, with the step and the directory to resume from.
    #[error(
        "rank {rank}: writing checkpoint step {step} in the background failed ({error}); the newest complete \
         checkpoint in {} is the one to resume from",
        root.display()
    )]
    Background { rank: usize, step: u64, root: PathBuf, error: Box<CheckpointError> },
}

/// What to do about an I/O error that has a usual cause.
fn io_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => {
            " (the disk is full: free space on it or write elsewhere; for checkpoints, point checkpoint.dir at a \
             larger disk or keep fewer with checkpoint.keep)"
        }
        std::io::ErrorKind::FileTooLarge => {
            " (the file-size limit, `ulimit -f`, is lower than the file: raise it in the shell that starts the launcher)"
        }
        std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem => {
            " (not writable: choose a directory this user may write)"
        }
        _ => "",
    }
}

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.into();
    move |source| CheckpointError::Io { path, source }
}

/// The directory name of the checkpoint at `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:08}")
}

/// The shard file of `rank`.
pub fn shard_file_name(rank: usize) -> String {
    format!("rank{rank:05}.safetensors")
}
