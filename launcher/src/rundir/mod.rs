//! A run directory belongs to one run: who owns `output.dir` (`owner`: `run.json`, a new run
//! refused or set aside with `--overwrite`, `metrics.jsonl` and the rank logs continued on a
//! resume), one launcher at a time per directory (`runlock`), and the checkpoint a run
//! continues from (`resume`: `--resume DIR|latest`, verified before any rank starts).
//!
//! May import only the leaves (`errors`, `out`, `time`); `job::setup` drives it.

pub mod owner;
pub mod resume;
pub mod runlock;
