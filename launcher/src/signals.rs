//! Signals by name: the one place that turns a signal number into `SIGXFSZ` (never
//! "signal 25") and, where the signal says something about the cause, a hint at what to do.
//! Every report of a process killed by a signal goes through [`describe`].
//!
//! Also a rank's stop order: the hooks it runs before it exits ([`on_stop`]: a GPU rank's NCCL
//! abort, registered where the communicator is made) and the bounded exit ([`stop_now`]).
//! A leaf: it imports nothing of the crate.

/// Linux's signal numbers (x86-64 and aarch64 share them) with their names.
const NAMES: [(i32, &str); 31] = [
    (1, "SIGHUP"),
    (2, "SIGINT"),
    (3, "SIGQUIT"),
    (4, "SIGILL"),
    (5, "SIGTRAP"),
    (6, "SIGABRT"),
    (7, "SIGBUS"),
    (8, "SIGFPE"),
    (9, "SIGKILL"),
    (10, "SIGUSR1"),
    (11, "SIGSEGV"),
    (12, "SIGUSR2"),
    (13, "SIGPIPE"),
    (14, "SIGALRM"),
    (15, "SIGTERM"),
    (16, "SIGSTKFLT"),
    (17, "SIGCHLD"),
    (18, "SIGCONT"),
    (19, "SIGSTOP"),
    (20, "SIGTSTP"),
    (21, "SIGTTIN"),
    (22, "SIGTTOU"),
    (23, "SIGURG"),
    (24, "SIGXCPU"),
    (25, "SIGXFSZ"),
    (26, "SIGVTALRM"),
    (27, "SIGPROF"),
    (28, "SIGWINCH"),
    (29, "SIGIO"),
    (30, "SIGPWR"),
    (31, "SIGSYS"),
];

/// `SIGXFSZ` for 25; real-time signals as `SIGRTMIN+k`; anything else `signal N`.
pub fn name(sig: i32) -> String {
    if let Some((_, n)) = NAMES.iter().find(|(s, _)| *s == sig) {
        return (*n).to_string();
    }
    // glibc reserves 32 and 33; SIGRTMIN as programs see it is 34.
    match sig {
        34..=64 => format!("SIGRTMIN+{}", sig - 34),
        _ => format!("signal {sig}"),
    }
}

/// What a process killed by `sig` most likely ran into, and what to do; `None` where the
/// name says enough. (SIGKILL's hint is the OOM check's: `oom.rs`.)
pub fn hint(sig: i32) -> Option<&'static str> {
    Some(match sig {
        25 => {
            "it exceeded the file-size limit (`ulimit -f`, RLIMIT_FSIZE) while writing a file: raise the limit \
               (`ulimit -f unlimited`) in the shell that starts the launcher"
        }
        24 => {
            "it used up its CPU-time limit (`ulimit -t`, RLIMIT_CPU): raise the limit in the shell that starts \
               the launcher"
        }
        11 => "a crash (invalid memory access): please report it with the rank's log",
        7 => {
            "a memory-mapped file went away or shrank (a data shard or checkpoint changed while it ran), or the \
              host ran out of memory for the mapping"
        }
        4 | 8 => "a crash: please report it with the rank's log",
        6 => "the process aborted itself: its log above says why",
        1 => "its terminal closed: start long jobs under nohup, tmux or a scheduler",
        15 | 2 => "something outside the launcher stopped it (a user, a scheduler, a time limit)",
        _ => return None,
    })
}

/// "SIGXFSZ (signal 25: it exceeded the file-size limit ...)": the name, its number, the hint.
pub fn describe(sig: i32) -> String {
    match hint(sig) {
        Some(h) => format!("{} (signal {sig}: {h})", name(sig)),
        None => format!("{} (signal {sig})", name(sig)),
    }
}

/// What to run before this process exits on a stop order (e.g. abort the NCCL communicator,
/// so a thread blocked in a collective is released and the GPU freed promptly).
type StopHook = Box<dyn FnOnce() + Send>;
static STOP_HOOKS: std::sync::Mutex<Vec<StopHook>> = std::sync::Mutex::new(Vec::new());

/// Register `f` to run when this rank is stopped (see [`stop_now`]). GPU ranks register
/// their NCCL abort (a build without `cuda` has nothing to register).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn on_stop(f: impl FnOnce() + Send + 'static) {
    STOP_HOOKS.lock().unwrap_or_else(|p| p.into_inner()).push(Box::new(f));
}

/// How long the stop hooks may take before the rank exits without them.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Run the stop hooks (aborting communicators) and exit with `code`, within [`STOP_GRACE`].
pub fn stop_now(code: u8) -> ! {
    let _ = std::thread::Builder::new().name("stop-grace".into()).spawn(move || {
        std::thread::sleep(STOP_GRACE);
        trainer::log_line!("stopping took longer than {STOP_GRACE:?} (a communicator abort hung): exiting anyway");
        std::process::exit(i32::from(code))
    });
    let hooks: Vec<StopHook> = std::mem::take(&mut *STOP_HOOKS.lock().unwrap_or_else(|p| p.into_inner()));
    for h in hooks {
        h();
    }
    std::process::exit(i32::from(code))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_signal_has_a_name() {
        assert_eq!(name(25), "SIGXFSZ");
        assert_eq!(name(9), "SIGKILL");
        assert_eq!(name(11), "SIGSEGV");
        assert_eq!(name(36), "SIGRTMIN+2");
        assert_eq!(name(99), "signal 99");
        for sig in (1..=31).chain(34..=64) {
            assert!(!name(sig).starts_with("signal"), "{sig}");
        }
        let x = describe(25);
        assert!(x.starts_with("SIGXFSZ (signal 25: ") && x.contains("ulimit -f"), "{x}");
        assert_eq!(describe(10), "SIGUSR1 (signal 10)");
    }
}
