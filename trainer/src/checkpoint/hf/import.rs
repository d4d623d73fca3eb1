//! Import (`train.init_from`): Hugging Face weights as a rank's initial values. The source
//! is a model folder (`model.safetensors`, or `model.safetensors.index.json` and its shards,
//! as `save_pretrained` and `launcher export` write them) or one safetensors file. Tensors
//! may be float32, bfloat16 or float16 (widened to f32 here); another dtype is refused,
//! naming the tensor. A rank reads only the elements it holds ([`HfWeights::unit_range`]):
//! where the family's layout is Hugging Face's element for element (Llama), only that
//! range's bytes of each tensor are read, so a ZeRO-3 rank of a model that fits no single
//! GPU — or host — never reads the rest. Every problem is a [`CheckpointError::Init`], so a
//! rank that finds one stops the job with exit code 2, as the launcher does when it finds
//! it before start.

use super::{INDEX_FILE, SINGLE_FILE};
use crate::checkpoint::CheckpointError;
use crate::model::{ModelLayout, TensorSpec};
use crate::TrainError;
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Hugging Face weights opened for import: every file mapped, every tensor's file known.
pub struct HfWeights {
    /// The path as given.
    origin: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    /// Tensor name → its file in `files`.
    index: HashMap<String, usize>,
}

impl HfWeights {
    /// Open a folder or a file; each file's header is read and checked.
    pub fn open(path: &Path) -> Result<HfWeights, TrainError> {
        let err = |problem: String| TrainError::from(CheckpointError::Init { path: path.to_path_buf(), problem });
        let paths = if path.is_dir() { folder_files(path).map_err(err)? } else { vec![path.to_path_buf()] };
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for p in paths {
            let file = std::fs::File::open(&p).map_err(|e| err(format!("cannot open {}: {e}", p.display())))?;
            // SAFETY: the file is only read; a concurrent writer would be a user error.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| err(format!("cannot map {}: {e}", p.display())))?;
            let (_, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                err(format!(
                    "{} is not a safetensors file ({e}): give a Hugging Face model folder or its .safetensors file \
                     (e.g. from `launcher export`)",
                    p.display()
                ))
            })?;
            for name in meta.tensors().keys() {
                if index.insert(name.clone(), files.len()).is_some() {
                    return Err(err(format!("tensor {name} is in more than one file (the last: {})", p.display())));
                }
            }
            files.push((p, map));
        }
        Ok(HfWeights { origin: path.to_path_buf(), files, index })
    }

    fn err(&self, problem: String) -> TrainError {
        CheckpointError::Init { path: self.origin.clone(), problem }.into()
    }

    /// The tensor standing for our `t` (the first of the family's accepted names present).
    fn find(&self, layout: &ModelLayout, t: &TensorSpec) -> Result<(String, TensorView<'_>), TrainError> {
        let names = layout.cfg.family.hf().import_names(t);
        for n in &names {
            if let Some(&f) = self.index.get(n) {
                let (path, map) = &self.files[f];
                let st = SafeTensors::deserialize(map)
                    .map_err(|e| self.err(format!("{} is not a valid safetensors file: {e}", path.display())))?;
                let view = st.tensor(n).map_err(|e| self.err(format!("{n} in {}: {e}", path.display())))?;
                return Ok((n.clone(), view));
            }
        }
        let shown = match names.split_first() {
            Some((first, rest)) if !rest.is_empty() => format!("{first} (or {})", rest.join(", ")),
            _ => names.join(""),
        };
        Err(self.err(format!("tensor {shown} is missing")))
    }

    /// Every tensor of `layout` is present in a dtype import reads (shapes are checked as
    /// each unit is read): what the launcher checks before any rank starts.
    pub fn check(&self, layout: &ModelLayout) -> Result<(), TrainError> {
        for t in layout.units.iter().flat_map(|u| &u.tensors) {
            let (name, view) = self.find(layout, t)?;
            readable(&name, view.dtype()).map_err(|m| self.err(m))?;
        }
        Ok(())
    }

    /// Unit `u`'s values in our layout (the family's [`HfFormat`](crate::model::HfFormat)
    /// maps names and layouts).
    pub fn unit_values(&self, layout: &ModelLayout, u: usize) -> Result<Vec<f32>, TrainError> {
        self.unit_range(layout, u, 0..layout.units[u].numel)
    }

    /// Elements `range` of unit `u` in our layout. A tensor whose Hugging Face shape is
    /// ours and whose values need no mapping ([`HfFormat::same_layout`]) is read only over
    /// the part inside `range`; any other (a transposed GPT-2 `Conv1D`, an embedding padded
    /// to a larger vocabulary) is read whole and mapped, then cut.
    ///
    /// [`HfFormat::same_layout`]: crate::model::HfFormat::same_layout
    pub fn unit_range(
        &self,
        layout: &ModelLayout,
        u: usize,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, TrainError> {
        let hf = layout.cfg.family.hf();
        let mut out = vec![0.0f32; range.len()];
        for t in &layout.units[u].tensors {
            let (lo, hi) = (t.loc.off.max(range.start), t.loc.end().min(range.end));
            if lo >= hi {
                continue;
            }
            let (name, view) = self.find(layout, t)?;
            let dst = &mut out[lo - range.start..hi - range.start];
            let (a, b) = (lo - t.loc.off, hi - t.loc.off);
            if hf.same_layout(t) && view.shape() == t.shape.as_slice() {
                widen_into(&name, &view, a, dst).map_err(|m| self.err(m))?;
            } else {
                let vals = widen(&name, &view).map_err(|m| self.err(m))?;
                let ours = hf.import_hf(t, &vals, view.shape()).map_err(|m| self.err(m))?;
                dst.copy_from_slice(&ours[a..b]);
            }
        }
        Ok(out)
    }
}

/// The weights files of a model folder: the index's shards, or `model.safetensors`.
fn folder_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| format!("cannot read {}: {e}", index.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", index.display()))?;
        let map = json["weight_map"]
            .as_object()
            .ok_or_else(|| format!("{} has no weight_map (tensor name -> file)", index.display()))?;
        let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        if names.is_empty() {
            return Err(format!("{} lists no weights file", index.display()));
        }
        for n in &names {
            // Only files beside the index: a weight_map cannot point elsewhere.
            if Path::new(n).components().count() != 1 {
                return Err(format!("{} names {n:?}, not a file in its folder", index.display()));
            }
        }
        return Ok(names.into_iter().map(|n| dir.join(n)).collect());
    }
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(format!(
        "{} holds neither {SINGLE_FILE} nor {INDEX_FILE}: give a Hugging Face model folder (as `launcher export` or \
         save_pretrained write it) or a .safetensors file",
        dir.display()
    ))
}

/// Whether import reads `dtype`, or what to do.
fn readable(name: &str, dtype: Dtype) -> Result<(), String> {
    match dtype {
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => Ok(()),
        other => Err(format!(
            "{name} is {other:?}: import reads float32, bfloat16 and float16 tensors; convert the weights \
             (e.g. model.to(torch.float32).save_pretrained(DIR)) and point train.init_from at them"
        )),
    }
}

/// A tensor's values as f32 (safetensors stores little-endian).
fn widen(name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, String> {
    let mut out = vec![0.0f32; view.shape().iter().product()];
    widen_into(name, view, 0, &mut out)?;
    Ok(out)
}

/// Elements `first .. first + dst.len()` of a tensor, as f32, into `dst`: only those bytes
/// of the (memory-mapped) file are touched.
fn widen_into(name: &str, view: &TensorView<'_>, first: usize, dst: &mut [f32]) -> Result<(), String> {
    readable(name, view.dtype())?;
    let size = view.dtype().bitsize() / 8;
    let d = view
        .data()
        .get(first * size..(first + dst.len()) * size)
        .ok_or_else(|| format!("{name} holds fewer elements than its shape says"))?;
    match view.dtype() {
        Dtype::F32 => {
            for (o, b) in dst.iter_mut().zip(d.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::BF16 => {
            for (o, b) in dst.iter_mut().zip(d.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        _ => {
            for (o, b) in dst.iter_mut().zip(d.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_is_widened_and_other_dtypes_are_refused_by_name() {
        let vals = [1.5f32, -2.25, 0.0, 65504.0];
        let bf: Vec<u8> = vals.iter().flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes()).collect();
        let h: Vec<u8> = vals.iter().flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes()).collect();
        let f: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        for (dtype, bytes) in [(Dtype::BF16, &bf), (Dtype::F16, &h), (Dtype::F32, &f)] {
            let view = TensorView::new(dtype, vec![4], bytes).expect("view");
            let got = widen("w", &view).expect("widen");
            assert_eq!(got[..3], vals[..3], "{dtype:?}");
        }
        let ints = vec![0u8; 32];
        let view = TensorView::new(Dtype::F64, vec![4], &ints).expect("view");
        let e = widen("transformer.wte.weight", &view).unwrap_err();
        assert!(e.contains("transformer.wte.weight is F64") && e.contains("bfloat16"), "{e}");
    }
}
