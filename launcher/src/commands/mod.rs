//! The command line, a file per subcommand with its clap arguments on top (ripgrep's
//! `flags/` shape): `launcher --cpus N CONFIG [--set section.key=value]... [--resume DIR|latest]`
//! trains (`train.rs`), `launcher prepare-data` tokenises text, JSON lines and Parquet
//! (`prepare.rs`, its progress lines `prepare_progress.rs`), `launcher export` writes a
//! checkpoint as a Hugging Face model folder, `launcher eval` the loss of some weights,
//! `launcher memory` predicts per-rank memory for every ZeRO stage, `launcher plan` memory and
//! step time on a cluster, `launcher sweep` trains one config over rank counts and stages
//! (table, and plots: `plot.rs`), `launcher doctor` checks the network (`doctor.rs`), and the
//! hidden `launcher worker` is one rank (`rank::worker`, which owns its flags: the launcher
//! starts its own binary with it; users never type it).
//!
//! The top of the house: a command may import every folder below it (`run/`, `rank/`,
//! `doctor/`, `job/`, `rundir/`) and the leaves; nothing below imports a command.

pub mod doctor;
pub mod eval;
pub mod export;
pub mod memory;
pub mod plan;
pub mod plot;
pub mod prepare;
pub mod prepare_progress;
pub mod sweep;
pub mod train;

use clap::{Parser, Subcommand};
use doctor::DoctorArgs;
use eval::EvalArgs;
use export::ExportArgs;
use memory::MemoryArgs;
use plan::PlanArgs;
use prepare::PrepareDataArgs;
use sweep::SweepArgs;
use train::LaunchArgs;

#[derive(Debug, Parser)]
#[command(
    name = "launcher",
    version,
    about = "Train GPT-2 with ZeRO-sharded ranks: one process per CPU rank (or GPU), a rendezvous, \
             progress, metrics.jsonl, and a clean stop when any rank fails",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub launch: LaunchArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Tokenise text, JSON-lines and Parquet files (plain, .gz, .zst) with GPT-2's BPE or a tokenizer.json into
    /// token shards (train + val, split by documents) for `data.path`.
    PrepareData(PrepareDataArgs),
    /// Write a checkpoint as a Hugging Face model folder (config.json and model.safetensors, float32) that
    /// transformers' `from_pretrained` loads.
    Export(ExportArgs),
    /// The mean loss (and perplexity) of train.init_from's weights, or a checkpoint's, on the first N windows of
    /// the config's validation split, in order.
    Eval(EvalArgs),
    /// Predict per-rank memory (by category, after one step and at the peak) for ZeRO stages 0-3 side by side.
    Memory(MemoryArgs),
    /// Train the config on several rank counts and ZeRO stages; write a table (CSV, JSON) and plots (SVG).
    Sweep(SweepArgs),
    /// Predict memory and step time per ZeRO stage and activation checkpointing on a cluster of K nodes × G GPUs.
    Plan(PlanArgs),
    /// Check the network before a long run: start the job's ranks as training would (same flags and
    /// environments), time all-reduce, all-gather and every pair of ranks, compare with what the GPUs and
    /// NICs should give, and name a slow rank or link (exit code 4 below --threshold).
    Doctor(DoctorArgs),
    /// One rank of a job (started by the launcher; not for direct use).
    #[command(hide = true)]
    Worker(crate::rank::worker::WorkerArgs),
}
