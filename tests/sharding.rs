//! The heart of the foundation: every ZeRO stage, on 2 and 3 ranks, with and without
//! activation checkpointing, with gradient accumulation, reproduces a single-rank
//! stage-0 run at the same global batch — per-step losses within relative 1e-5 and
//! parameters after N steps within 1e-5 absolute (observed differences are ~1e-7).

mod common;
use common::{KEEP_ATTENTION, KEEP_GELU};

use trainer::backend::cpu::CpuBackend;
use trainer::train::Trainer;
use trainer::Config;

const LOSS_RTOL: f64 = 1e-5;
const PARAM_ATOL: f32 = 1e-5;

struct RunResult {
    losses: Vec<f64>,
    norms: Vec<f64>,
    params: Vec<Vec<f32>>,
}

/// Run `world` ranks as threads over a loopback TCP group; return rank 0's view.
fn run(world: usize, stage: u8, accum: usize, activations: &str, data: &std::path::Path) -> RunResult {
    run_toml(world, common::tiny_toml(stage, accum, activations), data)
}

/// [`run`] with extra config lines (e.g. an `[offload]` section) appended to the TOML.
fn run_with(world: usize, stage: u8, accum: usize, extra: &str, data: &std::path::Path) -> RunResult {
    run_toml(world, common::tiny_toml(stage, accum, "\"none\"") + extra, data)
}

fn run_toml(world: usize, toml: String, data: &std::path::Path) -> RunResult {
    let cfg = Config::from_toml_str(&toml, "test").expect("config");
    cfg.validate().expect("valid");
    let data = data.to_path_buf();
    let mut results = common::run_ranks(world, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&cfg, &be, rank, world, &data).expect("trainer");
        let mut losses = vec![];
        let mut norms = vec![];
        for _ in 0..cfg.train.steps {
            let m = tr.train_step(&be, &mut comm).expect("step");
            losses.push(m.loss);
            norms.push(m.grad_norm);
        }
        let params = tr.full_params(&be, &mut comm).expect("params");
        RunResult { losses, norms, params }
    });
    // Every rank must agree exactly on the reduced loss and on the parameters.
    for r in &results[1..] {
        assert_eq!(r.losses, results[0].losses, "ranks disagree on loss");
        assert_eq!(r.params, results[0].params, "ranks disagree on parameters");
    }
    results.swap_remove(0)
}

fn assert_matches(name: &str, got: &RunResult, reference: &RunResult) {
    for (i, (a, b)) in got.losses.iter().zip(&reference.losses).enumerate() {
        let rel = ((a - b) / b).abs();
        assert!(rel <= LOSS_RTOL, "{name}: step {} loss {a} vs reference {b} (rel {rel:e})", i + 1);
    }
    for (i, (a, b)) in got.norms.iter().zip(&reference.norms).enumerate() {
        let rel = ((a - b) / b).abs();
        assert!(rel <= 1e-4, "{name}: step {} grad norm {a} vs reference {b}", i + 1);
    }
    let mut worst = 0.0f32;
    for (u, (pa, pb)) in got.params.iter().zip(&reference.params).enumerate() {
        assert_eq!(pa.len(), pb.len());
        for (j, (x, y)) in pa.iter().zip(pb).enumerate() {
            let d = (x - y).abs();
            worst = worst.max(d);
            assert!(d <= PARAM_ATOL, "{name}: unit {u} element {j}: {x} vs {y}");
        }
    }
    eprintln!("{name}: max |Δparam| = {worst:e}");
}

#[test]
fn every_stage_matches_single_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for world in [2usize, 3] {
        let accum = 2;
        // Reference: one rank, stage 0, same global batch (micro_batch × accum × world).
        let reference = run(1, 0, accum * world, "\"none\"", &data);
        // grad_clip (0.05 in the tiny config) is below every step's norm, so clipping is active
        // on every step: a norm computed over a partial or unreduced shard would change the update.
        assert!(reference.norms.iter().all(|&n| n > 0.05), "clipping not exercised: {:?}", reference.norms);
        for stage in 0..=3u8 {
            for act in ["\"none\"", "\"every_layer\"", KEEP_ATTENTION] {
                let got = run(world, stage, accum, act, &data);
                assert_matches(&format!("world {world} stage {stage} checkpointing {act}"), &got, &reference);
            }
        }
    }
}

/// The Llama family on every stage, 2 and 3 ranks, checkpointing or not, tied and untied
/// head (the untied head is a unit of its own, reduced and stepped like a block), and the
/// LM head in chunks: the single-rank stage-0 run's losses and parameters.
#[test]
fn every_stage_matches_single_rank_llama() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for tied in [false, true] {
        for world in [2usize, 3] {
            let accum = 2;
            let toml = |stage: u8, accum: usize, act: &str| common::tiny_llama_toml(stage, accum, act, tied);
            let reference = run_toml(1, toml(0, accum * world, "\"none\""), &data);
            assert!(reference.norms.iter().all(|&n| n > 0.05), "clipping not exercised: {:?}", reference.norms);
            for stage in 0..=3u8 {
                for act in ["\"none\"", "\"every_layer\"", KEEP_ATTENTION, KEEP_GELU] {
                    let got = run_toml(world, toml(stage, accum, act), &data);
                    let name = format!("llama tied {tied} world {world} stage {stage} checkpointing {act}");
                    assert_matches(&name, &got, &reference);
                }
            }
            // Chunks of 5 rows for a micro-batch of 32: the head's weight gradient is summed
            // over chunks in another order, so within the tolerance rather than bit for bit.
            let chunked_toml = toml(2, accum, "\"none\"").replace("[train]\n", "[train]\nloss_chunk_rows = 5\n");
            let chunked = run_toml(world, chunked_toml, &data);
            assert_matches(&format!("llama tied {tied} world {world} chunks of 5"), &chunked, &reference);
        }
    }
}

/// The engine and model one rank of a hand-driven test steps (what `Trainer::new` builds,
/// without the data and the loop).
fn engine_and_model(
    cfg: &Config,
    rank: usize,
    world: usize,
) -> (trainer::zero::Engine<CpuBackend>, Box<dyn trainer::model::DecoderModel<CpuBackend>>) {
    use trainer::model::{ModelLayout, ModelOptions};
    use trainer::zero::{Engine, EngineOptions};
    let layout = ModelLayout::new(&cfg.model);
    let (family, l2, seed) = (cfg.model.family, layout.clone(), cfg.train.seed);
    let mut init = |u, r| Ok(family.init_range(&l2, u, seed, cfg.init.scheme, r));
    let opts = EngineOptions::from_config(cfg);
    let mut eng = Engine::new(&CpuBackend::new(), layout, opts, rank, world, Some(&mut init)).expect("engine");
    let model =
        family.build(&CpuBackend::new(), &eng.layout, &ModelOptions::from_config(cfg), &mut eng.ledger).expect("model");
    (eng, model)
}

/// `n` input and target ids of a hand-driven test, different on every rank, micro-step
/// and step.
fn hand_batch(n: usize, step: usize, micro: usize, rank: usize) -> (Vec<u32>, Vec<u32>) {
    let tok = |i: usize| ((i * 7 + 13 * micro + 31 * step + 57 * rank) % 97) as u32;
    ((0..n).map(tok).collect(), (0..n).map(|i| tok(i + 1)).collect())
}

/// Every unit's full parameters, as rank 0 sees them after a hand-driven run.
fn all_params<C: trainer::zero::EngineComm<CpuBackend>>(
    eng: &mut trainer::zero::Engine<CpuBackend>,
    comm: &mut C,
) -> Vec<Vec<f32>> {
    (0..eng.num_units()).map(|i| eng.full_params_host(&CpuBackend::new(), comm, i).expect("params")).collect()
}

/// The step's first backward writes each unit's gradient instead of adding onto a cleared
/// buffer: the same bits as clearing first (`Engine::set_clear_grads`), on every stage, one
/// and two ranks, with and without accumulation, over several steps (an element the
/// model failed to write would carry the last step's gradient into this one's update).
#[test]
fn written_gradients_match_cleared_ones() {
    use trainer::model::{step_micro, MicroBatch};
    use trainer::optim::Hyper;
    for (world, accum) in [(1usize, 1usize), (1, 2), (2, 1), (2, 3)] {
        for stage in 0..4u8 {
            let cfg = Config::from_toml_str(&common::tiny_toml(stage, accum, "\"none\""), "test").expect("config");
            // Per run (written, cleared), per rank: losses, gradient norms, final parameters.
            type Ranks = Vec<(Vec<f64>, Vec<f64>, Vec<Vec<f32>>)>;
            let runs: Vec<Ranks> = [false, true]
                .into_iter()
                .map(|clear| {
                    let cfg = cfg.clone();
                    common::run_ranks(world, move |rank, mut comm| {
                        let be = CpuBackend::new();
                        let (mut eng, mut model) = engine_and_model(&cfg, rank, world);
                        eng.set_clear_grads(clear);
                        let n = cfg.train.micro_batch * cfg.model.seq_len;
                        let dloss = 1.0 / (n * accum * world) as f32;
                        let (mut losses, mut norms) = (vec![], vec![]);
                        for step in 0..3 {
                            eng.begin_step(&be).expect("begin");
                            for micro in 0..accum {
                                let (inputs, targets) = hand_batch(n, step, micro, rank);
                                eng.set_final_micro(micro + 1 == accum);
                                step_micro(
                                    model.as_mut(),
                                    &be,
                                    &mut eng,
                                    &mut comm,
                                    &MicroBatch::plain(&inputs, &targets),
                                    Some(dloss),
                                )
                                .expect("micro");
                            }
                            let h = Hyper {
                                lr: 1e-3,
                                weight_decay: 0.1,
                                beta1: 0.9,
                                beta2: 0.95,
                                eps: 1e-8,
                                grad_clip: 0.0,
                            };
                            norms.push(eng.step(&be, &mut comm, h, step as u64 + 1).expect("step").grad_norm);
                            losses.push(model.take_mean_loss(&be).expect("loss"));
                        }
                        (losses, norms, all_params(&mut eng, &mut comm))
                    })
                })
                .collect();
            assert_eq!(runs[0], runs[1], "world {world} stage {stage} accum {accum}: written vs cleared gradients");
        }
    }
}

/// One rank has nothing to shard: every stage computes stage 0's update, bit for bit
/// (stage 1 there uses its full gradient as the shard; stages 2/3 accumulate into theirs).
#[test]
fn every_stage_on_one_rank_is_stage_0_bit_for_bit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let reference = run(1, 0, 2, "\"none\"", &data);
    for stage in 1..=3u8 {
        let got = run(1, stage, 2, "\"none\"", &data);
        assert_eq!(got.losses, reference.losses, "stage {stage}: losses");
        assert_eq!(got.norms, reference.norms, "stage {stage}: gradient norms");
        assert_eq!(got.params, reference.params, "stage {stage}: parameters");
    }
}

#[test]
fn checkpointing_every_k_matches_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let a = run(1, 0, 1, "\"none\"", &data);
    // Same arithmetic on the same ranks: recomputation is bit-identical, with the
    // attention or the GELU output recomputed or kept.
    for act in ["2", "2\nkeep_attention = true", KEEP_ATTENTION, KEEP_GELU, "2\nkeep_gelu = true"] {
        let b = run(1, 0, 1, act, &data);
        assert_eq!(a.losses, b.losses, "{act}");
        assert_eq!(a.params, b.params, "{act}");
    }
}

/// [`tiny_toml`](common::tiny_toml) or its Llama with `data.document_mask = true`.
fn masked(toml: String) -> String {
    toml.replace("[zero]", "[data]\ndocument_mask = true\n\n[zero]")
}

/// `data.document_mask` (documents begin with the shards' end-of-text id every 24 tokens, so
/// windows of 16 hold one or two boundaries): every stage on 2 and 3 ranks reproduces the
/// single-rank stage-0 run at the same global batch, GPT-2 and Llama, with checkpointing
/// (the recompute within documents too); and the mask changes the losses.
#[test]
fn document_mask_every_stage_matches_single_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_documents(dir.path(), 97, 20_000, "train");
    type Toml = fn(u8, usize, &str) -> String;
    let families: [(&str, Toml); 2] =
        [("gpt2", common::tiny_toml), ("llama", |stage, accum, act| common::tiny_llama_toml(stage, accum, act, false))];
    for (family, toml) in families {
        for world in [2usize, 3] {
            let accum = 2;
            let reference = run_toml(1, masked(toml(0, accum * world, "\"none\"")), &data);
            let unmasked = run_toml(1, toml(0, accum * world, "\"none\""), &data);
            assert_ne!(reference.losses, unmasked.losses, "{family}: the mask must change the losses");
            let runs = [
                (0u8, "\"none\""),
                (1, "\"none\""),
                (2, "\"none\""),
                (3, "\"none\""),
                (3, KEEP_ATTENTION),
                (2, "\"every_layer\""),
            ];
            for (stage, act) in runs {
                let got = run_toml(world, masked(toml(stage, accum, act)), &data);
                let name = format!("{family} document_mask world {world} stage {stage} checkpointing {act}");
                assert_matches(&name, &got, &reference);
            }
        }
    }
}

/// Validation loss within documents too: agreed by every rank and by one rank alone, and
/// not the unmasked one.
#[test]
fn validation_loss_with_document_mask_matches_across_world_sizes() {
    let dir = tempfile::tempdir().expect("tempdir");
    common::write_synthetic_documents(dir.path(), 97, 20_000, "train");
    common::write_synthetic_documents(dir.path(), 97, 4_000, "val");
    let val_losses = |world: usize, stage: u8, mask: bool| -> Vec<f64> {
        let toml = common::tiny_toml(stage, 2 / world, "\"none\"");
        let mut cfg = Config::from_toml_str(&if mask { masked(toml) } else { toml }, "t").expect("cfg");
        cfg.train.eval_every = 2;
        cfg.train.eval_batches = 2 / world;
        let dir_path = dir.path().to_path_buf();
        let vals: Vec<Vec<f64>> = common::run_ranks(world, move |rank, mut comm| {
            let be = CpuBackend::new();
            let mut tr = Trainer::new(&cfg, &be, rank, world, &dir_path).expect("trainer");
            (0..cfg.train.steps).filter_map(|_| tr.train_step(&be, &mut comm).expect("step").val_loss).collect()
        });
        assert!(vals.iter().all(|v| v == &vals[0] && v.len() == 2), "ranks agree: {vals:?}");
        vals[0].clone()
    };
    let one = val_losses(1, 0, true);
    let two = val_losses(2, 3, true);
    for (a, b) in one.iter().zip(&two) {
        assert!(a.is_finite() && ((a - b) / a).abs() <= LOSS_RTOL, "validation loss {a} on one rank vs {b} on two");
    }
    assert_ne!(one, val_losses(1, 0, false), "the mask must change the validation loss");
}

#[test]
fn validation_loss_is_agreed_by_all_ranks_and_finite() {
    // Validation runs forward-only through the same gather schedule (stage 3 included).
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    // A val shard next to the train shard.
    let toks: Vec<u16> = (0..4000u32).map(|i| ((i * 7 + i / 13) % 97) as u16).collect();
    data::write_shard(dir.path().join("synthetic_val_000000.bin"), &toks).expect("val shard");
    let toml = common::tiny_toml(3, 1, "\"none\"") + "\n";
    let mut cfg = Config::from_toml_str(&toml, "t").expect("cfg");
    cfg.train.eval_every = 2;
    cfg.train.eval_batches = 2;
    let dir_path = dir.path().to_path_buf();
    let vals: Vec<Vec<Option<f64>>> = common::run_ranks(2, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&cfg, &be, rank, 2, &dir_path).expect("trainer");
        (0..cfg.train.steps).map(|_| tr.train_step(&be, &mut comm).expect("step").val_loss).collect::<Vec<_>>()
    });
    assert_eq!(vals[0], vals[1]);
    assert!(vals[0][0].is_none() && vals[0][1].is_some() && vals[0][3].is_some(), "{:?}", vals[0]);
    let _ = data;
    for v in vals[0].iter().flatten() {
        assert!(v.is_finite() && *v > 0.0 && *v < 6.0, "{v}");
    }
}

#[test]
fn stage3_prefetch_depth_does_not_change_results() {
    // Prefetching reorders the all-gathers (and, on GPU, overlaps them with compute); the
    // arithmetic must stay the same bit for bit.
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let mut results = vec![];
    for prefetch in [0usize, 1, 3] {
        let mut cfg = Config::from_toml_str(&common::tiny_toml(3, 2, "\"every_layer\""), "t").expect("cfg");
        cfg.zero.prefetch_blocks = prefetch;
        let data = data.clone();
        let mut all = common::run_ranks(2, move |rank, mut comm| {
            let be = CpuBackend::new();
            let mut tr = Trainer::new(&cfg, &be, rank, 2, &data).expect("trainer");
            let losses: Vec<f64> =
                (0..cfg.train.steps).map(|_| tr.train_step(&be, &mut comm).expect("step").loss).collect();
            (losses, tr.full_params(&be, &mut comm).expect("params"))
        });
        results.push(all.swap_remove(0));
    }
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0], results[2]);
}

/// Optimizer offload (and, on ZeRO-3, parameter offload) trains exactly like the optimizer
/// on the device: the host AdamW is the reference's arithmetic, so on the CPU backend the
/// losses and parameters are the same bits, on every stage and world size.
#[test]
fn offload_trains_the_same_bits_as_the_device_optimizer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for world in [1usize, 2] {
        for stage in 0..=3u8 {
            let device = run_with(world, stage, 2, "", &data);
            let offload = run_with(world, stage, 2, "\n[offload]\noptimizer = true\ncpu_threads = 2\n", &data);
            assert_eq!(offload.losses, device.losses, "world {world} stage {stage}: losses");
            assert_eq!(offload.params, device.params, "world {world} stage {stage}: parameters");
            if stage == 3 {
                // Parameter offload takes no gradient accumulation (yet): compare at accum 1.
                let device = run_with(world, stage, 1, "", &data);
                let both = "\n[offload]\noptimizer = true\nparams = true\n";
                let params_too = run_with(world, stage, 1, both, &data);
                assert_eq!(params_too.losses, device.losses, "world {world}: parameter offload losses");
                assert_eq!(params_too.params, device.params, "world {world}: parameter offload parameters");
            }
        }
    }
}

/// The delayed update (`offload.delayed_update`, ZeRO-Offload's schedule). Before the delay
/// starts it is the in-order host step: the device optimizer's bits. Once it runs, every
/// stage on one rank gives the same bits, and every stage on two ranks matches one rank at
/// the same global batch (within the suite's tolerance: reductions add in another order),
/// the losses leave
/// the in-order ones exactly where the first delayed update would have reached the
/// weights, and stay close to them (the same batches, a step-late update).
#[test]
fn delayed_update_is_the_same_schedule_on_every_stage_and_world() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    // Global batch 4 sequences on one or two ranks.
    let toml = |stage: u8, world: usize, extra: &str| {
        common::tiny_toml(stage, 2 / world, "\"none\"").replace("steps = 4", "steps = 8") + extra
    };
    let offload = "\n[offload]\noptimizer = true\ncpu_threads = 2\ndelayed_update = true\n";
    let in_order = run_toml(1, toml(0, 1, ""), &data);
    let not_yet = run_toml(1, toml(0, 1, &format!("{offload}delayed_update_after = 100\n")), &data);
    assert_eq!(not_yet.losses, in_order.losses, "before the delay starts: the in-order losses");
    assert_eq!(not_yet.params, in_order.params, "before the delay starts: the in-order parameters");

    // Step 1 in order; step 2's update lands a step late, so step 3 is the first to differ.
    let delayed_cfg = format!("{offload}delayed_update_after = 1\n");
    let one_rank = run_toml(1, toml(0, 1, &delayed_cfg), &data);
    assert_eq!(one_rank.losses[..2], in_order.losses[..2], "steps 1-2 see the same weights");
    assert_ne!(one_rank.losses[2], in_order.losses[2], "step 3 computes with the weights of step 1");
    assert_ne!(one_rank.params, in_order.params);
    // Both runs see the same batches (the loader's order does not depend on the weights),
    // so step by step their losses differ only by the update's delay: it still trains.
    for (s, (d, o)) in one_rank.losses.iter().zip(&in_order.losses).enumerate() {
        assert!((d - o).abs() < 0.03, "step {}: delayed loss {d} strays from the in-order {o}", s + 1);
    }
    for world in [1usize, 2] {
        for stage in 0..=3u8 {
            let got = run_toml(world, toml(stage, world, &delayed_cfg), &data);
            if world == 1 {
                assert_eq!(got.losses, one_rank.losses, "stage {stage}: losses");
                assert_eq!(got.params, one_rank.params, "stage {stage}: parameters");
            } else {
                assert_matches(&format!("delayed, 2 ranks, stage {stage}"), &got, &one_rank);
            }
        }
    }
}

/// What a CUDA-graph replay relies on, checked on the CPU ranks with several ranks: a
/// micro-step run as it is recorded (the step's first and last micro-steps told apart, and
/// every collective it started waited for before it ends, `Engine::join_micro`) computes
/// the same bits as the eager micro-step, and each kind of micro-step starts from and
/// leaves the same engine host state at every step (a replay runs no host code: the
/// trainer checks the first and restores the second). Stages 0–3, 2 ranks, grad_accum 3.
#[test]
fn recorded_micro_steps_compute_what_eager_ones_do() {
    use std::collections::HashMap;
    use trainer::model::{run_micro, step_micro, MicroBatch};
    use trainer::optim::Hyper;
    let (world, accum, steps) = (2usize, 3usize, 3usize);
    for stage in 0..4u8 {
        let cfg = Config::from_toml_str(&common::tiny_toml(stage, accum, "\"none\""), "test").expect("config");
        // Per run (eager, recorded), per rank: the step losses and the final parameters.
        type Ranks = Vec<(Vec<f64>, Vec<Vec<f32>>)>;
        let runs: Vec<Ranks> = [false, true]
            .into_iter()
            .map(|recorded| {
                let cfg = cfg.clone();
                common::run_ranks(world, move |rank, mut comm| {
                    let be = CpuBackend::new();
                    let (mut eng, mut model) = engine_and_model(&cfg, rank, world);
                    let n = cfg.train.micro_batch * cfg.model.seq_len;
                    let dloss = 1.0 / (n * accum * world) as f32;
                    let mut states = HashMap::new();
                    let mut losses = vec![];
                    for step in 0..steps {
                        eng.begin_step(&be).expect("begin");
                        for micro in 0..accum {
                            let (inputs, targets) = hand_batch(n, step, micro, rank);
                            let (first, last) = (micro == 0, micro + 1 == accum);
                            if !recorded {
                                eng.set_final_micro(last);
                                step_micro(
                                    model.as_mut(),
                                    &be,
                                    &mut eng,
                                    &mut comm,
                                    &MicroBatch::plain(&inputs, &targets),
                                    Some(dloss),
                                )
                                .expect("micro");
                                continue;
                            }
                            let key = eng.micro_key(first, last);
                            eng.set_final_micro(key.last);
                            model.load_batch(&be, &MicroBatch::plain(&inputs, &targets)).expect("batch");
                            eng.await_pending(&be, &mut comm).expect("await");
                            let before = eng.micro_state();
                            run_micro(model.as_mut(), &be, &mut eng, &mut comm, Some(dloss)).expect("micro");
                            eng.join_micro(&be, &mut comm).expect("join");
                            let seen = states.entry(key).or_insert_with(|| (before.clone(), eng.micro_state()));
                            assert_eq!((&seen.0, &seen.1), (&before, &eng.micro_state()), "stage {stage} {key:?}");
                        }
                        let h =
                            Hyper { lr: 1e-3, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, grad_clip: 0.05 };
                        eng.step(&be, &mut comm, h, step as u64 + 1).expect("step");
                        losses.push(model.take_mean_loss(&be).expect("loss"));
                    }
                    assert_eq!(states.len(), if recorded { 3 } else { 0 }, "first, middle and last kinds");
                    (losses, all_params(&mut eng, &mut comm))
                })
            })
            .collect();
        assert_eq!(runs[1], runs[0], "stage {stage}: recorded micro-steps differ from eager ones");
    }
}
