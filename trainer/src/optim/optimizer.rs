//! The AdamW optimizer state and its step, per unit, on the device or on the host.
//!
//! For every unit the rank owns the elements `off..off + len` (unit coordinates) and keeps
//! their fp32 master weights and moments `m`, `v`:
//! - [`Placement::Device`]: in device buffers; `AdamWOps::adamw` updates them and rounds
//!   the result into the compute parameters, one call per unit;
//! - [`Placement::Host`] (`offload.optimizer`): in host memory. A step streams each unit's
//!   reduced gradient to the host through a ring of page-locked slots (the next units'
//!   copies run while the host updates this one), runs the host AdamW
//!   (`host_adamw.rs`) on the rank's cores, and streams the rounded parameters back through
//!   a second ring, or keeps them in a page-locked host shard when the parameters are
//!   offloaded too (`offload.params`: a ZeRO-3 gather fetches them from there).
//!
//! Only what crosses PCIe is page-locked (the staging rings and the host parameter shard):
//! the master weights and moments never leave the host, and pinning 12 bytes per parameter
//! would take the memory the host needs to hold the largest models.
//!
//! With `offload.delayed_update` (ZeRO-Offload's schedule) the host update runs on a thread
//! of its own (`delayed.rs`) while the device runs the next step: each unit keeps its own
//! page-locked gradient and rounded-update buffers; gradients stream to the host as the
//! last micro-step's backward finishes each unit ([`Optimizer::grad_ready`]), and the
//! update's result goes to the device at the next step ([`Optimizer::settle`]).
//!
//! The engine drives it: [`Optimizer::step`] once per optimizer step with every unit's
//! reduced gradient and where its rounded parameters go.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use rayon::prelude::*;
use std::thread::JoinHandle;

use crate::backend::{
    AdamWSegment, AdamWStep, AdamWTensors, BResult, Backend, BackendError, HostRead, HostValues, Loc,
};
use crate::model::TensorSpec;
use crate::optim::delayed;
use crate::optim::host_adamw::{HostAdamW, HostAdamWStats, HostState};
use crate::optim::unit::{thread_failed, HostUnit, Staged, UnitCell};
use crate::zero::{Category, HostMemory, MemoryLedger};

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

/// Where the optimizer state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Device,
    /// Host memory, updated by `threads` host threads (0: the rank's share of the cores);
    /// with `params_on_host` the rounded parameters stay in a page-locked host shard; with
    /// `delay_after: Some(n)` steps after the n-th run delayed (the update of step t
    /// overlaps step t + 1 on the device).
    Host {
        threads: usize,
        params_on_host: bool,
        delay_after: Option<u64>,
    },
}

/// Page-locked staging slots per direction: the copies of the next units run while the
/// host updates this one.
const SLOTS: usize = 3;

/// One unit's device state: master weights and moments of elements `off..off + len`.
struct DeviceUnit<B: Backend> {
    master: B::F32,
    m: B::F32,
    v: B::F32,
    off: usize,
    len: usize,
}

/// The delayed update's bookkeeping on the driving thread.
struct Delay<B: Backend> {
    /// Steps up to this one apply their update at once.
    after: u64,
    /// The update in flight: it hands back the host AdamW (and whether it succeeded).
    worker: Option<JoinHandle<(HostAdamW, Result<(), String>)>>,
    /// This step's gradient copies to the host, per unit.
    downloads: Vec<Option<B::Event>>,
    /// The last update's copies to the device, per unit (they read the unit's `out`: the
    /// next update waits for them before rewriting it).
    uploads: Vec<Option<Arc<B::Event>>>,
}

struct HostSide<B: Backend> {
    /// `None` on a backend without values, or while the delayed update holds it.
    adamw: Option<HostAdamW>,
    units: Arc<Vec<UnitCell<B>>>,
    /// Held elements `(off, len)` of each unit.
    ranges: Vec<(usize, usize)>,
    params_on_host: bool,
    grad_slots: Vec<B::HostF32>,
    param_slots: Vec<B::HostBuf>,
    /// Threads, and what finished delayed updates did since the last report.
    stats: HostAdamWStats,
    delay: Option<Delay<B>>,
}

impl<B: Backend> HostSide<B> {
    fn unit(&self, u: usize) -> BResult<MutexGuard<'_, HostUnit<B>>> {
        self.units[u].lock()
    }
}

impl<B: Backend> Drop for HostSide<B> {
    fn drop(&mut self) {
        // The update thread reads page-locked memory of this rank's device context: let it
        // finish before the backend can go away.
        if let Some(w) = self.delay.as_mut().and_then(|d| d.worker.take()) {
            let _ = w.join();
        }
    }
}

/// Where one unit's update reads its gradient and writes its rounded parameters.
pub struct UnitUpdate<'a, B: Backend> {
    /// The reduced gradient of the held elements, from element 0.
    pub grads: &'a B::Grad,
    /// The compute-precision buffer receiving the rounded update, and the index in it of
    /// the first held element; `None` where no device copy is kept (ZeRO-3 on the device
    /// rounds at gather time; `offload.params` keeps them on the host).
    pub params: Option<(&'a mut B::Buf, usize)>,
    /// Set by the delayed update: the copy bringing the unit's rounded weights to
    /// `params`, which compute must wait for before it reads them (the engine orders each
    /// unit's first use after its own copy, so the next forward starts on the first unit).
    pub upload: Option<Arc<B::Event>>,
    /// The unit's FP8 weights whose amaxes the device update leaves for their casts, with
    /// their FP8 layer (`AdamWSegment::fp8_layer`): those whose every element this rank
    /// updates and writes into `params` (the engine's choice; empty: none).
    pub step_amax: &'a [(Loc, usize)],
}

/// AdamW state of every unit.
pub struct Optimizer<B: Backend> {
    device: Vec<DeviceUnit<B>>,
    host: Option<HostSide<B>>,
    /// An asynchronous checkpoint's copy of the device state to the host, still queued:
    /// the next write of the state (an update, a load) is ordered after it on the device,
    /// so the forward and backward in between overlap the copy.
    copy_in_flight: Option<Arc<B::Event>>,
}

impl<B: Backend> Optimizer<B> {
    /// An empty optimizer; `rank` places its host threads on this rank's share of the cores.
    pub fn new(be: &B, placement: Placement, rank: usize) -> BResult<Optimizer<B>> {
        let host = match placement {
            Placement::Device => None,
            Placement::Host { threads, params_on_host, delay_after } => {
                let adamw = if be.holds_values() {
                    let reserve = usize::from(delay_after.is_some());
                    Some(HostAdamW::new(threads, rank, true, reserve).map_err(BackendError::Device)?)
                } else {
                    None
                };
                let threads = adamw.as_ref().map_or(threads, |a| a.threads());
                let stats = HostAdamWStats { threads, ..Default::default() };
                let delay =
                    delay_after.map(|after| Delay { after, worker: None, downloads: Vec::new(), uploads: Vec::new() });
                Some(HostSide {
                    adamw,
                    units: Arc::new(Vec::new()),
                    ranges: Vec::new(),
                    params_on_host,
                    grad_slots: Vec::new(),
                    param_slots: Vec::new(),
                    stats,
                    delay,
                })
            }
        };
        Ok(Optimizer { device: Vec::new(), host, copy_in_flight: None })
    }

    /// Whether the state lives on the host.
    pub fn on_host(&self) -> bool {
        self.host.is_some()
    }

    /// Whether the rounded parameters live in a host shard (`offload.params`).
    pub fn params_on_host(&self) -> bool {
        self.host.as_ref().is_some_and(|h| h.params_on_host)
    }

    /// Add the next unit's state for elements `off..off + len`, with master weights
    /// `init` (`len` values) when given, else zero; moments start at zero. Device bytes go
    /// to `ledger`, host bytes to `host`.
    pub fn add_unit(
        &mut self,
        be: &B,
        name: &str,
        (off, len): (usize, usize),
        init: Option<&[f32]>,
        ledger: &mut MemoryLedger,
        host: &mut HostMemory,
    ) -> BResult<()> {
        let what = |s: &str| format!("{s} of unit {name}");
        let Some(hs) = self.host.as_mut() else {
            let mut master = be.alloc_f32(len, &what("fp32 master weights"))?;
            if let Some(values) = init {
                be.upload_f32(values, &mut master, 0)?;
            }
            // Allocations are zeroed by every backend: the moments start at zero.
            let m = be.alloc_f32(len, &what("AdamW m"))?;
            let v = be.alloc_f32(len, &what("AdamW v"))?;
            ledger.alloc(Category::Optimizer, 3 * len * be.elem_bytes().f32);
            self.device.push(DeviceUnit { master, m, v, off, len });
            return Ok(());
        };
        host.optimizer += 3 * len as u64 * 4;
        // `init` (or zeros) in a new vector, filled by all cores: at these sizes (tens of GB
        // per rank) the first touch of every page is most of the start-up time.
        let vec = |init: Option<&[f32]>, n: usize, s: &str| -> BResult<Vec<f32>> {
            if !be.holds_values() {
                return Ok(Vec::new());
            }
            let mut v = Vec::new();
            v.try_reserve_exact(n).map_err(|_| BackendError::OutOfMemory {
                device: "host".into(),
                bytes: n * 4,
                what: what(s),
            })?;
            match init {
                Some(values) => v.par_extend(values[..n].par_iter().copied()),
                None => v.par_extend(rayon::iter::repeat_n(0.0f32, n)),
            }
            Ok(v)
        };
        let master = vec(init, len, "host fp32 master weights")?;
        let (m, v) = (vec(None, len, "host AdamW m")?, vec(None, len, "host AdamW v")?);
        let params = if hs.params_on_host {
            host.params += len as u64 * be.elem_bytes().buf as u64;
            let mut p = be.alloc_host_buf(len, &what("page-locked parameter shard"))?;
            if let (Some(values), true) = (init, be.holds_values()) {
                write_rounded(be.host_buf_mut(&mut p)?, values);
            }
            Some(p)
        } else {
            None
        };
        let unit = HostUnit { master, m, v, params, staged: None };
        Arc::get_mut(&mut hs.units)
            .expect("units are added before any update runs")
            .push(UnitCell { state: Mutex::new(unit), updated: Condvar::new() });
        hs.ranges.push((off, len));
        Ok(())
    }

    /// After the last `add_unit`: the page-locked staging rings, sized for the largest unit
    /// (delayed update: every unit's own gradient and rounded-update buffers instead).
    pub fn allocate_staging(&mut self, be: &B, host: &mut HostMemory) -> BResult<()> {
        let Some(hs) = self.host.as_mut() else { return Ok(()) };
        let buf_bytes = be.elem_bytes().buf as u64;
        if let Some(d) = hs.delay.as_mut() {
            for (cell, &(_, len)) in hs.units.iter().zip(&hs.ranges) {
                let grads = be.alloc_host_f32(len, "page-locked gradients (delayed update)")?;
                let out = be.alloc_host_buf(len, "page-locked updated parameters (delayed update)")?;
                host.staging += len as u64 * (4 + buf_bytes);
                cell.lock()?.staged = Some(Staged { grads, out, pending: false });
            }
            d.downloads = (0..hs.ranges.len()).map(|_| None).collect();
            return Ok(());
        }
        let slot = hs.ranges.iter().map(|r| r.1).max().unwrap_or(0);
        for _ in 0..SLOTS {
            hs.grad_slots.push(be.alloc_host_f32(slot, "page-locked gradient staging")?);
            host.staging += slot as u64 * 4;
            if !hs.params_on_host {
                hs.param_slots.push(be.alloc_host_buf(slot, "page-locked parameter staging")?);
                host.staging += slot as u64 * buf_bytes;
            }
        }
        Ok(())
    }

    /// The elements `(off, len)` of unit `u` this optimizer holds.
    pub fn range(&self, u: usize) -> (usize, usize) {
        match &self.host {
            Some(h) => h.ranges[u],
            None => (self.device[u].off, self.device[u].len),
        }
    }

    /// Round unit `u`'s master weights (the first `len` held elements) into `dst` at
    /// `doff` (device state only: host state reaches the device through `step` or
    /// [`Optimizer::upload_params`]).
    pub fn cast_params(&self, be: &B, u: usize, dst: &mut B::Buf, doff: usize, len: usize) -> BResult<()> {
        be.cast_to_buf(dst, doff, &self.device[u].master, Loc::all(len))
    }

    /// `offload.params`: queue the copy of unit `u`'s host parameter shard (its first
    /// `len` elements) into `dst` at `doff`.
    pub fn upload_params(&self, be: &B, u: usize, dst: &mut B::Buf, doff: usize, len: usize) -> BResult<B::Event> {
        let hs = self.host.as_ref().expect("parameters on the host need the optimizer on the host");
        let unit = hs.unit(u)?;
        let p = unit.params.as_ref().expect("offload.params keeps a host parameter shard");
        be.buf_from_host(p, Loc::all(len), dst, doff)
    }

    /// Time and parameters the host optimizer spent since the last call (`None` on the
    /// device). A delayed update counts once it has finished.
    pub fn take_host_stats(&mut self) -> Option<HostAdamWStats> {
        let hs = self.host.as_mut()?;
        if let Some(a) = hs.adamw.as_mut() {
            hs.stats.add(a.take_stats());
        }
        let s = hs.stats;
        hs.stats.seconds = 0.0;
        hs.stats.params = 0;
        Some(s)
    }

    /// AdamW on every unit: `updates[u]` says where unit `u`'s gradient is and where its
    /// rounded parameters go. Every tensor's part inside the held range is one segment
    /// (decay for matrices only).
    pub fn step(
        &mut self,
        be: &B,
        tensors: &[&[TensorSpec]],
        updates: &mut [UnitUpdate<'_, B>],
        h: AdamWStep,
    ) -> BResult<()> {
        if self.host.is_none() {
            self.after_copy(be)?;
            for (u, (up, ts)) in updates.iter_mut().zip(tensors).enumerate() {
                let st = &mut self.device[u];
                let (params, base) = match up.params.as_mut() {
                    Some((p, base)) => (Some(&mut **p), *base),
                    None => (None, 0),
                };
                let segs = segments(ts, st.off, st.len, base, if params.is_some() { up.step_amax } else { &[] });
                let t = AdamWTensors { params, master: &mut st.master, m: &mut st.m, v: &mut st.v, grads: up.grads };
                be.adamw(t, &segs, h)?;
            }
            return Ok(());
        }
        if self.delays() {
            return self.delayed_step(be, tensors, updates, h);
        }
        self.host_step(be, tensors, updates, h)
    }

    /// The host pipeline: gradient copies run up to `SLOTS` units ahead of the update, the
    /// parameter copies behind it.
    fn host_step(
        &mut self,
        be: &B,
        tensors: &[&[TensorSpec]],
        updates: &mut [UnitUpdate<'_, B>],
        h: AdamWStep,
    ) -> BResult<()> {
        let hs = self.host.as_mut().expect("host placement");
        let n = updates.len();
        let mut down: Vec<Option<B::Event>> = (0..n).map(|_| None).collect();
        let mut up: Vec<Option<B::Event>> = (0..SLOTS).map(|_| None).collect();
        for i in 0..n.min(SLOTS) {
            let len = hs.ranges[i].1;
            down[i] = Some(be.grad_to_host(updates[i].grads, Loc::all(len), &mut hs.grad_slots[i % SLOTS])?);
        }
        for i in 0..n {
            let slot = i % SLOTS;
            let (off, len) = hs.ranges[i];
            be.wait_event(down[i].as_ref().expect("started above"))?;
            let mut guard = hs.units[i].lock()?;
            let unit = &mut *guard;
            let segs = segments(tensors[i], off, len, 0, &[]);
            let out = match unit.params.as_mut() {
                Some(p) => Some(be.host_buf_mut(p)?),
                None => {
                    // The slot's previous upload must have left it before it is rewritten.
                    if let Some(e) = up[slot].take() {
                        be.wait_event(&e)?;
                    }
                    if updates[i].params.is_some() {
                        Some(be.host_buf_mut(&mut hs.param_slots[slot])?)
                    } else {
                        None
                    }
                }
            };
            if let Some(adamw) = hs.adamw.as_mut() {
                let g = be.host_f32(&hs.grad_slots[slot])?;
                adamw.step(HostState { master: &mut unit.master, m: &mut unit.m, v: &mut unit.v }, g, out, &segs, h);
            }
            if unit.params.is_none() {
                if let Some((dst, base)) = updates[i].params.as_mut() {
                    up[slot] = Some(be.buf_from_host(&hs.param_slots[slot], Loc::all(len), dst, *base)?);
                }
            }
            if i + SLOTS < n {
                let (j, len) = (i + SLOTS, hs.ranges[i + SLOTS].1);
                down[j] = Some(be.grad_to_host(updates[j].grads, Loc::all(len), &mut hs.grad_slots[slot])?);
            }
        }
        // The compute stream uses the new parameters only after their copies.
        for e in up.into_iter().flatten() {
            be.order_compute_after(&e)?;
        }
        Ok(())
    }

    /// Whether steps run the delayed update (`offload.delayed_update`).
    pub fn delays(&self) -> bool {
        self.host.as_ref().is_some_and(|hs| hs.delay.is_some())
    }

    /// Whether a delayed update is in flight (its result not yet on the device).
    pub fn update_in_flight(&self) -> bool {
        self.host.as_ref().and_then(|hs| hs.delay.as_ref()).is_some_and(|d| d.worker.is_some())
    }

    /// Delayed update: unit `u`'s reduced gradient of this step is final in `grads`; queue
    /// its copy into the unit's host buffer (once the update in flight is done with it).
    /// A no-op otherwise, or when the copy was queued already this step.
    pub fn grad_ready(&mut self, be: &B, u: usize, grads: &B::Grad) -> BResult<()> {
        let Some(hs) = self.host.as_mut() else { return Ok(()) };
        let Some(d) = hs.delay.as_mut() else { return Ok(()) };
        if d.downloads[u].is_some() {
            return Ok(());
        }
        let cell = &hs.units[u];
        let mut unit = cell.lock()?;
        // The update thread goes from the last unit to the first, the order in which the
        // backward finishes them, so this rarely waits.
        while unit.staged.as_ref().is_some_and(|s| s.pending) {
            unit = cell.updated.wait(unit).map_err(|_| thread_failed())?;
        }
        let st = unit.staged.as_mut().expect("the delayed update stages every unit");
        d.downloads[u] = Some(be.grad_to_host(grads, Loc::all(hs.ranges[u].1), &mut st.grads)?);
        Ok(())
    }

    /// The delayed schedule's step: put the update in flight (the previous step's) on the
    /// device, then start this step's on its own thread. Up to step `after` it is
    /// applied at once, like the in-order host step.
    fn delayed_step(
        &mut self,
        be: &B,
        tensors: &[&[TensorSpec]],
        updates: &mut [UnitUpdate<'_, B>],
        h: AdamWStep,
    ) -> BResult<()> {
        self.settle_updates(be, updates)?;
        for (u, up) in updates.iter().enumerate() {
            self.grad_ready(be, u, up.grads)?;
        }
        let hs = self.host.as_mut().expect("host placement");
        let d = hs.delay.as_mut().expect("delayed schedule");
        // The update reads every gradient copy (most finished under the backward).
        for e in d.downloads.iter_mut().filter_map(Option::take) {
            be.wait_event(&e)?;
        }
        let Some(adamw) = hs.adamw.take() else { return Ok(()) }; // a backend without values
        let segs: Vec<Vec<AdamWSegment>> =
            hs.ranges.iter().zip(tensors).map(|(&(off, len), ts)| segments(ts, off, len, 0, &[])).collect();
        for cell in hs.units.iter() {
            if let Some(st) = cell.lock()?.staged.as_mut() {
                st.pending = true;
            }
        }
        let units = Arc::clone(&hs.units);
        let uploads = std::mem::take(&mut d.uploads);
        let worker = std::thread::Builder::new()
            .name("host-adamw-delayed".into())
            .spawn(move || delayed::update_units(&units, adamw, &segs, &uploads, h))
            .map_err(|e| BackendError::Device(format!("starting the delayed host optimizer thread: {e}")))?;
        d.worker = Some(worker);
        if h.t <= d.after {
            self.settle_updates(be, updates)?;
        }
        Ok(())
    }

    /// [`Optimizer::settle`] into the step's destinations, each unit's copy noted in its
    /// [`UnitUpdate::upload`].
    fn settle_updates(&mut self, be: &B, updates: &mut [UnitUpdate<'_, B>]) -> BResult<()> {
        let mut dests = destinations(updates);
        let landed = self.settle(be, &mut dests)?;
        drop(dests);
        for (up, e) in updates.iter_mut().zip(landed) {
            up.upload = e;
        }
        Ok(())
    }

    /// Delayed update: wait for the update in flight, if any, and queue its rounded weights
    /// to the device (`dests[u]`: where unit `u`'s go, as in [`UnitUpdate::params`]).
    /// Returns each unit's copy: compute must wait for it before reading the unit (empty
    /// when nothing was in flight). Evaluations and checkpoints settle first.
    pub fn settle(
        &mut self,
        be: &B,
        dests: &mut [Option<(&mut B::Buf, usize)>],
    ) -> BResult<Vec<Option<Arc<B::Event>>>> {
        let Some(hs) = self.host.as_mut() else { return Ok(Vec::new()) };
        let Some(d) = hs.delay.as_mut() else { return Ok(Vec::new()) };
        let Some(worker) = d.worker.take() else { return Ok(Vec::new()) };
        let (mut adamw, done) =
            worker.join().map_err(|_| BackendError::Device("the delayed host optimizer thread panicked".into()))?;
        hs.stats.add(adamw.take_stats());
        hs.adamw = Some(adamw);
        done.map_err(BackendError::Device)?;
        d.uploads = Vec::with_capacity(dests.len());
        for (u, dest) in dests.iter_mut().enumerate() {
            let e = match dest.as_mut() {
                Some((buf, base)) => {
                    let unit = hs.units[u].lock()?;
                    let st = unit.staged.as_ref().expect("the delayed update stages every unit");
                    Some(Arc::new(be.buf_from_host(&st.out, Loc::all(hs.ranges[u].1), buf, *base)?))
                }
                None => None,
            };
            d.uploads.push(e);
        }
        Ok(d.uploads.clone())
    }

    /// One of unit `u`'s tensors (0 = master weights, 1 = m, 2 = v) over `[lo, hi)` (unit
    /// coordinates, inside the held range), on the host.
    pub fn tensor_host(&self, be: &B, u: usize, which: usize, lo: usize, hi: usize) -> BResult<Vec<f32>> {
        if self.update_in_flight() {
            return Err(BackendError::Device(
                "optimizer state read while a delayed update is in flight (settle it first)".into(),
            ));
        }
        if let Some(hs) = &self.host {
            let st = hs.unit(u)?;
            let off = hs.ranges[u].0;
            let src = [&st.master, &st.m, &st.v][which.min(2)];
            return Ok(src.get(lo - off..hi - off).map(<[f32]>::to_vec).unwrap_or_else(|| vec![0.0; hi - lo]));
        }
        let st = &self.device[u];
        let src = [&st.master, &st.m, &st.v][which.min(2)];
        be.download_f32(src, Loc::new(lo - st.off, hi - lo))
    }

    /// Queue the copy of unit `u`'s master weights, m and v over `[lo, hi)` (unit coordinates,
    /// inside the held range) into `dst` one after the other (`3 × (hi − lo)` values): an
    /// asynchronous checkpoint's snapshot. Device state is copied after the work queued so far,
    /// on the copy stream, in queue order (the last event says every earlier copy is done);
    /// host state is copied at once (no event).
    pub fn copy_to_host(
        &self,
        be: &B,
        u: usize,
        lo: usize,
        hi: usize,
        dst: &mut B::HostF32,
    ) -> BResult<Option<B::Event>> {
        if self.update_in_flight() {
            return Err(BackendError::Device(
                "optimizer state copied while a delayed update is in flight (settle it first)".into(),
            ));
        }
        let n = hi - lo;
        if let Some(hs) = &self.host {
            if !be.holds_values() {
                return Ok(None);
            }
            let st = hs.unit(u)?;
            let off = hs.ranges[u].0;
            let out = dst.writable().map_err(BackendError::Device)?;
            for (k, src) in [&st.master, &st.m, &st.v].into_iter().enumerate() {
                out[k * n..(k + 1) * n].copy_from_slice(&src[lo - off..hi - off]);
            }
            return Ok(None);
        }
        let st = &self.device[u];
        let mut last = None;
        for (k, src) in [&st.master, &st.m, &st.v].into_iter().enumerate() {
            last = Some(be.f32_to_host(src, Loc::new(lo - st.off, n), dst, k * n)?);
        }
        Ok(last)
    }

    /// The device state is being copied to the host until `done`: its next write waits for it.
    pub fn copying_until(&mut self, done: Arc<B::Event>) {
        self.copy_in_flight = Some(done);
    }

    /// Order the device's next write of the state after a checkpoint copy still queued.
    fn after_copy(&mut self, be: &B) -> BResult<()> {
        match self.copy_in_flight.take() {
            Some(e) => be.order_compute_after(&e),
            None => Ok(()),
        }
    }

    /// Overwrite unit `u`'s master weights, m and v from `lo` (unit coordinates) with
    /// `state` (and, with the parameters on the host, their rounded copy).
    pub fn load(&mut self, be: &B, u: usize, lo: usize, state: &[Vec<f32>; 3]) -> BResult<()> {
        if let Some(hs) = self.host.as_mut() {
            let off = hs.ranges[u].0;
            let mut guard = hs.unit(u)?;
            let st = &mut *guard;
            let r = lo - off..lo - off + state[0].len();
            if be.holds_values() {
                st.master[r.clone()].copy_from_slice(&state[0]);
                st.m[r.clone()].copy_from_slice(&state[1]);
                st.v[r.clone()].copy_from_slice(&state[2]);
                if let Some(p) = st.params.as_mut() {
                    write_rounded(be.host_buf_mut(p)?, &st.master);
                }
            }
            return Ok(());
        }
        self.after_copy(be)?;
        let st = &mut self.device[u];
        let off = lo - st.off;
        be.upload_f32(&state[0], &mut st.master, off)?;
        be.upload_f32(&state[1], &mut st.m, off)?;
        be.upload_f32(&state[2], &mut st.v, off)
    }

    /// Host state: round unit `u`'s master weights (the first `len` held elements) into
    /// `dst` at `doff` through a staging slot (start-up and checkpoint loads).
    pub fn upload_master(&mut self, be: &B, u: usize, dst: &mut B::Buf, doff: usize, len: usize) -> BResult<()> {
        let hs = self.host.as_mut().expect("host placement");
        if !be.holds_values() {
            return Ok(());
        }
        let mut guard = hs.units[u].lock()?;
        let unit = &mut *guard;
        let staged = match (unit.params.as_mut(), unit.staged.as_mut()) {
            (Some(p), _) => p,
            (None, Some(st)) => &mut st.out,
            (None, None) => hs.param_slots.first_mut().expect("staging allocated"),
        };
        write_rounded(be.host_buf_mut(staged)?, &unit.master[..len]);
        let e = be.buf_from_host(staged, Loc::all(len), dst, doff)?;
        be.wait_event(&e)
    }
}

/// Where each unit's rounded update goes, reborrowed from `updates`.
fn destinations<'a, B: Backend>(updates: &'a mut [UnitUpdate<'_, B>]) -> Vec<Option<(&'a mut B::Buf, usize)>> {
    updates.iter_mut().map(|u| u.params.as_mut().map(|(p, base)| (&mut **p, *base))).collect()
}

/// `values` rounded into a host compute-precision buffer (all cores: start-up and
/// checkpoint loads round whole shards).
fn write_rounded(dst: HostValues<'_>, values: &[f32]) {
    match dst {
        HostValues::Bf16(o) => {
            o.par_iter_mut().zip(values.par_iter()).for_each(|(d, &x)| *d = half::bf16::from_f32(x).to_bits());
        }
        HostValues::F32(o) => o[..values.len()].par_iter_mut().zip(values.par_iter()).for_each(|(d, &x)| *d = x),
    }
}

/// AdamW segments of the held elements `off..off + len` of a unit's tensors: state and
/// gradient from 0, rounded parameters from `pbase`.
fn segments(tensors: &[TensorSpec], off: usize, len: usize, pbase: usize, fp8: &[(Loc, usize)]) -> Vec<AdamWSegment> {
    let (lo, hi) = (off, off + len);
    tensors
        .iter()
        .filter_map(|ts| {
            let (a, b) = (ts.loc.off.max(lo), ts.loc.end().min(hi));
            // An FP8 weight's amax where the whole weight is held: it may span several
            // tensors (Llama's q, k, v), whose segments all max into its amax.
            let held = |w: &Loc| w.off >= lo && w.end() <= hi;
            let fp8_layer =
                fp8.iter().find(|(w, _)| held(w) && ts.loc.off >= w.off && ts.loc.end() <= w.end()).map(|&(_, l)| l);
            (a < b).then_some(AdamWSegment {
                poff: a - lo + pbase,
                moff: a - lo,
                goff: a - lo,
                len: b - a,
                decay: ts.decay,
                fp8_layer,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    fn step_of(t: u64) -> AdamWStep {
        AdamWStep { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t, grad_scale: 0.7 }
    }

    /// The delayed schedule: a step's update reaches the parameters one step later (the
    /// next step computes with the weights before it), with the same bits as the in-order
    /// update of the same gradients; `settle` lands the update in flight.
    #[test]
    fn delayed_update_lands_one_step_later_with_the_in_order_bits() {
        let be = CpuBackend::new();
        let n = 70_001; // more than one chunk of the host AdamW
        let ts = [
            TensorSpec { name: "w".into(), shape: vec![n - 1], loc: Loc::new(0, n - 1), decay: true },
            TensorSpec { name: "b".into(), shape: vec![1], loc: Loc::new(n - 1, 1), decay: false },
        ];
        let tensors: [&[TensorSpec]; 1] = [&ts];
        let init: Vec<f32> = (0..n as u64).map(|i| crate::rng::normal(1, 0, i) as f32 * 0.02).collect();
        let grads: Vec<Vec<f32>> =
            (0..3u64).map(|s| (0..n as u64).map(|i| crate::rng::normal(2 + s, 0, i) as f32).collect()).collect();
        let (mut ledger, mut host) = (MemoryLedger::default(), HostMemory::default());

        let mut in_order = Optimizer::new(&be, Placement::Device, 0).expect("optimizer");
        in_order.add_unit(&be, "u", (0, n), Some(&init), &mut ledger, &mut host).expect("unit");
        let mut p = init.clone();
        let mut expect = Vec::new();
        for (t, g) in grads.iter().enumerate() {
            let mut up = [UnitUpdate { grads: g, params: Some((&mut p, 0)), upload: None, step_amax: &[] }];
            in_order.step(&be, &tensors, &mut up, step_of(t as u64 + 1)).expect("step");
            expect.push(p.clone());
        }

        let placement = Placement::Host { threads: 2, params_on_host: false, delay_after: Some(0) };
        let mut delayed = Optimizer::new(&be, placement, 0).expect("optimizer");
        delayed.add_unit(&be, "u", (0, n), Some(&init), &mut ledger, &mut host).expect("unit");
        delayed.allocate_staging(&be, &mut host).expect("staging");
        assert_eq!(host.staging, n as u64 * 8, "a gradient and a rounded copy per element (f32 on the CPU)");
        let mut q = init.clone();
        for (t, g) in grads.iter().enumerate() {
            let mut up = [UnitUpdate { grads: g, params: Some((&mut q, 0)), upload: None, step_amax: &[] }];
            delayed.step(&be, &tensors, &mut up, step_of(t as u64 + 1)).expect("step");
            assert!(delayed.update_in_flight());
            let want = if t == 0 { &init } else { &expect[t - 1] };
            assert!(q == *want, "after step {}: the parameters of step {t}", t + 1);
            let read = delayed.tensor_host(&be, 0, 0, 0, n);
            assert!(read.is_err(), "state read while the update runs");
        }
        let landed = delayed.settle(&be, &mut [Some((&mut q, 0))]).expect("settle");
        assert_eq!(landed.len(), 1, "one copy per unit");
        assert!(!delayed.update_in_flight());
        assert!(q == expect[2], "settled: every update applied");
        assert!(delayed.tensor_host(&be, 0, 0, 0, n).expect("master") == expect[2]);
        let st = delayed.take_host_stats().expect("host stats");
        assert_eq!(st.params, 3 * n as u64, "three updates counted once finished");
    }
}
