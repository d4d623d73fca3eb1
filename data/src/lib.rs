//! Token data for shardtrain: llm.c token shards of `u16` or `u32` ids (writer and
//! validating mmap reader, [`Ids`] to read either width, document indexes beside them),
//! datasets of shards split into train/val, the training loader (epochs without
//! replacement, weighted mixtures, a position that is a row count: `epoch.rs`,
//! `mixture.rs`, `sampler.rs`), the preparation of text, JSON-lines and Parquet inputs with GPT-2's BPE or
//! any Hugging Face `tokenizer.json` (with a record of every source in `dataset.json`),
//! and a built-in synthetic corpus that needs no download.
//!
//! Preparation, by file: `inputs.rs` (what INPUT arguments name), `documents.rs` and
//! `parquet_text.rs` (files into documents, bad records named), `tokenizer.rs`,
//! `prepare.rs` (the streaming, parallel pipeline and its split), `writer.rs` (shards of
//! a split), `docindex.rs` (the `.idx` sidecar), `doc_starts.rs` (where documents start
//! inside a training window, for `data.document_mask`), `sources.rs` (`dataset.json`), `text.rs`
//! (one string of GPT-2 text: the built-in corpus).
//!
//! Determinism is a project rule: all randomness comes from the hand-written SplitMix64
//! in [`rng`], never from the `rand` crate, so sampled batches and the built-in corpus
//! never change across crate versions or machines.

pub mod builtin;
pub mod dataset;
pub mod doc_starts;
pub mod docindex;
pub mod documents;
pub mod epoch;
pub mod error;
pub mod header;
pub mod ids;
pub mod inputs;
pub mod mixture;
mod parquet_text;
pub mod prepare;
pub mod rng;
pub mod sampler;
pub mod shard;
pub mod sources;
pub mod text;
pub mod tokenizer;
pub mod writer;

pub use builtin::{ensure_builtin_dataset, generate_corpus};
pub use dataset::{Dataset, Split, ValBatch, ValBatches};
pub use doc_starts::doc_starts_from_eot;
pub use documents::{BadKind, TxtDocs};
pub use error::DataError;
pub use ids::{Ids, Width};
pub use prepare::{prepare, Existing, OnBad, PrepareOptions, PrepareProgress, PrepareSummary};
pub use sampler::{BatchSampler, LoaderState, Source, SourceState, WindowRef};
pub use shard::{write_shard, write_shard_ids, ShardInfo, TokenShard};
pub use text::ValSplit;
pub use tokenizer::{Tokenizer, TokenizerSpec, TokenizerStamp};

/// GPT-2's end-of-text token, placed between documents.
pub const EOT_TOKEN: u16 = 50256;
/// Size of the GPT-2 BPE vocabulary (token ids are `0..GPT2_VOCAB`).
pub const GPT2_VOCAB: usize = 50257;
