//! The ZeRO engine: one per-unit mechanism (flat buffer → gather → compute → release;
//! gradients → reduce → shard) with the four stages expressed as a [`Policy`].
//!
//! | stage | optimizer state + fp32 master | gradients | compute parameters |
//! |---|---|---|---|
//! | 0 | full on every rank (all-reduce grads) | full | full |
//! | 1 | shard | full, reduce-scattered at step end | full (all-gathered after update) |
//! | 2 | shard | reduce-scattered per unit during backward; full buffer released | full |
//! | 3 | shard | as stage 2 | shard; gathered per unit before use, released after |
//!
//! Where a stage differs is decided in `Policy`; everything else is shared code: the
//! [`Engine`] in `engine.rs` (its state, a unit's life, micro-steps) and its `impl` blocks by
//! idea, `gather.rs` (parameters), `reduce.rs` (gradients), `step.rs` (the optimizer step),
//! `host.rs` (host-side access for checkpoints and tests).

pub mod engine;
mod gather;
mod host;
pub mod memory;
pub mod plan;
mod reduce;
pub mod snapshot;
mod step;

pub use engine::{Engine, EngineComm, EngineOptions, InitFn, MicroKey, MicroState};
pub use memory::{Category, HostMemory, MemoryBytes, MemoryLedger, MemoryReport};
pub use step::StepStats;

/// What a ZeRO stage shards. Each flag is one decision in the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub stage: u8,
    /// fp32 master weights and AdamW moments are split across ranks (stage >= 1).
    pub shard_optimizer: bool,
    /// Full gradient buffers live only during a unit's backward (stage >= 2).
    pub shard_grads: bool,
    /// Compute parameters live as shards and are gathered on demand (stage 3).
    pub shard_params: bool,
}

impl Policy {
    pub fn for_stage(stage: u8) -> Policy {
        Policy { stage, shard_optimizer: stage >= 1, shard_grads: stage >= 2, shard_params: stage >= 3 }
    }
}
