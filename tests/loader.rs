//! The training loader through the trainer: each window of an epoch trained on exactly
//! once across a checkpoint and a resume on another number of ranks and batch shape; an
//! interrupted run sees the same tokens as an uninterrupted one (losses bit-equal); mixed
//! sources hold their weights, resume exactly, and refuse changed data.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use trainer::backend::cpu::CpuBackend;
use trainer::checkpoint::CheckpointReader;
use trainer::train::Trainer;
use trainer::Config;

/// micro_batch, grad_accum, world.
type Shape = (usize, usize, usize);

fn cfg(shape: Shape, steps: usize, ckpt: &Path, extra: &str) -> Config {
    let (mb, accum, _) = shape;
    let text =
        common::tiny_toml(1, accum, "\"none\"").replace("micro_batch = 2", &format!("micro_batch = {mb}")) + extra;
    let mut c = Config::from_toml_str(&text, "t").expect("cfg");
    c.train.steps = steps;
    c.checkpoint.dir = Some(ckpt.to_path_buf());
    c.checkpoint.keep = 10;
    c
}

/// What rank 0 saw after each step: the loss, the step's windows, the step's source metrics.
struct Seen {
    losses: Vec<f64>,
    windows: Vec<data::WindowRef>,
    sources: Vec<Vec<trainer::metrics::SourceMetrics>>,
}

/// Run `shape` from `resume` (or from scratch) until step `until`, saving at the end if asked.
fn run(c: &Config, shape: Shape, data: &Path, resume: Option<PathBuf>, until: usize, save: bool) -> Seen {
    let (c, data, world) = (c.clone(), data.to_path_buf(), shape.2);
    let mut all = common::run_ranks(world, move |rank, mut comm| {
        let be = CpuBackend::new();
        let mut tr = Trainer::new(&c, &be, rank, world, &data).expect("trainer");
        if let Some(dir) = &resume {
            tr.resume(&be, &mut comm, dir).expect("resume");
        }
        let mut seen = Seen { losses: vec![], windows: vec![], sources: vec![] };
        while tr.step < until {
            let m = tr.train_step(&be, &mut comm).expect("step");
            seen.losses.push(m.loss);
            seen.sources.push(m.sources);
            seen.windows.extend_from_slice(tr.sampler().step_windows());
        }
        if save {
            tr.save_checkpoint(&be, &mut comm).expect("save");
        }
        seen
    });
    all.swap_remove(0)
}

fn step_dir(ck: &Path, step: usize) -> PathBuf {
    ck.join(format!("step_{step:08}"))
}

#[test]
fn each_window_of_the_epoch_is_trained_once_across_a_resume_on_other_ranks() {
    let dir = tempfile::tempdir().expect("tmp");
    // 4000 tokens, seq_len 16: (4000 - 1) / 16 = 249 windows in an epoch.
    let data = common::write_synthetic_shard(dir.path(), 97, 4000);
    let ck = dir.path().join("ck");
    let (a, b): (Shape, Shape) = ((2, 3, 2), (1, 2, 3)); // 12 rows a step, then 6
    let first = run(&cfg(a, 60, &ck, ""), a, &data, None, 5, true);
    assert_eq!(first.windows.len(), 60);
    let saved = CheckpointReader::open(&step_dir(&ck, 5), false).expect("open").manifest;
    let pos = saved.data.expect("the loader's position is in the manifest");
    assert_eq!((pos.rows, pos.sources[0].rows, pos.sources[0].windows), (60, 60, 249));
    // The rest of the epoch (and a little of the next) on 3 ranks with another batch shape.
    let rest = run(&cfg(b, 60, &ck, ""), b, &data, Some(step_dir(&ck, 5)), 5 + 33, false);
    let all: Vec<_> = first.windows.iter().chain(&rest.windows).copied().collect();
    assert_eq!(all.len(), 60 + 33 * 6);
    assert!(all[..249].iter().all(|w| w.epoch == 0) && all[249..].iter().all(|w| w.epoch == 1));
    let mut count: HashMap<(usize, usize), usize> = HashMap::new();
    for w in &all[..249] {
        *count.entry((w.shard, w.start)).or_default() += 1;
    }
    assert_eq!(count.len(), 249, "every window of the epoch");
    assert!(count.values().all(|&n| n == 1), "each exactly once");
    assert!(count.keys().all(|&(s, start)| s == 0 && start % 16 == 0 && start + 17 <= 4000));

    // The same rows in the same order as a run never interrupted (on yet another layout).
    let c: Shape = (3, 1, 2);
    let whole = run(&cfg(c, 60, &ck, ""), c, &data, None, 43, false);
    assert_eq!(whole.windows[..all.len()], all[..], "interrupted + resumed = uninterrupted, row by row");
}

#[test]
fn an_interrupted_run_sees_the_same_tokens_and_losses_bit_for_bit() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = common::write_synthetic_shard(dir.path(), 97, 3000);
    let ck = dir.path().join("ck");
    let s: Shape = (2, 2, 2); // 8 rows a step; 187 windows: the run crosses into epoch 2
    let c = cfg(s, 30, &ck, "");
    let full = run(&c, s, &data, None, 30, false);
    let first = run(&c, s, &data, None, 13, true);
    let rest = run(&c, s, &data, Some(step_dir(&ck, 13)), 30, false);
    let losses: Vec<f64> = first.losses.iter().chain(&rest.losses).copied().collect();
    assert_eq!(losses, full.losses, "bit-equal losses");
    let windows: Vec<_> = first.windows.iter().chain(&rest.windows).copied().collect();
    assert_eq!(windows, full.windows);
    assert_eq!(full.windows.last().map(|w| w.epoch), Some(1));
}

/// Two sources in `dir/big` and `dir/small`, with validation splits.
fn two_sources(dir: &Path) {
    for (name, n) in [("big", 6000), ("small", 200)] {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).expect("mkdir");
        let shard = common::write_synthetic_shard(&d, 97, n);
        std::fs::copy(&shard, d.join("synthetic_val_000000.bin")).expect("val");
    }
}

const MIX: &str =
    "\n[data]\n[[data.sources]]\npath = \"big\"\nweight = 3\n[[data.sources]]\npath = \"small\"\nname = \"tiny\"\n";

#[test]
fn mixed_sources_hold_their_weights_repeat_the_small_one_and_resume_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    two_sources(dir.path());
    let ck = dir.path().join("ck");
    let s: Shape = (2, 1, 2); // 4 rows a step
    let mut c = cfg(s, 20, &ck, MIX);
    c.train.eval_every = 10;
    let full = run(&c, s, dir.path(), None, 20, false);
    let last = full.sources.last().expect("metrics");
    assert_eq!(last.iter().map(|m| (m.name.as_str(), m.rows)).collect::<Vec<_>>(), [("big", 60), ("tiny", 20)]);
    // "small" holds 199 / 16 = 12 windows: its 20 rows are 1.67 epochs (it repeats).
    assert!((last[1].epochs - 20.0 / 12.0).abs() < 1e-12, "{}", last[1].epochs);
    let tiny: Vec<_> = full.windows.iter().filter(|w| w.source == 1).collect();
    assert_eq!(tiny.iter().filter(|w| w.epoch == 0).count(), 12, "its first epoch whole, then the second");
    assert!(last.iter().all(|m| m.val_loss.is_some_and(f64::is_finite)), "a val loss per source");
    for (step, metrics) in full.sources.iter().enumerate() {
        let rows = 4.0 * (step + 1) as f64;
        for (m, w) in metrics.iter().zip([0.75, 0.25]) {
            assert!((m.rows as f64 - rows * w).abs() < 1.0, "step {}: {} has {} rows", step + 1, m.name, m.rows);
        }
    }
    // Resumed on 1 rank with 2 micro-steps of 2: the same rows, so the same losses.
    let first = run(&c, s, dir.path(), None, 7, true);
    let one: Shape = (2, 2, 1);
    let c1 = cfg(one, 20, &ck, MIX);
    let rest = run(&c1, one, dir.path(), Some(step_dir(&ck, 7)), 20, false);
    let windows: Vec<_> = first.windows.iter().chain(&rest.windows).copied().collect();
    assert_eq!(windows, full.windows, "mixture rows continue exactly");
    let pos = CheckpointReader::open(&step_dir(&ck, 7), false).expect("open").manifest.data.expect("position");
    assert_eq!(pos.sources.iter().map(|s| (s.name.as_str(), s.rows)).collect::<Vec<_>>(), [("big", 21), ("tiny", 7)]);

    // Another weight: refused, naming it; allowed with data.allow_changed_data.
    let changed = MIX.replace("weight = 3", "weight = 2");
    let c2 = cfg(s, 20, &ck, &changed);
    let err = common::run_ranks(1, {
        let (c2, root, at) = (c2.clone(), dir.path().to_path_buf(), step_dir(&ck, 7));
        move |rank, mut comm| {
            let be = CpuBackend::new();
            let mut tr = Trainer::new(&c2, &be, rank, 1, &root).expect("trainer");
            tr.resume(&be, &mut comm, &at).expect_err("refused").to_string()
        }
    })
    .remove(0);
    assert!(err.contains("source \"big\"'s weight was 3, is 2") && err.contains("allow_changed_data"), "{err}");
    let mut c3 = c2.clone();
    c3.data.allow_changed_data = true;
    let went_on = run(&c3, s, dir.path(), Some(step_dir(&ck, 7)), 8, false);
    assert_eq!(went_on.losses.len(), 1);
}

#[test]
fn bad_mixtures_are_refused_with_clear_errors() {
    let dir = tempfile::tempdir().expect("tmp");
    two_sources(dir.path());
    let ck = dir.path().join("ck");
    let s: Shape = (2, 1, 1);
    let cfg_err = |extra: &str| {
        let text = common::tiny_toml(1, 1, "\"none\"") + extra;
        Config::from_toml_str(&text, "t").and_then(|c| c.validate().map(|()| c)).expect_err("refused").to_string()
    };
    for w in ["0", "-1", "nan"] {
        let e = cfg_err(&MIX.replace("weight = 3", &format!("weight = {w}")));
        assert!(e.contains("data.sources") && e.contains("\"big\"") && e.contains("positive finite"), "{w}: {e}");
    }
    let e = cfg_err(&MIX.replace("[data]\n", "[data]\npath = \"x\"\n"));
    assert!(e.contains("cannot be given with data.path"), "{e}");
    let e = cfg_err(&MIX.replace("name = \"tiny\"\n", "name = \"big\"\n"));
    assert!(e.contains("two sources named \"big\""), "{e}");

    let trainer_err = |c: Config| {
        let root = dir.path().to_path_buf();
        common::run_ranks(1, move |rank, _comm| {
            Trainer::new(&c, &CpuBackend::new(), rank, 1, &root).err().map(|e| e.to_string()).expect("refused")
        })
        .remove(0)
    };
    let e = trainer_err(cfg(s, 4, &ck, &MIX.replace("path = \"small\"", "path = \"missing\"")));
    assert!(e.contains("data source \"tiny\"") && e.contains("missing") && e.contains("does not exist"), "{e}");
    // One epoch of the data smaller than one step's rows: refused with the numbers.
    let e = trainer_err(cfg((2, 400, 1), 4, &ck, MIX));
    assert!(e.contains("800 rows") && e.contains("windows") && e.contains("train.grad_accum 400"), "{e}");
    // A source of ids beyond model.vocab_size: refused naming the source and the id.
    let wide = dir.path().join("wide");
    std::fs::create_dir_all(&wide).expect("mkdir");
    common::write_synthetic_shard(&wide, 200, 3000);
    let e = trainer_err(cfg(s, 4, &ck, &MIX.replace("path = \"small\"", "path = \"wide\"")));
    assert!(e.contains("data source \"tiny\"") && e.contains("model.vocab_size"), "{e}");
}

/// `data.document_mask` with a mixture: rows of both sources are masked with the sources'
/// one end-of-text id (the losses leave the unmasked run's, on the very same rows), and so
/// is each source's validation loss; a source whose id is unknown, or sources that begin
/// documents with different ids, are refused naming them.
#[test]
fn document_mask_holds_for_every_source_of_a_mixture() {
    let dir = tempfile::tempdir().expect("tmp");
    for (name, n) in [("big", 6000), ("small", 400)] {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).expect("mkdir");
        // Documents of 24 tokens, each begun by the recorded end-of-text id 96.
        common::write_synthetic_documents(&d, 97, n, "train");
        common::write_synthetic_documents(&d, 97, n, "val");
    }
    let ck = dir.path().join("ck");
    let s: Shape = (2, 1, 2);
    let masked = MIX.replace("[data]\n", "[data]\ndocument_mask = true\n");
    let (mut on, mut off) = (cfg(s, 6, &ck, &masked), cfg(s, 6, &ck, MIX));
    on.train.eval_every = 3;
    off.train.eval_every = 3;
    assert!(on.data.document_mask && !off.data.document_mask && on.data.sources.len() == 2);
    let (a, b) = (run(&on, s, dir.path(), None, 6, false), run(&off, s, dir.path(), None, 6, false));
    assert_eq!(a.windows, b.windows, "the mask does not change which rows are trained on");
    assert!(a.windows.iter().any(|w| w.source == 1), "rows of both sources");
    // Step 1 sees the same weights and rows: only the mask can move its loss.
    assert_ne!(a.losses[0], b.losses[0], "the mask reached the model");
    assert!(a.losses.iter().all(|l| l.is_finite()));
    for (m_on, m_off) in a.sources[2].iter().zip(&b.sources[2]) {
        let (x, y) = (m_on.val_loss.expect("evaluated"), m_off.val_loss.expect("evaluated"));
        assert!(x.is_finite() && x != y, "{}: masked val loss {x} vs unmasked {y}", m_on.name);
    }

    let trainer_err = |c: Config| {
        let root = dir.path().to_path_buf();
        common::run_ranks(1, move |rank, _comm| {
            Trainer::new(&c, &CpuBackend::new(), rank, 1, &root).err().map(|e| e.to_string()).expect("refused")
        })
        .remove(0)
    };
    // Shards without a tokenizer record beside recorded ones.
    let legacy = dir.path().join("legacy");
    std::fs::create_dir_all(&legacy).expect("mkdir");
    common::write_synthetic_shard(&legacy, 97, 3000);
    let mixed = masked.replace("path = \"small\"", "path = \"legacy\"");
    // Its id unknown for a vocabulary that is not GPT-2's.
    let e = trainer_err(cfg(s, 4, &ck, &mixed));
    assert!(e.contains("data source \"tiny\"") && e.contains("no tokenizer record"), "{e}");
    // With GPT-2's vocabulary it would be 50256, but the other source's documents begin with 96.
    let mut gpt2 = cfg(s, 4, &ck, &mixed);
    gpt2.model.vocab_size = 50304;
    let e = trainer_err(gpt2);
    assert!(e.contains("\"big\" begins its documents with 96 and \"tiny\" with 50256"), "{e}");
}
