//! The GPT-2 family: everything GPT-2-specific lives here — the parameter layout
//! (`layout.rs`, with its initialisation rule), the block forward/backward and the
//! activations (`model.rs`), and the Hugging Face names and layouts (`hf.rs`). What every
//! decoder shares (units, the gather/release schedule) is in `model/`.

pub mod hf;
pub mod layout;
pub mod model;

pub use hf::Gpt2Hf;
pub use layout::{BlockLocs, EmbedUnitLocs, Gpt2Locs};
pub use model::Gpt2;
