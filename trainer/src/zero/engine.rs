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
//!
//! One type over sibling files, one idea each, each file an `impl Engine` block:
//! - `engine.rs` (here): the [`Engine`], its units' state, construction, the buffer pool,
//!   the step's start (`begin_step`) and the micro-step's keys and host state that let a
//!   CUDA-graph replay stand in for a recorded micro-step (`micro_key`, `join_micro`);
//! - `gather.rs`: compute parameters (step 1: gather, prefetch, release; publish after a step);
//! - `reduce.rs`: gradients (step 2: buffers per micro-step, reductions during backward);
//! - `step.rs`: the optimizer step (step 3: finish the reduction, norm, clip, update, and
//!   the delayed update still in flight);
//! - `host.rs`: host-side access for checkpoints and tests (downloads, held ranges, loading);
//! - `snapshot.rs`: the host copy of this rank's checkpoint shard (`checkpoint.async`).

use std::sync::Arc;

use super::memory::{Category, MemoryLedger};
use super::Policy;
use crate::backend::{BResult, Backend, Fp8GatherLayout, Loc};
use crate::config::Config;
use crate::model::ModelLayout;
use crate::optim::optimizer::Placement;
use crate::optim::Optimizer;
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
    /// `checkpoint.async`: keep a host copy of this rank's checkpoint shard (`snapshot.rs`).
    pub checkpoint_copy: bool,
    /// Stage 3 with `train.precision = "fp8"` and `zero.fp8_gather`: gather the blocks'
    /// FP8 weights as FP8 codes (`backend/fp8_gather.rs`); the rows of a micro-batch, which
    /// decide the GEMM shapes that run in FP8, and the block's layers kept in bf16
    /// (`train.fp8_bf16_layers`, gathered at full precision). Only where more than one rank
    /// gathers.
    pub fp8_gather: Option<(usize, crate::model::units::Bf16Layers)>,
    /// `train.precision = "fp8"`: the optimizer step leaves the amax of each FP8 weight it
    /// writes whole (stages 0-2, the optimizer on the device: `AdamWSegment::fp8_layer`),
    /// so the next parameter version's casts run no amax pass over it; the rows of a
    /// micro-batch and the layers kept in bf16, which decide the FP8 weights. `None` (bf16):
    /// nothing to leave.
    pub fp8_step_amax: Option<(usize, crate::model::units::Bf16Layers)>,
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
        let fp8 = cfg.train.precision == crate::backend::Precision::Fp8;
        // The rows of a micro-batch and the layers kept in bf16: which weights are FP8's.
        let weights =
            (cfg.train.micro_batch * cfg.model.seq_len, cfg.model.family.bf16_layers(&cfg.train.fp8_bf16_layers));
        EngineOptions {
            stage: cfg.zero.stage,
            prefetch: cfg.zero.prefetch_blocks,
            optimizer,
            checkpoint_copy: cfg.checkpoint.async_save && cfg.checkpoint.every > 0,
            fp8_gather: (fp8 && cfg.zero.stage == 3 && cfg.zero.fp8_gather).then_some(weights),
            fp8_step_amax: fp8.then_some(weights),
        }
    }

    /// Stage `stage` with the default prefetch, the optimizer on the device (tests, tools).
    pub fn stage(stage: u8) -> EngineOptions {
        EngineOptions {
            stage,
            prefetch: 1,
            optimizer: Placement::Device,
            checkpoint_copy: false,
            fp8_gather: None,
            fp8_step_amax: None,
        }
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
    /// The parameters last changed by an optimizer step that left the FP8 weights' amaxes
    /// ([`Engine::params_by_step`]): its recording casts them without amax passes, where
    /// the first step's (after the build) or one after a load measures them.
    pub by_step: bool,
}

/// The engine's host-side state after a micro-step (see [`Engine::micro_state`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroState {
    shard_empty: Vec<bool>,
    reduced: Vec<bool>,
    grads_fresh: Vec<bool>,
    params_changed: bool,
    params_by_step: bool,
}

/// One unit's buffers and where they stand in the step (fields read by the sibling files).
pub(super) struct Unit<B: Backend> {
    pub(super) numel: usize,
    /// Elements per rank; `padded = shard * world`.
    pub(super) shard: usize,
    pub(super) padded: usize,
    /// Full compute parameters (always for stage 0-2; while gathered for stage 3).
    pub(super) params: Option<B::Buf>,
    /// Stage 3 with the optimizer on the host (and the parameters not): this rank's
    /// rounded parameters on the device, the gather's source, refreshed by every step.
    pub(super) param_shard: Option<B::Buf>,
    /// A parameter upload from the host still filling `params` (one rank, `offload.params`:
    /// the gather orders compute after it).
    pub(super) upload_pending: Option<Arc<B::Event>>,
    /// The all-gather filling `params` may still be running: stage 3's prefetch, or
    /// stage 1/2's publish of the updated parameters (waited for at the next `gather`).
    pub(super) gather_pending: Option<Pending>,
    /// Stage 0/1: the gradient reduction started during the last micro-step's backward.
    pub(super) reduce_pending: Option<Pending>,
    /// Stage 0/1: this step's reduction is complete already (a recorded final micro-step
    /// waits for its reductions inside the recording), so `step` does not start it again.
    pub(super) reduced: bool,
    /// Full gradient accumulation buffer (always for stage 0/1; during backward for 2/3).
    pub(super) grads: Option<B::Grad>,
    /// Stage 3's FP8 gather of this unit (`EngineOptions::fp8_gather`, the unit has FP8
    /// weights): how its pieces are laid out.
    pub(super) fp8: Option<Fp8GatherLayout>,
    /// Each FP8 weight's amax over every rank (by slot, on the device), agreed once per
    /// parameter version (`refresh_fp8_amax`).
    pub(super) fp8_amax: Option<B::F32>,
    /// The FP8 gather in flight: the pieces' buffer, expanded into `params` once the
    /// all-gather is waited for (`finish_gather`).
    pub(super) fp8_pieces: Option<B::Buf>,
    /// The unit's FP8 weights (with their FP8 layer) whose amaxes this rank's optimizer
    /// step leaves: those it updates whole into `params` (`EngineOptions::fp8_step_amax`).
    pub(super) step_amax: Vec<(Loc, usize)>,
    /// `grads` holds nothing of this step yet and was not cleared: the next backward writes
    /// every element instead of adding (see [`UnitGrads`](crate::backend::UnitGrads)). Set
    /// by `begin_step` (and, where each micro-step takes a pooled buffer, by `ensure_grads`);
    /// cleared once the unit's backward is done.
    pub(super) grads_fresh: bool,
    /// This rank's reduced gradient shard (stage >= 1; stage 1 on one rank keeps none and
    /// `grads` serves).
    pub(super) grad_shard: Option<B::Grad>,
    /// Stage 2/3: no reduce-scatter has reached the shard yet this step, so the next one
    /// writes it directly instead of through the receive buffer and an addition.
    pub(super) shard_empty: bool,
}

/// The ZeRO engine for one rank.
pub struct Engine<B: Backend> {
    pub policy: Policy,
    pub rank: usize,
    pub world: usize,
    pub layout: ModelLayout,
    pub(super) units: Vec<Unit<B>>,
    /// Stage 2/3 receive buffers for reduce-scatter before accumulating into the shard,
    /// one per distinct shard length (the embedding unit and the blocks differ).
    pub(super) rs_scratch: Vec<(usize, B::Grad)>,
    /// Released working buffers kept for reuse, by length (ledger category `Cached`):
    /// after the first step, gathers and gradient buffers allocate nothing.
    pub(super) param_pool: Pool<B::Buf>,
    pub(super) grad_pool: Pool<B::Grad>,
    /// Stage 2/3: the last finished unit's reduce-scatter, still running on the
    /// communication stream while backward continues: (unit, pending, its full gradient,
    /// whether it lands in the receive buffer and must still be added to the shard).
    pub(super) rs_in_flight: Option<(usize, Pending, B::Grad, bool)>,
    /// Stage 3: how many units ahead of use to start all-gathers (`zero.prefetch_blocks`).
    pub(super) prefetch: usize,
    /// fp32 master weights and AdamW moments of the elements this rank updates.
    pub(super) opt: Optimizer<B>,
    /// Host memory held for offload and the checkpoint copy.
    pub(super) host: HostMemory,
    /// `checkpoint.async`: the host copy of this rank's checkpoint shard, while not lent to
    /// a background writer.
    pub(super) shard_copy: Option<super::snapshot::ShardCopy<B>>,
    /// The micro-step running is the step's last (see [`Engine::set_final_micro`]).
    pub(super) final_micro: bool,
    /// Clear every gradient buffer before use and have backward add onto zeros, instead of
    /// the first backward writing it ([`Engine::set_clear_grads`]).
    pub(super) clear_grads: bool,
    /// The compute parameters changed (built, stepped, loaded) since a training micro-step
    /// last used them ([`Engine::params_changed`]).
    pub(super) params_changed: bool,
    /// The last change was an optimizer step that left FP8 weights' amaxes
    /// ([`Engine::params_by_step`]).
    pub(super) params_by_step: bool,
    /// The FP8 gathers' amaxes are of an older parameter version (`refresh_fp8_amax`).
    pub(super) fp8_amax_stale: bool,
    /// Per-unit sums of squared gradients as [`F64Pair`](crate::backend::F64Pair)s, filled
    /// on the device and read with one download per step.
    pub(super) norm_slots: B::F32,
    pub ledger: MemoryLedger,
    pub(super) sizes: crate::backend::ElemBytes,
}

/// Idle working buffers by length, kept for reuse so the steady-state step allocates
/// nothing. Parked buffers stay in the ledger, under `Cached`.
pub(super) struct Pool<T> {
    idle: Vec<(usize, T)>,
}

impl<T> Pool<T> {
    /// An idle buffer of `len` elements (moved from `Cached` to `cat`), or a new one from `alloc`.
    pub(super) fn take(
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
    pub(super) fn park(&mut self, len: usize, buf: T, bytes: usize, cat: Category, ledger: &mut MemoryLedger) {
        ledger.reassign(cat, Category::Cached, bytes);
        self.idle.push((len, buf));
    }
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// Unit `ui`'s initial values over `range` (of its `numel` elements; what lies past them is
/// zero padding), from `init`.
fn initial_values(
    init: &mut InitFn<'_>,
    ui: usize,
    name: &str,
    numel: usize,
    range: std::ops::Range<usize>,
) -> Result<Vec<f32>, TrainError> {
    let (lo, hi) = (range.start.min(numel), range.end.min(numel));
    let mut v = init(ui, lo..hi)?;
    if v.len() != hi - lo {
        return Err(TrainError::Invalid(format!(
            "initial values of unit {name} over {lo}..{hi} have {} elements, expected {}",
            v.len(),
            hi - lo
        )));
    }
    v.resize(range.len(), 0.0);
    Ok(v)
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
        // FP8 gathers need the optimizer on the device: the amaxes come from rounding its
        // master weights (the host optimizer's shards arrive by other paths).
        let fp8_weights = match opts.fp8_gather {
            Some((rows, bf16)) if policy.shard_params && world > 1 && !opt.on_host() => {
                Some(layout.cfg.family.fp8_weights(&layout, rows, bf16))
            }
            _ => None,
        };
        // The optimizer step writes the compute parameters on stages 0-2 with the optimizer
        // on the device (ZeRO-3's gathers round the master weights; the host optimizer's
        // copies arrive by other paths).
        let step_weights = match opts.fp8_step_amax {
            Some((rows, bf16)) if !policy.shard_params && !opt.on_host() => {
                Some(layout.cfg.family.fp8_weight_layers(&layout, rows, bf16))
            }
            _ => None,
        };
        for (ui, ul) in layout.units.iter().enumerate() {
            let numel = ul.numel;
            let shard = round_up(numel.div_ceil(world).max(1), SHARD_ALIGN);
            let padded = shard * world;
            let fp8 = fp8_weights.as_ref().and_then(|w| {
                let tensors: Vec<Loc> = ul.tensors.iter().map(|t| t.loc).collect();
                Fp8GatherLayout::new(&tensors, &w[ui], shard, world, sizes.buf)
            });
            // Stage 3 keeps only its shard, so only that range is made (or read); the others
            // hold the whole unit. `host` covers `base..base + len`, zero-padded.
            let (base, len) = if policy.shard_params { (rank * shard, shard) } else { (0, padded) };
            let host = match init.as_mut() {
                Some(f) => Some(initial_values(f, ui, &ul.name, numel, base..base + len)?),
                None => None,
            };
            let (opt_off, opt_len) = if policy.shard_optimizer { (rank * shard, shard) } else { (0, padded) };
            // The weights this rank updates whole (where the optimizer is sharded, a weight
            // cut by a shard boundary gets its amax at its first use instead).
            let step_amax: Vec<(Loc, usize)> = step_weights
                .as_ref()
                .map(|w| {
                    w[ui].iter().copied().filter(|(l, _)| l.off >= opt_off && l.end() <= opt_off + opt_len).collect()
                })
                .unwrap_or_default();
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
            let fp8_amax = match &fp8 {
                Some(l) => {
                    ledger.alloc(Category::Workspace, l.slots * sizes.f32);
                    Some(be.alloc_f32(l.slots, &what("FP8 gather amaxes"))?)
                }
                None => None,
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
                fp8_amax,
                fp8,
                fp8_pieces: None,
                step_amax,
            });
        }
        // Receive buffers are made on first use: only gradient accumulation over several
        // ranks needs them (a step's first reduction of a unit writes its shard directly).
        let rs_scratch: Vec<(usize, B::Grad)> = Vec::new();
        opt.allocate_staging(be, &mut host_mem)?;
        let shard_copy = if opts.checkpoint_copy {
            let ranges: Vec<(usize, usize)> = units.iter().map(|u| (u.shard, u.numel)).collect();
            Some(super::snapshot::ShardCopy::allocate(be, &layout, &ranges, rank, &mut host_mem)?)
        } else {
            None
        };
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
            shard_copy,
            final_micro: false,
            clear_grads: false,
            params_changed: true,
            params_by_step: false,
            fp8_amax_stale: true,
            norm_slots,
            ledger,
            sizes,
        })
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
        MicroKey { first, last: last && self.world > 1, by_step: self.params_by_step() }
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
            params_changed: self.params_changed,
            params_by_step: self.params_by_step,
        }
    }

    /// Set the host-side state a replayed micro-step left (see [`Engine::micro_state`]).
    pub fn restore_micro_state(&mut self, s: &MicroState) {
        for (k, u) in self.units.iter_mut().enumerate() {
            u.shard_empty = s.shard_empty[k];
            u.reduced = s.reduced[k];
            u.grads_fresh = s.grads_fresh[k];
        }
        self.params_changed = s.params_changed;
        self.params_by_step = s.params_by_step;
    }

    /// Whether the compute parameters changed (the engine was built, a step updated them, a
    /// checkpoint was loaded into them) since a training micro-step last ran: state derived
    /// from them (the FP8 weight cache, `MatmulOps::fp8_weights_changed`) must be made
    /// again. Part of [`MicroState`], so a CUDA-graph recording that made it again is only
    /// replayed where it must be made again (every step's first micro-step).
    pub fn params_changed(&self) -> bool {
        self.params_changed
    }

    /// The compute parameters have just changed (a step, a load, a test's write): what is
    /// derived from them is made again, the FP8 weight cache at the next micro-step
    /// ([`Engine::params_changed`]) and the FP8 gathers' amaxes at the next gather or step
    /// end (`refresh_fp8_amax`).
    pub(super) fn mark_params_changed(&mut self) {
        self.params_changed = true;
        self.params_by_step = false;
        self.fp8_amax_stale = true;
    }

    /// Whether the parameters changed last by an optimizer step that left the amaxes of the
    /// FP8 weights it wrote whole (`EngineOptions::fp8_step_amax`), nothing having written
    /// them since: the casts of the version it begins use them
    /// (`MatmulOps::fp8_weights_changed(by_step)`).
    pub fn params_by_step(&self) -> bool {
        self.params_changed && self.params_by_step
    }

    /// A training micro-step is using the parameters as they are now (`model::run_micro`).
    pub fn params_used(&mut self) {
        self.params_changed = false;
        self.params_by_step = false;
    }

    /// End a micro-step that is being recorded: order the compute stream after every
    /// collective the micro-step started (a recording must join all the work it forked to
    /// the communication stream, and a later wait could not reach inside it), and finish
    /// what waits on them (the last reduce-scatter's accumulation and its buffer's return
    /// to the pool). Eager micro-steps leave them running into `step`, which waits for them.
    pub fn join_micro<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        self.finish_reduce_scatter(be, comm)?;
        for i in 0..self.units.len() {
            if let Some(p) = self.units[i].reduce_pending.take() {
                Group::wait(comm, p)?;
                self.units[i].reduced = true;
            }
            self.finish_gather(be, comm, i)?;
        }
        Ok(())
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
