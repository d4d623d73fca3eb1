//! `model.family`: which decoder family the config names. The config owns the names and
//! the family's rules on the `[model]` keys (each family refuses the keys it has no use
//! for); `model/` builds the family (layouts, blocks, Hugging Face names) by matching on it.

use super::{bad, ConfigError, ModelConfig};
use serde::{Deserialize, Serialize};

/// A model family (`model.family` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelFamily {
    /// GPT-2: learned positions, LayerNorm, GELU MLP, tied LM head.
    #[default]
    Gpt2,
    /// Llama (2, 3, 3.1, 3.2 and models of its shape): RoPE, RMSNorm, SwiGLU MLP,
    /// grouped-query attention, no biases, tied or untied LM head.
    Llama,
}

impl ModelFamily {
    /// Every family with its config name.
    pub const ALL: [(&'static str, ModelFamily); 2] = [("gpt2", ModelFamily::Gpt2), ("llama", ModelFamily::Llama)];

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

    /// The block's linear layers by name, in FP8 layer order (`train.fp8_bf16_layers`
    /// names them; `BlockLocs::linears` lists them in this order).
    pub fn linear_names(self) -> [&'static str; 4] {
        match self {
            ModelFamily::Gpt2 => ["qkv", "proj", "fc", "fc2"],
            ModelFamily::Llama => ["qkv", "o", "gate_up", "down"],
        }
    }

    /// Refuse `cfg`'s keys that this family does not use or cannot take, naming the key.
    pub fn validate(self, cfg: &ModelConfig) -> Result<(), ConfigError> {
        match self {
            ModelFamily::Gpt2 => validate_gpt2(cfg),
            ModelFamily::Llama => validate_llama(cfg),
        }
    }
}

/// GPT-2 has one shape of block: the Llama family's keys are refused, naming the key.
fn validate_gpt2(cfg: &ModelConfig) -> Result<(), ConfigError> {
    let set = [
        ("model.n_kv_head", cfg.n_kv_head.is_some()),
        ("model.intermediate_size", cfg.intermediate_size.is_some()),
        ("model.rope_theta", cfg.rope_theta.is_some()),
        ("model.rope_scaling", cfg.rope_scaling.is_some()),
        ("model.rms_norm_eps", cfg.rms_norm_eps.is_some()),
        ("model.tie_embeddings", cfg.tie_embeddings.is_some()),
    ];
    match set.iter().find(|(_, on)| *on) {
        Some((key, _)) => Err(ConfigError::Invalid {
            key,
            value: "set".into(),
            message: "applies to model.family = \"llama\"; GPT-2 (the default family) has multi-head attention, \
                      a 4·n_embd GELU MLP, learned positions, LayerNorm and a tied head: delete the key or set \
                      model.family = \"llama\""
                .into(),
        }),
        None => Ok(()),
    }
}

/// The Llama keys' values a model can be built from, each refusal naming the key.
fn validate_llama(cfg: &ModelConfig) -> Result<(), ConfigError> {
    let f = cfg.intermediate_size.ok_or_else(|| {
        bad(
            "model.intermediate_size",
            "unset",
            "a Llama needs its MLP width (transformers' intermediate_size; Llama 3.2 1B: 8192, Llama 3 8B: 14336)",
        )
    })?;
    if f == 0 {
        return Err(bad("model.intermediate_size", f, "must be at least 1"));
    }
    let nkv = cfg.kv_heads();
    if nkv == 0 || !cfg.n_head.is_multiple_of(nkv) {
        return Err(bad(
            "model.n_kv_head",
            nkv,
            format!(
                "must divide model.n_head = {} (each key/value head serves n_head / n_kv_head query heads)",
                cfg.n_head
            ),
        ));
    }
    if !cfg.head_size().is_multiple_of(2) {
        return Err(bad(
            "model.n_embd",
            cfg.n_embd,
            format!("gives an odd head size {} (n_embd / n_head); RoPE rotates pairs of dimensions", cfg.head_size()),
        ));
    }
    let theta = cfg.rope_theta();
    if !(theta.is_finite() && theta > 1.0) {
        return Err(bad("model.rope_theta", theta, "must be a number > 1 (Llama 3: 500000)"));
    }
    let eps = cfg.rms_norm_eps();
    if !(eps.is_finite() && eps > 0.0) {
        return Err(bad("model.rms_norm_eps", eps, "must be > 0 (Llama 3: 1e-5)"));
    }
    if let Some(sc) = cfg.rope_scaling {
        let ok = sc.factor.is_finite()
            && sc.factor >= 1.0
            && sc.low_freq_factor > 0.0
            && sc.high_freq_factor > sc.low_freq_factor
            && sc.original_max_position_embeddings > 0;
        if !ok {
            return Err(bad(
                "model.rope_scaling",
                format!("{sc:?}"),
                "needs factor >= 1, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0 \
                 (Llama 3.1: factor 8, low 1, high 4, original 8192)",
            ));
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tied: bool) -> ModelConfig {
        ModelConfig {
            family: ModelFamily::Llama,
            n_kv_head: Some(2),
            intermediate_size: Some(40),
            tie_embeddings: Some(tied),
            ..ModelConfig::gpt2(2, 4, 16, 50, 8)
        }
    }

    #[test]
    fn keys_that_cannot_build_a_llama_are_named() {
        let e = ModelFamily::Llama
            .validate(&ModelConfig { intermediate_size: None, ..cfg(false) })
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.intermediate_size"), "{e}");
        let e = ModelFamily::Llama.validate(&ModelConfig { n_kv_head: Some(3), ..cfg(false) }).unwrap_err().to_string();
        assert!(e.contains("model.n_kv_head") && e.contains("divide"), "{e}");
        let e =
            ModelFamily::Llama.validate(&ModelConfig { rope_theta: Some(0.5), ..cfg(false) }).unwrap_err().to_string();
        assert!(e.contains("model.rope_theta"), "{e}");
        let e =
            ModelFamily::Llama.validate(&ModelConfig { n_embd: 12, n_head: 4, ..cfg(false) }).unwrap_err().to_string();
        assert!(e.contains("odd head size"), "{e}");
        ModelFamily::Llama.validate(&cfg(true)).expect("valid");
    }
}
