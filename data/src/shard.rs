//! The llm.c token-shard file format: an atomic writer and a validating mmap reader.
//!
//! Layout (all little-endian): a header of 256 `i32` — `[0]` = magic 20240520,
//! `[1]` = version 1, `[2]` = token count, the rest zero — followed by `count`
//! `u16` GPT-2 token ids. Files written here are byte-identical to llm.c's
//! (`dev/data/data_common.py::write_datafile`), so shards can be shared both ways.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;

use crate::error::{io_err, DataError, Result};

// Tokens are viewed in place as `u16`; that is only correct on little-endian hosts.
#[cfg(target_endian = "big")]
compile_error!(
    "the data crate reads llm.c shards (little-endian u16 tokens) in place: big-endian hosts are unsupported"
);

/// Header magic number of an llm.c token shard.
pub const MAGIC: i32 = 20240520;
/// Header version for GPT-2 tokens stored as `u16`.
pub const VERSION: i32 = 1;
/// Number of `i32` in the header.
pub const HEADER_INTS: usize = 256;
/// Header size in bytes (1024: keeps the `u16` payload aligned).
pub const HEADER_BYTES: usize = HEADER_INTS * 4;

/// A unique-enough suffix for temporary files and directories: pid, time and a counter,
/// so that threads of one process and concurrent processes never collide.
pub(crate) fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{}-{nanos}-{n}", std::process::id())
}

/// Write `tokens` to `path` as an llm.c shard.
///
/// The data goes to a hidden temporary file in the same directory, is flushed to disk,
/// then renamed over `path`: a crash never leaves a half-written shard under the final
/// name. The parent directory must exist.
pub fn write_shard(path: impl AsRef<Path>, tokens: &[u16]) -> Result<()> {
    let path = path.as_ref();
    let count = i32::try_from(tokens.len())
        .map_err(|_| DataError::TooManyTokens { path: path.to_owned(), tokens: tokens.len() })?;
    let file_name = path
        .file_name()
        .ok_or_else(|| DataError::InvalidArgument(format!("shard path {} has no file name", path.display())))?;
    let tmp = path.with_file_name(format!(".{}.tmp-{}", file_name.to_string_lossy(), unique_suffix()));

    let result = write_file(&tmp, count, tokens)
        .and_then(|()| fs::rename(&tmp, path).map_err(io_err("rename a temporary file to", path)));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    } else if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        // Best effort: make the rename itself durable (not possible on every platform).
        let _ = File::open(dir).and_then(|d| d.sync_all());
    }
    result
}

fn write_file(tmp: &Path, count: i32, tokens: &[u16]) -> Result<()> {
    let file = File::create(tmp).map_err(io_err("create", tmp))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut header = [0i32; HEADER_INTS];
    header[0] = MAGIC;
    header[1] = VERSION;
    header[2] = count;
    let mut bytes = Vec::with_capacity(HEADER_BYTES);
    for v in header {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    w.write_all(&bytes).map_err(io_err("write", tmp))?;
    // Little-endian host (checked at compile time above): the in-memory bytes are the file bytes.
    w.write_all(bytemuck::cast_slice(tokens)).map_err(io_err("write", tmp))?;
    let file =
        w.into_inner().map_err(|e| DataError::Io { action: "write", path: tmp.to_owned(), source: e.into_error() })?;
    file.sync_all().map_err(io_err("flush to disk", tmp))?;
    Ok(())
}

/// A read-only, memory-mapped llm.c token shard, validated on open.
#[derive(Debug)]
pub struct TokenShard {
    path: PathBuf,
    mmap: Mmap,
    len: usize,
}

impl TokenShard {
    /// Map `path` and validate its header and length.
    ///
    /// Errors: unreadable file, file shorter than the header, wrong magic (not an
    /// llm.c shard), unsupported version, negative count, or a file length that
    /// disagrees with the count (truncated or trailing bytes).
    pub fn open(path: impl AsRef<Path>) -> Result<TokenShard> {
        let path = path.as_ref().to_owned();
        let file = File::open(&path).map_err(io_err("open", &path))?;
        let file_len = file.metadata().map_err(io_err("read the metadata of", &path))?.len();
        if file_len < HEADER_BYTES as u64 {
            return Err(DataError::ShortHeader { path, len: file_len });
        }
        // SAFETY: the map is read-only. As with any mmap, another process truncating or
        // rewriting the file while it is mapped is outside our control; shards are written
        // by rename (never in place), so ours never are.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err("memory-map", &path))?;
        let int = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&mmap[4 * i..4 * i + 4]);
            i32::from_le_bytes(b)
        };
        let (magic, version, count) = (int(0), int(1), int(2));
        if magic != MAGIC {
            return Err(DataError::BadMagic { path, found: magic });
        }
        if version != VERSION {
            return Err(DataError::BadVersion { path, found: version });
        }
        if count < 0 {
            return Err(DataError::NegativeCount { path, count });
        }
        let expected = HEADER_BYTES as u64 + 2 * count as u64;
        if expected != file_len {
            return Err(DataError::LengthMismatch { path, tokens: count as u64, expected, found: file_len });
        }
        if let Err(e) = bytemuck::try_cast_slice::<u8, u16>(&mmap[HEADER_BYTES..]) {
            return Err(DataError::Misaligned { path, reason: format!("{e:?}") });
        }
        Ok(TokenShard { path, mmap, len: count as usize })
    }

    /// The token ids.
    pub fn tokens(&self) -> &[u16] {
        // Validated in `open`: the payload length is even and the mmap is page-aligned,
        // so the 1024-byte offset keeps it 2-byte aligned.
        bytemuck::try_cast_slice(&self.mmap[HEADER_BYTES..]).expect("shard payload alignment was validated in open")
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file this shard was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(magic: i32, version: i32, count: i32) -> Vec<u8> {
        let mut h = [0i32; HEADER_INTS];
        h[0] = magic;
        h[1] = version;
        h[2] = count;
        h.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x_train_000000.bin");
        let toks: Vec<u16> = (0..10_000u32).map(|i| (i * 7919 % 50257) as u16).collect();
        write_shard(&path, &toks).unwrap();
        let s = TokenShard::open(&path).unwrap();
        assert_eq!(s.tokens(), &toks[..]);
        assert_eq!(s.len(), toks.len());
        assert_eq!(s.path(), path);
        // Exactly the llm.c layout, and no temporary file left behind.
        let bytes = fs::read(&path).unwrap();
        assert_eq!(bytes.len(), HEADER_BYTES + 2 * toks.len());
        assert_eq!(&bytes[..HEADER_BYTES], &header(MAGIC, VERSION, toks.len() as i32)[..]);
        assert_eq!(u16::from_le_bytes([bytes[HEADER_BYTES + 2], bytes[HEADER_BYTES + 3]]), toks[1]);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn empty_shard_round_trips_and_overwrite_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.bin");
        write_shard(&path, &[1, 2, 3]).unwrap();
        write_shard(&path, &[]).unwrap();
        let s = TokenShard::open(&path).unwrap();
        assert!(s.is_empty());
        assert_eq!(s.tokens(), &[] as &[u16]);
    }

    #[test]
    fn short_header_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.bin");
        fs::write(&path, &header(MAGIC, VERSION, 0)[..100]).unwrap();
        let e = TokenShard::open(&path).unwrap_err();
        assert!(matches!(e, DataError::ShortHeader { len: 100, .. }), "{e}");
        assert!(e.to_string().contains("short.bin") && e.to_string().contains("1024"), "{e}");
    }

    #[test]
    fn wrong_magic_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("magic.bin");
        let mut b = header(12345, VERSION, 2);
        b.extend_from_slice(&[0; 4]);
        fs::write(&path, b).unwrap();
        let e = TokenShard::open(&path).unwrap_err();
        assert!(matches!(e, DataError::BadMagic { found: 12345, .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("not an llm.c token shard") && msg.contains("12345") && msg.contains("magic.bin"),
            "{msg}"
        );
    }

    #[test]
    fn bad_version_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.bin");
        fs::write(&path, header(MAGIC, 2, 0)).unwrap();
        let e = TokenShard::open(&path).unwrap_err();
        assert!(matches!(e, DataError::BadVersion { found: 2, .. }), "{e}");
    }

    #[test]
    fn truncated_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        write_shard(&path, &[5u16; 100]).unwrap();
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 11]).unwrap();
        let e = TokenShard::open(&path).unwrap_err();
        match &e {
            DataError::LengthMismatch { tokens, expected, found, .. } => {
                assert_eq!((*tokens, *expected, *found), (100, 1224, 1213));
            }
            other => panic!("unexpected error {other}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("truncated") && msg.contains("1224") && msg.contains("1213"), "{msg}");
    }

    #[test]
    fn trailing_bytes_and_negative_count_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("long.bin");
        let mut b = header(MAGIC, VERSION, 1);
        b.extend_from_slice(&[0; 6]);
        fs::write(&path, b).unwrap();
        let e = TokenShard::open(&path).unwrap_err();
        assert!(matches!(e, DataError::LengthMismatch { expected: 1026, found: 1030, .. }), "{e}");
        assert!(e.to_string().contains("longer than its header says"), "{e}");

        fs::write(&path, header(MAGIC, VERSION, -3)).unwrap();
        let e = TokenShard::open(&path).unwrap_err();
        assert!(matches!(e, DataError::NegativeCount { count: -3, .. }), "{e}");
    }

    #[test]
    fn missing_file_names_the_path() {
        let e = TokenShard::open("/nonexistent/dir/abc.bin").unwrap_err();
        assert!(matches!(e, DataError::Io { .. }));
        assert!(e.to_string().contains("/nonexistent/dir/abc.bin"), "{e}");
    }
}
