//! Reading checkpoints: validation before training, resharding reads, `latest` lookup.

use super::manifest::{file_crc, manifest_crc_line, Manifest, FORMAT_VERSION, MANIFEST_CRC};
use super::{io_err, CheckpointError};
use crate::config::ModelConfig;
use crate::TrainError;
use memmap2::Mmap;
use safetensors::SafeTensors;
use std::fs;
use std::path::{Path, PathBuf};

/// An opened checkpoint: manifest plus memory-mapped shard files.
pub struct CheckpointReader {
    pub dir: PathBuf,
    pub manifest: Manifest,
    maps: Vec<Mmap>,
}

impl CheckpointReader {
    /// Open `dir`: the manifest must parse and every shard file must exist with the
    /// recorded size. `verify_checksums` also reads every file and compares CRC-32s.
    pub fn open(dir: &Path, verify_checksums: bool) -> Result<CheckpointReader, CheckpointError> {
        let bad = |problem: String| CheckpointError::Invalid { dir: dir.to_path_buf(), problem };
        let mpath = dir.join("manifest.json");
        if !mpath.exists() {
            return Err(bad(if looks_like_a_save(dir) {
                "manifest.json is missing: the save did not complete (a crash mid-save leaves no manifest)".into()
            } else {
                "it is not a checkpoint: it has no manifest.json and no shard files (a checkpoint is a step_* \
                 directory under checkpoint.dir, e.g. runs/NAME/checkpoints/step_00000100)"
                    .into()
            }));
        }
        let text = fs::read(&mpath).map_err(io_err(&mpath))?;
        check_manifest_crc(dir, &text, verify_checksums).map_err(bad)?;
        let manifest: Manifest =
            serde_json::from_slice(&text).map_err(|e| bad(format!("manifest.json does not parse: {e}")))?;
        if manifest.format != FORMAT_VERSION {
            return Err(bad(format!(
                "format version {} but this build reads version {FORMAT_VERSION}",
                manifest.format
            )));
        }
        let mut maps = Vec::with_capacity(manifest.files.len());
        for f in &manifest.files {
            let p = dir.join(&f.name);
            let file = fs::File::open(&p).map_err(|e| bad(format!("shard file {} cannot be opened: {e}", f.name)))?;
            let len = file.metadata().map_err(io_err(&p))?.len();
            if len != f.bytes {
                return Err(bad(format!(
                    "shard file {} has {len} bytes but the manifest recorded {} (truncated or replaced)",
                    f.name, f.bytes
                )));
            }
            if verify_checksums {
                let (_, crc) = file_crc(&p)?;
                if crc != f.crc32 {
                    return Err(bad(format!(
                        "shard file {} fails its checksum (CRC-32 {crc:08x}, manifest {:08x}): the file is corrupt",
                        f.name, f.crc32
                    )));
                }
            }
            // SAFETY: checkpoint files are written once and never modified in place
            // (saves go to a new directory that is renamed into place).
            let map = unsafe { Mmap::map(&file) }.map_err(io_err(&p))?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| bad(format!("shard file {} is not valid safetensors: {e}", f.name)))?;
            check_segments(&manifest, f, &st).map_err(|problem| {
                bad(format!(
                    "manifest.json and shard file {} disagree: {problem}; the checkpoint is damaged (an edited or \
                     mixed-up manifest.json): resume from another checkpoint, e.g. --resume latest for the newest \
                     intact one or --resume DIR with an earlier step_* directory",
                    f.name
                ))
            })?;
            maps.push(map);
        }
        Ok(CheckpointReader { dir: dir.to_path_buf(), manifest, maps })
    }

    /// The checkpoint must describe the same model shape as `model`.
    pub fn check_model(&self, model: &ModelConfig) -> Result<(), CheckpointError> {
        let m = &self.manifest.model;
        let diffs: Vec<String> = [
            ("n_layer", m.n_layer, model.n_layer),
            ("n_head", m.n_head, model.n_head),
            ("n_embd", m.n_embd, model.n_embd),
            ("vocab_size", m.vocab_size, model.vocab_size),
            ("seq_len", m.seq_len, model.seq_len),
        ]
        .iter()
        .filter(|(_, a, b)| a != b)
        .map(|(k, a, b)| format!("model.{k} is {a} in the checkpoint but {b} in the config"))
        .collect();
        if diffs.is_empty() {
            Ok(())
        } else {
            Err(CheckpointError::Invalid {
                dir: self.dir.clone(),
                problem: format!("it is from another model shape: {}", diffs.join("; ")),
            })
        }
    }

    /// Master weights, m and v of `unit` over `[lo, hi)`, assembled from whichever shard
    /// files hold pieces of it (this is the resharding read: no rank loads the whole model).
    pub fn read_state(&self, unit: usize, lo: usize, hi: usize) -> Result<[Vec<f32>; 3], TrainError> {
        let name = &self
            .manifest
            .units
            .get(unit)
            .ok_or_else(|| TrainError::Invalid(format!("checkpoint has no unit {unit}")))?
            .name;
        let mut out = [vec![0.0f32; hi - lo], vec![0.0f32; hi - lo], vec![0.0f32; hi - lo]];
        let mut covered = 0;
        for (fi, f) in self.manifest.files.iter().enumerate() {
            for s in f.segments.iter().filter(|s| s.unit == unit) {
                let (a, b) = (s.lo.max(lo), s.hi.min(hi));
                if a >= b {
                    continue;
                }
                let st = SafeTensors::deserialize(&self.maps[fi]).map_err(|e| self.bad(&f.name, e.to_string()))?;
                for (k, tag) in ["master", "m", "v"].iter().enumerate() {
                    let t = st.tensor(&format!("{name}.{tag}")).map_err(|e| self.bad(&f.name, e.to_string()))?;
                    let bytes = t.data().get((a - s.lo) * 4..(b - s.lo) * 4).ok_or_else(|| {
                        self.bad(
                            &f.name,
                            format!(
                                "tensor {name}.{tag} holds {} values, not the {}..{} of its segment in manifest.json \
                                 (the checkpoint is damaged: resume from another one)",
                                t.data().len() / 4,
                                s.lo,
                                s.hi
                            ),
                        )
                    })?;
                    for (dst, src) in out[k][a - lo..b - lo].iter_mut().zip(bytes.chunks_exact(4)) {
                        *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
                    }
                }
                covered += b - a;
            }
        }
        if covered != hi - lo {
            return Err(TrainError::Checkpoint(CheckpointError::Invalid {
                dir: self.dir.clone(),
                problem: format!("unit {name} range {lo}..{hi} is not fully covered by the shard files"),
            }));
        }
        Ok(out)
    }

    fn bad(&self, file: &str, e: String) -> TrainError {
        TrainError::Checkpoint(CheckpointError::Invalid { dir: self.dir.clone(), problem: format!("{file}: {e}") })
    }
}

/// manifest.json must match its checksum file ([`MANIFEST_CRC`]); a checkpoint saved before
/// manifest checksums has none and is read unchecked (said once per full validation, `log`).
fn check_manifest_crc(dir: &Path, text: &[u8], log: bool) -> Result<(), String> {
    let path = dir.join(MANIFEST_CRC);
    let saved = match fs::read_to_string(&path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if log {
                eprintln!(
                    "checkpoint {}: no {MANIFEST_CRC} (saved before manifests had a checksum): its manifest.json \
                     is used unchecked",
                    dir.display()
                );
            }
            return Ok(());
        }
        Err(e) => return Err(format!("{MANIFEST_CRC} cannot be read: {e}")),
    };
    let now = manifest_crc_line(text);
    if saved.trim() != now.trim() {
        return Err(format!(
            "manifest.json fails its checksum (CRC-32 {}, {MANIFEST_CRC} says {}): manifest.json was edited or is \
             corrupt; resume from another checkpoint, e.g. --resume latest for the newest intact one or --resume DIR \
             with an earlier step_* directory",
            now.trim(),
            saved.trim()
        ));
    }
    Ok(())
}

/// Every segment `f` lists must lie inside its unit and match the tensors of the shard
/// file: `master`, `m` and `v` of the unit, little-endian f32, exactly `hi - lo` values each
/// (a bound off by one would otherwise slice out of range on a rank).
fn check_segments(m: &Manifest, f: &super::FileEntry, st: &SafeTensors) -> Result<(), String> {
    for s in &f.segments {
        let unit = m
            .units
            .get(s.unit)
            .ok_or_else(|| format!("a segment is of unit {} but the model has {} units", s.unit, m.units.len()))?;
        if s.lo > s.hi || s.hi > unit.numel {
            return Err(format!(
                "the segment {}..{} of unit {} is outside its {} values",
                s.lo, s.hi, unit.name, unit.numel
            ));
        }
        for tag in ["master", "m", "v"] {
            let name = format!("{}.{tag}", unit.name);
            let t = st.tensor(&name).map_err(|e| format!("tensor {name} of segment {}..{}: {e}", s.lo, s.hi))?;
            let held = t.data().len() / 4;
            if t.dtype() != safetensors::Dtype::F32 || t.data().len() % 4 != 0 || held != s.hi - s.lo {
                return Err(format!(
                    "the segment {}..{} of unit {} is {} values but tensor {name} holds {held} ({:?})",
                    s.lo,
                    s.hi,
                    unit.name,
                    s.hi - s.lo,
                    t.dtype()
                ));
            }
        }
    }
    Ok(())
}

/// Whether `dir` (which has no manifest) is what a save leaves: a `step_*` or
/// `.step_*.partial` directory, or one holding shard files.
fn looks_like_a_save(dir: &Path) -> bool {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if name.starts_with("step_") || (name.starts_with(".step_") && name.ends_with(".partial")) {
        return true;
    }
    fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("rank") && (n.ends_with(".safetensors") || n.ends_with(".sum.json"))
        })
    })
}

/// Complete checkpoints (those with a manifest) under `root`, as (step, dir).
pub fn list_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut out = vec![];
    let rd = match fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(CheckpointError::Io { path: root.to_path_buf(), source: e }),
    };
    for entry in rd {
        let entry = entry.map_err(io_err(root))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(step) = name.strip_prefix("step_").and_then(|s| s.parse::<u64>().ok()) {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// The newest checkpoint under `root` that validates completely (manifest, sizes,
/// checksums). If newer ones are broken, the error says what is wrong with the newest
/// and names the newest intact one to resume from instead.
pub fn find_latest(root: &Path) -> Result<PathBuf, CheckpointError> {
    find_latest_of(root, None)
}

/// [`find_latest`] among the checkpoints of run `owner` only (see `owner.rs`: checkpoints
/// without a run id count as the owner's; `None` takes every run's).
pub fn find_latest_of(root: &Path, owner: Option<&str>) -> Result<PathBuf, CheckpointError> {
    let mut all = list_checkpoints(root)?;
    let mut others: Vec<String> = Vec::new();
    // A manifest that cannot be read is kept: it is reported as broken below, not skipped.
    all.retain(|(_, d)| match super::owner::run_id_of_checkpoint(d) {
        Ok(saved) if !super::owner::belongs_to(saved.as_deref(), owner) => {
            others.push(format!("{} (run {})", d.display(), saved.unwrap_or_default()));
            false
        }
        _ => true,
    });
    if all.is_empty() {
        let detail = match (owner, others.is_empty()) {
            (Some(run), false) => format!(
                "it holds checkpoints of other runs only ({}), none of run {run}, which owns this run directory: \
                 resume one of them by name with --resume DIR into an output.dir of its own",
                others.join(", ")
            ),
            _ => "it holds no step_* checkpoint directories (set checkpoint.every to save some)".into(),
        };
        return Err(CheckpointError::NoneFound { dir: root.to_path_buf(), detail });
    }
    let mut newest_problem: Option<CheckpointError> = None;
    for (_, dir) in all.iter().rev() {
        match CheckpointReader::open(dir, true) {
            Ok(_) => {
                return match newest_problem {
                    None => Ok(dir.clone()),
                    Some(p) => Err(CheckpointError::NoneFound {
                        dir: root.to_path_buf(),
                        detail: format!(
                            "the newest checkpoint is broken ({p}); the newest intact one is {}: \
                             resume from it with --resume {}",
                            dir.display(),
                            dir.display()
                        ),
                    }),
                };
            }
            Err(e) => {
                if newest_problem.is_none() {
                    newest_problem = Some(e);
                }
            }
        }
    }
    Err(CheckpointError::NoneFound {
        dir: root.to_path_buf(),
        detail: format!(
            "no checkpoint is intact; the newest failed with: {}",
            newest_problem.map(|e| e.to_string()).unwrap_or_default()
        ),
    })
}
