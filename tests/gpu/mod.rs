//! What the GPU tests share: the backend they run on, random bf16-exact inputs, and a
//! report that compares GPU outputs with the CPU reference and fails the test with a
//! table of every compared output.
//!
//! The GPU tests are `#[ignore]`d, so `cargo test` on a machine without a GPU lists them
//! as ignored (skipped), never as passed. On a GPU machine run them with
//! `--include-ignored` (`scripts/gpu-test.sh` does); there a missing GPU is a failure.
#![allow(dead_code)]

use half::bf16;
use trainer::backend::cuda::CudaBackend;
use trainer::backend::{BResult, Device, MemoryOps};

/// The message every GPU test is ignored with.
pub const NEEDS_GPU: &str = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)";

/// Device 0, or a failure saying why there is none.
pub fn backend() -> CudaBackend {
    let be = CudaBackend::new_lenient(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    eprintln!("on {} ({} SMs)", be.name(), be.sm_count());
    be
}

/// Run one GPU test: `f` compares outputs into the report; then the table is printed and
/// the test fails if any comparison failed or `f` returned an error.
pub fn check(f: impl FnOnce(&CudaBackend, &mut Rng, &mut Report) -> BResult<()>) {
    let (be, mut rng, mut rep) = (backend(), Rng::new(), Report::default());
    let r = f(&be, &mut rng, &mut rep);
    rep.finish(r);
}

/// bf16 outputs: relative error near 2^-9 per element; fp32 outputs from identical
/// inputs differ only by summation order.
pub const TOL_BF16: f64 = 1e-2;
pub const TOL_F32: f64 = 1e-4;

/// Random inputs, fresh per run unless `GPU_CHECK_SEED` is set (the seed is printed).
pub struct Rng {
    seed: u64,
    next: u64,
}

impl Rng {
    pub fn new() -> Rng {
        let seed = std::env::var("GPU_CHECK_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
        });
        eprintln!("GPU_CHECK_SEED={seed}");
        Rng { seed, next: 0 }
    }
    /// `n` normal values times `scale`, rounded to bf16 so both backends see identical inputs.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        self.next += 1;
        (0..n as u64)
            .map(|i| bf16::from_f32(trainer::rng::normal(self.seed, self.next, i) as f32 * scale).to_f32())
            .collect()
    }
    /// `n` integers below `bound`.
    pub fn below(&mut self, n: usize, bound: u32) -> Vec<u32> {
        self.next += 1;
        (0..n as u64).map(|i| (trainer::rng::uniform(self.seed, self.next, i) * bound as f64) as u32 % bound).collect()
    }
}

/// Whether `GPU_CHECK_SMALL` asks for the small cases only (for compute-sanitizer, which
/// runs kernels far slower).
pub fn small() -> bool {
    std::env::var_os("GPU_CHECK_SMALL").is_some()
}

struct Row {
    op: String,
    what: String,
    max_abs: f64,
    rel: f64,
    tol: f64,
    ok: bool,
    note: String,
}

/// Compared outputs; `finish` prints them and fails the test if any failed.
#[derive(Default)]
pub struct Report {
    rows: Vec<Row>,
}

impl Report {
    /// ‖gpu − cpu‖ / ‖cpu‖ against `tol`; any non-finite GPU value where the CPU has a
    /// finite one fails (that is how an unwritten, NaN-poisoned element shows).
    pub fn cmp(&mut self, op: &str, what: &str, gpu: &[f32], cpu: &[f32], tol: f64) {
        let mut note = String::new();
        let mut ok = gpu.len() == cpu.len();
        if !ok {
            note = format!("length {} vs {}", gpu.len(), cpu.len());
        }
        let (mut num, mut den, mut max_abs, mut bad) = (0f64, 0f64, 0f64, 0usize);
        for (&g, &c) in gpu.iter().zip(cpu) {
            if !g.is_finite() && c.is_finite() {
                bad += 1;
                continue;
            }
            let d = (g as f64 - c as f64).abs();
            num += d * d;
            den += (c as f64) * (c as f64);
            max_abs = max_abs.max(d);
        }
        if bad > 0 {
            ok = false;
            note = format!("{bad} non-finite (unwritten?) elements");
        }
        let rel = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
        ok &= rel <= tol;
        self.rows.push(Row { op: op.into(), what: what.into(), max_abs, rel, tol, ok, note });
    }

    /// Two runs of the same op must give the same bits (no races, no atomics).
    pub fn same_bits(&mut self, op: &str, what: &str, a: &[f32], b: &[f32]) {
        let diff = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        let ok = diff == 0 && a.len() == b.len();
        let note =
            if ok { "bit-identical on repeat".to_string() } else { format!("{diff} elements differ between two runs") };
        self.rows.push(Row { op: op.into(), what: what.into(), max_abs: 0.0, rel: 0.0, tol: 0.0, ok, note });
    }

    /// A yes/no check.
    pub fn check(&mut self, op: &str, what: &str, ok: bool, note: &str) {
        let r = Row { op: op.into(), what: what.into(), max_abs: 0.0, rel: 0.0, tol: 0.0, ok, note: note.into() };
        self.rows.push(r);
    }

    /// Print the table; panic (fail the test) if a row failed or `result` is an error.
    pub fn finish(self, result: BResult<()>) {
        println!("\n{:<40} {:<14} {:>11} {:>11} {:>9}  result", "op", "output", "max |err|", "rel err", "tol");
        for r in &self.rows {
            let note = if r.note.is_empty() { String::new() } else { format!(" ({})", r.note) };
            let res = if r.ok { "ok" } else { "FAIL" };
            println!("{:<40} {:<14} {:>11.3e} {:>11.3e} {:>9.1e}  {res}{note}", r.op, r.what, r.max_abs, r.rel, r.tol);
        }
        if let Err(e) = result {
            panic!("error: {e}");
        }
        let failed: Vec<String> = self.rows.iter().filter(|r| !r.ok).map(|r| format!("{} {}", r.op, r.what)).collect();
        assert!(failed.is_empty(), "{} check(s) failed: {}", failed.len(), failed.join(", "));
        assert!(!self.rows.is_empty(), "nothing was compared");
    }
}

pub fn up_buf<B: MemoryOps>(be: &B, v: &[f32]) -> BResult<B::Buf> {
    let mut b = be.alloc_buf(v.len(), "check input")?;
    be.upload_buf(v, &mut b, 0)?;
    Ok(b)
}
pub fn up_f32<B: MemoryOps>(be: &B, v: &[f32]) -> BResult<B::F32> {
    let mut b = be.alloc_f32(v.len(), "check input")?;
    be.upload_f32(v, &mut b, 0)?;
    Ok(b)
}
/// Gradients to accumulate into (`Grad` is fp32 on both backends, like `F32`).
pub fn up_grad<B: MemoryOps<Grad = <B as Device>::F32>>(be: &B, v: &[f32]) -> BResult<B::Grad> {
    up_f32(be, v)
}
pub fn up_tok<B: MemoryOps>(be: &B, v: &[u32]) -> BResult<B::Tokens> {
    let mut b = be.alloc_tokens(v.len(), trainer::backend::TokenRole::Inputs)?;
    be.upload_tokens(v, &mut b)?;
    Ok(b)
}
/// A compute buffer of `n` NaNs: an element the op does not write stays NaN and fails.
pub fn poisoned_buf<B: MemoryOps>(be: &B, n: usize) -> BResult<B::Buf> {
    up_buf(be, &vec![f32::NAN; n])
}
pub fn poisoned_f32<B: MemoryOps>(be: &B, n: usize) -> BResult<B::F32> {
    up_f32(be, &vec![f32::NAN; n])
}
