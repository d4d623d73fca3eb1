//! The llm.c token-shard header's numbers: magic, version and size of each layout (the
//! layouts themselves are described in `shard.rs`). A leaf: the shard reader and writer
//! and the error messages that quote them both import it.

/// Header magic number of an llm.c shard of `u16` ids (GPT-2).
pub const MAGIC: i32 = 20240520;
/// Header version of `u16` shards.
pub const VERSION: i32 = 1;
/// Header magic number of an llm.c shard of `u32` ids (Llama 3).
pub const MAGIC_U32: i32 = 20240801;
/// Header version of `u32` shards.
pub const VERSION_U32: i32 = 7;
/// Number of `i32` in the header.
pub const HEADER_INTS: usize = 256;
/// Header size in bytes (1024: keeps the payload aligned for `u16` and `u32`).
pub const HEADER_BYTES: usize = HEADER_INTS * 4;
