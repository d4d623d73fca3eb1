//! `dataset.json`: which inputs a directory of token shards was prepared from.
//!
//! Every shard of a directory is trained on ([`crate::Dataset::open`] takes every `*train*`
//! shard), so preparing more inputs into a directory that holds shards mixes the two
//! datasets: [`crate::prepare()`] refuses it unless asked to append
//! ([`crate::prepare::Existing::Append`]), and records every source here: its input files
//! (path, size, a hash), the tokenizer (name, file and SHA-256, vocabulary size,
//! end-of-text id, fingerprint), the options, the document and token counts, the records
//! skipped (counts and the first of each kind) and the shard files. Shards found without a
//! record (prepared before this file existed, or by llm.c's scripts) are recorded at the
//! first append as sources of unknown origin, one per shard name. Records of format 1
//! (one text file per source, no tokenizer) still read.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::dataset::Split;
use crate::documents::TxtDocs;
use crate::error::{io_err, DataError, Result};
use crate::inputs::InputFile;
use crate::prepare::{BadReport, OnBad};
use crate::shard::TokenShard;
use crate::tokenizer::TokenizerStamp;

/// The record's file name in a prepared directory.
pub const SOURCES_FILE: &str = "dataset.json";
/// The layout written now (2: several inputs, tokenizer, options, skipped records);
/// format 1 records read as sources without those.
pub const FORMAT: u32 = 2;
/// Inputs up to this size are hashed whole; larger ones by their first and last MiB and size.
const WHOLE_HASH_BYTES: u64 = 2 << 20;

/// Every source of a prepared directory, in the order they were added.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sources {
    pub format: u32,
    pub sources: Vec<Source>,
}

/// One prepared text (or, with `input` unset, shards found without a record).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Source {
    /// The shard name prefix: `<name>_train_000000.bin`, `<name>_val_000000.bin`, ...
    pub name: String,
    /// The input file when there is one, absolute; `None` for several inputs (see
    /// `inputs`) and for shards of unknown origin.
    pub input: Option<PathBuf>,
    pub input_bytes: Option<u64>,
    /// FNV-1a (64 bits) of the input, hex (see [`InputRecord::fnv1a64`]).
    pub input_fnv1a64: Option<String>,
    /// Every input file, in the order read.
    #[serde(default)]
    pub inputs: Vec<InputRecord>,
    pub documents: Option<usize>,
    #[serde(default)]
    pub val_documents: Option<u64>,
    pub train_tokens: usize,
    pub val_tokens: usize,
    /// Its shard files (names in the directory).
    pub files: Vec<String>,
    /// When it was prepared (seconds since the Unix epoch).
    pub prepared_unix: Option<u64>,
    /// The tokenizer (`None`: unknown origin, or format 1).
    #[serde(default)]
    pub tokenizer: Option<TokenizerStamp>,
    /// Records that were not documents.
    #[serde(default)]
    pub bad: Option<BadReport>,
    #[serde(default)]
    pub options: Option<SourceOptions>,
}

/// The options a source was prepared with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceOptions {
    pub text_field: String,
    #[serde(with = "txt_docs_serde")]
    pub txt_docs: TxtDocs,
    #[serde(with = "on_bad_serde")]
    pub on_bad: OnBad,
    pub val_fraction: f64,
    pub shard_tokens: usize,
}

mod txt_docs_serde {
    use crate::documents::TxtDocs;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    pub fn serialize<S: Serializer>(v: &TxtDocs, s: S) -> Result<S::Ok, S::Error> {
        v.serialize(s)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TxtDocs, D::Error> {
        match String::deserialize(d)?.as_str() {
            "line" => Ok(TxtDocs::Line),
            "paragraph" => Ok(TxtDocs::Paragraph),
            _ => Ok(TxtDocs::File),
        }
    }
}

mod on_bad_serde {
    use crate::prepare::OnBad;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    pub fn serialize<S: Serializer>(v: &OnBad, s: S) -> Result<S::Ok, S::Error> {
        v.serialize(s)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<OnBad, D::Error> {
        Ok(if String::deserialize(d)? == "refuse" { OnBad::Refuse } else { OnBad::Skip })
    }
}

/// One input file of a source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputRecord {
    /// Absolute.
    pub path: PathBuf,
    pub bytes: u64,
    /// FNV-1a (64 bits, hex) of the file as stored: of all of it up to 2 MiB, else of its
    /// first and last MiB and its size (so the check costs no second read of a large corpus).
    pub fnv1a64: String,
}

impl InputRecord {
    /// The record of `file` (reads at most 2 MiB of it).
    pub fn of(file: &InputFile) -> Result<InputRecord> {
        use std::io::{Read, Seek, SeekFrom};
        let path = &file.path;
        let mut f = fs::File::open(path).map_err(io_err("open", path))?;
        let mut bytes = Vec::new();
        if file.bytes <= WHOLE_HASH_BYTES {
            f.read_to_end(&mut bytes).map_err(io_err("read", path))?;
        } else {
            let mib = 1 << 20;
            let mut head = vec![0u8; mib];
            f.read_exact(&mut head).map_err(io_err("read", path))?;
            f.seek(SeekFrom::End(-(mib as i64))).map_err(io_err("read", path))?;
            let mut tail = vec![0u8; mib];
            f.read_exact(&mut tail).map_err(io_err("read", path))?;
            bytes = head;
            bytes.extend_from_slice(&tail);
            bytes.extend_from_slice(&file.bytes.to_le_bytes());
        }
        Ok(InputRecord {
            path: std::path::absolute(path).unwrap_or_else(|_| path.clone()),
            bytes: file.bytes,
            fnv1a64: fnv1a64(&bytes),
        })
    }
}

impl Sources {
    /// The record of `dir` (empty when it has none).
    pub fn read(dir: &Path) -> Result<Sources> {
        let path = dir.join(SOURCES_FILE);
        match fs::read(&path) {
            Ok(text) => serde_json::from_slice(&text).map_err(|e| {
                DataError::InvalidArgument(format!(
                    "{} does not parse ({e}): it records the sources of the shards beside it; restore it, or \
                     prepare into a new directory",
                    path.display()
                ))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Sources { format: FORMAT, sources: vec![] }),
            Err(e) => Err(io_err("read", path)(e)),
        }
    }

    /// Write the record into `dir` (atomically: a temporary file renamed).
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(SOURCES_FILE);
        let tmp = dir.join(format!(".{SOURCES_FILE}.partial"));
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| DataError::InvalidArgument(format!("cannot encode {}: {e}", path.display())))?;
        fs::write(&tmp, text + "\n").map_err(io_err("write", &tmp))?;
        fs::rename(&tmp, &path).map_err(io_err("rename a temporary file to", &path))
    }

    /// The first recorded source holding one of `inputs` (same size and hash): its name
    /// and the input.
    pub fn holds_any(&self, inputs: &[InputRecord]) -> Option<(String, PathBuf)> {
        for s in &self.sources {
            let mut theirs: Vec<(u64, &str)> = s.inputs.iter().map(|i| (i.bytes, i.fnv1a64.as_str())).collect();
            if let (Some(b), Some(h)) = (s.input_bytes, s.input_fnv1a64.as_deref()) {
                theirs.push((b, h));
            }
            if let Some(i) = inputs.iter().find(|i| theirs.contains(&(i.bytes, i.fnv1a64.as_str()))) {
                return Some((s.name.clone(), i.path.clone()));
            }
        }
        None
    }

    /// Record the shards of `found` that no source lists, one source per shard name.
    pub fn add_unrecorded(&mut self, dir: &Path, found: &[String]) -> Result<()> {
        let recorded: Vec<&String> = self.sources.iter().flat_map(|s| &s.files).collect();
        let mut loose: Vec<&String> = found.iter().filter(|f| !recorded.contains(f)).collect();
        loose.sort();
        let mut names: Vec<String> = loose.iter().map(|f| shard_prefix(f)).collect();
        names.dedup();
        for name in names {
            let mut source = Source {
                name: name.clone(),
                input: None,
                input_bytes: None,
                input_fnv1a64: None,
                inputs: vec![],
                documents: None,
                val_documents: None,
                train_tokens: 0,
                val_tokens: 0,
                files: vec![],
                prepared_unix: None,
                tokenizer: None,
                bad: None,
                options: None,
            };
            for f in loose.iter().filter(|f| shard_prefix(f) == name) {
                let tokens = TokenShard::open(dir.join(f.as_str()))?.len();
                if Split::Val.matches(f) {
                    source.val_tokens += tokens;
                } else {
                    source.train_tokens += tokens;
                }
                source.files.push(f.to_string());
            }
            self.sources.push(source);
        }
        Ok(())
    }
}

/// The token shards (of either split) directly in `dir`, by file name, sorted (their
/// `.idx` sidecars are not shards).
pub fn shards_in(dir: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(io_err("list the directory", dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io_err("list the directory", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if Split::Train.matches(&name) || Split::Val.matches(&name) {
            found.push(name);
        }
    }
    found.sort();
    Ok(found)
}

/// "12 shards: story_* (6), other_* (6)".
pub fn describe(found: &[String]) -> String {
    let mut names: Vec<String> = found.iter().map(|f| shard_prefix(f)).collect();
    names.sort();
    let mut groups: Vec<(String, usize)> = Vec::new();
    for n in names {
        match groups.last_mut() {
            Some((last, count)) if *last == n => *count += 1,
            _ => groups.push((n, 1)),
        }
    }
    let list: Vec<String> = groups.iter().map(|(n, c)| format!("{n}_* ({c})")).collect();
    format!("{} shard{}: {}", found.len(), if found.len() == 1 { "" } else { "s" }, list.join(", "))
}

/// The name a shard file was prepared under: what comes before `_train_` / `_val_`.
pub fn shard_prefix(file: &str) -> String {
    ["_train_", "_val_"]
        .iter()
        .filter_map(|sep| file.find(sep))
        .min()
        .map_or_else(|| file.trim_end_matches(".bin").to_string(), |i| file[..i].to_string())
}

/// FNV-1a, 64 bits, as 16 hex digits.
pub fn fnv1a64(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_group_by_prefix() {
        assert_eq!(shard_prefix("story_train_000001.bin"), "story");
        assert_eq!(shard_prefix("fineweb_val_000000.bin"), "fineweb");
        assert_eq!(shard_prefix("interval_train_000000.bin"), "interval");
        assert_eq!(shard_prefix("train.bin"), "train");
        let found: Vec<String> =
            ["a_train_000000.bin", "a_val_000000.bin", "b_train_000000.bin"].iter().map(|s| s.to_string()).collect();
        assert_eq!(describe(&found), "3 shards: a_* (2), b_* (1)");
        assert_eq!(fnv1a64(b""), "cbf29ce484222325");
    }

    #[test]
    fn format_1_records_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let old = r#"{"format": 1, "sources": [{"name": "a", "input": "/x/a.txt", "input_bytes": 5,
            "input_fnv1a64": "00000000000000aa", "documents": 1, "train_tokens": 4, "val_tokens": 1,
            "files": ["a_train_000000.bin"], "prepared_unix": 1}]}"#;
        fs::write(dir.path().join(SOURCES_FILE), old).unwrap();
        let r = Sources::read(dir.path()).unwrap();
        assert_eq!((r.sources[0].tokenizer.as_ref(), r.sources[0].inputs.len()), (None, 0));
        // The same file again (size and hash) is found through the old fields.
        let again = InputRecord { path: "/y/a.txt".into(), bytes: 5, fnv1a64: "00000000000000aa".into() };
        assert_eq!(r.holds_any(&[again]), Some(("a".to_string(), PathBuf::from("/y/a.txt"))));
    }
}
