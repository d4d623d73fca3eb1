//! One launcher at a time per run directory: `output.dir`, and `checkpoint.dir` when it
//! lies outside it. Two runs writing one directory interleave `metrics.jsonl` and lose its
//! steps, and save over each other's checkpoints; the second launcher is refused instead.
//!
//! `<dir>/launcher.lock` is held with `flock` ([`std::fs::File::try_lock`]) for the launcher's
//! life, so the kernel releases it on any exit, SIGKILL included. It also names its holder
//! (host, pid, the process's start time, since when) for the message that refuses another
//! launcher. The file is removed on every exit the launcher lives through (the end of the
//! job, a failed rank, Ctrl-C, a panic: [`RunLock`]'s `Drop`). One left behind by a killed
//! launcher is stale: on this host the lock is free and its process gone (pid and start
//! time), so it is taken over with a message; from another host (a shared file system,
//! where `flock` may not reach across hosts) that cannot be checked, and the launch is
//! refused naming the host and pid: whoever knows that run is dead removes the file.

use crate::errors::SetupError;
use crate::time::now_unix;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The lock file in a locked directory.
pub const LOCK_FILE: &str = "launcher.lock";

/// Who holds a lock (the lock file's contents, JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    pub host: String,
    pub pid: u32,
    /// The process's start time (`/proc/<pid>/stat`, clock ticks since boot): a pid reused
    /// by another process is not mistaken for the holder.
    pub start_ticks: Option<u64>,
    pub since_unix: u64,
}

impl Holder {
    fn me() -> Holder {
        let pid = std::process::id();
        Holder { host: host_name(), pid, start_ticks: start_ticks(pid), since_unix: now_unix() }
    }

    fn describe(&self) -> String {
        format!("launcher pid {} on host {} (since {})", self.pid, self.host, crate::time::utc(self.since_unix))
    }

    /// Whether this holder's process is running on this host now.
    fn alive_here(&self) -> bool {
        match (self.start_ticks, start_ticks(self.pid)) {
            (Some(want), Some(now)) => want == now,
            (None, now) => now.is_some() || Path::new(&format!("/proc/{}", self.pid)).exists(),
            (Some(_), None) => false,
        }
    }
}

/// A held lock; released (its file removed) when dropped.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    file: Option<File>,
}

impl RunLock {
    /// Lock `dir` (created if missing) for this launcher. `role` names the directory in
    /// messages (`output.dir`, `checkpoint.dir`). Returns the lock and, when it took over
    /// a stale one, a line saying so.
    pub fn acquire(dir: &Path, role: &str) -> Result<(RunLock, Option<String>), SetupError> {
        std::fs::create_dir_all(dir).map_err(|e| {
            SetupError(format!(
                "{role} = {} is not writable (cannot create it: {e}): choose a writable directory, e.g. \
                 --set {role}='\"runs/mine\"'",
                dir.display()
            ))
        })?;
        let path = dir.join(LOCK_FILE);
        let io = |what: &str, e: std::io::Error| SetupError(format!("cannot {what} {} ({e})", path.display()));
        // A holder that releases removes the file between our open and our lock: try again.
        for _ in 0..10 {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|e| io("create the lock file", e))?;
            let flocked = match file.try_lock() {
                Ok(()) => true,
                Err(TryLockError::WouldBlock) => {
                    let holder = read_holder(&mut file).map(|h| h.describe());
                    return Err(SetupError(format!(
                        "{role} = {} is in use by another run: {}; two runs in one directory would mix their \
                         metrics and checkpoints. Wait for it to finish, stop it, or give this run its own \
                         directory (--set {role}='\"...\"')",
                        dir.display(),
                        holder.unwrap_or_else(|| "a launcher that is starting".into())
                    )));
                }
                // No flock on this file system (some network mounts): the holder's record decides.
                Err(TryLockError::Error(_)) => false,
            };
            if !same_file(&file, &path) {
                continue;
            }
            let note = match read_holder(&mut file) {
                None => None,
                Some(h) if h.host != host_name() => {
                    return Err(SetupError(format!(
                        "{role} = {} is locked by {} ({}); this host cannot tell whether that run is still \
                         going. If it is dead, remove {} and launch again; if it runs, give this run its own \
                         directory (--set {role}='\"...\"')",
                        dir.display(),
                        h.describe(),
                        path.display(),
                        path.display()
                    )));
                }
                Some(h) if !flocked && h.alive_here() => {
                    return Err(SetupError(format!(
                        "{role} = {} is in use by another run: {}; wait for it to finish, stop it, or give this \
                         run its own directory (--set {role}='\"...\"')",
                        dir.display(),
                        h.describe()
                    )));
                }
                Some(h) => Some(format!(
                    "launcher: took over the lock of {role} = {} left by {}, which is no longer running",
                    dir.display(),
                    h.describe()
                )),
            };
            let me = serde_json::to_string(&Holder::me()).map_err(|e| io("encode", std::io::Error::other(e)))?;
            file.set_len(0)
                .and_then(|()| file.rewind())
                .and_then(|()| file.write_all(me.as_bytes()))
                .and_then(|()| file.sync_all())
                .map_err(|e| io("write", e))?;
            return Ok((RunLock { path, file: Some(file) }, note));
        }
        Err(SetupError(format!(
            "cannot lock {}: it keeps being replaced (several launchers starting at once?); launch again",
            path.display()
        )))
    }

    /// The locked directory was renamed to `dir` (moved aside with the run it held).
    pub fn moved_to(&mut self, dir: &Path) {
        self.path = dir.join(LOCK_FILE);
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if let Some(file) = self.file.take() {
            // Removed while still locked, and only if it is still ours (never another's new lock).
            if same_file(&file, &self.path) {
                let _ = std::fs::remove_file(&self.path);
            }
            drop(file);
        }
    }
}

fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

/// Whether `path` still names the open `file` (not removed or replaced since it was opened).
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// This machine's name (for locks and run identities).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "unknown-host".into())
}

/// When process `pid` started (field 22 of `/proc/<pid>/stat`), if it runs.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_and_released_on_drop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (lock, note) = RunLock::acquire(dir.path(), "output.dir").expect("first");
        assert!(note.is_none());
        let e = RunLock::acquire(dir.path(), "output.dir").unwrap_err().0;
        assert!(e.contains("in use by another run") && e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(lock);
        assert!(!dir.path().join(LOCK_FILE).exists(), "released: the file is gone");
        let (_again, note) = RunLock::acquire(dir.path(), "output.dir").expect("free again");
        assert!(note.is_none());
    }

    #[test]
    fn stale_locks_are_taken_over_and_other_hosts_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |h: &Holder| std::fs::write(dir.path().join(LOCK_FILE), serde_json::to_string(h).expect("json"));
        // A holder on this host whose process is gone (this process's pid, another start time).
        let mut dead = Holder::me();
        dead.start_ticks = dead.start_ticks.map(|t| t + 1).or(Some(1));
        write(&dead).expect("write");
        let (lock, note) = RunLock::acquire(dir.path(), "output.dir").expect("stale: taken over");
        assert!(note.is_some_and(|n| n.contains("no longer running")));
        drop(lock);
        let far = Holder { host: "elsewhere.example".into(), ..Holder::me() };
        write(&far).expect("write");
        let e = RunLock::acquire(dir.path(), "output.dir").unwrap_err().0;
        assert!(e.contains("elsewhere.example") && e.contains("remove") && e.contains(LOCK_FILE), "{e}");
        assert!(dir.path().join(LOCK_FILE).exists(), "another host's lock is left alone");
    }

    #[test]
    fn this_process_has_a_start_time() {
        assert!(start_ticks(std::process::id()).is_some());
        assert!(Holder::me().alive_here());
    }
}
