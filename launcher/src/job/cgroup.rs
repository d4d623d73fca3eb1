//! This process's memory cgroup (v2, or v1's memory controller), as far as this machine
//! shows it: its limit less its usage (inside a container or a scheduler's allocation the
//! ranks are held to that, while `MemAvailable` shows the whole host) for the fit check, and
//! its OOM-kill count for naming "out of memory" (`oom.rs`). The ranks run in the
//! launcher's cgroup, so its figures are theirs.

use std::path::{Path, PathBuf};

/// Limits this high mean none (v1 writes "unlimited" as the largest page-counter value).
const NO_LIMIT: u64 = 1 << 62;

/// A memory cgroup's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    pub dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    /// The cgroup of this process, under `/proc` and `/sys/fs/cgroup` on a real machine.
    pub fn of_self() -> Option<MemoryCgroup> {
        MemoryCgroup::find(Path::new("/proc"), Path::new("/sys/fs/cgroup"))
    }

    /// The most specific visible directory of this process's memory cgroup: its path as
    /// `/proc/self/cgroup` names it, or a tail of that path (a container sees its own cgroup
    /// as the root of the mount), else the root; v2 where it has the memory controller.
    pub fn find(proc_root: &Path, sys_root: &Path) -> Option<MemoryCgroup> {
        let text = std::fs::read_to_string(proc_root.join("self/cgroup")).ok()?;
        let mut v1 = None;
        for line in text.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
            if controllers.is_empty() {
                for base in [sys_root.to_path_buf(), sys_root.join("unified")] {
                    if let Some(dir) = visible(&base, path, "memory.max") {
                        return Some(MemoryCgroup { dir, v2: true });
                    }
                }
            } else if controllers.split(',').any(|c| c == "memory") {
                v1 = visible(&sys_root.join("memory"), path, "memory.limit_in_bytes");
            }
        }
        v1.map(|dir| MemoryCgroup { dir, v2: false })
    }

    fn read(&self, file: &str) -> Option<String> {
        std::fs::read_to_string(self.dir.join(file)).ok()
    }

    fn number(&self, file: &str) -> Option<u64> {
        self.read(file)?.trim().parse().ok()
    }

    /// Its memory limit in bytes (`None`: none).
    pub fn limit(&self) -> Option<u64> {
        let limit = if self.v2 { self.number("memory.max") } else { self.number("memory.limit_in_bytes") }?;
        (limit < NO_LIMIT).then_some(limit)
    }

    /// What its processes may still allocate: the limit less the usage (`None`: no limit).
    pub fn headroom(&self) -> Option<u64> {
        let usage = if self.v2 { self.number("memory.current") } else { self.number("memory.usage_in_bytes") };
        Some(self.limit()?.saturating_sub(usage.unwrap_or(0)))
    }

    /// (the counter file, its `oom_kill`): the processes of this cgroup the kernel's OOM
    /// killer ended.
    pub fn oom_kills(&self) -> Option<(PathBuf, u64)> {
        let file = if self.v2 { "memory.events" } else { "memory.oom_control" };
        Some((self.dir.join(file), oom_kill(&self.read(file)?)?))
    }
}

/// The first of `base/a/b/c`, `base/b/c`, `base/c`, `base` (for `path` = `/a/b/c`) that
/// holds `marker`.
fn visible(base: &Path, path: &str, marker: &str) -> Option<PathBuf> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    (0..=parts.len())
        .map(|skip| parts[skip..].iter().fold(base.to_path_buf(), |d, p| d.join(p)))
        .find(|d| d.join(marker).is_file())
}

/// The `oom_kill N` line's N (`memory.events`, `memory.oom_control`, `/proc/vmstat`).
pub fn oom_kill(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, text: &str) {
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, text).expect("write");
    }

    #[test]
    fn the_visible_cgroup_and_its_figures_are_found() {
        let d = tempfile::tempdir().expect("tempdir");
        let (proc, sys) = (d.path().join("proc"), d.path().join("sys"));
        // v1 memory controller, seen from inside a container: the path's tail is visible.
        write(&proc.join("self/cgroup"), "4:memory:/docker/abc/job\n1:cpu:/x\n0::/\n");
        write(&sys.join("memory/memory.limit_in_bytes"), "9223372036854771712\n");
        assert_eq!(MemoryCgroup::find(&proc, &sys).map(|c| c.dir), Some(sys.join("memory")), "the root of the view");
        assert_eq!(MemoryCgroup::find(&proc, &sys).and_then(|c| c.limit()), None, "unlimited");
        write(&sys.join("memory/job/memory.limit_in_bytes"), "1000\n");
        write(&sys.join("memory/job/memory.usage_in_bytes"), "300\n");
        write(&sys.join("memory/job/memory.oom_control"), "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n");
        let c = MemoryCgroup::find(&proc, &sys).expect("cgroup");
        assert_eq!(c.dir, sys.join("memory/job"));
        assert_eq!((c.limit(), c.headroom()), (Some(1000), Some(700)));
        assert_eq!(c.oom_kills(), Some((sys.join("memory/job/memory.oom_control"), 2)));
        // v2 with the memory controller wins.
        write(&proc.join("self/cgroup"), "0::/user/job\n");
        write(&sys.join("user/job/memory.max"), "max\n");
        write(&sys.join("user/job/memory.events"), "low 0\noom 1\noom_kill 1\noom_group_kill 0\n");
        let c = MemoryCgroup::find(&proc, &sys).expect("v2");
        assert_eq!((c.limit(), c.headroom()), (None, None));
        assert_eq!(c.oom_kills().map(|k| k.1), Some(1));
        assert_eq!(oom_kill("nr_free_pages 5\noom_kill 7\n"), Some(7));
    }
}
