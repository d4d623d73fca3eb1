//! The flight recorder: every rank keeps its last N collectives — sequence number, kind,
//! bytes, element type, the unit (parameter group) and micro-step they were for, when they
//! began and ended, and how they ended — so that when a job hangs or a rank fails, the
//! launcher can line the ranks' records up and name the first collective at which they
//! disagree (a rank that called another collective, or the same with another size) or at
//! which some rank never arrived. Most collective hangs are such host-side divergences
//! (PyTorch's NCCL flight recorder, whose authors report it, is the model here).
//!
//! A [`FlightRecorder`] is a bounded ring behind a mutex that only the rank's own training
//! thread writes (twice per collective: a push and an update of the newest records) and its
//! heartbeat or control thread reads now and then, so it is cheap enough to be always on.
//! Records are fixed-size values (no allocation per collective). [`crate::progress::Tracked`]
//! fills it: the sequence number is the rank's collective count, the same as the watchdog's
//! "collective #N". Collectives recorded in a CUDA graph are recorded once, when recorded:
//! a replay runs no host code.

use crate::progress::{Op, Phase};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// How a recorded collective stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// The rank is inside the call (blocked on its peers, or queuing it).
    Running,
    /// The call returned and the collective is complete.
    Done,
    /// A `*_start` call returned: the collective runs on (a GPU stream) until waited for.
    Queued,
    /// The call returned an error.
    Failed,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Done => "done",
            State::Queued => "queued",
            State::Failed => "failed",
        }
    }
}

/// What a collective moves: its bytes and element type, for any buffer type a
/// [`crate::Communicator`] takes.
pub trait Payload {
    fn payload_bytes(&self) -> u64;
    fn dtype_name(&self) -> &'static str;
}

/// The last segment of a type's name: `f32`, `bf16` (from `half::bfloat::bf16`).
pub fn short_type_name<T: ?Sized>() -> &'static str {
    let full = std::any::type_name::<T>();
    full.rsplit("::").next().unwrap_or(full)
}

impl<T> Payload for [T] {
    fn payload_bytes(&self) -> u64 {
        std::mem::size_of_val(self) as u64
    }
    fn dtype_name(&self) -> &'static str {
        short_type_name::<T>()
    }
}

impl<T> Payload for Vec<T> {
    fn payload_bytes(&self) -> u64 {
        self.as_slice().payload_bytes()
    }
    fn dtype_name(&self) -> &'static str {
        short_type_name::<T>()
    }
}

/// GPU buffers (NCCL and the one-GPU communicator).
#[cfg(feature = "nccl")]
impl<T> Payload for cudarc::driver::CudaSlice<T> {
    fn payload_bytes(&self) -> u64 {
        (self.len() * std::mem::size_of::<T>()) as u64
    }
    fn dtype_name(&self) -> &'static str {
        short_type_name::<T>()
    }
}

/// One collective as a rank saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The rank's collective count when it entered this one (1-based; every rank runs the
    /// same sequence, so equal numbers should be the same collective everywhere).
    pub seq: u64,
    pub op: Op,
    /// Bytes of this rank's buffer (the send buffer; in-place: the whole buffer).
    pub bytes: u64,
    pub dtype: &'static str,
    /// The parameter unit it is for, when the engine said ([`crate::progress::unit_scope`]).
    pub unit: Option<u32>,
    /// Optimizer steps completed when it began, the micro-step and the phase.
    pub steps_done: u64,
    pub micro: u32,
    pub phase: Phase,
    /// Wall-clock times in microseconds since the Unix epoch (comparable across hosts as far
    /// as their clocks agree).
    pub start_us: u64,
    pub end_us: Option<u64>,
    pub state: State,
}

/// Microseconds since the Unix epoch, now.
pub fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// A bounded ring of a rank's last collectives (capacity 0: records nothing).
#[derive(Debug)]
pub struct FlightRecorder {
    capacity: usize,
    ring: Mutex<VecDeque<Record>>,
}

impl FlightRecorder {
    pub fn new(capacity: usize) -> FlightRecorder {
        FlightRecorder { capacity, ring: Mutex::new(VecDeque::with_capacity(capacity)) }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, VecDeque<Record>> {
        // A panic elsewhere while holding it leaves a usable ring of plain values.
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record a collective entered (its `end_us` and `state` are set by [`Self::end`]).
    pub fn begin(&self, record: Record) {
        if self.capacity == 0 {
            return;
        }
        let mut ring = self.ring();
        if ring.len() == self.capacity {
            ring.pop_front();
        }
        ring.push_back(record);
    }

    /// Collective `seq` returned in `state`.
    pub fn end(&self, seq: u64, state: State) {
        let mut ring = self.ring();
        // The newest record, unless a collective ran inside another's call (none does today).
        if let Some(r) = ring.iter_mut().rev().find(|r| r.seq == seq) {
            r.end_us = Some(now_us());
            r.state = state;
        }
    }

    /// Every record kept, oldest first.
    pub fn records(&self) -> Vec<Record> {
        self.ring().iter().copied().collect()
    }

    /// The newest record.
    pub fn last(&self) -> Option<Record> {
        self.ring().back().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64) -> Record {
        Record {
            seq,
            op: Op::AllGather,
            bytes: 64,
            dtype: "f32",
            unit: Some(1),
            steps_done: 0,
            micro: 0,
            phase: Phase::Training,
            start_us: now_us(),
            end_us: None,
            state: State::Running,
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_records() {
        let f = FlightRecorder::new(3);
        for s in 1..=5 {
            f.begin(rec(s));
            f.end(s, if s == 5 { State::Failed } else { State::Done });
        }
        let r = f.records();
        assert_eq!(r.iter().map(|r| r.seq).collect::<Vec<_>>(), [3, 4, 5]);
        assert!(r.iter().all(|r| r.end_us.is_some()));
        assert_eq!(f.last().map(|r| r.state), Some(State::Failed));
        let off = FlightRecorder::new(0);
        off.begin(rec(1));
        assert!(off.records().is_empty() && off.last().is_none());
        assert_eq!([0.0f32; 3][..].payload_bytes(), 12);
        assert_eq!(vec![0u16; 3].dtype_name(), "u16");
        assert_eq!(short_type_name::<f32>(), "f32");
    }
}
