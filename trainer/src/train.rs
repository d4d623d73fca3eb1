//! The training loop one rank runs: sample its part of the global batch, forward/backward
//! every micro-step through the ZeRO engine, step the optimizer, report metrics.

use crate::backend::{Backend, Precision, TunedGemm};
use crate::checkpoint::init::InitSource;
use crate::checkpoint::{CheckpointReader, SaveMeta};
use crate::config::{Config, ConfigError};
use crate::documents::DocumentMask;
use crate::metrics::{CheckpointMetrics, SourceMetrics, StepMetrics};
use crate::model::{run_micro, step_micro, step_micro_loss, DecoderModel, ModelLayout, ModelOptions};
use crate::optim::{lr_at, Hyper};
use crate::sources::{open_loader, open_val, ValSource};
use crate::tuning::RunTuning;
use crate::zero::engine::all_reduce_f64;
use crate::zero::{Engine, EngineComm, EngineOptions, MicroKey, MicroState};
use crate::TrainError;
use collectives::Group;
use data::{BatchSampler, Dataset};
use std::path::Path;
use std::time::Instant;

/// The result of a finished run on one rank.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub steps: usize,
    /// Global mean loss of every step, in order.
    pub losses: Vec<f64>,
}

/// A recorded micro-step: its kind, the engine's host-side state it starts from and
/// leaves (a replay runs no host code, so the trainer sets it), and the graph.
struct Recorded<B: Backend> {
    key: MicroKey,
    before: MicroState,
    after: MicroState,
    graph: B::Graph,
}

/// One rank's model, engine and data: the pieces of the loop, usable step by step (tests).
pub struct Trainer<B: Backend> {
    /// `checkpoint.async`: the save being written in the background. First, so that it is
    /// dropped first: its writer may still be waiting for a copy out of the engine's memory.
    saves: crate::checkpoint::background::BackgroundSaves<B>,
    pub cfg: Config,
    pub engine: Engine<B>,
    model: Box<dyn DecoderModel<B>>,
    sampler: BatchSampler,
    /// Each source's validation split, when `train.eval_every > 0` (sources without one
    /// are left out).
    val: Vec<ValSource>,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    /// The training micro-batches' document starts (`data.document_mask`; each validation
    /// split has its own end-of-text id, [`ValSource::eot`]).
    docs: DocumentMask,
    /// Optimizer steps taken so far.
    pub step: usize,
    /// The launcher's `--profile` ([`train_from`]'s `profile`): wait for the device between
    /// the phases of every step and print their times (perturbs the overlap a little; for
    /// finding where time goes). Off from [`Trainer::new`].
    pub profile: bool,
    /// `train.cuda_graphs` applies: a backend that records, the optimizer on the device.
    graphs: bool,
    /// The recorded micro-steps, one per kind, each made the first time its kind comes
    /// from this process's second optimizer step on (when every pool and scratch buffer has
    /// reached its size: a recording must allocate nothing).
    graphs_recorded: Vec<Recorded<B>>,
    /// Optimizer steps this process has run (a resumed run starts at 0 here).
    steps_here: usize,
    /// The GEMM algorithm choices of the run (`train.gemm_tuning`).
    tuning: RunTuning,
    /// The last save's stall, until the step's metrics take it ([`Trainer::take_save_metrics`]).
    last_save: Option<CheckpointMetrics>,
}

impl<B: Backend> Trainer<B> {
    /// Open the data, build the layout, initialise the engine and allocate activations.
    /// `data_path` is `data.path`, or with `[[data.sources]]` the directory their relative
    /// paths start from (the launcher makes them absolute).
    pub fn new(cfg: &Config, be: &B, rank: usize, world: usize, data_path: &Path) -> Result<Trainer<B>, TrainError> {
        // The end-of-text id is every source's (one tokenizer), so one mask serves rows
        // of any source.
        let (sampler, eot) = open_loader(cfg, data_path, world)?;
        let docs = DocumentMask::new(eot, cfg.model.seq_len);
        let val = if cfg.train.eval_every > 0 {
            let (val, missing) = open_val(cfg, data_path, world)?;
            if !missing.is_empty() && rank == 0 {
                crate::log_line!(
                    "rank 0: data sources without a validation split, not evaluated: {}",
                    missing.join(", ")
                );
            }
            val
        } else {
            Vec::new()
        };
        if cfg.train.precision == Precision::Fp8 {
            // Before anything is allocated: an older GPU is a config problem, said at once.
            be.fp8_support().map_err(|message| ConfigError::Invalid {
                key: "train.precision",
                value: "\"fp8\"".into(),
                message,
            })?;
        }
        let layout = ModelLayout::new(&cfg.model);
        let opts = EngineOptions::from_config(cfg);
        let (family, l2) = (cfg.model.family, layout.clone());
        let mut engine = match &cfg.train.init_from {
            None => {
                let (seed, scheme) = (cfg.train.seed, cfg.init.scheme);
                let mut init = |u, r| Ok(family.init_range(&l2, u, seed, scheme, r));
                Engine::new(be, layout, opts, rank, world, Some(&mut init))?
            }
            Some(path) => {
                // Each rank reads only the elements the engine asks it for.
                let src = InitSource::open(path)?;
                src.check(&l2, path)?;
                Engine::new(be, layout, opts, rank, world, Some(&mut |u, r| src.values(&l2, u, r)))?
            }
        };
        let mopts = ModelOptions::from_config(cfg);
        let model = family
            .build(be, &engine.layout, &mopts, &mut engine.ledger)
            .map_err(|e| with_memory(e.into(), &engine.memory()))?;
        let n = cfg.train.micro_batch * cfg.model.seq_len;
        let tuning = RunTuning::new(cfg, be)?;
        // The host optimizer's copies and waits between units cannot be recorded.
        let graphs = cfg.train.cuda_graphs && be.graphs_supported() && !cfg.offload.optimizer;
        if cfg.zero.fp8_gather && rank == 0 {
            // Set, but with nothing to act on: said once, naming what it needs.
            let missing = [
                (cfg.train.precision != Precision::Fp8, "train.precision = \"fp8\""),
                (cfg.zero.stage != 3, "zero.stage = 3"),
                (world < 2, "more than one rank"),
                (cfg.offload.optimizer, "offload.optimizer = false"),
            ];
            let needs: Vec<&str> = missing.iter().filter(|m| m.0).map(|m| m.1).collect();
            if !needs.is_empty() {
                crate::log_line!(
                    "rank 0: zero.fp8_gather gathers FP8 weights with {}: this run gathers at compute precision",
                    needs.join(", ")
                );
            }
        }
        if cfg.train.cuda_graphs && be.graphs_supported() && !graphs && rank == 0 {
            crate::log_line!(
                "rank 0: train.cuda_graphs records runs with the optimizer on the GPU; \
                 this run (offload.optimizer = true) runs eagerly"
            );
        }
        Ok(Trainer {
            cfg: cfg.clone(),
            engine,
            model,
            sampler,
            val,
            inputs: vec![0; n],
            targets: vec![0; n],
            docs,
            step: 0,
            profile: false,
            graphs,
            graphs_recorded: Vec::new(),
            steps_here: 0,
            tuning,
            saves: Default::default(),
            last_save: None,
        })
    }

    /// Tokens in one global batch.
    pub fn global_tokens(&self) -> u64 {
        let t = &self.cfg.train;
        (t.micro_batch * t.grad_accum * self.engine.world * self.cfg.model.seq_len) as u64
    }

    /// One micro-step through a CUDA graph: upload the batch, then replay the recorded
    /// forward and backward (recording it first, the first time this kind of micro-step
    /// comes). On one rank every micro-step runs as a non-final one — the reductions that a
    /// final micro-step starts during backward wait for `Engine::step` — so one recording
    /// serves them all. On several ranks the collectives are recorded too: the step's
    /// first and last micro-step each get their own recording ([`Engine::micro_key`]), and
    /// the recording waits for every collective it started ([`Engine::join_micro`]).
    fn micro_from_graph<C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
        dloss_scale: f32,
        (first, last): (bool, bool),
    ) -> Result<(), TrainError> {
        let key = self.engine.micro_key(first, last);
        self.engine.set_final_micro(key.last);
        self.model.load_batch(be, &self.docs.batch(&self.inputs, &self.targets))?;
        self.engine.await_pending(be, comm)?;
        let before = self.engine.micro_state();
        if let Some(r) = self.graphs_recorded.iter().find(|r| r.key == key) {
            if r.before != before {
                return Err(TrainError::Invalid(format!(
                    "the recorded micro-step {key:?} started from engine state {:?} but this one starts from {before:?} \
                     (a bug: set train.cuda_graphs = false to run eagerly, and report it)",
                    r.before
                )));
            }
            be.replay(&r.graph)?;
            self.engine.restore_micro_state(&r.after);
            self.model.replayed_micro();
            return Ok(());
        }
        let failed = |e: TrainError| {
            TrainError::Invalid(format!(
                "recording the micro-step as a CUDA graph failed: {e}; set train.cuda_graphs = false to run eagerly"
            ))
        };
        be.begin_capture().map_err(|e| failed(e.into()))?;
        let recorded = run_micro(self.model.as_mut(), be, &mut self.engine, comm, Some(dloss_scale))
            .and_then(|()| self.engine.join_micro(be, comm));
        // End the capture whatever happened, so the stream is usable for the error path.
        let graph = be.end_capture();
        recorded.map_err(failed)?;
        let graph = graph.map_err(|e| failed(e.into()))?;
        be.replay(&graph)?; // recording ran nothing: this micro-step runs now
        let after = self.engine.micro_state();
        self.graphs_recorded.push(Recorded { key, before, after, graph });
        Ok(())
    }

    /// Run one optimizer step and return its metrics.
    pub fn train_step<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<StepMetrics, TrainError> {
        let t0 = Instant::now();
        let tc = self.cfg.train.clone();
        let (rank, world) = (self.engine.rank, self.engine.world);
        let n = tc.micro_batch * self.cfg.model.seq_len;
        // Mean over the global batch: every token's dloss is 1/(global tokens); reductions sum.
        let dloss_scale = 1.0 / (n * tc.grad_accum * world) as f32;
        let mut phases: Vec<(&str, Instant)> = Vec::new();
        let profile = self.profile;
        let mut mark = |be: &B, name: &'static str| -> Result<(), TrainError> {
            if profile {
                be.synchronize()?;
                phases.push((name, Instant::now()));
            }
            Ok(())
        };
        self.tuning.settle(be, comm, self.step, self.steps_here)?;
        mark(be, "start")?;
        self.sampler.begin_step(tc.micro_batch * tc.grad_accum * world);
        self.engine.begin_step(be)?;
        mark(be, "zero gradients")?;
        for micro in 0..tc.grad_accum {
            collectives::progress::note_micro_step(micro);
            self.engine.set_final_micro(micro + 1 == tc.grad_accum);
            self.sampler.micro_batch(rank, world, micro, tc.micro_batch, &mut self.inputs, &mut self.targets)?;
            if self.graphs && self.steps_here >= 1 {
                self.micro_from_graph(be, comm, dloss_scale, (micro == 0, micro + 1 == tc.grad_accum))?;
            } else {
                let batch = self.docs.batch(&self.inputs, &self.targets);
                step_micro(self.model.as_mut(), be, &mut self.engine, comm, &batch, Some(dloss_scale))?;
            }
        }
        mark(be, "forward+backward")?;
        let lr = lr_at(self.step, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr);
        let hyper = Hyper {
            lr,
            weight_decay: tc.weight_decay,
            beta1: tc.beta1,
            beta2: tc.beta2,
            eps: tc.eps,
            grad_clip: tc.grad_clip,
        };
        let stats = self.engine.step(be, comm, hyper, self.step as u64 + 1)?;
        mark(be, "optimizer")?;
        let loss = all_reduce_f64(comm, self.model.take_mean_loss(be)?)? / world as f64;
        be.synchronize()?;
        mark(be, "loss")?;
        if self.profile {
            let parts: Vec<String> = phases
                .windows(2)
                .map(|w| format!("{} {:.2} ms", w[1].0, (w[1].1 - w[0].1).as_secs_f64() * 1e3))
                .collect();
            crate::log_line!("profile: rank {rank} step {}: {}", self.step + 1, parts.join(", "));
        }
        let step_time_s = t0.elapsed().as_secs_f64();
        if self.steps_here == 0 && rank == 0 {
            report_gemm_tuning(&be.gemm_tuning_report(), tc.gemm_tuning, profile);
            report_unfused_gemms(&be.unfused_gemms());
        }
        self.sampler.end_step();
        self.step += 1;
        self.steps_here += 1;
        // Before an evaluation of this step: the choices apply from here on.
        self.tuning.settle(be, comm, self.step, self.steps_here)?;
        let ev = tc.eval_every;
        let eval_due = ev > 0 && (self.step.is_multiple_of(ev) || self.step == tc.steps);
        if self.step >= tc.steps {
            // The run's last step ends with every update applied (a delayed one included).
            self.engine.settle(be, comm)?;
            if rank == 0 {
                report_fp8_predictions(be.fp8_prediction_counts()?);
            }
        }
        let by_source = if eval_due { self.evaluate_sources(be, comm)? } else { Vec::new() };
        let val_loss = eval_due.then(|| self.mean_val_loss(&by_source));
        let sources = self.source_metrics(&by_source);
        Ok(StepMetrics {
            step: self.step as u64,
            loss,
            lr,
            grad_norm: stats.grad_norm,
            tokens: self.global_tokens(),
            step_time_s,
            val_loss,
            memory: self.engine.memory(),
            device: be.device_memory(),
            host_optimizer: self.engine.take_host_optimizer_stats(),
            sources,
            checkpoint: None,
        })
    }

    /// With `[[data.sources]]`: each source's rows, epochs and validation loss (if evaluated).
    fn source_metrics(&self, val: &[(String, f64)]) -> Vec<SourceMetrics> {
        if self.cfg.data.sources.is_empty() {
            return Vec::new();
        }
        let s = &self.sampler;
        s.source_names()
            .iter()
            .zip(s.source_rows())
            .zip(s.windows())
            .map(|((name, &rows), windows)| SourceMetrics {
                name: name.to_string(),
                rows,
                epochs: rows as f64 / windows.max(1) as f64,
                val_loss: val.iter().find(|(n, _)| n == name).map(|(_, l)| *l),
            })
            .collect()
    }

    /// The data loader (its position, windows and the rows of the last step).
    pub fn sampler(&self) -> &BatchSampler {
        &self.sampler
    }

    /// Continue from the checkpoint in `dir` (any world size and stage): load this rank's
    /// optimizer-state range from whichever shards hold it, rebuild parameters, take up the
    /// step count and the data loader's position (refused when the data changed, unless
    /// `data.allow_changed_data`).
    pub fn resume<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C, dir: &Path) -> Result<(), TrainError> {
        // Sizes are checked by every rank; the launcher verifies checksums once before spawning.
        let reader = CheckpointReader::open(dir, false)?;
        reader.check_model(&self.cfg.model)?;
        if reader.manifest.step as usize > self.cfg.train.steps {
            return Err(TrainError::Invalid(format!(
                "checkpoint {} is at step {} but train.steps = {}: raise train.steps to continue",
                dir.display(),
                reader.manifest.step,
                self.cfg.train.steps
            )));
        }
        self.restore_data(&reader.manifest, dir)?;
        for i in 0..self.engine.num_units() {
            let (lo, hi) = self.engine.held_range(i);
            let state = reader.read_state(i, lo, hi)?;
            self.engine.load_optimizer_state(be, comm, i, state)?;
        }
        self.step = reader.manifest.step as usize;
        self.tuning.resuming(be, reader.manifest.gemm_tuning.clone(), dir);
        Ok(())
    }

    /// Take up the loader position of a checkpoint's manifest. A checkpoint saved before
    /// positions were recorded sampled by step: it continues at the rows its steps took.
    fn restore_data(&mut self, m: &crate::checkpoint::Manifest, dir: &Path) -> Result<(), TrainError> {
        let rank = self.engine.rank;
        match &m.data {
            Some(saved) => {
                let changes = self
                    .sampler
                    .restore(saved, self.cfg.data.allow_changed_data)
                    .map_err(|e| TrainError::Invalid(format!("cannot resume from {}: {e}", dir.display())))?;
                if !changes.is_empty() && rank == 0 {
                    crate::log_line!(
                        "rank 0: resuming with changed data (data.allow_changed_data = true): {}",
                        changes.join("; ")
                    );
                }
            }
            None => {
                let old = Config::from_toml_str(&m.config_toml, "the checkpoint's config")?;
                let rows = m.step * (old.train.micro_batch * old.train.grad_accum * m.world) as u64;
                self.sampler.restore_rows(rows);
                if rank == 0 {
                    crate::log_line!(
                        "rank 0: {} predates recorded loader positions: continuing after the {rows} rows its {} steps \
                         took",
                        dir.display(),
                        m.step
                    );
                }
            }
        }
        Ok(())
    }

    /// Save a sharded checkpoint of the current step (collective). A delayed update in
    /// flight is applied first, so the checkpoint holds every step's update. With
    /// `checkpoint.async` it waits for the previous save, copies this rank's shard to host
    /// memory and returns while a thread writes it (the directory appears once every rank's
    /// shard is durable: [`Trainer::finish_saves`] waits for it).
    pub fn save_checkpoint<C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
    ) -> Result<std::path::PathBuf, TrainError> {
        let (rank, step, root) = (self.engine.rank, self.step as u64, self.cfg.checkpoint_dir());
        let t0 = Instant::now();
        if self.cfg.checkpoint.async_save {
            let data = self.sampler.state();
            let meta = SaveMeta { cfg: &self.cfg, step, data: Some(&data), gemm_tuning: self.tuning.applied() };
            let (dir, s) = self.saves.start(be, comm, &mut self.engine, meta, &root)?;
            let stall_s = t0.elapsed().as_secs_f64();
            self.last_save =
                Some(CheckpointMetrics { stall_s, waited_s: s.waited_s, bytes: s.bytes, background: true });
            crate::log_line!(
                "rank {rank}: checkpoint step {step}: training stalled {stall_s:.3} s (waited {:.3} s for the previous \
                 save, {:.2} GB to host memory, {:.3} s of it on this thread); writing it in the background",
                s.waited_s,
                s.bytes as f64 / 1e9,
                s.copy_s
            );
            return Ok(dir);
        }
        self.engine.settle(be, comm)?;
        let data = self.sampler.state();
        let meta = SaveMeta { cfg: &self.cfg, step, data: Some(&data), gemm_tuning: self.tuning.applied() };
        let dir = crate::checkpoint::save(be, comm, &self.engine, meta, &root)?;
        let stall_s = t0.elapsed().as_secs_f64();
        let bytes = self.engine.checkpoint_bytes();
        self.last_save = Some(CheckpointMetrics { stall_s, waited_s: 0.0, bytes, background: false });
        crate::log_line!("rank {rank}: checkpoint step {step}: training stalled {stall_s:.3} s (saved synchronously)");
        Ok(dir)
    }

    /// Collect a background save that has finished (its error, if any, surfaces now).
    pub fn poll_saves(&mut self) -> Result<Option<std::path::PathBuf>, TrainError> {
        self.saves.poll(&mut self.engine)
    }

    /// The stall of the save since the last call, if any (for the step's metrics).
    pub fn take_save_metrics(&mut self) -> Option<CheckpointMetrics> {
        self.last_save.take()
    }

    /// Wait for the checkpoint being written in the background, if any (`checkpoint.async`):
    /// this rank's shard is durable, and on rank 0 the checkpoint complete. Its directory.
    pub fn finish_saves(&mut self) -> Result<Option<std::path::PathBuf>, TrainError> {
        let t = Instant::now();
        let dir = self.saves.wait(&mut self.engine)?;
        if let Some(d) = &dir {
            crate::log_line!(
                "rank {}: waited {:.3} s for the background save of {}",
                self.engine.rank,
                t.elapsed().as_secs_f64(),
                d.display()
            );
        }
        Ok(dir)
    }

    /// The validation loss: with one source its loss; with a mixture the mean of the
    /// evaluated sources' losses weighted by their mixture weights (the expected loss of
    /// the training mixture, over the sources that have a validation split).
    pub fn evaluate<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<f64, TrainError> {
        let by_source = self.evaluate_sources(be, comm)?;
        Ok(self.mean_val_loss(&by_source))
    }

    fn mean_val_loss(&self, by_source: &[(String, f64)]) -> f64 {
        let weight = |name: &str| {
            let s = &self.cfg.data.sources;
            s.iter().find(|c| c.display_name() == name).map_or(1.0, |c| c.weight)
        };
        let total: f64 = by_source.iter().map(|(n, _)| weight(n)).sum();
        by_source.iter().map(|(n, l)| weight(n) * l).sum::<f64>() / total.max(f64::MIN_POSITIVE)
    }

    /// Each source's validation loss (see `Self::evaluate_split`), in source order.
    pub fn evaluate_sources<C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
    ) -> Result<Vec<(String, f64)>, TrainError> {
        if self.val.is_empty() {
            return Err(TrainError::Invalid("evaluation needs train.eval_every > 0 and a validation split".into()));
        }
        collectives::progress::note_phase(collectives::progress::Phase::Evaluating);
        self.engine.settle(be, comm)?; // evaluate the weights with every update applied
        let val = std::mem::take(&mut self.val);
        let mut out = Vec::with_capacity(val.len());
        let mut result = Ok(());
        for v in &val {
            match self.evaluate_split(be, comm, v) {
                Ok(l) => out.push((v.name.clone(), l)),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.val = val;
        result?;
        collectives::progress::note_phase(collectives::progress::Phase::Training);
        Ok(out)
    }

    /// Mean loss over `train.eval_batches` validation batches per rank of one split (rank r
    /// takes batches r, r+W, …, so the ranks together cover W·eval_batches distinct batches),
    /// documents masked as training masks them.
    fn evaluate_split<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C, val: &ValSource) -> Result<f64, TrainError> {
        let (rank, world) = (self.engine.rank, self.engine.world);
        let want = self.cfg.train.eval_batches * world;
        let t = self.cfg.model.seq_len;
        let mut batches = val.dataset.val_batches(self.cfg.train.micro_batch, t, want)?;
        let mut docs = DocumentMask::new(val.eot, t);
        // Every rank must run the same number of forwards (stage 3 gathers are collective).
        let per_rank = batches.len() / world;
        let (mut sum, mut i, mut done) = (0.0f64, 0usize, 0usize);
        while done < per_rank && batches.next_into(&mut self.inputs, &mut self.targets)? {
            if i % world == rank {
                let batch = docs.batch(&self.inputs, &self.targets);
                sum += step_micro_loss(self.model.as_mut(), be, &mut self.engine, comm, &batch, None)?;
                done += 1;
            }
            i += 1;
        }
        let mean = sum / per_rank.max(1) as f64;
        Ok(all_reduce_f64(comm, mean)? / world as f64)
    }

    /// Every unit's parameters on the host, unpadded (gathers sharded ones).
    pub fn full_params<C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<Vec<Vec<f32>>, TrainError> {
        self.engine.settle(be, comm)?;
        (0..self.engine.num_units()).map(|i| self.engine.full_params_host(be, comm, i)).collect()
    }
}

/// After the first step (every GEMM shape has run once): what `train.gemm_tuning =
/// "timed"` (or `"searched"`) picked, in one line, and per shape with `profile` (the launcher's `--profile`).
fn report_gemm_tuning(tuned: &[TunedGemm], mode: crate::backend::GemmTuning, per_shape: bool) {
    if tuned.is_empty() {
        return;
    }
    let changed = tuned.iter().filter(|t| t.chosen != 0).count();
    let (h, c) = tuned.iter().fold((0.0, 0.0), |(h, c), t| (h + t.heuristic_ms, c + t.chosen_ms));
    let searched: usize = tuned.iter().map(|t| t.searched).sum();
    let seconds: f64 = tuned.iter().map(|t| t.seconds).sum();
    let (mode, how) = if mode == crate::backend::GemmTuning::Searched {
        let found = tuned.iter().filter(|t| t.chosen >= t.candidates).count();
        let disagreed = tuned.iter().filter(|t| t.disagreed).count();
        let disagreed = if disagreed > 0 {
            format!(", {disagreed} fastest found one(s) set aside: output off the heuristic's")
        } else {
            String::new()
        };
        ("searched", format!(" beside {searched} configurations found near them ({found} picked{disagreed})"))
    } else {
        ("timed", String::new())
    };
    crate::log_line!(
        "rank 0: train.gemm_tuning = {mode}: {} GEMM shapes timed in the first step (which ran the heuristic's \
         algorithms) in {seconds:.1} s{how}, {changed} picked another cuBLASLt algorithm than the heuristic's \
         first ({h:.3} -> {c:.3} ms for one call of each); every rank runs rank 0's picks from the second step on",
        tuned.len()
    );
    if per_shape {
        for t in tuned {
            let found = if t.searched > 0 { format!(" (+{} found)", t.searched) } else { String::new() };
            crate::log_line!(
                "  {}: candidate {} of {}{found}, {:.4} -> {:.4} ms",
                t.gemm,
                t.chosen,
                t.candidates,
                t.heuristic_ms,
                t.chosen_ms
            );
        }
    }
}

/// After the first step: the fused GEMMs that ran as a GEMM and a separate kernel (no
/// cuBLASLt algorithm for their epilogue here, e.g. some FP8 epilogues), so a slower step
/// than expected says why.
/// How often the FP8 casts that predict their scale were right (a wrong one casts again).
fn report_fp8_predictions(counts: Option<crate::backend::Fp8Predictions>) {
    let Some(c) = counts else { return };
    let part = |what: &str, (right, wrong): (u64, u64)| {
        (right + wrong > 0).then(|| format!("{what} {right} of {}", right + wrong))
    };
    let parts: Vec<String> =
        [part("inputs", c.inputs), part("gradients", c.grads), part("weights (the step's codes)", c.weights)]
            .into_iter()
            .flatten()
            .collect();
    if parts.is_empty() {
        return;
    }
    crate::log_line!("rank 0: FP8 predicted scales right: {} (each wrong one cast its tensor again)", parts.join(", "));
}

fn report_unfused_gemms(unfused: &[String]) {
    if unfused.is_empty() {
        return;
    }
    crate::log_line!(
        "rank 0: {} fused GEMM epilogue(s) have no cuBLASLt algorithm on this GPU at their shape and precision; \
         each runs as its GEMM and a separate kernel:",
        unfused.len()
    );
    for u in unfused {
        crate::log_line!("  {u}");
    }
}

/// The model's vocabulary must hold every token id in the training data (the launcher
/// calls this before spawning ranks; `Trainer::new` calls it again on every rank).
pub fn check_data_fits(cfg: &Config, dataset: &Dataset, data_path: &Path) -> Result<(), TrainError> {
    let max_tok = dataset.max_token() as usize;
    if max_tok >= cfg.model.vocab_size {
        // Shards from `prepare-data` name their tokenizer: say which, and its vocabulary.
        let (made_by, need) = match dataset.tokenizer()? {
            Some(t) => (
                format!(" (tokenised with {}, a vocabulary of {} ids)", t.tokenizer, t.vocab_size),
                (t.vocab_size as usize).max(max_tok + 1),
            ),
            None => (String::new(), max_tok + 1),
        };
        return Err(TrainError::Invalid(format!(
            "data {} holds token id {max_tok}{made_by} but model.vocab_size = {}: set model.vocab_size to at least \
             {need} (GPT-2 BPE data needs 50257, or 50304 for speed; Llama 3's 128256)",
            data_path.display(),
            cfg.model.vocab_size,
        )));
    }
    Ok(())
}

/// The tokenizer of `train.init_from` (the `tokenizer.json` of its Hugging Face folder, or
/// of the folder of its `.safetensors` file) must be the one the shards were made with:
/// the weights would otherwise read every id as other text. Compared by fingerprint
/// (`data::tokenizer`), so a copy of the same tokenizer, or GPT-2's `tokenizer.json`
/// against the built-in GPT-2, agree. Nothing to compare (no `init_from`, no
/// `tokenizer.json` beside it, shards without a tokenizer record) passes.
pub fn check_tokenizer(cfg: &Config, dataset: &Dataset, data_path: &Path) -> Result<(), TrainError> {
    let Some(init) = &cfg.train.init_from else { return Ok(()) };
    let folder = if init.is_dir() { init.as_path() } else { init.parent().unwrap_or(Path::new(".")) };
    let file = folder.join("tokenizer.json");
    let Some(shards) = dataset.tokenizer()? else { return Ok(()) };
    if !file.is_file() {
        return Ok(());
    }
    let (theirs, name) = data::tokenizer::fingerprint_file(&file)
        .map_err(|e| TrainError::Invalid(format!("train.init_from's tokenizer {}: {e}", file.display())))?;
    if theirs != shards.fingerprint {
        return Err(TrainError::Invalid(format!(
            "data {} was tokenised with {} (fingerprint {:016x}), but train.init_from {} comes with another \
             tokenizer, {} (fingerprint {theirs:016x}): the model would read every id as other text. Prepare the \
             data with its tokenizer (`launcher prepare-data INPUT... OUT_DIR --tokenizer {}`), or start from \
             weights trained with the data's",
            data_path.display(),
            shards.tokenizer,
            shards.fingerprint,
            init.display(),
            name,
            file.display()
        )));
    }
    Ok(())
}

/// An out-of-memory error gains what this rank held, by category, and what to change.
fn with_memory(e: TrainError, held: &crate::zero::MemoryReport) -> TrainError {
    match e {
        TrainError::Backend(crate::backend::BackendError::OutOfMemory { .. }) => {
            let c = held.current;
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            TrainError::Invalid(format!(
                "{e}; this rank held {:.1} MiB: params {:.1}, grads {:.1}, optimizer {:.1}, activations {:.1}, \
                 comm {:.1}, workspace {:.1}, cached {:.1}. Lower train.micro_batch, set checkpointing.activations, \
                 or raise zero.stage (`launcher memory CONFIG --ranks N --device gpu` predicts each choice)",
                mib(c.total()),
                mib(c.params),
                mib(c.grads),
                mib(c.optimizer),
                mib(c.activations),
                mib(c.comm),
                mib(c.workspace),
                mib(c.cached)
            ))
        }
        other => other,
    }
}

/// Train for `cfg.train.steps` steps, calling `on_step` after each (on every rank).
pub fn train<B: Backend, C: EngineComm<B> + Group>(
    cfg: &Config,
    be: &B,
    comm: &mut C,
    data_path: &Path,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<(), TrainError>,
) -> Result<TrainSummary, TrainError> {
    train_from(cfg, be, comm, data_path, None, false, on_step)
}

/// As [`train`], optionally resuming from a checkpoint directory first, and with `profile`
/// timing the phases of every step ([`Trainer::profile`]). Saves a checkpoint every
/// `checkpoint.every` steps and after the last step.
pub fn train_from<B: Backend, C: EngineComm<B> + Group>(
    cfg: &Config,
    be: &B,
    comm: &mut C,
    data_path: &Path,
    resume: Option<&Path>,
    profile: bool,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<(), TrainError>,
) -> Result<TrainSummary, TrainError> {
    let (rank, world) = (comm.rank(), comm.world());
    let t0 = Instant::now();
    let mut trainer = Trainer::new(cfg, be, rank, world, data_path)?;
    trainer.profile = profile;
    if let Some(dir) = resume {
        trainer.resume(be, comm, dir)?;
    }
    // Into the rank's log: at tens of GB of host state per rank, start-up takes a while.
    let host = trainer.engine.host_memory();
    let host_gb = (host.optimizer + host.params + host.staging) as f64 / 1e9;
    let offload = if host_gb > 0.0 { format!(" (host memory for offload: {host_gb:.1} GB)") } else { String::new() };
    crate::log_line!("rank {rank}: ready to train after {:.1} s{offload}", t0.elapsed().as_secs_f64());
    let mut losses = Vec::with_capacity(cfg.train.steps);
    let every = cfg.checkpoint.every;
    collectives::progress::note_phase(collectives::progress::Phase::Training);
    while trainer.step < cfg.train.steps {
        let m = trainer.train_step(be, comm).map_err(|e| with_memory(e, &trainer.engine.memory()))?;
        if !m.loss.is_finite() {
            return Err(TrainError::Invalid(format!(
                "loss became {} at step {}: lower train.lr or enable train.grad_clip",
                m.loss, m.step
            )));
        }
        losses.push(m.loss);
        trainer.poll_saves()?;
        // Saved before the step is reported, so that its metrics carry the save's stall.
        let mut m = m;
        if every > 0 && (trainer.step.is_multiple_of(every) || trainer.step == cfg.train.steps) {
            collectives::progress::note_phase(collectives::progress::Phase::Checkpoint);
            trainer.save_checkpoint(be, comm)?;
            m.checkpoint = trainer.take_save_metrics();
            collectives::progress::note_phase(collectives::progress::Phase::Training);
        }
        on_step(&m)?;
    }
    // The end of training waits for a checkpoint still being written.
    collectives::progress::note_phase(collectives::progress::Phase::Checkpoint);
    trainer.finish_saves()?;
    collectives::progress::note_phase(collectives::progress::Phase::Done);
    Ok(TrainSummary { steps: cfg.train.steps, losses })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendError;
    use crate::zero::{Category, MemoryLedger};

    #[test]
    fn out_of_memory_names_what_the_rank_held() {
        let mut ledger = MemoryLedger::default();
        ledger.alloc(Category::Params, 3 << 20);
        ledger.alloc(Category::Activations, 5 << 20);
        let oom = TrainError::Backend(BackendError::OutOfMemory {
            device: "cuda:1".into(),
            bytes: 1 << 30,
            what: "gathered parameters of unit h.3".into(),
        });
        let msg = with_memory(oom, &ledger.report()).to_string();
        assert!(msg.contains("cuda:1") && msg.contains("1073741824") && msg.contains("unit h.3"), "{msg}");
        assert!(msg.contains("held 8.0 MiB") && msg.contains("params 3.0") && msg.contains("activations 5.0"), "{msg}");
        assert!(msg.contains("launcher memory"), "{msg}");
        // Other errors pass through unchanged.
        let other = with_memory(TrainError::Invalid("x".into()), &ledger.report());
        assert_eq!(other.to_string(), "x");
    }
}
