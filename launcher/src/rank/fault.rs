//! TEST-ONLY fault injection, so the launcher's failure handling can be tested with real
//! processes. A worker reads `SHARDTRAIN_FAULT=rank:step:kind` from its environment:
//! - `kind = exit`: that rank exits with code 7 right after reporting that step;
//! - `kind = abort`: that rank calls `std::process::abort()` (a hard crash, SIGABRT)
//!   right after reporting that step;
//! - `kind = skip-collective`, `extra-collective`, `stop-at-collective` (CPU ranks): at the
//!   first collective that rank enters after reporting that step, it skips the collective
//!   (as if its code took another branch), first runs an extra one (an all-reduce of one
//!   float: another collective, of another size, at that number), or stops itself with
//!   SIGSTOP (it never arrives). These make the host-side divergences the flight recorder
//!   must name; [`Faulty`] wraps the rank's communicator, outside the recording one, so the
//!   records show what the rank really called;
//! - `kind = abort-mid-save`: that rank aborts while its background writer is in the middle
//!   of the shard of the checkpoint of that step (`checkpoint.async`; after the file's first
//!   tensor): a crash mid-write; `fail-mid-save`: the write fails there instead with a
//!   full disk's error (ENOSPC's kind), and training must stop with that error, code 2;
//! - `kind = throttle` (the step is not used): in `launcher doctor`, that rank's traffic is
//!   held to [`THROTTLE_BYTES_PER_S`], a slow rank the report must name.
//!
//! Not a user feature: nothing sets it outside tests/launcher.rs. (Code 7 is no code the
//! launcher gives a meaning: 2 and 3 mean a setup problem and a watchdog stop.)

use collectives::progress::Progress;
use collectives::{AllGatherInPlace, CommError, Communicator, Group, Pending, ReduceOp};
use std::sync::Arc;

/// The environment variable a worker reads.
pub const FAULT_ENV: &str = "SHARDTRAIN_FAULT";

/// `throttle`: a throttled rank's doctor traffic, bytes per second.
pub const THROTTLE_BYTES_PER_S: f64 = 20e6;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Exit,
    Abort,
    SkipCollective,
    ExtraCollective,
    StopAtCollective,
    AbortMidSave,
    FailMidSave,
    Throttle,
}

impl FaultKind {
    const NAMES: [(&'static str, FaultKind); 8] = [
        ("exit", FaultKind::Exit),
        ("abort", FaultKind::Abort),
        ("skip-collective", FaultKind::SkipCollective),
        ("extra-collective", FaultKind::ExtraCollective),
        ("stop-at-collective", FaultKind::StopAtCollective),
        ("abort-mid-save", FaultKind::AbortMidSave),
        ("fail-mid-save", FaultKind::FailMidSave),
        ("throttle", FaultKind::Throttle),
    ];

    /// Whether it acts at a collective (through [`Faulty`]) rather than after a step.
    fn at_collective(self) -> bool {
        matches!(self, FaultKind::SkipCollective | FaultKind::ExtraCollective | FaultKind::StopAtCollective)
    }
}

/// A fault to inject on one rank after one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub step: u64,
    pub kind: FaultKind,
}

impl Fault {
    /// The fault requested in the environment, if any.
    pub fn from_env() -> Result<Option<Fault>, String> {
        match std::env::var(FAULT_ENV) {
            Ok(spec) => Fault::parse(&spec).map(Some),
            Err(_) => Ok(None),
        }
    }

    fn parse(spec: &str) -> Result<Fault, String> {
        let kinds: Vec<&str> = FaultKind::NAMES.iter().map(|(n, _)| *n).collect();
        let bad = || {
            format!(
                "{FAULT_ENV}={spec:?} is not rank:step:kind with kind one of {} (a test-only setting)",
                kinds.join(", ")
            )
        };
        let parts: Vec<&str> = spec.trim().split(':').collect();
        let [rank, step, kind] = parts.as_slice() else {
            return Err(bad());
        };
        let kind = FaultKind::NAMES.iter().find(|(n, _)| n == kind).map(|(_, k)| *k).ok_or_else(bad)?;
        Ok(Fault { rank: rank.parse().map_err(|_| bad())?, step: step.parse().map_err(|_| bad())?, kind })
    }

    /// Crash this process now if the fault is for `rank` at `step` (and acts after a step).
    pub fn trigger(&self, rank: usize, step: u64) {
        if self.rank != rank || self.step != step {
            return;
        }
        match self.kind {
            FaultKind::Exit => {
                trainer::log_line!("rank {rank}: {FAULT_ENV}: exiting with code 7 after step {step} (injected fault)");
                std::process::exit(7);
            }
            FaultKind::Abort => {
                trainer::log_line!("rank {rank}: {FAULT_ENV}: aborting after step {step} (injected crash)");
                std::process::abort();
            }
            _ => {}
        }
    }

    /// `throttle` for `rank`: the rate its doctor traffic is held to.
    pub fn throttle(&self, rank: usize) -> Option<f64> {
        (self.kind == FaultKind::Throttle && self.rank == rank).then_some(THROTTLE_BYTES_PER_S)
    }

    /// An `abort-mid-save` or `fail-mid-save` for `rank`: hook it into the background
    /// checkpoint writer.
    pub fn install_save_hook(&self, rank: usize) {
        let (kind, step) = (self.kind, self.step);
        if !matches!(kind, FaultKind::AbortMidSave | FaultKind::FailMidSave) || self.rank != rank {
            return;
        }
        trainer::checkpoint::background::set_mid_write_hook(move |r, s| {
            if r != rank || s != step {
                return Ok(());
            }
            if kind == FaultKind::FailMidSave {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    format!("{FAULT_ENV}: injected write failure in the middle of the shard (no space left on device)"),
                ));
            }
            trainer::log_line!(
                "rank {rank}: {FAULT_ENV}: aborting while writing checkpoint step {step} (injected crash)"
            );
            std::process::abort();
        });
    }

    /// The collective fault for `rank`, if this is one.
    pub fn at_collective(&self, rank: usize) -> Option<Fault> {
        (self.rank == rank && self.kind.at_collective()).then_some(*self)
    }
}

/// A communicator that injects a collective fault (see the module's list) once, at the
/// first collective after its step; otherwise the communicator it wraps.
pub struct Faulty<C> {
    inner: C,
    fault: Option<Fault>,
    progress: Arc<Progress>,
}

impl<C> Faulty<C> {
    /// `fault`: this rank's collective fault, if any; `progress` says which step it is in.
    pub fn new(inner: C, fault: Option<Fault>, progress: Arc<Progress>) -> Faulty<C> {
        Faulty { inner, fault, progress }
    }
}

impl<C: Communicator<[f32]>> Faulty<C> {
    /// Before a collective: `true` when the fault says to skip it.
    fn intercept(&mut self) -> Result<bool, CommError> {
        let Some(f) = self.fault else { return Ok(false) };
        if self.progress.snapshot().steps_done < f.step {
            return Ok(false);
        }
        self.fault = None;
        let (rank, step) = (f.rank, f.step);
        match f.kind {
            FaultKind::SkipCollective => {
                trainer::log_line!(
                    "rank {rank}: {FAULT_ENV}: skipping a collective after step {step} (injected divergence)"
                );
                Ok(true)
            }
            FaultKind::ExtraCollective => {
                trainer::log_line!(
                    "rank {rank}: {FAULT_ENV}: an extra all-reduce after step {step} (injected divergence)"
                );
                let mut one = [0.0f32];
                self.inner.all_reduce(&mut one[..], ReduceOp::Sum)?;
                Ok(false)
            }
            FaultKind::StopAtCollective => {
                trainer::log_line!(
                    "rank {rank}: {FAULT_ENV}: stopping before a collective after step {step} (injected hang)"
                );
                let _ = std::process::Command::new("kill").args(["-STOP", &std::process::id().to_string()]).status();
                Ok(false)
            }
            FaultKind::Exit
            | FaultKind::Abort
            | FaultKind::AbortMidSave
            | FaultKind::FailMidSave
            | FaultKind::Throttle => Ok(false),
        }
    }
}

impl<C: Communicator<[f32]>> Group for Faulty<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        if self.intercept()? {
            return Ok(());
        }
        self.inner.barrier()
    }
    fn wait(&mut self, p: Pending) -> Result<(), CommError> {
        self.inner.wait(p)
    }
}

impl<B: ?Sized, C: AllGatherInPlace<B> + Communicator<[f32]>> AllGatherInPlace<B> for Faulty<C> {
    fn all_gather_in_place_start(&mut self, buf: &mut B) -> Result<Pending, CommError> {
        if self.intercept()? {
            return Ok(Pending::DONE);
        }
        self.inner.all_gather_in_place_start(buf)
    }
}

impl<B: ?Sized, C: Communicator<B> + Communicator<[f32]>> Communicator<B> for Faulty<C> {
    fn all_gather(&mut self, send: &B, recv: &mut B) -> Result<(), CommError> {
        if self.intercept()? {
            return Ok(());
        }
        self.inner.all_gather(send, recv)
    }
    fn reduce_scatter(&mut self, send: &B, recv: &mut B, op: ReduceOp) -> Result<(), CommError> {
        if self.intercept()? {
            return Ok(());
        }
        self.inner.reduce_scatter(send, recv, op)
    }
    fn all_reduce(&mut self, buf: &mut B, op: ReduceOp) -> Result<(), CommError> {
        if self.intercept()? {
            return Ok(());
        }
        self.inner.all_reduce(buf, op)
    }
    fn broadcast(&mut self, buf: &mut B, root: usize) -> Result<(), CommError> {
        if self.intercept()? {
            return Ok(());
        }
        self.inner.broadcast(buf, root)
    }
    fn all_gather_start(&mut self, send: &B, recv: &mut B) -> Result<Pending, CommError> {
        if self.intercept()? {
            return Ok(Pending::DONE);
        }
        self.inner.all_gather_start(send, recv)
    }
    fn reduce_scatter_start(&mut self, send: &B, recv: &mut B, op: ReduceOp) -> Result<Pending, CommError> {
        if self.intercept()? {
            return Ok(Pending::DONE);
        }
        self.inner.reduce_scatter_start(send, recv, op)
    }
    fn all_reduce_start(&mut self, buf: &mut B, op: ReduceOp) -> Result<Pending, CommError> {
        if self.intercept()? {
            return Ok(Pending::DONE);
        }
        self.inner.all_reduce_start(buf, op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(Fault::parse("1:2:exit"), Ok(Fault { rank: 1, step: 2, kind: FaultKind::Exit }));
        assert_eq!(Fault::parse("0:7:abort"), Ok(Fault { rank: 0, step: 7, kind: FaultKind::Abort }));
        let skip = Fault::parse("2:3:skip-collective").expect("skip");
        assert_eq!(skip.at_collective(2), Some(skip));
        assert_eq!(skip.at_collective(1), None);
        assert_eq!(Fault::parse("1:2:exit").expect("exit").at_collective(1), None);
        for bad in ["", "1:2", "1:2:explode", "a:2:exit", "1:2:exit:4"] {
            let e = Fault::parse(bad).unwrap_err();
            assert!(e.contains("extra-collective"), "{bad:?}: {e}");
        }
    }
}
