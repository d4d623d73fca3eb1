//! `[train]`: the optimisation hyper-parameters, the GEMMs' precision and tuning, and the
//! checks that need only this section.

use super::{bad, ConfigError};
use crate::backend::{Fp8GradFormat, Fp8WeightGrad, GemmTuning, Precision};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
    /// The peak learning rate, reached at the end of the warmup.
    pub lr: f32,
    /// The learning rate the cosine decay reaches at the last step (between 0 and `lr`).
    pub min_lr: f32,
    /// Steps of linear warmup to `lr`; then cosine decay to `min_lr` at the last step.
    pub warmup_steps: usize,
    /// AdamW's decoupled weight decay (the matrices only).
    pub weight_decay: f32,
    /// AdamW's first-moment decay, in [0, 1).
    pub beta1: f32,
    /// AdamW's second-moment decay, in [0, 1).
    pub beta2: f32,
    /// AdamW's epsilon (added to the second moment's square root).
    pub eps: f32,
    /// Global gradient-norm clip; 0 disables clipping.
    pub grad_clip: f32,
    /// The seed of the random initial weights and of the data's order.
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

    /// Reject impossible values of this section's keys, and the FP8 keys outside FP8.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let t = self;
        if t.steps == 0 {
            return Err(bad("train.steps", t.steps, "must be at least 1 (the number of optimizer steps to run)"));
        }
        if t.micro_batch == 0 {
            return Err(bad("train.micro_batch", t.micro_batch, "must be at least 1"));
        }
        if t.grad_accum == 0 {
            return Err(bad("train.grad_accum", t.grad_accum, "must be at least 1"));
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
        if let (GemmTuning::Heuristic, Some(p)) = (t.gemm_tuning, &t.gemm_tuning_from) {
            return Err(bad(
                "train.gemm_tuning_from",
                p.display(),
                "applies to train.gemm_tuning = \"timed\" or \"searched\" (stored timed choices), and \
                 \"heuristic\" picks no stored algorithm; set train.gemm_tuning = \"timed\" or drop gemm_tuning_from",
            ));
        }
        Ok(())
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
