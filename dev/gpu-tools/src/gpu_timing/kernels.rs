//! `gpu-timing attention`, `layernorm` and `llama`: single kernels' tables.

use crate::timer::*;
use cudarc::driver::CudaSlice;
use half::bf16;
use trainer::backend::cuda::AttentionImpl;
use trainer::backend::cuda::CudaBackend;
use trainer::backend::*;

/// Attention alone at every tensor-core head size: fwd and bwd TFLOP/s (causal: half of
/// the T x T products per query head; forward 2 GEMMs, backward 5 of which 2 recompute), the
/// default kernels beside the mma.sync ones. B x NH = 4 x 16 unless given (a model's shape,
/// e.g. GPT-2 124M: `attention 1024 16 12`; `dev/sdpa_timing.py` takes the same
/// arguments). With NKV < NH (grouped-query) the backward is timed twice: with the dK/dV
/// split it picks per shape, and with the other choice (unsplit, or split once per query
/// head of a group: `CudaBackend::set_attention_dkv_split`). With DOC (document-aware
/// attention, `data.document_mask`), each row is followed by the same call within documents
/// of DOC tokens packed into every sequence (TFLOP/s of the documents' own causal products,
/// and the time against the plain row's: the speed-up of the skipped tiles).
pub(crate) fn attention_timing(
    be: &CudaBackend,
    t: usize,
    b: usize,
    nh: usize,
    nkv: usize,
    doc: Option<usize>,
) -> BResult<()> {
    let heads = if nkv == nh { format!("{nh} heads") } else { format!("{nh} query heads, {nkv} key/value heads") };
    let within = doc.map_or(String::new(), |l| format!("; each also within documents of {l} tokens"));
    println!("\nCausal attention, B x NH = {b} x {heads}, T = {t}{within} (median of event-timed repeats)");
    for hs in [64usize, 80, 96, 128] {
        let (c, n) = (nh * hs, b * t);
        let s = AttnShape { b, t, c, nh, nkv };
        let chunk = randn(4, 1 << 22, 1.0);
        let fill = |len: usize| -> BResult<CudaSlice<bf16>> {
            let mut x = be.alloc_buf(len, "timing")?;
            fill_buf(be, &mut x, &chunk)?;
            Ok(x)
        };
        let w = s.qkv_width();
        let (qkv, mut out, dout, mut dqkv) = (fill(n * w)?, fill(n * c)?, fill(n * c)?, fill(n * w)?);
        let mut saved = be.alloc_f32(be.attention_saved_len(s), "timing")?;
        let flop = 2.0 * 2.0 * (b * nh * t * t * hs) as f64 / 2.0;
        // Within documents: the starts, and the documents' own causal products.
        let docs = match doc {
            Some(len) => {
                let len = len.clamp(1, t);
                let mut d = be.alloc_tokens(n, TokenRole::DocStarts { seq_len: t })?;
                be.upload_tokens(&doc_starts(&vec![len; n.div_ceil(len)], t, n), &mut d)?;
                let (full, rest) = (t / len, t % len);
                let pairs = (full * len * len + rest * rest) as f64 / (t * t) as f64;
                Some((d, len, pairs * flop))
            }
            None => None,
        };
        let mut tm = Timer { be, rows: Vec::new(), algos: None, search: None, algo_sums: Vec::new() };
        let plain = AttnInputs { qkv: &qkv, docs: None };
        // Time `call` plain, then (with DOC) within documents, and print the speed-up.
        let both =
            |tm: &mut Timer, name: &str, mul: f64, call: &mut dyn FnMut(AttnInputs<'_, CudaBackend>) -> BResult<()>| {
                tm.time(name, 3, 20, tflops(mul * flop), || call(plain));
                let base = tm.rows.last().map_or(0.0, |r| r.1);
                if let Some((d, len, dflop)) = &docs {
                    let masked = AttnInputs { qkv: &qkv, docs: Some(d) };
                    tm.time(&format!("{name}, documents of {len}"), 3, 20, tflops(mul * dflop), || call(masked));
                    let ms = tm.rows.last().map_or(0.0, |r| r.1);
                    if ms > 0.0 {
                        println!("    (documents of {len}: {:.2}x the plain call's speed)", base / ms);
                    }
                }
            };
        for (imp, label) in [(AttentionImpl::TensorCore, ""), (AttentionImpl::MmaSync, " (mma.sync)")] {
            be.set_attention_impl(imp);
            both(&mut tm, &format!("attention_fwd HS{hs}{label}"), 1.0, &mut |x| {
                be.attention_fwd(&mut out, &mut saved, x, s, None)
            });
            let split = be.attention_dkv_splits(s, false)?;
            let note = if split > 1 { format!(", dK/dV split {split}") } else { String::new() };
            both(&mut tm, &format!("attention_bwd HS{hs}{label}{note}"), 2.5, &mut |x| {
                be.attention_bwd(&mut dqkv, &dout, x, &out, &saved, s, None)
            });
            if nkv != nh {
                // The other choice: unsplit where it splits, else split once per query head.
                let other = if split > 1 { 1 } else { s.group() };
                let what = if other == 1 { "unsplit".to_string() } else { format!("split {other}") };
                be.set_attention_dkv_split(Some(other));
                both(&mut tm, &format!("attention_bwd HS{hs}{label}, dK/dV {what}"), 2.5, &mut |x| {
                    be.attention_bwd(&mut dqkv, &dout, x, &out, &saved, s, None)
                });
                be.set_attention_dkv_split(None);
            }
        }
        be.set_attention_impl(AttentionImpl::TensorCore);
    }
    Ok(())
}

/// `gpu-timing layernorm`: the LayerNorm forward and backward alone at the three models'
/// row shapes (124M 16x1024 x 768, 1.5B 8x1024 x 1600, 6.65B 4x1024 x 4096), for quick
/// before/after comparisons of those kernels (the backward includes its partial-sum reduction).
pub(crate) fn layernorm_timing(be: &CudaBackend) -> BResult<()> {
    let chunk = randn(1, 1 << 22, 1.0);
    let small = randn(2, 1 << 22, 0.02);
    let mut tm = Timer { be, rows: Vec::new(), algos: None, search: None, algo_sums: Vec::new() };
    for (n, c) in [(16384usize, 768usize), (8192, 1600), (4096, 4096)] {
        println!("\nLayerNorm at N={n} C={c} (median of event-timed repeats)");
        let (x, mut y, mut dres) =
            (new_buf(be, n * c, &chunk)?, new_buf(be, n * c, &chunk)?, new_buf(be, n * c, &chunk)?);
        let params = new_buf(be, 2 * c, &small)?;
        let mut grads = be.alloc_grad(2 * c, "timing")?;
        let (mut mean, mut rstd) = (be.alloc_f32(n, "")?, be.alloc_f32(n, "")?);
        let ln_bufs = LnBufs {
            x: &x,
            y: &mut y,
            dres: &mut dres,
            params: &params,
            grads: &mut grads,
            mean: &mut mean,
            rstd: &mut rstd,
        };
        time_layernorm(&mut tm, ln_bufs, Rows { n, c }, 50);
    }
    Ok(())
}

/// A Llama model's shapes for the `llama` table.
pub(crate) struct LlamaShape {
    name: &'static str,
    c: usize,
    /// The MLP's hidden width (SwiGLU's F).
    f: usize,
    nh: usize,
    nkv: usize,
}

pub(crate) const LLAMA_SHAPES: [LlamaShape; 2] = [
    LlamaShape { name: "Llama-3.2-1B", c: 2048, f: 8192, nh: 32, nkv: 8 },
    LlamaShape { name: "Llama-3-8B", c: 4096, f: 14336, nh: 32, nkv: 8 },
];

/// `gpu-timing llama [B [T]]`: RMSNorm, SwiGLU and RoPE forward and backward at each
/// `LLAMA_SHAPES` model's widths over B×T rows, in GB/s of the bytes each must move
/// (RMSNorm's backward: x, dy and dx read, dx written, its partial dw rows and their
/// reduction included in the time, not the bytes).
pub(crate) fn llama_timing(be: &CudaBackend, b: usize, t: usize) -> BResult<()> {
    let chunk = randn(1, 1 << 22, 1.0);
    let small = randn(2, 1 << 22, 0.02);
    let n = b * t;
    let mut tm = Timer { be, rows: Vec::new(), algos: None, search: None, algo_sums: Vec::new() };
    for &LlamaShape { name, c, f, nh, nkv } in &LLAMA_SHAPES {
        let s = AttnShape { b, t, c, nh, nkv };
        let hs = s.hs();
        println!(
            "\n{name} at B={b} T={t} (N={n}) C={c} F={f} NH={nh} NKV={nkv} HS={hs} (median of event-timed repeats)"
        );
        let bytes = |elems: usize| (elems * 2) as f64;
        {
            let (x, mut y, mut dx) =
                (new_buf(be, n * c, &chunk)?, new_buf(be, n * c, &chunk)?, new_buf(be, n * c, &chunk)?);
            let w = new_buf(be, c, &small)?;
            let mut dw = be.alloc_grad(c, "timing")?;
            let mut rstd = be.alloc_f32(n, "timing")?;
            let (r, at) = (Rows { n, c }, Loc::all(c));
            tm.time("rmsnorm_fwd", 3, 50, gbps(bytes(2 * n * c)), || {
                be.rmsnorm_fwd(&mut y, &mut rstd, &x, Weights::new(&w, at), r, 1e-5, None)
            });
            tm.time("rmsnorm_bwd", 3, 50, gbps(bytes(4 * n * c)), || {
                let saved = RmsSaved { inp: &x, rstd: &rstd };
                be.rmsnorm_bwd(&mut dx, WeightGrads::new(&mut dw, at), &y, saved, Weights::new(&w, at), r, None)
            });
        }
        {
            let (gu, mut h, mut dgu) =
                (new_buf(be, n * 2 * f, &chunk)?, new_buf(be, n * f, &chunk)?, new_buf(be, n * 2 * f, &chunk)?);
            let r = Rows { n, c: f };
            tm.time("swiglu_fwd", 3, 20, gbps(bytes(3 * n * f)), || be.swiglu_fwd(&mut h, &gu, r, None));
            tm.time("swiglu_bwd", 3, 20, gbps(bytes(5 * n * f)), || be.swiglu_bwd(&mut dgu, &gu, &h, r, None));
        }
        {
            let mut qkv = new_buf(be, n * s.qkv_width(), &chunk)?;
            let table = rope_table(t, hs, 500_000.0, None);
            let mut gt = be.alloc_f32(table.len(), "timing")?;
            be.upload_f32(&table, &mut gt, 0)?;
            // Read and written: the query and key heads.
            let moved = gbps(bytes(2 * n * (nh + nkv) * hs));
            tm.time("rope_fwd", 3, 50, &moved, || be.rope_fwd(&mut qkv, &gt, None, s));
            tm.time("rope_bwd", 3, 50, &moved, || be.rope_bwd(&mut qkv, &gt, None, s));
            // Within documents of 512 tokens (`data.document_mask`): positions from the starts.
            let starts = doc_starts(&vec![512; n.div_ceil(512)], t, n);
            let mut docs = be.alloc_tokens(n, TokenRole::DocStarts { seq_len: t })?;
            be.upload_tokens(&starts, &mut docs)?;
            tm.time("rope_fwd (documents of 512)", 3, 50, &moved, || be.rope_fwd(&mut qkv, &gt, Some(&docs), s));
            tm.time("rope_bwd (documents of 512)", 3, 50, &moved, || be.rope_bwd(&mut qkv, &gt, Some(&docs), s));
        }
    }
    Ok(())
}
