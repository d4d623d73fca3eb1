//! TEST-ONLY fault injection, so the launcher's failure handling can be tested with real
//! processes. A worker reads `SHARDTRAIN_FAULT=rank:step:kind` from its environment:
//! - `kind = exit`: that rank exits with code 7 right after reporting that step;
//! - `kind = abort`: that rank calls `std::process::abort()` (a hard crash, SIGABRT)
//!   right after reporting that step.
//!
//! Not a user feature: nothing sets it outside tests/launcher.rs. (Code 7 is no code the
//! launcher gives a meaning: 2 and 3 mean a setup problem and a watchdog stop.)

/// The environment variable a worker reads.
pub const FAULT_ENV: &str = "SHARDTRAIN_FAULT";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Exit,
    Abort,
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
        let bad = || format!("{FAULT_ENV}={spec:?} is not rank:step:exit or rank:step:abort (a test-only setting)");
        let parts: Vec<&str> = spec.trim().split(':').collect();
        let [rank, step, kind] = parts.as_slice() else {
            return Err(bad());
        };
        let kind = match *kind {
            "exit" => FaultKind::Exit,
            "abort" => FaultKind::Abort,
            _ => return Err(bad()),
        };
        Ok(Fault { rank: rank.parse().map_err(|_| bad())?, step: step.parse().map_err(|_| bad())?, kind })
    }

    /// Crash this process now if the fault is for `rank` at `step`.
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(Fault::parse("1:2:exit"), Ok(Fault { rank: 1, step: 2, kind: FaultKind::Exit }));
        assert_eq!(Fault::parse("0:7:abort"), Ok(Fault { rank: 0, step: 7, kind: FaultKind::Abort }));
        for bad in ["", "1:2", "1:2:explode", "a:2:exit", "1:2:exit:4"] {
            assert!(Fault::parse(bad).is_err(), "{bad:?}");
        }
    }
}
