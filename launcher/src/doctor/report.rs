//! Node 0's report of `launcher doctor`: every rank's timings joined into bus bandwidths,
//! compared with what the hardware should give, and a verdict naming the slow rank or link.
//!
//! Bus bandwidth follows nccl-tests: algorithm bandwidth (bytes / time) times `2(n-1)/n` for
//! an all-reduce and `(n-1)/n` for an all-gather (whose bytes are the gathered buffer), so it
//! compares with a link's speed whatever the rank count. A collective's time is its slowest
//! rank's. A link's bandwidth is the bytes one way over the slower side's best try.
//!
//! Expectations, per direction: within a node, the GPUs' NVLink or PCIe link (the slowest
//! rank's); across nodes, the node's InfiniBand ports together (else its fastest interface)
//! for the collectives, and one interface for a pair of ranks; `--expect-gbps` replaces them
//! all. CPU ranks on one node have none (loopback is memory): only `--expect-gbps` and the
//! comparison between links apply. Only the largest collective size is judged (smaller ones
//! are bound by latency).

use super::hardware::Hardware;
use super::spec::Spec;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The collectives measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Collective {
    AllReduce,
    AllGather,
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
        }
    }
    /// Bus bandwidth over algorithm bandwidth on `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather => (n - 1.0) / n,
        }
    }
}

/// One collective at one size as a rank timed it (mean per call).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub op: Collective,
    pub bytes: u64,
    pub seconds: f64,
    pub iters: u32,
}

/// A rank's best exchange with `peer`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkTiming {
    pub peer: u32,
    pub bytes: u64,
    pub seconds: f64,
}

/// What one rank sends node 0.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    pub hardware: Hardware,
    pub collectives: Vec<Timing>,
    pub links: Vec<LinkTiming>,
}

/// Node 0's input: every rank's report and where each rank runs.
pub struct Input<'a> {
    pub spec: &'a Spec,
    /// The node of each rank (launcher nodes; with `--one-rank`, ranks on one host).
    pub node_of: Vec<usize>,
    pub ranks: Vec<RankReport>,
    pub gpu: bool,
}

/// A collective at one size over the whole job.
#[derive(Debug, Clone, Serialize)]
pub struct CollectiveRow {
    pub op: Collective,
    pub bytes: u64,
    /// The slowest rank's mean per call, and that rank.
    pub seconds: f64,
    pub slowest_rank: usize,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
}

/// A pair of ranks.
#[derive(Debug, Clone, Serialize)]
pub struct LinkRow {
    pub a: usize,
    pub b: usize,
    pub across_nodes: bool,
    pub gbps: f64,
    /// Why it is slow (against the expectation, or its kind's best link), when it is.
    pub slow: Option<String>,
}

/// What a kind of connection should give (GB/s per direction) and where the figure is from.
#[derive(Debug, Clone, Serialize)]
pub struct Expected {
    pub gbps: f64,
    pub from: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub world: usize,
    pub nodes: usize,
    pub threshold: f64,
    pub collectives: Vec<CollectiveRow>,
    pub links: Vec<LinkRow>,
    pub intra: Option<Expected>,
    pub inter_job: Option<Expected>,
    pub inter_link: Option<Expected>,
    /// Every failure, worst first; empty when the network is as expected.
    pub findings: Vec<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.findings.is_empty()
    }
}

fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        f64::INFINITY
    }
}

fn min_expected(it: impl Iterator<Item = (f64, String)>) -> Option<Expected> {
    it.min_by(|a, b| a.0.total_cmp(&b.0)).map(|(gbps, from)| Expected { gbps, from })
}

/// Join the ranks' timings and judge them.
pub fn analyse(input: &Input) -> Report {
    let spec = input.spec;
    let world = input.ranks.len();
    let nodes = input.node_of.iter().collect::<std::collections::BTreeSet<_>>().len();
    let node = |r: usize| input.node_of.get(r).copied().unwrap_or(r);
    let given = spec.expect_gbps.map(|g| Expected { gbps: g, from: "--expect-gbps".into() });
    // One rank per node speaks for its node's interfaces (every rank of a node reads the same).
    let mut first_of_node: BTreeMap<usize, usize> = BTreeMap::new();
    for r in 0..world {
        first_of_node.entry(node(r)).or_insert(r);
    }
    let hw = |r: usize| &input.ranks[r].hardware;
    let intra = given.clone().or_else(|| {
        if !input.gpu {
            return None;
        }
        min_expected((0..world).filter_map(|r| hw(r).gpu.as_ref().and_then(|g| g.expected())))
    });
    let inter_job =
        given.clone().or_else(|| min_expected(first_of_node.values().filter_map(|&r| hw(r).node_network())));
    let inter_link =
        given.clone().or_else(|| min_expected(first_of_node.values().filter_map(|&r| hw(r).fastest_nic())));
    let mut findings = Vec::new();

    // Collectives: the slowest rank's time at each (op, size).
    let mut by_key: BTreeMap<(u64, Collective), (f64, usize)> = BTreeMap::new();
    for (r, rep) in input.ranks.iter().enumerate() {
        for t in &rep.collectives {
            let e = by_key.entry((t.bytes, t.op)).or_insert((0.0, r));
            if t.seconds > e.0 {
                *e = (t.seconds, r);
            }
        }
    }
    let collectives: Vec<CollectiveRow> = by_key
        .iter()
        .map(|(&(bytes, op), &(seconds, slowest_rank))| {
            let algbw = gbps(bytes, seconds);
            CollectiveRow {
                op,
                bytes,
                seconds,
                slowest_rank,
                algbw_gbps: algbw,
                busbw_gbps: algbw * op.bus_factor(world),
            }
        })
        .collect();
    let job_expected = if nodes > 1 { inter_job.as_ref() } else { intra.as_ref() };
    // One rank has no link to judge (its "collectives" are copies).
    let judged = if world > 1 { job_expected } else { None };
    if let (Some(e), Some(largest)) = (judged, collectives.iter().map(|c| c.bytes).max()) {
        for c in collectives.iter().filter(|c| c.bytes == largest) {
            if c.busbw_gbps < spec.threshold * e.gbps {
                findings.push(format!(
                    "{} of {} over the job's {world} ranks: {:.2} GB/s bus bandwidth, below {:.0}% of the {:.2} GB/s \
                     expected from {}",
                    c.op.name(),
                    size(c.bytes),
                    c.busbw_gbps,
                    spec.threshold * 100.0,
                    e.gbps,
                    e.from
                ));
            }
        }
    }

    // Links: both sides timed the pair; the slower side's best try counts.
    let mut pairs: BTreeMap<(usize, usize), (u64, f64)> = BTreeMap::new();
    for (r, rep) in input.ranks.iter().enumerate() {
        for l in &rep.links {
            let p = l.peer as usize;
            let e = pairs.entry((r.min(p), r.max(p))).or_insert((l.bytes, 0.0));
            e.1 = e.1.max(l.seconds);
        }
    }
    let mut links: Vec<LinkRow> = pairs
        .iter()
        .map(|(&(a, b), &(bytes, s))| LinkRow {
            a,
            b,
            across_nodes: node(a) != node(b),
            gbps: gbps(bytes, s),
            slow: None,
        })
        .collect();
    for across in [false, true] {
        let expected = if across { inter_link.as_ref() } else { intra.as_ref() };
        let best = links.iter().filter(|l| l.across_nodes == across).map(|l| l.gbps).fold(0.0, f64::max);
        for l in links.iter_mut().filter(|l| l.across_nodes == across) {
            l.slow = match expected {
                Some(e) if l.gbps < spec.threshold * e.gbps => Some(format!(
                    "below {:.0}% of the {:.2} GB/s expected from {}",
                    spec.threshold * 100.0,
                    e.gbps,
                    e.from
                )),
                _ if l.gbps < spec.threshold * best => Some(format!(
                    "below {:.0}% of the best link {} ({best:.2} GB/s)",
                    spec.threshold * 100.0,
                    if across { "across nodes" } else { "within a node" }
                )),
                _ => None,
            };
        }
    }
    findings.extend(name_the_culprits(&links, world, &node));
    Report { world, nodes, threshold: spec.threshold, collectives, links, intra, inter_job, inter_link, findings }
}

/// The slow links, said as briefly as is true: a rank that is in every slow link (of at
/// least two) and in all of its own links is named as the slow rank; otherwise each link.
fn name_the_culprits(links: &[LinkRow], world: usize, node: &dyn Fn(usize) -> usize) -> Vec<String> {
    let slow: Vec<&LinkRow> = links.iter().filter(|l| l.slow.is_some()).collect();
    if slow.is_empty() {
        return Vec::new();
    }
    let describe = |l: &LinkRow| {
        format!(
            "link {} <-> {} ({}): {:.2} GB/s, {}",
            l.a,
            l.b,
            if l.across_nodes {
                format!("node {} <-> node {}", node(l.a), node(l.b))
            } else {
                format!("within node {}", node(l.a))
            },
            l.gbps,
            l.slow.as_deref().unwrap_or_default()
        )
    };
    if slow.len() >= 2 {
        for r in 0..world {
            let in_every_slow = slow.iter().all(|l| l.a == r || l.b == r);
            let all_own_slow = links.iter().filter(|l| l.a == r || l.b == r).all(|l| l.slow.is_some());
            if in_every_slow && all_own_slow {
                let mut s = format!(
                    "rank {r} (node {}) is slow: all {} of its links are, and no other link is:",
                    node(r),
                    slow.len()
                );
                for l in &slow {
                    s += &format!("\n    {}", describe(l));
                }
                return vec![s];
            }
        }
    }
    slow.into_iter().map(describe).collect()
}

/// `1 MiB`, `64 KiB`, `1 GiB`; `~64 KiB` for an all-gather's buffer rounded down to a
/// multiple of the rank count (bandwidths use the exact bytes).
pub fn size(bytes: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        let whole = (bytes + (1 << shift) / 2) >> shift;
        if whole == 0 {
            continue;
        }
        let off = (whole << shift).abs_diff(bytes);
        if off == 0 {
            return format!("{whole} {unit}");
        }
        if off * 1000 <= bytes {
            return format!("~{whole} {unit}");
        }
    }
    format!("{bytes} B")
}

impl Report {
    /// The tables and the verdict, as printed.
    pub fn text(&self) -> String {
        let mut s = format!(
            "network check: {} rank(s) on {} node(s)\ncollectives over the whole job (the slowest rank's time per call; \
             bus bandwidth as nccl-tests computes it):\n  {:<10} {:>9} {:>11} {:>12} {:>12} {:>8}\n",
            self.world, self.nodes, "op", "size", "time ms", "algbw GB/s", "busbw GB/s", "slowest"
        );
        for c in &self.collectives {
            let _ = writeln!(
                s,
                "  {:<10} {:>9} {:>11.3} {:>12.2} {:>12.2} {:>8}",
                c.op.name(),
                size(c.bytes),
                c.seconds * 1e3,
                c.algbw_gbps,
                c.busbw_gbps,
                format!("rank {}", c.slowest_rank)
            );
        }
        for (kind, across) in [("within a node", false), ("across nodes", true)] {
            let v: Vec<&LinkRow> = self.links.iter().filter(|l| l.across_nodes == across).collect();
            if v.is_empty() {
                continue;
            }
            let mut g: Vec<f64> = v.iter().map(|l| l.gbps).collect();
            g.sort_by(f64::total_cmp);
            let _ = writeln!(
                s,
                "links {kind}: {} pair(s), GB/s per direction min {:.2}, median {:.2}, max {:.2}",
                v.len(),
                g[0],
                g[g.len() / 2],
                g[g.len() - 1]
            );
            if v.len() <= 16 {
                for l in &v {
                    let _ = writeln!(
                        s,
                        "  {:>4} <-> {:<4} {:>9.2} GB/s{}",
                        l.a,
                        l.b,
                        l.gbps,
                        if l.slow.is_some() { "  SLOW" } else { "" }
                    );
                }
            }
        }
        let show = |e: &Option<Expected>| {
            e.as_ref().map_or("nothing to compare with".to_string(), |e| format!("{:.2} GB/s ({})", e.gbps, e.from))
        };
        let _ = writeln!(s, "expected within a node: {}", show(&self.intra));
        if self.nodes > 1 {
            let _ = writeln!(
                s,
                "expected across nodes: job {}; one pair {}",
                show(&self.inter_job),
                show(&self.inter_link)
            );
        }
        if self.world < 2 {
            let _ = write!(s, "verdict: nothing to check: one rank has no link to another (start 2 or more)");
        } else if self.ok() {
            let _ = write!(s, "verdict: OK (nothing below {:.0}% of what is expected)", self.threshold * 100.0);
        } else {
            let _ = write!(s, "verdict: SLOW");
            for f in &self.findings {
                let _ = write!(s, "\n  - {f}");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::super::hardware::{GpuLinks, Hardware, Nic};
    use super::*;

    fn spec() -> Spec {
        Spec { sizes: vec![1 << 20], link_bytes: 1 << 30, expect_gbps: None, threshold: 0.5, json: None }
    }

    /// Four ranks, every link 10 GB/s but rank 3's at 1 GB/s: rank 3 is named.
    fn links(world: usize, slow: Option<usize>, seconds_of: impl Fn(usize, usize) -> f64) -> Vec<RankReport> {
        (0..world)
            .map(|r| RankReport {
                hardware: Hardware::default(),
                collectives: vec![Timing { op: Collective::AllReduce, bytes: 1 << 30, seconds: 0.1, iters: 3 }],
                links: (0..world)
                    .filter(|&p| p != r)
                    .map(|p| {
                        let s = if slow.is_some_and(|x| x == r || x == p) { 1.0737 } else { seconds_of(r, p) };
                        LinkTiming { peer: p as u32, bytes: 1 << 30, seconds: s }
                    })
                    .collect(),
            })
            .collect()
    }

    #[test]
    fn a_slow_rank_is_named_and_a_single_slow_link_is_said_as_one() {
        let spec = spec();
        let r =
            analyse(&Input { spec: &spec, node_of: vec![0; 4], ranks: links(4, Some(3), |_, _| 0.10737), gpu: false });
        assert_eq!(r.findings.len(), 1, "{:#?}", r.findings);
        assert!(r.findings[0].starts_with("rank 3 (node 0) is slow: all 3 of its links"), "{}", r.text());
        assert!(r.text().contains("verdict: SLOW"), "{}", r.text());
        // busbw of a 1 GiB all-reduce in 0.1 s over 4 ranks: 10.74 GB/s × 1.5.
        assert!((r.collectives[0].busbw_gbps - 16.106).abs() < 0.01, "{:?}", r.collectives);

        let one = analyse(&Input {
            spec: &spec,
            node_of: vec![0; 4],
            ranks: links(4, None, |a, b| if a.min(b) == 0 && a.max(b) == 1 { 1.0737 } else { 0.10737 }),
            gpu: false,
        });
        assert_eq!(one.findings.len(), 1, "{:#?}", one.findings);
        assert!(
            one.findings[0].starts_with("link 0 <-> 1 (within node 0): 1.00 GB/s, below 50% of the best"),
            "{}",
            one.findings[0]
        );

        assert_eq!(
            (size(1 << 20), size(65532), size(100)),
            ("1 MiB".to_string(), "~64 KiB".to_string(), "100 B".to_string())
        );
        let fine =
            analyse(&Input { spec: &spec, node_of: vec![0; 4], ranks: links(4, None, |_, _| 0.10737), gpu: false });
        assert!(fine.ok() && fine.text().contains("verdict: OK"), "{}", fine.text());
    }

    /// Two nodes of two GPU ranks: a job at a tenth of the InfiniBand speed fails against
    /// the NICs; `--expect-gbps` replaces the hardware's figure.
    #[test]
    fn the_job_is_judged_against_the_nics_across_nodes_and_the_override() {
        let gpu = GpuLinks {
            name: "NVIDIA H100 80GB HBM3".into(),
            nvlink_gbps: Some(450.0),
            peer_access: true,
            ..Default::default()
        };
        let hw = |host: &str| Hardware {
            host: host.into(),
            gpu: Some(gpu.clone()),
            nics: vec![Nic { name: "mlx5_0 port 1".into(), infiniband: true, gbps: 50.0 }],
        };
        let mut ranks = links(4, None, |_, _| 0.10737);
        for (r, rep) in ranks.iter_mut().enumerate() {
            rep.hardware = hw(if r < 2 { "a" } else { "b" });
            // 1 GiB all-reduce in 0.4 s: 4.03 GB/s bus bandwidth, against 50 GB/s of NIC.
            rep.collectives[0].seconds = 0.4;
        }
        let spec = spec();
        let r = analyse(&Input { spec: &spec, node_of: vec![0, 0, 1, 1], ranks: ranks.clone(), gpu: true });
        assert_eq!(r.nodes, 2);
        assert!(
            r.findings.iter().any(|f| f.starts_with("all_reduce of 1 GiB over the job's 4 ranks: 4.03 GB/s")),
            "{}",
            r.text()
        );
        // Links at 10 GB/s: below half of NVLink (450) within a node and of one 50 GB/s port across.
        assert!(r.links.iter().all(|l| l.slow.is_some()), "{}", r.text());
        let low = Spec { expect_gbps: Some(5.0), ..spec };
        let r = analyse(&Input { spec: &low, node_of: vec![0, 0, 1, 1], ranks, gpu: true });
        assert!(r.ok(), "{}", r.text());
        assert!(r.text().contains("5.00 GB/s (--expect-gbps)"), "{}", r.text());
    }
}
