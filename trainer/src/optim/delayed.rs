//! The delayed host update's thread (`offload.delayed_update`, ZeRO-Offload's schedule):
//! it updates every unit from the gradient in its page-locked buffer and writes the rounded
//! weights beside it, while the driving thread runs the next step on the device.
//!
//! Units go from the last to the first, the order in which the next backward finishes
//! them: the driving thread waits on a unit's `updated` signal only if the backward
//! catches up with the update ([`super::Optimizer::grad_ready`]).

use std::sync::{Arc, MutexGuard, PoisonError};

use super::host_adamw::{HostAdamW, HostState};
use super::unit::{HostUnit, UnitCell};
use crate::backend::{AdamWSegment, AdamWStep, Backend, HostRead, HostWait, HostWrite};

/// Update every unit (`segs[u]`: its segments, rounded weights from 0), each once the
/// previous update's copy of its rounded weights (`uploads[u]`) has left the buffer; hands
/// the host AdamW back with the outcome.
pub(super) fn update_units<B: Backend>(
    units: &[UnitCell<B>],
    mut adamw: HostAdamW,
    segs: &[Vec<AdamWSegment>],
    uploads: &[Option<Arc<B::Event>>],
    h: AdamWStep,
) -> (HostAdamW, Result<(), String>) {
    // However this ends (an error, a panic), no unit is left marked pending: the driving
    // thread would wait for it forever. The failure reaches it when it joins this thread.
    let _release = ReleaseOnExit(units);
    let mut run = || -> Result<(), String> {
        for (u, cell) in units.iter().enumerate().rev() {
            let mut guard = cell.state.lock().map_err(|_| "a unit's state was poisoned".to_string())?;
            let HostUnit { master, m, v, staged, .. } = &mut *guard;
            let st = staged.as_mut().ok_or("a unit without delayed-update buffers")?;
            if st.pending {
                if let Some(e) = uploads.get(u).and_then(Option::as_ref) {
                    e.wait_host()?;
                }
                adamw.step(HostState { master, m, v }, st.grads.values()?, Some(st.out.values_mut()?), &segs[u], h);
                st.pending = false;
            }
            drop(guard);
            cell.updated.notify_all();
        }
        Ok(())
    };
    let done = run();
    (adamw, done)
}

struct ReleaseOnExit<'a, B: Backend>(&'a [UnitCell<B>]);

impl<B: Backend> Drop for ReleaseOnExit<'_, B> {
    fn drop(&mut self) {
        for cell in self.0 {
            let mut g: MutexGuard<'_, HostUnit<B>> = cell.state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(st) = g.staged.as_mut() {
                st.pending = false;
            }
            drop(g);
            cell.updated.notify_all();
        }
    }
}
