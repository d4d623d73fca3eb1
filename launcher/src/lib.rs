//! `launcher`: starts a shardtrain job and watches it.
//!
//! `launcher --cpus N CONFIG [--set section.key=value]... [--resume DIR|latest]` checks the
//! config, data and checkpoint once (`job/`, `rundir/`), starts N rank processes of this same
//! binary, runs the rendezvous that connects them, shows progress and writes `metrics.jsonl`,
//! and stops every rank as soon as one fails (`run/`; `run::supervise` is where a rank is
//! judged to have failed). `rank/` is one rank's side. `prepare-data`, `export`, `eval` (the
//! loss of some weights), `memory` and `plan` (memory and step time on a cluster) are tools
//! that start no job; `sweep` runs one job per rank count and ZeRO stage; `doctor` starts a
//! job's ranks to check the network instead of training (`doctor/`).
//!
//! The folders, an import only ever pointing down the list: `commands/` (a file per
//! subcommand, its clap arguments on top), `rank/` (one rank), `run/` (a launcher watching
//! its job), `job/` (everything checked and decided before a rank starts), `doctor/` (what a
//! doctor run measures and how it is judged), `rundir/` (a run directory: its owner, its lock,
//! the checkpoint it resumes from), and the leaves `errors` (the errors that pick the exit
//! code), `signals` (signals by name, a rank's stop hooks), `out` (output that never stops a
//! job when stdout is closed) and `time` (UTC dates).
//!
//! Exit codes (docs/reference/commands.md's table): 0 finished; 1 the job failed while it ran (a rank
//! crashed, was killed or erred, or the launcher could not run it); 2 it never started (bad
//! arguments, config, data, checkpoint or `train.init_from`, a run directory that holds
//! another run or is in use, a plan that does not fit memory, too
//! many `--cpus`, node 0 unreachable or refusing this node: nothing trained), or a rank found
//! a data, checkpoint or config problem (a checkpoint it cannot write, e.g. a full disk,
//! included); 3 the hang watchdog stopped it (no progress for `watchdog.timeout_s`); 130
//! interrupted. The tools (`prepare-data`, `export`, `memory`, `plan`) start no job: they
//! exit 0, or 2 when they cannot do what was asked. `sweep` exits 2 for bad arguments and 1
//! when none of its runs finished.

mod commands;
mod doctor;
mod errors;
mod job;
mod out;
mod rank;
mod run;
mod rundir;
mod signals;
mod time;

use clap::Parser;
use commands::{Cli, Command};
use std::process::ExitCode;

/// The whole launcher: parse the command line, run the command, map its result to the exit
/// code (the table above). `main.rs` calls this and nothing else; the crate is a library so
/// that its tests can build the binary with the `fault-injection` feature (Cargo.toml).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Worker(args)) => rank::worker::run(args),
        Some(Command::PrepareData(args)) => report_tool(commands::prepare::run(&args)),
        Some(Command::Export(args)) => report_tool(commands::export::run(&args)),
        Some(Command::Eval(args)) => report_tool(commands::eval::run(&args)),
        Some(Command::Memory(args)) => report_tool(commands::memory::run(&args)),
        Some(Command::Sweep(args)) => report(commands::sweep::run(&args)),
        Some(Command::Plan(args)) => report_tool(commands::plan::run(&args)),
        Some(Command::Doctor(args)) => report(commands::doctor::run(&args)),
        None => report(commands::train::run(&cli.launch)),
    }
}

/// A tool's result: it started no job, so a failure is exit code 2 (see the module's table).
fn report_tool(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            out::warn(&format!("error: {}", error_text(&e)));
            ExitCode::from(errors::SETUP_EXIT)
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
            if let Some(job) = e.downcast_ref::<errors::JobError>() {
                ExitCode::from(job.code)
            } else if e.downcast_ref::<errors::SetupError>().is_some() {
                ExitCode::from(2)
            } else if e.downcast_ref::<errors::Interrupted>().is_some() {
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
