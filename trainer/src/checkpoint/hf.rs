//! Hugging Face GPT-2 interop: export a sharded checkpoint as one `model.safetensors`
//! with `GPT2LMHeadModel` names and layouts, and import such a file as initial weights.
//!
//! Layout differences: Hugging Face's GPT-2 uses `Conv1D`, whose weight is `[in, out]`;
//! ours is `nn.Linear`'s `[out, in]`, so the four projection weights are transposed both
//! ways. The LM head is tied to `wte` and is not written (transformers re-ties it).
//! Export streams tensor by tensor from the shard files (never the whole model twice).

use super::load::CheckpointReader;
use super::stream::{write_streamed, ReadFn};
use super::{io_err, CheckpointError};
use crate::model::{ModelLayout, TensorSpec};
use crate::TrainError;
use memmap2::Mmap;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Prefix of `GPT2LMHeadModel`'s transformer weights.
const PREFIX: &str = "transformer.";

/// Whether our `[out, in]` tensor is a `Conv1D` weight stored `[in, out]` by Hugging Face.
fn is_conv1d(name: &str) -> bool {
    name.ends_with("c_attn.weight") || name.ends_with("c_proj.weight") || name.ends_with("c_fc.weight")
}

/// The Hugging Face shape of one of our tensors.
fn hf_shape(t: &TensorSpec) -> Vec<usize> {
    if is_conv1d(&t.name) {
        vec![t.shape[1], t.shape[0]]
    } else {
        t.shape.clone()
    }
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

/// One exported tensor's values (Hugging Face layout), read from the checkpoint shards.
fn hf_values(reader: &CheckpointReader, unit: usize, spec: &TensorSpec) -> Result<Vec<f32>, TrainError> {
    let [master, _, _] = reader.read_state(unit, spec.loc.off, spec.loc.end())?;
    Ok(if is_conv1d(&spec.name) { transpose(&master, spec.shape[0], spec.shape[1]) } else { master })
}

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    pub path: PathBuf,
    pub tensors: usize,
    pub params: usize,
    pub step: u64,
}

/// Write the checkpoint in `ckpt_dir` as a Hugging Face GPT-2 `model.safetensors` at `out`.
pub fn export(ckpt_dir: &Path, out: &Path) -> Result<ExportSummary, TrainError> {
    let reader = CheckpointReader::open(ckpt_dir, true)?;
    let layout = ModelLayout::new(&reader.manifest.model);
    let mut tensors: Vec<(String, Vec<usize>, ReadFn)> = Vec::new();
    for (u, unit) in layout.units.iter().enumerate() {
        for t in &unit.tensors {
            let read: ReadFn = Box::new({
                let reader = &reader;
                move || hf_values(reader, u, t)
            });
            tensors.push((format!("{PREFIX}{}", t.name), hf_shape(t), read));
        }
    }
    let n = tensors.len();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    // The checkpoint was fully validated (checksums) above, so a read error while writing
    // means its files changed underneath us.
    write_streamed(out, tensors, Some(meta))
        .map_err(|e| TrainError::Invalid(format!("export of {} failed: {e}", ckpt_dir.display())))?;
    Ok(ExportSummary { path: out.to_path_buf(), tensors: n, params: layout.num_params(), step: reader.manifest.step })
}

/// A Hugging Face GPT-2 safetensors file opened for import.
pub struct HfWeights {
    path: PathBuf,
    map: Mmap,
}

impl HfWeights {
    pub fn open(path: &Path) -> Result<HfWeights, TrainError> {
        let file = std::fs::File::open(path)
            .map_err(|e| TrainError::Invalid(format!("init.from = {}: cannot open: {e}", path.display())))?;
        // SAFETY: the file is only read; a concurrent writer would be a user error.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(path)).map_err(TrainError::from)?;
        SafeTensors::deserialize(&map).map_err(|e| {
            TrainError::Invalid(format!("init.from = {} is not a safetensors file: {e}", path.display()))
        })?;
        Ok(HfWeights { path: path.to_path_buf(), map })
    }

    fn err(&self, msg: String) -> TrainError {
        TrainError::Checkpoint(CheckpointError::Invalid { dir: self.path.clone(), problem: msg })
    }

    /// Unit `u`'s values in our layout. `wte` with fewer rows than `vocab_size` is padded
    /// with zero rows (e.g. 50257 → 50304); `wpe` with more rows than `seq_len` is cut.
    pub fn unit_values(&self, layout: &ModelLayout, u: usize) -> Result<Vec<f32>, TrainError> {
        let st = SafeTensors::deserialize(&self.map).map_err(|e| self.err(e.to_string()))?;
        let unit = &layout.units[u];
        let mut out = vec![0.0f32; unit.numel];
        for t in &unit.tensors {
            let view = st
                .tensor(&format!("{PREFIX}{}", t.name))
                .or_else(|_| st.tensor(&t.name))
                .map_err(|_| self.err(format!("tensor {PREFIX}{} (or {}) is missing", t.name, t.name)))?;
            if view.dtype() != Dtype::F32 {
                return Err(self.err(format!("{} is {:?}; import reads float32 files", t.name, view.dtype())));
            }
            let vals: Vec<f32> =
                view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let want = hf_shape(t);
            let got = view.shape().to_vec();
            let dst = &mut out[t.loc.off..t.loc.end()];
            let row_tensor = t.name == "wte.weight" || t.name == "wpe.weight";
            if row_tensor && got.len() == 2 && got[1] == want[1] {
                let cols = want[1];
                let rows = got[0].min(want[0]);
                if t.name == "wte.weight" && got[0] > want[0] {
                    return Err(self.err(format!(
                        "wte.weight has {} rows but model.vocab_size = {}: raise model.vocab_size",
                        got[0], want[0]
                    )));
                }
                if t.name == "wpe.weight" && got[0] < want[0] {
                    return Err(self.err(format!(
                        "wpe.weight has {} positions but model.seq_len = {}: lower model.seq_len",
                        got[0], want[0]
                    )));
                }
                dst[..rows * cols].copy_from_slice(&vals[..rows * cols]);
                continue;
            }
            if got != want {
                return Err(self.err(format!(
                    "{} has shape {got:?}; the config's model needs {want:?} (check model.n_embd / n_layer)",
                    t.name
                )));
            }
            if is_conv1d(&t.name) {
                dst.copy_from_slice(&transpose(&vals, t.shape[1], t.shape[0]));
            } else {
                dst.copy_from_slice(&vals);
            }
        }
        Ok(out)
    }
}
