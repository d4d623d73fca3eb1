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
//! Where a stage differs is decided in `Policy`; everything else is shared code in `engine.rs`.

pub mod engine;
pub mod memory;
pub mod plan;

pub use engine::{Engine, EngineComm, EngineOptions, InitFn, MicroKey, MicroState, StepStats};
pub use memory::{Category, HostMemory, MemoryBytes, MemoryLedger, MemoryReport};

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
