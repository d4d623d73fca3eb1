//! `launcher plan CONFIG --nodes K --gpus-per-node G`: before renting a cluster, what each
//! ZeRO stage and activation-checkpointing choice would cost there: per-rank GPU memory (the
//! planner, [`trainer::zero::plan::predict`], plus the measured CUDA runtime), whether it fits,
//! and the step time from a compute and communication model, with the fastest choice that
//! fits named.
//!
//! The model: step time = compute + e × communication, where
//! - compute = tokens per GPU per step × (6·N + 12·L·T·C) FLOPs per token (N the weights
//!   that multiply: GPT-2's without the position table, an untied Llama's without the
//!   embedding; a checkpointed block adds its forward again) / (peak TFLOP/s × η);
//! - communication = the bytes a rank moves per step in NCCL's ring collectives (ZeRO-0:
//!   all-reduce of fp32 gradients; 1: reduce-scatter of fp32 gradients and all-gather of bf16
//!   parameters; 2: the reduce-scatter each micro-step; 3: two parameter all-gathers and one
//!   reduce-scatter each micro-step) / the bus bandwidth: NVLink within a node, and across
//!   nodes the network (one NIC per GPU, rings using every NIC of a node: at most G × NIC);
//! - η (the compute efficiency) and e (how much of the ring time shows in the step: NCCL's
//!   kernels share the GPU with the compute they overlap, and small collectives cost more
//!   than their bytes) are fitted at run time to the measured runs in [`CALIBRATION`]
//!   (BENCHMARKS.md run 18: 1 and 4 × H200, the current kernels; its one-GPU rows fix η, its
//!   4-GPU rows e), and the plan prints its error on each of them (3.6% mean). No
//!   multi-node run has been measured yet, so the network term is not calibrated, and the
//!   plan says so.
//!
//! CPU offload (`offload.*`) is not in the table (its step is bound by PCIe and the host's
//! AdamW, which this model does not describe): `launcher memory` predicts an offloaded run's
//! GPU and host bytes, and BENCHMARKS.md (run 8) measures its step.

use crate::commands::memory::MemoryDevice;
use crate::errors::SetupError;
use anyhow::Context;
use clap::Args;
use clap::ValueEnum;
use serde::Serialize;
use std::path::PathBuf;
use trainer::config::{ActivationCheckpointing, CheckpointingConfig, ModelConfig};
use trainer::model::ModelLayout;
use trainer::Config;

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
    #[arg(long, value_enum, default_value_t = crate::commands::plan::GpuKind::H100)]
    pub gpu: crate::commands::plan::GpuKind,
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

/// A GPU the defaults describe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuKind {
    /// H100 SXM 80 GB: 989 TFLOP/s bf16 dense, NVLink 4.
    H100,
    /// H200 SXM 141 GB: 989 TFLOP/s bf16 dense, NVLink 4.
    H200,
}

/// Hardware figures the model uses.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Hardware {
    pub gpu: &'static str,
    /// Dense bf16 peak per GPU.
    pub tflops: f64,
    /// Memory per GPU the driver reports as total, GiB.
    pub memory_gib: f64,
    /// NVLink bandwidth per GPU and direction, GB/s.
    pub intra_gbs: f64,
    /// Network bandwidth per GPU (one NIC each), Gb/s.
    pub inter_gbits: f64,
}

impl GpuKind {
    pub fn hardware(self) -> Hardware {
        match self {
            GpuKind::H100 => {
                Hardware { gpu: "H100", tflops: 989.0, memory_gib: 79.6, intra_gbs: 450.0, inter_gbits: 400.0 }
            }
            GpuKind::H200 => {
                Hardware { gpu: "H200", tflops: 989.0, memory_gib: 139.8, intra_gbs: 450.0, inter_gbits: 400.0 }
            }
        }
    }
}

/// One measured run the model is calibrated on.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    pub name: &'static str,
    pub model: (usize, usize, usize, usize, usize), // n_layer, n_head, n_embd, vocab_size, seq_len
    pub micro_batch: usize,
    pub stage: u8,
    pub checkpointed: bool,
    /// The build that ran it recomputed a checkpointed block's whole forward (runs before
    /// the recompute stopped at the MLP's GELU): its FLOPs count 12·C² per recomputed block.
    pub full_recompute: bool,
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub gpu: GpuKind,
    /// Measured tokens/s per GPU.
    pub tokens_per_s: f64,
}

/// A row of run 18's scaling tables: GPT-2 `model`, no activation checkpointing, on one node
/// of `gpus` H200s.
const fn scaling_row(
    name: &'static str,
    model: (usize, usize, usize, usize, usize),
    micro_batch: usize,
    stage: u8,
    gpus: usize,
    tokens_per_s: f64,
) -> Measured {
    Measured {
        name,
        model,
        micro_batch,
        stage,
        checkpointed: false,
        full_recompute: false,
        nodes: 1,
        gpus_per_node: gpus,
        gpu: GpuKind::H200,
        tokens_per_s,
    }
}

const GPT2_124M: (usize, usize, usize, usize, usize) = (12, 12, 768, 50304, 1024);
const GPT2_1_5B: (usize, usize, usize, usize, usize) = (48, 25, 1600, 50304, 1024);

/// BENCHMARKS.md, run 18 (calls 2 and 3): 1 and 4 × H200 with NVLink, one node, grad_accum 1,
/// the kernels of 2026-11-27 (the scaling tables' rows; runs before it measured older kernels).
pub const CALIBRATION: [Measured; 6] = [
    scaling_row("GPT-2 124M, ZeRO-1, 16×1024 per GPU, 1× H200", GPT2_124M, 16, 1, 1, 558_800.0),
    scaling_row("GPT-2 124M, ZeRO-1, 16×1024 per GPU, 4× H200", GPT2_124M, 16, 1, 4, 507_300.0),
    scaling_row("GPT-2 124M, ZeRO-3, 16×1024 per GPU, 1× H200", GPT2_124M, 16, 3, 1, 545_900.0),
    scaling_row("GPT-2 124M, ZeRO-3, 16×1024 per GPU, 4× H200", GPT2_124M, 16, 3, 4, 508_300.0),
    scaling_row("GPT-2 1.5B, ZeRO-3, 8×1024 per GPU, 1× H200", GPT2_1_5B, 8, 3, 1, 47_500.0),
    scaling_row("GPT-2 1.5B, ZeRO-3, 8×1024 per GPU, 4× H200", GPT2_1_5B, 8, 3, 4, 45_300.0),
];

/// What the time model needs about a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workload {
    pub n_layer: usize,
    pub n_embd: usize,
    pub seq_len: usize,
    /// Parameters (what the collectives move).
    pub params: usize,
    /// Forward+backward FLOPs per token without recomputation (the family's count, as for MFU).
    pub base_flops: f64,
    /// Tokens per GPU per step, micro-steps per step.
    pub tokens: usize,
    pub grad_accum: usize,
    pub stage: u8,
    /// Share of blocks whose forward is recomputed in backward.
    pub recompute: f64,
    /// Whether the recompute skips the attention (`checkpointing.keep_attention`).
    pub keep_attention: bool,
    /// Weights of a block its recompute multiplies (the family's; GPT-2: 8·C², its qkv, proj
    /// and fc; 12·C² for runs measured when the recompute also ran fc2).
    pub recompute_weights: f64,
    /// Bytes per parameter a ZeRO-3 parameter all-gather moves: 2 (bf16), less with FP8
    /// gathers ([`Workload::with_fp8_gathers`]).
    pub gather_bytes: f64,
}

impl Workload {
    pub fn new(
        m: &ModelConfig,
        micro_batch: usize,
        grad_accum: usize,
        stage: u8,
        ckpt: &CheckpointingConfig,
    ) -> Workload {
        let layout = ModelLayout::new(m);
        let params = layout.num_params();
        let recomputed = (0..m.n_layer).filter(|&l| ckpt.activations.is_checkpointed(l)).count();
        let recompute = recomputed as f64 / m.n_layer.max(1) as f64;
        Workload {
            n_layer: m.n_layer,
            n_embd: m.n_embd,
            seq_len: m.seq_len,
            params,
            base_flops: layout.flops_per_token(),
            tokens: micro_batch * grad_accum * m.seq_len,
            grad_accum,
            stage,
            recompute,
            keep_attention: ckpt.keep_attention,
            recompute_weights: m.family.recomputed_weights(m) as f64,
            gather_bytes: 2.0,
        }
    }

    /// The same with ZeRO-3's FP8 gathers where `cfg` has them (`train.precision = "fp8"`,
    /// `zero.fp8_gather`, several ranks, the optimizer on the GPU): the blocks' FP8 weights
    /// move at one byte, the other parameters at two.
    pub fn with_fp8_gathers(self, cfg: &Config, world: usize) -> Workload {
        let on = cfg.train.precision == trainer::backend::Precision::Fp8
            && cfg.zero.fp8_gather
            && !cfg.offload.optimizer
            && self.stage == 3
            && world > 1;
        if !on || self.params == 0 {
            return self;
        }
        let layout = ModelLayout::new(&cfg.model);
        let rows = cfg.train.micro_batch * cfg.model.seq_len;
        let bf16 = cfg.model.family.bf16_layers(&cfg.train.fp8_bf16_layers);
        let fp8: usize = cfg.model.family.fp8_weights(&layout, rows, bf16).iter().flatten().map(|l| l.len).sum();
        Workload { gather_bytes: 2.0 - fp8 as f64 / self.params as f64, ..self }
    }

    /// Training FLOPs per token, recomputation included.
    pub fn flops_per_token(&self) -> f64 {
        let (l, t, c) = (self.n_layer as f64, self.seq_len as f64, self.n_embd as f64);
        // A recomputed block runs its forward again up to the MLP's activation (backward
        // does not read the last projection's output): 2 FLOPs per weight it multiplies, and
        // 4·T·C attention unless the block kept it.
        let attention = if self.keep_attention { 0.0 } else { 4.0 * l * t * c };
        let block_forward = 2.0 * self.recompute_weights * l + attention;
        self.base_flops + self.recompute * block_forward
    }

    /// Bytes one rank sends per step in ring collectives, for `world` ranks.
    pub fn comm_bytes(&self, world: usize) -> f64 {
        if world <= 1 {
            return 0.0;
        }
        let f = (world - 1) as f64 / world as f64;
        let (p, g) = (self.params as f64, self.grad_accum as f64);
        let (grads, weights) = (4.0 * p, 2.0 * p); // fp32 gradients, bf16 parameters
        f * match self.stage {
            0 => 2.0 * grads,
            1 => grads + weights,
            2 => g * grads + weights,
            _ => g * (2.0 * self.gather_bytes * p + grads),
        }
    }
}

/// The cluster a plan is for.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Cluster {
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub hw: Hardware,
}

impl Cluster {
    pub fn world(&self) -> usize {
        self.nodes * self.gpus_per_node
    }

    /// Ring bus bandwidth per GPU, bytes/s: NVLink in one node; across nodes every NIC of a
    /// node carries one ring, so at most G NICs' worth, and never more than NVLink.
    pub fn bus_bytes_per_s(&self) -> f64 {
        let intra = self.hw.intra_gbs * 1e9;
        if self.nodes <= 1 {
            intra
        } else {
            intra.min(self.gpus_per_node as f64 * self.hw.inter_gbits / 8.0 * 1e9)
        }
    }
}

/// The model's two constants.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Fit {
    /// Achieved share of peak FLOP/s in compute (fitted).
    pub efficiency: f64,
    /// Step time added per second of ring communication (fitted).
    pub exposure: f64,
}

/// (compute, communication after exposure) seconds per step.
pub fn step_time(w: &Workload, c: &Cluster, fit: Fit) -> (f64, f64) {
    let compute = w.tokens as f64 * w.flops_per_token() / (c.hw.tflops * 1e12 * fit.efficiency);
    let comm = fit.exposure * w.comm_bytes(c.world()) / c.bus_bytes_per_s();
    (compute, comm)
}

fn measured_workload(m: &Measured) -> (Workload, Cluster) {
    let (n_layer, n_head, n_embd, vocab_size, seq_len) = m.model;
    let mc = ModelConfig::gpt2(n_layer, n_head, n_embd, vocab_size, seq_len);
    let activations = if m.checkpointed { ActivationCheckpointing::EveryLayer } else { ActivationCheckpointing::None };
    let mut w = Workload::new(
        &mc,
        m.micro_batch,
        1,
        m.stage,
        &CheckpointingConfig { activations, ..CheckpointingConfig::default() },
    );
    if m.full_recompute {
        w.recompute_weights = 12.0 * (m.model.2 * m.model.2) as f64;
    }
    (w, Cluster { nodes: m.nodes, gpus_per_node: m.gpus_per_node, hw: m.gpu.hardware() })
}

/// Predicted tokens/s per GPU of a calibration run.
fn predicted_tps(m: &Measured, fit: Fit) -> f64 {
    let (w, c) = measured_workload(m);
    let (a, b) = step_time(&w, &c, fit);
    w.tokens as f64 / (a + b)
}

/// η and e minimising the squared relative error of tokens/s over [`CALIBRATION`] (its one-GPU
/// rows fix η, its several-GPU rows e).
pub fn calibrate() -> Fit {
    let runs: Vec<(Workload, Cluster, f64)> = CALIBRATION
        .iter()
        .map(|m| {
            let (w, c) = measured_workload(m);
            (w, c, m.tokens_per_s)
        })
        .collect();
    let mut best = (f64::INFINITY, Fit { efficiency: 0.4, exposure: 1.0 });
    for (i, j) in (0..=1600).flat_map(|i| (0..=300).map(move |j| (i, j))) {
        let fit = Fit { efficiency: 0.2 + i as f64 * 0.00025, exposure: j as f64 * 0.01 };
        let err: f64 = runs
            .iter()
            .map(|(w, c, measured)| {
                let (a, b) = step_time(w, c, fit);
                (w.tokens as f64 / (a + b) / measured - 1.0).powi(2)
            })
            .sum();
        if err < best.0 {
            best = (err, fit);
        }
    }
    best.1
}

/// One choice of the plan.
#[derive(Debug, Clone, Serialize)]
pub struct Choice {
    pub stage: u8,
    pub activation_checkpointing: String,
    /// Whether blocks keep their GELU output: `checkpointing.keep_gelu` as given, or as
    /// `"auto"` decides for this choice against the GPU's memory.
    pub keep_gelu: bool,
    /// The decision's reason, where `"auto"` decided.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_gelu_reason: Option<String>,
    /// Ledger peak of the highest rank, bytes.
    pub tracked_peak_bytes: u64,
    /// Plus the CUDA runtime (context, NCCL, kernels, scratch) as measured: the driver's figure.
    pub device_peak_bytes: u64,
    pub fits: bool,
    pub compute_ms: f64,
    pub comm_ms: f64,
    pub step_ms: f64,
    pub tokens_per_s_per_gpu: f64,
}

#[derive(Debug, Serialize)]
struct CalibrationRow {
    run: &'static str,
    measured_tokens_per_s: f64,
    predicted_tokens_per_s: f64,
    relative_error: f64,
}

#[derive(Debug, Serialize)]
struct Plan {
    config: String,
    cluster: Cluster,
    world: usize,
    params: usize,
    tokens_per_gpu_per_step: usize,
    fit: Fit,
    choices: Vec<Choice>,
    fastest_that_fits: Option<usize>,
    calibration: Vec<CalibrationRow>,
    mean_absolute_error: f64,
    network_calibrated: bool,
    /// `train.precision = "fp8"`: memory as FP8 holds it, compute at the bf16 rate.
    fp8: bool,
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let cfg = Config::load(&args.config, &args.overrides).map_err(|e| SetupError(e.to_string()))?;
    let base = args.gpu.hardware();
    let hw = Hardware {
        gpu: base.gpu,
        tflops: args.tflops.unwrap_or(base.tflops),
        memory_gib: args.gpu_mem_gib.unwrap_or(base.memory_gib),
        intra_gbs: args.intra_gbs.unwrap_or(base.intra_gbs),
        inter_gbits: args.inter_gbits.unwrap_or(base.inter_gbits),
    };
    for (name, v) in [
        ("--tflops", hw.tflops),
        ("--gpu-mem-gib", hw.memory_gib),
        ("--intra-gbs", hw.intra_gbs),
        ("--inter-gbits", hw.inter_gbits),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(SetupError(format!("{name} {v}: give a positive number")).into());
        }
    }
    let cluster = Cluster { nodes: args.nodes as usize, gpus_per_node: args.gpus_per_node as usize, hw };
    let world = cluster.world();
    let fit = calibrate();
    let mut ckpts = vec![ActivationCheckpointing::None, ActivationCheckpointing::EveryLayer];
    if !ckpts.contains(&cfg.checkpointing.activations) {
        ckpts.push(cfg.checkpointing.activations);
    }
    let runtime = crate::job::fit::gpu_runtime_bytes(world);
    let capacity = (hw.memory_gib * (1u64 << 30) as f64) as u64;
    let mut choices = Vec::new();
    for stage in 0..=3u8 {
        for &ckpt in &ckpts {
            let mut c = cfg.clone();
            c.zero.stage = stage;
            c.checkpointing.activations = ckpt;
            // The "auto" settings as a launch on this hardware would decide them (the runtime
            // on top of the tracked peak, within the GPU's memory).
            let cap = crate::job::fit::Capacity { gpu: Some(capacity), host: None, host_source: "" };
            let shape = crate::job::fit::PlanShape {
                world,
                local: cluster.gpus_per_node,
                ranks_per_gpu: 1,
                model: MemoryDevice::Gpu.model(),
                gpu: true,
            };
            let decision = crate::job::fit::resolve_auto(&mut c, shape, cap)
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("deciding the \"auto\" settings at ZeRO stage {stage}"))?
                .keep_gelu;
            // Shards are padded to equal sizes: the first and last ranks bound every other.
            let tracked = [0, world - 1]
                .iter()
                .map(|&r| trainer::zero::plan::predict(&c, world, r, MemoryDevice::Gpu.model()).map(|m| m.peak_total))
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("predicting the memory of ZeRO stage {stage} on {world} ranks"))?
                .into_iter()
                .max()
                .unwrap_or(0);
            let w = Workload::new(&c.model, c.train.micro_batch, c.train.grad_accum, stage, &c.checkpointing)
                .with_fp8_gathers(&c, world);
            let (compute, comm) = step_time(&w, &cluster, fit);
            let step = compute + comm;
            choices.push(Choice {
                stage,
                activation_checkpointing: ckpt_name(ckpt),
                keep_gelu: c.checkpointing.keep_gelu.keeps(),
                keep_gelu_reason: decision.map(|d| d.reason),
                tracked_peak_bytes: tracked,
                device_peak_bytes: tracked + runtime,
                fits: tracked + runtime <= capacity,
                compute_ms: compute * 1e3,
                comm_ms: comm * 1e3,
                step_ms: step * 1e3,
                tokens_per_s_per_gpu: w.tokens as f64 / step,
            });
        }
    }
    // On a tie the lower stage (less communication to go wrong) is named.
    let fastest = (0..choices.len()).filter(|&i| choices[i].fits).fold(None, |best: Option<usize>, i| match best {
        Some(b) if choices[b].tokens_per_s_per_gpu >= choices[i].tokens_per_s_per_gpu => Some(b),
        _ => Some(i),
    });
    let calibration: Vec<CalibrationRow> = CALIBRATION
        .iter()
        .map(|m| {
            let p = predicted_tps(m, fit);
            CalibrationRow {
                run: m.name,
                measured_tokens_per_s: m.tokens_per_s,
                predicted_tokens_per_s: p,
                relative_error: p / m.tokens_per_s - 1.0,
            }
        })
        .collect();
    let mae = calibration.iter().map(|r| r.relative_error.abs()).sum::<f64>() / calibration.len() as f64;
    let w0 = Workload::new(&cfg.model, cfg.train.micro_batch, cfg.train.grad_accum, cfg.zero.stage, &cfg.checkpointing);
    let plan = Plan {
        config: args.config.display().to_string(),
        cluster,
        world,
        params: w0.params,
        tokens_per_gpu_per_step: w0.tokens,
        fit,
        choices,
        fastest_that_fits: fastest,
        calibration,
        mean_absolute_error: mae,
        network_calibrated: false,
        fp8: cfg.train.precision == trainer::backend::Precision::Fp8,
    };
    if args.json {
        crate::out::say(&serde_json::to_string_pretty(&plan).context("cannot encode the plan")?);
    } else {
        crate::out::say(&table(&plan));
    }
    Ok(())
}

fn ckpt_name(c: ActivationCheckpointing) -> String {
    match c {
        ActivationCheckpointing::None => "none".into(),
        ActivationCheckpointing::EveryLayer => "every_layer".into(),
        ActivationCheckpointing::Every(k) => format!("every {k}"),
    }
}

fn table(p: &Plan) -> String {
    let c = &p.cluster;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let k = |x: f64| if x >= 1e3 { format!("{:.1}k", x / 1e3) } else { format!("{x:.0}") };
    let mut s = format!(
        "plan: {} on {} node(s) × {} {} = {} ranks ({} TFLOP/s bf16, {:.1} GiB each; NVLink {} GB/s, network {} Gb/s per GPU)\n\
         model: {:.1} M parameters; {} tokens per GPU per step\n\n\
         {:>5}  {:<12} {:<9} {:>14} {:>5} {:>11} {:>9} {:>9} {:>13}\n",
        p.config,
        c.nodes,
        c.gpus_per_node,
        c.hw.gpu,
        p.world,
        c.hw.tflops,
        c.hw.memory_gib,
        c.hw.intra_gbs,
        c.hw.inter_gbits,
        p.params as f64 / 1e6,
        p.tokens_per_gpu_per_step,
        "stage",
        "act. ckpt",
        "GELU",
        "GiB per rank",
        "fits",
        "compute ms",
        "comm ms",
        "step ms",
        "tokens/s/GPU"
    );
    for (i, ch) in p.choices.iter().enumerate() {
        s += &format!(
            "{:>5}  {:<12} {:<9} {:>14.2} {:>5} {:>11.1} {:>9.1} {:>9.1} {:>13}{}\n",
            ch.stage,
            ch.activation_checkpointing,
            if ch.keep_gelu { "kept" } else { "recompute" },
            gib(ch.device_peak_bytes),
            if ch.fits { "yes" } else { "no" },
            ch.compute_ms,
            ch.comm_ms,
            ch.step_ms,
            k(ch.tokens_per_s_per_gpu),
            if Some(i) == p.fastest_that_fits { "  <- fastest that fits" } else { "" }
        );
    }
    match p.fastest_that_fits.map(|i| &p.choices[i]) {
        Some(ch) => {
            s += &format!(
                "\nfastest that fits: zero.stage = {}, checkpointing.activations = {}: {} tokens/s per GPU, {} for the job\n",
                ch.stage,
                ch.activation_checkpointing,
                k(ch.tokens_per_s_per_gpu),
                k(ch.tokens_per_s_per_gpu * p.world as f64)
            )
        }
        None => s += "\nno choice fits: more GPUs (zero.stage 3 shards everything), a smaller train.micro_batch, or a smaller model\n",
    }
    if p.choices.iter().any(|c| c.keep_gelu_reason.is_some()) {
        s +=
            "\nGELU: checkpointing.keep_gelu = \"auto\" decided per choice as a launch would: the GELU output is kept \
              where the peak with it fits the GPU (the numbers above are with the decision)\n";
    }
    s += &format!(
        "\nGiB per rank: the planner's tracked peak plus the CUDA runtime measured on H200 (context, NCCL, kernels, \
         scratch); step = compute at {:.1}% of peak + {:.0}% of the ring communication time (both fitted to the \
         measured runs below). Its error on those runs:\n",
        p.fit.efficiency * 100.0,
        p.fit.exposure * 100.0
    );
    for r in &p.calibration {
        s += &format!(
            "  {}: measured {}, predicted {} tokens/s per GPU ({:+.1}%)\n",
            r.run,
            k(r.measured_tokens_per_s),
            k(r.predicted_tokens_per_s),
            r.relative_error * 100.0
        );
    }
    s += &format!("  mean absolute error {:.1}%\n", p.mean_absolute_error * 100.0);
    if p.cluster.nodes > 1 {
        s += "the network term is not calibrated: no multi-node run has been measured yet (it assumes one NIC per GPU \
              and rings over every NIC of a node)\n";
    }
    if p.fp8 {
        s += "train.precision = \"fp8\": memory is FP8's (operand workspace, cached weights at stages 0-2, the FP8 \
              gathers' pieces at stage 3) and, with zero.fp8_gather, ZeRO-3's gathers move the blocks' linear \
              weights at one byte, but compute is modelled at the bf16 rate: the runs above are bf16, and an FP8 step \
              measured 1.02x (GPT-2 1.5B) to 1.28x (6.65B) a bf16 one on one H200 (BENCHMARKS.md run 17)\n";
    }
    s += "CPU offload (offload.*) is not in this table: `launcher memory CONFIG --ranks N --device gpu --set \
          offload.optimizer=true` predicts its GPU and host memory; its step time is measured in BENCHMARKS.md (run 8)\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2(n_layer: usize, n_embd: usize, n_head: usize) -> ModelConfig {
        ModelConfig::gpt2(n_layer, n_head, n_embd, 50304, 1024)
    }

    #[test]
    fn the_model_counts_flops_and_bytes_as_documented() {
        let m = gpt2(12, 768, 12);
        let w = Workload::new(&m, 16, 1, 1, &CheckpointingConfig::default());
        // 124M: 6·N + 12·L·T·C per token.
        let expect = 6.0 * (w.params - 1024 * 768) as f64 + 12.0 * 12.0 * 1024.0 * 768.0;
        assert_eq!(w.flops_per_token(), expect);
        let every = |keep_attention| CheckpointingConfig {
            activations: ActivationCheckpointing::EveryLayer,
            keep_attention,
            keep_gelu: trainer::config::KeepGelu::Recompute,
        };
        let ckpt = Workload::new(&m, 16, 1, 1, &every(false));
        let extra = ckpt.flops_per_token() / w.flops_per_token();
        assert!(extra > 1.15 && extra < 1.2, "recomputing every block's forward up to the GELU: {extra}");
        let kept = Workload::new(&m, 16, 1, 1, &every(true));
        let attention = 4.0 * 12.0 * 1024.0 * 768.0;
        assert_eq!(kept.flops_per_token(), ckpt.flops_per_token() - attention);
        // A run measured when the recompute also ran fc2 (as run 4's checkpointed one was).
        let old = Measured {
            checkpointed: true,
            full_recompute: true,
            ..scaling_row(
                "GPT-2 1.5B, ZeRO-3 + activation checkpointing, 2× H200 (run 4)",
                GPT2_1_5B,
                8,
                3,
                2,
                31_400.0,
            )
        };
        let (w_old, _) = measured_workload(&old);
        let (l, c) = (old.model.0 as f64, old.model.2 as f64);
        let now = Workload { recompute_weights: 8.0 * c * c, ..w_old };
        assert_eq!(w_old.flops_per_token() - now.flops_per_token(), 2.0 * 4.0 * l * c * c);
        assert_eq!(w.comm_bytes(1), 0.0);
        let p = w.params as f64;
        assert_eq!(w.comm_bytes(2), 0.5 * (4.0 * p + 2.0 * p));
        let s3 = Workload { stage: 3, grad_accum: 2, ..w };
        assert_eq!(s3.comm_bytes(4), 0.75 * 2.0 * (2.0 * 2.0 * p + 4.0 * p));
    }

    /// ZeRO-3's FP8 gathers move the blocks' linear weights (12·L·C² of GPT-2) at one byte;
    /// bf16, other stages, one rank and the host optimizer keep two.
    #[test]
    fn fp8_gathers_halve_the_weight_bytes_of_zero3() {
        let mut cfg = Config::from_toml_str(
            "[model]\nn_layer = 4\nn_head = 4\nn_embd = 256\nvocab_size = 50304\nseq_len = 1024\n",
            "test",
        )
        .expect("config");
        cfg.model = gpt2(4, 256, 4);
        cfg.train.micro_batch = 4;
        cfg.train.precision = trainer::backend::Precision::Fp8;
        cfg.zero.fp8_gather = true;
        let w = |cfg: &Config, stage: u8, world: usize| {
            Workload::new(&cfg.model, 4, 1, stage, &CheckpointingConfig::default()).with_fp8_gathers(cfg, world)
        };
        let on = w(&cfg, 3, 2);
        let fp8 = (12 * 4 * 256 * 256) as f64;
        assert_eq!(on.gather_bytes, 2.0 - fp8 / on.params as f64);
        let p = on.params as f64;
        assert_eq!(on.comm_bytes(2), 0.5 * (2.0 * (2.0 * p - fp8) + 4.0 * p));
        assert_eq!(w(&cfg, 2, 2).gather_bytes, 2.0);
        assert_eq!(w(&cfg, 3, 1).gather_bytes, 2.0);
        cfg.offload.optimizer = true;
        assert_eq!(w(&cfg, 3, 2).gather_bytes, 2.0);
        cfg.offload.optimizer = false;
        cfg.zero.fp8_gather = false;
        assert_eq!(w(&cfg, 3, 2).gather_bytes, 2.0);
        cfg.zero.fp8_gather = true;
        cfg.train.precision = trainer::backend::Precision::Bf16;
        assert_eq!(w(&cfg, 3, 2).gather_bytes, 2.0);
    }

    #[test]
    fn the_network_slows_multi_node_plans() {
        let hw = GpuKind::H100.hardware();
        let one = Cluster { nodes: 1, gpus_per_node: 8, hw };
        let two = Cluster { nodes: 2, gpus_per_node: 4, hw };
        let thin = Cluster { nodes: 8, gpus_per_node: 1, hw };
        assert_eq!(one.bus_bytes_per_s(), 450e9);
        assert_eq!(two.bus_bytes_per_s(), 200e9);
        assert_eq!(thin.bus_bytes_per_s(), 50e9);
        let w = Workload::new(&gpt2(48, 1600, 25), 8, 1, 3, &CheckpointingConfig::default());
        let fit = Fit { efficiency: 0.4, exposure: 1.0 };
        assert!(step_time(&w, &thin, fit).1 > 5.0 * step_time(&w, &one, fit).1);
    }

    #[test]
    fn the_fit_reproduces_the_measured_runs() {
        let fit = calibrate();
        // The one-GPU runs reached 47-49% MFU; a 4-GPU step showed well under its ring time.
        assert!(fit.efficiency > 0.4 && fit.efficiency < 0.55 && fit.exposure > 0.1 && fit.exposure < 1.5, "{fit:?}");
        let mut sum = 0.0;
        for m in &CALIBRATION {
            let err = predicted_tps(m, fit) / m.tokens_per_s - 1.0;
            assert!(err.abs() < 0.15, "{}: {err:+.3}", m.name);
            sum += err.abs();
        }
        assert!(sum / CALIBRATION.len() as f64 <= 0.05, "mean absolute error {}", sum / CALIBRATION.len() as f64);
    }
}
