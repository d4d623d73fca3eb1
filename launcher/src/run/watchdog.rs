//! The hang watchdog (node 0): decides from the ranks' heartbeats that a job has stopped
//! making progress, and says where every rank is and which ones the others wait on.
//!
//! Every rank sends a [`RankProgress`] about every [`Watchdog::heartbeat_interval`]: optimizer
//! steps done, the micro-step, how many collectives it has entered and whether it is blocked
//! inside one, and its phase. A rank *progresses* when its report changes (a micro-step,
//! a collective entered or left, a step), and also while it is alive outside a collective
//! in phases where the host itself does the work: start-up (initialising, loading a
//! checkpoint), a checkpoint save (file I/O), and anything on CPU ranks (their compute runs
//! on the host thread). A GPU rank outside a collective may be blocked on a device that
//! waits for a collective, so there only a changed report counts.
//!
//! The job is hung when no unfinished rank has progressed for `watchdog.timeout_s`: since
//! every step couples all ranks through collectives, one stuck rank stops the others within
//! a step. Behind are the ranks that entered fewer collectives than the furthest one, and
//! those gone silent (no heartbeat: stopped, frozen, or their host is unreachable).

use crate::run::protocol::RankProgress;
use std::time::{Duration, Instant};

/// What the watchdog knows about one rank.
#[derive(Debug, Clone)]
struct Seen {
    last: Option<RankProgress>,
    /// Last heartbeat (or the start, before the first).
    heard: Instant,
    /// Last progress (or the start).
    progressed: Instant,
    /// Since when the rank has been inside its current collective.
    inside_since: Option<Instant>,
    /// The last step it reported finished (`Step` messages).
    steps_reported: u64,
    done: bool,
}

/// The watchdog of one job.
#[derive(Debug)]
pub struct Watchdog {
    timeout: Duration,
    /// CPU ranks: a live rank outside a collective is computing, which is progress.
    host_compute: bool,
    total_steps: u64,
    ranks: Vec<Seen>,
}

impl Watchdog {
    /// A watchdog over `world` ranks, started (every rank counted as progressing) at `now`.
    pub fn new(world: usize, timeout: Duration, host_compute: bool, total_steps: u64, now: Instant) -> Watchdog {
        let seen = Seen { last: None, heard: now, progressed: now, inside_since: None, steps_reported: 0, done: false };
        Watchdog { timeout, host_compute, total_steps, ranks: vec![seen; world] }
    }

    /// How often ranks should report for this timeout: four reports per timeout, between
    /// 50 ms and 1 s.
    pub fn heartbeat_interval(timeout: Duration) -> Duration {
        (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1))
    }

    /// No heartbeat for this long: the rank is silent.
    fn silence(&self) -> Duration {
        Watchdog::heartbeat_interval(self.timeout) * 3 + Duration::from_millis(500)
    }

    /// A heartbeat from `rank`.
    pub fn heartbeat(&mut self, rank: usize, p: RankProgress, now: Instant) {
        let host_compute = self.host_compute;
        let Some(s) = self.ranks.get_mut(rank) else { return };
        s.heard = now;
        let changed = s.last.as_ref().is_none_or(|l| l.events != p.events);
        let live_work = !p.inside && (host_compute || p.phase == "start-up" || p.phase == "checkpoint save");
        if changed || live_work {
            s.progressed = now;
        }
        let same_collective = s.last.as_ref().is_some_and(|l| l.inside && l.collectives == p.collectives);
        s.inside_since = match (p.inside, same_collective) {
            (false, _) => None,
            (true, true) => s.inside_since.or(Some(now)),
            (true, false) => Some(now),
        };
        s.last = Some(p);
    }

    /// `rank` reported finished step `step` (progress, whatever its heartbeats say).
    pub fn step(&mut self, rank: usize, step: u64, now: Instant) {
        if let Some(s) = self.ranks.get_mut(rank) {
            s.progressed = now;
            s.heard = now;
            s.steps_reported = s.steps_reported.max(step);
        }
    }

    /// `rank` finished training: it no longer has to progress.
    pub fn done(&mut self, rank: usize) {
        if let Some(s) = self.ranks.get_mut(rank) {
            s.done = true;
        }
    }

    /// `Some(report)` when no unfinished rank has progressed for the timeout.
    pub fn check(&self, now: Instant) -> Option<String> {
        let newest = self.ranks.iter().filter(|s| !s.done).map(|s| s.progressed).max()?;
        let idle = now.saturating_duration_since(newest);
        (idle >= self.timeout).then(|| self.report(now, idle))
    }

    /// Ranks the others wait on: the silent ones if any (stopped, frozen or unreachable: the
    /// ranks still heard from wait for them, some a collective further than others because
    /// a silent rank may have sent its part of a collective to one neighbour and not the
    /// other); else those that entered fewer collectives than the furthest rank, or never
    /// reported.
    pub fn behind(&self, now: Instant) -> Vec<usize> {
        let live = |r: &usize| !self.ranks[*r].done;
        let silent: Vec<usize> = (0..self.ranks.len())
            .filter(live)
            .filter(|&r| now.saturating_duration_since(self.ranks[r].heard) > self.silence())
            .collect();
        if !silent.is_empty() {
            return silent;
        }
        let furthest = self.ranks.iter().filter_map(|s| s.last.as_ref()).map(|p| p.collectives).max().unwrap_or(0);
        (0..self.ranks.len())
            .filter(live)
            .filter(|&r| self.ranks[r].last.as_ref().is_none_or(|p| p.collectives < furthest))
            .collect()
    }

    fn report(&self, now: Instant, idle: Duration) -> String {
        let secs = |d: Duration| format!("{:.1} s", d.as_secs_f64());
        let mut s = format!(
            "the job is hung: no rank made progress for {} (watchdog.timeout_s = {}); stopping every rank\n\
             where each rank is:",
            secs(idle),
            self.timeout.as_secs_f64()
        );
        for (r, seen) in self.ranks.iter().enumerate() {
            s += &format!("\n  rank {r}: {}", self.describe(seen, now));
        }
        let behind = self.behind(now);
        let furthest = self.ranks.iter().filter_map(|x| x.last.as_ref()).max_by_key(|p| p.collectives);
        let waiting_in = furthest
            .map(|p| format!("collective #{} ({})", p.collectives, p.last_op.as_deref().unwrap_or("none")))
            .unwrap_or_else(|| "start-up".to_string());
        if behind.is_empty() {
            s += &format!(
                "\nno rank is behind: every rank reached {waiting_in} and none returned; the hang is inside it \
                 (the network, NCCL or a GPU)"
            );
        } else {
            let names: Vec<String> = behind.iter().map(|r| r.to_string()).collect();
            let silent =
                behind.iter().filter(|&&r| now.saturating_duration_since(self.ranks[r].heard) > self.silence()).count();
            s += &format!(
                "\nranks behind: {} (the others wait for {} in {waiting_in}){}",
                names.join(", "),
                if behind.len() == 1 { "it" } else { "them" },
                if silent > 0 {
                    "; silent ranks sent no heartbeat: stopped, frozen, or their host is unreachable"
                } else {
                    ""
                }
            );
        }
        s += "\nto look at a hang instead of stopping it, raise watchdog.timeout_s (0 turns the watchdog off)";
        s
    }

    fn describe(&self, seen: &Seen, now: Instant) -> String {
        let secs = |d: Duration| format!("{:.1} s", d.as_secs_f64());
        if seen.done {
            return "finished".to_string();
        }
        let quiet = now.saturating_duration_since(seen.heard);
        let Some(p) = &seen.last else {
            let done = seen.steps_reported;
            return format!(
                "step {} of {} ({done} done), no heartbeat since the job started; silent for {}",
                (done + 1).min(self.total_steps),
                self.total_steps,
                secs(quiet)
            );
        };
        let done = p.steps_done.max(seen.steps_reported);
        let step = (done + 1).min(self.total_steps);
        let mut d = format!("step {step} of {} ({done} done), micro-step {}, {}, ", self.total_steps, p.micro, p.phase);
        let op = p.last_op.as_deref().unwrap_or("none");
        match (p.inside, seen.inside_since) {
            (true, Some(t)) => {
                d += &format!(
                    "inside collective #{} ({op}) for {}",
                    p.collectives,
                    secs(now.saturating_duration_since(t))
                )
            }
            (true, None) => d += &format!("inside collective #{} ({op})", p.collectives),
            (false, _) if p.collectives == 0 => d += "no collective yet",
            (false, _) => d += &format!("after collective #{} ({op})", p.collectives),
        }
        if quiet > self.silence() {
            d += &format!("; silent for {} (no heartbeat; where it was when last heard from)", secs(quiet));
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(steps_done: u64, collectives: u64, inside: bool, events: u64) -> RankProgress {
        RankProgress {
            events,
            steps_done,
            micro: 0,
            collectives,
            last_op: Some("all_reduce".into()),
            inside,
            phase: "training".into(),
            last: None,
        }
    }

    #[test]
    fn a_stopped_rank_is_named_after_the_timeout() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut w = Watchdog::new(3, Duration::from_secs(2), false, 100, t0);
        for r in 0..3 {
            w.heartbeat(r, at(4, 50, false, 10), ms(100));
        }
        // Ranks 0 and 2 enter collective #51 and wait; rank 1 stops (no more heartbeats).
        for k in 0..30 {
            for r in [0, 2] {
                w.heartbeat(r, at(4, 51, true, 11), ms(200 + 100 * k));
            }
        }
        assert!(w.check(ms(2100)).is_none(), "not before the timeout");
        let report = w.check(ms(3000)).expect("hung");
        assert!(report.contains("ranks behind: 1 "), "{report}");
        assert!(
            report.contains("rank 1: step 5 of 100 (4 done)") && report.contains("after collective #50"),
            "{report}"
        );
        assert!(
            report.contains("rank 0: step 5 of 100") && report.contains("inside collective #51 (all_reduce)"),
            "{report}"
        );
        assert!(report.contains("silent for"), "{report}");
        assert_eq!(w.behind(ms(3000)), vec![1]);

        // A rank stopped inside a ring collective may have sent its part to one neighbour
        // and not the other: rank 2 got through #51 and waits in #52, rank 0 still in #51.
        // The silent rank is the one behind, not rank 0.
        let mut w = Watchdog::new(3, Duration::from_secs(2), false, 100, t0);
        for r in 0..3 {
            w.heartbeat(r, at(4, 50, false, 10), ms(100));
        }
        for k in 0..30 {
            w.heartbeat(0, at(4, 51, true, 11), ms(200 + 100 * k));
            w.heartbeat(2, at(4, 52, true, 12), ms(200 + 100 * k));
        }
        assert_eq!(w.behind(ms(3000)), vec![1]);
        assert!(w.check(ms(3000)).expect("hung").contains("ranks behind: 1 "));
    }

    #[test]
    fn progress_liveness_and_finished_ranks() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        let timeout = Duration::from_secs(5);
        // GPU ranks blocked outside a collective (on the device) are not progressing...
        let mut gpu = Watchdog::new(1, timeout, false, 10, t0);
        for k in 1..=6 {
            gpu.heartbeat(0, at(1, 7, false, 3), s(k));
        }
        assert!(gpu.check(s(6)).is_some());
        // ...unless they save a checkpoint or start up; CPU ranks outside a collective compute.
        let mut saving = Watchdog::new(1, timeout, false, 10, t0);
        let mut cpu = Watchdog::new(1, timeout, true, 10, t0);
        for k in 1..=6 {
            saving.heartbeat(0, RankProgress { phase: "checkpoint save".into(), ..at(1, 7, false, 3) }, s(k));
            cpu.heartbeat(0, at(1, 7, false, 3), s(k));
        }
        assert!(saving.check(s(6)).is_none() && cpu.check(s(6)).is_none());
        // Changing reports are progress; a finished rank no longer counts.
        let mut w = Watchdog::new(2, timeout, false, 10, t0);
        for k in 1..=20 {
            w.heartbeat(0, at(k, k * 3, false, k), s(k));
        }
        w.done(1);
        assert!(w.check(s(20)).is_none());
        w.done(0);
        assert!(w.check(s(100)).is_none(), "nothing left to wait for");
        assert_eq!(Watchdog::heartbeat_interval(Duration::from_secs(120)), Duration::from_secs(1));
        assert_eq!(Watchdog::heartbeat_interval(Duration::from_millis(100)), Duration::from_millis(50));
    }

    #[test]
    fn when_nobody_is_behind_the_hang_is_inside_the_collective() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(2, Duration::from_secs(1), false, 10, t0);
        for k in 0..30 {
            for r in 0..2 {
                w.heartbeat(r, at(2, 9, true, 4), t0 + Duration::from_millis(100 * k));
            }
        }
        let report = w.check(t0 + Duration::from_millis(2900)).expect("hung");
        assert!(report.contains("no rank is behind") && report.contains("collective #9"), "{report}");
    }
}
