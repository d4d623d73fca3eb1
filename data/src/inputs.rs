//! What `prepare-data`'s INPUT arguments name: files, directories (walked, sorted) and
//! glob patterns (`*`, `?` in any path component), resolved to a sorted list of input
//! files with their format (`.txt`, `.jsonl`, `.parquet`) and compression (none, `.gz`,
//! `.zst`), and the streams that read them while counting the bytes taken from disk
//! (the progress bar's position).
//!
//! A file named explicitly must have a known suffix (else it is refused, naming the known
//! ones); files of other kinds inside a directory are skipped and counted in the summary.
//! The same file reached twice (a directory and a file in it) is refused: it would be
//! trained on twice.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{io_err, DataError, Result};

/// How a file's documents are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Plain UTF-8 text (one document per file unless told otherwise).
    Txt,
    /// One JSON object per line; the text is one of its fields.
    Jsonl,
    /// A Parquet table; the text is one of its columns, a document per row.
    Parquet,
}

/// How a file is compressed as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// One input file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputFile {
    pub path: PathBuf,
    pub format: Format,
    pub compression: Compression,
    /// Size on disk.
    pub bytes: u64,
}

/// The suffixes `prepare-data` reads, for messages.
pub const KNOWN_SUFFIXES: &str = ".txt, .jsonl, .parquet, each optionally followed by .gz or .zst";

/// The format and compression a file name says, `None` for other files.
pub fn classify(name: &str) -> Option<(Format, Compression)> {
    let lower = name.to_ascii_lowercase();
    let (stem, compression) = if let Some(s) = lower.strip_suffix(".gz") {
        (s, Compression::Gzip)
    } else if let Some(s) = lower.strip_suffix(".zst") {
        (s, Compression::Zstd)
    } else {
        (lower.as_str(), Compression::None)
    };
    let format = if stem.ends_with(".txt") {
        Format::Txt
    } else if stem.ends_with(".jsonl") {
        Format::Jsonl
    } else if stem.ends_with(".parquet") {
        Format::Parquet
    } else {
        return None;
    };
    Some((format, compression))
}

/// The inputs found, and the files inside directories that were not inputs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expanded {
    pub files: Vec<InputFile>,
    /// Files inside the given directories with another suffix, skipped (sorted).
    pub skipped: Vec<PathBuf>,
}

/// Resolve INPUT arguments into input files, in argument order; a directory's or a
/// pattern's files sorted by path.
pub fn expand(args: &[PathBuf]) -> Result<Expanded> {
    if args.is_empty() {
        return Err(DataError::InvalidArgument(
            "no input given: name text files, directories or patterns such as 'data/*.jsonl.gz'".into(),
        ));
    }
    let mut out = Expanded::default();
    let mut seen: Vec<(PathBuf, PathBuf)> = Vec::new();
    for arg in args {
        let mut found = Vec::new();
        if arg.is_dir() {
            walk(arg, &mut found, &mut out.skipped)?;
        } else if arg.exists() {
            found.push(explicit(arg)?);
        } else if is_pattern(arg) {
            let matches = glob(arg)?;
            if matches.is_empty() {
                return Err(DataError::InvalidArgument(format!(
                    "input pattern {} matches no file or directory",
                    arg.display()
                )));
            }
            for m in matches {
                if m.is_dir() {
                    walk(&m, &mut found, &mut out.skipped)?;
                } else {
                    found.push(explicit(&m)?);
                }
            }
        } else {
            // The OS's own words for why it is not there (missing, or a directory we may not enter).
            let e = std::fs::metadata(arg).err().unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound));
            return Err(io_err("read the input", arg)(e));
        }
        for f in found {
            let canonical = f.path.canonicalize().map_err(io_err("resolve the input", &f.path))?;
            if let Some((_, by)) = seen.iter().find(|(c, _)| *c == canonical) {
                return Err(DataError::InvalidArgument(format!(
                    "{} is named twice (through {} and {}): its documents would be trained on twice; name it once",
                    f.path.display(),
                    by.display(),
                    arg.display()
                )));
            }
            seen.push((canonical, arg.clone()));
            out.files.push(f);
        }
    }
    out.skipped.sort();
    if out.files.is_empty() {
        return Err(DataError::InvalidArgument(format!(
            "the inputs hold no file to read ({} skipped: {}); inputs are {KNOWN_SUFFIXES}",
            out.skipped.len(),
            out.skipped.iter().take(3).map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        )));
    }
    Ok(out)
}

fn explicit(path: &Path) -> Result<InputFile> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let (format, compression) = classify(&name).ok_or_else(|| {
        DataError::InvalidArgument(format!(
            "input {} is of no kind prepare-data reads: inputs are {KNOWN_SUFFIXES} (rename a text file to .txt)",
            path.display()
        ))
    })?;
    let bytes = std::fs::metadata(path).map_err(io_err("read the metadata of", path))?.len();
    Ok(InputFile { path: path.to_owned(), format, compression, bytes })
}

/// Every input file under `dir`, sorted; hidden entries are not entered.
fn walk(dir: &Path, found: &mut Vec<InputFile>, skipped: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io_err("list the directory", dir))? {
        let e = e.map_err(io_err("list the directory", dir))?;
        if !e.file_name().to_string_lossy().starts_with('.') {
            entries.push(e.path());
        }
    }
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, found, skipped)?;
        } else if classify(&p.file_name().unwrap_or_default().to_string_lossy()).is_some() {
            found.push(explicit(&p)?);
        } else {
            skipped.push(p);
        }
    }
    Ok(())
}

fn is_pattern(p: &Path) -> bool {
    p.to_string_lossy().contains(['*', '?'])
}

/// Expand `*` and `?` component by component; matches sorted. Hidden names match only
/// a pattern component that starts with `.`.
fn glob(pattern: &Path) -> Result<Vec<PathBuf>> {
    let mut current: Vec<PathBuf> = vec![PathBuf::new()];
    for comp in pattern.components() {
        let part = comp.as_os_str().to_string_lossy().into_owned();
        if !part.contains(['*', '?']) {
            current = current.into_iter().map(|p| p.join(&part)).filter(|p| p.exists()).collect();
            continue;
        }
        let mut next = Vec::new();
        for base in &current {
            let dir = if base.as_os_str().is_empty() { Path::new(".") } else { base.as_path() };
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if (!name.starts_with('.') || part.starts_with('.')) && crate::dataset::wildcard_match(&part, &name) {
                    next.push(base.join(name));
                }
            }
        }
        next.sort();
        current = next;
    }
    Ok(current)
}

/// A reader that counts the bytes read through it (the compressed bytes, for a `.gz`).
struct Counting<R> {
    inner: R,
    counter: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.counter.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The decompressed bytes of a `.txt` or `.jsonl` input; every byte read from disk is
/// added to `disk_bytes`.
pub fn open_stream(file: &InputFile, disk_bytes: Arc<AtomicU64>) -> Result<Box<dyn BufRead + Send>> {
    let f = File::open(&file.path).map_err(io_err("open", &file.path))?;
    let counted = BufReader::with_capacity(1 << 20, Counting { inner: f, counter: disk_bytes });
    Ok(match file.compression {
        Compression::None => Box::new(counted),
        Compression::Gzip => Box::new(BufReader::with_capacity(1 << 20, flate2::bufread::MultiGzDecoder::new(counted))),
        Compression::Zstd => Box::new(BufReader::with_capacity(
            1 << 20,
            zstd::stream::read::Decoder::with_buffer(counted).map_err(io_err("start decompressing", &file.path))?,
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_name_format_and_compression() {
        assert_eq!(classify("a.txt"), Some((Format::Txt, Compression::None)));
        assert_eq!(classify("A.JSONL.GZ"), Some((Format::Jsonl, Compression::Gzip)));
        assert_eq!(classify("x.parquet.zst"), Some((Format::Parquet, Compression::Zstd)));
        assert_eq!(classify("notes.md"), None);
        assert_eq!(classify("x.gz"), None);
    }

    #[test]
    fn files_directories_and_patterns_expand_sorted_and_once() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("sub/deeper")).unwrap();
        for f in ["b.txt", "a.jsonl.gz", "sub/c.parquet", "sub/deeper/d.txt.zst", "sub/readme.md", ".hidden.txt"] {
            std::fs::write(d.join(f), "x").unwrap();
        }
        let e = expand(&[d.to_owned()]).unwrap();
        let names: Vec<_> = e.files.iter().map(|f| f.path.strip_prefix(d).unwrap().to_owned()).collect();
        assert_eq!(
            names,
            [d.join("a.jsonl.gz"), d.join("b.txt"), d.join("sub/c.parquet"), d.join("sub/deeper/d.txt.zst")]
                .iter()
                .map(|p| p.strip_prefix(d).unwrap().to_owned())
                .collect::<Vec<_>>()
        );
        assert_eq!(e.skipped, [d.join("sub/readme.md")]);

        let e = expand(&[d.join("*/*.parquet"), d.join("b.txt")]).unwrap();
        assert_eq!(e.files.len(), 2);
        assert_eq!(e.files[0].format, Format::Parquet);
        assert!(expand(&[d.join("*.nothing")]).unwrap_err().to_string().contains("matches no file"));
        let twice = expand(&[d.to_owned(), d.join("b.txt")]).unwrap_err();
        assert!(twice.to_string().contains("named twice"), "{twice}");
        let md = expand(&[d.join("sub/readme.md")]).unwrap_err();
        assert!(md.to_string().contains("of no kind") && md.to_string().contains(".jsonl"), "{md}");
        let missing = expand(&[d.join("missing.txt")]).unwrap_err();
        assert!(missing.to_string().contains("missing.txt"), "{missing}");
    }
}
