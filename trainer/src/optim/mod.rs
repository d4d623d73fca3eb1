//! Optimisation: the learning-rate schedule and the optimizer that owns the fp32 master
//! weights and AdamW moments of the elements this rank updates.
//!
//! The ZeRO engine decides *which* elements a rank owns (its shard, or everything at
//! stage 0) and hands the optimizer each unit's reduced gradient; the optimizer decides
//! *where* that state lives and runs the update (`optimizer.rs`).

mod delayed;
pub mod host_adamw;
pub mod optimizer;
pub mod schedule;
mod unit;

pub use host_adamw::{HostAdamW, HostAdamWStats, HostValues};
pub use optimizer::{Hyper, Optimizer};
pub use schedule::lr_at;
