//! The run's GEMM algorithm choices over its life (`train.gemm_tuning = "timed"` or
//! `"searched"`, which differ only in how many candidates a shape's timing tries): where
//! they come from, when they take effect, how every rank gets the same ones, and where they
//! are stored. The table itself and its matching rules are `backend/gemm_tuning.rs`.
//!
//! The rule that makes reruns and resumes bit-identical: a run's first step always runs
//! cuBLASLt's heuristic's algorithms, and from the second step on every rank runs one table
//! of choices:
//! - timed from scratch: the first step times each shape's candidates (measuring only), then
//!   rank 0's picks are broadcast and used by every rank (data-parallel ranks timing on their
//!   own could pick differently, and their gradients would then be summed from other sums);
//! - `train.gemm_tuning_from`: the stored table is used from the second step on, exactly as
//!   the run that stored it did, with nothing timed; a table timed on another GPU or cuBLASLt,
//!   or holding an algorithm cuBLASLt no longer offers, is refused (the user asked for those
//!   algorithms: running others would silently give other bits);
//! - a resume (`--resume`): the checkpoint's table is used at once (its run used it from its
//!   second step on); timed on another GPU or library it is set aside with a note and the
//!   GEMMs are timed anew, as continuing matters more than bits other hardware cannot give.
//!
//! Rank 0 writes the table in use to `OUTPUT_DIR/gemm_tuning.json`; checkpoints carry it in
//! their manifest.

use crate::backend::gemm_tuning::{pack, unpack, TABLE_FILE};
use crate::backend::{Backend, GemmTuning, GemmTuningTable, OnMismatch};
use crate::config::{Config, ConfigError};
use crate::zero::engine::all_reduce_f64;
use crate::zero::EngineComm;
use crate::TrainError;
use collectives::Communicator;
use std::path::{Path, PathBuf};

/// A stored table waiting for the second step, and how to treat it if it does not fit.
struct Waiting {
    table: GemmTuningTable,
    origin: String,
    on: OnMismatch,
}

/// One rank's view of the run's GEMM choices.
pub struct RunTuning {
    mode: GemmTuning,
    waiting: Option<Waiting>,
    /// The table in use (stored with the run and in checkpoints).
    applied: Option<GemmTuningTable>,
    /// Nothing more to do: the choices are in use, or there are none to make.
    settled: bool,
    /// Process steps already run when timing started: the picks are shared after the next.
    measuring_since: usize,
    /// Where rank 0 writes the table in use.
    out_file: PathBuf,
}

fn config_err(value: String, message: String) -> TrainError {
    ConfigError::Invalid { key: "train.gemm_tuning_from", value, message }.into()
}

impl RunTuning {
    /// From the config: time in the first step, or wait with `gemm_tuning_from`'s table.
    pub fn new<B: Backend>(cfg: &Config, be: &B) -> Result<RunTuning, TrainError> {
        let mode = cfg.train.gemm_tuning;
        let waiting = match (&cfg.train.gemm_tuning_from, mode) {
            (Some(path), m) if m.times() => Some(Waiting {
                table: GemmTuningTable::load(path)
                    .map_err(|e| config_err(path.display().to_string(), e.to_string()))?,
                origin: format!("train.gemm_tuning_from = {}", path.display()),
                on: OnMismatch::Refuse,
            }),
            _ => None,
        };
        // Refused before anything runs where it cannot fit this rank's GPU and library (the
        // agreed check when it is used covers the other ranks).
        if let (Some(w), Some(here)) = (&waiting, be.gemm_environment()) {
            w.table.fits(&here, &w.origin, w.on).map_err(|e| {
                config_err(
                    cfg.train.gemm_tuning_from.as_deref().unwrap_or(Path::new("")).display().to_string(),
                    e.to_string(),
                )
            })?;
        }
        let t = RunTuning {
            mode,
            waiting,
            applied: None,
            // CPU ranks have one way to multiply: nothing to pick, share or store.
            settled: mode == GemmTuning::Heuristic || be.gemm_environment().is_none(),
            measuring_since: 0,
            out_file: cfg.output.dir.join(TABLE_FILE),
        };
        t.measure(be, t.waiting.is_none());
        Ok(t)
    }

    /// A resume from checkpoint `dir` holding `table` (its run's choices): used from the
    /// first step here, unless `train.gemm_tuning_from` names another table.
    pub fn resuming<B: Backend>(&mut self, be: &B, table: Option<GemmTuningTable>, dir: &Path) {
        if !self.mode.times() || self.waiting.is_some() {
            return;
        }
        if let Some(table) = table {
            self.waiting =
                Some(Waiting { table, origin: format!("checkpoint {}", dir.display()), on: OnMismatch::SetAside });
            self.measure(be, false);
        }
    }

    /// The table in use, if any.
    pub fn applied(&self) -> Option<&GemmTuningTable> {
        self.applied.as_ref()
    }

    /// Time (in the configured mode) the shapes first run from here on, or not.
    fn measure<B: Backend>(&self, be: &B, on: bool) {
        be.set_gemm_tuning(if on { self.mode } else { GemmTuning::Heuristic });
    }

    /// Called on every rank before and after every step, with `step` the optimizer steps
    /// done and `steps_here` those this process ran: every rank takes the same branch (some
    /// hold collectives).
    pub fn settle<B: Backend, C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
        step: usize,
        steps_here: usize,
    ) -> Result<(), TrainError> {
        if self.settled {
            return Ok(());
        }
        if self.waiting.is_some() {
            if step < 1 {
                return Ok(()); // the first step runs the heuristic's algorithms
            }
            let w = self.waiting.take().expect("checked");
            return self.use_stored(be, comm, w, step, steps_here);
        }
        if steps_here > self.measuring_since {
            return self.share(be, comm);
        }
        Ok(())
    }

    fn use_stored<B: Backend, C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
        w: Waiting,
        step: usize,
        steps_here: usize,
    ) -> Result<(), TrainError> {
        let rank = comm.rank();
        let Some(here) = be.gemm_environment() else {
            self.settled = true; // not reached: `new` settles backends without a choice
            return Ok(());
        };
        // Agreed first: a rank that refuses or sets aside must not leave the others waiting
        // in a collective the path it does not take would run.
        let fits = w.table.fits(&here, &w.origin, OnMismatch::SetAside).unwrap_or(false);
        let misfits = all_reduce_f64(comm, if fits { 0.0 } else { 1.0 })?;
        if misfits > 0.5 {
            if w.on == OnMismatch::Refuse {
                let value = w.origin.trim_start_matches("train.gemm_tuning_from = ").to_string();
                return Err(match w.table.fits(&here, &w.origin, OnMismatch::Refuse) {
                    Err(e) => config_err(value, e.to_string()),
                    Ok(_) => config_err(
                        value,
                        format!(
                            "{misfits:.0} other rank(s) run another GPU or cuBLASLt than it was timed on ({}); \
                             see their logs",
                            w.table.environment
                        ),
                    ),
                });
            }
            if rank == 0 {
                crate::log_line!(
                    "rank 0: {}: its GEMM algorithms were timed on {}, not on {here}: timing them anew in this \
                     step (the losses will not match that run's bit for bit)",
                    w.origin,
                    w.table.environment
                );
            }
            self.measuring_since = steps_here;
            self.measure(be, true);
            return Ok(());
        }
        // Under `gemm_tuning_from` an algorithm cuBLASLt refuses is that key's problem (exit code 2).
        let used = be.use_gemm_choices(&w.table, &w.origin, w.on).map_err(|e| match w.on {
            OnMismatch::Refuse => {
                config_err(w.origin.trim_start_matches("train.gemm_tuning_from = ").to_string(), e.to_string())
            }
            OnMismatch::SetAside => e.into(),
        })?;
        if rank == 0 {
            crate::log_line!(
                "rank 0: train.gemm_tuning: {used} stored GEMM algorithm(s) of {} ({} not the heuristic's first) from \
                 {} in use from step {}",
                w.table.gemms.len(),
                w.table.changed(),
                w.origin,
                step + 1
            );
        }
        self.finish(be, rank, w.table)
    }

    /// Rank 0's picks to every rank, and into use.
    fn share<B: Backend, C: EngineComm<B>>(&mut self, be: &B, comm: &mut C) -> Result<(), TrainError> {
        let rank = comm.rank();
        let mut words = if rank == 0 { pack(be.gemm_choices().as_ref()) } else { Vec::new() };
        // Word counts stay far below 2^24, exact in an f32.
        let mut len = [words.len() as f32];
        Communicator::<[f32]>::broadcast(comm, &mut len[..], 0)?;
        words.resize(len[0] as usize, 0.0);
        if !words.is_empty() {
            Communicator::<[f32]>::broadcast(comm, &mut words[..], 0)?;
        }
        let origin = "rank 0's GEMM choices";
        let table = unpack(&words, origin).map_err(|e| TrainError::Invalid(e.to_string()))?;
        match table {
            Some(t) if !t.gemms.is_empty() => {
                let used = be.use_gemm_choices(&t, origin, OnMismatch::SetAside)?;
                if used < t.gemms.len() {
                    let here = be.gemm_environment().map_or_else(|| "this device".into(), |e| e.to_string());
                    crate::log_line!(
                        "rank {rank}: uses {used} of rank 0's {} GEMM choices (rank 0 timed them on {}, this rank \
                         runs {here}); the others run cuBLASLt's heuristic's algorithm",
                        t.gemms.len(),
                        t.environment
                    );
                }
                self.finish(be, rank, t)
            }
            _ => {
                self.measure(be, false);
                self.settled = true;
                Ok(())
            }
        }
    }

    fn finish<B: Backend>(&mut self, be: &B, rank: usize, table: GemmTuningTable) -> Result<(), TrainError> {
        self.measure(be, false);
        self.settled = true;
        if rank == 0 {
            let written = self
                .out_file
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| table.write(&self.out_file));
            written.map_err(|e| {
                TrainError::Invalid(format!(
                    "cannot write the GEMM tuning to {}: {e}; choose a writable output.dir",
                    self.out_file.display()
                ))
            })?;
        }
        self.applied = Some(table);
        Ok(())
    }
}
