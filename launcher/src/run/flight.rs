//! The flight recorder's report (node 0): when the job hangs or a rank fails, every rank that
//! can answers with its last collectives (`Msg::Flight`; see `collectives::flight`), and the
//! ranks that cannot are known by the newest record of their last heartbeat. [`report`] lines
//! them up by sequence number and names the first collective at which the ranks disagree (one
//! called another collective, or the same with another size, element type or unit) or at
//! which some rank never arrived, with the ranks on each side, then each rank's last few
//! records. It exists because a hang looks the same from every rank that waits: only the
//! records side by side show which rank went elsewhere.

use crate::out::rank_list;
use crate::run::protocol::CollectiveRecord;
use std::collections::{BTreeMap, BTreeSet};

/// What node 0 has of one rank's collectives.
#[derive(Debug, Clone, Copy)]
pub struct RankRecords<'a> {
    pub rank: usize,
    /// Its answer to the dump: the whole ring, oldest first (`None`: no answer).
    pub dump: Option<&'a [CollectiveRecord]>,
    /// The newest record of its last heartbeat.
    pub heard: Option<&'a CollectiveRecord>,
}

/// Ranks whose last records are shown, and records per rank.
const SHOWN_RANKS: usize = 8;
const SHOWN_RECORDS: usize = 4;

/// The same collective on two ranks: kind, size, element type and unit agree.
fn signature(r: &CollectiveRecord) -> (&str, u64, &str, Option<u32>) {
    (r.op.as_str(), r.bytes, r.dtype.as_str(), r.unit)
}

/// "all_reduce of 5.3 KiB f32 for unit 2 (h.1)".
fn what(r: &CollectiveRecord, units: &[String]) -> String {
    let mut s = r.op.clone();
    if r.op != "barrier" {
        s += &format!(" of {} {}", size(r.bytes), r.dtype);
    }
    if let Some(u) = r.unit {
        match units.get(u as usize) {
            Some(name) => s += &format!(" for unit {u} ({name})"),
            None => s += &format!(" for unit {u}"),
        }
    }
    s
}

/// "#41 all_reduce of 5.3 KiB f32 for unit 2 (h.1), step 3 micro-step 0: done in 0.2 ms".
pub fn line(r: &CollectiveRecord, units: &[String], now_us: u64) -> String {
    line_as_of(r, units, Some(now_us))
}

/// [`line`](fn@line) of a record known as of some earlier moment (`now_us: None`: a heartbeat's).
fn line_as_of(r: &CollectiveRecord, units: &[String], now_us: Option<u64>) -> String {
    let took = |a: u64, b: u64| {
        let s = b.saturating_sub(a) as f64 / 1e6;
        if s < 1.0 {
            format!("{:.1} ms", s * 1e3)
        } else {
            format!("{s:.1} s")
        }
    };
    let how = match (r.state.as_str(), r.end_us) {
        ("running", _) => match now_us {
            Some(now) => format!("running for {}", took(r.start_us, now)),
            None => "inside it when last heard from".to_string(),
        },
        ("done", Some(e)) => format!("done in {}", took(r.start_us, e)),
        ("queued", Some(e)) => format!("queued in {} (runs on until waited for)", took(r.start_us, e)),
        ("failed", Some(e)) => format!("failed after {}", took(r.start_us, e)),
        (state, _) => state.to_string(),
    };
    format!("#{} {}, step {} micro-step {} ({}): {how}", r.seq, what(r, units), r.steps_done + 1, r.micro, r.phase)
}

fn size(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1024 => format!("{bytes} B"),
        1024..1048576 => format!("{:.1} KiB", b / 1024.0),
        1048576..1073741824 => format!("{:.1} MiB", b / 1048576.0),
        _ => format!("{:.2} GiB", b / 1073741824.0),
    }
}

fn ranks_word(ranks: &[usize]) -> String {
    format!("{} {}", if ranks.len() == 1 { "rank" } else { "ranks" }, rank_list(ranks))
}

/// The report, or `None` when no rank recorded any collective. `units` names the model's
/// units by index; `now_us` (microseconds since the Unix epoch) dates running collectives.
pub fn report(ranks: &[RankRecords<'_>], units: &[String], now_us: u64) -> Option<String> {
    if ranks.iter().all(|r| r.dump.is_none_or(|d| d.is_empty()) && r.heard.is_none()) {
        return None;
    }
    // Each answering rank's records by sequence number.
    let by_seq: Vec<(usize, BTreeMap<u64, &CollectiveRecord>)> =
        ranks.iter().filter_map(|r| r.dump.map(|d| (r.rank, d.iter().map(|x| (x.seq, x)).collect()))).collect();
    let reached = |m: &BTreeMap<u64, &CollectiveRecord>| m.keys().next_back().copied().unwrap_or(0);
    let furthest = by_seq.iter().map(|(_, m)| reached(m)).max().unwrap_or(0);
    let mut s = String::from("flight recorder (each rank's last collectives, lined up by number):");
    let mut named: Vec<usize> = Vec::new();

    // The first number at which answering ranks hold different collectives.
    let seqs: BTreeSet<u64> = by_seq.iter().flat_map(|(_, m)| m.keys().copied()).collect();
    let divergence = seqs.iter().find_map(|&q| {
        let mut groups: Vec<(&CollectiveRecord, Vec<usize>)> = Vec::new();
        for (rank, m) in &by_seq {
            let Some(rec) = m.get(&q) else { continue };
            match groups.iter_mut().find(|(g, _)| signature(g) == signature(rec)) {
                Some((_, rs)) => rs.push(*rank),
                None => groups.push((rec, vec![*rank])),
            }
        }
        (groups.len() > 1).then_some((q, groups))
    });
    // The first number some answering rank never reached while another did.
    let missing = by_seq.iter().filter(|(_, m)| reached(m) < furthest).map(|(rank, m)| (reached(m) + 1, *rank)).min();

    match (&divergence, missing) {
        (Some((q, groups)), m) if m.is_none_or(|(mq, _)| *q <= mq) => {
            let mut groups = groups.clone();
            groups.sort_by_key(|(_, rs)| std::cmp::Reverse(rs.len()));
            let first = groups[0].0;
            s += &format!(
                "\n  first divergence at collective #{q} (step {}, micro-step {}):",
                first.steps_done + 1,
                first.micro
            );
            for (rec, rs) in &groups {
                s += &format!("\n    {} called {}", ranks_word(rs), what(rec, units));
            }
            let majority = groups.len() > 1 && groups[0].1.len() > groups[1].1.len();
            let odd: Vec<usize> = groups.iter().skip(usize::from(majority)).flat_map(|(_, rs)| rs.clone()).collect();
            named.extend(&odd);
            if majority {
                s += &format!(
                    "\n  {} diverged: {} another collective there than the others (or with another size or unit)",
                    ranks_word(&odd),
                    if odd.len() == 1 { "it called" } else { "they called" }
                );
            } else {
                s += "\n  no majority: the ranks split evenly, so the records alone cannot tell which side diverged";
            }
        }
        (_, Some((q, _))) => {
            let there: Vec<(usize, &CollectiveRecord)> =
                by_seq.iter().filter_map(|(r, m)| m.get(&q).map(|x| (*r, *x))).collect();
            let absent: Vec<usize> = by_seq.iter().filter(|(_, m)| reached(m) < q).map(|(r, _)| *r).collect();
            let entered: Vec<usize> = there.iter().map(|(r, _)| *r).collect();
            let desc = there.first().map_or_else(String::new, |(_, x)| format!(" ({})", what(x, units)));
            s += &format!(
                "\n  collective #{q}{desc}: {} entered it; {} never did",
                ranks_word(&entered),
                ranks_word(&absent)
            );
            for r in &absent {
                let last = by_seq.iter().find(|(x, _)| x == r).and_then(|(_, m)| m.values().next_back());
                match last {
                    Some(l) => s += &format!("\n    rank {r}'s last: {}", line(l, units, now_us)),
                    None => s += &format!("\n    rank {r} recorded no collective"),
                }
            }
            named.extend(&absent);
        }
        _ if by_seq.len() == 1 => {
            s += &format!("\n  rank {} alone answered; it reached collective #{furthest}", by_seq[0].0);
        }
        _ if !by_seq.is_empty() => {
            let answered: Vec<usize> = by_seq.iter().map(|(r, _)| *r).collect();
            s += &format!("\n  {} agree on every collective they recorded, up to #{furthest}", ranks_word(&answered));
        }
        _ => {}
    }
    // Ranks that could not answer: what their last heartbeat said.
    let silent: Vec<&RankRecords> = ranks.iter().filter(|r| r.dump.is_none()).collect();
    if !silent.is_empty() {
        let ids: Vec<usize> = silent.iter().map(|r| r.rank).collect();
        s += &format!(
            "\n  {} did not answer (stopped, frozen, exited or unreachable); as last heard (heartbeats lag by up to a \
             second):",
            ranks_word(&ids)
        );
        for r in silent.iter().take(SHOWN_RANKS) {
            match r.heard {
                Some(h) if h.seq < furthest => {
                    s += &format!(
                        "\n    rank {} was at {}; behind the others' #{furthest}",
                        r.rank,
                        line_as_of(h, units, None)
                    )
                }
                Some(h) => s += &format!("\n    rank {} was at {}", r.rank, line_as_of(h, units, None)),
                None => s += &format!("\n    rank {} had sent no record (no heartbeat carried one)", r.rank),
            }
        }
        named.extend(ids.iter().filter(|r| !named.contains(r)).collect::<Vec<_>>());
    }
    // Each rank's last few records: the named ranks first.
    let mut order: Vec<usize> = named.clone();
    order.extend(by_seq.iter().map(|(r, _)| *r).filter(|r| !named.contains(r)));
    let shown: Vec<(usize, &BTreeMap<u64, &CollectiveRecord>)> = order
        .iter()
        .filter_map(|r| by_seq.iter().find(|(x, _)| x == r).map(|(x, m)| (*x, m)))
        .take(SHOWN_RANKS)
        .collect();
    if !shown.is_empty() {
        s += &format!("\n  last {SHOWN_RECORDS} collectives of each rank that answered (oldest first):");
        for (rank, m) in &shown {
            s += &format!("\n    rank {rank}:");
            let n = m.len();
            for rec in m.values().skip(n.saturating_sub(SHOWN_RECORDS)) {
                s += &format!("\n      {}", line(rec, units, now_us));
            }
        }
        if by_seq.len() > shown.len() {
            s += &format!("\n    ({} more ranks answered; their logs hold their records)", by_seq.len() - shown.len());
        }
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, op: &str, bytes: u64, unit: u32, state: &str) -> CollectiveRecord {
        CollectiveRecord {
            seq,
            op: op.into(),
            bytes,
            dtype: "f32".into(),
            unit: Some(unit),
            steps_done: 2,
            micro: 0,
            phase: "training".into(),
            start_us: 1_000_000,
            end_us: (state != "running").then_some(1_000_200),
            state: state.into(),
        }
    }

    fn units() -> Vec<String> {
        ["wte", "h.0", "h.1", "ln_f"].map(String::from).to_vec()
    }

    #[test]
    fn a_rank_that_called_another_collective_is_named() {
        let same =
            |unit: u32| vec![rec(40, "all_reduce", 5400, 3, "done"), rec(41, "all_reduce", 5400, unit, "running")];
        let (a, b, c) = (same(2), same(1), same(2));
        let ranks = [
            RankRecords { rank: 0, dump: Some(&a), heard: None },
            RankRecords { rank: 1, dump: Some(&b), heard: None },
            RankRecords { rank: 2, dump: Some(&c), heard: None },
        ];
        let r = report(&ranks, &units(), 4_000_000).expect("a report");
        assert!(r.contains("first divergence at collective #41 (step 3, micro-step 0)"), "{r}");
        assert!(r.contains("ranks 0, 2 called all_reduce of 5.3 KiB f32 for unit 2 (h.1)"), "{r}");
        assert!(r.contains("rank 1 called all_reduce of 5.3 KiB f32 for unit 1 (h.0)"), "{r}");
        assert!(r.contains("rank 1 diverged"), "{r}");
        assert!(r.contains("running for 3.0 s") && r.contains("#40 all_reduce"), "{r}");
    }

    #[test]
    fn a_rank_that_never_arrived_and_one_that_did_not_answer_are_named() {
        let ahead = vec![rec(40, "all_gather", 100, 1, "done"), rec(41, "reduce_scatter", 100, 1, "running")];
        let behind = vec![rec(39, "all_gather", 100, 0, "done"), rec(40, "all_gather", 100, 1, "done")];
        let heard = rec(38, "all_gather", 100, 0, "done");
        let ranks = [
            RankRecords { rank: 0, dump: Some(&ahead), heard: None },
            RankRecords { rank: 1, dump: Some(&behind), heard: None },
            RankRecords { rank: 2, dump: None, heard: Some(&heard) },
            RankRecords { rank: 3, dump: Some(&ahead), heard: None },
        ];
        let r = report(&ranks, &units(), 2_000_000).expect("a report");
        assert!(
            r.contains("collective #41 (reduce_scatter of 100 B f32 for unit 1 (h.0)): ranks 0, 3 entered it; rank 1 never did"),
            "{r}"
        );
        assert!(r.contains("rank 1's last: #40 all_gather"), "{r}");
        assert!(r.contains("rank 2 did not answer") && r.contains("rank 2 was at #38"), "{r}");
        assert!(r.contains("behind the others' #41"), "{r}");
        // The divergence at an earlier number wins over a rank missing later.
        let split = vec![rec(40, "broadcast", 8, 1, "done"), rec(41, "reduce_scatter", 100, 1, "running")];
        let ranks = [
            RankRecords { rank: 0, dump: Some(&ahead), heard: None },
            RankRecords { rank: 1, dump: Some(&split), heard: None },
        ];
        let r = report(&ranks, &units(), 2_000_000).expect("a report");
        assert!(r.contains("first divergence at collective #40") && r.contains("no majority"), "{r}");
        // Everyone agrees: said so; nothing recorded: no report.
        let ranks = [RankRecords { rank: 0, dump: Some(&ahead), heard: None }];
        assert!(report(&ranks, &units(), 0)
            .expect("report")
            .contains("rank 0 alone answered; it reached collective #41"));
        let ranks = [
            RankRecords { rank: 0, dump: Some(&ahead), heard: None },
            RankRecords { rank: 1, dump: Some(&ahead), heard: None },
        ];
        assert!(report(&ranks, &units(), 0).expect("report").contains("ranks 0, 1 agree on every collective"));
        assert!(report(&[RankRecords { rank: 0, dump: Some(&[]), heard: None }], &units(), 0).is_none());
    }
}
