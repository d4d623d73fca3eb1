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
//!
//! Split by idea: this file holds the loop and its reactions (a [`Supervisor`] per job),
//! `rank_state.rs` what is known of each rank, `verdict.rs` the reports that say how the job
//! ended (the rank that failed first, the hang, the missing hellos).

use crate::errors::{Interrupted, JobError, HUNG_EXIT, SETUP_EXIT};
use crate::job::setup::RunPlan;
use crate::out::{self, rank_list};
use crate::run::metrics::MetricsLog;
use crate::run::oom::OomWatch;
use crate::run::progress::Progress;
use crate::run::protocol::{self, Bootstrap, Msg, StopKind};
use crate::run::rank_state::{RankState, Stop};
use crate::run::ranks::{self, logged_end, Exited};
use crate::run::rendezvous::{self, ConnEvent};
use crate::run::verdict::{
    doctor_verdict, failure_report, flight_report, hello_timeout_report, hung_report, lost_log_lines,
};
use crate::run::watchdog::Watchdog;
use anyhow::Context;
use std::net::SocketAddr;
use std::process::ExitStatus;
use std::time::Duration;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpListener;
use tokio::signal::unix::{Signal, SignalKind};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
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

/// Connections turned away that are remembered for the hello-timeout report.
const REMEMBERED_REJECTIONS: usize = 20;

/// Run the job to the end; `Ok` when every rank finished.
pub async fn run(plan: &RunPlan) -> anyhow::Result<()> {
    let (conn_tx, mut conn_rx) = mpsc::unbounded_channel::<ConnEvent>();
    let (exit_tx, mut exit_rx) = mpsc::unbounded_channel::<Exited>();
    let (kill_tx, kill_rx) = watch::channel(false);
    let (rendezvous_addr, acceptor) = open_rendezvous(plan, &conn_tx).await?;
    drop(conn_tx);

    let mut ranks: Vec<RankState> = (0..plan.world).map(|_| RankState::default()).collect();
    for r in plan.local_rank_ids() {
        ranks[r].local = true;
    }
    let timeout = Duration::from_secs_f64(plan.cfg.watchdog.timeout_s);
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

    let mut job = Supervisor::new(plan, ranks, acceptor, timeout)?;
    job.announce(&pids, rendezvous_addr);
    job.watch(&mut conn_rx, &mut exit_rx, heartbeat).await?;
    job.tear_down(&kill_tx, &mut exit_rx, &pids).await;
    job.verdict(&oom)
}

/// Node 0 listens for the ranks (the rendezvous); another node first waits until node 0
/// answers and takes this job's token, then points its ranks at it.
async fn open_rendezvous(
    plan: &RunPlan,
    conn_tx: &mpsc::UnboundedSender<ConnEvent>,
) -> anyhow::Result<(SocketAddr, Option<JoinHandle<()>>)> {
    if plan.is_master() {
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
        Ok((addr, Some(tokio::spawn(rendezvous::accept_loop(listener, plan.world, token, conn_tx.clone())))))
    } else {
        let addr = plan.master_addr.context("--master-addr is required on nodes other than 0")?;
        // No rank starts before node 0 answers and takes this job's token: until then this
        // node says what it waits for, and where.
        rendezvous::reach_master(addr, plan.node_rank, &plan.token, HELLO_TIMEOUT, MASTER_WAIT_NOTE, out::warn)
            .await
            .map_err(|e| JobError { code: SETUP_EXIT, message: format!("{}: {e}", plan.launcher_name(plan.node_rank)) })?;
        Ok((addr, None))
    }
}

/// One job as its launcher watches it: every rank's state, and what has been decided.
struct Supervisor<'a> {
    plan: &'a RunPlan,
    ranks: Vec<RankState>,
    /// Node 0: the task accepting rank connections (stopped once all are in).
    acceptor: Option<JoinHandle<()>>,
    progress: Progress,
    /// Node 0: `metrics.jsonl`.
    metrics: Option<MetricsLog>,
    timeout: Duration,
    watchdog_on: bool,
    total_steps: u64,
    /// Every rank said hello and was sent `Start` (other nodes: from the start).
    started: bool,
    /// Why the job is being stopped, and since when.
    stop: Option<(Stop, Instant)>,
    /// Since when every rank has reported `Done`.
    done_since: Option<Instant>,
    /// The order in which ranks showed trouble ([`RankState::mark_trouble`]).
    seq: u64,
    watchdog: Option<Watchdog>,
    /// The watchdog's report while the ranks' flight recorders are collected, and until when.
    hung: Option<(String, Instant)>,
    /// Connections turned away (for the hello-timeout report), and nodes refused.
    rejected: Vec<String>,
    refused_nodes: Vec<usize>,
    metrics_warned: bool,
    log_warned: bool,
}

impl<'a> Supervisor<'a> {
    fn new(
        plan: &'a RunPlan,
        ranks: Vec<RankState>,
        acceptor: Option<JoinHandle<()>>,
        timeout: Duration,
    ) -> anyhow::Result<Supervisor<'a>> {
        let total_steps = plan.cfg.train.steps as u64;
        let metrics = if plan.is_master() { Some(MetricsLog::open(&plan.metrics_path, plan.world)?) } else { None };
        let resumed_at = plan.resume.as_ref().map_or(0, |r| r.step);
        let progress = Progress::new(total_steps, resumed_at, plan.is_master());
        Ok(Supervisor {
            plan,
            ranks,
            acceptor,
            progress,
            metrics,
            timeout,
            watchdog_on: plan.is_master() && !timeout.is_zero(),
            total_steps,
            started: !plan.is_master(),
            stop: None,
            done_since: None,
            seq: 0,
            watchdog: None,
            hung: None,
            rejected: Vec::new(),
            refused_nodes: Vec::new(),
            metrics_warned: false,
            log_warned: false,
        })
    }

    /// The launch line, and (node 0) the generated job token and the checkpoint resumed from.
    fn announce(&self, pids: &[u32], rendezvous_addr: SocketAddr) {
        let (plan, progress, total_steps) = (self.plan, &self.progress, self.total_steps);
        progress.println(&format!(
            "launched {} {} rank(s) on {} (world {}, pids {}){}; rendezvous {}; logs in {}",
            plan.local_ranks,
            plan.device.name().to_uppercase(),
            plan.launcher_name(plan.node_rank),
            plan.world,
            some(pids),
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
    }

    /// The event loop: react to connections, messages, exits, signals and timers until the
    /// job has finished or is stopping and has settled.
    async fn watch(
        &mut self,
        conn_rx: &mut mpsc::UnboundedReceiver<ConnEvent>,
        exit_rx: &mut mpsc::UnboundedReceiver<Exited>,
        heartbeat: Duration,
    ) -> anyhow::Result<()> {
        let hello_deadline = Instant::now() + HELLO_TIMEOUT;
        let watch_tick = (heartbeat / 2).max(Duration::from_millis(25));
        // A fixed deadline, not a sleep re-armed every loop: heartbeats of many ranks arrive more
        // often than the tick and would otherwise keep postponing the check forever.
        let mut next_watch = Instant::now() + watch_tick;
        let (mut sigint, mut sigterm) = (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?);
        loop {
            if self.is_over() {
                break;
            }
            self.collect_flight().await;
            let settle_at = self.stop.as_ref().map(|(_, t)| *t + SETTLE);
            let dump_until = self.hung.as_ref().map(|(_, t)| *t);
            tokio::select! {
                Some(ev) = conn_rx.recv() => self.on_connection(ev).await,
                Some(Exited { rank, status }) = exit_rx.recv() => self.on_exit(rank, status),
                _ = sigint.recv() => {
                    self.stop = Some((Stop::Interrupted, Instant::now()));
                    break;
                }
                _ = sigterm.recv() => {
                    self.stop = Some((Stop::Interrupted, Instant::now()));
                    break;
                }
                _ = tokio::time::sleep_until(hello_deadline), if !self.started && self.stop.is_none() => {
                    let missing = (0..self.plan.world).filter(|&r| self.ranks[r].data_addr.is_none()).collect();
                    fail(&mut self.stop, Stop::HelloTimeout(missing));
                }
                _ = tokio::time::sleep_until(next_watch),
                    if self.watchdog.is_some() && self.stop.is_none() && self.hung.is_none() =>
                {
                    next_watch = Instant::now() + watch_tick;
                    self.check_watchdog().await;
                }
                _ = tokio::time::sleep_until(dump_until.unwrap_or(hello_deadline)), if dump_until.is_some() => {}
                _ = tokio::time::sleep_until(settle_at.unwrap_or(hello_deadline)), if settle_at.is_some() => break,
                _ = tokio::time::sleep(Duration::from_millis(500)), if self.done_since.is_some() => {}
            }
        }
        Ok(())
    }

    /// Whether the loop is over: the job finished, its ranks finished but do not exit, or it
    /// is stopping and every rank is gone (nothing more can be learned).
    fn is_over(&mut self) -> bool {
        let (plan, ranks) = (self.plan, &self.ranks);
        if self.done_since.is_none() && ranks.iter().all(|r| r.done) {
            self.done_since = Some(Instant::now());
        }
        if self.stop.is_none() && finished(plan, ranks) {
            return true;
        }
        if let Some(since) = self.done_since {
            if self.stop.is_none() && since.elapsed() >= EXIT_GRACE {
                let slow: Vec<usize> = plan.local_rank_ids().filter(|&r| ranks[r].exit.is_none()).collect();
                self.progress.println(&format!(
                    "launcher: warning: ranks {slow:?} finished training but did not exit within {EXIT_GRACE:?}: killing them"
                ));
                return true;
            }
        }
        self.stop.is_some()
            && ranks.iter().all(|r| (!r.local || r.exit.is_some()) && (r.writer.is_none() || r.closed.is_some()))
    }

    /// The flight recorders: after a failure every rank still there is asked for its own (the
    /// answers arrive while the failure settles); after a hang, the job is stopped once every
    /// rank asked has answered, or the wait is over.
    async fn collect_flight(&mut self) {
        if matches!(self.stop, Some((Stop::Failure, _))) && self.plan.is_master() {
            ask_for_flight(&mut self.ranks).await;
        }
        if let (Some((_, until)), None) = (&self.hung, &self.stop) {
            let answered = self.ranks.iter().all(|r| !r.dump_asked || r.flight.is_some() || r.closed.is_some());
            if answered || Instant::now() >= *until {
                let (report, _) = self.hung.take().expect("checked above");
                let report = match flight_report(self.plan, &self.ranks) {
                    Some(f) => format!("{report}\n{f}"),
                    None => report,
                };
                stop_every_rank(&mut self.ranks, &report, StopKind::Hung).await;
                fail(&mut self.stop, Stop::Hung(report));
            }
        }
    }

    /// The watchdog's tick: a hung job first has every rank's flight recorder asked for.
    async fn check_watchdog(&mut self) {
        if let Some(report) = self.watchdog.as_ref().and_then(|w| w.check(Instant::now().into_std())) {
            // Before stopping anyone: what every rank's last collectives were.
            ask_for_flight(&mut self.ranks).await;
            self.hung = Some((report, Instant::now() + DUMP_WAIT));
        }
    }

    /// A rendezvous event: a rank's hello, a message, a closed connection, a node reaching
    /// node 0, a connection turned away.
    async fn on_connection(&mut self, ev: ConnEvent) {
        match ev {
            ConnEvent::Hello { rank, peer, data_addr, fingerprint, writer } => {
                self.on_hello(rank, peer, data_addr, &fingerprint, writer).await;
            }
            ConnEvent::Msg { rank, msg } => self.on_message(rank, msg),
            // `Done` travels on the same connection before it closes, so a close without it is a failure.
            ConnEvent::Closed { rank, error } => {
                self.ranks[rank].closed = Some(error);
                if !self.ranks[rank].done {
                    self.ranks[rank].mark_trouble(&mut self.seq);
                    fail(&mut self.stop, Stop::Failure);
                }
            }
            ConnEvent::NodeUp { node, peer } => {
                self.progress.println(&format!(
                    "launcher: node {node} ({}) reached the rendezvous; its ranks follow",
                    peer.ip()
                ));
            }
            ConnEvent::Rejected { peer, reason, fatal } => {
                if fatal {
                    fail(&mut self.stop, Stop::Fatal(reason));
                } else {
                    self.progress.println(&format!("launcher: ignored a connection from {peer}: {reason}"));
                    if self.rejected.len() < REMEMBERED_REJECTIONS {
                        self.rejected.push(format!("{peer}: {reason}"));
                    }
                }
            }
        }
    }

    /// A rank's hello: refused when its node runs another job than node 0; once every rank
    /// is in, every rank is sent `Start` and the watchdog starts.
    async fn on_hello(
        &mut self,
        rank: usize,
        peer: SocketAddr,
        data_addr: String,
        fingerprint: &crate::job::fingerprint::Fingerprint,
        mut writer: OwnedWriteHalf,
    ) {
        let plan = self.plan;
        if self.ranks[rank].data_addr.is_some() {
            fail(
                &mut self.stop,
                Stop::Fatal(format!("two workers claim rank {rank}: give each node a distinct --node-rank")),
            );
            return;
        }
        let node = rank / plan.local_ranks.max(1);
        let (this, first) = (plan.launcher_name(node), plan.launcher_name(0));
        let diffs = crate::job::fingerprint::differences(&plan.fingerprint, fingerprint, &first, &this);
        if !diffs.is_empty() {
            let reason = format!(
                "{this} (rank {rank}, connecting from {}) does not run the same job as {first}: {}\n\
                 start every node with the same config file, --set overrides, --cpus/--gpus, --resume \
                 and launcher build",
                peer.ip(),
                diffs.join("; ")
            );
            let _ =
                protocol::send_async(&mut writer, &Msg::Stop { reason: reason.clone(), kind: StopKind::Refused }).await;
            if !self.refused_nodes.contains(&node) {
                self.refused_nodes.push(node);
                self.progress.println(&format!("launcher: refused {reason}"));
            }
            fail(&mut self.stop, Stop::Refused(reason));
            return;
        }
        self.ranks[rank].data_addr = Some(data_addr);
        self.ranks[rank].writer = Some(writer);
        if !self.started && self.stop.is_none() && self.ranks.iter().all(|r| r.data_addr.is_some()) {
            self.started = true;
            if let Some(a) = &self.acceptor {
                a.abort();
            }
            send_start(&mut self.ranks, &self.progress, &plan.nccl_id).await;
            if self.watchdog_on {
                self.watchdog = Some(Watchdog::new(
                    plan.world,
                    self.timeout,
                    plan.device == crate::job::device::Device::Cpu,
                    self.total_steps,
                    Instant::now().into_std(),
                ));
            }
        }
    }

    /// A control message from a rank.
    fn on_message(&mut self, rank: usize, msg: Msg) {
        let plan = self.plan;
        match msg {
            Msg::Heartbeat { progress: p, .. } => {
                if p.last.is_some() {
                    self.ranks[rank].heard = p.last.clone();
                }
                if let Some(w) = self.watchdog.as_mut() {
                    w.heartbeat(rank, p, Instant::now().into_std());
                }
            }
            Msg::Step { metrics: m, .. } => {
                self.ranks[rank].last_step = m.step;
                if let Some(w) = self.watchdog.as_mut() {
                    w.step(rank, m.step, Instant::now().into_std());
                }
                if let Some(log) = self.metrics.as_mut() {
                    match log.add(rank, *m) {
                        Ok(Some(rec)) => self.progress.step(&rec),
                        Ok(None) => {}
                        Err(e) => self.progress.println(&format!("launcher: warning: {e:#}")),
                    }
                    if let (false, Some(e)) = (self.metrics_warned, log.write_error()) {
                        self.metrics_warned = true;
                        out::warn(&format!(
                            "launcher: warning: {e}; training goes on, and the run summary counts every step"
                        ));
                    }
                }
            }
            Msg::LogLost { lines, error, .. } => {
                let r = &mut self.ranks[rank];
                r.log_lost = r.log_lost.max(lines);
                r.log_error.get_or_insert(error.clone());
                if !self.log_warned {
                    self.log_warned = true;
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
            Msg::Flight { records, .. } => self.ranks[rank].flight = Some(records),
            Msg::Doctor { report, .. } if plan.doctor.is_some() => self.ranks[rank].doctor = Some(*report),
            Msg::Done { .. } => {
                self.ranks[rank].done = true;
                if let Some(w) = self.watchdog.as_mut() {
                    w.done(rank);
                }
            }
            Msg::Failed { message, peer, setup, .. } => {
                self.ranks[rank].setup_failure = setup;
                self.ranks[rank].failed = Some((message, peer));
                self.ranks[rank].mark_trouble(&mut self.seq);
                fail(&mut self.stop, Stop::Failure);
            }
            other => {
                fail(&mut self.stop, Stop::Fatal(format!("rank {rank} sent an unexpected control message: {other:?}")))
            }
        }
    }

    /// A rank process of this node exited. A clean exit is judged by its connection (`Done`
    /// then close); a clean exit of a rank that never connected, or any unclean exit, is a
    /// failure now.
    fn on_exit(&mut self, rank: usize, status: std::io::Result<ExitStatus>) {
        let clean = matches!(&status, Ok(s) if s.success());
        self.ranks[rank].exit = Some(status);
        if !clean || (self.plan.is_master() && self.ranks[rank].data_addr.is_none()) {
            self.ranks[rank].mark_trouble(&mut self.seq);
            fail(&mut self.stop, Stop::Failure);
        }
    }

    /// Tear down: kill this node's ranks, close every control connection, reap; a node other
    /// than 0 then reads its ranks' last steps from their logs.
    async fn tear_down(
        &mut self,
        kill_tx: &watch::Sender<bool>,
        exit_rx: &mut mpsc::UnboundedReceiver<Exited>,
        pids: &[u32],
    ) {
        let (plan, ranks) = (self.plan, &mut self.ranks);
        let _ = kill_tx.send(true);
        if let Some(a) = &self.acceptor {
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
        self.progress.finish();
        let leftover: Vec<usize> = (0..plan.world).filter(|&r| ranks[r].local && ranks[r].exit.is_none()).collect();
        if !leftover.is_empty() {
            out::warn(&format!(
                "launcher: warning: ranks {} could not be reaped (pids {}); check for leftover processes",
                rank_list(&leftover),
                some(pids)
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
    }

    /// How the job ended: the summary, or the error with its exit code.
    fn verdict(mut self, oom: &OomWatch) -> anyhow::Result<()> {
        let plan = self.plan;
        let lost = lost_log_lines(plan, &self.ranks);
        match self.stop.take() {
            None if plan.doctor.is_some() => doctor_verdict(plan, &mut self.ranks),
            None => {
                match &self.metrics {
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
                Err(JobError { code: HUNG_EXIT, message: hung_report(plan, &self.ranks, report) }.into())
            }
            Some((Stop::HelloTimeout(missing), _)) => {
                anyhow::bail!(hello_timeout_report(plan, &self.ranks, &missing, &self.rejected, HELLO_TIMEOUT))
            }
            Some((Stop::Failure, _)) => {
                let (code, mut message) = failure_report(plan, &self.ranks, oom, flight_report(plan, &self.ranks));
                if let Some(lost) = lost {
                    message = format!("{message}\n{lost}");
                }
                Err(JobError { code, message }.into())
            }
        }
    }
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
