//! `gpu-timing` and `gpu-timing gemm-algos`: the per-op table at a model's shapes, and the
//! step time it adds up to.

use crate::timer::*;
use cudarc::driver::CudaSlice;
use half::bf16;
use trainer::backend::cuda::AttentionImpl;
use trainer::backend::cuda::CudaBackend;
use trainer::backend::*;

pub(crate) fn timing(be: &CudaBackend, algos: Option<usize>) -> BResult<()> {
    let ((b, t, c, nh, v), layers) = timed_shape();
    let n = b * t;
    let s = AttnShape::mha(b, t, c, nh);
    println!("\nTiming at shapes B={b} T={t} C={c} NH={nh} V={v} (median of event-timed repeats)");
    let chunk = randn(1, 1 << 22, 1.0);
    let small = randn(2, 1 << 22, 0.02);
    let newbuf = |len: usize, ch: &[f32]| new_buf(be, len, ch);
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
    let toks: Vec<u32> = (0..n as u64).map(|i| (trainer::rng::uniform(3, 1, i) * v as f64) as u32 % v as u32).collect();
    let mut gtok = be.alloc_tokens(n, TokenRole::Inputs)?;
    be.upload_tokens(&toks, &mut gtok)?;
    let emb = EmbedLocs { wte: Loc::new(0, v * c), wpe: Some(Loc::new(v * c, t * c)) };
    let mut tm = Timer { be, rows: Vec::new(), algos, search: None, algo_sums: Vec::new() };
    let bc2 = (n * c * 2) as f64;

    tm.time("encoder_fwd", 3, 20, gbps(2.0 * bc2), || {
        be.encoder_fwd(
            &mut y,
            EmbedInputs { tokens: &gtok, docs: None },
            Weights::new(&eparams, emb),
            SeqShape { b, t, c },
        )
    });
    tm.time("encoder_bwd (grouping planned at upload)", 2, 10, gbps(bc2 + (n * c * 8) as f64), || {
        be.encoder_bwd(
            WeightGrads::new(&mut egrads, emb),
            &x,
            EmbedInputs { tokens: &gtok, docs: None },
            SeqShape { b, t, c },
        )
    });
    let mut dres = newbuf(n * c, &chunk)?;
    let ln_bufs = LnBufs {
        x: &x,
        y: &mut y,
        dres: &mut dres,
        params: &bparams,
        grads: &mut bgrads,
        mean: &mut mean,
        rstd: &mut rstd,
    };
    time_layernorm(&mut tm, ln_bufs, Rows { n, c }, 20);
    let mut total_fwd = 0.0;
    let mut total_bwd = 0.0;
    for (name, cin, cout) in [("qkv", c, 3 * c), ("attn proj", c, c), ("fc", c, 4 * c), ("fc2", 4 * c, c)] {
        let lin = LinearLocs::new(Loc::new(2 * c, cout * cin), Some(Loc::new(2 * c + cout * cin, cout)));
        let ms = MatShape { n, c: cin, oc: cout };
        let flop = 2.0 * (n * cin * cout) as f64;
        let (inp, out): (&CudaSlice<bf16>, &mut CudaSlice<bf16>) = match name {
            "qkv" => (&x, &mut dqkv),
            "fc" => (&x, &mut y4),
            "fc2" => (&x4, &mut y),
            _ => (&x, &mut y),
        };
        tm.time(&format!("matmul_fwd {name} ({cin}->{cout})"), 3, 20, tflops(flop), || {
            be.matmul_fwd(out, inp, Weights::new(&bparams, lin), ms)
        });
        tm.sweep();
        total_fwd += tm.rows.last().map_or(0.0, |r| r.1);
        let dout: &CudaSlice<bf16> = match name {
            "qkv" => &qkv,
            "fc" => &x4,
            _ => &x,
        };
        let mut dinp = newbuf(n * cin, &chunk)?;
        tm.time(&format!("matmul_bwd {name} ({cin}->{cout})"), 3, 20, tflops(2.0 * flop), || {
            be.matmul_bwd(&mut dinp, WeightGrads::new(&mut bgrads, lin), dout, inp, Weights::new(&bparams, lin), ms)
        });
        tm.sweep();
        total_bwd += tm.rows.last().map_or(0.0, |r| r.1);
    }
    time_fused_mlp(&mut tm, &x, &mut y4, &bparams, &mut bgrads, &chunk, Rows { n, c })?;
    // Causal: half of the T x T products. fwd: QK^T and PV; bwd: 5 products (+2 recomputed).
    let att_flop = 2.0 * 2.0 * (b * nh * t * t * (c / nh)) as f64 / 2.0;
    let (t_att_f, t_att_b) = time_attention(&mut tm, s, att_flop, &qkv, &mut dqkv, &x, &chunk)?;
    tm.time("gelu_fwd", 3, 20, gbps(8.0 * bc2 / 2.0 * 2.0), || be.gelu_fwd(&mut y4, &x4, n * 4 * c, None));
    let t_gf = tm.rows.last().map_or(0.0, |r| r.1);
    let mut x4b = newbuf(n * 4 * c, &chunk)?;
    tm.time("gelu_bwd (in place)", 3, 20, gbps(12.0 * bc2), || be.gelu_bwd(&mut x4b, &x4, n * 4 * c, None));
    let t_gb = tm.rows.last().map_or(0.0, |r| r.1);
    tm.time("residual_fwd", 3, 20, gbps(3.0 * bc2), || be.residual_fwd(&mut y, &x, &dres, n * c));
    let t_res = tm.rows.last().map_or(0.0, |r| r.1);
    let t_lnf = tm.rows.iter().find(|r| r.0 == "layernorm_fwd").map_or(0.0, |r| r.1);
    let t_lnb = tm.rows.iter().find(|r| r.0 == "layernorm_bwd").map_or(0.0, |r| r.1);
    drop((x4b, y4));
    // LM head (tied wte) and the loss.
    let mut logits = newbuf(n * v, &chunk)?;
    let head = LinearLocs::new(Loc::new(0, v * c), None);
    let head_flop = 2.0 * (n * c * v) as f64;
    tm.time(&format!("matmul_fwd lm head ({c}->{v})"), 2, 10, tflops(head_flop), || {
        be.matmul_fwd(&mut logits, &x, Weights::new(&eparams, head), MatShape { n, c, oc: v })
    });
    tm.sweep();
    let t_hf = tm.rows.last().map_or(0.0, |r| r.1);
    let mut losses = be.alloc_f32(n, "")?;

    tm.time("cross_entropy_fwd_bwd", 2, 10, gbps(2.0 * 2.0 * (n * v) as f64 + 2.0 * (n * v) as f64), || {
        be.cross_entropy_fwd_bwd(&mut logits, &mut losses, &gtok, LossRows::all(n, v), 1.0 / n as f32)
    });
    let t_ce = tm.rows.last().map_or(0.0, |r| r.1);
    let mut dln = newbuf(n * c, &chunk)?;
    tm.time(&format!("matmul_bwd lm head ({c}->{v})"), 2, 10, tflops(2.0 * head_flop), || {
        be.matmul_bwd(
            &mut dln,
            WeightGrads::new(&mut egrads, head),
            &logits,
            &x,
            Weights::new(&eparams, head),
            MatShape { n, c, oc: v },
        )
    });
    tm.sweep();
    let t_hb = tm.rows.last().map_or(0.0, |r| r.1);
    drop(logits);
    time_padded_head(&mut tm, &x, &chunk, &small, Rows { n, c }, v)?;
    // Parameters of the timed model (GPT-2 layout, vocab v, context t, `layers` blocks).
    let np = v * c + t * c + 2 * c + layers * (12 * c * c + 13 * c);
    let (t_adam, t_norm) = time_optimizer(&mut tm, np, &small)?;

    // Estimated step (no communication): blocks as the model runs them (GELU fused into the
    // fc forward and the fc2 backward; GELU recomputed in backward) + head + optimizer.
    let row = |name: &str| tm.rows.iter().find(|r| r.0.starts_with(name)).map_or(0.0, |r| r.1);
    let (fc_f, fused_f) = (row("matmul_fwd fc ("), row("matmul_gelu_fwd"));
    let (fc2_b, fused_b) = (row("matmul_bwd fc2"), row("matmul_bwd_dgelu"));
    let _ = t_gb;
    let t_block_f = 2.0 * t_lnf + total_fwd - fc_f + fused_f + t_att_f + 2.0 * t_res;
    let t_block_b = 2.0 * t_lnb + total_bwd - fc2_b + fused_b + t_gf + t_att_b;
    let step = layers as f64 * (t_block_f + t_block_b) + t_lnf + t_lnb + t_hf + t_ce + t_hb + t_adam + t_norm;
    tm.sweep_summary();
    println!("\nEstimate from the table (one GPU, sum of op medians, no launch gaps): block fwd {t_block_f:.2} ms, block bwd {t_block_b:.2} ms,");
    println!(
        "step ({layers} layers, B={b}, T={t}, fwd+bwd+AdamW) {step:.1} ms = {:.0} tokens/s; attention is {:.0}% of it.",
        n as f64 / (step * 1e-3),
        100.0 * layers as f64 * (t_att_f + t_att_b) / step
    );
    Ok(())
}

/// The timed model: (B, T, C, NH, V) and the layer count.
fn timed_shape() -> ((usize, usize, usize, usize, usize), usize) {
    // GPT-2 124M by default; GPU_CHECK_SHAPE="B,T,C,NH,V" times another model (e.g. 1.5B: 8,1024,1600,25,50304).
    let shape: Vec<usize> = std::env::var("GPU_CHECK_SHAPE")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| v.len() == 5)
        .unwrap_or_else(|| vec![16, 1024, 768, 12, 50257]);
    let layers: usize = std::env::var("GPU_CHECK_LAYERS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    ((shape[0], shape[1], shape[2], shape[3], shape[4]), layers)
}

/// The MLP with GELU fused into the GEMMs (compare with matmul fc + gelu_fwd, fc2 + gelu_bwd).
fn time_fused_mlp(
    tm: &mut Timer<'_>,
    x: &CudaSlice<bf16>,
    y4: &mut CudaSlice<bf16>,
    bparams: &CudaSlice<bf16>,
    bgrads: &mut CudaSlice<f32>,
    chunk: &[f32],
    r: Rows,
) -> BResult<()> {
    let (be, Rows { n, c }) = (tm.be, r);
    let fc = LinearLocs::new(Loc::new(2 * c, 4 * c * c), Some(Loc::new(2 * c + 4 * c * c, 4 * c)));
    let flop = 2.0 * (n * c * 4 * c) as f64;
    let mut pre = new_buf(be, n * 4 * c, chunk)?;
    tm.time("matmul_gelu_fwd fc (fused epilogue)", 3, 20, tflops(flop), || {
        be.matmul_gelu_fwd(&mut pre, y4, x, Weights::new(bparams, fc), MatShape { n, c, oc: 4 * c }, None)
    });
    tm.sweep();
    let fc2 = LinearLocs::new(Loc::new(2 * c, 4 * c * c), Some(Loc::new(2 * c + 4 * c * c, c)));
    let mut dpre = new_buf(be, n * 4 * c, chunk)?;
    tm.time("matmul_bwd_dgelu fc2 (fused epilogue)", 3, 20, tflops(2.0 * flop), || {
        let gelu = GeluInput { act: Some(&*y4), pre: &pre, dpre_amax: None };
        let ms = MatShape { n, c: 4 * c, oc: c };
        be.matmul_bwd_dgelu(&mut dpre, WeightGrads::new(bgrads, fc2), x, gelu, Weights::new(bparams, fc2), ms)
    });
    tm.sweep();
    Ok(())
}

/// Attention forward and backward: SIMT, mma.sync and tensor cores; returns the tensor cores' (fwd, bwd) ms.
fn time_attention(
    tm: &mut Timer<'_>,
    s: AttnShape,
    att_flop: f64,
    qkv: &CudaSlice<bf16>,
    dqkv: &mut CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    chunk: &[f32],
) -> BResult<(f64, f64)> {
    let be = tm.be;
    let mut att = new_buf(be, x.len(), chunk)?;
    let mut saved = be.alloc_f32(be.attention_saved_len(s), "")?;
    let ai = AttnInputs { qkv, docs: None };
    be.set_attention_impl(AttentionImpl::Simt);
    tm.time("attention_fwd (SIMT fp32)", 2, 10, tflops(att_flop), || {
        be.attention_fwd(&mut att, &mut saved, ai, s, None)
    });
    tm.time("attention_bwd (SIMT fp32)", 2, 10, tflops(2.5 * att_flop), || {
        be.attention_bwd(dqkv, x, ai, &att, &saved, s, None)
    });
    be.set_attention_impl(AttentionImpl::MmaSync);
    tm.time("attention_fwd (mma.sync)", 3, 20, tflops(att_flop), || {
        be.attention_fwd(&mut att, &mut saved, ai, s, None)
    });
    be.set_attention_impl(AttentionImpl::TensorCore);
    tm.time("attention_fwd (tensor cores)", 3, 20, tflops(att_flop), || {
        be.attention_fwd(&mut att, &mut saved, ai, s, None)
    });
    let t_att_f = tm.rows.last().map_or(0.0, |r| r.1);
    tm.time("attention_bwd (tensor cores)", 3, 20, tflops(2.5 * att_flop), || {
        be.attention_bwd(dqkv, x, ai, &att, &saved, s, None)
    });
    let t_att_b = tm.rows.last().map_or(0.0, |r| r.1);
    Ok((t_att_f, t_att_b))
}

/// The same head with the vocabulary padded to a multiple of 64 (as llm.c does): is
/// the odd leading dimension costing anything?
fn time_padded_head(
    tm: &mut Timer<'_>,
    x: &CudaSlice<bf16>,
    chunk: &[f32],
    small: &[f32],
    r: Rows,
    v: usize,
) -> BResult<()> {
    let (be, Rows { n, c }) = (tm.be, r);
    let vp = v.div_ceil(64) * 64;
    let mut logits_p = new_buf(be, n * vp, chunk)?;
    let eparams_p = new_buf(be, vp * c, small)?;
    tm.time(&format!("matmul_fwd lm head padded ({c}->{vp})"), 2, 10, tflops(2.0 * (n * c * vp) as f64), || {
        let headp = LinearLocs::new(Loc::new(0, vp * c), None);
        be.matmul_fwd(&mut logits_p, x, Weights::new(&eparams_p, headp), MatShape { n, c, oc: vp })
    });
    tm.sweep();
    drop((logits_p, eparams_p));
    Ok(())
}

/// The optimizer and the whole-model passes over `np` parameters; returns (AdamW, gradient norm) ms.
fn time_optimizer(tm: &mut Timer<'_>, np: usize, small: &[f32]) -> BResult<(f64, f64)> {
    let be = tm.be;
    let mut p = be.alloc_buf(np, "")?;
    let mut w = be.alloc_f32(np, "")?;
    let mut m = be.alloc_f32(np, "")?;
    let mut vv = be.alloc_f32(np, "")?;
    let mut g = be.alloc_grad(np, "")?;
    fill_f32(be, &mut w, small)?;
    fill_f32(be, &mut g, small)?;
    let h = AdamWStep { lr: 6e-4, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 10, grad_scale: 1.0 };
    let mp = format!("{:.0}M", np as f64 / 1e6);
    // The optimizer over all of them in one segment.
    tm.time(&format!("adamw ({mp} params)"), 3, 20, gbps((np * (4 * 7 + 2)) as f64), || {
        let t = AdamWTensors { params: Some(&mut p), master: &mut w, m: &mut m, v: &mut vv, grads: &g };
        be.adamw(t, &[AdamWSegment::plain(0, 0, 0, np, true)], h)
    });
    let t_adam = tm.rows.last().map_or(0.0, |r| r.1);
    let mut slots = be.alloc_f32(2, "")?;
    tm.time(&format!("grad_sumsq_into ({mp})"), 3, 20, gbps((np * 4) as f64), || {
        be.grad_sumsq_into(&g, Loc::all(np), &mut slots, 0)
    });
    let t_norm = tm.rows.last().map_or(0.0, |r| r.1);
    tm.time(&format!("cast_to_buf ({mp})"), 3, 20, gbps((np * 6) as f64), || {
        be.cast_to_buf(&mut p, 0, &w, Loc::all(np))
    });
    tm.time(&format!("add_grad ({mp})"), 3, 20, gbps((np * 12) as f64), || be.add_grad(&mut g, 0, &w, Loc::all(np)));
    Ok((t_adam, t_norm))
}
