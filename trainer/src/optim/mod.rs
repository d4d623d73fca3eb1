//! Optimisation schedule. The AdamW update itself is a backend op (`backend::*::adamw`)
//! applied by the ZeRO engine to the shard each rank owns.

pub mod schedule;
pub use schedule::lr_at;
