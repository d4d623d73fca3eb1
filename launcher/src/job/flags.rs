//! The flags that place a job's ranks: the device and rank count, the nodes and the
//! rendezvous, the job token, the GPU of each rank. Training (`commands/train.rs`) and
//! `launcher doctor` (`commands/doctor.rs`) flatten the same [`JobArgs`]; `setup::place` reads them.

use crate::job::device::Device;
use clap::Args;

/// Where a job's ranks run: the device and rank count, the nodes and the rendezvous. Training
/// and `launcher doctor` take the same flags (and the same Slurm / torchrun-style variables).
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("device").args(["cpus", "gpus"]))]
pub struct JobArgs {
    /// N CPU ranks on this node, one OS process each (collectives over TCP).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub cpus: Option<u32>,
    /// N GPU ranks on this node, one process per GPU (CUDA backend, NCCL); the
    /// launcher checks the CUDA libraries and the GPU count before starting any rank.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub gpus: Option<u32>,
    /// Multi-node: the rendezvous address, HOST:PORT of node 0 (node 0 listens there; a host
    /// name or an IP address). Default: from the scheduler's environment (Slurm: the first host
    /// of the step's node list; torchrun-style: MASTER_ADDR, MASTER_PORT); single-node runs pick
    /// a free loopback port by themselves.
    #[arg(long, value_name = "HOST:PORT", value_parser = crate::job::cluster::HostPort::parse)]
    pub master_addr: Option<crate::job::cluster::HostPort>,
    /// Multi-node: how many nodes take part (each runs this launcher with the same config and
    /// --cpus). Default: from the scheduler's environment (SLURM_*, WORLD_SIZE), else 1. With
    /// --one-rank every launcher is a node of one rank: this is the world size.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub nnodes: Option<u32>,
    /// Multi-node: this node's index in 0..nnodes (node 0 hosts the rendezvous); ranks are
    /// node_rank*N + local. Default: from the environment (SLURM_NODEID, NODE_RANK, ...), else 0.
    /// With --one-rank: this rank.
    #[arg(long, value_name = "K")]
    pub node_rank: Option<u32>,
    /// This process is one rank of the job, not a node's launcher: a task per GPU (`srun
    /// --ntasks-per-node=G launcher --one-rank CONFIG`, or a process per GPU under torchrun).
    /// Its rank, the world and the rendezvous come from SLURM_PROCID / SLURM_NTASKS or RANK /
    /// WORLD_SIZE / MASTER_ADDR, its GPU from SLURM_LOCALID or LOCAL_RANK (GPU 0 when
    /// CUDA_VISIBLE_DEVICES shows it one). GPU unless --cpus 1.
    #[arg(long)]
    pub one_rank: bool,
    /// The job's secret that ranks show to the rendezvous (others are ignored). Node 0 makes
    /// one if none is given and prints it for multi-node jobs; every other node must be given
    /// the same. Prefer the environment variable SHARDTRAIN_JOB_TOKEN (a command line is
    /// visible to other users in `ps`).
    #[arg(long, value_name = "TOKEN")]
    pub job_token: Option<String>,
    /// GPU ranks: the GPU of each of this node's ranks, one index per rank, e.g. `0,0` puts
    /// local ranks 0 and 1 both on GPU 0 (to test multi-rank behaviour, such as the hang
    /// watchdog, on a one-GPU machine; ranks sharing a GPU talk through NCCL's network
    /// transport, slowly). Default: local rank i uses GPU i.
    #[arg(long, value_name = "G,G,...")]
    pub gpu_map: Option<String>,
    /// CPU ranks: start more than 8 ranks per core of this machine (refused otherwise: ranks
    /// beyond the cores only take turns).
    #[arg(long)]
    pub oversubscribe: bool,
}

impl JobArgs {
    /// The device kind and the ranks this launcher starts, from `--cpus` / `--gpus` (clap
    /// allows at most one) and `--one-rank` (one rank; a GPU unless `--cpus 1`).
    pub fn device(&self) -> Result<(Device, usize), String> {
        let (device, n) = match (self.cpus, self.gpus) {
            (Some(n), _) => (Device::Cpu, n as usize),
            (None, Some(n)) => (Device::Gpu, n as usize),
            (None, None) if self.one_rank => (Device::Gpu, 1),
            (None, None) => {
                return Err("say what to train on: --cpus N (CPU ranks) or --gpus N (GPU ranks), e.g. \
                            `launcher --cpus 2 CONFIG`"
                    .into())
            }
        };
        if self.one_rank && n != 1 {
            let flag = if device == Device::Cpu { "--cpus" } else { "--gpus" };
            return Err(format!(
                "--one-rank runs one rank per process, but {flag} {n} asks for {n}: drop {flag} (a GPU rank) or give \
                 {flag} 1; for a launcher that starts a node's ranks, drop --one-rank"
            ));
        }
        Ok((device, n))
    }
}
