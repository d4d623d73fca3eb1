//! The AdamW optimizer state and its step, per unit.
//!
//! For every unit the rank owns the elements `off..off + len` (unit coordinates) and
//! keeps their fp32 master weights and moments `m`, `v` in device buffers of the backend
//! (`AdamWOps::adamw` updates them and rounds the result into the compute parameters).
//! The engine drives it: `step_unit` once per unit per optimizer step, with the unit's
//! reduced gradient and the parameter buffer to publish into, both laid out from `off`.

use crate::backend::{AdamWSegment, AdamWStep, AdamWTensors, BResult, Backend, Loc};
use crate::model::TensorSpec;
use crate::zero::{Category, MemoryLedger};

/// Optimizer hyper-parameters for one step.
#[derive(Debug, Clone, Copy)]
pub struct Hyper {
    pub lr: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Clip the global gradient norm to this value; 0 disables.
    pub grad_clip: f32,
}

/// One unit's state: master weights and moments of elements `off..off + len`.
struct UnitState<B: Backend> {
    master: B::F32,
    m: B::F32,
    v: B::F32,
    off: usize,
    len: usize,
}

/// AdamW state of every unit, on the device.
pub struct Optimizer<B: Backend> {
    units: Vec<UnitState<B>>,
}

impl<B: Backend> Default for Optimizer<B> {
    fn default() -> Self {
        Optimizer { units: Vec::new() }
    }
}

impl<B: Backend> Optimizer<B> {
    /// Add the next unit's state for elements `off..off + len`, with master weights
    /// `init` (`len` values) when given, else zero; moments start at zero.
    pub fn add_unit(
        &mut self,
        be: &B,
        name: &str,
        (off, len): (usize, usize),
        init: Option<&[f32]>,
        ledger: &mut MemoryLedger,
    ) -> BResult<()> {
        let what = |s: &str| format!("{s} of unit {name}");
        let mut master = be.alloc_f32(len, &what("fp32 master weights"))?;
        if let Some(values) = init {
            be.upload_f32(values, &mut master, 0)?;
        }
        // Allocations are zeroed by every backend: the moments start at zero.
        let m = be.alloc_f32(len, &what("AdamW m"))?;
        let v = be.alloc_f32(len, &what("AdamW v"))?;
        ledger.alloc(Category::Optimizer, 3 * len * be.elem_bytes().f32);
        self.units.push(UnitState { master, m, v, off, len });
        Ok(())
    }

    /// The elements `(off, len)` of unit `u` this optimizer holds.
    pub fn range(&self, u: usize) -> (usize, usize) {
        (self.units[u].off, self.units[u].len)
    }

    /// Round unit `u`'s master weights (the first `len` held elements) into `dst` at `doff`.
    pub fn cast_params(&self, be: &B, u: usize, dst: &mut B::Buf, doff: usize, len: usize) -> BResult<()> {
        be.cast_to_buf(dst, doff, &self.units[u].master, Loc::all(len))
    }

    /// AdamW on unit `u`: `grads` holds the reduced gradient of the held elements (laid
    /// out from element `off` of the unit); `params`, when given, is the unit's full
    /// compute copy (unit coordinates) and receives the rounded update of the held
    /// elements. Every tensor's part inside the held range is one segment (decay for
    /// matrices only).
    pub fn step_unit(
        &mut self,
        be: &B,
        u: usize,
        tensors: &[TensorSpec],
        params: Option<&mut B::Buf>,
        grads: &B::Grad,
        h: AdamWStep,
    ) -> BResult<()> {
        let st = &mut self.units[u];
        let (lo, hi) = (st.off, st.off + st.len);
        let segs: Vec<AdamWSegment> = tensors
            .iter()
            .filter_map(|ts| {
                let (a, b) = (ts.loc.off.max(lo), ts.loc.end().min(hi));
                (a < b).then_some(AdamWSegment { poff: a, moff: a - lo, goff: a - lo, len: b - a, decay: ts.decay })
            })
            .collect();
        let t = AdamWTensors { params, master: &mut st.master, m: &mut st.m, v: &mut st.v, grads };
        be.adamw(t, &segs, h)
    }

    /// One of unit `u`'s tensors (0 = master weights, 1 = m, 2 = v) over `[lo, hi)` (unit
    /// coordinates, inside the held range), on the host.
    pub fn tensor_host(&self, be: &B, u: usize, which: usize, lo: usize, hi: usize) -> BResult<Vec<f32>> {
        let st = &self.units[u];
        let src = [&st.master, &st.m, &st.v][which.min(2)];
        be.download_f32(src, Loc::new(lo - st.off, hi - lo))
    }

    /// Overwrite unit `u`'s master weights, m and v from `lo` (unit coordinates) with `state`.
    pub fn load(&mut self, be: &B, u: usize, lo: usize, state: &[Vec<f32>; 3]) -> BResult<()> {
        let st = &mut self.units[u];
        let off = lo - st.off;
        be.upload_f32(&state[0], &mut st.master, off)?;
        be.upload_f32(&state[1], &mut st.m, off)?;
        be.upload_f32(&state[2], &mut st.v, off)
    }
}
