//! The one error type of the `data` crate.
//!
//! Every message names the file or argument at fault and, where there is one, the
//! fix (usually: re-create the shards with `launcher prepare-data`).

use std::path::PathBuf;

use crate::header::{HEADER_BYTES, MAGIC, MAGIC_U32};

/// Everything that can go wrong reading, writing, sampling or preparing token data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An I/O operation on `path` failed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. "open", "write", "rename to its final name".
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file cannot even hold the 1024-byte header.
    #[error(
        "{} is {len} bytes, shorter than the {HEADER_BYTES}-byte llm.c shard header: the file is truncated or \
         is not a token shard; re-create it with `launcher prepare-data`",
        path.display()
    )]
    ShortHeader { path: PathBuf, len: u64 },

    /// The header's first int is not the llm.c magic number.
    #[error(
        "{} is not an llm.c token shard: its header magic is {found}, expected {MAGIC} (u16 ids) or {MAGIC_U32} \
         (u32 ids); point the data path at `.bin` shards written by llm.c or by `launcher prepare-data`",
        path.display()
    )]
    BadMagic { path: PathBuf, found: i32 },

    /// The header's version does not go with its magic.
    #[error(
        "{} has llm.c shard version {found} with magic {magic}, which llm.c writes with version {expected} only \
         (20240520: version 1, u16 ids; 20240801: version 7, u32 ids); re-create it with `launcher prepare-data`",
        path.display()
    )]
    BadVersion { path: PathBuf, magic: i32, found: i32, expected: i32 },

    /// A shard's `.idx` sidecar does not belong to it.
    #[error(
        "{} is not the document index of {}: {why}; it is stale or damaged: delete it (the shard then has no \
         document index) or re-create both with `launcher prepare-data`",
        idx.display(),
        shard.display()
    )]
    BadDocIndex { idx: PathBuf, shard: PathBuf, why: String },

    /// The header's token count is negative.
    #[error("{} has a negative token count ({count}) in its header: the file is corrupt; re-create it", path.display())]
    NegativeCount { path: PathBuf, count: i32 },

    /// The file length disagrees with the header's token count.
    #[error(
        "{} is {}: its header says {tokens} tokens, so {expected} bytes were expected, but the file ends at byte \
         offset {found}; re-create it with `launcher prepare-data`",
        path.display(),
        if found < expected { "truncated" } else { "longer than its header says" }
    )]
    LengthMismatch { path: PathBuf, tokens: u64, expected: u64, found: u64 },

    /// The mapped token bytes could not be viewed as `u16` (should not happen: the header is 1024 bytes).
    #[error("{}: the token data is not aligned in memory ({reason}); this is a bug, please report it", path.display())]
    Misaligned { path: PathBuf, reason: String },

    /// Too many tokens for the format's i32 count.
    #[error(
        "cannot write {}: {tokens} tokens do not fit the llm.c header's i32 count (max {}); use smaller shards",
        path.display(),
        i32::MAX
    )]
    TooManyTokens { path: PathBuf, tokens: usize },

    /// The data path does not exist.
    #[error(
        "data path {} does not exist: give a directory of `.bin` token shards, one shard file, or a pattern such \
         as `dir/name_train_*.bin`; create shards with `launcher prepare-data`",
        path.display()
    )]
    NotFound { path: PathBuf },

    /// A directory or pattern matched no shard of the requested split.
    #[error(
        "no {split} shards in {}: expected files named like {expected}; create them with `launcher prepare-data`",
        dir.display()
    )]
    NoShards { dir: PathBuf, split: String, expected: String },

    /// No shard of a dataset can hold one training window (`path`: its longest).
    #[error(
        "no shard holds one training window: the longest, {}, holds {tokens} tokens, fewer than the {needed} \
         needed for one window of seq_len {seq_len} (seq_len inputs + 1 target): lower model.seq_len, or \
         prepare more data / larger shards with `launcher prepare-data`",
        path.display()
    )]
    ShardTooShort { path: PathBuf, tokens: usize, needed: usize, seq_len: usize },

    /// The validation split is too small for one evaluation batch.
    #[error(
        "the {split} data in {} holds {tokens} tokens, fewer than the {needed} needed for one eval batch of \
         {micro_batch} x {seq_len} tokens: lower the eval batch or seq_len, or prepare a larger validation split",
        dir.display()
    )]
    SplitTooShort { dir: PathBuf, split: String, tokens: usize, needed: usize, micro_batch: usize, seq_len: usize },

    /// One epoch of the training data cannot fill one global batch.
    #[error(
        "the training data holds {tokens} tokens, {windows} windows of seq_len + 1 = {} tokens, fewer than the \
         {rows} rows one optimizer step takes ({shape}): a step would train on some window twice. Prepare \
         more data, or lower train.micro_batch, train.grad_accum, the number of ranks or model.seq_len",
        seq_len + 1
    )]
    TooLittleData { tokens: usize, windows: u64, seq_len: usize, rows: u64, shape: String },

    /// A token id the model's vocabulary cannot hold, met while reading a row.
    #[error(
        "{} holds token id {id} at token {offset} (byte offset {byte}), but the model's vocabulary has {vocab} ids: \
         the shard is corrupt or was made with a larger tokenizer; re-create it with `launcher prepare-data`",
        path.display()
    )]
    TokenOutOfRange { path: PathBuf, offset: usize, byte: u64, id: u32, vocab: u32 },

    /// A resume whose data differs from the checkpoint's.
    #[error(
        "the training data differs from the checkpoint's: {changes}. The checkpoint's loader position only means \
         the same rows with the same data; restore the data and settings it was saved with, or set \
         data.allow_changed_data = true to continue anyway (each source from its saved row count, by name; an \
         epoch of a changed source is then no longer seen exactly once)"
    )]
    DataChanged { changes: String },

    /// A caller passed an argument outside its domain (seq_len 0, rank >= world, buffer size...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The text to prepare is empty.
    #[error("input {} is empty (or only whitespace): there is nothing to tokenise", path.display())]
    EmptyInput { path: PathBuf },

    /// The text tokenises to too few tokens for the requested validation split.
    #[error(
        "input {} tokenises to {total} tokens, too few for a validation split of {val} tokens plus any training \
         tokens: use a larger input or a smaller validation split",
        path.display()
    )]
    TooFewTokens { path: PathBuf, total: usize, val: usize },

    /// A tokenizer failed to load or encode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// Preparing into a directory that already holds shards (without appending).
    #[error(
        "{} already holds token shards ({found}): preparing another text into it would mix both datasets in \
         training (every shard of a directory is trained on). Choose one: prepare into a new directory; \
         append this text as another source with --append (every source is recorded in dataset.json); or \
         remove those shards first",
        dir.display()
    )]
    ShardsExist { dir: PathBuf, found: String },

    /// Appending under a shard name the directory already uses.
    #[error(
        "{} already holds shards named {name}_*: appending under that name would replace them; give this text \
         another name with --name",
        dir.display()
    )]
    NameTaken { dir: PathBuf, name: String },

    /// Appending an input the directory already holds.
    #[error(
        "{} is already in {} (source {name} of dataset.json: same size and content): appending it again would \
         train on it twice",
        input.display(),
        dir.display()
    )]
    AlreadyPrepared { dir: PathBuf, input: PathBuf, name: String },

    /// Appending inputs with another tokenizer than the directory's shards.
    #[error(
        "{} holds shards of the tokenizer {theirs}, and these inputs would be tokenised with {ours}: the same id \
         would mean different text in training; prepare into a new directory, or append with the directory's \
         tokenizer (--tokenizer)",
        dir.display()
    )]
    TokenizerMismatch { dir: PathBuf, theirs: String, ours: String },

    /// A record that is not a document, under `--on-bad refuse`.
    #[error(
        "{record} ({kind}); nothing was written. Fix the input, or let prepare-data skip such records with \
         --on-bad skip (they are counted and the first of each kind named)"
    )]
    BadRecord { kind: &'static str, record: String },

    /// The inputs held no document at all.
    #[error(
        "the {inputs} input file(s) hold no document{}; nothing was written",
        if bad.is_empty() { String::new() } else { format!(" (skipped: {bad})") }
    )]
    NoDocuments { inputs: usize, bad: String },

    /// The consumer of a stream stopped (internal: never shown).
    #[error("stopped")]
    Stopped,

    /// A dataset's shards were made by different tokenizers.
    #[error(
        "{} mixes tokenizers: {first} was made with {first_name}, {second} with {second_name}; the same id would \
         mean different text: keep one tokenizer's shards in a data.path",
        dir.display()
    )]
    MixedTokenizers { dir: PathBuf, first: String, first_name: String, second: String, second_name: String },

    /// `ensure_builtin_dataset` was pointed at a directory holding something else.
    #[error(
        "{} exists but does not hold the built-in dataset (found {found}); refusing to replace it: pass an \
         empty or non-existent directory",
        dir.display()
    )]
    NotBuiltinDir { dir: PathBuf, found: String },
}

/// Result alias used throughout the crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Build an [`DataError::Io`] mapper for `path`: `.map_err(io_err("open", path))`.
pub(crate) fn io_err(action: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> DataError {
    let path = path.into();
    move |source| DataError::Io { action, path, source }
}
