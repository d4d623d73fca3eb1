//! One string of text, already in memory, into GPT-2 shards: how the built-in corpus is
//! prepared. Its token stream is what it has always been — documents separated by
//! `<|endoftext|>` (50256) *between* them, the first tokens of the stream going to the
//! validation split — so runs on the built-in corpus keep their losses; the shards now
//! carry the tokenizer record and a document index like `prepare-data`'s (the index marks
//! the first document of the stream at 0 and every later one at its separator).

use std::fmt;
use std::path::{Path, PathBuf};

use crate::dataset::Split;
use crate::documents::ENDOFTEXT;
use crate::error::{DataError, Result};
use crate::tokenizer::{gpt2, Tokenizer, TokenizerSpec};
use crate::writer::SplitWriter;
use crate::EOT_TOKEN;

/// How much of the token stream (taken from its start) becomes the validation split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValSplit {
    /// Exactly this many tokens (0: no validation shard).
    Tokens(usize),
    /// This fraction of all tokens, in `[0, 1)`, rounded (at least one token if positive).
    Fraction(f64),
}

/// What [`prepare_str`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextSummary {
    pub out_dir: PathBuf,
    /// Documents in the text (separators + 1).
    pub documents: usize,
    pub total_tokens: usize,
    pub val_tokens: usize,
    pub train_tokens: usize,
    /// Shard files written: validation first, then training, in order.
    pub files: Vec<PathBuf>,
}

impl fmt::Display for TextSummary {
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
        )
    }
}

/// Tokenise `text` with GPT-2 BPE; each `<|endoftext|>` becomes [`EOT_TOKEN`]. Returns
/// the tokens and the number of documents. Identical to tiktoken's
/// `encode(text, allowed_special = {"<|endoftext|>"})`, but documents are encoded on
/// several threads.
pub fn tokenize(text: &str) -> Result<(Vec<u16>, usize)> {
    let bpe = gpt2()?;
    let docs: Vec<&str> = text.split(ENDOFTEXT).collect();
    use rayon::prelude::*;
    let encoded: Vec<Result<Vec<u32>>> = docs
        .par_iter()
        .with_min_len(64)
        .map(|doc| {
            // `encode` (not `encode_ordinary`) reports regex failures instead of panicking.
            let (ids, _) =
                bpe.encode(doc, &std::collections::HashSet::new()).map_err(|e| DataError::Tokenizer(e.message))?;
            Ok(ids)
        })
        .collect();
    let mut tokens = Vec::with_capacity(text.len() / 3);
    for (i, part) in encoded.into_iter().enumerate() {
        if i > 0 {
            tokens.push(EOT_TOKEN);
        }
        for id in part? {
            tokens
                .push(u16::try_from(id).map_err(|_| DataError::Tokenizer(format!("token id {id} does not fit u16")))?);
        }
    }
    Ok((tokens, docs.len()))
}

/// Decode GPT-2 token ids back to text (lossy for byte sequences that are not UTF-8).
pub fn detokenize(tokens: &[u32]) -> Result<String> {
    let bytes = gpt2()?.decode_bytes(tokens).map_err(|e| DataError::Tokenizer(e.to_string()))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Tokenise `text` (GPT-2) and write `<name>_val_%06d.bin` (the first tokens, per `val`)
/// and `<name>_train_%06d.bin` (the rest, `shard_tokens` per shard) into `out_dir` as they
/// are: no check of what the directory holds, no `dataset.json`. `source` names the text
/// in errors.
pub fn prepare_str(
    text: &str,
    source: &Path,
    out_dir: &Path,
    name: &str,
    shard_tokens: usize,
    val: ValSplit,
) -> Result<TextSummary> {
    crate::prepare::check_name(name)?;
    crate::prepare::check_shard_tokens(shard_tokens)?;
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
    std::fs::create_dir_all(out_dir).map_err(crate::error::io_err("create the output directory", out_dir))?;
    let stamp = Tokenizer::load(&TokenizerSpec::Gpt2, None)?.stamp().clone();
    let mut files = Vec::new();
    for (split, range) in [(Split::Val, 0..val_tokens), (Split::Train, val_tokens..total)] {
        let mut w = SplitWriter::new(out_dir, name, split, shard_tokens, &stamp);
        // Segments that begin a document: the stream's start and every separator.
        let mut seg = range.start;
        for i in range.clone() {
            if i > seg && tokens[i] == EOT_TOKEN {
                push(&mut w, &tokens[seg..i], seg == 0 || tokens[seg] == EOT_TOKEN)?;
                seg = i;
            }
        }
        push(&mut w, &tokens[seg..range.end], seg == 0 || tokens.get(seg) == Some(&EOT_TOKEN))?;
        w.finish()?;
        files.extend(w.files);
    }
    Ok(TextSummary {
        out_dir: out_dir.to_owned(),
        documents,
        total_tokens: total,
        val_tokens,
        train_tokens: total - val_tokens,
        files,
    })
}

fn push(w: &mut SplitWriter, ids: &[u16], doc_start: bool) -> Result<()> {
    let wide: Vec<u32> = ids.iter().map(|&t| u32::from(t)).collect();
    w.push(&wide, doc_start)
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
        let wide: Vec<u32> = toks.iter().map(|&t| t as u32).collect();
        assert_eq!(wide, reference);
        assert_eq!(toks.iter().filter(|&&t| t == EOT_TOKEN).count(), 3);
        assert_eq!(detokenize(&wide).unwrap(), TEXT);
        let big = TEXT.repeat(600);
        let (toks, docs) = tokenize(&big).unwrap();
        assert_eq!(docs, 3 * 600 + 1);
        assert_eq!(
            toks.iter().map(|&t| t as u32).collect::<Vec<_>>(),
            gpt2().unwrap().encode_with_special_tokens(&big)
        );
    }

    #[test]
    fn prepare_str_writes_the_stream_with_a_document_index() {
        let dir = tempfile::tempdir().unwrap();
        let text = TEXT.repeat(20);
        let out = dir.path().join("out");
        let sum = prepare_str(&text, Path::new("<t>"), &out, "tiny", 100, ValSplit::Tokens(30)).unwrap();
        assert_eq!((sum.val_tokens, sum.total_tokens), (30, sum.val_tokens + sum.train_tokens));
        assert!(sum.files[0].ends_with("tiny_val_000000.bin") && sum.files[1].ends_with("tiny_train_000000.bin"));
        assert_eq!(sum.files.len(), 1 + sum.train_tokens.div_ceil(100));
        let mut all = Vec::new();
        let mut starts = Vec::new();
        for f in &sum.files {
            let s = TokenShard::open(f).unwrap();
            assert_eq!(s.info().unwrap().tokenizer, "gpt2");
            starts.extend(s.doc_starts().unwrap().iter().map(|&o| o as usize + all.len()));
            s.ids().extend_u32(&mut all);
        }
        assert_eq!(detokenize(&all).unwrap(), text);
        // Document k begins at the stream's start or at the separator before it.
        let eots: Vec<usize> = (0..all.len()).filter(|&i| all[i] == 50256).collect();
        assert_eq!(starts[0], 0);
        assert_eq!(starts[1..], eots[..]);
        assert_eq!(Dataset::open(&out, Split::Val).unwrap().total_tokens(), 30);
        assert!(sum.to_string().contains(&format!("wrote {} tokens", sum.total_tokens)));
    }
}
