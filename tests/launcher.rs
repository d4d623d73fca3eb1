//! The launcher as a user runs it: real rank processes over loopback TCP, end to end.
//! Training runs, sharded-vs-single-rank loss equality through metrics.jsonl, failure
//! handling with injected faults (a rank exiting, a rank crashing, Ctrl-C), errors that
//! stop a job before it starts, `prepare-data` feeding a run, `--resume` (resharded, exact,
//! broken checkpoints refused), `export`, and `memory` predictions against a real run.

mod common;
#[path = "common/wordlevel.rs"]
mod wordlevel;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// One tiny job: a config file and a synthetic shard in a temporary directory.
struct Job {
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Job {
    /// The shared tiny GPT (vocab 97, a few steps) on a synthetic shard, output in the temp dir.
    fn new() -> Job {
        Job::with_toml(&common::tiny_toml(0, 1, "\"none\""))
    }

    /// `toml` plus `data.path` / `output.dir` pointing into the temp dir.
    fn with_toml(toml: &str) -> Job {
        let dir = tempfile::tempdir().expect("tempdir");
        let shard = common::write_synthetic_shard(dir.path(), 97, 20_000);
        let config = dir.path().join("job.toml");
        let text = format!(
            "{toml}\n[data]\npath = '{}'\n\n[output]\ndir = '{}'\n",
            shard.display(),
            dir.path().join("out").display()
        );
        std::fs::write(&config, text).expect("write config");
        Job { dir, config }
    }

    fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }

    /// The job's config as the trainer reads it (tests derive their expectations from it).
    fn cfg(&self) -> trainer::Config {
        let text = std::fs::read_to_string(&self.config).expect("read config");
        trainer::Config::from_toml_str(&text, "job.toml").expect("valid test config")
    }

    /// `launcher --cpus N CONFIG args...` with extra environment.
    fn run(&self, cpus: usize, args: &[&str], env: &[(&str, &str)]) -> Run {
        let mut all = vec!["--cpus".to_string(), cpus.to_string(), self.config.display().to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        run_launcher(&all, env)
    }

    fn metrics(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(self.out().join("metrics.jsonl")).expect("metrics.jsonl");
        text.lines().map(|l| serde_json::from_str(l).expect("a JSON object per line")).collect()
    }

    fn losses(&self) -> Vec<f64> {
        self.metrics().iter().map(|m| m["loss"].as_f64().expect("loss")).collect()
    }

    /// Rank processes of this job still alive: `launcher worker ... --config <this job's dir>/...`.
    fn live_ranks(&self) -> Vec<String> {
        let dir = self.dir.path().display().to_string();
        processes_mentioning(&dir).into_iter().filter(|cmd| cmd.contains(" worker ")).collect()
    }
}

struct Run {
    output: Output,
    elapsed: Duration,
}

impl Run {
    fn code(&self) -> Option<i32> {
        self.output.status.code()
    }
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }
    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }
    fn assert_success(&self) {
        assert!(
            self.output.status.success(),
            "launcher failed ({:?})\nstdout:\n{}\nstderr:\n{}",
            self.output.status,
            self.stdout(),
            self.stderr()
        );
    }
}

/// Variables a scheduler sets, which the launcher reads (`launcher/src/cluster.rs`): a test
/// run inside a Slurm job or under torchrun must not see its own.
const SCHEDULER_ENV: [&str; 25] = [
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES",
    "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_STEP_NODELIST",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "SHARDTRAIN_FAULT",
    "SHARDTRAIN_JOB_TOKEN",
];

/// `cmd` without the scheduler's variables nor the test-only fault of the calling environment.
fn scrubbed(cmd: &mut Command) -> &mut Command {
    for v in SCHEDULER_ENV {
        cmd.env_remove(v);
    }
    cmd
}

/// The launcher binary as a command with a scrubbed environment.
fn launcher_cmd() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_launcher"));
    scrubbed(&mut cmd);
    cmd
}

fn run_launcher(args: &[String], env: &[(&str, &str)]) -> Run {
    let start = Instant::now();
    let output =
        launcher_cmd().args(args).envs(env.iter().copied()).stdin(Stdio::null()).output().expect("run the launcher");
    Run { output, elapsed: start.elapsed() }
}

/// Command lines (of live, non-zombie processes) that contain `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for e in entries.flatten() {
        if !e.file_name().to_string_lossy().chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(raw) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&raw).replace('\0', " ");
            if cmd.contains(needle) {
                found.push(format!("pid {}: {cmd}", e.file_name().to_string_lossy()));
            }
        }
    }
    found
}

fn wait_gone(job: &Job) -> Vec<String> {
    // Reaped by the launcher before it exits; allow the kernel a moment to tear down.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let live = job.live_ranks();
        if live.is_empty() || Instant::now() > deadline {
            return live;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn two_ranks_train_end_to_end() {
    let job = Job::new();
    let run = job.run(2, &["--set", "zero.stage=2"], &[]);
    run.assert_success();

    let cfg = job.cfg();
    let steps = cfg.train.steps;
    let global_tokens = (cfg.train.micro_batch * cfg.train.grad_accum * 2 * cfg.model.seq_len) as u64;
    let metrics = job.metrics();
    assert_eq!(metrics.len(), steps, "one line per step");
    for (i, m) in metrics.iter().enumerate() {
        assert_eq!(m["step"], i as u64 + 1);
        for key in ["loss", "lr", "grad_norm", "step_time_s", "tokens_per_s"] {
            let v = m[key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "step {}: {key} = {}", i + 1, m[key]);
        }
        assert_eq!(m["tokens"], global_tokens);
        let mem = m["memory"].as_array().expect("memory array");
        assert_eq!(mem.len(), 2, "memory of both ranks");
        for (r, rank_mem) in mem.iter().enumerate() {
            assert_eq!(rank_mem["rank"], r);
            for key in ["params", "grads", "optimizer", "activations", "comm", "workspace", "total", "peak_total"] {
                assert!(rank_mem[key].is_u64(), "step {} rank {r}: {key} missing in {rank_mem}", i + 1);
            }
            assert!(
                rank_mem["total"].as_u64() > Some(0) && rank_mem["peak_total"].as_u64() >= rank_mem["total"].as_u64()
            );
        }
    }
    for r in 0..2 {
        let log = std::fs::read_to_string(job.out().join(format!("logs/rank{r}.log"))).expect("rank log");
        assert!(log.contains(&format!("rank {r} step {steps}/{steps}")), "rank {r} log:\n{log}");
    }
    assert!(job.out().join("config.resolved.toml").is_file());
    let stdout = run.stdout();
    assert!(stdout.contains(&format!("steps: {steps}")) && stdout.contains("tokens/s"), "summary missing:\n{stdout}");
    assert!(stdout.contains(&job.out().join("metrics.jsonl").display().to_string()), "{stdout}");
    assert!(job.live_ranks().is_empty());
}

#[test]
fn stage3_on_three_ranks_matches_one_rank_with_accumulation() {
    let job = Job::new();
    job.run(3, &["--set", "zero.stage=3"], &[]).assert_success();
    let sharded = job.losses();
    // A second run in the same output.dir: the first is moved aside (issue 28), not overwritten.
    job.run(1, &["--overwrite", "--set", "zero.stage=0", "--set", "train.grad_accum=3"], &[]).assert_success();
    let single = job.losses();
    assert_eq!(sharded.len(), job.cfg().train.steps);
    assert_eq!(single.len(), sharded.len());
    for (step, (a, b)) in sharded.iter().zip(&single).enumerate() {
        let rel = ((a - b) / b).abs();
        assert!(rel <= 1e-5, "step {}: 3 ranks stage 3 loss {a} vs 1 rank {b} (rel {rel:e})", step + 1);
    }
}

/// A rank that dies after step 2 of 50: the job stops at once, names it, shows its log.
fn assert_fault_stops_job(fault: &str, rank: usize, status_words: &str) {
    let job = Job::new();
    let run = job.run(2, &["--set", "train.steps=50"], &[("SHARDTRAIN_FAULT", fault)]);
    let stderr = run.stderr();
    assert_ne!(run.code(), Some(0), "the job must fail; stderr:\n{stderr}");
    assert!(run.elapsed < Duration::from_secs(20), "took {:?} to stop; stderr:\n{stderr}", run.elapsed);
    assert!(
        stderr.contains(&format!("error: rank {rank} failed after step 2 of 50")),
        "must name rank {rank} first:\n{stderr}"
    );
    assert!(stderr.contains(status_words), "must give the exit status ({status_words}):\n{stderr}");
    let log = std::fs::read_to_string(job.out().join(format!("logs/rank{rank}.log"))).expect("rank log");
    let last = log.lines().last().expect("log has lines");
    assert!(stderr.contains(last), "must quote the log tail (`{last}`):\n{stderr}");
    assert!(job.metrics().len() <= 2, "no step after the fault may complete");
    let left = wait_gone(&job);
    assert!(left.is_empty(), "rank processes left behind: {left:?}");
    assert!(!job.out().join("launcher.lock").exists(), "the run directory's lock is released");
}

#[test]
fn rank_exit_stops_the_job() {
    assert_fault_stops_job("1:2:exit", 1, "exited with code 7");
}

#[test]
fn rank_crash_stops_the_job() {
    assert_fault_stops_job("0:2:abort", 0, "SIGABRT");
}

/// Kills the launcher if the test fails while it runs, so no job outlives the test.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn interrupt_kills_every_rank() {
    let job = Job::new();
    let mut launcher = KillOnDrop(
        launcher_cmd()
            .args(["--cpus", "2"])
            .arg(&job.config)
            .args(["--set", "train.steps=100000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the launcher"),
    );
    // Wait until training runs, then Ctrl-C the launcher alone (not its process group).
    let deadline = Instant::now() + Duration::from_secs(60);
    let metrics = job.out().join("metrics.jsonl");
    while std::fs::metadata(&metrics).map(|m| m.len()).unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "no step completed within 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(job.live_ranks().len(), 2, "both ranks run before the interrupt");
    let sent = Command::new("kill").args(["-INT", &launcher.0.id().to_string()]).status().expect("kill -INT");
    assert!(sent.success());
    let start = Instant::now();
    let status = launcher.0.wait().expect("wait for the launcher");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?} to stop", start.elapsed());
    assert_eq!(status.code(), Some(130));
    let left = wait_gone(&job);
    assert!(left.is_empty(), "rank processes left behind: {left:?}");
    assert!(!job.out().join("launcher.lock").exists(), "the run directory's lock is released");
}

#[test]
fn bad_config_stops_before_any_rank_starts() {
    // (extra TOML appended to the config, --set arguments, what stderr must name)
    let cases: [(&str, &[&str], &[&str]); 7] = [
        ("[bogus_section]\nx = 1\n", &[], &["bogus_section"]),
        ("", &["--set", "train.stepz=3"], &["stepz"]),
        ("", &["--set", "train.steps=\"many\""], &["train.steps", "many"]),
        ("", &["--set", "zero.stage=7"], &["zero.stage"]),
        ("", &["--set", "train.steps=0"], &["train.steps", "at least 1"]),
        ("", &["--set", "model.vocab_size=50"], &["model.vocab_size", "96"]),
        ("", &["--set", "data.path='/nonexistent/shards'"], &["/nonexistent/shards", "prepare-data"]),
    ];
    for (extra, args, needles) in cases {
        let job = Job::with_toml(&format!("{}\n{extra}", common::tiny_toml(0, 1, "\"none\"")));
        let run = job.run(2, args, &[]);
        let stderr = run.stderr();
        assert_eq!(run.code(), Some(2), "{args:?}: expected exit code 2, stderr:\n{stderr}");
        for needle in needles {
            assert!(stderr.contains(needle), "{args:?}: stderr must name `{needle}`:\n{stderr}");
        }
        assert_eq!(stderr.lines().filter(|l| l.starts_with("error")).count(), 1, "{args:?}: printed once:\n{stderr}");
        assert!(!job.out().join("logs/rank0.log").exists(), "{args:?}: no rank may start");
    }
}

#[test]
fn gpus_without_cuda_are_refused_before_any_rank_starts() {
    // On a machine without the CUDA libraries (CI) `--gpus` must say what is missing and start
    // nothing; on a GPU machine this test is skipped with a message (scripts/gpu-test.sh covers it).
    let cuda_here = ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1"]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    if cuda_here {
        eprintln!("skipped: this machine has a CUDA driver; GPU behaviour is tested by scripts/gpu-test.sh");
        return;
    }
    let job = Job::new();
    let run = run_launcher(&["--gpus".into(), "1".into(), job.config.display().to_string()], &[]);
    assert_eq!(run.code(), Some(2));
    let stderr = run.stderr();
    assert!(stderr.contains("--gpus") && stderr.contains("libcuda") && stderr.contains("LD_LIBRARY_PATH"), "{stderr}");
    assert!(!job.out().join("logs/rank0.log").exists());
}

#[test]
fn prepared_text_trains_with_the_gpt2_vocabulary() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("story.txt");
    let text: String = (0..400)
        .map(|i| format!("On day {i} the fox counted {} apples and gave {} to the owl.\n", i % 17, i % 5))
        .collect();
    std::fs::write(&input, text).expect("write text");
    let shards = dir.path().join("shards");
    let prep = run_launcher(&["prepare-data".into(), input.display().to_string(), shards.display().to_string()], &[]);
    prep.assert_success();
    assert!(prep.stdout().contains("wrote"), "{}", prep.stdout());
    assert!(shards.join("story_train_000000.bin").is_file());
    // A .txt file is one document: too few for a validation split by documents, and it says so.
    assert!(
        prep.stdout().contains("warning: no validation split") && prep.stdout().contains("--txt-docs"),
        "{}",
        prep.stdout()
    );

    let job = Job::new();
    let args = [
        "--set".to_string(),
        format!("data.path='{}'", shards.display()),
        "--set".into(),
        "model.vocab_size=50257".into(),
        "--set".into(),
        "train.steps=2".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    job.run(1, &args, &[]).assert_success();
    let losses = job.losses();
    assert_eq!(losses.len(), 2);
    // An untrained model over 50257 tokens starts near ln(50257) = 10.8.
    assert!((losses[0] - 50257f64.ln()).abs() < 1.0, "{losses:?}");
}

/// `launcher ARGS...` (a tool subcommand, or a launch given in full).
fn launcher(args: &[&str]) -> Run {
    run_launcher(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>(), &[])
}

fn steps_of(metrics: &[Value]) -> Vec<u64> {
    metrics.iter().map(|m| m["step"].as_u64().expect("step")).collect()
}

/// A job of 2 ranks that trained the default 4 steps with a checkpoint every 2: step_00000002, step_00000004.
fn job_with_checkpoints() -> (Job, PathBuf) {
    let job = Job::new();
    job.run(2, &["--set", "checkpoint.every=2"], &[]).assert_success();
    let ck = job.out().join("checkpoints");
    for step in ["step_00000002", "step_00000004"] {
        for file in ["manifest.json", "rank00000.safetensors", "rank00001.safetensors"] {
            assert!(ck.join(step).join(file).is_file(), "{step}/{file} missing");
        }
        // Each manifest names the run that saved it: the run directory's owner.
        assert_eq!(manifest_run_id(&ck.join(step)), Some(run_id(&job.out())), "{step}");
    }
    (job, ck)
}

/// The run id of a run directory's run.json.
fn run_id(out: &Path) -> String {
    let text = std::fs::read_to_string(out.join("run.json")).expect("run.json");
    let v: Value = serde_json::from_str(&text).expect("run.json is JSON");
    v["run_id"].as_str().expect("a run id").to_string()
}

/// The run id recorded in a checkpoint's manifest.
fn manifest_run_id(ck: &Path) -> Option<String> {
    let text = std::fs::read_to_string(ck.join("manifest.json")).expect("manifest");
    let v: Value = serde_json::from_str(&text).expect("manifest JSON");
    v["run_id"].as_str().map(str::to_string)
}

#[test]
fn resume_latest_on_other_ranks_and_stage_continues_the_run() {
    // A flat learning rate after warmup (min_lr = lr), so the schedules of the 4-step and the 6-step
    // runs agree on their common steps. Global batch 12 sequences: 2 ranks × 3, 3 × 2, 1 × 6.
    let flat = ["--set", "train.min_lr=3e-3"];
    let job = Job::new();
    job.run(2, &[&flat[..], &["--set", "train.grad_accum=3", "--set", "checkpoint.every=2"]].concat(), &[])
        .assert_success();
    let ck = job.out().join("checkpoints");
    assert!(ck.join("step_00000002/manifest.json").is_file() && ck.join("step_00000004/manifest.json").is_file());
    assert_eq!(steps_of(&job.metrics()), vec![1, 2, 3, 4]);

    let run = job.run(
        3,
        &[
            &flat[..],
            &["--set", "train.steps=6", "--set", "zero.stage=3", "--set", "train.grad_accum=2", "--resume", "latest"],
        ]
        .concat(),
        &[],
    );
    run.assert_success();
    let stdout = run.stdout();
    let from = ck.join("step_00000004");
    assert!(stdout.contains(&format!("resuming from {} at step 4 of 6", from.display())), "{stdout}");
    assert!(stdout.contains("step 5/6") && !stdout.contains("step 1/6"), "progress starts at step 5:\n{stdout}");

    // metrics.jsonl continues the first run's file: steps 1-4 from 2 ranks, then 5 and 6 from 3.
    let metrics = job.metrics();
    assert_eq!(steps_of(&metrics), vec![1, 2, 3, 4, 5, 6]);
    let ranks: Vec<usize> = metrics.iter().map(|m| m["memory"].as_array().expect("memory").len()).collect();
    assert_eq!(ranks, vec![2, 2, 2, 2, 3, 3]);
    let log = std::fs::read_to_string(job.out().join("logs/rank0.log")).expect("rank 0 log");
    let (before, after) = log.split_once("--- launcher: resuming from").expect("the log is continued after a marker");
    assert!(before.contains("rank 0 step 4/4") && after.contains("rank 0 step 6/6"), "{log}");

    let reference = Job::new();
    reference
        .run(1, &[&flat[..], &["--set", "train.steps=6", "--set", "train.grad_accum=6"]].concat(), &[])
        .assert_success();
    let (got, want) = (job.losses(), reference.losses());
    assert_eq!(want.len(), 6);
    for (step, (a, b)) in got.iter().zip(&want).enumerate() {
        let rel = ((a - b) / b).abs();
        assert!(rel <= 1e-5, "step {}: resumed run {a} vs uninterrupted 1-rank run {b} (rel {rel:e})", step + 1);
    }
}

#[test]
fn resume_after_a_crash_on_the_same_layout_is_exact() {
    let uninterrupted = Job::new();
    uninterrupted.run(2, &["--set", "train.steps=6", "--set", "zero.stage=1"], &[]).assert_success();
    let want = uninterrupted.losses();
    assert_eq!(want.len(), 6);

    // Rank 1 dies after step 5; the last checkpoint is step 4.
    let job = Job::new();
    let args = ["--set", "train.steps=6", "--set", "zero.stage=1", "--set", "checkpoint.every=2"];
    let crashed = job.run(2, &args, &[("SHARDTRAIN_FAULT", "1:5:exit")]);
    assert_eq!(crashed.code(), Some(1), "stderr:\n{}", crashed.stderr());
    let ck = job.out().join("checkpoints");
    assert!(ck.join("step_00000004/manifest.json").is_file());
    assert!(!ck.join("step_00000006").exists());
    let interrupted = job.metrics();
    assert!(steps_of(&interrupted).starts_with(&[1, 2, 3, 4]), "{interrupted:?}");

    let run = job.run(2, &[&args[..], &["--resume", "latest"]].concat(), &[]);
    run.assert_success();
    assert!(run.stdout().contains("at step 4 of 6"), "{}", run.stdout());
    // Each step once (the crashed run's step 5 was taken again), losses bit-identical.
    let metrics = job.metrics();
    assert_eq!(steps_of(&metrics), vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(job.losses(), want, "resumed vs uninterrupted losses");
    assert_eq!(&metrics[..4], &interrupted[..4], "the interrupted run's lines are kept as they were");
    assert!(ck.join("step_00000006/manifest.json").is_file(), "the resumed run saves at its end");
    // The crashed rank's log keeps its last words above the continuation.
    let log = std::fs::read_to_string(job.out().join("logs/rank1.log")).expect("rank 1 log");
    let (before, after) = log.split_once("--- launcher: resuming from").expect("continued log");
    assert!(before.contains("injected fault") && after.contains("rank 1 step 6/6"), "{log}");
}

#[test]
fn broken_checkpoints_are_refused_before_any_rank_starts() {
    let (job, ck) = job_with_checkpoints();
    let (step2, step4) = (ck.join("step_00000002"), ck.join("step_00000004"));
    let shard = step4.join("rank00001.safetensors");
    let metrics_before = std::fs::read(job.out().join("metrics.jsonl")).expect("metrics");
    let log_before = std::fs::read(job.out().join("logs/rank0.log")).expect("log");
    let resume = |what: &std::path::Path, extra: &[&str]| {
        let what = what.display().to_string();
        let run = job.run(2, &[&["--set", "train.steps=6", "--resume", &what], extra].concat(), &[]);
        let stderr = run.stderr();
        assert_eq!(run.code(), Some(2), "--resume {what}: exit code 2 expected; stderr:\n{stderr}");
        assert_eq!(stderr.lines().filter(|l| l.starts_with("error")).count(), 1, "printed once:\n{stderr}");
        stderr
    };
    let latest = std::path::Path::new("latest");

    // One flipped byte inside rank 1's tensor data.
    let mut bytes = std::fs::read(&shard).expect("read shard");
    let n = bytes.len();
    bytes[n - 5] ^= 0x40;
    std::fs::write(&shard, &bytes).expect("write shard");
    let e = resume(latest, &[]);
    assert!(
        e.contains("rank00001.safetensors") && e.contains("checksum") && e.contains(&step2.display().to_string()),
        "must name the corrupt file and the newest intact checkpoint:\n{e}"
    );
    let e = resume(&step4, &[]);
    assert!(e.contains("rank00001.safetensors") && e.contains("checksum"), "{e}");

    // Truncated, then missing.
    std::fs::write(&shard, &bytes[..n / 2]).expect("truncate");
    let e = resume(&step4, &[]);
    assert!(e.contains("rank00001.safetensors") && e.contains("bytes"), "{e}");
    std::fs::remove_file(&shard).expect("rm");
    let e = resume(&step4, &[]);
    assert!(e.contains("rank00001.safetensors") && e.contains("cannot be opened"), "{e}");
    let e = resume(latest, &[]);
    assert!(e.contains("rank00001.safetensors") && e.contains(&step2.display().to_string()), "{e}");

    // The checkpoint root instead of one checkpoint; another model shape; nothing left to train.
    let e = resume(&ck, &[]);
    assert!(e.contains("not one") && e.contains(&step2.display().to_string()), "{e}");
    let e = resume(&step2, &["--set", "model.n_embd=48"]);
    assert!(e.contains("model.n_embd is 36 in the checkpoint but 48"), "{e}");
    let e = resume(&step2, &["--set", "train.steps=2"]);
    assert!(e.contains("step 2 and train.steps = 2") && e.contains("raise train.steps"), "{e}");
    let e = resume(&job.dir.path().join("nowhere"), &[]);
    assert!(e.contains("nowhere") && e.contains("does not exist"), "{e}");

    // Nothing was started or touched.
    assert_eq!(std::fs::read(job.out().join("metrics.jsonl")).expect("metrics"), metrics_before);
    assert_eq!(std::fs::read(job.out().join("logs/rank0.log")).expect("log"), log_before);
}

/// The JSON header of a safetensors file.
fn safetensors_header(path: &std::path::Path) -> Value {
    let bytes = std::fs::read(path).expect("read safetensors");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    serde_json::from_slice(&bytes[8..8 + n]).expect("header JSON")
}

/// `launcher eval`: a tiny Llama's checkpoint and the folder exported from it give the same
/// loss over the validation split's first windows; on the JSON line as on the text one; too
/// many windows for the split, or nothing to evaluate, are refused (exit code 2) saying why.
#[test]
fn eval_gives_one_loss_for_a_checkpoint_and_its_exported_folder() {
    let job = Job::with_toml(&common::tiny_llama_toml(1, 1, "\"none\"", false));
    let data = job.dir.path().join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    let toks: Vec<u16> = (0..4000u32).map(|i| ((i * 7 + i / 13) % 97) as u16).collect();
    data::write_shard(data.join("t_train_000000.bin"), &toks).expect("train");
    data::write_shard(data.join("t_val_000000.bin"), &toks[..1000]).expect("val");
    let set_data = format!("data.path='{}'", data.display());
    job.run(2, &["--set", &set_data, "--set", "checkpoint.every=4"], &[]).assert_success();
    let ck = job.out().join("checkpoints/step_00000004");
    let hf = job.dir.path().join("hf");
    launcher(&["export", &ck.display().to_string(), &hf.display().to_string()]).assert_success();
    let config = job.config.display().to_string();
    let eval = |extra: &[&str]| {
        let mut args = vec!["eval", &config, "--set", &set_data];
        args.extend_from_slice(extra);
        if !extra.contains(&"--windows") {
            args.extend(["--windows", "5"]);
        }
        launcher(&args)
    };
    let json = |r: &Run| -> Value { serde_json::from_str(r.stdout().trim()).expect("one JSON line") };
    let from_ck = eval(&["--checkpoint", &ck.display().to_string(), "--json"]);
    from_ck.assert_success();
    let init = format!("train.init_from='{}'", hf.display());
    let from_hf = eval(&["--set", &init, "--json"]);
    from_hf.assert_success();
    let (a, b) = (json(&from_ck), json(&from_hf));
    assert_eq!(a["loss"], b["loss"], "the checkpoint and its export: {a} vs {b}");
    assert_eq!((a["windows"].as_u64(), a["seq_len"].as_u64(), a["tokens"].as_u64()), (Some(5), Some(16), Some(80)));
    let loss = a["loss"].as_f64().expect("loss");
    assert!(loss > 0.5 && loss < 4.6, "a trained tiny model on its own data: {loss}");
    let text = eval(&["--checkpoint", &ck.display().to_string()]);
    assert!(text.stdout().contains(&format!("loss {loss:.6}")), "{}", text.stdout());
    let too_many = eval(&["--checkpoint", &ck.display().to_string(), "--windows", "100"]);
    assert_eq!(too_many.code(), Some(2), "{}", too_many.stderr());
    assert!(too_many.stderr().contains("at most 62 windows"), "{}", too_many.stderr());
    let nothing = eval(&[]);
    assert_eq!(nothing.code(), Some(2), "{}", nothing.stderr());
    assert!(nothing.stderr().contains("--checkpoint DIR"), "{}", nothing.stderr());
}

#[test]
fn export_writes_hugging_face_gpt2_weights() {
    let (job, ck) = job_with_checkpoints();
    let out = job.dir.path().join("model");
    let run = launcher(&["export", &ck.join("step_00000004").display().to_string(), &out.display().to_string()]);
    run.assert_success();

    let header = safetensors_header(&out.join("model.safetensors"));
    let shape = |name: &str| -> Vec<u64> {
        let t = &header[name];
        assert_eq!(t["dtype"], "F32", "{name}: {t}");
        t["shape"].as_array().unwrap_or_else(|| panic!("{name} missing")).iter().filter_map(Value::as_u64).collect()
    };
    let c = 36;
    assert_eq!(shape("transformer.h.0.attn.c_attn.weight"), vec![c, 3 * c], "Conv1D layout [C, 3C]");
    assert_eq!(shape("transformer.h.1.mlp.c_fc.weight"), vec![c, 4 * c]);
    assert_eq!(shape("transformer.wte.weight"), vec![97, c]);
    assert_eq!(header["__metadata__"]["format"], "pt", "transformers refuses safetensors without it");
    let tensors: Vec<&String> = header.as_object().expect("object").keys().filter(|k| *k != "__metadata__").collect();
    let params: u64 = tensors.iter().map(|k| shape(k).iter().product::<u64>()).sum();
    let stdout = run.stdout();
    assert!(
        stdout.contains(&format!("{} tensors, {params} parameters", tensors.len())) && stdout.contains("step 4"),
        "{stdout}"
    );
    assert!(stdout.contains("from_pretrained"), "{stdout}");
    assert_eq!(tensors.len(), 4 + 2 * 12);
    // The folder from_pretrained loads: its config.json, the GPT-2 shape, files readable by all
    // as the umask allows (not the 0600 of a private temporary file).
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config.json")).expect("JSON");
    assert_eq!(
        (config["model_type"].as_str(), config["architectures"][0].as_str()),
        (Some("gpt2"), Some("GPT2LMHeadModel"))
    );
    let cfg = job.cfg();
    for (key, want) in [("n_embd", cfg.model.n_embd), ("n_layer", cfg.model.n_layer), ("n_head", cfg.model.n_head)] {
        assert_eq!(config[key].as_u64(), Some(want as u64), "{key}");
    }
    assert_eq!(config["n_positions"].as_u64(), Some(cfg.model.seq_len as u64));
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    let plain = job.dir.path().join("plain");
    std::fs::write(&plain, b"").expect("write");
    for f in ["config.json", "model.safetensors"] {
        assert_eq!(mode(&out.join(f)), mode(&plain), "{f}: the mode of any new file here");
    }
    assert_eq!(
        std::fs::read_dir(job.dir.path())
            .expect("dir")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains("partial"))
            .count(),
        0
    );

    // Sharded above --max-shard-size, as save_pretrained: shards and their index.
    let sharded = job.dir.path().join("sharded");
    let args = ["export", &ck.join("step_00000004").display().to_string(), &sharded.display().to_string()];
    launcher(&[&args[..], &["--max-shard-size", "20KB"]].concat()).assert_success();
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(sharded.join("model.safetensors.index.json")).expect("index"))
            .expect("JSON");
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(4 * params));
    assert!(index["weight_map"]["transformer.wte.weight"].as_str().is_some_and(|f| f.starts_with("model-00001-of-")));
    assert!(!sharded.join("model.safetensors").exists() && sharded.join("config.json").is_file());

    // Refused, exit code 2: a checkpoint root (suggesting one), an existing non-empty OUT_DIR,
    // and a .safetensors file name (export writes a folder).
    let run = launcher(&["export", &ck.display().to_string(), &job.dir.path().join("x").display().to_string()]);
    assert_eq!(run.code(), Some(2));
    assert!(run.stderr().contains("step_00000004"), "a checkpoint root: suggests one:\n{}", run.stderr());
    let run = launcher(&["export", &ck.join("step_00000004").display().to_string(), &out.display().to_string()]);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(run.stderr().contains("OUT_DIR") && run.stderr().contains("not empty"), "{}", run.stderr());
    let file = job.dir.path().join("model.safetensors");
    let run = launcher(&["export", &ck.join("step_00000004").display().to_string(), &file.display().to_string()]);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(run.stderr().contains("Hugging Face model folder") && !file.exists(), "{}", run.stderr());
}

#[test]
fn memory_prediction_matches_a_real_run() {
    let job = Job::new();
    let config = job.config.display().to_string();
    let table = launcher(&["memory", &config, "--ranks", "2", "--set", "zero.stage=2"]);
    table.assert_success();
    let text = table.stdout();
    for needle in ["stage 0 ", "stage 1 ", "stage 2*", "stage 3 ", "CPU backend's f32 accounting", "zero.stage = 2"] {
        assert!(text.contains(needle), "`{needle}` missing:\n{text}");
    }
    assert!(!text.contains("cuMemGetInfo"), "no GPU runtime line for CPU ranks:\n{text}");
    // The GPU prediction adds the measured runtime (context, NCCL, …) to the peak it names.
    let gpu = launcher(&["memory", &config, "--ranks", "2", "--device", "gpu", "--set", "zero.stage=2"]);
    gpu.assert_success();
    assert!(gpu.stdout().contains("stage 2 peak is about") && gpu.stdout().contains("NCCL"), "{}", gpu.stdout());
    let json = launcher(&["memory", &config, "--ranks", "2", "--set", "zero.stage=2", "--json"]);
    json.assert_success();
    let predicted: Value = serde_json::from_str(&json.stdout()).expect("JSON");
    let stages = predicted["stages"].as_array().expect("stages");
    assert_eq!(stages.len(), 4);
    assert_eq!(predicted["config_stage"], 2);
    let optimizer = |s: usize| stages[s]["ranks"][0]["current"]["optimizer"].as_u64().expect("bytes");
    assert!(optimizer(1) < optimizer(0), "stage 1 shards the optimizer state");

    job.run(2, &["--set", "zero.stage=2"], &[]).assert_success();
    let metrics = job.metrics();
    for r in 0..2 {
        let p = &stages[2]["ranks"][r];
        let step1 = &metrics[0]["memory"][r];
        for key in ["params", "grads", "optimizer", "activations", "comm", "workspace", "cached"] {
            assert_eq!(p["current"][key], step1[key], "rank {r} {key} after one step: predicted vs measured");
        }
        assert_eq!(p["peak"], step1["peak"], "rank {r}: categories at the peak");
        for m in &metrics {
            assert_eq!(p["peak_total"], m["memory"][r]["peak_total"], "rank {r} step {}: peak_total", m["step"]);
        }
    }
    // The table's peak total of the config's stage is that number in MiB.
    let peak = metrics[0]["memory"][0]["peak_total"].as_u64().expect("peak") as f64 / (1024.0 * 1024.0);
    let row = text.lines().find(|l| l.trim_start().starts_with("total MiB")).expect("total row");
    let cells: Vec<&str> = row.split_whitespace().skip(2).collect();
    assert_eq!(cells[2], format!("{peak:.2}"), "{row}");

    let bad = launcher(&["memory", &config, "--ranks", "2", "--set", "zero.stage=9"]);
    assert_eq!(bad.code(), Some(2), "{}", bad.stderr());
}

/// `checkpoint.async` end to end: `launcher memory` predicts the host copy the run's ledger
/// records and the summary shows it; the rank logs say how long training stalled for each
/// save. A rank that crashes in the middle of writing a checkpoint in the background leaves
/// the previous checkpoint the newest intact one, and `--resume latest` continues from it.
#[test]
fn a_crash_in_the_middle_of_an_asynchronous_save_leaves_the_previous_checkpoint() {
    let job = Job::new();
    let config = job.config.display().to_string();
    let set = ["--set", "checkpoint.every=2", "--set", "checkpoint.async=true", "--set", "train.steps=8"];
    let json = launcher(&[&["memory", config.as_str(), "--ranks", "2", "--json"][..], &set].concat());
    json.assert_success();
    let predicted: Value = serde_json::from_str(&json.stdout()).expect("JSON");
    let table = launcher(&[&["memory", config.as_str(), "--ranks", "2"][..], &set].concat());
    assert!(table.stdout().contains("checkpoint copy"), "{}", table.stdout());

    let run = job.run(2, &set, &[("SHARDTRAIN_FAULT", "1:4:abort-mid-save")]);
    let stderr = run.stderr();
    assert_eq!(run.code(), Some(1), "{stderr}");
    // The writer runs beside training: rank 1 dies at whatever step it had reached by then.
    assert!(stderr.contains("rank 1 failed after step") && stderr.contains("SIGABRT"), "{stderr}");
    let log = std::fs::read_to_string(job.out().join("logs/rank1.log")).expect("rank 1 log");
    assert!(log.contains("aborting while writing checkpoint step 4"), "{log}");
    let ck = job.out().join("checkpoints");
    assert!(ck.join("step_00000002/manifest.json").is_file(), "the previous checkpoint is complete");
    assert!(!ck.join("step_00000004").exists(), "the checkpoint being written never appeared");
    assert!(ck.join(".step_00000004.partial").is_dir(), "its partial directory is what the crash left");

    let resumed = job.run(2, &[&set[..], &["--resume", "latest"]].concat(), &[]);
    resumed.assert_success();
    let stdout = resumed.stdout();
    assert!(stdout.contains(".step_00000004.partial") && stdout.contains("removed"), "{stdout}");
    assert!(stdout.contains("step_00000002 at step 2 of 8"), "resumed from the previous checkpoint:\n{stdout}");
    assert!(stdout.contains("ckpt copy"), "the summary shows the host copy:\n{stdout}");
    assert_eq!(steps_of(&job.metrics()), (1..=8).collect::<Vec<u64>>());
    assert!(ck.join("step_00000008/manifest.json").is_file(), "the end of training waited for the last save");
    let log = std::fs::read_to_string(job.out().join("logs/rank0.log")).expect("rank 0 log");
    assert!(
        log.contains("checkpoint step 4: training stalled") && log.contains("writing it in the background"),
        "{log}"
    );
    assert!(log.contains("rank 0: checkpoint step 6 complete"), "{log}");
    let metrics = job.metrics();
    // Each save's stall is on its step's line (the bench reads it), and only there.
    for line in &metrics {
        let step = line["step"].as_u64().expect("step");
        let stall = line.get("checkpoint_stall_s").and_then(Value::as_f64);
        assert_eq!(stall.is_some(), step % 2 == 0, "step {step}: {line}");
        if step % 2 == 0 {
            assert!(stall.is_some_and(|s| s >= 0.0) && line["checkpoint_async"] == true, "step {step}: {line}");
            assert!(line["checkpoint_bytes"].as_u64().is_some_and(|b| b > 0), "step {step}: {line}");
        }
    }
    for r in 0..2 {
        let copy = &metrics.last().expect("a step")["memory"][r]["host"]["checkpoint"];
        assert!(copy.as_u64().is_some_and(|b| b > 0), "rank {r}: {copy}");
        assert_eq!(&predicted["stages"][0]["ranks"][r]["host"]["checkpoint"], copy, "rank {r}: predicted vs measured");
    }
}

/// A background write that fails on a full disk stops the job with that error and exit code 2,
/// as a synchronous save's would (the exit-code table), naming the rank, the checkpoint, the
/// shard file and what to do, and leaves the previous checkpoint the newest complete one; a
/// synchronous save's stall is on its step's line too.
#[test]
fn a_failed_background_write_stops_the_job_and_names_the_checkpoint() {
    let job = Job::new();
    let set = ["--set", "checkpoint.every=2", "--set", "checkpoint.async=true", "--set", "train.steps=8"];
    let run = job.run(2, &set, &[("SHARDTRAIN_FAULT", "1:4:fail-mid-save")]);
    let stderr = run.stderr();
    assert_eq!(run.code(), Some(2), "{stderr}");
    let first = stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
    assert!(
        first.contains("rank 1: writing checkpoint step 4 in the background failed")
            && first.contains("injected write failure")
            && first.contains("checkpoint I/O on")
            && first.contains("rank00001.safetensors"),
        "{stderr}"
    );
    assert!(first.contains("point checkpoint.dir at a larger disk"), "what to do:\n{first}");
    let ck = job.out().join("checkpoints");
    assert!(ck.join("step_00000002/manifest.json").is_file(), "the previous checkpoint is complete");
    assert!(!ck.join("step_00000004").exists(), "the failed checkpoint never appeared");
    // The failure surfaces by the next save at the latest.
    assert!(steps_of(&job.metrics()).len() <= 6, "{:?}", steps_of(&job.metrics()));

    let sync = Job::new();
    sync.run(2, &["--set", "checkpoint.every=3", "--set", "train.steps=4"], &[]).assert_success();
    let lines = sync.metrics();
    let stalls: Vec<bool> = lines.iter().map(|l| l.get("checkpoint_stall_s").is_some()).collect();
    assert_eq!(stalls, [false, false, true, true], "saves at step 3 and at the end");
    assert_eq!(lines[2]["checkpoint_async"], false);
    assert_eq!(lines[2]["checkpoint_waited_s"], 0.0);
}

/// Multi-node: two launchers (nodes 0 and 1, 2 ranks each) pointed at one master address
/// train one 4-rank job, with the losses of a single-node 1-rank run at the same global batch.
#[test]
fn two_nodes_on_loopback_form_one_job() {
    let job = Job::with_toml(&common::tiny_toml(3, 1, "\"none\""));
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
        l.local_addr().expect("addr").port()
    };
    let master = format!("127.0.0.1:{port}");
    let spawn_node = |node: &str| {
        launcher_cmd()
            .args(["--cpus", "2", &job.config.display().to_string(), "--nnodes", "2", "--node-rank", node])
            .args(["--master-addr", &master])
            .env("SHARDTRAIN_JOB_TOKEN", "two-nodes-test-token")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a node's launcher")
    };
    let node0 = spawn_node("0");
    let node1 = spawn_node("1");
    let (out0, out1) = (node0.wait_with_output().expect("node 0"), node1.wait_with_output().expect("node 1"));
    assert!(out0.status.success(), "node 0: {}", String::from_utf8_lossy(&out0.stderr));
    assert!(out1.status.success(), "node 1: {}", String::from_utf8_lossy(&out1.stderr));
    // Node 0 hosts the rendezvous and writes metrics for all 4 ranks.
    let metrics = job.metrics();
    assert_eq!(metrics.len(), job.cfg().train.steps);
    assert_eq!(metrics[0]["memory"].as_array().map(|m| m.len()), Some(4));
    let four_ranks = job.losses();
    job.run(1, &["--overwrite", "--set", "zero.stage=0", "--set", "train.grad_accum=4"], &[]).assert_success();
    for (step, (a, b)) in four_ranks.iter().zip(&job.losses()).enumerate() {
        assert!(((a - b) / b).abs() <= 1e-5, "step {}: 2 nodes x 2 ranks {a} vs 1 rank {b}", step + 1);
    }
}

// ---- Jobs a scheduler starts (issue 27): the layout from Slurm's or torchrun's variables.

/// One launcher of an environment-driven job: its extra arguments and its environment.
type Launcher = (Vec<&'static str>, Vec<(&'static str, String)>);

/// Run the launchers of one job (each with only its own environment) to the end; every one
/// must finish. Returns node 0's stdout.
fn env_driven_job(job: &Job, launchers: Vec<Launcher>) -> String {
    let mut running: Vec<Background> = launchers
        .iter()
        .enumerate()
        .map(|(i, (args, env))| {
            let mut a = vec![job.config.display().to_string()];
            a.extend(args.iter().map(|s| s.to_string()));
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            Background::start(&a, &env, job.dir.path(), &format!("launcher{i}"))
        })
        .collect();
    for (i, l) in running.iter_mut().enumerate() {
        assert_eq!(l.wait(Duration::from_secs(120)), Some(0), "launcher {i}:\n{}\n{}", l.stdout(), l.stderr());
    }
    running[0].stdout()
}

/// Losses of the 4-rank job `job` ran and of one rank with 4 micro-steps (a run of its own,
/// moving the first aside): equal to 1e-5 as in `two_nodes_on_loopback_form_one_job`.
fn assert_one_launcher_trains_the_same(job: &Job, what: &str) -> Vec<f64> {
    let four_ranks = job.losses();
    assert_eq!(four_ranks.len(), job.cfg().train.steps, "{what}: every step recorded by rank 0's launcher");
    assert_eq!(job.metrics()[0]["memory"].as_array().map(|m| m.len()), Some(4), "{what}: 4 ranks");
    job.run(1, &["--overwrite", "--set", "zero.stage=0", "--set", "train.grad_accum=4"], &[]).assert_success();
    for (step, (a, b)) in four_ranks.iter().zip(&job.losses()).enumerate() {
        assert!(((a - b) / b).abs() <= 1e-5, "{what}: step {}: {a} vs one launcher's {b}", step + 1);
    }
    four_ranks
}

/// Slurm, both shapes, from `SLURM_*` alone (no --nnodes, --node-rank, --master-addr or token):
/// `srun --ntasks-per-node=1 launcher --cpus 2` (a launcher per node) and `srun
/// --ntasks-per-node=2 launcher --one-rank --cpus 1` (a launcher per rank), on two "nodes"
/// of loopback; the job token derives from the job id. Both train what one launcher does.
#[test]
fn slurm_tasks_per_node_and_per_rank_train_the_job_of_one_launcher() {
    let slurm = |procid: usize, localid: usize, nodeid: usize, ntasks: usize, port: u16| {
        vec![
            ("SLURM_JOB_ID", "271828".to_string()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_PROCID", procid.to_string()),
            ("SLURM_LOCALID", localid.to_string()),
            ("SLURM_NODEID", nodeid.to_string()),
            ("SLURM_NTASKS", ntasks.to_string()),
            ("SLURM_NNODES", "2".into()),
            ("SLURM_JOB_NODELIST", "127.0.0.1,localhost".into()),
            // On one machine the job id's port could be taken: the rendezvous port as a batch
            // script would choose it.
            ("MASTER_PORT", port.to_string()),
        ]
    };
    let job = Job::with_toml(&common::tiny_toml(3, 1, "\"none\""));
    let port = free_port();
    let per_node = (0..2).map(|k| (vec!["--cpus", "2"], slurm(k, 0, k, 2, port))).collect();
    let stdout = env_driven_job(&job, per_node);
    assert!(stdout.contains("from the Slurm environment (job 271828, step 0): node 0 of 2"), "{stdout}");
    assert!(stdout.contains("job token derived from SLURM_JOB_ID 271828, step 0"), "{stdout}");
    let per_node = assert_one_launcher_trains_the_same(&job, "a launcher per node");

    let job = Job::with_toml(&common::tiny_toml(3, 1, "\"none\""));
    let port = free_port();
    let per_rank = (0..4).map(|r| (vec!["--one-rank", "--cpus", "1"], slurm(r, r % 2, r / 2, 4, port))).collect();
    let stdout = env_driven_job(&job, per_rank);
    assert!(stdout.contains("rank 0 of 4"), "{stdout}");
    let per_rank = assert_one_launcher_trains_the_same(&job, "a launcher per rank");
    assert_eq!(per_node, per_rank, "the same 4-rank job either way, bit for bit");

    // A contradictory environment is refused naming the variable, before any rank starts;
    // flags that give the whole layout leave the environment unread.
    let job = Job::new();
    let mut env = slurm(1, 0, 1, 3, port);
    env.retain(|(k, _)| *k != "SLURM_NTASKS");
    env.push(("SLURM_NTASKS", "3".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let run = job.run(1, &[], &env);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(run.stderr().contains("SLURM_NTASKS=3 is not a multiple of SLURM_NNODES=2"), "{}", run.stderr());
    assert!(!job.out().join("logs/rank0.log").exists(), "no rank may start");
    job.run(1, &["--nnodes", "1", "--node-rank", "0"], &env).assert_success();
}

/// torchrun-style variables, both shapes: a launcher per node (`NODE_RANK`, WORLD_SIZE
/// counting ranks) and a process per rank (`RANK`, `LOCAL_RANK`, ... with --one-rank), as
/// Kubernetes operators and torchrun set them.
#[test]
fn torchrun_style_environments_train_the_job_of_one_launcher() {
    let common_env = |port: u16| {
        vec![("MASTER_ADDR", "127.0.0.1".to_string()), ("MASTER_PORT", port.to_string()), ("WORLD_SIZE", "4".into())]
    };
    let job = Job::with_toml(&common::tiny_toml(3, 1, "\"none\""));
    let port = free_port();
    let per_node = (0..2)
        .map(|k| {
            let mut env = common_env(port);
            env.extend([("NODE_RANK", k.to_string()), ("LOCAL_WORLD_SIZE", "2".into())]);
            (vec!["--cpus", "2"], env)
        })
        .collect();
    let stdout = env_driven_job(&job, per_node);
    assert!(stdout.contains("from the torchrun-style environment"), "{stdout}");
    let per_node = assert_one_launcher_trains_the_same(&job, "a launcher per node");

    let job = Job::with_toml(&common::tiny_toml(3, 1, "\"none\""));
    let port = free_port();
    let per_rank = (0..4)
        .map(|r| {
            let mut env = common_env(port);
            env.extend([
                ("RANK", r.to_string()),
                ("LOCAL_RANK", (r % 2).to_string()),
                ("LOCAL_WORLD_SIZE", "2".into()),
                ("GROUP_RANK", (r / 2).to_string()),
                ("TORCHELASTIC_RUN_ID", "issue27".into()),
            ]);
            (vec!["--one-rank", "--cpus", "1"], env)
        })
        .collect();
    env_driven_job(&job, per_rank);
    let per_rank = assert_one_launcher_trains_the_same(&job, "a process per rank");
    assert_eq!(per_node, per_rank, "the same 4-rank job either way, bit for bit");
}

// ---- Running it like production (issue 11): hangs, nodes that differ, strangers, and
// ---- the ways a job used to be lost or a checkpoint destroyed.

/// A launcher running in the background with its stdout and stderr in files.
struct Background {
    child: KillOnDrop,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Background {
    fn start(args: &[String], env: &[(&str, &str)], dir: &std::path::Path, name: &str) -> Background {
        let (stdout, stderr) = (dir.join(format!("{name}.stdout")), dir.join(format!("{name}.stderr")));
        let child = launcher_cmd()
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).expect("stdout file"))
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start the launcher");
        Background { child: KillOnDrop(child), stdout, stderr }
    }

    /// Wait (at most `limit`) for the launcher to exit; its exit code.
    fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.0.try_wait().expect("try_wait") {
                return status.code();
            }
            assert!(Instant::now() < deadline, "the launcher did not exit within {limit:?}:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

/// Sends SIGKILL to a process when dropped (a SIGSTOPped rank must not outlive a failed test).
struct KillPid(u32);

impl Drop for KillPid {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-KILL", &self.0.to_string()]).stderr(Stdio::null()).status();
    }
}

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill").success();
    assert!(ok, "kill {sig} {pid}");
}

/// The pid of this job's rank `rank` (a `launcher worker ... --rank R` process).
fn rank_pid(job: &Job, rank: usize) -> u32 {
    let needle = format!(" --rank {rank} ");
    let line = job.live_ranks().into_iter().find(|l| l.contains(&needle)).unwrap_or_else(|| panic!("rank {rank} runs"));
    line.strip_prefix("pid ").and_then(|l| l.split(':').next()).and_then(|p| p.parse().ok()).expect("a pid")
}

/// Wait until metrics.jsonl has at least `lines` lines.
fn wait_for_steps(job: &Job, lines: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let path = job.out().join("metrics.jsonl");
    while std::fs::read_to_string(&path).map(|t| t.lines().count()).unwrap_or(0) < lines {
        assert!(Instant::now() < deadline, "fewer than {lines} steps within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
    l.local_addr().expect("addr").port()
}

fn launch_args(cpus: usize, job: &Job, extra: &[&str]) -> Vec<String> {
    let mut a = vec!["--cpus".to_string(), cpus.to_string(), job.config.display().to_string()];
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn a_stopped_rank_is_caught_by_the_watchdog_and_named() {
    let job = Job::new();
    let args = launch_args(3, &job, &["--set", "train.steps=1000000", "--set", "watchdog.timeout_s=3"]);
    let mut launcher = Background::start(&args, &[], job.dir.path(), "launcher");
    wait_for_steps(&job, 2);
    std::thread::sleep(Duration::from_millis(1500)); // heartbeats have flowed
    let pid = rank_pid(&job, 1);
    let _cleanup = KillPid(pid);
    signal("-STOP", pid);
    let stopped = Instant::now();
    let code = launcher.wait(Duration::from_secs(40));
    let took = stopped.elapsed();
    let stderr = launcher.stderr();
    assert_eq!(code, Some(3), "the watchdog's exit code; stderr:\n{stderr}");
    assert!(took >= Duration::from_secs(3) && took < Duration::from_secs(15), "stopped after {took:?}:\n{stderr}");
    for needle in [
        "the job is hung: no rank made progress for",
        "watchdog.timeout_s = 3",
        "ranks behind: 1 ",
        "rank 1: step ",
        "rank 0: step ",
        "inside collective #",
        "silent for",
    ] {
        assert!(stderr.contains(needle), "`{needle}` missing:\n{stderr}");
    }
    let left = wait_gone(&job);
    assert!(left.is_empty(), "rank processes left behind (the stopped one too): {left:?}");
}

/// The flight recorder on the failure path: a rank that skips a collective, or runs one
/// more, is named with the collective where the ranks' records first disagree (TCP
/// collectives see the mismatch as an error soon after, rather than hanging).
#[test]
fn the_flight_recorder_names_a_rank_that_skipped_or_added_a_collective() {
    for (fault, what) in [("1:2:skip-collective", "for unit"), ("1:2:extra-collective", "all_reduce of 4 B f32")] {
        let job = Job::new();
        let run = job.run(3, &["--set", "train.steps=50"], &[("SHARDTRAIN_FAULT", fault)]);
        let stderr = run.stderr();
        assert_eq!(run.code(), Some(1), "{fault}:\n{stderr}");
        for needle in [
            "flight recorder (each rank's last collectives, lined up by number):",
            "first divergence at collective #",
            "(step 3, micro-step 0)",
            "ranks 0, 2 called ",
            "rank 1 diverged",
            "last 4 collectives of each rank that answered",
        ] {
            assert!(stderr.contains(needle), "{fault}: `{needle}` missing:\n{stderr}");
        }
        let odd = stderr.lines().find(|l| l.trim_start().starts_with("rank 1 called ")).unwrap_or_default();
        assert!(odd.contains(what), "{fault}: rank 1's collective ({what}):\n{stderr}");
        let log = std::fs::read_to_string(job.out().join("logs/rank0.log")).expect("rank 0 log");
        assert!(log.contains("rank 0: flight recorder: the last "), "each rank's log holds its records:\n{log}");
        assert!(wait_gone(&job).is_empty());
    }
}

/// The flight recorder on the hang path: a rank stops itself right before a collective (after
/// enough steps for heartbeats to have carried its records), the others wait in it, the watchdog fires, the ranks that can answer send their records and
/// the report names the rank that never arrived (exit code 3).
#[test]
fn the_flight_recorder_names_the_rank_that_never_arrived_at_a_hung_collective() {
    let job = Job::new();
    let args = launch_args(3, &job, &["--set", "train.steps=1000000", "--set", "watchdog.timeout_s=2"]);
    let mut launcher =
        Background::start(&args, &[("SHARDTRAIN_FAULT", "1:600:stop-at-collective")], job.dir.path(), "l");
    let code = launcher.wait(Duration::from_secs(60));
    let stderr = launcher.stderr();
    let pid_of_1 = std::fs::read_to_string(job.out().join("logs/rank1.log")).unwrap_or_default();
    assert_eq!(code, Some(3), "the watchdog's exit code:\n{stderr}\nrank 1:\n{pid_of_1}");
    for needle in [
        "the job is hung",
        "ranks behind: 1 ",
        "flight recorder (each rank's last collectives, lined up by number):",
        "ranks 0, 2 agree on every collective they recorded, up to #",
        "rank 1 did not answer (stopped, frozen, exited or unreachable)",
        "rank 1 was at #",
        "behind the others' #",
        "running for ",
    ] {
        assert!(stderr.contains(needle), "`{needle}` missing:\n{stderr}");
    }
    let left = wait_gone(&job);
    assert!(left.is_empty(), "rank processes left behind (the stopped one too): {left:?}");
}

#[test]
fn a_closed_stdout_does_not_stop_the_job() {
    use std::io::BufRead;
    let job = Job::new();
    let mut child = KillOnDrop(
        launcher_cmd()
            .args(launch_args(2, &job, &["--set", "train.steps=30"]))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start"),
    );
    // `launcher ... | head -2`: read two lines, then close the pipe.
    let mut reader = std::io::BufReader::new(child.0.stdout.take().expect("stdout"));
    for _ in 0..2 {
        let mut line = String::new();
        reader.read_line(&mut line).expect("a line");
    }
    drop(reader);
    let status = child.0.wait().expect("wait");
    assert!(status.success(), "the job must finish: {status:?}");
    assert_eq!(job.metrics().len(), 30, "every step trained and recorded");
}

#[test]
fn a_metrics_write_failure_leaves_the_summary_right() {
    let job = Job::new();
    std::fs::create_dir_all(job.out()).expect("mkdir");
    // Every write fails with "No space left on device", as on a full disk.
    std::os::unix::fs::symlink("/dev/full", job.out().join("metrics.jsonl")).expect("symlink");
    let run = job.run(2, &["--set", "train.steps=6"], &[]);
    run.assert_success();
    let (stdout, stderr) = (run.stdout(), run.stderr());
    assert!(stdout.contains("steps: 6\n"), "the summary counts every step:\n{stdout}");
    assert!(stdout.contains("6 of the 6 step records are missing"), "{stdout}");
    assert!(stderr.contains("No space left on device") && stderr.contains("step 1"), "{stderr}");
    assert_eq!(stderr.matches("cannot write").count(), 1, "warned once:\n{stderr}");
}

#[test]
fn export_into_a_checkpoint_is_refused_and_the_checkpoint_kept() {
    let (job, ck) = job_with_checkpoints();
    let step4 = ck.join("step_00000004");
    let shard = step4.join("rank00000.safetensors");
    let before = std::fs::read(&shard).expect("shard");
    for out in [shard.clone(), step4.join("hf")] {
        let run = launcher(&["export", &step4.display().to_string(), &out.display().to_string()]);
        assert_eq!(run.code(), Some(2), "{}", run.stderr());
        assert!(run.stderr().contains("inside the checkpoint directory"), "{}", run.stderr());
    }
    assert_eq!(std::fs::read(&shard).expect("shard"), before, "the shard is untouched");
    assert!(!step4.join("hf").exists());
    job.run(2, &["--set", "train.steps=6", "--resume", "latest"], &[]).assert_success();
}

#[test]
fn a_validation_split_beyond_the_vocabulary_is_refused_before_launch() {
    let job = Job::new();
    let data = job.dir.path().join("shards");
    std::fs::create_dir_all(&data).expect("mkdir");
    common::write_synthetic_shard(&data, 97, 20_000);
    let val: Vec<u16> = (0..5_000).map(|i| if i == 4_000 { 150 } else { (i % 97) as u16 }).collect();
    data::write_shard(data.join("synthetic_val_000000.bin"), &val).expect("val shard");
    let path = format!("data.path='{}'", data.display());
    let run = job.run(2, &["--set", &path, "--set", "train.eval_every=2"], &[]);
    let stderr = run.stderr();
    assert_eq!(run.code(), Some(2), "{stderr}");
    assert!(stderr.contains("validation split") && stderr.contains("150") && stderr.contains("vocab_size"), "{stderr}");
    assert!(!job.out().join("logs/rank0.log").exists(), "no rank may start");
}

#[test]
fn checkpoint_directories_are_checked_and_cleaned_before_launch() {
    // A save that crashed left a partial directory: removed at the next start.
    let job = Job::new();
    let partial = job.out().join("checkpoints/.step_00000002.partial");
    std::fs::create_dir_all(&partial).expect("mkdir");
    std::fs::write(partial.join("rank00000.safetensors"), b"half a shard").expect("junk");
    let run = job.run(2, &[], &[]);
    run.assert_success();
    assert!(!partial.exists(), "the partial save is gone");
    assert!(run.stdout().contains(".step_00000002.partial"), "and said so:\n{}", run.stdout());

    // A checkpoint.dir that cannot be created is an error before any rank starts.
    let job = Job::new();
    let file = job.dir.path().join("a-file");
    std::fs::write(&file, b"").expect("file");
    let dir = format!("checkpoint.dir='{}'", file.join("ck").display());
    let run = job.run(2, &["--set", "checkpoint.every=2", "--set", &dir], &[]);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(run.stderr().contains("checkpoint.dir") && run.stderr().contains("not writable"), "{}", run.stderr());
    assert!(!job.out().join("logs/rank0.log").exists(), "no rank may start");
}

#[test]
fn inconsistent_manifests_are_refused() {
    let (job, ck) = job_with_checkpoints();
    let step4 = ck.join("step_00000004");
    let path = step4.join("manifest.json");
    let original = std::fs::read_to_string(&path).expect("manifest");
    // Without its checksum file (as saved before manifest checksums), so that these manifests
    // reach the consistency check instead of failing their checksum.
    std::fs::remove_file(step4.join("manifest.json.crc32")).expect("rm checksum");
    let cases: [(&str, Value, &str); 3] = [
        ("stage", Value::from(7), "ZeRO stage 7"),
        ("world", Value::from(3), "world 3 but lists 2 shard files"),
        ("step", Value::from(6), "step 6 but its directory is step 4"),
    ];
    for (key, value, needle) in cases {
        let mut m: Value = serde_json::from_str(&original).expect("json");
        m[key] = value;
        std::fs::write(&path, serde_json::to_string_pretty(&m).expect("json")).expect("write");
        let run = job.run(2, &["--set", "train.steps=8", "--resume", &step4.display().to_string()], &[]);
        assert_eq!(run.code(), Some(2), "{key}: {}", run.stderr());
        assert!(run.stderr().contains(needle), "{key}: `{needle}` missing:\n{}", run.stderr());
        let out = job.dir.path().join("model");
        let export = launcher(&["export", &step4.display().to_string(), &out.display().to_string()]);
        assert_eq!(export.code(), Some(2), "export, {key}: {}", export.stderr());
        assert!(export.stderr().contains("manifest.json is inconsistent"), "export, {key}: {}", export.stderr());
    }
    std::fs::write(&path, original).expect("restore");
}

#[test]
fn a_checkpoint_problem_found_inside_a_rank_exits_with_code_2() {
    let (job, ck) = job_with_checkpoints();
    let hf = job.dir.path().join("model");
    launcher(&["export", &ck.join("step_00000004").display().to_string(), &hf.display().to_string()]).assert_success();
    // The weights are of n_embd 36. The folder's config.json says so, and the config
    // disagrees: refused before anything starts, naming the key.
    let init = format!("train.init_from='{}'", hf.display());
    let run = job.run(2, &["--overwrite", "--set", &init, "--set", "model.n_embd=48"], &[]);
    let stderr = run.stderr();
    assert_eq!(run.code(), Some(2), "{stderr}");
    assert!(stderr.contains("model.n_embd") && stderr.contains("holds a model with n_embd = 36"), "{stderr}");
    // A lone safetensors file says nothing of its model: the ranks find out when they load it.
    let init = format!("train.init_from='{}'", hf.join("model.safetensors").display());
    let run = job.run(2, &["--overwrite", "--set", &init, "--set", "model.n_embd=48"], &[]);
    let stderr = run.stderr();
    assert_eq!(run.code(), Some(2), "{stderr}");
    assert!(stderr.contains("failed before its first step") && stderr.contains("model.n_embd"), "{stderr}");
}

/// A launcher of node `node` (of 2, 2 ranks each) of a job whose rendezvous is `master`,
/// with `args` and the job token in its environment.
fn node(job: &Job, master: &str, node: usize, args: &[&str], env: &[(&str, &str)]) -> Background {
    let rank = node.to_string();
    let mut a = launch_args(2, job, &["--nnodes", "2", "--node-rank", &rank, "--master-addr", master]);
    a.extend(args.iter().map(|s| s.to_string()));
    let mut env = env.to_vec();
    env.push(("SHARDTRAIN_JOB_TOKEN", "two-nodes-test-token"));
    Background::start(&a, &env, job.dir.path(), &format!("node{rank}"))
}

/// Two launchers on loopback forming one 4-rank job: both get `args`, node 1 also `node1_extra`.
fn two_nodes(job: &Job, args: &[&str], node1_extra: &[&str], env: &[(&str, &str)]) -> (Background, Background) {
    let master = format!("127.0.0.1:{}", free_port());
    (node(job, &master, 0, args, env), node(job, &master, 1, &[args, node1_extra].concat(), env))
}

#[test]
fn nodes_with_different_configs_are_refused_naming_the_keys() {
    let job = Job::new();
    let (mut node0, mut node1) = two_nodes(&job, &[], &["--set", "train.lr=0.002", "--set", "train.seed=7"], &[]);
    let (c0, c1) = (node0.wait(Duration::from_secs(60)), node1.wait(Duration::from_secs(60)));
    let (e0, e1) = (node0.stderr(), node1.stderr());
    assert_eq!(c0, Some(2), "node 0:\n{e0}");
    assert_eq!(c1, Some(2), "node 1:\n{e1}");
    assert!(e0.contains("node 1") && e0.contains("does not run the same job as node 0"), "{e0}");
    assert!(e0.contains("train.lr = 0.002 on node 1 but 0.003 on node 0"), "{e0}");
    assert!(e0.contains("train.seed = 7 on node 1 but 42 on node 0"), "{e0}");
    assert!(!e0.contains("train.steps"), "only the keys that differ:\n{e0}");
    assert!(job.metrics().is_empty(), "no step was trained");
}

#[test]
fn a_node_names_the_step_its_rank_failed_after() {
    let job = Job::new();
    let (mut node0, mut node1) =
        two_nodes(&job, &["--set", "train.steps=50"], &[], &[("SHARDTRAIN_FAULT", "2:3:exit")]);
    let _ = node0.wait(Duration::from_secs(60));
    assert_eq!(node1.wait(Duration::from_secs(60)), Some(1));
    let e1 = node1.stderr();
    assert!(e1.contains("rank 2 (node 1) failed after step 3 of 50"), "node 1 must name the step:\n{e1}");
    // Node 1 knows nothing of ranks 0 and 1: it says so instead of "rank 0 was told to stop".
    assert!(!e1.contains("rank 0 was told to stop") && !e1.contains("rank 0 (node 0) was told"), "{e1}");
    assert!(e1.contains("ranks 0, 1 run on other nodes"), "{e1}");
}

#[test]
fn a_node_names_a_rank_of_another_node_as_such() {
    // Rank 0 (node 0) exits: node 1's ranks lose it. Node 1 names it with its node and leaves
    // how it ended to node 0 (it used to say "rank 0 was told to stop").
    let job = Job::new();
    let (mut node0, mut node1) =
        two_nodes(&job, &["--set", "train.steps=50"], &[], &[("SHARDTRAIN_FAULT", "0:3:exit")]);
    assert_eq!(node0.wait(Duration::from_secs(60)), Some(1));
    assert!(node0.stderr().contains("error: rank 0 (node 0) failed after step 3 of 50"), "{}", node0.stderr());
    assert_eq!(node1.wait(Duration::from_secs(60)), Some(1));
    let e1 = node1.stderr();
    assert!(
        e1.contains(
            "rank 0 (node 0) failed after step 3 of 50: this node's ranks lost it; node 0's launcher reports why"
        ),
        "{e1}"
    );
    assert!(!e1.contains("was told to stop"), "{e1}");
}

#[test]
fn ranks_stop_when_their_own_launcher_dies() {
    let job = Job::new();
    let (mut node0, mut node1) = two_nodes(&job, &["--set", "train.steps=1000000"], &[], &[]);
    wait_for_steps(&job, 2);
    let (r2, r3) = (rank_pid(&job, 2), rank_pid(&job, 3));
    let (_k2, _k3) = (KillPid(r2), KillPid(r3));
    signal("-KILL", node1.child.0.id());
    let _ = node1.child.0.wait();
    // A rank stops within its stop grace (10 s: the communicator's abort, then exit regardless);
    // the margin is for a loaded CI machine (10 s alone flaked once under load).
    let deadline = Instant::now() + Duration::from_secs(25);
    let alive = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "));
    while alive(r2) || alive(r3) {
        assert!(Instant::now() < deadline, "node 1's ranks trained on without their launcher");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(node0.wait(Duration::from_secs(30)), Some(1), "node 0 loses ranks 2 and 3:\n{}", node0.stderr());
    let log = std::fs::read_to_string(job.out().join("logs/rank2.log")).expect("rank 2 log");
    assert!(log.contains("this node's launcher is gone"), "{log}");
}

/// The control protocol's hello as a stranger would forge it (same layout, wrong token).
#[derive(serde::Serialize)]
enum ForgedMsg {
    Hello {
        magic: [u8; 8],
        version: u32,
        token: String,
        rank: u32,
        data_addr: String,
        fingerprint: Vec<(String, String)>,
    },
}

#[test]
fn strangers_cannot_join_or_stop_a_job() {
    use std::io::Write;
    let job = Job::new();
    let master = format!("127.0.0.1:{}", free_port());
    // Node 0 waits for node 1's ranks: the rendezvous is open, and strangers try their luck.
    let mut node0 = node(&job, &master, 0, &[], &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !node0.stdout().contains("launched") {
        assert!(Instant::now() < deadline, "node 0 did not start:\n{}", node0.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    // A process that knows the protocol but not the token claims rank 2 (without tokens it
    // would take the rank's place, and the real rank 2 would stop the job: "two workers
    // claim rank 2"), one sends a 1 GiB frame length, one sends garbage.
    let forged = ForgedMsg::Hello {
        magic: *b"SHRDTRN\0",
        version: 3,
        token: "guessed-token".into(),
        rank: 2,
        data_addr: "127.0.0.1:9".into(),
        fingerprint: vec![],
    };
    let body = bincode::serde::encode_to_vec(&forged, bincode::config::standard()).expect("encode");
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    for bytes in [frame, (1u32 << 30).to_le_bytes().to_vec(), b"GET / HTTP/1.1\r\n\r\n".to_vec()] {
        let mut s = std::net::TcpStream::connect(&master).expect("connect");
        s.write_all(&bytes).expect("write");
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut node1 = node(&job, &master, 1, &[], &[]);
    assert_eq!(node1.wait(Duration::from_secs(60)), Some(0), "node 1:\n{}", node1.stderr());
    assert_eq!(node0.wait(Duration::from_secs(60)), Some(0), "node 0:\n{}", node0.stderr());
    assert_eq!(job.metrics().len(), job.cfg().train.steps, "the job trained to the end");
    let stdout = node0.stdout();
    assert!(stdout.contains("ignored a connection from 127.0.0.1") && stdout.contains("wrong job token"), "{stdout}");
    assert!(stdout.contains("exceeds"), "the oversized frame is refused:\n{stdout}");
}

#[test]
fn a_sweep_over_ranks_and_stages_writes_its_table_and_plots() {
    let job = Job::new();
    let out = job.dir.path().join("sweep");
    // Rank 2 exists only in the 3-rank runs: they fail, are recorded, and the sweep goes on.
    let run = run_launcher(
        &[
            "sweep".into(),
            "--cpus".into(),
            "1,2,3".into(),
            "--stages".into(),
            "1,2".into(),
            job.config.display().to_string(),
            "--set".into(),
            "train.steps=3".into(),
            "--out".into(),
            out.display().to_string(),
        ],
        &[("SHARDTRAIN_FAULT", "2:2:exit")],
    );
    run.assert_success();
    let csv = std::fs::read_to_string(out.join("sweep.csv")).expect("sweep.csv");
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 1 + 6, "a header and one row per (ranks, stage):\n{csv}");
    let header: Vec<&str> = lines[0].split(',').collect();
    for col in [
        "ranks",
        "stage",
        "status",
        "tokens_per_s_per_rank",
        "weak_scaling_efficiency",
        "step_time_s",
        "predicted_peak_mib_per_rank",
        "measured_peak_mib_per_rank",
        "measured_host_peak_mib_per_rank",
    ] {
        assert!(header.contains(&col), "column {col} missing: {}", lines[0]);
    }
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).expect("json")).expect("JSON");
    let rows = json["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 6);
    for r in rows {
        let (ranks, stage) = (r["ranks"].as_u64().expect("ranks"), r["stage"].as_u64().expect("stage"));
        if ranks == 3 {
            assert_eq!(r["status"], "failed", "{r}");
            assert!(r["error"].as_str().is_some_and(|e| e.contains("rank 2 failed")), "{r}");
            continue;
        }
        assert_eq!(r["status"], "ok", "{r}");
        assert!(r["tokens_per_s_per_rank"].as_f64().is_some_and(|t| t > 0.0), "{r}");
        assert!(r["step_time_s"].as_f64().is_some_and(|t| t > 0.0), "{r}");
        assert!(r["measured_host_peak_bytes"].as_u64().is_some_and(|b| b > 0), "{r}");
        // The ledger's measured peak is what the planner predicted.
        assert_eq!(r["measured_peak_bytes"], r["predicted_peak_bytes"], "ranks {ranks} stage {stage}");
        let eff = r["weak_scaling_efficiency"].as_f64().expect("efficiency");
        if ranks == 1 {
            assert_eq!(eff, 1.0);
        } else {
            assert!(eff > 0.0, "{r}");
        }
    }
    for plot in ["throughput.svg", "memory.svg"] {
        let svg = std::fs::read_to_string(out.join(plot)).expect("plot");
        assert!(svg.contains("<svg") && svg.contains("stage 1") && svg.contains("stage 2"), "{plot}");
    }
    assert!(run.stdout().contains("4 of 6 runs finished"), "{}", run.stdout());

    // A second sweep into the same --out: the earlier run's directory is moved aside, not deleted.
    let first = run_id(&out.join("runs/cpu1-stage1"));
    let config = job.config.display().to_string();
    let again = launcher(&["sweep", "--cpus", "1", "--stages", "1", &config, "--out", &out.display().to_string()]);
    again.assert_success();
    assert!(out.join(format!("runs/cpu1-stage1.prev-{first}/metrics.jsonl")).is_file());
    assert_ne!(run_id(&out.join("runs/cpu1-stage1")), first);
}

#[test]
fn a_cluster_plan_names_what_fits_and_its_calibration_error() {
    let job = Job::new();
    let config = job.config.display().to_string();
    let text = launcher(&["plan", &config, "--nodes", "2", "--gpus-per-node", "2"]);
    text.assert_success();
    let out = text.stdout();
    for needle in ["2 node(s) × 2 H100 = 4 ranks", "<- fastest that fits", "mean absolute error", "not calibrated"] {
        assert!(out.contains(needle), "`{needle}` missing:\n{out}");
    }
    let json = launcher(&["plan", &config, "--nodes", "2", "--gpus-per-node", "2", "--json"]);
    json.assert_success();
    let plan: Value = serde_json::from_str(&json.stdout()).expect("JSON");
    let choices = plan["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 8, "4 stages × (no checkpointing, every layer)");
    assert!(plan["fastest_that_fits"].is_u64());
    for c in plan["calibration"].as_array().expect("calibration") {
        assert!(c["relative_error"].as_f64().is_some_and(|e| e.abs() < 0.15), "{c}");
    }
    // Its memory is the planner's, as `launcher memory --device gpu` prints it for the same GPU
    // (an H100's 79.6 GiB: `keep_gelu = "auto"` is decided against it), plus the runtime.
    let memory = launcher(&["memory", &config, "--ranks", "4", "--device", "gpu", "--gpu-mem", "79.6", "--json"]);
    let memory: Value = serde_json::from_str(&memory.stdout()).expect("memory JSON");
    for c in choices.iter().filter(|c| c["activation_checkpointing"] == "none") {
        let stage = c["stage"].as_u64().expect("stage") as usize;
        let peak = memory["stages"][stage]["ranks"]
            .as_array()
            .expect("ranks")
            .iter()
            .map(|r| r["peak_total"].as_u64().expect("peak"))
            .max();
        assert_eq!(c["tracked_peak_bytes"].as_u64(), peak, "stage {stage}");
        // Both decided it, the same way: this small model keeps the GELU output.
        assert_eq!(c["keep_gelu"], true, "stage {stage}");
        assert_eq!(memory["stages"][stage]["keep_gelu"]["keep"], true, "stage {stage}");
    }
    assert!(out.contains("GELU") && out.contains("kept"), "{out}");
    // Nothing fits in 1 MiB; bad hardware figures are refused.
    let tiny = launcher(&["plan", &config, "--gpus-per-node", "2", "--gpu-mem-gib", "0.001"]);
    tiny.assert_success();
    assert!(tiny.stdout().contains("no choice fits"), "{}", tiny.stdout());
    let bad = launcher(&["plan", &config, "--gpus-per-node", "2", "--tflops", "-1"]);
    assert_eq!(bad.code(), Some(2), "{}", bad.stderr());
}

/// The shipped large configs fit the node sizes their headers name, in bf16 and in FP8, by the
/// planner that the launch's fit check uses (one H200: 143771 MiB; hosts as the lent machines
/// have them). A change to the memory model that pushed one over would make `launcher --gpus N`
/// refuse it.
#[test]
fn large_configs_fit_the_node_sizes_they_name() {
    let h200 = format!("{}", 143_771.0 / 1024.0);
    // (config, ranks, host GiB, at least this many parameters)
    let cases = [
        ("gpt-9b.toml", "1", "125", 9.0e9),
        ("gpt-10b-offload.toml", "1", "125", 10.0e9),
        ("gpt-13b.toml", "2", "250", 12.5e9),
        ("gpt-20b.toml", "4", "500", 20.0e9),
        ("gpt-30b.toml", "4", "500", 30.0e9),
        ("gpt-40b-offload.toml", "4", "500", 40.0e9),
        ("gpt-60b.toml", "8", "550", 60.0e9),
    ];
    // In bf16 (the default) and in FP8: its operand workspace must fit too, and the weight
    // cache ("auto") takes only what is left.
    for (name, ranks, host, at_least) in cases {
        for precision in ["", "train.precision=\"fp8\""] {
            let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs").join(name).display().to_string();
            let mut args = vec![
                "memory",
                &config,
                "--ranks",
                ranks,
                "--device",
                "gpu",
                "--json",
                "--gpu-mem",
                &h200,
                "--host-mem",
                host,
            ];
            if !precision.is_empty() {
                args.extend(["--set", precision]);
            }
            let m = launcher(&args);
            m.assert_success();
            let j: Value = serde_json::from_str(&m.stdout()).expect("memory JSON");
            let tag = format!("{name} {precision} on {ranks} H200(s)");
            assert!(j["fit"]["problem"].is_null(), "{tag}: {}", j["fit"]["problem"]);
            let params = j["params"].as_f64().expect("params");
            assert!(params >= at_least, "{name}: {params} parameters, its name promises {at_least}");
        }
    }
}

#[test]
fn a_memory_size_that_is_not_positive_is_refused() {
    for bad in ["-3", "0", "NaN", "lots"] {
        let r = launcher(&["--gpus", "1", "config.toml", &format!("--host-mem={bad}")]);
        assert_eq!(r.code(), Some(2), "--host-mem {bad}: {}", r.stderr());
        assert!(r.stderr().contains("not a size in GiB"), "{}", r.stderr());
    }
}

// ---- Nothing lost, ever (issue 28): memory checked for CPU ranks, signals named, nodes that
// ---- say why, exit codes as the table in docs/reference/commands.md says, Hugging Face folders.

/// This machine has a CUDA driver (GPU-only behaviour is tested by the GPU scripts there).
fn cuda_here() -> bool {
    ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1"].iter().any(|p| Path::new(p).exists())
}

#[test]
fn cpu_plans_that_do_not_fit_the_host_are_refused_before_launch() {
    let job = Job::new();
    let config = job.config.display().to_string();
    // `launcher memory --device cpu` compares with the host (it used to say "fits" against
    // "GPU unknown (no check)"): this machine's MemAvailable holds the tiny model easily, a
    // stated 10 MiB does not.
    let here = launcher(&["memory", &config, "--ranks", "2", "--device", "cpu"]);
    here.assert_success();
    let out = here.stdout();
    assert!(
        out.contains("GPU none used (CPU ranks compute in host memory), host ") && out.contains("  fits\n"),
        "{out}"
    );
    let small = launcher(&["memory", &config, "--ranks", "2", "--device", "cpu", "--host-mem", "0.01"]);
    small.assert_success();
    let out = small.stdout();
    for needle in ["DOES NOT FIT", "2 CPU rank(s) need", "(--host-mem)", "GiB short", "zero.stage", "micro_batch"] {
        assert!(out.contains(needle), "`{needle}` missing:\n{out}");
    }
    // The launch runs the same check: nothing starts.
    let run = job.run(2, &["--host-mem", "0.01"], &[]);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(
        run.stderr().contains("does not fit the host") && run.stderr().contains("--skip-fit-check"),
        "{}",
        run.stderr()
    );
    assert!(!job.out().join("logs/rank0.log").exists(), "no rank may start");
    // The old environment switch is not read: only the flag launches anyway.
    let run = job.run(2, &["--host-mem", "0.01"], &[("SHARDTRAIN_SKIP_FIT_CHECK", "1")]);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    job.run(2, &["--host-mem", "0.01", "--skip-fit-check"], &[]).assert_success();
    // Without a capacity to compare with, never "fits": a GPU plan on a machine without a GPU.
    if !cuda_here() {
        let gpu = launcher(&["memory", &config, "--ranks", "2", "--device", "gpu"]);
        gpu.assert_success();
        let out = gpu.stdout();
        assert!(out.contains("cannot tell whether it fits") && out.contains("--gpu-mem"), "{out}");
        assert!(!out.contains("  fits\n"), "{out}");
        let json = launcher(&["memory", &config, "--ranks", "2", "--device", "gpu", "--json"]);
        let v: Value = serde_json::from_str(&json.stdout()).expect("JSON");
        assert_eq!(v["fit"]["verdict"], "unknown", "{}", v["fit"]);
    }
}

#[test]
fn an_absurd_model_is_refused_at_once() {
    // 1.3 quadrillion parameters took 33 s and 430 MB and then said "fits".
    let job = Job::new();
    let set = ["--set", "model.n_layer=2000", "--set", "model.n_head=1000", "--set", "model.n_embd=230000"];
    let start = Instant::now();
    let run = launcher(&[&["memory", &job.config.display().to_string(), "--ranks", "8"][..], &set].concat());
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(run.stderr().contains("1.270e15 parameters") && run.stderr().contains("model.n_embd"), "{}", run.stderr());
    // Deep and long: bounded too, each named.
    for (set, needle) in [("model.n_layer=100000", "model.n_layer"), ("train.grad_accum=1000000000", "")] {
        let start = Instant::now();
        let run = launcher(&["memory", &job.config.display().to_string(), "--ranks", "8", "--set", set]);
        assert!(start.elapsed() < Duration::from_secs(5), "{set}: took {:?}", start.elapsed());
        if needle.is_empty() {
            run.assert_success(); // a long accumulation plans in three micro-steps
        } else {
            assert_eq!(run.code(), Some(2), "{set}: {}", run.stderr());
            assert!(run.stderr().contains(needle), "{}", run.stderr());
        }
    }
}

#[test]
fn profile_reaches_every_rank() {
    let job = Job::new();
    job.run(2, &["--set", "train.steps=2", "--profile"], &[]).assert_success();
    for r in 0..2 {
        let log = std::fs::read_to_string(job.out().join(format!("logs/rank{r}.log"))).expect("rank log");
        assert!(log.contains(&format!("profile: rank {r} step 1: ")), "{log}");
    }
    // Without the flag (the old environment switch is not read), no phase times.
    job.run(2, &["--set", "train.steps=2", "--overwrite"], &[("SHARDTRAIN_PROFILE", "1")]).assert_success();
    let log = std::fs::read_to_string(job.out().join("logs/rank0.log")).expect("rank log");
    assert!(!log.contains("profile: rank 0"), "{log}");
}

#[test]
fn too_many_cpu_ranks_are_refused_in_one_short_line() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let job = Job::new();
    let too_many = (8 * cores + 1).to_string();
    let run = job.run(8 * cores + 1, &[], &[]);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    let stderr = run.stderr();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.len() < 1000, "one short line, not 44 KB: {} bytes", stderr.len());
    assert!(
        stderr.contains(&format!("--cpus {too_many}")) && stderr.contains("core") && stderr.contains("--oversubscribe"),
        "{stderr}"
    );
    assert!(!job.out().join("logs/rank0.log").exists(), "no rank may start");
}

#[test]
fn a_rank_killed_by_sigkill_is_named_with_the_out_of_memory_hint() {
    let job = Job::new();
    let args = launch_args(2, &job, &["--set", "train.steps=1000000"]);
    let mut launcher = Background::start(&args, &[], job.dir.path(), "launcher");
    wait_for_steps(&job, 2);
    signal("-KILL", rank_pid(&job, 1));
    assert_eq!(launcher.wait(Duration::from_secs(30)), Some(1), "{}", launcher.stderr());
    let stderr = launcher.stderr();
    for needle in
        ["error: rank 1 failed after step", "was killed by SIGKILL (signal 9)", "out of memory", "launcher memory"]
    {
        assert!(stderr.contains(needle), "`{needle}` missing:\n{stderr}");
    }
    assert!(wait_gone(&job).is_empty());
}

/// A memory cgroup made for one test (v1's memory controller, or v2's), removed afterwards.
struct TestCgroup(PathBuf);

impl TestCgroup {
    /// A child cgroup limited to `bytes`, if this machine lets the test make one (root).
    fn new(bytes: u64) -> Option<TestCgroup> {
        let name = format!("shardtrain-test-{}", std::process::id());
        for (root, limit) in [("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")] {
            let dir = Path::new(root).join(&name);
            if std::fs::create_dir(&dir).is_err() {
                continue;
            }
            let cg = TestCgroup(dir);
            if std::fs::write(cg.0.join(limit), bytes.to_string()).is_ok() {
                return Some(cg);
            }
        }
        None
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A rank that outgrows its memory is ended by the kernel's OOM killer: the launcher counts
/// the kill in its cgroup and says "out of memory"; and the fit check counts the cgroup's
/// limit (a container's) as the host's memory, so the same launch is refused before start.
#[test]
fn a_rank_the_oom_killer_ends_is_named_out_of_memory() {
    let Some(cg) = TestCgroup::new(160 << 20) else {
        eprintln!("skipped: this machine does not let the test make a memory cgroup (needs root)");
        return;
    };
    let job = Job::new();
    // About 600 MiB per rank (the attention's B·heads·T·T softmax), limited to 160 MiB.
    let big = [
        "--set",
        "model.n_embd=128",
        "--set",
        "model.n_head=8",
        "--set",
        "model.seq_len=256",
        "--set",
        "train.micro_batch=64",
        "--set",
        "train.steps=3",
    ];
    let in_cgroup = |flags: &[&str]| {
        let mut args =
            vec!["-c".to_string(), "echo $$ > \"$0/cgroup.procs\" && exec \"$@\"".into(), cg.0.display().to_string()];
        args.push(env!("CARGO_BIN_EXE_launcher").into());
        args.extend(launch_args(1, &job, &big));
        args.extend(flags.iter().map(|f| f.to_string()));
        scrubbed(&mut Command::new("sh")).args(&args).stdin(Stdio::null()).output().expect("sh")
    };
    let refused = in_cgroup(&[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("does not fit the host") && stderr.contains("memory cgroup's limit"), "{stderr}");
    let killed = in_cgroup(&["--skip-fit-check"]);
    let stderr = String::from_utf8_lossy(&killed.stderr);
    assert_eq!(killed.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("SIGKILL") && stderr.contains("out of memory: the kernel's OOM killer ended it"),
        "{stderr}"
    );
}

#[test]
fn a_rank_killed_by_the_file_size_limit_is_named() {
    // Checkpoint shards of ~200 KB under `ulimit -f 100` (blocks of 512 or 1024 bytes): the
    // rank writing one gets SIGXFSZ, reported as "signal 25" before.
    let job = Job::new();
    let mut args = vec!["-c".to_string(), "ulimit -f 100 && exec \"$@\"".into(), "sh".into()];
    args.push(env!("CARGO_BIN_EXE_launcher").into());
    args.extend(launch_args(2, &job, &["--set", "checkpoint.every=2"]));
    let out = scrubbed(&mut Command::new("sh")).args(&args).stdin(Stdio::null()).output().expect("sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("was killed by SIGXFSZ (signal 25: ") && stderr.contains("ulimit -f"), "{stderr}");
}

#[test]
fn a_node_with_the_wrong_job_token_is_told_why() {
    let job = Job::new();
    let master = format!("127.0.0.1:{}", free_port());
    let _node0 = node(&job, &master, 0, &[], &[]);
    let rank = "1".to_string();
    let args = launch_args(2, &job, &["--nnodes", "2", "--node-rank", &rank, "--master-addr", &master]);
    let mut node1 =
        Background::start(&args, &[("SHARDTRAIN_JOB_TOKEN", "not-the-jobs-token")], job.dir.path(), "node1");
    assert_eq!(node1.wait(Duration::from_secs(30)), Some(2), "{}", node1.stderr());
    let e1 = node1.stderr();
    assert!(
        e1.contains("node 0 refused node 1: its job token is not this job's") && e1.contains("SHARDTRAIN_JOB_TOKEN"),
        "{e1}"
    );
    assert!(!e1.contains("two-nodes-test-token"), "node 0's token never travels: {e1}");
    assert!(!job.out().join("logs/rank2.log").exists(), "no rank of node 1 started");
}

#[test]
fn a_node_says_what_it_waits_for_until_node_0_is_up() {
    let job = Job::new();
    let master = format!("127.0.0.1:{}", free_port());
    let mut node1 = node(&job, &master, 1, &[], &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let waiting = format!("node 1: waiting for node 0's rendezvous at {master} (");
    while !node1.stderr().contains(&waiting) {
        assert!(Instant::now() < deadline, "node 1 said nothing while waiting:\n{}", node1.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut node0 = node(&job, &master, 0, &[], &[]);
    assert_eq!(node1.wait(Duration::from_secs(60)), Some(0), "node 1:\n{}", node1.stderr());
    assert_eq!(node0.wait(Duration::from_secs(60)), Some(0), "node 0:\n{}", node0.stderr());
    assert!(node0.stdout().contains("node 1 (127.0.0.1) reached the rendezvous"), "{}", node0.stdout());
}

/// A checkpoint save that finds the disk full stops the job with exit code 2 (a checkpoint
/// problem, as the exit-code table says), naming the file and the OS error once. The full disk
/// is a 64 KiB tmpfs mounted on checkpoint.dir in a namespace of the launcher's own; where
/// that is not allowed, a file-size limit with SIGXFSZ ignored makes the same write fail
/// (EFBIG) on the same path.
#[test]
fn a_full_disk_during_a_save_stops_the_job_with_code_2() {
    let job = Job::new();
    let ck = job.dir.path().join("ck");
    std::fs::create_dir_all(&ck).expect("mkdir");
    let set = format!("checkpoint.dir='{}'", ck.display());
    let launch = launch_args(2, &job, &["--set", "checkpoint.every=2", "--set", &set]);
    let namespaces =
        Command::new("unshare").args(["-rm", "true"]).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    let (mut cmd, os_error) = if namespaces {
        let mut c = Command::new("unshare");
        c.args(["-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs \"$0\" && exec \"$@\""]).arg(&ck);
        (c, "No space left on device")
    } else {
        eprintln!("note: no mount namespace here: the write fails on a file-size limit instead of a full disk");
        let mut c = Command::new("sh");
        c.args(["-c", "trap '' XFSZ; ulimit -f 100 && exec \"$@\"", "sh"]);
        (c, "File too large")
    };
    let out = scrubbed(&mut cmd)
        .arg(env!("CARGO_BIN_EXE_launcher"))
        .args(&launch)
        .stdin(Stdio::null())
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let first = stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
    assert!(
        // A step that saves is reported once its save is done (its metrics line carries the
        // stall): the rank failed in step 2's save, after step 1.
        first.contains("failed after step 1") && first.contains("checkpoint I/O on") && first.contains(".safetensors"),
        "{stderr}"
    );
    assert_eq!(first.matches(os_error).count(), 1, "the OS error once:\n{first}");
    assert!(first.contains("checkpoint.dir") || first.contains("ulimit -f"), "what to do:\n{first}");
}

/// The table of exit codes (docs/reference/commands.md): every code it lists, and each case it names, is
/// produced here or by the named test. Cases cheap enough run here.
#[test]
fn exit_codes_are_those_of_the_readme_table() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference/commands.md"))
        .expect("docs/reference/commands.md");
    let section = readme.split("### Exit codes").nth(1).expect("commands.md has an `### Exit codes` section");
    let rows: Vec<(i32, &str)> = section
        .lines()
        .skip_while(|l| !l.starts_with("| code"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`').parse().expect("a code"), cells[3])
        })
        .collect();
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 130], "{section}");
    let here = include_str!("launcher.rs");
    for (code, tests) in &rows {
        for t in tests.split(',').map(|t| t.trim().trim_matches('`')).filter(|t| !t.is_empty()) {
            assert!(
                here.contains(&format!("fn {t}()")),
                "exit code {code}: the table names test `{t}`, which does not exist"
            );
        }
    }

    let job = Job::new();
    let dir = job.dir.path();
    let code = |args: &[&str]| launcher(args).code();
    // 0: a tool that did what was asked.
    assert_eq!(code(&["memory", &job.config.display().to_string(), "--ranks", "1"]), Some(0));
    // 2: the tools, when they cannot do what was asked (they used to exit 1).
    let missing = dir.join("missing.txt").display().to_string();
    let prep = launcher(&["prepare-data", &missing, &dir.join("shards").display().to_string()]);
    assert_eq!(prep.code(), Some(2), "{}", prep.stderr());
    assert_eq!(prep.stderr().matches("No such file or directory").count(), 1, "the OS error once: {}", prep.stderr());
    assert_eq!(code(&["export", &dir.display().to_string(), &dir.join("m").display().to_string()]), Some(2));
    // 2: a train.init_from that is not safetensors, found before any rank starts.
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, "not weights").expect("write");
    let init = format!("train.init_from='{}'", notes.display());
    let run = job.run(1, &["--set", &init], &[]);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(
        run.stderr().contains("is not a safetensors file") && run.stderr().contains("launcher export"),
        "{}",
        run.stderr()
    );
    assert!(!job.out().join("logs/rank0.log").exists());
    // 1: a rank that failed while the job ran.
    assert_eq!(job.run(2, &["--set", "train.steps=3"], &[("SHARDTRAIN_FAULT", "1:1:exit")]).code(), Some(1));
}

// ---- Nothing lost, ever (issue 28): a run directory belongs to one run, one launcher at a
// ---- time, prepared data is never mixed by accident, full disks, not-a-checkpoint.

/// Every file under `dir` (relative path → bytes): "nothing was touched" is equality.
fn snapshot(dir: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let rel = p.strip_prefix(dir).expect("inside").to_path_buf();
                out.insert(rel, std::fs::read(&p).expect("read"));
            }
        }
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir").flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

#[test]
fn a_new_run_where_a_run_is_refused_and_resume_latest_takes_only_its_own_checkpoints() {
    let (job, ck) = job_with_checkpoints();
    let id = run_id(&job.out());
    let before = snapshot(&job.out());
    // The README's "your own text" example used to do this: a new, shorter run into the same output.dir.
    let run = job.run(2, &["--set", "train.steps=2", "--set", "checkpoint.every=1"], &[]);
    let stderr = run.stderr();
    assert_eq!(run.code(), Some(2), "{stderr}");
    let out = job.out().display().to_string();
    for needle in [
        &format!("output.dir = {out} holds run {id}"),
        "4 steps in metrics.jsonl",
        "step_00000002, step_00000004",
        "--resume latest",
        "--set output.dir=",
        &format!("--overwrite (renames it to {out}.prev-{id}"),
    ] {
        assert!(stderr.contains(needle), "`{needle}` missing:\n{stderr}");
    }
    assert_eq!(snapshot(&job.out()), before, "the run directory is untouched");

    // A newer checkpoint of another run lands in this checkpoint.dir (copied, or a shared directory).
    let other = Job::new();
    other.run(2, &["--set", "train.steps=8", "--set", "checkpoint.every=8"], &[]).assert_success();
    let foreign = ck.join("step_00000008");
    copy_dir(&other.out().join("checkpoints/step_00000008"), &foreign);
    let foreign_before = snapshot(&foreign);
    assert_ne!(manifest_run_id(&foreign), Some(id.clone()));

    // `latest` is this directory's run's newest checkpoint, never the other run's newer one.
    let run = job.run(2, &["--set", "train.steps=7", "--set", "checkpoint.every=2", "--resume", "latest"], &[]);
    run.assert_success();
    let from = ck.join("step_00000004");
    assert!(run.stdout().contains(&format!("resuming from {} at step 4 of 7", from.display())), "{}", run.stdout());
    assert_eq!(steps_of(&job.metrics()), (1..=7).collect::<Vec<u64>>());
    assert_eq!(manifest_run_id(&ck.join("step_00000007")), Some(id.clone()), "saved as this run's");
    // Pruning to checkpoint.keep = 3 counts this run's checkpoints only: the other run's is kept as it was.
    assert!(!ck.join("step_00000002").exists() && ck.join("step_00000004").exists());
    assert_eq!(snapshot(&foreign), foreign_before, "the other run's checkpoint is untouched");
}

#[test]
fn overwrite_moves_the_old_run_aside_and_deletes_nothing() {
    let (job, _) = job_with_checkpoints();
    let id = run_id(&job.out());
    let before = snapshot(&job.out());
    let run = job.run(1, &["--overwrite", "--set", "train.steps=2"], &[]);
    run.assert_success();
    let aside = job.dir.path().join(format!("out.prev-{id}"));
    let said = format!("moved output.dir = {} aside to {}", job.out().display(), aside.display());
    assert!(run.stdout().contains(&said), "{}", run.stdout());
    assert_eq!(snapshot(&aside), before, "the old run, every file of it, as it was");
    assert_ne!(run_id(&job.out()), id, "the directory belongs to the new run");
    assert_eq!(steps_of(&job.metrics()), vec![1, 2]);
    assert!(!job.out().join("launcher.lock").exists() && !aside.join("launcher.lock").exists());

    // The old run still continues where it now is.
    let set_out = format!("output.dir='{}'", aside.display());
    let run = job.run(2, &["--set", &set_out, "--set", "train.steps=6", "--resume", "latest"], &[]);
    run.assert_success();
    assert!(run.stdout().contains("at step 4 of 6"), "{}", run.stdout());
    assert_eq!(run_id(&aside), id);
}

#[test]
fn an_outside_checkpoint_dir_belongs_to_its_run_too() {
    let job = Job::new();
    let ckdir = job.dir.path().join("ck");
    let set_ck = format!("checkpoint.dir='{}'", ckdir.display());
    job.run(2, &["--set", "checkpoint.every=2", "--set", &set_ck], &[]).assert_success();
    let id = run_id(&job.out());
    assert_eq!(manifest_run_id(&ckdir.join("step_00000004")), Some(id.clone()));
    let before = snapshot(&ckdir);

    // Another run (its own output.dir) saving into the same checkpoint.dir: refused, naming it.
    let out2 = job.dir.path().join("out2");
    let set_out2 = format!("output.dir='{}'", out2.display());
    let args = ["--set", "checkpoint.every=2", "--set", &set_ck, "--set", &set_out2];
    let run = job.run(2, &args, &[]);
    let stderr = run.stderr();
    assert_eq!(run.code(), Some(2), "{stderr}");
    let ck = ckdir.display().to_string();
    for needle in [&format!("checkpoint.dir = {ck} holds checkpoints"), &id, "--overwrite", &format!("{ck}.prev-{id}")]
    {
        assert!(stderr.contains(needle), "`{needle}` missing:\n{stderr}");
    }
    assert_eq!(snapshot(&ckdir), before);
    assert!(!out2.join("run.json").exists() && !out2.join("metrics.jsonl").exists(), "nothing started");

    // --overwrite moves those checkpoints aside; the new run saves into a fresh directory.
    let run = job.run(2, &[&args[..], &["--overwrite"]].concat(), &[]);
    run.assert_success();
    let aside = job.dir.path().join(format!("ck.prev-{id}"));
    assert!(run.stdout().contains(&format!("moved checkpoint.dir = {ck} aside to {}", aside.display())));
    assert_eq!(snapshot(&aside), before, "moved, not deleted");
    assert_eq!(manifest_run_id(&ckdir.join("step_00000004")), Some(run_id(&out2)));
}

#[test]
fn a_run_that_never_completed_a_step_is_taken_over_and_its_log_kept() {
    let job = Job::new();
    // Weights of another width in a lone safetensors file: the ranks find out as they load them.
    let (other, ck) = job_with_checkpoints();
    let hf = other.dir.path().join("model");
    launcher(&["export", &ck.join("step_00000004").display().to_string(), &hf.display().to_string()]).assert_success();
    let init = format!("train.init_from='{}'", hf.join("model.safetensors").display());
    let failed = job.run(2, &["--set", &init, "--set", "model.n_embd=48"], &[]);
    assert_ne!(failed.code(), Some(0), "{}", failed.stderr());
    assert!(job.metrics().is_empty());
    let old = run_id(&job.out());
    let old_log = std::fs::read_to_string(job.out().join("logs/rank0.log")).expect("log");

    // Fixed and run again, as typed: no flag needed for a run that has nothing to lose.
    let run = job.run(2, &[], &[]);
    run.assert_success();
    assert!(run.stdout().contains(&format!("held run {old}")) && run.stdout().contains("never completed a step"));
    let new = run_id(&job.out());
    assert_ne!(new, old);
    let log = std::fs::read_to_string(job.out().join("logs/rank0.log")).expect("log");
    let (above, below) =
        log.split_once(&format!("--- launcher: run {new} starts here")).unwrap_or_else(|| panic!("no marker:\n{log}"));
    assert_eq!(above, old_log, "the failed attempt's log is kept above the marker");
    assert!(below.contains("rank 0 step 4/4"), "{log}");
}

#[test]
fn two_runs_at_once_in_one_directory_are_refused() {
    let job = Job::new();
    let args = launch_args(2, &job, &["--set", "train.steps=1000000"]);
    let mut first = Background::start(&args, &[], job.dir.path(), "first");
    wait_for_steps(&job, 2);
    let pid = first.child.0.id();
    for extra in [&[][..], &["--overwrite"][..]] {
        let run = job.run(1, &[&["--set", "train.steps=3"], extra].concat(), &[]);
        let stderr = run.stderr();
        assert_eq!(run.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains("is in use by another run") && stderr.contains(&format!("launcher pid {pid} on host")));
    }
    assert!(job.out().is_dir(), "--overwrite never moves a directory in use");
    std::thread::sleep(Duration::from_millis(500));

    // Killed outright (no chance to release): its lock is stale, and a new launcher takes it over.
    signal("-KILL", pid);
    let _ = first.child.0.wait();
    assert!(job.out().join("launcher.lock").exists(), "left behind by SIGKILL");
    let steps = steps_of(&job.metrics());
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<u64>>(), "one run's steps, in order");
    let run = job.run(2, &["--overwrite", "--set", "train.steps=3"], &[]);
    run.assert_success();
    assert!(run.stdout().contains(&format!("left by launcher pid {pid}")), "{}", run.stdout());
    assert!(run.stdout().contains("no longer running"), "{}", run.stdout());
    assert_eq!(steps_of(&job.metrics()), vec![1, 2, 3]);
    assert!(!job.out().join("launcher.lock").exists(), "released at the end");
}

#[test]
fn a_lock_held_on_another_host_is_refused_naming_it() {
    let job = Job::new();
    std::fs::create_dir_all(job.out()).expect("mkdir");
    let lock = job.out().join("launcher.lock");
    let holder = r#"{"host":"gpu-node-17.example","pid":4242,"start_ticks":123,"since_unix":1795602645}"#;
    std::fs::write(&lock, holder).expect("lock");
    let run = job.run(2, &[], &[]);
    let stderr = run.stderr();
    assert_eq!(run.code(), Some(2), "{stderr}");
    for needle in
        ["launcher pid 4242 on host gpu-node-17.example", "If it is dead, remove", &lock.display().to_string()]
    {
        assert!(stderr.contains(needle), "`{needle}` missing:\n{stderr}");
    }
    assert_eq!(std::fs::read_to_string(&lock).expect("lock"), holder, "left alone");
    assert!(!job.out().join("logs").exists(), "nothing started");
}

#[test]
fn prepare_data_into_a_directory_with_shards_is_refused_unless_appended() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("fables.txt"), dir.path().join("ledgers.txt"));
    let text =
        |w: &str| (0..300).map(|i| format!("On day {i} the {w} counted {} apples.\n", i % 7)).collect::<String>();
    std::fs::write(&a, text("fox")).expect("a");
    std::fs::write(&b, text("owl")).expect("b");
    let shards = dir.path().join("shards");
    let prep = |input: &Path, extra: &[&str]| {
        let mut args = vec!["prepare-data".to_string(), input.display().to_string(), shards.display().to_string()];
        // A document per line: enough documents for a validation split.
        args.extend(["--txt-docs".to_string(), "line".to_string()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        run_launcher(&args, &[])
    };
    prep(&a, &[]).assert_success();
    let before = snapshot(&shards);

    let refused = prep(&b, &[]);
    let stderr = refused.stderr();
    assert_eq!(refused.code(), Some(2), "{stderr}");
    for needle in [&shards.display().to_string(), "fables_* (2)", "mix both datasets", "--append"] {
        assert!(stderr.contains(needle), "`{needle}` missing:\n{stderr}");
    }
    assert_eq!(snapshot(&shards), before, "nothing written");

    let appended = prep(&b, &["--append"]);
    appended.assert_success();
    assert!(appended.stdout().contains("now holds 2 sources"), "{}", appended.stdout());
    let record: Value =
        serde_json::from_str(&std::fs::read_to_string(shards.join("dataset.json")).expect("dataset.json"))
            .expect("json");
    let sources = record["sources"].as_array().expect("sources");
    let names: Vec<&str> = sources.iter().map(|s| s["name"].as_str().expect("name")).collect();
    assert_eq!(names, ["fables", "ledgers"]);
    assert_eq!(sources[1]["input"], b.display().to_string());
    let train = data::Dataset::open(&shards, data::Split::Train).expect("train split");
    let recorded: u64 = sources.iter().map(|s| s["train_tokens"].as_u64().expect("tokens")).sum();
    assert_eq!(train.total_tokens() as u64, recorded, "training reads exactly the recorded sources");
}

#[test]
fn a_full_disk_under_the_rank_logs_does_not_stop_the_job() {
    let job = Job::new();
    std::fs::create_dir_all(job.out().join("logs")).expect("mkdir");
    // Rank 0's log and metrics.jsonl on a "full disk": every write fails with ENOSPC.
    std::os::unix::fs::symlink("/dev/full", job.out().join("logs/rank0.log")).expect("symlink");
    std::os::unix::fs::symlink("/dev/full", job.out().join("metrics.jsonl")).expect("symlink");
    let run = job.run(2, &["--set", "train.steps=6", "--set", "checkpoint.every=3"], &[]);
    run.assert_success();
    let (stdout, stderr) = (run.stdout(), run.stderr());
    assert!(stdout.contains("steps: 6\n"), "the summary counts every step:\n{stdout}");
    assert!(stdout.contains("6 of the 6 step records are missing"), "{stdout}");
    let lost = stdout.lines().find(|l| l.contains("lines of the rank logs could not be written")).expect(&stdout);
    assert!(lost.contains("(rank 0: ") && !lost.contains("rank 1:") && lost.contains("No space left on device"));
    assert!(stderr.contains("rank 0 cannot write its log"), "warned while it ran:\n{stderr}");
    let log1 = std::fs::read_to_string(job.out().join("logs/rank1.log")).expect("rank 1 log");
    assert!(log1.contains("rank 1 step 6/6"), "{log1}");
    // Checkpoints are not progress output: they were written.
    assert!(job.out().join("checkpoints/step_00000006/manifest.json").is_file());
}

#[test]
fn resume_of_a_directory_that_is_not_a_checkpoint_says_so() {
    let (job, ck) = job_with_checkpoints();
    let resume = |what: &Path| {
        let run = job.run(2, &["--set", "train.steps=6", "--resume", &what.display().to_string()], &[]);
        assert_eq!(run.code(), Some(2), "{}", run.stderr());
        run.stderr()
    };
    let empty = job.dir.path().join("empty");
    std::fs::create_dir_all(&empty).expect("mkdir");
    let e = resume(&empty);
    assert!(e.contains("it is not a checkpoint") && !e.contains("did not complete"), "{e}");
    // A save that crashed: its shard, no manifest.
    let half = ck.join("step_00000006");
    std::fs::create_dir_all(&half).expect("mkdir");
    std::fs::write(half.join("rank00000.safetensors"), b"half").expect("shard");
    let e = resume(&half);
    assert!(e.contains("the save did not complete"), "{e}");
    // The run directory itself.
    let e = resume(&job.out());
    assert!(e.contains("is a run directory, not a checkpoint") && e.contains("--resume latest"), "{e}");
}

/// `prepare-data INPUT OUT_DIR extra...`, asserted to succeed.
fn prepare(input: &Path, out: &Path, extra: &[&str]) -> Run {
    let mut args = vec!["prepare-data".to_string(), input.display().to_string(), out.display().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let run = run_launcher(&args, &[]);
    run.assert_success();
    run
}

#[test]
fn a_vocabulary_too_small_for_the_shards_is_refused_naming_both() {
    let job = Job::new();
    let dir = job.dir.path();
    let tok = dir.join("big");
    std::fs::create_dir_all(&tok).expect("mkdir");
    std::fs::write(tok.join("tokenizer.json"), wordlevel::wordlevel(70_000)).expect("tokenizer");
    let text: String = (0..300).map(|i| format!("w{} w{} w3\n", 2 + i * 211 % 69_000, i % 90 + 2)).collect();
    std::fs::write(dir.join("ids.txt"), text).expect("text");
    let shards = dir.join("shards");
    let tokenizer = tok.display().to_string();
    let prep = prepare(&dir.join("ids.txt"), &shards, &["--tokenizer", &tokenizer, "--txt-docs", "line"]);
    assert!(
        prep.stdout().contains("ids stored as u32") && prep.stdout().contains("model.vocab_size=70000"),
        "{}",
        prep.stdout()
    );

    let data = format!("data.path='{}'", shards.display());
    let run = job.run(1, &["--set", &data], &[]);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    let stderr = run.stderr();
    for needle in ["model.vocab_size = 97", "big/tokenizer.json", "70000", &shards.display().to_string()] {
        assert!(stderr.contains(needle), "`{needle}` missing:\n{stderr}");
    }
    assert!(!job.out().join("logs/rank0.log").exists(), "refused before any rank started");
}

#[test]
fn shards_of_another_tokenizer_than_init_from_are_refused_naming_both() {
    let job = Job::new();
    let dir = job.dir.path();
    let text: String = (0..200).map(|i| format!("w{} w{} w4\n", i % 9 + 2, i % 7 + 2)).collect();
    std::fs::write(dir.join("t.txt"), text).expect("text");
    let hf = dir.join("hf-model");
    std::fs::create_dir_all(&hf).expect("mkdir");
    std::fs::write(hf.join("tokenizer.json"), wordlevel::wordlevel(50)).expect("tokenizer");
    let gpt2 = dir.join("gpt2-shards");
    prepare(&dir.join("t.txt"), &gpt2, &["--txt-docs", "line"]);

    let launch = |shards: &Path| {
        let data = format!("data.path='{}'", shards.display());
        let init = format!("train.init_from='{}'", hf.display());
        job.run(1, &["--set", &data, "--set", &init, "--set", "model.vocab_size=50304"], &[])
    };
    let run = launch(&gpt2);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    let stderr = run.stderr();
    for needle in ["tokenised with gpt2", "hf-model/tokenizer.json", "another tokenizer", "--tokenizer"] {
        assert!(stderr.contains(needle), "`{needle}` missing:\n{stderr}");
    }
    assert!(!job.out().join("logs/rank0.log").exists(), "refused before any rank started");

    // Shards of the folder's own tokenizer pass that check (the folder has no weights: refused for that).
    let own = dir.join("own-shards");
    prepare(&dir.join("t.txt"), &own, &["--txt-docs", "line", "--tokenizer", &hf.display().to_string()]);
    let run = launch(&own);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(!run.stderr().contains("another tokenizer"), "{}", run.stderr());
}

#[test]
fn prepare_data_refuses_a_bad_record_when_asked_and_writes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("web.jsonl");
    std::fs::write(&input, "{\"text\": \"fine\"}\n{\"text\": 3}\n").expect("write");
    let out = dir.path().join("out");
    let args = ["prepare-data", &input.display().to_string(), &out.display().to_string(), "--on-bad", "refuse"];
    let run = launcher(&args);
    assert_eq!(run.code(), Some(2), "{}", run.stderr());
    assert!(run.stderr().contains("web.jsonl: line 2: field \"text\" is a number"), "{}", run.stderr());
    assert!(!out.exists());
    // Skipped by default, and said.
    let run = prepare(&input, &out, &[]);
    assert!(run.stdout().contains("skipped 1 malformed record (--on-bad skip):\n  "), "{}", run.stdout());
}

#[test]
fn prepare_data_output_is_plain_off_a_terminal_and_survives_a_closed_stdout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let docs: String = (0..3000)
        .map(|i| serde_json::json!({"text": format!("Document {i} about owls and foxes.")}).to_string() + "\n")
        .collect();
    std::fs::write(d.join("a.jsonl"), &docs).expect("write");
    std::fs::write(d.join("b.txt"), "One more document.").expect("write");
    let pattern = d.join("*.jsonl").display().to_string();
    let run = launcher(&[
        "prepare-data",
        &pattern,
        &d.join("b.txt").display().to_string(),
        &d.join("out").display().to_string(),
    ]);
    run.assert_success();
    let stdout = run.stdout();
    assert!(stdout.contains("from 3001 document(s) of 2 input file(s)"), "{stdout}");
    assert!(!stdout.contains('\u{1b}') && !stdout.contains('\r'), "no terminal control codes in a pipe: {stdout:?}");
    // `| head -1`: stdout closes after the first line; the run still finishes and writes everything.
    let exe = env!("CARGO_BIN_EXE_launcher");
    let out2 = d.join("out2");
    let script = format!("'{exe}' prepare-data '{pattern}' '{}' | head -1; exit ${{PIPESTATUS[0]}}", out2.display());
    let status = Command::new("bash").arg("-c").arg(&script).stdin(Stdio::null()).output().expect("bash");
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    assert!(out2.join("dataset.json").is_file() && out2.join("data_train_000000.bin").is_file());
}

/// `[[data.sources]]` through the launcher: two ranks train on a 3:1 mixture and
/// metrics.jsonl gives each source's rows and epochs; a missing source, or one given with
/// data.path, is refused before any rank starts, naming it.
#[test]
fn mixed_sources_train_and_bad_ones_are_refused_before_launch() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, n) in [("web", 20_000), ("code", 3_000)] {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).expect("mkdir");
        common::write_synthetic_shard(&d, 97, n);
    }
    let write = |sources: &str, extra: &str| {
        let config = dir.path().join("mix.toml");
        let text = format!(
            "{}\n{extra}\n[data]\n{sources}\n[output]\ndir = '{}'\n",
            common::tiny_toml(0, 1, "\"none\""),
            dir.path().join("out").display()
        );
        std::fs::write(&config, text).expect("write config");
        config.display().to_string()
    };
    let entry = |path: &str, weight: u32| {
        format!("[[data.sources]]\npath = '{}'\nweight = {weight}\n", dir.path().join(path).display())
    };
    let config = write(&(entry("web", 3) + &entry("code", 1)), "");
    let run = run_launcher(&["--cpus".into(), "2".into(), config], &[]);
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    let text = std::fs::read_to_string(dir.path().join("out/metrics.jsonl")).expect("metrics");
    let last: Value = serde_json::from_str(text.lines().last().expect("a line")).expect("json");
    // 4 steps of micro_batch 2 x 2 ranks = 16 rows: 12 and 4.
    let rows: Vec<(String, u64)> = last["sources"]
        .as_array()
        .expect("sources")
        .iter()
        .map(|s| (s["name"].as_str().unwrap_or_default().to_string(), s["rows"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(rows, [("web".to_string(), 12), ("code".to_string(), 4)]);

    for (sources, extra, needles) in [
        (entry("web", 3) + &entry("nowhere", 1), "", vec!["data source \"nowhere\"", "does not exist"]),
        (format!("path = 'x'\n{}", entry("web", 1)), "", vec!["data.sources", "cannot be given with data.path"]),
        // Document masking checks every source: these shards record no end-of-text id.
        (
            format!("document_mask = true\n{}", entry("web", 3) + &entry("code", 1)),
            "",
            vec!["data source \"web\"", "data.document_mask", "no tokenizer record"],
        ),
    ] {
        let config = write(&sources, extra);
        let run = run_launcher(&["--cpus".into(), "2".into(), config, "--overwrite".into()], &[]);
        let stderr = run.stderr();
        assert_eq!(run.code(), Some(2), "{stderr}");
        for n in needles {
            assert!(stderr.contains(n), "stderr must name `{n}`:\n{stderr}");
        }
    }
}

// ---- `launcher doctor` (issue 27): the network check before a long run.

/// `launcher doctor` on CPU ranks (TCP, as in training): it runs, reports bandwidths for
/// every collective size and every pair of ranks, and passes; a rank throttled by the
/// test-only fault is named as the slow rank (exit code 4); `--expect-gbps` above what
/// loopback gives fails the collectives against it.
#[test]
fn doctor_measures_cpu_ranks_and_names_a_throttled_rank() {
    let dir = tempfile::tempdir().expect("tmp");
    let json = dir.path().join("report.json");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a = vec!["doctor", "--cpus", "3", "--sizes", "64K,1M", "--link-size", "1M", "--threshold", "0.2"];
        a.extend_from_slice(extra);
        a.iter().map(|s| s.to_string()).collect()
    };
    let out = dir.path().join("out");
    let ok = run_launcher(&args(&["--json", &json.display().to_string(), "--out", &out.display().to_string()]), &[]);
    ok.assert_success();
    let stdout = ok.stdout();
    assert!(stdout.contains("network check: 3 rank(s) on 1 node(s)") && stdout.contains("verdict: OK"), "{stdout}");
    assert!(stdout.contains("links within a node: 3 pair(s)"), "{stdout}");
    assert!(out.join("logs/rank2.log").is_file(), "the ranks' logs are in --out");
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("--json")).expect("JSON");
    let rows = report["collectives"].as_array().expect("rows");
    assert_eq!(rows.len(), 4, "2 sizes x all_reduce, all_gather: {report}");
    for r in rows.iter().chain(report["links"].as_array().expect("links")) {
        let g = r.get("busbw_gbps").or(r.get("gbps")).and_then(Value::as_f64).expect("a bandwidth");
        assert!(g.is_finite() && g > 0.0, "{r}");
    }
    assert_eq!(report["links"].as_array().map(Vec::len), Some(3));

    let slow = run_launcher(&args(&[]), &[("SHARDTRAIN_FAULT", "1:0:throttle")]);
    let text = slow.stdout();
    assert_eq!(slow.code(), Some(4), "{text}\n{}", slow.stderr());
    assert!(
        text.contains("verdict: SLOW") && text.contains("rank 1 (node 0) is slow: all 2 of its links are"),
        "{text}"
    );
    assert!(slow.stderr().contains("the network is slower than 20% of what is expected"), "{}", slow.stderr());

    let expect = run_launcher(&args(&["--expect-gbps", "100000"]), &[]);
    assert_eq!(expect.code(), Some(4), "{}", expect.stdout());
    assert!(expect.stdout().contains("all_reduce of 1 MiB over the job's 3 ranks"), "{}", expect.stdout());
    assert!(expect.stdout().contains("expected from --expect-gbps"), "{}", expect.stdout());
}

/// Two doctor launchers as two nodes, laid out by torchrun-style variables alone: one
/// report on node 0 with links within and across nodes.
#[test]
fn doctor_checks_a_two_node_job_from_torchrun_variables() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port().to_string();
    let json = dir.path().join("report.json");
    let mut nodes: Vec<Background> = (0..2)
        .map(|k| {
            let mut a = vec!["doctor", "--cpus", "2", "--sizes", "64K", "--link-size", "256K", "--threshold", "0.05"];
            let j = json.display().to_string();
            if k == 0 {
                a.extend(["--json", &j]);
            }
            let a: Vec<String> = a.iter().map(|s| s.to_string()).collect();
            let k = k.to_string();
            let env = [
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port.as_str()),
                ("WORLD_SIZE", "4"),
                ("NODE_RANK", k.as_str()),
                ("LOCAL_WORLD_SIZE", "2"),
                ("SHARDTRAIN_JOB_TOKEN", "doctor-test-token"),
            ];
            Background::start(&a, &env, dir.path(), &format!("node{k}"))
        })
        .collect();
    let codes: Vec<Option<i32>> = nodes.iter_mut().map(|n| n.wait(Duration::from_secs(60))).collect();
    let stdout0 = nodes[0].stdout();
    assert_eq!(codes, [Some(0), Some(0)], "{stdout0}\n{}\n{}", nodes[0].stderr(), nodes[1].stderr());
    assert!(stdout0.contains("from the torchrun-style environment"), "{stdout0}");
    assert!(stdout0.contains("network check: 4 rank(s) on 2 node(s)"), "{stdout0}");
    assert!(
        stdout0.contains("links within a node: 2 pair(s)") && stdout0.contains("links across nodes: 4 pair(s)"),
        "{stdout0}"
    );
    assert!(nodes[1].stdout().contains("measured; the report is on node 0"), "{}", nodes[1].stdout());
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("--json")).expect("JSON");
    assert_eq!(report["nodes"], 2);
    let across = report["links"].as_array().expect("links").iter().filter(|l| l["across_nodes"] == true).count();
    assert_eq!(across, 4);
}

/// `launcher eval` with `[[data.sources]]`: every source with a validation split gets its own
/// loss (the weights loaded once), a source without one is named on stderr, `--source NAME`
/// evaluates one (the same loss as in the full run), and an unknown name, or a source without
/// a validation split, is refused (exit code 2) saying what there is.
#[test]
fn eval_gives_a_loss_per_data_source() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, mult, val) in [("web", 7u32, true), ("code", 11, true), ("books", 13, false)] {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).expect("mkdir");
        let toks: Vec<u16> = (0..4000u32).map(|i| ((i * mult + i / 13) % 97) as u16).collect();
        data::write_shard(d.join("t_train_000000.bin"), &toks).expect("train");
        if val {
            data::write_shard(d.join("t_val_000000.bin"), &toks[..1000]).expect("val");
        }
    }
    let entry = |path: &str| format!("[[data.sources]]\npath = '{}'\n", dir.path().join(path).display());
    let config = dir.path().join("mix.toml");
    let text = format!(
        "{}\n[checkpoint]\nevery = 4\n\n[data]\n{}{}{}\n[output]\ndir = '{}'\n",
        common::tiny_llama_toml(1, 1, "\"none\"", false),
        entry("web"),
        entry("code"),
        entry("books"),
        dir.path().join("out").display()
    );
    std::fs::write(&config, text).expect("write config");
    let config = config.display().to_string();
    let run = run_launcher(&["--cpus".into(), "2".into(), config.clone()], &[]);
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    let ck = dir.path().join("out/checkpoints/step_00000004").display().to_string();
    let eval = |extra: &[&str]| {
        let mut args = vec!["eval", &config, "--checkpoint", &ck, "--windows", "5", "--json"];
        args.extend_from_slice(extra);
        launcher(&args)
    };
    let all = eval(&[]);
    all.assert_success();
    let lines: Vec<Value> = all.stdout().lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
    let got: Vec<(&str, f64)> =
        lines.iter().map(|v| (v["source"].as_str().unwrap_or("?"), v["loss"].as_f64().unwrap_or(f64::NAN))).collect();
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec!["web", "code"], "{}", all.stdout());
    assert!(got[0].1 != got[1].1 && got.iter().all(|g| g.1 > 0.0), "two sources, two losses: {got:?}");
    assert!(all.stderr().contains("books"), "the source without a validation split is named: {}", all.stderr());
    let code = eval(&["--source", "code"]);
    code.assert_success();
    let one: Value = serde_json::from_str(code.stdout().trim()).expect("one JSON line");
    assert_eq!(one["loss"].as_f64(), Some(got[1].1), "--source code: the same windows, the same loss");
    let unknown = eval(&["--source", "news"]);
    assert_eq!(unknown.code(), Some(2), "{}", unknown.stderr());
    assert!(unknown.stderr().contains("web, code, books"), "{}", unknown.stderr());
    let none = eval(&["--source", "books"]);
    assert_eq!(none.code(), Some(2), "{}", none.stderr());
    assert!(none.stderr().contains("no validation split"), "{}", none.stderr());
}

/// `zero.fp8_gather = true` where it has nothing to act on (bf16, ZeRO-0, one rank) trains as
/// before and says so in rank 0's log, naming what it would need.
#[test]
fn an_fp8_gather_with_nothing_to_gather_is_said() {
    let job = Job::new();
    job.run(1, &["--set", "zero.fp8_gather=true"], &[]).assert_success();
    let log = std::fs::read_to_string(job.out().join("logs/rank0.log")).expect("rank 0 log");
    assert!(
        log.contains(
            "zero.fp8_gather gathers FP8 weights with train.precision = \"fp8\", zero.stage = 3, more than one rank: \
             this run gathers at compute precision"
        ),
        "{log}"
    );
}
