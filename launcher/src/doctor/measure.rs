//! A rank's side of `launcher doctor`: time the job's collectives and every pair of ranks,
//! over the same communicators training uses (TCP for CPU ranks, NCCL for GPU ranks: [`Net`]).
//!
//! - Collectives: for each size, one untimed call, a barrier, then `iters` timed calls (a GPU
//!   rank waits for its stream after the last); each rank reports its mean per call, and the
//!   report takes the slowest rank's (a collective is as fast as its slowest member).
//! - Links: rounds of disjoint pairs (the circle method: every pair meets once in `world - 1`
//!   rounds, `world` rounds when it is odd and one rank sits out each). A pair exchanges
//!   [`Spec::link_bytes`] each way at once, [`LINK_TRIES`] times; the best try counts (noise
//!   only ever slows a try). Pairs of a round run at the same time but share no rank, so a slow
//!   rank slows its own links and no other.

use super::report::{Collective, LinkTiming, Timing};
use super::spec::Spec;
use collectives::progress::Progress;
use std::time::{Duration, Instant};

/// Tries per pair in the link test.
pub const LINK_TRIES: usize = 3;

/// The communicator a rank measures with, owning its buffers (sized for the largest message).
pub trait Net {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    fn barrier(&mut self) -> Result<(), String>;
    /// In-place all-reduce (sum) of `elems` f32 values.
    fn all_reduce(&mut self, elems: usize) -> Result<(), String>;
    /// All-gather of `elems / world` values per rank into `elems`.
    fn all_gather(&mut self, elems: usize) -> Result<(), String>;
    /// Exchange `elems` values each way with `peer` (`None`: sit this round out).
    fn exchange(&mut self, peer: Option<usize>, elems: usize) -> Result<(), String>;
    /// Wait until the calls queued so far are done (a GPU's stream; nothing on CPU ranks).
    fn sync(&mut self) -> Result<(), String>;
}

/// Calls per timed size: about `budget` bytes, at least 3 and at most 20.
pub fn iters_for(bytes: u64, budget: u64) -> usize {
    (budget / bytes.max(1)).clamp(3, 20) as usize
}

/// What a rank measured.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    pub collectives: Vec<Timing>,
    pub links: Vec<LinkTiming>,
}

/// The partner of `rank` in round `round` of the circle method over `world` ranks (`None`:
/// it sits out). Every pair meets exactly once over [`rounds`]`(world)` rounds.
pub fn partner(rank: usize, round: usize, world: usize) -> Option<usize> {
    if world < 2 {
        return None;
    }
    // Odd worlds get a phantom rank `world`: whoever meets it sits out.
    let n = world + world % 2;
    let m = n - 1;
    let p = if rank == m {
        round % m
    } else if rank == round % m {
        m
    } else {
        (2 * round + m - rank) % m
    };
    (p < world).then_some(p)
}

/// Rounds of the link test.
pub fn rounds(world: usize) -> usize {
    if world < 2 {
        0
    } else {
        world + world % 2 - 1
    }
}

/// Run the whole measurement on `net` (every rank of the job calls it), noting progress for
/// the watchdog after each piece. `budget`: bytes per timed size (see [`iters_for`]).
pub fn run(net: &mut dyn Net, spec: &Spec, budget: u64, progress: &Progress) -> Result<Measured, String> {
    let mut out = Measured::default();
    let mut done = 0u64;
    let world = net.world();
    for &bytes in &spec.sizes {
        for op in [Collective::AllReduce, Collective::AllGather] {
            // An all-gather's buffer splits evenly over the ranks (rounded down to that).
            let elems = match op {
                Collective::AllReduce => (bytes / 4) as usize,
                Collective::AllGather => (bytes / 4) as usize / world * world,
            };
            if elems == 0 {
                continue;
            }
            let iters = iters_for(bytes, budget);
            let call = |net: &mut dyn Net| match op {
                Collective::AllReduce => net.all_reduce(elems),
                Collective::AllGather => net.all_gather(elems),
            };
            call(net)?;
            net.sync()?;
            net.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                call(net)?;
            }
            net.sync()?;
            let seconds = t.elapsed().as_secs_f64() / iters as f64;
            out.collectives.push(Timing { op, bytes: elems as u64 * 4, seconds, iters: iters as u32 });
            done += 1;
            progress.step_done(done);
        }
    }
    let elems = (spec.link_bytes / 4) as usize;
    for round in 0..rounds(world) {
        let peer = partner(net.rank(), round, world);
        net.barrier()?;
        let mut best = Duration::MAX;
        for _ in 0..LINK_TRIES {
            let t = Instant::now();
            net.exchange(peer, elems)?;
            best = best.min(t.elapsed());
        }
        if let Some(p) = peer {
            out.links.push(LinkTiming { peer: p as u32, bytes: elems as u64 * 4, seconds: best.as_secs_f64() });
        }
        done += 1;
        progress.step_done(done);
    }
    net.barrier()?;
    Ok(out)
}

/// CPU ranks: the TCP communicator training uses. `throttle` (test-only, `SHARDTRAIN_FAULT`
/// kind `throttle`): hold this rank's outgoing traffic to that many bytes per second.
pub struct TcpNet {
    comm: collectives::tcp::TcpComm,
    a: Vec<f32>,
    b: Vec<f32>,
    throttle: Option<f64>,
}

impl TcpNet {
    pub fn new(comm: collectives::tcp::TcpComm, spec: &Spec, throttle: Option<f64>) -> TcpNet {
        let most = spec.sizes.iter().copied().chain([spec.link_bytes]).max().unwrap_or(4);
        let n = (most / 4) as usize;
        TcpNet { comm, a: vec![1.0; n], b: vec![0.0; n], throttle }
    }

    /// The throttle: sleep as long as sending `bytes` at its rate takes.
    fn hold(&self, bytes: usize) {
        if let Some(rate) = self.throttle {
            std::thread::sleep(Duration::from_secs_f64(bytes as f64 / rate));
        }
    }
}

fn comm_err(e: collectives::CommError) -> String {
    e.to_string()
}

impl Net for TcpNet {
    fn rank(&self) -> usize {
        collectives::Group::rank(&self.comm)
    }
    fn world(&self) -> usize {
        collectives::Group::world(&self.comm)
    }
    fn barrier(&mut self) -> Result<(), String> {
        collectives::Group::barrier(&mut self.comm).map_err(comm_err)
    }
    fn all_reduce(&mut self, elems: usize) -> Result<(), String> {
        use collectives::Communicator;
        self.hold(elems * 4);
        // Ones summed stay exact integers far beyond any world size: nothing overflows.
        self.a[..elems].fill(1.0);
        self.comm.all_reduce(&mut self.a[..elems], collectives::ReduceOp::Sum).map_err(comm_err)
    }
    fn all_gather(&mut self, elems: usize) -> Result<(), String> {
        use collectives::Communicator;
        let per = elems / self.world();
        self.hold(per * 4);
        self.comm.all_gather(&self.a[..per], &mut self.b[..elems]).map_err(comm_err)
    }
    fn exchange(&mut self, peer: Option<usize>, elems: usize) -> Result<(), String> {
        if peer.is_some() {
            self.hold(elems * 4);
        }
        self.comm.exchange_with(peer, &self.a[..elems], &mut self.b[..elems]).map_err(comm_err)
    }
    fn sync(&mut self) -> Result<(), String> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every pair meets exactly once, no rank twice in a round, for worlds 1 to 9.
    #[test]
    fn the_circle_method_pairs_every_rank_with_every_other_once() {
        for world in 1..=9 {
            let mut met = BTreeSet::new();
            for round in 0..rounds(world) {
                for r in 0..world {
                    if let Some(p) = partner(r, round, world) {
                        assert_ne!(p, r, "world {world} round {round}");
                        assert_eq!(partner(p, round, world), Some(r), "world {world} round {round}: symmetric");
                        met.insert((r.min(p), r.max(p)));
                    }
                }
            }
            assert_eq!(met.len(), world * (world - 1) / 2, "world {world}");
        }
        assert_eq!(iters_for(1 << 30, 64 << 20), 3);
        assert_eq!(iters_for(1 << 10, 64 << 20), 20);
    }

    /// The measurement over a loopback group of 3 (one rank sits out each link round), with
    /// rank 2 throttled: its links are the slow ones.
    #[test]
    fn a_throttled_rank_slows_its_own_links_only() {
        let spec =
            Spec { sizes: vec![4096, 1 << 20], link_bytes: 1 << 20, expect_gbps: None, threshold: 0.5, json: None };
        let comms = collectives::tcp::TcpComm::local_group(3).expect("group");
        let results: Vec<Measured> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(r, c)| {
                    let spec = &spec;
                    s.spawn(move || {
                        let mut net = TcpNet::new(c, spec, (r == 2).then_some(20e6));
                        run(&mut net, spec, 8 << 20, &Progress::default()).expect("measure")
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        for (r, m) in results.iter().enumerate() {
            assert_eq!(m.collectives.len(), 4, "rank {r}: 2 sizes x 2 collectives");
            assert_eq!(m.links.len(), 2, "rank {r}: a link to each other rank");
            for l in &m.links {
                let slow = r == 2 || l.peer == 2;
                // 1 MiB at 20 MB/s takes 52 ms; over loopback well under 10 ms.
                assert_eq!(l.seconds > 0.04, slow, "rank {r} to {}: {} s", l.peer, l.seconds);
            }
        }
    }
}
