//! `--resume DIR|latest`: choosing the checkpoint and checking it once, before any rank starts.
//!
//! `latest` is the newest checkpoint under `checkpoint.dir` of the run that owns the run
//! directory that validates completely ([`trainer::checkpoint::find_latest_of`]: checkpoints
//! of other runs are skipped; when newer ones are broken its message says what is wrong with
//! the newest and names the newest intact one). A directory given by name is
//! opened with every file's size and CRC-32 verified. Either way the model shape must match
//! the config, the manifest must be consistent (ZeRO stage 0-3, one shard file per rank of
//! its world, a step that matches the directory name, segments inside their units: see
//! [`check_manifest`]), and the checkpoint's step must leave steps to train. Any problem is a
//! [`SetupError`] (exit code 2) that names the file and what is wrong with it.
//!
//! The ranks then only check sizes ([`trainer::train::Trainer::resume`]): the checksums were
//! read here, once. The world size and ZeRO stage may differ from the run that saved it: each
//! rank reads just the byte ranges it holds now (the trainer reshards).

use crate::errors::SetupError;
use std::path::{Path, PathBuf};
use trainer::checkpoint::load::list_checkpoints;
use trainer::checkpoint::{find_latest_of, CheckpointReader};
use trainer::Config;

/// The value of `--resume` that picks the newest intact checkpoint.
pub const LATEST: &str = "latest";

/// A validated checkpoint to continue from.
#[derive(Debug, Clone)]
pub struct Resume {
    /// The checkpoint directory (`.../step_00000100`), absolute; every worker gets `--resume` it.
    pub dir: PathBuf,
    /// Optimizer steps the checkpoint completed: training continues at `step + 1`.
    pub step: u64,
    /// World size and ZeRO stage of the run that saved it.
    pub saved_world: usize,
    pub saved_stage: u8,
    /// The run that saved it (`None`: saved before run ids).
    pub run_id: Option<String>,
    /// Differences from the saved run worth knowing (the learning-rate schedule, the batch).
    pub notes: Vec<String>,
}

impl Resume {
    /// The line after which rank logs continue: the interrupted run's log (and its last
    /// error) stays above it.
    pub fn log_marker(&self) -> String {
        format!("--- launcher: resuming from {} at step {} ---", self.dir.display(), self.step)
    }
}

/// Resolve `--resume` (`latest` or a directory) for a job of `world` ranks running `cfg`
/// (whose paths are absolute already), in a run directory owned by run `owner`.
pub fn resolve(arg: &Path, cfg: &Config, world: usize, owner: Option<&str>) -> Result<Resume, SetupError> {
    let root = cfg.checkpoint_dir();
    let reader = if arg == Path::new(LATEST) {
        // find_latest verified every file's checksum of the one it returns: sizes suffice now.
        let dir = find_latest_of(&root, owner).map_err(|e| SetupError(format!("--resume {LATEST}: {e}")))?;
        CheckpointReader::open(&dir, false)
    } else {
        let dir = std::path::absolute(arg).unwrap_or_else(|_| arg.to_path_buf());
        if !dir.exists() {
            return Err(SetupError(format!(
                "--resume {}: {} does not exist; give a checkpoint directory (step_*) or `--resume {LATEST}` \
                 for the newest intact one in checkpoint.dir = {}",
                arg.display(),
                dir.display(),
                root.display()
            )));
        }
        if let Some(hint) = root_hint(&dir) {
            return Err(SetupError(format!("--resume {}: {hint}", arg.display())));
        }
        CheckpointReader::open(&dir, true)
    }
    .map_err(|e| SetupError(format!("--resume {}: {e}", arg.display())))?;
    reader.check_model(&cfg.model).map_err(|e| SetupError(format!("--resume {}: {e}", arg.display())))?;
    check_manifest(&reader.dir, &reader.manifest).map_err(|e| {
        SetupError(format!(
            "--resume {}: checkpoint {} has an inconsistent manifest.json: {e}; it cannot be resumed: pick another \
             checkpoint directory (--resume DIR)",
            arg.display(),
            reader.dir.display()
        ))
    })?;

    let m = &reader.manifest;
    let steps = cfg.train.steps as u64;
    if m.step >= steps {
        return Err(SetupError(format!(
            "--resume {}: checkpoint {} is at step {} and train.steps = {steps}, so there is nothing left to train: \
             raise train.steps to continue, e.g. --set train.steps={}",
            arg.display(),
            reader.dir.display(),
            m.step,
            m.step + steps.max(1)
        )));
    }
    Ok(Resume {
        dir: reader.dir.clone(),
        step: m.step,
        saved_world: m.world,
        saved_stage: m.stage,
        run_id: m.run_id.clone(),
        notes: differences(&m.config_toml, m.world, cfg, world),
    })
}

/// The manifest's own numbers must agree with each other and with the directory: a ZeRO
/// stage 0-3, a world of at least one rank with exactly one shard file per rank, a step of
/// at least 1 equal to the `step_N` of the directory name, and every file segment inside
/// its unit. (A hand-edited or mixed-up manifest would otherwise resume with wrong state, or
/// crash a rank.)
pub fn check_manifest(dir: &Path, m: &trainer::checkpoint::Manifest) -> Result<(), String> {
    if m.stage > 3 {
        return Err(format!("it says ZeRO stage {}, but stages are 0 to 3", m.stage));
    }
    if m.world == 0 {
        return Err("it says world 0: a checkpoint is saved by at least one rank".into());
    }
    if m.files.len() != m.world {
        return Err(format!("it says world {} but lists {} shard files (one per rank)", m.world, m.files.len()));
    }
    let mut ranks: Vec<usize> = m.files.iter().map(|f| f.rank).collect();
    ranks.sort_unstable();
    if ranks.iter().enumerate().any(|(i, &r)| i != r) {
        return Err(format!("its shard files are of ranks {ranks:?}, not 0 to {}", m.world - 1));
    }
    if m.step == 0 {
        return Err("it says step 0: checkpoints are saved after a step".into());
    }
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("step_"))
        .and_then(|s| s.parse::<u64>().ok());
    if let Some(n) = named.filter(|&n| n != m.step) {
        return Err(format!("it says step {} but its directory is step {n}", m.step));
    }
    for f in &m.files {
        for s in &f.segments {
            let unit = m.units.get(s.unit).ok_or_else(|| {
                format!("{} holds a segment of unit {} but the model has {} units", f.name, s.unit, m.units.len())
            })?;
            if s.lo > s.hi || s.hi > unit.numel {
                return Err(format!(
                    "{} holds {}..{} of unit {} which has {} values",
                    f.name, s.lo, s.hi, unit.name, unit.numel
                ));
            }
        }
    }
    Ok(())
}

/// When `dir` is not one checkpoint but a directory of them (or a run directory), say which to pick.
fn root_hint(dir: &Path) -> Option<String> {
    let Some((count, intact)) = checkpoint_root(dir) else {
        let inner = dir.join("checkpoints");
        let (_, intact) = checkpoint_root(&inner)?;
        let pick =
            intact.map_or(String::new(), |d| format!(" or one of its checkpoints, e.g. --resume {}", d.display()));
        return Some(format!(
            "{} is a run directory, not a checkpoint: continue its run with `--resume {LATEST}` and \
             output.dir = {}{pick}",
            dir.display(),
            dir.display()
        ));
    };
    let pick = match intact {
        Some(d) => format!("pass one of them, e.g. --resume {}", d.display()),
        None => "and none of them is intact".to_string(),
    };
    Some(format!(
        "{} holds {count} checkpoints (step_* directories), it is not one: {pick}, or `--resume {LATEST}` with \
         checkpoint.dir = {}",
        dir.display(),
        dir.display()
    ))
}

/// If `dir` is a directory of checkpoints (no manifest of its own, `step_*` inside): how many
/// it holds and the newest one that validates completely (sizes and checksums).
pub fn checkpoint_root(dir: &Path) -> Option<(usize, Option<PathBuf>)> {
    if dir.join("manifest.json").exists() {
        return None;
    }
    let all = list_checkpoints(dir).ok().filter(|a| !a.is_empty())?;
    let intact = all.iter().rev().find(|(_, d)| CheckpointReader::open(d, true).is_ok()).map(|(_, d)| d.clone());
    Some((all.len(), intact))
}

/// What changed in `[train]` and in the global batch since the saved run (notes, not errors:
/// resuming with other settings is allowed, but then it is not the saved run's continuation).
fn differences(saved_toml: &str, saved_world: usize, cfg: &Config, world: usize) -> Vec<String> {
    let Ok(saved) = Config::from_toml_str(saved_toml, "the checkpoint's config") else {
        return vec![];
    };
    let mut notes = vec![];
    let table = |c: &Config| toml::Value::try_from(&c.train).ok().and_then(|v| v.as_table().cloned());
    if let (Some(old), Some(new)) = (table(&saved), table(cfg)) {
        let changed: Vec<String> = new
            .iter()
            .filter(|(k, v)| k.as_str() != "steps" && old.get(*k) != Some(*v))
            .map(|(k, v)| {
                format!("train.{k} = {v} (was {})", old.get(k).map(|o| o.to_string()).unwrap_or("unset".into()))
            })
            .collect();
        if !changed.is_empty() {
            notes.push(format!("changed since the checkpoint was saved: {}", changed.join(", ")));
        }
        if saved.train.steps != cfg.train.steps {
            notes.push(format!(
                "train.steps = {} (the saved run had {}): from here on the learning rate follows the schedule of {} \
                 steps (warmup, then cosine decay to min_lr at the last step)",
                cfg.train.steps, saved.train.steps, cfg.train.steps
            ));
        }
    }
    let rows = |c: &Config, w: usize| c.train.micro_batch * c.train.grad_accum * w;
    let (before, now) = (rows(&saved, saved_world), rows(cfg, world));
    if before != now {
        notes.push(format!(
            "the global batch is {now} sequences (micro_batch × grad_accum × ranks); the saved run used {before}: \
             keep it equal for the same training trajectory"
        ));
    }
    notes
}
