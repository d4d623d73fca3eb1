//! Streaming one split's token ids into numbered shards: `<name>_<split>_000000.bin`,
//! `..._000001.bin`, ... of `shard_tokens` ids each (the last one shorter), each with its
//! header record ([`crate::shard::ShardInfo`]) and its document index (`.idx`).
//!
//! A shard is cut at exactly `shard_tokens` ids, as llm.c's scripts cut theirs, so a
//! document may begin in one shard and end in the next: the next shard's index then does
//! not start at 0. Only the shard being filled is held in memory.

use std::path::{Path, PathBuf};

use crate::dataset::Split;
use crate::error::{DataError, Result};
use crate::ids::{Ids, Width};
use crate::shard::write_shard_ids;
use crate::tokenizer::TokenizerStamp;

/// `<name>_<split>_<index as 6 digits>.bin`.
pub fn shard_name(name: &str, split: Split, index: usize) -> String {
    format!("{name}_{}_{index:06}.bin", split.word())
}

enum Buf {
    U16(Vec<u16>),
    U32(Vec<u32>),
}

impl Buf {
    fn len(&self) -> usize {
        match self {
            Buf::U16(v) => v.len(),
            Buf::U32(v) => v.len(),
        }
    }
}

/// One split's shards, written as ids arrive.
pub(crate) struct SplitWriter {
    dir: PathBuf,
    name: String,
    split: Split,
    shard_tokens: usize,
    stamp: TokenizerStamp,
    buf: Buf,
    starts: Vec<u64>,
    max_id: Option<u32>,
    /// Shards written so far, in order.
    pub files: Vec<PathBuf>,
    /// Ids written or buffered.
    pub tokens: u64,
    /// Documents begun.
    pub documents: u64,
}

impl SplitWriter {
    /// Shards of `split` named `name` in `dir`, ids stored in the width `stamp`'s vocabulary needs.
    pub(crate) fn new(dir: &Path, name: &str, split: Split, shard_tokens: usize, stamp: &TokenizerStamp) -> Self {
        let buf = match Width::for_vocab(stamp.vocab_size) {
            Width::U16 => Buf::U16(Vec::new()),
            Width::U32 => Buf::U32(Vec::new()),
        };
        SplitWriter {
            dir: dir.to_owned(),
            name: name.to_owned(),
            split,
            shard_tokens,
            stamp: stamp.clone(),
            buf,
            starts: Vec::new(),
            max_id: None,
            files: Vec::new(),
            tokens: 0,
            documents: 0,
        }
    }

    /// Append `ids`; with `doc_start`, a document begins at the first of them. Every id
    /// must be below the vocabulary size (checked: a shard never holds an id its header
    /// says cannot occur).
    pub(crate) fn push(&mut self, ids: &[u32], doc_start: bool) -> Result<()> {
        if let Some(&bad) = ids.iter().find(|&&id| id >= self.stamp.vocab_size) {
            return Err(DataError::Tokenizer(format!(
                "{} produced id {bad}, outside its vocabulary of {} ids; the tokenizer file is inconsistent",
                self.stamp.name, self.stamp.vocab_size
            )));
        }
        if doc_start && !ids.is_empty() {
            self.starts.push(self.buf.len() as u64);
            self.documents += 1;
        }
        let mut rest = ids;
        while !rest.is_empty() {
            let room = self.shard_tokens - self.buf.len();
            let (now, later) = rest.split_at(room.min(rest.len()));
            if let Some(m) = now.iter().copied().max() {
                self.max_id = Some(self.max_id.map_or(m, |x| x.max(m)));
            }
            match &mut self.buf {
                // Ids of a u16 writer are below its vocabulary of at most 65536 (checked above).
                Buf::U16(v) => v.extend(now.iter().map(|&id| id as u16)),
                Buf::U32(v) => v.extend_from_slice(now),
            }
            self.tokens += now.len() as u64;
            rest = later;
            if self.buf.len() == self.shard_tokens {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.buf.len() == 0 {
            return Ok(());
        }
        let path = self.dir.join(shard_name(&self.name, self.split, self.files.len()));
        let info = self.stamp.shard_info(self.max_id);
        let ids = match &self.buf {
            Buf::U16(v) => Ids::U16(v),
            Buf::U32(v) => Ids::U32(v),
        };
        write_shard_ids(&path, ids, Some(&info), Some(&self.starts))?;
        self.files.push(path);
        match &mut self.buf {
            Buf::U16(v) => v.clear(),
            Buf::U32(v) => v.clear(),
        }
        self.starts.clear();
        self.max_id = None;
        Ok(())
    }

    /// Write the last, partial shard.
    pub(crate) fn finish(&mut self) -> Result<()> {
        self.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::TokenShard;

    fn stamp(vocab: u32) -> TokenizerStamp {
        TokenizerStamp {
            name: "t".into(),
            file: None,
            file_sha256: None,
            vocab_size: vocab,
            eot_token: "<e>".into(),
            eot_id: 0,
            fingerprint: "00000000000000ab".into(),
        }
    }

    #[test]
    fn documents_spanning_shards_are_indexed_in_each() {
        let dir = tempfile::tempdir().unwrap();
        for vocab in [1000, 100_000] {
            let mut w = SplitWriter::new(dir.path(), &format!("v{vocab}"), Split::Train, 4, &stamp(vocab));
            // Documents of 3, 6 and 1 ids: [0 1 2 | 0 1 2 3 4 5 | 0] → shards of 4.
            w.push(&[0, 1, 2], true).unwrap();
            w.push(&[0], true).unwrap();
            w.push(&[1, 2, 3, 4, 5], false).unwrap();
            w.push(&[0], true).unwrap();
            w.finish().unwrap();
            assert_eq!((w.tokens, w.documents, w.files.len()), (10, 3, 3));
            let shards: Vec<TokenShard> = w.files.iter().map(|f| TokenShard::open(f).unwrap()).collect();
            let ids: Vec<Vec<u32>> = shards.iter().map(|s| s.ids().iter().collect()).collect();
            assert_eq!(ids, [vec![0, 1, 2, 0], vec![1, 2, 3, 4], vec![5, 0]]);
            let starts: Vec<&[u64]> = shards.iter().map(|s| s.doc_starts().unwrap()).collect();
            assert_eq!(starts, [&[0, 3][..], &[][..], &[1][..]]);
            assert_eq!(shards[1].info().unwrap().max_id, Some(4));
            let width = if vocab == 1000 { crate::ids::Width::U16 } else { crate::ids::Width::U32 };
            assert!(shards.iter().all(|s| s.width() == width));
            assert!(w.files[0].ends_with(format!("v{vocab}_train_000000.bin")));
        }
        let mut w = SplitWriter::new(dir.path(), "x", Split::Val, 4, &stamp(10));
        assert!(w.push(&[3, 10], true).unwrap_err().to_string().contains("id 10"));
    }
}
