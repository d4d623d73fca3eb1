//! Memory accounting: the prediction made before launch (meta backend) equals what the
//! ledger records in a real CPU run, for every stage; and the stages shard model state
//! the way the ZeRO paper says.

mod common;
use common::{KEEP_ATTENTION, KEEP_GELU};

use trainer::backend::cpu::CpuBackend;
use trainer::train::Trainer;
use trainer::zero::plan::{predict, DeviceModel};
use trainer::Config;

fn measured(cfg: &Config, world: usize, data: &std::path::Path) -> Vec<trainer::zero::MemoryReport> {
    let (cfg, data) = (cfg.clone(), data.to_path_buf());
    common::run_ranks(world, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&cfg, &be, rank, world, &data).expect("trainer");
        tr.train_step(&be, &mut comm).expect("step").memory
    })
}

#[test]
fn prediction_equals_measured_ledger_on_every_stage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for stage in 0..=3u8 {
        for act in ["\"none\"", "\"every_layer\"", KEEP_ATTENTION, KEEP_GELU] {
            let cfg = Config::from_toml_str(&common::tiny_toml(stage, 2, act), "test").expect("cfg");
            let got = measured(&cfg, 2, &data);
            for (rank, m) in got.iter().enumerate() {
                let p = predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict");
                assert_eq!(&p, m, "stage {stage} {act} rank {rank}: predicted vs measured");
            }
        }
    }
}

/// The same for the Llama family (tied and untied head, a chunked LM head): every byte the
/// ledger records in a real run was predicted, on every stage.
#[test]
fn llama_prediction_equals_measured_ledger_on_every_stage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for tied in [false, true] {
        for stage in 0..=3u8 {
            for act in ["\"none\"", KEEP_ATTENTION, KEEP_GELU] {
                let toml =
                    common::tiny_llama_toml(stage, 2, act, tied).replace("[train]\n", "[train]\nloss_chunk_rows = 7\n");
                let cfg = Config::from_toml_str(&toml, "test").expect("cfg");
                let got = measured(&cfg, 2, &data);
                for (rank, m) in got.iter().enumerate() {
                    let p = predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict");
                    assert_eq!(&p, m, "llama tied {tied} stage {stage} {act} rank {rank}: predicted vs measured");
                }
            }
        }
    }
}

/// `data.document_mask`: the document starts' buffer (4 bytes a token) is predicted exactly,
/// GPT-2 and Llama, every stage, checkpointing or not, and it is all the mask adds.
#[test]
fn document_mask_prediction_equals_measured_ledger() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_documents(dir.path(), 97, 20_000, "train");
    type Toml = fn(u8, &str) -> String;
    let families: [(&str, Toml); 2] = [
        ("gpt2", |stage, act| common::tiny_toml(stage, 2, act)),
        ("llama", |stage, act| common::tiny_llama_toml(stage, 2, act, true)),
    ];
    for (family, toml) in families {
        for stage in 0..=3u8 {
            for act in ["\"none\"", KEEP_ATTENTION] {
                let text = toml(stage, act).replace("[zero]", "[data]\ndocument_mask = true\n\n[zero]");
                let cfg = Config::from_toml_str(&text, "test").expect("cfg");
                let got = measured(&cfg, 2, &data);
                let plain = Config::from_toml_str(&toml(stage, act), "test").expect("cfg");
                for (rank, m) in got.iter().enumerate() {
                    let p = predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict");
                    assert_eq!(&p, m, "{family} document_mask stage {stage} {act} rank {rank}: predicted vs measured");
                    let without = predict(&plain, 2, rank, DeviceModel::cpu()).expect("predict");
                    let starts = (cfg.train.micro_batch * cfg.model.seq_len * 4) as u64;
                    assert_eq!(m.current.workspace, without.current.workspace + starts, "{family} stage {stage}");
                    assert_eq!(m.current.total(), without.current.total() + starts, "{family} stage {stage}");
                }
            }
        }
    }
}

/// The planner runs at most three micro-steps (first, middle, last): a real run of five
/// records the same ledger, on every stage.
#[test]
fn a_long_accumulation_is_planned_from_three_micro_steps_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for stage in 0..=3u8 {
        let cfg = Config::from_toml_str(&common::tiny_toml(stage, 5, "\"none\""), "test").expect("cfg");
        for (rank, m) in measured(&cfg, 2, &data).iter().enumerate() {
            assert_eq!(&predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict"), m, "stage {stage} rank {rank}");
        }
    }
}

/// `launcher memory` and the launch's fit check predict the first and the last rank only:
/// every other rank predicts what the first does (equal padded shards), on every stage,
/// with and without offload, for world sizes whose shards divide the units unevenly.
#[test]
fn every_rank_predicts_what_the_first_or_the_last_does() {
    for world in [3usize, 5, 7] {
        for stage in 0..=3u8 {
            for extra in ["", "\n[offload]\noptimizer = true\n"] {
                let toml = common::tiny_toml(stage, 2, "\"none\"") + extra;
                let cfg = Config::from_toml_str(&toml, "t").expect("cfg");
                let p = |r: usize| predict(&cfg, world, r, DeviceModel::cuda()).expect("predict");
                let (first, last) = (p(0), p(world - 1));
                for r in 1..world - 1 {
                    assert_eq!(p(r), first, "world {world} stage {stage} {extra:?}: rank {r} vs rank 0");
                }
                assert_eq!(last.host, first.host, "world {world} stage {stage}: host memory");
            }
        }
    }
}

#[test]
fn stages_shard_model_state_as_zero_paper() {
    // A model big enough that padding is negligible: 4 ranks.
    let toml =
        common::tiny_toml(0, 1, "\"none\"").replace("n_embd = 36", "n_embd = 96").replace("n_layer = 2", "n_layer = 4");
    let mut states = vec![];
    for stage in 0..=3u8 {
        let mut cfg = Config::from_toml_str(&toml, "t").expect("cfg");
        cfg.zero.stage = stage;
        let p = predict(&cfg, 4, 0, DeviceModel::cpu()).expect("predict");
        let c = p.current;
        states.push((c.params + c.grads + c.optimizer) as f64);
    }
    let psi =
        trainer::model::ModelLayout::new(&Config::from_toml_str(&toml, "t").expect("cfg").model).num_params() as f64;
    // fp32 everywhere on the CPU: stage 0 holds params 4Ψ + grads 4Ψ + (master, m, v) 12Ψ.
    let per_param: Vec<f64> = states.iter().map(|s| s / psi).collect();
    assert!((per_param[0] - 20.0).abs() < 0.2, "stage 0: {per_param:?}");
    // No compute-precision parameter shard is kept beside the fp32 master weights (a
    // gather or a publish rounds the master weights into place).
    // stage 1: params 4Ψ + grads 4Ψ (+ the reduced 4Ψ/N shard) + 12Ψ/N
    assert!((per_param[1] - (8.0 + 16.0 / 4.0)).abs() < 0.3, "stage 1: {per_param:?}");
    // stage 2: params 4Ψ, grads only the shard 4Ψ/N, optimizer 12Ψ/N
    assert!((per_param[2] - (4.0 + 16.0 / 4.0)).abs() < 0.3, "stage 2: {per_param:?}");
    // stage 3: everything sharded (steady state, after release): (4 + 12)Ψ/N
    assert!((per_param[3] - 16.0 / 4.0).abs() < 0.3, "stage 3: {per_param:?}");
}

/// On one rank stage 1's shard is the whole gradient: it keeps the one full gradient
/// buffer stage 0 keeps, not a second one (and the ledger of a real run agrees).
#[test]
fn one_rank_stage_1_keeps_one_gradient_buffer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let plan = |stage: u8| {
        let cfg = Config::from_toml_str(&common::tiny_toml(stage, 2, "\"none\""), "test").expect("cfg");
        let p = predict(&cfg, 1, 0, DeviceModel::cpu()).expect("predict");
        assert_eq!(vec![p], measured(&cfg, 1, &data), "stage {stage}: predicted vs measured on one rank");
        p
    };
    let (s0, s1) = (plan(0), plan(1));
    assert_eq!(s1.current.grads, s0.current.grads, "stage 1 on one rank: {:?} vs stage 0 {:?}", s1.current, s0.current);
    assert_eq!(s1.peak_total, s0.peak_total, "stage 1 on one rank: peak");
}

#[test]
fn steady_state_steps_allocate_nothing_on_any_stage() {
    for stage in 0..=3u8 {
        for act in ["\"none\"", "\"every_layer\"", KEEP_ATTENTION, KEEP_GELU] {
            let cfg = Config::from_toml_str(&common::tiny_toml(stage, 2, act), "test").expect("cfg");
            let (_, allocs) = trainer::zero::plan::dry_run(&cfg, 3, 1, DeviceModel::cuda(), 3).expect("dry run");
            assert_eq!(allocs[0], allocs[2], "stage {stage} {act}: buffers allocated after step 1: {allocs:?}");
        }
    }
}

/// The planner allocates nothing that grows with the model: a 4-layer model of width 24576
/// (7.2 billion parameters per block; the old planner made a 29 GB host vector of initial
/// values for one block and aborted on this 24 GiB machine) and a 100B-parameter model are
/// planned, on every stage.
#[test]
fn planning_huge_models_allocates_no_model_sized_host_memory() {
    let wide = "[model]\nn_layer = 4\nn_head = 192\nn_embd = 24576\nvocab_size = 50304\nseq_len = 2048\n";
    let big = "[model]\nn_layer = 96\nn_head = 80\nn_embd = 10240\nvocab_size = 50304\nseq_len = 2048\n";
    for toml in [wide, big] {
        for stage in 0..=3u8 {
            let mut cfg = Config::from_toml_str(toml, "huge").expect("cfg");
            cfg.zero.stage = stage;
            cfg.train.micro_batch = 1;
            let p = predict(&cfg, 8, 3, DeviceModel::cuda()).expect("predict");
            let psi = trainer::model::ModelLayout::new(&cfg.model).num_params() as u64;
            // At least the optimizer state of this rank's shard is there.
            assert!(p.peak_total >= 12 * psi / 8, "stage {stage}: {} bytes for {psi} parameters", p.peak_total);
        }
    }
}

/// With the optimizer offloaded the device holds no optimizer state and the host holds
/// 12 bytes per owned parameter (plus page-locked staging; with the parameters offloaded,
/// their rounded shard too) — predicted exactly, on every stage.
#[test]
fn offload_moves_optimizer_state_to_the_host_as_predicted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for stage in 0..=3u8 {
        for params in [false, true] {
            if params && stage != 3 {
                continue;
            }
            let extra = format!("\n[offload]\noptimizer = true\nparams = {params}\n");
            let accum = if params { 1 } else { 2 };
            let cfg = Config::from_toml_str(&(common::tiny_toml(stage, accum, "\"none\"") + &extra), "t").expect("cfg");
            let got = measured(&cfg, 2, &data);
            for (rank, m) in got.iter().enumerate() {
                let p = predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict");
                assert_eq!(&p, m, "stage {stage} params {params} rank {rank}: predicted vs measured");
                assert_eq!(m.current.optimizer, 0, "stage {stage}: optimizer state left on the device");
                assert!(m.host.optimizer > 0 && m.host.staging > 0, "stage {stage}: {:?}", m.host);
                assert_eq!(m.host.params > 0, params, "stage {stage}: host parameter shard {:?}", m.host);
            }
            // The host state is 12 bytes per element this rank owns: the whole model at stage
            // 0, half of it (and padding) on the others.
            let psi = trainer::model::ModelLayout::new(&cfg.model).num_params() as f64;
            let per_param = got[0].host.optimizer as f64 / psi;
            let want = if stage == 0 { 12.0 } else { 6.0 };
            assert!((per_param - want).abs() < 0.5, "stage {stage}: {per_param} bytes per parameter");
        }
        // The delayed update stages every held element's gradient and rounded update (f32
        // each on the CPU backend: 8 bytes, where the GPU's bf16 copy makes it 6) instead of
        // the rings — also predicted exactly.
        let extra = "\n[offload]\noptimizer = true\ndelayed_update = true\ndelayed_update_after = 0\n";
        let cfg = Config::from_toml_str(&(common::tiny_toml(stage, 2, "\"none\"") + extra), "t").expect("cfg");
        let got = measured(&cfg, 2, &data);
        for (rank, m) in got.iter().enumerate() {
            let p = predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict");
            assert_eq!(&p, m, "stage {stage} delayed rank {rank}: predicted vs measured");
            assert_eq!(m.host.staging * 12, m.host.optimizer * 8, "stage {stage}: {:?}", m.host);
        }
    }
}

/// `checkpointing.keep_attention` holds each checkpointed block's attention output (C
/// values per token) and softmax state: more activation memory than recomputing it, far
/// less than keeping every activation.
#[test]
fn keeping_the_attention_costs_its_output_per_checkpointed_block() {
    let act = |a: &str| {
        let cfg = Config::from_toml_str(&common::tiny_toml(1, 1, a), "test").expect("cfg");
        predict(&cfg, 1, 0, DeviceModel::cuda()).expect("predict").current.activations
    };
    let (none, every, kept) = (act("\"none\""), act("\"every_layer\""), act(KEEP_ATTENTION));
    // tiny_toml: 2 blocks, micro-batch 2 x 16 tokens, C = 36, 3 heads: bf16 outputs (2 bytes)
    // plus the attention's saved state.
    let outputs = 2 * (2 * 16 * 36 * 2) as u64;
    assert!(kept >= every + outputs && kept < none, "none {none}, every layer {every}, attention kept {kept}");
}

/// `keep_gelu` costs exactly each non-checkpointed block's GELU output (4·C bf16 values per
/// token), and nothing where the block is checkpointed.
#[test]
fn keeping_the_gelu_output_costs_it_per_block_not_checkpointed() {
    let act = |a: &str| {
        let cfg = Config::from_toml_str(&common::tiny_toml(1, 1, a), "test").expect("cfg");
        predict(&cfg, 1, 0, DeviceModel::cuda()).expect("predict").current.activations
    };
    // tiny_toml: 2 blocks, micro-batch 2 x 16 tokens, C = 36.
    let gelu = (2 * 16 * 4 * 36 * 2) as u64;
    assert_eq!(act(KEEP_GELU), act("\"none\"") + 2 * gelu, "both blocks keep theirs");
    // Every second block checkpointed: block 0 is, block 1 keeps its GELU output.
    assert_eq!(act("2\nkeep_gelu = true"), act("2") + gelu, "only the block not checkpointed");
}

/// `keep_gelu = "auto"` (the default) is decided by the launcher before the ranks start
/// (`launcher/src/fit.rs`, tested there); a config that reaches the trainer undecided (the
/// trainer as a library) recomputes, and the prediction says so exactly: equal to `false`'s,
/// and to what its run records.
#[test]
fn an_undecided_keep_gelu_predicts_and_runs_as_recompute() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let cfg = |a: &str| Config::from_toml_str(&common::tiny_toml(1, 1, a), "test").expect("cfg");
    let auto = cfg("\"none\"\nkeep_gelu = \"auto\"");
    assert_eq!(auto.checkpointing.keep_gelu, trainer::config::KeepGelu::Auto);
    let off = cfg("\"none\"\nkeep_gelu = false");
    for rank in 0..2 {
        let p = predict(&auto, 2, rank, DeviceModel::cuda()).expect("predict");
        assert_eq!(p, predict(&off, 2, rank, DeviceModel::cuda()).expect("predict"), "rank {rank}");
    }
    for (rank, m) in measured(&auto, 2, &data).iter().enumerate() {
        assert_eq!(&predict(&auto, 2, rank, DeviceModel::cpu()).expect("predict"), m, "rank {rank}");
    }
}

/// `train.precision = "fp8"`: the planner predicts the ledger of a real CPU run on every
/// stage, with the weight cache of every block, of the first block only, and without
/// (`train.fp8_weight_cache` = true, 1, false; CPU ranks keep an input scale per layer and
/// each cached layer's dequantized weight: `fp8::cpu_reserved`); for the CUDA backend it adds
/// exactly the FP8 operand workspace with its per-layer scale slots (`CudaFp8Workspace`,
/// workspace), both layouts of each cached linear layer's weight in FP8
/// (`CudaFp8WeightCache`, 2 bytes per parameter, params) and the input codes the layers of
/// blocks that are not checkpointed keep for their backward (`CudaFp8KeptInputs`, a byte per
/// input value of qkv, proj and fc: activations), at stage 3 too.
#[test]
fn fp8_prediction_equals_measured_ledger_and_models_the_cuda_workspace_and_weight_cache() {
    use trainer::backend::fp8::{CudaFp8KeptInputs, CudaFp8WeightCache, CudaFp8Workspace};
    use trainer::backend::{Fp8Layers, LinearExtent};
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let toml = |stage: u8, precision: &str, cache: &str| {
        common::tiny_toml(stage, 2, "\"none\"")
            .replace("n_head = 3\nn_embd = 36\n", "n_head = 2\nn_embd = 32\n")
            .replace("[train]\n", &format!("[train]\nprecision = \"{precision}\"\nfp8_weight_cache = {cache}\n"))
    };
    // tiny_toml: 2 blocks of C = 32, 2 × 16 rows.
    let c = 32;
    let linears = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)];
    let e = LinearExtent::of(2 * 16, &linears);
    let layers = Fp8Layers::blocks(2 * 16, &linears, 2, 2);
    let workspace = CudaFp8Workspace::new(e, 8).bytes as u64;
    let cache = CudaFp8WeightCache::new(&layers.weights).bytes as u64;
    assert_eq!(cache, 2 * 2 * 12 * 32 * 32, "both layouts of 12·C² weights per block, 256-byte aligned");
    // Without keep_gelu, fc2 recomputes its input: qkv's, proj's and fc's inputs (32 × C codes).
    let kept_codes: Vec<usize> = (0..8).map(|i| if i % 4 == 3 { 0 } else { 2 * 16 * c }).collect();
    let kept = CudaFp8KeptInputs::new(&kept_codes).bytes as u64;
    assert_eq!(kept, 2 * 3 * 32 * 32);
    // qkv applies ln1 in its cast (`model::norm_in_cast`): no block allocates ln1's
    // output (bf16, 32 × C a block); ln2's stays (fc2 keeps no codes without keep_gelu).
    let ln1 = 2 * 2 * 16 * c as u64 * 2;
    for stage in 0..=3u8 {
        for (on, cached) in [("true", cache), ("1", cache / 2), ("false", 0)] {
            let cfg = Config::from_toml_str(&toml(stage, "fp8", on), "test").expect("cfg");
            for (rank, m) in measured(&cfg, 2, &data).iter().enumerate() {
                let p = predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict");
                assert_eq!(&p, m, "fp8 stage {stage} cache {on} rank {rank}: predicted vs measured");
            }
            let bf16 = Config::from_toml_str(&toml(stage, "bf16", on), "test").expect("cfg");
            let (f, b) = (
                predict(&cfg, 2, 0, DeviceModel::cuda()).expect("fp8"),
                predict(&bf16, 2, 0, DeviceModel::cuda()).expect("bf16"),
            );
            let tag = format!("stage {stage}, fp8_weight_cache = {on}");
            assert_eq!(f.current.workspace - b.current.workspace, workspace, "{tag}");
            assert_eq!(f.current.params - b.current.params, cached, "{tag}");
            assert_eq!(f.current.activations + ln1 - b.current.activations, kept, "{tag}");
            assert_eq!(f.current.total() + ln1 - b.current.total(), workspace + cached + kept, "{tag}");
        }
    }
    // A layer kept in bf16 (`train.fp8_bf16_layers`) has no cached weight: proj's C² of a
    // block's 12·C² leaves the cache; the workspace (sized by the largest layer) is the same.
    for stage in 0..=3u8 {
        let kept = toml(stage, "fp8", "true").replace("[train]\n", "[train]\nfp8_bf16_layers = [\"proj\"]\n");
        let cfg = Config::from_toml_str(&kept, "test").expect("cfg");
        for (rank, m) in measured(&cfg, 2, &data).iter().enumerate() {
            let p = predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict");
            assert_eq!(&p, m, "fp8, proj kept in bf16, stage {stage} rank {rank}: predicted vs measured");
        }
        let bf16 = Config::from_toml_str(&toml(stage, "bf16", "true"), "test").expect("cfg");
        let (f, b) = (
            predict(&cfg, 2, 0, DeviceModel::cuda()).expect("fp8"),
            predict(&bf16, 2, 0, DeviceModel::cuda()).expect("bf16"),
        );
        assert_eq!(f.current.params - b.current.params, cache / 12 * 11, "stage {stage}, proj kept");
        assert_eq!(f.current.workspace - b.current.workspace, workspace, "stage {stage}, proj kept");
    }
    // At GPT-2 1.5B, 8 × 1024 tokens: 256 B of per-op scales, 2·8192·6400 B of activations and
    // gradients, 6400·1600 B of weight: 115 MiB; 48 layers' slots add 1.5 KiB.
    let e = LinearExtent::of(8192, &[(1600, 4800), (1600, 1600), (1600, 6400), (6400, 1600)]);
    assert_eq!(CudaFp8Workspace::new(e, 0).bytes, 256 + 2 * 8192 * 6400 + 6400 * 1600);
    // The weight cache at 1.5B: 2 bytes per parameter of 48 blocks' 12·C² (2.8 GiB).
    let l = Fp8Layers::blocks(8192, &[(1600, 4800), (1600, 1600), (1600, 6400), (6400, 1600)], 48, 48);
    assert_eq!(CudaFp8WeightCache::new(&l.weights).bytes, 2 * 48 * 12 * 1600 * 1600);
}

/// FP8 with both families' MLP activations applied in their output layer's cast (keep_gelu:
/// GPT-2's fc2 of GELU, Llama's down of SwiGLU, each with a predicted scale on CUDA) and
/// without (no checkpointing, every block checkpointed): the planner runs the same ops as a
/// real run (the meta backend has each of them) and predicts every byte, on every stage.
#[test]
fn fp8_activations_in_casts_are_planned_and_predicted_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let gpt2 = |stage: u8, act: &str| {
        common::tiny_toml(stage, 2, act)
            .replace("n_head = 3\nn_embd = 36\n", "n_head = 2\nn_embd = 32\n")
            .replace("[train]\n", "[train]\nprecision = \"fp8\"\n")
    };
    let llama = |stage: u8, act: &str| {
        common::tiny_llama_toml(stage, 2, act, false)
            .replace("intermediate_size = 40", "intermediate_size = 48")
            .replace("[train]\n", "[train]\nprecision = \"fp8\"\n")
    };
    for (family, toml) in [("gpt2", &gpt2 as &dyn Fn(u8, &str) -> String), ("llama", &llama)] {
        for stage in [0u8, 3] {
            for act in [KEEP_GELU, "\"every_layer\""] {
                let cfg = Config::from_toml_str(&toml(stage, act), "test").expect("cfg");
                for (rank, m) in measured(&cfg, 2, &data).iter().enumerate() {
                    let p = predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict");
                    assert_eq!(&p, m, "{family} fp8 stage {stage} {act} rank {rank}: predicted vs measured");
                }
            }
        }
    }
}

/// Every feature that adds memory at once — the FP8 weight cache and operand workspace
/// (`train.precision = "fp8"`), document starts (`data.document_mask`), kept GELU outputs
/// (`checkpointing.keep_gelu`, what `"auto"` decides with these predictions) — predicted
/// exactly on every stage against a real CPU run; and in the CUDA model together they add
/// the sum of what each adds alone: nothing counted twice or lost where they meet.
#[test]
fn fp8_cache_document_mask_and_kept_gelu_together_are_predicted_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_documents(dir.path(), 97, 20_000, "train");
    let cfg = |stage: u8, fp8: bool, mask: bool, keep: bool| {
        let text = common::tiny_toml(stage, 2, if keep { KEEP_GELU } else { "\"none\"" })
            .replace("n_head = 3\nn_embd = 36\n", "n_head = 2\nn_embd = 32\n")
            .replace(
                "[train]\n",
                &format!("[train]\nprecision = \"{}\"\nfp8_weight_cache = true\n", if fp8 { "fp8" } else { "bf16" }),
            )
            .replace("[zero]", &format!("[data]\ndocument_mask = {mask}\n\n[zero]"));
        Config::from_toml_str(&text, "test").expect("cfg")
    };
    for stage in 0..=3u8 {
        let all = cfg(stage, true, true, true);
        assert!(
            all.data.document_mask
                && all.checkpointing.keep_gelu.keeps()
                && all.train.fp8_weight_cache.cached_blocks(2, stage) == 2
        );
        for (rank, m) in measured(&all, 2, &data).iter().enumerate() {
            let p = predict(&all, 2, rank, DeviceModel::cpu()).expect("predict");
            assert_eq!(
                &p, m,
                "fp8 + cache, document_mask, keep_gelu: stage {stage} rank {rank}: predicted vs measured"
            );
        }
        let cuda = |c: &Config| predict(c, 2, 0, DeviceModel::cuda()).expect("predict").current;
        let none = cuda(&cfg(stage, false, false, false));
        let added = |c: &Config| cuda(c).total() - none.total();
        let (fp8, mask, gelu) = (
            added(&cfg(stage, true, false, false)),
            added(&cfg(stage, false, true, false)),
            added(&cfg(stage, false, false, true)),
        );
        assert!(fp8 > 0 && mask > 0 && gelu > 0, "stage {stage}: each adds memory ({fp8}, {mask}, {gelu})");
        // In FP8 what keep_gelu keeps is fc2's e4m3 codes of the GELU output: half the bytes
        // of the bf16 output kept in bf16 (each block's 32 × 4C, a multiple of 256 bytes); and
        // with every fc2 keeping codes, fc applies ln2 in its cast, so no block keeps ln2's
        // bf16 output (32 × C a block), and fc2 takes GELU from the pre-activation, so the
        // model holds no scratch for GELU's output (32 × 4C).
        let (ln2, gelu_out) = (2 * 2 * 16 * 32 * 2, 2 * 16 * 4 * 32 * 2);
        assert_eq!(
            added(&all) + ln2 + gelu_out,
            fp8 + mask + gelu / 2,
            "stage {stage}: together, the sum of each alone"
        );
    }
}

/// `checkpoint.async` keeps a host copy of each rank's checkpoint shard (fp32 master weights,
/// AdamW m and v of its range of every unit: 12 bytes per element), counted as host memory
/// and predicted exactly, on every stage and with the optimizer on the host too; the device
/// memory is what it is without it.
#[test]
fn the_asynchronous_checkpoint_copy_is_host_memory_predicted_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for stage in 0..=3u8 {
        for offload in ["", "\n[offload]\noptimizer = true\n"] {
            let base = common::tiny_toml(stage, 2, "\"none\"") + offload;
            let with = base.clone() + "\n[checkpoint]\nevery = 2\nasync = true\n";
            let plain = Config::from_toml_str(&base, "t").expect("cfg");
            let cfg = Config::from_toml_str(&with, "t").expect("cfg");
            let got = measured(&cfg, 2, &data);
            for (rank, m) in got.iter().enumerate() {
                let p = predict(&cfg, 2, rank, DeviceModel::cpu()).expect("predict");
                assert_eq!(&p, m, "stage {stage} {offload:?} rank {rank}: predicted vs measured");
                let without = predict(&plain, 2, rank, DeviceModel::cpu()).expect("predict");
                assert_eq!(m.current, without.current, "stage {stage}: the copy is not device memory");
                assert_eq!(m.host.checkpoint, m.host.total() - without.host.total(), "stage {stage}: {:?}", m.host);
            }
            // Together the ranks copy 12 bytes for every parameter of the model, once.
            let psi = trainer::model::ModelLayout::new(&cfg.model).num_params() as u64;
            assert_eq!(got.iter().map(|m| m.host.checkpoint).sum::<u64>(), 12 * psi, "stage {stage} {offload:?}");
        }
    }
}

/// ZeRO-3's FP8 gathers (`zero.fp8_gather`): the pieces' buffers and the amaxes are
/// predicted exactly, on 2 and 3 ranks, GPT-2 (its tiny shape made FP8-eligible) and Llama,
/// and they are what the gathers add: the same run with bf16 gathers holds less.
#[test]
fn fp8_gather_prediction_equals_measured_ledger() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let gpt2 =
        common::tiny_toml(3, 2, "\"every_layer\"").replace("n_head = 3\nn_embd = 36\n", "n_head = 2\nn_embd = 32\n");
    let llama =
        common::tiny_llama_toml(3, 2, "\"none\"", true).replace("intermediate_size = 40", "intermediate_size = 48");
    for (family, toml) in [("gpt2", gpt2), ("llama", llama)] {
        for world in [2usize, 3] {
            let with = |on: bool| {
                let t = toml.replace("[train]\n", "[train]\nprecision = \"fp8\"\n");
                Config::from_toml_str(&t.replace("[zero]\n", &format!("[zero]\nfp8_gather = {on}\n")), "test")
                    .expect("cfg")
            };
            let (on, off) = (measured(&with(true), world, &data), measured(&with(false), world, &data));
            for (rank, m) in on.iter().enumerate() {
                let p = predict(&with(true), world, rank, DeviceModel::cpu()).expect("predict");
                assert_eq!(&p, m, "{family} world {world} rank {rank}: predicted vs measured");
                assert!(m.peak_total > off[rank].peak_total, "{family} world {world} rank {rank}: nothing added?");
            }
        }
    }
}
