//! Who owns a run directory, and what a launch may do with it.
//!
//! A run directory (`output.dir`) belongs to one run: its `run.json` names it (a run id made
//! at its first launch, when and where it started, the config's hash, its checkpoint.dir),
//! and rank 0 records that id in every checkpoint it saves (`trainer::checkpoint::owner`).
//! Node 0's launcher looks at the directory before writing anything ([`Survey`]) and decides
//! ([`claim`]):
//! - a new run where a run has completed steps or saved checkpoints, or whose outside
//!   `checkpoint.dir` holds checkpoints, is refused (exit code 2) naming the directory and the
//!   choices: `--resume`, another directory, or `--overwrite`, which moves the old run (and
//!   such a checkpoint.dir) aside to `<dir>.prev-<run id>`: nothing is ever deleted;
//! - a run that never completed a step (it failed or was stopped before its first step) is
//!   taken over by the new run, whose rank logs continue the old ones after a marker line;
//! - `--resume` continues the owner's run: `latest` picks only its checkpoints, and a
//!   checkpoint of another run is refused; a fresh directory continuing a checkpoint takes
//!   the checkpoint's run id (the same run, moved);
//! - a directory from before run ids (metrics, logs or checkpoints but no `run.json`) is one
//!   run: a new run is refused as above, `--resume` adopts it (its checkpoints have no run id
//!   and count as its own).
//!
//! Both directories are locked first (`runlock`). Other nodes write only their ranks' logs
//! and their resolved config: node 0 owns the run directory.

use crate::errors::SetupError;
use crate::rundir::resume::Resume;
use crate::rundir::runlock::{host_name, RunLock};
use crate::time::{compact_utc, now_unix, utc};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use trainer::checkpoint::load::list_checkpoints;
use trainer::checkpoint::owner::{belongs_to, run_id_of_checkpoint, RUN_FILE};
use trainer::Config;

/// `run.json`: the run that owns a run directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunIdentity {
    /// `YYYYMMDD-HHMMSS-xxxxxxxx`: the first launch's UTC time and 32 random bits.
    pub run_id: String,
    pub created_unix: u64,
    /// The same, for people (UTC).
    pub created: String,
    pub host: String,
    pub launcher_pid: u32,
    /// The config file as given on the first launch's command line.
    pub config: String,
    /// FNV-1a (64 bits) of the resolved config of the first launch (`--set` applied).
    pub config_hash: String,
    pub checkpoint_dir: PathBuf,
    /// The checkpoint a fresh directory started from (`--resume`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<PathBuf>,
    /// The directory held a run from before run ids, adopted by a `--resume`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopted: bool,
}

impl RunIdentity {
    fn new(run_id: String, cfg: &Config, config_path: &Path) -> RunIdentity {
        let now = now_unix();
        RunIdentity {
            run_id,
            created_unix: now,
            created: utc(now),
            host: host_name(),
            launcher_pid: std::process::id(),
            config: config_path.display().to_string(),
            config_hash: config_hash(cfg),
            checkpoint_dir: cfg.checkpoint_dir(),
            resumed_from: None,
            adopted: false,
        }
    }
}

/// What a run directory (and its checkpoint.dir) holds before a launch.
#[derive(Debug)]
pub struct Survey {
    out_dir: PathBuf,
    ckpt_dir: PathBuf,
    /// `checkpoint.dir` lies outside `output.dir`.
    ckpt_outside: bool,
    owner: Option<RunIdentity>,
    /// Lines of `metrics.jsonl` (steps recorded).
    steps: usize,
    /// Non-empty logs of node 0's ranks (other nodes' ranks may be writing theirs already
    /// when nodes share the directory).
    logs: usize,
    /// Complete checkpoints (with a manifest) in `checkpoint.dir`: directory name and run id.
    checkpoints: Vec<(String, Option<String>)>,
}

impl Survey {
    /// Look at the directories of `cfg` (paths absolute), of a node 0 that runs `local_ranks` ranks.
    pub fn of(cfg: &Config, local_ranks: usize) -> Result<Survey, SetupError> {
        let out_dir = cfg.output.dir.clone();
        let ckpt_dir = cfg.checkpoint_dir();
        let run_file = out_dir.join(RUN_FILE);
        let owner = match std::fs::read(&run_file) {
            Ok(text) => Some(serde_json::from_slice::<RunIdentity>(&text).map_err(|e| {
                SetupError(format!(
                    "{} does not parse ({e}): it names the run that owns output.dir; restore it, or move the \
                     directory aside (or give this run another output.dir)",
                    run_file.display()
                ))
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(SetupError(format!("cannot read {} ({e})", run_file.display()))),
        };
        let logs = (0..local_ranks)
            .filter(|r| {
                std::fs::metadata(out_dir.join("logs").join(format!("rank{r}.log")))
                    .is_ok_and(|m| m.is_file() && m.len() > 0)
            })
            .count();
        let checkpoints = list_checkpoints(&ckpt_dir)
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, d)| d.join("manifest.json").is_file())
            .map(|(_, d)| {
                let id = run_id_of_checkpoint(&d).ok().flatten();
                (d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(), id)
            })
            .collect();
        Ok(Survey {
            steps: count_lines(&out_dir.join("metrics.jsonl")),
            ckpt_outside: !ckpt_dir.starts_with(&out_dir),
            out_dir,
            ckpt_dir,
            owner,
            logs,
            checkpoints,
        })
    }

    /// The run that owns the directory, if it has a `run.json`.
    pub fn owner_id(&self) -> Option<&str> {
        self.owner.as_ref().map(|o| o.run_id.as_str())
    }

    /// Checkpoints inside output.dir (they are the directory's run's).
    fn inner_checkpoints(&self) -> &[(String, Option<String>)] {
        if self.ckpt_outside {
            &[]
        } else {
            &self.checkpoints
        }
    }

    /// A run completed steps here (or saved checkpoints).
    fn has_progress(&self) -> bool {
        self.steps > 0 || !self.inner_checkpoints().is_empty()
    }

    /// A run started here (perhaps without completing a step).
    fn holds_run(&self) -> bool {
        self.owner.is_some() || self.logs > 0 || self.has_progress()
    }

    /// "run X (started ... on host H)" or "a run from before run ids".
    fn who(&self) -> String {
        match &self.owner {
            Some(o) => format!("run {} (started {} on host {})", o.run_id, o.created, o.host),
            None => "a run from before run ids".to_string(),
        }
    }

    /// What the directory's run left: steps and checkpoints.
    fn what(&self) -> String {
        let mut parts = Vec::new();
        if self.steps > 0 {
            parts.push(format!("{} steps in metrics.jsonl", self.steps));
        }
        if !self.inner_checkpoints().is_empty() {
            parts.push(format!("checkpoints {}", names(self.inner_checkpoints())));
        }
        if self.logs > 0 {
            parts.push(format!("{} rank logs", self.logs));
        }
        parts.join(", ")
    }
}

/// The locks of a launch: `output.dir`, and `checkpoint.dir` when it lies outside it and
/// the run saves checkpoints there.
#[derive(Debug)]
pub struct Locks {
    out: RunLock,
    ckpt: Option<RunLock>,
}

/// Lock the run's directories (node 0, before anything else is read or written there).
/// Returns the locks and lines to print (stale locks taken over).
pub fn lock(cfg: &Config) -> Result<(Locks, Vec<String>), SetupError> {
    let (out, note) = RunLock::acquire(&cfg.output.dir, "output.dir")?;
    let mut notes: Vec<String> = note.into_iter().collect();
    let ckpt_dir = cfg.checkpoint_dir();
    let ckpt = if cfg.checkpoint.every > 0 && !ckpt_dir.starts_with(&cfg.output.dir) {
        let (lock, note) = RunLock::acquire(&ckpt_dir, "checkpoint.dir")?;
        notes.extend(note);
        Some(lock)
    } else {
        None
    };
    Ok((Locks { out, ckpt }, notes))
}

/// What a launch does with its run directory; see [`claim`].
#[derive(Debug)]
pub struct Claim {
    pub identity: RunIdentity,
    /// `run.json` is (re)written: a new run, or a directory that had none.
    write: bool,
    /// The line after which this run's rank logs continue the ones there (a resume, or a
    /// run taking over one that never completed a step); `None`: the logs start empty.
    pub log_marker: Option<String>,
    /// What was done, for the launcher to print (runs moved aside, a run taken over).
    pub notes: Vec<String>,
}

impl Claim {
    /// Write `run.json` (after every check passed, before the ranks start).
    pub fn commit(&self, out_dir: &Path) -> Result<(), SetupError> {
        if !self.write {
            return Ok(());
        }
        let path = out_dir.join(RUN_FILE);
        let text = serde_json::to_string_pretty(&self.identity)
            .map_err(|e| SetupError(format!("cannot encode {} ({e}; a bug: please report it)", path.display())))?;
        let tmp = out_dir.join(format!(".{RUN_FILE}.partial"));
        std::fs::write(&tmp, text + "\n")
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| SetupError(format!("cannot write {} ({e}): is output.dir writable?", path.display())))
    }
}

/// Decide what this launch may do with the directories `survey` describes (see the module
/// notes), moving old runs aside for `--overwrite`. Refusals come before any move.
pub fn claim(
    cfg: &Config,
    survey: &Survey,
    resume: Option<&Resume>,
    overwrite: bool,
    locks: &mut Locks,
    config_path: &Path,
) -> Result<Claim, SetupError> {
    let saves = cfg.checkpoint.every > 0;
    let mut notes = Vec::new();
    let mut log_marker = None;
    let mut write = true;
    let identity = match resume {
        None => {
            let mut moves: Vec<(&Path, &str)> = Vec::new();
            let identity = RunIdentity::new(new_run_id()?, cfg, config_path);
            if survey.has_progress() || (overwrite && survey.holds_run()) {
                if !overwrite {
                    return Err(refuse_new_run(survey));
                }
                moves.push((&survey.out_dir, "output.dir"));
            } else if survey.holds_run() {
                log_marker = Some(format!(
                    "--- launcher: run {} starts here; {} above never completed a step ---",
                    identity.run_id,
                    survey.who()
                ));
                notes.push(format!(
                    "launcher: output.dir = {} held {}, which never completed a step: this run takes its place \
                     (its rank logs continue after a marker line)",
                    survey.out_dir.display(),
                    survey.who()
                ));
            }
            if saves && survey.ckpt_outside && !survey.checkpoints.is_empty() {
                if !overwrite {
                    return Err(refuse_checkpoint_dir(survey));
                }
                moves.push((&survey.ckpt_dir, "checkpoint.dir"));
            }
            for (dir, role) in &moves {
                check_movable(dir, role, cfg, config_path)?;
            }
            for (dir, role) in moves {
                notes.push(move_aside(dir, role, survey, cfg, locks)?);
            }
            identity
        }
        Some(r) => {
            let saved = r.run_id.as_deref();
            let identity = match &survey.owner {
                Some(owner) if belongs_to(saved, Some(&owner.run_id)) => {
                    write = false;
                    owner.clone()
                }
                Some(owner) => return Err(refuse_foreign_checkpoint(survey, r, &owner.run_id)),
                None if survey.holds_run() => {
                    if saved.is_some() {
                        return Err(refuse_foreign_checkpoint(survey, r, "from before run ids"));
                    }
                    let adopted = RunIdentity { adopted: true, ..RunIdentity::new(new_run_id()?, cfg, config_path) };
                    notes.push(format!(
                        "launcher: output.dir = {} holds a run from before run ids: it is now run {} (its checkpoints, \
                         saved without a run id, count as its own)",
                        survey.out_dir.display(),
                        adopted.run_id
                    ));
                    adopted
                }
                // A fresh directory continues the checkpoint's run.
                None => RunIdentity {
                    resumed_from: Some(r.dir.clone()),
                    ..RunIdentity::new(saved.map_or_else(new_run_id, |s| Ok(s.to_string()))?, cfg, config_path)
                },
            };
            if saves && survey.ckpt_outside {
                let others: Vec<(String, Option<String>)> = survey
                    .checkpoints
                    .iter()
                    .filter(|(_, id)| !belongs_to(id.as_deref(), Some(&identity.run_id)))
                    .cloned()
                    .collect();
                if !others.is_empty() {
                    return Err(SetupError(format!(
                        "checkpoint.dir = {} also holds checkpoints of other runs ({}): run {} would save among \
                         them. Give it a checkpoint.dir of its own (--set checkpoint.dir='\"...\"'), or set \
                         checkpoint.every = 0",
                        survey.ckpt_dir.display(),
                        describe_checkpoints(&others),
                        identity.run_id
                    )));
                }
            }
            log_marker = Some(r.log_marker());
            identity
        }
    };
    Ok(Claim { identity, write, log_marker, notes })
}

fn refuse_new_run(s: &Survey) -> SetupError {
    let aside = aside_name(&s.out_dir, s.owner_id());
    // Without a checkpoint the run cannot be continued: only the other two choices remain.
    let resume = if s.inner_checkpoints().is_empty() { "" } else { "\n  continue that run:         --resume latest" };
    SetupError(format!(
        "output.dir = {} holds {}: {}. A new run here would overwrite its metrics.jsonl and checkpoints. \
         Choose one:{resume}\n  \
         start in a new directory:  --set output.dir='\"{}\"'\n  \
         move that run aside:       --overwrite (renames it to {}; nothing is deleted)",
        s.out_dir.display(),
        s.who(),
        s.what(),
        free_sibling(&s.out_dir).display(),
        aside.display()
    ))
}

fn refuse_checkpoint_dir(s: &Survey) -> SetupError {
    let owner = s.checkpoints.iter().rev().find_map(|(_, id)| id.as_deref());
    SetupError(format!(
        "checkpoint.dir = {} holds checkpoints of another run ({}): a new run would save its checkpoints among \
         them. Choose one:\n  \
         continue that run:                 --resume latest\n  \
         save elsewhere:                    --set checkpoint.dir='\"{}\"'\n  \
         move those checkpoints aside:      --overwrite (renames the directory to {}; nothing is deleted)",
        s.ckpt_dir.display(),
        describe_checkpoints(&s.checkpoints),
        free_sibling(&s.ckpt_dir).display(),
        aside_name(&s.ckpt_dir, owner).display()
    ))
}

fn refuse_foreign_checkpoint(s: &Survey, r: &Resume, owner: &str) -> SetupError {
    let of = r.run_id.as_deref().map_or("a run from before run ids".to_string(), |id| format!("run {id}"));
    SetupError(format!(
        "--resume {}: that checkpoint belongs to {of}, but output.dir = {} holds {} ({owner}); continuing it here \
         would mix two runs' metrics and checkpoints. Continue it in a directory of its own \
         (--set output.dir='\"{}\"'), or resume this directory's run (--resume latest)",
        r.dir.display(),
        s.out_dir.display(),
        s.who(),
        free_sibling(&s.out_dir).display()
    ))
}

/// `--overwrite` renames a directory with everything in it: refuse when the launch itself
/// needs something inside it, or the current directory is in it.
fn check_movable(dir: &Path, role: &str, cfg: &Config, config_path: &Path) -> Result<(), SetupError> {
    let abs = |p: Option<&Path>| p.and_then(|p| std::path::absolute(p).ok());
    let needed = [
        ("the current directory", std::env::current_dir().ok()),
        ("the config file", abs(Some(config_path))),
        ("data.path", abs(cfg.data.path.as_deref())),
        ("train.init_from", abs(cfg.train.init_from.as_deref())),
    ];
    for (what, path) in needed {
        if let Some(p) = path.filter(|p| p.starts_with(dir)) {
            return Err(SetupError(format!(
                "--overwrite would move {role} = {} aside, and with it {what} ({}): keep what a run reads outside \
                 its run directory, or move the old run aside yourself",
                dir.display(),
                p.display()
            )));
        }
    }
    Ok(())
}

/// Rename `dir` to a sibling (`<dir>.prev-<run id>`); returns the line saying where it went.
fn move_aside(dir: &Path, role: &str, s: &Survey, cfg: &Config, locks: &mut Locks) -> Result<String, SetupError> {
    let id =
        if role == "output.dir" { s.owner_id() } else { s.checkpoints.iter().rev().find_map(|(_, id)| id.as_deref()) };
    let aside = aside_name(dir, id);
    std::fs::rename(dir, &aside).map_err(|e| {
        SetupError(format!(
            "--overwrite: cannot rename {role} = {} to {} ({e}); move it aside yourself",
            dir.display(),
            aside.display()
        ))
    })?;
    // Our lock moved with the directory: lock the new one, then release the old.
    let (fresh, _) = RunLock::acquire(dir, role)?;
    let old = if role == "output.dir" {
        std::mem::replace(&mut locks.out, fresh)
    } else {
        match locks.ckpt.replace(fresh) {
            Some(old) => old,
            None => return Ok(moved(role, dir, &aside)),
        }
    };
    let mut old = old;
    old.moved_to(&aside);
    drop(old);
    // The generated corpus is a cache, not part of the run: it stays (no regeneration).
    let builtin = aside.join("builtin-data");
    if role == "output.dir" && cfg.data.path.is_none() && builtin.is_dir() {
        let _ = std::fs::rename(&builtin, dir.join("builtin-data"));
    }
    Ok(moved(role, dir, &aside))
}

fn moved(role: &str, dir: &Path, aside: &Path) -> String {
    format!(
        "launcher: --overwrite: moved {role} = {} aside to {} (nothing was deleted)",
        dir.display(),
        aside.display()
    )
}

/// `<dir>.prev-<run id>` (or `-<now>` for a run without an id), made unique.
fn aside_name(dir: &Path, run_id: Option<&str>) -> PathBuf {
    let tag = run_id.map_or_else(|| compact_utc(now_unix()), str::to_string);
    let base = format!("{}.prev-{tag}", dir.file_name().map(|n| n.to_string_lossy()).unwrap_or_default());
    unique_sibling(dir, &base)
}

/// `<dir>-2`, `<dir>-3`, ...: the first that does not exist (a suggestion for a new directory).
fn free_sibling(dir: &Path) -> PathBuf {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    (2..).map(|i| dir.with_file_name(format!("{name}-{i}"))).find(|p| !p.exists()).unwrap_or_default()
}

fn unique_sibling(dir: &Path, base: &str) -> PathBuf {
    let first = dir.with_file_name(base);
    if !first.exists() {
        return first;
    }
    (2..).map(|i| dir.with_file_name(format!("{base}-{i}"))).find(|p| !p.exists()).unwrap_or(first)
}

fn names(cks: &[(String, Option<String>)]) -> String {
    match cks {
        [] => String::new(),
        [one] => one.0.clone(),
        [first, .., last] if cks.len() > 3 => format!("{} ... {} ({} in all)", first.0, last.0, cks.len()),
        _ => cks.iter().map(|c| c.0.as_str()).collect::<Vec<_>>().join(", "),
    }
}

/// "step_00000050, step_00000100 of run X" (grouped by run).
fn describe_checkpoints(cks: &[(String, Option<String>)]) -> String {
    let mut runs: Vec<Option<&str>> = Vec::new();
    for c in cks {
        if !runs.contains(&c.1.as_deref()) {
            runs.push(c.1.as_deref());
        }
    }
    runs.iter()
        .map(|run| {
            let of: Vec<(String, Option<String>)> = cks.iter().filter(|c| c.1.as_deref() == *run).cloned().collect();
            let who = run.map_or("saved before run ids".to_string(), |r| format!("of run {r}"));
            format!("{} {who}", names(&of))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Lines of a regular file (0 for anything else: `/dev/full` reads forever).
fn count_lines(path: &Path) -> usize {
    use std::io::Read;
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return 0;
    }
    let Ok(mut f) = std::fs::File::open(path) else { return 0 };
    let (mut buf, mut lines, mut last) = (vec![0u8; 1 << 16], 0, b'\n');
    while let Ok(n) = f.read(&mut buf) {
        if n == 0 {
            break;
        }
        lines += buf[..n].iter().filter(|&&b| b == b'\n').count();
        last = buf[n - 1];
    }
    lines + usize::from(last != b'\n')
}

/// A fresh run id: the UTC time and 32 random bits from the OS.
fn new_run_id() -> Result<String, SetupError> {
    use std::io::Read;
    let mut bytes = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| SetupError(format!("cannot read /dev/urandom to make a run id ({e})")))?;
    Ok(format!("{}-{:08x}", compact_utc(now_unix()), u32::from_le_bytes(bytes)))
}

/// FNV-1a of the config as TOML.
fn config_hash(cfg: &Config) -> String {
    let text = toml::to_string(cfg).unwrap_or_default();
    let h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("{h:016x}")
}

/// Prepare `metrics.jsonl` for a run: empty it, or, resuming from `resume_step`, keep its
/// lines up to that step (a missing file starts empty). Returns the steps kept and dropped.
pub fn start_file(path: &Path, resume_step: Option<u64>) -> anyhow::Result<(usize, usize)> {
    use anyhow::Context;
    let Some(last) = resume_step else {
        std::fs::write(path, b"").with_context(|| format!("cannot write {}", path.display()))?;
        return Ok((0, 0));
    };
    let old = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {} to continue it", path.display())),
    };
    let mut kept = String::with_capacity(old.len());
    let (mut n_kept, mut n_dropped) = (0, 0);
    for line in old.lines() {
        // A line cut short (the interrupted launcher died mid-write) has no step: dropped too.
        let step = serde_json::from_str::<serde_json::Value>(line).ok().and_then(|v| v["step"].as_u64());
        match step {
            Some(s) if s <= last => {
                kept.push_str(line);
                kept.push('\n');
                n_kept += 1;
            }
            _ if line.trim().is_empty() => {}
            _ => n_dropped += 1,
        }
    }
    let tmp = path.with_extension("jsonl.partial");
    std::fs::write(&tmp, kept).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot replace {}", path.display()))?;
    Ok((n_kept, n_dropped))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_dated() {
        let id = new_run_id().expect("id");
        assert_eq!(id.len(), "20261125-091045-0123abcd".len(), "{id}");
    }

    #[test]
    fn lines_are_counted_in_regular_files_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("m.jsonl");
        assert_eq!(count_lines(&p), 0);
        std::fs::write(&p, "{}\n{}\n{\"cut").expect("write");
        assert_eq!(count_lines(&p), 3);
        assert_eq!(count_lines(Path::new("/dev/full")), 0, "a device is not read");
    }

    #[test]
    fn checkpoints_are_described_by_run() {
        let c = |n: &str, id: Option<&str>| (n.to_string(), id.map(str::to_string));
        let d = describe_checkpoints(&[c("step_2", Some("a")), c("step_4", Some("a")), c("step_6", None)]);
        assert_eq!(d, "step_2, step_4 of run a; step_6 saved before run ids");
    }
}
