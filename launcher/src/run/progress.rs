//! Training progress on the launcher's stdout: an indicatif bar on a terminal; otherwise
//! (CI logs, pipes) one plain line at the first step, every ~10% of the steps, and the last.
//! A resumed run starts at the checkpoint's step (the bar shows the steps done before it).
//! Lines go through [`crate::out`]: a closed stdout (`launcher ... | head`) never stops a job.

use crate::run::metrics::StepRecord;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

pub struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    /// Plain mode: print a line when the step is a multiple of this.
    every: u64,
    /// When the first step was reported (ETA is measured from there).
    first_at: Option<(u64, Instant)>,
}

impl Progress {
    /// Progress over `total` steps of which `done` were done before this run (resume);
    /// `show` false (nodes other than 0, which see no steps) prints messages only.
    pub fn new(total: u64, done: u64, show: bool) -> Progress {
        let bar = (show && std::io::stdout().is_terminal()).then(|| {
            let style = ProgressStyle::with_template("{bar:30.cyan/blue} {pos}/{len} | {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stdout()).with_style(style);
            bar.set_position(done);
            bar.set_message("waiting for the first step");
            bar.enable_steady_tick(Duration::from_millis(250));
            bar
        });
        Progress { bar, total, every: total.div_ceil(10).max(1), first_at: None }
    }

    /// Show a finished step.
    pub fn step(&mut self, rec: &StepRecord) {
        let now = Instant::now();
        let first = self.first_at.is_none();
        let (s0, t0) = *self.first_at.get_or_insert((rec.step, now));
        let remaining = self.total.saturating_sub(rec.step);
        let eta = if rec.step > s0 {
            format_eta(now.duration_since(t0).as_secs_f64() / (rec.step - s0) as f64 * remaining as f64)
        } else {
            "?".to_string()
        };
        let val = rec.val_loss.map(|v| format!(" | val {v:.4}")).unwrap_or_default();
        let msg = format!("loss {:.4}{val} | {:.0} tok/s | ETA {eta}", rec.loss, rec.tokens_per_s);
        match &self.bar {
            Some(bar) => {
                bar.set_position(rec.step);
                bar.set_message(msg);
            }
            None => {
                if first || rec.step.is_multiple_of(self.every) || rec.step == self.total {
                    crate::out::say(&format!(
                        "step {:>width$}/{} | {msg}",
                        rec.step,
                        self.total,
                        width = digits(self.total)
                    ));
                }
            }
        }
    }

    /// Print a line without tearing the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => crate::out::say(line),
        }
    }

    /// Remove the bar (before the summary or an error report).
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn digits(n: u64) -> usize {
    n.to_string().len()
}

fn format_eta(secs: f64) -> String {
    let s = secs.round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn eta_is_readable() {
        assert_eq!(super::format_eta(5.2), "5s");
        assert_eq!(super::format_eta(125.0), "2m05s");
        assert_eq!(super::format_eta(7260.0), "2h01m");
    }
}
