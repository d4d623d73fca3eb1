//! GPU ranks: the checks made before any rank starts (libraries, device count, NCCL),
//! the NCCL unique id the rendezvous hands out, and one rank's CUDA backend + NCCL group.
//!
//! Built with the `cuda` feature (the default). cudarc loads every CUDA library at run
//! time, so this compiles on machines without CUDA and fails there with a clear message.

#[cfg(feature = "cuda")]
mod imp {
    use std::path::Path;
    use trainer::backend::cuda::CudaBackend;
    use trainer::{Config, StepMetrics, TrainError, TrainSummary};

    /// Before spawning: every library loads and this node has at least `local_ranks` GPUs.
    pub fn preflight(local_ranks: usize) -> Result<String, String> {
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
        if count < local_ranks {
            return Err(format!(
                "--gpus {local_ranks}: this node has {count} GPU(s) visible (CUDA_VISIBLE_DEVICES={}); ask for at most {count}",
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

    /// Run one GPU rank: CUDA backend on `local_rank`, NCCL group from `id`, then train.
    #[allow(clippy::too_many_arguments)]
    pub fn train_rank(
        cfg: &Config,
        data_path: &Path,
        resume: Option<&Path>,
        rank: usize,
        world: usize,
        local_rank: usize,
        id: &[u8],
        on_step: &mut dyn FnMut(&StepMetrics) -> Result<(), TrainError>,
    ) -> Result<TrainSummary, TrainError> {
        let be = CudaBackend::new(local_rank)?;
        println!("rank {rank}: {be:?} on GPU {local_rank}");
        // What NCCL allocates for itself (channels, buffers; connected at creation: the
        // launcher sets NCCL_RUNTIME_CONNECT=0) is measured here for the memory report.
        let before = be.outside_pool_bytes();
        let mut comm = collectives::nccl::NcclComm::new(be.stream().clone(), rank, world, id)?;
        if let (Some(a), Some(b)) = (before, be.outside_pool_bytes()) {
            be.set_comm_library_bytes(b.saturating_sub(a));
        }
        trainer::train::train_from(cfg, &be, &mut comm, data_path, resume, on_step)
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use std::path::Path;
    use trainer::{Config, StepMetrics, TrainError, TrainSummary};

    const NOT_BUILT: &str = "--gpus: this launcher was built without the `cuda` feature; \
                             rebuild with `cargo build --release -p launcher` (cuda is a default feature)";

    pub fn preflight(_local_ranks: usize) -> Result<String, String> {
        Err(NOT_BUILT.into())
    }
    pub fn nccl_id() -> Result<Vec<u8>, String> {
        Err(NOT_BUILT.into())
    }
    #[allow(clippy::too_many_arguments)]
    pub fn train_rank(
        _: &Config,
        _: &Path,
        _: Option<&Path>,
        _: usize,
        _: usize,
        _: usize,
        _: &[u8],
        _: &mut dyn FnMut(&StepMetrics) -> Result<(), TrainError>,
    ) -> Result<TrainSummary, TrainError> {
        Err(TrainError::Invalid(NOT_BUILT.into()))
    }
}

pub use imp::{nccl_id, preflight, train_rank};
