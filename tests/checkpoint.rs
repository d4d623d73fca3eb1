//! Sharded checkpoints: exact resume, resharding across world sizes and ZeRO stages,
//! corruption detection, `latest` selection, retention, the run each checkpoint belongs to.

mod common;

use collectives::tcp::TcpComm;
use std::path::{Path, PathBuf};
use trainer::backend::cpu::{CpuBackend, HostComm};
use trainer::checkpoint::{find_latest, find_latest_of, CheckpointReader};
use trainer::train::Trainer;
use trainer::Config;

/// Global batch = micro_batch 2 × grad_accum × world = 24 rows for every layout below.
const GLOBAL_ROWS: usize = 24;

fn cfg_for(world: usize, stage: u8, ckpt_dir: &Path) -> Config {
    let mut cfg =
        Config::from_toml_str(&common::tiny_toml(stage, GLOBAL_ROWS / (2 * world), "\"none\""), "t").expect("cfg");
    cfg.train.steps = 6;
    cfg.checkpoint.dir = Some(ckpt_dir.to_path_buf());
    cfg.checkpoint.keep = 10;
    cfg
}

/// Run `world` ranks from `resume` (or from scratch) until step `until`; save at the end if asked.
fn run(cfg: &Config, world: usize, data: &Path, resume: Option<PathBuf>, until: usize, save: bool) -> Vec<f64> {
    let (cfg, data) = (cfg.clone(), data.to_path_buf());
    let mut all = common::run_ranks(world, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&cfg, &be, rank, world, &data).expect("trainer");
        if let Some(dir) = &resume {
            tr.resume(&be, &mut comm, dir).expect("resume");
        }
        let mut losses = vec![];
        while tr.step < until {
            losses.push(tr.train_step(&be, &mut comm).expect("step").loss);
        }
        if save {
            tr.save_checkpoint(&be, &mut comm).expect("save");
        }
        losses
    });
    all.swap_remove(0)
}

fn close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(((x - y) / y).abs() <= 1e-5, "{what}: step {}: {x} vs {y}", i + 1);
    }
}

#[test]
fn resume_is_exact_on_the_same_layout() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let ck = dir.path().join("ck");
    let cfg = cfg_for(2, 1, &ck);
    let full = run(&cfg, 2, &data, None, 6, false);
    let first = run(&cfg, 2, &data, None, 3, true);
    let rest = run(&cfg, 2, &data, Some(ck.join("step_00000003")), 6, false);
    assert_eq!(first, full[..3].to_vec());
    // CPU backend: bit-identical continuation.
    assert_eq!(rest, full[3..].to_vec());
}

#[test]
fn resharding_matrix_continues_the_uninterrupted_run() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let reference = run(&cfg_for(1, 0, &dir.path().join("unused")), 1, &data, None, 6, false);
    // (saved world, stage) -> (resumed world, stage)
    for &((w0, s0), (w1, s1)) in
        &[((2, 1), (3, 3)), ((3, 2), (2, 0)), ((4, 3), (1, 0)), ((1, 0), (4, 2)), ((2, 3), (2, 1))]
    {
        let ck = dir.path().join(format!("ck_{w0}_{s0}_{w1}_{s1}"));
        let first = run(&cfg_for(w0, s0, &ck), w0, &data, None, 3, true);
        close(&first, &reference[..3], &format!("{w0}x stage {s0} first half"));
        let rest = run(&cfg_for(w1, s1, &ck), w1, &data, Some(ck.join("step_00000003")), 6, false);
        close(&rest, &reference[3..], &format!("saved {w0} ranks stage {s0}, resumed on {w1} ranks stage {s1}"));
    }
}

fn saved_checkpoint(dir: &Path) -> (PathBuf, PathBuf) {
    let data = common::write_synthetic_shard(dir, 97, 20_000);
    let ck = dir.join("ck");
    let cfg = cfg_for(2, 2, &ck);
    run(&cfg, 2, &data, None, 1, true);
    run(&cfg, 2, &data, Some(ck.join("step_00000001")), 2, true);
    (ck, data)
}

#[test]
fn corruption_is_detected_and_named() {
    let dir = tempfile::tempdir().expect("tmp");
    let (ck, _) = saved_checkpoint(dir.path());
    let step2 = ck.join("step_00000002");
    assert!(CheckpointReader::open(&step2, true).is_ok());
    assert_eq!(find_latest(&ck).expect("latest"), step2);

    // Checksum mismatch: flip one byte inside the tensor data of rank 1's shard.
    let shard = step2.join("rank00001.safetensors");
    let mut bytes = std::fs::read(&shard).expect("read");
    let n = bytes.len();
    bytes[n - 5] ^= 0x40;
    std::fs::write(&shard, &bytes).expect("write");
    let e = CheckpointReader::open(&step2, true).err().expect("must fail").to_string();
    assert!(e.contains("rank00001.safetensors") && e.contains("checksum"), "{e}");
    // `latest` names the broken one's problem and the older intact checkpoint.
    let e = find_latest(&ck).expect_err("newest is corrupt").to_string();
    assert!(e.contains("checksum") && e.contains("step_00000001"), "{e}");

    // Truncated file.
    std::fs::write(&shard, &bytes[..n / 2]).expect("truncate");
    let e = CheckpointReader::open(&step2, false).err().expect("must fail").to_string();
    assert!(e.contains("rank00001.safetensors") && e.contains("bytes"), "{e}");

    // Missing shard.
    std::fs::remove_file(&shard).expect("rm");
    let e = CheckpointReader::open(&step2, false).err().expect("must fail").to_string();
    assert!(e.contains("rank00001.safetensors"), "{e}");

    // Missing manifest (a crash mid-save).
    let step1 = ck.join("step_00000001");
    std::fs::remove_file(step1.join("manifest.json")).expect("rm");
    let e = CheckpointReader::open(&step1, false).err().expect("must fail").to_string();
    assert!(e.contains("manifest.json"), "{e}");
    let e = find_latest(&ck).expect_err("none intact").to_string();
    assert!(e.contains("no checkpoint is intact"), "{e}");
}

/// Edit `dir`'s manifest.json as JSON (the way a hand edit or a mixed-up file would).
fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
    edit(&mut m);
    std::fs::write(&path, serde_json::to_vec_pretty(&m).expect("json")).expect("write");
}

#[test]
fn a_segment_bound_off_by_one_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().expect("tmp");
    let (ck, _) = saved_checkpoint(dir.path());
    let step2 = ck.join("step_00000002");
    // Rank 0 holds the first half of unit 0: one more value is still inside the unit (so the
    // launcher's manifest check passes) but beyond what the shard file holds.
    edit_manifest(&step2, |m| {
        let seg = &mut m["files"][0]["segments"][0];
        assert_eq!(seg["lo"], 0);
        seg["hi"] = (seg["hi"].as_u64().expect("hi") + 1).into();
    });
    // Without its checksum file (as a checkpoint saved before manifest checksums), so the
    // bounds themselves are what is checked.
    std::fs::remove_file(step2.join("manifest.json.crc32")).expect("rm checksum");
    for verify in [false, true] {
        let e = CheckpointReader::open(&step2, verify).err().expect("must be refused").to_string();
        assert!(e.contains("rank00000.safetensors") && e.contains("manifest.json") && e.contains("--resume"), "{e}");
    }
    let e = find_latest(&ck).expect_err("newest is damaged").to_string();
    assert!(e.contains("rank00000.safetensors") && e.contains("step_00000001"), "{e}");
}

#[test]
fn an_edited_manifest_fails_its_checksum_and_older_checkpoints_without_one_load() {
    let dir = tempfile::tempdir().expect("tmp");
    let (ck, _) = saved_checkpoint(dir.path());
    let step2 = ck.join("step_00000002");
    assert!(step2.join("manifest.json.crc32").is_file());
    let original = std::fs::read(step2.join("manifest.json")).expect("read");
    // A one-digit edit of the data position (still valid JSON and a consistent manifest).
    edit_manifest(&step2, |m| {
        let rows = &mut m["data"]["sources"][0]["rows"];
        *rows = (rows.as_u64().expect("rows") + 10).into();
    });
    for verify in [false, true] {
        let e = CheckpointReader::open(&step2, verify).err().expect("must be refused").to_string();
        assert!(e.contains("step_00000002") && e.contains("manifest.json fails its checksum"), "{e}");
        assert!(e.contains("--resume"), "{e}");
    }
    let e = find_latest(&ck).expect_err("newest is edited").to_string();
    assert!(e.contains("manifest.json fails its checksum") && e.contains("step_00000001"), "{e}");
    // A checkpoint saved before manifest checksums (no checksum file) still loads.
    std::fs::write(step2.join("manifest.json"), original).expect("restore");
    std::fs::remove_file(step2.join("manifest.json.crc32")).expect("rm checksum");
    assert!(CheckpointReader::open(&step2, true).is_ok());
    assert_eq!(find_latest(&ck).expect("latest"), step2);
}

#[test]
fn another_model_shape_is_refused_before_training() {
    let dir = tempfile::tempdir().expect("tmp");
    let (ck, data) = saved_checkpoint(dir.path());
    let mut cfg = cfg_for(1, 0, &ck);
    cfg.model.n_embd = 48;
    let be = CpuBackend::new();
    let mut comm = HostComm(TcpComm::local_group(1).expect("g").remove(0));
    let mut tr = Trainer::new(&cfg, &be, 0, 1, &data).expect("trainer");
    let e = tr.resume(&be, &mut comm, &ck.join("step_00000002")).expect_err("must fail").to_string();
    assert!(e.contains("model.n_embd is 36 in the checkpoint but 48"), "{e}");
}

#[test]
fn retention_keeps_the_newest_and_ignores_partial_saves() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let ck = dir.path().join("ck");
    let mut cfg = cfg_for(2, 3, &ck);
    cfg.checkpoint.keep = 2;
    for s in 1..=4 {
        let resume = (s > 1).then(|| ck.join(format!("step_{:08}", s - 1)));
        run(&cfg, 2, &data, resume, s, true);
    }
    // A crash mid-save leaves a hidden partial directory: never picked up as a checkpoint.
    std::fs::create_dir_all(ck.join(".step_00000005.partial")).expect("mkdir");
    let mut names: Vec<String> = std::fs::read_dir(&ck)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("step_"))
        .collect();
    names.sort();
    assert_eq!(names, vec!["step_00000003", "step_00000004"]);
    assert_eq!(find_latest(&ck).expect("latest"), ck.join("step_00000004"));
}

#[test]
fn checkpoints_belong_to_their_run_and_are_never_replaced_or_pruned_by_another() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let ck = dir.path().join("ck");
    // Two runs (their run directories say who they are) sharing one checkpoint.dir, keep = 1.
    let run_cfg = |name: &str| {
        let mut cfg = cfg_for(2, 1, &ck);
        cfg.checkpoint.keep = 1;
        cfg.output.dir = dir.path().join(name);
        std::fs::create_dir_all(&cfg.output.dir).expect("mkdir");
        std::fs::write(cfg.output.dir.join("run.json"), format!("{{\"run_id\": \"{name}\"}}")).expect("run.json");
        cfg
    };
    let (a, b) = (run_cfg("run-a"), run_cfg("run-b"));
    run(&a, 2, &data, None, 1, true);
    let a1 = ck.join("step_00000001");
    let manifest = |d: &Path| CheckpointReader::open(d, true).expect("intact").manifest;
    assert_eq!(manifest(&a1).run_id.as_deref(), Some("run-a"));
    run(&b, 2, &data, None, 2, true);
    // run-b's save pruned to its own newest 1: run-a's checkpoint is not its to prune.
    assert_eq!(manifest(&a1).run_id.as_deref(), Some("run-a"));
    assert_eq!(find_latest_of(&ck, Some("run-a")).expect("a's latest"), a1);
    assert_eq!(find_latest_of(&ck, Some("run-b")).expect("b's latest"), ck.join("step_00000002"));
    let e = find_latest_of(&ck, Some("run-c")).expect_err("none of run-c").to_string();
    assert!(e.contains("other runs only") && e.contains("run-a") && e.contains("run-b"), "{e}");

    // run-b reaching step 1 does not replace run-a's step_00000001: it fails, loudly, and keeps it.
    let before = std::fs::read(a1.join("rank00000.safetensors")).expect("shard");
    let (b2, d2) = (b.clone(), data.clone());
    let errors = common::run_ranks(2, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&b2, &be, rank, 2, &d2).expect("trainer");
        tr.train_step(&be, &mut comm).expect("step");
        tr.save_checkpoint(&be, &mut comm).err().map(|e| e.to_string())
    });
    let e = errors[0].as_deref().expect("rank 0 refuses to replace it");
    assert!(e.contains("belongs to run run-a") && e.contains("it is kept"), "{e}");
    assert_eq!(manifest(&a1).run_id.as_deref(), Some("run-a"));
    assert_eq!(std::fs::read(a1.join("rank00000.safetensors")).expect("shard"), before);
}

#[test]
fn hugging_face_export_import_export_is_bit_identical() {
    use trainer::checkpoint::hf::{export, DEFAULT_MAX_SHARD_BYTES};
    let dir = tempfile::tempdir().expect("tmp");
    let (ck, data) = saved_checkpoint(dir.path());
    let a = dir.path().join("a");
    let summary = export(&ck.join("step_00000002"), &a, DEFAULT_MAX_SHARD_BYTES).expect("export");
    assert_eq!(summary.tensors, 4 + 2 * 12);
    assert_eq!(summary.files, vec!["model.safetensors"]);

    // A transformers folder: config.json beside the weights.
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.join("config.json")).expect("config.json")).expect("JSON");
    assert_eq!(config["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(
        (config["n_embd"].as_u64(), config["n_layer"].as_u64(), config["n_positions"].as_u64()),
        (Some(36), Some(2), Some(16))
    );
    // Names and Hugging Face (Conv1D) layouts.
    let bytes = std::fs::read(a.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    let shape = |n: &str| st.tensor(n).expect(n).shape().to_vec();
    assert_eq!(shape("transformer.wte.weight"), vec![97, 36]);
    assert_eq!(shape("transformer.wpe.weight"), vec![16, 36]);
    assert_eq!(shape("transformer.h.1.attn.c_attn.weight"), vec![36, 108]);
    assert_eq!(shape("transformer.h.1.mlp.c_fc.weight"), vec![36, 144]);
    assert_eq!(shape("transformer.h.1.mlp.c_proj.weight"), vec![144, 36]);
    assert_eq!(shape("transformer.ln_f.bias"), vec![36]);
    assert!(st.tensor("lm_head.weight").is_err(), "the head is tied to wte and not written");

    // Import the folder as the initial weights on another layout, save, export again.
    let ck2 = dir.path().join("ck2");
    let mut cfg = cfg_for(3, 3, &ck2);
    cfg.train.init_from = Some(a.clone());
    common::run_ranks(3, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&cfg, &be, rank, 3, &data).expect("trainer");
        tr.save_checkpoint(&be, &mut comm).expect("save");
    });
    let b = dir.path().join("b");
    export(&ck2.join("step_00000000"), &b, DEFAULT_MAX_SHARD_BYTES).expect("export again");
    for file in ["model.safetensors", "config.json"] {
        assert_eq!(std::fs::read(a.join(file)).expect("a"), std::fs::read(b.join(file)).expect("b"), "{file}");
    }
}

/// Above the shard size the folder is split as save_pretrained splits it (shards and an
/// index), reads back as the single file does, from the folder or any way round.
#[test]
fn sharded_folders_carry_an_index_and_import_like_one_file() {
    use trainer::checkpoint::hf::{export, HfWeights};
    let dir = tempfile::tempdir().expect("tmp");
    let (ck, _) = saved_checkpoint(dir.path());
    let (one, many) = (dir.path().join("one"), dir.path().join("many"));
    export(&ck.join("step_00000002"), &one, u64::MAX).expect("export");
    // wte alone is 97 x 36 x 4 = 13968 bytes: every block's tensors make several more files.
    let s = export(&ck.join("step_00000002"), &many, 20_000).expect("sharded export");
    let n = s.files.len();
    assert!(n >= 3, "{:?}", s.files);
    assert_eq!(s.files[0], format!("model-00001-of-{n:05}.safetensors"));
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(many.join("model.safetensors.index.json")).expect("index"))
            .expect("JSON");
    let map = index["weight_map"].as_object().expect("weight_map");
    assert_eq!(map.len(), s.tensors);
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(4 * s.params as u64));
    let mut total = 0;
    for f in &s.files {
        let bytes = std::fs::read(many.join(f)).expect("shard");
        assert!(bytes.len() as u64 <= 20_000 + 4096, "{f}: {} bytes", bytes.len());
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid");
        for name in st.names() {
            assert_eq!(map[name], f.as_str(), "{name} is where the index says");
            total += st.tensor(name).expect("tensor").data().len() as u64;
        }
    }
    assert_eq!(Some(total), index["metadata"]["total_size"].as_u64());
    assert!(!many.join("model.safetensors").exists());
    let cfg = cfg_for(1, 0, &ck);
    let layout = trainer::model::ModelLayout::new(&cfg.model);
    let (a, b) = (HfWeights::open(&one).expect("one"), HfWeights::open(&many).expect("many"));
    let c = HfWeights::open(&one.join("model.safetensors")).expect("the file alone");
    for u in 0..layout.units.len() {
        let want = a.unit_values(&layout, u).expect("unit");
        assert_eq!(b.unit_values(&layout, u).expect("unit"), want, "unit {u}");
        assert_eq!(c.unit_values(&layout, u).expect("unit"), want, "unit {u}");
    }
}

/// Write `src`'s float32 tensors again as `dtype` (`odd`: one tensor as another dtype).
fn rewrite(src: &Path, dst: &Path, dtype: safetensors::Dtype, odd: Option<(&str, safetensors::Dtype)>) {
    let bytes = std::fs::read(src).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid");
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let vals: Vec<f32> =
            view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let dt = match odd {
            Some((n, d)) if n == name => d,
            _ => dtype,
        };
        let data: Vec<u8> = match dt {
            safetensors::Dtype::BF16 => {
                vals.iter().flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()).collect()
            }
            safetensors::Dtype::F16 => {
                vals.iter().flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes()).collect()
            }
            safetensors::Dtype::F64 => vals.iter().flat_map(|&v| f64::from(v).to_le_bytes()).collect(),
            _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        owned.push((name, dt, view.shape().to_vec(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, dst).expect("write");
}

/// Hugging Face weights in bfloat16 or float16 (as most models are published) import as
/// their values widened to f32; another dtype is refused, naming the tensor.
#[test]
fn half_precision_weights_import_and_other_dtypes_are_named() {
    use trainer::checkpoint::hf::{export, HfWeights, DEFAULT_MAX_SHARD_BYTES};
    let dir = tempfile::tempdir().expect("tmp");
    let (ck, data) = saved_checkpoint(dir.path());
    let f32_dir = dir.path().join("f32");
    export(&ck.join("step_00000002"), &f32_dir, DEFAULT_MAX_SHARD_BYTES).expect("export");
    let f32_file = f32_dir.join("model.safetensors");
    let cfg = cfg_for(1, 0, &ck);
    let layout = trainer::model::ModelLayout::new(&cfg.model);
    let full = HfWeights::open(&f32_file).expect("f32");
    for (dtype, round) in [
        (safetensors::Dtype::BF16, (|v: f32| half::bf16::from_f32(v).to_f32()) as fn(f32) -> f32),
        (safetensors::Dtype::F16, |v: f32| half::f16::from_f32(v).to_f32()),
    ] {
        let path = dir.path().join(format!("{dtype:?}.safetensors"));
        rewrite(&f32_file, &path, dtype, None);
        let w = HfWeights::open(&path).expect("open");
        for u in 0..layout.units.len() {
            let want: Vec<f32> = full.unit_values(&layout, u).expect("f32").into_iter().map(round).collect();
            assert_eq!(w.unit_values(&layout, u).expect("half"), want, "{dtype:?} unit {u}");
        }
        // And as a run's initial weights.
        let mut c = cfg.clone();
        c.train.init_from = Some(path);
        Trainer::<CpuBackend>::new(&c, &CpuBackend::new(), 0, 1, &data)
            .expect("a run starts from half-precision weights");
    }
    let odd = dir.path().join("f64.safetensors");
    rewrite(&f32_file, &odd, safetensors::Dtype::BF16, Some(("transformer.wte.weight", safetensors::Dtype::F64)));
    let e = HfWeights::open(&odd).expect("open").check(&layout).unwrap_err().to_string();
    assert!(e.contains("transformer.wte.weight is F64") && e.contains("float32, bfloat16 and float16"), "{e}");
    let mut c = cfg.clone();
    c.train.init_from = Some(odd);
    let e = Trainer::<CpuBackend>::new(&c, &CpuBackend::new(), 0, 1, &data).err().expect("must fail");
    assert!(matches!(e, trainer::TrainError::Checkpoint(_)), "a checkpoint problem (exit code 2): {e}");
}

#[test]
fn import_errors_name_the_tensor() {
    use trainer::checkpoint::hf::{export, DEFAULT_MAX_SHARD_BYTES};
    let dir = tempfile::tempdir().expect("tmp");
    let (ck, data) = saved_checkpoint(dir.path());
    let a = dir.path().join("a");
    export(&ck.join("step_00000002"), &a, DEFAULT_MAX_SHARD_BYTES).expect("export");
    let mut cfg = cfg_for(1, 0, &ck);
    cfg.train.init_from = Some(a);
    cfg.model.n_layer = 3;
    let e = Trainer::<CpuBackend>::new(&cfg, &CpuBackend::new(), 0, 1, &data).err().expect("must fail").to_string();
    assert!(e.contains("h.2.ln_1.weight") && e.contains("missing"), "{e}");
    cfg.model.n_layer = 2;
    cfg.train.init_from = Some(dir.path().join("nope.safetensors"));
    let e = Trainer::<CpuBackend>::new(&cfg, &CpuBackend::new(), 0, 1, &data).err().expect("must fail").to_string();
    assert!(e.contains("nope.safetensors"), "{e}");
    // A folder without weights, and a file that is not safetensors: named, never a panic.
    std::fs::create_dir(dir.path().join("empty")).expect("mkdir");
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "not weights").expect("write");
    for (path, needle) in [(dir.path().join("empty"), "holds neither"), (text, "is not a safetensors file")] {
        cfg.train.init_from = Some(path);
        let e = Trainer::<CpuBackend>::new(&cfg, &CpuBackend::new(), 0, 1, &data).err().expect("must fail");
        assert!(matches!(e, trainer::TrainError::Checkpoint(_)) && e.to_string().contains(needle), "{e}");
    }
}

/// A checkpoint saved with the optimizer on the host resumes with it on the device and
/// the other way round (and with the parameters offloaded on ZeRO-3), continuing the
/// uninterrupted run exactly.
#[test]
fn offloaded_and_device_optimizers_share_checkpoints() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let offload = |mut c: Config, params: bool| {
        c.offload.optimizer = true;
        c.offload.params = params;
        c
    };
    for (i, (save_off, load_off, stage)) in
        [(true, false, 1u8), (false, true, 2), (true, true, 3), (false, true, 3)].into_iter().enumerate()
    {
        let ck = dir.path().join(format!("ck{i}"));
        let mut base = cfg_for(2, stage, &ck);
        let params = stage == 3;
        if params {
            // Parameter offload takes no gradient accumulation (yet): the same global batch in one micro-step.
            base.train.micro_batch *= base.train.grad_accum;
            base.train.grad_accum = 1;
        }
        let saver = if save_off { offload(base.clone(), params) } else { base.clone() };
        let loader = if load_off { offload(base.clone(), params) } else { base.clone() };
        let full = run(&base, 2, &data, None, 6, false);
        run(&saver, 2, &data, None, 3, true);
        let latest = find_latest(&ck).expect("a checkpoint");
        let rest = run(&loader, 2, &data, Some(latest), 6, false);
        assert_eq!(
            rest,
            full[3..].to_vec(),
            "case {i}: saved offload={save_off}, loaded offload={load_off}, stage {stage}"
        );
    }
}

/// With the delayed update (`offload.delayed_update`) a checkpoint first applies the update
/// in flight: resuming from it continues exactly like the run that saved it and went on.
#[test]
fn delayed_update_resumes_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let ck = dir.path().join("ck");
    let mut cfg = cfg_for(2, 3, &ck);
    cfg.offload.optimizer = true;
    cfg.offload.delayed_update = true;
    cfg.offload.delayed_update_after = 1;
    cfg.offload.cpu_threads = 1;
    cfg.validate().expect("valid");
    let (c, d) = (cfg.clone(), data.clone());
    let mut saved_and_went_on = common::run_ranks(2, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&c, &be, rank, 2, &d).expect("trainer");
        let mut losses = vec![];
        while tr.step < 6 {
            losses.push(tr.train_step(&be, &mut comm).expect("step").loss);
            if tr.step == 3 {
                tr.save_checkpoint(&be, &mut comm).expect("save");
            }
        }
        losses
    });
    let full = saved_and_went_on.swap_remove(0);
    let rest = run(&cfg, 2, &data, Some(ck.join("step_00000003")), 6, false);
    assert_eq!(rest, full[3..].to_vec(), "CPU backend: the same bits after the resume");
}

/// `checkpoint.async`: the shard is copied to host memory at the step boundary and written
/// while training goes on (steps 4 and 5 run before the save is waited for). The files are
/// the synchronous save's byte for byte, on every stage, with the optimizer on the device
/// or the host, and resuming from them continues the uninterrupted run exactly.
#[test]
fn asynchronous_checkpoints_are_the_synchronous_ones_and_resume_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    for (stage, offload) in [(0u8, false), (1, false), (2, true), (3, false)] {
        let sync_ck = dir.path().join(format!("sync{stage}"));
        let mut sync_cfg = cfg_for(2, stage, &sync_ck);
        sync_cfg.offload.optimizer = offload;
        let full = run(&sync_cfg, 2, &data, None, 6, false);
        run(&sync_cfg, 2, &data, None, 3, true);

        let async_ck = dir.path().join(format!("async{stage}"));
        let mut cfg = sync_cfg.clone();
        cfg.checkpoint.dir = Some(async_ck.clone());
        cfg.checkpoint.async_save = true;
        cfg.checkpoint.every = 3;
        cfg.validate().expect("valid");
        let (c, d) = (cfg.clone(), data.clone());
        let mut went_on = common::run_ranks(2, move |rank, mut comm| {
            let be = CpuBackend::new();
            let mut tr = Trainer::new(&c, &be, rank, 2, &d).expect("trainer");
            let mut losses = vec![];
            while tr.step < 6 {
                losses.push(tr.train_step(&be, &mut comm).expect("step").loss);
                if tr.step == 3 {
                    let dir = tr.save_checkpoint(&be, &mut comm).expect("save started");
                    assert_eq!(dir.file_name().and_then(|n| n.to_str()), Some("step_00000003"));
                }
            }
            tr.finish_saves().expect("the save in the background").is_some()
        });
        assert!(went_on.iter().all(|waited| *waited), "stage {stage}: every rank had a save to wait for");
        went_on.clear();
        for file in ["rank00000.safetensors", "rank00001.safetensors"] {
            let a = std::fs::read(sync_ck.join("step_00000003").join(file)).expect("sync file");
            let b = std::fs::read(async_ck.join("step_00000003").join(file)).expect("async file");
            assert!(
                a == b,
                "stage {stage} offload {offload}: {file} differs between the synchronous and asynchronous save"
            );
        }
        // The manifests agree but for the config they record (checkpoint.dir, async, every).
        let manifest = |ck: &Path| {
            let text = std::fs::read_to_string(ck.join("step_00000003/manifest.json")).expect("manifest");
            let mut m: serde_json::Value = serde_json::from_str(&text).expect("json");
            m.as_object_mut().expect("object").remove("config_toml");
            m
        };
        assert_eq!(manifest(&sync_ck), manifest(&async_ck), "stage {stage}: manifests");
        let names: Vec<String> = std::fs::read_dir(&async_ck)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into())
            .collect();
        assert_eq!(names, ["step_00000003"], "stage {stage}: nothing else left behind");
        let rest = run(&sync_cfg, 2, &data, Some(async_ck.join("step_00000003")), 6, false);
        assert_eq!(rest, full[3..].to_vec(), "stage {stage}: resumed from the asynchronous checkpoint");
    }
}

/// `checkpoint.async` saves one after the other: the second waits for the first (the host
/// copy is one), and the first is complete and pruned by `keep = 1` once the second is
/// published; the second resumes exactly. Both saves' stalls are measured.
#[test]
fn consecutive_asynchronous_saves_wait_for_each_other() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let ck = dir.path().join("ck");
    let mut cfg = cfg_for(2, 2, &ck);
    cfg.checkpoint.async_save = true;
    cfg.checkpoint.every = 1;
    cfg.checkpoint.keep = 1;
    cfg.validate().expect("valid");
    let full = run(&cfg_for(2, 2, &dir.path().join("plain")), 2, &data, None, 6, false);
    let (c, d) = (cfg.clone(), data.clone());
    let stalls = common::run_ranks(2, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&c, &be, rank, 2, &d).expect("trainer");
        let mut saves = vec![];
        while tr.step < 3 {
            tr.train_step(&be, &mut comm).expect("step");
            if tr.step >= 2 {
                tr.save_checkpoint(&be, &mut comm).expect("save started");
                saves.push(tr.take_save_metrics().expect("a save's stall"));
            }
        }
        let last = tr.finish_saves().expect("the last save");
        assert_eq!(last.as_deref().and_then(|p| p.file_name()).and_then(|n| n.to_str()), Some("step_00000003"));
        saves
    });
    for s in stalls.iter().flatten() {
        assert!(s.background && s.bytes > 0 && s.stall_s >= s.waited_s, "{s:?}");
    }
    let names: Vec<String> =
        std::fs::read_dir(&ck).expect("ls").map(|e| e.expect("entry").file_name().to_string_lossy().into()).collect();
    assert_eq!(names, ["step_00000003"], "step 2 complete, then pruned by keep = 1 after step 3");
    let rest = run(&cfg_for(2, 2, &dir.path().join("plain")), 2, &data, Some(ck.join("step_00000003")), 6, false);
    assert_eq!(rest, full[3..].to_vec(), "resumed from the second asynchronous save");
}

/// A Llama in and out of Hugging Face folders: an untied tiny Llama's checkpoint exported
/// as a sharded folder, imported with `[model]` left out (the shape from its config.json)
/// on one rank at stage 0 and on three at stage 3 (each rank reading its own range of each
/// tensor), saved and exported again: the same bytes. A checkpoint directory as
/// `train.init_from` gives the same weights; a config that disagrees with the folder is
/// refused naming the key, and weights of another shape naming the tensor.
#[test]
fn llama_folders_import_on_any_layout_and_export_the_same_bytes() {
    use trainer::checkpoint::hf::{export, INDEX_FILE};
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let ck = dir.path().join("ck");
    let mut cfg = Config::from_toml_str(&common::tiny_llama_toml(1, 2, "\"none\"", false), "t").expect("cfg");
    cfg.checkpoint.dir = Some(ck.clone());
    run(&cfg, 2, &data, None, 2, true);
    let a = dir.path().join("a");
    // 30 kB files: several shards and an index, as save_pretrained writes above its size.
    let summary = export(&ck.join("step_00000002"), &a, 30_000).expect("export");
    assert!(summary.files.len() > 2 && a.join(INDEX_FILE).is_file(), "{:?}", summary.files);

    // The config names no model: the folder's config.json does.
    let toml = |from: &Path, ck: &Path, stage: u8, extra: &str| {
        format!(
            "[model]\nseq_len = 16\n{extra}\n[train]\ninit_from = '{}'\nmicro_batch = 2\n\n[zero]\nstage = {stage}\n\n\
             [checkpoint]\ndir = '{}'\n",
            from.display(),
            ck.display()
        )
    };
    let load = |text: String| {
        let p = dir.path().join(format!("c{}.toml", text.len()));
        std::fs::write(&p, text).expect("write");
        Config::load(&p, &[])
    };
    for (world, stage) in [(1usize, 0u8), (3, 3)] {
        let out = dir.path().join(format!("ck-{world}-{stage}"));
        let cfg = load(toml(&a, &out, stage, "")).expect("model from config.json");
        assert_eq!(cfg.model.family, trainer::model::ModelFamily::Llama);
        assert_eq!((cfg.model.kv_heads(), cfg.model.intermediate_size, cfg.model.tied()), (2, Some(40), false));
        let data = data.clone();
        common::run_ranks(world, move |rank, mut comm| {
            let mut tr = Trainer::new(&cfg, &CpuBackend::new(), rank, world, &data).expect("trainer");
            tr.save_checkpoint(&CpuBackend::new(), &mut comm).expect("save");
        });
        let b = dir.path().join(format!("b-{world}-{stage}"));
        export(&out.join("step_00000000"), &b, 30_000).expect("export again");
        for file in std::iter::once(INDEX_FILE.to_string()).chain(summary.files.iter().cloned()) {
            let same = std::fs::read(a.join(&file)).expect("a") == std::fs::read(b.join(&file)).expect("b");
            assert!(same, "{world} ranks, stage {stage}: {file} differs");
        }
    }
    // A checkpoint as train.init_from: its master weights, the same bytes once exported.
    let out = dir.path().join("ck-from-ck");
    let cfg = load(toml(&ck.join("step_00000002"), &out, 2, "")).expect("model from the manifest");
    let d2 = data.clone();
    common::run_ranks(2, move |rank, mut comm| {
        let mut tr = Trainer::new(&cfg, &CpuBackend::new(), rank, 2, &d2).expect("trainer");
        tr.save_checkpoint(&CpuBackend::new(), &mut comm).expect("save");
    });
    let c = dir.path().join("c");
    export(&out.join("step_00000000"), &c, 30_000).expect("export");
    assert_eq!(
        std::fs::read(a.join(&summary.files[0])).expect("a"),
        std::fs::read(c.join(&summary.files[0])).expect("c")
    );

    // Keys that disagree with the folder are named; seq_len is the config's to choose.
    let e = load(toml(&a, &out, 0, "n_kv_head = 4\n")).unwrap_err().to_string();
    assert!(e.contains("model.n_kv_head") && e.contains("holds a model with n_kv_head = 2"), "{e}");
    load(toml(&a, &out, 0, "family = \"llama\"\nn_layer = 2\nvocab_size = 128\n"))
        .expect("agreeing keys, a larger vocabulary");
    // Weights without a config.json, for another MLP width: the tensor is named.
    let bare = dir.path().join("bare");
    std::fs::create_dir(&bare).expect("mkdir");
    for f in std::iter::once(INDEX_FILE.to_string()).chain(summary.files.iter().cloned()) {
        std::fs::copy(a.join(&f), bare.join(&f)).expect("copy");
    }
    let mut cfg = Config::from_toml_str(&common::tiny_llama_toml(0, 2, "\"none\"", false), "t").expect("cfg");
    cfg.model.intermediate_size = Some(48);
    cfg.train.init_from = Some(bare);
    let e = match Trainer::new(&cfg, &CpuBackend::new(), 0, 1, &data) {
        Ok(_) => panic!("weights of another shape were accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("mlp.gate_proj.weight has shape [40, 32]") && e.contains("[48, 32]"), "{e}");
}

/// ZeRO-3 with FP8 gathers (`zero.fp8_gather`): a resumed run agrees on the amaxes again from
/// the loaded weights (not the ones it was built with) and continues bit for bit, on 2 and 3
/// ranks, resumed on the other world size too.
#[test]
fn fp8_gathers_resume_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 20_000);
    let ck = dir.path().join("ck");
    let fp8 = |world: usize| {
        let text = common::tiny_toml(3, GLOBAL_ROWS / (2 * world), "\"none\"")
            .replace("n_head = 3\nn_embd = 36\n", "n_head = 2\nn_embd = 32\n")
            .replace("[train]\n", "[train]\nprecision = \"fp8\"\n")
            .replace("[zero]\n", "[zero]\nfp8_gather = true\n");
        let mut cfg = Config::from_toml_str(&text, "t").expect("cfg");
        cfg.train.steps = 6;
        cfg.checkpoint.dir = Some(ck.clone());
        cfg.checkpoint.keep = 10;
        cfg
    };
    let full = run(&fp8(2), 2, &data, None, 6, false);
    let first = run(&fp8(2), 2, &data, None, 3, true);
    assert_eq!(first, full[..3].to_vec());
    let rest = run(&fp8(2), 2, &data, Some(ck.join("step_00000003")), 6, false);
    assert_eq!(rest, full[3..].to_vec(), "resumed on 2 ranks");
    let other = run(&fp8(3), 3, &data, Some(ck.join("step_00000003")), 6, false);
    close(&other, &full[3..], "resumed on 3 ranks");
}
