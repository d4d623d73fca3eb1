//! `[model]`: the model's family and shape, and the checks on its keys.

use super::{bad, ConfigError, ModelFamily};
use crate::backend::RopeScaling;
use serde::{Deserialize, Serialize};

/// The model: its family and shape. The keys after `seq_len` belong to the Llama family
/// (their names are transformers' `LlamaConfig`'s); each family refuses the keys it has no
/// use for ([`ModelFamily::validate`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model family (`"gpt2"`, `"llama"`); an unknown name is an error listing the known ones.
    #[serde(default)]
    pub family: ModelFamily,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention (query) heads; divides `n_embd` (head size = n_embd / n_head).
    pub n_head: usize,
    /// The residual stream's width C.
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
    /// Llama 3.1's RoPE frequency scaling (transformers' `rope_scaling` with `rope_type =
    /// "llama3"`), a table of `factor`, `low_freq_factor`, `high_freq_factor` and
    /// `original_max_position_embeddings`; unset: none.
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

    /// Reject impossible shapes, then the keys the family refuses ([`ModelFamily::validate`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let m = self;
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
        m.family.validate(m)
    }
}

/// Every `[model]` key by its full name (errors name keys as `&'static str`).
pub(super) const MODEL_KEYS: [&str; 12] = [
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
