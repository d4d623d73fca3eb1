//! What a rank computes on, whether this build can do it, and the environment every
//! rank process gets for it (thread counts, NCCL/NVSHMEM settings).

use clap::ValueEnum;

/// The backend a rank runs: the CPU reference (`--cpus`) or the CUDA backend with NCCL
/// (`--gpus`; the NCCL id travels in the rendezvous `Start`, see `gpu.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Cpu,
    Gpu,
}

impl Device {
    /// The spelling of the worker's `--device` value and of messages.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        }
    }

    /// Why this build cannot run ranks on this device, if it cannot.
    pub fn unavailable_reason(self) -> Option<String> {
        match self {
            Device::Cpu => None,
            Device::Gpu if cfg!(feature = "cuda") => None,
            Device::Gpu => Some(
                "--gpus: this launcher was built without the `cuda` feature; rebuild with \
                 `cargo build --release -p launcher` (cuda is a default feature), or train on CPU ranks with --cpus N"
                    .to_string(),
            ),
        }
    }

    /// Environment variables for a rank process when `local_ranks` ranks share this node.
    pub fn rank_env(self, local_ranks: usize) -> Vec<(&'static str, String)> {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let mut env = vec![
            // matrixmultiply's thread count: the node's cores divided between its ranks.
            ("MATMUL_NUM_THREADS", (cores / local_ranks.max(1)).max(1).to_string()),
            // NVLink SHARP / multicast stays off on the machines this runs on (see KINDS.md):
            // set for every rank whatever the device, so no library turns it on by itself.
            ("NCCL_NVLS_ENABLE", "0".to_string()),
            ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1".to_string()),
            ("NVSHMEM_DISABLE_NVLS", "1".to_string()),
        ];
        // NCCL connects its channels (and allocates their buffers) when the communicator is
        // made rather than at each collective's first use, so the per-rank memory report can
        // measure them and no training step pays for the set-up. A user's setting wins.
        if self == Device::Gpu && std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
            env.push(("NCCL_RUNTIME_CONNECT", "0".to_string()));
        }
        env
    }
}

/// The GPU of each local rank: `spec` (`--gpu-map`, a comma-separated list, one GPU index
/// per rank: `0,0` puts local ranks 0 and 1 both on GPU 0) or the identity.
pub fn gpu_map(local_ranks: usize, spec: Option<&str>) -> Result<Vec<usize>, String> {
    let Some(spec) = spec else {
        return Ok((0..local_ranks).collect());
    };
    let bad = |why: String| {
        format!("--gpu-map {spec:?}: {why}; give one GPU index per rank of this node, e.g. --gpu-map 0,0 for two ranks on GPU 0")
    };
    let map: Vec<usize> = spec
        .split(',')
        .map(|g| g.trim().parse::<usize>().map_err(|_| bad(format!("`{}` is not a GPU index", g.trim()))))
        .collect::<Result<_, _>>()?;
    if map.len() != local_ranks {
        return Err(bad(format!("{} entries for --gpus {local_ranks}", map.len())));
    }
    Ok(map)
}

/// Whether two ranks of `map` share a GPU. NCCL refuses two ranks of one communicator on
/// one GPU of one host ("Duplicate GPU detected"), so such ranks are each given their own
/// `NCCL_HOSTID`: NCCL then connects them through its network transport (slow; for tests).
pub fn shares_gpus(map: &[usize]) -> bool {
    let mut seen = map.to_vec();
    seen.sort_unstable();
    seen.windows(2).any(|w| w[0] == w[1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_maps_parse_and_name_their_problems() {
        assert_eq!(gpu_map(3, None), Ok(vec![0, 1, 2]));
        assert_eq!(gpu_map(2, Some("0,0")), Ok(vec![0, 0]));
        assert!(shares_gpus(&[0, 0]) && !shares_gpus(&[1, 0]));
        let e = gpu_map(2, Some("0")).unwrap_err();
        assert!(e.contains("1 entries for --gpus 2") && e.contains("--gpu-map"), "{e}");
        assert!(gpu_map(2, Some("0,x")).unwrap_err().contains("`x` is not a GPU index"));
    }

    #[test]
    fn env_divides_cores_and_disables_multicast() {
        let env = Device::Cpu.rank_env(1_000_000);
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get("MATMUL_NUM_THREADS").as_deref(), Some("1"));
        assert_eq!(get("NCCL_NVLS_ENABLE").as_deref(), Some("0"));
        assert_eq!(get("TORCH_SYMM_MEM_DISABLE_MULTICAST").as_deref(), Some("1"));
        assert_eq!(get("NVSHMEM_DISABLE_NVLS").as_deref(), Some("1"));
        // GPU ranks connect NCCL at start-up (measured memory), unless the user chose otherwise.
        let gpu = Device::Gpu.rank_env(2);
        let connect = gpu.iter().find(|(n, _)| *n == "NCCL_RUNTIME_CONNECT").map(|(_, v)| v.as_str());
        if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
            assert_eq!(connect, Some("0"));
        } else {
            assert_eq!(connect, None);
        }
        assert!(env.iter().all(|(n, _)| *n != "NCCL_RUNTIME_CONNECT"));
    }

    #[test]
    fn gpu_availability_follows_the_build() {
        assert!(Device::Cpu.unavailable_reason().is_none());
        assert_eq!(Device::Gpu.unavailable_reason().is_none(), cfg!(feature = "cuda"));
    }
}
