//! `launcher memory CONFIG --ranks N`: the predicted memory of every rank, by category,
//! after one optimizer step and at the peak within it, for ZeRO stages 0–3 side by side.
//!
//! The numbers come from [`trainer::zero::plan::predict`]: one step of the real engine and
//! model on the meta backend (no data, no arithmetic), so they are exactly what the ledger of
//! a real run records (`memory` in `metrics.jsonl`) for the backend whose element sizes and
//! attention state the [`MemoryDevice`] describes.

use crate::job::fit::{gpu_runtime_parts, parse_gib};
use anyhow::Context;
use clap::Args;
use clap::ValueEnum;
use serde::Serialize;
use std::path::PathBuf;
use trainer::config::ActivationCheckpointing;
use trainer::model::ModelLayout;
use trainer::zero::plan::{predict, DeviceModel};
use trainer::zero::{MemoryBytes, MemoryReport};
use trainer::Config;

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
    #[arg(long, value_enum, default_value_t = crate::commands::memory::MemoryDevice::Cpu)]
    pub device: crate::commands::memory::MemoryDevice,
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

/// Whose memory accounting to predict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MemoryDevice {
    /// The CPU backend: every parameter, gradient, optimizer and activation element is an f32,
    /// and attention keeps its full softmax.
    Cpu,
    /// The CUDA backend: bf16 parameters and activations, fp32 gradients and optimizer state,
    /// flash attention (one fp32 log-sum-exp per row). Tracked buffers only: the CUDA context,
    /// NCCL, lazily loaded library kernels and backend scratch come on top; a run measures
    /// each of them per rank (metrics.jsonl `runtime`; about 1.7 GiB on 2 H200s).
    Gpu,
}

impl MemoryDevice {
    pub fn name(self) -> &'static str {
        match self {
            MemoryDevice::Cpu => "cpu",
            MemoryDevice::Gpu => "gpu",
        }
    }

    /// The element sizes and attention state the dry run models.
    pub fn model(self) -> DeviceModel {
        match self {
            MemoryDevice::Cpu => DeviceModel::cpu(),
            MemoryDevice::Gpu => DeviceModel::cuda(),
        }
    }

    /// What the numbers account for, said in the output.
    pub fn accounting(self) -> &'static str {
        match self {
            MemoryDevice::Cpu => {
                "the CPU backend's f32 accounting: parameters, gradients, AdamW master/m/v, activations and \
                 communication buffers are all 4-byte floats, and attention keeps its full B·heads·T·T softmax"
            }
            MemoryDevice::Gpu => {
                "the CUDA backend's accounting: bf16 parameters and activations, fp32 gradients, master weights and \
                 AdamW moments, flash attention, with train.precision = \"fp8\" the FP8 GEMM operands' workspace \
                 (in workspace), the cached FP8 weights (in params, train.fp8_weight_cache) and at ZeRO 3 the FP8 gathers' pieces (in params, zero.fp8_gather); on top come the CUDA context (~0.5 GiB), NCCL (~0.9 GiB on 2 H200s, ~1.2 GiB on 4) \
                 and its kernels loaded on first use (~0.2 GiB), and scratch with the cuBLASLt workspace (~45 MiB), \
                 which a run measures per rank (measured on H200, CUDA 13, NCCL 2.28)"
            }
        }
    }
}

/// One stage's prediction for every rank.
#[derive(Debug, Serialize)]
struct StagePrediction {
    stage: u8,
    /// `ranks[r]`: rank r's report (current = after one step; peak = at the highest total).
    ranks: Vec<MemoryReport>,
    /// `checkpointing.keep_gelu = "auto"` decided for this stage (as a launch would).
    #[serde(skip_serializing_if = "Option::is_none")]
    keep_gelu: Option<crate::job::fit::KeepGeluDecision>,
    /// `train.fp8_weight_cache = "auto"` decided for this stage (FP8 at stages 0-2).
    #[serde(skip_serializing_if = "Option::is_none")]
    fp8_weight_cache: Option<crate::job::fit::Fp8CacheDecision>,
}

#[derive(Debug, Serialize)]
struct Prediction {
    config: String,
    ranks: usize,
    /// The ranks predicted (each stage's `ranks[i]` is rank `predicted_ranks[i]`).
    predicted_ranks: Vec<usize>,
    device: &'static str,
    accounting: &'static str,
    /// The config's `zero.stage`.
    config_stage: u8,
    params: usize,
    stages: Vec<StagePrediction>,
}

/// The ranks whose memory is predicted: the first and the last. Every rank holds an equally
/// padded shard of every unit, so the last (whose shards may be all padding) is the only
/// one that can differ from the first (tests/memory.rs checks every rank of several worlds);
/// predicting each of 4096 ranks of a deep model would take minutes.
pub fn predicted_ranks(world: usize) -> Vec<usize> {
    if world <= 1 {
        vec![0]
    } else {
        vec![0, world - 1]
    }
}

pub fn run(args: &MemoryArgs) -> anyhow::Result<()> {
    let cfg = Config::load(&args.config, &args.overrides).map_err(|e| crate::errors::SetupError(e.to_string()))?;
    let world = args.ranks as usize;
    let device = args.device;
    let which = predicted_ranks(world);
    let gpu = device == MemoryDevice::Gpu;
    let cap = crate::job::fit::Capacity::of_this_machine(gpu, args.gpu_mem, args.host_mem);
    let shape = crate::job::fit::PlanShape {
        world,
        local: args.ranks_per_node.map_or(world, |n| n as usize).min(world),
        ranks_per_gpu: 1,
        model: device.model(),
        gpu,
    };
    let stages = (0..=3u8)
        // Stages the config cannot run on (offload.params needs stage 3) are left out.
        .filter(|&stage| {
            let mut c = cfg.clone();
            c.zero.stage = stage;
            c.validate().is_ok()
        })
        .map(|stage| {
            let mut c = cfg.clone();
            c.zero.stage = stage;
            let auto = crate::job::fit::resolve_auto(&mut c, shape, cap).map_err(anyhow::Error::msg)?;
            let ranks = which
                .iter()
                .map(|&rank| predict(&c, world, rank, device.model()))
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("predicting ZeRO stage {stage} on {world} ranks"))?;
            Ok(StagePrediction { stage, ranks, keep_gelu: auto.keep_gelu, fp8_weight_cache: auto.fp8_weight_cache })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let p = Prediction {
        config: args.config.display().to_string(),
        ranks: world,
        predicted_ranks: which,
        device: device.name(),
        accounting: device.accounting(),
        config_stage: cfg.zero.stage,
        params: ModelLayout::new(&cfg.model).num_params(),
        stages,
    };
    // The fit check is of the config's stage as a launch would run it.
    let mut resolved = cfg.clone();
    crate::job::fit::resolve_auto(&mut resolved, shape, cap).map_err(anyhow::Error::msg)?;
    let fit = fit_summary(args, &resolved, &cfg)?;
    if args.json {
        let mut v = serde_json::to_value(&p).context("cannot encode the prediction")?;
        v["fit"] = serde_json::to_value(&fit).context("cannot encode the fit check")?;
        println!("{}", serde_json::to_string_pretty(&v).context("cannot encode the prediction")?);
    } else {
        print!("{}", table(&p, &cfg));
        print!("{}", fit_text(&fit, &cfg));
    }
    Ok(())
}

/// The fit check at the config's stage (`launcher memory`'s last section).
#[derive(Debug, Serialize)]
struct FitSummary {
    ranks: usize,
    ranks_per_node: usize,
    /// Device bytes at the peak of a step (with the GPU runtime on GPUs), worst rank.
    device_peak: u64,
    /// Host bytes of one node's ranks, and one rank's by category.
    host_per_node: u64,
    host_per_rank: trainer::zero::HostMemory,
    gpu_capacity: Option<u64>,
    host_capacity: Option<u64>,
    /// `fits`, `does not fit`, or `unknown` (a capacity it needs is not known: `unknown_capacity`).
    verdict: &'static str,
    /// Why it does not fit.
    problem: Option<String>,
    /// The capacities not known, each with the flag that gives it.
    unknown_capacity: Vec<&'static str>,
    /// `--max-batch`: the largest micro-batch that fits (`Some(None)`: not even 1).
    max_batch: Option<Option<usize>>,
    gpu: bool,
}

/// Whether the config's stage fits this machine (or the `--gpu-mem` / `--host-mem` given),
/// and with `--max-batch` the largest micro-batch that does (`cfg` with its
/// `keep_gelu = "auto"` decided, `given` as written: each micro-batch tried decides anew).
fn fit_summary(args: &MemoryArgs, cfg: &Config, given: &Config) -> anyhow::Result<FitSummary> {
    let world = args.ranks as usize;
    let local = args.ranks_per_node.map_or(world, |n| n as usize).min(world);
    let gpu = args.device == MemoryDevice::Gpu;
    let cap = crate::job::fit::Capacity::of_this_machine(gpu, args.gpu_mem, args.host_mem);
    let model = args.device.model();
    let need = crate::job::fit::need(cfg, world, local, model, gpu).map_err(anyhow::Error::msg)?;
    let max_batch = if args.max_batch {
        let unknown = crate::job::fit::unknown(&need, cap);
        if !unknown.is_empty() {
            anyhow::bail!(
                "--max-batch compares with the machine's memory, and this is not known: {}",
                unknown.join("; ")
            );
        }
        Some(crate::job::fit::max_batch(given, world, local, model, gpu, cap, 4096).map_err(anyhow::Error::msg)?)
    } else {
        None
    };
    let problem = crate::job::fit::check(&need, cap, cfg).err();
    let unknown_capacity = crate::job::fit::unknown(&need, cap);
    let verdict = match (&problem, unknown_capacity.is_empty()) {
        (Some(_), _) => "does not fit",
        (None, true) => "fits",
        (None, false) => "unknown",
    };
    Ok(FitSummary {
        ranks: world,
        ranks_per_node: local,
        device_peak: need.device_peak,
        host_per_node: need.host_per_node,
        host_per_rank: need.report.host,
        gpu_capacity: cap.gpu,
        host_capacity: cap.host,
        verdict,
        problem,
        unknown_capacity,
        max_batch,
        gpu,
    })
}

fn fit_text(f: &FitSummary, cfg: &Config) -> String {
    let g = |b: u64| b as f64 / (1u64 << 30) as f64;
    let h = f.host_per_rank;
    let said = |c: Option<u64>| c.map_or("unknown".to_string(), |b| format!("{:.2} GiB", g(b)));
    let gpu_capacity = if f.gpu { said(f.gpu_capacity) } else { "none used (CPU ranks compute in host memory)".into() };
    let host_holds = if f.gpu {
        String::new()
    } else {
        format!(
            ", each rank's device peak and {} MiB for its process included",
            crate::job::fit::CPU_RANK_OVERHEAD >> 20
        )
    };
    let mut s = format!(
        "\nfit at zero.stage = {} ({} rank(s), {} per node): device peak {:.2} GiB per rank{}; host {:.2} GiB \
         per node{host_holds} (per rank: optimizer {:.2}, parameters {:.2}, page-locked staging {:.2}, checkpoint \
         copy {:.2}; page-locked in all {:.2})\n\
         \x20 capacity: GPU {}, host {}\n",
        cfg.zero.stage,
        f.ranks,
        f.ranks_per_node,
        g(f.device_peak),
        if f.gpu { " with the GPU runtime" } else { "" },
        g(f.host_per_node),
        g(h.optimizer),
        g(h.params),
        g(h.staging),
        g(h.checkpoint),
        g(h.pinned()),
        gpu_capacity,
        said(f.host_capacity)
    );
    s += &match (&f.problem, f.unknown_capacity.as_slice()) {
        (Some(e), _) => format!("  DOES NOT FIT: {e}\n"),
        (None, []) => "  fits\n".to_string(),
        (None, unknown) => format!("  cannot tell whether it fits: not known: {}\n", unknown.join("; ")),
    };
    match f.max_batch {
        Some(Some(b)) => s += &format!("  largest train.micro_batch that fits: {b}\n"),
        Some(None) => s += "  not even train.micro_batch = 1 fits\n",
        None => {}
    }
    s
}

fn mib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1024.0 * 1024.0))
}

/// The human-readable report: a header saying what is counted, then per rank (or once, when
/// every rank predicts the same) a table with one column per stage.
fn table(p: &Prediction, cfg: &Config) -> String {
    let (m, t) = (&cfg.model, &cfg.train);
    let mut s = format!(
        "predicted memory per rank: {} on {} rank(s)\n\
         model: {} layers, {} heads, n_embd {}, vocab {}, seq_len {} ({:.2} M parameters); \
         micro_batch {} x grad_accum {}, activation checkpointing {}\n\
         device: {} — {}\n\
         from one optimizer step of the real engine on the meta backend (no data, no arithmetic): what the ledger \
         of a real run records (metrics.jsonl `memory`). MiB = 2^20 bytes.\n",
        p.config,
        p.ranks,
        m.n_layer,
        m.n_head,
        m.n_embd,
        m.vocab_size,
        m.seq_len,
        p.params as f64 / 1e6,
        t.micro_batch,
        t.grad_accum,
        match cfg.checkpointing.activations {
            ActivationCheckpointing::None => "none".to_string(),
            ActivationCheckpointing::EveryLayer => "every layer".to_string(),
            ActivationCheckpointing::Every(k) => format!("every {k}th block"),
        },
        p.device,
        p.accounting
    );
    if let Some(st) = p.stages.iter().find(|st| st.stage == p.config_stage) {
        if let Some(d) = &st.keep_gelu {
            s += &format!("{d} at zero.stage = {}", st.stage);
            let others: Vec<String> = p
                .stages
                .iter()
                .filter(|o| o.stage != st.stage)
                .filter_map(|o| {
                    o.keep_gelu.as_ref().map(|d| format!("{} {}", o.stage, if d.keep { "keeps" } else { "recomputes" }))
                })
                .collect();
            if !others.is_empty() {
                s += &format!("; decided per stage as a launch would: stage {}", others.join(", "));
            }
            s += "\n";
        }
        if let Some(d) = &st.fp8_weight_cache {
            s += &format!("{d} at zero.stage = {}\n", st.stage);
        }
    }
    let same = p.stages.iter().all(|st| st.ranks.windows(2).all(|w| w[0] == w[1]));
    let shown: Vec<usize> = if same { vec![0] } else { (0..p.predicted_ranks.len()).collect() };
    for r in shown {
        s += "\n";
        if same {
            s += &format!(
                "every rank ({} of {}) predicts the same:\n",
                if p.ranks == 1 { "the only one" } else { "all" },
                p.ranks
            );
        } else if r == 0 {
            s += &format!("rank 0 (and every other rank but the last, {}):\n", p.ranks - 1);
        } else {
            s += &format!("rank {} (the last: its shards hold the padding):\n", p.predicted_ranks[r]);
        }
        let header: String = p
            .stages
            .iter()
            .map(|st| {
                let mark = if st.stage == p.config_stage { "*" } else { " " };
                format!("{:>12}", format!("stage {}{mark}", st.stage))
            })
            .collect();
        let reports: Vec<&MemoryReport> = p.stages.iter().map(|st| &st.ranks[r]).collect();
        for (title, pick) in [
            ("at the peak of a step", (|r: &MemoryReport| r.peak) as fn(&MemoryReport) -> MemoryBytes),
            ("after one step", |r: &MemoryReport| r.current),
        ] {
            s += &format!("  {title:<24}{header}\n");
            let rows: Vec<[(&str, u64); 7]> = reports.iter().map(|rep| MemoryBytes::categories(&pick(rep))).collect();
            for c in 0..7 {
                let name = rows[0][c].0;
                let cells: String = rows.iter().map(|row| format!("{:>12}", mib(row[c].1))).collect();
                s += &format!("    {name:<22}{cells}\n");
            }
            let totals: String = reports.iter().map(|rep| format!("{:>12}", mib(pick(rep).total()))).collect();
            s += &format!("    {:<22}{totals}\n", "total MiB");
        }
    }
    if p.device == MemoryDevice::Gpu.name() {
        let rt: u64 = gpu_runtime_parts(p.ranks).map(|(_, m)| m).sum();
        let parts: Vec<String> = gpu_runtime_parts(p.ranks).map(|(n, m)| format!("{n} {m}")).collect();
        let peak = p
            .stages
            .iter()
            .find(|st| st.stage == p.config_stage)
            .map_or(0, |st| st.ranks.iter().map(|r| r.peak_total).max().unwrap_or(0));
        s += &format!(
            "\non the GPU the driver also counts the runtime, measured per rank on 2x H200 (CUDA 13, NCCL 2.28; \
             NCCL's share depends on the topology): {} MiB = {rt} MiB, so the stage {} peak is about {:.2} GiB \
             as cuMemGetInfo sees it.\n",
            parts.join(" + "),
            p.config_stage,
            (peak as f64 / (1024.0 * 1024.0) + rt as f64) / 1024.0
        );
    }
    s += &format!(
        "\n* zero.stage = {} in the config. Stages: 0 data parallel, 1 shards the optimizer state, \
         2 + gradients, 3 + parameters.\n",
        p.config_stage
    );
    s
}
