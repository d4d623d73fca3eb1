//! `launcher`: starts a shardtrain job and watches it.
//!
//! `launcher --cpus N CONFIG [--set section.key=value]... [--resume DIR|latest]` checks the
//! config, data and checkpoint once (`setup`, `resume`), starts N rank processes of this same binary (`ranks`), runs the
//! rendezvous that connects them (`rendezvous`, `protocol`), shows progress and writes
//! `metrics.jsonl` (`progress`, `metrics`), and stops every rank as soon as one fails
//! (`supervise`: where a rank is judged to have failed). `worker` is one rank's side.
//! `prepare-data`, `export`, `memory` and `plan` (memory and step time on a cluster) are
//! tools that start no job; `sweep` runs one job per rank count and ZeRO stage (`sweep`, `plot`).
//!
//! Exit codes: 0 finished; 1 the job failed (a rank failed, or the launcher could not run it);
//! 2 it never started (bad arguments, config, data or checkpoint, or a run directory that
//! holds another run or is in use: nothing was spawned), or a
//! rank found a data, checkpoint or config problem, or node 0 refused a node that runs
//! another config; 3 the hang watchdog stopped it (no progress for `watchdog.timeout_s`);
//! 130 interrupted. The tools exit 0, or 1 on failure (2 for bad arguments or config, and
//! `prepare-data` into a directory that holds shards).
//!
//! Also: `token` (the job's rendezvous secret), `fingerprint` (what must match across
//! nodes), `watchdog` (when a job is hung, and who is behind), `out` (output that never
//! stops a job when stdout is closed), `rundir` (a run directory belongs to one run) and
//! `runlock` (one launcher at a time per run directory).

mod cli;
mod device;
mod export;
mod fault;
mod fingerprint;
mod fit;
mod gpu;
mod memory;
mod metrics;
mod out;
mod plan;
mod plot;
mod prepare;
mod progress;
mod protocol;
mod ranks;
mod rendezvous;
mod resume;
mod rundir;
mod runlock;
mod setup;
mod supervise;
mod sweep;
mod token;
mod watchdog;
mod worker;

use clap::Parser;
use cli::{Cli, Command};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Worker(args)) => worker::run(args),
        Some(Command::PrepareData(args)) => report(prepare::run(&args)),
        Some(Command::Export(args)) => report(export::run(&args)),
        Some(Command::Memory(args)) => report(memory::run(&args)),
        Some(Command::Sweep(args)) => report(sweep::run(&args)),
        Some(Command::Plan(args)) => report(plan::run(&args)),
        None => report(launch(&cli.launch)),
    }
}

/// Check everything, then run the job on a small async runtime (it only waits on sockets and processes).
fn launch(args: &cli::LaunchArgs) -> anyhow::Result<()> {
    let plan = setup::plan(args)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("cannot start the launcher's async runtime: {e}"))?;
    let result = runtime.block_on(supervise::run(&plan));
    // The run directories stay locked until every rank is reaped and the summary written.
    drop(plan.locks);
    result
}

/// Print an error once, with its causes, and map it to the exit code.
fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            out::warn(&format!("error: {e:#}"));
            if let Some(job) = e.downcast_ref::<supervise::JobError>() {
                ExitCode::from(job.code)
            } else if e.downcast_ref::<setup::SetupError>().is_some() {
                ExitCode::from(2)
            } else if e.downcast_ref::<supervise::Interrupted>().is_some() {
                ExitCode::from(130)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
