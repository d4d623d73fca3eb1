//! Joins the ranks' per-step reports into one record per step (written as a line of
//! `metrics.jsonl` once every rank has reported that step) and keeps what the end-of-run
//! summary needs.
//!
//! Lines carry the real step numbers. A new run starts the file empty; a resumed run
//! (`--resume`) continues the file of the run it resumes: the lines up to the checkpoint's
//! step are kept, later ones (steps the interrupted run took after its last checkpoint,
//! which are now taken again) are dropped, and the new steps are appended, so the file
//! holds each step once, in order (`rundir::owner::start_file`).
//!
//! A line that cannot be written (disk full, the file removed) loses only that line: the
//! record still counts for the run summary, which then says how many lines are missing. A line
//! lands whole or not at all: the part of one a full disk cut short is cut off the file again,
//! so the file never holds a torn line.

use anyhow::Context;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use trainer::metrics::RuntimeMemory;
use trainer::zero::MemoryBytes;
use trainer::StepMetrics;

/// One rank's memory at a step, in bytes.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RankMemory {
    pub rank: usize,
    /// The categories now (written as top-level keys: params, grads, …, cached).
    #[serde(flatten)]
    pub current: MemoryBytes,
    /// Sum of the categories now.
    pub total: u64,
    /// Highest total so far.
    pub peak_total: u64,
    /// The categories at the moment of that peak.
    pub peak: MemoryBytes,
    /// GPU ranks: bytes the driver reports in use on this rank's GPU (cuMemGetInfo).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_used: Option<u64>,
    /// GPU ranks: what the driver's figure holds beyond the ledger, each part measured
    /// (CUDA context, NCCL, backend scratch with the cuBLASLt workspace, pool slack).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeMemory>,
    /// GPU ranks: `device_used` minus the tracked total and the runtime parts — bytes
    /// nothing accounts for (about zero).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub untracked: Option<i64>,
    /// Offload and `checkpoint.async`: host bytes by category (optimizer, params, staging,
    /// checkpoint; `pinned` = the page-locked part).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<HostEntry>,
    /// Offload: the host AdamW this step (seconds, parameters, threads, and its speed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_optimizer: Option<HostOptimizerEntry>,
}

/// A rank's host memory for offload and the checkpoint copy, as written to metrics.jsonl.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct HostEntry {
    #[serde(flatten)]
    pub bytes: trainer::zero::HostMemory,
    pub pinned: u64,
}

/// The host AdamW of one step, as written to metrics.jsonl.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct HostOptimizerEntry {
    #[serde(flatten)]
    pub stats: trainer::optim::HostAdamWStats,
    pub params_per_s_per_core: f64,
}

/// One line of `metrics.jsonl`: a step as seen by the whole job.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StepRecord {
    pub step: u64,
    /// Mean training loss over the global batch.
    pub loss: f64,
    pub lr: f32,
    pub grad_norm: f64,
    /// Tokens in the global batch.
    pub tokens: u64,
    /// The slowest rank's step time.
    pub step_time_s: f64,
    /// Global tokens / slowest step time.
    pub tokens_per_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// With `[[data.sources]]`: each source's rows, epochs and validation loss.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<trainer::metrics::SourceMetrics>,
    /// A checkpoint saved at this step: the longest time a rank's step boundary was blocked
    /// by it (synchronous: the whole save; `checkpoint.async`: the wait for the previous
    /// save, the barrier and the host copy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_stall_s: Option<f64>,
    /// Of that, the longest wait for the previous background save.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_waited_s: Option<f64>,
    /// Bytes of the checkpoint (every rank's optimizer state).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_bytes: Option<u64>,
    /// Whether it is written in the background (`checkpoint.async`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_async: Option<bool>,
    pub memory: Vec<RankMemory>,
}

impl StepRecord {
    fn join(reports: Vec<StepMetrics>) -> StepRecord {
        let first = &reports[0];
        let step_time_s = reports.iter().map(|m| m.step_time_s).fold(0.0, f64::max);
        let memory = reports
            .iter()
            .enumerate()
            .map(|(rank, m)| {
                let c = m.memory.current;
                RankMemory {
                    rank,
                    current: c,
                    total: c.total(),
                    peak_total: m.memory.peak_total,
                    peak: m.memory.peak,
                    device_used: m.device.map(|d| d.used),
                    runtime: m.device.map(|d| d.runtime),
                    untracked: m.device.map(|d| d.untracked(c.total())),
                    host: (m.memory.host.total() > 0)
                        .then_some(HostEntry { bytes: m.memory.host, pinned: m.memory.host.pinned() }),
                    host_optimizer: m
                        .host_optimizer
                        .map(|st| HostOptimizerEntry { stats: st, params_per_s_per_core: st.params_per_s_per_core() }),
                }
            })
            .collect();
        let saves = reports.iter().filter_map(|m| m.checkpoint);
        StepRecord {
            step: first.step,
            loss: first.loss,
            lr: first.lr,
            grad_norm: first.grad_norm,
            tokens: first.tokens,
            step_time_s,
            tokens_per_s: if step_time_s > 0.0 { first.tokens as f64 / step_time_s } else { 0.0 },
            val_loss: reports.iter().find_map(|m| m.val_loss),
            sources: first.sources.clone(),
            checkpoint_stall_s: saves.clone().map(|c| c.stall_s).reduce(f64::max),
            checkpoint_waited_s: saves.clone().map(|c| c.waited_s).reduce(f64::max),
            checkpoint_bytes: saves.clone().map(|c| c.bytes).reduce(|a, b| a + b),
            checkpoint_async: saves.clone().next().map(|c| c.background),
            memory,
        }
    }
}

/// Collects per-rank reports and appends complete steps to `metrics.jsonl`.
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
    world: usize,
    pending: BTreeMap<u64, Vec<Option<StepMetrics>>>,
    first: Option<StepRecord>,
    last: Option<StepRecord>,
    /// Tokens and slowest-rank seconds of every step after the first (for mean throughput).
    tokens_after_first: u64,
    seconds_after_first: f64,
    /// Lines that could not be written, and the first such failure (step, error).
    unwritten: usize,
    first_write_error: Option<(u64, String)>,
}

impl MetricsLog {
    /// Append to `path` (prepared by `rundir::owner::start_file` before the run).
    pub fn open(path: &Path, world: usize) -> anyhow::Result<MetricsLog> {
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("cannot open {} for writing", path.display()))?;
        Ok(MetricsLog {
            path: path.to_path_buf(),
            file,
            world,
            pending: BTreeMap::new(),
            first: None,
            last: None,
            tokens_after_first: 0,
            seconds_after_first: 0.0,
            unwritten: 0,
            first_write_error: None,
        })
    }

    /// Record `rank`'s report; when it completes a step, write and return that step's record.
    /// A failed write is remembered ([`MetricsLog::write_error`]), not returned: the record
    /// still counts.
    pub fn add(&mut self, rank: usize, m: StepMetrics) -> anyhow::Result<Option<StepRecord>> {
        let slots = self.pending.entry(m.step).or_insert_with(|| vec![None; self.world]);
        let Some(slot) = slots.get_mut(rank) else {
            anyhow::bail!("rank {rank} reported a step but the job has {} ranks", self.world);
        };
        let step = m.step;
        *slot = Some(m);
        if slots.iter().any(Option::is_none) {
            return Ok(None);
        }
        let reports = self.pending.remove(&step).unwrap_or_default().into_iter().flatten().collect();
        let rec = StepRecord::join(reports);
        let mut line = serde_json::to_string(&rec).context("cannot encode a metrics record")?;
        line.push('\n');
        if let Err(e) = append_whole(&mut self.file, line.as_bytes()) {
            self.unwritten += 1;
            self.first_write_error.get_or_insert((rec.step, e.to_string()));
        }
        if self.first.is_none() {
            self.first = Some(rec.clone());
        } else {
            self.tokens_after_first += rec.tokens;
            self.seconds_after_first += rec.step_time_s;
        }
        self.last = Some(rec.clone());
        Ok(Some(rec))
    }

    /// The first failed write, described, once there was one.
    pub fn write_error(&self) -> Option<String> {
        self.first_write_error
            .as_ref()
            .map(|(step, e)| format!("cannot write step {step}'s record to {}: {e}", self.path.display()))
    }

    /// The end-of-run summary, as printable text.
    pub fn summary(&self) -> String {
        let Some(last) = &self.last else {
            return format!("no step completed; metrics: {}", self.path.display());
        };
        let mean_tps = if self.seconds_after_first > 0.0 {
            self.tokens_after_first as f64 / self.seconds_after_first
        } else {
            last.tokens_per_s
        };
        let (first_step, first_loss) = self.first.as_ref().map_or((last.step, last.loss), |f| (f.step, f.loss));
        let first = if first_step == 1 {
            "the first step".to_string()
        } else {
            format!("step {first_step}, the first of this run")
        };
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let mut s = format!(
            "steps: {}\nloss: {:.4} ({:.4} at {first})\nmean throughput: {:.0} tokens/s (excluding the first step)\n\
             peak memory per rank (MiB, by category at the peak):\n  {:>4}",
            last.step, last.loss, first_loss, mean_tps, "rank"
        );
        // Columns are at least 9 wide, wider for longer names ("activations").
        let width = |name: &str| name.len().max(9);
        for (name, _) in MemoryBytes::default().categories() {
            s += &format!(" {name:>w$}", w = width(name));
        }
        s += &format!(" {:>9}\n", "total");
        for m in &last.memory {
            s += &format!("  {:>4}", m.rank);
            for (name, bytes) in m.peak.categories() {
                s += &format!(" {:>w$.2}", mib(bytes), w = width(name));
            }
            s += &format!(" {:>9.2}\n", mib(m.peak_total));
        }
        if last.memory.iter().any(|m| m.runtime.is_some()) {
            s += &format!(
                "device memory per rank at the last step (MiB; the driver's figure = tracked + the measured rest):\n  \
                 {:>4} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9}\n",
                "rank", "tracked", "context", "nccl", "lazy libs", "scratch", "pool slack", "untracked", "driver"
            );
            for m in &last.memory {
                let (Some(r), Some(used), Some(u)) = (m.runtime, m.device_used, m.untracked) else { continue };
                s += &format!(
                    "  {:>4} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>9.2} {:>9.2}\n",
                    m.rank,
                    mib(m.total),
                    mib(r.context),
                    mib(r.comm_library),
                    mib(r.lazy_libraries),
                    mib(r.scratch),
                    mib(r.pool_slack),
                    u as f64 / (1024.0 * 1024.0),
                    mib(used)
                );
            }
        }
        if last.memory.iter().any(|m| m.host.is_some()) {
            s += &format!(
                "host memory per rank (MiB; offload, checkpoint.async):\n  {:>4} {:>10} {:>9} {:>9} {:>10} {:>9} {:>9}\n",
                "rank", "optimizer", "params", "staging", "ckpt copy", "pinned", "total"
            );
            for m in &last.memory {
                let Some(h) = m.host else { continue };
                let b = h.bytes;
                s += &format!(
                    "  {:>4} {:>10.2} {:>9.2} {:>9.2} {:>10.2} {:>9.2} {:>9.2}\n",
                    m.rank,
                    mib(b.optimizer),
                    mib(b.params),
                    mib(b.staging),
                    mib(b.checkpoint),
                    mib(h.pinned),
                    mib(b.total())
                );
            }
            for m in &last.memory {
                if let Some(o) = m.host_optimizer {
                    s += &format!(
                        "  rank {}: host AdamW {:.3} s for {:.1} M parameters on {} threads: {:.2} G parameters/s, \
                         {:.3} G/s per core\n",
                        m.rank,
                        o.stats.seconds,
                        o.stats.params as f64 / 1e6,
                        o.stats.threads,
                        o.stats.params as f64 / o.stats.seconds.max(1e-12) / 1e9,
                        o.params_per_s_per_core / 1e9
                    );
                }
            }
        }
        s += &format!("metrics: {}", self.path.display());
        if let Some(e) = self.write_error() {
            s += &format!(
                "\nwarning: {} of the {} step records are missing from metrics.jsonl (first: {e}); the numbers \
                 above count every step",
                self.unwritten,
                self.records()
            );
        }
        s
    }

    /// Step records made this run (written or not).
    fn records(&self) -> usize {
        match (&self.first, &self.last) {
            (Some(f), Some(l)) => (l.step - f.step + 1) as usize,
            _ => 0,
        }
    }
}

/// Append `line` to `file` (opened to append) with one write call; a short write (a disk that
/// fills during it) is completed or, when the rest fails, undone: the file is cut back to its
/// length before the line, and the error of the failed write returned.
fn append_whole(file: &mut std::fs::File, line: &[u8]) -> std::io::Result<()> {
    let before = file.metadata()?.len();
    let written = loop {
        match file.write(line) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    };
    if written == line.len() {
        return Ok(());
    }
    // The rest, to learn why the write stopped (a full disk's error); whole after all if it goes.
    let rest = file.write_all(&line[written..]);
    if rest.is_err() {
        // The error of the write is what the summary reports; a file that cannot be cut back
        // keeps the torn part, as nothing more can be done about it.
        let _ = file.set_len(before);
    }
    rest
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rundir::owner::start_file;
    use trainer::zero::MemoryReport;

    fn report(step: u64, time: f64, params: u64) -> StepMetrics {
        let bytes = MemoryBytes { params, ..MemoryBytes::default() };
        StepMetrics {
            step,
            loss: 2.0 / step as f64,
            lr: 1e-3,
            grad_norm: 0.5,
            tokens: 1000,
            step_time_s: time,
            val_loss: None,
            memory: MemoryReport { current: bytes, peak: bytes, peak_total: params, host: Default::default() },
            device: None,
            host_optimizer: None,
            sources: Vec::new(),
            checkpoint: None,
        }
    }

    #[test]
    fn a_step_is_written_once_every_rank_reported_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(&path, 2).expect("open");
        assert!(log.add(1, report(1, 0.5, 10)).expect("add").is_none());
        assert!(log.add(1, report(2, 0.5, 10)).expect("add").is_none());
        let rec = log.add(0, report(1, 0.25, 20)).expect("add").expect("complete");
        assert_eq!(rec.step_time_s, 0.5);
        assert_eq!(rec.tokens_per_s, 2000.0);
        assert_eq!(rec.memory.iter().map(|m| (m.rank, m.current.params)).collect::<Vec<_>>(), vec![(0, 20), (1, 10)]);
        log.add(0, report(2, 0.1, 20)).expect("add").expect("complete");
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["step"], 2);
        assert!(log.summary().contains("2000 tokens/s"), "{}", log.summary());
        assert!(log.add(5, report(3, 0.1, 1)).is_err());
    }

    /// A step with a save carries its stall (the slowest rank's) and size (every rank's);
    /// a step without one has no checkpoint fields.
    #[test]
    fn a_save_puts_its_stall_on_its_step() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(&path, 2).expect("open");
        let saved = |rank: u64, stall_s: f64| {
            let mut m = report(2, 0.5, 10);
            m.checkpoint = Some(trainer::metrics::CheckpointMetrics {
                stall_s,
                waited_s: stall_s / 2.0,
                bytes: 100 + rank,
                background: true,
            });
            m
        };
        log.add(0, report(1, 0.5, 10)).expect("add");
        log.add(1, report(1, 0.5, 10)).expect("add");
        log.add(0, saved(0, 0.25)).expect("add");
        log.add(1, saved(1, 0.75)).expect("add");
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
        assert!(lines[0].get("checkpoint_stall_s").is_none(), "{}", lines[0]);
        assert_eq!(lines[1]["checkpoint_stall_s"], 0.75);
        assert_eq!(lines[1]["checkpoint_waited_s"], 0.375);
        assert_eq!(lines[1]["checkpoint_bytes"], 201);
        assert_eq!(lines[1]["checkpoint_async"], true);
    }

    #[test]
    fn a_failed_write_loses_the_line_but_not_the_summary() {
        // /dev/full: every write fails with "No space left on device", like a full disk.
        let mut log = MetricsLog::open(Path::new("/dev/full"), 1).expect("open");
        for step in 1..=30 {
            let rec = log.add(0, report(step, 0.5, 10)).expect("add").expect("complete");
            assert_eq!(rec.step, step);
        }
        let e = log.write_error().expect("the failure is kept");
        assert!(e.contains("step 1") && e.contains("/dev/full"), "{e}");
        let summary = log.summary();
        assert!(summary.starts_with("steps: 30\n"), "{summary}");
        assert!(summary.contains("30 of the 30 step records are missing"), "{summary}");
        assert!(summary.contains("2000 tokens/s"), "{summary}");
    }

    /// The child of [`a_line_a_full_disk_cuts_short_is_not_left_torn`]: the file it writes.
    const TORN_CHILD: &str = "SHARDTRAIN_TEST_METRICS_FSIZE_CHILD";

    #[test]
    fn a_line_a_full_disk_cuts_short_is_not_left_torn() {
        if let Some(path) = std::env::var_os(TORN_CHILD) {
            // In a child under a 1-block file-size limit with SIGXFSZ ignored: a write that
            // crosses the limit writes what fits (a short write) and the next one fails, as on
            // a disk that fills in the middle of a line.
            let mut log = MetricsLog::open(Path::new(&path), 1).expect("open");
            for step in 1..=20 {
                log.add(0, report(step, 0.5, 10)).expect("add").expect("complete");
            }
            assert!(log.write_error().is_some(), "the limit was never reached");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("metrics.jsonl");
        let name = "run::metrics::tests::a_line_a_full_disk_cuts_short_is_not_left_torn";
        let out = std::process::Command::new("sh")
            .args(["-c", "trap '' XFSZ; ulimit -f 1 && exec \"$@\"", "sh"])
            .arg(std::env::current_exe().expect("test binary"))
            .args([name, "--exact", "--test-threads=1"])
            .env(TORN_CHILD, &path)
            .output()
            .expect("run the child");
        assert!(out.status.success(), "child: {}", String::from_utf8_lossy(&out.stdout));
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(!text.is_empty() && text.ends_with('\n'), "a torn last line: {text:?}");
        for line in text.lines() {
            serde_json::from_str::<serde_json::Value>(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        }
    }

    #[test]
    fn gpu_ranks_account_for_the_drivers_figure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(&path, 1).expect("open");
        let mib = 1u64 << 20;
        let mut m = report(1, 0.5, 100 * mib);
        m.device = Some(trainer::metrics::DeviceMemory {
            used: 1000 * mib,
            total: 80_000 * mib,
            runtime: RuntimeMemory {
                context: 500 * mib,
                comm_library: 300 * mib,
                lazy_libraries: 50 * mib,
                scratch: 40 * mib,
                pool_slack: 6 * mib,
            },
        });
        let rec = log.add(0, m).expect("add").expect("complete");
        // 1000 = 100 tracked + 500 + 300 + 50 + 40 + 6, and 4 MiB nobody explains.
        assert_eq!(rec.memory[0].untracked, Some(4 * mib as i64));
        let line: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(&path).expect("read").trim()).expect("json");
        assert_eq!(line["memory"][0]["runtime"]["comm_library"], 300 * mib);
        let summary = log.summary();
        assert!(summary.contains("device memory per rank") && summary.contains("4.00"), "{summary}");
    }

    #[test]
    fn a_resumed_run_continues_the_file_up_to_its_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("metrics.jsonl");
        // The interrupted run: steps 1-5 and a line cut short by its death; checkpoint at step 4.
        let lines: String = (1..=5).map(|s| format!("{{\"step\":{s},\"loss\":1.0}}\n")).collect();
        std::fs::write(&path, format!("{lines}{{\"step\":6,\"lo")).expect("write");
        assert_eq!(start_file(&path, Some(4)).expect("start"), (4, 2));
        let mut log = MetricsLog::open(&path, 1).expect("open");
        log.add(0, report(5, 0.5, 10)).expect("add").expect("complete");
        let steps: Vec<u64> = std::fs::read_to_string(&path)
            .expect("read")
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["step"].as_u64().expect("step"))
            .collect();
        assert_eq!(steps, vec![1, 2, 3, 4, 5]);
        assert!(log.summary().contains("at step 5, the first of this run"), "{}", log.summary());
        // A new run empties it; resuming into a run directory without one starts it.
        assert_eq!(start_file(&path, None).expect("start"), (0, 0));
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "");
        let fresh = dir.path().join("new.jsonl");
        assert_eq!(start_file(&fresh, Some(3)).expect("start"), (0, 0));
        assert!(fresh.is_file());
    }
}
