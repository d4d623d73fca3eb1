//! The errors that pick the launcher's exit code (`main.rs` maps them; its header has the
//! table): a job that never started ([`SetupError`], 2), one that ended for a reason with its
//! own code ([`JobError`]), one interrupted ([`Interrupted`], 130). A leaf: every layer may
//! return them, and it imports nothing of the crate.

/// The job could not start; the message names the problem and the fix.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SetupError(pub String);

impl From<trainer::config::ConfigError> for SetupError {
    fn from(e: trainer::config::ConfigError) -> Self {
        SetupError(e.to_string())
    }
}

/// The job was stopped by Ctrl-C or SIGTERM (exit code 130).
#[derive(Debug, thiserror::Error)]
#[error("interrupted: stopped all {0} ranks of this node")]
pub struct Interrupted(pub usize);

/// Exit code of a job stopped by the hang watchdog.
pub const HUNG_EXIT: u8 = 3;
/// Exit code of a job that never properly started: data, checkpoint or config problems
/// found by a rank, or a node refused for running another config.
pub const SETUP_EXIT: u8 = 2;

/// The job ended for a reason with its own exit code (see `main.rs`).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct JobError {
    pub code: u8,
    pub message: String,
}
