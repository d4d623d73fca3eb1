//! Compute parameters of the [`Engine`]: make a unit's full parameters available before its
//! forward/backward (`gather`; stage 3 all-gathers the shards, `prefetch_unit` starts that
//! early), give them back after (`release`, into the pool), and, after a step, `publish` the
//! updated pieces (stage 1/2: all-gather in place, overlapping the next forward).
//!
//! Step 1 of a unit's life (see `engine.rs`); gradients are in `reduce.rs`.

use std::sync::Arc;

use super::engine::{Engine, EngineComm};
use super::memory::Category;
use crate::backend::{Backend, Loc};
use crate::TrainError;
use collectives::{AllGatherInPlace, Group};

impl<B: Backend> Engine<B> {
    /// Stage 3: how many units ahead of use the schedule starts all-gathers.
    pub fn prefetch(&self) -> usize {
        self.prefetch
    }

    /// Make unit `i`'s full parameters available (stage 3: all-gather its shards, or wait
    /// for the prefetch that already started it).
    pub fn gather<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C, i: usize) -> Result<(), TrainError> {
        self.prefetch_unit(be, comm, i)?;
        if let Some(e) = self.units[i].upload_pending.take() {
            be.order_compute_after(&e)?;
        }
        if let Some(p) = self.units[i].gather_pending.take() {
            Group::wait(comm, p)?;
        }
        Ok(())
    }

    /// Stage 3: start all-gathering unit `i` without waiting, so it overlaps the compute
    /// that comes before its use (a no-op when it is already gathered or in flight).
    pub fn prefetch_unit<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C, i: usize) -> Result<(), TrainError> {
        let u = &mut self.units[i];
        if u.params.is_some() {
            return Ok(());
        }
        let name = &self.layout.units[i].name;
        let mut full =
            self.param_pool.take(u.padded, u.padded * self.sizes.buf, Category::Params, &mut self.ledger, || {
                be.alloc_buf(u.padded, &format!("gathered parameters of unit {name}"))
            })?;
        // This rank's piece: rounded from its fp32 master weights on the device (no
        // compute-precision shard is kept: 2 bytes per parameter less), copied from the
        // device shard the host optimizer refreshes, or fetched from the host shard
        // (`offload.params`). The other ranks' pieces arrive beside it.
        let own = self.rank * u.shard;
        if let Some(ps) = &u.param_shard {
            if let Some(e) = u.upload_pending.take() {
                be.order_compute_after(&e)?; // the delayed update's copy into the shard
            }
            be.copy_buf(&mut full, own, ps, Loc::all(u.shard))?;
        } else if self.opt.params_on_host() {
            let e = self.opt.upload_params(be, i, &mut full, own, u.shard)?;
            if self.world == 1 {
                // Nothing to gather: compute waits for the copy only where it uses the unit,
                // so the copy overlaps the compute queued before.
                u.upload_pending = Some(Arc::new(e));
            } else {
                be.order_compute_after(&e)?;
            }
        } else {
            self.opt.cast_params(be, i, &mut full, own, u.shard)?;
        }
        if self.world > 1 {
            let _unit = collectives::progress::unit_scope(i); // for the flight recorder
            u.gather_pending = Some(AllGatherInPlace::<B::Buf>::all_gather_in_place_start(comm, &mut full)?);
        }
        u.params = Some(full);
        Ok(())
    }

    /// Wait for every gather or upload still filling a unit's parameters (stage 1/2's
    /// publish after a step, a delayed update's copies): before recording a micro-step as a
    /// CUDA graph, which cannot wait on work queued outside it, and before each replay,
    /// which would not.
    pub fn await_pending<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        for u in &mut self.units {
            if let Some(e) = u.upload_pending.take() {
                be.order_compute_after(&e)?;
            }
            if let Some(p) = u.gather_pending.take() {
                Group::wait(comm, p)?;
            }
        }
        Ok(())
    }

    /// Done with unit `i`'s parameters for now (stage 3: park the gathered copy in the pool).
    pub fn release(&mut self, i: usize) {
        let u = &mut self.units[i];
        if !self.policy.shard_params {
            return;
        }
        if u.gather_pending.is_some() || u.upload_pending.is_some() {
            // Prefetched but not used yet: the gather that follows waits for it.
            return;
        }
        if let Some(buf) = u.params.take() {
            self.param_pool.park(u.padded, buf, u.padded * self.sizes.buf, Category::Params, &mut self.ledger);
        }
    }

    /// Unit `i`'s gathered parameters. Panics if not gathered: a bug in the model's schedule.
    pub fn params(&self, i: usize) -> &B::Buf {
        self.units[i].params.as_ref().expect("unit parameters used without gather()")
    }

    /// Stage 1/2: all-gather the updated pieces in place. It runs while the next forward
    /// starts; `gather` waits for it.
    pub(super) fn publish<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        if self.policy.shard_optimizer && !self.policy.shard_params {
            for (i, u) in self.units.iter_mut().enumerate() {
                let _unit = collectives::progress::unit_scope(i);
                if let Some(e) = u.upload_pending.take() {
                    be.order_compute_after(&e)?; // the gather sends the uploaded piece
                }
                if let Some(p) = u.gather_pending.take() {
                    Group::wait(comm, p)?; // the step's own publish, before a settle's
                }
                let p = u.params.as_mut().expect("stage 1/2 params");
                u.gather_pending = Some(AllGatherInPlace::<B::Buf>::all_gather_in_place_start(comm, p)?);
            }
        }
        Ok(())
    }
}
