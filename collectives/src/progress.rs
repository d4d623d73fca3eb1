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
//!
//! The same [`Progress`] holds the rank's [flight recorder](crate::flight): `Tracked` records
//! each collective's kind, bytes and element type there, with the unit the engine is working
//! on ([`unit_scope`]), the step, micro-step and phase.

use crate::flight::{now_us, FlightRecorder, Payload, Record, State};
use crate::{AllGatherInPlace, CommError, Communicator, Group, Pending, ReduceOp};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// Collectives a rank's flight recorder keeps unless told otherwise (`watchdog.flight_records`).
pub const DEFAULT_FLIGHT_RECORDS: usize = 64;
/// `Progress::unit` when the engine named no unit.
const NO_UNIT: u32 = u32::MAX;

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
#[derive(Debug)]
pub struct Progress {
    events: AtomicU64,
    steps_done: AtomicU64,
    micro: AtomicU32,
    collectives: AtomicU64,
    last_op: AtomicU8,
    inside: AtomicU8,
    phase: AtomicU8,
    /// The unit the engine is gathering or reducing now ([`NO_UNIT`]: none).
    unit: AtomicU32,
    flight: FlightRecorder,
}

impl Default for Progress {
    fn default() -> Self {
        Progress::with_flight_records(DEFAULT_FLIGHT_RECORDS)
    }
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

    /// A progress whose flight recorder keeps the last `n` collectives (0: none).
    pub fn with_flight_records(n: usize) -> Progress {
        Progress {
            events: AtomicU64::new(0),
            steps_done: AtomicU64::new(0),
            micro: AtomicU32::new(0),
            collectives: AtomicU64::new(0),
            last_op: AtomicU8::new(0),
            inside: AtomicU8::new(0),
            phase: AtomicU8::new(0),
            unit: AtomicU32::new(NO_UNIT),
            flight: FlightRecorder::new(n),
        }
    }

    /// This rank's flight recorder.
    pub fn flight(&self) -> &FlightRecorder {
        &self.flight
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
    /// [`Op::Wait`] and [`Op::Connect`] are not counted as collectives; the others are, and
    /// recorded in the flight recorder without a size (see [`Progress::enter_collective`]).
    pub fn enter(&self, op: Op) -> Inside<'_> {
        if matches!(op, Op::Wait | Op::Connect) {
            self.last_op.store(op.code(), Ordering::Relaxed);
            self.inside.store(op.code(), Ordering::Relaxed);
            self.bump();
            return Inside { progress: self, seq: None };
        }
        self.enter_collective(op, 0, "-")
    }

    /// The rank enters collective `op` on `bytes` bytes of `dtype`: counted, and recorded in
    /// the flight recorder until the guard says how it returned ([`Inside::returned`]).
    pub fn enter_collective(&self, op: Op, bytes: u64, dtype: &'static str) -> Inside<'_> {
        let seq = self.collectives.fetch_add(1, Ordering::Relaxed) + 1;
        self.last_op.store(op.code(), Ordering::Relaxed);
        self.inside.store(op.code(), Ordering::Relaxed);
        self.bump();
        let unit = self.unit.load(Ordering::Relaxed);
        self.flight.begin(Record {
            seq,
            op,
            bytes,
            dtype,
            unit: (unit != NO_UNIT).then_some(unit),
            steps_done: self.steps_done.load(Ordering::Relaxed),
            micro: self.micro.load(Ordering::Relaxed),
            phase: Phase::from_code(self.phase.load(Ordering::Relaxed)),
            start_us: now_us(),
            end_us: None,
            state: State::Running,
        });
        Inside { progress: self, seq: Some(seq) }
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
pub struct Inside<'a> {
    progress: &'a Progress,
    /// The flight record of a collective, until its end is recorded.
    seq: Option<u64>,
}

impl Inside<'_> {
    /// The call returned `result`; on success the collective is `ok` ([`State::Done`], or
    /// [`State::Queued`] for a started one).
    pub fn returned<T>(mut self, result: Result<T, CommError>, ok: State) -> Result<T, CommError> {
        if let Some(seq) = self.seq.take() {
            self.progress.flight.end(seq, if result.is_ok() { ok } else { State::Failed });
        }
        result
    }

    /// A `*_start` call returned `result`: queued while the collective runs on, done when
    /// the communicator completed it before returning ([`Pending::DONE`], as TCP does).
    pub fn started(self, result: Result<Pending, CommError>) -> Result<Pending, CommError> {
        let ok = if matches!(result, Ok(Pending::DONE)) { State::Done } else { State::Queued };
        self.returned(result, ok)
    }
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        if let Some(seq) = self.seq.take() {
            // Left without `returned` (a panic, or a guard dropped early): not known to be done.
            self.progress.flight.end(seq, State::Failed);
        }
        self.progress.inside.store(0, Ordering::Relaxed);
        self.progress.bump();
    }
}

/// The engine works on unit `unit` until the guard is dropped: collectives recorded
/// meanwhile carry it (on the [`Progress`] [`install`]ed for this thread; a no-op without one).
pub fn unit_scope(unit: usize) -> UnitScope {
    let unit = u32::try_from(unit).unwrap_or(NO_UNIT - 1);
    let mut before = NO_UNIT;
    with_current(|p| before = p.unit.swap(unit, Ordering::Relaxed));
    UnitScope { before }
}

/// Restores the unit noted before [`unit_scope`] when dropped.
#[must_use = "the unit is noted only while this guard lives"]
pub struct UnitScope {
    before: u32,
}

impl Drop for UnitScope {
    fn drop(&mut self) {
        let before = self.before;
        with_current(|p| p.unit.store(before, Ordering::Relaxed));
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
        let g = self.progress.enter_collective(Op::Barrier, 0, "-");
        g.returned(self.inner.barrier(), State::Done)
    }
    fn wait(&mut self, p: Pending) -> Result<(), CommError> {
        if p == Pending::DONE {
            return self.inner.wait(p);
        }
        let _in = self.progress.enter(Op::Wait);
        self.inner.wait(p)
    }
}

impl<B: ?Sized + Payload, C: AllGatherInPlace<B>> AllGatherInPlace<B> for Tracked<C> {
    fn all_gather_in_place_start(&mut self, buf: &mut B) -> Result<Pending, CommError> {
        let g = self.progress.enter_collective(Op::AllGather, buf.payload_bytes(), buf.dtype_name());
        g.started(self.inner.all_gather_in_place_start(buf))
    }
}

impl<B: ?Sized + Payload, C: Communicator<B>> Communicator<B> for Tracked<C> {
    fn all_gather(&mut self, send: &B, recv: &mut B) -> Result<(), CommError> {
        let g = self.progress.enter_collective(Op::AllGather, send.payload_bytes(), send.dtype_name());
        g.returned(self.inner.all_gather(send, recv), State::Done)
    }
    fn reduce_scatter(&mut self, send: &B, recv: &mut B, op: ReduceOp) -> Result<(), CommError> {
        let g = self.progress.enter_collective(Op::ReduceScatter, send.payload_bytes(), send.dtype_name());
        g.returned(self.inner.reduce_scatter(send, recv, op), State::Done)
    }
    fn all_reduce(&mut self, buf: &mut B, op: ReduceOp) -> Result<(), CommError> {
        let g = self.progress.enter_collective(Op::AllReduce, buf.payload_bytes(), buf.dtype_name());
        g.returned(self.inner.all_reduce(buf, op), State::Done)
    }
    fn broadcast(&mut self, buf: &mut B, root: usize) -> Result<(), CommError> {
        let g = self.progress.enter_collective(Op::Broadcast, buf.payload_bytes(), buf.dtype_name());
        g.returned(self.inner.broadcast(buf, root), State::Done)
    }
    fn all_gather_start(&mut self, send: &B, recv: &mut B) -> Result<Pending, CommError> {
        let g = self.progress.enter_collective(Op::AllGather, send.payload_bytes(), send.dtype_name());
        g.started(self.inner.all_gather_start(send, recv))
    }
    fn reduce_scatter_start(&mut self, send: &B, recv: &mut B, op: ReduceOp) -> Result<Pending, CommError> {
        let g = self.progress.enter_collective(Op::ReduceScatter, send.payload_bytes(), send.dtype_name());
        g.started(self.inner.reduce_scatter_start(send, recv, op))
    }
    fn all_reduce_start(&mut self, buf: &mut B, op: ReduceOp) -> Result<Pending, CommError> {
        let g = self.progress.enter_collective(Op::AllReduce, buf.payload_bytes(), buf.dtype_name());
        g.started(self.inner.all_reduce_start(buf, op))
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

    #[test]
    fn the_flight_recorder_numbers_sizes_and_ends_every_collective() {
        let comms = TcpComm::local_group(2).expect("group");
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let p = Arc::new(Progress::with_flight_records(3));
                    install(p.clone());
                    let mut t = Tracked::new(c, p.clone());
                    note_phase(Phase::Training);
                    note_micro_step(1);
                    let mut buf = [1.0f32; 4];
                    {
                        let _u = unit_scope(7);
                        t.all_reduce(&mut buf[..], ReduceOp::Sum).expect("all_reduce");
                    }
                    let mut out = [0.0f32; 8];
                    let pending = t.all_gather_start(&buf[..], &mut out[..]).expect("start");
                    t.wait(pending).expect("wait");
                    t.barrier().expect("barrier");
                    // Sizes that do not fit: the call fails and is recorded so.
                    let mut wrong = [0.0f32; 3];
                    assert!(t.all_gather(&buf[..], &mut wrong[..]).is_err());
                    p.flight().records()
                })
            })
            .collect();
        for h in handles {
            let r = h.join().expect("rank");
            // The ring of 3 kept the newest: #2 all_gather (started, and complete when TCP
            // returns), #3 barrier, #4 the failed one.
            let got: Vec<(u64, Op, u64, State)> = r.iter().map(|r| (r.seq, r.op, r.bytes, r.state)).collect();
            assert_eq!(
                got,
                [
                    (2, Op::AllGather, 16, State::Done),
                    (3, Op::Barrier, 0, State::Done),
                    (4, Op::AllGather, 16, State::Failed)
                ]
            );
            assert!(r.iter().all(|x| x.dtype == "f32" || x.op == Op::Barrier), "{r:?}");
            assert!(r.iter().all(|x| x.micro == 1 && x.phase == Phase::Training && x.unit.is_none()), "{r:?}");
            assert!(r.iter().all(|x| x.end_us.is_some_and(|e| e >= x.start_us)), "{r:?}");
        }
        // The unit noted around a collective, and cleared after.
        let p = Arc::new(Progress::with_flight_records(4));
        install(p.clone());
        {
            let _u = unit_scope(7);
            drop(p.enter(Op::Broadcast));
        }
        drop(p.enter(Op::Broadcast));
        let units: Vec<Option<u32>> = p.flight().records().iter().map(|r| r.unit).collect();
        assert_eq!(units, [Some(7), None]);
    }
}
