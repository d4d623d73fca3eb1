//! Llama in Hugging Face transformers' `LlamaForCausalLM` naming and layouts.
//!
//! Our tensors carry transformers' names and `[out, in]` shapes, so the mapping is the
//! identity, RoPE included: we rotate the pairs of dimensions `(i, i + hs/2)` as
//! transformers' `rotate_half` does, which is the layout of every Hugging Face Llama
//! checkpoint (Meta's original checkpoints pair `(2i, 2i + 1)`, and transformers'
//! converter permutes the rows of `q_proj` and `k_proj` into this layout; we read only the
//! converted form). An imported `embed_tokens` / `lm_head` with fewer rows than
//! `model.vocab_size` is padded with zero rows (a vocabulary rounded up for speed).

use crate::model::{HfFormat, TensorSpec};

/// Llama's mapping to and from Hugging Face.
pub struct LlamaHf;

fn is_vocab_rows(name: &str) -> bool {
    name == "model.embed_tokens.weight" || name == "lm_head.weight"
}

impl HfFormat for LlamaHf {
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
