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
//! Abort: communicators are created non-blocking (`ncclCommInitRankConfig` with
//! `blocking = 0`), so no NCCL call ever blocks the calling thread: a call that is not done
//! returns `ncclInProgress` and is polled with `ncclCommGetAsyncError`. An [`NcclAbort`]
//! handle (from [`NcclComm::abort_handle`], or made first and passed to
//! [`NcclComm::new_abortable`] so that even a join that never completes can be cut short)
//! calls `ncclCommAbort` from any thread: kernels waiting for a peer that will never come
//! stop, a thread blocked on the stream returns, and every later call on the communicator
//! fails with "aborted". The launcher's hang watchdog uses it to stop GPU ranks.
//!
//! Collectives run on a communication stream of their own. Each first waits (an event)
//! for the work queued so far on the compute stream the communicator was made with; a
//! plain collective then makes the compute stream wait for it, while a started one
//! (`all_gather_start`, `reduce_scatter_start`) returns a `Pending` that the caller hands
//! to `Group::wait` just before it reads the result — that is how ZeRO-3 prefetch and the
//! overlapped gradient reduce-scatter work.
//! Keep an `NcclComm` on the thread that made it (NCCL uses the thread's current device).
//!
//! Determinism: NCCL's reduction order is fixed for a given communicator, message size
//! and world, so results repeat run to run, but it is not the rank order 0, 1, ... of
//! the host communicator; results can differ from `tcp::TcpComm` in the last bit.
//!
//! Keep `NCCL_NVLS_ENABLE=0` in the environment of every process that uses this (NVLink
//! multicast can take a shared host's GPUs out of service); nothing here enables it.

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{self, sys, Id, NcclType};

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
    code_err(op, e.0)
}

/// As [`nccl_err`], from a raw result code.
fn code_err(op: &'static str, code: sys::ncclResult_t) -> CommError {
    let e = nccl::result::NcclError(code);
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

fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// `NCCL_VERSION(major, minor, patch)` of nccl.h (NCCL >= 2.9).
const fn nccl_version_code(major: i32, minor: i32, patch: i32) -> i32 {
    major * 10000 + minor * 100 + patch
}

/// The version of the `ncclConfig_t` layout cudarc's bindings describe (its `nccl` feature
/// selects the NCCL 2.30 headers).
const CONFIG_HEADER_VERSION: i32 = nccl_version_code(2, 30, 0);

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every other field is NCCL's "undefined"
/// marker (`INT_MIN` / null), i.e. NCCL's default. `version` is that of the loaded library
/// when it is older than the headers (NCCL reads only the fields its version knows; the
/// layout only ever grows at the end).
fn nonblocking_config(library_version: i32) -> sys::ncclConfig_t {
    const UNDEF: core::ffi::c_int = core::ffi::c_int::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: library_version.clamp(nccl_version_code(2, 14, 0), CONFIG_HEADER_VERSION) as core::ffi::c_uint,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// The raw communicator, shared between the [`NcclComm`] that uses it and the
/// [`NcclAbort`] handles that may abort it from other threads. Every NCCL call is made with
/// the lock held; on a non-blocking communicator no call blocks, so an abort never waits
/// long. Null before the communicator exists and after it was aborted.
struct RawComm {
    comm: Mutex<CommPtr>,
    /// The same pointer, for an abort that cannot get the lock (a thread stuck inside an
    /// NCCL call, e.g. a kernel launch on a hung device whose queue is full).
    unlocked: AtomicPtr<sys::ncclComm>,
    aborted: AtomicBool,
}

/// How long an abort waits for the lock before aborting without it.
const ABORT_LOCK_PATIENCE: Duration = Duration::from_secs(2);

/// `ncclComm_t` is a pointer to NCCL's communicator state; NCCL allows it to be used from
/// any thread (and `ncclCommAbort` from another thread than the one using it).
struct CommPtr(sys::ncclComm_t);
// SAFETY: see above; every use goes through `RawComm::comm`'s lock.
unsafe impl Send for CommPtr {}

impl RawComm {
    fn lock(&self) -> MutexGuard<'_, CommPtr> {
        // A panic while holding the lock leaves only a pointer behind: still usable.
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn aborted_err(op: &'static str) -> CommError {
        CommError::Nccl {
            op,
            detail: "the communicator was aborted (the launcher stopped the job, or a peer failed)".into(),
        }
    }

    /// Make one NCCL call on the communicator; wait (polling, lock released in between)
    /// while it reports `ncclInProgress`.
    fn call(&self, op: &'static str, f: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t) -> Result<(), CommError> {
        let result = {
            let g = self.lock();
            if g.0.is_null() {
                return Err(RawComm::aborted_err(op));
            }
            f(g.0)
        };
        match result {
            sys::ncclResult_t::ncclSuccess => Ok(()),
            sys::ncclResult_t::ncclInProgress => self.wait_ready(op),
            e => Err(code_err(op, e)),
        }
    }

    /// Poll `ncclCommGetAsyncError` until the communicator's last operation is done.
    fn wait_ready(&self, op: &'static str) -> Result<(), CommError> {
        let mut polls = 0u32;
        loop {
            polls = polls.saturating_add(1);
            let state = {
                let g = self.lock();
                if g.0.is_null() {
                    return Err(RawComm::aborted_err(op));
                }
                let mut state = sys::ncclResult_t::ncclSuccess;
                // SAFETY: a live communicator (checked under the lock) and a valid out-pointer.
                let r = unsafe { sys::ncclCommGetAsyncError(g.0, &mut state) };
                if r != sys::ncclResult_t::ncclSuccess {
                    return Err(code_err(op, r));
                }
                state
            };
            match state {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress if polls < 1000 => std::thread::yield_now(),
                sys::ncclResult_t::ncclInProgress => std::thread::sleep(Duration::from_micros(200)),
                e => return Err(code_err(op, e)),
            }
        }
    }

    /// `ncclCommAbort`, once; later calls (and every NCCL call after) see "aborted".
    fn abort(&self) -> Result<(), CommError> {
        self.aborted.store(true, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + ABORT_LOCK_PATIENCE;
        let comm = loop {
            match self.comm.try_lock() {
                Ok(mut g) => break std::mem::replace(&mut g.0, std::ptr::null_mut()),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    break std::mem::replace(&mut p.into_inner().0, std::ptr::null_mut())
                }
                Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                // Another thread is stuck inside NCCL with the lock: abort under it, which is
                // what ncclCommAbort is for (the process is stopping).
                Err(std::sync::TryLockError::WouldBlock) => break self.unlocked.load(Ordering::SeqCst),
            }
        };
        // Whoever swaps the pointer out of `unlocked` makes the one ncclCommAbort call.
        let swapped = self.unlocked.compare_exchange(comm, std::ptr::null_mut(), Ordering::SeqCst, Ordering::SeqCst);
        if comm.is_null() || swapped.is_err() {
            return Ok(());
        }
        // SAFETY: a live communicator, aborted once (the compare-exchange above), never used
        // again by this process (the locked pointer is cleared, or the thread holding it is stuck).
        match unsafe { sys::ncclCommAbort(comm) } {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            e => Err(code_err("abort", e)),
        }
    }
}

/// Aborts an [`NcclComm`] from any thread (see the module docs). Cloning shares the handle.
#[derive(Clone)]
pub struct NcclAbort(Arc<RawComm>);

impl std::fmt::Debug for NcclAbort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclAbort").field("aborted", &self.is_aborted()).finish()
    }
}

impl Default for NcclAbort {
    fn default() -> Self {
        NcclAbort::new()
    }
}

impl NcclAbort {
    /// A handle for a communicator not made yet: pass it to [`NcclComm::new_abortable`].
    /// Aborting it first makes that join fail at once.
    pub fn new() -> NcclAbort {
        NcclAbort(Arc::new(RawComm {
            comm: Mutex::new(CommPtr(std::ptr::null_mut())),
            unlocked: AtomicPtr::new(std::ptr::null_mut()),
            aborted: AtomicBool::new(false),
        }))
    }

    /// Abort the communicator (`ncclCommAbort`): its pending and future operations fail.
    /// Idempotent; safe from any thread, also while the communicator is being made.
    pub fn abort(&self) -> Result<(), CommError> {
        self.0.abort()
    }

    pub fn is_aborted(&self) -> bool {
        self.0.aborted.load(Ordering::SeqCst)
    }
}

/// One rank of an NCCL communicator; use it on the thread that made it.
pub struct NcclComm {
    raw: Arc<RawComm>,
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
        NcclComm::new_abortable(stream, rank, world, id, &NcclAbort::new())
    }

    /// As [`NcclComm::new`], with `abort` able to cut the join (and everything after) short
    /// from another thread. `abort` must be fresh (not used for another communicator).
    pub fn new_abortable(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: &[u8],
        abort: &NcclAbort,
    ) -> Result<NcclComm, CommError> {
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
        let id = *Id::uninit(raw).internal();
        let version = nccl::result::get_nccl_version().map_err(|e| nccl_err("version", e))?;
        let mut config = nonblocking_config(version);
        let (nranks, me) = (i32::try_from(world), i32::try_from(rank));
        let (Ok(nranks), Ok(me)) = (nranks, me) else {
            return Err(CommError::Other(format!("NCCL world {world} does not fit an int")));
        };
        let raw_comm = abort.0.clone();
        {
            let mut g = raw_comm.lock();
            if raw_comm.aborted.load(Ordering::SeqCst) {
                return Err(RawComm::aborted_err("init"));
            }
            if !g.0.is_null() {
                return Err(CommError::Other("an NcclAbort handle was passed to a second communicator".into()));
            }
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: valid out-pointer, a 128-byte unique id, and a config initialised as
            // NCCL_CONFIG_INITIALIZER does. Non-blocking: returns at once (ncclInProgress).
            let r = unsafe {
                sys::ncclCommInitRankConfig(&mut comm, nranks, sys::ncclUniqueId { internal: id }, me, &mut config)
            };
            if !comm.is_null() {
                g.0 = comm;
                raw_comm.unlocked.store(comm, Ordering::SeqCst);
            }
            match r {
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress if !comm.is_null() => {}
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {
                    return Err(CommError::Nccl { op: "init", detail: "NCCL returned no communicator".into() })
                }
                e => {
                    drop(g);
                    let _ = raw_comm.abort();
                    return Err(code_err("init", e));
                }
            }
        }
        // Every rank must join; abortable while we wait.
        if let Err(e) = raw_comm.wait_ready("init") {
            let _ = raw_comm.abort();
            return Err(e);
        }
        Ok(NcclComm {
            raw: raw_comm,
            stream,
            comm_stream,
            in_flight: Vec::new(),
            next_id: 1,
            rank,
            world,
            staging: None,
        })
    }

    /// A handle that aborts this communicator from any thread.
    pub fn abort_handle(&self) -> NcclAbort {
        NcclAbort(self.raw.clone())
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
    fn staged(&mut self, n: usize) -> Result<(&RawComm, &Arc<CudaStream>, &mut CudaSlice<f32>), CommError> {
        if self.staging.as_ref().is_none_or(|s| s.len() < n) {
            self.staging = None;
            let s = self.comm_stream.alloc_zeros::<f32>(n.max(64)).map_err(|e| cuda_err("alloc staging", e))?;
            self.staging = Some(s);
        }
        Ok((&self.raw, &self.comm_stream, self.staging.as_mut().expect("allocated above")))
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
        raw_all_gather(&self.raw, &self.comm_stream, send, recv)?;
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
        raw_reduce_scatter(&self.raw, &self.comm_stream, send, recv, op)?;
        Ok(())
    }

    fn dev_all_reduce<T: NcclType>(&mut self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<(), CommError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.after_compute("all_reduce")?;
        raw_all_reduce(&self.raw, &self.comm_stream, buf, op)?;
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
        raw_broadcast(&self.raw, &self.comm_stream, buf, root)?;
        Ok(())
    }
}

impl NcclComm {
    /// A point-to-point exchange with `peer` (`ncclSend` and `ncclRecv` in one group), then
    /// a wait on the host: the network check times links with it. Ranks call it in rounds of
    /// disjoint pairs; `None` sits a round out (nothing to do on NCCL's side).
    pub fn exchange_with<T: NcclType>(
        &mut self,
        peer: Option<usize>,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<(), CommError> {
        let Some(p) = peer else { return Ok(()) };
        let n = send.len();
        if recv.len() != n || p >= self.world || p == self.rank {
            return Err(self.bad_size(
                "exchange",
                format!("rank {} with rank {p}: send has {n} elements, recv {}", self.rank, recv.len()),
            ));
        }
        let peer = i32::try_from(p).map_err(|_| CommError::Other(format!("rank {p} does not fit an int")))?;
        self.after_compute("exchange")?;
        {
            let stream = &self.comm_stream;
            let (src, _read) = send.device_ptr(stream);
            let (dst, _write) = recv.device_ptr_mut(stream);
            let s = nccl_stream(stream);
            // SAFETY: device pointers of live buffers of n elements (checked above), on the
            // communication stream; the group is opened and closed within this one call.
            self.raw.call("exchange", |c| unsafe {
                let opened = sys::ncclGroupStart();
                if opened != sys::ncclResult_t::ncclSuccess {
                    return opened;
                }
                let sent = sys::ncclSend(src as _, n, T::as_nccl_type(), peer, c, s);
                let got = sys::ncclRecv(dst as _, n, T::as_nccl_type(), peer, c, s);
                let closed = sys::ncclGroupEnd();
                [sent, got].into_iter().find(|r| !ok_or_pending(*r)).unwrap_or(closed)
            })?;
        }
        self.sync("exchange")
    }
}

/// A call that succeeded or is still running (a non-blocking communicator's answer).
fn ok_or_pending(r: sys::ncclResult_t) -> bool {
    matches!(r, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress)
}

/// The raw stream handle NCCL wants.
fn nccl_stream(stream: &CudaStream) -> sys::cudaStream_t {
    stream.cu_stream() as sys::cudaStream_t
}

/// `ncclAllGather` of `send` (per rank) into `recv` on `stream`.
fn raw_all_gather<T: NcclType>(
    raw: &RawComm,
    stream: &CudaStream,
    send: &impl DevicePtr<T>,
    recv: &mut impl DevicePtrMut<T>,
) -> Result<(), CommError> {
    let n = send.len();
    let (src, _read) = send.device_ptr(stream);
    let (dst, _write) = recv.device_ptr_mut(stream);
    let s = nccl_stream(stream);
    // SAFETY: device pointers of live buffers of the sizes checked by the callers, on `stream`.
    raw.call("all_gather", |c| unsafe { sys::ncclAllGather(src as _, dst as _, n, T::as_nccl_type(), c, s) })
}

/// `ncclReduceScatter` of `send` (world × recv) into `recv` on `stream`.
fn raw_reduce_scatter<T: NcclType>(
    raw: &RawComm,
    stream: &CudaStream,
    send: &impl DevicePtr<T>,
    recv: &mut impl DevicePtrMut<T>,
    op: ReduceOp,
) -> Result<(), CommError> {
    let n = recv.len();
    let (src, _read) = send.device_ptr(stream);
    let (dst, _write) = recv.device_ptr_mut(stream);
    let s = nccl_stream(stream);
    // SAFETY: as in raw_all_gather.
    raw.call("reduce_scatter", |c| unsafe {
        sys::ncclReduceScatter(src as _, dst as _, n, T::as_nccl_type(), red_op(op), c, s)
    })
}

/// In-place `ncclAllReduce` of `buf` on `stream`.
fn raw_all_reduce<T: NcclType>(
    raw: &RawComm,
    stream: &CudaStream,
    buf: &mut impl DevicePtrMut<T>,
    op: ReduceOp,
) -> Result<(), CommError> {
    let n = buf.len();
    let (ptr, _write) = buf.device_ptr_mut(stream);
    let s = nccl_stream(stream);
    // SAFETY: as in raw_all_gather (in place: same send and receive buffer).
    raw.call("all_reduce", |c| unsafe {
        sys::ncclAllReduce(ptr as _, ptr as _, n, T::as_nccl_type(), red_op(op), c, s)
    })
}

/// In-place `ncclBroadcast` of `buf` from `root` on `stream`.
fn raw_broadcast<T: NcclType>(
    raw: &RawComm,
    stream: &CudaStream,
    buf: &mut impl DevicePtrMut<T>,
    root: usize,
) -> Result<(), CommError> {
    let n = buf.len();
    let root =
        i32::try_from(root).map_err(|_| CommError::Other(format!("broadcast root {root} does not fit an int")))?;
    let (ptr, _write) = buf.device_ptr_mut(stream);
    let s = nccl_stream(stream);
    // SAFETY: as in raw_all_gather (in place).
    raw.call("broadcast", |c| unsafe { sys::ncclBroadcast(ptr as _, ptr as _, n, T::as_nccl_type(), root, c, s) })
}

impl Drop for NcclComm {
    /// Aborted rather than destroyed: `ncclCommDestroy` waits for pending operations,
    /// which never finish when a peer is gone (what cudarc's `Comm` did as well).
    fn drop(&mut self) {
        let _ = self.raw.abort();
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
        raw_all_reduce(comm, stream, &mut one, ReduceOp::Sum)?;
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
        {
            let (base, _write) = buf.device_ptr_mut(&self.comm_stream);
            let own = base + (self.rank * n * std::mem::size_of::<T>()) as u64;
            let s = nccl_stream(&self.comm_stream);
            // SAFETY: `own` and `base` address n and world * n elements of `buf` (checked
            // above), which outlives the call; NCCL documents sendbuff == recvbuff + rank *
            // sendcount as the in-place all-gather.
            self.raw.call("all_gather_in_place", |c| unsafe {
                sys::ncclAllGather(own as _, base as _, n, T::as_nccl_type(), c, s)
            })?;
        }
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
        raw_all_gather(comm, stream, &src, &mut dst)?;
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
        raw_reduce_scatter(comm, stream, &src, &mut dst, op)?;
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
        raw_all_reduce(comm, stream, &mut v, op)?;
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
        raw_broadcast(comm, stream, &mut v, root)?;
        stream.memcpy_dtoh(&v, buf).map_err(|e| cuda_err("broadcast", e))?;
        self.sync("broadcast")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn communicators_are_made_non_blocking() {
        let c = nonblocking_config(nccl_version_code(2, 28, 3));
        assert_eq!((c.blocking, c.magic, c.size), (0, 0xcafe_beef, std::mem::size_of::<sys::ncclConfig_t>()));
        assert_eq!(c.version, 22803);
        assert_eq!(c.minCTAs, i32::MIN, "everything else is NCCL's default");
        assert_eq!(nonblocking_config(nccl_version_code(2, 40, 0)).version, CONFIG_HEADER_VERSION as u32);
    }

    #[test]
    fn an_abort_handle_works_before_any_communicator_exists() {
        // No NCCL call is made for a handle whose communicator was never created.
        let a = NcclAbort::new();
        assert!(!a.is_aborted());
        a.abort().expect("abort");
        a.clone().abort().expect("idempotent");
        assert!(a.is_aborted());
        let e = a.0.call("all_reduce", |_| unreachable!("no call on an aborted communicator")).unwrap_err();
        assert!(e.to_string().contains("aborted"), "{e}");
    }
}
