//! Everything checked and prepared before any rank is spawned: the device and the GPU of
//! each rank, the node layout (from the flags, else from a scheduler's environment:
//! `cluster.rs`), the job token, the config (loaded and validated once, here),
//! (node 0) the run directory's lock and owner (`rundir::runlock`, `rundir::owner`: a
//! directory holds one run), the checkpoint to resume from (`rundir::resume`), the data (both splits against the vocabulary,
//! the shards' tokenizer against `train.init_from`'s),
//! `train.init_from`, the checkpoint directory (writable; half-written `.step_*.partial`
//! directories of a crashed save removed), the run directory, the node's fingerprint and the
//! resolved config file the ranks read. A problem found here is a [`SetupError`]: printed
//! once, exit code 2, nothing started.

use crate::errors::SetupError;
use crate::job::device::Device;
use crate::job::fingerprint::Fingerprint;
use crate::job::flags::JobArgs;
use crate::job::token::JobToken;
use crate::rundir::resume::Resume;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use trainer::Config;

/// A validated launch: what to spawn, where everything goes.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// The validated config; `data.path`, `output.dir`, `checkpoint.dir` and
    /// `train.gemm_tuning_from` are resolved to absolute paths, `checkpointing.keep_gelu =
    /// "auto"` to its decision.
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
    /// The rendezvous as written (a host name, from a flag or the environment), for messages.
    pub master_name: Option<String>,
    /// `--one-rank`: this launcher is one rank (a "node" of one rank, named a task).
    pub one_rank: bool,
    /// Ranks on this host, sharing its memory and cores (more than `local_ranks` when
    /// several `--one-rank` launchers share a node).
    pub host_ranks: usize,
    /// The scheduler environment the layout came from, if any (for the launch line).
    pub env_source: Option<String>,
    pub logs_dir: PathBuf,
    pub resolved_config: PathBuf,
    /// `metrics.jsonl`: truncated for a new run; on resume, kept up to the checkpoint's step and appended to.
    pub metrics_path: PathBuf,
    /// `--resume`: the validated checkpoint every rank continues from.
    pub resume: Option<Resume>,
    /// GPU jobs: the NCCL unique id node 0 hands every rank in `Start`.
    pub nccl_id: Option<Vec<u8>>,
    /// The secret every rank shows in its hello.
    pub token: JobToken,
    /// What this node runs, compared across nodes at the rendezvous.
    pub fingerprint: Fingerprint,
    /// GPU jobs: the GPU of each local rank (`--gpu-map`, default the identity).
    pub gpu_map: Vec<usize>,
    /// `--profile`: every rank waits for the device between the phases of each step and
    /// prints their times.
    pub profile: bool,
    /// The run that owns the run directory (node 0; `run.json`).
    pub run_id: Option<String>,
    /// The line after which rank logs continue the ones there (a resume, or a run taking
    /// over one that never completed a step); `None`: each log starts empty.
    pub log_marker: Option<String>,
    /// Node 0's locks on the run's directories, held until the plan is dropped.
    pub locks: Option<std::sync::Arc<crate::rundir::owner::Locks>>,
    /// `launcher doctor`: the ranks measure the network instead of training.
    pub doctor: Option<crate::doctor::Spec>,
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
    /// The launcher `k` as reports name it: "node 1", or with `--one-rank` "task 1".
    pub fn launcher_name(&self, k: usize) -> String {
        format!("{} {k}", if self.one_rank { "task" } else { "node" })
    }
}

/// CPU ranks per available core beyond which a launch is refused: every rank is a process
/// computing on its own, and each collective waits for the slowest, so ranks beyond the
/// cores only take turns (a few per core is useful for tests of sharding on a small machine).
pub const RANKS_PER_CORE: usize = 8;

/// Where this launcher stands in the job and what it starts: the device, the node layout,
/// the job token, the GPUs and the rendezvous. Training and `launcher doctor` share it.
pub(crate) struct Place {
    device: Device,
    local_ranks: usize,
    layout: Layout,
    token: JobToken,
    nccl_id: Option<Vec<u8>>,
    gpu_map: Vec<usize>,
    master_addr: Option<SocketAddr>,
}

/// What a training launch asks for: the training command's flags (`commands::train`), as
/// [`plan`] reads them.
pub struct Launch<'a> {
    pub job: &'a JobArgs,
    /// The TOML config file (`None`: not given, said as an error).
    pub config: Option<&'a Path>,
    /// `--set section.key=value`, in order.
    pub overrides: &'a [String],
    /// `--resume DIR|latest`.
    pub resume: Option<&'a Path>,
    pub overwrite: bool,
    /// `--host-mem GIB`: the host memory of the fit check (default: MemAvailable).
    pub host_mem: Option<f64>,
    /// `--skip-fit-check`: launch a plan predicted not to fit.
    pub skip_fit_check: bool,
    pub profile: bool,
}

/// Check the arguments and config, prepare the data and the run directory.
pub fn plan(args: &Launch) -> Result<RunPlan, SetupError> {
    let Place { device, local_ranks, layout, token, nccl_id, gpu_map, master_addr } = place(args.job)?;
    let (nnodes, node_rank) = (layout.nnodes, layout.node_rank);
    let config_path = args.config.ok_or_else(|| SetupError("no CONFIG given: launcher --cpus N CONFIG.toml".into()))?;
    let mut cfg = Config::load(config_path, args.overrides)?;
    if device == Device::Gpu && cfg.train.precision == trainer::backend::Precision::Fp8 {
        crate::job::gpu::check_fp8(&gpu_map).map_err(SetupError)?;
    }
    check_gemm_tuning_from(&cfg)?;
    let world = nnodes * local_ranks;
    let gpu = device == Device::Gpu;
    let capacity = crate::job::fit::Capacity::of_this_machine(gpu, None, args.host_mem);
    let shape = crate::job::fit::PlanShape {
        world,
        // Ranks sharing this host's memory (with --one-rank, the other tasks on it too).
        local: layout.host_ranks,
        ranks_per_gpu: gpu_map.iter().map(|g| gpu_map.iter().filter(|h| *h == g).count()).max().unwrap_or(1),
        model: if gpu { trainer::zero::plan::DeviceModel::cuda() } else { trainer::zero::plan::DeviceModel::cpu() },
        gpu,
    };
    // Decided before the fingerprint: nodes that decide differently are told which key differs.
    for d in crate::job::fit::resolve_auto(&mut cfg, shape, capacity).map_err(SetupError)?.lines() {
        crate::out::say(&format!("launcher: {d}"));
    }
    if let Some(recipe) = cfg.train.fp8_recipe_summary() {
        crate::out::say(&format!("launcher: {recipe}"));
    }
    // Paths as written: nodes may start in different directories.
    let as_given = cfg.clone();

    let out_dir = absolute(&cfg.output.dir);
    cfg.output.dir = out_dir.clone();
    cfg.checkpoint.dir = cfg.checkpoint.dir.as_deref().map(absolute);
    cfg.train.gemm_tuning_from = cfg.train.gemm_tuning_from.as_deref().map(absolute);
    // A plan that cannot fit the GPU or the host stops here, before any rank allocates.
    if !args.skip_fit_check {
        let need = crate::job::fit::need(&cfg, world, shape.local, shape.model, gpu)
            .map_err(SetupError)?
            .sharing(shape.ranks_per_gpu);
        crate::job::fit::check(&need, capacity, &cfg)
            .map_err(|e| SetupError(format!("{e} (add --skip-fit-check to launch anyway)")))?;
    }
    // Node 0 owns the run directory: lock it, and see which run it holds.
    let (mut locks, survey) = if node_rank == 0 {
        let (locks, notes) = crate::rundir::owner::lock(&cfg)?;
        for note in notes {
            crate::out::say(&note);
        }
        (Some(locks), Some(crate::rundir::owner::Survey::of(&cfg, local_ranks)?))
    } else {
        (None, None)
    };
    let owner = survey.as_ref().and_then(|s| s.owner_id());
    // Before anything is written: a checkpoint that cannot be resumed leaves the run directory as it was.
    let resume = args.resume.map(|arg| crate::rundir::resume::resolve(arg, &cfg, world, owner)).transpose()?;
    let claim = match (&survey, locks.as_mut()) {
        (Some(survey), Some(locks)) => {
            Some(crate::rundir::owner::claim(&cfg, survey, resume.as_ref(), args.overwrite, locks, config_path)?)
        }
        _ => None,
    };
    for note in claim.iter().flat_map(|c| &c.notes) {
        crate::out::say(note);
    }

    let logs_dir = out_dir.join("logs");
    std::fs::create_dir_all(&logs_dir).map_err(|e| {
        SetupError(format!(
            "cannot create the run directory {} (output.dir): {e}; choose a writable output.dir, \
             e.g. --set output.dir=runs/mine",
            logs_dir.display()
        ))
    })?;
    let data_path = if cfg.data.sources.is_empty() {
        let p = resolve_data(cfg.data.path.as_deref(), &out_dir)?;
        cfg.data.path = Some(p.clone());
        p
    } else {
        resolve_sources(&mut cfg)?
    };
    let train_tokens = check_data(&cfg, &data_path, world)?;
    check_init(&cfg)?;
    prepare_checkpoint_dir(&cfg, node_rank == 0)?;
    let fingerprint = crate::job::fingerprint::of(
        &as_given,
        &crate::job::fingerprint::Launch {
            device: device.name(),
            ranks_per_node: local_ranks,
            nnodes,
            resume_step: resume.as_ref().map(|r| r.step),
            train_tokens,
        },
    );

    // Nodes may share a file system (and an output.dir): each reads its own resolved config.
    let resolved_config = out_dir.join(if node_rank == 0 {
        "config.resolved.toml".to_string()
    } else {
        format!("config.resolved.node{node_rank}.toml")
    });
    let text = toml::to_string(&cfg)
        .map_err(|e| SetupError(format!("cannot serialize the resolved config: {e} (a bug: please report it)")))?;
    write(&resolved_config, text.as_bytes())?;
    let metrics_path = out_dir.join("metrics.jsonl");
    if let Some(claim) = &claim {
        claim.commit(&out_dir)?;
    }
    if node_rank == 0 {
        crate::rundir::owner::start_file(&metrics_path, resume.as_ref().map(|r| r.step))
            .map_err(|e| SetupError(format!("{e:#}")))?;
    }
    let log_marker = match &claim {
        Some(c) => c.log_marker.clone(),
        None => resume.as_ref().map(crate::rundir::resume::Resume::log_marker),
    };
    Ok(RunPlan {
        cfg,
        device,
        local_ranks,
        first_rank: node_rank * local_ranks,
        world,
        node_rank,
        master_addr,
        master_name: layout.master.as_ref().filter(|_| nnodes > 1).map(|m| m.to_string()),
        one_rank: args.job.one_rank,
        host_ranks: layout.host_ranks,
        env_source: layout.env.map(|e| e.source),
        logs_dir,
        resolved_config,
        metrics_path,
        resume,
        nccl_id,
        token,
        fingerprint,
        gpu_map,
        profile: args.profile,
        run_id: claim.map(|c| c.identity.run_id),
        log_marker,
        locks: locks.map(std::sync::Arc::new),
        doctor: None,
    })
}

/// `launcher doctor`: the ranks of a job laid out as training would lay them out, started
/// to measure the network (`spec`); no config, data or checkpoint. Their logs and the small
/// config they read go to `out_dir` (node-local).
pub fn plan_doctor(args: &JobArgs, spec: crate::doctor::Spec, out_dir: &Path) -> Result<RunPlan, SetupError> {
    let Place { device, local_ranks, layout, token, nccl_id, gpu_map, master_addr } = place(args)?;
    let (nnodes, node_rank) = (layout.nnodes, layout.node_rank);
    let out_dir = absolute(out_dir);
    // The ranks read a config (the watchdog and flight-recorder settings); no model is built.
    let mut cfg = Config::from_toml_str(crate::doctor::CONFIG, "launcher doctor")?;
    let as_given = cfg.clone();
    cfg.output.dir = out_dir.clone();
    let logs_dir = out_dir.join("logs");
    std::fs::create_dir_all(&logs_dir).map_err(|e| {
        SetupError(format!("cannot create {} for the ranks' logs: {e}; give a writable --out DIR", logs_dir.display()))
    })?;
    let mut fingerprint = crate::job::fingerprint::of(
        &as_given,
        &crate::job::fingerprint::Launch {
            device: device.name(),
            ranks_per_node: local_ranks,
            nnodes,
            resume_step: None,
            train_tokens: 0,
        },
    );
    fingerprint.push(("doctor.sizes".into(), format!("{:?}", spec.sizes)));
    fingerprint.push(("doctor.link_bytes".into(), spec.link_bytes.to_string()));
    fingerprint.sort();
    let resolved_config = out_dir.join(format!("doctor.node{node_rank}.toml"));
    let text = toml::to_string(&cfg)
        .map_err(|e| SetupError(format!("cannot serialize the doctor's config: {e} (a bug: please report it)")))?;
    write(&resolved_config, text.as_bytes())?;
    let spec_path = out_dir.join(format!("doctor.node{node_rank}.json"));
    let text = serde_json::to_vec(&spec)
        .map_err(|e| SetupError(format!("cannot serialize the doctor's plan: {e} (a bug: please report it)")))?;
    write(&spec_path, &text)?;
    Ok(RunPlan {
        metrics_path: out_dir.join("metrics.jsonl"),
        cfg,
        device,
        local_ranks,
        first_rank: node_rank * local_ranks,
        world: nnodes * local_ranks,
        node_rank,
        master_addr,
        master_name: layout.master.as_ref().filter(|_| nnodes > 1).map(|m| m.to_string()),
        one_rank: args.one_rank,
        host_ranks: layout.host_ranks,
        env_source: layout.env.map(|e| e.source),
        logs_dir,
        resolved_config,
        resume: None,
        nccl_id,
        token,
        fingerprint,
        gpu_map,
        profile: false,
        run_id: None,
        log_marker: None,
        locks: None,
        doctor: Some(spec),
    })
}

/// The part of a launch that does not depend on the config: device, layout, token, GPUs,
/// rendezvous.
pub(crate) fn place(args: &JobArgs) -> Result<Place, SetupError> {
    let (device, local_ranks) = args.device().map_err(SetupError)?;
    if let Some(reason) = device.unavailable_reason() {
        return Err(SetupError(reason));
    }
    let layout = Layout::of(args, local_ranks)?;
    let (nnodes, node_rank) = (layout.nnodes, layout.node_rank);
    if device == Device::Cpu && !args.oversubscribe {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        check_cpu_ranks(layout.host_ranks, cores)?;
    }
    if node_rank >= nnodes {
        return Err(SetupError(format!(
            "--node-rank {node_rank} is out of range for --nnodes {nnodes}: use 0 to {}",
            nnodes - 1
        )));
    }
    let token = crate::job::token::resolve(
        args.job_token.as_deref(),
        std::env::var(crate::job::token::TOKEN_ENV).ok().filter(|t| !t.is_empty()),
        layout.env.as_ref().and_then(|e| e.token.clone()),
        node_rank,
    )?;
    let mut nccl_id = None;
    let mut gpu_map = Vec::new();
    if device == Device::Gpu {
        let spec = args.gpu_map.clone();
        gpu_map = match (&spec, args.one_rank) {
            // A rank per process: its index on the host picks the GPU.
            (None, true) => vec![crate::job::cluster::gpu_of_local_rank(
                layout.env.as_ref().map_or(0, |e| e.local_rank),
                std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
            )],
            _ => crate::job::device::gpu_map(local_ranks, spec.as_deref()).map_err(SetupError)?,
        };
        // Libraries and GPU count are checked before any rank starts: a clear error, never a panic.
        let needed = gpu_map.iter().max().map_or(0, |g| g + 1);
        let found = crate::job::gpu::preflight(needed).map_err(SetupError)?;
        crate::out::say(&format!("launcher: {found}"));
        if crate::job::device::shares_gpus(&gpu_map) {
            crate::out::say(&format!(
                "launcher: --gpu-map {} puts several ranks on one GPU; they talk through NCCL's network transport \
                 (slow: for tests only)",
                spec.unwrap_or_default()
            ));
        }
        if node_rank == 0 {
            nccl_id = Some(crate::job::gpu::nccl_id().map_err(SetupError)?);
        }
    }
    let master_addr = match (&layout.master, nnodes > 1) {
        (Some(hp), true) => Some(resolve_addr(hp)?),
        (None, true) => {
            return Err(SetupError(format!(
                "--nnodes {nnodes} needs --master-addr HOST:PORT: node 0's address that every node can reach"
            )))
        }
        (_, false) => None,
    };
    Ok(Place { device, local_ranks, layout, token, nccl_id, gpu_map, master_addr })
}

/// This launcher's place in the job: the flags, and for what they leave out the scheduler's
/// environment (`cluster.rs`).
struct Layout {
    nnodes: usize,
    node_rank: usize,
    master: Option<crate::job::cluster::HostPort>,
    host_ranks: usize,
    env: Option<crate::job::cluster::FromEnv>,
}

impl Layout {
    fn of(args: &JobArgs, local_ranks: usize) -> Result<Layout, SetupError> {
        let explicit =
            args.nnodes.is_some() && args.node_rank.is_some() && (args.nnodes == Some(1) || args.master_addr.is_some());
        // Flags that say everything leave the environment unread (it may describe another
        // launch, e.g. a shell inside a Slurm allocation); otherwise it fills in the rest.
        let env = if explicit {
            None
        } else {
            let req = crate::job::cluster::Request { one_rank: args.one_rank, ranks_per_launcher: local_ranks };
            let get = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
            crate::job::cluster::resolve(&get, req).map_err(|e| {
                SetupError(format!(
                    "{e}. (The launcher reads the layout of a job from the scheduler's environment; --nnodes, \
                     --node-rank and --master-addr given on the command line override it.)"
                ))
            })?
        };
        let nnodes = args.nnodes.map(|n| n as usize).or(env.as_ref().map(|e| e.nnodes)).unwrap_or(1);
        let node_rank = args.node_rank.map(|n| n as usize).or(env.as_ref().map(|e| e.node_rank)).unwrap_or(0);
        let master = args.master_addr.clone().or_else(|| env.as_ref().and_then(|e| e.master.clone()));
        let host_ranks = env.as_ref().map_or(local_ranks, |e| e.ranks_per_host).max(local_ranks);
        if let Some(e) = &env {
            let mut what = format!("{} of {}", node_rank, nnodes);
            if let Some(m) = master.as_ref().filter(|_| nnodes > 1) {
                let from = if args.master_addr.is_some() { "--master-addr" } else { e.master_from.as_str() };
                what += &format!(", rendezvous {m} ({from})");
            }
            let unit = if args.one_rank { "rank" } else { "node" };
            crate::out::say(&format!("launcher: from {}: {unit} {what}", e.source));
        }
        Ok(Layout { nnodes, node_rank, master, host_ranks, env })
    }
}

/// A rendezvous host and port as an address (IPv4 first: the listener and every node must
/// agree on one, and `localhost` may resolve to `::1` too).
fn resolve_addr(hp: &crate::job::cluster::HostPort) -> Result<SocketAddr, SetupError> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<SocketAddr> = (hp.host.as_str(), hp.port)
        .to_socket_addrs()
        .map_err(|e| {
            SetupError(format!(
                "the rendezvous host {} does not resolve ({e}): give node 0's address with --master-addr IP:PORT \
                 (or MASTER_ADDR), or fix the name",
                hp.host
            ))
        })?
        .collect();
    addrs.iter().find(|a| a.is_ipv4()).or(addrs.first()).copied().ok_or_else(|| {
        SetupError(format!("the rendezvous host {} resolves to no address: give --master-addr IP:PORT", hp.host))
    })
}

/// `train.gemm_tuning_from` names a table this build can read (its fit to each rank's GPU
/// and cuBLASLt is checked by the ranks, which know them).
fn check_gemm_tuning_from(cfg: &Config) -> Result<(), SetupError> {
    match (&cfg.train.gemm_tuning_from, cfg.train.gemm_tuning) {
        (Some(path), m) if m.times() => trainer::backend::GemmTuningTable::load(path)
            .map(|_| ())
            .map_err(|e| SetupError(format!("config key `train.gemm_tuning_from`: {e}"))),
        _ => Ok(()),
    }
}

/// At most [`RANKS_PER_CORE`] CPU ranks per core of this machine.
fn check_cpu_ranks(ranks: usize, cores: usize) -> Result<(), SetupError> {
    let most = RANKS_PER_CORE * cores.max(1);
    if ranks <= most {
        return Ok(());
    }
    Err(SetupError(format!(
        "--cpus {ranks} would start {ranks} rank processes on this machine's {cores} core(s), more than \
         {RANKS_PER_CORE} per core ({most}): each rank is a process computing on its own and every collective \
         waits for the slowest, so they would only take turns. Use --cpus {cores} (one rank per core) up to \
         --cpus {most}, or spread the ranks over several nodes (--nnodes); add --oversubscribe to start \
         them anyway"
    )))
}

/// `data.path` as given, or the built-in corpus generated under the run directory.
pub fn resolve_data(path: Option<&Path>, out_dir: &Path) -> Result<PathBuf, SetupError> {
    match path {
        None => {
            let dir = out_dir.join("builtin-data");
            data::ensure_builtin_dataset(&dir)
                .map_err(|e| SetupError(format!("cannot generate the built-in dataset in {}: {e}", dir.display())))
        }
        Some(p) if p.exists() || is_pattern(p) => Ok(absolute(p)),
        Some(p) => Err(SetupError(format!(
            "data.path = {} does not exist: make token shards with `launcher prepare-data INPUT... {}`, \
             fix the path, or remove data.path to train on the built-in corpus",
            p.display(),
            p.display()
        ))),
    }
}

/// `[[data.sources]]`: every path made absolute (ranks may run elsewhere), a missing one
/// named. Returns the directory relative source paths start from (the current one).
fn resolve_sources(cfg: &mut Config) -> Result<PathBuf, SetupError> {
    let base = absolute(Path::new("."));
    for s in &mut cfg.data.sources {
        if !(s.path.exists() || is_pattern(&s.path)) {
            return Err(SetupError(format!(
                "data source {:?}: path {} does not exist: make token shards with `launcher prepare-data INPUT... \
                 {}`, or fix the path of its [[data.sources]] entry",
                s.display_name(),
                s.path.display(),
                s.path.display()
            )));
        }
        let name = s.display_name();
        s.path = absolute(&s.path);
        // The default name is the path's last component: keep it what the user saw.
        s.name.get_or_insert(name);
    }
    Ok(base)
}

/// Open the data once here, so data problems stop the job before any rank starts, with
/// the trainer's own checks ([`trainer::sources::open_loader`], [`trainer::sources::open_val`]):
/// unreadable shards, token ids the model's vocabulary cannot hold (the largest id, from
/// the shards' headers when they record it), shards of another tokenizer than
/// `train.init_from`'s `tokenizer.json` or than another source's, `data.document_mask` on
/// shards whose end-of-text token is unknown or differs between sources
/// ([`trainer::documents::end_of_text`], per source and split), shards shorter than a
/// window, an epoch smaller than one global batch of `world` ranks, and, when evaluation
/// is on, a validation split too small to give each rank a batch. Returns the training
/// tokens over all sources.
fn check_data(cfg: &Config, path: &Path, world: usize) -> Result<usize, SetupError> {
    let what = if cfg.data.sources.is_empty() { "data.path" } else { "data.sources" };
    let (loader, _eot) =
        trainer::sources::open_loader(cfg, path, world).map_err(|e| SetupError(format!("{what}: {e}")))?;
    let tokens = (0..loader.source_names().len()).map(|i| loader.source_dataset(i).total_tokens()).sum();
    if cfg.train.eval_every > 0 {
        trainer::sources::open_val(cfg, path, world).map_err(|e| SetupError(e.to_string()))?;
    }
    Ok(tokens)
}

/// `train.init_from` must be Hugging Face weights (a model folder or a safetensors file)
/// holding every tensor of the model in a dtype import reads, or a verified shardtrain
/// checkpoint of the same tensors; Hugging Face shapes are checked by the ranks that load
/// them (they too stop the job with exit code 2).
fn check_init(cfg: &Config) -> Result<(), SetupError> {
    let Some(path) = &cfg.train.init_from else { return Ok(()) };
    if !path.exists() {
        return Err(SetupError(format!(
            "train.init_from = {} does not exist: give a Hugging Face model folder or its .safetensors file (e.g. \
             from `launcher export`), or a checkpoint directory, or remove train.init_from to start from random \
             weights",
            path.display()
        )));
    }
    let source = trainer::checkpoint::init::InitSource::open(path).map_err(|e| SetupError(e.to_string()))?;
    source.check(&trainer::model::ModelLayout::new(&cfg.model), path).map_err(|e| SetupError(e.to_string()))
}

/// When checkpoints will be written: the directory must exist or be creatable, and be
/// writable (found now, not at the first save hours in). Node 0 also removes the
/// `.step_*.partial` directories a crash mid-save left (they never became checkpoints:
/// a save renames its directory into place only once complete).
fn prepare_checkpoint_dir(cfg: &Config, remove_partials: bool) -> Result<(), SetupError> {
    let dir = cfg.checkpoint_dir();
    if cfg.checkpoint.every > 0 {
        let unusable = |e: std::io::Error| {
            SetupError(format!(
                "checkpoint.dir = {} is not writable ({e}): checkpoints could not be saved; choose a writable \
                 directory (--set checkpoint.dir='...') or set checkpoint.every = 0",
                dir.display()
            ))
        };
        std::fs::create_dir_all(&dir).map_err(unusable)?;
        let probe = dir.join(format!(".write-test-{}", std::process::id()));
        std::fs::write(&probe, b"").map_err(unusable)?;
        std::fs::remove_file(&probe).map_err(unusable)?;
    }
    if !remove_partials {
        return Ok(());
    }
    let Ok(entries) = std::fs::read_dir(&dir) else { return Ok(()) };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".step_") && name.ends_with(".partial") && e.path().is_dir() {
            std::fs::remove_dir_all(e.path()).map_err(|err| {
                SetupError(format!(
                    "cannot remove {}, left by a save that crashed: {err}; remove it yourself",
                    e.path().display()
                ))
            })?;
            crate::out::say(&format!(
                "launcher: removed {}, left by a checkpoint save that did not finish",
                e.path().display()
            ));
        }
    }
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
