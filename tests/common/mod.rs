//! Helpers shared by the integration tests: tiny configs and synthetic token shards.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A deliberately awkward tiny GPT: vocab 97, n_embd 36 and head size 12 divide by no
/// world size we test, so every unit needs padding and shards are uneven.
/// `tiny_toml`'s `activations` for every block checkpointed with its attention kept.
pub const KEEP_ATTENTION: &str = "\"every_layer\"\nkeep_attention = true";
/// No block checkpointed, each keeping its GELU output (`checkpointing.keep_gelu`).
pub const KEEP_GELU: &str = "\"none\"\nkeep_gelu = true";

pub fn tiny_toml(stage: u8, world_accum: usize, activations: &str) -> String {
    format!(
        r#"
[model]
n_layer = 2
n_head = 3
n_embd = 36
vocab_size = 97
seq_len = 16

[train]
micro_batch = 2
grad_accum = {world_accum}
steps = 4
lr = 3e-3
min_lr = 3e-4
warmup_steps = 1
weight_decay = 0.1
grad_clip = 0.05
seed = 42

[zero]
stage = {stage}

[checkpointing]
activations = {activations}
"#
    )
}

/// [`tiny_toml`] as a tiny Llama: grouped-query attention (4 query heads, 2 key/value heads
/// of 8), RoPE with Llama 3.1 scaling, an MLP of 40, the head tied to the embedding or not.
pub fn tiny_llama_toml(stage: u8, world_accum: usize, activations: &str, tied: bool) -> String {
    tiny_toml(stage, world_accum, activations).replace(
        "[model]\nn_layer = 2\nn_head = 3\nn_embd = 36\n",
        &format!(
            "[model]\nfamily = \"llama\"\nn_layer = 2\nn_head = 4\nn_kv_head = 2\nn_embd = 32\nintermediate_size = 40\n\
             rope_theta = 500.0\nrms_norm_eps = 1e-5\ntie_embeddings = {tied}\n\
             rope_scaling = {{ factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, \
             original_max_position_embeddings = 8 }}\n"
        ),
    )
}

/// Write a learnable synthetic token shard (noisy arithmetic progressions mod `vocab`).
pub fn write_synthetic_shard(dir: &Path, vocab: u32, n_tokens: usize) -> PathBuf {
    let mut toks = Vec::with_capacity(n_tokens);
    let mut state = 12345u64;
    let mut cur = 0u32;
    let mut stride = 1u32;
    for i in 0..n_tokens {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        if i % 24 == 0 {
            stride = 1 + ((state >> 33) as u32 % 5);
            cur = (state >> 40) as u32 % vocab;
        }
        let noise = (state >> 60) == 0;
        cur = (cur + stride) % vocab;
        toks.push(if noise { ((state >> 20) as u32 % vocab) as u16 } else { cur as u16 });
    }
    let path = dir.join("synthetic_train_000000.bin");
    data::write_shard(&path, &toks).expect("write shard");
    path
}

/// [`write_synthetic_shard`]'s progressions as documents: each run of 24 tokens begins
/// with the end-of-text id `eot` (outside `0..vocab - 1`'s progressions: `vocab - 1`), in
/// a shard whose header records the tokenizer (`vocab`, `eot`), as `prepare-data` writes
/// them, so `data.document_mask` knows where documents start. `split`: `train` or `val`.
pub fn write_synthetic_documents(dir: &Path, vocab: u32, n_tokens: usize, split: &str) -> PathBuf {
    let eot = vocab - 1;
    let mut toks = Vec::with_capacity(n_tokens);
    let mut state = 12345u64;
    let (mut cur, mut stride) = (0u32, 1u32);
    for i in 0..n_tokens {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        if i % 24 == 0 {
            stride = 1 + ((state >> 33) as u32 % 5);
            cur = (state >> 40) as u32 % eot;
            toks.push(eot as u16);
            continue;
        }
        cur = (cur + stride) % eot;
        toks.push(cur as u16);
    }
    let info = data::ShardInfo {
        vocab_size: vocab,
        eot_id: eot,
        max_id: toks.iter().max().map(|&m| m as u32),
        fingerprint: 0x5eed,
        tokenizer: "synthetic".into(),
    };
    let path = dir.join(format!("synthetic_{split}_000000.bin"));
    data::write_shard_ids(&path, data::Ids::U16(&toks), Some(&info), None).expect("write shard");
    path
}

/// Run `world` CPU ranks as threads over a loopback TCP group; `f(rank, comm)` is one
/// rank's work. Returns every rank's result, in rank order.
pub fn run_ranks<T, F>(world: usize, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize, trainer::backend::cpu::HostComm<collectives::tcp::TcpComm>) -> T + Send + Sync + 'static,
{
    let f = std::sync::Arc::new(f);
    let comms = collectives::tcp::TcpComm::local_group(world).expect("local group");
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, c)| {
            let f = f.clone();
            std::thread::spawn(move || f(rank, trainer::backend::cpu::HostComm(c)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}
