//! What a rank reports after each optimizer step (sent to the launcher, written to metrics.jsonl).

use crate::zero::MemoryReport;
use serde::{Deserialize, Serialize};

/// One optimizer step as seen by one rank. Loss and norm are global (already reduced).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepMetrics {
    /// 1-based optimizer step.
    pub step: u64,
    /// Mean training loss over the global batch.
    pub loss: f64,
    pub lr: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens in the global batch.
    pub tokens: u64,
    /// Wall time of the step on this rank.
    pub step_time_s: f64,
    /// Validation loss, when evaluated at this step.
    pub val_loss: Option<f64>,
    /// This rank's memory by category.
    pub memory: MemoryReport,
    /// What the device driver says this process's GPU holds (`None` on the CPU backend).
    #[serde(default)]
    pub device: Option<DeviceMemory>,
    /// With the optimizer offloaded: the host AdamW's time and parameters this step.
    #[serde(default)]
    pub host_optimizer: Option<crate::optim::HostAdamWStats>,
    /// With `[[data.sources]]`: each source's rows, epochs and validation loss. (Sent to
    /// the launcher with bincode, which has no optional fields: never skip serialising.)
    #[serde(default)]
    pub sources: Vec<SourceMetrics>,
    /// A checkpoint saved at the end of this step: how long it held training up.
    #[serde(default)]
    pub checkpoint: Option<CheckpointMetrics>,
}

/// One data source of a mixture after a step.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SourceMetrics {
    pub name: String,
    /// Rows it has served since the run began.
    pub rows: u64,
    /// Epochs of it trained on (rows / windows per epoch): above 1, the source repeats.
    pub epochs: f64,
    /// Its validation loss, when evaluated at this step and it has a validation split.
    pub val_loss: Option<f64>,
}

/// A checkpoint save as the training thread saw it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct CheckpointMetrics {
    /// Seconds the step boundary was blocked: the whole save when synchronous; with
    /// `checkpoint.async` waiting for the previous save, the barrier and the host copy.
    pub stall_s: f64,
    /// Of that, waiting for the previous background save (0 when synchronous).
    pub waited_s: f64,
    /// Bytes of optimizer state this rank saves.
    pub bytes: u64,
    /// Written in the background (`checkpoint.async`).
    pub background: bool,
}

pub use crate::backend::{DeviceMemory, RuntimeMemory};
