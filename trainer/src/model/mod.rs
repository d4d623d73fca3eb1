//! The GPT-2 model: parameter layout (flat buffers per block), initialisation,
//! and forward/backward written once over the [`Backend`](crate::backend::Backend) trait.

pub mod gpt;
pub mod init;
pub mod layout;

pub use gpt::Gpt;
pub use layout::{BlockLocs, EmbedLocs, ModelLayout, TensorSpec, UnitLayout};
