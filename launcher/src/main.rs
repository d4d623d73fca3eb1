//! `launcher`: starts a shardtrain job and watches it.
//!
//! `launcher --cpus N CONFIG [--set section.key=value]... [--resume DIR|latest]` checks the
//! config, data and checkpoint once (`setup`, `resume`), starts N rank processes of this same binary (`ranks`), runs the
//! rendezvous that connects them (`rendezvous`, `protocol`), shows progress and writes
//! `metrics.jsonl` (`progress`, `metrics`), and stops every rank as soon as one fails
//! (`supervise`: where a rank is judged to have failed). `worker` is one rank's side.
//! `prepare-data`, `export`, `eval` (the loss of some weights), `memory` and `plan` (memory and step time on a cluster) are
//! tools that start no job; `sweep` runs one job per rank count and ZeRO stage (`sweep`, `plot`);
//! `doctor` starts a job's ranks to check the network instead of training (`doctor/`).
//!
//! Exit codes (the README's table): 0 finished; 1 the job failed while it ran (a rank
//! crashed, was killed or erred, or the launcher could not run it); 2 it never started (bad
//! arguments, config, data, checkpoint or `train.init_from`, a run directory that holds
//! another run or is in use, a plan that does not fit memory, too
//! many `--cpus`, node 0 unreachable or refusing this node: nothing trained), or a rank found
//! a data, checkpoint or config problem (a checkpoint it cannot write, e.g. a full disk,
//! included); 3 the hang watchdog stopped it (no progress for `watchdog.timeout_s`); 130
//! interrupted. The tools (`prepare-data`, `export`, `memory`, `plan`) start no job: they
//! exit 0, or 2 when they cannot do what was asked. `sweep` exits 2 for bad arguments and 1
//! when none of its runs finished.
//!
//! Also: `token` (the job's rendezvous secret), `fingerprint` (what must match across
//! nodes), `watchdog` (when a job is hung, and who is behind), `out` (output that never
//! stops a job when stdout is closed), `rundir` (a run directory belongs to one run) and
//! `runlock` (one launcher at a time per run directory).

mod cgroup;
mod cli;
mod cluster;
mod device;
mod doctor;
mod eval;
mod export;
mod fault;
mod fingerprint;
mod fit;
mod flight;
mod gpu;
mod memory;
mod metrics;
mod oom;
mod out;
mod plan;
mod plot;
mod prepare;
mod prepare_progress;
mod progress;
mod protocol;
mod ranks;
mod rendezvous;
mod resume;
mod rundir;
mod runlock;
mod setup;
mod signals;
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
        Some(Command::PrepareData(args)) => report_tool(prepare::run(&args)),
        Some(Command::Export(args)) => report_tool(export::run(&args)),
        Some(Command::Eval(args)) => report_tool(eval::run(&args)),
        Some(Command::Memory(args)) => report_tool(memory::run(&args)),
        Some(Command::Sweep(args)) => report(sweep::run(&args)),
        Some(Command::Plan(args)) => report_tool(plan::run(&args)),
        Some(Command::Doctor(args)) => report(doctor::run(&args)),
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

/// A tool's result: it started no job, so a failure is exit code 2 (see the module's table).
fn report_tool(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            out::warn(&format!("error: {}", error_text(&e)));
            ExitCode::from(supervise::SETUP_EXIT)
        }
    }
}

/// The error and its causes, each said once: a cause whose text the message before it
/// already quotes (`checkpoint I/O on /x: No space left on device (os error 28)` over that
/// io::Error) is left out, so no OS error is printed twice.
fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if said.is_empty() || text.contains(&said) {
            continue;
        }
        if !text.is_empty() {
            text += ": ";
        }
        text += &said;
    }
    text
}

/// Print an error once, with its causes, and map it to the exit code.
fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            out::warn(&format!("error: {}", error_text(&e)));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_os_error_quoted_by_its_context_is_said_once() {
        let io = std::io::Error::from_raw_os_error(28);
        let quoted = format!("writing /ck/rank00000.safetensors: {io}");
        let e = anyhow::Error::new(io).context(quoted.clone()).context("saving step 4");
        assert_eq!(error_text(&e), format!("saving step 4: {quoted}"));
        assert_eq!(error_text(&e).matches("os error 28").count(), 1);
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_text(&plain), "outer: inner");
    }
}
