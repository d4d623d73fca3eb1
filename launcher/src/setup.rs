//! Everything checked and prepared before any rank is spawned: the device, the node
//! layout, the config (loaded and validated once, here), the checkpoint to resume from
//! (`resume`), the data path, the run directory and the resolved config file the ranks
//! read. A problem found here is a [`SetupError`]: printed once, exit code 2, nothing started.

use crate::cli::LaunchArgs;
use crate::device::Device;
use crate::resume::Resume;
use data::Split;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use trainer::Config;

/// The job could not start; the message names the problem and the fix.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SetupError(pub String);

impl From<trainer::config::ConfigError> for SetupError {
    fn from(e: trainer::config::ConfigError) -> Self {
        SetupError(e.to_string())
    }
}

/// A validated launch: what to spawn, where everything goes.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// The validated config; `data.path`, `output.dir` and `checkpoint.dir` are resolved to absolute paths.
    pub cfg: Config,
    pub device: Device,
    /// Ranks on this node.
    pub local_ranks: usize,
    /// Global rank of this node's first rank.
    pub first_rank: usize,
    /// Ranks in the whole job (nnodes × local_ranks).
    pub world: usize,
    pub node_rank: usize,
    /// Rendezvous address for multi-node jobs; `None`: a free loopback port on this node.
    pub master_addr: Option<SocketAddr>,
    pub logs_dir: PathBuf,
    pub resolved_config: PathBuf,
    /// `metrics.jsonl`: truncated for a new run; on resume, kept up to the checkpoint's step and appended to.
    pub metrics_path: PathBuf,
    /// `--resume`: the validated checkpoint every rank continues from.
    pub resume: Option<Resume>,
    /// GPU jobs: the NCCL unique id node 0 hands every rank in `Start`.
    pub nccl_id: Option<Vec<u8>>,
}

impl RunPlan {
    /// Whether this node hosts the rendezvous (and writes metrics).
    pub fn is_master(&self) -> bool {
        self.node_rank == 0
    }
    pub fn multi_node(&self) -> bool {
        self.world > self.local_ranks
    }
    /// Log file of a (global) rank that runs on this node.
    pub fn log_path(&self, rank: usize) -> PathBuf {
        self.logs_dir.join(format!("rank{rank}.log"))
    }
    /// Global ranks that run on this node.
    pub fn local_rank_ids(&self) -> std::ops::Range<usize> {
        self.first_rank..self.first_rank + self.local_ranks
    }
}

/// Check the arguments and config, prepare the data and the run directory.
pub fn plan(args: &LaunchArgs) -> Result<RunPlan, SetupError> {
    let (device, local_ranks) = args.device();
    if let Some(reason) = device.unavailable_reason() {
        return Err(SetupError(reason));
    }
    let mut nccl_id = None;
    if device == Device::Gpu {
        // Libraries and GPU count are checked before any rank starts: a clear error, never a panic.
        let found = crate::gpu::preflight(local_ranks).map_err(SetupError)?;
        println!("launcher: {found}");
        if args.node_rank == 0 {
            nccl_id = Some(crate::gpu::nccl_id().map_err(SetupError)?);
        }
    }
    let (nnodes, node_rank) = (args.nnodes as usize, args.node_rank as usize);
    if node_rank >= nnodes {
        return Err(SetupError(format!(
            "--node-rank {node_rank} is out of range for --nnodes {nnodes}: use 0 to {}",
            nnodes - 1
        )));
    }
    if nnodes > 1 && args.master_addr.is_none() {
        return Err(SetupError(format!(
            "--nnodes {nnodes} needs --master-addr HOST:PORT: node 0's address that every node can reach"
        )));
    }
    let config_path =
        args.config.as_deref().ok_or_else(|| SetupError("no CONFIG given: launcher --cpus N CONFIG.toml".into()))?;
    let mut cfg = Config::load(config_path, &args.overrides)?;

    let out_dir = absolute(&cfg.output.dir);
    cfg.output.dir = out_dir.clone();
    cfg.checkpoint.dir = cfg.checkpoint.dir.as_deref().map(absolute);
    let world = nnodes * local_ranks;
    // Before anything is written: a checkpoint that cannot be resumed leaves the run directory as it was.
    let resume = args.resume.as_deref().map(|arg| crate::resume::resolve(arg, &cfg, world)).transpose()?;

    let logs_dir = out_dir.join("logs");
    std::fs::create_dir_all(&logs_dir).map_err(|e| {
        SetupError(format!(
            "cannot create the run directory {} (output.dir): {e}; choose a writable output.dir, \
             e.g. --set output.dir=runs/mine",
            logs_dir.display()
        ))
    })?;
    let data_path = resolve_data(cfg.data.path.as_deref(), &out_dir)?;
    check_data(&cfg, &data_path)?;
    cfg.data.path = Some(data_path);

    let resolved_config = out_dir.join("config.resolved.toml");
    let text = toml::to_string(&cfg)
        .map_err(|e| SetupError(format!("cannot serialize the resolved config: {e} (a bug: please report it)")))?;
    write(&resolved_config, text.as_bytes())?;
    let metrics_path = out_dir.join("metrics.jsonl");
    if node_rank == 0 {
        crate::metrics::start_file(&metrics_path, resume.as_ref().map(|r| r.step))
            .map_err(|e| SetupError(format!("{e:#}")))?;
    }
    Ok(RunPlan {
        cfg,
        device,
        local_ranks,
        first_rank: node_rank * local_ranks,
        world,
        node_rank,
        master_addr: args.master_addr,
        logs_dir,
        resolved_config,
        metrics_path,
        resume,
        nccl_id,
    })
}

/// `data.path` as given, or the built-in corpus generated under the run directory.
fn resolve_data(path: Option<&Path>, out_dir: &Path) -> Result<PathBuf, SetupError> {
    match path {
        None => {
            let dir = out_dir.join("builtin-data");
            data::ensure_builtin_dataset(&dir)
                .map_err(|e| SetupError(format!("cannot generate the built-in dataset in {}: {e}", dir.display())))
        }
        Some(p) if p.exists() || is_pattern(p) => Ok(absolute(p)),
        Some(p) => Err(SetupError(format!(
            "data.path = {} does not exist: make token shards with `launcher prepare-data INPUT.txt {}`, \
             fix the path, or remove data.path to train on the built-in corpus",
            p.display(),
            p.display()
        ))),
    }
}

/// Open the training shards once here, so data problems stop the job before any rank starts:
/// unreadable shards, token ids the model's vocabulary cannot hold (the trainer's own check,
/// [`trainer::train::check_data_fits`]), shards shorter than a window.
fn check_data(cfg: &Config, path: &Path) -> Result<(), SetupError> {
    let dataset = data::Dataset::open(path, Split::Train).map_err(|e| SetupError(format!("data.path: {e}")))?;
    trainer::train::check_data_fits(cfg, &dataset, path).map_err(|e| SetupError(e.to_string()))?;
    data::BatchSampler::new(dataset, cfg.model.seq_len, cfg.train.seed)
        .map_err(|e| SetupError(format!("data.path: {e}")))?;
    Ok(())
}

/// `data.path` may be a shard pattern such as `dir/name_train_*.bin`.
fn is_pattern(p: &Path) -> bool {
    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.contains(['*', '?']))
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), SetupError> {
    std::fs::write(path, bytes).map_err(|e| SetupError(format!("cannot write {}: {e}", path.display())))
}

/// `p` made absolute against the current directory (ranks may run elsewhere in multi-node jobs).
fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}
