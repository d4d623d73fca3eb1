//! Tests of the TCP host communicator: every collective against values computed
//! directly, on world sizes 1–4 and sizes that do not divide evenly; determinism;
//! and the failure modes (bad sizes, mismatched collectives, dead and hung peers,
//! rendezvous errors), none of which may hang.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use collectives::tcp::TcpComm;
use collectives::{CommError, Communicator, Group, ReduceOp};

const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// Run `f` on every rank of a loopback group, one thread each. Communicators are
/// dropped only after every rank has finished, so no rank sees a peer vanish early.
fn run_group<R: Send>(world: usize, f: impl Fn(&mut TcpComm) -> R + Sync) -> Vec<R> {
    run_group_owned(world, |mut c| {
        let r = f(&mut c);
        (r, c)
    })
    .into_iter()
    .map(|(r, _c)| r)
    .collect()
}

/// Like [`run_group`], but each rank owns its communicator (and may drop it).
fn run_group_owned<R: Send>(world: usize, f: impl Fn(TcpComm) -> R + Sync) -> Vec<R> {
    let comms = TcpComm::local_group(world).expect("local group");
    assert_eq!(comms.len(), world);
    thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, c)| {
                assert_eq!((c.rank(), c.world()), (rank, world));
                s.spawn(move || f(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Deterministic inputs of varied sign and magnitude, so summation order shows.
fn input(rank: usize, i: usize) -> f32 {
    let x = ((rank * 7919 + i * 104_729) % 2003) as f32 / 2003.0 - 0.5;
    x * 10f32.powi(((i + 3 * rank) % 7) as i32 - 3)
}

/// The reduction of `vals` (one per rank) in rank order, as the contract specifies.
fn reduce_ref(vals: impl IntoIterator<Item = f32>, op: ReduceOp, world: usize) -> f32 {
    let mut it = vals.into_iter();
    let mut acc = it.next().expect("at least one rank");
    for v in it {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => acc += v,
            ReduceOp::Max => {
                if v > acc || v.is_nan() {
                    acc = v
                }
            }
        }
    }
    if op == ReduceOp::Avg {
        acc /= world as f32;
    }
    acc
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn all_gather_matches_direct_concatenation() {
    for world in 1..=4 {
        for n in [0, 1, 7, 1000] {
            let got = run_group(world, |c| {
                let send: Vec<f32> = (0..n).map(|i| input(c.rank(), i)).collect();
                let mut recv = vec![f32::NAN; world * n];
                c.all_gather(&send[..], &mut recv[..]).unwrap();
                recv
            });
            let want: Vec<f32> = (0..world).flat_map(|r| (0..n).map(move |i| input(r, i))).collect();
            for (rank, g) in got.iter().enumerate() {
                assert_eq!(bits(g), bits(&want), "world {world}, n {n}, rank {rank}");
            }
        }
    }
}

#[test]
fn reduce_scatter_matches_rank_order_reduction() {
    for world in 1..=4 {
        for n in [1, 7, 1000] {
            for op in OPS {
                let got = run_group(world, |c| {
                    let send: Vec<f32> = (0..world * n).map(|i| input(c.rank(), i)).collect();
                    let mut recv = vec![f32::NAN; n];
                    c.reduce_scatter(&send[..], &mut recv[..], op).unwrap();
                    recv
                });
                for (rank, g) in got.iter().enumerate() {
                    let want: Vec<f32> =
                        (0..n).map(|i| reduce_ref((0..world).map(|q| input(q, rank * n + i)), op, world)).collect();
                    assert_eq!(bits(g), bits(&want), "world {world}, n {n}, {op:?}, rank {rank}");
                }
            }
        }
    }
}

#[test]
fn all_reduce_handles_lengths_not_divisible_by_world() {
    for world in 1..=4 {
        for n in [0, 1, 2, 3, 5, 7, 13, 1000, 4099] {
            for op in OPS {
                let got = run_group(world, |c| {
                    let mut buf: Vec<f32> = (0..n).map(|i| input(c.rank(), i)).collect();
                    c.all_reduce(&mut buf[..], op).unwrap();
                    buf
                });
                let want: Vec<f32> = (0..n).map(|i| reduce_ref((0..world).map(|q| input(q, i)), op, world)).collect();
                for (rank, g) in got.iter().enumerate() {
                    assert_eq!(bits(g), bits(&want), "world {world}, n {n}, {op:?}, rank {rank}");
                }
            }
        }
    }
}

#[test]
fn f64_collectives() {
    let world = 3;
    let n = 5;
    let got = run_group(world, |c| {
        let r = c.rank() as f64;
        let mut buf: Vec<f64> = (0..n).map(|i| r * 0.1 + i as f64).collect();
        c.all_reduce(&mut buf[..], ReduceOp::Sum).unwrap();
        let mut gathered = vec![0.0f64; world * 2];
        c.all_gather(&[r, -r][..], &mut gathered[..]).unwrap();
        let send: Vec<f64> = (0..world * 2).map(|i| r + i as f64).collect();
        let mut scattered = vec![0.0f64; 2];
        c.reduce_scatter(&send[..], &mut scattered[..], ReduceOp::Max).unwrap();
        let mut b = vec![r; 3];
        c.broadcast(&mut b[..], 2).unwrap();
        (buf, gathered, scattered, b)
    });
    for (rank, (buf, gathered, scattered, b)) in got.into_iter().enumerate() {
        let want: Vec<f64> = (0..n).map(|i| ((0.0 + i as f64) + (0.1 + i as f64)) + (0.2 + i as f64)).collect();
        assert_eq!(buf, want);
        assert_eq!(gathered, vec![0.0, -0.0, 1.0, -1.0, 2.0, -2.0]);
        let r = rank as f64;
        assert_eq!(scattered, vec![2.0 + 2.0 * r, 3.0 + 2.0 * r]);
        assert_eq!(b, vec![2.0; 3]);
    }
}

#[test]
fn broadcast_from_every_root() {
    for world in 1..=4 {
        for n in [0, 5, 1000] {
            for root in 0..world {
                let got = run_group(world, |c| {
                    let mut buf: Vec<f32> = (0..n).map(|i| input(c.rank(), i)).collect();
                    c.broadcast(&mut buf[..], root).unwrap();
                    buf
                });
                let want: Vec<f32> = (0..n).map(|i| input(root, i)).collect();
                for (rank, g) in got.iter().enumerate() {
                    assert_eq!(bits(g), bits(&want), "world {world}, n {n}, root {root}, rank {rank}");
                }
            }
        }
    }
}

#[test]
fn barrier_waits_for_every_rank() {
    for world in 1..=4 {
        let arrived = AtomicUsize::new(0);
        let rounds = 4;
        run_group(world, |c| {
            for round in 0..rounds {
                // Stagger arrivals so that an early return would see a short count.
                thread::sleep(Duration::from_millis((5 * ((c.rank() + round) % world)) as u64));
                arrived.fetch_add(1, Ordering::SeqCst);
                c.barrier().unwrap();
                assert!(arrived.load(Ordering::SeqCst) >= (round + 1) * world, "rank {} left early", c.rank());
                // Second barrier: nobody starts the next round before all have checked.
                c.barrier().unwrap();
            }
        });
        assert_eq!(arrived.load(Ordering::SeqCst), rounds * world);
    }
}

#[test]
fn all_reduce_is_deterministic_and_rank_ordered() {
    let world = 4;
    let n = 10_001;
    // Element 0 cancels catastrophically: only the rank order 0,1,2,3 gives exactly 1.0
    // ((1e8 + 1) - 1e8) + 1; reversed order gives 0.0.
    let value = |rank: usize, i: usize| {
        if i == 0 {
            [1e8f32, 1.0, -1e8, 1.0][rank]
        } else {
            input(rank, i) * 1e3f32.powi((rank % 3) as i32)
        }
    };
    let once = || {
        run_group(world, |c| {
            let mut buf: Vec<f32> = (0..n).map(|i| value(c.rank(), i)).collect();
            c.all_reduce(&mut buf[..], ReduceOp::Sum).unwrap();
            bits(&buf)
        })
    };
    let first = once();
    let second = once();
    let want: Vec<f32> = (0..n).map(|i| reduce_ref((0..world).map(|q| value(q, i)), ReduceOp::Sum, world)).collect();
    assert_eq!(f32::from_bits(first[0][0]), 1.0);
    for rank in 0..world {
        assert_eq!(first[rank], bits(&want), "rank {rank} differs from the rank-order sum");
        assert_eq!(first[rank], second[rank], "rank {rank} differs between runs");
    }
}

#[test]
fn max_propagates_nan() {
    let got = run_group(3, |c| {
        let mut buf = vec![c.rank() as f32, if c.rank() == 1 { f32::NAN } else { 0.0 }];
        c.all_reduce(&mut buf[..], ReduceOp::Max).unwrap();
        buf
    });
    for g in got {
        assert_eq!(g[0], 2.0);
        assert!(g[1].is_nan());
    }
}

#[test]
fn multi_megabyte_buffers_do_not_deadlock() {
    let world = 4;
    let n = 1 << 20; // 4 MiB of f32 per buffer
    let start = Instant::now();
    let got = run_group(world, |c| {
        let r = c.rank() as f32;
        let mut buf: Vec<f32> = (0..n).map(|i| r + (i % 1024) as f32).collect();
        c.all_reduce(&mut buf[..], ReduceOp::Sum).unwrap();
        let send = vec![r; n];
        let mut gathered = vec![0.0f32; world * n];
        c.all_gather(&send[..], &mut gathered[..]).unwrap();
        let mut scattered = vec![0.0f32; n / world];
        c.reduce_scatter(&buf[..], &mut scattered[..], ReduceOp::Avg).unwrap();
        let mut b = vec![r; n];
        c.broadcast(&mut b[..], world - 1).unwrap();
        (buf, gathered, scattered, b)
    });
    for (rank, (buf, gathered, scattered, b)) in got.into_iter().enumerate() {
        for i in [0, 1, 1023, 1024, n / 2 + 17, n - 1] {
            assert_eq!(buf[i], 6.0 + 4.0 * (i % 1024) as f32, "all_reduce element {i}");
        }
        for q in 0..world {
            assert!(gathered[q * n..(q + 1) * n].iter().all(|&x| x == q as f32), "all_gather block {q}");
        }
        let off = rank * (n / world);
        assert_eq!(scattered[5], buf[off + 5]);
        assert!(b.iter().all(|&x| x == (world - 1) as f32));
    }
    // Generous bound: only here to catch a pathological slowdown, not to benchmark.
    assert!(start.elapsed() < Duration::from_secs(15), "took {:?}", start.elapsed());
}

#[test]
fn slow_receiver_with_messages_larger_than_socket_buffers() {
    // 16 MiB per message, more than the kernel buffers while the receiver is not
    // reading: the sender must finish in a writer thread, not block.
    let n = 4 << 20;
    let got = run_group(2, |c| {
        if c.rank() == 1 {
            thread::sleep(Duration::from_millis(200));
        }
        let send = vec![c.rank() as f32 + 1.0; n];
        let mut recv = vec![0.0f32; 2 * n];
        c.all_gather(&send[..], &mut recv[..]).unwrap();
        recv
    });
    for g in got {
        assert!(g[..n].iter().all(|&x| x == 1.0) && g[n..].iter().all(|&x| x == 2.0));
    }
}

#[test]
fn world_of_one_copies_without_sockets() {
    let mut solo = TcpComm::local_group(1).unwrap().remove(0);
    let pending = TcpComm::bind("127.0.0.1:0").unwrap();
    let addr = pending.local_addr();
    let mut connected = pending.connect(0, 1, &[addr], Duration::from_secs(1)).unwrap();
    for c in [&mut solo, &mut connected] {
        assert_eq!((c.rank(), c.world()), (0, 1));
        let mut buf = vec![1.0f32, 2.0, 3.0];
        c.all_reduce(&mut buf[..], ReduceOp::Avg).unwrap();
        assert_eq!(buf, [1.0, 2.0, 3.0]);
        let mut out = vec![0.0f32; 3];
        c.all_gather(&buf[..], &mut out[..]).unwrap();
        assert_eq!(out, buf);
        c.reduce_scatter(&buf[..], &mut out[..], ReduceOp::Max).unwrap();
        assert_eq!(out, buf);
        c.broadcast(&mut out[..], 0).unwrap();
        c.barrier().unwrap();
    }
}

#[test]
fn bad_sizes_are_reported_without_breaking_the_group() {
    let got = run_group(2, |c| {
        let mut errs = Vec::new();
        let mut recv = [0.0f32; 5];
        errs.push(c.all_gather(&[1.0f32, 2.0, 3.0][..], &mut recv[..]).unwrap_err());
        errs.push(c.reduce_scatter(&[0.0f32; 7][..], &mut recv[..3], ReduceOp::Sum).unwrap_err());
        errs.push(Communicator::<[f32]>::broadcast(c, &mut recv[..], 2).unwrap_err());
        // Nothing was sent, so the group still works.
        let mut buf = vec![1.0f32; 3];
        c.all_reduce(&mut buf[..], ReduceOp::Sum).unwrap();
        assert_eq!(buf, [2.0; 3]);
        errs
    });
    for errs in got {
        let msgs: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        assert!(matches!(errs[0], CommError::BadSize { op: "all_gather", world: 2, .. }), "{}", msgs[0]);
        assert!(msgs[0].contains("3 elements") && msgs[0].contains("has 5"), "{}", msgs[0]);
        assert!(matches!(errs[1], CommError::BadSize { op: "reduce_scatter", .. }), "{}", msgs[1]);
        assert!(msgs[1].contains("3 elements") && msgs[1].contains("has 7"), "{}", msgs[1]);
        assert!(matches!(errs[2], CommError::BadSize { op: "broadcast", .. }), "{}", msgs[2]);
        assert!(msgs[2].contains("root 2"), "{}", msgs[2]);
    }
}

#[test]
fn mismatched_collectives_are_protocol_errors() {
    // Large enough that the payloads cannot sit in socket buffers: must not hang.
    let n = 3_000_000;
    let got = run_group(2, |c| {
        let first = if c.rank() == 0 {
            let mut recv = vec![0.0f32; 2 * n];
            c.all_gather(&vec![1.0f32; n][..], &mut recv[..])
        } else {
            let mut recv = vec![0.0f32; n];
            c.reduce_scatter(&vec![1.0f32; 2 * n][..], &mut recv[..], ReduceOp::Sum)
        };
        let later = c.barrier();
        (first.unwrap_err(), later.unwrap_err())
    });
    for (rank, (err, later)) in got.into_iter().enumerate() {
        let msg = err.to_string();
        match err {
            CommError::Protocol { peer, .. } => assert_eq!(peer, 1 - rank, "{msg}"),
            other => panic!("rank {rank}: expected a protocol error, got {other}"),
        }
        assert!(msg.contains("all_gather") && msg.contains("reduce_scatter") && msg.contains("3000000"), "{msg}");
        assert!(matches!(later, CommError::Other(_)) && later.to_string().contains("failed earlier"), "{later}");
    }
}

#[test]
fn mismatched_lengths_are_protocol_errors() {
    let got = run_group(3, |c| {
        let n = if c.rank() == 2 { 200_001 } else { 200_000 };
        let mut recv = vec![0.0f32; 3 * n];
        c.all_gather(&vec![1.0f32; n][..], &mut recv[..]).unwrap_err()
    });
    for (rank, err) in got.into_iter().enumerate() {
        let msg = err.to_string();
        assert!(matches!(err, CommError::Protocol { .. }), "rank {rank}: {msg}");
        assert!(msg.contains("200000") && msg.contains("200001"), "rank {rank}: {msg}");
    }
}

#[test]
fn mismatched_broadcast_roots_are_protocol_errors() {
    let got = run_group(2, |c| {
        let mut buf = vec![0.0f32; 1 << 20];
        let root = c.rank();
        c.broadcast(&mut buf[..], root).unwrap_err()
    });
    for (rank, err) in got.into_iter().enumerate() {
        let msg = err.to_string();
        assert!(matches!(err, CommError::Protocol { .. }), "rank {rank}: {msg}");
        assert!(msg.contains("root 0") && msg.contains("root 1"), "{msg}");
    }
}

#[test]
fn skipped_collective_is_reported() {
    let got = run_group(2, |c| {
        if c.rank() == 0 {
            c.barrier().unwrap_err(); // rank 1 skips this one
        }
        c.all_reduce(&mut [1.0f32; 3][..], ReduceOp::Sum).unwrap_err()
    });
    // Rank 1's all_reduce meets rank 0's barrier; rank 0 is broken afterwards.
    let msg = got[1].to_string();
    assert!(matches!(got[1], CommError::Protocol { peer: 0, .. }), "{msg}");
    assert!(msg.contains("`barrier` #0") && msg.contains("`all_reduce` #0"), "{msg}");
    assert!(got[0].to_string().contains("failed earlier"), "{}", got[0]);
}

#[test]
fn dropped_peer_is_named_not_hung() {
    // Rank 2 leaves before the collective; ranks 0 and 1 must blame rank 2.
    let start = Instant::now();
    let got = run_group_owned(3, |mut c| {
        if c.rank() == 2 {
            drop(c);
            return None;
        }
        let mut buf = vec![1.0f32; 100_000];
        let err = c.all_reduce(&mut buf[..], ReduceOp::Sum).unwrap_err();
        Some((err, c))
    });
    for (rank, r) in got.into_iter().enumerate().take(2) {
        let (err, _c) = r.unwrap();
        let msg = err.to_string();
        assert!(matches!(err, CommError::PeerIo { peer: 2, .. }), "rank {rank}: {msg}");
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn peer_dying_mid_stream_is_named() {
    // Rank 1 takes part in one collective, then vanishes while rank 0 sends megabytes.
    let got = run_group_owned(2, |mut c| {
        c.barrier().unwrap();
        if c.rank() == 1 {
            drop(c);
            return None;
        }
        let mut buf = vec![1.0f32; 4 << 20];
        let err = c.all_reduce(&mut buf[..], ReduceOp::Sum).unwrap_err();
        Some((err, c))
    });
    let (err, _c) = got.into_iter().next().unwrap().unwrap();
    let msg = err.to_string();
    assert!(matches!(err, CommError::PeerIo { peer: 1, .. }), "{msg}");
    assert!(msg.contains("rank 1"), "{msg}");
}

#[test]
fn hung_peer_times_out_naming_it() {
    let (tx, rx) = mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let got = run_group(2, |c| {
        if c.rank() == 1 {
            // Alive but never joins the collective; released once rank 0 gave up.
            rx.lock().unwrap().recv().unwrap();
            return None;
        }
        c.set_io_timeout(Duration::from_millis(300)).unwrap();
        let start = Instant::now();
        let err = c.all_reduce(&mut vec![1.0f32; 1000][..], ReduceOp::Sum).unwrap_err();
        let took = start.elapsed();
        tx.send(()).unwrap();
        Some((err, took))
    });
    let (err, took) = got.into_iter().next().unwrap().unwrap();
    let msg = err.to_string();
    assert!(matches!(err, CommError::PeerIo { peer: 1, .. }), "{msg}");
    assert!(msg.contains("io timeout"), "{msg}");
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn failure_is_relayed_to_healthy_peers() {
    // Rank 2 hangs; rank 0 times out on it during a broadcast that rank 1 completes.
    // Rank 1's next collective must fail naming rank 2 (told by rank 0), not wait.
    let (tx, rx) = mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let done = Barrier::new(2);
    let got = run_group(3, |c| match c.rank() {
        2 => {
            rx.lock().unwrap().recv().unwrap();
            None
        }
        rank => {
            if rank == 0 {
                c.set_io_timeout(Duration::from_millis(300)).unwrap();
            }
            let mut buf = vec![rank as f32; 10];
            let bcast = c.broadcast(&mut buf[..], 0);
            let next = if rank == 1 {
                assert_eq!(buf, vec![0.0; 10]);
                bcast.unwrap();
                c.barrier()
            } else {
                bcast
            };
            if done.wait().is_leader() {
                tx.send(()).unwrap();
            }
            Some(next.unwrap_err())
        }
    });
    for (rank, err) in got.into_iter().take(2).enumerate() {
        let err = err.unwrap();
        let msg = err.to_string();
        assert!(matches!(err, CommError::PeerIo { peer: 2, .. }), "rank {rank}: {msg}");
        if rank == 1 {
            assert!(msg.contains("reported to rank 1 by rank 0"), "{msg}");
        }
    }
}

fn dead_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

#[test]
fn connect_timeout_names_the_missing_peer() {
    let dead = dead_addr();
    let pending = TcpComm::bind("127.0.0.1:0").unwrap();
    let me = pending.local_addr();
    let start = Instant::now();
    let err = pending.connect(1, 2, &[dead, me], Duration::from_millis(300)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, CommError::Setup(_)), "{msg}");
    assert!(msg.contains("rank 0") && msg.contains(&dead.to_string()), "{msg}");
    assert!(start.elapsed() < Duration::from_secs(3));

    // The accepting side names the ranks that never connected.
    let pending = TcpComm::bind("127.0.0.1:0").unwrap();
    let me = pending.local_addr();
    let err = pending.connect(0, 3, &[me, dead, dead], Duration::from_millis(300)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("rank 1") && msg.contains("rank 2") && msg.contains("did not connect"), "{msg}");
}

#[test]
fn world_size_disagreement_fails_setup() {
    let p0 = TcpComm::bind("127.0.0.1:0").unwrap();
    let p1 = TcpComm::bind("127.0.0.1:0").unwrap();
    let (a0, a1) = (p0.local_addr(), p1.local_addr());
    let t0 = thread::spawn(move || p0.connect(0, 2, &[a0, a1], Duration::from_millis(800)));
    let t1 = thread::spawn(move || p1.connect(1, 3, &[a0, a1, dead_addr()], Duration::from_millis(800)));
    let e0 = t0.join().unwrap().unwrap_err().to_string();
    let e1 = t1.join().unwrap().unwrap_err().to_string();
    // Rank 1 is told why; rank 0 keeps waiting for a proper rank 1, then says whom it
    // turned away.
    assert!(e1.contains("rank 0") && e1.contains(&a0.to_string()) && e1.contains("rejected"), "{e1}");
    assert!(e1.contains("world of size 3"), "{e1}");
    assert!(e0.contains("rank 1") && e0.contains("did not connect") && e0.contains("world of size 3"), "{e0}");
}

#[test]
fn stranger_is_turned_away_and_the_group_still_forms() {
    let p0 = TcpComm::bind("127.0.0.1:0").unwrap();
    let p1 = TcpComm::bind("127.0.0.1:0").unwrap();
    let stranger = TcpComm::bind("127.0.0.1:0").unwrap();
    let (a0, a1, a_s) = (p0.local_addr(), p1.local_addr(), stranger.local_addr());
    let t0 = thread::spawn(move || p0.connect(0, 2, &[a0, a1], Duration::from_secs(5)));
    // Same world size and rank, but another group's address list (e.g. a recycled port).
    let err = stranger.connect(1, 2, &[a0, a_s], Duration::from_secs(5)).unwrap_err().to_string();
    assert!(err.contains("rejected") && err.contains("different peer address list"), "{err}");
    let t1 = thread::spawn(move || p1.connect(1, 2, &[a0, a1], Duration::from_secs(5)));
    let mut comms = [t0.join().unwrap().unwrap(), t1.join().unwrap().unwrap()];
    thread::scope(|s| {
        for c in &mut comms {
            s.spawn(move || {
                let mut buf = [c.rank() as f32 + 1.0];
                c.all_reduce(&mut buf[..], ReduceOp::Sum).unwrap();
                assert_eq!(buf, [3.0]);
            });
        }
    });
}

#[test]
fn bad_connect_arguments_are_setup_errors() {
    let addr = dead_addr();
    let err = TcpComm::bind("127.0.0.1:0").unwrap().connect(2, 2, &[addr, addr], Duration::from_millis(10));
    assert!(matches!(err, Err(CommError::Setup(_))));
    let err = TcpComm::bind("127.0.0.1:0").unwrap().connect(0, 3, &[addr], Duration::from_millis(10));
    assert!(matches!(err, Err(CommError::Setup(_))));
    assert!(matches!(TcpComm::local_group(0), Err(CommError::Setup(_))));
    assert!(matches!(TcpComm::bind("not an address"), Err(CommError::Setup(_))));
    let mut c = TcpComm::local_group(1).unwrap().remove(0);
    assert!(c.set_io_timeout(Duration::ZERO).is_err());
}

/// Point-to-point exchanges in rounds of disjoint pairs (3 ranks: one sits out each round):
/// each rank gets its partner's values; a rank whose partner expects another pair fails
/// with a protocol error instead of mixing data.
#[test]
fn exchange_with_pairs_ranks_and_catches_a_mismatched_schedule() {
    // Round k pairs ranks (k, k+1 mod 3); the third sits out.
    let got = run_group(3, |c| {
        let r = c.rank();
        let mut seen = Vec::new();
        for k in 0..3 {
            let (a, b) = (k, (k + 1) % 3);
            let peer = if r == a {
                Some(b)
            } else if r == b {
                Some(a)
            } else {
                None
            };
            let send: Vec<f32> = (0..1000).map(|i| (r * 10_000 + i) as f32).collect();
            let mut recv = vec![0.0f32; 1000];
            c.exchange_with(peer, &send, &mut recv).expect("exchange");
            if let Some(p) = peer {
                assert!(recv.iter().enumerate().all(|(i, &x)| x == (p * 10_000 + i) as f32), "rank {r} from {p}");
                seen.push(p);
            }
        }
        c.barrier().expect("still usable");
        seen
    });
    assert_eq!(got, vec![vec![1, 2], vec![0, 2], vec![1, 0]]);

    let errs = run_group(2, |c| {
        let r = c.rank();
        let (send, mut recv) = (vec![1.0f32; 8], vec![0.0f32; 8]);
        // Rank 1 sits out while rank 0 expects it: rank 0 must not hang or take rank 1's
        // next message as this one.
        let first = c.exchange_with(if r == 0 { Some(1) } else { None }, &send, &mut recv);
        let second = c.exchange_with(if r == 1 { Some(0) } else { None }, &send, &mut recv);
        first.and(second)
    });
    assert!(errs.iter().any(|e| matches!(e, Err(CommError::Protocol { .. }))), "{errs:?}");
    assert!(matches!(
        run_group(2, |c| c.exchange_with(Some(c.rank()), &[1.0f32], &mut [0.0f32])).remove(0),
        Err(CommError::BadSize { .. })
    ));
}
