//! `gpu-nccl [WORLD]`: the NCCL communicator checked on real GPUs. Spawns one process per
//! GPU (itself, the NCCL id passed as hex on the command line) and checks all-gather,
//! reduce-scatter (sum, avg), all-reduce, broadcast and the host-scalar collectives
//! against expected values, with odd sizes; then a bandwidth table. Exits non-zero if any
//! check fails. One GPU runs the checks on a world of one (the CUDA-graph recording of
//! started collectives included); the bandwidth figures need 2 GPUs.

use std::process::ExitCode;
use std::time::Instant;

use collectives::nccl::{nccl_unique_id, nccl_version, NcclComm};
use collectives::{AllGatherInPlace, CommError, Communicator, Group, ReduceOp};
use cudarc::driver::{sys as dsys, CudaSlice};
use half::bf16;
use trainer::backend::cuda::CudaBackend;
use trainer::backend::{BResult, Device, GraphOps, Loc, MemoryOps};
use trainer::zero::EngineComm;

// The engine's collective bound must hold for the real pair, and the backend must be
// movable to a rank's thread (compile-time checks).
const _: fn() = || {
    fn needs<C: EngineComm<CudaBackend>>() {}
    fn send<T: Send>() {}
    needs::<NcclComm>();
    send::<CudaBackend>();
};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len() / 2).map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()).collect()
}

fn up_buf(be: &CudaBackend, v: &[f32]) -> BResult<CudaSlice<bf16>> {
    let mut b = be.alloc_buf(v.len(), "check input")?;
    be.upload_buf(v, &mut b, 0)?;
    Ok(b)
}
fn up_f32(be: &CudaBackend, v: &[f32]) -> BResult<CudaSlice<f32>> {
    let mut b = be.alloc_f32(v.len(), "check input")?;
    be.upload_f32(v, &mut b, 0)?;
    Ok(b)
}
/// NaNs: an element a collective does not write stays NaN and fails its check.
fn poison_buf(be: &CudaBackend, b: &mut CudaSlice<bf16>, n: usize) -> BResult<()> {
    be.upload_buf(&vec![f32::NAN; n], b, 0)
}

/// Check results of one rank, printed as they come.
struct NcclReport {
    rank: usize,
    failed: usize,
}

impl NcclReport {
    fn check(&mut self, what: &str, r: Result<bool, String>) {
        match r {
            Ok(true) => println!("rank {}: ok    {what}", self.rank),
            Ok(false) => {
                self.failed += 1;
                println!("rank {}: FAIL  {what}", self.rank);
            }
            Err(e) => {
                self.failed += 1;
                println!("rank {}: ERROR {what}: {e}", self.rank);
            }
        }
    }
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Small integers: exact in bf16 and in any summation order.
fn val(r: usize, i: usize) -> f32 {
    ((r * 7 + i) % 61) as f32
}
fn nccl_rank(rank: usize, world: usize, id: &[u8]) -> Result<usize, String> {
    let t0 = Instant::now();
    let be = CudaBackend::new(rank).map_err(s)?;
    let mut comm = NcclComm::new(be.stream().clone(), rank, world, id).map_err(s)?;
    println!(
        "rank {rank}: {} joined a world of {world} in {:.1} s (NCCL {})",
        be.name(),
        t0.elapsed().as_secs_f64(),
        nccl_version().unwrap_or_default()
    );
    let mut rep = NcclReport { rank, failed: 0 };
    check_device_collectives(&be, &mut comm, &mut rep, rank, world);
    check_host_collectives(&be, &mut comm, &mut rep, rank, world);
    check_graph_collectives(&be, &mut comm, &mut rep, rank, world);
    let bench = bandwidth(&be, &mut comm, rank, world);
    match bench {
        Ok(t) => print!("{t}"),
        Err(e) => println!("rank {rank}: bandwidth run failed: {e}"),
    }
    comm.barrier().map_err(s)?;
    Ok(rep.failed)
}

/// The device collectives against expected values: all-gather (bf16, f32), reduce-scatter
/// (f32 sum/avg/max, bf16 sum), all-reduce and broadcast, at odd sizes.
fn check_device_collectives(be: &CudaBackend, comm: &mut NcclComm, rep: &mut NcclReport, rank: usize, world: usize) {
    let wf = world as f32;

    for &n in &[1000usize, 13, 1] {
        rep.check(
            &format!("all_gather bf16, {n} per rank"),
            (|| {
                let send: Vec<f32> = (0..n).map(|i| val(rank, i)).collect();
                let sb = up_buf(be, &send).map_err(s)?;
                let mut rb = be.alloc_buf(n * world, "").map_err(s)?;
                poison_buf(be, &mut rb, n * world).map_err(s)?;
                Communicator::<CudaSlice<bf16>>::all_gather(&mut *comm, &sb, &mut rb).map_err(s)?;
                let got = be.download_buf(&rb, Loc::all(n * world)).map_err(s)?;
                Ok((0..world).all(|r| (0..n).all(|i| got[r * n + i] == val(r, i))))
            })(),
        );
    }
    for &n in &[1001usize, 4096] {
        rep.check(
            &format!("all_gather f32, {n} per rank"),
            (|| {
                let send: Vec<f32> = (0..n).map(|i| val(rank, i) + 0.25).collect();
                let sb = up_f32(be, &send).map_err(s)?;
                let mut rb = be.alloc_grad(n * world, "").map_err(s)?;
                Communicator::<CudaSlice<f32>>::all_gather(&mut *comm, &sb, &mut rb).map_err(s)?;
                let got = be.download_grad(&rb, Loc::all(n * world)).map_err(s)?;
                Ok((0..world).all(|r| (0..n).all(|i| got[r * n + i] == val(r, i) + 0.25)))
            })(),
        );
    }
    for &n in &[257usize, 1024, 3] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            rep.check(
                &format!("reduce_scatter f32 {op:?}, {n} per rank"),
                (|| {
                    let send: Vec<f32> = (0..n * world).map(|j| val(rank, j)).collect();
                    let sb = up_f32(be, &send).map_err(s)?;
                    let mut rb = be.alloc_grad(n, "").map_err(s)?;
                    Communicator::<CudaSlice<f32>>::reduce_scatter(&mut *comm, &sb, &mut rb, op).map_err(s)?;
                    let got = be.download_grad(&rb, Loc::all(n)).map_err(s)?;
                    Ok((0..n).all(|i| {
                        let j = rank * n + i;
                        let vals = (0..world).map(|r| val(r, j));
                        let want = match op {
                            ReduceOp::Sum => vals.sum::<f32>(),
                            ReduceOp::Avg => vals.sum::<f32>() / wf,
                            ReduceOp::Max => vals.fold(f32::MIN, f32::max),
                        };
                        (got[i] - want).abs() <= 1e-6 * want.abs().max(1.0)
                    }))
                })(),
            );
        }
    }
    rep.check(
        "reduce_scatter bf16 Sum, 13 per rank",
        (|| {
            let n = 13;
            let send: Vec<f32> = (0..n * world).map(|j| val(rank, j)).collect();
            let sb = up_buf(be, &send).map_err(s)?;
            let mut rb = be.alloc_buf(n, "").map_err(s)?;
            Communicator::<CudaSlice<bf16>>::reduce_scatter(&mut *comm, &sb, &mut rb, ReduceOp::Sum).map_err(s)?;
            let got = be.download_buf(&rb, Loc::all(n)).map_err(s)?;
            Ok((0..n).all(|i| got[i] == (0..world).map(|r| val(r, rank * n + i)).sum::<f32>()))
        })(),
    );
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        rep.check(
            &format!("all_reduce f32 {op:?}, 1000003 elements"),
            (|| {
                let n = 1_000_003;
                let send: Vec<f32> = (0..n).map(|i| val(rank, i)).collect();
                let mut b = up_f32(be, &send).map_err(s)?;
                Communicator::<CudaSlice<f32>>::all_reduce(&mut *comm, &mut b, op).map_err(s)?;
                let got = be.download_f32(&b, Loc::all(n)).map_err(s)?;
                Ok((0..n).all(|i| {
                    let vals = (0..world).map(|r| val(r, i));
                    let want = match op {
                        ReduceOp::Sum => vals.sum::<f32>(),
                        ReduceOp::Avg => vals.sum::<f32>() / wf,
                        ReduceOp::Max => vals.fold(f32::MIN, f32::max),
                    };
                    (got[i] - want).abs() <= 1e-6 * want.abs().max(1.0)
                }))
            })(),
        );
    }
    for root in 0..world {
        rep.check(
            &format!("broadcast f32 and bf16 from root {root}, 999 elements"),
            (|| {
                let n = 999;
                let mine: Vec<f32> = (0..n).map(|i| val(rank, i)).collect();
                let mut b = up_f32(be, &mine).map_err(s)?;
                Communicator::<CudaSlice<f32>>::broadcast(&mut *comm, &mut b, root).map_err(s)?;
                let mut h = up_buf(be, &mine).map_err(s)?;
                Communicator::<CudaSlice<bf16>>::broadcast(&mut *comm, &mut h, root).map_err(s)?;
                let g1 = be.download_f32(&b, Loc::all(n)).map_err(s)?;
                let g2 = be.download_buf(&h, Loc::all(n)).map_err(s)?;
                Ok((0..n).all(|i| g1[i] == val(root, i) && g2[i] == val(root, i)))
            })(),
        );
    }
}

/// The host-scalar collectives the engine uses, and size mismatches refused.
fn check_host_collectives(be: &CudaBackend, comm: &mut NcclComm, rep: &mut NcclReport, rank: usize, world: usize) {
    // Host scalars, as the engine uses them (all_reduce_f64's two words, losses).
    rep.check(
        "host [f32] all_reduce / all_gather / reduce_scatter / broadcast",
        (|| {
            let x = 1.0 + rank as f64 * 1e-9;
            let got = trainer::zero::engine::all_reduce_f64(&mut *comm, x).map_err(s)?;
            let want: f64 = (0..world).map(|r| 1.0 + r as f64 * 1e-9).sum();
            let ok1 = (got - want).abs() < 1e-12;
            let send = [rank as f32, 10.0 + rank as f32, 0.5];
            let mut recv = vec![0.0f32; 3 * world];
            Communicator::<[f32]>::all_gather(&mut *comm, &send, &mut recv).map_err(s)?;
            let ok2 = (0..world).all(|r| recv[3 * r..3 * r + 3] == [r as f32, 10.0 + r as f32, 0.5]);
            let send: Vec<f32> = (0..2 * world).map(|j| (rank * 100 + j) as f32).collect();
            let mut recv = [0.0f32; 2];
            Communicator::<[f32]>::reduce_scatter(&mut *comm, &send, &mut recv, ReduceOp::Sum).map_err(s)?;
            let ok3 = (0..2).all(|i| recv[i] == (0..world).map(|r| (r * 100 + rank * 2 + i) as f32).sum::<f32>());
            let mut b = [rank as f32 + 3.0; 5];
            Communicator::<[f32]>::broadcast(&mut *comm, &mut b, world - 1).map_err(s)?;
            let ok4 = b.iter().all(|&v| v == (world - 1) as f32 + 3.0);
            comm.barrier().map_err(s)?;
            Ok(ok1 && ok2 && ok3 && ok4)
        })(),
    );
    rep.check(
        "size mismatches are BadSize errors (no collective issued)",
        (|| {
            let sb = be.alloc_buf(10, "").map_err(s)?;
            let mut rb = be.alloc_buf(10 * world + 1, "").map_err(s)?;
            let e1 = Communicator::<CudaSlice<bf16>>::all_gather(&mut *comm, &sb, &mut rb);
            let mut small = be.alloc_grad(3, "").map_err(s)?;
            let big = be.alloc_grad(3 * world + 2, "").map_err(s)?;
            let e2 = Communicator::<CudaSlice<f32>>::reduce_scatter(&mut *comm, &big, &mut small, ReduceOp::Sum);
            let mut h = [0.0f32; 2];
            let e3 = Communicator::<[f32]>::broadcast(&mut *comm, &mut h[..], world);
            Ok([e1, e2, e3].iter().all(|e| matches!(e, Err(CommError::BadSize { .. }))))
        })(),
    );
}

/// Started collectives inside a CUDA graph, as `train.cuda_graphs` records them on
/// several GPUs: the communication stream forks from the recorded compute stream and
/// joins it at each wait. Replayed with new inputs each time (same buffers): results as
/// eager, and the compute after a wait sees the collective's output.
fn check_graph_collectives(be: &CudaBackend, comm: &mut NcclComm, rep: &mut NcclReport, rank: usize, world: usize) {
    rep.check(
        "reduce_scatter + all_gather_in_place recorded in a CUDA graph, replayed 3 times",
        (|| {
            let n = 1000usize;
            let mut g = be.alloc_grad(n * world, "").map_err(s)?;
            let mut sh = be.alloc_grad(n, "").map_err(s)?;
            let mut t = be.alloc_grad(n, "").map_err(s)?;
            let mut p = be.alloc_buf(n * world, "").map_err(s)?;
            be.begin_capture().map_err(s)?;
            let recorded = (|| -> Result<(), String> {
                let a = Communicator::<CudaSlice<f32>>::reduce_scatter_start(&mut *comm, &g, &mut sh, ReduceOp::Sum)
                    .map_err(s)?;
                let b =
                    AllGatherInPlace::<CudaSlice<bf16>>::all_gather_in_place_start(&mut *comm, &mut p).map_err(s)?;
                comm.wait(a).map_err(s)?;
                be.add_grad(&mut t, 0, &sh, Loc::all(n)).map_err(s)?;
                comm.wait(b).map_err(s)
            })();
            let graph = be.end_capture().map_err(s);
            recorded?;
            let graph = graph?;
            let mut ok = true;
            for k in 0..3usize {
                let v = |r: usize, i: usize| val(r, i + 5 * k);
                be.upload_f32(&(0..n * world).map(|j| v(rank, j)).collect::<Vec<_>>(), &mut g, 0).map_err(s)?;
                be.upload_f32(&vec![f32::NAN; n], &mut sh, 0).map_err(s)?;
                be.upload_f32(&vec![0.5; n], &mut t, 0).map_err(s)?;
                let own: Vec<f32> = (0..n * world).map(|j| if j / n == rank { v(rank, j) } else { f32::NAN }).collect();
                be.upload_buf(&own, &mut p, 0).map_err(s)?;
                be.replay(&graph).map_err(s)?;
                let want: Vec<f32> = (0..n).map(|i| (0..world).map(|r| v(r, rank * n + i)).sum()).collect();
                let got_s = be.download_grad(&sh, Loc::all(n)).map_err(s)?;
                let got_t = be.download_grad(&t, Loc::all(n)).map_err(s)?;
                let got_p = be.download_buf(&p, Loc::all(n * world)).map_err(s)?;
                ok &= got_s == want;
                ok &= got_t.iter().zip(&want).all(|(a, b)| *a == b + 0.5);
                ok &= (0..n * world).all(|j| got_p[j] == v(j / n, j));
            }
            Ok(ok)
        })(),
    );
}

/// Bandwidth at GPT-2 124M sizes: one block unit (7.09M parameters) per collective: the
/// table's lines, or why it could not run.
fn bandwidth(be: &CudaBackend, comm: &mut NcclComm, rank: usize, world: usize) -> Result<String, String> {
    let wf = world as f32;
    if world == 1 {
        return Ok(format!("rank {rank}: no bandwidth figures on a world of one\n"));
    }
    let unit = 7_087_872usize.div_ceil(8 * world) * 8 * world;
    let shard = unit / world;
    let ps = up_buf(be, &vec![1.0; shard]).map_err(s)?;
    let mut pf = be.alloc_buf(unit, "").map_err(s)?;
    let gf = up_f32(be, &vec![1.0; unit]).map_err(s)?;
    let mut gs = be.alloc_grad(shard, "").map_err(s)?;
    let ctx = be.context();
    let mut out = String::new();
    for which in ["all_gather bf16", "reduce_scatter f32"] {
        let mut ts = Vec::new();
        for i in 0..25 {
            let a = ctx.new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(s)?;
            let b = ctx.new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(s)?;
            a.record(be.stream()).map_err(s)?;
            if which.starts_with("all_gather") {
                Communicator::<CudaSlice<bf16>>::all_gather(&mut *comm, &ps, &mut pf).map_err(s)?;
            } else {
                Communicator::<CudaSlice<f32>>::reduce_scatter(&mut *comm, &gf, &mut gs, ReduceOp::Sum).map_err(s)?;
            }
            b.record(be.stream()).map_err(s)?;
            b.synchronize().map_err(s)?;
            if i >= 5 {
                ts.push(a.elapsed_ms(&b).map_err(s)? as f64);
            }
        }
        ts.sort_by(|a, b| a.total_cmp(b));
        let ms = ts[ts.len() / 2];
        let bytes = (unit * if which.ends_with("bf16") { 2 } else { 4 }) as f64;
        // Bus bandwidth as nccl-tests defines it for these two: bytes*(w-1)/w / time.
        out.push_str(&format!(
            "rank {rank}: {which} of {unit} elements: {ms:.3} ms median, bus bandwidth {:.0} GB/s\n",
            bytes * (wf as f64 - 1.0) / wf as f64 / (ms * 1e-3) / 1e9
        ));
    }
    Ok(out)
}

fn nccl_main(args: &[String]) -> ExitCode {
    // Never NVLink multicast on shared machines, also for the ranks spawned below.
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let devices = match cudarc::driver::CudaContext::device_count() {
        Ok(n) => n as usize,
        Err(e) => {
            println!("nccl: no CUDA devices ({e})");
            return ExitCode::FAILURE;
        }
    };
    let world = args.get(1).and_then(|w| w.parse().ok()).unwrap_or(devices);
    if world < 1 || world > devices {
        println!("nccl: need a world of at least 1 and at most the {devices} visible GPU(s); got {world}");
        return ExitCode::FAILURE;
    }
    let id = match nccl_unique_id() {
        Ok(id) => id,
        Err(e) => {
            println!("nccl: {e}");
            return ExitCode::FAILURE;
        }
    };
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            println!("nccl: cannot find my own executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut kids = Vec::new();
    for r in 1..world {
        match std::process::Command::new(&exe)
            .args(["rank", &world.to_string(), &r.to_string(), &hex(&id)])
            .env("NCCL_NVLS_ENABLE", "0")
            .spawn()
        {
            Ok(k) => kids.push((r, k)),
            Err(e) => {
                println!("nccl: spawning rank {r}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let mut failed = match nccl_rank(0, world, &id) {
        Ok(f) => f,
        Err(e) => {
            println!("rank 0: {e}");
            1
        }
    };
    for (r, mut k) in kids {
        match k.wait() {
            Ok(st) if st.success() => {}
            Ok(st) => {
                println!("rank {r} exited with {st}");
                failed += 1;
            }
            Err(e) => {
                println!("rank {r}: {e}");
                failed += 1;
            }
        }
    }
    println!("\nnccl check: {}", if failed == 0 { "all passed".to_string() } else { format!("{failed} failure(s)") });
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn nccl_rank_main(args: &[String]) -> ExitCode {
    let parsed = (|| -> Option<(usize, usize, Vec<u8>)> {
        Some((args.get(2)?.parse().ok()?, args.get(3)?.parse().ok()?, unhex(args.get(4)?)?))
    })();
    let Some((world, rank, id)) = parsed else {
        println!("usage: gpu-nccl rank WORLD RANK ID_HEX (spawned by gpu-nccl itself)");
        return ExitCode::FAILURE;
    };
    match nccl_rank(rank, world, &id) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            println!("rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("rank") => nccl_rank_main(&args),
        _ => nccl_main(&args),
    }
}
