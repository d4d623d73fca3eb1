//! Every op of the CUDA backend against the CPU reference, a test per op group (and per
//! Llama op: `rmsnorm`, `swiglu`, `rope`, `encoder_without_positions`,
//! `cross_entropy_chunk`; document-aware attention: `attention_documents`, `rope` and
//! `encoder_documents` within documents), on fresh random inputs (outputs poisoned with NaN first, so an
//! element the GPU never writes fails; parameter gradients both added to and written over
//! NaN), forward and backward, at GPT-2 and Llama shapes and at odd ones; bit-for-bit
//! repeat checks of the backward ops. (One training step of a small GPT through the real
//! engine and model on both backends: tests/gpu_model.rs.)
//!
//! Ignored without `--include-ignored` (no GPU in CI): `scripts/gpu-test.sh` runs them on
//! a GPU machine. Both backends see the same bf16-rounded inputs, so the differences are
//! the GPU's own (bf16 outputs, summation order).

mod gpu;

use gpu::{backend, poisoned_buf, poisoned_f32, small, up_buf, up_f32, up_grad, up_tok, NEEDS_GPU, TOL_BF16, TOL_F32};
use half::bf16;
use trainer::backend::cpu::CpuBackend;
use trainer::backend::cuda::{AttentionImpl, CudaBackend, DeviceTokens};
use trainer::backend::*;

#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn kernels_build() {
    let be = backend();
    let failed = be.kernel_failures();
    assert!(failed.is_empty(), "{NEEDS_GPU}; kernels failed to build:\n{}", failed.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn encoder() {
    gpu::check(|be, rng, rep| encoder_cases(be, rng, rep, true, false));
}

/// The embedding with no position table (`EmbedLocs { wpe: None }`: Llama's, RoPE rotates
/// queries and keys instead): the token rows alone, forward and backward.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn encoder_without_positions() {
    gpu::check(|be, rng, rep| encoder_cases(be, rng, rep, false, false));
}

/// GPT-2's learned positions within documents (`EmbedInputs::docs`, `data.document_mask`):
/// random packed documents against the CPU, forward and backward (the position table's
/// gradient grouped by position at upload); and starts all 0 give the plain op's bits.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn encoder_documents() {
    gpu::check(|be, rng, rep| encoder_cases(be, rng, rep, true, true));
}

/// The embedding against the CPU, with the position table (GPT-2) or without, positions
/// within random documents or not; forward (written over NaN), backward added to random
/// gradients or written over NaN (fresh).
fn encoder_cases(
    be: &CudaBackend,
    rng: &mut gpu::Rng,
    rep: &mut gpu::Report,
    positions: bool,
    documents: bool,
) -> BResult<()> {
    let cpu = CpuBackend::new();
    // GPT-2-like, odd (C % 8 != 0: the one-element path), and a Llama width.
    for &(b, t, c, v) in &[(4usize, 64usize, 768usize, 300usize), (3, 17, 36, 7), (2, 33, 2048, 500)] {
        let tag = format!(
            "encoder{}{} B{b} T{t} C{c} V{v}",
            if positions { "" } else { " (no wpe)" },
            if documents { " within documents" } else { "" }
        );
        let (n, s) = (b * t, SeqShape { b, t, c });
        let wpe_len = if positions { t * c } else { 0 };
        let at = EmbedLocs { wte: Loc::new(0, v * c), wpe: positions.then(|| Loc::new(v * c, t * c)) };
        let params = rng.vec(v * c + wpe_len, 0.5);
        let toks = rng.below(n, v as u32);
        // Documents of 1 to T/2 tokens, some crossing into the next sequence.
        let lengths: Vec<usize> = rng.below(n, (t / 2) as u32).into_iter().map(|l| l as usize + 1).collect();
        let docs = documents.then(|| doc_starts(&lengths, t, n));
        let gdocs = match &docs {
            Some(d) => {
                let mut g = be.alloc_tokens(n, TokenRole::DocStarts { seq_len: t })?;
                be.upload_tokens(d, &mut g)?;
                Some(g)
            }
            None => None,
        };
        let mut out_c = cpu.alloc_buf(n * c, "")?;
        cpu.encoder_fwd(&mut out_c, EmbedInputs { tokens: &toks, docs: docs.as_ref() }, Weights::new(&params, at), s)?;
        let (gp, gt) = (up_buf(be, &params)?, up_tok(be, &toks)?);
        let gx = EmbedInputs { tokens: &gt, docs: gdocs.as_ref() };
        let mut out_g = poisoned_buf(be, n * c)?;
        be.encoder_fwd(&mut out_g, gx, Weights::new(&gp, at), s)?;
        rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&out_g, Loc::all(n * c))?, &out_c, TOL_BF16);
        // backward: += into random gradients, or written over NaN (fresh)
        let dout = rng.vec(n * c, 1.0);
        let dg = up_buf(be, &dout)?;
        for fresh in [false, true] {
            let tag = format!("{tag} bwd{}", if fresh { " fresh" } else { "" });
            let g0 = rng.vec(v * c + wpe_len, 0.1);
            let mut gc = g0.clone();
            let cx = EmbedInputs { tokens: &toks, docs: docs.as_ref() };
            cpu.encoder_bwd(WeightGrads { buf: &mut gc, at, fresh }, &dout, cx, s)?;
            let gpu0 = if fresh { vec![f32::NAN; g0.len()] } else { g0 };
            let run = |x: EmbedInputs<'_, CudaBackend>| -> BResult<Vec<f32>> {
                let mut gg = up_grad(be, &gpu0)?;
                be.encoder_bwd(WeightGrads { buf: &mut gg, at, fresh }, &dg, x, s)?;
                be.download_grad(&gg, Loc::all(gpu0.len()))
            };
            let got = run(gx)?;
            rep.cmp(&tag, "dwte", &got[..v * c], &gc[..v * c], TOL_F32);
            if positions {
                rep.cmp(&tag, "dwpe", &got[v * c..], &gc[v * c..], TOL_F32);
            }
            rep.same_bits(&tag, "repeat", &run(gx)?, &got);
            if documents {
                // Starts all 0 (one document per sequence) take the grouped path: the plain bits.
                let mut zeros = be.alloc_tokens(n, TokenRole::DocStarts { seq_len: t })?;
                be.upload_tokens(&vec![0; n], &mut zeros)?;
                let plain = run(EmbedInputs { tokens: &gt, docs: None })?;
                rep.same_bits(
                    &tag,
                    "starts all 0 vs no documents",
                    &run(EmbedInputs { tokens: &gt, docs: Some(&zeros) })?,
                    &plain,
                );
            }
        }
        if documents {
            let mut zeros = be.alloc_tokens(n, TokenRole::DocStarts { seq_len: t })?;
            be.upload_tokens(&vec![0; n], &mut zeros)?;
            let fwd = |docs: Option<&DeviceTokens>| -> BResult<Vec<f32>> {
                let mut out = poisoned_buf(be, n * c)?;
                be.encoder_fwd(&mut out, EmbedInputs { tokens: &gt, docs }, Weights::new(&gp, at), s)?;
                be.download_buf(&out, Loc::all(n * c))
            };
            rep.same_bits(&format!("{tag} fwd"), "starts all 0 vs no documents", &fwd(Some(&zeros))?, &fwd(None)?);
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn layernorm() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
        // Every backward path at two parameter offsets: 5 (unaligned weights: the general
        // kernel) and 8 (16-byte aligned: the fast kernel, every instance — J = 1 with 1..4
        // warps up to C = 1024, J = 2 with 4, 8, 12, 16 warps up to 8192 — with ragged last
        // chunks (1600), blocks of 8 and 32 rows (N = 9000) and a ragged last block of an odd
        // row count, which the fast kernel's row pairs end with a single row); and
        // C % 8 != 0 (100), which only the general kernel takes.
        let shapes = [
            (256usize, 768usize),
            (37, 100),
            (33, 64),
            (70, 512),
            (40, 1024),
            (41, 1280),
            (300, 1536),
            (77, 1600),
            (50, 2048),
            (21, 2560),
            (45, 3072),
            (64, 4096),
            (13, 5120),
            (11, 6144),
            (9, 7168),
            (19, 8192),
            (9000, 64),
        ];
        for (&(n, c), off) in shapes.iter().flat_map(|s| [(s, 5usize), (s, 8)]) {
            let tag = format!("layernorm N{n} C{c} offset {off}");
            let at = NormLocs { w: Loc::new(off, c), b: Loc::new(off + c, c) };
            let r = Rows { n, c };
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
            cpu.layernorm_fwd(
                &mut oc,
                LnStats { mean: &mut mc, rstd: &mut rc },
                &inp,
                Weights::new(&params, at),
                r,
                None,
            )?;
            let (gp, gi) = (up_buf(be, &params)?, up_buf(be, &inp)?);
            let mut og = poisoned_buf(be, n * c)?;
            let (mut mg, mut rg) = (poisoned_f32(be, n)?, poisoned_f32(be, n)?);
            be.layernorm_fwd(&mut og, LnStats { mean: &mut mg, rstd: &mut rg }, &gi, Weights::new(&gp, at), r, None)?;
            rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&og, Loc::all(n * c))?, &oc, TOL_BF16);
            rep.cmp(&format!("{tag} fwd"), "mean", &be.download_f32(&mg, Loc::all(n))?, &mc, TOL_F32);
            rep.cmp(&format!("{tag} fwd"), "rstd", &be.download_f32(&rg, Loc::all(n))?, &rc, TOL_F32);
            // backward: dinp +=, dw +=, db += (or dw, db written over NaN: fresh); both use
            // the CPU's statistics
            let dout = rng.vec(n * c, 1.0);
            let dinp0 = rng.vec(n * c, 0.5);
            let (gdo, gm, gr) = (up_buf(be, &dout)?, up_f32(be, &mc)?, up_f32(be, &rc)?);
            for fresh in [false, true] {
                let tag = format!("{tag} bwd{}", if fresh { " fresh" } else { "" });
                let g0 = rng.vec(off + 2 * c, 0.1);
                let (mut dic, mut gc) = (dinp0.clone(), g0.clone());
                let saved = LnSaved { inp: &inp, mean: &mc, rstd: &rc };
                let wg = WeightGrads { buf: &mut gc, at, fresh };
                cpu.layernorm_bwd(&mut dic, wg, &dout, saved, Weights::new(&params, at), r, None)?;
                let gpu0 = if fresh { vec![f32::NAN; g0.len()] } else { g0 };
                let run = || -> BResult<(Vec<f32>, Vec<f32>)> {
                    let mut dig = up_buf(be, &dinp0)?;
                    let mut gg = up_grad(be, &gpu0)?;
                    let saved = LnSaved { inp: &gi, mean: &gm, rstd: &gr };
                    let wg = WeightGrads { buf: &mut gg, at, fresh };
                    be.layernorm_bwd(&mut dig, wg, &gdo, saved, Weights::new(&gp, at), r, None)?;
                    Ok((be.download_buf(&dig, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(gpu0.len()))?))
                };
                let (di1, g1) = run()?;
                rep.cmp(&tag, "dinp", &di1, &dic, TOL_BF16);
                rep.cmp(&tag, "dw", &g1[off..off + c], &gc[off..off + c], TOL_F32);
                rep.cmp(&tag, "db", &g1[off + c..], &gc[off + c..], TOL_F32);
                let (di2, g2) = run()?;
                rep.same_bits(&tag, "repeat", &[di2, g2].concat(), &[di1, g1].concat());
            }
        }
        Ok(())
    });
}

/// RMSNorm forward and backward against the CPU: Llama's widths (2048, 3072, 4096, 8192)
/// and an odd one (777: C % 8 != 0, only the general kernels), every instance of the fast
/// forward (registers: 64 .. 12288 columns, ragged last chunks at 1600, 5120, 12288) and of
/// the fast backward (LayerNorm's template: up to 8192; 12288 the general one), each at
/// parameter offsets 5 (unaligned weight: the general kernels) and 8 (aligned); ragged row
/// counts (a last block of one row: 2001; odd pair ends: 77) and blocks of 8 and 32 rows.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn rmsnorm() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
        let eps = 1e-5f32;
        let shapes = [
            (256usize, 2048usize),
            (77, 2048),
            (2001, 2048),
            (45, 3072),
            (64, 4096),
            (19, 8192),
            (37, 777),
            (33, 64),
            (70, 512),
            (41, 768),
            (40, 1024),
            (77, 1600),
            (13, 5120),
            (11, 6144),
            (11, 12288),
            (9000, 64),
        ];
        for (&(n, c), off) in shapes.iter().flat_map(|s| [(s, 5usize), (s, 8)]) {
            let tag = format!("rmsnorm N{n} C{c} offset {off}");
            let at = Loc::new(off, c);
            let r = Rows { n, c };
            let mut params = rng.vec(off + c, 0.3);
            for x in &mut params[off..] {
                *x = bf16::from_f32(*x + 1.0).to_f32();
            }
            // Rows of different scales, so rstd differs between rows.
            let inp: Vec<f32> = rng
                .vec(n * c, 1.0)
                .iter()
                .enumerate()
                .map(|(i, x)| bf16::from_f32(x * (0.5 + (i / c % 7) as f32 * 0.25)).to_f32())
                .collect();
            let (mut oc, mut rc) = (vec![0.0; n * c], vec![0.0; n]);
            cpu.rmsnorm_fwd(&mut oc, &mut rc, &inp, Weights::new(&params, at), r, eps, None)?;
            let (gp, gi) = (up_buf(be, &params)?, up_buf(be, &inp)?);
            let (mut og, mut rg) = (poisoned_buf(be, n * c)?, poisoned_f32(be, n)?);
            be.rmsnorm_fwd(&mut og, &mut rg, &gi, Weights::new(&gp, at), r, eps, None)?;
            rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&og, Loc::all(n * c))?, &oc, TOL_BF16);
            rep.cmp(&format!("{tag} fwd"), "rstd", &be.download_f32(&rg, Loc::all(n))?, &rc, TOL_F32);
            // backward: dinp +=, dw += (or written over NaN: fresh); both from the CPU's rstd
            let dout = rng.vec(n * c, 1.0);
            let dinp0 = rng.vec(n * c, 0.5);
            let (gdo, gr) = (up_buf(be, &dout)?, up_f32(be, &rc)?);
            for fresh in [false, true] {
                let tag = format!("{tag} bwd{}", if fresh { " fresh" } else { "" });
                let g0 = rng.vec(off + c, 0.1);
                let (mut dic, mut gc) = (dinp0.clone(), g0.clone());
                let saved = RmsSaved { inp: &inp, rstd: &rc };
                cpu.rmsnorm_bwd(
                    &mut dic,
                    WeightGrads { buf: &mut gc, at, fresh },
                    &dout,
                    saved,
                    Weights::new(&params, at),
                    r,
                    None,
                )?;
                // Fresh: NaN everywhere, so the elements before the weight must stay NaN too.
                let gpu0 = if fresh { vec![f32::NAN; g0.len()] } else { g0 };
                let run = || -> BResult<(Vec<f32>, Vec<f32>)> {
                    let mut dig = up_buf(be, &dinp0)?;
                    let mut gg = up_grad(be, &gpu0)?;
                    let saved = RmsSaved { inp: &gi, rstd: &gr };
                    let wg = WeightGrads { buf: &mut gg, at, fresh };
                    be.rmsnorm_bwd(&mut dig, wg, &gdo, saved, Weights::new(&gp, at), r, None)?;
                    Ok((be.download_buf(&dig, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(gpu0.len()))?))
                };
                let (di1, g1) = run()?;
                rep.cmp(&tag, "dinp", &di1, &dic, TOL_BF16);
                rep.cmp(&tag, "dw", &g1[off..], &gc[off..], TOL_F32);
                let before = g1[..off].iter().zip(&gpu0[..off]).all(|(a, b)| a.to_bits() == b.to_bits());
                rep.check(&tag, "untouched", before, "the gradient buffer before dw");
                let (di2, g2) = run()?;
                rep.same_bits(&tag, "repeat", &[di2, g2].concat(), &[di1, g1].concat());
            }
        }
        // No rows: a fresh dw is written (zeros), an accumulated one left as it was.
        for fresh in [false, true] {
            let c = 2048;
            let params = up_buf(be, &vec![1.0; c])?;
            let mut gg = up_grad(be, &vec![if fresh { f32::NAN } else { 0.5 }; c])?;
            let (mut dig, x, rs) = (be.alloc_buf(1, "")?, be.alloc_buf(1, "")?, be.alloc_f32(1, "")?);
            let (wg, saved) = (WeightGrads { buf: &mut gg, at: Loc::all(c), fresh }, RmsSaved { inp: &x, rstd: &rs });
            be.rmsnorm_bwd(&mut dig, wg, &x, saved, Weights::new(&params, Loc::all(c)), Rows { n: 0, c }, None)?;
            let want = if fresh { 0.0 } else { 0.5 };
            let got = be.download_grad(&gg, Loc::all(c))?;
            rep.check("rmsnorm N0 bwd", if fresh { "fresh dw" } else { "dw" }, got.iter().all(|&g| g == want), "");
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn matmul() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
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
            if small() && n * oc > 4 << 20 {
                continue;
            }
            let tag = format!("matmul N{n} C{c} OC{oc} off{off}");
            let s = MatShape { n, c, oc };
            let at = LinearLocs::new(Loc::new(off, oc * c), bias.then(|| Loc::new(off + oc * c, oc)));
            let plen = off + oc * c + if bias { oc } else { 0 };
            let params = rng.vec(plen, 0.05);
            let inp = rng.vec(n * c, 1.0);
            let mut outc = vec![0.0; n * oc];
            cpu.matmul_fwd(&mut outc, &inp, Weights::new(&params, at), s)?;
            let (gp, gi) = (up_buf(be, &params)?, up_buf(be, &inp)?);
            let mut outg = poisoned_buf(be, n * oc)?;
            be.matmul_fwd(&mut outg, &gi, Weights::new(&gp, at), s)?;
            rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&outg, Loc::all(n * oc))?, &outc, TOL_BF16);
            // The same layer added to a residual stream (the residual in the GEMM epilogue
            // where the backend fuses it, GEMM + add otherwise).
            let res = rng.vec(n * oc, 1.0);
            let (mut outrc, mut tmpc) = (vec![0.0; n * oc], vec![0.0; n * oc]);
            cpu.matmul_residual_fwd(&mut outrc, &res, &inp, Weights::new(&params, at), s, &mut tmpc)?;
            let (gres, mut tmpg) = (up_buf(be, &res)?, poisoned_buf(be, n * oc)?);
            let mut outrg = poisoned_buf(be, n * oc)?;
            be.matmul_residual_fwd(&mut outrg, &gres, &gi, Weights::new(&gp, at), s, &mut tmpg)?;
            let got = be.download_buf(&outrg, Loc::all(n * oc))?;
            rep.cmp(&format!("{tag} fwd + residual"), "out", &got, &outrc, TOL_BF16);
            let dout = rng.vec(n * oc, 0.1);
            let gdo = up_buf(be, &dout)?;
            // dW, dbias += into random gradients, or written over NaN (fresh).
            for fresh in [false, true] {
                let tag = format!("{tag} bwd{}", if fresh { " fresh" } else { "" });
                let g0 = rng.vec(plen, 0.01);
                let (mut dic, mut gc) = (vec![0.0; n * c], g0.clone());
                let wg = WeightGrads { buf: &mut gc, at, fresh };
                cpu.matmul_bwd(&mut dic, wg, &dout, &inp, Weights::new(&params, at), s)?;
                let gpu0 = if fresh { vec![f32::NAN; plen] } else { g0 };
                let run = || -> BResult<(Vec<f32>, Vec<f32>)> {
                    let mut dig = poisoned_buf(be, n * c)?;
                    let mut gg = up_grad(be, &gpu0)?;
                    let wg = WeightGrads { buf: &mut gg, at, fresh };
                    be.matmul_bwd(&mut dig, wg, &gdo, &gi, Weights::new(&gp, at), s)?;
                    Ok((be.download_buf(&dig, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(plen))?))
                };
                let (di1, g1) = run()?;
                rep.cmp(&tag, "dinp", &di1, &dic, TOL_BF16);
                rep.cmp(&tag, "dW", &g1[off..off + oc * c], &gc[off..off + oc * c], TOL_F32);
                if bias {
                    rep.cmp(&tag, "dbias", &g1[off + oc * c..], &gc[off + oc * c..], TOL_F32);
                }
                let (di2, g2) = run()?;
                rep.same_bits(&tag, "repeat", &[di2, g2].concat(), &[di1, g1].concat());
            }
        }
        Ok(())
    });
}

/// MLP layers with GELU in the GEMM epilogue (fused where cuBLASLt can).
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn matmul_gelu() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
        // (n, c, oc): fc-like forward n x c -> oc and fc2-like backward with input width c.
        for &(n, c, oc) in &[(256usize, 768usize, 3072usize), (256, 3072, 768), (37, 72, 56), (37, 75, 51)] {
            let tag = format!("matmul+gelu N{n} C{c} OC{oc}");
            let at = LinearLocs::new(Loc::new(0, oc * c), Some(Loc::new(oc * c, oc)));
            let plen = oc * c + oc;
            let params = rng.vec(plen, 0.05);
            let inp = rng.vec(n * c, 1.0);
            let (mut prec, mut actc) = (vec![0.0; n * oc], vec![0.0; n * oc]);
            cpu.matmul_gelu_fwd(&mut prec, &mut actc, &inp, Weights::new(&params, at), MatShape { n, c, oc }, None)?;
            let (gp, gi) = (up_buf(be, &params)?, up_buf(be, &inp)?);
            let (mut preg, mut actg) = (poisoned_buf(be, n * oc)?, poisoned_buf(be, n * oc)?);
            be.matmul_gelu_fwd(&mut preg, &mut actg, &gi, Weights::new(&gp, at), MatShape { n, c, oc }, None)?;
            rep.cmp(&format!("{tag} fwd"), "pre", &be.download_buf(&preg, Loc::all(n * oc))?, &prec, TOL_BF16);
            rep.cmp(&format!("{tag} fwd"), "gelu", &be.download_buf(&actg, Loc::all(n * oc))?, &actc, TOL_BF16);
            // Backward of a layer c -> oc whose input is GELU(pre), pre of width c.
            let pre = rng.vec(n * c, 1.0);
            let mut act = vec![0.0; n * c];
            cpu.gelu_fwd(&mut act, &pre, n * c, None)?;
            // The GPU holds GELU(pre) in bf16: give the reference the same input for dW.
            act.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
            let dout = rng.vec(n * oc, 0.1);
            let s = MatShape { n, c, oc };
            let (gdo, gpre) = (up_buf(be, &dout)?, up_buf(be, &pre)?);
            // dW, dbias += into random gradients, or written over NaN (fresh).
            for fresh in [false, true] {
                let tag = format!("{tag} bwd{}", if fresh { " fresh" } else { "" });
                let g0 = rng.vec(plen, 0.01);
                let (mut dpc, mut gc) = (vec![0.0; n * c], g0.clone());
                let x = GeluInput { act: Some(&act), pre: &pre, dpre_amax: None };
                let wg = WeightGrads { buf: &mut gc, at, fresh };
                cpu.matmul_bwd_dgelu(&mut dpc, wg, &dout, x, Weights::new(&params, at), s)?;
                let gpu0 = if fresh { vec![f32::NAN; plen] } else { g0 };
                let run = || -> BResult<(Vec<f32>, Vec<f32>)> {
                    let mut dpg = poisoned_buf(be, n * c)?;
                    let gact = up_buf(be, &act)?;
                    let mut gg = up_grad(be, &gpu0)?;
                    let x = GeluInput { act: Some(&gact), pre: &gpre, dpre_amax: None };
                    let wg = WeightGrads { buf: &mut gg, at, fresh };
                    be.matmul_bwd_dgelu(&mut dpg, wg, &gdo, x, Weights::new(&gp, at), s)?;
                    Ok((be.download_buf(&dpg, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(plen))?))
                };
                let (dp1, g1) = run()?;
                rep.cmp(&tag, "dpre", &dp1, &dpc, TOL_BF16);
                rep.cmp(&tag, "dW", &g1[..oc * c], &gc[..oc * c], TOL_F32);
                rep.cmp(&tag, "dbias", &g1[oc * c..], &gc[oc * c..], TOL_F32);
                let (dp2, g2) = run()?;
                rep.same_bits(&tag, "repeat", &[dp2, g2].concat(), &[dp1, g1].concat());
            }
        }
        Ok(())
    });
}

/// One attention shape of the `attention` tests: its inputs (with document starts or not)
/// and the CPU reference's results.
struct AttnCase {
    s: AttnShape,
    qkv: Vec<f32>,
    dout: Vec<f32>,
    /// `AttnInputs::docs` (document-aware attention), if any.
    docs: Option<Vec<u32>>,
    out: Vec<f32>,
    dqkv: Vec<f32>,
    /// The saved log-sum-exp (base 2) the GPU must produce.
    lse: Vec<f32>,
}

impl AttnCase {
    fn new(rng: &mut gpu::Rng, b: usize, t: usize, nh: usize, nkv: usize, hs: usize) -> AttnCase {
        let s = AttnShape { b, t, c: nh * hs, nh, nkv };
        let n = b * t;
        let qkv = rng.vec(n * s.qkv_width(), 1.0);
        let dout = rng.vec(n * s.c, 1.0);
        AttnCase { s, qkv, dout, docs: None, out: Vec::new(), dqkv: Vec::new(), lse: Vec::new() }
    }

    /// The same inputs within documents of these lengths (`doc_starts`: laid out over the
    /// B·T rows, restarting at each sequence).
    fn with_documents(mut self, lengths: &[usize]) -> AttnCase {
        let s = self.s;
        self.docs = Some(doc_starts(lengths, s.t, s.b * s.t));
        self
    }

    /// A short description of the documents for test names.
    fn docs_tag(&self) -> String {
        let Some(d) = &self.docs else { return String::new() };
        let starts = d.iter().enumerate().filter(|&(row, &v)| v as usize == row % self.s.t).count();
        format!(" in {starts} documents")
    }

    /// The CPU reference (O(T²) time and memory per head: the test runs the cases' references
    /// on threads of their own).
    fn reference(&mut self) -> BResult<()> {
        let (cpu, s) = (CpuBackend::new(), self.s);
        let (n, hs, w, g) = (s.b * s.t, s.hs(), s.qkv_width(), s.group());
        self.out = vec![0.0; n * s.c];
        let mut att = vec![0.0; cpu.attention_saved_len(s)];
        let x = AttnInputs { qkv: &self.qkv, docs: self.docs.as_ref() };
        cpu.attention_fwd(&mut self.out, &mut att, x, s, None)?;
        self.dqkv = vec![0.0; n * w];
        cpu.attention_bwd(&mut self.dqkv, &self.dout, x, &self.out, &att, s, None)?;
        // The saved log-sum-exp (base 2) from the CPU's probabilities: at the diagonal
        // (attended within documents too) p = exp2(s2 - lse), so lse = s2 - log2(p) with
        // s2 = q.k*scale*log2 e, k from the query head's key/value head.
        let scale = 1.0 / (hs as f32).sqrt();
        self.lse = vec![0.0f32; s.b * s.nh * s.t];
        for bi in 0..s.b {
            for h in 0..s.nh {
                for ti in 0..s.t {
                    let row = &self.qkv[(bi * s.t + ti) * w..][..w];
                    let q = &row[h * hs..][..hs];
                    let k = &row[s.k_off() + (h / g) * hs..][..hs];
                    let s2 = q.iter().zip(k).map(|(x, y)| x * y).sum::<f32>() * scale * std::f32::consts::LOG2_E;
                    let p = att[((bi * s.nh + h) * s.t + ti) * s.t + ti];
                    self.lse[(bi * s.nh + h) * s.t + ti] = s2 - p.log2();
                }
            }
        }
        Ok(())
    }
}

/// The attention kernels (every variant the shape allows) against the CPU reference, multi-head
/// and grouped-query (NH query heads sharing NKV key/value heads; the grouped dK/dV pass also
/// with every split forced: none, and one per query head of the group).
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn attention() {
    gpu::check(|be, rng, rep| {
        // (B, T, NH, NKV, HS). Multi-head: every tensor-core head size at T = 1024 and 2048
        // (causal), ragged lengths, and the SIMT-only head size 32.
        let mut shapes = vec![(1usize, 1024usize, 12usize, 12usize, 64usize), (2, 77, 3, 3, 64), (2, 77, 3, 3, 32)];
        shapes.push((2, 64, 2, 2, 64));
        for hs in [64, 80, 96, 128] {
            shapes.extend([(1, 1024, 2, 2, hs), (1, 2048, 1, 1, hs), (2, 77, 2, 2, hs), (1, 130, 2, 2, hs)]);
        }
        // Grouped-query: groups of 8, 4 and 1 at T = 2048 and 4096 for the wgmma / mma.sync /
        // SIMT head sizes 64 and 128 (heads kept few at 4096: the CPU reference is O(T²)), and
        // ragged lengths at every head size (groups of 2 and 3 included).
        for hs in [64, 128] {
            shapes.extend([(1, 2048, 8, 1, hs), (2, 2048, 8, 2, hs), (1, 2048, 4, 4, hs), (2, 130, 8, 2, hs)]);
        }
        shapes.extend([(1, 4096, 8, 1, 64), (1, 4096, 4, 1, 128), (1, 130, 4, 1, 128), (2, 77, 4, 2, 32)]);
        shapes.extend([(1, 130, 6, 2, 80), (2, 77, 6, 3, 96), (1, 200, 4, 2, 96)]);
        shapes.retain(|&(_, t, ..)| !small() || t <= 512);
        let cases: Vec<AttnCase> =
            shapes.iter().map(|&(b, t, nh, nkv, hs)| AttnCase::new(rng, b, t, nh, nkv, hs)).collect();
        attention_cases(be, rep, cases)
    });
}

/// Document lengths of the `attention_documents` cases at T = 2048, B = 2: sequence 0 has
/// documents shorter than a tile (37, 1, 5, 3), boundaries exactly at tile edges (64, 128,
/// 768, 832), a document of exactly one aligned tile (64 at 768) and ones spanning many
/// tiles (640, 1213); sequence 1 boundaries inside tiles (100, 1000, 1001, 1002, 1065).
const DOCS_2048: [usize; 15] = [37, 27, 1, 5, 58, 640, 64, 3, 1213, 100, 900, 1, 1, 63, 983];

/// Ragged document lengths (1 to 300 tokens) covering `rows` rows.
fn random_documents(rng: &mut gpu::Rng, rows: usize) -> Vec<usize> {
    rng.below(rows, 300).into_iter().map(|l| l as usize + 1).collect()
}

/// Document-aware attention (`AttnInputs::docs`, packed sequences) against the CPU reference,
/// every kernel family (wgmma, mma.sync, SIMT), forward and backward (the grouped dK/dV pass
/// with every split forced too), and with documents of one sequence each (starts all 0) the
/// same bits as plain causal attention.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn attention_documents() {
    gpu::check(|be, rng, rep| {
        // (B, T, NH, NKV, HS): groups of 1 and 4 at head sizes 64 and 128 over the DOCS_2048
        // documents; the other tensor-core head sizes (80, 96) and the SIMT-only 32; ragged
        // T (not a multiple of 64) with random ragged documents.
        let mut cases = Vec::new();
        for hs in [64, 128] {
            for (nh, nkv) in [(4, 4), (8, 2)] {
                cases.push(AttnCase::new(rng, 2, 2048, nh, nkv, hs).with_documents(&DOCS_2048));
            }
        }
        for (nh, nkv, hs) in [(2, 2, 80), (4, 2, 96), (2, 2, 32)] {
            cases.push(AttnCase::new(rng, 2, 2048, nh, nkv, hs).with_documents(&DOCS_2048));
        }
        for (b, t, nh, nkv, hs) in [(2, 1000, 4, 1, 64), (2, 1000, 4, 1, 128), (2, 333, 6, 2, 80), (1, 333, 6, 3, 96)] {
            let lengths = random_documents(rng, b * t);
            cases.push(AttnCase::new(rng, b, t, nh, nkv, hs).with_documents(&lengths));
        }
        cases.retain(|c| !small() || c.s.t <= 512);
        attention_cases(be, rep, cases)?;

        // Starts all 0 (one document per sequence) take the *_docs kernels: the plain bits.
        for (b, t, nh, nkv, hs) in
            [(1, 1000, 4, 2, 64), (1, 1024, 4, 1, 128), (1, 300, 2, 2, 80), (2, 300, 3, 3, 96), (1, 200, 2, 2, 32)]
        {
            let s = AttnShape { b, t, c: nh * hs, nh, nkv };
            let (n, w) = (b * t, s.qkv_width());
            let tag = format!("attention B{b} T{t} NH{nh} NKV{nkv} HS{hs}, starts all 0 vs no documents");
            let (gq, gdo) = (up_buf(be, &rng.vec(n * w, 1.0))?, up_buf(be, &rng.vec(n * s.c, 1.0))?);
            let mut zeros = be.alloc_tokens(n, TokenRole::DocStarts { seq_len: t })?;
            be.upload_tokens(&vec![0; n], &mut zeros)?;
            for imp in [AttentionImpl::TensorCore, AttentionImpl::MmaSync, AttentionImpl::Simt] {
                be.set_attention_impl(imp);
                let run = |docs: Option<&DeviceTokens>| -> BResult<Vec<f32>> {
                    let x = AttnInputs { qkv: &gq, docs };
                    let (mut out, mut saved) =
                        (poisoned_buf(be, n * s.c)?, poisoned_f32(be, be.attention_saved_len(s))?);
                    be.attention_fwd(&mut out, &mut saved, x, s, None)?;
                    let mut dq = poisoned_buf(be, n * w)?;
                    be.attention_bwd(&mut dq, &gdo, x, &out, &saved, s, None)?;
                    let lse = be.download_f32(&saved, Loc::all(s.b * s.nh * t))?;
                    Ok([be.download_buf(&out, Loc::all(n * s.c))?, lse, be.download_buf(&dq, Loc::all(n * w))?]
                        .concat())
                };
                rep.same_bits(&format!("{tag} {imp:?}"), "out, lse, dqkv", &run(Some(&zeros))?, &run(None)?);
            }
            be.set_attention_impl(AttentionImpl::TensorCore);
        }
        Ok(())
    });
}

/// Every case on every kernel family the shape allows against its CPU reference: forward
/// output and log-sum-exp, and the backward (the grouped dK/dV pass as it picks its split,
/// then every split forced) twice, for the same bits.
fn attention_cases(be: &CudaBackend, rep: &mut gpu::Report, mut cases: Vec<AttnCase>) -> BResult<()> {
    {
        std::thread::scope(|sc| {
            let runs: Vec<_> = cases.iter_mut().map(|c| sc.spawn(move || c.reference())).collect();
            runs.into_iter().try_for_each(|r| r.join().expect("CPU reference thread"))
        })?;
        for c in &cases {
            let s = c.s;
            let (n, w, hs) = (s.b * s.t, s.qkv_width(), s.hs());
            let tag = format!("attention B{} T{} NH{} NKV{} HS{hs}{}", s.b, s.t, s.nh, s.nkv, c.docs_tag());
            let (gq, gdo) = (up_buf(be, &c.qkv)?, up_buf(be, &c.dout)?);
            let gdocs = match &c.docs {
                Some(d) => {
                    let mut g = be.alloc_tokens(n, TokenRole::DocStarts { seq_len: s.t })?;
                    be.upload_tokens(d, &mut g)?;
                    Some(g)
                }
                None => None,
            };
            let x = AttnInputs { qkv: &gq, docs: gdocs.as_ref() };
            // dQ, dK, dV: the query heads' columns, then the key heads', then the value heads'.
            let parts = [("dq", 0, s.c), ("dk", s.k_off(), s.v_off()), ("dv", s.v_off(), w)];
            let pick = |v: &[f32], lo: usize, hi: usize| -> Vec<f32> {
                v.chunks(w).flat_map(|r| r[lo..hi].to_vec()).collect()
            };
            // The grouped dK/dV pass as it picks its split, then every split forced.
            let mut splits = vec![None];
            if s.nkv != s.nh {
                splits.extend([Some(1), Some(s.group())]);
            }
            // The default (wgmma at head sizes 64 and 128 on Hopper), the mma.sync kernels, SIMT.
            for imp in [AttentionImpl::TensorCore, AttentionImpl::MmaSync, AttentionImpl::Simt] {
                be.set_attention_impl(imp);
                let tag = format!("{tag} {imp:?}");
                let mut outg = poisoned_buf(be, n * s.c)?;
                let mut saved = poisoned_f32(be, be.attention_saved_len(s))?;
                be.attention_fwd(&mut outg, &mut saved, x, s, None)?;
                rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&outg, Loc::all(n * s.c))?, &c.out, TOL_BF16);
                let lse = be.download_f32(&saved, Loc::all(s.b * s.nh * s.t))?;
                rep.cmp(&format!("{tag} fwd"), "lse", &lse, &c.lse, 1e-3);
                for &split in &splits {
                    be.set_attention_dkv_split(split);
                    let tag = match split {
                        None => format!("{tag} bwd"),
                        Some(k) => format!("{tag} bwd split {k}"),
                    };
                    let run = || -> BResult<Vec<f32>> {
                        let mut dq = poisoned_buf(be, n * w)?;
                        be.attention_bwd(&mut dq, &gdo, x, &outg, &saved, s, None)?;
                        be.download_buf(&dq, Loc::all(n * w))
                    };
                    let d1 = run()?;
                    for (name, lo, hi) in parts {
                        rep.cmp(&tag, name, &pick(&d1, lo, hi), &pick(&c.dqkv, lo, hi), TOL_BF16);
                    }
                    rep.same_bits(&tag, "repeat", &run()?, &d1);
                }
                be.set_attention_dkv_split(None);
            }
            be.set_attention_impl(AttentionImpl::TensorCore);
        }
        Ok(())
    }
}

/// The producers that leave an FP8 amax (`AmaxSink`: the norms, GELU and SwiGLU both ways,
/// and the pass of its own): with a sink they write the same bits as without, and
/// the amax left is, bit for bit, the amax of what they wrote (NaN included: it propagates).
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn fp8_amax_sinks() {
    gpu::check(|be, rng, rep| {
        if let Err(why) = be.fp8_support() {
            rep.check("fp8 amax sinks", "skipped", true, &why);
            return Ok(());
        }
        let (n, c, f) = (64usize, 1600usize, 320usize);
        let layers = Fp8Layers {
            largest: LinearExtent::of(n, &[(c, 2 * f)]),
            weights: vec![(c, 2 * f); 2],
            ..Fp8Layers::default()
        };
        be.prepare_fp8(&layers)?;
        let amax_of = |v: &[f32]| trainer::backend::fp8::amax(v);
        let mut same = |tag: &str, with: Vec<f32>, without: &[f32], sink: AmaxSink| -> BResult<()> {
            rep.same_bits(tag, "output with a sink", &with, without);
            let (left, want) = (be.fp8_sink_amax(sink)?, amax_of(&with));
            rep.check(tag, "amax left", left.to_bits() == want.to_bits(), &format!("{left:e} vs {want:e}"));
            Ok(())
        };
        // The norms (C = 1600: LayerNorm's vector path, RMSNorm's fast kernel; C = 1004: the general ones).
        for &cc in &[c, 1004] {
            let r = Rows { n, c: cc };
            let (inp, params) = (rng.vec(n * cc, 2.0), rng.vec(2 * cc, 1.0));
            let (gi, gp) = (up_buf(be, &inp)?, up_buf(be, &params)?);
            let at = NormLocs { w: Loc::new(0, cc), b: Loc::new(cc, cc) };
            let run = |sink: Option<AmaxSink>| -> BResult<Vec<f32>> {
                let (mut o, mut m, mut rs) = (poisoned_buf(be, n * cc)?, poisoned_f32(be, n)?, poisoned_f32(be, n)?);
                be.layernorm_fwd(&mut o, LnStats { mean: &mut m, rstd: &mut rs }, &gi, Weights::new(&gp, at), r, sink)?;
                be.download_buf(&o, Loc::all(n * cc))
            };
            let plain = run(None)?;
            same(&format!("layernorm_fwd C{cc}"), run(Some(AmaxSink::Input(0)))?, &plain, AmaxSink::Input(0))?;
            let run = |sink: Option<AmaxSink>| -> BResult<Vec<f32>> {
                let (mut o, mut rs) = (poisoned_buf(be, n * cc)?, poisoned_f32(be, n)?);
                be.rmsnorm_fwd(&mut o, &mut rs, &gi, Weights::new(&gp, Loc::new(0, cc)), r, 1e-5, sink)?;
                be.download_buf(&o, Loc::all(n * cc))
            };
            let plain = run(None)?;
            same(&format!("rmsnorm_fwd C{cc}"), run(Some(AmaxSink::Input(1)))?, &plain, AmaxSink::Input(1))?;
            // The backward (the residual gradient's amax), on an odd number of rows: the fast
            // kernels' last pair is a single row.
            let nb = n - 1;
            let rb = Rows { n: nb, c: cc };
            let (dout, dinp0) = (rng.vec(nb * cc, 1.0), rng.vec(nb * cc, 0.5));
            let (gdo, gm, grs) = (up_buf(be, &dout)?, up_f32(be, &rng.vec(nb, 0.3))?, up_f32(be, &rng.vec(nb, 1.0))?);
            let (grads_at, rms_at) = (NormLocs { w: Loc::new(0, cc), b: Loc::new(cc, cc) }, Loc::new(0, cc));
            let run = |sink: Option<AmaxSink>| -> BResult<Vec<f32>> {
                let (mut d, mut gg) = (up_buf(be, &dinp0)?, up_grad(be, &vec![0.0; 2 * cc])?);
                let saved = LnSaved { inp: &gi, mean: &gm, rstd: &grs };
                let wg = WeightGrads { buf: &mut gg, at: grads_at, fresh: true };
                be.layernorm_bwd(&mut d, wg, &gdo, saved, Weights::new(&gp, at), rb, sink)?;
                be.download_buf(&d, Loc::all(nb * cc))
            };
            let plain = run(None)?;
            same(&format!("layernorm_bwd C{cc}"), run(Some(AmaxSink::Grad(0)))?, &plain, AmaxSink::Grad(0))?;
            let run = |sink: Option<AmaxSink>| -> BResult<Vec<f32>> {
                let (mut d, mut gg) = (up_buf(be, &dinp0)?, up_grad(be, &vec![0.0; cc])?);
                let saved = RmsSaved { inp: &gi, rstd: &grs };
                let wg = WeightGrads { buf: &mut gg, at: rms_at, fresh: true };
                be.rmsnorm_bwd(&mut d, wg, &gdo, saved, Weights::new(&gp, rms_at), rb, sink)?;
                be.download_buf(&d, Loc::all(nb * cc))
            };
            let plain = run(None)?;
            same(&format!("rmsnorm_bwd C{cc}"), run(Some(AmaxSink::Grad(1)))?, &plain, AmaxSink::Grad(1))?;
        }
        // GELU both ways (the backward in place; an odd length: the scalar tail too), SwiGLU
        // both ways.
        for &len in &[n * c, n * c - 3] {
            let (x, d0) = (rng.vec(len, 2.0), rng.vec(len, 1.0));
            let gx = up_buf(be, &x)?;
            let run = |sink: Option<AmaxSink>| -> BResult<Vec<f32>> {
                let mut d = up_buf(be, &d0)?;
                be.gelu_bwd(&mut d, &gx, len, sink)?;
                be.download_buf(&d, Loc::all(len))
            };
            let plain = run(None)?;
            same(&format!("gelu_bwd n{len}"), run(Some(AmaxSink::Grad(0)))?, &plain, AmaxSink::Grad(0))?;
            let run = |sink: Option<AmaxSink>| -> BResult<Vec<f32>> {
                let mut o = poisoned_buf(be, len)?;
                be.gelu_fwd(&mut o, &gx, len, sink)?;
                be.download_buf(&o, Loc::all(len))
            };
            let plain = run(None)?;
            same(&format!("gelu_fwd n{len}"), run(Some(AmaxSink::Input(0)))?, &plain, AmaxSink::Input(0))?;
        }
        let r = Rows { n, c: f };
        let (inp, dout) = (rng.vec(n * 2 * f, 2.0), rng.vec(n * f, 1.0));
        let (gi, gdo) = (up_buf(be, &inp)?, up_buf(be, &dout)?);
        let run = |sink: Option<AmaxSink>| -> BResult<Vec<f32>> {
            let mut o = poisoned_buf(be, n * f)?;
            be.swiglu_fwd(&mut o, &gi, r, sink)?;
            be.download_buf(&o, Loc::all(n * f))
        };
        let plain = run(None)?;
        same("swiglu_fwd", run(Some(AmaxSink::Input(1)))?, &plain, AmaxSink::Input(1))?;
        let run = |sink: Option<AmaxSink>| -> BResult<Vec<f32>> {
            let mut d = poisoned_buf(be, n * 2 * f)?;
            be.swiglu_bwd(&mut d, &gi, &gdo, r, sink)?;
            be.download_buf(&d, Loc::all(n * 2 * f))
        };
        let plain = run(None)?;
        same("swiglu_bwd", run(Some(AmaxSink::Grad(1)))?, &plain, AmaxSink::Grad(1))?;
        // Attention: the output (forward) and dqkv (backward) with sinks, on every kernel family
        // (the Hopper kernels max as they write; the others, and a split dK/dV pass, take a
        // pass after), plain and within documents, grouped-query with its dK/dV split forced.
        for (b, t, nh, nkv, hs, split) in
            [(2, 300, 4, 4, 64, None), (1, 333, 4, 2, 128, Some(2)), (1, 200, 4, 2, 64, None)]
        {
            let s = AttnShape { b, t, c: nh * hs, nh, nkv };
            let (na, w) = (b * t, s.qkv_width());
            let (gq, gdo) = (up_buf(be, &rng.vec(na * w, 1.0))?, up_buf(be, &rng.vec(na * s.c, 1.0))?);
            let mut starts = be.alloc_tokens(na, TokenRole::DocStarts { seq_len: t })?;
            be.upload_tokens(&doc_starts(&random_documents(rng, na), t, na), &mut starts)?;
            be.set_attention_dkv_split(split);
            for imp in [AttentionImpl::TensorCore, AttentionImpl::MmaSync, AttentionImpl::Simt] {
                be.set_attention_impl(imp);
                for docs in [None, Some(&starts)] {
                    let x = AttnInputs { qkv: &gq, docs };
                    let tag = format!(
                        "attention B{b} T{t} NH{nh} NKV{nkv} HS{hs} {imp:?}{}",
                        if docs.is_some() { " docs" } else { "" }
                    );
                    let mut saved = poisoned_f32(be, be.attention_saved_len(s))?;
                    let mut run_fwd = |sink: Option<AmaxSink>| -> BResult<(Vec<f32>, <CudaBackend as Device>::Buf)> {
                        let mut out = poisoned_buf(be, na * s.c)?;
                        be.attention_fwd(&mut out, &mut saved, x, s, sink)?;
                        Ok((be.download_buf(&out, Loc::all(na * s.c))?, out))
                    };
                    let (plain, _) = run_fwd(None)?;
                    let (with, out) = run_fwd(Some(AmaxSink::Input(0)))?;
                    same(&format!("{tag} fwd"), with, &plain, AmaxSink::Input(0))?;
                    let run_bwd = |sink: Option<AmaxSink>| -> BResult<Vec<f32>> {
                        let mut dq = poisoned_buf(be, na * w)?;
                        be.attention_bwd(&mut dq, &gdo, x, &out, &saved, s, sink)?;
                        be.download_buf(&dq, Loc::all(na * w))
                    };
                    let plain = run_bwd(None)?;
                    same(&format!("{tag} bwd"), run_bwd(Some(AmaxSink::Grad(1)))?, &plain, AmaxSink::Grad(1))?;
                }
            }
            be.set_attention_impl(AttentionImpl::TensorCore);
            be.set_attention_dkv_split(None);
        }
        // The pass of its own (after a fused GELU' epilogue), a NaN included.
        let mut v = rng.vec(n * c, 3.0);
        v[77] = f32::NAN;
        let gv = up_buf(be, &v)?;
        be.fp8_amax_into(&gv, n * c, AmaxSink::Grad(0))?;
        let left = be.fp8_sink_amax(AmaxSink::Grad(0))?;
        rep.check("fp8_amax_into", "NaN propagates", left.is_nan(), &format!("{left:e}"));
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn activation() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
        for &n in &[1usize << 20, 1001] {
            let x = rng.vec(n, 2.0);
            let y = rng.vec(n, 2.0);
            let (gx, gy) = (up_buf(be, &x)?, up_buf(be, &y)?);
            let mut c1 = vec![0.0; n];
            cpu.gelu_fwd(&mut c1, &x, n, None)?;
            let mut g1 = poisoned_buf(be, n)?;
            be.gelu_fwd(&mut g1, &gx, n, None)?;
            rep.cmp(&format!("gelu_fwd n{n}"), "out", &be.download_buf(&g1, Loc::all(n))?, &c1, TOL_BF16);
            // In place: the gradient y in, GELU'(x)·y out in its buffer.
            c1.copy_from_slice(&y);
            cpu.gelu_bwd(&mut c1, &x, n, None)?;
            let mut g1 = up_buf(be, &y)?;
            be.gelu_bwd(&mut g1, &gx, n, None)?;
            rep.cmp(&format!("gelu_bwd n{n}"), "d", &be.download_buf(&g1, Loc::all(n))?, &c1, TOL_BF16);
            cpu.residual_fwd(&mut c1, &x, &y, n)?;
            let mut g1 = poisoned_buf(be, n)?;
            be.residual_fwd(&mut g1, &gx, &gy, n)?;
            rep.cmp(&format!("residual_fwd n{n}"), "out", &be.download_buf(&g1, Loc::all(n))?, &c1, TOL_BF16);
        }
        Ok(())
    });
}

/// SwiGLU forward and backward against the CPU: Llama widths F = 8192 (3.2-1B) and 14336
/// (3-8B) on 16-byte words, and F % 8 != 0 (1001, 3: one element at a time); outputs and
/// input gradients written over NaN.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn swiglu() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
        for &(n, f) in &[(64usize, 8192usize), (33, 14336), (37, 1001), (300, 64), (5, 8), (7, 3)] {
            let tag = format!("swiglu N{n} F{f}");
            let r = Rows { n, c: f };
            // gate over the range where silu bends (and its tails), up and dout around 1
            let inp = rng.vec(n * 2 * f, 3.0);
            let dout = rng.vec(n * f, 1.0);
            let mut oc = vec![0.0; n * f];
            cpu.swiglu_fwd(&mut oc, &inp, r, None)?;
            let (gi, gdo) = (up_buf(be, &inp)?, up_buf(be, &dout)?);
            let mut og = poisoned_buf(be, n * f)?;
            be.swiglu_fwd(&mut og, &gi, r, None)?;
            rep.cmp(&format!("{tag} fwd"), "out", &be.download_buf(&og, Loc::all(n * f))?, &oc, TOL_BF16);
            let mut dc = vec![0.0; n * 2 * f];
            cpu.swiglu_bwd(&mut dc, &inp, &dout, r, None)?;
            let mut dg = poisoned_buf(be, n * 2 * f)?;
            be.swiglu_bwd(&mut dg, &gi, &gdo, r, None)?;
            let got = be.download_buf(&dg, Loc::all(n * 2 * f))?;
            let half = |v: &[f32], k: usize| -> Vec<f32> {
                v.chunks(2 * f).flat_map(|row| row[k * f..][..f].to_vec()).collect()
            };
            rep.cmp(&format!("{tag} bwd"), "dgate", &half(&got, 0), &half(&dc, 0), TOL_BF16);
            rep.cmp(&format!("{tag} bwd"), "dup", &half(&got, 1), &half(&dc, 1), TOL_BF16);
        }
        Ok(())
    });
}

/// RoPE in place on the query and key heads against the CPU, and its backward: bwd(fwd(x))
/// gives x back (bf16 tolerance: two roundings), the backward of a random gradient matches
/// the CPU's, and the value heads are not touched (same bits); each plain, within random
/// ragged documents (`docs`: positions restart per document), and with starts all 0 (the
/// plain bits); and bad document starts refused. Llama's shapes (T 2048 and
/// 4096, head sizes 64 and 128, 1, 4 and 8 query heads per key/value head, B = 2 so
/// positions restart at row T; the Llama 3.1 scaled table at T = 4096), then the general
/// kernel (head sizes 80, 96, 10) and the other vectorised ones (32, 256) at odd lengths.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn rope() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
        // (b, t, nh, nkv, hs)
        let mut shapes = Vec::new();
        for t in [2048usize, 4096] {
            for hs in [64usize, 128] {
                for group in [1usize, 4, 8] {
                    shapes.push((2usize, t, 8usize, 8 / group, hs));
                }
            }
        }
        shapes.extend([(2, 77, 6, 2, 80), (2, 33, 4, 1, 96), (2, 9, 3, 3, 10), (3, 17, 4, 4, 32), (1, 5, 4, 2, 256)]);
        for (b, t, nh, nkv, hs) in shapes {
            if small() && t > 512 {
                continue;
            }
            let s = AttnShape { b, t, c: nh * hs, nh, nkv };
            let tag = format!("rope B{b} T{t} NH{nh} NKV{nkv} HS{hs}");
            let (n, w, qk) = (b * t, s.qkv_width(), (nh + nkv) * hs);
            let scaling = (t == 4096).then_some(RopeScaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            });
            let table = rope_table(t, hs, 500_000.0, scaling);
            let gt = up_f32(be, &table)?;
            // Columns [from, to) of every row.
            let cols = |v: &[f32], from: usize, to: usize| -> Vec<f32> {
                v.chunks(w).flat_map(|row| row[from..to].to_vec()).collect()
            };
            // Plain, then within random ragged documents (positions restart at each one; the
            // value heads still untouched), then with starts all 0: the plain bits.
            let lengths = random_documents(rng, n);
            let starts = doc_starts(&lengths, t, n);
            let mut gdocs = be.alloc_tokens(n, TokenRole::DocStarts { seq_len: t })?;
            be.upload_tokens(&starts, &mut gdocs)?;
            let mut gzeros = be.alloc_tokens(n, TokenRole::DocStarts { seq_len: t })?;
            be.upload_tokens(&vec![0; n], &mut gzeros)?;
            for (docs, gdocs, what) in [
                (None, None, ""),
                (Some(&starts), Some(&gdocs), " in documents"),
                (None, Some(&gzeros), " starts all 0"),
            ] {
                let tag = format!("{tag}{what}");
                let x = rng.vec(n * w, 1.0);
                let mut xc = x.clone();
                cpu.rope_fwd(&mut xc, &table, docs, s)?;
                let mut gx = up_buf(be, &x)?;
                be.rope_fwd(&mut gx, &gt, gdocs, s)?;
                let fwd = be.download_buf(&gx, Loc::all(n * w))?;
                rep.cmp(&format!("{tag} fwd"), "q, k", &cols(&fwd, 0, qk), &cols(&xc, 0, qk), TOL_BF16);
                rep.same_bits(&format!("{tag} fwd"), "v", &cols(&fwd, qk, w), &cols(&x, qk, w));
                be.rope_bwd(&mut gx, &gt, gdocs, s)?;
                rep.cmp(&format!("{tag} bwd(fwd)"), "x", &be.download_buf(&gx, Loc::all(n * w))?, &x, TOL_BF16);
                drop(gx);
                let d = rng.vec(n * w, 1.0);
                let mut dc = d.clone();
                cpu.rope_bwd(&mut dc, &table, docs, s)?;
                let mut gd = up_buf(be, &d)?;
                be.rope_bwd(&mut gd, &gt, gdocs, s)?;
                let bwd = be.download_buf(&gd, Loc::all(n * w))?;
                rep.cmp(&format!("{tag} bwd"), "dq, dk", &cols(&bwd, 0, qk), &cols(&dc, 0, qk), TOL_BF16);
                rep.same_bits(&format!("{tag} bwd"), "dv", &cols(&bwd, qk, w), &cols(&d, qk, w));
                // Starts all 0 on the plain case's inputs: the plain bits.
                if what.is_empty() {
                    let mut again = up_buf(be, &x)?;
                    be.rope_fwd(&mut again, &gt, Some(&gzeros), s)?;
                    let zeros = be.download_buf(&again, Loc::all(n * w))?;
                    rep.same_bits(&format!("{tag} fwd, starts all 0"), "qkv", &zeros, &fwd);
                }
            }
        }
        // Document starts are checked at upload, and only buffers allocated for them are taken.
        let (t, s) = (8usize, AttnShape { b: 1, t: 8, c: 32, nh: 2, nkv: 2 });
        let mut gd = be.alloc_tokens(t, TokenRole::DocStarts { seq_len: t })?;
        let bad = be.upload_tokens(&[0, 0, 0, 1, 1, 5, 5, 5], &mut gd);
        rep.check("upload_tokens (document starts)", "refuses starts that go back", bad.is_err(), &format!("{bad:?}"));
        let targets = up_tok(be, &[0; 8])?;
        let mut gx = up_buf(be, &rng.vec(t * s.qkv_width(), 1.0))?;
        let table = up_f32(be, &rope_table(t, s.hs(), 10_000.0, None))?;
        let wrong = be.rope_fwd(&mut gx, &table, Some(&targets), s);
        rep.check("rope_fwd", "refuses token ids that are not document starts", wrong.is_err(), &format!("{wrong:?}"));
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn cross_entropy() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
        // Odd (unaligned rows), padded, tiny and large vocabularies.
        for &(n, v) in &[(64usize, 50257usize), (16, 50304), (33, 8), (16, 1024), (6, 70001)] {
            let tag = format!("cross_entropy N{n} V{v}");
            let logits = rng.vec(n * v, 3.0);
            let tg = rng.below(n, v as u32);
            let scale = 1.0 / n as f32;
            let (mut lc, mut ls) = (logits.clone(), vec![0.0; n]);
            cpu.cross_entropy_fwd_bwd(&mut lc, &mut ls, &tg, LossRows::all(n, v), scale)?;
            let mut gl = up_buf(be, &logits)?;
            let mut gls = poisoned_f32(be, n)?;
            be.cross_entropy_fwd_bwd(&mut gl, &mut gls, &up_tok(be, &tg)?, LossRows::all(n, v), scale)?;
            rep.cmp(&tag, "losses", &be.download_f32(&gls, Loc::all(n))?, &ls, TOL_F32);
            rep.cmp(&tag, "dlogits", &be.download_buf(&gl, Loc::all(n * v))?, &lc, TOL_BF16);
        }
        Ok(())
    });
}

/// The loss over a chunk of the batch's rows (`LossRows { first > 0 }`, the LM head in
/// chunks): the chunk's logits against `targets[first..]`, its losses written at `first..`
/// (over NaN) and every other loss left as it was.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn cross_entropy_chunk() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
        // (rows in the batch, first, rows in the chunk, vocabulary)
        for &(total, first, n, v) in &[(48usize, 16usize, 16usize, 50304usize), (37, 11, 13, 1001), (9, 8, 1, 128256)] {
            let tag = format!("cross_entropy rows {first}..{} of {total} V{v}", first + n);
            let rows = LossRows { n, v, first };
            let logits = rng.vec(n * v, 3.0);
            let tg = rng.below(total, v as u32);
            let scale = 1.0 / total as f32;
            let before = rng.vec(total, 1.0);
            let (mut lc, mut ls) = (logits.clone(), before.clone());
            cpu.cross_entropy_fwd_bwd(&mut lc, &mut ls, &tg, rows, scale)?;
            let mut gpu_before = before.clone();
            gpu_before[first..first + n].fill(f32::NAN);
            let (mut gl, mut gls) = (up_buf(be, &logits)?, up_f32(be, &gpu_before)?);
            be.cross_entropy_fwd_bwd(&mut gl, &mut gls, &up_tok(be, &tg)?, rows, scale)?;
            let got = be.download_f32(&gls, Loc::all(total))?;
            rep.cmp(&tag, "chunk losses", &got[first..first + n], &ls[first..first + n], TOL_F32);
            let rest = |v: &[f32]| [&v[..first], &v[first + n..]].concat();
            rep.same_bits(&tag, "other losses", &rest(&got), &rest(&before));
            rep.cmp(&tag, "dlogits", &be.download_buf(&gl, Loc::all(n * v))?, &lc, TOL_BF16);
        }
        Ok(())
    });
}

/// LayerNorm and RMSNorm without their output (an FP8 cast applies the norm:
/// `matmul_fwd_of_norm`): the statistics of their forwards, bit for bit, and the amax of the
/// output they would write; without an amax sink (the cast predicts its scale), the same
/// statistics and the sink left as it was.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn layernorm_stats() {
    gpu::check(|be, rng, rep| {
        if let Err(why) = be.fp8_support() {
            rep.check("layernorm_stats", "skipped", true, &why);
            return Ok(());
        }
        let n = 64usize;
        be.prepare_fp8(&Fp8Layers::blocks(n, &[(1600, 1600)], 1, 0))?;
        for cc in [1600usize, 1004] {
            let r = Rows { n, c: cc };
            let (inp, params) = (rng.vec(n * cc, 2.0), rng.vec(2 * cc, 1.0));
            let (gi, gp) = (up_buf(be, &inp)?, up_buf(be, &params)?);
            let at = NormLocs { w: Loc::new(0, cc), b: Loc::new(cc, cc) };
            let (mut o, mut m, mut rs) = (poisoned_buf(be, n * cc)?, poisoned_f32(be, n)?, poisoned_f32(be, n)?);
            be.layernorm_fwd(&mut o, LnStats { mean: &mut m, rstd: &mut rs }, &gi, Weights::new(&gp, at), r, None)?;
            let want = [be.download_f32(&m, Loc::all(n))?, be.download_f32(&rs, Loc::all(n))?].concat();
            let out = be.download_buf(&o, Loc::all(n * cc))?;
            let (mut m2, mut rs2) = (poisoned_f32(be, n)?, poisoned_f32(be, n)?);
            let st = LnStats { mean: &mut m2, rstd: &mut rs2 };
            be.layernorm_stats(st, &gi, Weights::new(&gp, at), r, Some(AmaxSink::Input(0)))?;
            let got = [be.download_f32(&m2, Loc::all(n))?, be.download_f32(&rs2, Loc::all(n))?].concat();
            let tag = format!("layernorm_stats C{cc}");
            rep.same_bits(&tag, "mean and rstd", &got, &want);
            let (left, amax) = (be.fp8_sink_amax(AmaxSink::Input(0))?, trainer::backend::fp8::amax(&out));
            rep.check(&tag, "amax left", left.to_bits() == amax.to_bits(), &format!("{left:e} vs {amax:e}"));
            let (mut m3, mut rs3) = (poisoned_f32(be, n)?, poisoned_f32(be, n)?);
            be.layernorm_stats(LnStats { mean: &mut m3, rstd: &mut rs3 }, &gi, Weights::new(&gp, at), r, None)?;
            let got = [be.download_f32(&m3, Loc::all(n))?, be.download_f32(&rs3, Loc::all(n))?].concat();
            rep.same_bits(&format!("{tag}, no amax"), "mean and rstd", &got, &want);
            let still = be.fp8_sink_amax(AmaxSink::Input(0))?;
            rep.check(&format!("{tag}, no amax"), "sink untouched", still.to_bits() == left.to_bits(), "");
        }
        // RMSNorm (C = 2048: a fast kernel; C = 1004: the general one).
        for cc in [2048usize, 1004] {
            let r = Rows { n, c: cc };
            let (inp, params) = (rng.vec(n * cc, 2.0), rng.vec(cc, 1.0));
            let (gi, gp) = (up_buf(be, &inp)?, up_buf(be, &params)?);
            let w = Loc::new(0, cc);
            let (mut o, mut rs) = (poisoned_buf(be, n * cc)?, poisoned_f32(be, n)?);
            be.rmsnorm_fwd(&mut o, &mut rs, &gi, Weights::new(&gp, w), r, 1e-5, None)?;
            let (want, out) = (be.download_f32(&rs, Loc::all(n))?, be.download_buf(&o, Loc::all(n * cc))?);
            let mut rs2 = poisoned_f32(be, n)?;
            be.rmsnorm_stats(&mut rs2, &gi, Weights::new(&gp, w), r, 1e-5, Some(AmaxSink::Grad(0)))?;
            let tag = format!("rmsnorm_stats C{cc}");
            rep.same_bits(&tag, "rstd", &be.download_f32(&rs2, Loc::all(n))?, &want);
            let (left, amax) = (be.fp8_sink_amax(AmaxSink::Grad(0))?, trainer::backend::fp8::amax(&out));
            rep.check(&tag, "amax left", left.to_bits() == amax.to_bits(), &format!("{left:e} vs {amax:e}"));
            let mut rs3 = poisoned_f32(be, n)?;
            be.rmsnorm_stats(&mut rs3, &gi, Weights::new(&gp, w), r, 1e-5, None)?;
            rep.same_bits(&format!("{tag}, no amax"), "rstd", &be.download_f32(&rs3, Loc::all(n))?, &want);
            let still = be.fp8_sink_amax(AmaxSink::Grad(0))?;
            rep.check(&format!("{tag}, no amax"), "sink untouched", still.to_bits() == left.to_bits(), "");
        }
        Ok(())
    });
}

/// AdamW over 21 segments (more than one launch takes: 16), with and without weight decay,
/// one of them empty, at odd offsets and at offsets in multiples of 4 (both kernels); three
/// segments are FP8 layers' weights (two adjacent layers in the first launch, one in the
/// second), whose amax the update leaves in their weight slots: that of the bf16 values it
/// wrote, bit for bit.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn adamw() {
    gpu::check(|be, rng, rep| {
        let cpu = CpuBackend::new();
        let fp8_segs = [(2usize, 0usize), (3, 1), (17, 2)];
        let layers = Fp8Layers {
            largest: LinearExtent::of(64, &[(64, 64)]),
            weights: vec![(64, 64); 3],
            ..Fp8Layers::default()
        };
        cpu.prepare_fp8(&layers)?;
        let fp8 = be.fp8_support().is_ok();
        if fp8 {
            be.prepare_fp8(&layers)?;
        }
        // Odd offsets and lengths (the one-element kernel), then offsets and lengths in
        // multiples of 4 (the four-element kernel).
        for (poff, moff, goff, step, tag) in [(5usize, 3usize, 7usize, 997usize, "odd"), (4, 8, 12, 996, "by 4")] {
            let mut segs = Vec::new();
            let mut at = 0usize;
            for k in 0..21usize {
                let n = if k == 9 { 0 } else { 3_000 + (tag == "odd") as usize + step * k };
                let fp8_layer = fp8_segs.iter().find(|s| s.0 == k).map(|s| s.1);
                segs.push(AdamWSegment {
                    poff: poff + at,
                    moff: moff + at,
                    goff: goff + at,
                    len: n,
                    decay: k % 3 != 1,
                    fp8_layer: fp8_layer.filter(|_| fp8),
                });
                at += n;
            }
            let len = at;
            let master = rng.vec(moff + len, 0.5);
            let m0 = rng.vec(moff + len, 0.01);
            let v0: Vec<f32> = rng.vec(moff + len, 0.01).iter().map(|x| x * x).collect();
            let g = rng.vec(goff + len, 0.1);
            let h =
                AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 3, grad_scale: 0.7 };
            let (mut pc, mut wc, mut mc, mut vc) = (vec![0.0; poff + len], master.clone(), m0.clone(), v0.clone());
            let t = AdamWTensors { params: Some(&mut pc), master: &mut wc, m: &mut mc, v: &mut vc, grads: &g };
            cpu.adamw(t, &segs, h)?;
            let mut pg = poisoned_buf(be, poff + len)?;
            let (mut wg, mut mg, mut vg, gg) =
                (up_f32(be, &master)?, up_f32(be, &m0)?, up_f32(be, &v0)?, up_grad(be, &g)?);
            let t = AdamWTensors { params: Some(&mut pg), master: &mut wg, m: &mut mg, v: &mut vg, grads: &gg };
            be.adamw(t, &segs, h)?;
            let r = Loc::new(moff, len);
            let op = format!("adamw ({tag})");
            // The same bits as the CPU's (each operation rounded on its own on both).
            rep.same_bits(&op, "master", &be.download_f32(&wg, r)?, &wc[moff..]);
            rep.same_bits(&op, "m", &be.download_f32(&mg, r)?, &mc[moff..]);
            rep.same_bits(&op, "v", &be.download_f32(&vg, r)?, &vc[moff..]);
            rep.same_bits(&op, "params(bf16)", &be.download_buf(&pg, Loc::new(poff, len))?, &bf16_rounded(&pc[poff..]));
            for (k, l) in fp8_segs.into_iter().filter(|_| fp8) {
                let s = segs[k];
                let want = trainer::backend::fp8::amax(&be.download_buf(&pg, Loc::new(s.poff, s.len))?);
                let left = be.fp8_weight_slot_amax(l)?;
                let what = format!("FP8 layer {l}'s weight amax left");
                rep.check(&op, &what, left.to_bits() == want.to_bits(), &format!("{left:e} vs {want:e}"));
            }
        }
        Ok(())
    });
}

/// The optimizer step writing FP8 layers' cached weights (`Fp8Layers::step_codes`: the update
/// writing the codes as laid out with a predicted scale, then a transposing pass checking it):
/// the same parameters, moments and master weights as the CPU's AdamW, bit for bit, and for
/// each cached weight the codes (both layouts), inverse scale and amax a cast of the bf16 values
/// the step wrote gives, bit for bit, whether the prediction held or not (the first step has
/// none; the third multiplies the weights by 8 first). Weights with ragged tiles both ways, one
/// fused of three segments (Llama's q, k, v), at offsets in multiples of 4 (the four-element
/// update) and odd ones (the one-element update); a weight not cached leaves its amax and no codes.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn adamw_fp8_codes() {
    gpu::check(|be, rng, rep| {
        if let Err(why) = be.fp8_support() {
            rep.check("adamw fp8 codes", "skipped", true, &why);
            return Ok(());
        }
        // (inputs c, outputs oc) of each layer; layers 0..3 cached, layer 3 not.
        let weights = vec![(256usize, 272usize), (1616, 256), (256, 384), (256, 128)];
        let layers = Fp8Layers {
            largest: LinearExtent::of(64, &weights),
            weights: weights.clone(),
            cached_layers: 3,
            ..Fp8Layers::default()
        }
        .with_step_codes(true);
        for (tag, odd) in [("offsets by 4", false), ("layers 1 and 3 at odd offsets", true)] {
            let cpu = CpuBackend::new();
            cpu.prepare_fp8(&layers)?;
            be.prepare_fp8(&layers)?;
            // Segments: a bias, layer 0, layer 2 as q, k, v (256 + 64 + 64 rows), a bias,
            // layer 1, layer 3 (uncached).
            let mut segs = Vec::new();
            let mut at = 8usize;
            let mut seg = |len: usize, fp8_layer: Option<usize>, decay: bool, segs: &mut Vec<AdamWSegment>| {
                segs.push(AdamWSegment { poff: at, moff: at, goff: at, len, decay, fp8_layer });
                at += len;
            };
            seg(272, None, false, &mut segs);
            seg(256 * 272, Some(0), true, &mut segs);
            for rows in [256, 64, 64] {
                seg(rows * 256, Some(2), true, &mut segs);
            }
            seg(if odd { 13 } else { 16 }, None, false, &mut segs);
            seg(1616 * 256, Some(1), true, &mut segs);
            seg(256 * 128, Some(3), true, &mut segs);
            let len = at;
            let coded: &[usize] = &[0, 1, 2];
            let mut master = rng.vec(len, 0.5);
            let mut m0 = rng.vec(len, 0.01);
            let mut v0: Vec<f32> = rng.vec(len, 0.01).iter().map(|x| x * x).collect();
            let mut pc = vec![0.0; len];
            let mut pg = poisoned_buf(be, len)?;
            let (mut wg, mut mg, mut vg) = (up_f32(be, &master)?, up_f32(be, &m0)?, up_f32(be, &v0)?);
            // Each weight's amax the step before (none: 0, whose scale is 1), and the counts
            // the predictions should have reached.
            let mut last = [0.0f32; 3];
            let mut counts_want = (0u64, 0u64);
            for step in 1..=3u64 {
                if step == 3 {
                    // The weights jump: every prediction from step 2 is wrong.
                    master = be.download_f32(&wg, Loc::new(0, len))?.iter().map(|x| x * 8.0).collect();
                    m0 = be.download_f32(&mg, Loc::new(0, len))?;
                    v0 = be.download_f32(&vg, Loc::new(0, len))?;
                    wg = up_f32(be, &master)?;
                }
                let g = rng.vec(len, 0.1);
                let gg = up_grad(be, &g)?;
                let h = AdamWStep {
                    lr: 1e-3,
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                    weight_decay: 0.1,
                    t: step,
                    grad_scale: 0.7,
                };
                let (mut wc, mut mc, mut vc) = (master.clone(), m0.clone(), v0.clone());
                let t = AdamWTensors { params: Some(&mut pc), master: &mut wc, m: &mut mc, v: &mut vc, grads: &g };
                cpu.adamw(t, &segs, h)?;
                let t = AdamWTensors { params: Some(&mut pg), master: &mut wg, m: &mut mg, v: &mut vg, grads: &gg };
                be.adamw(t, &segs, h)?;
                be.fp8_weights_changed(true);
                let op = format!("adamw fp8 codes ({tag}), step {step}");
                let r = Loc::new(8, len - 8);
                rep.same_bits(&op, "master", &be.download_f32(&wg, r)?, &wc[8..]);
                rep.same_bits(&op, "m", &be.download_f32(&mg, r)?, &mc[8..]);
                rep.same_bits(&op, "v", &be.download_f32(&vg, r)?, &vc[8..]);
                rep.same_bits(&op, "params(bf16)", &be.download_buf(&pg, r)?, &bf16_rounded(&pc[8..]));
                (master, m0, v0) = (
                    be.download_f32(&wg, Loc::new(0, len))?,
                    be.download_f32(&mg, Loc::new(0, len))?,
                    be.download_f32(&vg, Loc::new(0, len))?,
                );
                for (l, &(c, oc)) in weights.iter().enumerate() {
                    let start = segs.iter().find(|s| s.fp8_layer == Some(l)).map_or(0, |s| s.poff);
                    let want = be.fp8_cast_check(&pg, start, oc, c, Fp8Format::E4M3)?;
                    let left = be.fp8_weight_slot_amax(l)?;
                    let what = format!("layer {l}");
                    rep.same_bits(&op, &format!("{what}: amax left"), &[left], &[want.amax]);
                    if l >= 3 {
                        continue;
                    }
                    let got = be.fp8_cached_weight_read(l)?;
                    let by_step = coded.contains(&l);
                    let fmt = Fp8Format::E4M3;
                    if by_step {
                        let right = fmt.scale(last[l]).to_bits() == fmt.scale(want.amax).to_bits();
                        if right {
                            counts_want.0 += 1;
                        } else {
                            counts_want.1 += 1;
                        }
                    }
                    last[l] = want.amax;
                    rep.check(
                        &op,
                        &format!("{what}: codes of this version"),
                        got.current == by_step,
                        &format!("current {}", got.current),
                    );
                    if !by_step {
                        continue;
                    }
                    rep.same_bits(&op, &format!("{what}: inverse scale"), &[got.inv_scale], &[want.inv_scale]);
                    let bad = got.codes.iter().zip(&want.codes).filter(|(a, b)| a != b).count();
                    rep.check(&op, &format!("{what}: codes"), bad == 0, &format!("{bad} of {} differ", c * oc));
                    let bad_t = got.codes_t.iter().zip(&want.codes_t).filter(|(a, b)| a != b).count();
                    rep.check(
                        &op,
                        &format!("{what}: transposed codes"),
                        bad_t == 0,
                        &format!("{bad_t} of {} differ", c * oc),
                    );
                }
                // Step 1 has no prediction (wrong), step 2 predicts from step 1 (most likely
                // right), step 3 after the jump (wrong).
                let counts = be.fp8_prediction_counts()?.map(|c| c.weights);
                let what = "weights' predictions (right, wrong)";
                rep.check(&op, what, counts == Some(counts_want), &format!("{counts:?} vs {counts_want:?}"));
                if step == 3 {
                    let n = coded.len() as u64;
                    rep.check(&op, "wrong at steps 1 and 3", counts_want.1 >= 2 * n, &format!("{counts_want:?}"));
                }
            }
            // A version not begun by the step drops the step's codes.
            be.fp8_weights_changed(false);
            for &l in coded {
                let got = be.fp8_cached_weight_read(l)?;
                rep.check(
                    &format!("adamw fp8 codes ({tag})"),
                    &format!("layer {l} stale after a load"),
                    !got.current,
                    "",
                );
            }
        }
        Ok(())
    });
}

/// `xs` rounded to bf16 (nearest even), as f32.
fn bf16_rounded(xs: &[f32]) -> Vec<f32> {
    xs.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Memory and copies, and the on-device sums.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn memory_and_reduce() {
    gpu::check(|be, rng, rep| {
        let n = 1_000_003usize;
        let x = rng.vec(n, 1.0);
        let y = rng.vec(n, 1.0);
        let (gx, gy) = (up_f32(be, &x)?, up_f32(be, &y)?);
        let mut b = poisoned_buf(be, n + 9)?;
        // At element 9 (an unaligned destination: the one-element path) and at 8 (the
        // four-element path, with n % 4 = 3 elements of tail).
        be.cast_to_buf(&mut b, 9, &gx, Loc::new(0, n))?;
        rep.cmp("cast_to_buf", "out", &be.download_buf(&b, Loc::new(9, n))?, &x, TOL_BF16);
        let mut b4 = poisoned_buf(be, n + 8)?;
        be.cast_to_buf(&mut b4, 8, &gx, Loc::new(0, n))?;
        rep.same_bits(
            "cast_to_buf aligned",
            "vs one-element",
            &be.download_buf(&b4, Loc::new(8, n))?,
            &be.download_buf(&b, Loc::new(9, n))?,
        );
        let mut b2 = be.alloc_buf(n, "")?;
        be.copy_buf(&mut b2, 0, &b, Loc::new(9, n))?;
        rep.cmp("copy_buf", "out", &be.download_buf(&b2, Loc::all(n))?, &x, TOL_BF16);
        be.zero_buf(&mut b2, Loc::new(1, n - 2))?;
        let z = be.download_buf(&b2, Loc::all(n))?;
        rep.check("zero_buf", "out", z[1..n - 1].iter().all(|&v| v == 0.0) && z[0] != 0.0, "");
        let mut acc = up_grad(be, &x)?;
        be.add_grad(&mut acc, 0, &gy, Loc::new(0, n))?;
        let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        rep.cmp("add_grad", "out", &be.download_grad(&acc, Loc::all(n))?, &want, 1e-7);
        // From element 1 of the source (unaligned: the one-element path).
        let mut acc1 = up_grad(be, &x[..n - 1])?;
        be.add_grad(&mut acc1, 0, &gy, Loc::new(1, n - 1))?;
        let want1: Vec<f32> = x.iter().zip(&y[1..]).map(|(a, b)| a + b).collect();
        rep.cmp("add_grad (unaligned)", "out", &be.download_grad(&acc1, Loc::all(n - 1))?, &want1, 1e-7);
        let mut slots = be.alloc_f32(4, "")?;
        be.grad_sumsq_into(&gx, Loc::new(3, n - 3), &mut slots, 1)?;
        let got = F64Pair::join(&be.download_f32(&slots, Loc::new(2, 2))?);
        let want: f64 = x[3..].iter().map(|&v| v as f64 * v as f64).sum();
        rep.cmp("grad_sumsq_into", "sum", &[got as f32], &[want as f32], 1e-6);
        // sum_into accumulates: two calls give twice the sum.
        be.upload_f32(&[0.0, 0.0], &mut slots, 0)?;
        be.sum_into(&gx, Loc::new(3, n - 3), &mut slots, 0)?;
        be.sum_into(&gx, Loc::new(3, n - 3), &mut slots, 0)?;
        let got = F64Pair::join(&be.download_f32(&slots, Loc::new(0, 2))?);
        let want: f64 = 2.0 * x[3..].iter().map(|&v| v as f64).sum::<f64>();
        rep.cmp("sum_into", "sum", &[got as f32], &[want as f32], 1e-6);
        Ok(())
    });
}

/// The FP8 casts against `backend/fp8.rs`, code for code: the amax, the power-of-two scale
/// the cast writes for the GEMM, and every code of the row-major and transposed casts, for
/// e4m3 and e5m2, on a normal tensor, one whose values reach the formats' subnormals, one at
/// an odd (unaligned) offset, zeros, and one holding a NaN (its scale is NaN, so it reaches
/// the loss).
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn fp8_casts() {
    gpu::check(|be, rng, rep| {
        if let Err(why) = be.fp8_support() {
            rep.check("fp8 casts", "skipped", true, &why);
            return Ok(());
        }
        for fmt in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for &(rows, cols, off, scale, what) in &[
                (256usize, 768usize, 0usize, 1.0f32, "normal"),
                // Tiles of 128 rows × 64 columns cut short on both sides (2 and 25 full ones).
                (272, 1616, 0, 1.0, "ragged tiles"),
                (64, 48, 3, 1.0, "offset 3"),
                (80, 2048, 0, 1e-3, "small"),
                (48, 32, 0, 0.0, "zeros"),
                (32, 64, 0, f32::NAN, "NaN"),
            ] {
                let tag = format!("fp8 cast {fmt:?} {rows}x{cols} {what}");
                let n = rows * cols;
                let mut x = match what {
                    "zeros" => vec![0.0; off + n],
                    "NaN" => rng.vec(off + n, 1.0),
                    _ => rng.vec(off + n, scale),
                };
                if what == "NaN" {
                    x[off + 77] = f32::NAN;
                }
                // A spread of magnitudes: some values land in the format's subnormals.
                if what == "small" {
                    for (i, v) in x.iter_mut().enumerate() {
                        *v = half::bf16::from_f32(*v * 2f32.powi(-((i % 24) as i32))).to_f32();
                    }
                }
                let xs = &x[off..];
                let amax = trainer::backend::fp8::amax(xs);
                let s = fmt.scale(amax);
                let got = be.fp8_cast_check(&up_buf(be, &x)?, off, rows, cols, fmt)?;
                let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                rep.check(&tag, "amax", same(got.amax, amax), &format!("{} vs {amax}", got.amax));
                rep.check(
                    &tag,
                    "inverse scale",
                    same(got.inv_scale, 1.0 / s),
                    &format!("{} vs {}", got.inv_scale, 1.0 / s),
                );
                if s.is_nan() {
                    let all_nan = got.codes.iter().all(|&c| fmt.decode(c).is_nan());
                    rep.check(&tag, "codes", all_nan, "every code NaN");
                    continue;
                }
                let want: Vec<u8> = xs.iter().map(|&v| fmt.encode(v * s)).collect();
                let bad = got.codes.iter().zip(&want).filter(|(a, b)| a != b).count();
                rep.check(&tag, "codes", bad == 0, &format!("{bad} of {n} differ"));
                let bad_beside = got.codes_beside_t.iter().zip(&want).filter(|(a, b)| a != b).count();
                rep.check(&tag, "codes (transposing cast)", bad_beside == 0, &format!("{bad_beside} of {n} differ"));
                let bad_t = (0..rows * cols)
                    .filter(|&k| {
                        let (c, r) = (k / rows, k % rows);
                        got.codes_t[k] != want[r * cols + c]
                    })
                    .count();
                rep.check(&tag, "transposed codes", bad_t == 0, &format!("{bad_t} of {n} differ"));
                // Its column sums (the fused bias gradient), in the kernel's order: each 4-row
                // group's ((x0 + x1) + x2) + x3, then the groups of a tile from the first.
                let tile = trainer::backend::cuda::FP8_COLSUM_ROWS;
                let bf = |v: f32| bf16::from_f32(v).to_f32();
                let mut sums = Vec::with_capacity(rows.div_ceil(tile) * cols);
                for t0 in (0..rows).step_by(tile) {
                    for c in 0..cols {
                        let mut acc = 0f32;
                        for g in (t0..(t0 + tile).min(rows)).step_by(4) {
                            let v = |i: usize| bf(xs[(g + i) * cols + c]);
                            acc += ((v(0) + v(1)) + v(2)) + v(3);
                        }
                        sums.push(acc);
                    }
                }
                rep.same_bits(&tag, "column sums (transposing cast)", &got.col_sums, &sums);
            }
        }
        Ok(())
    });
}

/// The transposing cast that predicts its scale (`cuda/fp8.rs`, `Cast::predicted`: the cast
/// with the predicted scale, finding the amax as it goes, then the check that casts again
/// with the scale of that amax where the prediction was wrong) gives the bits of the GPU's
/// own composition: the op that writes the tensor (nothing, `gelu_fwd`, `gelu_bwd`), then its
/// amax and the cast of it (`fp8_cast_check`): the amax, the inverse scale, both layouts'
/// codes and the column sums; for a prediction right, 4× and ¼ the scale (wrong both ways:
/// codes saturated or too coarse until cast again), none, and through a reference amax (one
/// that moved as the tensor did, one that did not); e4m3 and e5m2, whole and ragged tiles.
/// The prediction left is the amax found (and the reference's), and the counts move.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn fp8_predicted_casts() {
    use trainer::backend::cuda::{CheckedPrediction, PredictedInput};
    gpu::check(|be, rng, rep| {
        if let Err(why) = be.fp8_support() {
            rep.check("fp8 predicted casts", "skipped", true, &why);
            return Ok(());
        }
        for fmt in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for (rows, cols) in [(256usize, 768usize), (272, 1616)] {
                let n = rows * cols;
                // pre: GELU's pre-activation.
                let (x, pre) = (rng.vec(n, 1.0), rng.vec(n, 2.0));
                let (xb, preb) = (up_buf(be, &x)?, up_buf(be, &pre)?);
                for what in ["plain", "gelu", "dgelu"] {
                    // The composition: the tensor written, then cast with its amax.
                    let mut written = up_buf(be, &vec![0.0; n])?;
                    match what {
                        "plain" => written = up_buf(be, &x)?,
                        "gelu" => be.gelu_fwd(&mut written, &xb, n, None)?,
                        _ => {
                            written = up_buf(be, &x)?;
                            be.gelu_bwd(&mut written, &preb, n, None)?;
                        }
                    }
                    let want = be.fp8_cast_check(&written, 0, rows, cols, fmt)?;
                    let s = fmt.scale(want.amax);
                    let (made, read) = match what {
                        "plain" => (PredictedInput::Plain, &xb),
                        "gelu" => (PredictedInput::Gelu, &xb),
                        _ => (PredictedInput::Dgelu(&preb), &xb),
                    };
                    // (the amax last time, the reference's then, and now): right, the scale
                    // 4× too large and 4× too small, none, and through a reference that moved
                    // as the tensor did (right) and one that moved 16× more (wrong).
                    let a = want.amax;
                    let cases = [
                        ("right", a, 0.0, None),
                        ("4x scale", a / 4.0, 0.0, None),
                        ("scale / 4", a * 4.0, 0.0, None),
                        ("none", 0.0, 0.0, None),
                        ("by a reference", a * 8.0, 8.0, Some(1.0f32)),
                        ("by a reference that moved more", a, 1.0, Some(16.0f32)),
                    ];
                    for (pname, last_amax, last_ref, ref_now) in cases {
                        let tag = format!("fp8 predicted cast {fmt:?} {rows}x{cols} {what}, prediction {pname}");
                        let p = CheckedPrediction { last_amax, last_ref, ref_now };
                        let (got, after) = be.fp8_predicted_cast_check(read, made, (rows, cols), fmt, p)?;
                        rep.same_bits(&tag, "amax", &[got.amax], &[want.amax]);
                        rep.same_bits(&tag, "inverse scale", &[got.inv_scale], &[want.inv_scale]);
                        let bad = got.codes_beside_t.iter().zip(&want.codes_beside_t).filter(|(a, b)| a != b).count();
                        rep.check(&tag, "codes", bad == 0, &format!("{bad} of {n} differ"));
                        let bad_t = got.codes_t.iter().zip(&want.codes_t).filter(|(a, b)| a != b).count();
                        rep.check(&tag, "transposed codes", bad_t == 0, &format!("{bad_t} of {n} differ"));
                        rep.same_bits(&tag, "column sums", &got.col_sums, &want.col_sums);
                        // The kernel's prediction, in its order of operations.
                        let predicted = match ref_now {
                            Some(now) if last_ref > 0.0 => last_amax * (now / last_ref),
                            _ => last_amax,
                        };
                        let right = u32::from(fmt.scale(predicted).to_bits() == s.to_bits());
                        let expect_right = matches!(pname, "right" | "by a reference");
                        rep.check(&tag, "prediction as meant", (right == 1) == expect_right, &format!("right {right}"));
                        let want_after = [a.to_bits(), right, 1 - right, ref_now.map_or(0, f32::to_bits)];
                        rep.check(
                            &tag,
                            "prediction left, counts",
                            after == want_after,
                            &format!("{after:?} vs {want_after:?}"),
                        );
                    }
                }
            }
        }
        Ok(())
    });
}

/// The FP8 GEMMs of a linear layer (`Precision::Fp8`) against the CPU's simulation of the
/// same rounding (`cpu/matmul.rs`): forward with and without bias, with the residual and
/// with GELU in the epilogue (or composed where cuBLASLt has no FP8 epilogue), both backward
/// GEMMs added to random gradients and written over NaN (fresh), through GELU' too, and
/// repeated for the same bits. Both backends quantize the same bf16 values with the same
/// power-of-two scales, so the FP8 operands are identical: the differences are the
/// accumulation (fast accumulation in the forward) and the bf16 outputs, within the bf16
/// tolerances; dW (fp32) within 1e-3. Each output is also checked to differ from the
/// bf16 GEMM's by more than that (the layer really ran in FP8).
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
#[allow(clippy::too_many_lines)] // a test: every FP8 GEMM path checked in turn, read top to bottom
fn matmul_fp8() {
    gpu::check(|be, rng, rep| {
        if let Err(why) = be.fp8_support() {
            rep.check("matmul fp8", "skipped", true, &why);
            return Ok(());
        }
        let cpu = CpuBackend::new();
        let shapes = [
            (256usize, 768usize, 2304usize, true),
            (256, 3072, 768, true),
            (512, 2048, 3072, false),
            (128, 4096, 14336 / 4, false),
            (48, 64, 96, true),
        ];
        let weights: Vec<(usize, usize)> = shapes.iter().map(|&(_, c, oc, _)| (c, oc)).collect();
        let cached_layers = weights.len();
        let layers =
            Fp8Layers { largest: LinearExtent::of(512, &weights), weights, cached_layers, ..Fp8Layers::default() };
        be.prepare_fp8(&layers)?;
        for (k, &(n, c, oc, bias)) in shapes.iter().enumerate() {
            let tag = format!("matmul fp8 N{n} C{c} OC{oc}{}", if bias { " bias" } else { "" });
            let s = MatShape { n, c, oc };
            let at = LinearLocs::new(Loc::new(0, oc * c), bias.then(|| Loc::new(oc * c, oc)));
            let at8 = at.with_precision(Precision::Fp8);
            let plen = oc * c + if bias { oc } else { 0 };
            let params = rng.vec(plen, 0.05);
            let inp = rng.vec(n * c, 1.0);
            let (gp, gi) = (up_buf(be, &params)?, up_buf(be, &inp)?);
            let (mut outc, mut out16) = (vec![0.0; n * oc], vec![0.0; n * oc]);
            cpu.matmul_fwd(&mut outc, &inp, Weights::new(&params, at8), s)?;
            cpu.matmul_fwd(&mut out16, &inp, Weights::new(&params, at), s)?;
            let mut outg = poisoned_buf(be, n * oc)?;
            be.matmul_fwd(&mut outg, &gi, Weights::new(&gp, at8), s)?;
            let got = be.download_buf(&outg, Loc::all(n * oc))?;
            rep.cmp(&format!("{tag} fwd"), "out", &got, &outc, TOL_BF16);
            let off16 = rel(&got, &out16);
            rep.check(
                &format!("{tag} fwd"),
                "is fp8",
                off16 > rel(&got, &outc),
                &format!("rel to bf16 GEMM {off16:.2e}"),
            );
            // Residual in the epilogue (C), and GELU (aux = pre-activation).
            let res = rng.vec(n * oc, 1.0);
            let (mut outrc, mut tmpc) = (vec![0.0; n * oc], vec![0.0; n * oc]);
            cpu.matmul_residual_fwd(&mut outrc, &res, &inp, Weights::new(&params, at8), s, &mut tmpc)?;
            let (gres, mut tmpg, mut outrg) = (up_buf(be, &res)?, poisoned_buf(be, n * oc)?, poisoned_buf(be, n * oc)?);
            be.matmul_residual_fwd(&mut outrg, &gres, &gi, Weights::new(&gp, at8), s, &mut tmpg)?;
            rep.cmp(
                &format!("{tag} fwd + residual"),
                "out",
                &be.download_buf(&outrg, Loc::all(n * oc))?,
                &outrc,
                TOL_BF16,
            );
            if bias {
                let (mut prec, mut actc) = (vec![0.0; n * oc], vec![0.0; n * oc]);
                cpu.matmul_gelu_fwd(&mut prec, &mut actc, &inp, Weights::new(&params, at8), s, None)?;
                let (mut preg, mut actg) = (poisoned_buf(be, n * oc)?, poisoned_buf(be, n * oc)?);
                be.matmul_gelu_fwd(&mut preg, &mut actg, &gi, Weights::new(&gp, at8), s, None)?;
                rep.cmp(
                    &format!("{tag} fwd + gelu"),
                    "pre",
                    &be.download_buf(&preg, Loc::all(n * oc))?,
                    &prec,
                    TOL_BF16,
                );
                rep.cmp(
                    &format!("{tag} fwd + gelu"),
                    "gelu",
                    &be.download_buf(&actg, Loc::all(n * oc))?,
                    &actc,
                    TOL_BF16,
                );
            }
            let dout = rng.vec(n * oc, 1e-3);
            let gdo = up_buf(be, &dout)?;
            for fresh in [false, true] {
                let tag = format!("{tag} bwd{}", if fresh { " fresh" } else { "" });
                let g0 = rng.vec(plen, 0.01);
                let (mut dic, mut gc) = (vec![0.0; n * c], g0.clone());
                cpu.matmul_bwd(
                    &mut dic,
                    WeightGrads { buf: &mut gc, at: at8, fresh },
                    &dout,
                    &inp,
                    Weights::new(&params, at8),
                    s,
                )?;
                let (mut di16, mut g16) = (vec![0.0; n * c], g0.clone());
                cpu.matmul_bwd(
                    &mut di16,
                    WeightGrads { buf: &mut g16, at, fresh },
                    &dout,
                    &inp,
                    Weights::new(&params, at),
                    s,
                )?;
                let gpu0 = if fresh { vec![f32::NAN; plen] } else { g0.clone() };
                let run = || -> BResult<(Vec<f32>, Vec<f32>)> {
                    let (mut dig, mut gg) = (poisoned_buf(be, n * c)?, up_grad(be, &gpu0)?);
                    let wg = WeightGrads { buf: &mut gg, at: at8, fresh };
                    be.matmul_bwd(&mut dig, wg, &gdo, &gi, Weights::new(&gp, at8), s)?;
                    Ok((be.download_buf(&dig, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(plen))?))
                };
                let (di1, g1) = run()?;
                rep.cmp(&tag, "dinp", &di1, &dic, TOL_BF16);
                // The weight gradient alone (what this step added), so a large g0 cannot hide it.
                let added = |g: &[f32]| -> Vec<f32> {
                    g[..oc * c].iter().zip(&g0).map(|(a, b)| if fresh { *a } else { a - b }).collect()
                };
                rep.cmp(&tag, "dW", &added(&g1), &added(&gc), 1e-3);
                let off16 = rel(&added(&g1), &added(&g16));
                rep.check(&tag, "dW is fp8", off16 > 1e-3, &format!("rel to bf16 GEMM {off16:.2e}"));
                if bias {
                    rep.cmp(&tag, "dbias", &g1[oc * c..], &gc[oc * c..], TOL_F32);
                }
                let (di2, g2) = run()?;
                rep.same_bits(&tag, "repeat", &[di2, g2].concat(), &[di1, g1].concat());
            }
            // The backward's other recipes (`train.fp8_grad_format`, `train.fp8_weight_grad`)
            // against the CPU's: e4m3 dY (e4m3 × e4m3 GEMMs), dW from the bf16 operands, both.
            for backward in Fp8Backward::ALTERNATIVES {
                let tag = format!("{tag} bwd {:?} {:?}", backward.grad, backward.weight_grad);
                let recipe = layers.clone().with_backward(backward);
                let cpu_r = CpuBackend::new();
                cpu_r.prepare_fp8(&recipe)?;
                be.prepare_fp8(&recipe)?;
                let (mut dic, mut gc) = (vec![0.0; n * c], vec![0.0; plen]);
                let wg = WeightGrads { buf: &mut gc, at: at8, fresh: true };
                cpu_r.matmul_bwd(&mut dic, wg, &dout, &inp, Weights::new(&params, at8), s)?;
                let (mut dig, mut gg) = (poisoned_buf(be, n * c)?, up_grad(be, &vec![f32::NAN; plen])?);
                let wg = WeightGrads { buf: &mut gg, at: at8, fresh: true };
                be.matmul_bwd(&mut dig, wg, &gdo, &gi, Weights::new(&gp, at8), s)?;
                let (dig, gg) = (be.download_buf(&dig, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(plen))?);
                rep.cmp(&tag, "dinp", &dig, &dic, TOL_BF16);
                rep.cmp(&tag, "dW", &gg[..oc * c], &gc[..oc * c], 1e-3);
                if bias {
                    rep.cmp(&tag, "dbias", &gg[oc * c..], &gc[oc * c..], TOL_F32);
                }
            }
            be.prepare_fp8(&layers)?;
            // The same layer with its FP8 state (layer k): the weight cached in both layouts,
            // the input's scale kept from the forward for the backward. Bit for bit the
            // per-use path's, and the cache follows a parameter change.
            {
                let tag = format!("{tag} cached");
                let at8c = at8.with_fp8_index(k);
                let g0 = rng.vec(plen, 0.01);
                let mut gp = up_buf(be, &params)?;
                let pass = |at: LinearLocs,
                            gp: &<CudaBackend as Device>::Buf,
                            x: &<CudaBackend as Device>::Buf|
                 -> BResult<Vec<f32>> {
                    let mut out = poisoned_buf(be, n * oc)?;
                    be.matmul_fwd(&mut out, x, Weights::new(gp, at), s)?;
                    let (mut di, mut gg) = (poisoned_buf(be, n * c)?, up_grad(be, &g0)?);
                    be.matmul_bwd(&mut di, WeightGrads::new(&mut gg, at), &gdo, x, Weights::new(gp, at), s)?;
                    let out = be.download_buf(&out, Loc::all(n * oc))?;
                    Ok([out, be.download_buf(&di, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(plen))?].concat())
                };
                let want = pass(at8, &gp, &gi)?;
                rep.same_bits(&tag, "fwd + bwd vs per use", &pass(at8c, &gp, &gi)?, &want);
                rep.same_bits(&tag, "again, from the cache", &pass(at8c, &gp, &gi)?, &want);
                // New weights in the same buffer: stale codes until the version changes.
                let params2: Vec<f32> = params.iter().map(|x| -1.5 * x).collect();
                be.upload_buf(&params2, &mut gp, 0)?;
                be.fp8_weights_changed(false);
                let want2 = pass(at8, &gp, &gi)?;
                rep.same_bits(&tag, "after a parameter change", &pass(at8c, &gp, &gi)?, &want2);
                // Keyed by the version, not the buffer (stage 3 gathers into pooled ones).
                let gp_other = up_buf(be, &params2)?;
                rep.same_bits(&tag, "the same weight in another buffer", &pass(at8c, &gp_other, &gi)?, &want2);
                // A backward whose input is not the forward's takes its own scale.
                let inp2: Vec<f32> = inp.iter().map(|x| 3.0 * x).collect();
                let gi2 = up_buf(be, &inp2)?;
                let mut out = poisoned_buf(be, n * oc)?;
                be.matmul_fwd(&mut out, &gi, Weights::new(&gp, at8c), s)?;
                let bwd = |at: LinearLocs| -> BResult<Vec<f32>> {
                    let (mut di, mut gg) = (poisoned_buf(be, n * c)?, up_grad(be, &g0)?);
                    be.matmul_bwd(&mut di, WeightGrads::new(&mut gg, at), &gdo, &gi2, Weights::new(&gp, at), s)?;
                    Ok([be.download_buf(&di, Loc::all(n * c))?, be.download_grad(&gg, Loc::all(plen))?].concat())
                };
                rep.same_bits(&tag, "bwd of another input", &bwd(at8c.input_recomputed())?, &bwd(at8)?);
                // Without the cache (ZeRO-3, or fp8_weight_cache = false): the layer keeps its
                // weight's amax for the version's later uses, which only cast (from any buffer:
                // stage 3 gathers into pooled ones); bit for bit the per-use path, also after a
                // parameter change.
                be.prepare_fp8(&Fp8Layers { cached_layers: 0, ..layers.clone() })?;
                let tag = tag.replace("cached", "uncached, amax kept");
                rep.same_bits(&tag, "fwd + bwd vs per use", &pass(at8c, &gp, &gi)?, &want2);
                rep.same_bits(&tag, "again, amax kept", &pass(at8c, &gp, &gi)?, &want2);
                let params3: Vec<f32> = params.iter().map(|x| 0.25 * x).collect();
                be.upload_buf(&params3, &mut gp, 0)?;
                be.fp8_weights_changed(false);
                let want3 = pass(at8, &gp, &gi)?;
                rep.same_bits(&tag, "after a parameter change", &pass(at8c, &gp, &gi)?, &want3);
                let gp2 = up_buf(be, &params3)?;
                rep.same_bits(&tag, "the same weight in another buffer", &pass(at8c, &gp2, &gi)?, &want3);
                be.prepare_fp8(&layers)?;
            }
            // Through GELU': the layer's input is GELU(pre) (an FP8 layer composes it: the
            // GEMM, then GELU' as a kernel of its own).
            if bias {
                let tag = format!("{tag} bwd dgelu");
                let pre = rng.vec(n * c, 1.0);
                let mut act = vec![0.0; n * c];
                cpu.gelu_fwd(&mut act, &pre, n * c, None)?;
                act.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
                let g0 = rng.vec(plen, 0.01);
                let (mut dpc, mut gc) = (vec![0.0; n * c], g0.clone());
                let x = GeluInput { act: Some(&act), pre: &pre, dpre_amax: None };
                cpu.matmul_bwd_dgelu(
                    &mut dpc,
                    WeightGrads { buf: &mut gc, at: at8, fresh: false },
                    &dout,
                    x,
                    Weights::new(&params, at8),
                    s,
                )?;
                let (mut dpg, gact, gpre, mut gg) =
                    (poisoned_buf(be, n * c)?, up_buf(be, &act)?, up_buf(be, &pre)?, up_grad(be, &g0)?);
                let x = GeluInput { act: Some(&gact), pre: &gpre, dpre_amax: None };
                let wg = WeightGrads { buf: &mut gg, at: at8, fresh: false };
                be.matmul_bwd_dgelu(&mut dpg, wg, &gdo, x, Weights::new(&gp, at8), s)?;
                rep.cmp(&tag, "dpre", &be.download_buf(&dpg, Loc::all(n * c))?, &dpc, TOL_BF16);
                let g1 = be.download_grad(&gg, Loc::all(plen))?;
                let added = |g: &[f32]| -> Vec<f32> { g[..oc * c].iter().zip(&g0).map(|(a, b)| a - b).collect() };
                rep.cmp(&tag, "dW", &added(&g1), &added(&gc), 1e-3);
            }
        }
        Ok(())
    });
}

/// ‖a − b‖ / ‖b‖.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// `train.precision = "fp8"` is refused, naming the GPU and its compute capability, on a GPU
/// before Hopper; on Hopper and later it is accepted and `prepare_fp8` reserves the workspace
/// the planner predicts.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn fp8_is_refused_before_hopper_and_sized_as_planned() {
    gpu::check(|be, _rng, rep| {
        let e = LinearExtent::of(1024, &[(768, 2304), (3072, 768)]);
        match be.fp8_support() {
            Ok(()) => {
                for cached_blocks in [0, 2, 3] {
                    let layers = Fp8Layers::blocks(1024, &[(768, 2304), (3072, 768)], 3, cached_blocks);
                    let bytes = be.prepare_fp8(&layers)?;
                    let want = trainer::backend::fp8::CudaFp8WeightCache::reserved(&layers);
                    rep.check(
                        "fp8 support",
                        "bytes reserved",
                        bytes == want,
                        &format!("{bytes:?} vs planned {want:?}"),
                    );
                }
            }
            Err(why) => {
                let named = why.contains(&be.name()) && why.contains("compute capability");
                rep.check("fp8 support", "refused", named, &why);
                let layers = Fp8Layers { largest: e, ..Fp8Layers::default() };
                rep.check("fp8 support", "prepare refuses too", be.prepare_fp8(&layers).is_err(), "");
            }
        }
        Ok(())
    });
}

/// ZeRO-3's FP8 gathers (`backend/fp8_gather.rs`) against the CPU, value for value: each
/// rank's amaxes of its parts, every rank's piece packed (into one buffer, as the all-gather
/// leaves them) and expanded, at 2 and 3 ranks over a GPT-2 block of width 64 and one of
/// width 1600 (pieces cutting weights, norms and biases anywhere), outputs over NaN.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn fp8_gather() {
    gpu::check(|be, rng, rep| {
        if let Err(why) = be.fp8_support() {
            rep.check("fp8 gather", "skipped", true, &why);
            return Ok(());
        }
        let cpu = CpuBackend::new();
        for c in [64usize, 1600] {
            let mut at = 0;
            let mut t = |n: usize| {
                let l = Loc::new(at, n);
                at += n;
                l
            };
            let ts = [
                t(c),
                t(c),
                t(3 * c * c),
                t(3 * c),
                t(c * c),
                t(c),
                t(c),
                t(c),
                t(4 * c * c),
                t(4 * c),
                t(4 * c * c),
                t(c),
            ];
            let fp8 = [ts[2], ts[4], ts[8], ts[10]];
            let numel = at;
            for world in [2usize, 3] {
                let shard = numel.div_ceil(world).div_ceil(8) * 8;
                let tag = format!("fp8 gather C{c} world {world}");
                let (gl, cl) = match (
                    Fp8GatherLayout::new(&ts, &fp8, shard, world, 2),
                    Fp8GatherLayout::new(&ts, &fp8, shard, world, 4),
                ) {
                    (Some(g), Some(c)) => (g, c),
                    _ => return Err(BackendError::Device(format!("{tag}: no layout"))),
                };
                let mut x = rng.vec(shard * world, 0.05);
                x[numel..].fill(0.0);
                let gx = up_buf(be, &x)?;
                let x = be.download_buf(&gx, Loc::all(x.len()))?; // the bf16 values both see
                let mut amax = vec![0f32; gl.slots];
                for r in 0..world {
                    let parts = gl.fp8_parts(r);
                    let locs: Vec<Loc> = parts.iter().map(|p| p.1).collect();
                    let (g, want) = (be.amax_parts(&gx, &locs)?, cpu.amax_parts(&x, &locs)?);
                    rep.same_bits(&tag, &format!("amax rank {r}"), &g, &want);
                    for ((slot, _), a) in parts.iter().zip(want) {
                        amax[*slot] = amax[*slot].max(a);
                    }
                }
                let (gamax, camax) = (up_f32(be, &amax)?, amax.clone());
                let mut gp = poisoned_buf(be, gl.buffer_elems())?;
                let mut cp = vec![0f32; cl.buffer_elems()];
                for r in 0..world {
                    be.fp8_gather_pack(&gl, r, &gamax, &gx, &mut gp)?;
                    cpu.fp8_gather_pack(&cl, r, &camax, &x, &mut cp)?;
                }
                let mut gout = poisoned_buf(be, shard * world)?;
                be.fp8_gather_unpack(&gl, &gamax, &gp, &mut gout)?;
                let mut cout = vec![f32::NAN; shard * world];
                cpu.fp8_gather_unpack(&cl, &camax, &cp, &mut cout)?;
                rep.same_bits(&tag, "expanded", &be.download_buf(&gout, Loc::all(shard * world))?, &cout);
                let moved = gl.buffer_elems() * 2;
                rep.check(
                    &tag,
                    "bytes",
                    10 * moved < 6 * numel * 2,
                    &format!("{moved} bytes against {} in bf16", numel * 2),
                );
            }
        }
        Ok(())
    });
}
