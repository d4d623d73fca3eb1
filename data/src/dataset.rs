//! A dataset: the sorted set of token shards of one split (train or val), plus the
//! sequential fixed-window walk over it used for evaluation loss.
//!
//! `Dataset::open` accepts a directory (llm.c convention: shards whose file name
//! contains `train` or `val`, e.g. `name_train_000000.bin`, `name_val_000000.bin`),
//! a single shard file, or a pattern with `*`/`?` in its file name (`dir/name_train_*.bin`).
//! Shards of both widths may be mixed; shards whose headers name different tokenizers may
//! not ([`DataError::MixedTokenizers`]).

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{io_err, DataError, Result};
use crate::ids::Ids;
use crate::shard::{ShardInfo, TokenShard};

/// Which half of a prepared dataset to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// Training shards: file names containing `train`.
    Train,
    /// Validation shards: file names containing `val`.
    Val,
}

impl Split {
    /// The word a shard's file name must contain to belong to this split.
    pub fn word(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Val => "val",
        }
    }

    /// Whether `file_name` belongs to this split: a `.bin` file, not hidden, whose name
    /// contains the split word as a whole word (delimited by non-alphanumerics), so
    /// `interval_train_000000.bin` is a train shard and not a val one.
    pub fn matches(self, file_name: &str) -> bool {
        if file_name.starts_with('.') || !file_name.ends_with(".bin") {
            return false;
        }
        let word = self.word();
        let bytes = file_name.as_bytes();
        file_name.match_indices(word).any(|(i, _)| {
            let before = i.checked_sub(1).map(|j| bytes[j]);
            let after = bytes.get(i + word.len()).copied();
            !before.is_some_and(|b| b.is_ascii_alphanumeric()) && !after.is_some_and(|b| b.is_ascii_alphanumeric())
        })
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.word())
    }
}

/// The shards of one split, memory-mapped, in sorted file-name order.
#[derive(Debug)]
pub struct Dataset {
    source: PathBuf,
    split: Split,
    shards: Vec<TokenShard>,
    max_token: OnceLock<u32>,
}

impl Dataset {
    /// Open the `split` shards of `path`.
    ///
    /// * a directory: every `.bin` file whose name contains the split word, sorted;
    /// * a single file: that shard, whatever the split (a one-file dataset serves both);
    /// * a pattern whose file name holds `*` or `?`: the matching files in its directory,
    ///   sorted, whatever the split.
    ///
    /// Every shard is validated (see [`TokenShard::open`]).
    pub fn open(path: impl AsRef<Path>, split: Split) -> Result<Dataset> {
        let path = path.as_ref();
        let files = if path.is_dir() {
            let files = list_dir(path, |name| split.matches(name))?;
            if files.is_empty() {
                return Err(DataError::NoShards {
                    dir: path.to_owned(),
                    split: split.to_string(),
                    expected: format!(
                        "`<name>_{w}_000000.bin`, `<name>_{w}_000001.bin`, ... (`.bin` files whose name contains \"{w}\")",
                        w = split.word()
                    ),
                });
            }
            files
        } else if path.exists() {
            vec![path.to_owned()]
        } else if let Some(pattern) = path.file_name().and_then(|n| n.to_str()).filter(|n| n.contains(['*', '?'])) {
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            if !dir.is_dir() {
                return Err(DataError::NotFound { path: dir.to_owned() });
            }
            let files = list_dir(dir, |name| !name.starts_with('.') && wildcard_match(pattern, name))?;
            if files.is_empty() {
                return Err(DataError::NoShards {
                    dir: dir.to_owned(),
                    split: split.to_string(),
                    expected: format!("`{pattern}`"),
                });
            }
            files
        } else {
            return Err(DataError::NotFound { path: path.to_owned() });
        };
        let shards = files.iter().map(TokenShard::open).collect::<Result<Vec<_>>>()?;
        let dataset = Dataset { source: path.to_owned(), split, shards, max_token: OnceLock::new() };
        dataset.tokenizer()?;
        Ok(dataset)
    }

    /// Build a dataset from shards already opened (kept in the given order).
    pub fn from_shards(source: impl Into<PathBuf>, split: Split, shards: Vec<TokenShard>) -> Dataset {
        Dataset { source: source.into(), split, shards, max_token: OnceLock::new() }
    }

    /// The path this dataset was opened from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The split this dataset holds.
    pub fn split(&self) -> Split {
        self.split
    }

    /// The shards, in order.
    pub fn shards(&self) -> &[TokenShard] {
        &self.shards
    }

    /// Tokens over all shards.
    pub fn total_tokens(&self) -> usize {
        self.shards.iter().map(TokenShard::len).sum()
    }

    /// The largest token id present (0 for an empty dataset): from the headers of shards
    /// that record it, by scanning the others (once, then cached); compare it against the
    /// model's vocabulary size.
    pub fn max_token(&self) -> u32 {
        *self.max_token.get_or_init(|| self.shards.iter().filter_map(TokenShard::max_id).max().unwrap_or(0))
    }

    /// The tokenizer record its shards share (`None` when no shard has one: llm.c's or
    /// older shards); errors when two shards name different tokenizers.
    pub fn tokenizer(&self) -> Result<Option<&ShardInfo>> {
        let mut first: Option<&TokenShard> = None;
        for s in &self.shards {
            let Some(info) = s.info() else { continue };
            match first {
                None => first = Some(s),
                Some(f) => {
                    let theirs = f.info().map_or(0, |i| i.fingerprint);
                    if theirs != info.fingerprint {
                        return Err(DataError::MixedTokenizers {
                            dir: self.source.clone(),
                            first: f.path().display().to_string(),
                            first_name: f.info().map(|i| i.tokenizer.clone()).unwrap_or_default(),
                            second: s.path().display().to_string(),
                            second_name: info.tokenizer.clone(),
                        });
                    }
                }
            }
        }
        Ok(first.and_then(TokenShard::info))
    }

    /// Walk the shards in order in fixed, non-overlapping windows of `seq_len` tokens
    /// (each with its `seq_len` next-token targets), grouped into batches of `micro_batch`
    /// rows; stops after `max_batches` batches or when fewer than `micro_batch` windows
    /// remain. Deterministic and independent of any seed: for evaluation loss.
    ///
    /// Errors if `micro_batch` or `seq_len` is 0, or if the data cannot fill one batch.
    pub fn val_batches(&self, micro_batch: usize, seq_len: usize, max_batches: usize) -> Result<ValBatches<'_>> {
        if micro_batch == 0 || seq_len == 0 {
            return Err(DataError::InvalidArgument(format!(
                "val_batches needs micro_batch >= 1 and seq_len >= 1 (got {micro_batch} and {seq_len})"
            )));
        }
        let windows: usize = self.shards.iter().map(|s| s.len().saturating_sub(1) / seq_len).sum();
        let available = windows / micro_batch;
        if available == 0 {
            let needed = micro_batch.saturating_mul(seq_len).saturating_add(1);
            return Err(DataError::SplitTooShort {
                dir: self.source.clone(),
                split: self.split.to_string(),
                tokens: self.total_tokens(),
                needed,
                micro_batch,
                seq_len,
            });
        }
        Ok(ValBatches {
            dataset: self,
            micro_batch,
            seq_len,
            remaining: available.min(max_batches),
            shard: 0,
            offset: 0,
        })
    }
}

/// List the files of `dir` whose name passes `keep`, sorted by file name.
fn list_dir(dir: &Path, keep: impl Fn(&str) -> bool) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err("list the directory", dir))? {
        let entry = entry.map_err(io_err("list the directory", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if keep(name) && entry.path().is_file() {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

/// Shell-style match of `name` against `pattern` (`*` = any run, `?` = any one character).
pub(crate) fn wildcard_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            backtrack = Some((pi, ni));
            pi += 1;
        } else if let Some((bp, bn)) = backtrack {
            pi = bp + 1;
            ni = bn + 1;
            backtrack = Some((bp, bn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// One evaluation batch: `micro_batch * seq_len` inputs and their next-token targets, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValBatch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

/// Iterator over evaluation batches; see [`Dataset::val_batches`].
#[derive(Debug)]
pub struct ValBatches<'a> {
    dataset: &'a Dataset,
    micro_batch: usize,
    seq_len: usize,
    remaining: usize,
    shard: usize,
    offset: usize,
}

impl ValBatches<'_> {
    /// Fill caller-owned buffers (each `micro_batch * seq_len` long) with the next batch;
    /// false when the walk is over. Avoids the allocation of [`Iterator::next`].
    pub fn next_into(&mut self, inputs: &mut [u32], targets: &mut [u32]) -> Result<bool> {
        let n = self.micro_batch * self.seq_len;
        if inputs.len() != n || targets.len() != n {
            return Err(DataError::InvalidArgument(format!(
                "val batch buffers must hold micro_batch * seq_len = {n} tokens (got {} inputs, {} targets)",
                inputs.len(),
                targets.len()
            )));
        }
        if self.remaining == 0 {
            return Ok(false);
        }
        let t = self.seq_len;
        for (inp, tgt) in inputs.chunks_exact_mut(t).zip(targets.chunks_exact_mut(t)) {
            // `remaining` was bounded by the number of whole windows, so one exists.
            while self.offset + t + 1 > self.dataset.shards[self.shard].len() {
                self.shard += 1;
                self.offset = 0;
            }
            let window = self.dataset.shards[self.shard].ids().slice(self.offset..self.offset + t + 1);
            fill_row(window, inp, tgt);
            self.offset += t;
        }
        self.remaining -= 1;
        Ok(true)
    }
}

impl Iterator for ValBatches<'_> {
    type Item = ValBatch;

    fn next(&mut self) -> Option<ValBatch> {
        let n = self.micro_batch * self.seq_len;
        let mut b = ValBatch { inputs: vec![0; n], targets: vec![0; n] };
        // Buffers are sized right, so `next_into` cannot fail.
        match self.next_into(&mut b.inputs, &mut b.targets) {
            Ok(true) => Some(b),
            _ => None,
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl ExactSizeIterator for ValBatches<'_> {}

/// `window` holds `seq_len + 1` tokens: inputs are the first `seq_len`, targets the last.
/// One match on the width per row; each arm is the plain copy loop.
pub(crate) fn fill_row(window: Ids<'_>, inputs: &mut [u32], targets: &mut [u32]) {
    let n = inputs.len();
    window.slice(0..n).copy_to_u32(inputs);
    window.slice(1..n + 1).copy_to_u32(targets);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::write_shard;

    fn seq(start: u16, n: usize) -> Vec<u16> {
        (0..n).map(|i| start + i as u16).collect()
    }

    #[test]
    fn split_word_matching() {
        assert!(Split::Train.matches("fineweb_train_000001.bin"));
        assert!(Split::Val.matches("fineweb_val_000000.bin"));
        assert!(Split::Val.matches("tiny_shakespeare_val.bin"));
        assert!(Split::Train.matches("interval_train_000000.bin"));
        assert!(!Split::Val.matches("interval_train_000000.bin"));
        assert!(!Split::Train.matches("x_train_000000.txt"));
        assert!(!Split::Train.matches(".x_train_000000.bin.tmp-1"));
    }

    #[test]
    fn wildcards() {
        assert!(wildcard_match("a_train_*.bin", "a_train_000001.bin"));
        assert!(wildcard_match("*", "anything"));
        assert!(wildcard_match("a?c*", "abcdef"));
        assert!(!wildcard_match("a_train_*.bin", "a_val_000000.bin"));
        assert!(!wildcard_match("*.bin", "x.bin.tmp"));
    }

    #[test]
    fn open_directory_file_and_pattern() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write_shard(d.join("n_train_000001.bin"), &seq(100, 20)).unwrap();
        write_shard(d.join("n_train_000000.bin"), &seq(0, 10)).unwrap();
        write_shard(d.join("n_val_000000.bin"), &seq(500, 7)).unwrap();
        fs::write(d.join("notes.txt"), "not a shard").unwrap();

        let train = Dataset::open(d, Split::Train).unwrap();
        assert_eq!(train.shards().len(), 2);
        assert!(train.shards()[0].path().ends_with("n_train_000000.bin"), "sorted order");
        assert_eq!(train.total_tokens(), 30);
        assert_eq!(train.max_token(), 119);
        let val = Dataset::open(d, Split::Val).unwrap();
        assert_eq!((val.total_tokens(), val.max_token()), (7, 506));

        let one = Dataset::open(d.join("n_train_000001.bin"), Split::Val).unwrap();
        assert_eq!(one.total_tokens(), 20);
        let pat = Dataset::open(d.join("n_*_000000.bin"), Split::Train).unwrap();
        assert_eq!(pat.total_tokens(), 17);
    }

    #[test]
    fn widths_mix_but_tokenizers_do_not() {
        use crate::shard::write_shard_ids;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let info = |fp: u64, max: u32| ShardInfo {
            vocab_size: 200_000,
            eot_id: 1,
            max_id: Some(max),
            fingerprint: fp,
            tokenizer: format!("tok{fp}"),
        };
        write_shard_ids(d.join("a_train_000000.bin"), Ids::U32(&[1, 150_000, 3]), Some(&info(7, 150_000)), None)
            .unwrap();
        write_shard(d.join("b_train_000000.bin"), &seq(10, 5)).unwrap();
        let train = Dataset::open(d, Split::Train).unwrap();
        assert_eq!((train.total_tokens(), train.max_token()), (8, 150_000));
        assert_eq!(train.tokenizer().unwrap().map(|i| i.fingerprint), Some(7));
        let (mut inp, mut tgt) = (vec![0; 2], vec![0; 2]);
        fill_row(train.shards()[0].ids(), &mut inp, &mut tgt);
        assert_eq!((inp, tgt), (vec![1, 150_000], vec![150_000, 3]));
        write_shard_ids(d.join("c_train_000000.bin"), Ids::U16(&[1, 2]), Some(&info(8, 2)), None).unwrap();
        let e = Dataset::open(d, Split::Train).unwrap_err();
        assert!(matches!(e, DataError::MixedTokenizers { .. }), "{e}");
        assert!(e.to_string().contains("tok7") && e.to_string().contains("tok8"), "{e}");
    }

    #[test]
    fn no_matching_shards_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        write_shard(dir.path().join("n_train_000000.bin"), &seq(0, 10)).unwrap();
        let e = Dataset::open(dir.path(), Split::Val).unwrap_err();
        assert!(matches!(e, DataError::NoShards { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        assert!(msg.contains("_val_000000.bin") && msg.contains("launcher prepare-data"), "{msg}");

        let e = Dataset::open(dir.path().join("missing"), Split::Train).unwrap_err();
        assert!(matches!(e, DataError::NotFound { .. }), "{e}");
        let e = Dataset::open(dir.path().join("zz_*.bin"), Split::Train).unwrap_err();
        assert!(matches!(e, DataError::NoShards { .. }), "{e}");
    }

    #[test]
    fn corrupt_shard_in_directory_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("n_train_000000.bin"), b"hello").unwrap();
        let e = Dataset::open(dir.path(), Split::Train).unwrap_err();
        assert!(matches!(e, DataError::ShortHeader { .. }), "{e}");
    }

    #[test]
    fn val_batches_walk_sequential_windows() {
        let dir = tempfile::tempdir().unwrap();
        // Shard A: 25 tokens -> 3 windows of 8 (needs 9 tokens each step: 0..9, 8..17, 16..25).
        write_shard(dir.path().join("n_val_000000.bin"), &seq(0, 25)).unwrap();
        // Shard B: 9 tokens -> 1 window.
        write_shard(dir.path().join("n_val_000001.bin"), &seq(1000, 9)).unwrap();
        let ds = Dataset::open(dir.path(), Split::Val).unwrap();
        let batches: Vec<ValBatch> = ds.val_batches(2, 8, usize::MAX).unwrap().collect();
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].inputs[..8], (0..8).collect::<Vec<u32>>()[..]);
        assert_eq!(batches[0].targets[..8], (1..9).collect::<Vec<u32>>()[..]);
        assert_eq!(batches[0].inputs[8..], (8..16).collect::<Vec<u32>>()[..]);
        assert_eq!(batches[1].inputs[..8], (16..24).collect::<Vec<u32>>()[..]);
        assert_eq!(batches[1].inputs[8..], (1000..1008).collect::<Vec<u32>>()[..]);
        assert_eq!(batches[1].targets[8..], (1001..1009).collect::<Vec<u32>>()[..]);
        assert_eq!(ds.val_batches(2, 8, 1).unwrap().len(), 1);
        // Deterministic: a second walk is identical.
        let again: Vec<ValBatch> = ds.val_batches(2, 8, usize::MAX).unwrap().collect();
        assert_eq!(batches, again);
        let e = ds.val_batches(8, 8, 10).unwrap_err();
        assert!(matches!(e, DataError::SplitTooShort { .. }), "{e}");
    }
}
