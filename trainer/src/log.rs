//! A rank's log lines, written so that a failed write never stops training.
//!
//! A rank's stderr is its `logs/rank<r>.log` (the launcher points it there), and
//! `eprintln!` panics when the write fails: a full disk would kill the rank (exit 101) and
//! lose the panic message with it. [`line`](fn@line) (or the [`log_line!`](crate::log_line) macro)
//! writes one whole line instead and, when that fails, counts the line as lost and keeps
//! the first error; [`lost`] reads both back for the run summary.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

static LOST: AtomicU64 = AtomicU64::new(0);
static FIRST_ERROR: OnceLock<String> = OnceLock::new();

/// Write one line to this process's stderr (a rank's log); a line that cannot be written is
/// counted, never a panic.
pub fn line(args: std::fmt::Arguments) {
    let mut text = args.to_string();
    text.push('\n');
    write_counted(std::io::stderr().lock(), &text);
}

fn write_counted(mut w: impl Write, text: &str) {
    // One write of the whole line: lines of several threads do not interleave.
    if let Err(e) = w.write_all(text.as_bytes()).and_then(|()| w.flush()) {
        LOST.fetch_add(1, Ordering::Relaxed);
        let _ = FIRST_ERROR.set(e.to_string());
    }
}

/// Lines this process could not write so far, and the first error (`None` when none was lost).
pub fn lost() -> (u64, Option<String>) {
    (LOST.load(Ordering::Relaxed), FIRST_ERROR.get().cloned())
}

/// `eprintln!` for a rank's log that never panics: `log_line!("rank {rank}: ...")`.
#[macro_export]
macro_rules! log_line {
    ($($arg:tt)*) => {
        $crate::log::line(format_args!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_loses_lines_without_panicking() {
        let (before, _) = lost();
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").expect("/dev/full");
        write_counted(&full, "rank 0 step 1/2\n");
        write_counted(&full, "rank 0 step 2/2\n");
        let (after, error) = lost();
        assert_eq!(after - before, 2);
        assert!(error.is_some_and(|e| e.contains("No space left")));
        let mut ok = Vec::new();
        write_counted(&mut ok, "fine\n");
        assert_eq!(ok, b"fine\n");
        assert_eq!(lost().0, after, "a line written is not counted");
    }
}
