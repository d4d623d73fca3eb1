//! The launcher's own output, written so that it can never stop a job: `launcher ... | head`
//! closes stdout after a few lines, a terminal may go away, and `println!` would then panic
//! (the launcher ignores SIGPIPE, so a write to a closed pipe is an error) and take the
//! job with it. Here a failed write is dropped, and once stdout has failed nothing more is
//! tried on it; the job, its logs and metrics.jsonl carry on.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
static STDERR_GONE: AtomicBool = AtomicBool::new(false);

fn write_line(mut w: impl Write, gone: &AtomicBool, line: &str) {
    if gone.load(Ordering::Relaxed) {
        return;
    }
    if writeln!(w, "{line}").and_then(|()| w.flush()).is_err() {
        gone.store(true, Ordering::Relaxed);
    }
}

/// A line on stdout (progress, summaries); dropped if stdout is closed.
pub fn say(line: &str) {
    write_line(std::io::stdout().lock(), &STDOUT_GONE, line);
}

/// A line on stderr (warnings, the error report); dropped if stderr is closed.
pub fn warn(line: &str) {
    write_line(std::io::stderr().lock(), &STDERR_GONE, line);
}

/// Ranks as short as a list of 1000 can be: runs of consecutive ones as `first-last`.
pub fn rank_list(ranks: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(match j - i {
            0 => ranks[i].to_string(),
            1 => format!("{}, {}", ranks[i], ranks[j]),
            _ => format!("{}-{}", ranks[i], ranks[j]),
        });
        i = j + 1;
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_stay_short() {
        assert_eq!(rank_list(&[0, 1, 2, 3, 5, 7, 8, 10]), "0-3, 5, 7, 8, 10");
        assert_eq!(rank_list(&(0..1000).collect::<Vec<_>>()), "0-999");
        assert_eq!(rank_list(&[]), "");
    }

    /// A writer whose reader has gone away.
    struct Closed;
    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_stream_is_given_up_without_panicking() {
        let gone = AtomicBool::new(false);
        write_line(Closed, &gone, "step 1/10");
        assert!(gone.load(Ordering::Relaxed));
        write_line(Closed, &gone, "step 2/10"); // not even tried again
        let mut buf = Vec::new();
        let fine = AtomicBool::new(false);
        write_line(&mut buf, &fine, "ok");
        assert_eq!(buf, b"ok\n");
        assert!(!fine.load(Ordering::Relaxed));
    }
}
