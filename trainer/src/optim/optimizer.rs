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
//! The engine drives it: [`Optimizer::step`] once per optimizer step with every unit's
//! reduced gradient and where its rounded parameters go.

use crate::backend::{AdamWSegment, AdamWStep, AdamWTensors, BResult, Backend, HostValues, Loc};
use crate::model::TensorSpec;
use crate::optim::host_adamw::{HostAdamW, HostAdamWStats};
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
    /// with `params_on_host` the rounded parameters stay in a page-locked host shard.
    Host {
        threads: usize,
        params_on_host: bool,
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

/// One unit's host state (empty vectors on a backend that holds no values: the planner).
struct HostUnit<B: Backend> {
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    off: usize,
    len: usize,
    /// `offload.params`: the rounded parameters of the held elements, page-locked.
    params: Option<B::HostBuf>,
}

struct HostSide<B: Backend> {
    adamw: Option<HostAdamW>,
    units: Vec<HostUnit<B>>,
    params_on_host: bool,
    grad_slots: Vec<B::HostF32>,
    param_slots: Vec<B::HostBuf>,
    stats: HostAdamWStats,
}

/// Where one unit's update reads its gradient and writes its rounded parameters.
pub struct UnitUpdate<'a, B: Backend> {
    /// The reduced gradient of the held elements, from element 0.
    pub grads: &'a B::Grad,
    /// The compute-precision buffer receiving the rounded update, and the index in it of
    /// the first held element; `None` where no device copy is kept (ZeRO-3 on the device
    /// rounds at gather time; `offload.params` keeps them on the host).
    pub params: Option<(&'a mut B::Buf, usize)>,
}

/// AdamW state of every unit.
pub struct Optimizer<B: Backend> {
    device: Vec<DeviceUnit<B>>,
    host: Option<HostSide<B>>,
}

impl<B: Backend> Optimizer<B> {
    /// An empty optimizer; `rank` places its host threads on this rank's share of the cores.
    pub fn new(be: &B, placement: Placement, rank: usize) -> BResult<Optimizer<B>> {
        let host = match placement {
            Placement::Device => None,
            Placement::Host { threads, params_on_host } => {
                let adamw = if be.holds_values() {
                    Some(HostAdamW::new(threads, rank, true).map_err(crate::backend::BackendError::Device)?)
                } else {
                    None
                };
                let threads = adamw.as_ref().map_or(threads, |a| a.threads());
                let stats = HostAdamWStats { threads, ..Default::default() };
                Some(HostSide {
                    adamw,
                    units: Vec::new(),
                    params_on_host,
                    grad_slots: Vec::new(),
                    param_slots: Vec::new(),
                    stats,
                })
            }
        };
        Ok(Optimizer { device: Vec::new(), host })
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
        let vec = |n: usize, s: &str| -> BResult<Vec<f32>> {
            if !be.holds_values() {
                return Ok(Vec::new());
            }
            let mut v = Vec::new();
            v.try_reserve_exact(n).map_err(|_| crate::backend::BackendError::OutOfMemory {
                device: "host".into(),
                bytes: n * 4,
                what: what(s),
            })?;
            v.resize(n, 0.0);
            Ok(v)
        };
        let mut master = vec(len, "host fp32 master weights")?;
        if let (Some(values), false) = (init, master.is_empty()) {
            master.copy_from_slice(values);
        }
        let (m, v) = (vec(len, "host AdamW m")?, vec(len, "host AdamW v")?);
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
        hs.units.push(HostUnit { master, m, v, off, len, params });
        Ok(())
    }

    /// After the last `add_unit`: the page-locked staging rings, sized for the largest unit.
    pub fn allocate_staging(&mut self, be: &B, host: &mut HostMemory) -> BResult<()> {
        let Some(hs) = self.host.as_mut() else { return Ok(()) };
        let slot = hs.units.iter().map(|u| u.len).max().unwrap_or(0);
        for _ in 0..SLOTS {
            hs.grad_slots.push(be.alloc_host_f32(slot, "page-locked gradient staging")?);
            host.staging += slot as u64 * 4;
            if !hs.params_on_host {
                hs.param_slots.push(be.alloc_host_buf(slot, "page-locked parameter staging")?);
                host.staging += slot as u64 * be.elem_bytes().buf as u64;
            }
        }
        Ok(())
    }

    /// The elements `(off, len)` of unit `u` this optimizer holds.
    pub fn range(&self, u: usize) -> (usize, usize) {
        match &self.host {
            Some(h) => (h.units[u].off, h.units[u].len),
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
        let p = hs.units[u].params.as_ref().expect("offload.params keeps a host parameter shard");
        be.buf_from_host(p, Loc::all(len), dst, doff)
    }

    /// Time and parameters the host optimizer spent since the last call (`None` on the device).
    pub fn take_host_stats(&mut self) -> Option<HostAdamWStats> {
        let hs = self.host.as_mut()?;
        let s = hs.adamw.as_mut().map_or(hs.stats, |a| a.take_stats());
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
            for (u, (up, ts)) in updates.iter_mut().zip(tensors).enumerate() {
                let st = &mut self.device[u];
                let (params, base) = match up.params.as_mut() {
                    Some((p, base)) => (Some(&mut **p), *base),
                    None => (None, 0),
                };
                let segs = segments(ts, st.off, st.len, base);
                let t = AdamWTensors { params, master: &mut st.master, m: &mut st.m, v: &mut st.v, grads: up.grads };
                be.adamw(t, &segs, h)?;
            }
            return Ok(());
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
            let len = hs.units[i].len;
            down[i] = Some(be.grad_to_host(updates[i].grads, Loc::all(len), &mut hs.grad_slots[i % SLOTS])?);
        }
        for i in 0..n {
            let slot = i % SLOTS;
            be.wait_event(down[i].as_ref().expect("started above"))?;
            let unit = &mut hs.units[i];
            let segs = segments(tensors[i], unit.off, unit.len, 0);
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
                adamw.step(&mut unit.master, &mut unit.m, &mut unit.v, g, out, &segs, h);
            }
            if unit.params.is_none() {
                if let Some((dst, base)) = updates[i].params.as_mut() {
                    up[slot] = Some(be.buf_from_host(&hs.param_slots[slot], Loc::all(unit.len), dst, *base)?);
                }
            }
            if i + SLOTS < n {
                let (j, len) = (i + SLOTS, hs.units[i + SLOTS].len);
                down[j] = Some(be.grad_to_host(updates[j].grads, Loc::all(len), &mut hs.grad_slots[slot])?);
            }
        }
        // The compute stream uses the new parameters only after their copies.
        for e in up.into_iter().flatten() {
            be.order_compute_after(&e)?;
        }
        Ok(())
    }

    /// One of unit `u`'s tensors (0 = master weights, 1 = m, 2 = v) over `[lo, hi)` (unit
    /// coordinates, inside the held range), on the host.
    pub fn tensor_host(&self, be: &B, u: usize, which: usize, lo: usize, hi: usize) -> BResult<Vec<f32>> {
        if let Some(hs) = &self.host {
            let st = &hs.units[u];
            let src = [&st.master, &st.m, &st.v][which.min(2)];
            return Ok(src.get(lo - st.off..hi - st.off).map(<[f32]>::to_vec).unwrap_or_else(|| vec![0.0; hi - lo]));
        }
        let st = &self.device[u];
        let src = [&st.master, &st.m, &st.v][which.min(2)];
        be.download_f32(src, Loc::new(lo - st.off, hi - lo))
    }

    /// Overwrite unit `u`'s master weights, m and v from `lo` (unit coordinates) with
    /// `state` (and, with the parameters on the host, their rounded copy).
    pub fn load(&mut self, be: &B, u: usize, lo: usize, state: &[Vec<f32>; 3]) -> BResult<()> {
        if let Some(hs) = self.host.as_mut() {
            let st = &mut hs.units[u];
            let r = lo - st.off..lo - st.off + state[0].len();
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
        let unit = &mut hs.units[u];
        let staged = match unit.params.as_mut() {
            Some(p) => p,
            None => hs.param_slots.first_mut().expect("staging allocated"),
        };
        write_rounded(be.host_buf_mut(staged)?, &unit.master[..len]);
        let e = be.buf_from_host(staged, Loc::all(len), dst, doff)?;
        be.wait_event(&e)
    }
}

/// `values` rounded into a host compute-precision buffer.
fn write_rounded(dst: HostValues<'_>, values: &[f32]) {
    match dst {
        HostValues::Bf16(o) => {
            for (d, &x) in o.iter_mut().zip(values) {
                *d = half::bf16::from_f32(x).to_bits();
            }
        }
        HostValues::F32(o) => o[..values.len()].copy_from_slice(values),
    }
}

/// AdamW segments of the held elements `off..off + len` of a unit's tensors: state and
/// gradient from 0, rounded parameters from `pbase`.
fn segments(tensors: &[TensorSpec], off: usize, len: usize, pbase: usize) -> Vec<AdamWSegment> {
    let (lo, hi) = (off, off + len);
    tensors
        .iter()
        .filter_map(|ts| {
            let (a, b) = (ts.loc.off.max(lo), ts.loc.end().min(hi));
            (a < b).then_some(AdamWSegment {
                poff: a - lo + pbase,
                moff: a - lo,
                goff: a - lo,
                len: b - a,
                decay: ts.decay,
            })
        })
        .collect()
}
