//! The job token: a secret every rank shows in its hello, so only this job's ranks can join
//! its rendezvous (a rank of another job, a scanner or anyone else who reaches the port is
//! logged and ignored).
//!
//! Node 0 generates one (128 random bits from the OS) unless given `--job-token TOKEN` or
//! `SHARDTRAIN_JOB_TOKEN=TOKEN`; the other nodes of a multi-node job must be given the same
//! token in one of those two ways (node 0 prints it when it made it). A job started by a
//! scheduler (`cluster.rs`) without one derives it from what every task sees alike (Slurm's
//! job and step id, torchrun's run id or rendezvous): it keeps other jobs' ranks out, but
//! anyone who can read the job's id can compute it, so it is no secret; an sbatch script
//! that exports `SHARDTRAIN_JOB_TOKEN=$(openssl rand -hex 16)` gives every task a real one. Ranks receive it from
//! their own launcher on a private pipe (never on a command line other users can read).

use crate::errors::SetupError;

/// The environment variable that supplies the token (preferred over `--job-token`: a
/// command line is visible to every user of the machine in `ps`).
pub const TOKEN_ENV: &str = "SHARDTRAIN_JOB_TOKEN";
/// Tokens longer than this are refused (they travel in the bounded hello).
const MAX_TOKEN: usize = 256;

/// Where this node's token came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Flag,
    Env,
    /// From the scheduler's environment (`cluster.rs`): the same on every task, no secret.
    Derived,
    Generated,
}

/// The job token, checked for the rules in [`check`].
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken {
    value: String,
    pub origin: Origin,
}

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never in logs by accident.
        f.debug_struct("JobToken").field("origin", &self.origin).finish_non_exhaustive()
    }
}

impl JobToken {
    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// Whether `offered` is this token (compared in time independent of where they differ).
    pub fn matches(&self, offered: &str) -> bool {
        let (a, b) = (self.value.as_bytes(), offered.as_bytes());
        let mut diff = (a.len() != b.len()) as u8;
        for i in 0..a.len().max(b.len()) {
            diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
        }
        diff == 0
    }
}

/// The token of this node: `--job-token`, else `SHARDTRAIN_JOB_TOKEN`, else the one derived
/// from the scheduler's environment (with what it came from), else (node 0 only) a fresh
/// random one. Nodes other than 0 must be given the token node 0 uses.
pub fn resolve(
    flag: Option<&str>,
    env: Option<String>,
    derived: Option<(String, String)>,
    node_rank: usize,
) -> Result<JobToken, SetupError> {
    let (value, origin) = match (flag, env, derived) {
        (Some(f), _, _) => (f.to_string(), Origin::Flag),
        (None, Some(e), _) => (e, Origin::Env),
        (None, None, Some((d, from))) => {
            if node_rank == 0 {
                crate::out::say(&format!(
                    "launcher: job token derived from {from}: it keeps other jobs' ranks out but is no secret (set \
                     {TOKEN_ENV} to a random value in the job script for one)"
                ));
            }
            (d, Origin::Derived)
        }
        (None, None, None) if node_rank == 0 => (generate()?, Origin::Generated),
        (None, None, None) => {
            return Err(SetupError(format!(
                "node {node_rank} needs the job's token to join node 0's rendezvous: start it with \
                 {TOKEN_ENV}=TOKEN (or --job-token TOKEN), where TOKEN is what node 0 printed at start-up, \
                 or choose one yourself and give the same to every node, node 0 included"
            )))
        }
    };
    check(&value, origin)?;
    Ok(JobToken { value, origin })
}

/// A token is 8 to 256 printable ASCII characters without spaces.
fn check(value: &str, origin: Origin) -> Result<(), SetupError> {
    let from = match origin {
        Origin::Flag => "--job-token",
        Origin::Env => TOKEN_ENV,
        Origin::Derived => "the job token derived from the scheduler's environment",
        Origin::Generated => "the generated job token",
    };
    if value.len() < 8 || value.len() > MAX_TOKEN || !value.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(SetupError(format!(
            "{from}: a job token is 8 to {MAX_TOKEN} printable ASCII characters without spaces \
             (e.g. the output of `openssl rand -hex 16`)"
        )));
    }
    Ok(())
}

/// 128 random bits from the OS, as 32 hex digits.
fn generate() -> Result<String, SetupError> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).map_err(|e| {
        SetupError(format!(
            "cannot read /dev/urandom to make a job token ({e}); give one with {TOKEN_ENV}=TOKEN or --job-token TOKEN"
        ))
    })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_zero_makes_one_and_others_must_be_given_it() {
        let a = resolve(None, None, None, 0).expect("generated");
        let b = resolve(None, None, None, 0).expect("generated");
        assert_eq!(a.origin, Origin::Generated);
        assert_eq!(a.as_str().len(), 32);
        assert_ne!(a.as_str(), b.as_str(), "fresh per job");
        let e = resolve(None, None, None, 1).unwrap_err().0;
        assert!(e.contains(TOKEN_ENV) && e.contains("--job-token"), "{e}");
        let derived = || Some(("slurm-77.0".to_string(), "SLURM_JOB_ID 77".to_string()));
        let t = resolve(Some("flag-token-1"), Some("env-token-22".into()), derived(), 1).expect("flag wins");
        assert_eq!((t.as_str(), t.origin), ("flag-token-1", Origin::Flag));
        let t = resolve(None, Some("env-token-22".into()), derived(), 1).expect("env");
        assert_eq!(t.origin, Origin::Env);
        let d = resolve(None, None, derived(), 1).expect("derived on every node");
        assert_eq!((d.as_str(), d.origin), ("slurm-77.0", Origin::Derived));
        for bad in ["short", "has a space in it", &"x".repeat(300)] {
            assert!(resolve(Some(bad), None, None, 0).is_err(), "{bad:?}");
        }
        assert!(!format!("{t:?}").contains("env-token"), "never printed by Debug");
    }

    #[test]
    fn only_the_same_token_matches() {
        let t = resolve(Some("abcdefgh12"), None, None, 0).expect("token");
        assert!(t.matches("abcdefgh12"));
        for other in ["abcdefgh13", "abcdefgh1", "abcdefgh123", ""] {
            assert!(!t.matches(other), "{other:?}");
        }
    }
}
