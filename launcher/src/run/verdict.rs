//! How a job ended, in words and an exit code: the rank that failed first and why, with its
//! log's tail (`failure_report`: where the judgement of `supervise.rs` (beside it) is explained), the
//! hang watchdog's report, the ranks that never said hello, a doctor run's verdict, the
//! flight recorders compared, and the log lines the ranks could not write.

use crate::errors::{JobError, HUNG_EXIT, SETUP_EXIT};
use crate::job::setup::RunPlan;
use crate::out::{self, rank_list};
use crate::run::oom::OomWatch;
use crate::run::protocol::StopKind;
use crate::run::rank_state::RankState;
use crate::run::ranks::{self, describe_status, log_tail};
use anyhow::Context;
use std::time::Duration;

/// Log lines shown for a failed rank.
const TAIL_LINES: usize = 20;

/// `launcher doctor`'s end: node 0 prints the report of every rank's measurements and fails
/// with [`crate::doctor::SLOW_EXIT`] when something is slow; other nodes say where it is.
pub(super) fn doctor_verdict(plan: &RunPlan, ranks: &mut [RankState]) -> anyhow::Result<()> {
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
pub(super) fn lost_log_lines(plan: &RunPlan, ranks: &[RankState]) -> Option<String> {
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

/// The flight recorder's report over every rank (node 0, which hears from all of them).
pub(super) fn flight_report(plan: &RunPlan, ranks: &[RankState]) -> Option<String> {
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

/// The watchdog's report, with the run's logs and the log tail of the first rank behind.
pub(super) fn hung_report(plan: &RunPlan, ranks: &[RankState], report: String) -> String {
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

/// Pick the rank that failed first and describe it, the others, and its log tail; with the
/// exit code: 2 when it failed on data, a checkpoint or the config (or node 0 refused this
/// node), 3 when node 0's watchdog stopped the job, else 1. A rank killed by SIGKILL that
/// the launcher did not kill gets the OOM check's verdict (`oom.rs`).
pub(super) fn failure_report(
    plan: &RunPlan,
    ranks: &[RankState],
    oom: &OomWatch,
    flight: Option<String>,
) -> (u8, String) {
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
pub(super) fn rank_name(plan: &RunPlan, rank: usize) -> String {
    if plan.multi_node() && !plan.one_rank {
        format!("rank {rank} (node {})", rank / plan.local_ranks.max(1))
    } else {
        format!("rank {rank}")
    }
}

/// How a rank's process (or, on another node, its connection) ended.
pub(super) fn fate(r: &RankState) -> String {
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
pub(super) fn culprit(ranks: &[RankState]) -> usize {
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

pub(super) fn hello_timeout_report(
    plan: &RunPlan,
    ranks: &[RankState],
    missing: &[usize],
    rejected: &[String],
    hello_timeout: Duration,
) -> String {
    let mut s = format!(
        "rank{} {} did not connect to the rendezvous within {}s; stopped every rank",
        if missing.len() > 1 { "s" } else { "" },
        rank_list(missing),
        hello_timeout.as_secs()
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

pub(super) fn log_section(plan: &RunPlan, rank: usize) -> String {
    if !plan.local_rank_ids().contains(&rank) {
        return format!("\nrank {rank} ran on another node: see logs/rank{rank}.log in that node's output.dir");
    }
    let path = plan.log_path(rank);
    format!("\nlast {TAIL_LINES} lines of {}:\n{}", path.display(), log_tail(&path, TAIL_LINES))
}
