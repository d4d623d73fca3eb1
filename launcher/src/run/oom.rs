//! Was a rank that died of SIGKILL ended by the kernel's OOM killer? A process killed for
//! lack of memory gets SIGKILL and writes nothing, so its log stops mid-line and the exit
//! status alone says "killed by SIGKILL". The kernel counts its OOM kills: per cgroup
//! (v2 `memory.events`, v1 `memory.oom_control`: `oom_kill N`) and for the host
//! (`/proc/vmstat`). The supervisor reads them when the job starts ([`OomWatch::start`]) and
//! again when a rank it did not kill died of SIGKILL ([`OomWatch::explain_sigkill`]): a
//! count that rose names "out of memory"; otherwise the report still says that the OOM
//! killer is the usual sender of SIGKILL, with the host's available memory and what to do.

use crate::job::cgroup::{oom_kill, MemoryCgroup};
use std::path::{Path, PathBuf};

/// The OOM-kill counters this process can read, at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Counts {
    /// (the counter file, its `oom_kill`) of this process's cgroup.
    cgroup: Option<(PathBuf, u64)>,
    /// `/proc/vmstat`'s `oom_kill`: every OOM kill on the host since boot.
    host: Option<u64>,
}

/// The counters at the start of a job, to compare with when a rank dies of SIGKILL.
#[derive(Debug, Clone)]
pub struct OomWatch {
    proc_root: PathBuf,
    sys_root: PathBuf,
    start: Counts,
}

impl OomWatch {
    /// Read the counters of this machine now.
    pub fn start() -> OomWatch {
        OomWatch::with_roots(Path::new("/proc"), Path::new("/sys/fs/cgroup"))
    }

    fn with_roots(proc_root: &Path, sys_root: &Path) -> OomWatch {
        let start = Counts::read(proc_root, sys_root);
        OomWatch { proc_root: proc_root.to_path_buf(), sys_root: sys_root.to_path_buf(), start }
    }

    /// Why a rank that the launcher did not kill died of SIGKILL, and what to do about it.
    pub fn explain_sigkill(&self) -> String {
        let now = Counts::read(&self.proc_root, &self.sys_root);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let mut available = crate::job::fit::host_available_in(&self.proc_root)
            .map(|b| format!("; the host has {:.2} GiB available now (MemAvailable)", gib(b)))
            .unwrap_or_default();
        if let Some(limit) = MemoryCgroup::find(&self.proc_root, &self.sys_root).and_then(|c| c.limit()) {
            available += &format!(", and the ranks' memory cgroup allows {:.2} GiB", gib(limit));
        }
        let todo = "`launcher memory CONFIG --ranks N --device cpu|gpu` shows what each rank needs; use fewer ranks \
                    per node, a higher zero.stage, a smaller train.micro_batch or checkpointing.activations = \
                    \"every_layer\"";
        let rose = |before: Option<u64>, after: Option<u64>| matches!((before, after), (Some(b), Some(a)) if a > b);
        let cgroup_rose = rose(self.start.cgroup.as_ref().map(|c| c.1), now.cgroup.as_ref().map(|c| c.1));
        if cgroup_rose || rose(self.start.host, now.host) {
            let counter = match (&self.start.cgroup, &now.cgroup) {
                (Some((_, b)), Some((path, a))) if cgroup_rose => format!("{} oom_kill {b} -> {a}", path.display()),
                _ => format!("/proc/vmstat oom_kill {} -> {}", self.start.host.unwrap_or(0), now.host.unwrap_or(0)),
            };
            return format!(
                "out of memory: the kernel's OOM killer ended it while the job ran ({counter}){available}. {todo}"
            );
        }
        let seen = match (&now.cgroup, now.host) {
            (None, None) => "this machine does not expose its OOM-kill count".to_string(),
            (Some((path, n)), _) => format!("{} still counts oom_kill {n}", path.display()),
            (None, Some(n)) => format!("/proc/vmstat still counts oom_kill {n}"),
        };
        format!(
            "SIGKILL that the launcher did not send: most often the kernel's OOM killer (out of memory), though \
             none was counted here ({seen}: another cgroup's limit, a user or a scheduler may have sent it)\
             {available}. If it ran out of memory: {todo}"
        )
    }
}

impl Counts {
    fn read(proc_root: &Path, sys_root: &Path) -> Counts {
        let cgroup = MemoryCgroup::find(proc_root, sys_root).and_then(|c| c.oom_kills());
        let host = std::fs::read_to_string(proc_root.join("vmstat")).ok().and_then(|t| oom_kill(&t));
        Counts { cgroup, host }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake /proc and /sys/fs/cgroup: a v2 cgroup `/job` and the host's vmstat.
    fn machine(cgroup_kills: u64, host_kills: u64) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let (proc, sys) = (dir.path().join("proc"), dir.path().join("sys"));
        std::fs::create_dir_all(proc.join("self")).expect("mkdir");
        std::fs::create_dir_all(sys.join("job")).expect("mkdir");
        std::fs::write(proc.join("self/cgroup"), "0::/job\n").expect("write");
        std::fs::write(sys.join("job/memory.max"), "max\n").expect("write");
        std::fs::write(proc.join("meminfo"), "MemTotal: 1000 kB\nMemAvailable:   2097152 kB\n").expect("write");
        set(dir.path(), cgroup_kills, host_kills);
        dir
    }

    fn set(root: &Path, cgroup_kills: u64, host_kills: u64) {
        let events = format!("low 0\nhigh 0\nmax 3\noom 1\noom_kill {cgroup_kills}\noom_group_kill 0\n");
        std::fs::write(root.join("sys/job/memory.events"), events).expect("write");
        std::fs::write(root.join("proc/vmstat"), format!("nr_free_pages 5\noom_kill {host_kills}\n")).expect("write");
    }

    #[test]
    fn a_kill_counted_while_the_job_ran_is_named_out_of_memory() {
        let m = machine(0, 4);
        let watch = OomWatch::with_roots(&m.path().join("proc"), &m.path().join("sys"));
        let quiet = watch.explain_sigkill();
        assert!(quiet.contains("did not send") && quiet.contains("oom_kill 0"), "{quiet}");
        assert!(quiet.contains("2.00 GiB available") && quiet.contains("launcher memory"), "{quiet}");
        set(m.path(), 1, 5);
        let oom = watch.explain_sigkill();
        assert!(oom.starts_with("out of memory: the kernel's OOM killer"), "{oom}");
        assert!(oom.contains("memory.events oom_kill 0 -> 1"), "{oom}");
    }
}
