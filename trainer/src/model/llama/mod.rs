//! The Llama family (Llama 2/3/3.1/3.2 and models of the same shape): everything
//! Llama-specific lives here — the parameter layout, its initialisation rule and the
//! config checks (`layout.rs`), the block forward/backward and the activations
//! (`model.rs`), and the Hugging Face names (`hf.rs`). Its ops (RMSNorm, SwiGLU, RoPE,
//! grouped-query attention) are in the backend's op groups; what every decoder shares
//! (units, the schedule, the chunked LM head) is in `model/`.

pub mod hf;
pub mod layout;
pub mod model;

pub use hf::LlamaHf;
pub use layout::{BlockLocs, LlamaLocs};
pub use model::Llama;
