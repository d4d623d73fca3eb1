//! Host-side access to the [`Engine`]'s state, off the hot path: full parameters and local
//! gradients downloaded for tests and export, the ranges a rank saves and holds, optimizer
//! state read for checkpoints and loaded back (then published as a step would), the host
//! copy of the checkpoint shard lent to a background save (`snapshot.rs`), and the memory
//! reports.

use super::engine::{Engine, EngineComm};
use super::gather::Travel;
use super::memory::MemoryReport;
use super::snapshot::ShardCopy;
use crate::backend::{Backend, Loc};
use crate::optim::HostAdamWStats;
use crate::zero::HostMemory;
use crate::TrainError;
use collectives::AllGatherInPlace;
use std::sync::Arc;

impl<B: Backend> Engine<B> {
    /// Unit `i`'s full parameters on the host (unpadded), gathering if sharded (at compute
    /// precision, FP8 gathers or not).
    /// For tests and export; not for the hot path.
    pub fn full_params_host<C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
        i: usize,
    ) -> Result<Vec<f32>, TrainError> {
        let was_gathered = self.units[i].params.is_some();
        // The parameters themselves, not their FP8 codes expanded: an FP8 gather's unit is
        // gathered at compute precision here (stage 3 holds no unit gathered between steps).
        let got = self.gather_as(be, comm, i, Travel::Compute);
        let out = got.and_then(|()| Ok(be.download_buf(self.params(i), Loc::all(self.units[i].numel))?));
        if !was_gathered {
            self.release(i);
        }
        out
    }

    /// Overwrite one compute parameter (stage 0 only; finite-difference gradient checks).
    pub fn set_param(&mut self, be: &B, unit: usize, index: usize, value: f32) -> Result<(), TrainError> {
        if self.policy.stage != 0 {
            return Err(TrainError::Invalid("set_param is only supported on ZeRO stage 0".into()));
        }
        let p = self.units[unit].params.as_mut().expect("stage 0 params");
        be.upload_buf(&[value], p, index)?;
        self.mark_params_changed();
        Ok(())
    }

    /// Unit `i`'s accumulated (unreduced) local gradient on the host (stage 0/1; tests).
    pub fn local_grads_host(&self, be: &B, i: usize) -> Result<Vec<f32>, TrainError> {
        let u = &self.units[i];
        let g = u.grads.as_ref().ok_or_else(|| TrainError::Invalid("gradients are sharded on this stage".into()))?;
        Ok(be.download_grad(g, Loc::all(u.numel))?)
    }

    /// The range `[lo, hi)` of unit `i` this rank writes to a checkpoint: its ZeRO shard
    /// (clipped to the unpadded length). The same partition on every stage, so stage 0
    /// saves in parallel too and any stage can reload it.
    pub fn checkpoint_range(&self, i: usize) -> (usize, usize) {
        let u = &self.units[i];
        super::snapshot::checkpoint_range(self.rank, u.shard, u.numel)
    }

    /// Bytes of optimizer state this rank writes to a checkpoint (master weights, m and v of
    /// its range of every unit).
    pub fn checkpoint_bytes(&self) -> u64 {
        (0..self.units.len())
            .map(|i| {
                let (lo, hi) = self.checkpoint_range(i);
                12 * (hi - lo) as u64
            })
            .sum()
    }

    /// fp32 master weights, AdamW m and v of unit `i` over `[lo, hi)` (which must lie
    /// within what this rank holds).
    pub fn optimizer_state_host(&self, be: &B, i: usize, lo: usize, hi: usize) -> Result<[Vec<f32>; 3], TrainError> {
        Ok([
            self.optimizer_tensor_host(be, i, 0, lo, hi)?,
            self.optimizer_tensor_host(be, i, 1, lo, hi)?,
            self.optimizer_tensor_host(be, i, 2, lo, hi)?,
        ])
    }

    /// One of unit `i`'s optimizer tensors (0 = master weights, 1 = m, 2 = v) over `[lo, hi)`.
    pub fn optimizer_tensor_host(
        &self,
        be: &B,
        i: usize,
        which: usize,
        lo: usize,
        hi: usize,
    ) -> Result<Vec<f32>, TrainError> {
        let (off, len) = self.opt.range(i);
        if lo < off || hi > off + len {
            return Err(TrainError::Invalid(format!("unit {i}: range {lo}..{hi} is not held by rank {}", self.rank)));
        }
        Ok(self.opt.tensor_host(be, i, which, lo, hi)?)
    }

    /// The unpadded range of unit `i` whose optimizer state this rank holds.
    pub fn held_range(&self, i: usize) -> (usize, usize) {
        let u = &self.units[i];
        let (off, len) = self.opt.range(i);
        (off.min(u.numel), (off + len).min(u.numel))
    }

    /// Replace unit `i`'s optimizer state over its held range with `state` (master, m, v
    /// for exactly `held_range(i)`), then rebuild the compute parameters from the master
    /// weights the same way a step publishes them.
    pub fn load_optimizer_state<C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
        i: usize,
        state: [Vec<f32>; 3],
    ) -> Result<(), TrainError> {
        let (lo, hi) = self.held_range(i);
        let policy = self.policy;
        // A publish or prefetch still writing the parameters finishes first.
        self.finish_gather(be, comm, i)?;
        if state.iter().any(|s| s.len() != hi - lo) {
            return Err(TrainError::Invalid(format!("unit {i}: loaded state does not cover {lo}..{hi}")));
        }
        self.opt.load(be, i, lo, &state)?;
        self.mark_params_changed();
        let rank = self.rank;
        let u = &mut self.units[i];
        if let Some(ps) = u.param_shard.as_mut() {
            self.opt.upload_master(be, i, ps, 0, u.shard)?;
        }
        // Stage 3 outside a gather holds no compute copy: the next gather rounds the
        // loaded master weights (or fetches them). Otherwise the copy is rebuilt as a step
        // publishes it.
        let Some(p) = u.params.as_mut() else { return Ok(()) };
        let (own, len) = if policy.shard_optimizer { (rank * u.shard, u.shard) } else { (0, u.padded) };
        if self.opt.on_host() {
            self.opt.upload_master(be, i, p, own, len)?;
        } else {
            self.opt.cast_params(be, i, p, own, len)?;
        }
        if policy.shard_optimizer {
            let _unit = collectives::progress::unit_scope(i); // for the flight recorder
            AllGatherInPlace::<B::Buf>::all_gather_in_place(comm, p)?;
        }
        Ok(())
    }

    /// Stage 3's FP8 gathers (`zero.fp8_gather`): how many units gather their FP8 weights
    /// as codes, and the bytes one all-gather of all of them moves per rank against the
    /// same units at compute precision.
    pub fn fp8_gathers(&self) -> (usize, usize, usize) {
        let ls = self.units.iter().filter_map(|u| u.fp8.as_ref());
        ls.fold((0, 0, 0), |(n, fp8, full), l| (n + 1, fp8 + l.piece_bytes, full + l.shard * l.elem))
    }

    pub fn memory(&self) -> MemoryReport {
        self.ledger.report()
    }

    /// Host memory held for offload and the checkpoint copy.
    pub fn host_memory(&self) -> HostMemory {
        self.host
    }

    /// What the host optimizer did since the last call (`None` with the optimizer on the device).
    pub fn take_host_optimizer_stats(&mut self) -> Option<HostAdamWStats> {
        self.opt.take_host_stats()
    }
}

/// The host copy of the checkpoint shard (`snapshot.rs`), lent to a background save.
impl<B: Backend> Engine<B> {
    /// Copy this rank's checkpoint shard (master weights, m, v of its range of every unit) to
    /// the host copy and lend it out. Host state is copied before this returns; device state
    /// is queued ([`ShardCopy::wait_filled`] before reading it) and the next update of it is
    /// ordered after the copy. Settle a delayed update first (`Engine::settle`).
    pub fn lend_shard_copy(&mut self, be: &B) -> Result<ShardCopy<B>, TrainError> {
        let mut copy = self.shard_copy.take().ok_or_else(|| {
            TrainError::Invalid(
                "no host copy of the checkpoint shard to fill: it was not allocated (checkpoint.async is off) or a \
                 background save still holds it (a bug: please report it)"
                    .into(),
            )
        })?;
        let mut last = None;
        for part in copy.units.iter_mut() {
            // One copy stream, in queue order: the last event covers every copy.
            if let Some(e) = self.opt.copy_to_host(be, part.unit, part.lo, part.hi, &mut part.buf)? {
                last = Some(e);
            }
        }
        if let Some(e) = last {
            let done = Arc::new(e);
            self.opt.copying_until(done.clone());
            copy.ready = Some(done);
        }
        Ok(copy)
    }

    /// The copy a background save lent is free again.
    pub fn return_shard_copy(&mut self, copy: ShardCopy<B>) {
        self.shard_copy = Some(copy);
    }
}
