//! The tokenizers `prepare-data` encodes with: GPT-2's BPE built in (tiktoken-rs, the
//! vocabulary embedded: no file, no network), or any Hugging Face `tokenizer.json` (a
//! Llama model folder's, say) through the `tokenizers` crate.
//!
//! Documents are encoded as ordinary text: special-token strings inside a document
//! (`<|endoftext|>`, `<|begin_of_text|>` ...) are encoded as the characters they are, as
//! llm.c does (`split_special_tokens=True`), so only the separator `prepare-data` places
//! between documents is the end-of-text id. A `tokenizer.json`'s truncation and padding
//! settings are switched off: a document is never cut.
//!
//! A tokenizer's identity is its *fingerprint*: a hash of its vocabulary size and of the
//! ids it gives a fixed probe text (prose, code, digits, whitespace runs, many scripts).
//! Two files that tokenise alike (GPT-2's `tokenizer.json` and the built-in GPT-2, a copy
//! of a Llama folder's file) share it; different tokenizers do not. The fingerprint is
//! what shard headers record and what the launcher compares with `train.init_from`'s
//! `tokenizer.json` before any rank starts. The file's SHA-256 is recorded too
//! (`dataset.json`), for people checking which exact file was used.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tiktoken_rs::CoreBPE;

use crate::error::{io_err, DataError, Result};
use crate::shard::ShardInfo;

/// The name `--tokenizer` takes for the built-in GPT-2 BPE.
pub const GPT2_NAME: &str = "gpt2";
/// Tokens that end a document in common vocabularies, tried in this order when neither
/// `--eot` nor a `tokenizer_config.json` beside the file names one.
pub const KNOWN_EOT: &[&str] = &["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>"];

/// Which tokenizer to use: `gpt2`, or a `tokenizer.json` (or a folder holding one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSpec {
    Gpt2,
    File(PathBuf),
}

impl TokenizerSpec {
    /// `gpt2`, else a path: a `tokenizer.json` file, or a folder that holds one.
    pub fn parse(s: &str) -> TokenizerSpec {
        if s == GPT2_NAME {
            TokenizerSpec::Gpt2
        } else {
            TokenizerSpec::File(PathBuf::from(s))
        }
    }
}

/// What identifies a tokenizer in `dataset.json` and in shard headers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerStamp {
    /// `gpt2`, or `<folder>/tokenizer.json` of the file used.
    pub name: String,
    /// The `tokenizer.json` used, absolute (`None`: built in).
    pub file: Option<PathBuf>,
    /// SHA-256 of that file, hex.
    pub file_sha256: Option<String>,
    /// Ids it can produce: `0..vocab_size`.
    pub vocab_size: u32,
    /// The token placed before every document, and its id.
    pub eot_token: String,
    pub eot_id: u32,
    /// The behavioural fingerprint (see the module docs), 16 hex digits.
    pub fingerprint: String,
}

impl TokenizerStamp {
    /// The fingerprint as a number (0 if the record was edited into something else).
    pub fn fingerprint_u64(&self) -> u64 {
        u64::from_str_radix(&self.fingerprint, 16).unwrap_or(0)
    }

    /// The header record of a shard whose largest id is `max_id`.
    pub fn shard_info(&self, max_id: Option<u32>) -> ShardInfo {
        ShardInfo {
            vocab_size: self.vocab_size,
            eot_id: self.eot_id,
            max_id,
            fingerprint: self.fingerprint_u64(),
            tokenizer: self.name.clone(),
        }
    }
}

/// A loaded tokenizer, shareable between threads.
pub struct Tokenizer {
    inner: Inner,
    stamp: TokenizerStamp,
}

enum Inner {
    Gpt2(&'static CoreBPE),
    Hf(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("stamp", &self.stamp).finish_non_exhaustive()
    }
}

/// The GPT-2 BPE, built once per process.
pub(crate) fn gpt2() -> Result<&'static CoreBPE> {
    static BPE: OnceLock<std::result::Result<CoreBPE, String>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| DataError::Tokenizer(format!("cannot build the GPT-2 (r50k_base) tokenizer: {e}")))
}

impl Tokenizer {
    /// Load `spec`; `eot` names the end-of-text token of a `tokenizer.json` (default: the
    /// `eos_token` of a `tokenizer_config.json` beside it, else the first of [`KNOWN_EOT`]
    /// in its vocabulary). The built-in GPT-2 uses `<|endoftext|>` (50256).
    pub fn load(spec: &TokenizerSpec, eot: Option<&str>) -> Result<Tokenizer> {
        match spec {
            TokenizerSpec::Gpt2 => {
                if let Some(t) = eot.filter(|t| *t != "<|endoftext|>") {
                    return Err(DataError::InvalidArgument(format!(
                        "--eot {t:?}: the built-in GPT-2 tokenizer separates documents with <|endoftext|> (50256) \
                         only; leave --eot out, or give a tokenizer.json with --tokenizer"
                    )));
                }
                let inner = Inner::Gpt2(gpt2()?);
                let vocab = crate::GPT2_VOCAB as u32;
                let fingerprint = fingerprint(&inner, vocab)?;
                let stamp = TokenizerStamp {
                    name: GPT2_NAME.into(),
                    file: None,
                    file_sha256: None,
                    vocab_size: vocab,
                    eot_token: "<|endoftext|>".into(),
                    eot_id: u32::from(crate::EOT_TOKEN),
                    fingerprint: format!("{fingerprint:016x}"),
                };
                Ok(Tokenizer { inner, stamp })
            }
            TokenizerSpec::File(given) => {
                let loaded = load_file(given)?;
                let (eot_token, eot_id) = resolve_eot(&loaded.tokenizer, &loaded.path, eot)?;
                let inner = Inner::Hf(Box::new(loaded.tokenizer));
                let fingerprint = fingerprint(&inner, loaded.vocab_size)?;
                let stamp = TokenizerStamp {
                    name: loaded.name,
                    file: Some(std::path::absolute(&loaded.path).unwrap_or(loaded.path)),
                    file_sha256: Some(loaded.sha256),
                    vocab_size: loaded.vocab_size,
                    eot_token,
                    eot_id,
                    fingerprint: format!("{fingerprint:016x}"),
                };
                Ok(Tokenizer { inner, stamp })
            }
        }
    }

    /// What identifies this tokenizer.
    pub fn stamp(&self) -> &TokenizerStamp {
        &self.stamp
    }

    /// The ids of `text`, encoded as ordinary text (no special tokens added or recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        encode(&self.inner, text)
    }
}

fn encode(inner: &Inner, text: &str) -> Result<Vec<u32>> {
    match inner {
        Inner::Gpt2(bpe) => {
            // `encode` (not `encode_ordinary`) reports regex failures instead of panicking.
            let (ids, _) = bpe.encode(text, &HashSet::new()).map_err(|e| DataError::Tokenizer(e.message))?;
            Ok(ids)
        }
        Inner::Hf(t) => {
            let enc = t.encode_fast(text, false).map_err(|e| DataError::Tokenizer(e.to_string()))?;
            Ok(enc.get_ids().to_vec())
        }
    }
}

/// A `tokenizer.json` as read, before its end-of-text token is chosen.
struct Loaded {
    tokenizer: tokenizers::Tokenizer,
    path: PathBuf,
    name: String,
    sha256: String,
    vocab_size: u32,
}

/// `path` or `path/tokenizer.json`, parsed, with truncation and padding off and special
/// tokens in text encoded as text.
fn load_file(given: &Path) -> Result<Loaded> {
    let path = if given.is_dir() { given.join("tokenizer.json") } else { given.to_owned() };
    let bytes = std::fs::read(&path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            DataError::InvalidArgument(format!(
                "--tokenizer {}: {} does not exist; give `gpt2` (built in) or a Hugging Face tokenizer.json (or the \
                 model folder holding it)",
                given.display(),
                path.display()
            ))
        } else {
            io_err("read the tokenizer", &path)(e)
        }
    })?;
    let mut tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
        DataError::Tokenizer(format!(
            "{} is not a Hugging Face tokenizer.json this build reads ({e}); give the tokenizer.json of a model \
             folder (transformers' `save_pretrained` writes one), or `gpt2`",
            path.display()
        ))
    })?;
    tokenizer
        .with_truncation(None)
        .map_err(|e| DataError::Tokenizer(format!("{}: cannot turn truncation off: {e}", path.display())))?;
    tokenizer.with_padding(None);
    tokenizer.set_encode_special_tokens(true);
    let max_id = tokenizer.get_vocab(true).values().copied().max();
    let vocab_size = (tokenizer.get_vocab_size(true) as u32).max(max_id.map_or(0, |m| m + 1));
    let name = match path.parent().and_then(Path::file_name) {
        Some(dir) => format!("{}/{}", dir.to_string_lossy(), path.file_name().unwrap_or_default().to_string_lossy()),
        None => path.display().to_string(),
    };
    let sha256 = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    Ok(Loaded { tokenizer, path, name, sha256, vocab_size })
}

/// The end-of-text token: `--eot`, the `eos_token` of `tokenizer_config.json`, or a known name.
fn resolve_eot(t: &tokenizers::Tokenizer, path: &Path, eot: Option<&str>) -> Result<(String, u32)> {
    let id_of = |tok: &str| t.token_to_id(tok);
    if let Some(tok) = eot {
        return id_of(tok).map(|id| (tok.to_string(), id)).ok_or_else(|| {
            DataError::InvalidArgument(format!(
                "--eot {tok:?} is not a token of {}; its special tokens are: {}",
                path.display(),
                special_tokens(t)
            ))
        });
    }
    let config = path.with_file_name("tokenizer_config.json");
    if let Ok(text) = std::fs::read_to_string(&config) {
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            DataError::InvalidArgument(format!(
                "{} does not parse ({e}): it names the end-of-text token; fix it, or name the token with --eot",
                config.display()
            ))
        })?;
        let eos = value.get("eos_token").and_then(|v| v.as_str().or_else(|| v.get("content")?.as_str()));
        if let Some(tok) = eos {
            return id_of(tok).map(|id| (tok.to_string(), id)).ok_or_else(|| {
                DataError::InvalidArgument(format!(
                    "{} names eos_token {tok:?}, which {} does not hold; name the end-of-text token with --eot",
                    config.display(),
                    path.display()
                ))
            });
        }
    }
    KNOWN_EOT.iter().find_map(|tok| id_of(tok).map(|id| (tok.to_string(), id))).ok_or_else(|| {
        DataError::InvalidArgument(format!(
            "cannot tell which token of {} ends a document: it has none of {} and no tokenizer_config.json beside it \
             names an eos_token; name it with --eot TOKEN (its special tokens are: {})",
            path.display(),
            KNOWN_EOT.join(", "),
            special_tokens(t)
        ))
    })
}

/// The added tokens marked special, for error messages (the first 12).
fn special_tokens(t: &tokenizers::Tokenizer) -> String {
    let mut specials: Vec<(u32, String)> =
        t.get_added_tokens_decoder().into_iter().filter(|(_, a)| a.special).map(|(id, a)| (id, a.content)).collect();
    specials.sort();
    if specials.is_empty() {
        return "none".into();
    }
    let shown: Vec<String> = specials.iter().take(12).map(|(id, c)| format!("{c} ({id})")).collect();
    let more = specials.len().saturating_sub(12);
    if more > 0 {
        format!("{} and {more} more", shown.join(", "))
    } else {
        shown.join(", ")
    }
}

/// The fingerprint of the `tokenizer.json` at `path` (or in the folder `path`) and its
/// name: what the launcher compares with the shards' record.
pub fn fingerprint_file(path: &Path) -> Result<(u64, String)> {
    let loaded = load_file(path)?;
    let inner = Inner::Hf(Box::new(loaded.tokenizer));
    Ok((fingerprint(&inner, loaded.vocab_size)?, loaded.name))
}

/// Text that exercises what tokenizers disagree on: contractions, digit runs, code and
/// indentation, whitespace runs, punctuation, accents and many scripts. Never change it:
/// recorded fingerprints would no longer match.
const PROBE: &str = "The quick brown fox didn't jump; it's 12345678 metres (3.14159e-2 km) away!\n\n\
    def f(x):\n\tif x >= 10_000:\n        return {\"a\": [1, 2, 3]}  # ok\n    return None\r\n\
    Ünïcödé café naïve façade — “quotes” ‘single’ … ¿Qué tal? ¡Muy bien!\n\
    Привет, мир. Γειά σου κόσμε. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया. 你好，世界。こんにちは世界。안녕하세요 세계.\n\
    emoji 🦀🚀👍🏽 and symbols ∑∫√≈≠≤≥ ©®™ €£¥ ½ ¾ ⅓\n\
    https://example.com/path?query=1&x=y#frag user@example.org   trailing spaces   \n\
    ALLCAPS camelCase snake_case kebab-case 'tis I'll we've they're you'd she'll\n\
    1 22 333 4444 55555 666666 0.5 -7 +8 1e10 0x1F 2024-11-25 12:34:56\n   \n\t\t\n";

fn fingerprint(inner: &Inner, vocab_size: u32) -> Result<u64> {
    let ids = encode(inner, PROBE)?;
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&vocab_size.to_le_bytes());
    for id in ids {
        eat(&id.to_le_bytes());
    }
    Ok(h)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small `tokenizer.json`: a WordLevel model over whitespace-split words, with
    /// `<|endoftext|>` as an added special token (id 5).
    pub(crate) const TINY_TOKENIZER: &str = r#"{
      "version": "1.0",
      "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
      "padding": null,
      "added_tokens": [{"id": 5, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true}],
      "normalizer": null,
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": null,
      "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "fox": 3, "owl": 4,
                "<|endoftext|>": 5}, "unk_token": "[UNK]"}
    }"#;

    #[test]
    fn the_built_in_gpt2_is_tiktoken_r50k_with_endoftext_as_text() {
        let t = Tokenizer::load(&TokenizerSpec::Gpt2, None).unwrap();
        let s = t.stamp();
        assert_eq!((s.name.as_str(), s.vocab_size, s.eot_id), ("gpt2", 50257, 50256));
        assert_eq!(t.encode("Hello world").unwrap(), [15496, 995]);
        // A special-token string inside a document is text, not the separator.
        assert!(!t.encode("a<|endoftext|>b").unwrap().contains(&50256));
        assert!(Tokenizer::load(&TokenizerSpec::Gpt2, Some("</s>")).is_err());
        assert_eq!(Tokenizer::load(&TokenizerSpec::Gpt2, None).unwrap().stamp(), s, "deterministic");
    }

    #[test]
    fn a_tokenizer_json_loads_without_truncation_and_finds_its_end_of_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, TINY_TOKENIZER).unwrap();
        // The folder works as well as the file.
        let t = Tokenizer::load(&TokenizerSpec::File(dir.path().to_owned()), None).unwrap();
        let s = t.stamp().clone();
        assert_eq!((s.vocab_size, s.eot_id, s.eot_token.as_str()), (6, 5, "<|endoftext|>"));
        assert!(s.name.ends_with("/tokenizer.json") && s.file_sha256.as_ref().unwrap().len() == 64, "{s:?}");
        // The file asks for truncation at 2 tokens: switched off, documents are never cut.
        assert_eq!(t.encode("hello world fox owl").unwrap(), [1, 2, 3, 4]);
        assert_eq!(t.encode("hello <|endoftext|> owl").unwrap()[1], 0, "special text is not the separator");
        // Its fingerprint differs from GPT-2's; the launcher's reader agrees with the stamp.
        let gpt2 = Tokenizer::load(&TokenizerSpec::Gpt2, None).unwrap();
        assert_ne!(s.fingerprint, gpt2.stamp().fingerprint);
        let (fp, name) = fingerprint_file(&path).unwrap();
        assert_eq!((format!("{fp:016x}"), name), (s.fingerprint.clone(), s.name.clone()));

        // --eot, and a tokenizer_config.json's eos_token, choose another token.
        let t = Tokenizer::load(&TokenizerSpec::File(path.clone()), Some("owl")).unwrap();
        assert_eq!(t.stamp().eot_id, 4);
        let e = Tokenizer::load(&TokenizerSpec::File(path.clone()), Some("<eos>")).unwrap_err();
        assert!(e.to_string().contains("<|endoftext|> (5)"), "lists the special tokens: {e}");
        std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"eos_token": {"content": "fox"}}"#).unwrap();
        assert_eq!(Tokenizer::load(&TokenizerSpec::File(path.clone()), None).unwrap().stamp().eot_id, 3);
        std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();

        // No known end-of-text token and no --eot: refused, naming the choice.
        let no_eot = TINY_TOKENIZER.replace("<|endoftext|>", "<|sep|>");
        std::fs::write(&path, no_eot).unwrap();
        let e = Tokenizer::load(&TokenizerSpec::File(path.clone()), None).unwrap_err();
        assert!(e.to_string().contains("--eot TOKEN") && e.to_string().contains("<|sep|> (5)"), "{e}");

        std::fs::write(&path, "{ not json").unwrap();
        let e = Tokenizer::load(&TokenizerSpec::File(path.clone()), None).unwrap_err();
        assert!(e.to_string().contains("is not a Hugging Face tokenizer.json"), "{e}");
        let e = Tokenizer::load(&TokenizerSpec::File(dir.path().join("nope.json")), None).unwrap_err();
        assert!(e.to_string().contains("does not exist") && e.to_string().contains("gpt2"), "{e}");
    }
}
