//! Document start offsets of a shard, in a sidecar file beside it: `name.bin` → `name.idx`.
//!
//! Why a sidecar and not the shard's header: llm.c's Llama 3 `.bin` layout has no room
//! for an index (the header is 256 ints; a dataset shard holds millions of documents), and
//! any bytes after the tokens would make llm.c's loaders reject the file (they check the
//! file length against the count). With the index beside it the `.bin` stays
//! byte-compatible with llm.c both ways, and shards made by llm.c's scripts (no `.idx`)
//! simply have no document index.
//!
//! Layout (little-endian): `b"STDOCIDX"`, `u32` version 1, `u32` 0, `u64` the shard's
//! token count, `u64` n, then n `u64` offsets, strictly increasing and below the token
//! count. Offset k is where document k's span begins in this shard: its leading
//! end-of-text token when it has one (every document from `prepare-data` has). A shard
//! whose first offset is not 0 starts with the tail of a document begun in the shard
//! before it; the last document runs to the end of the shard (and may go on in the next).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{io_err, DataError, Result};

/// The sidecar's first 8 bytes.
pub const IDX_MAGIC: &[u8; 8] = b"STDOCIDX";
/// The sidecar layout version.
pub const IDX_VERSION: u32 = 1;
/// Bytes before the offsets.
const IDX_HEADER: usize = 32;

/// The sidecar path of a shard: the same name with `.idx` for `.bin`.
pub fn idx_path(shard: &Path) -> PathBuf {
    shard.with_extension("idx")
}

/// Write the index of a shard of `tokens` tokens whose documents start at `starts` to `path`
/// (a temporary name; the caller renames it into place).
pub(crate) fn write_idx(path: &Path, tokens: u64, starts: &[u64]) -> Result<()> {
    let file = File::create(path).map_err(io_err("create", path))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut head = Vec::with_capacity(IDX_HEADER);
    head.extend_from_slice(IDX_MAGIC);
    head.extend_from_slice(&IDX_VERSION.to_le_bytes());
    head.extend_from_slice(&0u32.to_le_bytes());
    head.extend_from_slice(&tokens.to_le_bytes());
    head.extend_from_slice(&(starts.len() as u64).to_le_bytes());
    w.write_all(&head).map_err(io_err("write", path))?;
    w.write_all(bytemuck::cast_slice(starts)).map_err(io_err("write", path))?;
    let file =
        w.into_inner().map_err(|e| DataError::Io { action: "write", path: path.to_owned(), source: e.into_error() })?;
    file.sync_all().map_err(io_err("flush to disk", path))
}

/// A validated, memory-mapped document index.
#[derive(Debug)]
pub(crate) struct DocIndex {
    mmap: Mmap,
    docs: usize,
}

impl DocIndex {
    /// The index beside `shard` (a shard of `tokens` tokens), `None` when there is none.
    /// A sidecar that does not belong to this shard (another token count, offsets out of
    /// order or past its end) is an error naming both files: a stale index would put
    /// document boundaries in the wrong places.
    pub(crate) fn open_beside(shard: &Path, tokens: u64) -> Result<Option<DocIndex>> {
        let path = idx_path(shard);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("open", &path)(e)),
        };
        let bad = |why: String| DataError::BadDocIndex { idx: path.clone(), shard: shard.to_owned(), why };
        let len = file.metadata().map_err(io_err("read the metadata of", &path))?.len();
        if len < IDX_HEADER as u64 {
            return Err(bad(format!("it is {len} bytes, shorter than its {IDX_HEADER}-byte header")));
        }
        // SAFETY: read-only map of a file written once and renamed into place (never in place).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err("memory-map", &path))?;
        let u64_at = |o: usize| u64::from_le_bytes(mmap[o..o + 8].try_into().unwrap_or([0; 8]));
        if &mmap[..8] != IDX_MAGIC {
            return Err(bad("it does not start with STDOCIDX".into()));
        }
        let version = u32::from_le_bytes(mmap[8..12].try_into().unwrap_or([0; 4]));
        if version != IDX_VERSION {
            return Err(bad(format!("its version is {version}; this build reads version {IDX_VERSION}")));
        }
        if u64_at(16) != tokens {
            return Err(bad(format!("it indexes a shard of {} tokens, but the shard holds {tokens}", u64_at(16))));
        }
        let docs = u64_at(24);
        if Some(len) != docs.checked_mul(8).and_then(|b| b.checked_add(IDX_HEADER as u64)) {
            return Err(bad(format!("{docs} offsets need {} bytes, the file has {len}", IDX_HEADER as u64 + docs * 8)));
        }
        let index = DocIndex { mmap, docs: docs as usize };
        let starts = index.starts();
        if let Some(i) = starts.windows(2).position(|w| w[0] >= w[1]) {
            return Err(bad(format!("offsets {i} and {} are not increasing", i + 1)));
        }
        if starts.last().is_some_and(|&s| s >= tokens) {
            return Err(bad(format!("its last offset is past the shard's {tokens} tokens")));
        }
        Ok(Some(index))
    }

    /// The offsets.
    pub(crate) fn starts(&self) -> &[u64] {
        // The map is page-aligned and the header 32 bytes, so the offsets are 8-byte aligned;
        // the length was checked in `open_beside`.
        bytemuck::try_cast_slice(&self.mmap[IDX_HEADER..IDX_HEADER + 8 * self.docs]).unwrap_or(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sidecar_round_trips_and_stale_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let shard = dir.path().join("a_train_000000.bin");
        assert!(DocIndex::open_beside(&shard, 10).unwrap().is_none(), "no sidecar: no index");
        write_idx(&idx_path(&shard), 10, &[0, 4, 9]).unwrap();
        let idx = DocIndex::open_beside(&shard, 10).unwrap().unwrap();
        assert_eq!(idx.starts(), &[0, 4, 9]);

        let e = DocIndex::open_beside(&shard, 11).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("a_train_000000.idx") && msg.contains("a_train_000000.bin"), "{msg}");
        assert!(msg.contains("10 tokens") && msg.contains("11"), "{msg}");

        write_idx(&idx_path(&shard), 10, &[0, 4, 4]).unwrap();
        assert!(DocIndex::open_beside(&shard, 10).unwrap_err().to_string().contains("not increasing"));
        write_idx(&idx_path(&shard), 10, &[10]).unwrap();
        assert!(DocIndex::open_beside(&shard, 10).unwrap_err().to_string().contains("past the shard"));
        std::fs::write(idx_path(&shard), b"STDOCIDX").unwrap();
        assert!(DocIndex::open_beside(&shard, 10).unwrap_err().to_string().contains("shorter"));
    }
}
