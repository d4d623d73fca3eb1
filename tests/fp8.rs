//! `train.precision = "fp8"` on CPU ranks, which simulate the CUDA backend's FP8 GEMMs
//! (e4m3 weights and activations, e5m2 output gradients, per-tensor power-of-two current
//! scaling: `backend/fp8.rs`): a linear layer's FP8 GEMMs are the f32 GEMMs of the rounded
//! operands; the LM head and shapes that are not multiples of 16 stay in full precision;
//! FP8 training gives the same losses on every ZeRO stage, world size and checkpointing
//! choice (within 1e-5, as f32 runs do: the scales are per tensor and a sharded run rounds
//! the same values the same way) and parameters within 1e-3 (looser than f32 runs' 1e-5:
//! an operand within an ulp of an FP8 rounding boundary may round the other way when a
//! sharded run's reductions differ in the last bit, and that element's AdamW update, which
//! Adam normalises, can then differ by up to the learning rate, 3e-3), and stays close to
//! the f32 run on a tiny GPT-2 and Llama.

mod common;

use trainer::backend::cpu::CpuBackend;
use trainer::backend::fp8::{fake_quant_into, Fp8Format};
use trainer::backend::*;
use trainer::train::Trainer;
use trainer::Config;

/// A tiny GPT-2 whose linear layers are all FP8-eligible (every dimension a multiple of 16:
/// C 32, 3C 96, 4C 128, 32 rows per micro-batch).
fn tiny_fp8_toml(stage: u8, accum: usize, activations: &str, precision: &str) -> String {
    common::tiny_toml(stage, accum, activations)
        .replace("n_head = 3\nn_embd = 36\n", "n_head = 2\nn_embd = 32\n")
        .replace("[train]\n", &format!("[train]\nprecision = \"{precision}\"\n"))
}

/// The same as a tiny Llama (qkv 4 + 2·2 heads of 8 = 64, MLP 48, gate/up 96).
fn tiny_llama_fp8_toml(stage: u8, accum: usize, activations: &str, precision: &str, tied: bool) -> String {
    common::tiny_llama_toml(stage, accum, activations, tied)
        .replace("intermediate_size = 40", "intermediate_size = 48")
        .replace("[train]\n", &format!("[train]\nprecision = \"{precision}\"\n"))
}

const LOSS_RTOL: f64 = 1e-5;
const PARAM_ATOL: f32 = 1e-3;

struct Run {
    losses: Vec<f64>,
    params: Vec<Vec<f32>>,
    /// Units gathered as FP8 codes, and the bytes per rank of gathering them all with and
    /// without (`Engine::fp8_gathers`).
    fp8_gathers: (usize, usize, usize),
}

fn run(world: usize, toml: String, steps: usize, data: &std::path::Path) -> Run {
    let mut cfg = Config::from_toml_str(&toml, "test").expect("config");
    cfg.train.steps = steps;
    cfg.validate().expect("valid");
    let data = data.to_path_buf();
    let mut results = common::run_ranks(world, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&cfg, &be, rank, world, &data).expect("trainer");
        let losses = (0..cfg.train.steps).map(|_| tr.train_step(&be, &mut comm).expect("step").loss).collect();
        let fp8_gathers = tr.engine.fp8_gathers();
        Run { losses, params: tr.full_params(&be, &mut comm).expect("params"), fp8_gathers }
    });
    for r in &results[1..] {
        assert_eq!(r.losses, results[0].losses, "ranks disagree on loss");
    }
    results.swap_remove(0)
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| ((x - y) / y).abs()).fold(0.0, f64::max)
}

/// Two runs with the same bits: every loss and every parameter.
fn assert_same_bits(a: &Run, b: &Run, name: &str) {
    assert_eq!(a.losses, b.losses, "{name}: losses");
    assert_eq!(a.params, b.params, "{name}: parameters");
}

fn max_abs(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// `got` within the tolerances above of `want` (losses relative, parameters absolute); the
/// two differences.
fn assert_close(got: &Run, want: &Run, name: &str) -> (f64, f32) {
    let (rel, abs) = (max_rel(&got.losses, &want.losses), max_abs(&got.params, &want.params));
    assert!(rel <= LOSS_RTOL && abs <= PARAM_ATOL, "{name}: loss rel {rel:e}, params abs {abs:e}");
    (rel, abs)
}

#[test]
fn fp8_matmul_is_the_gemm_of_the_rounded_operands() {
    let cpu = CpuBackend::new();
    let (n, c, oc) = (32usize, 48usize, 64usize);
    let vec = |stream: u64, len: usize, scale: f64| -> Vec<f32> {
        (0..len).map(|i| (trainer::rng::normal(7, stream, i as u64) * scale) as f32).collect()
    };
    let (w, x, dy) = (vec(1, oc * c + oc, 0.2), vec(2, n * c, 3.0), vec(3, n * oc, 1e-3));
    let at = LinearLocs::new(Loc::new(0, oc * c), Some(Loc::new(oc * c, oc)));
    let s = MatShape { n, c, oc };
    let q = |v: &[f32], f| {
        let mut o = vec![0.0; v.len()];
        fake_quant_into(&mut o, v, f);
        o
    };
    // Forward: the f32 GEMM of e4m3-rounded input and weight, plus the (unrounded) bias.
    let mut wq = q(&w[..oc * c], Fp8Format::E4M3);
    wq.extend_from_slice(&w[oc * c..]);
    let (mut want, mut got, mut exact) = (vec![0.0; n * oc], vec![0.0; n * oc], vec![0.0; n * oc]);
    cpu.matmul_fwd(&mut want, &q(&x, Fp8Format::E4M3), Weights::new(&wq, at), s).unwrap();
    cpu.matmul_fwd(&mut got, &x, Weights::new(&w, at.with_precision(Precision::Fp8)), s).unwrap();
    cpu.matmul_fwd(&mut exact, &x, Weights::new(&w, at), s).unwrap();
    assert_eq!(got, want);
    // ... which is not the f32 product, but close to it (e4m3 keeps 3 mantissa bits).
    let err = got.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    let big = exact.iter().map(|v| v.abs()).fold(0.0, f32::max);
    assert!(err > 0.0 && err < 0.1 * big, "fp8 forward error {err} of {big}");
    // Backward: dX from e5m2 dY and e4m3 W; dW from e5m2 dY and e4m3 X; dbias from dY.
    let (mut dx_w, mut g_w) = (vec![0.0; n * c], vec![0.0; oc * c + oc]);
    let wg = WeightGrads { buf: &mut g_w, at, fresh: true };
    cpu.matmul_bwd(&mut dx_w, wg, &q(&dy, Fp8Format::E5M2), &q(&x, Fp8Format::E4M3), Weights::new(&wq, at), s).unwrap();
    let (mut dx, mut g) = (vec![0.0; n * c], vec![0.0; oc * c + oc]);
    let wg = WeightGrads { buf: &mut g, at: at.with_precision(Precision::Fp8), fresh: true };
    cpu.matmul_bwd(&mut dx, wg, &dy, &x, Weights::new(&w, at.with_precision(Precision::Fp8)), s).unwrap();
    assert_eq!(dx, dx_w);
    assert_eq!(g[..oc * c], g_w[..oc * c]);
    let dbias: Vec<f32> = (0..oc).map(|j| (0..n).map(|i| dy[i * oc + j]).sum()).collect();
    for (a, b) in g[oc * c..].iter().zip(&dbias) {
        assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-3), "dbias {a} vs {b}");
    }
}

/// The backward's recipes (`train.fp8_grad_format`, `train.fp8_weight_grad`): with e4m3
/// output gradients both backward GEMMs read dY rounded to e4m3; with the weight gradient in
/// bf16, dX is the default's and dW is the full-precision GEMM of the unquantized dY and X.
#[test]
fn fp8_backward_recipes_are_the_gemms_of_their_operands() {
    let (n, c, oc) = (32usize, 48usize, 64usize);
    let vec = |stream: u64, len: usize, scale: f64| -> Vec<f32> {
        (0..len).map(|i| (trainer::rng::normal(11, stream, i as u64) * scale) as f32).collect()
    };
    let (w, x, dy) = (vec(1, oc * c, 0.2), vec(2, n * c, 3.0), vec(3, n * oc, 1e-3));
    let at = LinearLocs::new(Loc::new(0, oc * c), None);
    let s = MatShape { n, c, oc };
    let q = |v: &[f32], f| {
        let mut o = vec![0.0; v.len()];
        fake_quant_into(&mut o, v, f);
        o
    };
    // (dX, dW) of the plain f32 backward of the given operands.
    let plain = |dy: &[f32], x: &[f32], w: &Vec<f32>| {
        let cpu = CpuBackend::new();
        let (mut dx, mut g) = (vec![0.0; n * c], vec![0.0; oc * c]);
        let wg = WeightGrads { buf: &mut g, at, fresh: true };
        cpu.matmul_bwd(&mut dx, wg, &dy.to_vec(), &x.to_vec(), Weights::new(w, at), s).unwrap();
        (dx, g)
    };
    // (dX, dW) of the FP8 backward under `backward`.
    let fp8 = |backward: Fp8Backward| {
        let cpu = CpuBackend::new();
        cpu.prepare_fp8(&Fp8Layers::blocks(n, &[(c, oc)], 1, 0).with_backward(backward)).unwrap();
        let at = at.with_precision(Precision::Fp8);
        let (mut dx, mut g) = (vec![0.0; n * c], vec![0.0; oc * c]);
        let wg = WeightGrads { buf: &mut g, at, fresh: true };
        cpu.matmul_bwd(&mut dx, wg, &dy, &x, Weights::new(&w, at), s).unwrap();
        (dx, g)
    };
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let (wq, xq) = (q(&w, e4), q(&x, e4));
    let default = fp8(Fp8Backward::default());
    assert_eq!(default, plain(&q(&dy, e5), &xq, &wq), "the default: e5m2 dY in both GEMMs");
    let e4m3 = fp8(Fp8Backward { grad: Fp8GradFormat::E4m3, ..Fp8Backward::default() });
    assert_eq!(e4m3, plain(&q(&dy, e4), &xq, &wq), "e4m3 dY in both GEMMs");
    assert_ne!(e4m3.1, default.1, "e4m3 and e5m2 round dY differently");
    let hp = fp8(Fp8Backward { weight_grad: Fp8WeightGrad::Bf16, ..Fp8Backward::default() });
    assert_eq!(hp.0, default.0, "dX as the default's");
    assert_eq!(hp.1, plain(&dy, &x, &w).1, "dW from the unquantized operands");
    let both = fp8(Fp8Backward { grad: Fp8GradFormat::E4m3, weight_grad: Fp8WeightGrad::Bf16 });
    assert_eq!(both, (e4m3.0.clone(), hp.1.clone()), "e4m3 dX, full-precision dW");
}

#[test]
fn shapes_that_are_not_multiples_of_16_stay_in_full_precision() {
    let cpu = CpuBackend::new();
    let (n, c, oc) = (32usize, 36usize, 64usize);
    let w: Vec<f32> = (0..oc * c).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.003).collect();
    let x: Vec<f32> = (0..n * c).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.01).collect();
    let at = LinearLocs::new(Loc::new(0, oc * c), None);
    let s = MatShape { n, c, oc };
    assert!(!at.with_precision(Precision::Fp8).fp8(s));
    let (mut a, mut b) = (vec![0.0; n * oc], vec![0.0; n * oc]);
    cpu.matmul_fwd(&mut a, &x, Weights::new(&w, at), s).unwrap();
    cpu.matmul_fwd(&mut b, &x, Weights::new(&w, at.with_precision(Precision::Fp8)), s).unwrap();
    assert_eq!(a, b);
}

/// FP8 changes the numbers (the layers really are quantized), trains, and stays near the
/// f32 run: over 80 steps of the tiny GPT-2 and Llama (8 × 16 tokens, lr 1e-2, clipping at
/// 1), the mean of the last 20 losses within 2% of the f32 run's, and well below the first.
#[test]
fn fp8_training_stays_close_to_full_precision() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 40_000);
    let fast = |t: String| {
        t.replace("lr = 3e-3", "lr = 1e-2")
            .replace("grad_clip = 0.05", "grad_clip = 1.0")
            .replace("micro_batch = 2", "micro_batch = 8")
    };
    let gpt = |p: &str| fast(tiny_fp8_toml(0, 1, "\"none\"", p));
    let llama = |p: &str| fast(tiny_llama_fp8_toml(0, 1, "\"none\"", p, false));
    let tail = |l: &[f64]| l[l.len() - 20..].iter().sum::<f64>() / 20.0;
    for (name, toml) in [("gpt2", &gpt as &dyn Fn(&str) -> String), ("llama", &llama)] {
        let full = run(1, toml("bf16"), 80, &data);
        let fp8 = run(1, toml("fp8"), 80, &data);
        assert!(fp8.losses[0] != full.losses[0], "{name}: the first loss is bit-identical: nothing was quantized");
        let (a, b) = (tail(&fp8.losses), tail(&full.losses));
        eprintln!("{name}: last 20 steps' mean loss: fp8 {a:.4}, f32 {b:.4} (first {:.4})", fp8.losses[0]);
        assert!(((a - b) / b).abs() < 0.02, "{name}: fp8 {:?} vs f32 {:?}", fp8.losses, full.losses);
        assert!(a < fp8.losses[0] * 0.8, "{name}: fp8 does not train: {:?}", fp8.losses);
    }
}

/// The sharding test's promise for FP8: every stage, 2 and 3 ranks, checkpointing or not,
/// the single-rank stage-0 run's losses (rel 1e-5) and parameters (abs 1e-3, see the top).
#[test]
fn fp8_matches_single_rank_on_every_stage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let mut worst = (0.0f64, 0.0f32);
    for world in [2usize, 3] {
        let reference = run(1, tiny_fp8_toml(0, 2 * world, "\"none\"", "fp8"), 4, &data);
        for stage in 0..=3u8 {
            for act in ["\"none\"", "\"every_layer\"", common::KEEP_ATTENTION] {
                let got = run(world, tiny_fp8_toml(stage, 2, act, "fp8"), 4, &data);
                let (rel, abs) = assert_close(&got, &reference, &format!("fp8 world {world} stage {stage} {act}"));
                worst = (worst.0.max(rel), worst.1.max(abs));
            }
        }
        let llama_ref = run(1, tiny_llama_fp8_toml(0, 2 * world, "\"none\"", "fp8", true), 4, &data);
        for stage in [1u8, 3] {
            let got = run(world, tiny_llama_fp8_toml(stage, 2, common::KEEP_GELU, "fp8", true), 4, &data);
            let (rel, abs) = assert_close(&got, &llama_ref, &format!("fp8 llama world {world} stage {stage}"));
            worst = (worst.0.max(rel), worst.1.max(abs));
        }
    }
    eprintln!("fp8 sharded vs single rank: worst loss rel {:e}, params abs {:e}", worst.0, worst.1);
}

/// The backward's recipes train, shard like the default (a 2-rank ZeRO-3 run with
/// checkpointing gives the single-rank stage-0 run's losses and parameters within the
/// tolerances above) and change the run's bits (they are not ignored), on GPT-2 and Llama.
#[test]
fn fp8_backward_recipes_train_the_same_on_every_stage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let recipe = |t: String, grad: &str, wgrad: &str| {
        t.replace("[train]\n", &format!("[train]\nfp8_grad_format = \"{grad}\"\nfp8_weight_grad = \"{wgrad}\"\n"))
    };
    let gpt = |stage: u8, accum: usize, act: &str| tiny_fp8_toml(stage, accum, act, "fp8");
    let llama = |stage: u8, accum: usize, act: &str| tiny_llama_fp8_toml(stage, accum, act, "fp8", true);
    for (name, toml) in [("gpt2", &gpt as &dyn Fn(u8, usize, &str) -> String), ("llama", &llama)] {
        let default = run(1, toml(0, 4, "\"none\""), 4, &data);
        for b in Fp8Backward::ALTERNATIVES {
            let (grad, wgrad) = (b.grad.name(), b.weight_grad.name());
            let tag = format!("{name}, fp8_grad_format {grad}, fp8_weight_grad {wgrad}");
            let single = run(1, recipe(toml(0, 4, "\"none\""), grad, wgrad), 4, &data);
            assert_ne!(single.params, default.params, "{tag}: the default's parameters: the recipe did nothing");
            assert!(single.losses[3] < single.losses[0], "{tag}: the loss falls: {:?}", single.losses);
            let sharded = run(2, recipe(toml(3, 2, "\"every_layer\""), grad, wgrad), 4, &data);
            assert_close(&sharded, &single, &format!("{tag}, 2 ranks stage 3"));
        }
    }
}

/// `train.fp8_weight_cache`: a weight cast once per parameter version gives the bits of a
/// weight cast at every use, over several optimizer steps (each changes the parameters),
/// with gradient accumulation (every micro-step's forward, recompute and backward read the
/// cache the step's first forward made), activation checkpointing (recomputes), kept
/// attention, one and two ranks, ZeRO stages 0-3 (stage 3 makes the cache from gathered
/// weights in pooled buffers), every block cached or only the first, GPT-2 and Llama. The
/// CPU reference also checks, at every backward, that the input whose forward scale it
/// reuses is the forward's.
#[test]
fn the_fp8_weight_cache_gives_the_bits_of_casting_at_each_use() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let cache = |t: String, on: &str| t.replace("[train]\n", &format!("[train]\nfp8_weight_cache = {on}\n"));
    for (world, stage) in [(1usize, 0u8), (2, 1), (2, 2), (1, 3), (2, 3)] {
        for act in ["\"none\"", "\"every_layer\"", common::KEEP_ATTENTION] {
            let toml = tiny_fp8_toml(stage, 2, act, "fp8");
            let off = run(world, cache(toml.clone(), "false"), 3, &data);
            for on in ["true", "1"] {
                let tag = format!("gpt2 world {world} stage {stage} {act}, fp8_weight_cache = {on}");
                assert_same_bits(&run(world, cache(toml.clone(), on), 3, &data), &off, &tag);
            }
        }
        let toml = tiny_llama_fp8_toml(stage, 2, "1", "fp8", false);
        let off = run(world, cache(toml.clone(), "false"), 3, &data);
        for on in ["true", "1"] {
            let tag = format!("llama world {world} stage {stage}, fp8_weight_cache = {on}");
            assert_same_bits(&run(world, cache(toml.clone(), on), 3, &data), &off, &tag);
        }
    }
}

/// `zero.fp8_gather = true`: ZeRO-3 gathering the blocks' FP8 weights as e4m3 codes
/// with their tensors' scales gives the bits of gathering them at full precision, since the
/// GEMMs round them to those same codes: the same losses and parameters, over several
/// steps (each a new parameter version, new amaxes), with gradient accumulation,
/// checkpointing and kept attention, on 2 and 3 ranks (pieces that cut weights anywhere),
/// GPT-2 and Llama (whose q, k and v share their fused weight's scale, as in the GEMM); GPT-2
/// also with the FP8 weight cache made from the expanded codes.
#[test]
fn fp8_gathers_give_the_bits_of_full_precision_gathers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let gather = |t: String, on: bool| t.replace("[zero]\n", &format!("[zero]\nfp8_gather = {on}\n"));
    for world in [2usize, 3] {
        for act in ["\"none\"", "\"every_layer\"", common::KEEP_ATTENTION] {
            let toml = tiny_fp8_toml(3, 2, act, "fp8");
            assert!(toml.contains("[zero]\n"), "the test config has a [zero] table");
            let (on, off) =
                (run(world, gather(toml.clone(), true), 3, &data), run(world, gather(toml.clone(), false), 3, &data));
            let name = format!("gpt2 world {world} {act}");
            // Every block gathered as codes (one byte a weight against f32's four), none without.
            let (units, fp8, full) = on.fp8_gathers;
            assert!(units == 2 && 3 * fp8 < full, "{name}: {units} units, {fp8} bytes against {full}");
            assert_eq!(off.fp8_gathers.0, 0, "{name}");
            assert_same_bits(&on, &off, &name);
            // With the FP8 weight cache made from the expanded codes: the same bits again.
            let cached = gather(toml, true).replace("[train]\n", "[train]\nfp8_weight_cache = true\n");
            assert_same_bits(&run(world, cached, 3, &data), &off, &format!("{name}, weights cached"));
        }
        let toml = tiny_llama_fp8_toml(3, 2, "1", "fp8", false);
        let (on, off) = (run(world, gather(toml.clone(), true), 3, &data), run(world, gather(toml, false), 3, &data));
        assert_eq!((on.fp8_gathers.0, off.fp8_gathers.0), (2, 0), "llama world {world}");
        assert_same_bits(&on, &off, &format!("llama world {world}"));
    }
}

/// FP8 with the optimizer on the host (`offload.optimizer`, and at ZeRO-3 the parameters too):
/// the same bits as the device optimizer, on 2 ranks at stages 1 and 3 — the host AdamW
/// updates the fp32 master weights, and the FP8 GEMMs round what it publishes as they round
/// any weight.
#[test]
fn fp8_with_the_optimizer_offloaded_trains_the_same_bits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for (stage, accum, params) in [(1u8, 2usize, false), (3, 2, false), (3, 1, true)] {
        let toml = tiny_fp8_toml(stage, accum, "\"every_layer\"", "fp8");
        let offload = format!("{toml}\n[offload]\noptimizer = true\nparams = {params}\ncpu_threads = 2\n");
        let (device, host) = (run(2, toml, 3, &data), run(2, offload, 3, &data));
        let name = format!("stage {stage}, parameters offloaded {params}");
        assert_same_bits(&host, &device, &name);
        assert!(device.losses[2] < device.losses[0], "{name}: the loss falls: {:?}", device.losses);
    }
}

/// `train.fp8_bf16_layers`: the named layers' GEMMs run unquantized. Every layer kept gives
/// the bits of a bf16 run (the FP8 state numbered for them is never read); one layer kept
/// trains, differs from both plain runs (it is not ignored, nor is the rest), and shards
/// like the default: 2 ranks at ZeRO-3 with checkpointing and the weight cache match the
/// single rank within the tolerances above, and their FP8 gathers (which must send the kept
/// layer at full precision) give the bits of full-precision gathers. GPT-2 (proj) and
/// Llama (o).
#[test]
fn layers_kept_in_bf16_under_fp8_run_unquantized_and_shard_the_same() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let keep = |t: String, names: &str| t.replace("[train]\n", &format!("[train]\nfp8_bf16_layers = [{names}]\n"));
    let gpt = |stage: u8, accum: usize, act: &str, p: &str| tiny_fp8_toml(stage, accum, act, p);
    let llama = |stage: u8, accum: usize, act: &str, p: &str| tiny_llama_fp8_toml(stage, accum, act, p, true);
    type Toml<'a> = &'a dyn Fn(u8, usize, &str, &str) -> String;
    let families: [(&str, Toml, &str, &str); 2] = [
        ("gpt2", &gpt, r#""qkv", "proj", "fc", "fc2""#, r#""proj""#),
        ("llama", &llama, r#""qkv", "o", "gate_up", "down""#, r#""o""#),
    ];
    for (name, toml, all, one) in families {
        let bf16 = run(1, toml(0, 4, "\"none\"", "bf16"), 4, &data);
        let all_kept = run(1, keep(toml(0, 4, "\"none\"", "fp8"), all), 4, &data);
        assert_same_bits(&all_kept, &bf16, &format!("{name}: every layer kept in bf16 against a bf16 run"));
        let plain = run(1, toml(0, 4, "\"none\"", "fp8"), 4, &data);
        let single = run(1, keep(toml(0, 4, "\"none\"", "fp8"), one), 4, &data);
        let tag = format!("{name}, {one} kept in bf16");
        assert_ne!(single.params, plain.params, "{tag}: the plain fp8 run's parameters: the key did nothing");
        assert_ne!(single.params, bf16.params, "{tag}: the bf16 run's parameters: nothing ran in FP8");
        assert!(single.losses[3] < single.losses[0], "{tag}: the loss falls: {:?}", single.losses);
        let sharded =
            keep(toml(3, 2, "\"every_layer\"", "fp8"), one).replace("[train]\n", "[train]\nfp8_weight_cache = true\n");
        let got = run(2, sharded.clone(), 4, &data);
        assert_close(&got, &single, &format!("{tag}, 2 ranks stage 3"));
        let gathered = run(2, sharded.replace("[zero]\n", "[zero]\nfp8_gather = true\n"), 4, &data);
        assert_eq!(gathered.fp8_gathers.0, 2, "{tag}: both blocks gathered as FP8 codes");
        assert_same_bits(&gathered, &got, &format!("{tag}: FP8 gathers"));
    }
}

/// What [`run_with`] gives (rank 0's).
struct Handmade {
    /// Per step, the loss.
    losses: Vec<f64>,
    /// The parameters at the end, per unit.
    params: Vec<Vec<f32>>,
    /// The activations the ledger counted.
    activations: u64,
    /// Over the steps' first micro-steps, how many FP8 weights used the amax the optimizer
    /// step left, and how many cached FP8 weights were the ones the step wrote.
    amaxes_from_step: usize,
    coded_by_step: usize,
    /// How many FP8 GEMMs applied a norm in their cast, and how many FP8 casts found their
    /// amax themselves (predicted scales).
    norms_in_casts: usize,
    casts_without_amax: usize,
}

/// A hand-driven FP8 run (what `Trainer` does; without the amaxes the optimizer step leaves
/// where `step_amax` is false: `EngineOptions::fp8_step_amax`).
fn run_with(cfg: &Config, world: usize, step_amax: bool, steps: usize) -> Handmade {
    use trainer::model::{step_micro, ModelLayout, ModelOptions};
    use trainer::optim::Hyper;
    use trainer::zero::{Engine, EngineOptions};
    let cfg = cfg.clone();
    let mut results = common::run_ranks(world, move |rank, mut comm| {
        let be = CpuBackend::new();
        let layout = ModelLayout::new(&cfg.model);
        let (family, l2, seed) = (cfg.model.family, layout.clone(), cfg.train.seed);
        let mut init = |u, r| Ok(family.init_range(&l2, u, seed, cfg.init.scheme, r));
        let eopts = EngineOptions::from_config(&cfg);
        let eopts = EngineOptions { fp8_step_amax: eopts.fp8_step_amax.filter(|_| step_amax), ..eopts };
        let mut eng = Engine::new(&be, layout, eopts, rank, world, Some(&mut init)).expect("engine");
        let opts = ModelOptions::from_config(&cfg);
        let mut model = family.build(&be, &eng.layout, &opts, &mut eng.ledger).expect("model");
        let (accum, n) = (cfg.train.grad_accum, cfg.train.micro_batch * cfg.model.seq_len);
        let (mut losses, mut from_step, mut coded) = (Vec::new(), 0, 0);
        for step in 0..steps {
            eng.begin_step(&be).expect("begin");
            for micro in 0..accum {
                let tok = |i: usize| ((i * 7 + 13 * micro + 31 * step + 57 * rank) % 97) as u32;
                let (x, y): (Vec<u32>, Vec<u32>) = ((0..n).map(tok).collect(), (0..n).map(|i| tok(i + 1)).collect());
                eng.set_final_micro(micro + 1 == accum);
                let scale = Some(1.0 / (n * accum * world) as f32);
                let batch = trainer::model::MicroBatch::plain(&x, &y);
                step_micro(model.as_mut(), &be, &mut eng, &mut comm, &batch, scale).expect("micro");
                if micro == 0 {
                    from_step += be.fp8_weight_amaxes_from_step();
                    coded += be.fp8_weights_coded_by_step();
                }
            }
            let h = Hyper { lr: 3e-3, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, grad_clip: 1.0 };
            eng.step(&be, &mut comm, h, step as u64 + 1).expect("step");
            losses.push(model.take_mean_loss(&be).expect("loss"));
        }
        let params = (0..eng.num_units()).map(|u| eng.full_params_host(&be, &mut comm, u).expect("params")).collect();
        let activations = eng.ledger.report().current.activations;
        Handmade {
            losses,
            params,
            activations,
            amaxes_from_step: from_step,
            coded_by_step: coded,
            norms_in_casts: be.fp8_norms_applied_in_casts(),
            casts_without_amax: be.fp8_casts_without_amax(),
        }
    });
    results.swap_remove(0)
}

/// The FP8 savings of blocks that are not checkpointed give the bits of blocks that are,
/// where none of them runs: the layers keep their input's FP8 codes from the forward for the
/// backward's weight gradient (`Fp8Layer::keeps_input`; with `keep_gelu`, fc2's and down's
/// codes of the activation replace the kept bf16 output) instead of casting it again, and
/// the layers that read a norm's output (GPT-2's qkv and fc, Llama's qkv and gate/up) take it
/// from the norm's input, the norm applied by their cast (`MatmulOps::matmul_fwd_of_norm`),
/// instead of the norm's output written and cast. Over several steps with gradient
/// accumulation, on GPT-2 and Llama, one rank and ZeRO-3 on two, with and without
/// keep_gelu, against every block checkpointed; the paths run (both norms of every block in
/// their casts, but GPT-2's ln2 only where fc2 takes GELU from the pre-activation:
/// keep_gelu) and change what is held. The CPU reference keeps the codes as bytes, refuses a
/// backward that reads codes no forward kept, and checks the statistics it is handed are
/// the norm's.
#[test]
fn fp8_savings_give_the_bits_of_checkpointed_blocks() {
    for v in saving_variants().into_iter().filter(|v| v.act != "2\nkeep_gelu = true") {
        let (tag, name, act) = (&v.tag, v.family, v.act);
        let toml = v.toml.replace("activations = \"none\"", "activations = \"every_layer\"");
        assert_ne!(toml, v.toml, "{tag}: the checkpointed twin");
        let cfg = Config::from_toml_str(&toml, "test").expect("config");
        let checkpointed = run_with(&cfg, v.world, true, 3);
        let Handmade { losses: l0, params: p0, activations: a0, norms_in_casts: off, .. } = checkpointed;
        let Handmade { losses: l1, params: p1, activations: a1, norms_in_casts: on, casts_without_amax, .. } =
            run_with(&v.cfg, v.world, true, 3);
        assert_eq!(l1, l0, "{tag}: losses against every block checkpointed");
        assert_eq!(p1, p0, "{tag}: parameters");
        assert!(l1[2] < l1[0], "{tag}: the loss falls: {l1:?}");
        assert_ne!(a1, a0, "{tag}: the kept codes change the activations held");
        assert_eq!(off, 0, "{tag}: no norm in a cast in checkpointed blocks");
        // 2 blocks, 2 norms each, 3 steps of 2 micro-steps.
        let all = 2 * 2 * 3 * 2;
        match name {
            "gpt2" if act == "\"none\"" => assert_eq!(on, all / 2, "{tag}: ln1 of every forward in qkv's cast"),
            _ => assert_eq!(on, all, "{tag}: both norms of every forward in their casts"),
        }
        // GPT-2's casts that make what they cast and find its amax themselves (predicted
        // scales on CUDA): fc's backward of GELU's gradient in every block, and with
        // keep_gelu fc2's forward of GELU's output; the checkpointed blocks' fc2 writes GELU's
        // output. Llama's SwiGLU output and gradient are always written.
        let backwards = 2 * 3 * 2;
        let (want, want_checkpointed) = match (name, act) {
            ("gpt2", "\"none\"") => (backwards, backwards),
            ("gpt2", _) => (2 * backwards, backwards),
            _ => (0, 0),
        };
        assert_eq!(casts_without_amax, want, "{tag}: casts that found their own amax");
        assert_eq!(checkpointed.casts_without_amax, want_checkpointed, "{tag}: the same, checkpointed");
    }
}

/// One configuration of the FP8 savings' on/off tests.
struct SavingVariant {
    family: &'static str,
    world: usize,
    /// `checkpointing.activations` as the TOML gives it (with keep_gelu where said).
    act: &'static str,
    tag: String,
    toml: String,
    cfg: Config,
}

/// GPT-2 and Llama (2 micro-steps a step), one rank at stage 0 and ZeRO-3 on two, with no
/// checkpointing, keep_gelu, and every second block checkpointed with keep_gelu.
fn saving_variants() -> Vec<SavingVariant> {
    let gpt = |stage: u8, act: &str| tiny_fp8_toml(stage, 2, act, "fp8");
    let llama = |stage: u8, act: &str| tiny_llama_fp8_toml(stage, 2, act, "fp8", false);
    let mut out = Vec::new();
    for (family, toml) in [("gpt2", &gpt as &dyn Fn(u8, &str) -> String), ("llama", &llama)] {
        for (world, stage) in [(1usize, 0u8), (2, 3)] {
            for act in ["\"none\"", common::KEEP_GELU, "2\nkeep_gelu = true"] {
                let toml = toml(stage, act);
                let cfg = Config::from_toml_str(&toml, "test").expect("config");
                let tag = format!("{family} world {world} stage {stage} checkpointing {act:?}");
                out.push(SavingVariant { family, world, act, tag, toml, cfg });
            }
        }
    }
    out
}

/// The CPU reference refuses what would make the GPU's kept codes wrong unseen: a backward
/// reading kept codes that no forward kept since the last backward, and a backward without
/// its input for a layer that keeps none.
#[test]
fn kept_fp8_inputs_are_refused_where_no_forward_kept_them() {
    let cpu = CpuBackend::new();
    let (n, c, oc) = (32usize, 48usize, 64usize);
    let layers = Fp8Layers::blocks(n, &[(c, oc)], 1, 0).with_kept_inputs(vec![true]);
    assert_eq!(cpu.prepare_fp8(&layers).expect("prepare").kept_inputs, n * c);
    let params: Vec<f32> = (0..oc * c + oc).map(|i| ((i % 13) as f32 - 6.0) / 40.0).collect();
    let at = LinearLocs::new(Loc::new(0, oc * c), Some(Loc::new(oc * c, oc))).with_precision(Precision::Fp8);
    let (keeps, plain) = (at.with_fp8_index(0).with_kept_input(true), at.with_fp8_index(0));
    let s = MatShape { n, c, oc };
    let x: Vec<f32> = (0..n * c).map(|i| ((i % 7) as f32 - 3.0) / 5.0).collect();
    let dy: Vec<f32> = (0..n * oc).map(|i| ((i % 5) as f32 - 2.0) / 9.0).collect();
    let (mut out, mut dx, mut grads) = (vec![0.0; n * oc], vec![0.0; n * c], vec![0.0; oc * c + oc]);
    fn g(grads: &mut Vec<f32>, at: LinearLocs) -> WeightGrads<'_, CpuBackend, LinearLocs> {
        WeightGrads { buf: grads, at, fresh: true }
    }
    let e = cpu.matmul_bwd_kept(&mut dx, g(&mut grads, keeps), &dy, Weights::new(&params, keeps), s).unwrap_err();
    assert!(e.to_string().contains("no forward kept"), "{e}");
    cpu.matmul_fwd(&mut out, &x, Weights::new(&params, keeps), s).expect("forward");
    cpu.matmul_bwd_kept(&mut dx, g(&mut grads, keeps), &dy, Weights::new(&params, keeps), s).expect("backward");
    let kept_dw = grads.clone();
    // The same as the backward given its input and casting it.
    cpu.matmul_fwd(&mut out, &x, Weights::new(&params, plain), s).expect("forward");
    cpu.matmul_bwd(&mut dx, g(&mut grads, plain), &dy, &x, Weights::new(&params, plain), s).expect("backward");
    assert_eq!(grads, kept_dw, "dW from the kept codes");
    // One backward per forward.
    let e = cpu.matmul_bwd_kept(&mut dx, g(&mut grads, keeps), &dy, Weights::new(&params, keeps), s).unwrap_err();
    assert!(e.to_string().contains("no forward kept"), "{e}");
    let e = cpu.matmul_bwd_kept(&mut dx, g(&mut grads, plain), &dy, Weights::new(&params, plain), s).unwrap_err();
    assert!(e.to_string().contains("keeps no FP8 input"), "{e}");
}

/// The optimizer step leaves the amax of each FP8 weight it writes whole
/// (`AdamWSegment::fp8_layer`), and the next version's casts use it instead of measuring the
/// weight: the bits of measuring it (what the weights of other ranks' shards and ZeRO-3's
/// get), on GPT-2 and Llama, with
/// the weights cached and cast at each use, on one rank and sharded (stage 1 and 2 on two
/// ranks: each rank leaves the amaxes of the weights in its own shard, the others' are
/// measured). It is used (every FP8 weight from the second step on, on one rank; some on
/// two), not on ZeRO-3 (no step writes the compute weights there). The CPU reference checks
/// each amax it uses against the weight's: a stale one is an error.
#[test]
fn fp8_weight_amaxes_left_by_the_step_give_the_bits_of_measuring_them() {
    let gpt = |stage: u8| tiny_fp8_toml(stage, 2, "\"none\"", "fp8");
    let llama = |stage: u8| tiny_llama_fp8_toml(stage, 1, "\"none\"", "fp8", false);
    let steps = 3;
    for (name, toml) in [("gpt2", &gpt as &dyn Fn(u8) -> String), ("llama", &llama)] {
        for (world, stage) in [(1usize, 1u8), (2, 1), (2, 2), (2, 3)] {
            for cache in ["true", "false"] {
                let toml = toml(stage).replace("[train]\n", &format!("[train]\nfp8_weight_cache = {cache}\n"));
                let cfg = Config::from_toml_str(&toml, "test").expect("config");
                let tag = format!("{name} world {world} stage {stage} cached {cache}");
                let Handmade { losses: l0, params: p0, amaxes_from_step: none, .. } =
                    run_with(&cfg, world, false, steps);
                let Handmade { losses: l1, params: p1, amaxes_from_step: used, .. } =
                    run_with(&cfg, world, true, steps);
                assert_eq!(l1, l0, "{tag}: losses");
                assert_eq!(p1, p0, "{tag}: parameters");
                assert!(l1[steps - 1] < l1[0], "{tag}: the loss falls: {l1:?}");
                assert_eq!(none, 0, "{tag}: no amax from the step where it is off");
                // Every FP8 weight, left by steps 1.. for steps 2..
                let layout = trainer::model::ModelLayout::new(&cfg.model);
                let (rows, bf16) = (cfg.train.micro_batch * cfg.model.seq_len, [false; 4]);
                let weights: usize = cfg.model.family.fp8_weight_layers(&layout, rows, bf16).iter().map(Vec::len).sum();
                let all = weights * (steps - 1);
                match (world, stage) {
                    (_, 3) => assert_eq!(used, 0, "{tag}: ZeRO-3's step writes no compute weights"),
                    (1, _) => assert_eq!(used, all, "{tag}: every FP8 weight's amax from the step"),
                    _ => assert!(used > 0 && used < all, "{tag}: rank 0's own weights only: {used} of {all}"),
                }
            }
        }
    }
}

/// One FP8 layer on the CPU reference after an optimizer step that wrote its whole weight
/// (`AdamWSegment::fp8_layer`): its weight cached and written by the step where `cached`
/// (`Fp8Layers::step_codes`), else cast at each use; with an input and an output for its
/// forward. The new version is the caller's to begin.
struct AfterAStep {
    cpu: CpuBackend,
    params: Vec<f32>,
    at: LinearLocs,
    x: Vec<f32>,
    out: Vec<f32>,
    s: MatShape,
}

fn cpu_fp8_layer_after_a_step(cached: bool) -> AfterAStep {
    let cpu = CpuBackend::new();
    let (n, c, oc) = (32usize, 48usize, 64usize);
    let layers = Fp8Layers::blocks(n, &[(c, oc)], 1, usize::from(cached)).with_step_codes(cached);
    cpu.prepare_fp8(&layers).expect("prepare");
    let mut params: Vec<f32> = (0..oc * c).map(|i| ((i % 13) as f32 - 6.0) / 40.0).collect();
    let (mut master, mut m, mut v, grads) = (params.clone(), vec![0.0; oc * c], vec![0.0; oc * c], vec![0.01; oc * c]);
    let seg = AdamWSegment { fp8_layer: Some(0), ..AdamWSegment::plain(0, 0, 0, oc * c, true) };
    let h = AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0, t: 1, grad_scale: 1.0 };
    let t = AdamWTensors { params: Some(&mut params), master: &mut master, m: &mut m, v: &mut v, grads: &grads };
    cpu.adamw(t, &[seg], h).expect("adamw");
    let at = LinearLocs::new(Loc::new(0, oc * c), None).with_precision(Precision::Fp8).with_fp8_index(0);
    let x = (0..n * c).map(|i| ((i % 7) as f32 - 3.0) / 5.0).collect();
    AfterAStep { cpu, params, at, x, out: vec![0.0; n * oc], s: MatShape { n, c, oc } }
}

/// Where the optimizer step writes a cached FP8 layer's whole weight it writes the cache too
/// (`Fp8Layers::step_codes`; on CUDA the codes, with a predicted scale and a check), and the
/// version it begins casts that weight no more: the bits of casting it at its first use
/// (what ZeRO-3 does, whose step writes no compute weights), on GPT-2 and Llama, on one rank
/// and sharded (stage 1 and 2 on two ranks: each rank writes the cache of the weights in its
/// own shard, the others' are cast at first use), against ZeRO-3 on as many ranks. The CPU
/// reference checks the cache the step wrote against the weight at each use: a stale one is
/// an error (below).
#[test]
fn fp8_weight_caches_written_by_the_step_give_the_bits_of_casting_them() {
    let gpt = |stage: u8| tiny_fp8_toml(stage, 2, "\"none\"", "fp8");
    let llama = |stage: u8| tiny_llama_fp8_toml(stage, 1, "\"none\"", "fp8", false);
    let steps = 3;
    let cached = |toml: String| toml.replace("[train]\n", "[train]\nfp8_weight_cache = true\n");
    for (name, toml) in [("gpt2", &gpt as &dyn Fn(u8) -> String), ("llama", &llama)] {
        for world in [1usize, 2] {
            let zero3 = Config::from_toml_str(&cached(toml(3)), "test").expect("config");
            let off = run_with(&zero3, world, true, steps);
            assert_eq!(off.coded_by_step, 0, "{name} world {world}: ZeRO-3's step writes no compute weights");
            let stage = world as u8;
            let cfg = Config::from_toml_str(&cached(toml(stage)), "test").expect("config");
            let tag = format!("{name} world {world} stage {stage}");
            let on = run_with(&cfg, world, true, steps);
            assert_eq!(on.losses, off.losses, "{tag}: losses against ZeRO-3");
            assert_eq!(on.params, off.params, "{tag}: parameters");
            assert!(on.losses[steps - 1] < on.losses[0], "{tag}: the loss falls: {:?}", on.losses);
            // Every FP8 weight (all cached), written by steps 1.. for steps 2..
            let layout = trainer::model::ModelLayout::new(&cfg.model);
            let (rows, bf16) = (cfg.train.micro_batch * cfg.model.seq_len, [false; 4]);
            let weights: usize = cfg.model.family.fp8_weight_layers(&layout, rows, bf16).iter().map(Vec::len).sum();
            let (all, coded) = (weights * (steps - 1), on.coded_by_step);
            match world {
                1 => assert_eq!(coded, all, "{tag}: every cached weight from the step"),
                _ => assert!(coded > 0 && coded < all, "{tag}: rank 0's own weights only: {coded} of {all}"),
            }
        }
    }

    // The CPU reference's check: a version begun `by_step` whose weight changed since the step
    // wrote its cache (its amax unchanged, so the amax's check passes).
    let AfterAStep { cpu, mut params, at, x, mut out, s } = cpu_fp8_layer_after_a_step(true);
    cpu.fp8_weights_changed(true);
    assert_eq!(cpu.fp8_weights_coded_by_step(), 1, "the step wrote the cache");
    cpu.matmul_fwd(&mut out, &x, Weights::new(&params, at), s).expect("the step's cache, as it is");
    params[7] = 0.1; // below the amax (0.15): only the cache's check can see it
    let e = cpu.matmul_fwd(&mut out, &x, Weights::new(&params, at), s).unwrap_err();
    assert!(e.to_string().contains("the cached weight the optimizer step wrote"), "{e}");
    // Said by the version: cast again.
    cpu.fp8_weights_changed(false);
    assert_eq!(cpu.fp8_weights_coded_by_step(), 0);
    cpu.matmul_fwd(&mut out, &x, Weights::new(&params, at), s).expect("a version not begun by the step");
}

/// A weight written after the optimizer step (a test's `set_param`, as a load would) is
/// measured again, not quantized with the amax the step left: the next micro-step's loss is
/// that of a run that never used the step's amaxes. And the CPU reference refuses a stale
/// amax where a version claims the step's (the check that makes the GPU's bookkeeping
/// testable here).
#[test]
fn a_weight_written_after_the_step_is_measured_again() {
    use trainer::model::{step_micro, ModelLayout, ModelOptions};
    use trainer::optim::Hyper;
    use trainer::zero::{Engine, EngineOptions};
    let cfg = Config::from_toml_str(&tiny_fp8_toml(0, 1, "\"none\"", "fp8"), "test").expect("config");
    let run = |step_amax: bool| -> Vec<f64> {
        let cfg = cfg.clone();
        let mut got = common::run_ranks(1, move |_, mut comm| {
            let be = CpuBackend::new();
            let layout = ModelLayout::new(&cfg.model);
            let (family, l2, seed) = (cfg.model.family, layout.clone(), cfg.train.seed);
            let mut init = |u, r| Ok(family.init_range(&l2, u, seed, cfg.init.scheme, r));
            let eopts = EngineOptions::from_config(&cfg);
            let eopts = EngineOptions { fp8_step_amax: eopts.fp8_step_amax.filter(|_| step_amax), ..eopts };
            let mut eng = Engine::new(&be, layout, eopts, 0, 1, Some(&mut init)).expect("engine");
            let mut model =
                family.build(&be, &eng.layout, &ModelOptions::from_config(&cfg), &mut eng.ledger).expect("model");
            let n = cfg.train.micro_batch * cfg.model.seq_len;
            let (x, y): (Vec<u32>, Vec<u32>) =
                ((0..n).map(|i| (i * 7 % 97) as u32).collect(), (0..n).map(|i| ((i + 1) * 7 % 97) as u32).collect());
            let h = Hyper { lr: 3e-3, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, grad_clip: 1.0 };
            let mut losses = Vec::new();
            for step in 0..3u64 {
                eng.begin_step(&be).expect("begin");
                eng.set_final_micro(true);
                let batch = trainer::model::MicroBatch::plain(&x, &y);
                step_micro(model.as_mut(), &be, &mut eng, &mut comm, &batch, Some(1.0 / n as f32)).expect("micro");
                eng.step(&be, &mut comm, h, step + 1).expect("step");
                losses.push(model.take_mean_loss(&be).expect("loss"));
                // Block 0's first weight (qkv's, an FP8 layer's) gets a new largest element.
                let w = eng.layout.units[1].tensors.iter().find(|t| t.decay).expect("a weight").loc;
                eng.set_param(&be, 1, w.off + 5, 2.5 + step as f32).expect("set_param");
            }
            losses
        });
        got.swap_remove(0)
    };
    assert_eq!(run(true), run(false), "the step's amaxes are dropped once a weight is written after it");

    // The CPU reference's check: a version begun `by_step` whose weight changed since.
    let AfterAStep { cpu, mut params, at, x, mut out, s } = cpu_fp8_layer_after_a_step(false);
    params[7] = 3.0;
    cpu.fp8_weights_changed(true);
    let e = cpu.matmul_fwd(&mut out, &x, Weights::new(&params, at), s).unwrap_err();
    assert!(e.to_string().contains("the optimizer step left"), "{e}");
    // Said by the version: measured again.
    cpu.fp8_weights_changed(false);
    cpu.matmul_fwd(&mut out, &x, Weights::new(&params, at), s).expect("a version not begun by the step");
}
