//! `dataset.json`: which texts a directory of token shards was prepared from.
//!
//! Every shard of a directory is trained on ([`crate::Dataset::open`] takes every `*train*`
//! shard), so preparing a second text into a directory that holds shards mixes the two
//! datasets: [`crate::prepare_text`] refuses it unless asked to append
//! ([`crate::prepare::Existing::Append`]), and records every source here: the input file, its
//! size and FNV-1a hash, the shard name, the token counts and the shard files. Shards found
//! without a record (prepared before this file existed, or by llm.c's scripts) are recorded
//! at the first append as sources of unknown origin, one per shard name.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::dataset::Split;
use crate::error::{io_err, DataError, Result};
use crate::shard::TokenShard;

/// The record's file name in a prepared directory.
pub const SOURCES_FILE: &str = "dataset.json";
/// Bumped when the record's layout changes incompatibly.
const FORMAT: u32 = 1;

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
    /// The input text, absolute; `None` for shards of unknown origin.
    pub input: Option<PathBuf>,
    pub input_bytes: Option<u64>,
    /// FNV-1a (64 bits) of the input, hex: the same text is not appended twice.
    pub input_fnv1a64: Option<String>,
    pub documents: Option<usize>,
    pub train_tokens: usize,
    pub val_tokens: usize,
    /// Its shard files (names in the directory).
    pub files: Vec<String>,
    /// When it was prepared (seconds since the Unix epoch).
    pub prepared_unix: Option<u64>,
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
                documents: None,
                train_tokens: 0,
                val_tokens: 0,
                files: vec![],
                prepared_unix: None,
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

/// The token shards (of either split) directly in `dir`, by file name, sorted.
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
}
