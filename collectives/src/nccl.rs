//! The NCCL communicator: [`Communicator`] on GPU buffers (`CudaSlice<bf16>` for
//! parameters, `CudaSlice<f32>` for gradients) and on host scalars (`[f32]`, staged
//! through a small device buffer), for one rank per process and GPU.
//!
//! NCCL is loaded at run time (cudarc's `dynamic-loading`), so this builds on machines
//! without CUDA; [`nccl_available`] turns a missing `libnccl.so` into an error instead
//! of cudarc's panic. Ranks meet through NCCL's 128-byte unique id: rank 0 makes it
//! with [`nccl_unique_id`] and ships it to the others by any side channel (a command
//! line, the launcher's TCP rendezvous); every rank then calls [`NcclComm::new`], which
//! blocks until all have joined.
//!
//! Collectives run on a communication stream of their own. Each first waits (an event)
//! for the work queued so far on the compute stream the communicator was made with; a
//! plain collective then makes the compute stream wait for it, while a started one
//! (`all_gather_start`, `reduce_scatter_start`) returns a `Pending` that the caller hands
//! to `Group::wait` just before it reads the result — that is how ZeRO-3 prefetch and the
//! overlapped gradient reduce-scatter work.
//! `NcclComm` is not `Send` (cudarc's `Comm` is not): keep it on the thread that made it.
//!
//! Determinism: NCCL's reduction order is fixed for a given communicator, message size
//! and world, so results repeat run to run, but it is not the rank order 0, 1, ... of
//! the host communicator; results can differ from `tcp::TcpComm` in the last bit.
//!
//! Keep `NCCL_NVLS_ENABLE=0` in the environment of every process that uses this (NVLink
//! multicast can take a shared host's GPUs out of service); nothing here enables it.

use std::ffi::CStr;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::{self, Comm, Id, NcclType};

use crate::{AllGatherInPlace, CommError, Communicator, Group, Pending, ReduceOp};

/// Bytes in an NCCL unique id.
pub const NCCL_ID_BYTES: usize = 128;

/// Checks that `libnccl.so` can be loaded, and names where it is looked for if not.
pub fn nccl_available() -> Result<(), CommError> {
    // SAFETY: only probes the dynamic loader; no NCCL function is called.
    if unsafe { nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CommError::Nccl {
            op: "load",
            detail: format!(
                "the NCCL library was not found (tried {:?} on the loader path: ldconfig's cache and LD_LIBRARY_PATH). \
                 Install NCCL (e.g. /usr/lib/x86_64-linux-gnu/libnccl.so), or, for the pip wheel, put a `libnccl.so` \
                 symlink to its libnccl.so.2 in a directory on LD_LIBRARY_PATH",
                cudarc::get_lib_name_candidates("nccl")
            ),
        })
    }
}

/// The loaded NCCL's version as `major.minor.patch`.
pub fn nccl_version() -> Result<String, CommError> {
    nccl_available()?;
    let v = nccl::result::get_nccl_version().map_err(|e| nccl_err("version", e))?;
    // NCCL >= 2.9 encodes the version as major*10000 + minor*100 + patch.
    Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

/// A fresh NCCL unique id (rank 0 makes it; every rank passes the same bytes to
/// [`NcclComm::new`]).
pub fn nccl_unique_id() -> Result<Vec<u8>, CommError> {
    nccl_available()?;
    let id = Id::new().map_err(|e| nccl_err("get unique id", e))?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

/// Turns an NCCL error into a [`CommError`] that says what happened: cudarc's
/// `NcclError` prints only its type name, so spell out the code and NCCL's own text.
fn nccl_err(op: &'static str, e: nccl::result::NcclError) -> CommError {
    // SAFETY: both functions return pointers to static, NUL-terminated strings (or
    // null); ncclGetLastError ignores its argument, which may be null.
    let (what, last) = unsafe {
        let s = nccl::sys::ncclGetErrorString(e.0);
        let what = if s.is_null() { String::new() } else { CStr::from_ptr(s).to_string_lossy().into_owned() };
        let l = nccl::sys::ncclGetLastError(std::ptr::null_mut());
        let last = if l.is_null() { String::new() } else { CStr::from_ptr(l).to_string_lossy().into_owned() };
        (what, last)
    };
    let mut detail = format!("{:?}", e.0);
    if !what.is_empty() {
        detail.push_str(&format!(" ({what})"));
    }
    if !last.is_empty() {
        detail.push_str(&format!("; last NCCL message: {last}"));
    }
    detail.push_str(". Run with NCCL_DEBUG=WARN for NCCL's log");
    CommError::Nccl { op, detail }
}

fn cuda_err(op: &'static str, e: cudarc::driver::DriverError) -> CommError {
    CommError::Other(format!("CUDA error while staging `{op}`: {e}"))
}

fn red_op(op: ReduceOp) -> nccl::ReduceOp {
    match op {
        ReduceOp::Sum => nccl::ReduceOp::Sum,
        ReduceOp::Avg => nccl::ReduceOp::Avg,
        ReduceOp::Max => nccl::ReduceOp::Max,
    }
}

/// One rank of an NCCL communicator. Not `Send`: use it on the thread that made it.
pub struct NcclComm {
    comm: Comm,
    /// The compute stream: device collectives are ordered after the work queued on it so
    /// far, and (synchronous ones) before anything queued on it afterwards.
    stream: Arc<CudaStream>,
    /// The communication stream every collective runs on, so started collectives
    /// (`*_start`) overlap the compute stream's work.
    comm_stream: Arc<CudaStream>,
    /// Completion events of started collectives, by `Pending` id.
    in_flight: Vec<(u64, cudarc::driver::CudaEvent)>,
    next_id: u64,
    rank: usize,
    world: usize,
    /// Device staging for the `[f32]` (host) collectives; grown on demand.
    staging: Option<CudaSlice<f32>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

impl NcclComm {
    /// Join the communicator `id` (from [`nccl_unique_id`] on rank 0) as `rank` of
    /// `world`. Blocks until every rank has joined. Collectives run on `stream`, whose
    /// context's device this rank uses.
    pub fn new(stream: Arc<CudaStream>, rank: usize, world: usize, id: &[u8]) -> Result<NcclComm, CommError> {
        nccl_available()?;
        if world == 0 || rank >= world {
            return Err(CommError::Other(format!("NCCL rank {rank} is not in a world of {world}")));
        }
        if id.len() != NCCL_ID_BYTES {
            return Err(CommError::Other(format!(
                "an NCCL unique id has {NCCL_ID_BYTES} bytes, got {} (was it passed whole?)",
                id.len()
            )));
        }
        let mut raw = [0 as core::ffi::c_char; NCCL_ID_BYTES];
        for (d, s) in raw.iter_mut().zip(id) {
            *d = *s as core::ffi::c_char;
        }
        // NCCL uses the calling thread's current device.
        stream.context().bind_to_thread().map_err(|e| cuda_err("init", e))?;
        let comm_stream = stream.context().new_stream().map_err(|e| cuda_err("init", e))?;
        let comm =
            Comm::from_rank(comm_stream.clone(), rank, world, Id::uninit(raw)).map_err(|e| nccl_err("init", e))?;
        Ok(NcclComm { comm, stream, comm_stream, in_flight: Vec::new(), next_id: 1, rank, world, staging: None })
    }

    /// The compute stream the collectives are ordered with.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Make the communication stream wait for everything queued on the compute stream
    /// (inputs written, and earlier readers of the output buffer done).
    fn after_compute(&self, op: &'static str) -> Result<(), CommError> {
        let ev = self.stream.record_event(None).map_err(|e| cuda_err(op, e))?;
        self.comm_stream.wait(&ev).map_err(|e| cuda_err(op, e))
    }

    /// Event marking the end of the last collective queued on the communication stream.
    fn done_event(&self, op: &'static str) -> Result<cudarc::driver::CudaEvent, CommError> {
        self.comm_stream.record_event(None).map_err(|e| cuda_err(op, e))
    }

    /// Synchronous semantics: later compute-stream work waits for the collective.
    fn join(&self, op: &'static str) -> Result<(), CommError> {
        let ev = self.done_event(op)?;
        self.stream.wait(&ev).map_err(|e| cuda_err(op, e))
    }

    /// Started semantics: remember the completion event for `Group::wait`.
    fn pending(&mut self, op: &'static str) -> Result<Pending, CommError> {
        let ev = self.done_event(op)?;
        let id = self.next_id;
        self.next_id += 1;
        self.in_flight.push((id, ev));
        Ok(Pending(id))
    }

    fn bad_size(&self, op: &'static str, detail: String) -> CommError {
        CommError::BadSize { op, world: self.world, detail }
    }

    /// The communicator and a device staging buffer of at least `n` elements (for the
    /// host collectives), borrowed together.
    fn staged(&mut self, n: usize) -> Result<(&Comm, &Arc<CudaStream>, &mut CudaSlice<f32>), CommError> {
        if self.staging.as_ref().is_none_or(|s| s.len() < n) {
            self.staging = None;
            let s = self.comm_stream.alloc_zeros::<f32>(n.max(64)).map_err(|e| cuda_err("alloc staging", e))?;
            self.staging = Some(s);
        }
        Ok((&self.comm, &self.comm_stream, self.staging.as_mut().expect("allocated above")))
    }

    /// Host collectives: wait on the host for the communication stream.
    fn sync(&self, op: &'static str) -> Result<(), CommError> {
        self.comm_stream.synchronize().map_err(|e| cuda_err(op, e))
    }

    fn dev_all_gather<T: NcclType>(&mut self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>) -> Result<(), CommError> {
        let n = send.len();
        if recv.len() != n * self.world {
            return Err(self.bad_size(
                "all_gather",
                format!("send has {n} elements, so recv needs {} but has {}", n * self.world, recv.len()),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        self.after_compute("all_gather")?;
        self.comm.all_gather(send, recv).map_err(|e| nccl_err("all_gather", e))?;
        Ok(())
    }

    fn dev_reduce_scatter<T: NcclType>(
        &mut self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let n = recv.len();
        if send.len() != n * self.world {
            return Err(self.bad_size(
                "reduce_scatter",
                format!("recv has {n} elements, so send needs {} but has {}", n * self.world, send.len()),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        self.after_compute("reduce_scatter")?;
        self.comm.reduce_scatter(send, recv, &red_op(op)).map_err(|e| nccl_err("reduce_scatter", e))?;
        Ok(())
    }

    fn dev_all_reduce<T: NcclType>(&mut self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<(), CommError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.after_compute("all_reduce")?;
        self.comm.all_reduce_in_place(buf, &red_op(op)).map_err(|e| nccl_err("all_reduce", e))?;
        Ok(())
    }

    fn dev_broadcast<T: NcclType>(&mut self, buf: &mut CudaSlice<T>, root: usize) -> Result<(), CommError> {
        if root >= self.world {
            return Err(self.bad_size("broadcast", format!("root {root} is not a rank")));
        }
        if buf.is_empty() {
            return Ok(());
        }
        self.after_compute("broadcast")?;
        self.comm.broadcast_in_place(buf, root as i32).map_err(|e| nccl_err("broadcast", e))?;
        Ok(())
    }
}

impl Group for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    /// An all-reduce of one element, then a wait for it: every rank has arrived once
    /// it completes.
    fn barrier(&mut self) -> Result<(), CommError> {
        self.after_compute("barrier")?;
        let (comm, stream, s) = self.staged(1)?;
        let mut one = s.slice_mut(0..1);
        stream.memcpy_htod(&[1.0f32], &mut one).map_err(|e| cuda_err("barrier", e))?;
        comm.all_reduce_in_place(&mut one, &nccl::ReduceOp::Sum).map_err(|e| nccl_err("barrier", e))?;
        self.sync("barrier")
    }
    fn wait(&mut self, p: Pending) -> Result<(), CommError> {
        if p == Pending::DONE {
            return Ok(());
        }
        let k = self
            .in_flight
            .iter()
            .position(|(id, _)| *id == p.0)
            .ok_or_else(|| CommError::Other(format!("wait on unknown or already-waited collective #{}", p.0)))?;
        let (_, ev) = self.in_flight.swap_remove(k);
        self.stream.wait(&ev).map_err(|e| cuda_err("wait", e))
    }
}

impl<T: NcclType> AllGatherInPlace<CudaSlice<T>> for NcclComm {
    fn all_gather_in_place_start(&mut self, buf: &mut CudaSlice<T>) -> Result<Pending, CommError> {
        let n = buf.len() / self.world;
        if n * self.world != buf.len() {
            return Err(self.bad_size(
                "all_gather_in_place",
                format!("{} elements do not split into {} equal pieces", buf.len(), self.world),
            ));
        }
        if n == 0 {
            return Ok(Pending::DONE);
        }
        self.after_compute("all_gather_in_place")?;
        // NCCL's in-place form: the send buffer is this rank's piece of the receive buffer.
        // It is borrowed as a second slice over the same memory and released, not freed.
        let base = {
            let (p, _g) = buf.device_ptr(&self.comm_stream);
            p
        };
        let own = base + (self.rank * n * std::mem::size_of::<T>()) as u64;
        // SAFETY: `own` addresses n elements inside `buf`, which outlives this call; the
        // view is leaked (not freed) right after the call; NCCL documents sendbuff ==
        // recvbuff + rank * sendcount as the in-place all-gather.
        let send = unsafe { self.comm_stream.upgrade_device_ptr::<T>(own, n) };
        let r = self.comm.all_gather(&send, buf);
        let _ = send.leak();
        r.map_err(|e| nccl_err("all_gather_in_place", e))?;
        self.pending("all_gather_in_place")
    }
}

impl<T: NcclType> Communicator<CudaSlice<T>> for NcclComm {
    fn all_gather(&mut self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>) -> Result<(), CommError> {
        self.dev_all_gather(send, recv)?;
        self.join("all_gather")
    }
    fn reduce_scatter(&mut self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>, op: ReduceOp) -> Result<(), CommError> {
        self.dev_reduce_scatter(send, recv, op)?;
        self.join("reduce_scatter")
    }
    fn all_reduce(&mut self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<(), CommError> {
        self.dev_all_reduce(buf, op)?;
        self.join("all_reduce")
    }
    fn broadcast(&mut self, buf: &mut CudaSlice<T>, root: usize) -> Result<(), CommError> {
        self.dev_broadcast(buf, root)?;
        self.join("broadcast")
    }
    fn all_gather_start(&mut self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>) -> Result<Pending, CommError> {
        self.dev_all_gather(send, recv)?;
        self.pending("all_gather")
    }
    fn reduce_scatter_start(
        &mut self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<Pending, CommError> {
        self.dev_reduce_scatter(send, recv, op)?;
        self.pending("reduce_scatter")
    }
    fn all_reduce_start(&mut self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<Pending, CommError> {
        self.dev_all_reduce(buf, op)?;
        self.pending("all_reduce")
    }
}

/// Host scalars (losses, norms): copied to the device, reduced there, copied back.
/// Each call waits for its result, so the slices hold the answer on return.
impl Communicator<[f32]> for NcclComm {
    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let (n, w) = (send.len(), self.world);
        if recv.len() != n * w {
            return Err(self.bad_size(
                "all_gather",
                format!("send has {n} elements, so recv needs {} but has {}", n * w, recv.len()),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let (comm, stream, s) = self.staged(n * (w + 1))?;
        let (mut src, mut rest) = s.split_at_mut(n);
        let mut dst = rest.slice_mut(0..n * w);
        stream.memcpy_htod(send, &mut src).map_err(|e| cuda_err("all_gather", e))?;
        comm.all_gather(&src, &mut dst).map_err(|e| nccl_err("all_gather", e))?;
        stream.memcpy_dtoh(&dst, recv).map_err(|e| cuda_err("all_gather", e))?;
        self.sync("all_gather")
    }
    fn reduce_scatter(&mut self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let (n, w) = (recv.len(), self.world);
        if send.len() != n * w {
            return Err(self.bad_size(
                "reduce_scatter",
                format!("recv has {n} elements, so send needs {} but has {}", n * w, send.len()),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let (comm, stream, s) = self.staged(n * (w + 1))?;
        let (mut src, mut rest) = s.split_at_mut(n * w);
        let mut dst = rest.slice_mut(0..n);
        stream.memcpy_htod(send, &mut src).map_err(|e| cuda_err("reduce_scatter", e))?;
        comm.reduce_scatter(&src, &mut dst, &red_op(op)).map_err(|e| nccl_err("reduce_scatter", e))?;
        stream.memcpy_dtoh(&dst, recv).map_err(|e| cuda_err("reduce_scatter", e))?;
        self.sync("reduce_scatter")
    }
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let n = buf.len();
        if n == 0 {
            return Ok(());
        }
        let (comm, stream, s) = self.staged(n)?;
        let mut v = s.slice_mut(0..n);
        stream.memcpy_htod(&*buf, &mut v).map_err(|e| cuda_err("all_reduce", e))?;
        comm.all_reduce_in_place(&mut v, &red_op(op)).map_err(|e| nccl_err("all_reduce", e))?;
        stream.memcpy_dtoh(&v, buf).map_err(|e| cuda_err("all_reduce", e))?;
        self.sync("all_reduce")
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root >= self.world {
            return Err(self.bad_size("broadcast", format!("root {root} is not a rank")));
        }
        let n = buf.len();
        if n == 0 {
            return Ok(());
        }
        let (comm, stream, s) = self.staged(n)?;
        let mut v = s.slice_mut(0..n);
        stream.memcpy_htod(&*buf, &mut v).map_err(|e| cuda_err("broadcast", e))?;
        comm.broadcast_in_place(&mut v, root as i32).map_err(|e| nccl_err("broadcast", e))?;
        stream.memcpy_dtoh(&v, buf).map_err(|e| cuda_err("broadcast", e))?;
        self.sync("broadcast")
    }
}
