//! Where one rank is, for the launcher's hang watchdog: optimizer steps done, the micro-step
//! in progress, how many collectives it has entered and whether it is blocked inside one
//! now, and what phase it is in (start-up, training, evaluation, checkpoint save).
//!
//! It exists because a hung collective looks the same as a slow one from inside a rank; only
//! by comparing every rank's position can the launcher tell which ranks the others are
//! waiting on. [`Progress`] is a handful of atomics, cheap enough to bump on every collective;
//! [`Tracked`] wraps any communicator and records each collective it runs; the training loop
//! reports micro-steps and phases through [`note_micro_step`] / [`note_phase`], which act on
//! the [`Progress`] [`install`]ed for the calling thread (a no-op when none is, e.g. in tests).
//! A rank's heartbeat thread reads [`Progress::snapshot`] and sends it to the launcher.
//!
//! Every update also bumps [`Snapshot::events`], so "has this rank made progress since the
//! last heartbeat" is one comparison.

use crate::{AllGatherInPlace, CommError, Communicator, Group, Pending, ReduceOp};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// A collective (or the communicator's set-up), as named in watchdog reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
    Broadcast,
    Barrier,
    /// Waiting for a started collective (`Group::wait`).
    Wait,
    /// Creating the communicator (every rank must join).
    Connect,
}

impl Op {
    const ALL: [Op; 7] =
        [Op::AllGather, Op::ReduceScatter, Op::AllReduce, Op::Broadcast, Op::Barrier, Op::Wait, Op::Connect];

    pub fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllReduce => "all_reduce",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::Wait => "wait",
            Op::Connect => "connect",
        }
    }

    /// The op of a [`Op::name`], if it is one.
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.name() == name)
    }

    fn code(self) -> u8 {
        Op::ALL.iter().position(|&o| o == self).map_or(0, |i| i as u8 + 1)
    }

    fn from_code(c: u8) -> Option<Op> {
        (c as usize).checked_sub(1).and_then(|i| Op::ALL.get(i).copied())
    }
}

/// What a rank is doing, coarsely.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Connecting, initialising or loading weights, resuming from a checkpoint.
    Startup,
    /// Forward, backward and optimizer steps.
    Training,
    /// Validation loss.
    Evaluating,
    /// Writing a checkpoint (file I/O between collectives).
    Checkpoint,
    /// Training finished.
    Done,
}

impl Phase {
    const ALL: [Phase; 5] = [Phase::Startup, Phase::Training, Phase::Evaluating, Phase::Checkpoint, Phase::Done];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Startup => "start-up",
            Phase::Training => "training",
            Phase::Evaluating => "evaluation",
            Phase::Checkpoint => "checkpoint save",
            Phase::Done => "done",
        }
    }

    /// The phase of a [`Phase::name`], if it is one.
    pub fn from_name(name: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == name)
    }

    fn code(self) -> u8 {
        Phase::ALL.iter().position(|&p| p == self).map_or(0, |i| i as u8)
    }

    fn from_code(c: u8) -> Phase {
        Phase::ALL.get(c as usize).copied().unwrap_or(Phase::Startup)
    }
}

/// One rank's position, updated by the training thread and read by its heartbeat thread.
#[derive(Debug, Default)]
pub struct Progress {
    events: AtomicU64,
    steps_done: AtomicU64,
    micro: AtomicU32,
    collectives: AtomicU64,
    last_op: AtomicU8,
    inside: AtomicU8,
    phase: AtomicU8,
}

/// A copy of a [`Progress`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// Bumped by every update: equal in two snapshots means nothing happened in between.
    pub events: u64,
    /// Optimizer steps completed.
    pub steps_done: u64,
    /// The micro-step (0-based) of step `steps_done + 1` in progress, or last begun.
    pub micro: u32,
    /// Collectives entered so far (every rank runs the same sequence, so this orders ranks).
    pub collectives: u64,
    /// The last collective entered.
    pub last_op: Option<Op>,
    /// True while the rank is blocked inside `last_op` (waiting for its peers).
    pub inside: bool,
    pub phase: Phase,
}

impl Progress {
    pub fn new() -> Progress {
        Progress::default()
    }

    fn bump(&self) {
        self.events.fetch_add(1, Ordering::Relaxed);
    }

    /// Optimizer step `step` (1-based) finished.
    pub fn step_done(&self, step: u64) {
        self.steps_done.store(step, Ordering::Relaxed);
        self.micro.store(0, Ordering::Relaxed);
        self.bump();
    }

    /// Micro-step `micro` (0-based) of the step in progress begins.
    pub fn micro_step(&self, micro: u32) {
        self.micro.store(micro, Ordering::Relaxed);
        self.bump();
    }

    pub fn phase(&self, phase: Phase) {
        self.phase.store(phase.code(), Ordering::Relaxed);
        self.bump();
    }

    /// Something happened that is neither a step nor a collective (e.g. a file written).
    pub fn tick(&self) {
        self.bump();
    }

    /// The rank enters `op` and may block in it until the returned guard is dropped.
    /// [`Op::Wait`] and [`Op::Connect`] are not counted as collectives.
    pub fn enter(&self, op: Op) -> Inside<'_> {
        if !matches!(op, Op::Wait | Op::Connect) {
            self.collectives.fetch_add(1, Ordering::Relaxed);
        }
        self.last_op.store(op.code(), Ordering::Relaxed);
        self.inside.store(op.code(), Ordering::Relaxed);
        self.bump();
        Inside(self)
    }

    pub fn snapshot(&self) -> Snapshot {
        let last = self.last_op.load(Ordering::Relaxed);
        Snapshot {
            events: self.events.load(Ordering::Relaxed),
            steps_done: self.steps_done.load(Ordering::Relaxed),
            micro: self.micro.load(Ordering::Relaxed),
            collectives: self.collectives.load(Ordering::Relaxed),
            last_op: Op::from_code(last),
            inside: self.inside.load(Ordering::Relaxed) != 0,
            phase: Phase::from_code(self.phase.load(Ordering::Relaxed)),
        }
    }
}

/// Marks a rank as inside a collective until dropped.
#[must_use = "the rank counts as inside the collective only while this guard lives"]
pub struct Inside<'a>(&'a Progress);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.inside.store(0, Ordering::Relaxed);
        self.0.bump();
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<Progress>>> = const { RefCell::new(None) };
}

/// Make `p` the progress that [`note_micro_step`] and [`note_phase`] update on this thread.
pub fn install(p: Arc<Progress>) {
    CURRENT.with(|c| *c.borrow_mut() = Some(p));
}

fn with_current(f: impl FnOnce(&Progress)) {
    CURRENT.with(|c| {
        if let Some(p) = c.borrow().as_ref() {
            f(p)
        }
    });
}

/// The training loop begins micro-step `micro` (0-based) of its current step.
pub fn note_micro_step(micro: usize) {
    with_current(|p| p.micro_step(u32::try_from(micro).unwrap_or(u32::MAX)));
}

/// The training loop finished optimizer step `step` (1-based).
pub fn note_step_done(step: u64) {
    with_current(|p| p.step_done(step));
}

/// The training loop moves to `phase`.
pub fn note_phase(phase: Phase) {
    with_current(|p| p.phase(phase));
}

/// A communicator that records every collective it runs in a [`Progress`]; otherwise it
/// is the communicator it wraps (started collectives stay started).
pub struct Tracked<C> {
    inner: C,
    progress: Arc<Progress>,
}

impl<C> Tracked<C> {
    pub fn new(inner: C, progress: Arc<Progress>) -> Tracked<C> {
        Tracked { inner, progress }
    }

    pub fn inner(&self) -> &C {
        &self.inner
    }

    pub fn into_inner(self) -> C {
        self.inner
    }
}

impl<C: Group> Group for Tracked<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        let _in = self.progress.enter(Op::Barrier);
        self.inner.barrier()
    }
    fn wait(&mut self, p: Pending) -> Result<(), CommError> {
        if p == Pending::DONE {
            return self.inner.wait(p);
        }
        let _in = self.progress.enter(Op::Wait);
        self.inner.wait(p)
    }
}

impl<B: ?Sized, C: AllGatherInPlace<B>> AllGatherInPlace<B> for Tracked<C> {
    fn all_gather_in_place_start(&mut self, buf: &mut B) -> Result<Pending, CommError> {
        let _in = self.progress.enter(Op::AllGather);
        self.inner.all_gather_in_place_start(buf)
    }
}

impl<B: ?Sized, C: Communicator<B>> Communicator<B> for Tracked<C> {
    fn all_gather(&mut self, send: &B, recv: &mut B) -> Result<(), CommError> {
        let _in = self.progress.enter(Op::AllGather);
        self.inner.all_gather(send, recv)
    }
    fn reduce_scatter(&mut self, send: &B, recv: &mut B, op: ReduceOp) -> Result<(), CommError> {
        let _in = self.progress.enter(Op::ReduceScatter);
        self.inner.reduce_scatter(send, recv, op)
    }
    fn all_reduce(&mut self, buf: &mut B, op: ReduceOp) -> Result<(), CommError> {
        let _in = self.progress.enter(Op::AllReduce);
        self.inner.all_reduce(buf, op)
    }
    fn broadcast(&mut self, buf: &mut B, root: usize) -> Result<(), CommError> {
        let _in = self.progress.enter(Op::Broadcast);
        self.inner.broadcast(buf, root)
    }
    fn all_gather_start(&mut self, send: &B, recv: &mut B) -> Result<Pending, CommError> {
        let _in = self.progress.enter(Op::AllGather);
        self.inner.all_gather_start(send, recv)
    }
    fn reduce_scatter_start(&mut self, send: &B, recv: &mut B, op: ReduceOp) -> Result<Pending, CommError> {
        let _in = self.progress.enter(Op::ReduceScatter);
        self.inner.reduce_scatter_start(send, recv, op)
    }
    fn all_reduce_start(&mut self, buf: &mut B, op: ReduceOp) -> Result<Pending, CommError> {
        let _in = self.progress.enter(Op::AllReduce);
        self.inner.all_reduce_start(buf, op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::TcpComm;

    #[test]
    fn snapshots_follow_steps_collectives_and_phases() {
        let p = Progress::new();
        let s0 = p.snapshot();
        assert_eq!(
            (s0.steps_done, s0.collectives, s0.last_op, s0.inside, s0.phase),
            (0, 0, None, false, Phase::Startup)
        );
        p.phase(Phase::Training);
        p.micro_step(2);
        {
            let _in = p.enter(Op::ReduceScatter);
            let s = p.snapshot();
            assert!(s.inside && s.last_op == Some(Op::ReduceScatter) && s.collectives == 1 && s.micro == 2, "{s:?}");
        }
        let _ = p.enter(Op::Wait);
        let s = p.snapshot();
        assert!(!s.inside && s.collectives == 1 && s.last_op == Some(Op::Wait), "waits are not collectives: {s:?}");
        p.step_done(1);
        let s1 = p.snapshot();
        assert_eq!((s1.steps_done, s1.micro, s1.phase), (1, 0, Phase::Training));
        assert!(s1.events > s0.events);
        for op in Op::ALL {
            assert_eq!(Op::from_code(op.code()), Some(op));
            assert_eq!(Op::from_name(op.name()), Some(op));
        }
        for ph in Phase::ALL {
            assert_eq!(Phase::from_code(ph.code()), ph);
            assert_eq!(Phase::from_name(ph.name()), Some(ph));
        }
    }

    #[test]
    fn thread_notes_reach_only_the_installed_progress() {
        note_micro_step(5); // nothing installed: a no-op
        let p = Arc::new(Progress::new());
        install(p.clone());
        note_phase(Phase::Checkpoint);
        note_micro_step(3);
        note_step_done(7);
        let s = p.snapshot();
        assert_eq!((s.phase, s.steps_done, s.micro), (Phase::Checkpoint, 7, 0));
        let other = std::thread::spawn(move || {
            note_step_done(99);
        });
        other.join().expect("thread");
        assert_eq!(p.snapshot().steps_done, 7, "another thread's notes do not land here");
    }

    #[test]
    fn a_tracked_group_counts_the_same_collectives_on_every_rank() {
        let comms = TcpComm::local_group(2).expect("group");
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let p = Arc::new(Progress::new());
                    let mut t = Tracked::new(c, p.clone());
                    let mut buf = vec![1.0f32; 4];
                    t.all_reduce(&mut buf, ReduceOp::Sum).expect("all_reduce");
                    let mut out = [0.0f32; 8];
                    t.all_gather(&buf[..], &mut out[..]).expect("all_gather");
                    let pending = t.all_gather_start(&buf[..], &mut out[..]).expect("start");
                    t.wait(pending).expect("wait");
                    t.barrier().expect("barrier");
                    (buf, p.snapshot())
                })
            })
            .collect();
        for h in handles {
            let (buf, s) = h.join().expect("rank");
            assert_eq!(buf, vec![2.0; 4]);
            assert_eq!((s.collectives, s.last_op, s.inside), (4, Some(Op::Barrier), false), "{s:?}");
        }
    }
}
