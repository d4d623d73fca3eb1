//! Runs a job and decides whether a rank has failed. This is where that decision lives.
//!
//! The supervisor owns the rendezvous listener (node 0), the rank processes of this node
//! and every control connection, and reacts to one stream of events:
//! - a rank process exiting non-zero or by a signal, exiting before `Done`, its control
//!   connection dropping before `Done`, or a `Failed` message → the job has failed;
//! - a rank not saying hello within [`HELLO_TIMEOUT`] → the job has failed, naming it;
//! - (node 0) a rank whose node runs another config or build than node 0 → the job is
//!   refused, naming every differing key (exit code 2);
//! - (node 0) no rank making progress for `watchdog.timeout_s` (the [`Watchdog`], fed by
//!   the ranks' heartbeats) → the job is hung: every rank is told to stop (GPU ranks abort
//!   their NCCL communicators) and the report says where each rank was and which ones the
//!   others waited on (exit code 3);
//! - Ctrl-C / SIGTERM → the job is interrupted.
//!
//! Node 0 also asks every rank for its flight recorder (`DumpFlight`) when the job hangs
//! (waiting up to [`DUMP_WAIT`] for the answers before stopping the ranks) or a rank fails,
//! and its report shows where the ranks' collectives first disagree (`flight.rs`).
//!
//! On failure the supervisor waits [`SETTLE`] for the rest of the evidence (when one rank
//! crashes, its peers fail a moment later with "rank r is unreachable"), then kills every
//! rank of this node (SIGKILL), closes every control connection (ranks on other nodes exit
//! when theirs closes), reaps all processes, and reports the rank that failed *first*: the
//! one that crashed or erred on its own, not its peers that lost it.

use crate::errors::{Interrupted, JobError, HUNG_EXIT, SETUP_EXIT};
use crate::job::setup::RunPlan;
use crate::out::{self, rank_list};
use crate::run::metrics::MetricsLog;
use crate::run::oom::OomWatch;
use crate::run::progress::Progress;
use crate::run::protocol::{self, Bootstrap, Msg, StopKind};
use crate::run::ranks::{self, describe_status, log_tail, logged_end, Exited};
use crate::run::rendezvous::{self, ConnEvent};
use crate::run::watchdog::Watchdog;
use anyhow::Context;
use std::net::SocketAddr;
use std::process::ExitStatus;
use std::time::Duration;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpListener;
use tokio::signal::unix::{Signal, SignalKind};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Every rank must say hello within this long of being started (and a node other than 0
/// waits this long for node 0's rendezvous to answer).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(60);
/// While a node waits for node 0, how often it says so.
const MASTER_WAIT_NOTE: Duration = Duration::from_secs(5);
/// After the first sign of failure, how long to collect evidence before killing.
pub const SETTLE: Duration = Duration::from_millis(1000);
/// After every rank reported `Done`, how long their processes may take to exit.
const EXIT_GRACE: Duration = Duration::from_secs(30);
/// How long a hung job's ranks may take to answer the flight-recorder dump before they are
/// stopped (a stopped or frozen rank never answers).
const DUMP_WAIT: Duration = Duration::from_secs(2);
/// Log lines shown for a failed rank.
const TAIL_LINES: usize = 20;

/// Connections turned away that are remembered for the hello-timeout report.
const REMEMBERED_REJECTIONS: usize = 20;

/// What the supervisor knows about one rank.
#[derive(Default)]
struct RankState {
    local: bool,
    data_addr: Option<String>,
    writer: Option<OwnedWriteHalf>,
    last_step: u64,
    /// `Failed { setup: true }`: a data, checkpoint or config problem.
    setup_failure: bool,
    done: bool,
    /// `Failed` message and the peer it blames.
    failed: Option<(String, Option<u32>)>,
    exit: Option<std::io::Result<ExitStatus>>,
    /// The control connection ended (with the error, if it broke).
    closed: Option<Option<String>>,
    /// Order in which ranks first showed trouble (lower = earlier).
    trouble_seq: Option<u64>,
    /// The process was still running at teardown and was killed by the launcher.
    killed: bool,
    /// Lines of its log it could not write (reported by the rank), and the first error.
    log_lost: u64,
    log_error: Option<String>,
    /// Its flight recorder as it answered the dump, and the newest record its last heartbeat
    /// carried.
    flight: Option<Vec<protocol::CollectiveRecord>>,
    heard: Option<protocol::CollectiveRecord>,
    /// Asked for its flight recorder.
    dump_asked: bool,
    /// `launcher doctor`: what it measured.
    doctor: Option<crate::doctor::report::RankReport>,
}

impl RankState {
    /// Remember when this rank first showed trouble.
    fn mark_trouble(&mut self, seq: &mut u64) {
        if self.trouble_seq.is_none() {
            self.trouble_seq = Some(*seq);
            *seq += 1;
        }
    }
    fn exited_ok(&self) -> bool {
        matches!(&self.exit, Some(Ok(s)) if s.success())
    }
}

/// Why the job is being stopped.
enum Stop {
    /// Ranks failed; details are in the rank states.
    Failure,
    /// Some ranks never said hello.
    HelloTimeout(Vec<usize>),
    /// A connection that cannot take part (duplicate rank, wrong version, ...).
    Fatal(String),
    /// A node runs another config or build than node 0.
    Refused(String),
    /// The watchdog saw no progress; its report.
    Hung(String),
    Interrupted,
}

/// Run the job to the end; `Ok` when every rank finished.
pub async fn run(plan: &RunPlan) -> anyhow::Result<()> {
    let (conn_tx, mut conn_rx) = mpsc::unbounded_channel::<ConnEvent>();
    let (exit_tx, mut exit_rx) = mpsc::unbounded_channel::<Exited>();
    let (kill_tx, kill_rx) = watch::channel(false);

    // Node 0 hosts the rendezvous; other nodes point their ranks at it.
    let (rendezvous_addr, acceptor) = if plan.is_master() {
        let bind = plan.master_addr.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
        let listener = TcpListener::bind(bind).await.with_context(|| match &plan.master_name {
            Some(name) => format!(
                "cannot listen for ranks on {bind} ({name}, the rendezvous): it must be an address of this host, which \
                 runs {}, and a free port; pick another port (--master-addr or MASTER_PORT), or check the address \
                 (under Slurm the first host of the node list runs task 0)",
                plan.launcher_name(0)
            ),
            None => {
                format!("cannot listen for ranks on {bind}: pick a free port in --master-addr, or check the address")
            }
        })?;
        let addr = listener.local_addr().context("cannot read the rendezvous address")?;
        let token = plan.token.clone();
        (addr, Some(tokio::spawn(rendezvous::accept_loop(listener, plan.world, token, conn_tx.clone()))))
    } else {
        let addr = plan.master_addr.context("--master-addr is required on nodes other than 0")?;
        // No rank starts before node 0 answers and takes this job's token: until then this
        // node says what it waits for, and where.
        rendezvous::reach_master(addr, plan.node_rank, &plan.token, HELLO_TIMEOUT, MASTER_WAIT_NOTE, out::warn)
            .await
            .map_err(|e| JobError { code: SETUP_EXIT, message: format!("{}: {e}", plan.launcher_name(plan.node_rank)) })?;
        (addr, None)
    };
    drop(conn_tx);

    let mut ranks: Vec<RankState> = (0..plan.world).map(|_| RankState::default()).collect();
    for r in plan.local_rank_ids() {
        ranks[r].local = true;
    }
    let timeout = Duration::from_secs_f64(plan.cfg.watchdog.timeout_s);
    let watchdog_on = plan.is_master() && !timeout.is_zero();
    let heartbeat = if timeout.is_zero() { Duration::from_secs(1) } else { Watchdog::heartbeat_interval(timeout) };
    let boot = Bootstrap {
        token: plan.token.as_str().to_string(),
        fingerprint: plan.fingerprint.clone(),
        heartbeat_ms: heartbeat.as_millis() as u64,
    };
    // OOM kills are counted from here: a rank that dies of SIGKILL is compared with this.
    let oom = OomWatch::start();
    let pids = ranks::spawn_all(plan, rendezvous_addr, &boot, &exit_tx, &kill_rx)?;
    drop(exit_tx);
    drop(kill_rx);

    let total_steps = plan.cfg.train.steps as u64;
    let mut metrics = if plan.is_master() { Some(MetricsLog::open(&plan.metrics_path, plan.world)?) } else { None };
    let resumed_at = plan.resume.as_ref().map_or(0, |r| r.step);
    let mut progress = Progress::new(total_steps, resumed_at, plan.is_master());
    progress.println(&format!(
        "launched {} {} rank(s) on {} (world {}, pids {}){}; rendezvous {}; logs in {}",
        plan.local_ranks,
        plan.device.name().to_uppercase(),
        plan.launcher_name(plan.node_rank),
        plan.world,
        some(&pids),
        plan.run_id.as_ref().map_or(String::new(), |id| format!("; run {id}")),
        rendezvous_addr,
        plan.logs_dir.display()
    ));
    if plan.multi_node() && plan.is_master() && plan.token.origin == crate::job::token::Origin::Generated {
        progress.println(&format!(
            "job token: {} (start the other nodes with {}={} or --job-token {})",
            plan.token.as_str(),
            crate::job::token::TOKEN_ENV,
            plan.token.as_str(),
            plan.token.as_str()
        ));
    }
    if let Some(r) = &plan.resume {
        progress.println(&format!(
            "resuming from {} at step {} of {total_steps} (saved by {} rank(s) at ZeRO stage {}; now {} rank(s) at \
             stage {})",
            r.dir.display(),
            r.step,
            r.saved_world,
            r.saved_stage,
            plan.world,
            plan.cfg.zero.stage
        ));
        for note in &r.notes {
            progress.println(&format!("note: {note}"));
        }
    }

    let hello_deadline = Instant::now() + HELLO_TIMEOUT;
    let mut started = !plan.is_master();
    let mut stop: Option<(Stop, Instant)> = None;
    let mut done_since: Option<Instant> = None;
    let mut seq = 0u64;
    let mut watchdog: Option<Watchdog> = None;
    // The watchdog's report while the ranks' flight recorders are collected, and until when.
    let mut hung: Option<(String, Instant)> = None;
    let watch_tick = (heartbeat / 2).max(Duration::from_millis(25));
    // A fixed deadline, not a sleep re-armed every loop: heartbeats of many ranks arrive more
    // often than the tick and would otherwise keep postponing the check forever.
    let mut next_watch = Instant::now() + watch_tick;
    let mut rejected: Vec<String> = Vec::new();
    let mut refused_nodes: Vec<usize> = Vec::new();
    let mut metrics_warned = false;
    let mut log_warned = false;
    let (mut sigint, mut sigterm) = (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?);

    loop {
        if done_since.is_none() && ranks.iter().all(|r| r.done) {
            done_since = Some(Instant::now());
        }
        if stop.is_none() && finished(plan, &ranks) {
            break;
        }
        if let Some(since) = done_since {
            if stop.is_none() && since.elapsed() >= EXIT_GRACE {
                let slow: Vec<usize> = plan.local_rank_ids().filter(|&r| ranks[r].exit.is_none()).collect();
                progress.println(&format!(
                    "launcher: warning: ranks {slow:?} finished training but did not exit within {EXIT_GRACE:?}: killing them"
                ));
                break;
            }
        }
        // Once stopping, nothing more can be learned when every rank is gone.
        if stop.is_some()
            && ranks.iter().all(|r| (!r.local || r.exit.is_some()) && (r.writer.is_none() || r.closed.is_some()))
        {
            break;
        }
        // A failure: ask every rank still there for its flight recorder (answers arrive
        // while the failure settles).
        if matches!(stop, Some((Stop::Failure, _))) && plan.is_master() {
            ask_for_flight(&mut ranks).await;
        }
        // A hang: stop once every rank asked has answered, or the wait is over.
        if let (Some((_, until)), None) = (&hung, &stop) {
            let answered = ranks.iter().all(|r| !r.dump_asked || r.flight.is_some() || r.closed.is_some());
            if answered || Instant::now() >= *until {
                let (report, _) = hung.take().expect("checked above");
                let report = match flight_report(plan, &ranks) {
                    Some(f) => format!("{report}\n{f}"),
                    None => report,
                };
                stop_every_rank(&mut ranks, &report, StopKind::Hung).await;
                fail(&mut stop, Stop::Hung(report));
            }
        }
        let settle_at = stop.as_ref().map(|(_, t)| *t + SETTLE);
        let dump_until = hung.as_ref().map(|(_, t)| *t);
        tokio::select! {
            Some(ev) = conn_rx.recv() => match ev {
                ConnEvent::Hello { rank, peer, data_addr, fingerprint, mut writer } => {
                    if ranks[rank].data_addr.is_some() {
                        fail(&mut stop, Stop::Fatal(format!("two workers claim rank {rank}: give each node a distinct --node-rank")));
                        continue;
                    }
                    let node = rank / plan.local_ranks.max(1);
                    let (this, first) = (plan.launcher_name(node), plan.launcher_name(0));
                    let diffs = crate::job::fingerprint::differences(&plan.fingerprint, &fingerprint, &first, &this);
                    if !diffs.is_empty() {
                        let reason = format!(
                            "{this} (rank {rank}, connecting from {}) does not run the same job as {first}: {}\n\
                             start every node with the same config file, --set overrides, --cpus/--gpus, --resume \
                             and launcher build",
                            peer.ip(),
                            diffs.join("; ")
                        );
                        let _ = protocol::send_async(&mut writer, &Msg::Stop { reason: reason.clone(), kind: StopKind::Refused }).await;
                        if !refused_nodes.contains(&node) {
                            refused_nodes.push(node);
                            progress.println(&format!("launcher: refused {reason}"));
                        }
                        fail(&mut stop, Stop::Refused(reason));
                        continue;
                    }
                    ranks[rank].data_addr = Some(data_addr);
                    ranks[rank].writer = Some(writer);
                    if !started && stop.is_none() && ranks.iter().all(|r| r.data_addr.is_some()) {
                        started = true;
                        if let Some(a) = &acceptor {
                            a.abort();
                        }
                        send_start(&mut ranks, &progress, &plan.nccl_id).await;
                        if watchdog_on {
                            watchdog = Some(Watchdog::new(plan.world, timeout, plan.device == crate::job::device::Device::Cpu, total_steps, Instant::now().into_std()));
                        }
                    }
                }
                ConnEvent::Msg { rank, msg } => match msg {
                    Msg::Heartbeat { progress: p, .. } => {
                        if p.last.is_some() {
                            ranks[rank].heard = p.last.clone();
                        }
                        if let Some(w) = watchdog.as_mut() {
                            w.heartbeat(rank, p, Instant::now().into_std());
                        }
                    }
                    Msg::Step { metrics: m, .. } => {
                        ranks[rank].last_step = m.step;
                        if let Some(w) = watchdog.as_mut() {
                            w.step(rank, m.step, Instant::now().into_std());
                        }
                        if let Some(log) = metrics.as_mut() {
                            match log.add(rank, *m) {
                                Ok(Some(rec)) => progress.step(&rec),
                                Ok(None) => {}
                                Err(e) => progress.println(&format!("launcher: warning: {e:#}")),
                            }
                            if let (false, Some(e)) = (metrics_warned, log.write_error()) {
                                metrics_warned = true;
                                out::warn(&format!(
                                    "launcher: warning: {e}; training goes on, and the run summary counts every step"
                                ));
                            }
                        }
                    }
                    Msg::LogLost { lines, error, .. } => {
                        let r = &mut ranks[rank];
                        r.log_lost = r.log_lost.max(lines);
                        r.log_error.get_or_insert(error.clone());
                        if !log_warned {
                            log_warned = true;
                            out::warn(&format!(
                                "launcher: warning: rank {rank} cannot write its log {} ({error}); training goes \
                                 on, and the run summary counts the lost lines",
                                if plan.local_rank_ids().contains(&rank) {
                                    plan.log_path(rank).display().to_string()
                                } else {
                                    format!("logs/rank{rank}.log on its node")
                                }
                            ));
                        }
                    }
                    Msg::Flight { records, .. } => ranks[rank].flight = Some(records),
                    Msg::Doctor { report, .. } if plan.doctor.is_some() => ranks[rank].doctor = Some(*report),
                    Msg::Done { .. } => {
                        ranks[rank].done = true;
                        if let Some(w) = watchdog.as_mut() {
                            w.done(rank);
                        }
                    }
                    Msg::Failed { message, peer, setup, .. } => {
                        ranks[rank].setup_failure = setup;
                        ranks[rank].failed = Some((message, peer));
                        ranks[rank].mark_trouble(&mut seq);
                        fail(&mut stop, Stop::Failure);
                    }
                    other => fail(&mut stop, Stop::Fatal(format!("rank {rank} sent an unexpected control message: {other:?}"))),
                },
                // `Done` travels on the same connection before it closes, so a close without it is a failure.
                ConnEvent::Closed { rank, error } => {
                    ranks[rank].closed = Some(error);
                    if !ranks[rank].done {
                        ranks[rank].mark_trouble(&mut seq);
                        fail(&mut stop, Stop::Failure);
                    }
                }
                ConnEvent::NodeUp { node, peer } => {
                    progress.println(&format!("launcher: node {node} ({}) reached the rendezvous; its ranks follow", peer.ip()));
                }
                ConnEvent::Rejected { peer, reason, fatal } => {
                    if fatal {
                        fail(&mut stop, Stop::Fatal(reason));
                    } else {
                        progress.println(&format!("launcher: ignored a connection from {peer}: {reason}"));
                        if rejected.len() < REMEMBERED_REJECTIONS {
                            rejected.push(format!("{peer}: {reason}"));
                        }
                    }
                }
            },
            Some(Exited { rank, status }) = exit_rx.recv() => {
                // A clean exit is judged by its connection (`Done` then close); a clean exit of a rank
                // that never connected, or any unclean exit, is a failure now.
                let clean = matches!(&status, Ok(s) if s.success());
                ranks[rank].exit = Some(status);
                if !clean || (plan.is_master() && ranks[rank].data_addr.is_none()) {
                    ranks[rank].mark_trouble(&mut seq);
                    fail(&mut stop, Stop::Failure);
                }
            }
            _ = sigint.recv() => {
                stop = Some((Stop::Interrupted, Instant::now()));
                break;
            }
            _ = sigterm.recv() => {
                stop = Some((Stop::Interrupted, Instant::now()));
                break;
            }
            _ = tokio::time::sleep_until(hello_deadline), if !started && stop.is_none() => {
                fail(&mut stop, Stop::HelloTimeout((0..plan.world).filter(|&r| ranks[r].data_addr.is_none()).collect()));
            }
            _ = tokio::time::sleep_until(next_watch), if watchdog.is_some() && stop.is_none() && hung.is_none() => {
                next_watch = Instant::now() + watch_tick;
                if let Some(report) = watchdog.as_ref().and_then(|w| w.check(Instant::now().into_std())) {
                    // Before stopping anyone: what every rank's last collectives were.
                    ask_for_flight(&mut ranks).await;
                    hung = Some((report, Instant::now() + DUMP_WAIT));
                }
            }
            _ = tokio::time::sleep_until(dump_until.unwrap_or(hello_deadline)), if dump_until.is_some() => {}
            _ = tokio::time::sleep_until(settle_at.unwrap_or(hello_deadline)), if settle_at.is_some() => break,
            _ = tokio::time::sleep(Duration::from_millis(500)), if done_since.is_some() => {}
        }
    }

    // Tear down: kill this node's ranks, close every control connection, reap.
    let _ = kill_tx.send(true);
    if let Some(a) = &acceptor {
        a.abort();
    }
    for r in ranks.iter_mut() {
        r.writer = None;
    }
    let reap_deadline = Instant::now() + Duration::from_secs(10);
    while ranks.iter().any(|r| r.local && r.exit.is_none()) {
        match tokio::time::timeout_at(reap_deadline, exit_rx.recv()).await {
            Ok(Some(Exited { rank, status })) => {
                ranks[rank].killed = true;
                ranks[rank].exit = Some(status);
            }
            Ok(None) | Err(_) => break,
        }
    }
    progress.finish();
    let leftover: Vec<usize> = (0..plan.world).filter(|&r| ranks[r].local && ranks[r].exit.is_none()).collect();
    if !leftover.is_empty() {
        out::warn(&format!(
            "launcher: warning: ranks {} could not be reaped (pids {}); check for leftover processes",
            rank_list(&leftover),
            some(&pids)
        ));
    }
    if !plan.is_master() {
        // Step reports go to node 0: this node reads its ranks' last steps from their logs.
        for r in plan.local_rank_ids() {
            let (step, lost) = logged_end(&plan.log_path(r), r);
            ranks[r].last_step = step;
            // Which of its ranks failed first is the order their exits arrived in; a rank
            // whose log says it lost a peer is a consequence, whatever its exit's place.
            if let (None, Some(p)) = (&ranks[r].failed, lost) {
                ranks[r].failed = Some((format!("lost rank {p}"), Some(p)));
            }
        }
    }

    let lost = lost_log_lines(plan, &ranks);
    match stop {
        None if plan.doctor.is_some() => doctor_verdict(plan, &mut ranks),
        None => {
            match &metrics {
                Some(log) => out::say(&log.summary()),
                None => out::say(&format!(
                    "node {}: ranks {} finished; metrics and progress are on node 0",
                    plan.node_rank,
                    rank_list(&plan.local_rank_ids().collect::<Vec<_>>())
                )),
            }
            if let Some(lost) = lost {
                out::say(&lost);
            }
            Ok(())
        }
        Some((Stop::Interrupted, _)) => Err(Interrupted(plan.local_ranks).into()),
        Some((Stop::Fatal(msg), _)) => anyhow::bail!("{msg}\nstopped every rank of this node"),
        Some((Stop::Refused(msg), _)) => {
            Err(JobError { code: SETUP_EXIT, message: format!("{msg}\nstopped every rank of this node") }.into())
        }
        Some((Stop::Hung(report), _)) => {
            Err(JobError { code: HUNG_EXIT, message: hung_report(plan, &ranks, report) }.into())
        }
        Some((Stop::HelloTimeout(missing), _)) => {
            anyhow::bail!(hello_timeout_report(plan, &ranks, &missing, &rejected))
        }
        Some((Stop::Failure, _)) => {
            let (code, mut message) = failure_report(plan, &ranks, &oom, flight_report(plan, &ranks));
            if let Some(lost) = lost {
                message = format!("{message}\n{lost}");
            }
            Err(JobError { code, message }.into())
        }
    }
}

/// `launcher doctor`'s end: node 0 prints the report of every rank's measurements and fails
/// with [`crate::doctor::SLOW_EXIT`] when something is slow; other nodes say where it is.
fn doctor_verdict(plan: &RunPlan, ranks: &mut [RankState]) -> anyhow::Result<()> {
    let spec = plan.doctor.as_ref().context("a doctor run without its plan (a bug: please report it)")?;
    if !plan.is_master() {
        out::say(&format!("{}: measured; the report is on node 0", plan.launcher_name(plan.node_rank)));
        return Ok(());
    }
    let missing: Vec<usize> = (0..plan.world).filter(|&r| ranks[r].doctor.is_none()).collect();
    if !missing.is_empty() {
        anyhow::bail!("launcher doctor: ranks {} finished without sending their measurements", rank_list(&missing));
    }
    let reports: Vec<_> = ranks.iter_mut().map(|r| r.doctor.take().unwrap_or_default()).collect();
    let node_of = crate::doctor::nodes_of(&reports, plan.local_ranks, plan.one_rank);
    let report = crate::doctor::report::analyse(&crate::doctor::report::Input {
        spec,
        node_of,
        ranks: reports,
        gpu: plan.device == crate::job::device::Device::Gpu,
    });
    out::say(&report.text());
    if let Some(path) = &spec.json {
        let text = serde_json::to_vec_pretty(&report).context("serializing the doctor's report")?;
        std::fs::write(path, text).with_context(|| format!("cannot write the report to {}", path.display()))?;
    }
    if report.ok() {
        return Ok(());
    }
    Err(JobError {
        code: crate::doctor::SLOW_EXIT,
        message: format!(
            "launcher doctor: the network is slower than {:.0}% of what is expected (see the verdict above)",
            spec.threshold * 100.0
        ),
    }
    .into())
}

/// The summary's line on rank log lines that could not be written (node 0 hears from every
/// rank), or `None` when none was lost.
fn lost_log_lines(plan: &RunPlan, ranks: &[RankState]) -> Option<String> {
    let total: u64 = ranks.iter().map(|r| r.log_lost).sum();
    if total == 0 {
        return None;
    }
    let per_rank: Vec<String> = ranks
        .iter()
        .enumerate()
        .filter(|(_, r)| r.log_lost > 0)
        .map(|(i, r)| format!("rank {i}: {}", r.log_lost))
        .collect();
    let first = ranks.iter().find_map(|r| r.log_error.as_deref()).unwrap_or("unknown error");
    Some(format!(
        "warning: {total} lines of the rank logs could not be written ({}; first error: {first}): the logs in {} \
         are incomplete; training did not stop for it",
        per_rank.join(", "),
        plan.logs_dir.display()
    ))
}

/// Ask every rank still connected, once, for its flight recorder (`Msg::Flight` answers).
async fn ask_for_flight(ranks: &mut [RankState]) {
    for r in ranks.iter_mut().filter(|r| !r.dump_asked && !r.done && r.closed.is_none()) {
        let Some(w) = r.writer.as_mut() else { continue };
        r.dump_asked = true;
        // A rank that cannot be asked is reported from its last heartbeat.
        let _ = tokio::time::timeout(Duration::from_secs(1), protocol::send_async(w, &Msg::DumpFlight)).await;
    }
}

/// The flight recorder's report over every rank (node 0, which hears from all of them).
fn flight_report(plan: &RunPlan, ranks: &[RankState]) -> Option<String> {
    if !plan.is_master() {
        return None;
    }
    let units: Vec<String> =
        trainer::model::ModelLayout::new(&plan.cfg.model).units.iter().map(|u| u.name.clone()).collect();
    let records: Vec<crate::run::flight::RankRecords> = ranks
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.done)
        .map(|(rank, r)| crate::run::flight::RankRecords { rank, dump: r.flight.as_deref(), heard: r.heard.as_ref() })
        .collect();
    crate::run::flight::report(&records, &units, collectives::flight::now_us())
}

/// Tell every connected rank to stop (they abort their communicators and exit).
async fn stop_every_rank(ranks: &mut [RankState], reason: &str, kind: StopKind) {
    let stop = Msg::Stop { reason: reason.to_string(), kind };
    for r in ranks.iter_mut() {
        if let Some(w) = r.writer.as_mut() {
            // A rank that cannot be told is killed (this node) or loses its connection (others).
            let _ = tokio::time::timeout(Duration::from_secs(1), protocol::send_async(w, &stop)).await;
        }
    }
}

/// The watchdog's report, with the run's logs and the log tail of the first rank behind.
fn hung_report(plan: &RunPlan, ranks: &[RankState], report: String) -> String {
    let mut s = report;
    let first_behind = s
        .lines()
        .find_map(|l| l.strip_prefix("ranks behind: "))
        .and_then(|l| l.split([',', ' ']).next())
        .and_then(|r| r.parse::<usize>().ok());
    if let Some(r) = first_behind.filter(|&r| r < ranks.len()) {
        s += &log_section(plan, r);
    }
    s += &format!("\nrank logs: {}", plan.logs_dir.display());
    s
}

/// Start stopping the job, unless it is already stopping for an earlier reason.
fn fail(stop: &mut Option<(Stop, Instant)>, why: Stop) {
    stop.get_or_insert((why, Instant::now()));
}

/// Every rank reported `Done` (node 0) and every local process exited cleanly.
fn finished(plan: &RunPlan, ranks: &[RankState]) -> bool {
    let all_exited = ranks.iter().filter(|r| r.local).all(|r| r.exited_ok());
    all_exited && (!plan.is_master() || ranks.iter().all(|r| r.done))
}

/// Tell every rank the group's addresses; a rank that cannot be told has failed.
async fn send_start(ranks: &mut [RankState], progress: &Progress, nccl_id: &Option<Vec<u8>>) {
    let peers: Vec<String> = ranks.iter().map(|r| r.data_addr.clone().unwrap_or_default()).collect();
    let start = Msg::Start { world: ranks.len() as u32, peers, nccl_id: nccl_id.clone() };
    for (rank, r) in ranks.iter_mut().enumerate() {
        if let Some(w) = r.writer.as_mut() {
            if let Err(e) = protocol::send_async(w, &start).await {
                // The reader side will report the closed connection; say why here.
                progress.println(&format!("launcher: cannot send Start to rank {rank}: {e}"));
            }
        }
    }
}

/// Pick the rank that failed first and describe it, the others, and its log tail; with the
/// exit code: 2 when it failed on data, a checkpoint or the config (or node 0 refused this
/// node), 3 when node 0's watchdog stopped the job, else 1. A rank killed by SIGKILL that
/// the launcher did not kill gets the OOM check's verdict (`oom.rs`).
fn failure_report(plan: &RunPlan, ranks: &[RankState], oom: &OomWatch, flight: Option<String>) -> (u8, String) {
    let culprit = culprit(ranks);
    let r = &ranks[culprit];
    let exit_code = |rs: &RankState| match &rs.exit {
        Some(Ok(s)) => s.code(),
        _ => None,
    };
    let code = if r.setup_failure {
        SETUP_EXIT
    } else if !plan.is_master()
        && ranks.iter().any(|x| x.local && exit_code(x) == Some(StopKind::Hung.exit_code().into()))
    {
        HUNG_EXIT
    } else if !plan.is_master() && exit_code(r) == Some(StopKind::Refused.exit_code().into()) {
        SETUP_EXIT
    } else {
        1
    };
    // A node other than 0 knows nothing of the ranks elsewhere: their own launchers report them.
    let known = |o: usize| plan.is_master() || ranks[o].local;
    let mut what = Vec::new();
    if let Some((message, _)) = &r.failed {
        what.push(format!("reported: {message}"));
    }
    let mut last_step = r.last_step;
    if known(culprit) {
        what.push(fate(r));
    } else {
        // Blamed by this node's ranks (they lost it); they were in step with it.
        what.push(format!(
            "this {}'s ranks lost it; {}'s launcher reports why",
            if plan.one_rank { "task" } else { "node" },
            plan.launcher_name(culprit / plan.local_ranks.max(1))
        ));
        last_step = ranks.iter().filter(|x| x.local).map(|x| x.last_step).max().unwrap_or(0);
    }
    if !r.killed && r.exit.as_ref().and_then(ranks::killed_by) == Some(9) {
        what.push(oom.explain_sigkill());
    }
    let after = match (last_step, &plan.resume) {
        (0, None) => "before its first step".to_string(),
        (0, Some(resume)) => format!("before its first step after resuming at step {}", resume.step),
        (step, _) => format!("after step {step} of {}", plan.cfg.train.steps),
    };
    let mut s = format!("{} failed {after}: {}", rank_name(plan, culprit), what.join("; "));
    let others: Vec<String> = (0..ranks.len())
        .filter(|&o| o != culprit && known(o))
        .map(|o| match &ranks[o].failed {
            Some((_, Some(peer))) => {
                format!("{} {} after losing {}", rank_name(plan, o), fate(&ranks[o]), rank_name(plan, *peer as usize))
            }
            _ => format!("{} {}", rank_name(plan, o), fate(&ranks[o])),
        })
        .collect();
    if !others.is_empty() {
        s += &format!("\nthe other ranks were stopped: {}", others.join("; "));
    }
    let elsewhere: Vec<usize> = (0..ranks.len()).filter(|&o| o != culprit && !known(o)).collect();
    if !elsewhere.is_empty() {
        s += &format!(
            "\nranks {} run on other {}: {}'s launcher reports how the job ended for them",
            rank_list(&elsewhere),
            if plan.one_rank { "tasks" } else { "nodes" },
            plan.launcher_name(0)
        );
    }
    if code == HUNG_EXIT {
        s += "\nnode 0's hang watchdog stopped the job: its output says where every rank was";
    }
    if let Some(f) = flight {
        s += &format!("\n{f}");
    }
    s += &log_section(plan, culprit);
    (code, s)
}

/// "rank 2", or in a job of several nodes "rank 2 (node 1)" (with `--one-rank` the task is
/// the rank: "rank 2").
fn rank_name(plan: &RunPlan, rank: usize) -> String {
    if plan.multi_node() && !plan.one_rank {
        format!("rank {rank} (node {})", rank / plan.local_ranks.max(1))
    } else {
        format!("rank {rank}")
    }
}

/// How a rank's process (or, on another node, its connection) ended.
fn fate(r: &RankState) -> String {
    match &r.exit {
        Some(_) if r.killed => "was killed by the launcher".to_string(),
        Some(status) if r.exited_ok() && !r.done => format!("{} without finishing", describe_status(status)),
        Some(status) => describe_status(status),
        None if r.local => "could not be reaped".to_string(),
        None => match &r.closed {
            Some(Some(e)) => format!("lost its control connection ({e})"),
            Some(None) => "closed its control connection".to_string(),
            None => "was told to stop".to_string(),
        },
    }
}

/// The earliest rank that failed on its own account; else the rank others blamed; else the first in trouble.
fn culprit(ranks: &[RankState]) -> usize {
    let troubled = || {
        let mut t: Vec<(u64, usize)> =
            ranks.iter().enumerate().filter_map(|(i, r)| r.trouble_seq.map(|s| (s, i))).collect();
        t.sort();
        t.into_iter().map(|(_, i)| i)
    };
    let blames_peer = |r: &RankState| matches!(r.failed, Some((_, Some(_))));
    if let Some(root) = troubled().find(|&i| !blames_peer(&ranks[i])) {
        return root;
    }
    if let Some(p) = troubled().find_map(|i| ranks[i].failed.as_ref().and_then(|(_, p)| *p)) {
        if (p as usize) < ranks.len() {
            return p as usize;
        }
    }
    troubled().next().unwrap_or(0)
}

fn hello_timeout_report(plan: &RunPlan, ranks: &[RankState], missing: &[usize], rejected: &[String]) -> String {
    let mut s = format!(
        "rank{} {} did not connect to the rendezvous within {}s; stopped every rank",
        if missing.len() > 1 { "s" } else { "" },
        rank_list(missing),
        HELLO_TIMEOUT.as_secs()
    );
    let remote: Vec<usize> = missing.iter().copied().filter(|&r| !ranks[r].local).collect();
    if !remote.is_empty() {
        let rendezvous = plan.master_name.clone().unwrap_or_default();
        s += &match &plan.env_source {
            Some(source) => format!(
                "\nmissing ranks on other {}: {}; is every task of the job running (this launcher read its place from \
                 {source}), with the same config and --cpus/--gpus, and does each reach {rendezvous}?",
                if plan.one_rank { "tasks" } else { "nodes" },
                rank_list(&remote),
            ),
            None => format!(
                "\nmissing ranks on other nodes: {}; is `launcher --nnodes {} --node-rank K --master-addr {}` running \
                 on every node K, with the same --cpus?",
                rank_list(&remote),
                plan.world / plan.local_ranks,
                rendezvous
            ),
        };
    }
    if !rejected.is_empty() {
        s += &format!("\nconnections turned away meanwhile:\n  {}", rejected.join("\n  "));
    }
    if let Some(&first_local) = missing.iter().find(|&&r| ranks[r].local) {
        s += &log_section(plan, first_local);
    }
    s
}

fn log_section(plan: &RunPlan, rank: usize) -> String {
    if !plan.local_rank_ids().contains(&rank) {
        return format!("\nrank {rank} ran on another node: see logs/rank{rank}.log in that node's output.dir");
    }
    let path = plan.log_path(rank);
    format!("\nlast {TAIL_LINES} lines of {}:\n{}", path.display(), log_tail(&path, TAIL_LINES))
}

/// The first few of many numbers (pids): a report line stays a line.
fn some(xs: &[u32]) -> String {
    const SHOWN: usize = 8;
    let head: Vec<String> = xs.iter().take(SHOWN).map(|x| x.to_string()).collect();
    if xs.len() > SHOWN {
        format!("{}, ... ({} in all)", head.join(", "), xs.len())
    } else {
        head.join(", ")
    }
}

fn signal(kind: SignalKind) -> anyhow::Result<Signal> {
    tokio::signal::unix::signal(kind)
        .with_context(|| format!("cannot install a handler for {}", crate::signals::name(kind.as_raw_value())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_stay_short() {
        assert_eq!(some(&[1, 2, 3]), "1, 2, 3");
        assert!(some(&(0..1000).collect::<Vec<u32>>()).ends_with("7, ... (1000 in all)"));
    }
}
