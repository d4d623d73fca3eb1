//! Models: what every decoder family shares, and one folder per family.
//!
//! - `units.rs`: the parameter layout as flat units (what the ZeRO engine shards);
//! - `schedule.rs`: [`DecoderModel`], the per-unit hooks a family implements, and the
//!   micro-step schedule that drives them through the engine (gather, prefetch, release,
//!   reduce);
//! - `batch.rs`: one micro-batch (ids, targets, document starts) and its device buffers;
//! - `head.rs`: the LM head and the loss, in chunks of rows (every family's);
//! - `block.rs`: what both families' blocks share (their context, the norm before a linear
//!   layer, which an FP8 layer may apply in its cast);
//! - `checkpointing.rs`: activation checkpointing's saved sets, passes and kept attention;
//! - `init.rs`: random initialisation, per tensor as the family's rule says;
//! - `gpt2/`: the GPT-2 family (layout, blocks, Hugging Face names);
//! - `llama/`: the Llama family (RMSNorm, SwiGLU, RoPE, grouped-query attention).
//!
//! [`ModelFamily`] is `model.family` in the config (`config/family.rs` names the families
//! and checks their keys); adding a family means a folder beside `gpt2/`, a variant there,
//! and its arms in `ModelFamily`'s methods here and there.

pub mod batch;
mod block;
pub mod checkpointing;
pub mod gpt2;
pub mod head;
pub mod init;
pub mod llama;
pub mod schedule;
pub mod units;

pub use crate::config::ModelFamily;
pub use batch::{BatchTokens, MicroBatch};
pub use schedule::{run_micro, step_micro, step_micro_loss, DecoderModel};
pub use units::{Bf16Layers, ModelLayout, TensorSpec, UnitLayout};

use crate::backend::{fp8, BResult, Backend, Fp8Backward, Fp8Layers, Loc, MatShape, Precision};
use crate::config::{CheckpointingConfig, Config, InitScheme, ModelConfig};
use crate::zero::{Category, MemoryLedger};
use init::InitRule;
use std::ops::Range;

/// The families' layouts, blocks and Hugging Face names (the config names the family:
/// `config/family.rs`).
impl ModelFamily {
    /// Which of the block's linear layers (FP8 order) `names` keeps in bf16.
    pub fn bf16_layers(self, names: &[String]) -> Bf16Layers {
        self.linear_names().map(|n| names.iter().any(|m| m == n))
    }

    /// The parameter layout of `cfg`'s model.
    pub fn layout(self, cfg: &ModelConfig) -> ModelLayout {
        match self {
            ModelFamily::Gpt2 => gpt2::layout::layout(cfg).0,
            ModelFamily::Llama => llama::layout::layout(cfg).0,
        }
    }

    /// Initial values of elements `range` of unit `unit`, a pure function of the seed, the
    /// tensor and the index (so any rank, world size and stage makes the same values).
    pub fn init_range(
        self,
        layout: &ModelLayout,
        unit: usize,
        seed: u64,
        scheme: InitScheme,
        range: Range<usize>,
    ) -> Vec<f32> {
        init::init_unit_range(layout, &layout.units[unit], seed, scheme, range)
    }

    /// What tensor `t` is initialised to, given the scheme's (matrix, residual projection)
    /// standard deviations.
    pub fn init_rule(self, t: &TensorSpec, std_all: f64, proj_std: f64) -> InitRule {
        match self {
            ModelFamily::Gpt2 => gpt2::layout::init_rule(t, std_all, proj_std),
            ModelFamily::Llama => llama::layout::init_rule(t, std_all, proj_std),
        }
    }

    /// The model's activations as `opts` sizes them, counted in `ledger`.
    pub fn build<B: Backend>(
        self,
        be: &B,
        layout: &ModelLayout,
        opts: &ModelOptions,
        ledger: &mut MemoryLedger,
    ) -> BResult<Box<dyn DecoderModel<B>>> {
        Ok(match self {
            ModelFamily::Gpt2 => Box::new(gpt2::Gpt2::new(be, layout, opts, ledger)?),
            ModelFamily::Llama => Box::new(llama::Llama::new(be, layout, opts, ledger)?),
        })
    }

    /// Each unit's weights whose GEMMs run in FP8 over `rows` rows (`train.precision =
    /// "fp8"`): the blocks' linear layers of an eligible shape (`fp8::eligible`) but those
    /// kept in bf16 (`bf16`), what ZeRO-3's FP8 gathers send as FP8 (`zero.fp8_gather`);
    /// none in the other units.
    pub fn fp8_weights(self, layout: &ModelLayout, rows: usize, bf16: Bf16Layers) -> Vec<Vec<Loc>> {
        self.fp8_weight_layers(layout, rows, bf16).into_iter().map(|ws| ws.into_iter().map(|w| w.0).collect()).collect()
    }

    /// [`ModelFamily::fp8_weights`], each with its FP8 layer (`l · linears + k` for layer
    /// `k` of block `l`, as `prepare_precision` numbers them).
    pub fn fp8_weight_layers(self, layout: &ModelLayout, rows: usize, bf16: Bf16Layers) -> Vec<Vec<(Loc, usize)>> {
        let cfg = &layout.cfg;
        // The linears the models give `prepare_precision`, and where their weights are.
        let linears = match self {
            ModelFamily::Gpt2 => gpt2::layout::layout(cfg).1.block.linears(cfg),
            ModelFamily::Llama => llama::layout::layout(cfg).1.block.linears(cfg),
        };
        let per_block = linears.len();
        let eligible: Vec<(Loc, usize)> = linears
            .into_iter()
            .zip(bf16)
            .enumerate()
            .filter(|&(_, ((_, c, oc), kept))| {
                !kept && crate::backend::fp8::eligible(crate::backend::MatShape { n: rows, c, oc })
            })
            .map(|(k, ((w, ..), _))| (w, k))
            .collect();
        (0..layout.units.len())
            .map(|u| match u.checked_sub(1).filter(|&l| l < cfg.n_layer) {
                Some(l) => eligible.iter().map(|&(w, k)| (w, l * per_block + k)).collect(),
                None => Vec::new(),
            })
            .collect()
    }

    /// Forward+backward FLOPs per token (for MFU).
    pub fn flops_per_token(self, layout: &ModelLayout) -> f64 {
        match self {
            ModelFamily::Gpt2 => gpt2::layout::flops_per_token(layout),
            ModelFamily::Llama => llama::layout::flops_per_token(layout),
        }
    }

    /// The weights a checkpointed block's recompute multiplies (its forward up to the MLP's
    /// activation: every matrix but the last projection), for `launcher plan`'s FLOPs.
    pub fn recomputed_weights(self, cfg: &ModelConfig) -> usize {
        let c = cfg.n_embd;
        match self {
            // qkv 3C², proj C², fc 4C²
            ModelFamily::Gpt2 => 8 * c * c,
            // qkv C·(nh + 2·nkv)·hs, o C², gate/up 2·F·C
            ModelFamily::Llama => {
                c * (cfg.n_head + 2 * cfg.kv_heads()) * cfg.head_size()
                    + c * c
                    + 2 * cfg.intermediate_size.unwrap_or(0) * c
            }
        }
    }

    /// The family whose transformers `model_type` (in `config.json`) is `t`.
    pub fn from_hf_model_type(t: &str) -> Option<ModelFamily> {
        match t {
            "gpt2" => Some(ModelFamily::Gpt2),
            "llama" => Some(ModelFamily::Llama),
            _ => None,
        }
    }

    /// The family's Hugging Face names and layouts.
    pub fn hf(self) -> &'static dyn HfFormat {
        match self {
            ModelFamily::Gpt2 => &gpt2::Gpt2Hf,
            ModelFamily::Llama => &llama::LlamaHf,
        }
    }
}

/// What sizes a model's activations besides its shape: the micro-batch, activation
/// checkpointing, and the LM head's chunks.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOptions {
    /// Sequences per micro-step.
    pub micro_batch: usize,
    pub checkpointing: CheckpointingConfig,
    /// Rows of logits the LM head makes at a time (`train.loss_chunk_rows`; 0 = automatic).
    pub loss_chunk_rows: usize,
    /// The blocks' linear layers' GEMM precision (`train.precision`); the LM head stays in
    /// bf16 whatever this says.
    pub precision: Precision,
    /// FP8: the first this many blocks keep their linear layers' weights cast to FP8 from one
    /// parameter version to the next (`train.fp8_weight_cache`); the others cast at each use.
    pub fp8_cached_blocks: usize,
    /// FP8: the backward's output-gradient format and dW precision (`train.fp8_grad_format`,
    /// `train.fp8_weight_grad`).
    pub fp8_backward: Fp8Backward,
    /// FP8: the block's linear layers kept in bf16 (`train.fp8_bf16_layers`, FP8 order).
    pub fp8_bf16_layers: Bf16Layers,
    /// Attention and positions within documents (`data.document_mask`): every micro-batch
    /// then brings its document starts ([`MicroBatch::docs`]), kept in a buffer of their own.
    pub document_mask: bool,
}

impl ModelOptions {
    pub fn from_config(cfg: &Config) -> ModelOptions {
        ModelOptions {
            micro_batch: cfg.train.micro_batch,
            checkpointing: cfg.checkpointing.clone(),
            loss_chunk_rows: cfg.train.loss_chunk_rows,
            precision: cfg.train.precision,
            fp8_cached_blocks: cfg.train.fp8_weight_cache.cached_blocks(cfg.model.n_layer, cfg.zero.stage),
            fp8_backward: Fp8Backward { grad: cfg.train.fp8_grad_format, weight_grad: cfg.train.fp8_weight_grad },
            fp8_bf16_layers: cfg.model.family.bf16_layers(&cfg.train.fp8_bf16_layers),
            document_mask: cfg.data.document_mask,
        }
    }

    /// Micro-batch `b` with the defaults otherwise (no checkpointing, automatic chunks, bf16,
    /// FP8 weights cast at each use: right on every stage; no document masking).
    pub fn batch(b: usize) -> ModelOptions {
        ModelOptions {
            micro_batch: b,
            checkpointing: CheckpointingConfig::default(),
            loss_chunk_rows: 0,
            precision: Precision::Bf16,
            fp8_cached_blocks: 0,
            fp8_backward: Fp8Backward::default(),
            fp8_bf16_layers: [false; 4],
            document_mask: false,
        }
    }
}

/// In FP8 layer order, the block's layer whose input is the MLP's activation output (GPT-2's
/// `fc2`, Llama's `down`): both families' fourth.
const MLP_OUT: usize = 3;

/// Linear layers per block in both families (qkv, the attention's output projection, the
/// MLP's input and output layers): block `l`'s FP8 layers are `l · 4 .. l · 4 + 4`.
pub(crate) const LINEARS_PER_BLOCK: usize = 4;

/// Whether block `layer`'s FP8 layer `k` keeps its input's codes (`kept`: [`fp8_kept_inputs`]).
pub(crate) fn keeps_codes(kept: &[bool], layer: usize, k: usize) -> bool {
    kept.get(layer * LINEARS_PER_BLOCK + k).copied().unwrap_or(false)
}

/// Before block `layer`'s forward (not a recompute): its FP8 layers' amax sinks zeroed
/// together (`MatmulOps::fp8_clear_sinks`) instead of one by one by their producers.
pub(crate) fn clear_block_sinks<B: Backend>(be: &B, layer: usize) -> BResult<()> {
    let first = layer * LINEARS_PER_BLOCK;
    be.fp8_clear_sinks(first..first + LINEARS_PER_BLOCK)
}

/// Per FP8 layer (`l · linears.len() + k`, as [`prepare_precision`] numbers them), whether its
/// forward keeps its input's e4m3 codes for its backward's weight gradient
/// ([`crate::backend::Fp8Layer::keeps_input`]): every layer in FP8 at an eligible shape of a
/// block that is not checkpointed (its backward always follows its own forward; a
/// checkpointed block's recompute stops before its last layer), with the FP8 dW
/// (`train.fp8_weight_grad = "fp8"`). The MLP's last
/// layer only where `checkpointing.keep_gelu` keeps its input: in FP8 the codes are what is
/// kept (a byte a value instead of the bf16 activation's two), else the backward recomputes
/// the activation as in bf16.
pub(crate) fn fp8_kept_inputs(
    opts: &ModelOptions,
    rows: usize,
    linears: &[(usize, usize)],
    n_layer: usize,
) -> Vec<bool> {
    let on = opts.precision == Precision::Fp8 && opts.fp8_backward.weight_grad_in_fp8();
    (0..n_layer)
        .flat_map(|l| {
            linears.iter().enumerate().map(move |(k, &(c, oc))| {
                on && !opts.checkpointing.activations.is_checkpointed(l)
                    && !opts.fp8_bf16_layers.get(k).copied().unwrap_or(false)
                    && fp8::eligible(MatShape { n: rows, c, oc })
                    && (k != MLP_OUT || opts.checkpointing.keep_gelu.keeps())
            })
        })
        .collect()
}

/// Whether the MLP's last layer keeps its input's codes ([`fp8_kept_inputs`]' `kept`, of
/// blocks of `per_block` linear layers): in every block that is not checkpointed, or in none.
/// Where it does, the family keeps no copy of the activation of its own (`keep_gelu`'s).
pub(crate) fn mlp_out_keeps_codes(kept: &[bool], per_block: usize) -> bool {
    kept.iter().skip(MLP_OUT).step_by(per_block).any(|&k| k)
}

/// Get `be` ready for the blocks' GEMMs in `opts.precision`: for FP8, the backend refuses a
/// device without FP8 GEMMs (before any step) and reserves its operand workspace for the
/// largest of `linears` (`(inputs, outputs)` of one block's layers, over `rows` rows), the
/// `n_layer` blocks' per-layer scales, the first `opts.fp8_cached_blocks` blocks' cached
/// weights and the inputs `kept` ([`fp8_kept_inputs`]) keeps: counted in `ledger` (the cache
/// as parameters, the kept codes as activations). Layer `k` of block `l` is FP8 layer
/// `l · linears.len() + k`; a layer kept in bf16 (`opts.fp8_bf16_layers`) keeps its number
/// with nothing reserved for it (no weight, no workspace share). Every family calls it once
/// from its constructor.
pub(crate) fn prepare_precision<B: Backend>(
    be: &B,
    opts: &ModelOptions,
    rows: usize,
    linears: &[(usize, usize)],
    n_layer: usize,
    kept: &[bool],
    ledger: &mut MemoryLedger,
) -> BResult<()> {
    if opts.precision == Precision::Fp8 {
        let linears: Vec<(usize, usize)> =
            linears.iter().zip(opts.fp8_bf16_layers).map(|(&l, kept)| if kept { (0, 0) } else { l }).collect();
        let layers = Fp8Layers::blocks(rows, &linears, n_layer, opts.fp8_cached_blocks)
            .with_backward(opts.fp8_backward)
            .with_kept_inputs(kept.to_vec())
            .with_step_codes(true);
        let got = be.prepare_fp8(&layers)?;
        ledger.alloc(Category::Workspace, got.workspace);
        ledger.alloc(Category::Params, got.weight_cache);
        ledger.alloc(Category::Activations, got.kept_inputs);
    }
    Ok(())
}

/// How a family's tensors map to Hugging Face transformers' names and layouts (export to
/// and import from a model folder: `checkpoint/hf/`).
pub trait HfFormat: Sync {
    /// The folder's `config.json` for a model of shape `cfg`: what transformers'
    /// `from_pretrained` needs to build the model these weights fit (`architectures`,
    /// `model_type`, the shape, `torch_dtype`: float32, as export writes it).
    fn hf_config(&self, cfg: &ModelConfig) -> serde_json::Value;
    /// The `[model]` section a folder's `config.json` describes, at sequence length
    /// `seq_len` (transformers' configs hold the longest context, not the trained one;
    /// unset: the family's default), or what this family cannot run of it, naming the key.
    fn model_config(&self, json: &serde_json::Value, seq_len: Option<usize>) -> Result<ModelConfig, String>;
    /// Whether our tensor `t` is Hugging Face's element for element when the shapes agree
    /// (no transpose or permutation), so an import may read just a range of it.
    fn same_layout(&self, t: &TensorSpec) -> bool;
    /// The Hugging Face name of one of our tensors.
    fn hf_name(&self, t: &TensorSpec) -> String;
    /// The names an import accepts for it, in order of preference.
    fn import_names(&self, t: &TensorSpec) -> Vec<String>;
    /// Its shape in the Hugging Face layout.
    fn hf_shape(&self, t: &TensorSpec) -> Vec<usize>;
    /// Our values → the Hugging Face layout.
    fn to_hf(&self, t: &TensorSpec, values: Vec<f32>) -> Vec<f32>;
    /// A Hugging Face tensor of shape `shape` → our values for `t`, or what is wrong with
    /// it (naming the config key to change).
    fn import_hf(&self, t: &TensorSpec, values: &[f32], shape: &[usize]) -> Result<Vec<f32>, String>;
}
