//! `[checkpointing]`: activation checkpointing (which blocks recompute their forward in
//! backward) and what the blocks keep besides.

use super::{bad, ConfigError};
use serde::{Deserialize, Serialize};

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

/// Activation checkpointing: which blocks keep only their input and recompute their
/// forward during backward, and what they keep besides.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointingConfig {
    /// `"none"` (keep every activation), `"every_layer"`, or k: the blocks whose index is a
    /// multiple of k.
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

impl CheckpointingConfig {
    /// `keep_attention` needs checkpointed blocks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.keep_attention && self.activations == ActivationCheckpointing::None {
            return Err(bad(
                "checkpointing.keep_attention",
                true,
                "applies to checkpointed blocks, and checkpointing.activations = \"none\" checkpoints none; \
                 set checkpointing.activations (\"every_layer\" or k) or drop keep_attention",
            ));
        }
        Ok(())
    }
}
