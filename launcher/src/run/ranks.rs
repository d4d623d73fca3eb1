//! Rank processes on this node: spawning them (this same binary with the hidden `worker`
//! subcommand, the rank environment, output into `logs/rank<r>.log`: a new file for a new
//! run, appended to after a marker line when resuming or taking over a run directory whose
//! run never completed a step), handing each its start-up line
//! (job token, fingerprint, heartbeat period) on a stdin pipe that then stays open while
//! the rank lives (its end tells the rank that this launcher is gone), watching them exit,
//! killing them, and reading a log's tail (and last step) for error reports.

use crate::job::setup::RunPlan;
use crate::run::protocol::Bootstrap;
use anyhow::Context;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use tokio::sync::{mpsc, watch};

/// A rank process ended.
#[derive(Debug)]
pub struct Exited {
    pub rank: usize,
    pub status: std::io::Result<ExitStatus>,
}

/// Spawn every rank of this node. Each gets a task that reports its exit on `exits` and
/// kills it (SIGKILL) as soon as `kill` turns true. Returns the pids, by local index.
pub fn spawn_all(
    plan: &RunPlan,
    rendezvous: SocketAddr,
    boot: &Bootstrap,
    exits: &mpsc::UnboundedSender<Exited>,
    kill: &watch::Receiver<bool>,
) -> anyhow::Result<Vec<u32>> {
    let exe = std::env::current_exe().context("cannot find the launcher's own executable to start the ranks")?;
    let bind_host = if plan.multi_node() { "0.0.0.0" } else { "127.0.0.1" };
    let env = plan.device.rank_env(plan.host_ranks);
    let mut boot_line = serde_json::to_string(boot).context("cannot encode the ranks' start-up line")?;
    boot_line.push('\n');
    let shared_gpus = crate::job::device::shares_gpus(&plan.gpu_map);
    let mut pids = Vec::new();
    for rank in plan.local_rank_ids() {
        let local = rank - plan.first_rank;
        let log_path = plan.log_path(rank);
        let log = open_log(&log_path, plan)?;
        let log_err = log.try_clone().with_context(|| format!("cannot reopen {}", log_path.display()))?;
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.arg("worker")
            .arg("--rendezvous")
            .arg(rendezvous.to_string())
            .arg("--rank")
            .arg(rank.to_string())
            .arg("--world")
            .arg(plan.world.to_string())
            .arg("--config")
            .arg(&plan.resolved_config)
            .arg("--bind-host")
            .arg(bind_host)
            .arg("--device")
            .arg(plan.device.name())
            .arg("--local-rank")
            .arg(local.to_string())
            .args(plan.gpu_map.get(local).map(|g| format!("--gpu={g}")))
            .args(plan.resume.iter().flat_map(|r| [std::ffi::OsStr::new("--resume"), r.dir.as_os_str()]))
            .args(plan.profile.then_some("--profile"))
            .args(plan.doctor.iter().flat_map(|_| ["--doctor".into(), plan.resolved_config.with_extension("json")]))
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .kill_on_drop(true);
        // Own process group: a terminal's Ctrl-C reaches only the launcher, which then stops
        // every rank itself (and reports an interrupt rather than ranks dying of SIGINT).
        #[cfg(unix)]
        cmd.process_group(0);
        if shared_gpus {
            // NCCL tells ranks apart by host and GPU; ranks sharing a GPU get hosts of their own.
            cmd.env("NCCL_HOSTID", format!("shardtrain-{}-rank{rank}", std::process::id()));
        }
        let mut child = cmd.spawn().with_context(|| format!("cannot start rank {rank} ({})", exe.display()))?;
        pids.push(child.id().unwrap_or(0));
        let mut stdin = child.stdin.take().context("the rank's stdin pipe is missing")?;
        let line = boot_line.clone();
        let exits = exits.clone();
        let mut kill = kill.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            // A rank that cannot read it exits and is reported like any other failure.
            let _ = stdin.write_all(line.as_bytes()).await;
            let killed = async move {
                // Also fires when the launcher drops the sender: no rank outlives its supervisor.
                let _ = kill.wait_for(|k| *k).await;
            };
            let status = tokio::select! {
                status = child.wait() => status,
                _ = killed => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            // The pipe stays open while the rank lives; closing it after the rank is gone.
            drop(stdin);
            let _ = exits.send(Exited { rank, status });
        });
    }
    Ok(pids)
}

/// A rank's log: created empty, or appended to after the plan's marker line, so the earlier
/// run's log (and its last error) stays above the continuation. A marker that cannot be
/// written (a full disk) is a warning: log output never stops a job.
fn open_log(path: &Path, plan: &RunPlan) -> anyhow::Result<std::fs::File> {
    let Some(marker) = &plan.log_marker else {
        return std::fs::File::create(path).with_context(|| format!("cannot create the log file {}", path.display()));
    };
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .with_context(|| format!("cannot open the log file {}", path.display()))?;
    if let Err(e) = writeln!(log, "{marker}") {
        crate::out::warn(&format!(
            "launcher: warning: cannot write to {} ({e}): the rank's log goes on without its marker line",
            path.display()
        ));
    }
    Ok(log)
}

/// "exited with code 3", "was killed by SIGABRT (signal 6: ...)": signals by name ([`crate::signals`]).
pub fn describe_status(status: &std::io::Result<ExitStatus>) -> String {
    let status = match status {
        Ok(s) => s,
        Err(e) => return format!("could not be waited for ({e})"),
    };
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            let core = if status.core_dumped() { ", core dumped" } else { "" };
            return format!("was killed by {}{core}", crate::signals::describe(sig));
        }
    }
    format!("ended with {status}")
}

/// The signal that ended a process, if one did.
pub fn killed_by(status: &std::io::Result<ExitStatus>) -> Option<i32> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.as_ref().ok()?.signal()
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        None
    }
}

/// What a launcher that has no control connection to `rank` (nodes other than 0) reads from
/// the rank's log, in one read of its tail: the last step it reported (0 if none), which
/// names the step it failed after, and the rank whose loss made it fail, if it says so,
/// which tells the cause from the consequence.
pub fn logged_end(path: &Path, rank: usize) -> (u64, Option<u32>) {
    let text = log_tail_text(path);
    let step = text.lines().rev().find_map(|l| crate::run::protocol::parse_step_line(rank, l)).unwrap_or(0);
    let lost = text.lines().rev().find_map(|l| crate::run::protocol::parse_lost_peer_line(rank, l));
    (step, lost)
}

/// The last 256 KiB of a log ("" if it cannot be read).
fn log_tail_text(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 256 << 10;
    let Ok(mut f) = std::fs::File::open(path) else { return String::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut bytes = Vec::new();
    if f.seek(SeekFrom::Start(len.saturating_sub(TAIL))).is_err() || f.read_to_end(&mut bytes).is_err() {
        return String::new();
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The last `n` lines of a log file (or a note saying why there are none).
pub fn log_tail(path: &Path, n: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            if lines.is_empty() {
                return "    (the log is empty)".to_string();
            }
            lines[lines.len().saturating_sub(n)..].iter().map(|l| format!("    {l}")).collect::<Vec<_>>().join("\n")
        }
        Err(e) => format!("    (cannot read {}: {e})", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("r.log");
        let text: String = (0..50).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&p, text).expect("write");
        let tail = log_tail(&p, 20);
        assert_eq!(tail.lines().count(), 20);
        assert!(tail.starts_with("    line 30"));
        assert!(tail.ends_with("line 49"));
        assert!(log_tail(&dir.path().join("missing"), 5).contains("cannot read"));
    }

    #[test]
    fn the_last_step_is_read_from_the_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("rank2.log");
        let log = "rank 2/4: group connected\nrank 2 step 1/50 loss 4.5\nrank 2 step 2/50 loss 4.4\n\
                   rank 2 step 3/50 loss 4.3\nrank 2: error: boom\n    at somewhere\n";
        std::fs::write(&p, log).expect("write");
        assert_eq!(logged_end(&p, 2).0, 3);
        assert_eq!(logged_end(&p, 1).0, 0);
        assert_eq!(logged_end(&dir.path().join("none.log"), 2).0, 0);
    }

    #[cfg(unix)]
    #[test]
    fn statuses_are_described() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(describe_status(&Ok(ExitStatus::from_raw(3 << 8))), "exited with code 3");
        assert!(describe_status(&Ok(ExitStatus::from_raw(6))).contains("SIGABRT"));
        let xfsz = describe_status(&Ok(ExitStatus::from_raw(25)));
        assert!(xfsz.starts_with("was killed by SIGXFSZ (signal 25: ") && xfsz.contains("ulimit -f"), "{xfsz}");
        assert_eq!(killed_by(&Ok(ExitStatus::from_raw(9))), Some(9));
        assert_eq!(killed_by(&Ok(ExitStatus::from_raw(3 << 8))), None);
    }
}
