//! GPU ranks: the checks made before any rank starts (libraries, device count, NCCL),
//! the NCCL unique id the rendezvous hands out, and one rank's CUDA backend + NCCL group.
//!
//! Built with the `cuda` feature (the default). cudarc loads every CUDA library at run
//! time, so this compiles on machines without CUDA and fails there with a clear message.

/// One GPU rank of a job: what [`train_rank`] trains, on which GPU, in which NCCL group.
pub struct GpuRank<'a> {
    pub cfg: &'a trainer::Config,
    pub data_path: &'a std::path::Path,
    /// The checkpoint to resume from, if any.
    pub resume: Option<&'a std::path::Path>,
    /// `--profile`: time the phases of every step.
    pub profile: bool,
    pub rank: usize,
    pub world: usize,
    /// The CUDA device this rank uses.
    pub gpu: usize,
    /// The NCCL unique id the launcher handed out.
    pub nccl_id: &'a [u8],
}

#[cfg(feature = "cuda")]
mod imp {
    use collectives::local::LocalGpuComm;
    use collectives::nccl::{NcclAbort, NcclComm};
    use collectives::progress::{Op, Progress, Tracked};
    use std::path::Path;
    use std::sync::Arc;
    use trainer::backend::cuda::CudaBackend;
    use trainer::eval::EvalResult;
    use trainer::{Config, StepMetrics, TrainError, TrainSummary};

    /// Before spawning: every library loads and this node has at least `gpus_needed` GPUs
    /// (`--gpus N`, or one more than the highest GPU of `--gpu-map`).
    pub fn preflight(gpus_needed: usize) -> Result<String, String> {
        // SAFETY: each call only asks the dynamic loader whether the library opens.
        let libs = unsafe {
            [
                ("libcuda (the NVIDIA driver)", cudarc::driver::sys::is_culib_present()),
                ("libnvrtc (CUDA toolkit)", cudarc::nvrtc::sys::is_culib_present()),
                ("libcublas (CUDA toolkit)", cudarc::cublas::sys::is_culib_present()),
                ("libcublasLt (CUDA toolkit)", cudarc::cublaslt::sys::is_culib_present()),
                ("libnccl (NCCL)", cudarc::nccl::sys::is_culib_present()),
            ]
        };
        let missing: Vec<&str> = libs.iter().filter(|(_, ok)| !ok).map(|(n, _)| *n).collect();
        if !missing.is_empty() {
            return Err(format!(
                "--gpus: cannot load {}; install it or add its directory to LD_LIBRARY_PATH \
                 (NCCL is looked up as libnccl.so: pip's libnccl.so.2 needs a libnccl.so symlink)",
                missing.join(", ")
            ));
        }
        cudarc::driver::result::init().map_err(|e| format!("--gpus: the CUDA driver does not initialise: {e:?}"))?;
        let count = cudarc::driver::result::device::get_count()
            .map_err(|e| format!("--gpus: cannot count GPUs: {e:?}"))? as usize;
        if count < gpus_needed {
            return Err(format!(
                "--gpus: {gpus_needed} GPU(s) needed but this node has {count} visible (CUDA_VISIBLE_DEVICES={}); \
                 ask for at most {count}, or map ranks to GPUs with --gpu-map",
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
            ));
        }
        let nccl = collectives::nccl::nccl_version().map_err(|e| format!("--gpus: NCCL: {e}"))?;
        Ok(format!("{count} GPU(s), NCCL {nccl}"))
    }

    /// A fresh NCCL unique id (128 bytes) for the rendezvous to hand every rank.
    pub fn nccl_id() -> Result<Vec<u8>, String> {
        collectives::nccl::nccl_unique_id().map_err(|e| format!("cannot create the NCCL unique id: {e}"))
    }

    /// `train.precision = "fp8"`: every GPU of `gpus` has compute capability 9.0 or later
    /// (FP8 tensor cores; asked of the driver, no context made), or an error naming the
    /// first that has not. Each rank checks its own GPU again before training.
    pub fn check_fp8(gpus: &[usize]) -> Result<(), String> {
        use cudarc::driver::result::device;
        use cudarc::driver::sys::CUdevice_attribute as A;
        cudarc::driver::result::init().map_err(|e| format!("--gpus: the CUDA driver does not initialise: {e:?}"))?;
        let mut seen = gpus.to_vec();
        seen.sort_unstable();
        seen.dedup();
        for g in seen {
            let dev = device::get(g as i32).map_err(|e| format!("GPU {g}: {e:?}"))?;
            // SAFETY: a device handle from the driver; two integer attributes.
            let (major, minor) = unsafe {
                (
                    device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                    device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
                )
            };
            let (major, minor) = (major.map_err(|e| format!("GPU {g}: {e:?}"))?, minor.unwrap_or(0));
            if major < 9 {
                let name = device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into());
                return Err(format!(
                    "train.precision = \"fp8\" needs GPUs of compute capability 9.0 (Hopper) or later for FP8 GEMMs: \
                     GPU {g} ({name}) has compute capability {major}.{minor}; set train.precision = \"bf16\""
                ));
            }
        }
        Ok(())
    }

    /// Bytes of GPU 0 (cuDeviceTotalMem: no context is made), if the driver answers.
    pub fn total_memory() -> Option<u64> {
        // SAFETY: only asks the dynamic loader whether the driver library opens.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return None;
        }
        cudarc::driver::result::init().ok()?;
        let dev = cudarc::driver::result::device::get(0).ok()?;
        // SAFETY: a device handle from the driver, queried once.
        unsafe { cudarc::driver::result::device::total_mem(dev) }.ok().map(|b| b as u64)
    }

    /// Run one GPU rank: CUDA backend on `gpu`, NCCL group from `id`, then train, every
    /// collective recorded in `progress`. The communicator is abortable from the moment it
    /// is being made: a stop order from the launcher aborts it (`ncclCommAbort`), so a
    /// rank stuck in a collective (or in the join) is released.
    pub fn train_rank(
        job: super::GpuRank<'_>,
        progress: &Arc<Progress>,
        on_step: &mut dyn FnMut(&StepMetrics) -> Result<(), TrainError>,
    ) -> Result<TrainSummary, TrainError> {
        let super::GpuRank { cfg, data_path, resume, profile, rank, world, gpu, nccl_id: id } = job;
        let be = CudaBackend::new(gpu)?;
        trainer::log_line!("rank {rank}: {be:?} on GPU {gpu}");
        if world == 1 {
            // One GPU: nothing to communicate, so no NCCL communicator (and its ~1 GiB).
            let mut comm = Tracked::new(LocalGpuComm::new(be.stream().clone()), progress.clone());
            return trainer::train::train_from(cfg, &be, &mut comm, data_path, resume, profile, on_step);
        }
        let abort = NcclAbort::new();
        let on_stop = abort.clone();
        crate::signals::on_stop(move || {
            if let Err(e) = on_stop.abort() {
                trainer::log_line!("rank {rank}: aborting the NCCL communicator failed: {e}");
            }
        });
        // What NCCL allocates for itself (channels, buffers; connected at creation: the
        // launcher sets NCCL_RUNTIME_CONNECT=0) is measured here for the memory report.
        let before = be.outside_pool_bytes();
        let comm = {
            let _joining = progress.enter(Op::Connect);
            NcclComm::new_abortable(be.stream().clone(), rank, world, id, &abort)?
        };
        if let (Some(a), Some(b)) = (before, be.outside_pool_bytes()) {
            be.set_comm_library_bytes(b.saturating_sub(a));
        }
        let mut comm = Tracked::new(comm, progress.clone());
        trainer::train::train_from(cfg, &be, &mut comm, data_path, resume, profile, on_step)
    }

    /// `launcher eval` on one GPU (no communicator: a world of one).
    pub fn eval_rank(
        cfg: &Config,
        data: &[trainer::eval::EvalData],
        windows: usize,
        checkpoint: Option<&Path>,
        gpu: usize,
    ) -> Result<Vec<EvalResult>, TrainError> {
        let be = CudaBackend::new(gpu)?;
        let mut comm = LocalGpuComm::new(be.stream().clone());
        trainer::eval::evaluate(cfg, &be, &mut comm, data, windows, checkpoint)
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use collectives::progress::Progress;
    use std::path::Path;
    use std::sync::Arc;
    use trainer::{Config, StepMetrics, TrainError, TrainSummary};

    const NOT_BUILT: &str = "--gpus: this launcher was built without the `cuda` feature; \
                             rebuild with `cargo build --release -p launcher` (cuda is a default feature)";

    pub fn preflight(_gpus_needed: usize) -> Result<String, String> {
        Err(NOT_BUILT.into())
    }
    pub fn check_fp8(_gpus: &[usize]) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }
    pub fn nccl_id() -> Result<Vec<u8>, String> {
        Err(NOT_BUILT.into())
    }
    pub fn total_memory() -> Option<u64> {
        None
    }
    pub fn train_rank(
        _: super::GpuRank<'_>,
        _: &Arc<Progress>,
        _: &mut dyn FnMut(&StepMetrics) -> Result<(), TrainError>,
    ) -> Result<TrainSummary, TrainError> {
        Err(TrainError::Invalid(NOT_BUILT.into()))
    }
    pub fn eval_rank(
        _: &Config,
        _: &[trainer::eval::EvalData],
        _: usize,
        _: Option<&Path>,
        _: usize,
    ) -> Result<Vec<trainer::eval::EvalResult>, TrainError> {
        Err(TrainError::Invalid(NOT_BUILT.into()))
    }
}

pub use imp::{check_fp8, eval_rank, nccl_id, preflight, total_memory, train_rank};
