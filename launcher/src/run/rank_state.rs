//! What the supervisor knows about each rank ([`RankState`]: its connection, its steps, how
//! it ended, what it reported) and why it stops the job ([`Stop`]). `supervise.rs` fills them
//! in from the job's events; `verdict.rs` reads them to say how the job ended.

use crate::run::protocol;
use std::process::ExitStatus;
use tokio::net::tcp::OwnedWriteHalf;

/// What the supervisor knows about one rank.
#[derive(Default)]
pub(super) struct RankState {
    pub(super) local: bool,
    pub(super) data_addr: Option<String>,
    pub(super) writer: Option<OwnedWriteHalf>,
    pub(super) last_step: u64,
    /// `Failed { setup: true }`: a data, checkpoint or config problem.
    pub(super) setup_failure: bool,
    pub(super) done: bool,
    /// `Failed` message and the peer it blames.
    pub(super) failed: Option<(String, Option<u32>)>,
    pub(super) exit: Option<std::io::Result<ExitStatus>>,
    /// The control connection ended (with the error, if it broke).
    pub(super) closed: Option<Option<String>>,
    /// Order in which ranks first showed trouble (lower = earlier).
    pub(super) trouble_seq: Option<u64>,
    /// The process was still running at teardown and was killed by the launcher.
    pub(super) killed: bool,
    /// Lines of its log it could not write (reported by the rank), and the first error.
    pub(super) log_lost: u64,
    pub(super) log_error: Option<String>,
    /// Its flight recorder as it answered the dump, and the newest record its last heartbeat
    /// carried.
    pub(super) flight: Option<Vec<protocol::CollectiveRecord>>,
    pub(super) heard: Option<protocol::CollectiveRecord>,
    /// Asked for its flight recorder.
    pub(super) dump_asked: bool,
    /// `launcher doctor`: what it measured.
    pub(super) doctor: Option<crate::doctor::report::RankReport>,
}

impl RankState {
    /// Remember when this rank first showed trouble.
    pub(super) fn mark_trouble(&mut self, seq: &mut u64) {
        if self.trouble_seq.is_none() {
            self.trouble_seq = Some(*seq);
            *seq += 1;
        }
    }
    pub(super) fn exited_ok(&self) -> bool {
        matches!(&self.exit, Some(Ok(s)) if s.success())
    }
}

/// Why the job is being stopped.
pub(super) enum Stop {
    /// Ranks failed; details are in the rank states.
    Failure,
    /// Some ranks never said hello.
    HelloTimeout(Vec<usize>),
    /// A connection that cannot take part (duplicate rank, wrong version, ...).
    Fatal(String),
    /// A node runs another config or build than node 0.
    Refused(String),
    /// The watchdog saw no progress; its report.
    Hung(String),
    Interrupted,
}
