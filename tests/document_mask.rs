//! `data.document_mask` on the CPU reference, through the real engine and models:
//!
//! - packed documents equal each document alone: rows holding documents d1|d2|d3 (each
//!   beginning with the end-of-text token, as `prepare-data` writes them, the starts made
//!   from the inputs as the trainer makes them) give every token the loss it gets when its
//!   document is the whole sequence (a model of `seq_len` = the document's length, the same
//!   weights: GPT-2's position table cut to its first rows), and the gradient of the packed
//!   batch is the sum of the documents' gradients — for GPT-2 (learned positions) and Llama
//!   (RoPE, grouped-query attention), with and without activation checkpointing;
//! - starts all 0 (no end-of-text in the batch: one document per sequence) give the bits of
//!   `document_mask = false`;
//! - where documents start is refused rather than guessed for shards without a tokenizer
//!   record unless the model has GPT-2's vocabulary.
//!
//! Tolerances: the token losses agree bit for bit (every row's arithmetic is the same, in
//! the same order); the gradients within 1e-6 of the largest element of their unit (the sum
//! over documents is taken in another order than the packed backward's; measured: at most
//! 1.7e-7 of it).

mod common;

use collectives::tcp::TcpComm;
use std::ops::Range;
use trainer::backend::cpu::{CpuBackend, HostComm};
use trainer::backend::{doc_starts, RopeScaling};
use trainer::config::{ActivationCheckpointing, CheckpointingConfig, KeepGelu, ModelConfig};
use trainer::documents::DocumentMask;
use trainer::model::{step_micro, MicroBatch, ModelFamily, ModelLayout, ModelOptions};
use trainer::zero::{Engine, EngineOptions};
use trainer::Config;

const VOCAB: usize = 23;
/// The end-of-text id that begins every document.
const EOT: u32 = 22;
/// Gradient agreement, relative to the largest element of the unit's gradient.
const GRAD_RTOL: f32 = 1e-6;

/// A tiny GPT-2 with sequences of `t`.
fn gpt2(t: usize) -> ModelConfig {
    ModelConfig::gpt2(2, 2, 8, VOCAB, t)
}

/// A tiny Llama with sequences of `t`: grouped-query attention (4 heads of 4, 2 key/value
/// heads), RoPE with Llama 3.1 scaling, untied head.
fn llama(t: usize) -> ModelConfig {
    ModelConfig {
        family: ModelFamily::Llama,
        n_kv_head: Some(2),
        intermediate_size: Some(12),
        rope_theta: Some(500.0),
        rope_scaling: Some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8,
        }),
        rms_norm_eps: Some(1e-5),
        tie_embeddings: Some(false),
        ..ModelConfig::gpt2(2, 4, 16, VOCAB, t)
    }
}

/// Every unit's initial values for `cfg` (seed 7), whole.
fn initial_params(cfg: &ModelConfig) -> Vec<Vec<f32>> {
    let layout = ModelLayout::new(cfg);
    (0..layout.units.len())
        .map(|u| cfg.family.init_range(&layout, u, 7, Default::default(), 0..layout.units[u].numel))
        .collect()
}

/// `values` laid out for `from` (parameters or gradients, per unit), tensor by tensor into
/// `to`'s layout: each tensor's first elements, as many as the smaller of the two holds, the
/// rest zero. GPT-2's position table is the one tensor whose size differs: the packed model's
/// has a row per position of the sequence, a document's alone one per position of the document.
fn refit(values: &[Vec<f32>], from: &ModelLayout, to: &ModelLayout) -> Vec<Vec<f32>> {
    to.units
        .iter()
        .zip(&from.units)
        .zip(values)
        .map(|((tu, fu), v)| {
            let mut out = vec![0.0; tu.numel];
            for t in &tu.tensors {
                let f = fu.tensors.iter().find(|f| f.name == t.name).expect("the same tensors");
                let n = t.loc.len.min(f.loc.len);
                out[t.loc.off..t.loc.off + n].copy_from_slice(&v[f.loc.off..f.loc.off + n]);
            }
            out
        })
        .collect()
}

/// One training micro-step of a model of `cfg` holding `params`: every token's loss and
/// every unit's gradient (each token's loss scaled by `dloss`).
fn step(
    cfg: &ModelConfig,
    params: &[Vec<f32>],
    opts: &ModelOptions,
    batch: &MicroBatch<'_>,
    dloss: f32,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let be = CpuBackend::new();
    let mut comm = HostComm(TcpComm::local_group(1).expect("group").remove(0));
    let layout = ModelLayout::new(cfg);
    let mut init = |u: usize, r: Range<usize>| Ok(r.map(|i| params[u].get(i).copied().unwrap_or(0.0)).collect());
    let mut eng = Engine::new(&be, layout.clone(), EngineOptions::stage(0), 0, 1, Some(&mut init)).expect("engine");
    let mut model = cfg.family.build(&be, &layout, opts, &mut eng.ledger).expect("model");
    eng.begin_step(&be).expect("begin");
    step_micro(model.as_mut(), &be, &mut eng, &mut comm, batch, Some(dloss)).expect("micro-step");
    let losses = model.token_losses(&be).expect("losses");
    let grads = (0..eng.num_units()).map(|u| eng.local_grads_host(&be, u).expect("grads")).collect();
    (losses, grads)
}

/// `n` pseudo-random ids below `EOT` (never the end-of-text token).
fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)) >> 7) % EOT).collect()
}

/// Rows of `t` tokens packed with documents of `lengths`, each beginning with the
/// end-of-text id; the targets are the next tokens of the stream (a document's last token
/// predicts the next document's end-of-text), the last one a plain id.
fn packed(lengths: &[usize]) -> (Vec<u32>, Vec<u32>) {
    let mut stream = Vec::new();
    for (k, &l) in lengths.iter().enumerate() {
        stream.push(EOT);
        stream.extend(ids(l - 1, k as u32 + 1));
    }
    stream.push(3);
    (stream[..stream.len() - 1].to_vec(), stream[1..].to_vec())
}

fn checkpointing(activations: ActivationCheckpointing, keep_attention: bool) -> CheckpointingConfig {
    CheckpointingConfig { activations, keep_attention, keep_gelu: KeepGelu::Recompute }
}

/// Two sequences of 16: documents of 5, 7 and 4 tokens, then 9 and 7.
fn packed_documents_equal_each_document_alone(name: &str, model: fn(usize) -> ModelConfig) {
    let (t, b) = (16usize, 2usize);
    let lengths = [5usize, 7, 4, 9, 7];
    let (inputs, targets) = packed(&lengths);
    let n = b * t;
    assert_eq!(inputs.len(), n);
    let mut mask = DocumentMask::new(Some(EOT), t);
    let batch = mask.batch(&inputs, &targets);
    assert_eq!(batch.docs, Some(&doc_starts(&lengths, t, n)[..]), "the starts made from the end-of-text inputs");
    let cfg = model(t);
    let (layout, params) = (ModelLayout::new(&cfg), initial_params(&cfg));
    let dloss = 1.0 / n as f32;

    let opts = |ckpt| ModelOptions { document_mask: true, checkpointing: ckpt, ..ModelOptions::batch(b) };
    let plain = CheckpointingConfig::default();
    let (losses, grads) = step(&cfg, &params, &opts(plain.clone()), &batch, dloss);
    // Checkpointed blocks recompute their forward (attention within documents included,
    // or kept): the same bits.
    for (act, keep) in [(ActivationCheckpointing::EveryLayer, false), (ActivationCheckpointing::EveryLayer, true)] {
        let again = step(&cfg, &params, &opts(checkpointing(act, keep)), &batch, dloss);
        assert_eq!(again, (losses.clone(), grads.clone()), "{name}: checkpointing {act:?} keep_attention {keep}");
    }

    // Each document alone: a model whose sequences are the document, the same weights.
    let mut summed: Vec<Vec<f32>> = grads.iter().map(|g| vec![0.0; g.len()]).collect();
    let mut row = 0;
    for &l in &lengths {
        let alone_cfg = model(l);
        let alone_layout = ModelLayout::new(&alone_cfg);
        let alone_params = refit(&params, &layout, &alone_layout);
        let rows = row..row + l;
        let one = MicroBatch::plain(&inputs[rows.clone()], &targets[rows.clone()]);
        let (l_alone, g_alone) = step(&alone_cfg, &alone_params, &ModelOptions::batch(1), &one, dloss);
        assert_eq!(&losses[rows.clone()], &l_alone[..], "{name}: token losses of the document at rows {rows:?}");
        for (s, g) in summed.iter_mut().zip(refit(&g_alone, &alone_layout, &layout)) {
            for (a, x) in s.iter_mut().zip(g) {
                *a += x;
            }
        }
        row += l;
    }
    for (u, (got, want)) in grads.iter().zip(&summed).enumerate() {
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.0, "{name}: unit {u} has no gradient");
        let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        eprintln!("{name}: unit {u}: max |packed - sum of documents| = {worst:e} (largest element {scale:e})");
        assert!(worst <= GRAD_RTOL * scale, "{name}: unit {u}: gradient off by {worst:e} of {scale:e}");
    }

    // The mask matters: without it the later documents see the earlier ones.
    let unmasked = step(&cfg, &params, &ModelOptions::batch(b), &MicroBatch::plain(&inputs, &targets), dloss);
    assert_eq!(unmasked.0[..5], losses[..5], "{name}: the first document sees nothing before it either way");
    assert_ne!(unmasked.0[5..12], losses[5..12], "{name}: the second document must not see the first");
}

#[test]
fn gpt2_packed_documents_equal_each_document_alone() {
    packed_documents_equal_each_document_alone("gpt2", gpt2);
}

#[test]
fn llama_packed_documents_equal_each_document_alone() {
    packed_documents_equal_each_document_alone("llama", llama);
}

/// No end-of-text in the batch: starts all 0, one document per sequence, the bits of a
/// model without the mask (also with every block checkpointed).
#[test]
fn one_document_per_sequence_is_the_unmasked_model() {
    let (t, b) = (16usize, 2usize);
    let (inputs, targets) = (ids(b * t, 11), ids(b * t, 12));
    for (name, cfg) in [("gpt2", gpt2(t)), ("llama", llama(t))] {
        let params = initial_params(&cfg);
        let mut mask = DocumentMask::new(Some(EOT), t);
        let batch = mask.batch(&inputs, &targets);
        assert!(batch.docs.expect("masking on").iter().all(|&d| d == 0));
        for ckpt in [CheckpointingConfig::default(), checkpointing(ActivationCheckpointing::EveryLayer, false)] {
            let on = ModelOptions { document_mask: true, checkpointing: ckpt.clone(), ..ModelOptions::batch(b) };
            let off = ModelOptions { checkpointing: ckpt.clone(), ..ModelOptions::batch(b) };
            let dloss = 1.0 / (b * t) as f32;
            let masked = step(&cfg, &params, &on, &batch, dloss);
            let plain = step(&cfg, &params, &off, &MicroBatch::plain(&inputs, &targets), dloss);
            assert_eq!(masked, plain, "{name} {:?}: starts all 0 vs document_mask = false", ckpt.activations);
        }
    }
}

/// A model built with the mask needs the starts; one built without refuses them.
#[test]
fn a_batch_without_starts_is_refused_by_a_masking_model() {
    let cfg = gpt2(8);
    let params = initial_params(&cfg);
    let be = CpuBackend::new();
    let layout = ModelLayout::new(&cfg);
    let mut init = |u: usize, r: Range<usize>| Ok(r.map(|i| params[u].get(i).copied().unwrap_or(0.0)).collect());
    let mut eng = Engine::new(&be, layout.clone(), EngineOptions::stage(0), 0, 1, Some(&mut init)).expect("engine");
    let opts = ModelOptions { document_mask: true, ..ModelOptions::batch(1) };
    let mut model = cfg.family.build(&be, &layout, &opts, &mut eng.ledger).expect("model");
    let x = ids(8, 1);
    let e = model.load_batch(&be, &MicroBatch::plain(&x, &x)).unwrap_err().to_string();
    assert!(e.contains("with document masking") && e.contains("has no document starts"), "{e}");
}

/// Shards without a tokenizer record: GPT-2's end-of-text only for a GPT-2 vocabulary;
/// otherwise the run is refused, naming the key and the fix. Shards with a record use its
/// end-of-text id.
#[test]
fn the_end_of_text_id_comes_from_the_shards_or_is_refused() {
    use trainer::documents::end_of_text;
    let dir = tempfile::tempdir().expect("tempdir");
    let legacy = dir.path().join("legacy");
    std::fs::create_dir(&legacy).expect("dir");
    common::write_synthetic_shard(&legacy, 97, 2_000);
    let recorded = dir.path().join("recorded");
    std::fs::create_dir(&recorded).expect("dir");
    common::write_synthetic_documents(&recorded, 97, 2_000, "train");
    let cfg = |vocab: usize, mask: bool| {
        let mut c = Config::from_toml_str(&common::tiny_toml(0, 1, "\"none\""), "t").expect("cfg");
        c.model.vocab_size = vocab;
        c.data.document_mask = mask;
        c
    };
    let open = |p: &std::path::Path| data::Dataset::open(p, data::Split::Train).expect("dataset");
    assert_eq!(end_of_text(&cfg(97, false), &open(&legacy), &legacy).expect("off"), None);
    assert_eq!(end_of_text(&cfg(50304, true), &open(&legacy), &legacy).expect("gpt2"), Some(50256));
    assert_eq!(end_of_text(&cfg(97, true), &open(&recorded), &recorded).expect("recorded"), Some(96));
    let e = end_of_text(&cfg(97, true), &open(&legacy), &legacy).unwrap_err().to_string();
    assert!(e.contains("data.document_mask") && e.contains("no tokenizer record") && e.contains("prepare-data"), "{e}");
    // The trainer refuses it before building anything.
    let e = trainer::train::Trainer::new(&cfg(97, true), &CpuBackend::new(), 0, 1, &legacy).err().expect("refused");
    assert!(e.to_string().contains("model.vocab_size = 97 is not GPT-2's"), "{e}");
}
