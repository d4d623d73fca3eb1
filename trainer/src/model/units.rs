//! Parameter layout shared by every decoder family: the model's tensors grouped into
//! *units*, each one flat buffer.
//!
//! A unit is what the ZeRO engine gathers, reduces and shards as one piece (one
//! all-gather per block, never one per tensor). The decoder convention: unit 0 holds the
//! embeddings (and whatever else the family keeps outside the blocks, e.g. the final
//! norm), units `1..=n_layer` are the blocks in order, and the LM head lives in
//! `head_unit` (unit 0 when it is tied to the token embedding, as in GPT-2).

use crate::backend::Loc;
use crate::config::ModelConfig;

/// One tensor inside a unit's flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub loc: Loc,
    /// Matrices get weight decay; biases and norm parameters do not.
    pub decay: bool,
}

/// One flat parameter group.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitLayout {
    pub name: String,
    pub tensors: Vec<TensorSpec>,
    /// Elements used by tensors (before padding to the world size).
    pub numel: usize,
}

impl UnitLayout {
    pub fn new(name: impl Into<String>) -> UnitLayout {
        UnitLayout { name: name.into(), tensors: vec![], numel: 0 }
    }

    /// Append a tensor; matrices (2 or more dimensions) get weight decay.
    pub fn push(&mut self, name: String, shape: &[usize]) -> Loc {
        let len: usize = shape.iter().product();
        let loc = Loc::new(self.numel, len);
        self.tensors.push(TensorSpec { name, shape: shape.to_vec(), loc, decay: shape.len() >= 2 });
        self.numel += len;
        loc
    }
}

/// The whole model's layout.
#[derive(Debug, Clone)]
pub struct ModelLayout {
    pub cfg: ModelConfig,
    pub units: Vec<UnitLayout>,
    /// The unit holding the LM head (the embedding unit when the head is tied to it).
    pub head_unit: usize,
}

impl ModelLayout {
    /// The layout of `cfg`'s model family.
    pub fn new(cfg: &ModelConfig) -> ModelLayout {
        cfg.family.layout(cfg)
    }

    /// Total parameters (a tied head counted once).
    pub fn num_params(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// The embedding unit.
    pub const EMBED_UNIT: usize = 0;

    /// Unit index of block `l`.
    pub fn block_unit(l: usize) -> usize {
        l + 1
    }

    /// Model FLOPs per token for forward+backward, the convention used for MFU by the
    /// PyTorch and llm.c references.
    pub fn flops_per_token(&self) -> f64 {
        self.cfg.family.flops_per_token(self)
    }
}

/// The block's linear layers kept in bf16 under `train.precision = "fp8"`, in FP8 layer order
/// ([`crate::model::ModelFamily::linear_names`]).
pub type Bf16Layers = [bool; 4];
