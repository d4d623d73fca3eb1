//! One rank (the hidden `launcher worker` subcommand): read what its launcher hands it on
//! stdin (job token, the node's config fingerprint, heartbeat period), connect to the
//! rendezvous, bind the data-plane listener, say hello, wait for `Start`, build the
//! communicator group and train (from `--resume DIR` when given: a checkpoint the launcher
//! has already verified), reporting every step and, from a heartbeat thread, where it is
//! (step, micro-step, collective, phase) for the hang watchdog.
//!
//! Its flight recorder (the last collectives, `collectives::flight`) goes to the launcher
//! and into its log when the launcher asks (`DumpFlight`: the job hangs, or another rank
//! failed) and before it reports its own failure.
//!
//! It stops at once, aborting its communicator first (`ncclCommAbort` for GPU ranks), when
//! the launcher says `Stop`, when the rendezvous connection closes, or when its own
//! launcher dies (its stdin pipe ends; on nodes other than 0 that is the only sign).
//! Exit codes: 0 after `Done`; 1 after `Failed`; 2 for a data, checkpoint or config problem
//! or a refused config; 3 when stopped by the hang watchdog.
//!
//! Everything this process prints goes to its `logs/rank<r>.log` (the launcher redirects it),
//! through `trainer::log_line!`: a line that cannot be written (a full disk) is counted and
//! reported to the launcher (`LogLost`), never a panic.

use crate::job::device::Device;
use crate::run::protocol::{self, lost_peer_line, step_line, Bootstrap, CollectiveRecord, Msg, RankProgress};
use crate::signals::stop_now;
use clap::Args;
use collectives::progress::{self, Op, Progress, Tracked};
use collectives::tcp::TcpComm;
use collectives::CommError;
use std::io::BufRead;
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use trainer::backend::cpu::{CpuBackend, HostComm};
use trainer::{Config, TrainError};

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The launcher's rendezvous address.
    #[arg(long, value_name = "HOST:PORT")]
    pub rendezvous: SocketAddr,
    /// This process's global rank.
    #[arg(long)]
    pub rank: u32,
    /// Number of ranks in the job.
    #[arg(long)]
    pub world: u32,
    /// The resolved, validated config written by the launcher.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Interface the data-plane listener binds (127.0.0.1 on one node, 0.0.0.0 across nodes).
    #[arg(long, value_name = "IP")]
    pub bind_host: std::net::IpAddr,
    /// Which backend this rank computes on.
    #[arg(long, value_enum)]
    pub device: Device,
    /// Index of this rank on its node.
    #[arg(long, default_value_t = 0)]
    pub local_rank: u32,
    /// The GPU this rank uses (default: its local rank; the launcher's --gpu-map changes it).
    #[arg(long)]
    pub gpu: Option<u32>,
    /// Continue from this checkpoint directory (validated by the launcher).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// `launcher doctor`: measure the network as its plan (JSON) says, instead of training.
    #[arg(long, value_name = "FILE")]
    pub doctor: Option<PathBuf>,
    /// The launcher's `--profile`: time the phases of every step.
    #[arg(long)]
    pub profile: bool,
}

/// How long to keep trying to reach the launcher (multi-node: node 0 may start later).
const CONNECT_PATIENCE: Duration = Duration::from_secs(60);
/// How long the data-plane group may take to connect once `Start` arrived.
const GROUP_TIMEOUT: Duration = Duration::from_secs(60);
/// Exit code of a rank stopped for a data, checkpoint or config problem.
const SETUP_EXIT: u8 = 2;

/// Why a rank stopped: the message for the launcher and, when another rank's death
/// caused it, that rank; `setup` for data, checkpoint and config problems.
struct Failure {
    message: String,
    peer: Option<u32>,
    setup: bool,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure { message, peer: None, setup: false }
    }
}

impl From<TrainError> for Failure {
    fn from(e: TrainError) -> Self {
        let peer = match &e {
            TrainError::Comm(c) => lost_peer(c),
            _ => None,
        };
        let setup = matches!(e, TrainError::Data(_) | TrainError::Checkpoint(_) | TrainError::Config(_));
        Failure { message: e.to_string(), peer, setup }
    }
}

impl Failure {
    fn exit_code(&self) -> u8 {
        if self.setup {
            SETUP_EXIT
        } else {
            1
        }
    }
}

fn lost_peer(e: &CommError) -> Option<u32> {
    match e {
        CommError::PeerIo { peer, .. } | CommError::Protocol { peer, .. } => Some(*peer as u32),
        _ => None,
    }
}

/// The control connection's write side, shared by the training thread (steps, the final
/// report) and the heartbeat thread, one whole frame at a time.
#[derive(Clone)]
struct ControlTx(Arc<Mutex<TcpStream>>);

impl ControlTx {
    fn send(&self, msg: &Msg) -> Result<(), protocol::ProtocolError> {
        let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        protocol::send(&mut *s, msg)
    }
}

/// This rank's progress and flight recorder, and the model's unit names, once the config is
/// read (one rank per process).
static PROGRESS: OnceLock<(Arc<Progress>, Vec<String>)> = OnceLock::new();
/// The flight recorder went into the log already (it is written once: a rank asked for it by
/// the launcher usually fails a moment later).
static FLIGHT_LOGGED: AtomicBool = AtomicBool::new(false);

/// Send this rank's flight recorder to the launcher and write it to the rank's log (nodes
/// other than 0 report from logs).
fn send_flight(tx: &ControlTx, rank: u32) {
    let Some((p, units)) = PROGRESS.get() else { return };
    let records: Vec<CollectiveRecord> = p.flight().records().into_iter().map(CollectiveRecord::from).collect();
    if !FLIGHT_LOGGED.swap(true, Ordering::SeqCst) {
        trainer::log_line!(
            "rank {rank}: flight recorder: the last {} collectives (of {} entered), oldest first:",
            records.len(),
            p.snapshot().collectives
        );
        let now = collectives::flight::now_us();
        for r in &records {
            trainer::log_line!("rank {rank}:   {}", crate::run::flight::line(r, units, now));
        }
    }
    if let Err(e) = tx.send(&Msg::Flight { rank, records }) {
        trainer::log_line!("rank {rank}: cannot send the flight recorder to the launcher: {e}");
    }
}

/// Run one rank; the process exit code.
pub fn run(args: WorkerArgs) -> ExitCode {
    let rank = args.rank;
    let boot = match read_bootstrap() {
        Ok(b) => b,
        Err(e) => {
            trainer::log_line!("rank {rank}: {e}");
            return ExitCode::from(1);
        }
    };
    let finished = Arc::new(AtomicBool::new(false));
    if let Err(e) = watch_own_launcher(rank as usize, finished.clone()) {
        trainer::log_line!("rank {rank}: {e}");
        return ExitCode::from(1);
    }
    let control = match connect_control(args.rendezvous) {
        Ok(s) => s,
        Err(e) => {
            trainer::log_line!("rank {rank}: {e}");
            return ExitCode::from(1);
        }
    };
    let tx = match control.try_clone() {
        Ok(w) => ControlTx(Arc::new(Mutex::new(w))),
        Err(e) => {
            trainer::log_line!("rank {rank}: cannot clone the control socket: {e}");
            return ExitCode::from(1);
        }
    };
    match run_connected(&args, &boot, &control, &tx, &finished) {
        Ok(()) => {
            if let Some(bytes) = peak_host_bytes() {
                // Read back by `launcher sweep`.
                trainer::log_line!("rank {rank}: peak host memory {bytes} bytes (VmHWM)");
            }
            trainer::log_line!("rank {rank}: done");
            report_lost_lines(&tx, rank);
            match tx.send(&Msg::Done { rank }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    trainer::log_line!("rank {rank}: finished but cannot tell the launcher: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Err(f) => {
            finished.store(true, Ordering::SeqCst);
            // The records first, so the error stays the log's last lines (the failure report
            // quotes its tail).
            send_flight(&tx, rank);
            trainer::log_line!("rank {rank}: error: {}", f.message);
            if let Some(p) = f.peer {
                // Read back by a node without the control connection (it sees only exits).
                trainer::log_line!("{}", lost_peer_line(rank as usize, p));
            }
            let code = f.exit_code();
            report_lost_lines(&tx, rank);
            let _ = tx.send(&Msg::Failed { rank, message: f.message, peer: f.peer, setup: f.setup });
            ExitCode::from(code)
        }
    }
}

/// Log lines already reported lost to the launcher.
static LOST_TOLD: AtomicU64 = AtomicU64::new(0);

/// Tell the launcher how many lines of this rank's log could not be written (a full disk),
/// when more were lost since it was last told: the log cannot say so itself.
fn report_lost_lines(tx: &ControlTx, rank: u32) {
    let (lines, error) = trainer::log::lost();
    if lines > LOST_TOLD.swap(lines, Ordering::Relaxed) {
        let _ = tx.send(&Msg::LogLost { rank, lines, error: error.unwrap_or_default() });
    }
}

/// This process's peak resident set (Linux `VmHWM`), in bytes.
fn peak_host_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

/// The launcher's first line on stdin.
fn read_bootstrap() -> Result<Bootstrap, String> {
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| format!("cannot read the launcher's start-up line on stdin: {e}"))?;
    if line.is_empty() {
        return Err("stdin ended before the launcher's start-up line: ranks are started by the launcher \
                    (`launcher --cpus N CONFIG`), not by hand"
            .into());
    }
    serde_json::from_str(&line).map_err(|e| format!("the launcher's start-up line does not parse ({e}): same build?"))
}

/// Stop as soon as this rank's own launcher is gone: it holds the write end of our stdin,
/// so the end of stdin means it exited (on nodes other than 0 nothing else would tell us).
fn watch_own_launcher(rank: usize, finished: Arc<AtomicBool>) -> Result<(), String> {
    std::thread::Builder::new()
        .name("own-launcher-watch".into())
        .spawn(move || {
            let mut sink = Vec::new();
            // Returns at end of file: the launcher closed the pipe or died.
            let _ = std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut sink);
            if !finished.load(Ordering::SeqCst) {
                trainer::log_line!("rank {rank}: this node's launcher is gone (its pipe closed): stopping");
                stop_now(1);
            }
        })
        .map(|_| ())
        .map_err(|e| format!("cannot start the thread that watches this node's launcher: {e}"))
}

fn connect_control(addr: SocketAddr) -> Result<TcpStream, String> {
    let start = Instant::now();
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(_) if start.elapsed() < CONNECT_PATIENCE => std::thread::sleep(Duration::from_millis(250)),
            Err(e) => {
                return Err(format!(
                    "cannot reach the launcher's rendezvous at {addr} after {CONNECT_PATIENCE:?}: {e} \
                     (multi-node: is node 0 running with this --master-addr, and is the port open?)"
                ))
            }
        }
    }
}

fn run_connected(
    args: &WorkerArgs,
    boot: &Bootstrap,
    control: &TcpStream,
    tx: &ControlTx,
    finished: &Arc<AtomicBool>,
) -> Result<(), Failure> {
    let (rank, world) = (args.rank as usize, args.world as usize);
    // Builds with `fault-injection` only (the tests'): the fault SHARDTRAIN_FAULT asks for.
    #[cfg(feature = "fault-injection")]
    let fault = crate::rank::fault::Fault::from_env()?;
    #[cfg(feature = "fault-injection")]
    if let Some(f) = &fault {
        f.install_save_hook(rank);
    }
    let cfg = Config::load(&args.config, &[]).map_err(|e| Failure::from(TrainError::from(e)))?;
    let doctor = args.doctor.as_deref().map(crate::doctor::read_spec).transpose()?;
    // With [[data.sources]] the launcher has made every source's path absolute.
    let data_path = match (&doctor, &cfg.data.path, cfg.data.sources.is_empty()) {
        (Some(_), _, _) => std::path::PathBuf::new(),
        (None, Some(p), _) => p.clone(),
        (None, None, false) => std::path::PathBuf::from("."),
        (None, None, true) => {
            return Err(format!(
                "{} has no data.path: the launcher writes it; start ranks through the launcher",
                args.config.display()
            )
            .into())
        }
    };

    let pending = TcpComm::bind(&SocketAddr::new(args.bind_host, 0).to_string())
        .map_err(|e| format!("cannot bind the data-plane listener on {}: {e}", args.bind_host))?;
    let mut data_addr = pending.local_addr();
    if data_addr.ip().is_unspecified() {
        // Listening on every interface: advertise the one that reaches the launcher.
        let ip = control.local_addr().map_err(|e| format!("cannot read the control socket's address: {e}"))?.ip();
        data_addr.set_ip(ip);
    }
    trainer::log_line!("rank {rank}/{world}: data plane listening on {data_addr}");
    tx.send(&Msg::hello(boot.token.clone(), args.rank, data_addr.to_string(), boot.fingerprint.clone()))
        .map_err(|e| format!("cannot send hello to the launcher: {e}"))?;

    let mut reader = control.try_clone().map_err(|e| format!("cannot clone the control socket: {e}"))?;
    let (peers, nccl_id) =
        match protocol::recv(&mut reader).map_err(|e| format!("waiting for Start from the launcher: {e}"))? {
            Msg::Start { world: w, peers, nccl_id } if w as usize == world && peers.len() == world => (peers, nccl_id),
            Msg::Start { world: w, peers, .. } => {
                return Err(format!(
                    "the launcher started a world of {w} ranks with {} peers but this rank was told --world {world}",
                    peers.len()
                )
                .into())
            }
            Msg::Stop { reason, kind } => {
                trainer::log_line!("rank {rank}: the launcher stopped this rank: {reason}");
                stop_now(kind.exit_code());
            }
            other => return Err(format!("expected Start from the launcher, got {other:?}").into()),
        };
    let peers: Vec<SocketAddr> = peers
        .iter()
        .map(|p| p.parse().map_err(|e| format!("the launcher sent a bad peer address {p:?}: {e}")))
        .collect::<Result<_, _>>()?;
    let progress = Arc::new(Progress::with_flight_records(cfg.watchdog.flight_records));
    let units = trainer::model::ModelLayout::new(&cfg.model).units.iter().map(|u| u.name.clone()).collect();
    let _ = PROGRESS.set((progress.clone(), units));
    progress::install(progress.clone());
    watch_launcher(reader, rank, finished.clone(), tx.clone())?;
    start_heartbeat(tx.clone(), args.rank, progress.clone(), Duration::from_millis(boot.heartbeat_ms.max(10)))?;

    let comm = {
        let _connecting = progress.enter(Op::Connect);
        pending.connect(rank, world, &peers, GROUP_TIMEOUT)
    }
    .map_err(|e| Failure {
        peer: lost_peer(&e),
        message: format!("cannot connect the data-plane group: {e}"),
        setup: false,
    })?;
    trainer::log_line!("rank {rank}/{world}: group connected");
    if let Some(spec) = doctor {
        #[cfg(feature = "fault-injection")]
        let throttle = fault.and_then(|f| f.throttle(rank));
        #[cfg(not(feature = "fault-injection"))]
        let throttle = None;
        let result = crate::doctor::rank(crate::doctor::RankRun {
            spec: &spec,
            on_gpu: args.device == Device::Gpu,
            comm,
            rank,
            world,
            gpu: args.gpu.unwrap_or(args.local_rank) as usize,
            nccl_id: nccl_id.as_deref(),
            throttle,
            progress: &progress,
        });
        finished.store(true, Ordering::SeqCst);
        let report = result?;
        tx.send(&Msg::Doctor { rank: args.rank, report: Box::new(report) })
            .map_err(|e| format!("cannot send the measurements to the launcher: {e}"))?;
        return Ok(());
    }

    let total = cfg.train.steps;
    let on_step_progress = progress.clone();
    let mut on_step = |m: &trainer::StepMetrics| -> Result<(), TrainError> {
        on_step_progress.step_done(m.step);
        trainer::log_line!("{}", step_line(rank, m, total));
        tx.send(&Msg::Step { rank: args.rank, metrics: Box::new(m.clone()) })
            .map_err(|e| TrainError::Stopped(format!("lost the launcher connection: {e}")))?;
        #[cfg(feature = "fault-injection")]
        if let Some(f) = &fault {
            f.trigger(rank, m.step);
        }
        Ok(())
    };
    let resume = args.resume.as_deref();
    let result = match args.device {
        Device::Cpu => {
            let tracked = Tracked::new(HostComm(comm), progress.clone());
            // Outside the recording communicator: a skipped collective is not recorded.
            #[cfg(feature = "fault-injection")]
            let mut comm = {
                let injected = fault.and_then(|f| f.at_collective(rank));
                crate::rank::fault::Faulty::new(tracked, injected, progress.clone())
            };
            #[cfg(not(feature = "fault-injection"))]
            let mut comm = tracked;
            trainer::train::train_from(
                &cfg,
                &CpuBackend::new(),
                &mut comm,
                &data_path,
                resume,
                args.profile,
                &mut on_step,
            )
        }
        Device::Gpu => {
            // Collectives go through NCCL; the TCP group stays open (unused) until the end. A
            // rank that dies is noticed by the launcher (process exit), which stops the rest.
            let _host_group = comm;
            let id = nccl_id.ok_or_else(|| "the launcher sent no NCCL id for a GPU job".to_string())?;
            let gpu = args.gpu.unwrap_or(args.local_rank) as usize;
            let job = crate::job::gpu::GpuRank {
                cfg: &cfg,
                data_path: &data_path,
                resume,
                profile: args.profile,
                rank,
                world,
                gpu,
                nccl_id: &id,
            };
            crate::job::gpu::train_rank(job, &progress, &mut on_step)
        }
    };
    finished.store(true, Ordering::SeqCst);
    result.map(|_| ()).map_err(Failure::from)
}

/// Send where this rank is to the launcher every `every` until the connection fails.
fn start_heartbeat(tx: ControlTx, rank: u32, p: Arc<Progress>, every: Duration) -> Result<(), String> {
    std::thread::Builder::new()
        .name("heartbeat".into())
        .spawn(move || loop {
            std::thread::sleep(every);
            if tx.send(&Msg::Heartbeat { rank, progress: RankProgress::of(&p) }).is_err() {
                return;
            }
            report_lost_lines(&tx, rank);
        })
        .map(|_| ())
        .map_err(|e| format!("cannot start the heartbeat thread: {e}"))
}

/// Follow the launcher's orders after `Start`: on `Stop`, or when the connection closes
/// (the launcher died or stopped the job), abort and exit at once, so a rank never outlives
/// its launcher nor waits on a hung collective; answer `DumpFlight` (from this thread: the
/// training thread may be blocked in a collective).
fn watch_launcher(mut reader: TcpStream, rank: usize, finished: Arc<AtomicBool>, tx: ControlTx) -> Result<(), String> {
    std::thread::Builder::new()
        .name("launcher-watch".into())
        .spawn(move || loop {
            match protocol::recv(&mut reader) {
                Ok(Msg::Stop { reason, kind }) => {
                    trainer::log_line!("rank {rank}: stopped by the launcher: {reason}");
                    stop_now(kind.exit_code());
                }
                Ok(Msg::DumpFlight) => send_flight(&tx, rank as u32),
                Ok(other) => trainer::log_line!("rank {rank}: ignoring an unexpected control message: {other:?}"),
                Err(e) => {
                    if !finished.load(Ordering::SeqCst) {
                        trainer::log_line!("rank {rank}: the launcher closed the control connection ({e}): stopping");
                        stop_now(1);
                    }
                    return;
                }
            }
        })
        .map(|_| ())
        .map_err(|e| format!("cannot start the launcher watchdog thread: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_checkpoint_and_config_failures_exit_with_code_2() {
        let data =
            TrainError::Data(data::DataError::NoShards { dir: "/d".into(), split: "val".into(), expected: "x".into() });
        let f = Failure::from(data);
        assert!(f.setup);
        assert_eq!(f.exit_code(), 2);
        let ck = TrainError::Checkpoint(trainer::checkpoint::CheckpointError::Invalid {
            dir: "/c".into(),
            problem: "bad manifest".into(),
        });
        assert_eq!(Failure::from(ck).exit_code(), 2);
        let other = Failure::from(TrainError::Invalid("loss became NaN".into()));
        assert_eq!(other.exit_code(), 1);
    }
}
