//! Models: what every decoder family shares, and one folder per family.
//!
//! - `units.rs`: the parameter layout as flat units (what the ZeRO engine shards);
//! - `schedule.rs`: [`DecoderModel`], the per-unit hooks a family implements, and the
//!   micro-step schedule that drives them through the engine (gather, prefetch, release,
//!   reduce);
//! - `gpt2/`: the GPT-2 family (layout, init, blocks, Hugging Face names).
//!
//! [`ModelFamily`] is `model.family` in the config; adding a family means a folder beside
//! `gpt2/`, a variant here, and its arms in `ModelFamily`'s methods.

pub mod gpt2;
pub mod schedule;
pub mod units;

pub use schedule::{run_micro, step_micro, step_micro_loss, DecoderModel};
pub use units::{ModelLayout, TensorSpec, UnitLayout};

use crate::backend::{BResult, Backend};
use crate::config::{CheckpointingConfig, InitScheme, ModelConfig};
use crate::zero::MemoryLedger;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// A model family (`model.family` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelFamily {
    /// GPT-2: learned positions, LayerNorm, GELU MLP, tied LM head.
    #[default]
    Gpt2,
}

impl ModelFamily {
    /// Every family with its config name.
    pub const ALL: [(&'static str, ModelFamily); 1] = [("gpt2", ModelFamily::Gpt2)];

    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(_, f)| *f == self).map(|(n, _)| *n).expect("every family is listed in ALL")
    }

    /// The family called `name`, or an error listing the known ones.
    pub fn from_name(name: &str) -> Result<ModelFamily, String> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, f)| *f).ok_or_else(|| {
            let known: Vec<String> = Self::ALL.iter().map(|(n, _)| format!("\"{n}\"")).collect();
            format!("unknown model.family \"{name}\": the families built in are {}", known.join(", "))
        })
    }

    /// The parameter layout of `cfg`'s model.
    pub fn layout(self, cfg: &ModelConfig) -> ModelLayout {
        match self {
            ModelFamily::Gpt2 => gpt2::layout::layout(cfg).0,
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
        match self {
            ModelFamily::Gpt2 => gpt2::init::init_unit_range(layout, &layout.units[unit], seed, scheme, range),
        }
    }

    /// The model's activations for micro-batch `b`, counted in `ledger`.
    pub fn build<B: Backend>(
        self,
        be: &B,
        layout: &ModelLayout,
        b: usize,
        ckpt: &CheckpointingConfig,
        ledger: &mut MemoryLedger,
    ) -> BResult<Box<dyn DecoderModel<B>>> {
        Ok(match self {
            ModelFamily::Gpt2 => Box::new(gpt2::Gpt2::new(be, layout, b, ckpt, ledger)?),
        })
    }

    /// Forward+backward FLOPs per token (for MFU).
    pub fn flops_per_token(self, layout: &ModelLayout) -> f64 {
        match self {
            ModelFamily::Gpt2 => gpt2::layout::flops_per_token(layout),
        }
    }

    /// The family's Hugging Face names and layouts.
    pub fn hf(self) -> &'static dyn HfFormat {
        match self {
            ModelFamily::Gpt2 => &gpt2::Gpt2Hf,
        }
    }
}

impl Serialize for ModelFamily {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for ModelFamily {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        ModelFamily::from_name(&name).map_err(serde::de::Error::custom)
    }
}

/// How a family's tensors map to Hugging Face transformers' names and layouts (export to
/// and import from a model folder: `checkpoint/hf/`).
pub trait HfFormat: Sync {
    /// The folder's `config.json` for a model of shape `cfg`: what transformers'
    /// `from_pretrained` needs to build the model these weights fit (`architectures`,
    /// `model_type`, the shape, `torch_dtype`: float32, as export writes it).
    fn hf_config(&self, cfg: &ModelConfig) -> serde_json::Value;
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
