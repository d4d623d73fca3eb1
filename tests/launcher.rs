//! The launcher as a user runs it: real rank processes over loopback TCP, end to end.
//! Training runs, sharded-vs-single-rank loss equality through metrics.jsonl, failure
//! handling with injected faults (a rank exiting, a rank crashing, Ctrl-C), errors that
//! stop a job before it starts, and `prepare-data` feeding a run.

mod common;

use serde_json::Value;
use std::path::PathBuf;
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

fn run_launcher(args: &[String], env: &[(&str, &str)]) -> Run {
    let start = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_launcher"))
        .args(args)
        .env_remove("SHARDTRAIN_FAULT")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run the launcher");
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
    job.run(1, &["--set", "zero.stage=0", "--set", "train.grad_accum=3"], &[]).assert_success();
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
}

#[test]
fn rank_exit_stops_the_job() {
    assert_fault_stops_job("1:2:exit", 1, "exited with code 3");
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
        Command::new(env!("CARGO_BIN_EXE_launcher"))
            .args(["--cpus", "2"])
            .arg(&job.config)
            .args(["--set", "train.steps=100000"])
            .env_remove("SHARDTRAIN_FAULT")
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
}

#[test]
fn bad_config_stops_before_any_rank_starts() {
    // (extra TOML appended to the config, --set arguments, what stderr must name)
    let cases: [(&str, &[&str], &[&str]); 6] = [
        ("[bogus_section]\nx = 1\n", &[], &["bogus_section"]),
        ("", &["--set", "train.stepz=3"], &["stepz"]),
        ("", &["--set", "train.steps=\"many\""], &["train.steps", "many"]),
        ("", &["--set", "zero.stage=7"], &["zero.stage"]),
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
fn gpus_are_reported_not_built() {
    let job = Job::new();
    let run = run_launcher(&["--gpus".into(), "1".into(), job.config.display().to_string()], &[]);
    assert_ne!(run.code(), Some(0));
    let stderr = run.stderr();
    assert!(stderr.contains("CUDA backend is not built") && stderr.contains("--cpus"), "{stderr}");
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
