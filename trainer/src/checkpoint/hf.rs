//! Hugging Face interop: export a sharded checkpoint as one `model.safetensors` with the
//! names and layouts of the model family's transformers class, and import such a file as
//! initial weights. The mapping per family is its [`HfFormat`] (GPT-2: `model/gpt2/hf.rs`).
//! Export streams tensor by tensor from the shard files (never the whole model twice).

use super::load::CheckpointReader;
use super::stream::{write_streamed, ReadFn};
use super::{io_err, CheckpointError};
use crate::model::{HfFormat, ModelLayout, TensorSpec};
use crate::TrainError;
use memmap2::Mmap;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One exported tensor's values (Hugging Face layout), read from the checkpoint shards.
fn hf_values(
    reader: &CheckpointReader,
    hf: &dyn HfFormat,
    unit: usize,
    spec: &TensorSpec,
) -> Result<Vec<f32>, TrainError> {
    let [master, _, _] = reader.read_state(unit, spec.loc.off, spec.loc.end())?;
    Ok(hf.to_hf(spec, master))
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
    let hf = layout.cfg.family.hf();
    let mut tensors: Vec<(String, Vec<usize>, ReadFn)> = Vec::new();
    for (u, unit) in layout.units.iter().enumerate() {
        for t in &unit.tensors {
            let read: ReadFn = Box::new({
                let reader = &reader;
                move || hf_values(reader, hf, u, t)
            });
            tensors.push((hf.hf_name(t), hf.hf_shape(t), read));
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

    /// Unit `u`'s values in our layout (the family's [`HfFormat`] maps names and layouts).
    pub fn unit_values(&self, layout: &ModelLayout, u: usize) -> Result<Vec<f32>, TrainError> {
        let st = SafeTensors::deserialize(&self.map).map_err(|e| self.err(e.to_string()))?;
        let hf = layout.cfg.family.hf();
        let unit = &layout.units[u];
        let mut out = vec![0.0f32; unit.numel];
        for t in &unit.tensors {
            let names = hf.import_names(t);
            let Some(view) = names.iter().find_map(|n| st.tensor(n).ok()) else {
                let shown = match names.split_first() {
                    Some((first, rest)) if !rest.is_empty() => format!("{first} (or {})", rest.join(", ")),
                    _ => names.join(""),
                };
                return Err(self.err(format!("tensor {shown} is missing")));
            };
            if view.dtype() != Dtype::F32 {
                return Err(self.err(format!("{} is {:?}; import reads float32 files", t.name, view.dtype())));
            }
            let vals: Vec<f32> =
                view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let ours = hf.import_hf(t, &vals, view.shape()).map_err(|m| self.err(m))?;
            out[t.loc.off..t.loc.end()].copy_from_slice(&ours);
        }
        Ok(out)
    }
}
