//! Asynchronous checkpoints (`checkpoint.async = true`): at the step boundary each rank
//! copies its shard (fp32 master weights, AdamW m and v of its range of every unit) into the
//! engine's host copy (`zero/snapshot.rs`: page-locked on a GPU) — the only part training
//! waits for — and a thread of its own writes it while training goes on. The files and their
//! order are the synchronous save's (`save.rs`): each rank's shard under `.step_N.partial/`,
//! fsynced, then its summary; rank 0 writes the manifest last and renames the directory into
//! place, so a crash mid-write leaves the previous checkpoint the latest valid one.
//!
//! The completion barrier between ranks (rank 0 may publish only once every rank's shard is
//! durable) must not block training, and the control channel belongs to the launcher, not to
//! this library; it is the shard summaries themselves: a rank writes its `.sum.json`
//! atomically after its shard is fsynced (as the synchronous save does before its barrier),
//! and rank 0's writer thread waits until every rank's summary is in the partial directory —
//! the same shared checkpoint directory the synchronous save already reads them from — then
//! publishes. Only the next save and the end of training wait for a save in flight
//! ([`BackgroundSaves::wait`]), which also returns the host copy to the engine; an error of the
//! background write (a full disk) surfaces there, on every rank that hit it, and stops the job
//! like a synchronous save's would.

use super::manifest::Segment;
use super::save::{make_partial, publish, write_shard, ManifestBase, SaveDirs, SaveMeta, TAGS};
use super::stream::ReadFn;
use super::{shard_file_name, CheckpointError};
use crate::backend::Backend;
use crate::zero::snapshot::ShardCopy;
use crate::zero::{Engine, EngineComm};
use crate::TrainError;
use collectives::Group;
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a background writer hands back: the host copy, and how the write went.
type Finished<B> = (ShardCopy<B>, Result<(), TrainError>);

/// The save in flight.
struct InFlight<B: Backend> {
    step: u64,
    dir: PathBuf,
    worker: JoinHandle<Finished<B>>,
    /// Set when the trainer goes away without waiting: rank 0's writer stops waiting for the
    /// other ranks' summaries (the partial directory stays, never a checkpoint).
    abandon: Arc<AtomicBool>,
}

/// How a started save went on the training thread (for the log, and the stall measurements).
#[derive(Debug, Clone, Copy)]
pub struct Started {
    /// Waiting for the previous save to finish.
    pub waited_s: f64,
    /// Copying the shard to host memory, as far as training waits for it (host state: the
    /// copy; device state: queueing it).
    pub copy_s: f64,
    pub bytes: u64,
}

/// At most one background save per rank.
pub struct BackgroundSaves<B: Backend> {
    in_flight: Option<InFlight<B>>,
}

impl<B: Backend> Default for BackgroundSaves<B> {
    fn default() -> Self {
        BackgroundSaves { in_flight: None }
    }
}

/// How often rank 0's writer looks for the other ranks' summaries.
const POLL: Duration = Duration::from_millis(20);

impl<B: Backend> BackgroundSaves<B> {
    /// Wait for the save in flight, if any, and give its host copy back to `eng`: this rank's
    /// shard is durable (rank 0: the checkpoint is published). Its directory, or the error
    /// of its write.
    pub fn wait(&mut self, eng: &mut Engine<B>) -> Result<Option<PathBuf>, TrainError> {
        let Some(f) = self.in_flight.take() else { return Ok(None) };
        let (copy, result) = f.worker.join().map_err(|_| {
            TrainError::Invalid(format!("the background writer of checkpoint step {} panicked", f.step))
        })?;
        eng.return_shard_copy(copy);
        let root = f.dir.parent().map_or_else(|| f.dir.clone(), Path::to_path_buf);
        result.map_err(|e| match e {
            // A checkpoint problem (a full disk) stays one, as in a synchronous save (exit code 2).
            TrainError::Checkpoint(error) => TrainError::Checkpoint(CheckpointError::Background {
                rank: eng.rank,
                step: f.step,
                root,
                error: Box::new(error),
            }),
            e => TrainError::Invalid(format!(
                "rank {}: writing checkpoint step {} in the background failed ({e}); the newest complete \
                 checkpoint in {} is the one to resume from",
                eng.rank,
                f.step,
                root.display()
            )),
        })?;
        Ok(Some(f.dir))
    }

    /// A save in flight that has finished by now is collected as [`BackgroundSaves::wait`]
    /// would (its error surfaces at the step it is noticed, not at the next save); one still
    /// writing is left alone.
    pub fn poll(&mut self, eng: &mut Engine<B>) -> Result<Option<PathBuf>, TrainError> {
        match &self.in_flight {
            Some(f) if f.worker.is_finished() => self.wait(eng),
            _ => Ok(None),
        }
    }

    /// Start saving `step` (collective: every rank calls it at the same step): wait for the
    /// previous save, settle a delayed update, copy this rank's shard to the host copy, and
    /// leave the writing to a thread. Returns the directory the checkpoint will have.
    pub fn start<C: EngineComm<B>>(
        &mut self,
        be: &B,
        comm: &mut C,
        eng: &mut Engine<B>,
        meta: SaveMeta<'_>,
        root: &Path,
    ) -> Result<(PathBuf, Started), TrainError> {
        let step = meta.step;
        let t0 = Instant::now();
        self.wait(eng)?;
        let waited_s = t0.elapsed().as_secs_f64();
        eng.settle(be, comm)?;
        let rank = eng.rank;
        let dirs = SaveDirs::of(root, step);
        if rank == 0 {
            make_partial(&dirs)?;
        }
        // Every rank sees the partial directory before it writes into it.
        Group::barrier(comm)?;
        let t1 = Instant::now();
        let copy = eng.lend_shard_copy(be)?;
        let copy_s = t1.elapsed().as_secs_f64();
        let bytes = copy.bytes();
        let base = ManifestBase::of(eng, &meta)?;
        let names: Vec<String> = eng.layout.units.iter().map(|u| u.name.clone()).collect();
        let abandon = Arc::new(AtomicBool::new(false));
        let stop = abandon.clone();
        let dir = dirs.final_dir.clone();
        let worker = std::thread::Builder::new()
            .name(format!("checkpoint-{step}"))
            .spawn(move || {
                let t = Instant::now();
                let mut copy = copy;
                let filled = copy.wait_filled().map_err(|e| {
                    TrainError::Invalid(format!("copying checkpoint step {step} to host memory failed: {e}"))
                });
                let result = filled.and_then(|()| write_from_copy(&dirs, rank, &copy, &names, step)).and_then(|()| {
                    crate::log_line!(
                        "rank {rank}: checkpoint step {step}: shard written in the background ({:.2} GB in {:.2} s)",
                        bytes as f64 / 1e9,
                        t.elapsed().as_secs_f64()
                    );
                    if rank != 0 {
                        return Ok(());
                    }
                    await_summaries(&dirs, base.world(), &stop)?;
                    publish(&dirs, &base)?;
                    crate::log_line!(
                        "rank 0: checkpoint step {step} complete: {} ({:.2} s after its host copy)",
                        dirs.final_dir.display(),
                        t.elapsed().as_secs_f64()
                    );
                    Ok(())
                });
                (copy, result)
            })
            .map_err(|e| TrainError::Invalid(format!("cannot start the background checkpoint writer: {e}")))?;
        self.in_flight = Some(InFlight { step, dir: dir.clone(), worker, abandon });
        Ok((dir, Started { waited_s, copy_s, bytes }))
    }
}

impl<B: Backend> Drop for BackgroundSaves<B> {
    fn drop(&mut self) {
        // A trainer dropped without waiting (an error elsewhere): its writer finishes this
        // rank's shard, rank 0's stops waiting for the others; the save never publishes.
        if let Some(f) = self.in_flight.take() {
            f.abandon.store(true, Ordering::SeqCst);
            let _ = f.worker.join();
        }
    }
}

/// This rank's shard from the host copy, tensor by tensor as the synchronous save writes it.
fn write_from_copy<B: Backend>(
    dirs: &SaveDirs,
    rank: usize,
    copy: &ShardCopy<B>,
    names: &[String],
    step: u64,
) -> Result<(), TrainError> {
    let mut tensors: Vec<(String, Vec<usize>, ReadFn)> = Vec::new();
    let mut segments = Vec::new();
    for part in &copy.units {
        for (which, tag) in TAGS.iter().enumerate() {
            let first = tensors.is_empty();
            let read: ReadFn = Box::new(move || {
                if !first {
                    let path = dirs.tmp.join(format!("{}.partial", shard_file_name(rank)));
                    mid_write(rank, step).map_err(|source| CheckpointError::Io { path, source })?;
                }
                part.tensor(which).map(Cow::Borrowed).map_err(TrainError::Invalid)
            });
            tensors.push((format!("{}.{tag}", names[part.unit]), vec![part.hi - part.lo], read));
        }
        segments.push(Segment { unit: part.unit, lo: part.lo, hi: part.hi });
    }
    write_shard(dirs, rank, tensors, segments)
}

/// Rank 0's side of the completion barrier: every rank's summary in the partial directory.
fn await_summaries(dirs: &SaveDirs, world: usize, abandon: &AtomicBool) -> Result<(), TrainError> {
    let mut missing: Vec<usize> = (0..world).collect();
    loop {
        missing.retain(|&r| !dirs.summary(r).exists());
        if missing.is_empty() {
            return Ok(());
        }
        if abandon.load(Ordering::SeqCst) {
            return Err(TrainError::Invalid(format!(
                "checkpoint {} abandoned: ranks {missing:?} had not written their shards when training stopped",
                dirs.final_dir.display()
            )));
        }
        std::thread::sleep(POLL);
    }
}

/// TEST-ONLY: called by a background writer after the first tensor of its shard is in the
/// file (the launcher's `SHARDTRAIN_FAULT=rank:step:abort-mid-save` aborts the process there,
/// a crash mid-write; `fail-mid-save` returns an error, a write that fails like a full disk,
/// reported as a failed write of the shard file). Nothing else sets it.
type MidWriteHook = Box<dyn Fn(usize, u64) -> std::io::Result<()> + Send + Sync>;
static MID_WRITE_HOOK: OnceLock<MidWriteHook> = OnceLock::new();

/// Install the test-only hook (once per process).
pub fn set_mid_write_hook(f: impl Fn(usize, u64) -> std::io::Result<()> + Send + Sync + 'static) {
    let _ = MID_WRITE_HOOK.set(Box::new(f));
}

fn mid_write(rank: usize, step: u64) -> std::io::Result<()> {
    match MID_WRITE_HOOK.get() {
        Some(f) => f(rank, step),
        None => Ok(()),
    }
}
