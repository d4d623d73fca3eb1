//! The event timer (the median of event-timed repeats) with its cuBLASLt sweeps and
//! searches, and the random buffers the tables time on.

use cudarc::driver::sys as dsys;
use cudarc::driver::CudaSlice;
use half::bf16;
use trainer::backend::cuda::CudaBackend;
use trainer::backend::*;

/// Random inputs for timing (their values do not matter, only that they are not zero).
pub(crate) fn randn(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n as u64).map(|i| bf16::from_f32(trainer::rng::normal(seed, 1, i) as f32 * scale).to_f32()).collect()
}

pub(crate) struct Timer<'a> {
    pub(crate) be: &'a CudaBackend,
    pub(crate) rows: Vec<(String, f64, String)>,
    /// `gemm-algos COUNT`: after each GEMM row, time cuBLASLt's first COUNT candidates.
    pub(crate) algos: Option<usize>,
    /// `fp8-search CAP`: after each layer, time every GEMM over cuBLASLt's algorithm space
    /// (at most CAP configurations each).
    pub(crate) search: Option<usize>,
    /// Per GEMM: (the heuristic's first, the fastest candidate) in ms; with `fp8-search`
    /// (timed tuning's pick, the fastest configuration found).
    pub(crate) algo_sums: Vec<(f64, f64)>,
}

impl Timer<'_> {
    /// Median over `reps` event-timed calls of `f`, after `warm` untimed ones.
    pub(crate) fn time(
        &mut self,
        name: &str,
        warm: usize,
        reps: usize,
        work: impl Fn(f64) -> String,
        mut f: impl FnMut() -> BResult<()>,
    ) {
        let r = (|| -> BResult<f64> {
            for _ in 0..warm {
                f()?;
            }
            self.be.synchronize()?;
            let ctx = self.be.context();
            let mk = || {
                ctx.new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| BackendError::Device(format!("event: {e}")))
            };
            let mut ts = Vec::with_capacity(reps);
            for _ in 0..reps {
                let (a, b) = (mk()?, mk()?);
                a.record(self.be.stream()).map_err(|e| BackendError::Device(format!("event record: {e}")))?;
                f()?;
                b.record(self.be.stream()).map_err(|e| BackendError::Device(format!("event record: {e}")))?;
                b.synchronize().map_err(|e| BackendError::Device(format!("event sync: {e}")))?;
                ts.push(a.elapsed_ms(&b).map_err(|e| BackendError::Device(format!("event time: {e}")))? as f64);
            }
            self.be.synchronize()?;
            ts.sort_by(|a, b| a.total_cmp(b));
            Ok(ts[ts.len() / 2])
        })();
        match r {
            Ok(ms) => {
                let w = work(ms);
                println!("  {name:<40} {ms:>9.3} ms  {w}");
                self.rows.push((name.to_string(), ms, w));
            }
            Err(e) => {
                println!("  {name:<40} ERROR {e}");
                self.rows.push((name.to_string(), f64::NAN, format!("ERROR {e}")));
            }
        }
    }
}

impl Timer<'_> {
    /// With `gemm-algos`: every GEMM run since the last call (its buffers still live),
    /// timed again with each of cuBLASLt's first candidates; #0 is the trainer's.
    pub(crate) fn sweep(&mut self) {
        if let Some(cap) = self.search {
            self.search(cap);
        }
        let Some(count) = self.algos else { return };
        match self.be.gemm_sweep(count, 20) {
            Ok(rows) => {
                for row in rows {
                    println!("    GEMM {}", row.gemm);
                    let fastest = row.candidates.iter().map(|c| c.1).fold(f64::INFINITY, f64::min);
                    for (i, (cfg, ms)) in row.candidates.iter().enumerate() {
                        let mark = if *ms == fastest { " <- fastest" } else { "" };
                        println!("      #{i} {ms:>8.4} ms {:>6.1} TFLOP/s  {cfg}{mark}", row.flop / (ms * 1e-3) / 1e12);
                    }
                    self.algo_sums.push((row.candidates.first().map_or(0.0, |c| c.1), fastest));
                }
            }
            Err(e) => println!("    GEMM sweep failed: {e}"),
        }
    }

    /// With `fp8-search`: every GEMM run since the last call timed over cuBLASLt's
    /// algorithm space: the heuristic's first, timed tuning's pick (the fastest of the
    /// heuristic's first eight), and the fastest configurations found.
    pub(crate) fn search(&mut self, cap: usize) {
        match self.be.fp8_gemm_search(cap) {
            Ok(rows) => {
                for r in rows {
                    let tf = |ms: f64| r.flop / (ms * 1e-3) / 1e12;
                    println!("    GEMM {}", r.gemm);
                    println!(
                        "      heuristic's first {:.4} ms ({:.1} TFLOP/s), timed tuning's pick {:.4} ms ({:.1} TFLOP/s); \
                         {} configurations built, {} accepted, {} timed",
                        r.heuristic_first_ms,
                        tf(r.heuristic_first_ms),
                        r.heuristic_best_ms,
                        tf(r.heuristic_best_ms),
                        r.configs_built,
                        r.configs_valid,
                        r.configs_timed
                    );
                    for (cfg, ms) in &r.best {
                        println!("      found {ms:>8.4} ms {:>6.1} TFLOP/s  {cfg}", tf(*ms));
                    }
                    let found = r.best.first().map_or(f64::INFINITY, |b| b.1);
                    self.algo_sums.push((r.heuristic_best_ms, found.min(r.heuristic_best_ms)));
                }
            }
            Err(e) => println!("    GEMM search failed: {e}"),
        }
    }

    /// With `gemm-algos`/`fp8-algos`: every swept GEMM once, the heuristic's first choices
    /// against the fastest candidates; with `fp8-search`, timed tuning's picks against the
    /// fastest configurations found.
    pub(crate) fn sweep_summary(&self) {
        if self.search.is_some() {
            let (pick, best) = self.algo_sums.iter().fold((0.0, 0.0), |(a, b), (f, x)| (a + f, b + x));
            println!("\nGEMMs above, once each: timed tuning's picks {pick:.3} ms, the fastest configurations found {best:.3} ms");
            return;
        }
        if self.algos.is_none() {
            return;
        }
        let (first, best) = self.algo_sums.iter().fold((0.0, 0.0), |(a, b), (f, x)| (a + f, b + x));
        println!("\nGEMMs above, once each: the heuristic's first choices {first:.3} ms, the fastest candidates {best:.3} ms");
    }
}

pub(crate) fn tflops(flop: f64) -> impl Fn(f64) -> String {
    move |ms| format!("{:>7.1} TFLOP/s", flop / (ms * 1e-3) / 1e12)
}
pub(crate) fn gbps(bytes: f64) -> impl Fn(f64) -> String {
    move |ms| format!("{:>7.0} GB/s", bytes / (ms * 1e-3) / 1e9)
}

/// Fill a buffer with random (non-zero) bf16 data: one random chunk, tiled.
pub(crate) fn fill_buf(be: &CudaBackend, buf: &mut CudaSlice<bf16>, chunk: &[f32]) -> BResult<()> {
    let n = buf.len();
    let mut off = 0;
    while off < n {
        let k = chunk.len().min(n - off);
        be.upload_buf(&chunk[..k], buf, off)?;
        off += k;
    }
    Ok(())
}
/// A bf16 buffer of `len` elements filled from `chunk` (tiled).
pub(crate) fn new_buf(be: &CudaBackend, len: usize, chunk: &[f32]) -> BResult<CudaSlice<bf16>> {
    let mut x = be.alloc_buf(len, "timing")?;
    fill_buf(be, &mut x, chunk)?;
    Ok(x)
}

/// The buffers one LayerNorm is timed on: rows `x` in, `y` out, `dres` the residual
/// gradient the backward adds to; the weight and bias at 0 and C of `params`/`grads`.
pub(crate) struct LnBufs<'a> {
    pub(crate) x: &'a CudaSlice<bf16>,
    pub(crate) y: &'a mut CudaSlice<bf16>,
    pub(crate) dres: &'a mut CudaSlice<bf16>,
    pub(crate) params: &'a CudaSlice<bf16>,
    pub(crate) grads: &'a mut CudaSlice<f32>,
    pub(crate) mean: &'a mut CudaSlice<f32>,
    pub(crate) rstd: &'a mut CudaSlice<f32>,
}

/// The LayerNorm forward and backward (with its partial-sum reduction), `reps` timed calls each.
pub(crate) fn time_layernorm(tm: &mut Timer<'_>, b: LnBufs<'_>, r: Rows, reps: usize) {
    let (be, ln) = (tm.be, NormLocs { w: Loc::new(0, r.c), b: Loc::new(r.c, r.c) });
    let bc2 = (r.n * r.c * 2) as f64;
    let LnBufs { x, y, dres, params, grads, mean, rstd } = b;
    tm.time("layernorm_fwd", 3, reps, gbps(2.0 * bc2), || {
        be.layernorm_fwd(y, LnStats { mean, rstd }, x, Weights::new(params, ln), r, None)
    });
    tm.time("layernorm_bwd", 3, reps, gbps(4.0 * bc2), || {
        let saved = LnSaved { inp: x, mean, rstd };
        be.layernorm_bwd(dres, WeightGrads::new(grads, ln), y, saved, Weights::new(params, ln), r, None)
    });
}

pub(crate) fn fill_f32(be: &CudaBackend, buf: &mut CudaSlice<f32>, chunk: &[f32]) -> BResult<()> {
    let n = buf.len();
    let mut off = 0;
    while off < n {
        let k = chunk.len().min(n - off);
        be.upload_f32(&chunk[..k], buf, off)?;
        off += k;
    }
    Ok(())
}
