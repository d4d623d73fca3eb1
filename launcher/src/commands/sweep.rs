//! `launcher sweep CONFIG --cpus 1,2,3 | --gpus 1,2,4,8 [--stages 1,2,3] [--set ...]`: a
//! scaling experiment. Each (ranks, ZeRO stage) combination is one ordinary training run of
//! this same launcher (its own run directory under `<out>/runs/`, its output in
//! `<out>/runs/<name>.log`; an earlier sweep's run there is moved aside with `--overwrite`);
//! a run that fails (out of memory, not enough GPUs, anything) is recorded with its error
//! and the sweep goes on.
//!
//! For every combination the table has: tokens/s per rank (mean over the steps after the
//! first), weak-scaling efficiency (tokens/s per rank relative to the fewest ranks of the same
//! stage that ran: the per-rank batch is fixed, so ideal scaling keeps it at 1), step time,
//! and peak memory per rank: predicted by the planner ([`trainer::zero::plan::predict`], the
//! ledger's accounting), measured by the ledger (the same accounting, from `metrics.jsonl`),
//! measured on the GPU by the driver (GPU runs) and measured on the host (the rank process's
//! peak resident set, `VmHWM`, which every rank logs at its end). Written as `sweep.csv`,
//! `sweep.json`, and two SVG plots against ranks, one line per stage: `throughput.svg`
//! (tokens/s per rank) and `memory.svg` (peak memory per rank, measured and predicted).

use crate::commands::memory::MemoryDevice;
use crate::errors::SetupError;
use crate::job::device::Device;
use anyhow::Context;
use clap::Args;
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use trainer::Config;

/// `launcher sweep`: one training run per (ranks, stage) combination.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("device").required(true).args(["cpus", "gpus"]))]
pub struct SweepArgs {
    /// The TOML config file (train.steps sets each run's length: a few dozen steps suffice).
    #[arg(value_name = "CONFIG")]
    pub config: PathBuf,
    /// CPU rank counts to run, e.g. 1,2,3.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub cpus: Option<Vec<u32>>,
    /// GPU rank counts to run, e.g. 1,2,4,8 (counts above this node's GPUs are recorded as failed).
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub gpus: Option<Vec<u32>>,
    /// ZeRO stages to run, e.g. 1,2,3.
    #[arg(long, value_name = "S,S,...", value_delimiter = ',', default_value = "0,1,2,3", value_parser = clap::value_parser!(u8).range(0..=3))]
    pub stages: Vec<u8>,
    /// Override one config value for every run, as for training. Repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Where the table, the plots and each run's directory go (default: <output.dir>/sweep).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// One combination's outcome.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SweepRow {
    pub ranks: usize,
    pub stage: u8,
    /// `ok`, `oom` (out of memory) or `failed`.
    pub status: &'static str,
    /// The run's error, when it did not finish.
    pub error: Option<String>,
    pub steps: usize,
    /// Mean slowest-rank step time over the steps after the first, seconds.
    pub step_time_s: Option<f64>,
    /// Global tokens per second (same steps).
    pub tokens_per_s: Option<f64>,
    pub tokens_per_s_per_rank: Option<f64>,
    /// tokens/s per rank over that of the fewest ranks of this stage that ran.
    pub weak_scaling_efficiency: Option<f64>,
    /// Planner's peak per rank (the highest rank), bytes; ledger accounting.
    pub predicted_peak_bytes: Option<u64>,
    /// The same for GPU runs with the measured runtime (CUDA context, NCCL, ...) added:
    /// what the driver should report.
    pub predicted_device_peak_bytes: Option<u64>,
    /// The ledger's peak per rank (the highest rank), bytes.
    pub measured_peak_bytes: Option<u64>,
    /// GPU runs: the driver's figure (highest over ranks and steps), bytes.
    pub measured_device_peak_bytes: Option<u64>,
    /// The rank processes' peak resident set (highest rank), bytes.
    pub measured_host_peak_bytes: Option<u64>,
    /// Per rank: ledger peak, host peak.
    pub per_rank_peak_bytes: Vec<u64>,
    pub per_rank_host_peak_bytes: Vec<Option<u64>>,
    /// The run's directory.
    pub run_dir: PathBuf,
}

#[derive(Debug, Serialize)]
struct SweepReport<'a> {
    config: String,
    device: &'static str,
    ranks: &'a [usize],
    stages: &'a [u8],
    overrides: &'a [String],
    rows: &'a [SweepRow],
}

pub fn run(args: &SweepArgs) -> anyhow::Result<()> {
    let (device, ranks) = match (&args.cpus, &args.gpus) {
        (Some(c), _) => (Device::Cpu, c),
        (None, Some(g)) => (Device::Gpu, g),
        (None, None) => return Err(SetupError("launcher sweep needs --cpus N,N,... or --gpus N,N,...".into()).into()),
    };
    let ranks: Vec<usize> = ranks.iter().map(|&r| r as usize).collect();
    let mut stages = args.stages.clone();
    stages.dedup();
    let cfg = Config::load(&args.config, &args.overrides).map_err(|e| SetupError(e.to_string()))?;
    let out = args.out.clone().unwrap_or_else(|| cfg.output.dir.join("sweep"));
    let out = std::path::absolute(&out).unwrap_or(out);
    let runs = out.join("runs");
    std::fs::create_dir_all(&runs).map_err(|e| {
        SetupError(format!("cannot create the sweep directory {} ({e}): choose another with --out DIR", runs.display()))
    })?;
    let exe = std::env::current_exe().context("cannot find the launcher's own executable to run the sweep")?;
    let mdev = match device {
        Device::Cpu => MemoryDevice::Cpu,
        Device::Gpu => MemoryDevice::Gpu,
    };
    crate::out::say(&format!(
        "sweep: {} on {ranks:?} {} ranks × ZeRO stages {stages:?}: {} runs of {} steps; results in {}",
        args.config.display(),
        device.name().to_uppercase(),
        ranks.len() * stages.len(),
        cfg.train.steps,
        out.display()
    ));
    let mut rows = Vec::new();
    for &n in &ranks {
        for &stage in &stages {
            let name = format!("{}{n}-stage{stage}", device.name());
            let run_dir = runs.join(&name);
            let mut c = cfg.clone();
            c.zero.stage = stage;
            // The "auto" settings as the run's launch on this machine will decide them.
            let gpu = mdev == MemoryDevice::Gpu;
            let shape = crate::job::fit::PlanShape { world: n, local: n, ranks_per_gpu: 1, model: mdev.model(), gpu };
            let cap = crate::job::fit::Capacity::of_this_machine(gpu, None, None);
            let predicted = match crate::job::fit::resolve_auto(&mut c, shape, cap) {
                Ok(_) => predicted_peak(&c, n, mdev),
                Err(_) => None,
            };
            let combo = Combo { n, stage, run_dir: &run_dir, log: &runs.join(format!("{name}.log")), predicted };
            let row = run_one(&exe, args, device, &combo);
            crate::out::say(&describe(&row));
            rows.push(row);
        }
    }
    weak_scaling(&mut rows);
    let report = SweepReport {
        config: args.config.display().to_string(),
        device: device.name(),
        ranks: &ranks,
        stages: &stages,
        overrides: &args.overrides,
        rows: &rows,
    };
    let json = serde_json::to_string_pretty(&report).context("cannot encode the sweep table")?;
    write(&out.join("sweep.json"), json.as_bytes())?;
    write(&out.join("sweep.csv"), csv(&rows).as_bytes())?;
    let unit = device.name().to_uppercase();
    crate::commands::plot::lines(
        &out.join("throughput.svg"),
        &format!("tokens/s per {unit} rank ({})", file_name(&args.config)),
        "tokens/s per rank",
        &series(&rows, &stages, |r| r.tokens_per_s_per_rank, ""),
    )?;
    let mib = |b: Option<u64>| b.map(|b| b as f64 / (1u64 << 20) as f64);
    let mut memory = series(&rows, &stages, |r| mib(r.measured_peak_bytes), " measured");
    memory.extend(series(&rows, &stages, |r| mib(r.predicted_peak_bytes), " predicted").into_iter().map(|mut s| {
        s.dashed = true;
        s
    }));
    if rows.iter().any(|r| r.measured_device_peak_bytes.is_some()) {
        // GPU runs: the driver's figure too (the ledger plus context, NCCL, ...), offset colors.
        memory.extend(series(&rows, &stages, |r| mib(r.measured_device_peak_bytes), " GPU driver").into_iter().map(
            |mut s| {
                s.color += stages.len();
                s
            },
        ));
    }
    crate::commands::plot::lines(
        &out.join("memory.svg"),
        &format!("peak memory per {unit} rank, ledger (MiB, {})", file_name(&args.config)),
        "MiB per rank",
        &memory,
    )?;
    let ok = rows.iter().filter(|r| r.status == "ok").count();
    crate::out::say(&format!(
        "sweep: {ok} of {} runs finished; table {} and {}, plots {} and {}",
        rows.len(),
        out.join("sweep.csv").display(),
        out.join("sweep.json").display(),
        out.join("throughput.svg").display(),
        out.join("memory.svg").display()
    ));
    if ok == 0 {
        anyhow::bail!("no run of the sweep finished: see the errors above and the run logs in {}", runs.display());
    }
    Ok(())
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// The planner's peak per rank (highest rank) for `cfg` on `world` ranks.
fn predicted_peak(cfg: &Config, world: usize, device: MemoryDevice) -> Option<u64> {
    let peaks: Option<Vec<u64>> = (0..world)
        .map(|r| trainer::zero::plan::predict(cfg, world, r, device.model()).ok().map(|m| m.peak_total))
        .collect();
    peaks?.into_iter().max()
}

/// One combination of a sweep: `n` ranks at ZeRO `stage`, its run directory and log, and the
/// planner's peak per rank for it.
struct Combo<'a> {
    n: usize,
    stage: u8,
    run_dir: &'a Path,
    log: &'a Path,
    predicted: Option<u64>,
}

/// Run one combination as an ordinary launch of this launcher and read its results.
fn run_one(exe: &Path, args: &SweepArgs, device: Device, combo: &Combo<'_>) -> SweepRow {
    let &Combo { n, stage, run_dir, log, predicted } = combo;
    let mut row = SweepRow {
        ranks: n,
        stage,
        status: "failed",
        error: None,
        steps: 0,
        step_time_s: None,
        tokens_per_s: None,
        tokens_per_s_per_rank: None,
        weak_scaling_efficiency: None,
        predicted_peak_bytes: predicted,
        predicted_device_peak_bytes: None,
        measured_peak_bytes: None,
        measured_device_peak_bytes: None,
        measured_host_peak_bytes: None,
        per_rank_peak_bytes: vec![],
        per_rank_host_peak_bytes: vec![],
        run_dir: run_dir.to_path_buf(),
    };
    if device == Device::Gpu {
        row.predicted_device_peak_bytes = predicted.map(|p| p + crate::job::fit::gpu_runtime_bytes(n));
    }
    let log_file = match std::fs::File::create(log).and_then(|f| Ok((f.try_clone()?, f))) {
        Ok(f) => f,
        Err(e) => {
            row.error = Some(format!("cannot create {}: {e}", log.display()));
            return row;
        }
    };
    let status = Command::new(exe)
        .arg(format!("--{}s", device.name()))
        .arg(n.to_string())
        .arg(&args.config)
        .args(args.overrides.iter().flat_map(|o| ["--set".to_string(), o.clone()]))
        .args(["--set".to_string(), format!("zero.stage={stage}")])
        .args(["--set".to_string(), format!("output.dir={}", toml_string(run_dir))])
        // A fresh run directory (an earlier sweep's metrics must not be read): its run is
        // moved aside to `<name>.prev-<run id>`, never deleted.
        .arg("--overwrite")
        .stdin(Stdio::null())
        .stdout(Stdio::from(log_file.0))
        .stderr(Stdio::from(log_file.1))
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let first_error = text.lines().find(|l| l.starts_with("error")).unwrap_or("").to_string();
            let oom = text.to_lowercase().contains("out of memory");
            row.status = if oom { "oom" } else { "failed" };
            let how = crate::run::ranks::describe_status(&Ok(s));
            row.error = Some(if first_error.is_empty() {
                format!("the run {how}; see {}", log.display())
            } else {
                format!("{first_error} (the run {how}; see {})", log.display())
            });
            return row;
        }
        Err(e) => {
            row.error = Some(format!("cannot start the run: {e}"));
            return row;
        }
    }
    if let Err(e) = read_results(&mut row, run_dir, n) {
        row.error = Some(format!("{e:#}"));
        return row;
    }
    row.status = "ok";
    row
}

/// A path as a TOML string for `--set`.
fn toml_string(p: &Path) -> String {
    toml::Value::String(p.display().to_string()).to_string()
}

/// Throughput, step time and memory from a finished run's metrics.jsonl and rank logs.
fn read_results(row: &mut SweepRow, run_dir: &Path, n: usize) -> anyhow::Result<()> {
    let path = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let recs: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("{} does not parse", path.display()))?;
    anyhow::ensure!(!recs.is_empty(), "{} holds no step", path.display());
    row.steps = recs.len();
    // The first step compiles, allocates and warms caches: it is left out when there are others.
    let timed = if recs.len() > 1 { &recs[1..] } else { &recs[..] };
    let (tokens, secs) = timed.iter().fold((0.0, 0.0), |(t, s), r| {
        (t + r["tokens"].as_f64().unwrap_or(0.0), s + r["step_time_s"].as_f64().unwrap_or(0.0))
    });
    if secs > 0.0 {
        row.step_time_s = Some(secs / timed.len() as f64);
        row.tokens_per_s = Some(tokens / secs);
        row.tokens_per_s_per_rank = Some(tokens / secs / n as f64);
    }
    let mut peaks = vec![0u64; n];
    let mut device_peak: Option<u64> = None;
    for r in &recs {
        for m in r["memory"].as_array().into_iter().flatten() {
            let rank = m["rank"].as_u64().unwrap_or(0) as usize;
            if let (Some(p), Some(slot)) = (m["peak_total"].as_u64(), peaks.get_mut(rank)) {
                *slot = (*slot).max(p);
            }
            if let Some(d) = m["device_used"].as_u64() {
                device_peak = Some(device_peak.unwrap_or(0).max(d));
            }
        }
    }
    row.measured_peak_bytes = peaks.iter().copied().max();
    row.per_rank_peak_bytes = peaks;
    row.measured_device_peak_bytes = device_peak;
    row.per_rank_host_peak_bytes =
        (0..n).map(|r| host_peak_from_log(&run_dir.join("logs").join(format!("rank{r}.log")), r)).collect();
    row.measured_host_peak_bytes = row.per_rank_host_peak_bytes.iter().flatten().copied().max();
    Ok(())
}

/// The `rank R: peak host memory B bytes` line a rank logs at its end.
fn host_peak_from_log(path: &Path, rank: usize) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let prefix = format!("rank {rank}: peak host memory ");
    text.lines().rev().find_map(|l| l.strip_prefix(&prefix)?.split_whitespace().next()?.parse().ok())
}

/// Weak-scaling efficiency of each finished row against the fewest ranks of its stage.
fn weak_scaling(rows: &mut [SweepRow]) {
    let base: Vec<(u8, f64)> = {
        let mut b: Vec<(u8, usize, f64)> =
            rows.iter().filter_map(|r| Some((r.stage, r.ranks, r.tokens_per_s_per_rank?))).collect();
        b.sort_by_key(|&(s, n, _)| (s, n));
        b.dedup_by_key(|x| x.0);
        b.into_iter().map(|(s, _, t)| (s, t)).collect()
    };
    for r in rows.iter_mut() {
        let b = base.iter().find(|(s, _)| *s == r.stage).map(|(_, t)| *t);
        r.weak_scaling_efficiency = match (r.tokens_per_s_per_rank, b) {
            (Some(t), Some(b)) if b > 0.0 => Some(t / b),
            _ => None,
        };
    }
}

fn describe(r: &SweepRow) -> String {
    let mib = |b: Option<u64>| b.map_or("-".to_string(), |b| format!("{:.1}", b as f64 / (1u64 << 20) as f64));
    match r.status {
        "ok" => format!(
            "  {} rank(s), stage {}: {:.0} tokens/s per rank, step {:.3} s, peak per rank {} MiB (predicted {}), host {} MiB",
            r.ranks,
            r.stage,
            r.tokens_per_s_per_rank.unwrap_or(0.0),
            r.step_time_s.unwrap_or(0.0),
            mib(r.measured_peak_bytes),
            mib(r.predicted_peak_bytes),
            mib(r.measured_host_peak_bytes)
        ),
        status => format!(
            "  {} rank(s), stage {}: {status}: {}",
            r.ranks,
            r.stage,
            r.error.as_deref().unwrap_or("no error message")
        ),
    }
}

/// The table as CSV, one row per combination, memory in MiB.
fn csv(rows: &[SweepRow]) -> String {
    let mut s = String::from(
        "ranks,stage,status,steps,step_time_s,tokens_per_s,tokens_per_s_per_rank,weak_scaling_efficiency,\
         predicted_peak_mib_per_rank,predicted_device_peak_mib_per_rank,measured_peak_mib_per_rank,\
         measured_device_peak_mib_per_rank,measured_host_peak_mib_per_rank,error\n",
    );
    let f = |x: Option<f64>| x.map_or(String::new(), |v| format!("{v:.6}"));
    let mib = |b: Option<u64>| b.map_or(String::new(), |b| format!("{:.3}", b as f64 / (1u64 << 20) as f64));
    for r in rows {
        let error = r.error.as_deref().unwrap_or("").replace('"', "\"\"");
        s += &format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},\"{error}\"\n",
            r.ranks,
            r.stage,
            r.status,
            r.steps,
            f(r.step_time_s),
            f(r.tokens_per_s),
            f(r.tokens_per_s_per_rank),
            f(r.weak_scaling_efficiency),
            mib(r.predicted_peak_bytes),
            mib(r.predicted_device_peak_bytes),
            mib(r.measured_peak_bytes),
            mib(r.measured_device_peak_bytes),
            mib(r.measured_host_peak_bytes),
        );
    }
    s
}

/// One plot line per stage: (ranks, value) of the rows where `value` is known.
fn series(
    rows: &[SweepRow],
    stages: &[u8],
    value: impl Fn(&SweepRow) -> Option<f64>,
    suffix: &str,
) -> Vec<crate::commands::plot::Series> {
    stages
        .iter()
        .enumerate()
        .map(|(i, &stage)| crate::commands::plot::Series {
            label: format!("stage {stage}{suffix}"),
            color: i,
            dashed: false,
            points: rows
                .iter()
                .filter(|r| r.stage == stage)
                .filter_map(|r| Some((r.ranks as f64, value(r)?)))
                .collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ranks: usize, stage: u8, tps: Option<f64>) -> SweepRow {
        SweepRow {
            ranks,
            stage,
            status: if tps.is_some() { "ok" } else { "oom" },
            error: tps.is_none().then(|| "error: out of memory, \"big\"".to_string()),
            steps: 3,
            step_time_s: Some(0.5),
            tokens_per_s: tps.map(|t| t * ranks as f64),
            tokens_per_s_per_rank: tps,
            weak_scaling_efficiency: None,
            predicted_peak_bytes: Some(1 << 20),
            predicted_device_peak_bytes: None,
            measured_peak_bytes: Some(1 << 20),
            measured_device_peak_bytes: None,
            measured_host_peak_bytes: Some(3 << 20),
            per_rank_peak_bytes: vec![1 << 20; ranks],
            per_rank_host_peak_bytes: vec![Some(3 << 20); ranks],
            run_dir: PathBuf::from("/r"),
        }
    }

    #[test]
    fn efficiency_is_relative_to_the_fewest_ranks_of_the_stage_that_ran() {
        let mut rows = vec![
            row(1, 1, Some(100.0)),
            row(2, 1, Some(80.0)),
            row(1, 2, None),
            row(2, 2, Some(50.0)),
            row(3, 2, Some(40.0)),
        ];
        weak_scaling(&mut rows);
        let eff: Vec<Option<f64>> = rows.iter().map(|r| r.weak_scaling_efficiency).collect();
        assert_eq!(eff, vec![Some(1.0), Some(0.8), None, Some(1.0), Some(0.8)]);
        let table = csv(&rows);
        assert_eq!(table.lines().count(), 6);
        assert!(
            table
                .lines()
                .nth(3)
                .is_some_and(|l| l.starts_with("1,2,oom,") && l.ends_with("\"error: out of memory, \"\"big\"\"\"")),
            "{table}"
        );
    }

    #[test]
    fn host_peaks_are_read_from_rank_logs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("rank1.log");
        std::fs::write(&p, "rank 1 step 3/3 loss 1\nrank 1: peak host memory 123456 bytes (VmHWM)\nrank 1: done\n")
            .expect("write");
        assert_eq!(host_peak_from_log(&p, 1), Some(123456));
        assert_eq!(host_peak_from_log(&p, 0), None);
    }
}
