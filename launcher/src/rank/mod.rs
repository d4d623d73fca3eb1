//! One rank: the hidden `launcher worker` process the launcher starts per CPU or GPU
//! (`worker`: its flags, the rendezvous from the rank's side, training or a doctor run), and,
//! in builds with the `fault-injection` feature only, the faults the tests inject (`fault`).
//!
//! May import `run::protocol` and `run::flight` (the frames and records it shares with its
//! launcher), `job/` (the device, the GPU training entry), `doctor/` (a doctor rank's
//! measurements) and the leaves; only `commands/` (the hidden `worker` subcommand) imports it.

#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod worker;
