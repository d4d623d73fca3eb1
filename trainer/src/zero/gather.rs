//! Compute parameters of the [`Engine`]: make a unit's full parameters available before its
//! forward/backward (`gather`; stage 3 all-gathers the shards, `prefetch_unit` starts that
//! early), give them back after (`release`, into the pool), and, after a step, `publish` the
//! updated pieces (stage 1/2: all-gather in place, overlapping the next forward).
//! With `zero.fp8_gather` a stage-3 unit's FP8 weights travel as e4m3 codes
//! (`backend/fp8_gather.rs`): packed before the all-gather, expanded by `finish_gather`, with
//! amaxes agreed once per parameter version (`refresh_fp8_amax`).
//!
//! Step 1 of a unit's life (see `engine.rs`); gradients are in `reduce.rs`.

use std::sync::Arc;

use super::engine::{Engine, EngineComm};
use super::memory::Category;
use crate::backend::{Backend, Loc};
use crate::TrainError;
use collectives::{AllGatherInPlace, Communicator, Group, ReduceOp};

/// How a unit with an FP8 gather layout (`zero.fp8_gather`) sends its FP8 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Travel {
    /// As e4m3 codes, expanded after the all-gather: what the GEMMs read (training).
    Codes,
    /// At compute precision: the parameters themselves (read back to the host).
    Compute,
}

impl<B: Backend> Engine<B> {
    /// Stage 3: how many units ahead of use the schedule starts all-gathers.
    pub fn prefetch(&self) -> usize {
        self.prefetch
    }

    /// Make unit `i`'s full parameters available (stage 3: all-gather its shards, or wait
    /// for the prefetch that already started it).
    pub fn gather<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C, i: usize) -> Result<(), TrainError> {
        self.gather_as(be, comm, i, Travel::Codes)
    }

    /// [`Engine::gather`], the FP8 weights travelling as `how` says where that is not
    /// already decided (a unit gathered or in flight keeps how it was started).
    pub(super) fn gather_as<C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
        i: usize,
        how: Travel,
    ) -> Result<(), TrainError> {
        self.start_gather(be, comm, i, how)?;
        if let Some(e) = self.units[i].upload_pending.take() {
            be.order_compute_after(&e)?;
        }
        self.finish_gather(be, comm, i)
    }

    /// Wait for unit `i`'s all-gather, if one is in flight, and expand an FP8 gather's
    /// pieces into its parameters (the pieces' buffer back to the pool).
    pub(super) fn finish_gather<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C, i: usize) -> Result<(), TrainError> {
        let u = &mut self.units[i];
        if let Some(p) = u.gather_pending.take() {
            Group::wait(comm, p)?;
        }
        if let Some(pieces) = u.fp8_pieces.take() {
            let l = u.fp8.as_ref().expect("FP8 pieces come from a unit with an FP8 gather layout");
            let amax = u.fp8_amax.as_ref().expect("a unit with an FP8 gather layout has amaxes");
            let full = u.params.as_mut().expect("an FP8 gather fills gathered parameters");
            be.fp8_gather_unpack(l, amax, &pieces, full)?;
            let len = l.buffer_elems();
            self.param_pool.park(len, pieces, len * self.sizes.buf, Category::Params, &mut self.ledger);
        }
        Ok(())
    }

    /// Stage 3: start all-gathering unit `i` without waiting, so it overlaps the compute
    /// that comes before its use (a no-op when it is already gathered or in flight).
    pub fn prefetch_unit<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C, i: usize) -> Result<(), TrainError> {
        self.start_gather(be, comm, i, Travel::Codes)
    }

    /// [`Engine::prefetch_unit`], a unit with an FP8 gather layout sending its FP8 weights
    /// as codes (`Travel::Codes`) or at compute precision.
    fn start_gather<C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
        i: usize,
        how: Travel,
    ) -> Result<(), TrainError> {
        let codes = how == Travel::Codes && self.units[i].fp8.is_some();
        if self.units[i].params.is_none() && codes {
            self.refresh_fp8_amax(be, comm)?;
        }
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
            match u.fp8.as_ref().filter(|_| codes) {
                // FP8 weights travel as codes: this rank's piece packed from its elements,
                // the pieces all-gathered, expanded into `full` by `finish_gather`.
                Some(l) => {
                    let len = l.buffer_elems();
                    let mut pieces =
                        self.param_pool.take(len, len * self.sizes.buf, Category::Params, &mut self.ledger, || {
                            be.alloc_buf(len, &format!("FP8 gather pieces of unit {name}"))
                        })?;
                    let amax = u.fp8_amax.as_ref().expect("a unit with an FP8 gather layout has amaxes");
                    be.fp8_gather_pack(l, self.rank, amax, &full, &mut pieces)?;
                    u.gather_pending = Some(AllGatherInPlace::<B::Buf>::all_gather_in_place_start(comm, &mut pieces)?);
                    u.fp8_pieces = Some(pieces);
                }
                None => {
                    u.gather_pending = Some(AllGatherInPlace::<B::Buf>::all_gather_in_place_start(comm, &mut full)?);
                }
            }
        }
        u.params = Some(full);
        Ok(())
    }

    /// Stage 3's FP8 gathers: where the parameters changed since the amaxes were agreed,
    /// every rank rounds its shard of each unit with FP8 weights (as a gather will), takes
    /// the amax of its part of each weight, and one max-reduction over every unit's gives
    /// each weight's amax (a NaN as infinity: its scale is NaN either way), uploaded for the
    /// casts. Once per parameter version: `step` runs it at its end (outside any recorded
    /// micro-step), the first gather after a build or a load otherwise.
    pub(super) fn refresh_fp8_amax<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        if !self.fp8_amax_stale || self.units.iter().all(|u| u.fp8.is_none()) {
            return Ok(());
        }
        let mut all = Vec::new();
        for i in 0..self.units.len() {
            let u = &self.units[i];
            let Some(l) = &u.fp8 else { continue };
            let mut amax = vec![0f32; l.slots];
            let parts = l.fp8_parts(self.rank);
            if !parts.is_empty() {
                let (padded, shard, own) = (u.padded, u.shard, self.rank * u.shard);
                let name = &self.layout.units[i].name;
                let mut full = self.param_pool.take(
                    padded,
                    padded * self.sizes.buf,
                    Category::Params,
                    &mut self.ledger,
                    || be.alloc_buf(padded, &format!("gathered parameters of unit {name}")),
                )?;
                self.opt.cast_params(be, i, &mut full, own, shard)?;
                let locs: Vec<Loc> = parts.iter().map(|p| p.1).collect();
                let got = be.amax_parts(&full, &locs)?;
                self.param_pool.park(padded, full, padded * self.sizes.buf, Category::Params, &mut self.ledger);
                for ((slot, _), a) in parts.iter().zip(got) {
                    let a = if a.is_nan() { f32::INFINITY } else { a };
                    amax[*slot] = amax[*slot].max(a);
                }
            }
            all.extend(amax);
        }
        Communicator::<[f32]>::all_reduce(comm, &mut all, ReduceOp::Max)?;
        let mut at = 0;
        for u in &mut self.units {
            if let (Some(l), Some(dev)) = (&u.fp8, u.fp8_amax.as_mut()) {
                be.upload_f32(&all[at..at + l.slots], dev, 0)?;
                at += l.slots;
            }
        }
        self.fp8_amax_stale = false;
        Ok(())
    }

    /// Wait for every gather or upload still filling a unit's parameters (stage 1/2's
    /// publish after a step, a delayed update's copies): before recording a micro-step as a
    /// CUDA graph, which cannot wait on work queued outside it, and before each replay,
    /// which would not.
    pub fn await_pending<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        for i in 0..self.units.len() {
            if let Some(e) = self.units[i].upload_pending.take() {
                be.order_compute_after(&e)?;
            }
            self.finish_gather(be, comm, i)?;
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
