//! `gpu-timing`: the CUDA backend's per-op timing table (the median of event-timed
//! repeats) at a model's shapes, and the step time it adds up to. GPT-2 124M by default;
//! `GPU_CHECK_SHAPE="B,T,C,NH,V"` and `GPU_CHECK_LAYERS=L` time another model (e.g. 1.5B:
//! `8,1024,1600,25,50304` with 48 layers).
//!
//! `gpu-timing attention [T [B NH [NKV [DOC]]]]`: causal attention forward and backward at
//! every tensor-core head size (64, 80, 96, 128), B×NH query heads (default 4×16) of length T
//! (default 1024) sharing NKV key/value heads (grouped-query; default NKV = NH), in TFLOP/s,
//! the default kernels beside the mma.sync ones — the same shapes
//! `scripts/sdpa_timing.py T B NH [NKV]` times with PyTorch's SDPA. Llama 3.2 1B:
//! `attention 2048 8 32 8` (its head size is 64), Llama 3.1 8B: `attention 4096 1 32 8` (128).
//! DOC: each call also within documents of DOC tokens (`data.document_mask`), with its
//! speed-up over the plain call (e.g. `attention 2048 8 32 8 512`).
//!
//! `gpu-timing gemm-algos [COUNT]`: the table, then every GEMM it ran timed again with each
//! of cuBLASLt's first COUNT (default 8) heuristic algorithms: is the heuristic's first
//! choice, the one the trainer uses, the fastest at these shapes?
//!
//! `gpu-timing layernorm`: the LayerNorm forward and backward alone at the three models'
//! row shapes, for before/after comparisons of those kernels.
//!
//! `gpu-timing llama [B [T]]`: the Llama ops — RMSNorm, SwiGLU, RoPE, forward and backward —
//! at Llama-3.2-1B's and Llama-3-8B's shapes, B×T rows (default 8×2048), in GB/s.
//!
//! `gpu-timing fp8 [B [T]]`: every linear layer of GPT-2 1.5B and Llama-3-8B, forward and
//! backward (both GEMMs, dW accumulated), in bf16 beside FP8 (`train.precision = "fp8"`:
//! the amax passes and casts included) twice: every operand cast at each use (ZeRO-3, or
//! `train.fp8_weight_cache = false`), and the training path of stages 0-2 (the weight cached,
//! the input's scale kept from forward to backward); then each one's casts alone and the
//! weight cache's fill; B×T rows (default 8×1024), and the layers' sums: how much faster
//! the blocks' GEMMs get. Then each layer as the model calls it, with the residual, GELU
//! and GELU' epilogues it fuses, in bf16 and FP8 (training path), naming each fused GEMM
//! cuBLASLt has no FP8 algorithm for (it then runs as the GEMM and a separate kernel). And
//! each layer's backward under the FP8 backward's other recipes (e4m3 dY, dW in bf16, both).
//!
//! `gpu-timing fp8-algos [COUNT [B [T]]]`: the `fp8` table (without the other recipes), each
//! layer's GEMMs, bf16 and FP8, then timed again with each of cuBLASLt's first COUNT (default
//! 32) heuristic algorithms: does timed tuning's eight miss a faster FP8 kernel?
//!
//! `gpu-timing fp8-search [CAP [B [T]]]`: the same layers, each FP8 GEMM then timed over
//! cuBLASLt's whole algorithm space (every algorithm id's tiles, stages, cluster shapes,
//! custom options and swizzles that `cublasLtMatmulAlgoCheck` accepts, at most CAP, default
//! 4000, timed briefly, the fastest five again): does a configuration the heuristic never
//! offers beat timed tuning's pick?

use std::process::ExitCode;
use std::time::Instant;

use cudarc::driver::{sys as dsys, CudaSlice};
use half::bf16;
use trainer::backend::cuda::{AttentionImpl, CudaBackend, Fp8Casts};
use trainer::backend::*;

/// Random inputs for timing (their values do not matter, only that they are not zero).
fn randn(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n as u64).map(|i| bf16::from_f32(trainer::rng::normal(seed, 1, i) as f32 * scale).to_f32()).collect()
}

struct Timer<'a> {
    be: &'a CudaBackend,
    rows: Vec<(String, f64, String)>,
    /// `gemm-algos COUNT`: after each GEMM row, time cuBLASLt's first COUNT candidates.
    algos: Option<usize>,
    /// `fp8-search CAP`: after each layer, time every GEMM over cuBLASLt's algorithm space
    /// (at most CAP configurations each).
    search: Option<usize>,
    /// Per GEMM: (the heuristic's first, the fastest candidate) in ms; with `fp8-search`
    /// (timed tuning's pick, the fastest configuration found).
    algo_sums: Vec<(f64, f64)>,
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

impl Timer<'_> {
    /// With `gemm-algos`: every GEMM run since the last call (its buffers still live),
    /// timed again with each of cuBLASLt's first candidates; #0 is the trainer's.
    fn sweep(&mut self) {
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
    fn search(&mut self, cap: usize) {
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
    fn sweep_summary(&self) {
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
/// A bf16 buffer of `len` elements filled from `chunk` (tiled).
fn new_buf(be: &CudaBackend, len: usize, chunk: &[f32]) -> BResult<CudaSlice<bf16>> {
    let mut x = be.alloc_buf(len, "timing")?;
    fill_buf(be, &mut x, chunk)?;
    Ok(x)
}

/// The buffers one LayerNorm is timed on: rows `x` in, `y` out, `dres` the residual
/// gradient the backward adds to; the weight and bias at 0 and C of `params`/`grads`.
struct LnBufs<'a> {
    x: &'a CudaSlice<bf16>,
    y: &'a mut CudaSlice<bf16>,
    dres: &'a mut CudaSlice<bf16>,
    params: &'a CudaSlice<bf16>,
    grads: &'a mut CudaSlice<f32>,
    mean: &'a mut CudaSlice<f32>,
    rstd: &'a mut CudaSlice<f32>,
}

/// The LayerNorm forward and backward (with its partial-sum reduction), `reps` timed calls each.
fn time_layernorm(tm: &mut Timer<'_>, b: LnBufs<'_>, r: Rows, reps: usize) {
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

fn timing(be: &CudaBackend, algos: Option<usize>) -> BResult<()> {
    // GPT-2 124M by default; GPU_CHECK_SHAPE="B,T,C,NH,V" times another model (e.g. 1.5B: 8,1024,1600,25,50304).
    let shape: Vec<usize> = std::env::var("GPU_CHECK_SHAPE")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| v.len() == 5)
        .unwrap_or_else(|| vec![16, 1024, 768, 12, 50257]);
    let (b, t, c, nh, v) = (shape[0], shape[1], shape[2], shape[3], shape[4]);
    let layers: usize = std::env::var("GPU_CHECK_LAYERS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
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
    // The MLP with GELU fused into the GEMMs (compare with matmul fc + gelu_fwd, fc2 + gelu_bwd).
    {
        let fc = LinearLocs::new(Loc::new(2 * c, 4 * c * c), Some(Loc::new(2 * c + 4 * c * c, 4 * c)));
        let flop = 2.0 * (n * c * 4 * c) as f64;
        let mut pre = newbuf(n * 4 * c, &chunk)?;
        tm.time("matmul_gelu_fwd fc (fused epilogue)", 3, 20, tflops(flop), || {
            be.matmul_gelu_fwd(&mut pre, &mut y4, &x, Weights::new(&bparams, fc), MatShape { n, c, oc: 4 * c }, None)
        });
        tm.sweep();
        let fc2 = LinearLocs::new(Loc::new(2 * c, 4 * c * c), Some(Loc::new(2 * c + 4 * c * c, c)));
        let mut dpre = newbuf(n * 4 * c, &chunk)?;
        tm.time("matmul_bwd_dgelu fc2 (fused epilogue)", 3, 20, tflops(2.0 * flop), || {
            let gelu = GeluInput { act: Some(&y4), pre: &pre, dpre_amax: None };
            let ms = MatShape { n, c: 4 * c, oc: c };
            be.matmul_bwd_dgelu(
                &mut dpre,
                WeightGrads::new(&mut bgrads, fc2),
                &x,
                gelu,
                Weights::new(&bparams, fc2),
                ms,
            )
        });
        tm.sweep();
    }
    let mut att = newbuf(n * c, &chunk)?;
    let mut saved = be.alloc_f32(be.attention_saved_len(s), "")?;
    // Causal: half of the T x T products. fwd: QK^T and PV; bwd: 5 products (+2 recomputed).
    let att_flop = 2.0 * 2.0 * (b * nh * t * t * (c / nh)) as f64 / 2.0;
    let ai = AttnInputs { qkv: &qkv, docs: None };
    be.set_attention_impl(AttentionImpl::Simt);
    tm.time("attention_fwd (SIMT fp32)", 2, 10, tflops(att_flop), || {
        be.attention_fwd(&mut att, &mut saved, ai, s, None)
    });
    tm.time("attention_bwd (SIMT fp32)", 2, 10, tflops(2.5 * att_flop), || {
        be.attention_bwd(&mut dqkv, &x, ai, &att, &saved, s, None)
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
        be.attention_bwd(&mut dqkv, &x, ai, &att, &saved, s, None)
    });
    let t_att_b = tm.rows.last().map_or(0.0, |r| r.1);
    tm.time("gelu_fwd", 3, 20, gbps(8.0 * bc2 / 2.0 * 2.0), || be.gelu_fwd(&mut y4, &x4, n * 4 * c, None));
    let t_gf = tm.rows.last().map_or(0.0, |r| r.1);
    let mut x4b = newbuf(n * 4 * c, &chunk)?;
    tm.time("gelu_bwd (in place)", 3, 20, gbps(12.0 * bc2), || be.gelu_bwd(&mut x4b, &x4, n * 4 * c, None));
    let t_gb = tm.rows.last().map_or(0.0, |r| r.1);
    tm.time("residual_fwd", 3, 20, gbps(3.0 * bc2), || be.residual_fwd(&mut y, &x, &dres, n * c));
    let t_res = tm.rows.last().map_or(0.0, |r| r.1);
    let t_lnf = tm.rows.iter().find(|r| r.0 == "layernorm_fwd").map_or(0.0, |r| r.1);
    let t_lnb = tm.rows.iter().find(|r| r.0 == "layernorm_bwd").map_or(0.0, |r| r.1);
    drop((x4b, y4, att));
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
    // The same head with the vocabulary padded to a multiple of 64 (as llm.c does): is
    // the odd leading dimension costing anything?
    let vp = v.div_ceil(64) * 64;
    let mut logits_p = newbuf(n * vp, &chunk)?;
    let eparams_p = newbuf(vp * c, &small)?;
    tm.time(&format!("matmul_fwd lm head padded ({c}->{vp})"), 2, 10, tflops(2.0 * (n * c * vp) as f64), || {
        let headp = LinearLocs::new(Loc::new(0, vp * c), None);
        be.matmul_fwd(&mut logits_p, &x, Weights::new(&eparams_p, headp), MatShape { n, c, oc: vp })
    });
    tm.sweep();
    drop((logits_p, eparams_p));
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

/// Attention alone at every tensor-core head size: fwd and bwd TFLOP/s (causal: half of
/// the T x T products per query head; forward 2 GEMMs, backward 5 of which 2 recompute), the
/// default kernels beside the mma.sync ones. B x NH = 4 x 16 unless given (a model's shape,
/// e.g. GPT-2 124M: `attention 1024 16 12`; `scripts/sdpa_timing.py` takes the same
/// arguments). With NKV < NH (grouped-query) the backward is timed twice: with the dK/dV
/// split it picks per shape, and with the other choice (unsplit, or split once per query
/// head of a group: `CudaBackend::set_attention_dkv_split`). With DOC (document-aware
/// attention, `data.document_mask`), each row is followed by the same call within documents
/// of DOC tokens packed into every sequence (TFLOP/s of the documents' own causal products,
/// and the time against the plain row's: the speed-up of the skipped tiles).
fn attention_timing(be: &CudaBackend, t: usize, b: usize, nh: usize, nkv: usize, doc: Option<usize>) -> BResult<()> {
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
fn layernorm_timing(be: &CudaBackend) -> BResult<()> {
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
struct LlamaShape {
    name: &'static str,
    c: usize,
    /// The MLP's hidden width (SwiGLU's F).
    f: usize,
    nh: usize,
    nkv: usize,
}

const LLAMA_SHAPES: [LlamaShape; 2] = [
    LlamaShape { name: "Llama-3.2-1B", c: 2048, f: 8192, nh: 32, nkv: 8 },
    LlamaShape { name: "Llama-3-8B", c: 4096, f: 14336, nh: 32, nkv: 8 },
];

/// `gpu-timing llama [B [T]]`: RMSNorm, SwiGLU and RoPE forward and backward at each
/// `LLAMA_SHAPES` model's widths over B×T rows, in GB/s of the bytes each must move
/// (RMSNorm's backward: x, dy and dx read, dx written, its partial dw rows and their
/// reduction included in the time, not the bytes).
fn llama_timing(be: &CudaBackend, b: usize, t: usize) -> BResult<()> {
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

/// One model's linear layers for `fp8`: (name, inputs, outputs, bias, what the model fuses
/// into its GEMMs).
struct LinearShapes {
    name: &'static str,
    layers: [(&'static str, usize, usize, bool, Fused); 4],
}

/// What a block fuses into a linear layer's GEMMs (its `MatmulOps` call in the model).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fused {
    /// `matmul_fwd` / `matmul_bwd`: the bias only.
    Nothing,
    /// The output joins the residual stream (`matmul_residual_fwd`).
    Residual,
    /// GELU after the GEMM, its pre-activation kept (`matmul_gelu_fwd`).
    Gelu,
    /// The residual in the forward; the input is GELU(pre), so the backward goes through
    /// GELU' (`matmul_bwd_dgelu`).
    ResidualDgelu,
}

const FP8_SHAPES: [LinearShapes; 2] = [
    LinearShapes {
        name: "GPT-2 1.5B",
        layers: [
            ("qkv", 1600, 4800, true, Fused::Nothing),
            ("proj", 1600, 1600, true, Fused::Residual),
            ("fc", 1600, 6400, true, Fused::Gelu),
            ("fc2", 6400, 1600, true, Fused::ResidualDgelu),
        ],
    },
    LinearShapes {
        name: "Llama-3-8B",
        layers: [
            ("qkv", 4096, 6144, false, Fused::Nothing),
            ("o", 4096, 4096, false, Fused::Residual),
            ("gate_up", 4096, 28672, false, Fused::Nothing),
            ("down", 14336, 4096, false, Fused::Residual),
        ],
    },
];

/// An FP8 backward recipe as the timing rows name it (the config's spellings).
fn recipe_name(b: Fp8Backward) -> String {
    format!("dY {}, dW {}", b.grad.name(), b.weight_grad.name())
}

/// `gpu-timing fp8 [B [T]]` (see the top of the file).
fn fp8_timing(be: &CudaBackend, b: usize, t: usize, algos: Option<usize>, search: Option<usize>) -> BResult<()> {
    if let Err(why) = be.fp8_support() {
        println!("FP8 GEMMs unavailable: {why}");
        return Ok(());
    }
    let chunk = randn(1, 1 << 22, 1.0);
    let small = randn(2, 1 << 22, 0.02);
    let n = b * t;
    let mut tm = Timer { be, rows: Vec::new(), algos, search, algo_sums: Vec::new() };
    for shapes in &FP8_SHAPES {
        println!(
            "\n{} linear layers at B={b} T={t} (N={n}), bf16 beside FP8 (median of event-timed repeats)",
            shapes.name
        );
        let linears = shapes.layers.map(|(_, c, oc, _, _)| (c, oc));
        let reserved = be.prepare_fp8(&Fp8Layers::blocks(n, &linears, 1, 1))?;
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        println!(
            "  FP8 operand workspace: {:.1} MiB; the four layers' cached weights: {:.1} MiB",
            mib(reserved.workspace),
            mib(reserved.weight_cache)
        );
        // bf16, FP8 with every operand cast at each use, FP8 with the weight cached and the
        // input's scale kept from forward to backward (the training path at ZeRO 0-2).
        let kinds = ["bf16      ", "fp8 per use", "fp8 cached"];
        let (mut sums, mut fill, mut as_run) = ([0.0f64; 3], 0.0f64, [0.0f64; 2]);
        // The backward alone: bf16, the default FP8 recipe (cached), then each other recipe.
        let mut bwd_sums = [0.0f64; 2 + Fp8Backward::ALTERNATIVES.len()];
        for (k, &(layer, c, oc, bias, fused)) in shapes.layers.iter().enumerate() {
            let s = MatShape { n, c, oc };
            let plen = oc * c + if bias { oc } else { 0 };
            let params = new_buf(be, plen, &small)?;
            let mut grads = be.alloc_grad(plen, "timing")?;
            let (inp, dout) = (new_buf(be, n * c, &chunk)?, new_buf(be, n * oc, &small)?);
            let (mut out, mut dinp) = (be.alloc_buf(n * oc, "timing")?, be.alloc_buf(n * c, "timing")?);
            let flop = 2.0 * (n * c * oc) as f64;
            let plain = LinearLocs::new(Loc::new(0, oc * c), bias.then(|| Loc::new(oc * c, oc)));
            let mut plain_ms = [0.0f64; 3];
            let ats =
                [plain, plain.with_precision(Precision::Fp8), plain.with_precision(Precision::Fp8).with_fp8_index(k)];
            for (i, at) in ats.into_iter().enumerate() {
                let tag = kinds[i];
                let before = tm.rows.len();
                // The cached forward casts the weight at its first (warm-up) call only; its
                // backward reads the input scale the forward left.
                tm.time(&format!("{layer} {tag} fwd  {c}->{oc}"), 3, 20, tflops(flop), || {
                    be.matmul_fwd(&mut out, &inp, Weights::new(&params, at), s)
                });
                tm.time(&format!("{layer} {tag} bwd  {c}->{oc}"), 3, 20, tflops(2.0 * flop), || {
                    be.matmul_bwd(
                        &mut dinp,
                        WeightGrads::new(&mut grads, at),
                        &dout,
                        &inp,
                        Weights::new(&params, at),
                        s,
                    )
                });
                plain_ms[i] = tm.rows[before..].iter().map(|r| r.1).sum::<f64>();
                sums[i] += plain_ms[i];
                if i != 1 {
                    bwd_sums[i / 2] += tm.rows.last().map_or(0.0, |r| r.1);
                }
            }
            // As the model calls it, with its epilogues (bf16, and FP8 on the training path).
            // FP8 runs GELU and GELU' as kernels of their own (they leave the next FP8 GEMM's
            // amax); where cuBLASLt has no algorithm for another epilogue the row runs the
            // GEMM and a separate kernel, and says so.
            if fused != Fused::Nothing {
                let (res, mut tmp, mut pre) =
                    (new_buf(be, n * oc, &chunk)?, be.alloc_buf(n * oc, "timing")?, be.alloc_buf(n * oc, "timing")?);
                let pre_in = new_buf(be, n * c, &chunk)?;
                for (j, at) in [ats[0], ats[2]].into_iter().enumerate() {
                    let tag = format!("{} as run", kinds[2 * j].trim_end());
                    let (before, unfused) = (tm.rows.len(), be.unfused_gemms());
                    let w = || Weights::new(&params, at);
                    match fused {
                        Fused::Gelu => tm.time(&format!("{layer} {tag} fwd +GELU"), 3, 20, tflops(flop), || {
                            be.matmul_gelu_fwd(&mut pre, &mut out, &inp, w(), s, None)
                        }),
                        _ => tm.time(&format!("{layer} {tag} fwd +residual"), 3, 20, tflops(flop), || {
                            be.matmul_residual_fwd(&mut out, &res, &inp, w(), s, &mut tmp)
                        }),
                    }
                    match fused {
                        Fused::ResidualDgelu => {
                            tm.time(&format!("{layer} {tag} bwd +GELU'"), 3, 20, tflops(2.0 * flop), || {
                                let x = GeluInput { act: Some(&inp), pre: &pre_in, dpre_amax: None };
                                be.matmul_bwd_dgelu(&mut dinp, WeightGrads::new(&mut grads, at), &dout, x, w(), s)
                            })
                        }
                        _ => tm.time(&format!("{layer} {tag} bwd"), 3, 20, tflops(2.0 * flop), || {
                            be.matmul_bwd(&mut dinp, WeightGrads::new(&mut grads, at), &dout, &inp, w(), s)
                        }),
                    }
                    as_run[j] += tm.rows[before..].iter().map(|r| r.1).sum::<f64>();
                    for m in be.unfused_gemms().iter().filter(|m| !unfused.contains(m)) {
                        println!("    {layer} {tag}: composed, cuBLASLt has no fused algorithm for {m}");
                    }
                }
            } else {
                // Nothing fused: the plain rows are how the model runs it.
                as_run[0] += plain_ms[0];
                as_run[1] += plain_ms[2];
            }
            // `fp8-algos`: every GEMM above with each of cuBLASLt's candidates, while its
            // buffers (and the FP8 workspace the recipes below re-make) are live.
            tm.sweep();
            // The FP8 rows' casts alone (the rest of an FP8 row is its GEMMs), in bytes moved:
            // an amax pass reads 2 per element, a cast reads 2 and writes 1 per layout.
            let (x, w, g) = ((n * c) as f64, (oc * c) as f64, (n * oc) as f64);
            let rows = [
                ("fwd casts, per use", Fp8Casts::Forward, (x + w) * 5.0),
                ("bwd casts, per use", Fp8Casts::Backward, g * 6.0 + (w + x) * 5.0),
                ("fwd casts, cached", Fp8Casts::ForwardCached, x * 5.0),
                ("bwd casts, cached", Fp8Casts::BackwardCached, g * 6.0 + x * 3.0),
                ("weight cache fill (once a step)", Fp8Casts::WeightCache, w * 6.0),
            ];
            for (what, which, bytes) in rows {
                tm.time(&format!("{layer} fp8  {what}"), 3, 20, gbps(bytes), || {
                    be.fp8_casts_only(&inp, &dout, (&params, 0), s, which)
                });
            }
            fill += tm.rows.last().map_or(0.0, |r| r.1);
            // The backward's other recipes on the cached path (a forward first leaves the
            // input scale the backward reuses), then the default again for the next layer.
            // (Not with `fp8-algos`: their GEMMs would be swept after their workspace is gone.)
            let recipes =
                if tm.algos.is_some() || tm.search.is_some() { &[][..] } else { &Fp8Backward::ALTERNATIVES[..] };
            for (r, &backward) in recipes.iter().enumerate() {
                let name = recipe_name(backward);
                be.prepare_fp8(&Fp8Layers::blocks(n, &linears, 1, 1).with_backward(backward))?;
                be.matmul_fwd(&mut out, &inp, Weights::new(&params, ats[2]), s)?;
                tm.time(&format!("{layer} fp8 cached bwd, {name}"), 3, 20, tflops(2.0 * flop), || {
                    be.matmul_bwd(
                        &mut dinp,
                        WeightGrads::new(&mut grads, ats[2]),
                        &dout,
                        &inp,
                        Weights::new(&params, ats[2]),
                        s,
                    )
                });
                bwd_sums[2 + r] += tm.rows.last().map_or(0.0, |r| r.1);
            }
            be.prepare_fp8(&Fp8Layers::blocks(n, &linears, 1, 1))?;
        }
        let recipes: Vec<String> = Fp8Backward::ALTERNATIVES
            .into_iter()
            .enumerate()
            .filter(|_| tm.algos.is_none())
            .map(|(r, b)| {
                format!("{} {:.3} ms ({:.2}x)", recipe_name(b), bwd_sums[2 + r], bwd_sums[0] / bwd_sums[2 + r])
            })
            .collect();
        println!(
            "  {}: the four layers' backward alone: bf16 {:.3} ms, fp8 cached {:.3} ms ({:.2}x){}",
            shapes.name,
            bwd_sums[0],
            bwd_sums[1],
            bwd_sums[0] / bwd_sums[1],
            recipes.iter().map(|r| format!("; {r}")).collect::<String>()
        );
        println!(
            "  {}: the four layers' forward + backward: bf16 {:.3} ms, fp8 per use {:.3} ms ({:.2}x), \
             fp8 cached {:.3} ms ({:.2}x; + {:.3} ms once a step to fill the weight cache)",
            shapes.name,
            sums[0],
            sums[1],
            sums[0] / sums[1],
            sums[2],
            sums[0] / sums[2],
            fill
        );
        println!(
            "  {}: as the model runs them (residual, GELU and GELU' epilogues where the model fuses them): \
             bf16 {:.3} ms, fp8 cached {:.3} ms ({:.2}x)",
            shapes.name,
            as_run[0],
            as_run[1],
            as_run[0] / as_run[1]
        );
    }
    // The amax sinks' slot clears: a 16-byte memset before each producer that leaves an amax
    // (with FP8 about 12 a block a step: 8 sinks, 4 weights' amax passes), 100 of them
    // replayed as a CUDA graph, as a step runs them.
    if be.graphs_supported() {
        println!();
        be.begin_capture()?;
        let captured = be.fp8_sink_clears(100);
        let graph = be.end_capture()?;
        captured?;
        tm.time(
            "100 amax sink clears, a CUDA graph",
            3,
            20,
            |ms| format!("{:.2} us each", ms * 10.0),
            || be.replay(&graph),
        );
    }
    tm.sweep_summary();
    Ok(())
}

fn main() -> ExitCode {
    let t0 = Instant::now();
    let be = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            println!("CUDA backend unavailable: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "gpu-timing on {} ({} SMs); backend ready in {:.2} s",
        be.name(),
        be.sm_count(),
        t0.elapsed().as_secs_f64()
    );
    let args: Vec<String> = std::env::args().collect();
    let run = match args.get(1).map(String::as_str) {
        Some("attention") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            let nh = arg(4, 16);
            let doc = args.get(6).and_then(|v| v.parse().ok());
            attention_timing(&be, arg(2, 1024), arg(3, 4), nh, arg(5, nh), doc)
        }
        Some("layernorm") => layernorm_timing(&be),
        Some("llama") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            llama_timing(&be, arg(2, 8), arg(3, 2048))
        }
        Some("fp8") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            fp8_timing(&be, arg(2, 8), arg(3, 1024), None, None)
        }
        Some("fp8-algos") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            fp8_timing(&be, arg(3, 8), arg(4, 1024), Some(arg(2, 32)), None)
        }
        Some("fp8-search") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            fp8_timing(&be, arg(3, 8), arg(4, 1024), None, Some(arg(2, 4000)))
        }
        Some("gemm-algos") => timing(&be, Some(args.get(2).and_then(|v| v.parse().ok()).unwrap_or(8))),
        _ => timing(&be, None),
    };
    match run {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("timing failed: {e}");
            ExitCode::FAILURE
        }
    }
}
