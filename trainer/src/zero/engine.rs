//! The per-unit ZeRO mechanism shared by all stages; [`Policy`] says what is sharded.
//!
//! Life of a unit (one flat parameter group) in one optimizer step:
//! 1. `gather` before its forward/backward (stage 3: all-gather the shards), `release` after;
//! 2. backward writes (the step's first micro-step: nothing clears the buffer before) or
//!    accumulates into its full gradient buffer; `unit_backward_done` then
//!    (stage 2/3) reduce-scatters it into this rank's gradient shard and frees it;
//! 3. `step` finishes the reduction (stage 0 all-reduce, stage 1 reduce-scatter), computes
//!    the global gradient norm over the *reduced* gradient (sharded stages sum their shards'
//!    squares across ranks), clips, has the [`Optimizer`] update the elements this rank
//!    owns, and publishes the new compute parameters (stage 1/2: all-gather).
//!
//! Every buffer goes through the [`MemoryLedger`], so the per-rank report covers them all.

use std::sync::Arc;

use super::memory::{Category, MemoryLedger, MemoryReport};
use super::Policy;
use crate::backend::{AdamWStep, BResult, Backend, F64Pair, Loc, UnitGrads};
use crate::config::Config;
use crate::model::ModelLayout;
use crate::optim::optimizer::{Placement, UnitUpdate};
use crate::optim::{HostAdamWStats, Hyper, Optimizer};
use crate::zero::HostMemory;
use crate::TrainError;
use collectives::{AllGatherInPlace, Communicator, Group, Pending, ReduceOp};

/// The collectives the engine needs: on compute buffers, on gradients, and on host scalars.
pub trait EngineComm<B: Backend>:
    Communicator<B::Buf> + AllGatherInPlace<B::Buf> + Communicator<B::Grad> + Communicator<[f32]>
{
}
impl<B: Backend, T> EngineComm<B> for T where
    T: Communicator<B::Buf> + AllGatherInPlace<B::Buf> + Communicator<B::Grad> + Communicator<[f32]>
{
}

/// Shard sizes are rounded up to this many elements (aligned vector access on devices).
const SHARD_ALIGN: usize = 8;

/// How the engine is built, from `[zero]` and `[offload]` of the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// ZeRO stage 0–3.
    pub stage: u8,
    /// Stage 3: how many units ahead of use to start all-gathers (`zero.prefetch_blocks`).
    pub prefetch: usize,
    /// Where the optimizer state lives (`offload.optimizer`, `offload.params`,
    /// `offload.cpu_threads`).
    pub optimizer: Placement,
}

impl EngineOptions {
    pub fn from_config(cfg: &Config) -> EngineOptions {
        let o = &cfg.offload;
        let optimizer = if o.optimizer {
            Placement::Host {
                threads: o.cpu_threads,
                params_on_host: o.params,
                delay_after: o.delayed_update.then_some(o.delayed_update_after as u64),
            }
        } else {
            Placement::Device
        };
        EngineOptions { stage: cfg.zero.stage, prefetch: cfg.zero.prefetch_blocks, optimizer }
    }

    /// Stage `stage` with the default prefetch, the optimizer on the device (tests, tools).
    pub fn stage(stage: u8) -> EngineOptions {
        EngineOptions { stage, prefetch: 1, optimizer: Placement::Device }
    }
}

/// Initial values of unit `u` over an element range (unpadded unit coordinates).
pub type InitFn<'a> = dyn FnMut(usize, std::ops::Range<usize>) -> Result<Vec<f32>, TrainError> + 'a;

/// Which recording of a micro-step applies (see [`Engine::micro_key`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MicroKey {
    /// The step's first micro-step (several ranks).
    pub first: bool,
    /// The step's last micro-step (several ranks).
    pub last: bool,
}

/// The engine's host-side state after a micro-step (see [`Engine::micro_state`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroState {
    shard_empty: Vec<bool>,
    reduced: Vec<bool>,
    grads_fresh: Vec<bool>,
}

/// What one optimizer step measured.
#[derive(Debug, Clone, Copy)]
pub struct StepStats {
    /// Global L2 norm of the reduced gradient, before clipping.
    pub grad_norm: f64,
    /// Factor applied to the gradient (1 when not clipped).
    pub clip_scale: f32,
}

struct Unit<B: Backend> {
    numel: usize,
    /// Elements per rank; `padded = shard * world`.
    shard: usize,
    padded: usize,
    /// Full compute parameters (always for stage 0-2; while gathered for stage 3).
    params: Option<B::Buf>,
    /// Stage 3 with the optimizer on the host (and the parameters not): this rank's
    /// rounded parameters on the device, the gather's source, refreshed by every step.
    param_shard: Option<B::Buf>,
    /// A parameter upload from the host still filling `params` (one rank, `offload.params`:
    /// the gather orders compute after it).
    upload_pending: Option<Arc<B::Event>>,
    /// The all-gather filling `params` may still be running: stage 3's prefetch, or
    /// stage 1/2's publish of the updated parameters (waited for at the next `gather`).
    gather_pending: Option<Pending>,
    /// Stage 0/1: the gradient reduction started during the last micro-step's backward.
    reduce_pending: Option<Pending>,
    /// Stage 0/1: this step's reduction is complete already (a recorded final micro-step
    /// waits for its reductions inside the recording), so `step` does not start it again.
    reduced: bool,
    /// Full gradient accumulation buffer (always for stage 0/1; during backward for 2/3).
    grads: Option<B::Grad>,
    /// `grads` holds nothing of this step yet and was not cleared: the next backward writes
    /// every element instead of adding (see [`UnitGrads`]). Set by `begin_step` (and, where
    /// each micro-step takes a pooled buffer, by `ensure_grads`); cleared once the unit's
    /// backward is done.
    grads_fresh: bool,
    /// This rank's reduced gradient shard (stage >= 1; stage 1 on one rank keeps none and
    /// `grads` serves).
    grad_shard: Option<B::Grad>,
    /// Stage 2/3: no reduce-scatter has reached the shard yet this step, so the next one
    /// writes it directly instead of through the receive buffer and an addition.
    shard_empty: bool,
}

impl<B: Backend> Unit<B> {
    /// Where the optimizer reads this unit's reduced gradient and writes its rounded update.
    fn update(&mut self, policy: Policy, rank: usize) -> UnitUpdate<'_, B> {
        let Unit { grads, grad_shard, params, param_shard, shard, .. } = self;
        let grads = reduced_grads(grads, grad_shard, policy);
        UnitUpdate { grads, params: update_target(params, param_shard, policy, rank * *shard), upload: None }
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

/// The ZeRO engine for one rank.
pub struct Engine<B: Backend> {
    pub policy: Policy,
    pub rank: usize,
    pub world: usize,
    pub layout: ModelLayout,
    units: Vec<Unit<B>>,
    /// Stage 2/3 receive buffers for reduce-scatter before accumulating into the shard,
    /// one per distinct shard length (the embedding unit and the blocks differ).
    rs_scratch: Vec<(usize, B::Grad)>,
    /// Released working buffers kept for reuse, by length (ledger category `Cached`):
    /// after the first step, gathers and gradient buffers allocate nothing.
    param_pool: Pool<B::Buf>,
    grad_pool: Pool<B::Grad>,
    /// Stage 2/3: the last finished unit's reduce-scatter, still running on the
    /// communication stream while backward continues: (unit, pending, its full gradient,
    /// whether it lands in the receive buffer and must still be added to the shard).
    rs_in_flight: Option<(usize, Pending, B::Grad, bool)>,
    /// Stage 3: how many units ahead of use to start all-gathers (`zero.prefetch_blocks`).
    prefetch: usize,
    /// fp32 master weights and AdamW moments of the elements this rank updates.
    opt: Optimizer<B>,
    /// Host memory held for offload.
    host: HostMemory,
    /// The micro-step running is the step's last (see [`Engine::set_final_micro`]).
    final_micro: bool,
    /// Clear every gradient buffer before use and have backward add onto zeros, instead of
    /// the first backward writing it ([`Engine::set_clear_grads`]).
    clear_grads: bool,
    /// Per-unit sums of squared gradients as [`F64Pair`]s, filled on the device and read
    /// with one download per step.
    norm_slots: B::F32,
    pub ledger: MemoryLedger,
    sizes: crate::backend::ElemBytes,
}

/// Idle working buffers by length, kept for reuse so the steady-state step allocates
/// nothing. Parked buffers stay in the ledger, under `Cached`.
struct Pool<T> {
    idle: Vec<(usize, T)>,
}

impl<T> Pool<T> {
    /// An idle buffer of `len` elements (moved from `Cached` to `cat`), or a new one from `alloc`.
    fn take(
        &mut self,
        len: usize,
        bytes: usize,
        cat: Category,
        ledger: &mut MemoryLedger,
        alloc: impl FnOnce() -> BResult<T>,
    ) -> BResult<T> {
        match self.idle.iter().position(|(n, _)| *n == len) {
            Some(k) => {
                ledger.reassign(Category::Cached, cat, bytes);
                Ok(self.idle.swap_remove(k).1)
            }
            None => {
                ledger.alloc(cat, bytes);
                alloc()
            }
        }
    }

    /// Return a buffer of `len` elements that was counted under `cat`.
    fn park(&mut self, len: usize, buf: T, bytes: usize, cat: Category, ledger: &mut MemoryLedger) {
        ledger.reassign(cat, Category::Cached, bytes);
        self.idle.push((len, buf));
    }
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

impl<B: Backend> Engine<B> {
    /// Build every unit's state. `init(u, range)` gives unit `u`'s initial values over an
    /// element range; only the range this rank holds is asked for (stage 3: its shard).
    /// `None` leaves every buffer zero: the memory planner, whose backend holds no values,
    /// so that planning allocates nothing that grows with the model.
    pub fn new(
        be: &B,
        layout: ModelLayout,
        opts: EngineOptions,
        rank: usize,
        world: usize,
        mut init: Option<&mut InitFn<'_>>,
    ) -> Result<Engine<B>, TrainError> {
        let policy = Policy::for_stage(opts.stage);
        let sizes = be.elem_bytes();
        let mut ledger = MemoryLedger::default();
        let mut units = Vec::with_capacity(layout.units.len());
        let mut opt = Optimizer::new(be, opts.optimizer, rank)?;
        let mut host_mem = HostMemory::default();
        if opt.params_on_host() && !policy.shard_params {
            return Err(TrainError::Invalid(
                "offload.params needs zero.stage = 3 (stages 0-2 keep the full parameters on the device); \
                 set zero.stage = 3 or offload.params = false"
                    .into(),
            ));
        }
        for (ui, ul) in layout.units.iter().enumerate() {
            let numel = ul.numel;
            let shard = round_up(numel.div_ceil(world).max(1), SHARD_ALIGN);
            let padded = shard * world;
            // Stage 3 keeps only its shard, so only that range is made (or read); the others
            // hold the whole unit. `host` covers `base..base + len`, zero-padded.
            let (base, len) = if policy.shard_params { (rank * shard, shard) } else { (0, padded) };
            let host = match init.as_mut() {
                Some(f) => {
                    let (lo, hi) = (base.min(numel), (base + len).min(numel));
                    let mut v = f(ui, lo..hi)?;
                    if v.len() != hi - lo {
                        return Err(TrainError::Invalid(format!(
                            "initial values of unit {} over {lo}..{hi} have {} elements, expected {}",
                            ul.name,
                            v.len(),
                            hi - lo
                        )));
                    }
                    v.resize(len, 0.0);
                    Some(v)
                }
                None => None,
            };
            let (opt_off, opt_len) = if policy.shard_optimizer { (rank * shard, shard) } else { (0, padded) };
            let opt_init = host.as_ref().map(|h| &h[opt_off - base..opt_off - base + opt_len]);
            opt.add_unit(be, &ul.name, (opt_off, opt_len), opt_init, &mut ledger, &mut host_mem)?;
            let what = |s: &str| format!("{s} of unit {}", ul.name);

            let params = if policy.shard_params {
                None
            } else {
                // Full compute copy straight from the initial values (no collective needed).
                let mut p = be.alloc_buf(padded, &what("parameters"))?;
                if let Some(h) = &host {
                    let mut staging = be.alloc_f32(padded, &what("init staging"))?;
                    be.upload_f32(h, &mut staging, 0)?;
                    be.cast_to_buf(&mut p, 0, &staging, Loc::all(padded))?;
                }
                ledger.alloc(Category::Params, padded * sizes.buf);
                Some(p)
            };
            // ZeRO-3 with the optimizer on the host: the gather's source stays on the device
            // (unless the parameters are offloaded too).
            let param_shard = if policy.shard_params && opt.on_host() && !opt.params_on_host() {
                let mut p = be.alloc_buf(shard, &what("parameter shard"))?;
                if let Some(h) = &host {
                    be.upload_buf(h, &mut p, 0)?;
                }
                ledger.alloc(Category::Params, shard * sizes.buf);
                Some(p)
            } else {
                None
            };
            let grads = if policy.shard_grads {
                None
            } else {
                let mut g = be.alloc_grad(padded, &what("gradients"))?;
                be.zero_grad(&mut g, Loc::all(padded))?;
                ledger.alloc(Category::Grads, padded * sizes.grad);
                Some(g)
            };
            // Stage 1 on one rank: the shard would be a copy of the whole gradient (twice the
            // gradient memory and a copy per step), so the full buffer serves as the shard.
            let grad_shard = if policy.shard_optimizer && (policy.shard_grads || world > 1) {
                let mut g = be.alloc_grad(shard, &what("gradient shard"))?;
                be.zero_grad(&mut g, Loc::all(shard))?;
                ledger.alloc(Category::Grads, shard * sizes.grad);
                Some(g)
            } else {
                None
            };
            units.push(Unit {
                numel,
                shard,
                padded,
                params,
                param_shard,
                upload_pending: None,
                gather_pending: None,
                reduce_pending: None,
                reduced: false,
                grads,
                grads_fresh: false,
                grad_shard,
                shard_empty: true,
            });
        }
        // Receive buffers are made on first use: only gradient accumulation over several
        // ranks needs them (a step's first reduction of a unit writes its shard directly).
        let rs_scratch: Vec<(usize, B::Grad)> = Vec::new();
        opt.allocate_staging(be, &mut host_mem)?;
        ledger.set_host(host_mem);
        ledger.alloc(Category::Workspace, 2 * units.len() * sizes.f32);
        let norm_slots = be.alloc_f32(2 * units.len(), "gradient norm partial sums")?;
        Ok(Engine {
            policy,
            rank,
            world,
            layout,
            units,
            rs_scratch,
            param_pool: Pool { idle: vec![] },
            grad_pool: Pool { idle: vec![] },
            rs_in_flight: None,
            prefetch: opts.prefetch,
            opt,
            host: host_mem,
            final_micro: false,
            clear_grads: false,
            norm_slots,
            ledger,
            sizes,
        })
    }

    /// Stage 3: how many units ahead of use the schedule starts all-gathers.
    pub fn prefetch(&self) -> usize {
        self.prefetch
    }

    pub fn num_units(&self) -> usize {
        self.units.len()
    }

    /// Say whether the coming micro-step is the optimizer step's last. Stage 0/1 then start
    /// each unit's gradient reduction as soon as its backward is done, so it overlaps the
    /// rest of the backward instead of running after it. Without it `step` reduces everything.
    pub fn set_final_micro(&mut self, last: bool) {
        self.final_micro = last;
    }

    /// Start a new optimizer step's gradients. Nothing is cleared: the step's first
    /// backward writes every element of each unit's gradient (clearing 4 bytes a parameter
    /// first took 1.5 ms a step at 1.5B on an H200). Stage 2/3 on several ranks take a
    /// buffer per micro-step (`ensure_grads`), and a reduce-scatter's first landing
    /// overwrites the shard (`shard_empty`).
    pub fn begin_step(&mut self, be: &B) -> BResult<()> {
        for u in &mut self.units {
            u.grads_fresh = !self.clear_grads;
            if self.clear_grads {
                if let Some(g) = u.grads.as_mut() {
                    be.zero_grad(g, Loc::all(u.padded))?;
                }
                if let Some(g) = u.grad_shard.as_mut() {
                    be.zero_grad(g, Loc::all(u.shard))?;
                }
            }
            u.shard_empty = true;
            u.reduced = false;
        }
        Ok(())
    }

    /// Clear the gradient buffers (at `begin_step`, and each pooled one as a micro-step
    /// takes it) and have the backward add onto zeros, as the engine did before the first
    /// backward wrote them. The same bits either way: the tests check the written path
    /// against this one (an element a model failed to write would keep a stale value).
    pub fn set_clear_grads(&mut self, on: bool) {
        self.clear_grads = on;
    }

    /// What decides the work a micro-step queues besides the buffers it uses, i.e. which
    /// CUDA-graph recording a micro-step can replay (`first`/`last`: the step's first and
    /// last micro-step). Every rank count: the first micro-step writes the gradients, later
    /// ones add to them (and, on several ranks, a step's first reduce-scatter of a unit
    /// overwrites its shard, stage 2/3). Several ranks only: the last micro-step reduces
    /// during backward (one rank's reduction waits for `step`).
    pub fn micro_key(&self, first: bool, last: bool) -> MicroKey {
        MicroKey { first, last: last && self.world > 1 }
    }

    /// The host-side state a micro-step leaves behind (which shards a reduction has
    /// reached, which reductions are complete): a replay queues the recorded work but runs
    /// no host code, so the trainer records this after the recording and restores it
    /// after each replay.
    pub fn micro_state(&self) -> MicroState {
        MicroState {
            shard_empty: self.units.iter().map(|u| u.shard_empty).collect(),
            reduced: self.units.iter().map(|u| u.reduced).collect(),
            grads_fresh: self.units.iter().map(|u| u.grads_fresh).collect(),
        }
    }

    /// Set the host-side state a replayed micro-step left (see [`Engine::micro_state`]).
    pub fn restore_micro_state(&mut self, s: &MicroState) {
        for (k, u) in self.units.iter_mut().enumerate() {
            u.shard_empty = s.shard_empty[k];
            u.reduced = s.reduced[k];
            u.grads_fresh = s.grads_fresh[k];
        }
    }

    /// End a micro-step that is being recorded: order the compute stream after every
    /// collective the micro-step started (a recording must join all the work it forked to
    /// the communication stream, and a later wait could not reach inside it), and finish
    /// what waits on them (the last reduce-scatter's accumulation and its buffer's return
    /// to the pool). Eager micro-steps leave them running into `step`, which waits for them.
    pub fn join_micro<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        self.finish_reduce_scatter(be, comm)?;
        for u in &mut self.units {
            if let Some(p) = u.reduce_pending.take() {
                Group::wait(comm, p)?;
                u.reduced = true;
            }
            if let Some(p) = u.gather_pending.take() {
                Group::wait(comm, p)?;
            }
        }
        Ok(())
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
        let p = Communicator::<B::Grad>::reduce_scatter_start(comm, &full, recv, ReduceOp::Sum)?;
        self.rs_in_flight = Some((i, p, full, via_scratch));
        Ok(())
    }

    /// Stage 0/1: start reducing unit `i`'s complete gradient (stage 0: all-reduce in place;
    /// stage 1: reduce-scatter into this rank's shard). Idempotent within a step (started,
    /// or complete inside a recorded micro-step).
    fn start_reduction<C: EngineComm<B>>(&mut self, comm: &mut C, i: usize) -> Result<(), TrainError> {
        let shard_optimizer = self.policy.shard_optimizer;
        let u = &mut self.units[i];
        if u.reduce_pending.is_some() || u.reduced {
            return Ok(());
        }
        let g = u.grads.as_mut().expect("stage 0/1 keep full gradients");
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
    fn finish_reduce_scatter<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
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
        Ok(StepStats { grad_norm, clip_scale })
    }

    /// Stage 1/2: all-gather the updated pieces in place. It runs while the next forward
    /// starts; `gather` waits for it.
    fn publish<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        if self.policy.shard_optimizer && !self.policy.shard_params {
            for u in self.units.iter_mut() {
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
        self.publish(be, comm)
    }

    /// Unit `i`'s full parameters on the host (unpadded), gathering if sharded.
    /// For tests and export; not for the hot path.
    pub fn full_params_host<C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
        i: usize,
    ) -> Result<Vec<f32>, TrainError> {
        let was_gathered = self.units[i].params.is_some();
        self.gather(be, comm, i)?;
        let out = be.download_buf(self.params(i), Loc::all(self.units[i].numel))?;
        if !was_gathered {
            self.release(i);
        }
        Ok(out)
    }

    /// Overwrite one compute parameter (stage 0 only; finite-difference gradient checks).
    pub fn set_param(&mut self, be: &B, unit: usize, index: usize, value: f32) -> Result<(), TrainError> {
        if self.policy.stage != 0 {
            return Err(TrainError::Invalid("set_param is only supported on ZeRO stage 0".into()));
        }
        let p = self.units[unit].params.as_mut().expect("stage 0 params");
        be.upload_buf(&[value], p, index)?;
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
        let lo = (self.rank * u.shard).min(u.numel);
        let hi = ((self.rank + 1) * u.shard).min(u.numel);
        (lo, hi)
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
        if let Some(p) = self.units[i].gather_pending.take() {
            Group::wait(comm, p)?;
        }
        if state.iter().any(|s| s.len() != hi - lo) {
            return Err(TrainError::Invalid(format!("unit {i}: loaded state does not cover {lo}..{hi}")));
        }
        self.opt.load(be, i, lo, &state)?;
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
            AllGatherInPlace::<B::Buf>::all_gather_in_place(comm, p)?;
        }
        Ok(())
    }

    pub fn memory(&self) -> MemoryReport {
        self.ledger.report()
    }

    /// Host memory held for offload.
    pub fn host_memory(&self) -> HostMemory {
        self.host
    }

    /// What the host optimizer did since the last call (`None` with the optimizer on the device).
    pub fn take_host_optimizer_stats(&mut self) -> Option<HostAdamWStats> {
        self.opt.take_host_stats()
    }
}

/// Sum an f64 across ranks exactly enough for norms: split into two f32 words
/// (high and residual) so the f32 host collective loses nothing that matters.
pub fn all_reduce_f64<C: Communicator<[f32]> + ?Sized>(comm: &mut C, x: f64) -> Result<f64, TrainError> {
    let hi = x as f32;
    let lo = (x - hi as f64) as f32;
    let mut buf = [hi, lo];
    comm.all_reduce(&mut buf[..], ReduceOp::Sum)?;
    Ok(buf[0] as f64 + buf[1] as f64)
}
