//! The command line: `launcher --cpus N CONFIG [--set section.key=value]... [--resume DIR|latest]`
//! trains, `launcher prepare-data` tokenises text, JSON lines and Parquet, `launcher export` writes a checkpoint as a
//! Hugging Face model folder, `launcher memory` predicts per-rank memory for every ZeRO stage,
//! `launcher sweep` trains one config over rank counts and stages (table and plots),
//! and the hidden `launcher worker` is one rank (the launcher starts its own binary with it;
//! users never type it).

use crate::device::Device;
use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "launcher",
    version,
    about = "Train GPT-2 with ZeRO-sharded ranks: one process per CPU rank (or GPU), a rendezvous, \
             progress, metrics.jsonl, and a clean stop when any rank fails",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub launch: LaunchArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Tokenise text, JSON-lines and Parquet files (plain, .gz, .zst) with GPT-2's BPE or a tokenizer.json into
    /// token shards (train + val, split by documents) for `data.path`.
    PrepareData(PrepareDataArgs),
    /// Write a checkpoint as a Hugging Face model folder (config.json and model.safetensors, float32) that
    /// transformers' `from_pretrained` loads.
    Export(ExportArgs),
    /// The mean loss (and perplexity) of train.init_from's weights, or a checkpoint's, on the first N windows of
    /// the config's validation split, in order.
    Eval(EvalArgs),
    /// Predict per-rank memory (by category, after one step and at the peak) for ZeRO stages 0-3 side by side.
    Memory(MemoryArgs),
    /// Train the config on several rank counts and ZeRO stages; write a table (CSV, JSON) and plots (SVG).
    Sweep(SweepArgs),
    /// Predict memory and step time per ZeRO stage and activation checkpointing on a cluster of K nodes × G GPUs.
    Plan(PlanArgs),
    /// Check the network before a long run: start the job's ranks as training would (same flags and
    /// environments), time all-reduce, all-gather and every pair of ranks, compare with what the GPUs and
    /// NICs should give, and name a slow rank or link (exit code 4 below --threshold).
    Doctor(crate::doctor::DoctorArgs),
    /// One rank of a job (started by the launcher; not for direct use).
    #[command(hide = true)]
    Worker(WorkerArgs),
}

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
    #[arg(long, value_name = "HOST:PORT", value_parser = crate::cluster::HostPort::parse)]
    pub master_addr: Option<crate::cluster::HostPort>,
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
}

/// Options of a training launch (the default command).
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// The TOML config file.
    #[arg(value_name = "CONFIG", required = true)]
    pub config: Option<PathBuf>,
    /// Override one config value, e.g. `--set zero.stage=3 --set train.steps=20`. Repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// The job's ranks and nodes.
    #[command(flatten)]
    pub job: JobArgs,
    /// Continue from a checkpoint: its directory (`<checkpoint.dir>/step_00000100`) or `latest`, the
    /// newest intact one in checkpoint.dir of the run that owns output.dir. Verified (every file's size and CRC-32, the model shape)
    /// before any rank starts; --cpus and zero.stage may differ from the run that saved it.
    /// metrics.jsonl and the rank logs of the run directory are continued, not replaced.
    #[arg(long, value_name = "DIR|latest")]
    pub resume: Option<PathBuf>,
    /// Start a new run in an output.dir that holds another run: that run (and a
    /// checkpoint.dir outside output.dir that holds checkpoints) is first renamed to
    /// `<dir>.prev-<run id>`, never deleted. Without it such a launch is refused.
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Host memory this node's ranks may use, in GiB, for the launch's fit check (default:
    /// MemAvailable). State it where memory grows as it is used (a VM whose memory is plugged
    /// in on demand shows a small MemAvailable at start).
    #[arg(long, value_name = "GIB", value_parser = parse_gib)]
    pub host_mem: Option<f64>,
}

/// A memory size in GiB: a positive, finite number.
pub fn parse_gib(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(g) if g.is_finite() && g > 0.0 => Ok(g),
        _ => Err(format!("{s:?} is not a size in GiB: give a positive number, e.g. 480 or 139.8")),
    }
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

#[derive(Debug, Args)]
pub struct PrepareDataArgs {
    /// Input files, directories (walked) and quoted patterns ('data/*.jsonl.gz') of .txt, .jsonl and .parquet
    /// files, plain or .gz/.zst; then the directory to write the shards into (created if missing; point
    /// `data.path` at it).
    #[arg(value_name = "INPUT... OUT_DIR", required = true, num_args = 2..)]
    pub paths: Vec<PathBuf>,
    /// `gpt2` (the GPT-2 BPE, built in) or a Hugging Face tokenizer.json (or the model folder holding it,
    /// e.g. a Llama folder). Vocabularies above 65536 ids are stored as u32 (llm.c's Llama 3 layout).
    #[arg(long, value_name = "gpt2|PATH", default_value = "gpt2")]
    pub tokenizer: String,
    /// The token placed before every document (default: the eos_token of a tokenizer_config.json beside the
    /// tokenizer.json, else `<|endoftext|>`, `<|end_of_text|>`, `</s>` or `<eos>`, whichever it has).
    #[arg(long, value_name = "TOKEN")]
    pub eot: Option<String>,
    /// The field of a .jsonl line, and the column of a .parquet file, that holds the text.
    #[arg(long, value_name = "NAME", default_value = "text")]
    pub text_field: String,
    /// How a .txt file is cut into documents: `file` (the whole file; a literal <|endoftext|> in it separates
    /// documents), `line` (every non-blank line) or `paragraph` (runs of non-blank lines).
    #[arg(long, value_enum, default_value_t = TxtDocsArg::File)]
    pub txt_docs: TxtDocsArg,
    /// Records that are not documents (malformed JSON lines, missing or null fields, invalid UTF-8, empty
    /// text): `skip` counts them and names the first of each kind in the summary and dataset.json; `refuse`
    /// stops at the first one, writing nothing.
    #[arg(long, value_enum, default_value_t = OnBadArg::Skip)]
    pub on_bad: OnBadArg,
    /// Fraction of the documents that become the validation split: document i (from 0, in input order) goes
    /// to validation when floor((i+1)·F) > floor(i·F), so exactly floor(n·F) of n, evenly spread.
    #[arg(long, value_name = "F", default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Token ids per shard file.
    #[arg(long, value_name = "N", default_value_t = 100_000_000)]
    pub shard_tokens: usize,
    /// Name prefix of the shard files (default: the first input's name without its suffixes).
    #[arg(long)]
    pub name: Option<String>,
    /// Add these inputs to an OUT_DIR that already holds shards (training then samples both; the tokenizer
    /// must be the same); every source is recorded in OUT_DIR/dataset.json. Without it such an OUT_DIR is
    /// refused.
    #[arg(long)]
    pub append: bool,
}

/// `--txt-docs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TxtDocsArg {
    File,
    Line,
    Paragraph,
}

/// `--on-bad`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnBadArg {
    Skip,
    Refuse,
}

/// `launcher eval`: the loss of some weights on the validation split's first windows.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The TOML config file (its data.path's validation split, model.seq_len, train.init_from).
    #[arg(value_name = "CONFIG")]
    pub config: PathBuf,
    /// Evaluate this checkpoint directory (`.../step_00000100`) instead of train.init_from.
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// How many windows of model.seq_len tokens, from the start of the validation split.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    pub windows: u64,
    /// With [[data.sources]]: evaluate only the source of this name (default: every source
    /// that has a validation split, one result each).
    #[arg(long, value_name = "NAME")]
    pub source: Option<String>,
    /// Compute on the CPU (the f32 reference) or on one GPU.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// With --device gpu: which GPU.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub gpu: u32,
    /// Override one config value, as for training. Repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// One checkpoint directory, e.g. runs/tiny/checkpoints/step_00000100.
    #[arg(value_name = "CKPT_DIR")]
    pub checkpoint: PathBuf,
    /// The folder to write: config.json and model.safetensors (or shards and their index). It
    /// must not exist, or be empty.
    #[arg(value_name = "OUT_DIR")]
    pub out: PathBuf,
    /// The largest weights file, e.g. 5GB, 500MB, 100KB (1 KB = 1000 bytes) or bytes: above
    /// it the weights are split into model-0000K-of-0000N.safetensors with
    /// model.safetensors.index.json, as transformers' save_pretrained(max_shard_size) does.
    #[arg(long, value_name = "SIZE", default_value = "5GB", value_parser = parse_size)]
    pub max_shard_size: u64,
}

/// A size in bytes: a number with an optional KB, MB or GB (powers of 1000, as transformers).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let (num, unit) = [("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0)]
        .iter()
        .find_map(|(suffix, unit)| upper.strip_suffix(suffix).map(|n| (n.trim().to_string(), *unit)))
        .unwrap_or((upper.clone(), 1.0));
    match num.parse::<f64>() {
        Ok(n) if n.is_finite() && n * unit >= 1.0 && n * unit < 1e18 => Ok((n * unit) as u64),
        _ => Err(format!("{s:?} is not a size: give e.g. 5GB, 500MB, 100KB or a number of bytes")),
    }
}

#[derive(Debug, Args)]
pub struct MemoryArgs {
    /// The TOML config file.
    #[arg(value_name = "CONFIG")]
    pub config: PathBuf,
    /// The number of ranks (the world size) to predict for.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub ranks: u32,
    /// Override one config value, as for training. Repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Whose memory accounting to predict: `cpu` is the CPU backend (f32 everywhere).
    #[arg(long, value_enum, default_value_t = crate::memory::MemoryDevice::Cpu)]
    pub device: crate::memory::MemoryDevice,
    /// Print exact bytes as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Ranks per node, for the host memory they share (default: all ranks on one node).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub ranks_per_node: Option<u32>,
    /// One GPU's memory in GiB for the fit check (default with --device gpu: this
    /// machine's first GPU, if it has one).
    #[arg(long, value_name = "GIB", value_parser = parse_gib)]
    pub gpu_mem: Option<f64>,
    /// Host memory available to the node's ranks in GiB (default: this machine's MemAvailable).
    #[arg(long, value_name = "GIB", value_parser = parse_gib)]
    pub host_mem: Option<f64>,
    /// Also search the largest train.micro_batch that fits (at the config's stage).
    #[arg(long)]
    pub max_batch: bool,
}

/// `launcher plan`: the cluster and the hardware figures (defaults for the chosen GPU).
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The TOML config file.
    #[arg(value_name = "CONFIG")]
    pub config: PathBuf,
    /// Nodes in the cluster.
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub nodes: u32,
    /// GPUs (ranks) per node.
    #[arg(long, value_name = "G", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub gpus_per_node: u32,
    /// The GPU whose figures are the defaults below (NVLink nodes, 400 Gb/s InfiniBand per GPU).
    #[arg(long, value_enum, default_value_t = crate::plan::GpuKind::H100)]
    pub gpu: crate::plan::GpuKind,
    /// Dense bf16 TFLOP/s per GPU (default: the GPU's, 989).
    #[arg(long, value_name = "X")]
    pub tflops: Option<f64>,
    /// GPU memory in GiB (default: H100 79.6, H200 139.8).
    #[arg(long, value_name = "X")]
    pub gpu_mem_gib: Option<f64>,
    /// NVLink bandwidth per GPU and direction in GB/s (default 450).
    #[arg(long, value_name = "X")]
    pub intra_gbs: Option<f64>,
    /// Network bandwidth per GPU in Gb/s (default 400: one 400 Gb/s InfiniBand NIC per GPU).
    #[arg(long, value_name = "X")]
    pub inter_gbits: Option<f64>,
    /// Override one config value, as for training. Repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `launcher sweep`: one training run per (ranks, stage) combination.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("device").required(true).args(["cpus", "gpus"]))]
pub struct SweepArgs {
    /// The TOML config file (train.steps sets each run's length: a few dozen steps suffice).
    #[arg(value_name = "CONFIG")]
    pub config: PathBuf,
    /// CPU rank counts to run, e.g. 1,2,3.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub cpus: Option<Vec<u32>>,
    /// GPU rank counts to run, e.g. 1,2,4,8 (counts above this node's GPUs are recorded as failed).
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub gpus: Option<Vec<u32>>,
    /// ZeRO stages to run, e.g. 1,2,3.
    #[arg(long, value_name = "S,S,...", value_delimiter = ',', default_value = "0,1,2,3", value_parser = clap::value_parser!(u8).range(0..=3))]
    pub stages: Vec<u8>,
    /// Override one config value for every run, as for training. Repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Where the table, the plots and each run's directory go (default: <output.dir>/sweep).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The launcher's rendezvous address.
    #[arg(long, value_name = "HOST:PORT")]
    pub rendezvous: SocketAddr,
    /// This process's global rank.
    #[arg(long)]
    pub rank: u32,
    /// Number of ranks in the job.
    #[arg(long)]
    pub world: u32,
    /// The resolved, validated config written by the launcher.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Interface the data-plane listener binds (127.0.0.1 on one node, 0.0.0.0 across nodes).
    #[arg(long, value_name = "IP")]
    pub bind_host: std::net::IpAddr,
    /// Which backend this rank computes on.
    #[arg(long, value_enum)]
    pub device: Device,
    /// Index of this rank on its node.
    #[arg(long, default_value_t = 0)]
    pub local_rank: u32,
    /// The GPU this rank uses (default: its local rank; SHARDTRAIN_GPU_MAP changes it).
    #[arg(long)]
    pub gpu: Option<u32>,
    /// Continue from this checkpoint directory (validated by the launcher).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// `launcher doctor`: measure the network as its plan (JSON) says, instead of training.
    #[arg(long, value_name = "FILE")]
    pub doctor: Option<PathBuf>,
}
