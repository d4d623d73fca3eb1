//! Recording a stretch of queued device work once and replaying it (CUDA graphs): one
//! micro-step's forward and backward as a single launch instead of hundreds. What a
//! replay needs is the engine's discipline already: no allocation after the first step,
//! fixed shapes, buffers that stay put. Backends with no queue to record (the CPU
//! reference, the memory planner) say so and run eagerly.

use super::{BResult, BackendError, Device};

pub trait GraphOps: Device {
    /// A recorded, replayable stretch of work.
    type Graph;

    /// Whether this backend records and replays (the trainer runs eagerly otherwise).
    fn graphs_supported(&self) -> bool {
        false
    }
    /// Start recording the work queued from now on instead of running it.
    fn begin_capture(&self) -> BResult<()> {
        Err(BackendError::Device(format!("{}: no graph capture", self.name())))
    }
    /// Stop recording; the recorded work has not run yet.
    fn end_capture(&self) -> BResult<Self::Graph> {
        Err(BackendError::Device(format!("{}: no graph capture", self.name())))
    }
    /// Queue the recorded work once more.
    fn replay(&self, _g: &Self::Graph) -> BResult<()> {
        Err(BackendError::Device(format!("{}: no graph capture", self.name())))
    }
}
