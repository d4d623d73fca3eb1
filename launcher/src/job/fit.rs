//! Will the plan fit? The planner's prediction per rank (device bytes at the step's peak,
//! plus the measured GPU runtime; host bytes for offload) against what the machine has:
//! the GPU's memory (`cuDeviceTotalMem`, or `--gpu-mem`) and the host's (`MemAvailable`,
//! or `--host-mem`) shared by the node's ranks. CPU ranks compute in host memory, so their
//! whole prediction (and the process around it) counts against the host. A launch whose plan
//! cannot fit stops here, before any rank allocates, with the category that dominates and
//! the numbers; `launcher memory --max-batch` searches the largest micro-batch that fits.
//! Where a capacity is not known the answer is "cannot tell", never "fits".

use trainer::backend::Precision;
use trainer::config::{Fp8WeightCache, KeepGelu};
use trainer::zero::plan::{predict, DeviceModel};
use trainer::zero::{MemoryBytes, MemoryReport};
use trainer::Config;

const GIB: f64 = (1u64 << 30) as f64;

/// What a CPU rank's process holds besides the ledger's buffers (the binary, the GPT-2 BPE
/// tables, data pages, the allocator's slack): `configs/tiny.toml` on 2 ranks measured
/// 20 MiB of peak resident set (VmHWM) above the ledger's peak per rank; rounded up.
pub const CPU_RANK_OVERHEAD: u64 = 32 << 20;

/// What one node offers.
#[derive(Debug, Clone, Copy, Default)]
pub struct Capacity {
    /// Bytes of one GPU (`None`: not known, no GPU check).
    pub gpu: Option<u64>,
    /// Host bytes available to the node's ranks together (`None`: not known).
    pub host: Option<u64>,
    /// Where `host` comes from: `--host-mem`, `MemAvailable`, or the cgroup's limit.
    pub host_source: &'static str,
}

impl Capacity {
    /// This machine, except where the user states a figure (`--gpu-mem`, `--host-mem`, in GiB):
    /// the first GPU's size when `gpu` (without a context: cuDeviceTotalMem; no GPU check
    /// otherwise), and the host's `MemAvailable` (where memory is plugged in as it is used,
    /// MemAvailable at start says too little). A stated figure is not measured.
    pub fn of_this_machine(gpu: bool, gpu_gib: Option<f64>, host_gib: Option<f64>) -> Capacity {
        let bytes = |g: f64| (g * GIB) as u64;
        let gpu = if gpu { gpu_gib.map(bytes).or_else(crate::job::gpu::total_memory) } else { None };
        if let Some(g) = host_gib {
            return Capacity { gpu, host: Some(bytes(g)), host_source: "--host-mem" };
        }
        // Inside a container or an allocation the cgroup's limit binds before the host does.
        let cgroup = crate::job::cgroup::MemoryCgroup::of_self().and_then(|c| c.headroom());
        match (host_available(), cgroup) {
            (Some(h), Some(c)) if c < h => Capacity { gpu, host: Some(c), host_source: CGROUP_SOURCE },
            (None, Some(c)) => Capacity { gpu, host: Some(c), host_source: CGROUP_SOURCE },
            (h, _) => Capacity { gpu, host: h, host_source: "MemAvailable" },
        }
    }
}

/// How messages name a capacity read from the memory cgroup.
const CGROUP_SOURCE: &str = "the memory cgroup's limit less its usage";

/// The host's available memory from /proc/meminfo (Linux), in bytes.
fn host_available() -> Option<u64> {
    host_available_in(std::path::Path::new("/proc"))
}

/// `MemAvailable` of the `meminfo` under `proc_root`, in bytes.
pub fn host_available_in(proc_root: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(proc_root.join("meminfo")).ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The prediction for the worst rank of a plan, and what it needs of the machine.
#[derive(Debug, Clone)]
pub struct Need {
    /// The rank whose device peak is highest.
    pub rank: usize,
    pub report: MemoryReport,
    /// Device bytes at the peak, runtime included (GPU runs).
    pub device_peak: u64,
    /// Host bytes of all ranks on one node.
    pub host_per_node: u64,
    /// The most of this node's ranks that share one GPU (`--gpu-map`; 1 otherwise):
    /// their peaks add up on it.
    pub ranks_per_gpu: usize,
    /// CPU ranks: the device is the host, so `host_per_node` includes every rank's peak.
    pub cpu: bool,
    /// Ranks on one node.
    pub local: usize,
}

impl Need {
    /// The same need with `n` ranks on the busiest GPU.
    pub fn sharing(self, n: usize) -> Need {
        Need { ranks_per_gpu: n.max(1), ..self }
    }
}

/// Predict every distinct rank position (first, last) of `world` ranks, `local` per node;
/// `gpu`: GPU ranks (the measured runtime is added to the device), else CPU ranks (the
/// device is the host).
pub fn need(cfg: &Config, world: usize, local: usize, model: DeviceModel, gpu: bool) -> Result<Need, String> {
    let mut worst: Option<(usize, MemoryReport)> = None;
    for rank in [0, world - 1] {
        let r = predict(cfg, world, rank, model).map_err(|e| format!("predicting rank {rank}: {e}"))?;
        if worst.as_ref().is_none_or(|(_, w)| r.peak_total > w.peak_total) {
            worst = Some((rank, r));
        }
    }
    let (rank, report) = worst.expect("at least one rank");
    let runtime = if gpu { gpu_runtime_bytes(world) } else { 0 };
    let device_peak = report.peak_total + runtime;
    let per_rank = if gpu { report.host.total() } else { device_peak + report.host.total() + CPU_RANK_OVERHEAD };
    Ok(Need {
        rank,
        device_peak,
        // Saturating: a plan of many ranks of an absurd model must still compare as too big.
        host_per_node: per_rank.saturating_mul(local as u64),
        report,
        ranks_per_gpu: 1,
        cpu: !gpu,
        local,
    })
}

/// The capacities a plan needs that are not known (so its fit cannot be told), each with
/// how to give it.
pub fn unknown(need: &Need, cap: Capacity) -> Vec<&'static str> {
    let mut missing = Vec::new();
    if !need.cpu && cap.gpu.is_none() {
        missing.push("the GPU's memory (no GPU here: give it with --gpu-mem GIB)");
    }
    if cap.host.is_none() && (need.cpu || need.host_per_node > 0) {
        missing.push("the host's memory (no MemAvailable in /proc/meminfo: give it with --host-mem GIB)");
    }
    missing
}

/// `Err` naming what does not fit and what to change, if the need exceeds the capacity.
pub fn check(need: &Need, cap: Capacity, cfg: &Config) -> Result<(), String> {
    if let (false, Some(gpu)) = (need.cpu, cap.gpu) {
        let shared = need.ranks_per_gpu.max(1) as u64;
        if need.device_peak.saturating_mul(shared) > gpu {
            let (name, bytes) = biggest(&need.report.peak);
            let on_one = if shared > 1 {
                format!(
                    "; {shared} ranks share one GPU (--gpu-map), {:.2} GiB together",
                    (need.device_peak * shared) as f64 / GIB
                )
            } else {
                String::new()
            };
            return Err(format!(
                "the plan does not fit the GPU: rank {} needs {:.2} GiB at the peak of a step (largest part: {name} \
                 {:.2} GiB; runtime {:.2} GiB{on_one}) but the GPU has {:.2} GiB. Lower train.micro_batch, set \
                 checkpointing.activations = \"every_layer\", raise zero.stage, or offload the optimizer \
                 (offload.optimizer = true{}); `launcher memory CONFIG --ranks N --device gpu --max-batch` shows \
                 what fits",
                need.rank,
                need.device_peak as f64 / GIB,
                bytes as f64 / GIB,
                (need.device_peak - need.report.peak_total) as f64 / GIB,
                gpu as f64 / GIB,
                if cfg.zero.stage == 3 { ", offload.params = true" } else { "" }
            ));
        }
    }
    if let Some(host) = cap.host {
        if need.cpu && need.host_per_node > host {
            let (name, bytes) = biggest(&need.report.peak);
            return Err(format!(
                "the plan does not fit the host: {} CPU rank(s) need {:.2} GiB together (rank {} {:.2} GiB at the \
                 peak of a step, largest part: {name} {:.2} GiB, plus {} MiB for its process) but {:.2} GiB are \
                 available ({}), {:.2} GiB short. Use fewer ranks (--cpus), raise zero.stage (stage 3 shards the \
                 parameters too), lower train.micro_batch or set checkpointing.activations = \"every_layer\"; \
                 `launcher memory CONFIG --ranks N --max-batch` shows what fits. Where the host's memory grows as it \
                 is used (a VM whose memory is plugged in on demand), state what it holds with --host-mem GIB",
                need.local,
                need.host_per_node as f64 / GIB,
                need.rank,
                need.device_peak as f64 / GIB,
                bytes as f64 / GIB,
                CPU_RANK_OVERHEAD >> 20,
                host as f64 / GIB,
                cap.host_source,
                (need.host_per_node - host) as f64 / GIB
            ));
        }
        if need.host_per_node > host {
            let h = need.report.host;
            return Err(format!(
                "the plan does not fit the host: its ranks need {:.2} GiB of host memory (per rank: optimizer \
                 {:.2}, parameters {:.2}, page-locked staging {:.2}, checkpoint copy {:.2} GiB) but {:.2} GiB are \
                 available ({}), {:.2} GiB short. Use more ranks (the optimizer state is sharded over them), fewer \
                 ranks per node, keep the optimizer on the GPU (offload.optimizer = false) or write checkpoints \
                 synchronously (checkpoint.async = false). Where the host's memory grows as it is used (a VM whose \
                 memory is plugged in on demand starts with a small MemAvailable), state what it holds with \
                 --host-mem GIB",
                need.host_per_node as f64 / GIB,
                h.optimizer as f64 / GIB,
                h.params as f64 / GIB,
                h.staging as f64 / GIB,
                h.checkpoint as f64 / GIB,
                host as f64 / GIB,
                cap.host_source,
                (need.host_per_node - host) as f64 / GIB
            ));
        }
    }
    Ok(())
}

fn biggest(b: &MemoryBytes) -> (&'static str, u64) {
    b.categories().into_iter().max_by_key(|(_, v)| *v).unwrap_or(("params", 0))
}

/// What `checkpointing.keep_gelu = "auto"` became, and why (printed by the launch, `launcher
/// memory` and `launcher plan`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KeepGeluDecision {
    pub keep: bool,
    pub reason: String,
}

impl std::fmt::Display for KeepGeluDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.keep { "keep the GELU output" } else { "recompute the GELU output" };
        write!(f, "checkpointing.keep_gelu = \"auto\": {what} ({})", self.reason)
    }
}

/// What `train.fp8_weight_cache = "auto"` became, and why: the first `blocks` of the
/// model's `n_layer` blocks cached.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Fp8CacheDecision {
    pub blocks: usize,
    pub n_layer: usize,
    pub reason: String,
}

impl std::fmt::Display for Fp8CacheDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.blocks {
            0 => "cast each FP8 weight at each use".to_string(),
            k if k >= self.n_layer => "cache every block's FP8 weights".to_string(),
            k => format!("cache the FP8 weights of the first {k} of {} blocks", self.n_layer),
        };
        write!(f, "train.fp8_weight_cache = \"auto\": {what} ({})", self.reason)
    }
}

/// The planner's `"auto"` settings as decided for one plan (`None`: given, or, for the FP8
/// weight cache, nothing to decide: not FP8).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct AutoDecisions {
    pub keep_gelu: Option<KeepGeluDecision>,
    pub fp8_weight_cache: Option<Fp8CacheDecision>,
}

impl AutoDecisions {
    /// One line per decision, for the launch's and the tools' output.
    pub fn lines(&self) -> Vec<String> {
        let gelu = self.keep_gelu.iter().map(ToString::to_string);
        gelu.chain(self.fp8_weight_cache.iter().map(ToString::to_string)).collect()
    }
}

/// Decide every `"auto"` setting that spends memory for speed, for this plan, and write the
/// decisions into `cfg`: `checkpointing.keep_gelu` first, then `train.fp8_weight_cache` with
/// what is left. In that order because, where both apply, keeping the GELU output saved more
/// per GiB (BENCHMARKS.md run 17, GPT-2 1.5B on one H200: 4.3 ms a step for 4.7 GiB, the FP8
/// weight cache 1.6 ms for 2.8 GiB); each is kept only where the plan with it passes the
/// launch's own fit check.
pub fn resolve_auto(cfg: &mut Config, plan: PlanShape, cap: Capacity) -> Result<AutoDecisions, String> {
    let keep_gelu = resolve_keep_gelu(cfg, plan, cap)?;
    let fp8_weight_cache = resolve_fp8_weight_cache(cfg, plan, cap)?;
    Ok(AutoDecisions { keep_gelu, fp8_weight_cache })
}

/// Decide `checkpointing.keep_gelu = "auto"` for this plan and write the decision into
/// `cfg` (`None`: it was `true` or `false` already). Kept when the plan with it passes the
/// launch's own fit check with [`AUTO_HEADROOM`] left free (the step's predicted peak plus the
/// measured GPU runtime within the GPU's memory, `ranks_per_gpu` sharing one; CPU ranks:
/// within the host's); recomputed when
/// it does not, when no block could keep it, or when a capacity is not known ("cannot tell"
/// never counts as fitting). Keeping costs memory only, so a plan that fits without it still
/// fits after this. An undecided FP8 weight cache counts as off here (it is decided after).
fn resolve_keep_gelu(cfg: &mut Config, plan: PlanShape, cap: Capacity) -> Result<Option<KeepGeluDecision>, String> {
    if cfg.checkpointing.keep_gelu != KeepGelu::Auto {
        return Ok(None);
    }
    let decision = decide_keep_gelu(cfg, plan, cap)?;
    cfg.checkpointing.keep_gelu = decision.keep.into();
    Ok(Some(decision))
}

/// Where a plan runs: `world` ranks, `local` per node, `ranks_per_gpu` sharing the busiest
/// GPU, on GPUs (`gpu`) or CPUs, modelled by `model`.
#[derive(Debug, Clone, Copy)]
pub struct PlanShape {
    pub world: usize,
    pub local: usize,
    pub ranks_per_gpu: usize,
    pub model: DeviceModel,
    pub gpu: bool,
}

/// Whether a plan with an optional setting on passes the launch's fit check, with the
/// numbers or why it cannot be told.
enum FitWith {
    Fits(String),
    DoesNot(String),
    /// A capacity is not known: "cannot tell" never counts as fitting.
    CannotTell(String),
}

/// What an `"auto"` setting leaves free of the device (or, for CPU ranks, of the host): the
/// prediction has read up to 0.35 GiB below the driver's peak (BENCHMARKS.md run 18, NCCL at
/// 4 ranks), and an optional speed-up should not be what runs a plan out of memory.
pub const AUTO_HEADROOM: u64 = 1 << 29;

fn fits_with(with: &Config, p: PlanShape, cap: Capacity) -> Result<FitWith, String> {
    let n = need(with, p.world, p.local, p.model, p.gpu)?.sharing(p.ranks_per_gpu);
    let missing = unknown(&n, cap);
    if !missing.is_empty() {
        return Ok(FitWith::CannotTell(format!(
            "cannot tell whether it fits with it: not known: {}",
            missing.join("; ")
        )));
    }
    let (needed, has, what) = if p.gpu {
        (n.device_peak * p.ranks_per_gpu.max(1) as u64, cap.gpu.unwrap_or(0), "the GPU has")
    } else {
        (n.host_per_node, cap.host.unwrap_or(0), "the host has")
    };
    let numbers = format!(
        "{:.2} GiB at the peak with it, {what} {:.2} GiB, {:.1} GiB of it kept free",
        needed as f64 / GIB,
        has as f64 / GIB,
        AUTO_HEADROOM as f64 / GIB
    );
    let less = |b: Option<u64>| b.map(|b| b.saturating_sub(AUTO_HEADROOM));
    let room = Capacity { gpu: less(cap.gpu), host: less(cap.host), ..cap };
    Ok(if check(&n, room, with).is_ok() { FitWith::Fits(numbers) } else { FitWith::DoesNot(numbers) })
}

fn decide_keep_gelu(cfg: &Config, p: PlanShape, cap: Capacity) -> Result<KeepGeluDecision, String> {
    if cfg.every_block_checkpointed() {
        let reason = "every block is checkpointed: its recompute makes the GELU output anyway".into();
        return Ok(KeepGeluDecision { keep: false, reason });
    }
    let mut with = cfg.clone();
    with.checkpointing.keep_gelu = KeepGelu::Keep;
    if with.train.fp8_weight_cache == Fp8WeightCache::Auto {
        with.train.fp8_weight_cache = Fp8WeightCache::PerUse;
    }
    Ok(match fits_with(&with, p, cap)? {
        FitWith::Fits(numbers) => KeepGeluDecision { keep: true, reason: format!("it fits: {numbers}") },
        FitWith::CannotTell(why) => KeepGeluDecision { keep: false, reason: why },
        FitWith::DoesNot(numbers) => {
            KeepGeluDecision { keep: false, reason: format!("keeping it would not fit: {numbers}") }
        }
    })
}

/// Decide `train.fp8_weight_cache = "auto"` (FP8 only; `None` otherwise, the setting left as
/// it is) and write the decision into `cfg`: every block's weights cached where the plan with
/// them passes the launch's fit check, else the most blocks (the first ones) that do, else
/// none; none where a capacity is not known. At stage 3 too: the cache then holds whole
/// layers on every rank, in memory the plan has left.
fn resolve_fp8_weight_cache(cfg: &mut Config, p: PlanShape, cap: Capacity) -> Result<Option<Fp8CacheDecision>, String> {
    if cfg.train.fp8_weight_cache != Fp8WeightCache::Auto || cfg.train.precision != Precision::Fp8 {
        return Ok(None);
    }
    let n_layer = cfg.model.n_layer;
    let with = |blocks: usize| {
        let mut c = cfg.clone();
        c.train.fp8_weight_cache = Fp8WeightCache::of_blocks(blocks, n_layer);
        c
    };
    let decided = |blocks: usize, reason: String| Fp8CacheDecision { blocks, n_layer, reason };
    let decision = match fits_with(&with(n_layer), p, cap)? {
        FitWith::Fits(numbers) => decided(n_layer, format!("it fits: {numbers}")),
        FitWith::CannotTell(why) => decided(0, why),
        FitWith::DoesNot(every) => {
            // The most blocks that fit: fits(lo) (or lo = 0), not fits(hi).
            let (mut lo, mut hi, mut at_lo) = (0usize, n_layer, None);
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                match fits_with(&with(mid), p, cap)? {
                    FitWith::Fits(numbers) => (lo, at_lo) = (mid, Some(numbers)),
                    _ => hi = mid,
                }
            }
            match at_lo {
                Some(numbers) => decided(lo, format!("{numbers}; with every block's: {every}")),
                None => decided(0, format!("not even one block's fits; with every block's: {every}")),
            }
        }
    };
    cfg.train.fp8_weight_cache = Fp8WeightCache::of_blocks(decision.blocks, n_layer);
    Ok(Some(decision))
}

/// The largest `train.micro_batch` (up to `limit`) whose plan fits, or `None` if not even 1.
pub fn max_batch(
    cfg: &Config,
    world: usize,
    local: usize,
    model: DeviceModel,
    gpu: bool,
    cap: Capacity,
    limit: usize,
) -> Result<Option<usize>, String> {
    let shape = PlanShape { world, local, ranks_per_gpu: 1, model, gpu };
    let fits = |b: usize| -> Result<bool, String> {
        let mut c = cfg.clone();
        c.train.micro_batch = b;
        // The "auto" settings as a launch at this batch would decide them.
        resolve_auto(&mut c, shape, cap)?;
        Ok(check(&need(&c, world, local, model, gpu)?, cap, &c).is_ok())
    };
    if !fits(1)? {
        return Ok(None);
    }
    // Memory grows with the batch: double until it does not fit, then bisect.
    let (mut lo, mut hi) = (1usize, 2usize);
    while hi <= limit && fits(hi)? {
        lo = hi;
        hi *= 2;
    }
    let mut hi = hi.min(limit + 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}

/// What a GPU rank of a `world`-rank job holds beyond the ledger, in bytes.
pub fn gpu_runtime_bytes(world: usize) -> u64 {
    gpu_runtime_parts(world).map(|(_, m)| m << 20).sum()
}

/// The parts of [`gpu_runtime_bytes`] (name, MiB): a one-GPU job makes no NCCL
/// communicator and loads none of NCCL's kernels; NCCL holds more with more ranks.
pub fn gpu_runtime_parts(world: usize) -> impl Iterator<Item = (&'static str, u64)> {
    let four = world > 2;
    GPU_RUNTIME_MIB
        .iter()
        .filter(move |(_, _, _, nccl)| world > 1 || !nccl)
        .map(move |&(n, two, more, _)| (n, if four { more } else { two }))
}

/// What a GPU rank holds outside the ledger (name, MiB at up to 2 ranks, MiB at more,
/// whether only with NCCL), as measured on H200s: at 1 and 2 ranks BENCHMARKS.md runs 4 and
/// 6 (every rank of every run, 124M to 6.65B, reported these; the untracked rest was 0 MiB;
/// at one GPU nothing but the context and the scratch); at 4 ranks run 18 (the largest rank:
/// NCCL 1170–1218 MiB, lazily loaded kernels 216). No 8-rank run has been measured: it is
/// given the 4-rank figures.
const GPU_RUNTIME_MIB: [(&str, u64, u64, bool); 4] = [
    ("CUDA context", 533, 533, false),
    ("NCCL", 930, 1218, true),
    ("NCCL kernels loaded on first use", 186, 216, true),
    ("scratch", 45, 45, false),
];

/// A memory size in GiB: a positive, finite number.
pub fn parse_gib(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(g) if g.is_finite() && g > 0.0 => Ok(g),
        _ => Err(format!("{s:?} is not a size in GiB: give a positive number, e.g. 480 or 139.8")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nvocab_size = 512\nseq_len = 64\n";

    #[test]
    fn a_plan_over_capacity_is_refused_naming_the_numbers() {
        let cfg = Config::from_toml_str(TINY, "t").expect("cfg");
        let n = need(&cfg, 1, 1, DeviceModel::cuda(), true).expect("need");
        check(&n, Capacity { gpu: Some(n.device_peak), host: None, host_source: "" }, &cfg).expect("exactly fits");
        let e = check(&n, Capacity { gpu: Some(n.device_peak - 1), host: None, host_source: "" }, &cfg).unwrap_err();
        assert!(e.contains("does not fit the GPU") && e.contains("micro_batch"), "{e}");
        // Two ranks mapped onto one GPU (--gpu-map 0,0) add up there.
        let two = n.clone().sharing(2);
        check(&two, Capacity { gpu: Some(2 * n.device_peak), host: None, host_source: "" }, &cfg)
            .expect("two fit twice the GPU");
        let e =
            check(&two, Capacity { gpu: Some(2 * n.device_peak - 1), host: None, host_source: "" }, &cfg).unwrap_err();
        assert!(e.contains("2 ranks share one GPU") && e.contains("--gpu-map"), "{e}");
        let mut off = cfg.clone();
        off.offload.optimizer = true;
        let n = need(&off, 1, 4, DeviceModel::cuda(), true).expect("need");
        assert!(n.host_per_node >= 4 * n.report.host.optimizer && n.report.host.optimizer > 0);
        let e = check(&n, Capacity { gpu: None, host: Some(n.host_per_node - 1), host_source: "--host-mem" }, &off)
            .unwrap_err();
        assert!(e.contains("does not fit the host") && e.contains("optimizer") && e.contains("--host-mem"), "{e}");
    }

    #[test]
    fn cpu_plans_are_checked_against_the_host() {
        let cfg = Config::from_toml_str(TINY, "t").expect("cfg");
        let n = need(&cfg, 4, 4, DeviceModel::cpu(), false).expect("need");
        assert!(n.cpu && n.host_per_node == 4 * (n.device_peak + CPU_RANK_OVERHEAD), "{n:?}");
        let cap = |host: u64| Capacity { gpu: None, host: Some(host), host_source: "MemAvailable" };
        check(&n, cap(n.host_per_node), &cfg).expect("exactly fits");
        let e = check(&n, cap(n.host_per_node / 2), &cfg).unwrap_err();
        let short = format!("{:.2} GiB short", (n.host_per_node - n.host_per_node / 2) as f64 / GIB);
        for needle in ["does not fit the host", "4 CPU rank(s)", "MemAvailable", &short, "--cpus", "zero.stage"] {
            assert!(e.contains(needle), "`{needle}` missing: {e}");
        }
        // No capacity known: not "fits" but unknown, naming the flag that gives it.
        let none = Capacity::default();
        assert!(check(&n, none, &cfg).is_ok());
        assert_eq!(unknown(&n, none).len(), 1);
        assert!(unknown(&n, none)[0].contains("--host-mem"));
        assert!(unknown(&n, cap(1)).is_empty());
        let g = need(&cfg, 4, 4, DeviceModel::cuda(), true).expect("need");
        assert!(unknown(&g, cap(1 << 40))[0].contains("--gpu-mem"), "a GPU plan without a GPU size is unknown");
    }

    #[test]
    fn a_stated_host_size_replaces_mem_available() {
        let stated = Capacity::of_this_machine(false, None, Some(480.0));
        assert_eq!(stated.host, Some(480 << 30));
        assert_eq!(stated.gpu, None);
        let here = Capacity::of_this_machine(false, None, None);
        assert!(here.host <= host_available(), "the cgroup's limit can only lower it");
        assert_eq!(here.host.is_some(), host_available().is_some() || here.host_source == CGROUP_SOURCE);
        let gpu = Capacity::of_this_machine(true, Some(139.5), Some(1.0));
        assert_eq!((gpu.gpu, gpu.host), (Some(149_786_984_448), Some(1 << 30)));
        assert_eq!(Capacity::of_this_machine(false, Some(139.5), None).gpu, None, "no GPU check for CPU plans");
    }

    #[test]
    fn fp8_weight_cache_auto_caches_the_most_blocks_that_fit_after_keep_gelu() {
        let mut cfg = Config::from_toml_str(TINY, "t").expect("cfg");
        assert_eq!(cfg.train.fp8_weight_cache, Fp8WeightCache::Auto, "the default");
        cfg.train.precision = Precision::Fp8;
        // Eight blocks: in FP8, keeping the GELU output (as fc2's codes: 4C bytes a row a
        // block) frees ln2's output (2C) and the model's GELU scratch (8C, once), so it costs
        // memory only from five blocks on.
        cfg.model.n_layer = 8;
        let shape = PlanShape { world: 1, local: 1, ranks_per_gpu: 1, model: DeviceModel::cuda(), gpu: true };
        // The peak with the GELU output kept or not and the first `blocks` blocks cached.
        let peak = |c: &Config, keep: bool, blocks: usize| {
            let mut c = c.clone();
            c.checkpointing.keep_gelu = keep.into();
            c.train.fp8_weight_cache = Fp8WeightCache::of_blocks(blocks, c.model.n_layer);
            need(&c, 1, 1, DeviceModel::cuda(), true).expect("need").device_peak
        };
        let gpu = |bytes: u64| Capacity { gpu: Some(bytes), host: None, host_source: "" };
        for stage in [1, 3] {
            cfg.zero.stage = stage;
            // Each plan's peak with the headroom "auto" leaves free.
            let p = |keep, blocks| peak(&cfg, keep, blocks) + AUTO_HEADROOM;
            assert!(p(true, 2) > p(true, 1) && p(true, 1) > p(true, 0) && p(true, 0) > p(false, 0), "stage {stage}");
            // Room for everything; for the GELU output and one block; for the GELU output only
            // (decided first, it wins where only one fits); for neither; and, where the whole
            // cache alone is the smaller, for the cache only.
            let mut cases = vec![
                (p(true, 2), true, 2),
                (p(true, 1), true, 1),
                (p(true, 2) - 1, true, 1),
                (p(true, 0), true, 0),
                (p(false, 0), false, 0),
            ];
            if p(false, 2) < p(true, 0) {
                cases.push((p(false, 2), false, 2));
            }
            for (cap, keep, blocks) in cases {
                let mut c = cfg.clone();
                let d = resolve_auto(&mut c, shape, gpu(cap)).expect("decide");
                let (g, f) = (d.keep_gelu.clone().expect("auto"), d.fp8_weight_cache.clone().expect("auto"));
                assert_eq!((g.keep, f.blocks), (keep, blocks), "stage {stage}, capacity {cap}: {:?}", d.lines());
                assert_eq!(c.train.fp8_weight_cache, Fp8WeightCache::of_blocks(blocks, 8), "written into the config");
                assert!(d.lines()[1].contains("fp8_weight_cache = \"auto\""), "{:?}", d.lines());
                // The decided config is what the launch's fit check then sees: it fits.
                let n = need(&c, 1, 1, DeviceModel::cuda(), true).expect("need");
                check(&n, gpu(cap), &c).expect("the decided plan fits");
            }
        }
        // Nothing to decide in bf16, nor where it is given; not known: nothing cached.
        cfg.zero.stage = 1;
        for (precision, given) in [
            (Precision::Bf16, Fp8WeightCache::Auto),
            (Precision::Fp8, Fp8WeightCache::Cache),
            (Precision::Fp8, Fp8WeightCache::PerUse),
            (Precision::Fp8, Fp8WeightCache::Blocks(1)),
        ] {
            let mut c = cfg.clone();
            (c.train.precision, c.train.fp8_weight_cache) = (precision, given);
            assert_eq!(resolve_auto(&mut c, shape, gpu(1)).expect("decide").fp8_weight_cache, None);
            assert_eq!(c.train.fp8_weight_cache, given, "left as it was");
        }
        let mut c = cfg.clone();
        let d = resolve_auto(&mut c, shape, Capacity::default()).expect("decide").fp8_weight_cache.expect("auto");
        assert!(d.blocks == 0 && d.reason.contains("--gpu-mem"), "{d}");
    }

    #[test]
    fn keep_gelu_auto_keeps_exactly_where_the_plan_with_it_fits() {
        let cfg = Config::from_toml_str(TINY, "t").expect("cfg");
        assert_eq!(cfg.checkpointing.keep_gelu, KeepGelu::Auto, "the default");
        let shape = PlanShape { world: 2, local: 2, ranks_per_gpu: 1, model: DeviceModel::cuda(), gpu: true };
        let peak = |k: KeepGelu| {
            let mut c = cfg.clone();
            c.checkpointing.keep_gelu = k;
            need(&c, 2, 2, DeviceModel::cuda(), true).expect("need").device_peak
        };
        let (with, without) = (peak(KeepGelu::Keep), peak(KeepGelu::Recompute));
        assert!(with > without, "keeping costs memory: {with} vs {without}");
        let gpu = |bytes: u64| Capacity { gpu: Some(bytes), host: None, host_source: "" };
        let h = AUTO_HEADROOM;
        for (cap, keep) in [(with + h, true), (with + h - 1, false), (with, false), (without + h, false)] {
            let mut c = cfg.clone();
            let d = resolve_keep_gelu(&mut c, shape, gpu(cap)).expect("decide").expect("auto");
            assert_eq!(d.keep, keep, "capacity {cap}: {d}");
            assert_eq!(c.checkpointing.keep_gelu, KeepGelu::from(keep), "written into the config");
            assert!(d.to_string().contains("keep_gelu = \"auto\""), "{d}");
            // The decided config is what the launch's fit check then sees: it fits where kept.
            let n = need(&c, 2, 2, DeviceModel::cuda(), true).expect("need");
            if keep {
                check(&n, gpu(cap), &c).expect("a kept GELU output still fits");
            }
        }
        // Two ranks on the busiest GPU need twice the room.
        let mut c = cfg.clone();
        let shared = PlanShape { ranks_per_gpu: 2, ..shape };
        assert!(!resolve_keep_gelu(&mut c, shared, gpu(with + h)).expect("decide").expect("auto").keep);
        // Not known: never kept; true and false are left as given.
        let mut c = cfg.clone();
        let d = resolve_keep_gelu(&mut c, shape, Capacity::default()).expect("decide").expect("auto");
        assert!(!d.keep && d.reason.contains("--gpu-mem"), "{d}");
        for given in [KeepGelu::Keep, KeepGelu::Recompute] {
            let mut c = cfg.clone();
            c.checkpointing.keep_gelu = given;
            assert_eq!(resolve_keep_gelu(&mut c, shape, gpu(1)).expect("decide"), None);
            assert_eq!(c.checkpointing.keep_gelu, given);
        }
        // Every block checkpointed: nothing to keep, whatever the room.
        let mut c = cfg.clone();
        c.checkpointing.activations = trainer::config::ActivationCheckpointing::EveryLayer;
        let d = resolve_keep_gelu(&mut c, shape, gpu(u64::MAX)).expect("decide").expect("auto");
        assert!(!d.keep && d.reason.contains("every block is checkpointed"), "{d}");
        // CPU ranks: against the host.
        let cpu = PlanShape { model: DeviceModel::cpu(), gpu: false, ..shape };
        let host = need(
            &{
                let mut k = cfg.clone();
                k.checkpointing.keep_gelu = KeepGelu::Keep;
                k
            },
            2,
            2,
            DeviceModel::cpu(),
            false,
        )
        .expect("need")
        .host_per_node;
        let h = |b: u64| Capacity { gpu: None, host: Some(b), host_source: "MemAvailable" };
        let host = host + AUTO_HEADROOM;
        assert!(resolve_keep_gelu(&mut cfg.clone(), cpu, h(host)).expect("d").expect("a").keep);
        let d = resolve_keep_gelu(&mut cfg.clone(), cpu, h(host - 1)).expect("d").expect("a");
        assert!(!d.keep && d.reason.contains("the host has"), "{d}");
    }

    #[test]
    fn max_batch_is_the_largest_that_fits() {
        let cfg = Config::from_toml_str(TINY, "t").expect("cfg");
        let at = |b: usize| {
            let mut c = cfg.clone();
            c.train.micro_batch = b;
            need(&c, 2, 2, DeviceModel::cuda(), true).expect("need").device_peak
        };
        let cap = Capacity { gpu: Some(at(37)), host: None, host_source: "" };
        assert_eq!(max_batch(&cfg, 2, 2, DeviceModel::cuda(), true, cap, 1024).expect("search"), Some(37));
        let none = Capacity { gpu: Some(at(1) - 1), host: None, host_source: "" };
        assert_eq!(max_batch(&cfg, 2, 2, DeviceModel::cuda(), true, none, 1024).expect("search"), None);
    }
}
