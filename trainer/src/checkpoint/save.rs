//! Writing a sharded checkpoint: all ranks in parallel, manifest last, atomic rename. The
//! pieces (`make_partial`, `write_shard`, `publish`) serve the synchronous save here,
//! which runs them between barriers, and the background one (`background.rs`).

use super::manifest::{
    file_crc, manifest_crc_line, FileEntry, Manifest, Segment, UnitEntry, FORMAT_VERSION, MANIFEST_CRC,
};
use super::owner::{belongs_to, run_id_of_checkpoint, run_id_of_dir};
use super::stream::{write_streamed, ReadFn};
use super::{io_err, shard_file_name, step_dir_name, CheckpointError};
use crate::backend::{Backend, GemmTuningTable};
use crate::config::{Config, ModelConfig};
use crate::zero::{Engine, EngineComm};
use crate::TrainError;
use collectives::Group;
use std::borrow::Cow;
use std::fs;
use std::io::Write;
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
    let step = meta.step;
    let rank = eng.rank;
    let dirs = SaveDirs::of(root, step);
    if rank == 0 {
        make_partial(&dirs)?;
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
        for (which, tag) in TAGS.iter().enumerate() {
            let read: ReadFn = Box::new(move || eng.optimizer_tensor_host(be, i, which, lo, hi).map(Cow::Owned));
            tensors.push((format!("{}.{tag}", unit.name), vec![hi - lo], read));
        }
        segments.push(Segment { unit: i, lo, hi });
    }
    write_shard(&dirs, rank, tensors, segments)?;
    Group::barrier(comm)?;

    // 2. Rank 0: collect the entries, write the manifest last, publish atomically, prune.
    if rank == 0 {
        publish(&dirs, &ManifestBase::of(eng, &meta)?)?;
    }
    Group::barrier(comm)?;
    Ok(dirs.final_dir)
}

/// The names of a unit's three tensors in a shard file: `h.3.master`, `h.3.m`, `h.3.v`.
pub(crate) const TAGS: [&str; 3] = ["master", "m", "v"];

/// Where the checkpoint of one step is written and where it appears.
#[derive(Debug, Clone)]
pub(crate) struct SaveDirs {
    pub root: PathBuf,
    /// `.step_<step>.partial`: written into, renamed into place once complete.
    pub tmp: PathBuf,
    pub final_dir: PathBuf,
}

impl SaveDirs {
    pub fn of(root: &Path, step: u64) -> SaveDirs {
        let name = step_dir_name(step);
        SaveDirs { root: root.to_path_buf(), tmp: root.join(format!(".{name}.partial")), final_dir: root.join(&name) }
    }

    /// Rank `rank`'s summary of its shard file (its entry in the manifest).
    pub fn summary(&self, rank: usize) -> PathBuf {
        self.tmp.join(format!("{}.sum.json", shard_file_name(rank)))
    }
}

/// What the manifest holds besides the ranks' files, taken on the training thread (a
/// background writer builds the manifest from it later).
#[derive(Debug, Clone)]
pub(crate) struct ManifestBase {
    step: u64,
    world: usize,
    stage: u8,
    seed: u64,
    model: ModelConfig,
    config_toml: String,
    units: Vec<UnitEntry>,
    output_dir: PathBuf,
    keep: usize,
    /// The data loader's position and the data's identity.
    data: Option<data::LoaderState>,
    /// The GEMM algorithms in use.
    gemm_tuning: Option<GemmTuningTable>,
}

impl ManifestBase {
    pub fn of<B: Backend>(eng: &Engine<B>, meta: &SaveMeta<'_>) -> Result<ManifestBase, TrainError> {
        let (cfg, step) = (meta.cfg, meta.step);
        Ok(ManifestBase {
            step,
            world: eng.world,
            stage: eng.policy.stage,
            seed: cfg.train.seed,
            model: cfg.model.clone(),
            config_toml: toml::to_string(cfg).map_err(|e| TrainError::Invalid(e.to_string()))?,
            units: eng.layout.units.iter().map(|u| UnitEntry { name: u.name.clone(), numel: u.numel }).collect(),
            output_dir: cfg.output.dir.clone(),
            keep: cfg.checkpoint.keep,
            data: meta.data.cloned(),
            gemm_tuning: meta.gemm_tuning.cloned(),
        })
    }

    pub fn world(&self) -> usize {
        self.world
    }
}

/// Rank 0, before any rank writes: an empty partial directory for the step.
pub(crate) fn make_partial(dirs: &SaveDirs) -> Result<(), TrainError> {
    fs::create_dir_all(&dirs.root).map_err(io_err(&dirs.root))?;
    if dirs.tmp.exists() {
        // Left by a crash mid-save: it never became a checkpoint, so it is safe to drop.
        fs::remove_dir_all(&dirs.tmp).map_err(io_err(&dirs.tmp))?;
    }
    fs::create_dir(&dirs.tmp).map_err(io_err(&dirs.tmp))?;
    Ok(())
}

/// This rank's shard file (`tensors` streamed, fsynced) and then its summary: size, CRC-32
/// and the unit ranges it holds, written atomically once the shard is durable (its presence
/// says so: the background save's completion barrier waits for every rank's).
pub(crate) fn write_shard(
    dirs: &SaveDirs,
    rank: usize,
    tensors: Vec<(String, Vec<usize>, ReadFn<'_>)>,
    segments: Vec<Segment>,
) -> Result<(), TrainError> {
    let file = shard_file_name(rank);
    let path = dirs.tmp.join(&file);
    write_streamed(&path, tensors, None)?;
    let (bytes, crc32) = file_crc(&path)?;
    let entry = FileEntry { name: file, rank, bytes, crc32, segments };
    let text = serde_json::to_vec(&entry).map_err(|e| TrainError::Invalid(e.to_string()))?;
    write_atomic(&dirs.summary(rank), &text)?;
    Ok(())
}

/// Rank 0, once every rank's summary is there: the manifest (written last), the directory
/// renamed into place, this run's checkpoints beyond `checkpoint.keep` pruned.
pub(crate) fn publish(dirs: &SaveDirs, base: &ManifestBase) -> Result<(), TrainError> {
    let (tmp_dir, final_dir, root) = (&dirs.tmp, &dirs.final_dir, &dirs.root);
    let run_id = run_id_of_dir(&base.output_dir)?;
    let mut files = Vec::with_capacity(base.world);
    for r in 0..base.world {
        let p = dirs.summary(r);
        let text = fs::read(&p).map_err(io_err(&p))?;
        let e: FileEntry = serde_json::from_slice(&text)
            .map_err(|e| CheckpointError::Invalid { dir: tmp_dir.clone(), problem: format!("{}: {e}", p.display()) })?;
        fs::remove_file(&p).map_err(io_err(&p))?;
        files.push(e);
    }
    let manifest = Manifest {
        format: FORMAT_VERSION,
        step: base.step,
        world: base.world,
        stage: base.stage,
        seed: base.seed,
        model: base.model.clone(),
        config_toml: base.config_toml.clone(),
        units: base.units.clone(),
        files,
        run_id: run_id.clone(),
        data: base.data.clone(),
        gemm_tuning: base.gemm_tuning.clone(),
    };
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| TrainError::Invalid(e.to_string()))?;
    write_atomic(&tmp_dir.join("manifest.json"), &text)?;
    write_atomic(&tmp_dir.join(MANIFEST_CRC), manifest_crc_line(&text).as_bytes())?;
    fsync_dir(tmp_dir)?;
    if final_dir.exists() {
        // Only this run's own checkpoint of this step is replaced (the launcher keeps other
        // runs' checkpoints out of checkpoint.dir; this is the last line of defence).
        match run_id_of_checkpoint(final_dir) {
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
            _ => fs::remove_dir_all(final_dir).map_err(io_err(final_dir))?,
        }
    }
    fs::rename(tmp_dir, final_dir).map_err(io_err(final_dir))?;
    fsync_dir(root)?;
    prune(root, base.keep, run_id.as_deref())
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
