//! GPT-2 in Hugging Face transformers' `GPT2LMHeadModel` naming and layouts.
//!
//! Layout differences: Hugging Face's GPT-2 uses `Conv1D`, whose weight is `[in, out]`;
//! ours is `nn.Linear`'s `[out, in]`, so the four projection weights are transposed both
//! ways. The LM head is tied to `wte` and is not written (transformers re-ties it).
//! Imported `wte` with fewer rows than `vocab_size` is padded with zero rows (50257 →
//! 50304); `wpe` with more positions than `seq_len` is cut.

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
