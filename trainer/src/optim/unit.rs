//! One unit's host state (master weights, moments, the delayed update's buffers) and the
//! cell that shares it between the driving thread (`optimizer.rs`) and the delayed
//! update's thread (`delayed.rs`): a leaf both import.

use std::sync::{Condvar, Mutex, MutexGuard};

use crate::backend::{BResult, Backend, BackendError};

/// The error the driving thread reports when the update thread died holding a unit.
pub(super) fn thread_failed() -> BackendError {
    BackendError::Device("the delayed host optimizer thread failed while updating a unit".into())
}

/// One unit's host state (empty vectors on a backend that holds no values: the planner).
pub(super) struct HostUnit<B: Backend> {
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// `offload.params`: the rounded parameters of the held elements, page-locked.
    pub params: Option<B::HostBuf>,
    /// Delayed update: this unit's own page-locked buffers.
    pub staged: Option<Staged<B>>,
}

/// A unit's buffers for the delayed update.
pub(super) struct Staged<B: Backend> {
    /// The step's reduced gradient of the held elements.
    pub grads: B::HostF32,
    /// The update's rounded weights, for the device.
    pub out: B::HostBuf,
    /// The update thread has yet to update the unit from `grads`: they must not be
    /// overwritten, nor `out` read, until it has.
    pub pending: bool,
}

/// A unit's host state, shared with the delayed update's thread: it locks the unit while it
/// updates it and signals `updated` when done.
pub(super) struct UnitCell<B: Backend> {
    pub state: Mutex<HostUnit<B>>,
    pub updated: Condvar,
}

impl<B: Backend> UnitCell<B> {
    pub(super) fn lock(&self) -> BResult<MutexGuard<'_, HostUnit<B>>> {
        self.state.lock().map_err(|_| thread_failed())
    }
}
