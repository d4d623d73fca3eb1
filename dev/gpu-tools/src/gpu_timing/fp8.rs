//! `gpu-timing fp8`, `fp8-algos` and `fp8-search`: every linear layer in bf16 beside FP8.

use crate::timer::*;
use cudarc::driver::CudaSlice;
use half::bf16;
use trainer::backend::cuda::CudaBackend;
use trainer::backend::cuda::Fp8Casts;
use trainer::backend::*;

/// One model's linear layers for `fp8`: (name, inputs, outputs, bias, what the model fuses
/// into its GEMMs).
pub(crate) struct LinearShapes {
    name: &'static str,
    layers: [(&'static str, usize, usize, bool, Fused); 4],
}

/// What a block fuses into a linear layer's GEMMs (its `MatmulOps` call in the model).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fused {
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

pub(crate) const FP8_SHAPES: [LinearShapes; 2] = [
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
pub(crate) fn recipe_name(b: Fp8Backward) -> String {
    format!("dY {}, dW {}", b.grad.name(), b.weight_grad.name())
}

/// `gpu-timing fp8 [B [T]]` (see the top of the file).
pub(crate) fn fp8_timing(
    be: &CudaBackend,
    b: usize,
    t: usize,
    algos: Option<usize>,
    search: Option<usize>,
) -> BResult<()> {
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
            fill += time_casts(&mut tm, layer, &inp, &dout, &params, s);
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
        print_sums(&tm, shapes.name, sums, &bwd_sums, as_run, fill);
    }
    time_sink_clears(&mut tm)?;
    tm.sweep_summary();
    Ok(())
}

/// The FP8 rows' casts alone (the rest of an FP8 row is its GEMMs), in bytes moved: an amax
/// pass reads 2 per element, a cast reads 2 and writes 1 per layout. Returns the last row's
/// ms (the weight cache's fill).
fn time_casts(
    tm: &mut Timer<'_>,
    layer: &str,
    inp: &CudaSlice<bf16>,
    dout: &CudaSlice<bf16>,
    params: &CudaSlice<bf16>,
    s: MatShape,
) -> f64 {
    let be = tm.be;
    let (n, c, oc) = (s.n, s.c, s.oc);
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
            be.fp8_casts_only(inp, dout, (params, 0), s, which)
        });
    }
    tm.rows.last().map_or(0.0, |r| r.1)
}

/// One model's sums: the backward alone under each recipe, forward + backward, and as the
/// model runs them.
fn print_sums(tm: &Timer<'_>, name: &str, sums: [f64; 3], bwd_sums: &[f64], as_run: [f64; 2], fill: f64) {
    let recipes: Vec<String> = Fp8Backward::ALTERNATIVES
        .into_iter()
        .enumerate()
        .filter(|_| tm.algos.is_none())
        .map(|(r, b)| format!("{} {:.3} ms ({:.2}x)", recipe_name(b), bwd_sums[2 + r], bwd_sums[0] / bwd_sums[2 + r]))
        .collect();
    println!(
        "  {}: the four layers' backward alone: bf16 {:.3} ms, fp8 cached {:.3} ms ({:.2}x){}",
        name,
        bwd_sums[0],
        bwd_sums[1],
        bwd_sums[0] / bwd_sums[1],
        recipes.iter().map(|r| format!("; {r}")).collect::<String>()
    );
    println!(
        "  {}: the four layers' forward + backward: bf16 {:.3} ms, fp8 per use {:.3} ms ({:.2}x), \
         fp8 cached {:.3} ms ({:.2}x; + {:.3} ms once a step to fill the weight cache)",
        name,
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
        name,
        as_run[0],
        as_run[1],
        as_run[0] / as_run[1]
    );
}

/// The amax sinks' slot clears: a 16-byte memset before each producer that leaves an amax
/// (with FP8 about 12 a block a step: 8 sinks, 4 weights' amax passes), 100 of them
/// replayed as a CUDA graph, as a step runs them.
fn time_sink_clears(tm: &mut Timer<'_>) -> BResult<()> {
    let be = tm.be;
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
    Ok(())
}
