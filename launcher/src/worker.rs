//! One rank (the hidden `launcher worker` subcommand): connect to the launcher, bind the
//! data-plane listener, say hello, wait for `Start`, build the communicator group and
//! train (from `--resume DIR` when given: a checkpoint the launcher has already verified),
//! reporting every step. Exit code 0 after `Done`, 1 after `Failed`.
//!
//! Everything this process prints goes to its `logs/rank<r>.log` (the launcher redirects it).

use crate::cli::WorkerArgs;
use crate::device::Device;
use crate::fault::Fault;
use crate::protocol::{self, Msg};
use collectives::tcp::TcpComm;
use collectives::CommError;
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use trainer::backend::cpu::{CpuBackend, HostComm};
use trainer::{Config, TrainError};

/// How long to keep trying to reach the launcher (multi-node: node 0 may start later).
const CONNECT_PATIENCE: Duration = Duration::from_secs(60);
/// How long the data-plane group may take to connect once `Start` arrived.
const GROUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a rank stopped: the message for the launcher and, when another rank's death
/// caused it, that rank.
struct Failure {
    message: String,
    peer: Option<u32>,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure { message, peer: None }
    }
}

impl From<TrainError> for Failure {
    fn from(e: TrainError) -> Self {
        let peer = match &e {
            TrainError::Comm(c) => lost_peer(c),
            _ => None,
        };
        Failure { message: e.to_string(), peer }
    }
}

fn lost_peer(e: &CommError) -> Option<u32> {
    match e {
        CommError::PeerIo { peer, .. } | CommError::Protocol { peer, .. } => Some(*peer as u32),
        _ => None,
    }
}

/// Run one rank; the process exit code.
pub fn run(args: WorkerArgs) -> ExitCode {
    let rank = args.rank;
    let mut control = match connect_control(args.rendezvous) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            return ExitCode::from(1);
        }
    };
    match run_connected(&args, &mut control) {
        Ok(()) => match protocol::send(&mut control, &Msg::Done { rank }) {
            Ok(()) => {
                println!("rank {rank}: done");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("rank {rank}: finished but cannot tell the launcher: {e}");
                ExitCode::from(1)
            }
        },
        Err(f) => {
            eprintln!("rank {rank}: error: {}", f.message);
            let _ = protocol::send(&mut control, &Msg::Failed { rank, message: f.message, peer: f.peer });
            ExitCode::from(1)
        }
    }
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

fn run_connected(args: &WorkerArgs, control: &mut TcpStream) -> Result<(), Failure> {
    let (rank, world) = (args.rank as usize, args.world as usize);
    let fault = Fault::from_env()?;
    let cfg = Config::load(&args.config, &[]).map_err(|e| e.to_string())?;
    let data_path = cfg.data.path.clone().ok_or_else(|| {
        format!("{} has no data.path: the launcher writes it; start ranks through the launcher", args.config.display())
    })?;

    let pending = TcpComm::bind(&SocketAddr::new(args.bind_host, 0).to_string())
        .map_err(|e| format!("cannot bind the data-plane listener on {}: {e}", args.bind_host))?;
    let mut data_addr = pending.local_addr();
    if data_addr.ip().is_unspecified() {
        // Listening on every interface: advertise the one that reaches the launcher.
        let ip = control.local_addr().map_err(|e| format!("cannot read the control socket's address: {e}"))?.ip();
        data_addr.set_ip(ip);
    }
    println!("rank {rank}/{world}: data plane listening on {data_addr}");
    protocol::send(control, &Msg::hello(args.rank, data_addr.to_string()))
        .map_err(|e| format!("cannot send hello to the launcher: {e}"))?;

    let (peers, nccl_id) =
        match protocol::recv(control).map_err(|e| format!("waiting for Start from the launcher: {e}"))? {
            Msg::Start { world: w, peers, nccl_id } if w as usize == world && peers.len() == world => (peers, nccl_id),
            Msg::Start { world: w, peers, .. } => {
                return Err(format!(
                    "the launcher started a world of {w} ranks with {} peers but this rank was told --world {world}",
                    peers.len()
                )
                .into())
            }
            other => return Err(format!("expected Start from the launcher, got {other:?}").into()),
        };
    let peers: Vec<SocketAddr> = peers
        .iter()
        .map(|p| p.parse().map_err(|e| format!("the launcher sent a bad peer address {p:?}: {e}")))
        .collect::<Result<_, _>>()?;
    let finished = Arc::new(AtomicBool::new(false));
    watch_launcher(control, rank, finished.clone())?;

    let comm = pending
        .connect(rank, world, &peers, GROUP_TIMEOUT)
        .map_err(|e| Failure { peer: lost_peer(&e), message: format!("cannot connect the data-plane group: {e}") })?;
    println!("rank {rank}/{world}: group connected");

    let total = cfg.train.steps;
    let mut on_step = |m: &trainer::StepMetrics| -> Result<(), TrainError> {
        println!(
            "rank {rank} step {}/{total} loss {:.6} lr {:.3e} grad_norm {:.4} time {:.3}s",
            m.step, m.loss, m.lr, m.grad_norm, m.step_time_s
        );
        protocol::send(control, &Msg::Step { rank: args.rank, metrics: Box::new(m.clone()) })
            .map_err(|e| TrainError::Stopped(format!("lost the launcher connection: {e}")))?;
        if let Some(f) = &fault {
            f.trigger(rank, m.step);
        }
        Ok(())
    };
    let resume = args.resume.as_deref();
    let result = match args.device {
        Device::Cpu => {
            let mut comm = HostComm(comm);
            trainer::train::train_from(&cfg, &CpuBackend, &mut comm, &data_path, resume, &mut on_step)
        }
        Device::Gpu => {
            // Collectives go through NCCL; the TCP group stays open (unused) until the end. A
            // rank that dies is noticed by the launcher (process exit), which stops the rest.
            let _host_group = comm;
            let id = nccl_id.ok_or_else(|| "the launcher sent no NCCL id for a GPU job".to_string())?;
            crate::gpu::train_rank(&cfg, &data_path, resume, rank, world, args.local_rank as usize, &id, &mut on_step)
        }
    };
    finished.store(true, Ordering::SeqCst);
    result.map(|_| ()).map_err(Failure::from)
}

/// Exit as soon as the launcher's connection closes (the launcher died or stopped the job),
/// so a rank never outlives its launcher.
fn watch_launcher(control: &TcpStream, rank: usize, finished: Arc<AtomicBool>) -> Result<(), String> {
    let mut reader = control.try_clone().map_err(|e| format!("cannot clone the control socket: {e}"))?;
    std::thread::Builder::new()
        .name("launcher-watch".into())
        .spawn(move || loop {
            if let Err(e) = protocol::recv(&mut reader) {
                if !finished.load(Ordering::SeqCst) {
                    eprintln!("rank {rank}: the launcher closed the control connection ({e}): stopping");
                    std::process::exit(1);
                }
                return;
            }
        })
        .map_err(|e| format!("cannot start the launcher watchdog thread: {e}"))?;
    Ok(())
}
