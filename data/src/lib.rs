//! Token data for shardtrain: llm.c token shards (writer and validating mmap reader),
//! datasets of shards split into train/val, deterministic world-size-invariant batch
//! sampling, GPT-2 BPE preparation of text (with a record of every source text in
//! `dataset.json`), and a built-in synthetic corpus that needs no download.
//!
//! Determinism is a project rule: all randomness comes from the hand-written SplitMix64
//! in [`rng`], never from the `rand` crate, so sampled batches and the built-in corpus
//! never change across crate versions or machines.

pub mod builtin;
pub mod dataset;
pub mod error;
pub mod prepare;
pub mod rng;
pub mod sampler;
pub mod shard;
pub mod sources;

pub use builtin::{ensure_builtin_dataset, generate_corpus};
pub use dataset::{Dataset, Split, ValBatch, ValBatches};
pub use error::DataError;
pub use prepare::{prepare_text, Existing, PrepareSummary, ValSplit};
pub use sampler::BatchSampler;
pub use shard::{write_shard, TokenShard};

/// GPT-2's end-of-text token, placed between documents.
pub const EOT_TOKEN: u16 = 50256;
/// Size of the GPT-2 BPE vocabulary (token ids are `0..GPT2_VOCAB`).
pub const GPT2_VOCAB: usize = 50257;
