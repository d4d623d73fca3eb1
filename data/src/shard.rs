//! The llm.c token-shard file format, both of llm.c's layouts: an atomic writer and a
//! validating mmap reader.
//!
//! Layout (all little-endian): a header of 256 `i32` — `[0]` = magic, `[1]` = version,
//! `[2]` = token count — followed by `count` token ids: `u16` with magic 20240520 and
//! version 1 (llm.c's GPT-2 files), `u32` with magic 20240801 and version 7 (llm.c's
//! Llama 3 files, `dev/data/data_common.py::write_datafile(model_desc="llama-3")`). A
//! tokenizer of at most 65536 ids is written as `u16`, a larger one as `u32`.
//!
//! llm.c writes zeros in the other header slots and its loaders read only `[0..3]`; we
//! record the tokenizer there ([`ShardInfo`]: slot 3 a marker, then vocabulary size,
//! end-of-text id, the shard's largest id, the tokenizer's fingerprint and name), so files
//! stay readable by llm.c both ways and shards from llm.c (zeros there) just have no info.
//! Document start offsets live beside the shard, in `docindex.rs`'s `.idx` sidecar.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;

use crate::docindex::{idx_path, write_idx, DocIndex};
use crate::error::{io_err, DataError, Result};
use crate::header::{HEADER_BYTES, HEADER_INTS, MAGIC, MAGIC_U32, VERSION, VERSION_U32};
use crate::ids::{Ids, Width};

// Tokens are viewed in place as `u16`/`u32`; that is only correct on little-endian hosts.
#[cfg(target_endian = "big")]
compile_error!(
    "the data crate reads llm.c shards (little-endian token ids) in place: big-endian hosts are unsupported"
);

/// Slot 3 of a header that carries [`ShardInfo`] ("STK1"); llm.c leaves it 0.
const INFO_MARKER: i32 = 0x5354_4B31;
/// The info's layout version (slot 4).
const INFO_VERSION: i32 = 1;
/// Slots 16..32 hold the tokenizer's name, UTF-8, NUL-padded.
const NAME_SLOTS: std::ops::Range<usize> = 16..32;
/// The longest tokenizer name a header holds (longer names are cut at a character boundary).
pub const NAME_BYTES: usize = (NAME_SLOTS.end - NAME_SLOTS.start) * 4;

/// What a shard's header records about the tokenizer that made it (absent in llm.c's
/// files and in shards written before this record existed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    /// Ids the tokenizer can produce (`0..vocab_size`): the smallest `model.vocab_size` that holds them.
    pub vocab_size: u32,
    /// The end-of-text id that separates documents.
    pub eot_id: u32,
    /// The largest id in this shard (`None`: the shard is empty).
    pub max_id: Option<u32>,
    /// The tokenizer's behavioural fingerprint ([`crate::tokenizer`]): equal fingerprints
    /// tokenise text alike, whatever file they were loaded from.
    pub fingerprint: u64,
    /// A readable name: `gpt2`, or where its `tokenizer.json` came from (at most [`NAME_BYTES`]).
    pub tokenizer: String,
}

impl ShardInfo {
    fn write_into(&self, header: &mut [i32; HEADER_INTS]) {
        header[3] = INFO_MARKER;
        header[4] = INFO_VERSION;
        header[5] = self.vocab_size as i32;
        header[6] = self.eot_id as i32;
        header[7] = self.max_id.map_or(-1, |m| m as i32);
        header[8] = self.fingerprint as u32 as i32;
        header[9] = (self.fingerprint >> 32) as u32 as i32;
        let mut name = [0u8; NAME_BYTES];
        let cut = truncate_utf8(&self.tokenizer, NAME_BYTES);
        name[..cut.len()].copy_from_slice(cut.as_bytes());
        for (slot, b) in header[NAME_SLOTS].iter_mut().zip(name.chunks_exact(4)) {
            *slot = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }

    fn read_from(header: &[i32]) -> Option<ShardInfo> {
        if header[3] != INFO_MARKER || header[4] != INFO_VERSION {
            return None;
        }
        let name: Vec<u8> = header[NAME_SLOTS].iter().flat_map(|v| v.to_le_bytes()).collect();
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        Some(ShardInfo {
            vocab_size: header[5] as u32,
            eot_id: header[6] as u32,
            max_id: (header[7] >= 0).then_some(header[7] as u32),
            fingerprint: u64::from(header[8] as u32) | (u64::from(header[9] as u32) << 32),
            tokenizer: String::from_utf8_lossy(&name[..end]).into_owned(),
        })
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub(crate) fn truncate_utf8(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A unique-enough suffix for temporary files and directories: pid, time and a counter,
/// so that threads of one process and concurrent processes never collide.
pub(crate) fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{}-{nanos}-{n}", std::process::id())
}

/// Write `tokens` to `path` as an llm.c GPT-2 shard (`u16`, no tokenizer record, no
/// document index): byte-identical to llm.c's `write_datafile`.
///
/// The data goes to a hidden temporary file in the same directory, is flushed to disk,
/// then renamed over `path`: a crash never leaves a half-written shard under the final
/// name. The parent directory must exist.
pub fn write_shard(path: impl AsRef<Path>, tokens: &[u16]) -> Result<()> {
    write_shard_ids(path, Ids::U16(tokens), None, None)
}

/// Write `ids` to `path` as an llm.c shard of their width (`u16`: magic 20240520, `u32`:
/// magic 20240801), with `info` in the header's unused slots and, given `doc_starts`, the
/// `.idx` sidecar beside it (written and renamed first, so a shard never appears with
/// another shard's index). Atomic like [`write_shard`]; an existing sidecar is removed
/// when none is given.
pub fn write_shard_ids(
    path: impl AsRef<Path>,
    ids: Ids<'_>,
    info: Option<&ShardInfo>,
    doc_starts: Option<&[u64]>,
) -> Result<()> {
    let path = path.as_ref();
    let count =
        i32::try_from(ids.len()).map_err(|_| DataError::TooManyTokens { path: path.to_owned(), tokens: ids.len() })?;
    let file_name = path
        .file_name()
        .ok_or_else(|| DataError::InvalidArgument(format!("shard path {} has no file name", path.display())))?;
    let tmp_of = |p: &Path| p.with_file_name(format!(".{}.tmp-{}", file_name.to_string_lossy(), unique_suffix()));
    let idx = idx_path(path);
    match doc_starts {
        Some(starts) => {
            let tmp = tmp_of(&idx);
            let written = write_idx(&tmp, ids.len() as u64, starts)
                .and_then(|()| fs::rename(&tmp, &idx).map_err(io_err("rename a temporary file to", &idx)));
            if written.is_err() {
                let _ = fs::remove_file(&tmp);
            }
            written?;
        }
        None => match fs::remove_file(&idx) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err("remove the stale", &idx)(e)),
            _ => {}
        },
    }
    let tmp = tmp_of(path);
    let result = write_file(&tmp, count, ids, info)
        .and_then(|()| fs::rename(&tmp, path).map_err(io_err("rename a temporary file to", path)));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    } else if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        // Best effort: make the rename itself durable (not possible on every platform).
        let _ = File::open(dir).and_then(|d| d.sync_all());
    }
    result
}

fn write_file(tmp: &Path, count: i32, ids: Ids<'_>, info: Option<&ShardInfo>) -> Result<()> {
    let file = File::create(tmp).map_err(io_err("create", tmp))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut header = [0i32; HEADER_INTS];
    (header[0], header[1]) = match ids.width() {
        Width::U16 => (MAGIC, VERSION),
        Width::U32 => (MAGIC_U32, VERSION_U32),
    };
    header[2] = count;
    if let Some(info) = info {
        info.write_into(&mut header);
    }
    let mut bytes = Vec::with_capacity(HEADER_BYTES);
    for v in header {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    w.write_all(&bytes).map_err(io_err("write", tmp))?;
    // Little-endian host (checked at compile time above): the in-memory bytes are the file bytes.
    w.write_all(ids.as_bytes()).map_err(io_err("write", tmp))?;
    let file =
        w.into_inner().map_err(|e| DataError::Io { action: "write", path: tmp.to_owned(), source: e.into_error() })?;
    file.sync_all().map_err(io_err("flush to disk", tmp))?;
    Ok(())
}

/// A read-only, memory-mapped llm.c token shard of either width, validated on open, with
/// the tokenizer record of its header and the document index beside it when present.
#[derive(Debug)]
pub struct TokenShard {
    path: PathBuf,
    mmap: Mmap,
    len: usize,
    width: Width,
    info: Option<ShardInfo>,
    docs: Option<DocIndex>,
}

impl TokenShard {
    /// Map `path` and validate its header and length, and its `.idx` sidecar if any.
    ///
    /// Errors: unreadable file, file shorter than the header, wrong magic (not an
    /// llm.c shard), a version that does not go with the magic, negative count, a file
    /// length that disagrees with the count (truncated or trailing bytes), or a sidecar
    /// that does not belong to the shard.
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
        let header: Vec<i32> =
            mmap[..HEADER_BYTES].chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let (magic, version, count) = (header[0], header[1], header[2]);
        let (width, want) = match magic {
            MAGIC => (Width::U16, VERSION),
            MAGIC_U32 => (Width::U32, VERSION_U32),
            _ => return Err(DataError::BadMagic { path, found: magic }),
        };
        if version != want {
            return Err(DataError::BadVersion { path, magic, found: version, expected: want });
        }
        if count < 0 {
            return Err(DataError::NegativeCount { path, count });
        }
        let expected = HEADER_BYTES as u64 + width.bytes() as u64 * count as u64;
        if expected != file_len {
            return Err(DataError::LengthMismatch { path, tokens: count as u64, expected, found: file_len });
        }
        let payload = &mmap[HEADER_BYTES..];
        let aligned = match width {
            Width::U16 => bytemuck::try_cast_slice::<u8, u16>(payload).map(|_| ()),
            Width::U32 => bytemuck::try_cast_slice::<u8, u32>(payload).map(|_| ()),
        };
        if let Err(e) = aligned {
            return Err(DataError::Misaligned { path, reason: format!("{e:?}") });
        }
        let info = ShardInfo::read_from(&header);
        let docs = DocIndex::open_beside(&path, count as u64)?;
        Ok(TokenShard { path, mmap, len: count as usize, width, info, docs })
    }

    /// The token ids, in their stored width.
    pub fn ids(&self) -> Ids<'_> {
        // Validated in `open`: the payload length is a multiple of the width and the mmap
        // is page-aligned, so the 1024-byte offset keeps it aligned.
        let payload = &self.mmap[HEADER_BYTES..];
        match self.width {
            Width::U16 => Ids::U16(bytemuck::try_cast_slice(payload).unwrap_or(&[])),
            Width::U32 => Ids::U32(bytemuck::try_cast_slice(payload).unwrap_or(&[])),
        }
    }

    /// How the ids are stored.
    pub fn width(&self) -> Width {
        self.width
    }

    /// The tokenizer record of the header (`None`: llm.c's shards, older shards).
    pub fn info(&self) -> Option<&ShardInfo> {
        self.info.as_ref()
    }

    /// The largest id: from the header when it records it, else by scanning the shard.
    pub fn max_id(&self) -> Option<u32> {
        match &self.info {
            Some(info) => info.max_id,
            None => self.ids().max(),
        }
    }

    /// Where documents begin in this shard (see `docindex.rs` for what an offset means);
    /// `None` when the shard has no `.idx` sidecar (llm.c's shards, older shards).
    pub fn doc_starts(&self) -> Option<&[u64]> {
        self.docs.as_ref().map(DocIndex::starts)
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
        assert_eq!(s.ids(), Ids::U16(&toks));
        assert_eq!((s.width(), s.info(), s.doc_starts()), (Width::U16, None, None));
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
        assert_eq!(s.ids(), Ids::U16(&[]));
        assert_eq!(s.max_id(), None);
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

    fn info(vocab: u32, max_id: Option<u32>) -> ShardInfo {
        ShardInfo { vocab_size: vocab, eot_id: 7, max_id, fingerprint: 0x0123_4567_89ab_cdef, tokenizer: "t".into() }
    }

    #[test]
    fn u32_shards_round_trip_in_llm_c_llama_3_layout_with_info_and_documents() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l_train_000000.bin");
        let toks: Vec<u32> = (0..1000u32).map(|i| i * 131 % 128_256).collect();
        let max = toks.iter().copied().max();
        let mut meta = info(128_256, max);
        meta.tokenizer = "Meta-Llama-3-8B/tokenizer.json".into();
        write_shard_ids(&path, Ids::U32(&toks), Some(&meta), Some(&[0, 10, 500])).unwrap();
        let s = TokenShard::open(&path).unwrap();
        assert_eq!((s.width(), s.len(), s.ids()), (Width::U32, 1000, Ids::U32(&toks)));
        assert_eq!(s.info(), Some(&meta));
        assert_eq!(s.max_id(), max);
        assert_eq!(s.doc_starts(), Some(&[0u64, 10, 500][..]));
        // The bytes follow llm.c's write_datafile(model_desc="llama-3"): magic, version 7,
        // count, then u32 ids at byte 1024; our record sits in slots llm.c leaves zero.
        let bytes = fs::read(&path).unwrap();
        let int = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
        assert_eq!((int(0), int(1), int(2)), (20240801, 7, 1000));
        assert_eq!(bytes.len(), HEADER_BYTES + 4 * 1000);
        assert_eq!(u32::from_le_bytes(bytes[1028..1032].try_into().unwrap()), toks[1]);
        // Written again without documents: the old sidecar goes.
        write_shard_ids(&path, Ids::U32(&toks), None, None).unwrap();
        assert!(!idx_path(&path).exists());
        assert_eq!(TokenShard::open(&path).unwrap().doc_starts(), None);
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "no temporaries left: {names:?}");
    }

    #[test]
    fn files_laid_out_by_llm_c_rules_are_read() {
        // What llm.c's data_common.py writes, byte by byte: a zeroed 256-int header with
        // magic, version, count, then the ids; no record, no sidecar.
        let dir = tempfile::tempdir().unwrap();
        for (magic, version, width) in [(20240520, 1, 2usize), (20240801, 7, 4)] {
            let path = dir.path().join(format!("llmc_{magic}.bin"));
            let ids = [50256u32, 15496, 11, 995, 0];
            let mut b = header(magic, version, ids.len() as i32);
            for id in ids {
                b.extend_from_slice(&id.to_le_bytes()[..width]);
            }
            fs::write(&path, b).unwrap();
            let s = TokenShard::open(&path).unwrap();
            assert_eq!(s.ids().iter().collect::<Vec<_>>(), ids);
            assert_eq!((s.info(), s.doc_starts(), s.max_id()), (None, None, Some(50256)));
        }
        // A version that belongs to the other magic is refused, naming both.
        let path = dir.path().join("mixed.bin");
        fs::write(&path, header(20240801, 1, 0)).unwrap();
        let e = TokenShard::open(&path).unwrap_err();
        assert!(matches!(e, DataError::BadVersion { found: 1, expected: 7, .. }), "{e}");
        assert!(e.to_string().contains("20240801"), "{e}");
    }

    #[test]
    fn long_tokenizer_names_are_cut_at_a_character_boundary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.bin");
        let mut meta = info(50257, Some(3));
        meta.tokenizer = "é".repeat(40);
        write_shard_ids(&path, Ids::U16(&[1, 2, 3]), Some(&meta), None).unwrap();
        let got = TokenShard::open(&path).unwrap().info().unwrap().tokenizer.clone();
        assert_eq!(got, "é".repeat(NAME_BYTES / 2));
    }

    #[test]
    fn missing_file_names_the_path() {
        let e = TokenShard::open("/nonexistent/dir/abc.bin").unwrap_err();
        assert!(matches!(e, DataError::Io { .. }));
        assert!(e.to_string().contains("/nonexistent/dir/abc.bin"), "{e}");
    }
}
