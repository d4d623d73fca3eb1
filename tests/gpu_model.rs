//! One training step end to end through the real engine and model code on the GPU against
//! the CPU backend: a small GPT-2 (head size 64: the tensor-core attention; an odd
//! vocabulary: the staged head) and a small Llama (grouped-query attention, RoPE, RMSNorm,
//! SwiGLU, the LM head in chunks) with a one-rank NCCL communicator, ZeRO stages 0 and 3 —
//! the loss, every unit's gradient, and the parameters after one AdamW step; both also on
//! packed documents (`data.document_mask`).
//! Ignored without `--include-ignored` (no GPU in CI).

mod gpu;

use collectives::nccl::{nccl_unique_id, NcclComm};
use gpu::TOL_BF16;
use trainer::backend::cpu::{CpuBackend, HostComm};
use trainer::config::{ActivationCheckpointing, CheckpointingConfig, KeepGelu, ModelConfig};
use trainer::documents::DocumentMask;
use trainer::model::{step_micro_loss, MicroBatch, ModelFamily, ModelLayout, ModelOptions};
use trainer::optim::Hyper;
use trainer::zero::{Engine, EngineOptions};
use trainer::TrainError;

/// The GPT-2 these tests train: 2 layers, 2 heads of 64 (the tensor-core attention),
/// sequences of 256.
fn small_gpt(vocab_size: usize) -> ModelConfig {
    ModelConfig::gpt2(2, 2, 128, vocab_size, 256)
}

/// Every unit's initial values for `layout` from `seed` (what `Engine::new` asks for).
fn gpt2_init(
    layout: &ModelLayout,
    seed: u64,
) -> impl FnMut(usize, std::ops::Range<usize>) -> Result<Vec<f32>, TrainError> {
    let l = layout.clone();
    move |u, r| Ok(ModelFamily::Gpt2.init_range(&l, u, seed, Default::default(), r))
}

/// The optimizer step every test takes.
const HYPER: Hyper = Hyper { lr: 1e-3, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, grad_clip: 1.0 };

fn dev(e: impl std::fmt::Display) -> trainer::backend::BackendError {
    trainer::backend::BackendError::Device(e.to_string())
}

#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn one_training_step_matches_the_cpu() {
    gpu::check(|be, rng, rep| {
        let cfg = small_gpt(1001);
        let (b, seed) = (4usize, 11u64);
        let n = b * cfg.seq_len;
        let layout = ModelLayout::new(&cfg);
        let inputs = rng.below(n, cfg.vocab_size as u32);
        let targets = rng.below(n, cfg.vocab_size as u32);
        let scale = Some(1.0 / n as f32);
        let ckpt = CheckpointingConfig::default();

        let CpuStep { loss: closs, grads: cgrads, params: cparams } =
            cpu_step(&cfg, b, &mut gpt2_init(&layout, seed), &inputs, &targets)?;

        let id = nccl_unique_id().map_err(dev)?;
        let mut gcomm = NcclComm::new(be.stream().clone(), 0, 1, &id).map_err(dev)?;
        // Stage 0 and 3 against the CPU; then stage 0 with every block checkpointed (the
        // attention recomputed, then kept) against the GPU's own stage-0 gradients, bit for
        // bit: the recompute runs the same kernels on the same inputs, and stops before the
        // fc2 GEMM whose output backward never reads.
        let every = |keep_attention| CheckpointingConfig {
            activations: ActivationCheckpointing::EveryLayer,
            keep_attention,
            keep_gelu: KeepGelu::Recompute,
        };
        // Last, stage 0 keeping the GELU output (the forward's GEMM epilogue's values, not the
        // backward's recompute: within tolerance of the CPU, not bit-equal to the others).
        let keep_gelu = CheckpointingConfig { keep_gelu: KeepGelu::Keep, ..ckpt.clone() };
        let mut ggrads: Vec<Vec<f32>> = Vec::new();
        let runs = [(0u8, ckpt.clone()), (3, ckpt.clone()), (0, every(false)), (0, every(true)), (0, keep_gelu)];
        for (stage, ckpt) in runs {
            let recompute = ckpt.activations == ActivationCheckpointing::EveryLayer;
            let tag = format!(
                "model step (GPT L2 C128 V1001 T256 B4) stage {stage}{}",
                match (recompute, ckpt.keep_attention, ckpt.keep_gelu.keeps()) {
                    (_, _, true) => ", GELU output kept",
                    (false, _, _) => "",
                    (true, false, _) => ", every layer checkpointed",
                    (true, true, _) => ", every layer checkpointed, attention kept",
                }
            );
            let opts = EngineOptions::stage(stage);
            let mut geng =
                Engine::new(be, layout.clone(), opts, 0, 1, Some(&mut gpt2_init(&layout, seed))).map_err(dev)?;
            let mut gm = cfg.family.build(
                be,
                &layout,
                &ModelOptions { checkpointing: ckpt.clone(), ..ModelOptions::batch(b) },
                &mut geng.ledger,
            )?;
            geng.begin_step(be)?;
            let gloss =
                step_micro_loss(gm.as_mut(), be, &mut geng, &mut gcomm, &MicroBatch::plain(&inputs, &targets), scale)
                    .map_err(dev)?;
            rep.cmp(&tag, "loss", &[gloss as f32], &[closs as f32], 5e-3);
            if stage == 0 {
                for (u, cg) in cgrads.iter().enumerate() {
                    let gg = geng.local_grads_host(be, u).map_err(dev)?;
                    rep.cmp(&tag, &format!("grad unit {u}"), &gg, cg, 3e-2);
                    if recompute {
                        rep.same_bits(&tag, &format!("grad unit {u} vs no checkpointing"), &gg, &ggrads[u]);
                    } else if !ckpt.keep_gelu.keeps() {
                        ggrads.push(gg);
                    }
                }
            }
            geng.step(be, &mut gcomm, HYPER, 1).map_err(dev)?;
            for (u, cp) in cparams.iter().enumerate() {
                let gp = geng.full_params_host(be, &mut gcomm, u).map_err(dev)?;
                rep.cmp(&tag, &format!("params unit {u}"), &gp, cp, TOL_BF16);
            }
        }
        Ok(())
    });
}

/// A small Llama: 2 layers, 4 query heads and 2 key/value heads of 64 (grouped-query
/// attention on the tensor cores), SwiGLU of 384, RoPE with Llama 3.1 scaling, sequences of 256.
fn small_llama(tied: bool) -> ModelConfig {
    ModelConfig {
        family: ModelFamily::Llama,
        n_kv_head: Some(2),
        intermediate_size: Some(384),
        rope_theta: Some(500000.0),
        rope_scaling: Some(trainer::backend::RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        rms_norm_eps: Some(1e-5),
        tie_embeddings: Some(tied),
        ..ModelConfig::gpt2(2, 4, 256, 1001, 256)
    }
}

/// One Llama training step on the GPU against the CPU, tied and untied head, ZeRO stages 0
/// and 3, the LM head in chunks of 300 rows (4 chunks, the last short); then every block
/// checkpointed (attention recomputed, then kept) bit for bit against the GPU's own
/// stage-0 gradients, and the SwiGLU output kept within tolerance of the CPU.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn one_llama_training_step_matches_the_cpu() {
    gpu::check(|be, rng, rep| {
        for tied in [false, true] {
            let cfg = small_llama(tied);
            let (b, seed) = (4usize, 13u64);
            let n = b * cfg.seq_len;
            let layout = ModelLayout::new(&cfg);
            let l2 = layout.clone();
            let mut init = move |u, r| Ok(ModelFamily::Llama.init_range(&l2, u, seed, Default::default(), r));
            let (inputs, targets) = (rng.below(n, cfg.vocab_size as u32), rng.below(n, cfg.vocab_size as u32));
            let scale = Some(1.0 / n as f32);
            let CpuStep { loss: closs, grads: cgrads, params: cparams } =
                cpu_step(&cfg, b, &mut init, &inputs, &targets)?;
            let id = nccl_unique_id().map_err(dev)?;
            let mut gcomm = NcclComm::new(be.stream().clone(), 0, 1, &id).map_err(dev)?;
            let plain = CheckpointingConfig::default();
            let every = |keep_attention| CheckpointingConfig {
                activations: ActivationCheckpointing::EveryLayer,
                keep_attention,
                keep_gelu: KeepGelu::Recompute,
            };
            let keep_act = CheckpointingConfig { keep_gelu: KeepGelu::Keep, ..plain.clone() };
            let runs = [(0u8, plain.clone()), (3, plain.clone()), (0, every(false)), (0, every(true)), (0, keep_act)];
            let mut ggrads: Vec<Vec<f32>> = Vec::new();
            for (stage, ckpt) in runs {
                let recompute = ckpt.activations == ActivationCheckpointing::EveryLayer;
                let tag = format!(
                    "llama step (L2 C256 NH4 NKV2 F384 V1001 T256 B4, tied {tied}) stage {stage}{}{}{}",
                    if recompute { ", checkpointed" } else { "" },
                    if ckpt.keep_attention { ", attention kept" } else { "" },
                    if ckpt.keep_gelu.keeps() { ", swiglu kept" } else { "" },
                );
                let l2 = layout.clone();
                let mut init = move |u, r| Ok(ModelFamily::Llama.init_range(&l2, u, seed, Default::default(), r));
                let mut geng =
                    Engine::new(be, layout.clone(), EngineOptions::stage(stage), 0, 1, Some(&mut init)).map_err(dev)?;
                let opts = ModelOptions { checkpointing: ckpt.clone(), loss_chunk_rows: 300, ..ModelOptions::batch(b) };
                let mut gm = cfg.family.build(be, &layout, &opts, &mut geng.ledger)?;
                geng.begin_step(be)?;
                let gloss = step_micro_loss(
                    gm.as_mut(),
                    be,
                    &mut geng,
                    &mut gcomm,
                    &MicroBatch::plain(&inputs, &targets),
                    scale,
                )
                .map_err(dev)?;
                rep.cmp(&tag, "loss", &[gloss as f32], &[closs as f32], 5e-3);
                if stage == 0 {
                    for (u, cg) in cgrads.iter().enumerate() {
                        let gg = geng.local_grads_host(be, u).map_err(dev)?;
                        rep.cmp(&tag, &format!("grad unit {u}"), &gg, cg, 3e-2);
                        if recompute {
                            rep.same_bits(&tag, &format!("grad unit {u} vs no checkpointing"), &gg, &ggrads[u]);
                        } else if !ckpt.keep_gelu.keeps() {
                            ggrads.push(gg);
                        }
                    }
                }
                geng.step(be, &mut gcomm, HYPER, 1).map_err(dev)?;
                for (u, cp) in cparams.iter().enumerate() {
                    let gp = geng.full_params_host(be, &mut gcomm, u).map_err(dev)?;
                    rep.cmp(&tag, &format!("params unit {u}"), &gp, cp, TOL_BF16);
                }
            }
        }
        Ok(())
    });
}

/// One training step with `train.precision = "fp8"` on the GPU against the CPU's simulation
/// of the same FP8 rounding: GPT-2 (bias, GELU epilogues, tied head) and Llama (GQA, SwiGLU,
/// untied head in chunks), ZeRO stages 0 and 3, and every block checkpointed. The blocks'
/// GEMMs run in FP8, the LM head in bf16. The GPU quantizes bf16 activations, the CPU f32
/// ones, so an operand near a rounding boundary can fall either way, by one e4m3 step
/// (2^-3 of its value): the gradients are compared at 0.125 (bf16 runs: 3e-2; measured on an
/// H200: 6.4e-2 to 9.5e-2), the parameters after one AdamW step at 2e-2 (measured 1.0e-2 to
/// 1.3e-2: Adam's normalised step turns a small gradient's flipped rounding into a full
/// step), and the loss at 1e-2. The FP8 loss is also within 2% of the bf16 GPU loss (FP8
/// changes the numbers, not the model). The backward's other recipes (e4m3 output
/// gradients, dW from the bf16 operands, both) against the CPU's of the same recipe, and a
/// step with the attention projection kept in bf16 (`train.fp8_bf16_layers`).
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn one_fp8_training_step_matches_the_cpu() {
    use trainer::backend::{Fp8Backward, Fp8GradFormat, Fp8WeightGrad, MatmulOps, Precision};
    gpu::check(|be, rng, rep| {
        if let Err(why) = be.fp8_support() {
            rep.check("fp8 model step", "skipped", true, &why);
            return Ok(());
        }
        for (name, cfg, seed) in [
            ("GPT L2 C128 V1001 T256 B4", small_gpt(1001), 17u64),
            ("Llama L2 C256 F384 untied", small_llama(false), 19),
        ] {
            let b = 4usize;
            let n = b * cfg.seq_len;
            let layout = ModelLayout::new(&cfg);
            let family = cfg.family;
            let init = |l: &ModelLayout| {
                let l2 = l.clone();
                move |u, r: std::ops::Range<usize>| Ok(family.init_range(&l2, u, seed, Default::default(), r))
            };
            let (inputs, targets) = (rng.below(n, cfg.vocab_size as u32), rng.below(n, cfg.vocab_size as u32));
            let scale = Some(1.0 / n as f32);
            let fp8 = ModelOptions { precision: Precision::Fp8, loss_chunk_rows: 300, ..ModelOptions::batch(b) };
            let id = nccl_unique_id().map_err(dev)?;
            let mut gcomm = NcclComm::new(be.stream().clone(), 0, 1, &id).map_err(dev)?;
            let every = CheckpointingConfig { activations: ActivationCheckpointing::EveryLayer, ..Default::default() };
            let (plain, e4m3) = (CheckpointingConfig::default(), Fp8GradFormat::E4m3);
            let recipe = |grad, weight_grad| Fp8Backward { grad, weight_grad };
            let default = Fp8Backward::default();
            let all_fp8 = [false; 4];
            let runs = [
                (0u8, Precision::Fp8, plain.clone(), default, all_fp8),
                (3, Precision::Fp8, plain.clone(), default, all_fp8),
                (0, Precision::Fp8, every.clone(), default, all_fp8),
                // The backward's other recipes (`train.fp8_grad_format`, `fp8_weight_grad`).
                (0, Precision::Fp8, plain.clone(), recipe(e4m3, Fp8WeightGrad::Fp8), all_fp8),
                (3, Precision::Fp8, every.clone(), recipe(Fp8GradFormat::E5m2, Fp8WeightGrad::Bf16), all_fp8),
                (0, Precision::Fp8, plain.clone(), recipe(e4m3, Fp8WeightGrad::Bf16), all_fp8),
                // The attention projection kept in bf16 (`train.fp8_bf16_layers`): its
                // producers leave no amax for it, its neighbours still run in FP8.
                (3, Precision::Fp8, every, default, [false, true, false, false]),
                (0, Precision::Bf16, plain, default, all_fp8),
            ];
            let mut fp8_loss = 0.0;
            for (stage, precision, ckpt, backward, kept) in runs {
                let tag = format!(
                    "{precision:?} step ({name}) stage {stage}{}{}{}",
                    if ckpt.activations == ActivationCheckpointing::EveryLayer { ", checkpointed" } else { "" },
                    if backward == default { String::new() } else { format!(", {backward:?}") },
                    if kept == all_fp8 { String::new() } else { format!(", kept in bf16 {kept:?}") }
                );
                let opts = ModelOptions {
                    precision,
                    checkpointing: ckpt,
                    fp8_backward: backward,
                    fp8_bf16_layers: kept,
                    ..fp8.clone()
                };
                // The CPU reference of this recipe (checkpointing does not change its values).
                let cpu_opts = ModelOptions { checkpointing: CheckpointingConfig::default(), ..opts.clone() };
                let CpuStep { loss: closs, grads: cgrads, params: cparams } =
                    cpu_step_with(&cfg, &cpu_opts, &mut init(&layout), &inputs, &targets)?;
                let mut geng =
                    Engine::new(be, layout.clone(), EngineOptions::stage(stage), 0, 1, Some(&mut init(&layout)))
                        .map_err(dev)?;
                let mut gm = cfg.family.build(be, &layout, &opts, &mut geng.ledger)?;
                geng.begin_step(be)?;
                let gloss = step_micro_loss(
                    gm.as_mut(),
                    be,
                    &mut geng,
                    &mut gcomm,
                    &MicroBatch::plain(&inputs, &targets),
                    scale,
                )
                .map_err(dev)?;
                if precision == Precision::Bf16 {
                    let d = ((gloss - fp8_loss) / gloss).abs();
                    rep.check(
                        &tag,
                        "fp8 loss near bf16",
                        d < 0.02,
                        &format!("fp8 {fp8_loss:.5} bf16 {gloss:.5} (rel {d:.1e})"),
                    );
                    continue;
                }
                if backward == default && kept == all_fp8 {
                    fp8_loss = gloss;
                }
                rep.cmp(&tag, "loss", &[gloss as f32], &[closs as f32], 1e-2);
                if stage == 0 {
                    for (u, cg) in cgrads.iter().enumerate() {
                        let gg = geng.local_grads_host(be, u).map_err(dev)?;
                        rep.cmp(&tag, &format!("grad unit {u}"), &gg, cg, 0.125);
                    }
                }
                geng.step(be, &mut gcomm, HYPER, 1).map_err(dev)?;
                for (u, cp) in cparams.iter().enumerate() {
                    let gp = geng.full_params_host(be, &mut gcomm, u).map_err(dev)?;
                    rep.cmp(&tag, &format!("params unit {u}"), &gp, cp, 2e-2);
                }
            }
        }
        Ok(())
    });
}

/// `n` ids below `eot` packed as documents of 1 to `max_len` tokens, each beginning with
/// the end-of-text id `eot` (some crossing into the next sequence), as `prepare-data`'s
/// shards hold them.
fn packed_documents(rng: &mut gpu::Rng, n: usize, eot: u32, max_len: u32) -> Vec<u32> {
    let mut ids = rng.below(n, eot);
    let mut at = 0usize;
    for l in rng.below(n, max_len) {
        if at >= n {
            break;
        }
        ids[at] = eot;
        at += l as usize + 1;
    }
    ids
}

/// `data.document_mask`: one training step of the small GPT-2 (learned positions within
/// documents) and the small untied Llama (RoPE and grouped-query attention within
/// documents, the head in chunks) on packed documents against the CPU, ZeRO stages 0 and 3,
/// then every block checkpointed (attention recomputed, then kept) bit for bit against the
/// GPU's own stage-0 gradients; and with starts all 0 the bits of the unmasked model.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn document_mask_training_step_matches_the_cpu() {
    gpu::check(|be, rng, rep| {
        let models = [
            ("GPT L2 C128 V1001 T256 B4", small_gpt(1001), 23u64),
            ("Llama L2 C256 F384 untied", small_llama(false), 29),
        ];
        for (name, cfg, seed) in models {
            let b = 4usize;
            let (n, eot) = (b * cfg.seq_len, cfg.vocab_size as u32 - 1);
            let layout = ModelLayout::new(&cfg);
            let family = cfg.family;
            let init = |l: &ModelLayout| {
                let l2 = l.clone();
                move |u, r: std::ops::Range<usize>| Ok(family.init_range(&l2, u, seed, Default::default(), r))
            };
            let (inputs, targets) = (packed_documents(rng, n, eot, 120), rng.below(n, cfg.vocab_size as u32));
            let mut mask = DocumentMask::new(Some(eot), cfg.seq_len);
            let batch = mask.batch(&inputs, &targets);
            let docs = batch.docs.expect("masking on");
            let documents = docs.iter().enumerate().filter(|&(r, &d)| d as usize == r % cfg.seq_len).count();
            let scale = Some(1.0 / n as f32);
            let masked = ModelOptions { document_mask: true, loss_chunk_rows: 300, ..ModelOptions::batch(b) };
            let CpuStep { loss: closs, grads: cgrads, params: cparams } =
                cpu_step_batch(&cfg, &masked, &mut init(&layout), &batch)?;
            let id = nccl_unique_id().map_err(dev)?;
            let mut gcomm = NcclComm::new(be.stream().clone(), 0, 1, &id).map_err(dev)?;
            let plain = CheckpointingConfig::default();
            let every = |keep_attention| CheckpointingConfig {
                activations: ActivationCheckpointing::EveryLayer,
                keep_attention,
                keep_gelu: KeepGelu::Recompute,
            };
            let mut ggrads: Vec<Vec<f32>> = Vec::new();
            for (stage, ckpt) in [(0u8, plain.clone()), (3, plain.clone()), (0, every(false)), (0, every(true))] {
                let recompute = ckpt.activations == ActivationCheckpointing::EveryLayer;
                let tag = format!(
                    "document_mask step ({name}, {documents} documents) stage {stage}{}{}",
                    if recompute { ", checkpointed" } else { "" },
                    if ckpt.keep_attention { ", attention kept" } else { "" },
                );
                let mut geng =
                    Engine::new(be, layout.clone(), EngineOptions::stage(stage), 0, 1, Some(&mut init(&layout)))
                        .map_err(dev)?;
                let opts = ModelOptions { checkpointing: ckpt.clone(), ..masked.clone() };
                let mut gm = cfg.family.build(be, &layout, &opts, &mut geng.ledger)?;
                geng.begin_step(be)?;
                let gloss = step_micro_loss(gm.as_mut(), be, &mut geng, &mut gcomm, &batch, scale).map_err(dev)?;
                rep.cmp(&tag, "loss", &[gloss as f32], &[closs as f32], 5e-3);
                if stage == 0 {
                    for (u, cg) in cgrads.iter().enumerate() {
                        let gg = geng.local_grads_host(be, u).map_err(dev)?;
                        rep.cmp(&tag, &format!("grad unit {u}"), &gg, cg, 3e-2);
                        if recompute {
                            rep.same_bits(&tag, &format!("grad unit {u} vs no checkpointing"), &gg, &ggrads[u]);
                        } else {
                            ggrads.push(gg);
                        }
                    }
                }
                geng.step(be, &mut gcomm, HYPER, 1).map_err(dev)?;
                for (u, cp) in cparams.iter().enumerate() {
                    let gp = geng.full_params_host(be, &mut gcomm, u).map_err(dev)?;
                    rep.cmp(&tag, &format!("params unit {u}"), &gp, cp, TOL_BF16);
                }
            }
            // Starts all 0 (one document per sequence): the unmasked model's loss and gradients.
            let zeros = vec![0u32; n];
            let tag = format!("document_mask step ({name}), starts all 0 vs document_mask = false");
            let unmasked = ModelOptions { document_mask: false, ..masked.clone() };
            let mut got: Vec<Vec<f32>> = Vec::new();
            for (opts, docs) in [(&masked, Some(&zeros[..])), (&unmasked, None)] {
                let mut geng = Engine::new(be, layout.clone(), EngineOptions::stage(0), 0, 1, Some(&mut init(&layout)))
                    .map_err(dev)?;
                let mut gm = cfg.family.build(be, &layout, opts, &mut geng.ledger)?;
                geng.begin_step(be)?;
                let one = MicroBatch { inputs: &inputs, targets: &targets, docs };
                let loss = step_micro_loss(gm.as_mut(), be, &mut geng, &mut gcomm, &one, scale).map_err(dev)?;
                let mut all = vec![loss as f32];
                for u in 0..geng.num_units() {
                    all.extend(geng.local_grads_host(be, u).map_err(dev)?);
                }
                got.push(all);
            }
            rep.same_bits(&tag, "loss and every gradient", &got[0], &got[1]);
        }
        Ok(())
    });
}

/// The CPU reference of one micro-step and one AdamW step (`HYPER`) at ZeRO stage 0: the
/// loss, each unit's gradient, each unit's parameters after the step.
type UnitInit<'a> = dyn FnMut(usize, std::ops::Range<usize>) -> Result<Vec<f32>, TrainError> + 'a;
fn cpu_step(
    cfg: &ModelConfig,
    b: usize,
    init: &mut UnitInit<'_>,
    inputs: &[u32],
    targets: &[u32],
) -> Result<CpuStep, trainer::backend::BackendError> {
    cpu_step_with(cfg, &ModelOptions::batch(b), init, inputs, targets)
}

/// [`cpu_step`] with other model options (e.g. `train.precision`).
fn cpu_step_with(
    cfg: &ModelConfig,
    opts: &ModelOptions,
    init: &mut UnitInit<'_>,
    inputs: &[u32],
    targets: &[u32],
) -> Result<CpuStep, trainer::backend::BackendError> {
    cpu_step_batch(cfg, opts, init, &MicroBatch::plain(inputs, targets))
}

/// [`cpu_step_with`] on a whole micro-batch (e.g. with document starts).
fn cpu_step_batch(
    cfg: &ModelConfig,
    opts: &ModelOptions,
    init: &mut UnitInit<'_>,
    batch: &MicroBatch<'_>,
) -> Result<CpuStep, trainer::backend::BackendError> {
    let (cpu, layout) = (CpuBackend::new(), ModelLayout::new(cfg));
    let scale = Some(1.0 / batch.inputs.len() as f32);
    let mut comm = HostComm(collectives::tcp::TcpComm::local_group(1).map_err(dev)?.remove(0));
    let mut eng = Engine::new(&cpu, layout.clone(), EngineOptions::stage(0), 0, 1, Some(init)).map_err(dev)?;
    let mut m = cfg.family.build(&cpu, &layout, opts, &mut eng.ledger)?;
    eng.begin_step(&cpu)?;
    let loss = step_micro_loss(m.as_mut(), &cpu, &mut eng, &mut comm, batch, scale).map_err(dev)?;
    let grads: Vec<Vec<f32>> =
        (0..eng.num_units()).map(|u| eng.local_grads_host(&cpu, u)).collect::<Result<_, _>>().map_err(dev)?;
    eng.step(&cpu, &mut comm, HYPER, 1).map_err(dev)?;
    let params: Vec<Vec<f32>> = (0..eng.num_units())
        .map(|u| eng.full_params_host(&cpu, &mut comm, u))
        .collect::<Result<_, _>>()
        .map_err(dev)?;
    Ok(CpuStep { loss, grads, params })
}

struct CpuStep {
    loss: f64,
    grads: Vec<Vec<f32>>,
    params: Vec<Vec<f32>>,
}

/// `train.gemm_tuning = "timed"`: each GEMM shape's cuBLASLt candidates are timed on its
/// first call, on that call's own buffers (a gradient being accumulated is saved to the
/// host and put back). The step must match the CPU as closely as with the heuristic's
/// algorithms: a gradient left holding the timing runs' sums would be off by a factor.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn timed_gemm_tuning_matches_the_cpu() {
    gemm_tuning_matches_the_cpu(trainer::backend::GemmTuning::Timed, trainer::backend::Precision::Bf16);
}

/// `train.gemm_tuning = "searched"`: as timed, with the configurations found near the
/// heuristic's candidates timed too (and a found one picked only where its output agrees
/// with the heuristic's), in bf16 and (on Hopper) FP8, whose GEMMs the search is for.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn searched_gemm_tuning_matches_the_cpu() {
    use trainer::backend::{GemmTuning, Precision};
    gemm_tuning_matches_the_cpu(GemmTuning::Searched, Precision::Bf16);
    gemm_tuning_matches_the_cpu(GemmTuning::Searched, Precision::Fp8);
}

/// One step with GEMM tuning `mode` against the CPU (FP8: its simulation, at
/// `one_fp8_training_step_matches_the_cpu`'s tolerances), then on the picks as stored
/// with a run, twice, with the same bits.
fn gemm_tuning_matches_the_cpu(mode: trainer::backend::GemmTuning, precision: trainer::backend::Precision) {
    use trainer::backend::{GemmTuning, MatmulOps, Precision};
    gpu::check(|be, rng, rep| {
        if precision == Precision::Fp8 {
            if let Err(why) = be.fp8_support() {
                rep.check("fp8 GEMM tuning", "skipped", true, &why);
                return Ok(());
            }
        }
        // (loss, gradients, parameters) tolerances: bf16's, or FP8's against its simulation.
        let (tol_loss, tol_grad, tol_param) = match precision {
            Precision::Fp8 => (1e-2, 0.125, 2e-2),
            _ => (5e-3, 3e-2, TOL_BF16),
        };
        let cfg = small_gpt(1024);
        let (b, seed) = (4usize, 7u64);
        let n = b * cfg.seq_len;
        let layout = ModelLayout::new(&cfg);
        let opts = ModelOptions { precision, ..ModelOptions::batch(b) };
        let (inputs, targets) = (rng.below(n, cfg.vocab_size as u32), rng.below(n, cfg.vocab_size as u32));
        let CpuStep { loss: closs, grads: cgrads, params: cparams } =
            cpu_step_with(&cfg, &opts, &mut gpt2_init(&layout, seed), &inputs, &targets)?;

        be.set_gemm_tuning(mode);
        let what = format!("{mode:?} GEMM tuning, {precision:?} (GPT L2 C128 V1024 T256 B4)");
        let tag = format!("model step, {what}");
        let tag = tag.as_str();
        let id = nccl_unique_id().map_err(dev)?;
        let mut comm = NcclComm::new(be.stream().clone(), 0, 1, &id).map_err(dev)?;
        let mut eng =
            Engine::new(be, layout.clone(), EngineOptions::stage(0), 0, 1, Some(&mut gpt2_init(&layout, seed)))
                .map_err(dev)?;
        let mut m = cfg.family.build(be, &layout, &opts, &mut eng.ledger)?;
        eng.begin_step(be)?;
        let scale = Some(1.0 / n as f32);
        let loss = step_micro_loss(m.as_mut(), be, &mut eng, &mut comm, &MicroBatch::plain(&inputs, &targets), scale)
            .map_err(dev)?;
        rep.cmp(tag, "loss", &[loss as f32], &[closs as f32], tol_loss);
        for (u, cg) in cgrads.iter().enumerate() {
            let gg = eng.local_grads_host(be, u).map_err(dev)?;
            rep.cmp(tag, &format!("grad unit {u}"), &gg, cg, tol_grad);
        }
        eng.step(be, &mut comm, HYPER, 1).map_err(dev)?;
        for (u, cp) in cparams.iter().enumerate() {
            let gp = eng.full_params_host(be, &mut comm, u).map_err(dev)?;
            rep.cmp(tag, &format!("params unit {u}"), &gp, cp, tol_param);
        }
        let tuned = be.gemm_tuning_report();
        let accumulating = tuned.iter().filter(|t| t.candidates >= 2 && !t.gemm.ends_with("beta=0")).count();
        let changed = tuned.iter().filter(|t| t.chosen != 0).count();
        rep.check(
            tag,
            "shapes timed",
            tuned.iter().any(|t| t.candidates >= 2) && accumulating > 0,
            &format!(
                "{} shapes, {accumulating} accumulating with beta=1, {changed} off the heuristic's first",
                tuned.len()
            ),
        );
        if mode == GemmTuning::Searched {
            let searched = tuned.iter().filter(|t| t.searched > 0).count();
            let found = tuned.iter().filter(|t| t.chosen >= t.candidates).count();
            let disagreed = tuned.iter().filter(|t| t.disagreed).count();
            let (configs, seconds) = tuned.iter().fold((0, 0.0), |(n, s), t| (n + t.searched, s + t.seconds));
            rep.check(
                tag,
                "shapes searched",
                searched > 0,
                &format!(
                    "{searched} of {} searched ({configs} configurations, {seconds:.1} s), {found} picked a found \
                     configuration, {disagreed} disagreed",
                    tuned.len()
                ),
            );
        }

        // The picks as stored with a run, read back from their JSON, then in use: every
        // algorithm passes cuBLASLt's check, and a step on them matches the CPU too, with
        // the same bits twice (what reruns and resumes rely on).
        use trainer::backend::gemm_tuning::GemmTuningTable;
        use trainer::backend::OnMismatch;
        let table = be.gemm_choices().ok_or_else(|| dev("the CUDA backend has GEMM choices"))?;
        let table = GemmTuningTable::from_json(&table.to_json(), std::path::Path::new("picks.json")).map_err(dev)?;
        let used = be.use_gemm_choices(&table, "this step's picks", OnMismatch::Refuse).map_err(dev)?;
        rep.check(
            tag,
            "stored picks in use",
            used == table.gemms.len() && used > 0,
            &format!("{used} of {} in use", table.gemms.len()),
        );
        let tag = format!("model step, stored choices of {what}");
        let tag = tag.as_str();
        let mut runs: Vec<(f64, Vec<Vec<f32>>)> = Vec::new();
        for _ in 0..2 {
            let mut eng =
                Engine::new(be, layout.clone(), EngineOptions::stage(0), 0, 1, Some(&mut gpt2_init(&layout, seed)))
                    .map_err(dev)?;
            let mut m = cfg.family.build(be, &layout, &opts, &mut eng.ledger)?;
            eng.begin_step(be)?;
            let loss =
                step_micro_loss(m.as_mut(), be, &mut eng, &mut comm, &MicroBatch::plain(&inputs, &targets), scale)
                    .map_err(dev)?;
            let grads = (0..cgrads.len()).map(|u| eng.local_grads_host(be, u)).collect::<Result<Vec<_>, _>>();
            runs.push((loss, grads.map_err(dev)?));
        }
        rep.cmp(tag, "loss", &[runs[0].0 as f32], &[closs as f32], tol_loss);
        for (u, cg) in cgrads.iter().enumerate() {
            rep.cmp(tag, &format!("grad unit {u}"), &runs[0].1[u], cg, tol_grad);
            rep.same_bits(tag, &format!("grad unit {u}, second run"), &runs[1].1[u], &runs[0].1[u]);
        }
        rep.check(
            tag,
            "same loss twice",
            runs[0].0.to_bits() == runs[1].0.to_bits(),
            &format!("{} vs {}", runs[0].0, runs[1].0),
        );
        Ok(())
    });
}

/// A CUDA graph of one micro-step (recorded after an eager warm-up, then replayed) gives
/// the same loss and gradient bits as running the same micro-steps eagerly, on ZeRO stages
/// 0 and 3, in bf16 and (on Hopper) FP8, and in bf16 with `data.document_mask` (each batch
/// its own documents) — what `train.cuda_graphs` relies on.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn graph_replay_matches_eager_micro_steps() {
    use trainer::backend::GraphOps;
    use trainer::model::{run_micro, step_micro};
    gpu::check(|be, rng, rep| {
        let cfg = small_gpt(1024);
        let (b, seed) = (4usize, 5u64);
        let n = b * cfg.seq_len;
        let layout = ModelLayout::new(&cfg);
        // Each batch with its own documents (`data.document_mask` runs): the recording must
        // read the starts uploaded before each replay, not the first batch's.
        let batches: Vec<(Vec<u32>, Vec<u32>)> =
            (0..4).map(|_| (packed_documents(rng, n, 1023, 300), rng.below(n, cfg.vocab_size as u32))).collect();
        let mut masks: Vec<DocumentMask> = (0..4).map(|_| DocumentMask::new(Some(1023), cfg.seq_len)).collect();
        let scale = Some(1.0 / (4 * n) as f32);
        let id = nccl_unique_id().map_err(dev)?;
        let mut comm = NcclComm::new(be.stream().clone(), 0, 1, &id).map_err(dev)?;
        use trainer::backend::{MatmulOps, Precision};
        let precisions: &[Precision] =
            if be.fp8_support().is_ok() { &[Precision::Bf16, Precision::Fp8] } else { &[Precision::Bf16] };
        let runs = precisions.iter().flat_map(|&p| [(p, 0u8, false), (p, 3, false)]);
        let masked = [(Precision::Bf16, 0u8, true), (Precision::Bf16, 3, true)];
        for (precision, stage, document_mask) in runs.chain(masked) {
            let tag = format!(
                "graph replay (GPT L2 C128 T256 B4) stage {stage} {precision:?}{}",
                if document_mask { ", document_mask" } else { "" }
            );
            let mut out: Vec<(f64, Vec<Vec<f32>>)> = Vec::new();
            for graphs in [false, true] {
                let mut eng = Engine::new(
                    be,
                    layout.clone(),
                    EngineOptions::stage(stage),
                    0,
                    1,
                    Some(&mut gpt2_init(&layout, seed)),
                )
                .map_err(dev)?;
                let opts = ModelOptions { precision, document_mask, ..ModelOptions::batch(b) };
                let mut m = cfg.family.build(be, &layout, &opts, &mut eng.ledger)?;
                eng.begin_step(be)?;
                eng.set_final_micro(false);
                let mut graph = None;
                for (k, ((inp, tgt), mask)) in batches.iter().zip(masks.iter_mut()).enumerate() {
                    let batch = if document_mask { mask.batch(inp, tgt) } else { MicroBatch::plain(inp, tgt) };
                    if !graphs || k == 0 {
                        step_micro(m.as_mut(), be, &mut eng, &mut comm, &batch, scale).map_err(dev)?;
                        continue;
                    }
                    m.load_batch(be, &batch)?;
                    match &graph {
                        Some(g) => {
                            be.replay(g)?;
                            m.replayed_micro();
                        }
                        None => {
                            be.begin_capture()?;
                            let r = run_micro(m.as_mut(), be, &mut eng, &mut comm, scale);
                            let g = be.end_capture();
                            r.map_err(dev)?;
                            let g = g?;
                            be.replay(&g)?;
                            graph = Some(g);
                        }
                    }
                }
                let loss = m.take_mean_loss(be)?;
                eng.step(be, &mut comm, HYPER, 1).map_err(dev)?;
                let params: Vec<Vec<f32>> = (0..eng.num_units())
                    .map(|u| eng.full_params_host(be, &mut comm, u))
                    .collect::<Result<_, _>>()
                    .map_err(dev)?;
                out.push((loss, params));
            }
            rep.same_bits(&tag, "mean loss of 4 micro-steps", &[out[1].0 as f32], &[out[0].0 as f32]);
            for u in 0..out[0].1.len() {
                rep.same_bits(&tag, &format!("params unit {u} after the step"), &out[1].1[u], &out[0].1[u]);
            }
        }
        Ok(())
    });
}

/// `train.fp8_weight_cache` (every block, half, none; stages 0 and 3) on the GPU: three
/// optimizer steps of two micro-steps each, the first eager and the next two through CUDA
/// graphs as the trainer runs them (the step's first micro-step recorded once with its weight
/// casts, then replayed after each update), with and without activation checkpointing, GPT-2
/// and Llama, give the same loss and parameter bits with the weights cached (cast once per
/// step, the input's scale kept from forward to backward; where the optimizer step leaves the
/// weights' amaxes, it writes the cached weights' codes too) or not (the weight's amax kept
/// for the step), with the weights' amaxes left by the optimizer step or measured at their
/// first use — and as running every micro-step eagerly.
#[test]
#[ignore = "needs a CUDA GPU: run on one with --include-ignored (scripts/gpu-test.sh)"]
fn fp8_weight_cache_matches_per_use_casts_through_graphs_and_steps() {
    use trainer::backend::{GraphOps, MatmulOps, Precision};
    use trainer::model::{run_micro, step_micro};
    gpu::check(|be, rng, rep| {
        if let Err(why) = be.fp8_support() {
            rep.check("fp8 weight cache", "skipped", true, &why);
            return Ok(());
        }
        let (b, seed, steps, accum) = (4usize, 11u64, 3usize, 2usize);
        let id = nccl_unique_id().map_err(dev)?;
        let mut comm = NcclComm::new(be.stream().clone(), 0, 1, &id).map_err(dev)?;
        let every = CheckpointingConfig { activations: ActivationCheckpointing::EveryLayer, ..Default::default() };
        // keep_gelu: fc2's and down's kept input is their codes of the activation.
        let keep_gelu = CheckpointingConfig { keep_gelu: KeepGelu::Keep, ..Default::default() };
        for (cfg, ckpt) in [
            (small_gpt(1024), CheckpointingConfig::default()),
            (small_gpt(1024), keep_gelu.clone()),
            (small_gpt(1024), every.clone()),
            (small_llama(false), every),
            (small_llama(false), keep_gelu),
        ] {
            let n = b * cfg.seq_len;
            let layout = ModelLayout::new(&cfg);
            let family = cfg.family;
            let batches: Vec<(Vec<u32>, Vec<u32>)> = (0..steps * accum)
                .map(|_| (rng.below(n, cfg.vocab_size as u32), rng.below(n, cfg.vocab_size as u32)))
                .collect();
            let scale = Some(1.0 / (accum * n) as f32);
            let mut runs: Vec<(String, Vec<f32>, Vec<Vec<f32>>)> = Vec::new();
            // The reference first: no cache, eager, stage 0, the weights' amaxes measured at
            // their first use. Then the cache of every block or of the first half (the rest
            // cast at each use), and stage 3, whose gathers land in pooled buffers (the cache
            // is keyed by the parameter version); the weights' amaxes (and the cached weights'
            // codes) from the optimizer step (stages 0-2), or not.
            let (all, half) = (cfg.n_layer, cfg.n_layer / 2);
            let variants = [
                (0, false, 0u8, false),
                (0, false, 0, true),
                (all, false, 0, true),
                (all, true, 0, true),
                (all, true, 0, false),
                (0, true, 0, true),
                (half, true, 0, true),
                (all, true, 3, false),
                (0, true, 3, false),
            ];
            for (cached_blocks, graphs, stage, step_amax) in variants {
                let name = format!(
                    "{:?}: {cached_blocks} blocks cached, graphs {graphs}, stage {stage}, step amaxes {step_amax}, \
                     {:?} keep_gelu {:?}",
                    family, ckpt.activations, ckpt.keep_gelu
                );
                let l2 = layout.clone();
                let mut init = move |u, r| Ok(family.init_range(&l2, u, seed, Default::default(), r));
                let eopts = EngineOptions {
                    fp8_step_amax: step_amax.then_some((n, [false; 4])),
                    ..EngineOptions::stage(stage)
                };
                let mut eng = Engine::new(be, layout.clone(), eopts, 0, 1, Some(&mut init)).map_err(dev)?;
                let opts = ModelOptions {
                    precision: Precision::Fp8,
                    fp8_cached_blocks: cached_blocks,
                    checkpointing: ckpt.clone(),
                    ..ModelOptions::batch(b)
                };
                let mut m = cfg.family.build(be, &layout, &opts, &mut eng.ledger)?;
                // (first micro-step?, state before, state after, graph), as train.rs keeps them.
                let mut recorded = Vec::new();
                let mut losses = Vec::new();
                for step in 0..steps {
                    eng.begin_step(be)?;
                    for micro in 0..accum {
                        let (inp, tgt) = &batches[step * accum + micro];
                        eng.set_final_micro(false);
                        if !graphs || step == 0 {
                            step_micro(m.as_mut(), be, &mut eng, &mut comm, &MicroBatch::plain(inp, tgt), scale)
                                .map_err(dev)?;
                            continue;
                        }
                        m.load_batch(be, &MicroBatch::plain(inp, tgt))?;
                        eng.await_pending(be, &mut comm).map_err(dev)?;
                        let before = eng.micro_state();
                        let first = micro == 0;
                        if let Some((_, b0, after, g)) = recorded.iter().find(|r: &&(bool, _, _, _)| r.0 == first) {
                            rep.check(&name, "state before a replay", *b0 == before, &format!("micro {micro}"));
                            be.replay(g)?;
                            eng.restore_micro_state(after);
                            m.replayed_micro();
                            continue;
                        }
                        be.begin_capture()?;
                        let r = run_micro(m.as_mut(), be, &mut eng, &mut comm, scale);
                        let g = be.end_capture();
                        r.map_err(dev)?;
                        let g = g?;
                        be.replay(&g)?;
                        recorded.push((first, before, eng.micro_state(), g));
                    }
                    losses.push(m.take_mean_loss(be)? as f32);
                    eng.step(be, &mut comm, HYPER, step as u64 + 1).map_err(dev)?;
                }
                let params: Vec<Vec<f32>> = (0..eng.num_units())
                    .map(|u| eng.full_params_host(be, &mut comm, u))
                    .collect::<Result<_, _>>()
                    .map_err(dev)?;
                runs.push((name, losses, params));
            }
            let (_, want_loss, want_params) = &runs[0];
            for (name, losses, params) in &runs[1..] {
                let tag = format!("fp8 ({name}) vs per use, eager");
                rep.same_bits(&tag, "loss of each step", losses, want_loss);
                for (u, (p, w)) in params.iter().zip(want_params).enumerate() {
                    rep.same_bits(&tag, &format!("params unit {u} after 3 steps"), p, w);
                }
            }
        }
        Ok(())
    });
}
