//! Writing a sharded checkpoint: all ranks in parallel, manifest last, atomic rename.

use super::manifest::{FileEntry, Manifest, Segment, UnitEntry, FORMAT_VERSION};
use super::owner::{belongs_to, run_id_of_checkpoint, run_id_of_dir};
use super::stream::{write_streamed, ReadFn};
use super::{io_err, shard_file_name, step_dir_name, CheckpointError};
use crate::backend::{Backend, GemmTuningTable};
use crate::config::Config;
use crate::zero::{Engine, EngineComm};
use crate::TrainError;
use collectives::Group;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// What a checkpoint holds besides the engine's state.
pub struct SaveMeta<'a> {
    pub cfg: &'a Config,
    /// Optimizer steps done.
    pub step: u64,
    /// The data loader's position and the data's identity.
    pub data: Option<&'a data::LoaderState>,
    /// The GEMM algorithms in use (rank 0's is written).
    pub gemm_tuning: Option<&'a GemmTuningTable>,
}

/// Save this rank's shard of the engine state at `meta.step` into `<root>/step_<step>/`,
/// with the data loader's position and the GEMM choices in the manifest. Collective: every
/// rank must call it. Returns the checkpoint directory.
pub fn save<B: Backend, C: EngineComm<B>>(
    be: &B,
    comm: &mut C,
    eng: &Engine<B>,
    meta: SaveMeta<'_>,
    root: &Path,
) -> Result<PathBuf, TrainError> {
    let (cfg, step) = (meta.cfg, meta.step);
    let rank = eng.rank;
    let name = step_dir_name(step);
    let final_dir = root.join(&name);
    let tmp_dir = root.join(format!(".{name}.partial"));
    if rank == 0 {
        fs::create_dir_all(root).map_err(io_err(root))?;
        if tmp_dir.exists() {
            // Left by a crash mid-save: it never became a checkpoint, so it is safe to drop.
            fs::remove_dir_all(&tmp_dir).map_err(io_err(&tmp_dir))?;
        }
        fs::create_dir(&tmp_dir).map_err(io_err(&tmp_dir))?;
    }
    Group::barrier(comm)?;

    // 1. This rank's shard: its partition of every unit's master, m, v — streamed to the
    //    file one tensor at a time, so host memory stays at one tensor, not the whole shard.
    let mut tensors: Vec<(String, Vec<usize>, ReadFn)> = Vec::new();
    let mut segments = Vec::new();
    for (i, unit) in eng.layout.units.iter().enumerate() {
        let (lo, hi) = eng.checkpoint_range(i);
        if hi <= lo {
            continue;
        }
        for (which, tag) in ["master", "m", "v"].iter().enumerate() {
            let read: ReadFn = Box::new(move || eng.optimizer_tensor_host(be, i, which, lo, hi));
            tensors.push((format!("{}.{tag}", unit.name), vec![hi - lo], read));
        }
        segments.push(Segment { unit: i, lo, hi });
    }
    let file = shard_file_name(rank);
    let path = tmp_dir.join(&file);
    write_streamed(&path, tensors, None)?;
    let (bytes, crc32) = file_crc(&path)?;
    let entry = FileEntry { name: file, rank, bytes, crc32, segments };
    let sum_path = tmp_dir.join(format!("{}.sum.json", shard_file_name(rank)));
    write_atomic(&sum_path, serde_json::to_vec(&entry).map_err(|e| TrainError::Invalid(e.to_string()))?.as_slice())?;
    Group::barrier(comm)?;

    // 2. Rank 0: collect the entries, write the manifest last, publish atomically, prune.
    if rank == 0 {
        let run_id = run_id_of_dir(&cfg.output.dir)?;
        let mut files = Vec::with_capacity(eng.world);
        for r in 0..eng.world {
            let p = tmp_dir.join(format!("{}.sum.json", shard_file_name(r)));
            let text = fs::read(&p).map_err(io_err(&p))?;
            let e: FileEntry = serde_json::from_slice(&text).map_err(|e| CheckpointError::Invalid {
                dir: tmp_dir.clone(),
                problem: format!("{}: {e}", p.display()),
            })?;
            fs::remove_file(&p).map_err(io_err(&p))?;
            files.push(e);
        }
        let manifest = Manifest {
            format: FORMAT_VERSION,
            step,
            world: eng.world,
            stage: eng.policy.stage,
            seed: cfg.train.seed,
            model: cfg.model.clone(),
            config_toml: toml::to_string(cfg).map_err(|e| TrainError::Invalid(e.to_string()))?,
            units: eng.layout.units.iter().map(|u| UnitEntry { name: u.name.clone(), numel: u.numel }).collect(),
            files,
            run_id: run_id.clone(),
            data: meta.data.cloned(),
            gemm_tuning: meta.gemm_tuning.cloned(),
        };
        let text = serde_json::to_vec_pretty(&manifest).map_err(|e| TrainError::Invalid(e.to_string()))?;
        write_atomic(&tmp_dir.join("manifest.json"), &text)?;
        fsync_dir(&tmp_dir)?;
        if final_dir.exists() {
            // Only this run's own checkpoint of this step is replaced (the launcher keeps other
            // runs' checkpoints out of checkpoint.dir; this is the last line of defence).
            match run_id_of_checkpoint(&final_dir) {
                Ok(saved) if !belongs_to(saved.as_deref(), run_id.as_deref()) => {
                    return Err(CheckpointError::Invalid {
                        dir: final_dir.clone(),
                        problem: format!(
                            "it belongs to run {}, not to this run ({}): it is kept; give this run a \
                             checkpoint.dir of its own",
                            saved.unwrap_or_default(),
                            run_id.unwrap_or_default()
                        ),
                    }
                    .into());
                }
                _ => fs::remove_dir_all(&final_dir).map_err(io_err(&final_dir))?,
            }
        }
        fs::rename(&tmp_dir, &final_dir).map_err(io_err(&final_dir))?;
        fsync_dir(root)?;
        prune(root, cfg.checkpoint.keep, run_id.as_deref())?;
    }
    Group::barrier(comm)?;
    Ok(final_dir)
}

/// Remove this run's complete checkpoints beyond its newest `keep` (only ever after a new
/// one is complete). Checkpoints of other runs, and those without a run id when this run
/// has one (saved before run ids), are never pruned.
fn prune(root: &Path, keep: usize, run_id: Option<&str>) -> Result<(), TrainError> {
    let mut steps = super::load::list_checkpoints(root)?;
    steps.retain(|(_, d)| run_id_of_checkpoint(d).is_ok_and(|saved| saved.as_deref() == run_id));
    steps.sort();
    if steps.len() > keep {
        for (_, dir) in &steps[..steps.len() - keep] {
            fs::remove_dir_all(dir).map_err(io_err(dir))?;
        }
    }
    Ok(())
}

/// Write bytes under a temporary name, fsync, rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = path.with_extension("partial");
    let mut f = fs::File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))
}

fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    fs::File::open(dir).and_then(|f| f.sync_all()).map_err(io_err(dir))
}

/// Size and CRC-32 of a file, streamed.
pub(crate) fn file_crc(path: &Path) -> Result<(u64, u32), CheckpointError> {
    let mut f = fs::File::open(path).map_err(io_err(path))?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        total += n as u64;
    }
    Ok((total, h.finalize()))
}
