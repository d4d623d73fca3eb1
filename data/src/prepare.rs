//! Turning UTF-8 text into llm.c shards with the GPT-2 BPE tokenizer.
//!
//! The tokenizer is `tiktoken_rs::r50k_base` (the GPT-2 vocabulary, embedded in the
//! crate: no network). A file is one document unless it contains the literal separator
//! `<|endoftext|>`, which becomes token 50256 ([`crate::EOT_TOKEN`]) between documents.
//! The first tokens go to the validation split (`<name>_val_000000.bin`, ...), the rest to
//! `<name>_train_000000.bin`, ... in shards of `shard_tokens` tokens (the last one shorter).
//! A directory that already holds shards is refused unless the text is appended as another
//! source ([`Existing`]); every source is recorded in its `dataset.json` (`sources.rs`).

use std::collections::HashSet;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

use crate::dataset::Split;
use crate::error::{io_err, DataError, Result};
use crate::shard::write_shard;
use crate::EOT_TOKEN;

/// The document separator in input text.
pub const ENDOFTEXT: &str = "<|endoftext|>";

/// How much of the token stream (taken from its start) becomes the validation split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValSplit {
    /// Exactly this many tokens (0: no validation shard).
    Tokens(usize),
    /// This fraction of all tokens, in `[0, 1)`, rounded (at least one token if positive).
    Fraction(f64),
}

/// What [`prepare_text`] does when the output directory already holds token shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Refuse ([`DataError::ShardsExist`]): both datasets would be trained on, mixed.
    Refuse,
    /// Add this text as another source (under a shard name of its own), recorded with the
    /// others in `dataset.json`.
    Append,
}

/// What [`prepare_text`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareSummary {
    /// The directory holding the shards.
    pub out_dir: PathBuf,
    /// Documents in the input (separators + 1).
    pub documents: usize,
    /// Tokens written, over both splits.
    pub total_tokens: usize,
    /// Tokens in the validation shards.
    pub val_tokens: usize,
    /// Tokens in the training shards.
    pub train_tokens: usize,
    /// Shard files written: validation first, then training, in order.
    pub files: Vec<PathBuf>,
    /// Sources the directory holds now (recorded in `dataset.json`; 1 unless appended to).
    pub sources: usize,
}

impl fmt::Display for PrepareSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "wrote {} tokens ({} val, {} train) from {} document(s) in {} shard(s) to {}",
            self.total_tokens,
            self.val_tokens,
            self.train_tokens,
            self.documents,
            self.files.len(),
            self.out_dir.display()
        )?;
        if self.sources > 1 {
            write!(f, ", which now holds {} sources (listed in its {})", self.sources, crate::sources::SOURCES_FILE)?;
        }
        Ok(())
    }
}

/// The GPT-2 tokenizer, built once per process.
fn gpt2() -> Result<&'static CoreBPE> {
    static BPE: OnceLock<std::result::Result<CoreBPE, String>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| DataError::Tokenizer(format!("cannot build the GPT-2 (r50k_base) tokenizer: {e}")))
}

/// Tokenise `text` with GPT-2 BPE; each `<|endoftext|>` becomes [`EOT_TOKEN`]. Returns
/// the tokens and the number of documents. Identical to tiktoken's
/// `encode(text, allowed_special = {"<|endoftext|>"})`, but documents are encoded on
/// several threads.
pub fn tokenize(text: &str) -> Result<(Vec<u16>, usize)> {
    let bpe = gpt2()?;
    let docs: Vec<&str> = text.split(ENDOFTEXT).collect();
    let threads = if text.len() < (1 << 16) {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(8).min(docs.len())
    };
    // Contiguous groups of documents of about equal size; each group is encoded with
    // EOT between its documents, and groups are then joined with EOT.
    let mut groups: Vec<&[&str]> = Vec::with_capacity(threads);
    let (mut start, mut acc) = (0, 0usize);
    for (i, d) in docs.iter().enumerate() {
        acc += d.len() + ENDOFTEXT.len();
        if i + 1 < docs.len() && groups.len() + 1 < threads && acc * threads >= text.len() * (groups.len() + 1) {
            groups.push(&docs[start..=i]);
            start = i + 1;
        }
    }
    groups.push(&docs[start..]);

    let encoded: Vec<Result<Vec<u16>>> = if groups.len() == 1 {
        vec![encode_docs(bpe, groups[0])]
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = groups.iter().map(|&g| s.spawn(move || encode_docs(bpe, g))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(DataError::Tokenizer("a tokenizer thread panicked".into()))))
                .collect()
        })
    };
    let mut tokens = Vec::with_capacity(text.len() / 3);
    for (i, part) in encoded.into_iter().enumerate() {
        if i > 0 {
            tokens.push(EOT_TOKEN);
        }
        tokens.extend(part?);
    }
    Ok((tokens, docs.len()))
}

fn encode_docs(bpe: &CoreBPE, docs: &[&str]) -> Result<Vec<u16>> {
    let none = HashSet::new();
    let mut out = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        if i > 0 {
            out.push(EOT_TOKEN);
        }
        // `encode` (not `encode_ordinary`) reports regex failures instead of panicking.
        let (ids, _) = bpe.encode(doc, &none).map_err(|e| DataError::Tokenizer(e.message))?;
        for id in ids {
            out.push(u16::try_from(id).map_err(|_| DataError::Tokenizer(format!("token id {id} does not fit u16")))?);
        }
    }
    Ok(out)
}

/// Decode GPT-2 token ids back to text (lossy for byte sequences that are not UTF-8).
pub fn detokenize(tokens: &[u16]) -> Result<String> {
    let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    let bytes = gpt2()?.decode_bytes(&ids).map_err(|e| DataError::Tokenizer(e.to_string()))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Tokenise the UTF-8 text file `input_txt` with GPT-2 BPE and write llm.c shards named
/// `<name>_val_%06d.bin` (the first tokens, per `val`) and `<name>_train_%06d.bin` (the
/// rest, `shard_tokens` per shard) into `out_dir`, which is created if needed, and record
/// the source in its `dataset.json`. If `out_dir` already holds shards, `existing` decides:
/// refuse, or append this text as another source (a `name` of its own, a text not already
/// there; shards without a record are recorded first as sources of unknown origin).
///
/// Errors: missing or unreadable input (named), empty input, non-UTF-8 input (with the
/// byte offset), a bad `name`/`shard_tokens`/`val`, too few tokens for the split, an
/// `out_dir` that holds shards (and, appending, a name it uses or this same text).
pub fn prepare_text(
    input_txt: &Path,
    out_dir: &Path,
    name: &str,
    shard_tokens: usize,
    val: ValSplit,
    existing: Existing,
) -> Result<PrepareSummary> {
    // Checked before the (long) tokenisation: nothing is written when refused.
    let found = crate::sources::shards_in(out_dir)?;
    if !found.is_empty() && existing == Existing::Refuse {
        return Err(DataError::ShardsExist { dir: out_dir.to_owned(), found: crate::sources::describe(&found) });
    }
    check_name(name)?;
    if found.iter().any(|f| crate::sources::shard_prefix(f) == name) {
        return Err(DataError::NameTaken { dir: out_dir.to_owned(), name: name.to_string() });
    }
    let mut record = crate::sources::Sources::read(out_dir)?;
    let bytes = fs::read(input_txt).map_err(io_err("read the input text", input_txt))?;
    let hash = crate::sources::fnv1a64(&bytes);
    let same = record
        .sources
        .iter()
        .find(|s| s.input_fnv1a64.as_deref() == Some(hash.as_str()) && s.input_bytes == Some(bytes.len() as u64));
    if let Some(s) = same {
        return Err(DataError::AlreadyPrepared {
            dir: out_dir.to_owned(),
            input: input_txt.to_owned(),
            name: s.name.clone(),
        });
    }
    let text = std::str::from_utf8(&bytes)
        .map_err(|e| DataError::NotUtf8 { path: input_txt.to_owned(), offset: e.valid_up_to() })?;
    record.add_unrecorded(out_dir, &found)?;
    let mut summary = prepare_str(text, input_txt, out_dir, name, shard_tokens, val)?;
    let file_name = |p: &PathBuf| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    record.sources.push(crate::sources::Source {
        name: name.to_string(),
        input: Some(std::path::absolute(input_txt).unwrap_or_else(|_| input_txt.to_owned())),
        input_bytes: Some(bytes.len() as u64),
        input_fnv1a64: Some(hash),
        documents: Some(summary.documents),
        train_tokens: summary.train_tokens,
        val_tokens: summary.val_tokens,
        files: summary.files.iter().map(file_name).collect(),
        prepared_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_secs()),
    });
    record.write(out_dir)?;
    summary.sources = record.sources.len();
    Ok(summary)
}

/// [`prepare_text`] for text already in memory; `source` names it in errors. It writes its
/// shards into `out_dir` as they are: no check of what the directory holds, no record.
pub fn prepare_str(
    text: &str,
    source: &Path,
    out_dir: &Path,
    name: &str,
    shard_tokens: usize,
    val: ValSplit,
) -> Result<PrepareSummary> {
    check_name(name)?;
    if shard_tokens == 0 || shard_tokens > i32::MAX as usize {
        return Err(DataError::InvalidArgument(format!(
            "shard_tokens must be between 1 and {} (got {shard_tokens})",
            i32::MAX
        )));
    }
    if let ValSplit::Fraction(f) = val {
        if !(0.0..1.0).contains(&f) {
            return Err(DataError::InvalidArgument(format!("the validation fraction must be in [0, 1) (got {f})")));
        }
    }
    if text.trim().is_empty() {
        return Err(DataError::EmptyInput { path: source.to_owned() });
    }

    let (tokens, documents) = tokenize(text)?;
    let total = tokens.len();
    let val_tokens = match val {
        ValSplit::Tokens(n) => n,
        ValSplit::Fraction(f) if f > 0.0 => ((total as f64 * f).round() as usize).max(1),
        ValSplit::Fraction(_) => 0,
    };
    if val_tokens >= total {
        return Err(DataError::TooFewTokens { path: source.to_owned(), total, val: val_tokens });
    }

    fs::create_dir_all(out_dir).map_err(io_err("create the output directory", out_dir))?;
    let mut files = Vec::new();
    for (split, part) in [(Split::Val, &tokens[..val_tokens]), (Split::Train, &tokens[val_tokens..])] {
        for (i, chunk) in part.chunks(shard_tokens).enumerate() {
            let path = out_dir.join(shard_name(name, split, i));
            write_shard(&path, chunk)?;
            files.push(path);
        }
    }
    Ok(PrepareSummary {
        out_dir: out_dir.to_owned(),
        documents,
        total_tokens: total,
        val_tokens,
        train_tokens: total - val_tokens,
        files,
        sources: 1,
    })
}

/// `<name>_<split>_<index as 6 digits>.bin`.
pub fn shard_name(name: &str, split: Split, index: usize) -> String {
    format!("{name}_{}_{index:06}.bin", split.word())
}

fn check_name(name: &str) -> Result<()> {
    let ok_chars = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !ok_chars || name.starts_with('.') {
        return Err(DataError::InvalidArgument(format!(
            "dataset name {name:?} must be non-empty, not start with '.', and use only ASCII letters, digits, '-', \
             '_' and '.'"
        )));
    }
    // The split is recognised from the file name, so the name must not look like one.
    if Split::Val.matches(&shard_name(name, Split::Train, 0)) || Split::Train.matches(&shard_name(name, Split::Val, 0))
    {
        return Err(DataError::InvalidArgument(format!(
            "dataset name {name:?} contains the word \"train\" or \"val\", which would put its shards in both \
             splits: choose another name"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::Dataset;
    use crate::shard::TokenShard;

    const TEXT: &str = "The quick brown fox jumps over the lazy dog.\nÜnïcödé and emoji 🦀 too.<|endoftext|>Second \
                        document: 1 + 2 = 3.\n\nA new paragraph.<|endoftext|><|endoftext|>Fourth.";

    #[test]
    fn tokenize_matches_tiktoken_with_special_tokens() {
        let (toks, docs) = tokenize(TEXT).unwrap();
        assert_eq!(docs, 4);
        let reference = gpt2().unwrap().encode_with_special_tokens(TEXT);
        assert_eq!(toks.iter().map(|&t| t as u32).collect::<Vec<_>>(), reference);
        assert_eq!(toks.iter().filter(|&&t| t == EOT_TOKEN).count(), 3);
        assert_eq!(detokenize(&toks).unwrap(), TEXT);
        // Multi-threaded path (>= 64 KiB) agrees with tiktoken too.
        let big = TEXT.repeat(600);
        let (toks, docs) = tokenize(&big).unwrap();
        assert_eq!(docs, 3 * 600 + 1);
        assert_eq!(
            toks.iter().map(|&t| t as u32).collect::<Vec<_>>(),
            gpt2().unwrap().encode_with_special_tokens(&big)
        );
        // Uneven documents (small ones, then one huge one) never produce an empty group.
        let uneven = format!("a{ENDOFTEXT}b{ENDOFTEXT}{}", "word ".repeat(20_000));
        let (toks, docs) = tokenize(&uneven).unwrap();
        assert_eq!(docs, 3);
        assert_eq!(
            toks.iter().map(|&t| t as u32).collect::<Vec<_>>(),
            gpt2().unwrap().encode_with_special_tokens(&uneven)
        );
    }

    #[test]
    fn prepare_text_writes_val_then_train_shards_that_decode_back() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.txt");
        let text = TEXT.repeat(20);
        fs::write(&input, &text).unwrap();
        let out = dir.path().join("out");
        let sum = prepare_text(&input, &out, "tiny", 100, ValSplit::Tokens(30), Existing::Refuse).unwrap();
        assert_eq!(sum.val_tokens, 30);
        assert_eq!(sum.total_tokens, sum.val_tokens + sum.train_tokens);
        assert!(sum.files[0].ends_with("tiny_val_000000.bin"));
        assert!(sum.files[1].ends_with("tiny_train_000000.bin"));
        assert_eq!(sum.files.len(), 1 + sum.train_tokens.div_ceil(100));
        let mut all = Vec::new();
        for f in &sum.files {
            all.extend_from_slice(TokenShard::open(f).unwrap().tokens());
        }
        assert_eq!(all.len(), sum.total_tokens);
        assert_eq!(detokenize(&all).unwrap(), text);
        let train = Dataset::open(&out, Split::Train).unwrap();
        assert_eq!(train.total_tokens(), sum.train_tokens);
        assert_eq!(Dataset::open(&out, Split::Val).unwrap().total_tokens(), 30);
        assert!(sum.to_string().contains(&format!("wrote {} tokens", sum.total_tokens)));

        let record = crate::sources::Sources::read(&out).unwrap();
        assert_eq!(record.sources.len(), 1);
        assert_eq!(record.sources[0].input.as_deref(), Some(input.as_path()));
        assert_eq!(record.sources[0].files.len(), sum.files.len());
        assert_eq!(sum.sources, 1);
    }

    #[test]
    fn a_directory_with_shards_is_refused_unless_appended_to_and_every_source_is_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.txt"), dir.path().join("b.txt"));
        fs::write(&a, TEXT.repeat(20)).unwrap();
        fs::write(&b, "Another text entirely, about owls. ".repeat(100)).unwrap();
        let out = dir.path().join("out");
        let first = prepare_text(&a, &out, "a", 1_000_000, ValSplit::Fraction(0.1), Existing::Refuse).unwrap();
        let listing = |d: &Path| {
            let mut v: Vec<_> = fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
            v.sort();
            v
        };
        let before = listing(&out);

        // A second text: refused, naming the directory, what it holds and the choices; nothing written.
        let e = prepare_text(&b, &out, "b", 1_000_000, ValSplit::Fraction(0.1), Existing::Refuse).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, DataError::ShardsExist { .. }), "{msg}");
        assert!(
            msg.contains(&out.display().to_string()) && msg.contains("a_* (2)") && msg.contains("--append"),
            "{msg}"
        );
        assert_eq!(listing(&out), before);
        // The same text again under its own name is refused too (it would replace its shards).
        let e = prepare_text(&a, &out, "a", 1_000, ValSplit::Fraction(0.1), Existing::Append).unwrap_err();
        assert!(matches!(e, DataError::NameTaken { .. }), "{e}");
        let e = prepare_text(&a, &out, "a2", 1_000, ValSplit::Fraction(0.1), Existing::Append).unwrap_err();
        assert!(matches!(e, DataError::AlreadyPrepared { .. }) && e.to_string().contains("twice"), "{e}");

        // Appended: both in training, both recorded.
        let second = prepare_text(&b, &out, "b", 1_000_000, ValSplit::Fraction(0.1), Existing::Append).unwrap();
        assert_eq!(second.sources, 2);
        assert!(second.to_string().contains("2 sources"), "{second}");
        let train = Dataset::open(&out, Split::Train).unwrap();
        assert_eq!(train.total_tokens(), first.train_tokens + second.train_tokens);
        let record = crate::sources::Sources::read(&out).unwrap();
        let names: Vec<&str> = record.sources.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(record.sources[1].input.as_deref(), Some(b.as_path()));
        assert_eq!(record.sources[1].train_tokens, second.train_tokens);

        // Shards without a record (llm.c's, or from before dataset.json) are recorded at the first append.
        let legacy = dir.path().join("legacy");
        fs::create_dir_all(&legacy).unwrap();
        crate::shard::write_shard(legacy.join("fineweb_train_000000.bin"), &[1, 2, 3, 4]).unwrap();
        prepare_text(&b, &legacy, "b", 1_000_000, ValSplit::Fraction(0.1), Existing::Append).unwrap();
        let record = crate::sources::Sources::read(&legacy).unwrap();
        assert_eq!(record.sources.len(), 2);
        assert_eq!((record.sources[0].name.as_str(), record.sources[0].input.as_ref()), ("fineweb", None));
        assert_eq!(record.sources[0].train_tokens, 4);
    }

    #[test]
    fn bad_inputs_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let missing = dir.path().join("missing.txt");
        let e = prepare_text(&missing, &out, "x", 100, ValSplit::Tokens(1), Existing::Refuse).unwrap_err();
        assert!(matches!(e, DataError::Io { .. }) && e.to_string().contains("missing.txt"), "{e}");

        let empty = dir.path().join("empty.txt");
        fs::write(&empty, " \n\n").unwrap();
        let e = prepare_text(&empty, &out, "x", 100, ValSplit::Tokens(1), Existing::Refuse).unwrap_err();
        assert!(matches!(e, DataError::EmptyInput { .. }), "{e}");

        let latin1 = dir.path().join("latin1.txt");
        fs::write(&latin1, b"caf\xe9 au lait").unwrap();
        let e = prepare_text(&latin1, &out, "x", 100, ValSplit::Tokens(1), Existing::Refuse).unwrap_err();
        assert!(matches!(e, DataError::NotUtf8 { offset: 3, .. }), "{e}");
        assert!(e.to_string().contains("byte offset 3") && e.to_string().contains("latin1.txt"), "{e}");

        let small = dir.path().join("small.txt");
        fs::write(&small, "hi there").unwrap();
        let e = prepare_text(&small, &out, "x", 100, ValSplit::Tokens(2), Existing::Refuse).unwrap_err();
        assert!(matches!(e, DataError::TooFewTokens { total: 2, .. }), "{e}");
        for (name, shard, val) in [
            ("", 100, ValSplit::Tokens(0)),
            ("a/b", 100, ValSplit::Tokens(0)),
            ("my_val", 100, ValSplit::Tokens(0)),
            ("x", 0, ValSplit::Tokens(0)),
            ("x", 100, ValSplit::Fraction(1.0)),
        ] {
            let e = prepare_text(&small, &out, name, shard, val, Existing::Refuse).unwrap_err();
            assert!(matches!(e, DataError::InvalidArgument(_)), "{name:?}: {e}");
        }
        assert!(!out.exists(), "no output on error");
    }
}
