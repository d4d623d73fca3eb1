//! Node 0 (and every node's launcher) watching the job: `supervise` runs it and decides
//! whether a rank has failed (where a rank is judged failed; `rank_state` is what it knows
//! of each rank, `verdict` says how the job ended and which rank failed first), `ranks`
//! spawns and reaps the rank processes, `rendezvous` and `protocol` connect them (the control frames, and the
//! lines of a rank's log a launcher reads back), `watchdog` tells a hung job and who is
//! behind, `flight` compares the ranks' flight recorders, `oom` names a rank the kernel
//! killed for memory, `metrics` writes `metrics.jsonl`, `progress` the bar.
//!
//! May import `job/` (the [`crate::job::setup::RunPlan`] it runs), `doctor/` (node 0's
//! report of a doctor run), `rundir/` and the leaves; never `commands/` or `rank/` (a rank
//! imports `protocol` and `flight` from here, not the other way).

pub mod flight;
pub mod metrics;
pub mod oom;
pub mod progress;
pub mod protocol;
pub mod rank_state;
pub mod ranks;
pub mod rendezvous;
pub mod supervise;
pub mod verdict;
pub mod watchdog;
