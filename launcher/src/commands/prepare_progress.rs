//! `prepare-data`'s progress: a thread polls `data::PrepareProgress`'s counters five times a
//! second. On a terminal, an indicatif bar over the input bytes read from disk, with the
//! text throughput (MB/s of document text tokenised), documents, tokens, records skipped
//! and an ETA; otherwise (CI logs, pipes) one plain line at every tenth of the input and
//! none of the bar's control codes. Lines go through [`crate::out`]: a closed stdout never
//! stops the run.

use data::PrepareProgress;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What the display says, from the counters (a pure function: tested below).
pub fn message(docs: u64, tokens: u64, text_bytes: u64, bad: u64, secs: f64) -> String {
    let rate = text_bytes as f64 / 1e6 / secs.max(1e-3);
    let skipped = if bad > 0 { format!(", {bad} skipped") } else { String::new() };
    format!("{docs} docs, {tokens} tokens, {rate:.2} MB/s of text{skipped}")
}

/// Run `work` with fresh counters while a thread shows them; the display is gone when this returns.
pub fn while_running<T>(work: impl FnOnce(&PrepareProgress) -> T) -> T {
    let progress = PrepareProgress::default();
    let stop = AtomicBool::new(false);
    let terminal = std::io::stdout().is_terminal();
    std::thread::scope(|s| {
        let shown = s.spawn(|| show(&progress, &stop, terminal));
        let out = work(&progress);
        stop.store(true, Ordering::Relaxed);
        // A display that panicked must not turn a finished run into a failure.
        let _ = shown.join();
        out
    })
}

fn show(progress: &PrepareProgress, stop: &AtomicBool, terminal: bool) {
    let t0 = Instant::now();
    let bar = terminal.then(|| {
        let style = ProgressStyle::with_template(
            "{bar:30.cyan/blue} {binary_bytes}/{binary_total_bytes} read | {msg} | ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stdout()).with_style(style)
    });
    let mut next_tenth = 1u64;
    loop {
        let done = stop.load(Ordering::Relaxed);
        let total = progress.total_disk_bytes.load(Ordering::Relaxed);
        let read = progress.disk_bytes.load(Ordering::Relaxed).min(total);
        let msg = message(
            progress.documents.load(Ordering::Relaxed),
            progress.tokens.load(Ordering::Relaxed),
            progress.text_bytes.load(Ordering::Relaxed),
            progress.bad.load(Ordering::Relaxed),
            t0.elapsed().as_secs_f64(),
        );
        match &bar {
            Some(bar) => {
                bar.set_length(total);
                bar.set_position(read);
                bar.set_message(msg);
            }
            None if total > 0 && !done => {
                // Plain mode: a line each time another tenth of the input has been read.
                let tenths = read * 10 / total;
                if tenths >= next_tenth && tenths < 10 {
                    crate::out::say(&format!("prepare-data: {}% of the input read | {msg}", tenths * 10));
                    next_tenth = tenths + 1;
                }
            }
            None => {}
        }
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_message_gives_text_throughput_and_skips() {
        assert_eq!(super::message(10, 500, 2_000_000, 0, 2.0), "10 docs, 500 tokens, 1.00 MB/s of text");
        assert!(super::message(1, 1, 1, 3, 1.0).ends_with(", 3 skipped"));
    }
}
