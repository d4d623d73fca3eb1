//! The optimizer step of the [`Engine`]: finish the gradient reduction, the global norm of
//! the reduced gradient, clipping, the [`Optimizer`](crate::optim::Optimizer)'s update of the
//! elements this rank owns, and where the rounded update goes; with `offload.delayed_update`,
//! the update still in flight (`settle`) and its uploads.
//!
//! Step 3 of a unit's life (see `engine.rs`); the parameters are then published (`gather.rs`).

use std::sync::Arc;

use super::engine::{all_reduce_f64, Engine, EngineComm, Unit};
use super::Policy;
use crate::backend::{AdamWStep, Backend, F64Pair, Loc};
use crate::optim::optimizer::UnitUpdate;
use crate::optim::Hyper;
use crate::TrainError;
use collectives::Group;

/// What one optimizer step measured.
#[derive(Debug, Clone, Copy)]
pub struct StepStats {
    /// Global L2 norm of the reduced gradient, before clipping.
    pub grad_norm: f64,
    /// Factor applied to the gradient (1 when not clipped).
    pub clip_scale: f32,
}

impl<B: Backend> Unit<B> {
    /// Where the optimizer reads this unit's reduced gradient and writes its rounded update.
    fn update(&mut self, policy: Policy, rank: usize) -> UnitUpdate<'_, B> {
        let Unit { grads, grad_shard, params, param_shard, shard, step_amax, .. } = self;
        let grads = reduced_grads(grads, grad_shard, policy);
        let params = update_target(params, param_shard, policy, rank * *shard);
        UnitUpdate { grads, params, upload: None, step_amax }
    }
}

/// A unit's reduced gradient over the elements this rank owns: the shard where the
/// optimizer is sharded, except stage 1 on one rank, which keeps none (the full gradient
/// is already the reduced one); the full gradient on stage 0.
fn reduced_grads<'a, T>(grads: &'a Option<T>, grad_shard: &'a Option<T>, policy: Policy) -> &'a T {
    let g = if policy.shard_optimizer { grad_shard.as_ref().or(grads.as_ref()) } else { grads.as_ref() };
    g.expect("the reduced gradient of the elements this rank owns")
}

/// Where a unit's rounded update goes: stage 0-2 into their piece of the full compute copy
/// (from `own`, the first element this rank holds, when the optimizer is sharded); ZeRO-3
/// into its device shard if it keeps one (host optimizer), else nowhere (the next gather
/// rounds the master weights, or fetches the host shard).
fn update_target<'a, T>(
    params: &'a mut Option<T>,
    param_shard: &'a mut Option<T>,
    policy: Policy,
    own: usize,
) -> Option<(&'a mut T, usize)> {
    match (params.as_mut(), param_shard.as_mut()) {
        (Some(p), _) if !policy.shard_params => Some((p, if policy.shard_optimizer { own } else { 0 })),
        (_, Some(ps)) => Some((ps, 0)),
        _ => None,
    }
}

impl<B: Backend> Engine<B> {
    /// Finish gradient reduction, clip by the global norm, update, publish parameters.
    pub fn step<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C, h: Hyper, t: u64) -> Result<StepStats, TrainError> {
        let (rank, policy) = (self.rank, self.policy);
        // 0. Nothing cleared the gradients: a unit whose backward never ran holds the last
        // step's (or a pooled buffer's) values, which must not reach the update.
        if let Some(k) = self.units.iter().position(|u| u.grads_fresh) {
            return Err(TrainError::Invalid(format!(
                "unit {} has no gradient this step: its backward did not run since begin_step \
                 (the model's schedule must run every unit's backward in each micro-step)",
                self.layout.units[k].name
            )));
        }
        // 1. Reduction not yet done (or not yet waited for) during backward.
        self.final_micro = false;
        self.finish_reduce_scatter(be, comm)?;
        if !policy.shard_grads {
            for i in 0..self.units.len() {
                self.start_reduction(comm, i)?;
                if let Some(p) = self.units[i].reduce_pending.take() {
                    Group::wait(comm, p)?;
                }
            }
        }
        // 2. Global norm of the reduced gradient (padding is zero and adds nothing): every
        // unit's sum of squares into its device slot, then one download.
        for (i, u) in self.units.iter().enumerate() {
            let at = if !policy.shard_optimizer {
                Loc::all(u.numel)
            } else {
                let lo = (rank * u.shard).min(u.numel);
                let hi = ((rank + 1) * u.shard).min(u.numel);
                Loc::new(0, hi - lo)
            };
            be.grad_sumsq_into(reduced_grads(&u.grads, &u.grad_shard, policy), at, &mut self.norm_slots, i)?;
        }
        let slots = be.download_f32(&self.norm_slots, Loc::all(2 * self.units.len()))?;
        let mut sumsq: f64 = F64Pair::all(&slots).sum();
        if policy.shard_optimizer && self.world > 1 {
            sumsq = all_reduce_f64(comm, sumsq)?;
        }
        let grad_norm = sumsq.sqrt();
        let clip_scale = if h.grad_clip > 0.0 && grad_norm > h.grad_clip as f64 {
            (h.grad_clip as f64 / (grad_norm + 1e-6)) as f32
        } else {
            1.0
        };
        // 3. AdamW on the elements this rank owns, unit by unit.
        let step = AdamWStep {
            lr: h.lr,
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            weight_decay: h.weight_decay,
            t,
            grad_scale: clip_scale,
        };
        let tensors: Vec<&[crate::model::TensorSpec]> = self.layout.units.iter().map(|u| &u.tensors[..]).collect();
        let mut updates: Vec<UnitUpdate<'_, B>> = self.units.iter_mut().map(|u| u.update(policy, rank)).collect();
        self.opt.step(be, &tensors, &mut updates, step)?;
        let uploads: Vec<_> = updates.iter_mut().map(|up| up.upload.take()).collect();
        drop(updates);
        self.await_uploads(uploads);
        self.publish(be, comm)?;
        self.mark_params_changed();
        // The weights this rank wrote whole carry their amaxes into the next version (the
        // publish writes only other ranks' pieces).
        self.params_by_step = self.units.iter().any(|u| !u.step_amax.is_empty());
        self.refresh_fp8_amax(be, comm)?;
        Ok(StepStats { grad_norm, clip_scale })
    }

    /// The delayed update's copies of the units' rounded weights: each unit's first use
    /// (its gather, or stage 1/2's publish) orders compute after its own copy.
    fn await_uploads(&mut self, uploads: Vec<Option<Arc<B::Event>>>) {
        for (u, e) in self.units.iter_mut().zip(uploads) {
            if e.is_some() {
                u.upload_pending = e;
            }
        }
    }

    /// Whether a delayed update (`offload.delayed_update`) is still to reach the parameters.
    pub fn update_in_flight(&self) -> bool {
        self.opt.update_in_flight()
    }

    /// Apply the delayed update in flight, if any, to the parameters the next forward uses
    /// (before an evaluation, a checkpoint, or the end of training; collective on stage 1/2).
    pub fn settle<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        if !self.opt.update_in_flight() {
            return Ok(());
        }
        let (policy, rank) = (self.policy, self.rank);
        let mut dests: Vec<_> = self
            .units
            .iter_mut()
            .map(|u| update_target(&mut u.params, &mut u.param_shard, policy, rank * u.shard))
            .collect();
        let uploads = self.opt.settle(be, &mut dests)?;
        drop(dests);
        self.await_uploads(uploads);
        self.mark_params_changed();
        self.publish(be, comm)
    }
}
