//! Export: one sharded checkpoint as a Hugging Face model folder (`config.json` and the
//! weights, float32, in the family's transformers names and layouts), streamed tensor by
//! tensor from the shard files (never the whole model twice in memory). The folder is
//! written under a temporary name beside `out` and renamed into place once complete, so a
//! crash or a full disk never leaves a folder that looks whole.

use super::{shard_file_name, CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
use crate::checkpoint::load::CheckpointReader;
use crate::checkpoint::stream::{write_streamed, ReadFn};
use crate::checkpoint::{io_err, CheckpointError};
use crate::model::{HfFormat, ModelLayout, TensorSpec};
use crate::TrainError;
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

/// The largest weights file before the folder is sharded: `save_pretrained`'s default, 5 GB.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    /// The folder.
    pub dir: PathBuf,
    /// Its weights files, in order (one `model.safetensors`, or the shards).
    pub files: Vec<String>,
    pub tensors: usize,
    pub params: usize,
    /// Bytes of tensor data (the index's `metadata.total_size`).
    pub bytes: u64,
    pub step: u64,
}

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

/// Write the checkpoint in `ckpt_dir` as a Hugging Face model folder `out` (which must not
/// exist, or be empty), in files of at most `max_shard_bytes` (a larger tensor gets a file
/// of its own).
pub fn export(ckpt_dir: &Path, out: &Path, max_shard_bytes: u64) -> Result<ExportSummary, TrainError> {
    if fs::read_dir(out).is_ok_and(|mut d| d.next().is_some()) || (out.exists() && !out.is_dir()) {
        return Err(TrainError::Invalid(format!(
            "{} exists and is not an empty folder: export writes a new one; give another path",
            out.display()
        )));
    }
    let reader = CheckpointReader::open(ckpt_dir, true)?;
    let layout = ModelLayout::new(&reader.manifest.model);
    let hf = layout.cfg.family.hf();
    let specs: Vec<(usize, &TensorSpec)> =
        layout.units.iter().enumerate().flat_map(|(u, unit)| unit.tensors.iter().map(move |t| (u, t))).collect();
    let sizes: Vec<u64> = specs.iter().map(|(_, t)| 4 * hf.hf_shape(t).iter().product::<usize>() as u64).collect();
    let groups = shard_groups(&sizes, max_shard_bytes);
    let n = groups.len();
    let files: Vec<String> =
        (0..n).map(|i| if n == 1 { SINGLE_FILE.to_string() } else { shard_file_name(i + 1, n) }).collect();

    let tmp = partial_dir(out);
    if tmp.exists() {
        // Left by an export that crashed: it never became the folder.
        fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let written = (|| -> Result<u64, TrainError> {
        let config = serde_json::to_vec_pretty(&hf.hf_config(&layout.cfg))
            .map_err(|e| TrainError::Invalid(format!("cannot encode config.json: {e}")))?;
        write_file(&tmp.join(CONFIG_FILE), &config)?;
        let mut total = 0;
        let mut weight_map = serde_json::Map::new();
        for (group, file) in groups.iter().zip(&files) {
            let mut tensors: Vec<(String, Vec<usize>, ReadFn)> = Vec::new();
            for &k in group {
                let (u, t) = specs[k];
                let read: ReadFn = Box::new({
                    let reader = &reader;
                    move || hf_values(reader, hf, u, t).map(std::borrow::Cow::Owned)
                });
                weight_map.insert(hf.hf_name(t), serde_json::json!(file));
                tensors.push((hf.hf_name(t), hf.hf_shape(t), read));
            }
            // transformers refuses safetensors files without a `format`.
            let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
            total += write_streamed(&tmp.join(file), tensors, Some(meta))?;
        }
        if n > 1 {
            let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
            let text = serde_json::to_vec_pretty(&index)
                .map_err(|e| TrainError::Invalid(format!("cannot encode {INDEX_FILE}: {e}")))?;
            write_file(&tmp.join(INDEX_FILE), &text)?;
        }
        fsync(&tmp)?;
        Ok(total)
    })();
    let bytes = match written {
        Ok(b) => b,
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if out.is_dir() {
        fs::remove_dir(out).map_err(io_err(out))?;
    }
    fs::rename(&tmp, out).map_err(io_err(out))?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fsync(parent)?;
    }
    Ok(ExportSummary {
        dir: out.to_path_buf(),
        files,
        tensors: specs.len(),
        params: layout.num_params(),
        bytes,
        step: reader.manifest.step,
    })
}

/// Consecutive tensors in files of at most `max` bytes each (a tensor larger than `max`
/// alone in one): the indices of each file's tensors.
fn shard_groups(sizes: &[u64], max: u64) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = vec![vec![]];
    let mut used = 0u64;
    for (k, &size) in sizes.iter().enumerate() {
        let current = groups.last_mut().expect("never empty");
        if !current.is_empty() && used + size > max {
            groups.push(vec![k]);
            used = size;
        } else {
            current.push(k);
            used += size;
        }
    }
    groups
}

/// Where the folder is written before it is renamed to `out`: beside it, hidden.
fn partial_dir(out: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "export".into());
    out.with_file_name(format!(".{name}.partial"))
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    use std::io::Write;
    let mut f = fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

fn fsync(dir: &Path) -> Result<(), CheckpointError> {
    fs::File::open(dir).and_then(|f| f.sync_all()).map_err(io_err(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_are_grouped_into_files_of_at_most_the_shard_size() {
        assert_eq!(shard_groups(&[4, 4, 4], 100), vec![vec![0, 1, 2]]);
        assert_eq!(shard_groups(&[4, 4, 4], 8), vec![vec![0, 1], vec![2]]);
        assert_eq!(shard_groups(&[20, 4, 4], 8), vec![vec![0], vec![1, 2]], "a large tensor alone");
        assert_eq!(shard_groups(&[], 8), vec![Vec::<usize>::new()]);
        assert_eq!(partial_dir(Path::new("/x/model")), PathBuf::from("/x/.model.partial"));
    }
}
