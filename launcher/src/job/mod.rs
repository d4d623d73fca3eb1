//! Everything checked and decided before a rank starts: the flags that place the ranks
//! (`flags`), the node layout from a scheduler's environment (`cluster`), the device and the
//! GPU of each rank (`device`, `gpu`: the libraries, the GPU count, NCCL's id), whether the
//! plan fits memory (`fit`, reading the memory cgroup: `cgroup`), what must match across
//! nodes (`fingerprint`), the job's rendezvous secret (`token`), and `setup`, which runs
//! them in order and hands the supervisor a [`setup::RunPlan`].
//!
//! May import `doctor/` (a doctor run's plan: `doctor::spec`), `rundir/` (the run directory
//! it claims) and the leaves (`errors`, `out`, `signals`, `time`); never `commands/`, `run/`
//! or `rank/`.

pub mod cgroup;
pub mod cluster;
pub mod device;
pub mod fingerprint;
pub mod fit;
pub mod flags;
pub mod gpu;
pub mod setup;
pub mod token;
