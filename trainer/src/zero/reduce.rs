//! Gradients of the [`Engine`]: a unit's full gradient buffer for the backward (stage 2/3:
//! taken from the pool per micro-step), and its reduction once the unit's backward is done
//! (stage 2/3: reduce-scatter into this rank's shard, overlapping the next unit's backward;
//! stage 0/1: all-reduce or reduce-scatter during the step's last micro-step).
//!
//! Step 2 of a unit's life (see `engine.rs`); `step.rs` finishes what is still running.

use super::engine::{Engine, EngineComm};
use super::memory::Category;
use crate::backend::{BResult, Backend, Loc, UnitGrads};
use crate::TrainError;
use collectives::{Communicator, Group, ReduceOp};

impl<B: Backend> Engine<B> {
    /// Parameters and the gradient buffer of unit `i` (allocated on first use in a
    /// micro-step for stage 2/3), fresh if nothing of this step is in it yet.
    pub fn params_and_grads(&mut self, be: &B, i: usize) -> BResult<(&B::Buf, UnitGrads<'_, B>)> {
        self.ensure_grads(be, i)?;
        let u = &mut self.units[i];
        let p = u.params.as_ref().expect("unit parameters used without gather()");
        let buf = u.grads.as_mut().expect("allocated above");
        Ok((p, UnitGrads { buf, fresh: u.grads_fresh }))
    }

    /// Gradient buffer alone (for ops that need no parameters, e.g. the embedding backward).
    pub fn grads(&mut self, be: &B, i: usize) -> BResult<UnitGrads<'_, B>> {
        self.ensure_grads(be, i)?;
        let u = &mut self.units[i];
        Ok(UnitGrads { buf: u.grads.as_mut().expect("allocated above"), fresh: u.grads_fresh })
    }

    /// Stage 2/3: give unit `i` a full gradient buffer for this micro-step, from the pool
    /// when one of the right length is idle (fresh: the backward writes it; only its padding,
    /// which no op writes and another unit of the same padded length may have left
    /// non-zero, is cleared).
    fn ensure_grads(&mut self, be: &B, i: usize) -> BResult<()> {
        let u = &mut self.units[i];
        if u.grads.is_some() {
            return Ok(());
        }
        if self.world == 1 && self.policy.shard_grads {
            // One rank: its shard is the whole unit, so backward accumulates straight into
            // it (no second full buffer, no reduction copy). It was zeroed at begin_step.
            u.grads = u.grad_shard.take();
            return Ok(());
        }
        let name = &self.layout.units[i].name;
        let mut g =
            self.grad_pool.take(u.padded, u.padded * self.sizes.grad, Category::Grads, &mut self.ledger, || {
                be.alloc_grad(u.padded, &format!("gradients of unit {name}"))
            })?;
        if self.clear_grads {
            be.zero_grad(&mut g, Loc::all(u.padded))?;
        } else if u.padded > u.numel {
            be.zero_grad(&mut g, Loc::new(u.numel, u.padded - u.numel))?;
        }
        u.grads = Some(g);
        u.grads_fresh = !self.clear_grads;
        Ok(())
    }

    /// Unit `i`'s backward for this micro-step is complete. Stage 2/3: start reduce-scattering
    /// its full gradient into this rank's shard now (it overlaps the next unit's backward);
    /// the buffer goes back to the pool once that completes (gradient memory released
    /// block by block during backward).
    pub fn unit_backward_done<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C, i: usize) -> Result<(), TrainError> {
        self.units[i].grads_fresh = false;
        if !self.policy.shard_grads {
            if self.final_micro {
                self.start_reduction(comm, i)?;
            }
            return Ok(());
        }
        let Some(full) = self.units[i].grads.take() else { return Ok(()) };
        if self.world == 1 {
            // The gradient was accumulated in the shard itself (ensure_grads).
            if self.final_micro {
                self.opt.grad_ready(be, i, &full)?;
            }
            self.units[i].grad_shard = Some(full);
            return Ok(());
        }
        // The previous unit's reduction had this unit's backward to finish in; its receive
        // buffer is free again once its accumulation (queued here) has read it.
        self.finish_reduce_scatter(be, comm)?;
        let u = &mut self.units[i];
        // The step's first reduction of this unit (every micro-step when grad_accum = 1)
        // overwrites the shard; later ones go through the receive buffer and are added.
        let via_scratch = !u.shard_empty;
        u.shard_empty = false;
        let recv = if via_scratch {
            let shard = u.shard;
            if !self.rs_scratch.iter().any(|(n, _)| *n == shard) {
                self.ledger.alloc(Category::Comm, shard * self.sizes.grad);
                self.rs_scratch.push((shard, be.alloc_grad(shard, "reduce-scatter receive buffer")?));
            }
            &mut self.rs_scratch.iter_mut().find(|(n, _)| *n == shard).expect("made above for this shard length").1
        } else {
            u.grad_shard.as_mut().expect("sharded stages keep a gradient shard")
        };
        let _unit = collectives::progress::unit_scope(i); // for the flight recorder
        let p = Communicator::<B::Grad>::reduce_scatter_start(comm, &full, recv, ReduceOp::Sum)?;
        self.rs_in_flight = Some((i, p, full, via_scratch));
        Ok(())
    }

    /// Stage 0/1: start reducing unit `i`'s complete gradient (stage 0: all-reduce in place;
    /// stage 1: reduce-scatter into this rank's shard). Idempotent within a step (started,
    /// or complete inside a recorded micro-step).
    pub(super) fn start_reduction<C: EngineComm<B>>(&mut self, comm: &mut C, i: usize) -> Result<(), TrainError> {
        let shard_optimizer = self.policy.shard_optimizer;
        let u = &mut self.units[i];
        if u.reduce_pending.is_some() || u.reduced {
            return Ok(());
        }
        let g = u.grads.as_mut().expect("stage 0/1 keep full gradients");
        let _unit = collectives::progress::unit_scope(i); // for the flight recorder
        let p = if shard_optimizer {
            // One rank (no shard kept): the full gradient is the reduced one.
            let Some(s) = u.grad_shard.as_mut() else { return Ok(()) };
            Communicator::<B::Grad>::reduce_scatter_start(comm, g, s, ReduceOp::Sum)?
        } else {
            Communicator::<B::Grad>::all_reduce_start(comm, g, ReduceOp::Sum)?
        };
        u.reduce_pending = Some(p);
        Ok(())
    }

    /// Wait for the reduce-scatter in flight (if any), add it to its unit's gradient shard,
    /// and return its full gradient buffer to the pool.
    pub(super) fn finish_reduce_scatter<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        let Some((i, p, full, via_scratch)) = self.rs_in_flight.take() else { return Ok(()) };
        Group::wait(comm, p)?;
        let u = &mut self.units[i];
        if via_scratch {
            let (_, scratch) = self
                .rs_scratch
                .iter()
                .find(|(n, _)| *n == u.shard)
                .expect("a receive buffer exists for every shard length");
            let shard = u.grad_shard.as_mut().expect("sharded stages keep a gradient shard");
            be.add_grad(shard, 0, scratch, Loc::all(u.shard))?;
        }
        self.grad_pool.park(u.padded, full, u.padded * self.sizes.grad, Category::Grads, &mut self.ledger);
        if self.final_micro {
            // The unit's reduced gradient is complete: the delayed update's copy to the
            // host starts now, under the rest of the backward.
            let shard = self.units[i].grad_shard.as_ref().expect("sharded stages keep a gradient shard");
            self.opt.grad_ready(be, i, shard)?;
        }
        Ok(())
    }
}
