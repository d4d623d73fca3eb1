//! shardtrain's trainer: decoder models written once over a device backend, and the
//! ZeRO engine (stages 0–3) that shards them across ranks.
//!
//! Where things are (`docs/development/architecture.md` has the map):
//! - `config`: the TOML schema and validation;
//! - `backend`: the device interface as op groups, one file per group; `backend::cpu` is
//!   the f32 reference, `backend::cuda` the GPU, `backend::meta` the memory planner's;
//! - `model`: what every decoder shares (units, the per-unit schedule) and one folder per
//!   model family (`model/gpt2/`);
//! - `zero`: the per-unit sharding mechanism, stage policies, memory accounting and its
//!   prediction;
//! - `optim`: the optimizer (fp32 master weights, AdamW moments, their step) and the
//!   learning-rate schedule;
//! - `checkpoint`: sharded save/resume with resharding, Hugging Face import/export;
//! - `train`: the training loop one rank runs; `documents`: its document starts
//!   (`data.document_mask`); `log`: its log lines, which never stop it.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod documents;
pub mod eval;
pub mod log;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod rng;
pub mod sources;
pub mod train;
pub mod tuning;
pub mod zero;

pub use config::Config;
pub use metrics::StepMetrics;
pub use train::{train, TrainSummary};

use thiserror::Error;

/// Anything that stops training on a rank.
#[derive(Debug, Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Backend(#[from] backend::BackendError),
    #[error("communication failed: {0}")]
    Comm(#[from] collectives::CommError),
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("{0}")]
    Invalid(String),
    #[error("stopped: {0}")]
    Stopped(String),
}
