//! Training configuration: the TOML schema, `--set section.key=value` overrides, and validation.
//!
//! Every field a user can set lives here. Unknown keys and wrong types are rejected
//! by serde (`deny_unknown_fields`); impossible values are rejected by [`Config::validate`]
//! with an error that names the key and says how to fix it.

use crate::backend::{Fp8GradFormat, Fp8WeightGrad, GemmTuning, Precision, RopeScaling};
use crate::model::ModelFamily;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// A configuration problem, always naming the file/key and the fix.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("bad --set `{arg}`: {message}")]
    Override { arg: String, message: String },
    #[error("config key `{key}` = {value}: {message}")]
    Invalid { key: &'static str, value: String, message: String },
}

/// The whole configuration file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    #[serde(default)]
    pub train: TrainConfig,
    #[serde(default)]
    pub zero: ZeroConfig,
    #[serde(default)]
    pub checkpointing: CheckpointingConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub init: InitConfig,
    #[serde(default)]
    pub offload: OffloadConfig,
    #[serde(default)]
    pub data: DataConfig,
    #[serde(default)]
    pub output: OutputConfig,
    #[serde(default)]
    pub watchdog: WatchdogConfig,
}

/// The model: its family and shape. The keys after `seq_len` belong to the Llama family
/// (their names are transformers' `LlamaConfig`'s); each family refuses the keys it has no
/// use for ([`ModelFamily::validate`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model family (`"gpt2"`, `"llama"`); an unknown name is an error listing the known ones.
    #[serde(default)]
    pub family: ModelFamily,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Rows of the token embedding / LM head. May exceed the tokenizer's 50257
    /// (e.g. 50304) for faster matmuls; extra rows are never targets.
    pub vocab_size: usize,
    /// Context length T (GPT-2: also the number of learned positions).
    pub seq_len: usize,
    /// Key/value heads (grouped-query attention); divides `n_head`. Unset: `n_head`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_head: Option<usize>,
    /// The MLP's hidden width (SwiGLU: gate and up projections of this width).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intermediate_size: Option<usize>,
    /// RoPE base. Unset: 10000 (transformers' default; Llama 3 uses 500000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Llama 3.1's RoPE frequency scaling; unset: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm epsilon. Unset: 1e-6 (transformers' default; Llama 3 uses 1e-5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rms_norm_eps: Option<f64>,
    /// The LM head shares the token embedding. Unset: false (Llama 3.2 1B/3B set it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_embeddings: Option<bool>,
}

impl ModelConfig {
    /// A GPT-2 of this shape.
    pub fn gpt2(n_layer: usize, n_head: usize, n_embd: usize, vocab_size: usize, seq_len: usize) -> ModelConfig {
        ModelConfig {
            family: ModelFamily::Gpt2,
            n_layer,
            n_head,
            n_embd,
            vocab_size,
            seq_len,
            n_kv_head: None,
            intermediate_size: None,
            rope_theta: None,
            rope_scaling: None,
            rms_norm_eps: None,
            tie_embeddings: None,
        }
    }
    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_head.unwrap_or(self.n_head)
    }
    /// Head size.
    pub fn head_size(&self) -> usize {
        self.n_embd / self.n_head
    }
    /// Whether the LM head is the token embedding (GPT-2 always).
    pub fn tied(&self) -> bool {
        match self.family {
            ModelFamily::Gpt2 => true,
            _ => self.tie_embeddings.unwrap_or(false),
        }
    }
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta.unwrap_or(10000.0)
    }
    pub fn rms_norm_eps(&self) -> f64 {
        self.rms_norm_eps.unwrap_or(1e-6)
    }
}

/// Optimisation hyper-parameters.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Sequences per rank per micro-step.
    pub micro_batch: usize,
    /// Micro-steps per optimizer step. Global batch = micro_batch * grad_accum * world.
    pub grad_accum: usize,
    /// Optimizer steps to run.
    pub steps: usize,
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_steps: usize,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Global gradient-norm clip; 0 disables clipping.
    pub grad_clip: f32,
    pub seed: u64,
    /// Evaluate validation loss every this many steps (0 = never).
    pub eval_every: usize,
    /// Micro-batches per evaluation.
    pub eval_batches: usize,
    /// GPU ranks: record a micro-step's forward and backward (with its collectives) as a
    /// CUDA graph from the second optimizer step on and replay it (one launch instead of
    /// hundreds). Applies with the optimizer on the GPU; offload runs eagerly.
    pub cuda_graphs: bool,
    /// GPU ranks: how each GEMM shape's cuBLASLt algorithm is picked. `timed` (the
    /// default): the fastest of the heuristic's first 8, timed during the first step (which
    /// runs the heuristic's), rank 0's picks used by every rank from the second step on and
    /// stored with the run (`OUTPUT_DIR/gemm_tuning.json`, every checkpoint), so a resume or
    /// a run given `gemm_tuning_from` gets the same bits. `searched`: as `timed`, over
    /// every configuration cuBLASLt accepts for the heuristic's algorithms (a longer first
    /// step). `heuristic`: the heuristic's first, the same bits on every run without storing
    /// anything. The CPU reference has one way to multiply.
    pub gemm_tuning: GemmTuning,
    /// With `gemm_tuning = "timed"` or `"searched"`: use the choices stored by an earlier run instead of
    /// timing (its `gemm_tuning.json`, its output.dir, or one of its checkpoints), from the
    /// second step on as that run did; refused when timed on another GPU or cuBLASLt.
    pub gemm_tuning_from: Option<PathBuf>,
    /// The precision of the blocks' linear layers' GEMMs: `bf16` (the default; f32 on CPU
    /// ranks) or `fp8` (e4m3 weights and activations, e5m2 output gradients, per-tensor
    /// current scaling, fp32 accumulation; GPUs of compute capability 9.0 and later, CPU
    /// ranks simulate it). The embedding, norms, attention, the LM head and the loss, and
    /// the master weights, moments and gradients keep their precision.
    pub precision: Precision,
    /// With `precision = "fp8"` at ZeRO stages 0-2: keep each linear layer's weight cast to
    /// FP8 (both layouts the GEMMs read) from one optimizer step to the next, instead of
    /// casting it at each forward, recompute and backward (the same values either way). It
    /// costs 2 bytes per parameter of the blocks' linear layers on the GPU, predicted by
    /// `launcher memory`. `"auto"` (the default): the launcher caches as many blocks' weights
    /// as the plan still fits the device with ([`Fp8WeightCache`]); a number caches the
    /// first that many blocks. At stage 3 the cache is made from the gathered weights and
    /// holds whole layers on every rank (not shards).
    pub fp8_weight_cache: Fp8WeightCache,
    /// With `precision = "fp8"`: the output gradient's format in the backward's GEMMs,
    /// `"e5m2"` (the default: range) or `"e4m3"` (one more mantissa bit; values more than
    /// ~2^17.8 below the tensor's largest flush to zero instead of ~2^31.8 below).
    pub fp8_grad_format: Fp8GradFormat,
    /// With `precision = "fp8"`: the weight-gradient GEMM (`dW = dYᵀ·X`) in `"fp8"` (the
    /// default) or `"bf16"`: from the unquantized operands, as torchao's `rowwise_with_gw_hp`
    /// recipe keeps it, so the gradient the optimizer sees rounds neither to 8 bits. It
    /// gives up a third of the FP8 GEMMs' gain and saves the backward's casts of the input.
    pub fp8_weight_grad: Fp8WeightGrad,
    /// With `precision = "fp8"`: the blocks' linear layers kept in bf16, by name (GPT-2:
    /// `"qkv"`, `"proj"`, `"fc"`, `"fc2"`; Llama: `"qkv"`, `"o"`, `"gate_up"`, `"down"`), for
    /// layers whose FP8 GEMMs do not pay for their casts at the model's shapes (as torchao
    /// filters layers by shape and torchtitan by name), or that a run wants unquantized.
    /// Empty (the default): every eligible layer in FP8.
    pub fp8_bf16_layers: Vec<String>,
    /// Rows of logits the LM head makes at a time (its GEMMs, the loss and the backward run
    /// chunk by chunk, so a micro-batch's logits never exist whole); 0 = automatic: the
    /// fewest equal chunks of at most 4 GiB of logits.
    pub loss_chunk_rows: usize,
    /// Start from these weights instead of random ones (fine-tuning, with a fresh optimizer
    /// and schedule): a Hugging Face model folder (config.json + safetensors, one file or
    /// sharded with its index; float32, bfloat16 or float16), one safetensors file, or a
    /// shardtrain checkpoint directory. A folder or checkpoint also gives the model's shape,
    /// so `[model]` may be left out (keys given anyway must agree).
    pub init_from: Option<PathBuf>,
}

impl TrainConfig {
    /// With `precision = "fp8"`, what the blocks' linear layers run as, in a line the launch
    /// prints (so a run's log says which FP8 recipe it trained with); `None` in bf16.
    pub fn fp8_recipe_summary(&self) -> Option<String> {
        if self.precision != Precision::Fp8 {
            return None;
        }
        let grad = self.fp8_grad_format.name();
        let dw = match self.fp8_weight_grad {
            Fp8WeightGrad::Fp8 => "in FP8",
            Fp8WeightGrad::Bf16 => "from the unquantized operands (bf16 on GPUs, f32 on CPU ranks)",
        };
        let kept = match self.fp8_bf16_layers.as_slice() {
            [] => String::new(),
            names => format!("; kept in bf16: {} (train.fp8_bf16_layers)", names.join(", ")),
        };
        Some(format!(
            "train.precision = \"fp8\": the blocks' linear layers with e4m3 weights and inputs, {grad} output \
             gradients (train.fp8_grad_format), the weight gradient {dw} (train.fp8_weight_grad); per-tensor \
             current scaling{kept}"
        ))
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            micro_batch: 4,
            grad_accum: 1,
            steps: 100,
            lr: 6e-4,
            min_lr: 6e-5,
            warmup_steps: 10,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            seed: 1337,
            eval_every: 0,
            eval_batches: 4,
            cuda_graphs: true,
            gemm_tuning: GemmTuning::Timed,
            gemm_tuning_from: None,
            precision: Precision::Bf16,
            fp8_weight_cache: Fp8WeightCache::Auto,
            fp8_grad_format: Fp8GradFormat::E5m2,
            fp8_weight_grad: Fp8WeightGrad::Fp8,
            fp8_bf16_layers: Vec::new(),
            loss_chunk_rows: 0,
            init_from: None,
        }
    }
}

/// ZeRO stage and communication sizing.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ZeroConfig {
    /// 0 = data parallel, 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters.
    pub stage: u8,
    /// Removed: gradients are reduced one unit (a whole block) at a time, which is the
    /// bucket. Kept as a field only so that setting it is a clear error, not an unknown key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket_mb: Option<toml::Value>,
    /// Stage 3: how many blocks ahead to all-gather parameters.
    pub prefetch_blocks: usize,
    /// Stage 3 with `train.precision = "fp8"` on several ranks: all-gather the blocks'
    /// linear weights as FP8 codes (one byte each, with their tensors' scales) instead of at
    /// compute precision (`backend/fp8_gather.rs`): the same bits, half the bytes. Off by
    /// default: within one NVLink node the gathers are hidden behind compute and the casts
    /// cost more than the bytes save (0.77× the step at GPT-2 1.5B on 2 H200s, BENCHMARKS.md
    /// run 18); for jobs whose gathers are exposed (slow links). Elsewhere it changes nothing.
    pub fp8_gather: bool,
}

impl Default for ZeroConfig {
    fn default() -> Self {
        ZeroConfig { stage: 0, bucket_mb: None, prefetch_blocks: 1, fp8_gather: false }
    }
}

/// Which blocks recompute their forward during backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationCheckpointing {
    /// Keep every activation.
    None,
    /// Checkpoint every block (same as `Every(1)`).
    EveryLayer,
    /// Checkpoint blocks whose index is a multiple of k.
    Every(usize),
}

impl ActivationCheckpointing {
    /// Whether block `layer` keeps only its input and recomputes the rest in backward.
    pub fn is_checkpointed(self, layer: usize) -> bool {
        match self {
            ActivationCheckpointing::None => false,
            ActivationCheckpointing::EveryLayer => true,
            ActivationCheckpointing::Every(k) => k > 0 && layer.is_multiple_of(k),
        }
    }
}

impl Serialize for ActivationCheckpointing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ActivationCheckpointing::None => s.serialize_str("none"),
            ActivationCheckpointing::EveryLayer => s.serialize_str("every_layer"),
            ActivationCheckpointing::Every(k) => s.serialize_u64(*k as u64),
        }
    }
}

impl<'de> Deserialize<'de> for ActivationCheckpointing {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ActivationCheckpointing;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(r#""none", "every_layer", or a positive integer k (checkpoint every k-th block)"#)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "none" => Ok(ActivationCheckpointing::None),
                    "every_layer" => Ok(ActivationCheckpointing::EveryLayer),
                    other => Err(E::custom(format!(
                        r#"unknown value "{other}": use "none", "every_layer", or a positive integer k"#
                    ))),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                if v <= 0 {
                    return Err(E::custom(format!(
                        "{v} is not a positive integer: use k >= 1 to checkpoint every k-th block, or \"none\""
                    )));
                }
                Ok(ActivationCheckpointing::Every(v as usize))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                self.visit_i64(v as i64)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointingConfig {
    pub activations: ActivationCheckpointing,
    /// Checkpointed blocks also keep their attention output and softmax statistics
    /// (C + n_head/2 values per token per block, about 1/4 of a block's full activations),
    /// so their recompute skips the attention forward.
    pub keep_attention: bool,
    /// Blocks that are not checkpointed also keep their MLP's GELU output (4·C values per
    /// token per block), so their backward does not recompute it for the second MLP
    /// GEMM's weight gradient (checkpointed blocks reuse their recompute's anyway).
    /// `"auto"` (the default): the launcher keeps it where the plan still fits the device
    /// with it ([`KeepGelu`]).
    pub keep_gelu: KeepGelu,
}

impl Default for CheckpointingConfig {
    fn default() -> Self {
        CheckpointingConfig {
            activations: ActivationCheckpointing::None,
            keep_attention: false,
            keep_gelu: KeepGelu::Auto,
        }
    }
}

/// `checkpointing.keep_gelu`: `true`, `false`, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeepGelu {
    /// Decided before launch by the planner (`launcher`'s `fit.rs`): kept where the predicted
    /// peak with it fits the device, recomputed otherwise; the launcher writes its decision
    /// into the config the ranks read. Unresolved (the trainer used as a library), a block
    /// recomputes: the choice that never costs memory.
    #[default]
    Auto,
    /// `true`: keep it.
    Keep,
    /// `false`: recompute it.
    Recompute,
}

impl KeepGelu {
    /// Whether blocks keep their GELU output (`Auto` unresolved: no).
    pub fn keeps(self) -> bool {
        self == KeepGelu::Keep
    }
}

impl From<bool> for KeepGelu {
    fn from(b: bool) -> Self {
        if b {
            KeepGelu::Keep
        } else {
            KeepGelu::Recompute
        }
    }
}

impl Serialize for KeepGelu {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            KeepGelu::Auto => s.serialize_str("auto"),
            KeepGelu::Keep => s.serialize_bool(true),
            KeepGelu::Recompute => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for KeepGelu {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = KeepGelu;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(r#"true, false, or "auto" (kept where it fits the device)"#)
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(v.into())
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "auto" => Ok(KeepGelu::Auto),
                    other => Err(E::custom(format!(r#"unknown value "{other}": use true, false or "auto""#))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// `train.fp8_weight_cache`: `true`, `false`, `"auto"`, or a number of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8WeightCache {
    /// Decided before launch by the planner (`launcher`'s `fit.rs`), after `keep_gelu`: the
    /// most blocks whose cached weights the plan still fits the device with (all, some or
    /// none); the launcher writes its decision into the config the ranks read. Unresolved
    /// (the trainer used as a library): every block at ZeRO stages 0-2, none at stage 3.
    #[default]
    Auto,
    /// `true`: every block's weights cached.
    Cache,
    /// `false`: each weight cast at each use.
    PerUse,
    /// `N`: the first N blocks' weights cached, the rest cast at each use.
    Blocks(usize),
}

impl Fp8WeightCache {
    /// How many of `n_layer` blocks (the first ones) have their FP8 weights cached at ZeRO
    /// `stage` (`Auto` unresolved: every block at stages 0-2, none at stage 3, as before the
    /// planner decided it there).
    pub fn cached_blocks(self, n_layer: usize, stage: u8) -> usize {
        match self {
            Fp8WeightCache::Auto if stage >= 3 => 0,
            Fp8WeightCache::Auto | Fp8WeightCache::Cache => n_layer,
            Fp8WeightCache::PerUse => 0,
            Fp8WeightCache::Blocks(k) => k.min(n_layer),
        }
    }

    /// The setting that caches `blocks` of `n_layer` blocks (`true`, `false`, or the count).
    pub fn of_blocks(blocks: usize, n_layer: usize) -> Fp8WeightCache {
        match blocks {
            0 => Fp8WeightCache::PerUse,
            k if k >= n_layer => Fp8WeightCache::Cache,
            k => Fp8WeightCache::Blocks(k),
        }
    }
}

impl From<bool> for Fp8WeightCache {
    fn from(b: bool) -> Self {
        if b {
            Fp8WeightCache::Cache
        } else {
            Fp8WeightCache::PerUse
        }
    }
}

impl Serialize for Fp8WeightCache {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Fp8WeightCache::Auto => s.serialize_str("auto"),
            Fp8WeightCache::Cache => s.serialize_bool(true),
            Fp8WeightCache::PerUse => s.serialize_bool(false),
            Fp8WeightCache::Blocks(k) => s.serialize_u64(*k as u64),
        }
    }
}

impl<'de> Deserialize<'de> for Fp8WeightCache {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Fp8WeightCache;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(r#"true, false, "auto" (cached where it fits the device), or a number of blocks"#)
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(v.into())
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Fp8WeightCache::Blocks(v as usize))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!("{v} blocks: the number of blocks cannot be negative"))),
                }
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "auto" => Ok(Fp8WeightCache::Auto),
                    other => Err(E::custom(format!(
                        r#"unknown value "{other}": use true, false, "auto" or a number of blocks"#
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Sharded training checkpoints.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Save every this many optimizer steps (0 = never).
    pub every: usize,
    /// Where checkpoints go; unset = `<output.dir>/checkpoints`.
    pub dir: Option<PathBuf>,
    /// Keep the newest `keep` checkpoints; older ones are removed after a new one is complete.
    pub keep: usize,
    /// Copy each rank's shard to page-locked host memory at the step boundary and write it on
    /// a background thread while training goes on (the next save, and the end of training,
    /// wait for the previous one). Costs the shard's size in host memory per rank.
    #[serde(rename = "async")]
    pub async_save: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { every: 0, dir: None, keep: 3, async_save: false }
    }
}

impl Config {
    /// The directory checkpoints are written to and resumed from.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint.dir.clone().unwrap_or_else(|| self.output.dir.join("checkpoints"))
    }
}

/// How random initial weights are drawn (`train.init_from` starts from given ones instead).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct InitConfig {
    /// Moved to `train.init_from`; kept as a field only so that setting it is a clear error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<toml::Value>,
    /// The random initialisation's scales.
    pub scheme: InitScheme,
}

/// How random initial weights are scaled.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum InitScheme {
    /// GPT-2's: every matrix N(0, 0.02²), residual projections N(0, (0.02 / √(2L))²).
    #[default]
    Gpt2,
    /// Scaled with the width for large models (GPT-NeoX's "small init" and "wang init"):
    /// matrices N(0, 2 / (5C)), residual projections N(0, (2 / (L√C))²).
    Scaled,
}

/// CPU offload of the optimizer state and the parameters.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadConfig {
    /// fp32 master weights and AdamW moments in host memory, updated by the host AdamW.
    pub optimizer: bool,
    /// ZeRO-3: the rounded parameter shard in page-locked host memory too, fetched at
    /// gather time (needs `optimizer`).
    pub params: bool,
    /// Host threads for the host AdamW; 0 = this rank's share of the node's cores (less one
    /// with `delayed_update`, for the thread that drives the device meanwhile).
    pub cpu_threads: usize,
    /// ZeRO-Offload's one-step delayed update (needs `optimizer`): step t's host AdamW runs
    /// while step t+1's forward and backward run on the GPU, which therefore computes with
    /// weights one update older. Costs 6 bytes per held parameter of page-locked host
    /// memory (the step's gradient and its rounded update); evaluations and checkpoints
    /// first apply the update in flight.
    pub delayed_update: bool,
    /// Steps updated in order before the delay starts (the first steps move the weights
    /// most; ZeRO-Offload also starts its delayed update after a warm-up).
    pub delayed_update_after: usize,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        OffloadConfig {
            optimizer: false,
            params: false,
            cpu_threads: 0,
            delayed_update: false,
            delayed_update_after: 40,
        }
    }
}

/// Where tokens come from.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Directory (or single file) of llm.c token shards. Unset (and no `sources`): the
    /// built-in generated corpus. The one-source shorthand of `[[data.sources]]`.
    pub path: Option<PathBuf>,
    /// Attention stops at document boundaries inside a packed sequence, and positions
    /// (GPT-2's learned ones, Llama's RoPE) restart at each document. A document starts at
    /// every input that is the data's end-of-text token (from the shards' tokenizer record;
    /// GPT-2's 50256 for shards without one, `trainer::documents`), and at each sequence's
    /// first token. Training and validation loss both use it. The sources of a mixture must
    /// share the id (they share a tokenizer).
    pub document_mask: bool,
    /// Several datasets mixed by weight (`[[data.sources]]`); exclusive with `path`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceConfig>,
    /// Resume from a checkpoint whose data differs from this run's (other shards, weights,
    /// seq_len or seed): each source continues from its saved row count, matched by name.
    /// Off: such a resume is refused, naming what changed.
    pub allow_changed_data: bool,
}

/// One dataset of a mixture.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// Its shards, as for `data.path` (directory, shard file or pattern).
    pub path: PathBuf,
    /// Relative share of the training rows (a positive number; 3 and 1 give 75% / 25%).
    #[serde(default = "one")]
    pub weight: f64,
    /// The name in metrics, logs and checkpoints; default: the path's last component.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

fn one() -> f64 {
    1.0
}

impl SourceConfig {
    /// The configured name, or the path's last component (its parent's, for a pattern).
    pub fn display_name(&self) -> String {
        if let Some(n) = &self.name {
            return n.clone();
        }
        let p = &self.path;
        let last = p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        if last.contains(['*', '?']) || last.is_empty() {
            if let Some(parent) = p.parent().and_then(|q| q.file_name()) {
                return parent.to_string_lossy().into_owned();
            }
        }
        if last.is_empty() {
            p.display().to_string()
        } else {
            last
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OutputConfig {
    /// Run directory: rank logs, metrics.jsonl, built-in data cache.
    pub dir: PathBuf,
}

impl Default for OutputConfig {
    fn default() -> Self {
        OutputConfig { dir: PathBuf::from("runs/default") }
    }
}

/// The launcher's hang watchdog (read by the launcher; ranks report their progress).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WatchdogConfig {
    /// Stop the job when no rank has made progress (a micro-step, a collective entered or
    /// left, a step, a checkpoint being written) for this many seconds. 0 turns it off.
    pub timeout_s: f64,
    /// Collectives each rank's flight recorder keeps (its last ones), reported when the job
    /// hangs or a rank fails. 0 records none.
    pub flight_records: usize,
}

/// The most collectives a flight recorder may keep: a rank sends them in one control message.
pub const MAX_FLIGHT_RECORDS: usize = 16384;

impl Default for WatchdogConfig {
    fn default() -> Self {
        WatchdogConfig { timeout_s: 120.0, flight_records: 64 }
    }
}

impl Config {
    /// Parse TOML text; `origin` names the source in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse { origin: origin.to_string(), message: e.to_string() })
    }

    /// Read a file, apply `--set` overrides, validate.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        let mut value: toml::Table = toml::from_str(&text)
            .map_err(|e| ConfigError::Parse { origin: path.display().to_string(), message: e.to_string() })?;
        for o in overrides {
            apply_override(&mut value, o)?;
        }
        model_from_init(&mut value)?;
        let origin = if overrides.is_empty() {
            path.display().to_string()
        } else {
            format!("{} (with --set overrides)", path.display())
        };
        let cfg: Config = toml::Value::Table(value)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse { origin, message: e.to_string() })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reject impossible values with an error that names the key and the fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let m = &self.model;
        let t = &self.train;
        fn bad(key: &'static str, value: impl ToString, message: impl Into<String>) -> ConfigError {
            ConfigError::Invalid { key, value: value.to_string(), message: message.into() }
        }
        if m.n_layer == 0 {
            return Err(bad("model.n_layer", m.n_layer, "must be at least 1"));
        }
        if m.n_head == 0 {
            return Err(bad("model.n_head", m.n_head, "must be at least 1"));
        }
        if m.n_embd == 0 || !m.n_embd.is_multiple_of(m.n_head) {
            return Err(bad(
                "model.n_embd",
                m.n_embd,
                format!("must be a positive multiple of model.n_head = {} (head size = n_embd / n_head)", m.n_head),
            ));
        }
        if m.vocab_size < 2 {
            return Err(bad("model.vocab_size", m.vocab_size, "must be at least 2"));
        }
        if m.vocab_size > u32::MAX as usize {
            return Err(bad("model.vocab_size", m.vocab_size, "is too large"));
        }
        if m.seq_len == 0 {
            return Err(bad("model.seq_len", m.seq_len, "must be at least 1"));
        }
        m.family.validate(m)?;
        if t.steps == 0 {
            return Err(bad("train.steps", t.steps, "must be at least 1 (the number of optimizer steps to run)"));
        }
        if t.micro_batch == 0 {
            return Err(bad("train.micro_batch", t.micro_batch, "must be at least 1"));
        }
        if t.grad_accum == 0 {
            return Err(bad("train.grad_accum", t.grad_accum, "must be at least 1"));
        }
        if let Fp8WeightCache::Blocks(k) = t.fp8_weight_cache {
            if k > m.n_layer {
                return Err(bad(
                    "train.fp8_weight_cache",
                    k,
                    format!("caches the first N blocks, and the model has {} (model.n_layer)", m.n_layer),
                ));
            }
        }
        // The FP8 backward's recipe and the layers kept in bf16 only mean something in FP8:
        // refused rather than ignored.
        if t.precision != Precision::Fp8 {
            let set = [
                (
                    "train.fp8_grad_format",
                    t.fp8_grad_format.name().to_string(),
                    t.fp8_grad_format != Fp8GradFormat::default(),
                ),
                (
                    "train.fp8_weight_grad",
                    t.fp8_weight_grad.name().to_string(),
                    t.fp8_weight_grad != Fp8WeightGrad::default(),
                ),
                ("train.fp8_bf16_layers", format!("{:?}", t.fp8_bf16_layers), !t.fp8_bf16_layers.is_empty()),
            ];
            if let Some((key, value, _)) = set.into_iter().find(|k| k.2) {
                let why = "applies only to FP8 layers: set train.precision = \"fp8\" too, or leave it out";
                return Err(bad(key, value, why));
            }
        }
        let names = m.family.linear_names();
        for (i, name) in t.fp8_bf16_layers.iter().enumerate() {
            if !names.contains(&name.as_str()) {
                let why = format!("the {} family's block linear layers are {names:?}", m.family.name());
                return Err(bad("train.fp8_bf16_layers", format!("{name:?}"), why));
            }
            if t.fp8_bf16_layers[..i].contains(name) {
                return Err(bad("train.fp8_bf16_layers", format!("{name:?}"), "is listed twice"));
            }
        }
        self.check_scale()?;
        if !(t.lr.is_finite() && t.lr >= 0.0) {
            return Err(bad("train.lr", t.lr, "must be a finite number >= 0"));
        }
        if !(t.min_lr.is_finite() && t.min_lr >= 0.0 && t.min_lr <= t.lr) {
            return Err(bad("train.min_lr", t.min_lr, format!("must be between 0 and train.lr = {}", t.lr)));
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            return Err(bad("train.weight_decay", t.weight_decay, "must be >= 0"));
        }
        if !(0.0..1.0).contains(&t.beta1) {
            return Err(bad("train.beta1", t.beta1, "must be in [0, 1)"));
        }
        if !(0.0..1.0).contains(&t.beta2) {
            return Err(bad("train.beta2", t.beta2, "must be in [0, 1)"));
        }
        if !(t.eps.is_finite() && t.eps > 0.0) {
            return Err(bad("train.eps", t.eps, "must be > 0 (e.g. 1e-8)"));
        }
        if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
            return Err(bad("train.grad_clip", t.grad_clip, "must be >= 0 (0 disables clipping)"));
        }
        if self.zero.stage > 3 {
            return Err(bad(
                "zero.stage",
                self.zero.stage,
                "ZeRO stages are 0 (data parallel), 1 (optimizer), 2 (+gradients) and 3 (+parameters)",
            ));
        }
        if let Some(v) = &self.init.from {
            return Err(bad(
                "init.from",
                v,
                "moved to train.init_from (which also takes a Hugging Face model folder or a shardtrain checkpoint): \
                 write it under [train]",
            ));
        }
        if let Some(v) = &self.zero.bucket_mb {
            return Err(bad(
                "zero.bucket_mb",
                v,
                "was removed: gradients are reduced one unit (a whole transformer block) at a time as its \
                 backward finishes, so the block is the bucket; delete the key",
            ));
        }
        if self.offload.params && !self.offload.optimizer {
            return Err(bad(
                "offload.params",
                true,
                "needs offload.optimizer = true (the host optimizer writes the offloaded parameters)",
            ));
        }
        if self.offload.delayed_update && !self.offload.optimizer {
            return Err(bad(
                "offload.delayed_update",
                true,
                "needs offload.optimizer = true (it delays the host optimizer's update)",
            ));
        }
        if self.offload.delayed_update && self.offload.params {
            return Err(bad(
                "offload.delayed_update",
                true,
                "cannot be combined with offload.params (the update in flight would rewrite the host \
                 parameter shard the running step fetches from); set one of them to false",
            ));
        }
        if self.checkpointing.keep_attention && self.checkpointing.activations == ActivationCheckpointing::None {
            return Err(bad(
                "checkpointing.keep_attention",
                true,
                "applies to checkpointed blocks, and checkpointing.activations = \"none\" checkpoints none; \
                 set checkpointing.activations (\"every_layer\" or k) or drop keep_attention",
            ));
        }
        if self.checkpointing.keep_gelu.keeps() && self.every_block_checkpointed() {
            return Err(bad(
                "checkpointing.keep_gelu",
                true,
                "applies to blocks that are not checkpointed, and every block is (their recompute gives \
                 the GELU output to the backward anyway); checkpoint fewer blocks or drop keep_gelu",
            ));
        }
        if let (GemmTuning::Heuristic, Some(p)) = (t.gemm_tuning, &t.gemm_tuning_from) {
            return Err(bad(
                "train.gemm_tuning_from",
                p.display(),
                "applies to train.gemm_tuning = \"timed\" or \"searched\" (stored timed choices), and \
                 \"heuristic\" picks no stored algorithm; set train.gemm_tuning = \"timed\" or drop gemm_tuning_from",
            ));
        }
        if self.offload.params && self.zero.stage != 3 {
            return Err(bad(
                "offload.params",
                true,
                format!(
                    "needs zero.stage = 3 (stage {} keeps the full parameters on the device); set zero.stage = 3",
                    self.zero.stage
                ),
            ));
        }
        if self.checkpoint.every > 0 && self.checkpoint.keep == 0 {
            return Err(bad("checkpoint.keep", 0, "must be at least 1 when checkpoint.every > 0"));
        }
        if self.checkpoint.async_save && self.checkpoint.every == 0 {
            return Err(bad(
                "checkpoint.async",
                true,
                "writes checkpoints in the background, and checkpoint.every = 0 writes none: set checkpoint.every \
                 or drop checkpoint.async",
            ));
        }
        let w = self.watchdog.timeout_s;
        if !(w.is_finite() && w >= 0.0) {
            return Err(bad("watchdog.timeout_s", w, "must be a number of seconds >= 0 (0 turns the watchdog off)"));
        }
        if self.watchdog.flight_records > MAX_FLIGHT_RECORDS {
            return Err(bad(
                "watchdog.flight_records",
                self.watchdog.flight_records,
                format!(
                    "must be at most {MAX_FLIGHT_RECORDS} (a rank sends its records in one message; the first \
                     divergence is almost always among the last few dozen)"
                ),
            ));
        }
        if self.output.dir.as_os_str().is_empty() {
            return Err(bad("output.dir", "\"\"", "must name a directory"));
        }
        self.validate_sources()
    }

    /// `[[data.sources]]`: not with `data.path`; positive finite weights; distinct names.
    fn validate_sources(&self) -> Result<(), ConfigError> {
        let d = &self.data;
        let bad = |value: String, message: String| ConfigError::Invalid { key: "data.sources", value, message };
        if let (Some(p), false) = (&d.path, d.sources.is_empty()) {
            return Err(bad(
                format!("{} entries", d.sources.len()),
                format!(
                    "cannot be given with data.path = {} (data.path is the one-source shorthand): put that path in a \
                     [[data.sources]] entry, or remove the entries",
                    p.display()
                ),
            ));
        }
        let mut names: Vec<String> = Vec::new();
        for s in &d.sources {
            let name = s.display_name();
            if !(s.weight.is_finite() && s.weight > 0.0) {
                return Err(bad(
                    format!("weight = {} of source {name:?}", s.weight),
                    "every source's weight must be a positive finite number (weights are relative: 3 and 1 give \
                     75% and 25% of the rows)"
                        .into(),
                ));
            }
            if names.contains(&name) {
                return Err(bad(
                    format!("two sources named {name:?}"),
                    "give each [[data.sources]] entry its own name = \"...\"".into(),
                ));
            }
            names.push(name);
        }
        Ok(())
    }

    /// Whether every block recomputes its forward (so none has a GELU output to keep).
    pub fn every_block_checkpointed(&self) -> bool {
        let ckpt = self.checkpointing.activations;
        (0..self.model.n_layer).all(|l| ckpt.is_checkpointed(l))
    }

    /// Shapes beyond any machine are refused before anything multiplies them: every size
    /// then stays far from overflowing 64 bits, and planning, which walks every block, stays
    /// quick (`launcher memory` on a 100000-layer model took 20 s and 430 MB to answer).
    fn check_scale(&self) -> Result<(), ConfigError> {
        let (m, t) = (&self.model, &self.train);
        let huge = |key: &'static str, value: String, message: String| ConfigError::Invalid { key, value, message };
        if m.n_layer > MAX_LAYERS {
            return Err(huge(
                "model.n_layer",
                m.n_layer.to_string(),
                format!(
                    "is beyond {MAX_LAYERS} blocks (the deepest models trained have a few hundred; planning and \
                     training walk every block): use fewer, wider blocks"
                ),
            ));
        }
        // In f64: the estimates themselves must not overflow, whatever the config says.
        let [l, c, v, s, h, b] =
            [m.n_layer, m.n_embd, m.vocab_size, m.seq_len, m.n_head, t.micro_batch].map(|x| x as f64);
        // A decoder block holds about 12·C² parameters (attention 4·C², MLP 8·C²).
        let params = l * (12.0 * c * c + 13.0 * c) + (v + s) * c;
        if params > MAX_PARAMS {
            return Err(huge(
                "model.n_embd",
                m.n_embd.to_string(),
                format!(
                    "with model.n_layer = {} and model.vocab_size = {} the model has about {params:.3e} parameters, \
                     beyond {MAX_PARAMS:.0e} (1.6 PB of weights, gradients and optimizer state at 16 bytes per \
                     parameter: more than 4096 of the largest GPUs hold); make the model smaller",
                    m.n_layer, m.vocab_size
                ),
            ));
        }
        if b * s > MAX_TOKENS {
            return Err(huge(
                "train.micro_batch",
                t.micro_batch.to_string(),
                format!(
                    "times model.seq_len = {} is {:.3e} tokens per rank and micro-step, beyond {MAX_TOKENS:.3e}: \
                     lower train.micro_batch and raise train.grad_accum for the same global batch",
                    m.seq_len,
                    b * s
                ),
            ));
        }
        // Saved activations per micro-step, as the CPU backend keeps them (its attention keeps
        // B·heads·T·T): about 16·C + 2·heads·T values per token and block, and the logits.
        let activations = b * s * (l * (16.0 * c + 2.0 * h * s) + 2.0 * v);
        if activations > MAX_ACTIVATIONS {
            return Err(huge(
                "model.seq_len",
                m.seq_len.to_string(),
                format!(
                    "with train.micro_batch = {} and this model, one micro-step would keep about {activations:.3e} \
                     activation values, beyond {MAX_ACTIVATIONS:.3e}: lower train.micro_batch or model.seq_len",
                    t.micro_batch
                ),
            ));
        }
        Ok(())
    }
}

/// The most transformer blocks a model may have.
pub const MAX_LAYERS: usize = 10_000;
/// The most parameters a model may have (about: see `check_scale`).
const MAX_PARAMS: f64 = 1e14;
/// The most tokens one rank's micro-step may hold (2^30).
const MAX_TOKENS: f64 = 1_073_741_824.0;
/// The most activation values one micro-step may keep (2^52: 16 PiB in f32).
const MAX_ACTIVATIONS: f64 = 4_503_599_627_370_496.0;

/// Where `train.init_from` names a source that says what model it holds (a Hugging Face
/// folder's config.json, a checkpoint's manifest), fill the raw `[model]` section from it:
/// keys the config leaves out come from the source; keys it gives must agree (but
/// `seq_len`, the context to train, is the config's, and `vocab_size` may be larger: an
/// embedding padded for speed), or the run is refused naming the key.
fn model_from_init(table: &mut toml::Table) -> Result<(), ConfigError> {
    let Some(path) = table.get("train").and_then(|t| t.get("init_from")).and_then(|v| v.as_str()) else {
        return Ok(());
    };
    let path = PathBuf::from(path);
    let given = match table.get("model") {
        None => toml::Table::new(),
        Some(toml::Value::Table(t)) => t.clone(),
        Some(_) => return Err(ConfigError::Parse { origin: "[model]".into(), message: "must be a table".into() }),
    };
    let seq_len = given.get("seq_len").and_then(|v| v.as_integer()).map(|v| v.max(0) as usize);
    let source = crate::checkpoint::init::source_model(&path, seq_len).map_err(|message| ConfigError::Invalid {
        key: "train.init_from",
        value: path.display().to_string(),
        message,
    })?;
    let Some(source) = source else { return Ok(()) };
    let theirs = match toml::Value::try_from(&source) {
        Ok(toml::Value::Table(t)) => t,
        _ => return Err(ConfigError::Parse { origin: path.display().to_string(), message: "model section".into() }),
    };
    let mut merged = theirs.clone();
    for (k, v) in &given {
        merged.insert(k.clone(), v.clone());
    }
    // Compare as the typed config reads them (500000 and 500000.0 are one value), key by key.
    let typed = |t: &toml::Table| -> Option<toml::Table> {
        let m: ModelConfig = toml::Value::Table(t.clone()).try_into().ok()?;
        match toml::Value::try_from(&m) {
            Ok(toml::Value::Table(t)) => Some(t),
            _ => None,
        }
    };
    if let (Some(ours), Some(src)) = (typed(&merged), typed(&theirs)) {
        for (k, v) in &ours {
            let agree = match k.as_str() {
                "seq_len" => true,
                "vocab_size" => v.as_integer() >= src.get(k).and_then(|s| s.as_integer()),
                _ => src.get(k) == Some(v),
            };
            if !agree && given.contains_key(k) {
                let key: &'static str = MODEL_KEYS.iter().find(|n| n[6..] == **k).copied().unwrap_or("model");
                return Err(ConfigError::Invalid {
                    key,
                    value: v.to_string(),
                    message: format!(
                        "train.init_from = {} holds a model with {k} = {}: delete the key (the model comes from \
                         there) or point train.init_from at weights of this shape",
                        path.display(),
                        src.get(k).map_or("unset".to_string(), |s| s.to_string())
                    ),
                });
            }
        }
    }
    table.insert("model".into(), toml::Value::Table(merged));
    Ok(())
}

/// Every `[model]` key by its full name (errors name keys as `&'static str`).
const MODEL_KEYS: [&str; 12] = [
    "model.family",
    "model.n_layer",
    "model.n_head",
    "model.n_embd",
    "model.vocab_size",
    "model.seq_len",
    "model.n_kv_head",
    "model.intermediate_size",
    "model.rope_theta",
    "model.rope_scaling",
    "model.rms_norm_eps",
    "model.tie_embeddings",
];

/// Apply one `section.key=value` override to the raw TOML table. The value is parsed
/// as TOML (so `3`, `1e-4`, `true`, `"text"` work); bare words fall back to strings.
pub fn apply_override(table: &mut toml::Table, arg: &str) -> Result<(), ConfigError> {
    let err = |message: String| ConfigError::Override { arg: arg.to_string(), message };
    let (key, raw) =
        arg.split_once('=').ok_or_else(|| err("expected section.key=value, e.g. --set zero.stage=3".into()))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(err(format!("`{key}` is not of the form section.key (e.g. train.lr)")));
    }
    let raw = raw.trim();
    let value: toml::Value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").unwrap_or(toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let section = table.entry(parts[0].to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let section =
        section.as_table_mut().ok_or_else(|| err(format!("`{}` is not a section in the config", parts[0])))?;
    section.insert(parts[1].to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "[model]\nn_layer = 2\nn_head = 2\nn_embd = 8\nvocab_size = 11\nseq_len = 4\n";

    fn load_str(text: &str, overrides: &[&str]) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("c.toml");
        std::fs::write(&p, text).expect("write");
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        Config::load(&p, &o)
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = load_str(BASE, &[]).expect("valid");
        assert_eq!(c.zero.stage, 0);
        assert_eq!(c.checkpointing.activations, ActivationCheckpointing::None);
        assert_eq!(c.data.path, None);
    }

    #[test]
    fn unknown_key_is_named() {
        let e = load_str(&format!("{BASE}[train]\nlearning_rate = 1.0\n"), &[]).unwrap_err().to_string();
        assert!(e.contains("learning_rate"), "{e}");
        let e = load_str(&format!("{BASE}[trian]\nlr = 1.0\n"), &[]).unwrap_err().to_string();
        assert!(e.contains("trian"), "{e}");
    }

    #[test]
    fn wrong_type_is_named() {
        let e = load_str(&format!("{BASE}[train]\nsteps = \"ten\"\n"), &[]).unwrap_err().to_string();
        assert!(e.contains("steps") || e.contains("ten"), "{e}");
    }

    #[test]
    fn impossible_values_name_key_and_fix() {
        let e = load_str(BASE, &["zero.stage=7"]).unwrap_err().to_string();
        assert!(e.contains("zero.stage") && e.contains("0 (data parallel)"), "{e}");
        let e = load_str(&BASE.replace("n_embd = 8", "n_embd = 9"), &[]).unwrap_err().to_string();
        assert!(e.contains("model.n_embd") && e.contains("multiple of model.n_head"), "{e}");
        let e = load_str(BASE, &["train.steps=0"]).unwrap_err().to_string();
        assert!(e.contains("train.steps") && e.contains("at least 1"), "{e}");
        let e = load_str(BASE, &["watchdog.timeout_s=-1"]).unwrap_err().to_string();
        assert!(e.contains("watchdog.timeout_s"), "{e}");
        assert_eq!(load_str(BASE, &[]).expect("valid").watchdog.timeout_s, 120.0);
        assert_eq!(load_str(BASE, &[]).expect("valid").watchdog.flight_records, 64);
        let e = load_str(BASE, &["checkpoint.async=true"]).unwrap_err().to_string();
        assert!(e.contains("checkpoint.async") && e.contains("checkpoint.every"), "{e}");
        let c = load_str(BASE, &["checkpoint.async=true", "checkpoint.every=5"]).expect("valid");
        assert!(c.checkpoint.async_save);
        let e = load_str(BASE, &["watchdog.flight_records=100000"]).unwrap_err().to_string();
        assert!(e.contains("watchdog.flight_records") && e.contains("16384"), "{e}");
        let e = load_str(BASE, &["train.micro_batch=0"]).unwrap_err().to_string();
        assert!(e.contains("train.micro_batch"), "{e}");
        let e = load_str(BASE, &["train.beta2=1.5"]).unwrap_err().to_string();
        assert!(e.contains("train.beta2"), "{e}");
        let e = load_str(BASE, &["train.min_lr=1.0", "train.lr=0.1"]).unwrap_err().to_string();
        assert!(e.contains("train.min_lr"), "{e}");
        let e = load_str(BASE, &["checkpointing.activations=0"]).unwrap_err().to_string();
        assert!(e.contains("positive integer"), "{e}");
        let e = load_str(BASE, &["checkpointing.activations=sometimes"]).unwrap_err().to_string();
        assert!(e.contains("every_layer"), "{e}");
    }

    #[test]
    fn model_family_defaults_to_gpt2_and_unknown_ones_are_named() {
        assert_eq!(load_str(BASE, &[]).expect("valid").model.family, ModelFamily::Gpt2);
        let c = load_str(BASE, &["model.family=\"gpt2\""]).expect("valid");
        assert_eq!(c.model.family, ModelFamily::Gpt2);
        let e = load_str(BASE, &["model.family=\"gpt3\""]).unwrap_err().to_string();
        assert!(e.contains("unknown model.family \"gpt3\"") && e.contains("\"gpt2\", \"llama\""), "{e}");
    }

    #[test]
    fn gemm_tuning_takes_its_three_values_and_names_a_wrong_one() {
        assert_eq!(load_str(BASE, &[]).expect("valid").train.gemm_tuning, GemmTuning::Timed);
        let c = load_str(BASE, &["train.gemm_tuning=\"heuristic\""]).expect("valid");
        assert_eq!(c.train.gemm_tuning, GemmTuning::Heuristic);
        let c = load_str(BASE, &["train.gemm_tuning=\"searched\""]).expect("valid");
        assert_eq!(c.train.gemm_tuning, GemmTuning::Searched);
        let c =
            load_str(BASE, &["train.gemm_tuning=\"searched\"", "train.gemm_tuning_from=\"runs/a\""]).expect("valid");
        assert_eq!(c.train.gemm_tuning_from, Some(PathBuf::from("runs/a")));
        let e = load_str(BASE, &["train.gemm_tuning=\"fast\""]).unwrap_err().to_string();
        assert!(
            e.contains("gemm_tuning") && e.contains("heuristic") && e.contains("timed") && e.contains("searched"),
            "{e}"
        );
        // Stored choices are timed ones: asking for them with the heuristic is a contradiction.
        let c = load_str(BASE, &["train.gemm_tuning_from=\"runs/a\""]).expect("valid");
        assert_eq!(c.train.gemm_tuning_from, Some(PathBuf::from("runs/a")));
        let e = load_str(BASE, &["train.gemm_tuning_from=\"runs/a\"", "train.gemm_tuning=\"heuristic\""])
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.gemm_tuning_from") && e.contains("\"timed\""), "{e}");
    }

    #[test]
    fn keep_gelu_takes_true_false_or_auto() {
        assert_eq!(load_str(BASE, &[]).expect("valid").checkpointing.keep_gelu, KeepGelu::Auto);
        for (v, want) in [("true", KeepGelu::Keep), ("false", KeepGelu::Recompute), ("\"auto\"", KeepGelu::Auto)] {
            let c = load_str(BASE, &[&format!("checkpointing.keep_gelu={v}")]).expect("valid");
            assert_eq!(c.checkpointing.keep_gelu, want, "{v}");
            // The resolved config the ranks read says the same.
            let text = toml::to_string(&c).expect("toml");
            assert!(text.contains(&format!("keep_gelu = {v}")), "{text}");
            assert_eq!(Config::from_toml_str(&text, "resolved").expect("back").checkpointing.keep_gelu, want);
        }
        assert!(!KeepGelu::Auto.keeps() && KeepGelu::Keep.keeps() && !KeepGelu::Recompute.keeps());
        let e = load_str(BASE, &["checkpointing.keep_gelu=\"yes\""]).unwrap_err().to_string();
        assert!(e.contains("\"yes\"") && e.contains("\"auto\""), "{e}");
        // Auto with every block checkpointed is fine (it recomputes); true is refused.
        load_str(BASE, &["checkpointing.activations=\"every_layer\""]).expect("auto stays valid");
    }

    #[test]
    fn precision_takes_bf16_or_fp8_and_names_a_wrong_one() {
        assert_eq!(load_str(BASE, &[]).expect("valid").train.precision, Precision::Bf16);
        let c = load_str(BASE, &["train.precision=\"fp8\""]).expect("valid");
        assert_eq!(c.train.precision, Precision::Fp8);
        let e = load_str(BASE, &["train.precision=\"fp4\""]).unwrap_err().to_string();
        assert!(e.contains("precision") && e.contains("bf16") && e.contains("fp8"), "{e}");
    }

    #[test]
    fn the_fp8_recipe_is_summarised_for_the_launch_log() {
        assert_eq!(load_str(BASE, &[]).expect("valid").train.fp8_recipe_summary(), None);
        let c = load_str(BASE, &["train.precision=\"fp8\""]).expect("valid");
        let line = c.train.fp8_recipe_summary().expect("fp8");
        assert!(line.contains("e5m2 output gradients") && line.contains("weight gradient in FP8"), "{line}");
        let c = load_str(
            BASE,
            &["train.precision=\"fp8\"", "train.fp8_grad_format=\"e4m3\"", "train.fp8_weight_grad=\"bf16\""],
        )
        .expect("valid");
        let line = c.train.fp8_recipe_summary().expect("fp8");
        assert!(
            line.contains("e4m3 output gradients") && line.contains("weight gradient from the unquantized"),
            "{line}"
        );
    }

    #[test]
    fn fp8_bf16_layers_are_named_by_family_and_refused_outside_fp8() {
        let fp8 = "train.precision=\"fp8\"";
        let c = load_str(BASE, &[fp8, "train.fp8_bf16_layers=[\"proj\", \"fc2\"]"]).expect("valid");
        assert_eq!(c.train.fp8_bf16_layers, ["proj", "fc2"]);
        assert_eq!(c.model.family.bf16_layers(&c.train.fp8_bf16_layers), [false, true, false, true]);
        let line = c.train.fp8_recipe_summary().expect("fp8");
        assert!(line.contains("kept in bf16: proj, fc2"), "{line}");
        // Llama's names are not GPT-2's: the error lists the family's.
        let e = load_str(BASE, &[fp8, "train.fp8_bf16_layers=[\"o\"]"]).unwrap_err().to_string();
        assert!(e.contains("train.fp8_bf16_layers") && e.contains("\"o\"") && e.contains("\"proj\""), "{e}");
        let e = load_str(BASE, &[fp8, "train.fp8_bf16_layers=[\"fc\", \"fc\"]"]).unwrap_err().to_string();
        assert!(e.contains("listed twice"), "{e}");
        // In bf16 it would change nothing: refused, with what to do; empty is fine.
        let e = load_str(BASE, &["train.fp8_bf16_layers=[\"proj\"]"]).unwrap_err().to_string();
        assert!(e.contains("train.fp8_bf16_layers") && e.contains("train.precision"), "{e}");
        load_str(BASE, &["train.fp8_bf16_layers=[]"]).expect("valid");
    }

    #[test]
    fn fp8_backward_recipe_keys_parse_and_are_refused_outside_fp8() {
        let fp8 = "train.precision=\"fp8\"";
        let c = load_str(BASE, &[fp8]).expect("valid");
        assert_eq!((c.train.fp8_grad_format, c.train.fp8_weight_grad), (Fp8GradFormat::E5m2, Fp8WeightGrad::Fp8));
        let c =
            load_str(BASE, &[fp8, "train.fp8_grad_format=\"e4m3\"", "train.fp8_weight_grad=\"bf16\""]).expect("valid");
        assert_eq!((c.train.fp8_grad_format, c.train.fp8_weight_grad), (Fp8GradFormat::E4m3, Fp8WeightGrad::Bf16));
        let e = load_str(BASE, &[fp8, "train.fp8_grad_format=\"e3m4\""]).unwrap_err().to_string();
        assert!(e.contains("fp8_grad_format") && e.contains("e5m2") && e.contains("e4m3"), "{e}");
        let e = load_str(BASE, &[fp8, "train.fp8_weight_grad=\"fp32\""]).unwrap_err().to_string();
        assert!(e.contains("fp8_weight_grad") && e.contains("bf16"), "{e}");
        // In bf16 they would change nothing: refused, named, with what to do.
        let e = load_str(BASE, &["train.fp8_grad_format=\"e4m3\""]).unwrap_err().to_string();
        assert!(e.contains("train.fp8_grad_format") && e.contains("train.precision"), "{e}");
        let e = load_str(BASE, &["train.fp8_weight_grad=\"bf16\""]).unwrap_err().to_string();
        assert!(e.contains("train.fp8_weight_grad") && e.contains("train.precision"), "{e}");
        // The defaults spelled out are fine in bf16.
        load_str(BASE, &["train.fp8_grad_format=\"e5m2\"", "train.fp8_weight_grad=\"fp8\""]).expect("valid");
    }

    /// Every config shipped in configs/ loads and validates.
    #[test]
    fn shipped_configs_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).expect("configs/") {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "toml") {
                Config::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                n += 1;
            }
        }
        assert!(n >= 8, "only {n} configs found in {}", dir.display());
    }

    #[test]
    fn keys_that_would_do_nothing_are_errors() {
        let e = load_str(BASE, &["zero.bucket_mb=25"]).unwrap_err().to_string();
        assert!(e.contains("zero.bucket_mb") && e.contains("removed"), "{e}");
        // offload.params is a ZeRO-3 feature on top of the host optimizer.
        let e = load_str(BASE, &["offload.params=true"]).unwrap_err().to_string();
        assert!(e.contains("offload.params") && e.contains("offload.optimizer = true"), "{e}");
        let e = load_str(BASE, &["offload.params=true", "offload.optimizer=true"]).unwrap_err().to_string();
        assert!(e.contains("offload.params") && e.contains("zero.stage = 3"), "{e}");
        load_str(BASE, &["offload.params=true", "offload.optimizer=true", "zero.stage=3"]).expect("valid");
        load_str(BASE, &["offload.params=true", "offload.optimizer=true", "zero.stage=3", "train.grad_accum=2"])
            .expect("parameter offload with gradient accumulation is valid");
        load_str(BASE, &["offload.optimizer=true", "offload.cpu_threads=4"]).expect("valid");
        // The delayed update is a schedule of the host optimizer, not of the host parameters.
        let e = load_str(BASE, &["offload.delayed_update=true"]).unwrap_err().to_string();
        assert!(e.contains("offload.delayed_update") && e.contains("offload.optimizer = true"), "{e}");
        let both = ["offload.delayed_update=true", "offload.optimizer=true", "offload.params=true", "zero.stage=3"];
        let e = load_str(BASE, &both).unwrap_err().to_string();
        assert!(e.contains("offload.delayed_update") && e.contains("offload.params"), "{e}");
        load_str(BASE, &["offload.delayed_update=true", "offload.optimizer=true"]).expect("valid");
    }

    #[test]
    fn overrides_apply_and_bad_ones_are_explained() {
        let c =
            load_str(BASE, &["zero.stage=3", "train.lr=1e-4", "checkpointing.activations=every_layer", "data.path=/x"])
                .expect("valid");
        assert_eq!(c.zero.stage, 3);
        assert_eq!(c.train.lr, 1e-4);
        assert_eq!(c.checkpointing.activations, ActivationCheckpointing::EveryLayer);
        assert_eq!(c.data.path, Some(PathBuf::from("/x")));
        let e = load_str(BASE, &["checkpointing.keep_attention=true"]).unwrap_err().to_string();
        assert!(e.contains("checkpointing.keep_attention") && e.contains("checkpointing.activations"), "{e}");
        load_str(BASE, &["checkpointing.keep_attention=true", "checkpointing.activations=2"]).expect("valid");
        let e = load_str(BASE, &["checkpointing.keep_gelu=true", "checkpointing.activations=\"every_layer\""])
            .unwrap_err()
            .to_string();
        assert!(e.contains("checkpointing.keep_gelu") && e.contains("every block is"), "{e}");
        load_str(BASE, &["checkpointing.keep_gelu=true", "checkpointing.activations=2"]).expect("valid");
        load_str(BASE, &["checkpointing.keep_gelu=true"]).expect("valid");
        let c = load_str(BASE, &["checkpointing.activations=2"]).expect("valid");
        assert_eq!(c.checkpointing.activations, ActivationCheckpointing::Every(2));
        let e = load_str(BASE, &["zero.stage"]).unwrap_err().to_string();
        assert!(e.contains("section.key=value"), "{e}");
        let e = load_str(BASE, &["stage=3"]).unwrap_err().to_string();
        assert!(e.contains("section.key"), "{e}");
        let e = load_str(BASE, &["zero.nonsense=3"]).unwrap_err().to_string();
        assert!(e.contains("nonsense"), "{e}");
    }

    #[test]
    fn missing_file_and_bad_toml_are_reported() {
        let e = Config::load(Path::new("/definitely/not/here.toml"), &[]).unwrap_err().to_string();
        assert!(e.contains("/definitely/not/here.toml"), "{e}");
        let e = load_str("[model\n", &[]).unwrap_err().to_string();
        assert!(e.contains("c.toml"), "{e}");
    }

    #[test]
    fn shapes_beyond_any_machine_are_refused_naming_the_key() {
        let cases: [(&[&str], &str); 4] = [
            (&["model.n_layer=100000"], "model.n_layer"),
            (&["model.n_embd=230000", "model.n_head=1000", "model.n_layer=2000"], "1.270e15 parameters"),
            (&["model.n_embd=18446744073709551615", "model.n_head=1"], "model.n_embd"),
            (&["train.micro_batch=4000000000"], "train.micro_batch"),
        ];
        for (set, needle) in cases {
            let e = load_str(BASE, set).unwrap_err().to_string();
            assert!(e.contains(needle), "{set:?}: {e}");
        }
        let e = load_str(BASE, &["model.seq_len=100000000", "train.micro_batch=1"]).unwrap_err().to_string();
        assert!(e.contains("model.seq_len") && e.contains("activation values"), "{e}");
        // The largest shipped config is far inside every bound.
        load_str(BASE, &["model.n_layer=59", "model.n_head=72", "model.n_embd=9216", "model.vocab_size=50304"])
            .expect("60B");
    }

    #[test]
    fn checkpoint_policy_selects_blocks() {
        assert!(!ActivationCheckpointing::None.is_checkpointed(0));
        assert!(ActivationCheckpointing::EveryLayer.is_checkpointed(3));
        let e2 = ActivationCheckpointing::Every(2);
        assert!(e2.is_checkpointed(0) && !e2.is_checkpointed(1) && e2.is_checkpointed(2));
    }
}
