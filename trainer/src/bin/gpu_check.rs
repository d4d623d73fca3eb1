//! `gpu-check`: the CUDA backend and the NCCL communicator checked on a real GPU, in
//! one command.
//!
//! - `gpu-check` (or `gpu-check kernels`): every op of the CUDA backend against the CPU
//!   reference on fresh random inputs (outputs poisoned with NaN first, so an element
//!   the GPU never writes fails), forward and backward, at GPT-2 shapes and at odd
//!   ones; bit-for-bit repeat checks of the backward ops; then a timing table (median
//!   of event-timed repeats) at GPT-2 124M shapes (B=16, T=1024, C=768).
//! - `gpu-check kernels-small`: the checks without the large cases (for
//!   `compute-sanitizer`, which runs kernels far slower).
//! - `gpu-check timing`: only the timing table.
//! - `gpu-check nccl [world]`: spawns one process per GPU (itself, the NCCL id passed as
//!   hex on the command line) and checks all-gather, reduce-scatter (sum, avg), all-reduce,
//!   broadcast and the host-scalar collectives against expected values, with odd sizes.
//!
//! Exits non-zero if any check fails. Both CPU and GPU see the same bf16-rounded inputs,
//! so the differences printed are the GPU's own (bf16 outputs, summation order).

use std::process::ExitCode;
use std::time::Instant;

use collectives::nccl::{nccl_unique_id, nccl_version, NcclComm};
use collectives::{CommError, Communicator, Group, ReduceOp};
use cudarc::driver::{sys as dsys, CudaSlice};
use half::bf16;
use trainer::backend::cpu::CpuBackend;
use trainer::backend::cuda::{AttentionImpl, CudaBackend};
use trainer::backend::{AdamWStep, AttnShape, BResult, Backend, BackendError, F64Pair, Loc};
use trainer::zero::EngineComm;

// The engine's collective bound must hold for the real pair, and the backend must be
// movable to a rank's thread (compile-time checks).
const _: fn() = || {
    fn needs<C: EngineComm<CudaBackend>>() {}
    fn send<T: Send>() {}
    needs::<NcclComm>();
    send::<CudaBackend>();
};

/// SplitMix64: the check's own random numbers (fresh per run unless GPU_CHECK_SEED is set).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    /// Approximately normal (sum of 4 uniforms), scaled; rounded to bf16 so both
    /// backends see identical inputs.
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let s: f32 = (0..4).map(|_| self.uniform()).sum::<f32>() - 2.0;
                bf16::from_f32(s * scale * 1.732).to_f32()
            })
            .collect()
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % n as u64) as u32
    }
}

/// One compared output.
struct Row {
    op: String,
    what: String,
    max_abs: f64,
    rel: f64,
    tol: f64,
    ok: bool,
    note: String,
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    errors: Vec<String>,
}

impl Report {
    /// ‖gpu − cpu‖ / ‖cpu‖ against `tol`; any non-finite GPU value where the CPU has a
    /// finite one fails (that is how an unwritten, NaN-poisoned element shows).
    fn cmp(&mut self, op: &str, what: &str, gpu: &[f32], cpu: &[f32], tol: f64) {
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
    fn same_bits(&mut self, op: &str, what: &str, a: &[f32], b: &[f32]) {
        let diff = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        let ok = diff == 0 && a.len() == b.len();
        let note = if ok {
            "bit-identical on repeat".to_string()
        } else {
            format!("{diff} elements differ between two runs (a race?)")
        };
        self.rows.push(Row { op: op.into(), what: what.into(), max_abs: 0.0, rel: 0.0, tol: 0.0, ok, note });
    }
    fn error(&mut self, op: &str, e: impl std::fmt::Display) {
        self.errors.push(format!("{op}: {e}"));
    }
    fn failed(&self) -> usize {
        self.rows.iter().filter(|r| !r.ok).count() + self.errors.len()
    }
    fn print(&self) {
        println!("\n{:<34} {:<14} {:>11} {:>11} {:>9}  result", "op", "output", "max |err|", "rel err", "tol");
        for r in &self.rows {
            println!(
                "{:<34} {:<14} {:>11.3e} {:>11.3e} {:>9.1e}  {}{}",
                r.op,
                r.what,
                r.max_abs,
                r.rel,
                r.tol,
                if r.ok { "ok" } else { "FAIL" },
                if r.note.is_empty() { String::new() } else { format!(" ({})", r.note) }
            );
        }
        for e in &self.errors {
            println!("ERROR {e}");
        }
    }
}

// bf16 outputs: relative error near 2^-9 per element; fp32 outputs from identical
// inputs differ only by summation order.
const TOL_BF16: f64 = 1e-2;
const TOL_F32: f64 = 1e-4;

fn up_buf<B: Backend>(be: &B, v: &[f32]) -> BResult<B::Buf> {
    let mut b = be.alloc_buf(v.len(), "check input")?;
    be.upload_buf(v, &mut b, 0)?;
    Ok(b)
}
fn up_f32<B: Backend>(be: &B, v: &[f32]) -> BResult<B::F32> {
    let mut b = be.alloc_f32(v.len(), "check input")?;
    be.upload_f32(v, &mut b, 0)?;
    Ok(b)
}
fn up_tok<B: Backend>(be: &B, v: &[u32]) -> BResult<B::Tokens> {
    let mut b = be.alloc_tokens(v.len())?;
    be.upload_tokens(v, &mut b)?;
    Ok(b)
}
/// Gradients to accumulate into (`Grad` is `Vec<f32>` / `CudaSlice<f32>`, like `F32`).
fn up_grad_cpu(v: &[f32]) -> Vec<f32> {
    v.to_vec()
}
/// The GPU twin of [`up_grad_cpu`].
fn up_grad_gpu(be: &CudaBackend, v: &[f32]) -> BResult<CudaSlice<f32>> {
    up_f32(be, v)
}
fn poison_buf<B: Backend>(be: &B, b: &mut B::Buf, n: usize) -> BResult<()> {
    be.upload_buf(&vec![f32::NAN; n], b, 0)
}
fn poison_f32<B: Backend>(be: &B, b: &mut B::F32, n: usize) -> BResult<()> {
    be.upload_f32(&vec![f32::NAN; n], b, 0)
}

fn run_check(rep: &mut Report, name: &str, f: impl FnOnce(&mut Report) -> BResult<()>) {
    let t0 = Instant::now();
    if let Err(e) = f(rep) {
        rep.error(name, e);
    }
    eprintln!("  checked {name} in {:.1} s", t0.elapsed().as_secs_f64());
}

fn check_kernels(be: &CudaBackend, rng: &mut Rng, small: bool) -> Report {
    let cpu = CpuBackend;
    let mut rep = Report::default();
    for f in be.kernel_failures() {
        rep.error("kernel build", f);
    }

    // ---- encoder ----
    for &(b, t, c, v) in &[(4usize, 64usize, 768usize, 300usize), (3, 17, 36, 7)] {
        let tag = format!("encoder B{b} T{t} C{c} V{v}");
        run_check(&mut rep, &tag, |rep| {
            let n = b * t;
            let (wte, wpe) = (Loc::new(0, v * c), Loc::new(v * c, t * c));
            let params = rng.vec(v * c + t * c, 0.5);
            let toks: Vec<u32> = (0..n).map(|_| rng.below(v as u32)).collect();
            let mut out_c = cpu.alloc_buf(n * c, "")?;
            cpu.encoder_fwd(&mut out_c, &toks, &params, wte, wpe, b, t, c)?;
            let (gp, gt) = (up_buf(be, &params)?, up_tok(be, &toks)?);
            let mut out_g = be.alloc_buf(n * c, "")?;
            poison_buf(be, &mut out_g, n * c)?;
            be.encoder_fwd(&mut out_g, &gt, &gp, wte, wpe, b, t, c)?;
            rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&out_g, Loc::all(n * c))?, &out_c, TOL_BF16);
            // backward: += into random gradients
            let dout = rng.vec(n * c, 1.0);
            let g0 = rng.vec(v * c + t * c, 0.1);
            let mut gc = up_grad_cpu(&g0);
            cpu.encoder_bwd(&mut gc, wte, wpe, &dout, &toks, b, t, c)?;
            let dg = up_buf(be, &dout)?;
            let mut gg = up_grad_gpu(be, &g0)?;
            be.encoder_bwd(&mut gg, wte, wpe, &dg, &gt, b, t, c)?;
            let got = be.download_grad(&gg, Loc::all(g0.len()))?;
            rep.cmp(&format!("{tag} bwd"), "dwte", &got[..v * c], &gc[..v * c], TOL_F32);
            rep.cmp(&format!("{tag} bwd"), "dwpe", &got[v * c..], &gc[v * c..], TOL_F32);
            let mut gg2 = up_grad_gpu(be, &g0)?;
            be.encoder_bwd(&mut gg2, wte, wpe, &dg, &gt, b, t, c)?;
            rep.same_bits(&format!("{tag} bwd"), "repeat", &be.download_grad(&gg2, Loc::all(g0.len()))?, &got);
            Ok(())
        });
    }

    // ---- layernorm ----
    for &(n, c) in &[(256usize, 768usize), (37, 100)] {
        let tag = format!("layernorm N{n} C{c}");
        run_check(&mut rep, &tag, |rep| {
            let off = 5; // parameters at an odd offset: unaligned pointers
            let (w, bl) = (Loc::new(off, c), Loc::new(off + c, c));
            let mut params = rng.vec(off + 2 * c, 0.3);
            for x in &mut params[off..off + c] {
                *x = bf16::from_f32(*x + 1.0).to_f32();
            }
            let inp: Vec<f32> = rng
                .vec(n * c, 1.0)
                .iter()
                .enumerate()
                .map(|(i, x)| bf16::from_f32(x + (i / c) as f32 * 0.01).to_f32())
                .collect();
            let (mut oc, mut mc, mut rc) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            cpu.layernorm_fwd(&mut oc, &mut mc, &mut rc, &inp, &params, w, bl, n, c)?;
            let (gp, gi) = (up_buf(be, &params)?, up_buf(be, &inp)?);
            let mut og = be.alloc_buf(n * c, "")?;
            let (mut mg, mut rg) = (be.alloc_f32(n, "")?, be.alloc_f32(n, "")?);
            poison_buf(be, &mut og, n * c)?;
            poison_f32(be, &mut mg, n)?;
            poison_f32(be, &mut rg, n)?;
            be.layernorm_fwd(&mut og, &mut mg, &mut rg, &gi, &gp, w, bl, n, c)?;
            rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&og, Loc::all(n * c))?, &oc, TOL_BF16);
            rep.cmp(&format!("{tag} fwd"), "mean", &be.download_f32(&mg, Loc::all(n))?, &mc, TOL_F32);
            rep.cmp(&format!("{tag} fwd"), "rstd", &be.download_f32(&rg, Loc::all(n))?, &rc, TOL_F32);
            // backward: dinp +=, dw +=, db +=; both use the CPU's statistics
            let dout = rng.vec(n * c, 1.0);
            let dinp0 = rng.vec(n * c, 0.5);
            let g0 = rng.vec(off + 2 * c, 0.1);
            let (dw, db) = (Loc::new(off, c), Loc::new(off + c, c));
            let (mut dic, mut gc) = (dinp0.clone(), up_grad_cpu(&g0));
            cpu.layernorm_bwd(&mut dic, &mut gc, dw, db, &dout, &inp, &params, w, &mc, &rc, n, c)?;
            let (gdo, gm, gr) = (up_buf(be, &dout)?, up_f32(be, &mc)?, up_f32(be, &rc)?);
            let run = || -> BResult<(Vec<f32>, Vec<f32>)> {
                let mut dig = up_buf(be, &dinp0)?;
                let mut gg = up_grad_gpu(be, &g0)?;
                be.layernorm_bwd(&mut dig, &mut gg, dw, db, &gdo, &gi, &gp, w, &gm, &gr, n, c)?;
                Ok((be.download_buf(&dig, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(g0.len()))?))
            };
            let (di1, g1) = run()?;
            rep.cmp(&format!("{tag} bwd"), "dinp", &di1, &dic, TOL_BF16);
            rep.cmp(&format!("{tag} bwd"), "dw", &g1[off..off + c], &gc[off..off + c], TOL_F32);
            rep.cmp(&format!("{tag} bwd"), "db", &g1[off + c..], &gc[off + c..], TOL_F32);
            let (di2, g2) = run()?;
            rep.same_bits(&format!("{tag} bwd"), "repeat", &[di2, g2].concat(), &[di1, g1].concat());
            Ok(())
        });
    }

    // ---- matmul (cuBLASLt) ----
    // (n, c, oc, parameter offset, bias)
    for &(n, c, oc, off, bias) in &[
        (256usize, 768usize, 2304usize, 0usize, true),
        (256, 3072, 768, 0, true),
        (64, 768, 50257, 0, false),
        (3000, 64, 50257, 0, false),
        (1100, 64, 1001, 5, true),
        (37, 72, 50, 8, true),
        (37, 75, 51, 3, true),
    ] {
        if small && n * oc > 4 << 20 {
            continue;
        }
        let tag = format!("matmul N{n} C{c} OC{oc} off{off}");
        run_check(&mut rep, &tag, |rep| {
            let w = Loc::new(off, oc * c);
            let bl = if bias { Some(Loc::new(off + oc * c, oc)) } else { None };
            let plen = off + oc * c + if bias { oc } else { 0 };
            let params = rng.vec(plen, 0.05);
            let inp = rng.vec(n * c, 1.0);
            let mut outc = vec![0.0; n * oc];
            cpu.matmul_fwd(&mut outc, &inp, &params, w, bl, n, c, oc)?;
            let (gp, gi) = (up_buf(be, &params)?, up_buf(be, &inp)?);
            let mut outg = be.alloc_buf(n * oc, "")?;
            poison_buf(be, &mut outg, n * oc)?;
            be.matmul_fwd(&mut outg, &gi, &gp, w, bl, n, c, oc)?;
            rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&outg, Loc::all(n * oc))?, &outc, TOL_BF16);
            let dout = rng.vec(n * oc, 0.1);
            let g0 = rng.vec(plen, 0.01);
            let (mut dic, mut gc) = (vec![0.0; n * c], up_grad_cpu(&g0));
            cpu.matmul_bwd(&mut dic, &mut gc, w, bl, &dout, &inp, &params, w, n, c, oc)?;
            let gdo = up_buf(be, &dout)?;
            let run = || -> BResult<(Vec<f32>, Vec<f32>)> {
                let mut dig = be.alloc_buf(n * c, "")?;
                poison_buf(be, &mut dig, n * c)?;
                let mut gg = up_grad_gpu(be, &g0)?;
                be.matmul_bwd(&mut dig, &mut gg, w, bl, &gdo, &gi, &gp, w, n, c, oc)?;
                Ok((be.download_buf(&dig, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(plen))?))
            };
            let (di1, g1) = run()?;
            rep.cmp(&format!("{tag} bwd"), "dinp", &di1, &dic, TOL_BF16);
            rep.cmp(&format!("{tag} bwd"), "dW", &g1[off..off + oc * c], &gc[off..off + oc * c], TOL_F32);
            if bias {
                rep.cmp(&format!("{tag} bwd"), "dbias", &g1[off + oc * c..], &gc[off + oc * c..], TOL_F32);
            }
            let (di2, g2) = run()?;
            rep.same_bits(&format!("{tag} bwd"), "repeat", &[di2, g2].concat(), &[di1, g1].concat());
            Ok(())
        });
    }

    // ---- MLP layers with GELU in the GEMM epilogue (fused where cuBLASLt can) ----
    // (n, c, oc): fc-like forward n x c -> oc and fc2-like backward with input width c.
    for &(n, c, oc) in &[(256usize, 768usize, 3072usize), (256, 3072, 768), (37, 72, 56), (37, 75, 51)] {
        let tag = format!("matmul+gelu N{n} C{c} OC{oc}");
        run_check(&mut rep, &tag, |rep| {
            let (w, bl) = (Loc::new(0, oc * c), Loc::new(oc * c, oc));
            let plen = oc * c + oc;
            let params = rng.vec(plen, 0.05);
            let inp = rng.vec(n * c, 1.0);
            let (mut prec, mut actc) = (vec![0.0; n * oc], vec![0.0; n * oc]);
            cpu.matmul_gelu_fwd(&mut prec, &mut actc, &inp, &params, w, bl, n, c, oc)?;
            let (gp, gi) = (up_buf(be, &params)?, up_buf(be, &inp)?);
            let (mut preg, mut actg) = (be.alloc_buf(n * oc, "")?, be.alloc_buf(n * oc, "")?);
            poison_buf(be, &mut preg, n * oc)?;
            poison_buf(be, &mut actg, n * oc)?;
            be.matmul_gelu_fwd(&mut preg, &mut actg, &gi, &gp, w, bl, n, c, oc)?;
            rep.cmp(&format!("{tag} fwd"), "pre", &be.download_buf(&preg, Loc::all(n * oc))?, &prec, TOL_BF16);
            rep.cmp(&format!("{tag} fwd"), "gelu", &be.download_buf(&actg, Loc::all(n * oc))?, &actc, TOL_BF16);
            // Backward of a layer c -> oc whose input is GELU(pre), pre of width c.
            let pre = rng.vec(n * c, 1.0);
            let mut act = vec![0.0; n * c];
            cpu.gelu_fwd(&mut act, &pre, n * c)?;
            // The GPU holds GELU(pre) in bf16: give the reference the same input for dW.
            act.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
            let dout = rng.vec(n * oc, 0.1);
            let g0 = rng.vec(plen, 0.01);
            let (mut dpc, mut gc, mut actc2) = (vec![0.0; n * c], up_grad_cpu(&g0), act.clone());
            cpu.matmul_bwd_dgelu(&mut dpc, &mut gc, w, bl, &dout, &mut actc2, &pre, &params, w, n, c, oc)?;
            let (gdo, gpre) = (up_buf(be, &dout)?, up_buf(be, &pre)?);
            let run = || -> BResult<(Vec<f32>, Vec<f32>)> {
                let mut dpg = be.alloc_buf(n * c, "")?;
                poison_buf(be, &mut dpg, n * c)?;
                let mut gact = up_buf(be, &act)?;
                let mut gg = up_grad_gpu(be, &g0)?;
                be.matmul_bwd_dgelu(&mut dpg, &mut gg, w, bl, &gdo, &mut gact, &gpre, &gp, w, n, c, oc)?;
                Ok((be.download_buf(&dpg, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(plen))?))
            };
            let (dp1, g1) = run()?;
            rep.cmp(&format!("{tag} bwd"), "dpre", &dp1, &dpc, TOL_BF16);
            rep.cmp(&format!("{tag} bwd"), "dW", &g1[..oc * c], &gc[..oc * c], TOL_F32);
            rep.cmp(&format!("{tag} bwd"), "dbias", &g1[oc * c..], &gc[oc * c..], TOL_F32);
            let (dp2, g2) = run()?;
            rep.same_bits(&format!("{tag} bwd"), "repeat", &[dp2, g2].concat(), &[dp1, g1].concat());
            Ok(())
        });
    }

    // ---- attention: the tensor-core kernels (head size 64) and the SIMT ones ----
    for &(b, t, nh, hs) in
        &[(1usize, 1024usize, 12usize, 64usize), (2, 77, 3, 64), (2, 77, 3, 32), (1, 130, 2, 128), (2, 64, 2, 64)]
    {
        if small && t > 512 {
            continue;
        }
        let tag = format!("attention B{b} T{t} NH{nh} HS{hs}");
        run_check(&mut rep, &tag, |rep| {
            let c = nh * hs;
            let s = AttnShape { b, t, c, nh };
            let n = b * t;
            let qkv = rng.vec(n * 3 * c, 1.0);
            let mut outc = vec![0.0; n * c];
            let mut att = vec![0.0; cpu.attention_saved_len(s)];
            cpu.attention_fwd(&mut outc, &mut att, &qkv, s)?;
            let dout = rng.vec(n * c, 1.0);
            let mut dqc = vec![0.0; n * 3 * c];
            cpu.attention_bwd(&mut dqc, &dout, &qkv, &outc, &att, s)?;
            // The saved log-sum-exp (base 2) from the CPU's probabilities: at the
            // diagonal p = exp2(s2 - lse), so lse = s2 - log2(p) with s2 = q.k*scale*log2 e.
            let scale = 1.0 / (hs as f32).sqrt();
            let mut want = vec![0.0f32; b * nh * t];
            for bi in 0..b {
                for h in 0..nh {
                    for ti in 0..t {
                        let q = &qkv[(bi * t + ti) * 3 * c + h * hs..][..hs];
                        let k = &qkv[(bi * t + ti) * 3 * c + c + h * hs..][..hs];
                        let s2 = q.iter().zip(k).map(|(x, y)| x * y).sum::<f32>() * scale * std::f32::consts::LOG2_E;
                        let p = att[((bi * nh + h) * t + ti) * t + ti];
                        want[(bi * nh + h) * t + ti] = s2 - p.log2();
                    }
                }
            }
            let (gq, gdo) = (up_buf(be, &qkv)?, up_buf(be, &dout)?);
            let impls: &[AttentionImpl] =
                if hs == 64 { &[AttentionImpl::TensorCore, AttentionImpl::Simt] } else { &[AttentionImpl::Simt] };
            for &imp in impls {
                be.set_attention_impl(imp);
                let tag = format!("{tag} {}", if imp == AttentionImpl::Simt { "simt" } else { "mma" });
                let mut outg = be.alloc_buf(n * c, "")?;
                let mut saved = be.alloc_f32(be.attention_saved_len(s), "")?;
                poison_buf(be, &mut outg, n * c)?;
                poison_f32(be, &mut saved, be.attention_saved_len(s))?;
                be.attention_fwd(&mut outg, &mut saved, &gq, s)?;
                rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&outg, Loc::all(n * c))?, &outc, TOL_BF16);
                rep.cmp(&format!("{tag} fwd"), "lse", &be.download_f32(&saved, Loc::all(b * nh * t))?, &want, 1e-3);
                let run = || -> BResult<Vec<f32>> {
                    let mut dq = be.alloc_buf(n * 3 * c, "")?;
                    poison_buf(be, &mut dq, n * 3 * c)?;
                    be.attention_bwd(&mut dq, &gdo, &gq, &outg, &saved, s)?;
                    be.download_buf(&dq, Loc::all(n * 3 * c))
                };
                let d1 = run()?;
                let pick = |v: &[f32], part: usize| -> Vec<f32> {
                    v.chunks(3 * c).flat_map(|r| r[part * c..(part + 1) * c].to_vec()).collect()
                };
                for (part, name) in ["dq", "dk", "dv"].iter().enumerate() {
                    rep.cmp(&format!("{tag} bwd"), name, &pick(&d1, part), &pick(&dqc, part), TOL_BF16);
                }
                let d2 = run()?;
                rep.same_bits(&format!("{tag} bwd"), "repeat", &d2, &d1);
            }
            be.set_attention_impl(AttentionImpl::TensorCore);
            Ok(())
        });
    }

    // ---- gelu, residual ----
    for &n in &[1usize << 20, 1001] {
        let tag = format!("gelu/residual n{n}");
        run_check(&mut rep, &tag, |rep| {
            let x = rng.vec(n, 2.0);
            let y = rng.vec(n, 2.0);
            let (gx, gy) = (up_buf(be, &x)?, up_buf(be, &y)?);
            let mut c1 = vec![0.0; n];
            cpu.gelu_fwd(&mut c1, &x, n)?;
            let mut g1 = be.alloc_buf(n, "")?;
            poison_buf(be, &mut g1, n)?;
            be.gelu_fwd(&mut g1, &gx, n)?;
            rep.cmp(&format!("gelu_fwd n{n}"), "out", &be.download_buf(&g1, Loc::all(n))?, &c1, TOL_BF16);
            cpu.gelu_bwd(&mut c1, &x, &y, n)?;
            poison_buf(be, &mut g1, n)?;
            be.gelu_bwd(&mut g1, &gx, &gy, n)?;
            rep.cmp(&format!("gelu_bwd n{n}"), "dinp", &be.download_buf(&g1, Loc::all(n))?, &c1, TOL_BF16);
            cpu.residual_fwd(&mut c1, &x, &y, n)?;
            poison_buf(be, &mut g1, n)?;
            be.residual_fwd(&mut g1, &gx, &gy, n)?;
            rep.cmp(&format!("residual_fwd n{n}"), "out", &be.download_buf(&g1, Loc::all(n))?, &c1, TOL_BF16);
            Ok(())
        });
    }

    // ---- cross-entropy ----
    for &(n, v) in &[(64usize, 50257usize), (33, 8), (16, 1024)] {
        let tag = format!("cross_entropy N{n} V{v}");
        run_check(&mut rep, &tag, |rep| {
            let logits = rng.vec(n * v, 3.0);
            let tg: Vec<u32> = (0..n).map(|_| rng.below(v as u32)).collect();
            let scale = 1.0 / n as f32;
            let (mut lc, mut ls) = (logits.clone(), vec![0.0; n]);
            cpu.cross_entropy_fwd_bwd(&mut lc, &mut ls, &tg, n, v, scale)?;
            let mut gl = up_buf(be, &logits)?;
            let mut gls = be.alloc_f32(n, "")?;
            poison_f32(be, &mut gls, n)?;
            be.cross_entropy_fwd_bwd(&mut gl, &mut gls, &up_tok(be, &tg)?, n, v, scale)?;
            rep.cmp(&tag, "losses", &be.download_f32(&gls, Loc::all(n))?, &ls, TOL_F32);
            rep.cmp(&tag, "dlogits", &be.download_buf(&gl, Loc::all(n * v))?, &lc, TOL_BF16);
            Ok(())
        });
    }

    // ---- AdamW ----
    run_check(&mut rep, "adamw", |rep| {
        let (len, poff, moff, goff) = (100_003usize, 5usize, 3usize, 7usize);
        let master = rng.vec(moff + len, 0.5);
        let m0 = rng.vec(moff + len, 0.01);
        let v0: Vec<f32> = rng.vec(moff + len, 0.01).iter().map(|x| x * x).collect();
        let g = rng.vec(goff + len, 0.1);
        let h = AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 3, grad_scale: 0.7 };
        let (mut pc, mut wc, mut mc, mut vc) = (vec![0.0; poff + len], master.clone(), m0.clone(), v0.clone());
        cpu.adamw(&mut pc, poff, &mut wc, &mut mc, &mut vc, moff, &g, goff, len, h)?;
        let mut pg = be.alloc_buf(poff + len, "")?;
        poison_buf(be, &mut pg, poff + len)?;
        let (mut wg, mut mg, mut vg, gg) =
            (up_f32(be, &master)?, up_f32(be, &m0)?, up_f32(be, &v0)?, up_grad_gpu(be, &g)?);
        be.adamw(&mut pg, poff, &mut wg, &mut mg, &mut vg, moff, &gg, goff, len, h)?;
        let r = Loc::new(moff, len);
        rep.cmp("adamw", "master", &be.download_f32(&wg, r)?, &wc[moff..], 1e-6);
        rep.cmp("adamw", "m", &be.download_f32(&mg, r)?, &mc[moff..], 1e-5);
        rep.cmp("adamw", "v", &be.download_f32(&vg, r)?, &vc[moff..], 1e-5);
        rep.cmp("adamw", "params(bf16)", &be.download_buf(&pg, Loc::new(poff, len))?, &pc[poff..], TOL_BF16);
        Ok(())
    });

    // ---- buffer utilities ----
    run_check(&mut rep, "buffers", |rep| {
        let n = 1_000_003usize;
        let x = rng.vec(n, 1.0);
        let y = rng.vec(n, 1.0);
        let (gx, gy) = (up_f32(be, &x)?, up_f32(be, &y)?);
        let mut b = be.alloc_buf(n + 9, "")?;
        poison_buf(be, &mut b, n + 9)?;
        be.cast_to_buf(&mut b, 9, &gx, Loc::new(0, n))?;
        rep.cmp("cast_to_buf", "out", &be.download_buf(&b, Loc::new(9, n))?, &x, TOL_BF16);
        let mut b2 = be.alloc_buf(n, "")?;
        be.copy_buf(&mut b2, 0, &b, Loc::new(9, n))?;
        rep.cmp("copy_buf", "out", &be.download_buf(&b2, Loc::all(n))?, &x, TOL_BF16);
        be.zero_buf(&mut b2, Loc::new(1, n - 2))?;
        let z = be.download_buf(&b2, Loc::all(n))?;
        let zero_ok = z[1..n - 1].iter().all(|&v| v == 0.0) && z[0] != 0.0;
        rep.rows.push(Row {
            op: "zero_buf".into(),
            what: "out".into(),
            max_abs: 0.0,
            rel: 0.0,
            tol: 0.0,
            ok: zero_ok,
            note: String::new(),
        });
        let mut acc = up_grad_gpu(be, &x)?;
        be.add_grad(&mut acc, 0, &gy, Loc::new(0, n))?;
        let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        rep.cmp("add_grad", "out", &be.download_grad(&acc, Loc::all(n))?, &want, 1e-7);
        let mut slots = be.alloc_f32(4, "")?;
        be.grad_sumsq_into(&gx, Loc::new(3, n - 3), &mut slots, 1)?;
        let got = F64Pair::join(&be.download_f32(&slots, Loc::new(2, 2))?);
        let want: f64 = x[3..].iter().map(|&v| v as f64 * v as f64).sum();
        rep.cmp("grad_sumsq_into", "sum", &[got as f32], &[want as f32], 1e-6);
        // sum_into accumulates: two calls give twice the sum.
        let fx = up_f32(be, &x)?;
        be.upload_f32(&[0.0, 0.0], &mut slots, 0)?;
        be.sum_into(&fx, Loc::new(3, n - 3), &mut slots, 0)?;
        be.sum_into(&fx, Loc::new(3, n - 3), &mut slots, 0)?;
        let got = F64Pair::join(&be.download_f32(&slots, Loc::new(0, 2))?);
        let want: f64 = 2.0 * x[3..].iter().map(|&v| v as f64).sum::<f64>();
        rep.cmp("sum_into", "sum", &[got as f32], &[want as f32], 1e-6);
        Ok(())
    });
    rep
}

/// One GPT training step end to end through the real engine and model code: a small
/// GPT-2 (head size 64: the tensor-core attention; an odd vocabulary: the staged head)
/// on the CUDA backend with a one-rank NCCL communicator, ZeRO stages 0 and 3, against
/// the CPU backend: loss, every unit's gradient, and the parameters after one AdamW step.
fn check_model(be: &CudaBackend, rng: &mut Rng, rep: &mut Report) -> Result<(), String> {
    use trainer::backend::cpu::HostComm;
    use trainer::config::{ActivationCheckpointing, ModelConfig};
    use trainer::model::{Gpt, ModelLayout};
    use trainer::zero::engine::StepHyper;
    use trainer::zero::Engine;
    let cfg = ModelConfig { n_layer: 2, n_head: 2, n_embd: 128, vocab_size: 1001, seq_len: 256 };
    let (b, seed) = (4usize, 11u64);
    let n = b * cfg.seq_len;
    let layout = ModelLayout::new(&cfg);
    let inputs: Vec<u32> = (0..n).map(|_| rng.below(cfg.vocab_size as u32)).collect();
    let targets: Vec<u32> = (0..n).map(|_| rng.below(cfg.vocab_size as u32)).collect();
    let h = StepHyper { lr: 1e-3, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, grad_clip: 1.0 };
    let scale = Some(1.0 / n as f32);

    let cpu = CpuBackend;
    let mut ccomm = HostComm(collectives::tcp::TcpComm::local_group(1).map_err(s)?.remove(0));
    let mut ceng = Engine::new(&cpu, layout.clone(), 0, 0, 1, seed).map_err(s)?;
    let mut cm = Gpt::new(&cpu, &layout, b, ActivationCheckpointing::None, &mut ceng.ledger).map_err(s)?;
    ceng.begin_step(&cpu).map_err(s)?;
    let closs = cm.step_micro_loss(&cpu, &mut ceng, &mut ccomm, &inputs, &targets, scale).map_err(s)?;
    let cgrads: Vec<Vec<f32>> =
        (0..ceng.num_units()).map(|u| ceng.local_grads_host(&cpu, u)).collect::<Result<_, _>>().map_err(s)?;
    ceng.step(&cpu, &mut ccomm, h, 1).map_err(s)?;
    let cparams: Vec<Vec<f32>> = (0..ceng.num_units())
        .map(|u| ceng.full_params_host(&cpu, &mut ccomm, u))
        .collect::<Result<_, _>>()
        .map_err(s)?;

    let id = nccl_unique_id().map_err(s)?;
    let mut gcomm = NcclComm::new(be.stream().clone(), 0, 1, &id).map_err(s)?;
    for stage in [0u8, 3] {
        let tag = format!("model step (GPT L2 C128 V1001 T256 B4) stage {stage}");
        let mut geng = Engine::new(be, layout.clone(), stage, 0, 1, seed).map_err(s)?;
        let mut gm = Gpt::new(be, &layout, b, ActivationCheckpointing::None, &mut geng.ledger).map_err(s)?;
        geng.begin_step(be).map_err(s)?;
        let gloss = gm.step_micro_loss(be, &mut geng, &mut gcomm, &inputs, &targets, scale).map_err(s)?;
        rep.cmp(&tag, "loss", &[gloss as f32], &[closs as f32], 5e-3);
        if stage == 0 {
            for (u, cg) in cgrads.iter().enumerate() {
                let gg = geng.local_grads_host(be, u).map_err(s)?;
                rep.cmp(&tag, &format!("grad unit {u}"), &gg, cg, 3e-2);
            }
        }
        geng.step(be, &mut gcomm, h, 1).map_err(s)?;
        for (u, cp) in cparams.iter().enumerate() {
            let gp = geng.full_params_host(be, &mut gcomm, u).map_err(s)?;
            rep.cmp(&tag, &format!("params unit {u}"), &gp, cp, TOL_BF16);
        }
    }
    Ok(())
}

// ------------------------------------------------------------------ timing

struct Timer<'a> {
    be: &'a CudaBackend,
    rows: Vec<(String, f64, String)>,
}

impl Timer<'_> {
    /// Median over `reps` event-timed calls of `f`, after `warm` untimed ones.
    fn time(
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

fn tflops(flop: f64) -> impl Fn(f64) -> String {
    move |ms| format!("{:>7.1} TFLOP/s", flop / (ms * 1e-3) / 1e12)
}
fn gbps(bytes: f64) -> impl Fn(f64) -> String {
    move |ms| format!("{:>7.0} GB/s", bytes / (ms * 1e-3) / 1e9)
}

/// Fill a buffer with random (non-zero) bf16 data: one random chunk, tiled.
fn fill_buf(be: &CudaBackend, buf: &mut CudaSlice<bf16>, chunk: &[f32]) -> BResult<()> {
    let n = buf.len();
    let mut off = 0;
    while off < n {
        let k = chunk.len().min(n - off);
        be.upload_buf(&chunk[..k], buf, off)?;
        off += k;
    }
    Ok(())
}
fn fill_f32(be: &CudaBackend, buf: &mut CudaSlice<f32>, chunk: &[f32]) -> BResult<()> {
    let n = buf.len();
    let mut off = 0;
    while off < n {
        let k = chunk.len().min(n - off);
        be.upload_f32(&chunk[..k], buf, off)?;
        off += k;
    }
    Ok(())
}

fn timing(be: &CudaBackend, rng: &mut Rng) -> BResult<()> {
    // GPT-2 124M by default; GPU_CHECK_SHAPE="B,T,C,NH,V" times another model (e.g. 1.5B: 8,1024,1600,25,50304).
    let shape: Vec<usize> = std::env::var("GPU_CHECK_SHAPE")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| v.len() == 5)
        .unwrap_or_else(|| vec![16, 1024, 768, 12, 50257]);
    let (b, t, c, nh, v) = (shape[0], shape[1], shape[2], shape[3], shape[4]);
    let layers: usize = std::env::var("GPU_CHECK_LAYERS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    let n = b * t;
    let s = AttnShape { b, t, c, nh };
    println!("\nTiming at shapes B={b} T={t} C={c} NH={nh} V={v} (median of event-timed repeats)");
    let chunk = rng.vec(1 << 22, 1.0);
    let small = rng.vec(1 << 22, 0.02);
    let newbuf = |len: usize, ch: &[f32]| -> BResult<CudaSlice<bf16>> {
        let mut x = be.alloc_buf(len, "timing")?;
        fill_buf(be, &mut x, ch)?;
        Ok(x)
    };
    let x = newbuf(n * c, &chunk)?;
    let mut y = newbuf(n * c, &chunk)?;
    let x4 = newbuf(n * 4 * c, &chunk)?;
    let mut y4 = newbuf(n * 4 * c, &chunk)?;
    let qkv = newbuf(n * 3 * c, &chunk)?;
    let mut dqkv = newbuf(n * 3 * c, &chunk)?;
    // One block's parameters, and the embedding unit (wte, wpe, ln_f).
    let bp_len = 12 * c * c + 13 * c;
    let bparams = newbuf(bp_len, &small)?;
    let eparams = newbuf(v * c + t * c + 2 * c, &small)?;
    let mut bgrads = be.alloc_grad(bp_len, "timing")?;
    let mut egrads = be.alloc_grad(v * c + t * c + 2 * c, "timing")?;
    let mut mean = be.alloc_f32(n, "")?;
    let mut rstd = be.alloc_f32(n, "")?;
    fill_f32(be, &mut mean, &chunk[..n])?;
    let ones: Vec<f32> = vec![1.0; n];
    be.upload_f32(&ones, &mut rstd, 0)?;
    let toks: Vec<u32> = (0..n).map(|_| rng.below(v as u32)).collect();
    let gtok = up_tok(be, &toks)?;
    let mut tm = Timer { be, rows: Vec::new() };
    let bc2 = (n * c * 2) as f64;

    tm.time("encoder_fwd", 3, 20, gbps(2.0 * bc2), || {
        be.encoder_fwd(&mut y, &gtok, &eparams, Loc::new(0, v * c), Loc::new(v * c, t * c), b, t, c)
    });
    tm.time("encoder_bwd (incl. host grouping)", 2, 10, gbps(bc2 + (n * c * 8) as f64), || {
        be.encoder_bwd(&mut egrads, Loc::new(0, v * c), Loc::new(v * c, t * c), &x, &gtok, b, t, c)
    });
    let (lw, lb) = (Loc::new(0, c), Loc::new(c, c));
    tm.time("layernorm_fwd", 3, 20, gbps(2.0 * bc2), || {
        be.layernorm_fwd(&mut y, &mut mean, &mut rstd, &x, &bparams, lw, lb, n, c)
    });
    let mut dres = newbuf(n * c, &chunk)?;
    tm.time("layernorm_bwd", 3, 20, gbps(4.0 * bc2), || {
        be.layernorm_bwd(&mut dres, &mut bgrads, lw, lb, &y, &x, &bparams, lw, &mean, &rstd, n, c)
    });
    let mut total_fwd = 0.0;
    let mut total_bwd = 0.0;
    for (name, cin, cout) in [("qkv", c, 3 * c), ("attn proj", c, c), ("fc", c, 4 * c), ("fc2", 4 * c, c)] {
        let w = Loc::new(2 * c, cout * cin);
        let bias = Some(Loc::new(2 * c + cout * cin, cout));
        let flop = 2.0 * (n * cin * cout) as f64;
        let (inp, out): (&CudaSlice<bf16>, &mut CudaSlice<bf16>) = match name {
            "qkv" => (&x, &mut dqkv),
            "fc" => (&x, &mut y4),
            "fc2" => (&x4, &mut y),
            _ => (&x, &mut y),
        };
        tm.time(&format!("matmul_fwd {name} ({cin}->{cout})"), 3, 20, tflops(flop), || {
            be.matmul_fwd(out, inp, &bparams, w, bias, n, cin, cout)
        });
        total_fwd += tm.rows.last().map_or(0.0, |r| r.1);
        let dout: &CudaSlice<bf16> = match name {
            "qkv" => &qkv,
            "fc" => &x4,
            _ => &x,
        };
        let mut dinp = newbuf(n * cin, &chunk)?;
        tm.time(&format!("matmul_bwd {name} ({cin}->{cout})"), 3, 20, tflops(2.0 * flop), || {
            be.matmul_bwd(&mut dinp, &mut bgrads, w, bias, dout, inp, &bparams, w, n, cin, cout)
        });
        total_bwd += tm.rows.last().map_or(0.0, |r| r.1);
    }
    // The MLP with GELU fused into the GEMMs (compare with matmul fc + gelu_fwd, fc2 + gelu_bwd).
    {
        let (w, bias) = (Loc::new(2 * c, 4 * c * c), Loc::new(2 * c + 4 * c * c, 4 * c));
        let flop = 2.0 * (n * c * 4 * c) as f64;
        let mut pre = newbuf(n * 4 * c, &chunk)?;
        tm.time("matmul_gelu_fwd fc (fused epilogue)", 3, 20, tflops(flop), || {
            be.matmul_gelu_fwd(&mut pre, &mut y4, &x, &bparams, w, bias, n, c, 4 * c)
        });
        let (w2, b2) = (Loc::new(2 * c, 4 * c * c), Loc::new(2 * c + 4 * c * c, c));
        let mut dpre = newbuf(n * 4 * c, &chunk)?;
        tm.time("matmul_bwd_dgelu fc2 (fused epilogue)", 3, 20, tflops(2.0 * flop), || {
            be.matmul_bwd_dgelu(&mut dpre, &mut bgrads, w2, b2, &x, &mut y4, &pre, &bparams, w2, n, 4 * c, c)
        });
    }
    let mut att = newbuf(n * c, &chunk)?;
    let mut saved = be.alloc_f32(be.attention_saved_len(s), "")?;
    // Causal: half of the T x T products. fwd: QK^T and PV; bwd: 5 products (+2 recomputed).
    let att_flop = 2.0 * 2.0 * (b * nh * t * t * (c / nh)) as f64 / 2.0;
    be.set_attention_impl(AttentionImpl::Simt);
    tm.time("attention_fwd (SIMT fp32)", 2, 10, tflops(att_flop), || be.attention_fwd(&mut att, &mut saved, &qkv, s));
    tm.time("attention_bwd (SIMT fp32)", 2, 10, tflops(2.5 * att_flop), || {
        be.attention_bwd(&mut dqkv, &x, &qkv, &att, &saved, s)
    });
    be.set_attention_impl(AttentionImpl::TensorCore);
    tm.time("attention_fwd (tensor cores)", 3, 20, tflops(att_flop), || {
        be.attention_fwd(&mut att, &mut saved, &qkv, s)
    });
    let t_att_f = tm.rows.last().map_or(0.0, |r| r.1);
    tm.time("attention_bwd (tensor cores)", 3, 20, tflops(2.5 * att_flop), || {
        be.attention_bwd(&mut dqkv, &x, &qkv, &att, &saved, s)
    });
    let t_att_b = tm.rows.last().map_or(0.0, |r| r.1);
    tm.time("gelu_fwd", 3, 20, gbps(8.0 * bc2 / 2.0 * 2.0), || be.gelu_fwd(&mut y4, &x4, n * 4 * c));
    let t_gf = tm.rows.last().map_or(0.0, |r| r.1);
    let x4b = newbuf(n * 4 * c, &chunk)?;
    tm.time("gelu_bwd", 3, 20, gbps(12.0 * bc2), || be.gelu_bwd(&mut y4, &x4, &x4b, n * 4 * c));
    let t_gb = tm.rows.last().map_or(0.0, |r| r.1);
    tm.time("residual_fwd", 3, 20, gbps(3.0 * bc2), || be.residual_fwd(&mut y, &x, &dres, n * c));
    let t_res = tm.rows.last().map_or(0.0, |r| r.1);
    let t_lnf = tm.rows.iter().find(|r| r.0 == "layernorm_fwd").map_or(0.0, |r| r.1);
    let t_lnb = tm.rows.iter().find(|r| r.0 == "layernorm_bwd").map_or(0.0, |r| r.1);
    drop((x4b, y4, att));
    // LM head (tied wte) and the loss.
    let mut logits = newbuf(n * v, &chunk)?;
    let wte = Loc::new(0, v * c);
    let head_flop = 2.0 * (n * c * v) as f64;
    tm.time("matmul_fwd lm head (768->50257)", 2, 10, tflops(head_flop), || {
        be.matmul_fwd(&mut logits, &x, &eparams, wte, None, n, c, v)
    });
    let t_hf = tm.rows.last().map_or(0.0, |r| r.1);
    let mut losses = be.alloc_f32(n, "")?;
    let gt = up_tok(be, &toks)?;
    tm.time("cross_entropy_fwd_bwd", 2, 10, gbps(2.0 * 2.0 * (n * v) as f64 + 2.0 * (n * v) as f64), || {
        be.cross_entropy_fwd_bwd(&mut logits, &mut losses, &gt, n, v, 1.0 / n as f32)
    });
    let t_ce = tm.rows.last().map_or(0.0, |r| r.1);
    let mut dln = newbuf(n * c, &chunk)?;
    tm.time("matmul_bwd lm head (768->50257)", 2, 10, tflops(2.0 * head_flop), || {
        be.matmul_bwd(&mut dln, &mut egrads, wte, None, &logits, &x, &eparams, wte, n, c, v)
    });
    let t_hb = tm.rows.last().map_or(0.0, |r| r.1);
    drop(logits);
    // The same head with the vocabulary padded to a multiple of 64 (as llm.c does): is
    // the odd leading dimension costing anything?
    let vp = v.div_ceil(64) * 64;
    let mut logits_p = newbuf(n * vp, &chunk)?;
    let eparams_p = newbuf(vp * c, &small)?;
    tm.time(&format!("matmul_fwd lm head padded (768->{vp})"), 2, 10, tflops(2.0 * (n * c * vp) as f64), || {
        be.matmul_fwd(&mut logits_p, &x, &eparams_p, Loc::new(0, vp * c), None, n, c, vp)
    });
    drop((logits_p, eparams_p));
    // Optimizer over all 124M parameters in one segment.
    // Parameters of the timed model (GPT-2 layout, vocab v, context t, `layers` blocks).
    let np = v * c + t * c + 2 * c + layers * (12 * c * c + 13 * c);
    let mut p = be.alloc_buf(np, "")?;
    let mut w = be.alloc_f32(np, "")?;
    let mut m = be.alloc_f32(np, "")?;
    let mut vv = be.alloc_f32(np, "")?;
    let mut g = be.alloc_grad(np, "")?;
    fill_f32(be, &mut w, &small)?;
    fill_f32(be, &mut g, &small)?;
    let h = AdamWStep { lr: 6e-4, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 10, grad_scale: 1.0 };
    tm.time("adamw (124M params)", 3, 20, gbps((np * (4 * 7 + 2)) as f64), || {
        be.adamw(&mut p, 0, &mut w, &mut m, &mut vv, 0, &g, 0, np, h)
    });
    let t_adam = tm.rows.last().map_or(0.0, |r| r.1);
    let mut slots = be.alloc_f32(2, "")?;
    tm.time("grad_sumsq_into (124M)", 3, 20, gbps((np * 4) as f64), || {
        be.grad_sumsq_into(&g, Loc::all(np), &mut slots, 0)
    });
    let t_norm = tm.rows.last().map_or(0.0, |r| r.1);
    tm.time("cast_to_buf (124M)", 3, 20, gbps((np * 6) as f64), || be.cast_to_buf(&mut p, 0, &w, Loc::all(np)));
    tm.time("add_grad (124M)", 3, 20, gbps((np * 12) as f64), || be.add_grad(&mut g, 0, &w, Loc::all(np)));

    // Estimated step (no communication): blocks as the model runs them (GELU fused into the
    // fc forward and the fc2 backward; GELU recomputed in backward) + head + optimizer.
    let row = |name: &str| tm.rows.iter().find(|r| r.0.starts_with(name)).map_or(0.0, |r| r.1);
    let (fc_f, fused_f) = (row("matmul_fwd fc ("), row("matmul_gelu_fwd"));
    let (fc2_b, fused_b) = (row("matmul_bwd fc2"), row("matmul_bwd_dgelu"));
    let _ = t_gb;
    let t_block_f = 2.0 * t_lnf + total_fwd - fc_f + fused_f + t_att_f + 2.0 * t_res;
    let t_block_b = 2.0 * t_lnb + total_bwd - fc2_b + fused_b + t_gf + t_att_b;
    let step = layers as f64 * (t_block_f + t_block_b) + t_lnf + t_lnb + t_hf + t_ce + t_hb + t_adam + t_norm;
    println!("\nEstimate from the table (one GPU, sum of op medians, no launch gaps): block fwd {t_block_f:.2} ms, block bwd {t_block_b:.2} ms,");
    println!(
        "step ({layers} layers, B={b}, T={t}, fwd+bwd+AdamW) {step:.1} ms = {:.0} tokens/s; attention is {:.0}% of it.",
        n as f64 / (step * 1e-3),
        100.0 * layers as f64 * (t_att_f + t_att_b) / step
    );
    Ok(())
}

// ------------------------------------------------------------------ NCCL

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len() / 2).map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()).collect()
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
    let wf = world as f32;
    // Small integers: exact in bf16 and in any summation order.
    let val = |r: usize, i: usize| ((r * 7 + i) % 61) as f32;

    for &n in &[1000usize, 13, 1] {
        rep.check(
            &format!("all_gather bf16, {n} per rank"),
            (|| {
                let send: Vec<f32> = (0..n).map(|i| val(rank, i)).collect();
                let sb = up_buf(&be, &send).map_err(s)?;
                let mut rb = be.alloc_buf(n * world, "").map_err(s)?;
                poison_buf(&be, &mut rb, n * world).map_err(s)?;
                Communicator::<CudaSlice<bf16>>::all_gather(&mut comm, &sb, &mut rb).map_err(s)?;
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
                let sb = up_f32(&be, &send).map_err(s)?;
                let mut rb = be.alloc_grad(n * world, "").map_err(s)?;
                Communicator::<CudaSlice<f32>>::all_gather(&mut comm, &sb, &mut rb).map_err(s)?;
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
                    let sb = up_f32(&be, &send).map_err(s)?;
                    let mut rb = be.alloc_grad(n, "").map_err(s)?;
                    Communicator::<CudaSlice<f32>>::reduce_scatter(&mut comm, &sb, &mut rb, op).map_err(s)?;
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
            let sb = up_buf(&be, &send).map_err(s)?;
            let mut rb = be.alloc_buf(n, "").map_err(s)?;
            Communicator::<CudaSlice<bf16>>::reduce_scatter(&mut comm, &sb, &mut rb, ReduceOp::Sum).map_err(s)?;
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
                let mut b = up_f32(&be, &send).map_err(s)?;
                Communicator::<CudaSlice<f32>>::all_reduce(&mut comm, &mut b, op).map_err(s)?;
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
                let mut b = up_f32(&be, &mine).map_err(s)?;
                Communicator::<CudaSlice<f32>>::broadcast(&mut comm, &mut b, root).map_err(s)?;
                let mut h = up_buf(&be, &mine).map_err(s)?;
                Communicator::<CudaSlice<bf16>>::broadcast(&mut comm, &mut h, root).map_err(s)?;
                let g1 = be.download_f32(&b, Loc::all(n)).map_err(s)?;
                let g2 = be.download_buf(&h, Loc::all(n)).map_err(s)?;
                Ok((0..n).all(|i| g1[i] == val(root, i) && g2[i] == val(root, i)))
            })(),
        );
    }
    // Host scalars, as the engine uses them (all_reduce_f64's two words, losses).
    rep.check(
        "host [f32] all_reduce / all_gather / reduce_scatter / broadcast",
        (|| {
            let x = 1.0 + rank as f64 * 1e-9;
            let got = trainer::zero::engine::all_reduce_f64(&mut comm, x).map_err(s)?;
            let want: f64 = (0..world).map(|r| 1.0 + r as f64 * 1e-9).sum();
            let ok1 = (got - want).abs() < 1e-12;
            let send = [rank as f32, 10.0 + rank as f32, 0.5];
            let mut recv = vec![0.0f32; 3 * world];
            Communicator::<[f32]>::all_gather(&mut comm, &send, &mut recv).map_err(s)?;
            let ok2 = (0..world).all(|r| recv[3 * r..3 * r + 3] == [r as f32, 10.0 + r as f32, 0.5]);
            let send: Vec<f32> = (0..2 * world).map(|j| (rank * 100 + j) as f32).collect();
            let mut recv = [0.0f32; 2];
            Communicator::<[f32]>::reduce_scatter(&mut comm, &send, &mut recv, ReduceOp::Sum).map_err(s)?;
            let ok3 = (0..2).all(|i| recv[i] == (0..world).map(|r| (r * 100 + rank * 2 + i) as f32).sum::<f32>());
            let mut b = [rank as f32 + 3.0; 5];
            Communicator::<[f32]>::broadcast(&mut comm, &mut b, world - 1).map_err(s)?;
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
            let e1 = Communicator::<CudaSlice<bf16>>::all_gather(&mut comm, &sb, &mut rb);
            let mut small = be.alloc_grad(3, "").map_err(s)?;
            let big = be.alloc_grad(3 * world + 2, "").map_err(s)?;
            let e2 = Communicator::<CudaSlice<f32>>::reduce_scatter(&mut comm, &big, &mut small, ReduceOp::Sum);
            let mut h = [0.0f32; 2];
            let e3 = Communicator::<[f32]>::broadcast(&mut comm, &mut h[..], world);
            Ok([e1, e2, e3].iter().all(|e| matches!(e, Err(CommError::BadSize { .. }))))
        })(),
    );
    // Bandwidth at GPT-2 124M sizes: one block unit (7.09M parameters) per collective.
    let bench = (|| -> Result<String, String> {
        let unit = 7_087_872usize.div_ceil(8 * world) * 8 * world;
        let shard = unit / world;
        let ps = up_buf(&be, &vec![1.0; shard]).map_err(s)?;
        let mut pf = be.alloc_buf(unit, "").map_err(s)?;
        let gf = up_f32(&be, &vec![1.0; unit]).map_err(s)?;
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
                    Communicator::<CudaSlice<bf16>>::all_gather(&mut comm, &ps, &mut pf).map_err(s)?;
                } else {
                    Communicator::<CudaSlice<f32>>::reduce_scatter(&mut comm, &gf, &mut gs, ReduceOp::Sum)
                        .map_err(s)?;
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
    })();
    match bench {
        Ok(t) => print!("{t}"),
        Err(e) => println!("rank {rank}: bandwidth run failed: {e}"),
    }
    comm.barrier().map_err(s)?;
    Ok(rep.failed)
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
    let world = args.get(2).and_then(|w| w.parse().ok()).unwrap_or(devices);
    if world < 2 || world > devices {
        println!("nccl: need a world of at least 2 and at most the {devices} visible GPU(s); got {world}");
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
            .args(["nccl-rank", &world.to_string(), &r.to_string(), &hex(&id)])
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
        println!("usage: gpu-check nccl-rank WORLD RANK ID_HEX");
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
    let mode = args.get(1).map(String::as_str).unwrap_or("kernels");
    match mode {
        "nccl" => return nccl_main(&args),
        "nccl-rank" => return nccl_rank_main(&args),
        "kernels" | "kernels-small" | "timing" | "all" => {}
        _ => {
            println!("usage: gpu-check [kernels|kernels-small|timing|all|nccl [WORLD]]");
            return ExitCode::FAILURE;
        }
    }
    let seed = std::env::var("GPU_CHECK_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let mut rng = Rng(seed);
    let t0 = Instant::now();
    let be = match CudaBackend::new_lenient(0) {
        Ok(b) => b,
        Err(e) => {
            println!("CUDA backend unavailable: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "gpu-check on {} ({} SMs), seed {seed}; backend ready in {:.2} s",
        be.name(),
        be.sm_count(),
        t0.elapsed().as_secs_f64()
    );
    let mut failed = 0;
    if mode != "timing" {
        let mut rep = check_kernels(&be, &mut rng, mode == "kernels-small");
        let t1 = Instant::now();
        if let Err(e) = check_model(&be, &mut rng, &mut rep) {
            rep.error("model step", e);
        }
        eprintln!("  checked the model step in {:.1} s", t1.elapsed().as_secs_f64());
        rep.print();
        failed += rep.failed();
        println!(
            "\nkernel checks: {}",
            if rep.failed() == 0 { "all passed".to_string() } else { format!("{} failure(s)", rep.failed()) }
        );
    }
    if mode == "timing" || mode == "all" || args.len() == 1 {
        if let Err(e) = timing(&be, &mut rng) {
            println!("timing failed: {e}");
            failed += 1;
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
