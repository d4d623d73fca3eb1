//! Llama in Hugging Face transformers' `LlamaForCausalLM` naming and layouts.
//!
//! Our tensors carry transformers' names and `[out, in]` shapes, so the mapping is the
//! identity, RoPE included: we rotate the pairs of dimensions `(i, i + hs/2)` as
//! transformers' `rotate_half` does, which is the layout of every Hugging Face Llama
//! checkpoint (Meta's original checkpoints pair `(2i, 2i + 1)`, and transformers'
//! converter permutes the rows of `q_proj` and `k_proj` into this layout; we read only the
//! converted form). An imported `embed_tokens` / `lm_head` with fewer rows than
//! `model.vocab_size` is padded with zero rows (a vocabulary rounded up for speed).

use crate::backend::RopeScaling;
use crate::config::ModelConfig;
use crate::model::{HfFormat, ModelFamily, TensorSpec};

/// Llama's mapping to and from Hugging Face.
pub struct LlamaHf;

fn is_vocab_rows(name: &str) -> bool {
    name == "model.embed_tokens.weight" || name == "lm_head.weight"
}

impl HfFormat for LlamaHf {
    fn hf_config(&self, cfg: &ModelConfig) -> serde_json::Value {
        config_json(cfg)
    }

    fn model_config(&self, json: &serde_json::Value, seq_len: Option<usize>) -> Result<ModelConfig, String> {
        model_config(json, seq_len)
    }

    fn same_layout(&self, _t: &TensorSpec) -> bool {
        true
    }

    fn hf_name(&self, t: &TensorSpec) -> String {
        t.name.clone()
    }

    fn import_names(&self, t: &TensorSpec) -> Vec<String> {
        vec![t.name.clone()]
    }

    fn hf_shape(&self, t: &TensorSpec) -> Vec<usize> {
        t.shape.clone()
    }

    fn to_hf(&self, _t: &TensorSpec, values: Vec<f32>) -> Vec<f32> {
        values
    }

    fn import_hf(&self, t: &TensorSpec, vals: &[f32], got: &[usize]) -> Result<Vec<f32>, String> {
        let want = &t.shape;
        if is_vocab_rows(&t.name) && got.len() == 2 && got[1] == want[1] && got[0] != want[0] {
            if got[0] > want[0] {
                return Err(format!(
                    "{} has {} rows but model.vocab_size = {}: raise model.vocab_size to at least {}",
                    t.name, got[0], want[0], got[0]
                ));
            }
            let mut out = vec![0.0f32; want[0] * want[1]];
            out[..vals.len()].copy_from_slice(vals);
            return Ok(out);
        }
        if got != want.as_slice() {
            return Err(format!(
                "{} has shape {got:?}; the config's model needs {want:?} (check model.n_embd, n_head, n_kv_head, \
                 intermediate_size, vocab_size)",
                t.name
            ));
        }
        Ok(vals.to_vec())
    }
}

/// Context length when `[model]` does not give one: a config.json holds the longest the
/// model supports (131072 for Llama 3.1), not a length to train at.
pub const DEFAULT_SEQ_LEN: usize = 2048;

/// The `[model]` section a transformers `LlamaConfig` (`config.json`) describes, at
/// sequence length `seq_len` (unset: [`DEFAULT_SEQ_LEN`], or `max_position_embeddings`
/// if that is shorter). Reads both config layouts: transformers 4's top-level
/// `rope_theta` / `rope_scaling` (Meta's published folders) and transformers 5's
/// `rope_parameters`. Refuses what this family cannot run, naming the key.
pub fn model_config(json: &serde_json::Value, seq_len: Option<usize>) -> Result<ModelConfig, String> {
    let get = |k: &str| json.get(k).filter(|v| !v.is_null());
    let int = |k: &str| -> Result<usize, String> {
        get(k).and_then(|v| v.as_u64()).map(|v| v as usize).ok_or_else(|| format!("config.json has no integer `{k}`"))
    };
    let max_pos = get("max_position_embeddings").and_then(|v| v.as_u64()).map(|v| v as usize);
    let seq_len = seq_len.unwrap_or(max_pos.map_or(DEFAULT_SEQ_LEN, |m| m.min(DEFAULT_SEQ_LEN)));
    let (c, nh) = (int("hidden_size")?, int("num_attention_heads")?);
    if let Some(hd) = get("head_dim").and_then(|v| v.as_u64()) {
        if nh == 0 || hd as usize * nh != c {
            return Err(format!(
                "config.json's head_dim = {hd} is not hidden_size / num_attention_heads = {c} / {nh}: heads of their \
                 own width are not supported"
            ));
        }
    }
    for (k, what) in [("attention_bias", "biases in the attention projections"), ("mlp_bias", "biases in the MLP")] {
        if get(k).and_then(|v| v.as_bool()) == Some(true) {
            return Err(format!("config.json sets {k} = true ({what}): the Llama family has no biases"));
        }
    }
    if let Some(act) = get("hidden_act").and_then(|v| v.as_str()) {
        if act != "silu" {
            return Err(format!("config.json's hidden_act = \"{act}\": the Llama family's MLP is SwiGLU (\"silu\")"));
        }
    }
    // transformers 5 folds the RoPE settings into `rope_parameters`; 4 keeps them on top.
    let rope = get("rope_parameters").or_else(|| get("rope_scaling"));
    let theta = get("rope_parameters")
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| get("rope_theta"))
        .and_then(|v| v.as_f64())
        .unwrap_or(10000.0);
    let rope_type = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))).and_then(|v| v.as_str());
    let rope_scaling = match rope_type {
        None | Some("default") => None,
        Some("llama3") => {
            let r = rope.expect("a rope_type came from it");
            let f = |k: &str| {
                r.get(k).and_then(|v| v.as_f64()).ok_or_else(|| format!("config.json's llama3 RoPE has no `{k}`"))
            };
            Some(RopeScaling {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
            })
        }
        Some(other) => {
            return Err(format!(
            "config.json's RoPE type \"{other}\" is not supported (the Llama family runs \"default\" and \"llama3\")"
        ))
        }
    };
    Ok(ModelConfig {
        family: ModelFamily::Llama,
        n_kv_head: Some(get("num_key_value_heads").and_then(|v| v.as_u64()).map_or(nh, |v| v as usize)),
        intermediate_size: Some(int("intermediate_size")?),
        rope_theta: Some(theta),
        rope_scaling,
        rms_norm_eps: Some(get("rms_norm_eps").and_then(|v| v.as_f64()).unwrap_or(1e-6)),
        tie_embeddings: Some(get("tie_word_embeddings").and_then(|v| v.as_bool()).unwrap_or(false)),
        ..ModelConfig::gpt2(int("num_hidden_layers")?, nh, c, int("vocab_size")?, seq_len)
    })
}

/// The `config.json` of a `LlamaForCausalLM` of `cfg`'s shape, in transformers 4's layout
/// (which transformers 5 reads too), with `max_position_embeddings` the trained context.
pub fn config_json(cfg: &ModelConfig) -> serde_json::Value {
    let mut j = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.intermediate_size.unwrap_or(0),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_size(),
        "vocab_size": cfg.vocab_size,
        // The longest context the RoPE settings are for: the scaled one, or what was trained.
        "max_position_embeddings": cfg.seq_len.max(
            cfg.rope_scaling.map_or(0, |s| (s.original_max_position_embeddings as f64 * s.factor) as usize)
        ),
        "rms_norm_eps": cfg.rms_norm_eps(),
        "rope_theta": cfg.rope_theta(),
        "tie_word_embeddings": cfg.tied(),
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    });
    if let Some(s) = cfg.rope_scaling {
        j["rope_scaling"] = serde_json::json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        });
    }
    j
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3.2 1B's published config.json (transformers 4 layout).
    const LLAMA_32_1B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
      "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
      "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
      "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
      "pretraining_tp": 1, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256}"#;

    #[test]
    fn published_and_transformers_5_configs_read_the_same() {
        let v4: serde_json::Value = serde_json::from_str(LLAMA_32_1B).expect("json");
        let m = model_config(&v4, Some(2048)).expect("llama");
        assert_eq!((m.n_layer, m.n_head, m.kv_heads(), m.n_embd), (16, 32, 8, 2048));
        assert_eq!((m.intermediate_size, m.vocab_size, m.seq_len), (Some(8192), 128256, 2048));
        assert_eq!((m.rope_theta, m.rms_norm_eps, m.tied()), (Some(500000.0), Some(1e-5), true));
        assert_eq!(m.rope_scaling.map(|s| (s.factor, s.original_max_position_embeddings)), Some((32.0, 8192)));
        m.validate().expect("valid");
        // transformers 5 writes the RoPE settings as `rope_parameters`.
        let mut v5 = v4.clone();
        let o = v5.as_object_mut().expect("object");
        let mut rp = o.remove("rope_scaling").expect("rope_scaling");
        rp["rope_theta"] = o.remove("rope_theta").expect("rope_theta");
        o.insert("rope_parameters".into(), rp);
        assert_eq!(model_config(&v5, Some(2048)).expect("llama"), m);
        // What we write reads back as the same model.
        assert_eq!(model_config(&config_json(&m), Some(2048)).expect("llama"), m);
    }

    #[test]
    fn what_the_family_cannot_run_is_named() {
        let mut v: serde_json::Value = serde_json::from_str(LLAMA_32_1B).expect("json");
        v["attention_bias"] = true.into();
        assert!(model_config(&v, Some(64)).unwrap_err().contains("attention_bias"));
        let mut v: serde_json::Value = serde_json::from_str(LLAMA_32_1B).expect("json");
        v["rope_scaling"]["rope_type"] = "yarn".into();
        assert!(model_config(&v, Some(64)).unwrap_err().contains("yarn"));
        let mut v: serde_json::Value = serde_json::from_str(LLAMA_32_1B).expect("json");
        v["head_dim"] = 128.into();
        assert!(model_config(&v, Some(64)).unwrap_err().contains("head_dim"));
        let mut v: serde_json::Value = serde_json::from_str(LLAMA_32_1B).expect("json");
        v.as_object_mut().expect("object").remove("intermediate_size");
        assert!(model_config(&v, Some(64)).unwrap_err().contains("intermediate_size"));
    }
}
