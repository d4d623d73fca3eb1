//! GPT-2 in Hugging Face transformers' `GPT2LMHeadModel` naming and layouts.
//!
//! Layout differences: Hugging Face's GPT-2 uses `Conv1D`, whose weight is `[in, out]`;
//! ours is `nn.Linear`'s `[out, in]`, so the four projection weights are transposed both
//! ways. The LM head is tied to `wte` and is not written (transformers re-ties it).
//! Imported `wte` with fewer rows than `vocab_size` is padded with zero rows (50257 →
//! 50304); `wpe` with more positions than `seq_len` is cut. `config.json` is a
//! `GPT2LMHeadModel`'s: the shape, GELU's tanh approximation (`gelu_new`), LayerNorm's
//! epsilon, the tied head, and no dropout (shardtrain trains without it).

use crate::config::ModelConfig;
use crate::model::{HfFormat, TensorSpec};

/// Prefix of `GPT2LMHeadModel`'s transformer weights.
const PREFIX: &str = "transformer.";

/// GPT-2's mapping to and from Hugging Face.
pub struct Gpt2Hf;

/// Whether our `[out, in]` tensor is a `Conv1D` weight stored `[in, out]` by Hugging Face.
fn is_conv1d(name: &str) -> bool {
    name.ends_with("c_attn.weight") || name.ends_with("c_proj.weight") || name.ends_with("c_fc.weight")
}

/// Transpose a row-major `[rows, cols]` matrix.
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
    out
}

impl HfFormat for Gpt2Hf {
    fn hf_config(&self, cfg: &ModelConfig) -> serde_json::Value {
        let mut c = serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len,
            "n_ctx": cfg.seq_len,
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": null,
            "activation_function": "gelu_new",
            // backend::cpu::layernorm::LN_EPS, as every backend normalises.
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "initializer_range": 0.02,
            "scale_attn_weights": true,
            "tie_word_embeddings": true,
            "use_cache": true,
            "torch_dtype": "float32",
        });
        // The GPT-2 BPE's <|endoftext|> starts and ends documents, where the vocabulary has it.
        let eot = data::EOT_TOKEN as usize;
        if cfg.vocab_size > eot {
            c["bos_token_id"] = eot.into();
            c["eos_token_id"] = eot.into();
        }
        c
    }

    /// Unset `seq_len`: every learned position (`n_positions`).
    fn model_config(&self, json: &serde_json::Value, seq_len: Option<usize>) -> Result<ModelConfig, String> {
        let int = |k: &str| -> Result<usize, String> {
            json.get(k)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| format!("config.json has no integer `{k}`"))
        };
        let positions = int("n_positions")?;
        let seq_len = seq_len.unwrap_or(positions);
        if seq_len > positions {
            return Err(format!(
                "model.seq_len = {seq_len} is longer than the {positions} learned positions (n_positions) of this GPT-2: \
                 set model.seq_len to at most {positions}"
            ));
        }
        if let Some(act) = json.get("activation_function").and_then(|v| v.as_str()) {
            if act != "gelu_new" && act != "gelu_pytorch_tanh" {
                return Err(format!(
                    "config.json's activation_function = \"{act}\": GPT-2 here is the tanh GELU (gelu_new)"
                ));
            }
        }
        Ok(ModelConfig::gpt2(int("n_layer")?, int("n_head")?, int("n_embd")?, int("vocab_size")?, seq_len))
    }

    fn same_layout(&self, t: &TensorSpec) -> bool {
        // wpe is cut to model.seq_len and wte padded to model.vocab_size: read whole.
        !is_conv1d(&t.name) && t.name != "wpe.weight" && t.name != "wte.weight"
    }

    fn hf_name(&self, t: &TensorSpec) -> String {
        format!("{PREFIX}{}", t.name)
    }

    fn import_names(&self, t: &TensorSpec) -> Vec<String> {
        vec![self.hf_name(t), t.name.clone()]
    }

    fn hf_shape(&self, t: &TensorSpec) -> Vec<usize> {
        if is_conv1d(&t.name) {
            vec![t.shape[1], t.shape[0]]
        } else {
            t.shape.clone()
        }
    }

    fn to_hf(&self, t: &TensorSpec, values: Vec<f32>) -> Vec<f32> {
        if is_conv1d(&t.name) {
            transpose(&values, t.shape[0], t.shape[1])
        } else {
            values
        }
    }

    fn import_hf(&self, t: &TensorSpec, vals: &[f32], got: &[usize]) -> Result<Vec<f32>, String> {
        let want = self.hf_shape(t);
        let row_tensor = t.name == "wte.weight" || t.name == "wpe.weight";
        if row_tensor && got.len() == 2 && got[1] == want[1] {
            let cols = want[1];
            let rows = got[0].min(want[0]);
            if t.name == "wte.weight" && got[0] > want[0] {
                return Err(format!(
                    "wte.weight has {} rows but model.vocab_size = {}: raise model.vocab_size",
                    got[0], want[0]
                ));
            }
            if t.name == "wpe.weight" && got[0] < want[0] {
                return Err(format!(
                    "wpe.weight has {} positions but model.seq_len = {}: lower model.seq_len",
                    got[0], want[0]
                ));
            }
            let mut out = vec![0.0f32; want[0] * cols];
            out[..rows * cols].copy_from_slice(&vals[..rows * cols]);
            return Ok(out);
        }
        if got != want.as_slice() {
            return Err(format!(
                "{} has shape {got:?}; the config's model needs {want:?} (check model.n_embd / n_layer)",
                t.name
            ));
        }
        Ok(if is_conv1d(&t.name) { transpose(vals, t.shape[1], t.shape[0]) } else { vals.to_vec() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_json_is_a_gpt2_lm_head_models() {
        let cfg = ModelConfig::gpt2(12, 12, 768, 50304, 1024);
        let c = Gpt2Hf.hf_config(&cfg);
        assert_eq!(Gpt2Hf.model_config(&c, None), Ok(cfg.clone()));
        assert!(Gpt2Hf.model_config(&c, Some(2048)).unwrap_err().contains("n_positions"));
        assert_eq!(c["architectures"][0], "GPT2LMHeadModel");
        assert_eq!(c["model_type"], "gpt2");
        for (key, want) in
            [("n_embd", 768), ("n_layer", 12), ("n_head", 12), ("n_positions", 1024), ("vocab_size", 50304)]
        {
            assert_eq!(c[key], want, "{key}");
        }
        assert_eq!(c["layer_norm_epsilon"].as_f64().map(|e| e as f32), Some(crate::backend::cpu::LN_EPS));
        assert_eq!(
            (c["activation_function"].as_str(), c["tie_word_embeddings"].as_bool()),
            (Some("gelu_new"), Some(true))
        );
        assert_eq!(c["eos_token_id"], 50256);
        let small = Gpt2Hf.hf_config(&ModelConfig { vocab_size: 97, ..cfg });
        assert!(small.get("eos_token_id").is_none(), "no <|endoftext|> in a vocabulary of 97");
    }
}
