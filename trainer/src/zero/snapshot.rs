//! The host copy of this rank's checkpoint shard, for asynchronous checkpoints
//! (`checkpoint.async`): the fp32 master weights, AdamW m and v of the range of every unit
//! this rank saves ([`Engine::checkpoint_range`]), in page-locked host memory on a GPU.
//!
//! It is allocated with the engine, once, and counted in the ledger's host memory
//! (`HostMemory::checkpoint`), so the planner predicts it and `launcher memory` shows it. A
//! save fills it at a step boundary ([`Engine::lend_shard_copy`]) and lends it to the
//! background writer, which hands it back when the shard is on disk
//! ([`Engine::return_shard_copy`]); the next save waits for that.
//!
//! On a GPU the copies are only queued (on the copy stream, after the work queued so far):
//! the training thread goes on at once, the next forward and backward overlap the copy, and
//! the device orders the next optimizer update after it ([`Optimizer::copying_until`]); the
//! writer waits for the copy's event before it reads. Host state (offload) is copied on the
//! training thread.
//!
//! [`Optimizer::copying_until`]: crate::optim::Optimizer::copying_until
//! [`Engine::checkpoint_range`]: crate::zero::Engine::checkpoint_range
//! [`Engine::lend_shard_copy`]: crate::zero::Engine::lend_shard_copy
//! [`Engine::return_shard_copy`]: crate::zero::Engine::return_shard_copy

use super::HostMemory;
use crate::backend::{BResult, Backend, HostRead, HostWait};
use crate::model::ModelLayout;
use std::sync::Arc;

/// The range `[lo, hi)` of a unit of `numel` elements, padded to `shard` per rank, that
/// `rank` writes to a checkpoint: its ZeRO shard, clipped to the unpadded length.
pub(super) fn checkpoint_range(rank: usize, shard: usize, numel: usize) -> (usize, usize) {
    ((rank * shard).min(numel), ((rank + 1) * shard).min(numel))
}

/// One unit's part of the copy: master weights, m and v over `lo..hi`, one after the other.
pub struct CopiedUnit<B: Backend> {
    pub unit: usize,
    pub lo: usize,
    pub hi: usize,
    pub(super) buf: B::HostF32,
}

impl<B: Backend> CopiedUnit<B> {
    /// Tensor `which` (0 = master weights, 1 = m, 2 = v) of the copy: readable on any thread.
    pub fn tensor(&self, which: usize) -> Result<&[f32], String> {
        let n = self.hi - self.lo;
        let all = self.buf.values()?;
        all.get(which * n..(which + 1) * n).ok_or_else(|| {
            format!(
                "the checkpoint copy of unit {} holds {} values, not 3 × {n} (a bug: please report it)",
                self.unit,
                all.len()
            )
        })
    }
}

/// The host copy of a rank's checkpoint shard: every unit it saves a range of, in order.
pub struct ShardCopy<B: Backend> {
    pub units: Vec<CopiedUnit<B>>,
    /// The last queued copy into it (device state): complete before the values are read.
    pub(super) ready: Option<Arc<B::Event>>,
}

impl<B: Backend> ShardCopy<B> {
    /// Buffers for every unit's checkpoint range of `rank` (`units`: each unit's elements per
    /// rank and its unpadded length); their bytes go to `host.checkpoint`.
    pub(super) fn allocate(
        be: &B,
        layout: &ModelLayout,
        units: &[(usize, usize)],
        rank: usize,
        host: &mut HostMemory,
    ) -> BResult<ShardCopy<B>> {
        let mut parts = Vec::new();
        for (i, &(shard, numel)) in units.iter().enumerate() {
            let (lo, hi) = checkpoint_range(rank, shard, numel);
            if hi <= lo {
                continue;
            }
            let what = format!("the checkpoint copy of unit {} (checkpoint.async)", layout.units[i].name);
            let buf = be.alloc_host_f32(3 * (hi - lo), &what)?;
            host.checkpoint += 3 * (hi - lo) as u64 * 4;
            parts.push(CopiedUnit { unit: i, lo, hi, buf });
        }
        Ok(ShardCopy { units: parts, ready: None })
    }

    /// Block until every copy into it has landed (any thread): then its values are the state.
    pub fn wait_filled(&mut self) -> Result<(), String> {
        match self.ready.take() {
            Some(e) => e.wait_host(),
            None => Ok(()),
        }
    }

    /// Bytes of optimizer state in the copy.
    pub fn bytes(&self) -> u64 {
        self.units.iter().map(|u| 3 * (u.hi - u.lo) as u64 * 4).sum()
    }
}
