//! Hugging Face interop: a sharded checkpoint exported as a folder that transformers'
//! `from_pretrained` loads as it is, and such a folder (or one safetensors file) imported as
//! initial weights (`train.init_from`). The names, layouts and `config.json` per model family are
//! its [`HfFormat`](crate::model::HfFormat) (GPT-2: `model/gpt2/hf.rs`); this module knows
//! the folder:
//! - `config.json` — the family's transformers config;
//! - `model.safetensors` — every tensor, float32; or, above the shard size (5 GB, as
//!   `save_pretrained`), `model-00001-of-0000N.safetensors`, ... and
//!   `model.safetensors.index.json` (`metadata.total_size`, `weight_map`: tensor → file).
//!
//! `export.rs` writes it (streaming tensor by tensor, atomically); `import.rs` reads it,
//! float32, bfloat16 and float16 alike.

mod export;
mod import;

pub use export::{export, ExportSummary, DEFAULT_MAX_SHARD_BYTES};
pub use import::HfWeights;

/// The transformers config of the folder.
pub const CONFIG_FILE: &str = "config.json";
/// The weights of an unsharded folder.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded folder.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The name of shard `i` (from 1) of `n`, as `save_pretrained` names them.
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{i:05}-of-{n:05}.safetensors")
}
