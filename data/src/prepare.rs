//! `prepare-data`: documents from text, JSON-lines and Parquet files (plain, `.gz`,
//! `.zst`) tokenised on every core into llm.c shards of a validation and a training split.
//!
//! The pipeline streams: one reader thread decompresses and parses the inputs in order
//! ([`crate::documents`]) and hands batches of about 4 MiB of text over a channel of two;
//! the calling thread tokenises each batch's documents in parallel (rayon, every core) and
//! writes them in input order ([`crate::writer`]). Memory is a few batches plus the shard
//! being filled, whatever the corpus size.
//!
//! Every document is preceded by the tokenizer's end-of-text id (llm.c's convention: the
//! separator opens each document, so a document's last token predicts the end of text),
//! and its start is recorded in the shard's `.idx`. Document i (counting from 0 over all
//! inputs in the order given, bad records not counted) goes to validation when
//! ⌊(i+1)·f⌋ > ⌊i·f⌋ for `--val-fraction` f: exactly ⌊n·f⌋ of n documents, evenly spread
//! (every 10th for 0.1), the first always in training, the same split on every run.
//!
//! Malformed records, invalid UTF-8 and empty documents are counted and reported (the
//! first of each kind named), then skipped or, with [`OnBad::Refuse`], stop the run
//! before anything is written. Shards are written into a hidden staging directory inside
//! the output directory and moved into place only when all went well, so a refused or
//! failed run leaves the directory as it was. A directory that already holds shards is
//! refused unless the inputs are appended as another source ([`Existing`]), with the same
//! tokenizer; every source is recorded in `dataset.json` (`sources.rs`).

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::dataset::Split;
use crate::documents::{read_file, Bad, BadKind, ReadOptions, Record, TxtDocs};
use crate::error::{io_err, DataError, Result};
use crate::inputs::InputFile;
use crate::sources::{InputRecord, Source, Sources};
use crate::tokenizer::{Tokenizer, TokenizerSpec, TokenizerStamp};
use crate::writer::SplitWriter;

/// Text per batch handed from the reader to the tokenisers.
const BATCH_BYTES: usize = 4 << 20;
/// Records per batch at most (many tiny documents).
const BATCH_RECORDS: usize = 8192;
/// Bad records of each kind named in the summary and `dataset.json`.
pub const BAD_EXAMPLES: usize = 3;

/// What to do with a record that is not a document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBad {
    /// Count it, name the first few, go on.
    Skip,
    /// Stop at the first one, writing nothing.
    Refuse,
}

/// What [`prepare`] does when the output directory already holds token shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Refuse ([`DataError::ShardsExist`]): both datasets would be trained on, mixed.
    Refuse,
    /// Add these inputs as another source (under a shard name of its own, with the same
    /// tokenizer), recorded with the others in `dataset.json`.
    Append,
}

/// How to prepare.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// The shard name prefix: `<name>_train_000000.bin`.
    pub name: String,
    pub tokenizer: TokenizerSpec,
    /// The end-of-text token of a `tokenizer.json` (default: found in it).
    pub eot: Option<String>,
    /// The JSON field / Parquet column holding the text.
    pub text_field: String,
    pub txt_docs: TxtDocs,
    pub on_bad: OnBad,
    /// The fraction of documents for validation, in `[0, 1)`.
    pub val_fraction: f64,
    /// Ids per shard file.
    pub shard_tokens: usize,
    pub existing: Existing,
}

impl PrepareOptions {
    /// The defaults of `launcher prepare-data` for shards named `name`.
    pub fn new(name: &str) -> PrepareOptions {
        PrepareOptions {
            name: name.into(),
            tokenizer: TokenizerSpec::Gpt2,
            eot: None,
            text_field: "text".into(),
            txt_docs: TxtDocs::File,
            on_bad: OnBad::Skip,
            val_fraction: 0.1,
            shard_tokens: 100_000_000,
            existing: Existing::Refuse,
        }
    }
}

/// Live counters of a run, for a progress display polling them from another thread.
#[derive(Debug, Default)]
pub struct PrepareProgress {
    /// Bytes of all inputs on disk (set once the inputs are found).
    pub total_disk_bytes: AtomicU64,
    /// Bytes of the inputs on disk whose documents are tokenised and written (compressed
    /// bytes for compressed inputs); the reader runs at most a few batches ahead of it.
    pub disk_bytes: AtomicU64,
    /// Bytes of document text tokenised so far.
    pub text_bytes: AtomicU64,
    pub documents: AtomicU64,
    pub bad: AtomicU64,
    pub tokens: AtomicU64,
}

/// Counts of records that were not documents, and the first few of each kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct BadReport {
    pub malformed: u64,
    pub invalid_utf8: u64,
    pub empty: u64,
    /// The first [`BAD_EXAMPLES`] of each kind: `"<file>: line 3: no field \"text\""`.
    pub examples: Vec<String>,
}

impl BadReport {
    pub fn total(&self) -> u64 {
        self.malformed + self.invalid_utf8 + self.empty
    }

    fn count(&self, kind: BadKind) -> u64 {
        match kind {
            BadKind::Malformed => self.malformed,
            BadKind::InvalidUtf8 => self.invalid_utf8,
            BadKind::Empty => self.empty,
        }
    }

    fn add(&mut self, bad: &Bad) {
        let seen = self.count(bad.kind);
        if seen < BAD_EXAMPLES as u64 {
            self.examples.push(format!("{} ({})", bad, kind_word(bad.kind)));
        }
        match bad.kind {
            BadKind::Malformed => self.malformed += 1,
            BadKind::InvalidUtf8 => self.invalid_utf8 += 1,
            BadKind::Empty => self.empty += 1,
        }
    }

    /// "2 malformed records, 1 empty document" (empty when there were none).
    pub fn counts(&self) -> String {
        BadKind::ALL
            .iter()
            .filter(|&&k| self.count(k) > 0)
            .map(|&k| {
                let n = self.count(k);
                let words = if n == 1 {
                    k.words().replacen("records", "record", 1).replacen("documents", "document", 1)
                } else {
                    k.words().to_string()
                };
                format!("{n} {words}")
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn kind_word(kind: BadKind) -> &'static str {
    match kind {
        BadKind::Malformed => "malformed",
        BadKind::InvalidUtf8 => "invalid UTF-8",
        BadKind::Empty => "empty",
    }
}

/// What [`prepare`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareSummary {
    pub out_dir: PathBuf,
    pub tokenizer: TokenizerStamp,
    pub input_files: usize,
    /// Files inside the given directories that are of no input kind.
    pub skipped_files: Vec<PathBuf>,
    /// Documents written, over both splits.
    pub documents: u64,
    pub val_documents: u64,
    pub total_tokens: u64,
    pub val_tokens: u64,
    pub train_tokens: u64,
    /// Bytes of document text tokenised.
    pub text_bytes: u64,
    pub bad: BadReport,
    pub on_bad: OnBad,
    pub val_fraction: f64,
    /// Shard files written: validation first, then training, in order.
    pub files: Vec<PathBuf>,
    /// Sources the directory holds now (recorded in `dataset.json`; 1 unless appended to).
    pub sources: usize,
    pub seconds: f64,
}

impl fmt::Display for PrepareSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = match crate::ids::Width::for_vocab(self.tokenizer.vocab_size) {
            crate::ids::Width::U16 => "u16",
            crate::ids::Width::U32 => "u32",
        };
        writeln!(
            f,
            "wrote {} tokens ({} val, {} train) from {} document(s) of {} input file(s) in {} shard(s) to {}",
            self.total_tokens,
            self.val_tokens,
            self.train_tokens,
            self.documents,
            self.input_files,
            self.files.len(),
            self.out_dir.display()
        )?;
        writeln!(
            f,
            "tokenizer: {} (vocabulary {}, end of text {} = {}; ids stored as {width}); {:.1} MB of text in {:.1} s \
             ({:.2} MB/s)",
            self.tokenizer.name,
            self.tokenizer.vocab_size,
            self.tokenizer.eot_token,
            self.tokenizer.eot_id,
            self.text_bytes as f64 / 1e6,
            self.seconds,
            self.text_bytes as f64 / 1e6 / self.seconds.max(1e-9)
        )?;
        write!(
            f,
            "validation: {} of {} documents (--val-fraction {})",
            self.val_documents, self.documents, self.val_fraction
        )?;
        if self.val_fraction > 0.0 && self.val_documents == 0 {
            write!(
                f,
                "\nwarning: no validation split: {} document(s) are too few for --val-fraction {} (a .txt file is \
                 one document: --txt-docs line or paragraph makes more); train with train.eval_every = 0, or \
                 prepare more documents",
                self.documents, self.val_fraction
            )?;
        }
        if self.bad.total() > 0 {
            write!(f, "\nskipped {} (--on-bad skip):", self.bad.counts())?;
            for e in &self.bad.examples {
                write!(f, "\n  {e}")?;
            }
        }
        if !self.skipped_files.is_empty() {
            let shown: Vec<String> = self.skipped_files.iter().take(3).map(|p| p.display().to_string()).collect();
            write!(
                f,
                "\nnot read: {} file(s) in the input directories of no input kind ({}{})",
                self.skipped_files.len(),
                shown.join(", "),
                if self.skipped_files.len() > 3 { ", ..." } else { "" }
            )?;
        }
        if self.sources > 1 {
            write!(
                f,
                "\n{} now holds {} sources (listed in its {})",
                self.out_dir.display(),
                self.sources,
                crate::sources::SOURCES_FILE
            )?;
        }
        Ok(())
    }
}

/// Whether document `i` (0-based) goes to validation for fraction `f`.
pub fn is_val_document(i: u64, f: f64) -> bool {
    ((i + 1) as f64 * f).floor() > (i as f64 * f).floor()
}

/// Prepare `inputs` into `out_dir` (created if needed) as `opts` says; see the module docs.
///
/// Errors: no input or an unreadable one (named), an input of no known kind, a bad
/// option, a tokenizer that does not load, a bad record under [`OnBad::Refuse`], no
/// document at all, an `out_dir` that holds shards (and, appending, a name it uses, the
/// same inputs again, or shards of another tokenizer).
pub fn prepare(
    inputs: &[PathBuf],
    out_dir: &Path,
    opts: &PrepareOptions,
    progress: &PrepareProgress,
) -> Result<PrepareSummary> {
    let started = Instant::now();
    // Checked before the (long) tokenisation: nothing is written when refused.
    let found = crate::sources::shards_in(out_dir)?;
    if !found.is_empty() && opts.existing == Existing::Refuse {
        return Err(DataError::ShardsExist { dir: out_dir.to_owned(), found: crate::sources::describe(&found) });
    }
    check_name(&opts.name)?;
    check_shard_tokens(opts.shard_tokens)?;
    if !(0.0..1.0).contains(&opts.val_fraction) {
        return Err(DataError::InvalidArgument(format!(
            "--val-fraction must be in [0, 1): the fraction of documents for validation (got {})",
            opts.val_fraction
        )));
    }
    if opts.text_field.is_empty() {
        return Err(DataError::InvalidArgument("--text-field must name a field (default: text)".into()));
    }
    if found.iter().any(|f| crate::sources::shard_prefix(f) == opts.name) {
        return Err(DataError::NameTaken { dir: out_dir.to_owned(), name: opts.name.clone() });
    }
    let expanded = crate::inputs::expand(inputs)?;
    progress.total_disk_bytes.store(expanded.files.iter().map(|f| f.bytes).sum(), Ordering::Relaxed);
    let tokenizer = Tokenizer::load(&opts.tokenizer, opts.eot.as_deref())?;
    let stamp = tokenizer.stamp().clone();

    let mut record = Sources::read(out_dir)?;
    check_same_tokenizer(out_dir, &found, &record, &stamp)?;
    let input_records: Vec<InputRecord> = expanded.files.iter().map(InputRecord::of).collect::<Result<_>>()?;
    if let Some((name, input)) = record.holds_any(&input_records) {
        return Err(DataError::AlreadyPrepared { dir: out_dir.to_owned(), input, name });
    }
    record.add_unrecorded(out_dir, &found)?;

    let created = !out_dir.exists();
    fs::create_dir_all(out_dir).map_err(io_err("create the output directory", out_dir))?;
    remove_stale_staging(out_dir);
    let staging = out_dir.join(format!(".prepare-{}", crate::shard::unique_suffix()));
    fs::create_dir(&staging).map_err(io_err("create the staging directory", &staging))?;
    let run = run_pipeline(&expanded.files, &staging, opts, &tokenizer, progress);
    let outcome = run.and_then(|stats| {
        if stats.documents == 0 {
            return Err(DataError::NoDocuments { inputs: expanded.files.len(), bad: stats.bad.counts() });
        }
        let files = commit(&staging, out_dir, &stats.files)?;
        Ok((stats, files))
    });
    let _ = fs::remove_dir_all(&staging);
    if outcome.is_err() && created {
        // Left as it was: absent (`remove_dir` removes only an empty directory).
        let _ = fs::remove_dir(out_dir);
    }
    let (stats, files) = outcome?;

    let file_name = |p: &PathBuf| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let single = (input_records.len() == 1).then(|| input_records[0].clone());
    record.sources.push(Source {
        name: opts.name.clone(),
        input: single.as_ref().map(|i| i.path.clone()),
        input_bytes: single.as_ref().map(|i| i.bytes),
        input_fnv1a64: single.as_ref().map(|i| i.fnv1a64.clone()),
        inputs: input_records,
        documents: Some(stats.documents as usize),
        val_documents: Some(stats.val_documents),
        train_tokens: stats.train_tokens as usize,
        val_tokens: stats.val_tokens as usize,
        files: files.iter().map(file_name).collect(),
        prepared_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_secs()),
        tokenizer: Some(stamp.clone()),
        bad: Some(stats.bad.clone()),
        options: Some(crate::sources::SourceOptions {
            text_field: opts.text_field.clone(),
            txt_docs: opts.txt_docs,
            on_bad: opts.on_bad,
            val_fraction: opts.val_fraction,
            shard_tokens: opts.shard_tokens,
        }),
    });
    record.format = crate::sources::FORMAT;
    record.write(out_dir)?;
    Ok(PrepareSummary {
        out_dir: out_dir.to_owned(),
        tokenizer: stamp,
        input_files: expanded.files.len(),
        skipped_files: expanded.skipped,
        documents: stats.documents,
        val_documents: stats.val_documents,
        total_tokens: stats.val_tokens + stats.train_tokens,
        val_tokens: stats.val_tokens,
        train_tokens: stats.train_tokens,
        text_bytes: stats.text_bytes,
        bad: stats.bad,
        on_bad: opts.on_bad,
        val_fraction: opts.val_fraction,
        files,
        sources: record.sources.len(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Appending shards of another tokenizer would train on ids that mean different things.
fn check_same_tokenizer(out_dir: &Path, found: &[String], record: &Sources, stamp: &TokenizerStamp) -> Result<()> {
    for f in found {
        let shard = crate::shard::TokenShard::open(out_dir.join(f))?;
        if let Some(info) = shard.info().filter(|i| i.fingerprint != stamp.fingerprint_u64()) {
            return Err(DataError::TokenizerMismatch {
                dir: out_dir.to_owned(),
                theirs: format!("{} (in {f})", info.tokenizer),
                ours: stamp.name.clone(),
            });
        }
    }
    if let Some(s) =
        record.sources.iter().find(|s| s.tokenizer.as_ref().is_some_and(|t| t.fingerprint != stamp.fingerprint))
    {
        return Err(DataError::TokenizerMismatch {
            dir: out_dir.to_owned(),
            theirs: format!("{} (source {})", s.tokenizer.as_ref().map_or("", |t| t.name.as_str()), s.name),
            ours: stamp.name.clone(),
        });
    }
    Ok(())
}

/// Staging directories of runs whose process is gone (Linux: no `/proc/<pid>`).
fn remove_stale_staging(out_dir: &Path) {
    let Ok(entries) = fs::read_dir(out_dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(".prepare-").and_then(|r| r.split('-').next()) else { continue };
        if Path::new("/proc/self").exists() && !Path::new("/proc").join(pid).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// Move the staged shards (and their indexes) into `out_dir`; their final paths.
fn commit(staging: &Path, out_dir: &Path, staged: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::with_capacity(staged.len());
    for f in staged {
        let name = f.file_name().unwrap_or_default();
        let idx = crate::docindex::idx_path(f);
        let final_idx = out_dir.join(idx.file_name().unwrap_or_default());
        fs::rename(&idx, &final_idx).map_err(io_err("move into place", &final_idx))?;
        let dest = out_dir.join(name);
        fs::rename(f, &dest).map_err(io_err("move into place", &dest))?;
        files.push(dest);
    }
    debug_assert!(staged.iter().all(|f| f.starts_with(staging)));
    Ok(files)
}

/// What the pipeline wrote into the staging directory.
struct Stats {
    files: Vec<PathBuf>,
    documents: u64,
    val_documents: u64,
    val_tokens: u64,
    train_tokens: u64,
    text_bytes: u64,
    bad: BadReport,
}

/// A batch of records and how far into the inputs' disk bytes it ends, or the reader's error.
type Batch = Result<(Vec<Record>, u64)>;

fn run_pipeline(
    files: &[InputFile],
    staging: &Path,
    opts: &PrepareOptions,
    tokenizer: &Tokenizer,
    progress: &PrepareProgress,
) -> Result<Stats> {
    let read_opts =
        ReadOptions { txt_docs: opts.txt_docs, text_field: opts.text_field.clone(), scratch_dir: staging.to_owned() };
    let stamp = tokenizer.stamp();
    let mut val = SplitWriter::new(staging, &opts.name, Split::Val, opts.shard_tokens, stamp);
    let mut train = SplitWriter::new(staging, &opts.name, Split::Train, opts.shard_tokens, stamp);
    let mut bad = BadReport::default();
    let mut text_bytes = 0u64;
    std::thread::scope(|s| -> Result<()> {
        let (tx, rx) = sync_channel::<Batch>(2);
        let disk = Arc::new(AtomicU64::new(0));
        let reader = s.spawn(move || {
            let mut batch = Vec::new();
            let mut bytes = 0usize;
            for file in files {
                let mut emit = |r: Record| -> Result<()> {
                    if let Record::Doc(t) = &r {
                        bytes += t.len();
                    }
                    batch.push(r);
                    if bytes >= BATCH_BYTES || batch.len() >= BATCH_RECORDS {
                        bytes = 0;
                        let at = disk.load(Ordering::Relaxed);
                        tx.send(Ok((std::mem::take(&mut batch), at))).map_err(|_| DataError::Stopped)?;
                    }
                    Ok(())
                };
                if let Err(e) = read_file(file, &read_opts, disk.clone(), &mut emit) {
                    // The consumer stopped (a refused record): nothing more to say.
                    if !matches!(e, DataError::Stopped) {
                        let _ = tx.send(Err(e));
                    }
                    return;
                }
            }
            let _ = tx.send(Ok((batch, disk.load(Ordering::Relaxed))));
        });
        let out = Written { val: &mut val, train: &mut train, bad: &mut bad, text_bytes: &mut text_bytes };
        let result = consume(rx, opts, tokenizer, progress, out);
        // Dropping the receiver (inside `consume`) makes a blocked reader stop.
        if reader.join().is_err() {
            return Err(DataError::Tokenizer(
                "the input reader thread panicked; this is a bug, please report it".into(),
            ));
        }
        result
    })?;
    val.finish()?;
    train.finish()?;
    let mut files = std::mem::take(&mut val.files);
    files.append(&mut train.files);
    Ok(Stats {
        files,
        documents: val.documents + train.documents,
        val_documents: val.documents,
        val_tokens: val.tokens,
        train_tokens: train.tokens,
        text_bytes,
        bad,
    })
}

/// Where `consume` puts what it reads: the two splits' writers, the bad-record report and
/// the count of text bytes.
struct Written<'a> {
    val: &'a mut SplitWriter,
    train: &'a mut SplitWriter,
    bad: &'a mut BadReport,
    text_bytes: &'a mut u64,
}

fn consume(
    rx: Receiver<Batch>,
    opts: &PrepareOptions,
    tokenizer: &Tokenizer,
    progress: &PrepareProgress,
    out: Written<'_>,
) -> Result<()> {
    let Written { val, train, bad, text_bytes } = out;
    let eot = [tokenizer.stamp().eot_id];
    let mut index = 0u64;
    for batch in rx {
        let (records, disk_at) = batch?;
        let encoded: Vec<Option<Result<Vec<u32>>>> = records
            .par_iter()
            .map(|r| match r {
                Record::Doc(text) => Some(tokenizer.encode(text)),
                Record::Bad(_) => None,
            })
            .collect();
        for (record, ids) in records.into_iter().zip(encoded) {
            let (text, ids) = match (record, ids) {
                (Record::Doc(text), Some(ids)) => (text, ids?),
                (Record::Bad(b), _) => {
                    on_bad(b, opts.on_bad, bad, progress)?;
                    continue;
                }
                (Record::Doc(_), None) => unreachable!("every document was encoded"),
            };
            *text_bytes += text.len() as u64;
            progress.text_bytes.fetch_add(text.len() as u64, Ordering::Relaxed);
            if ids.is_empty() {
                let b = Bad {
                    kind: BadKind::Empty,
                    at: format!("document {}", index + 1),
                    why: "it tokenises to no tokens".into(),
                };
                on_bad(b, opts.on_bad, bad, progress)?;
                continue;
            }
            let w = if is_val_document(index, opts.val_fraction) { &mut *val } else { &mut *train };
            w.push(&eot, true)?;
            w.push(&ids, false)?;
            index += 1;
            progress.documents.fetch_add(1, Ordering::Relaxed);
            progress.tokens.fetch_add(ids.len() as u64 + 1, Ordering::Relaxed);
        }
        progress.disk_bytes.store(disk_at, Ordering::Relaxed);
    }
    Ok(())
}

fn on_bad(b: Bad, policy: OnBad, report: &mut BadReport, progress: &PrepareProgress) -> Result<()> {
    if policy == OnBad::Refuse {
        return Err(DataError::BadRecord { kind: kind_word(b.kind), record: b.to_string() });
    }
    report.add(&b);
    progress.bad.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

pub(crate) fn check_shard_tokens(shard_tokens: usize) -> Result<()> {
    if shard_tokens == 0 || shard_tokens > i32::MAX as usize {
        return Err(DataError::InvalidArgument(format!(
            "shard_tokens must be between 1 and {} (the llm.c header's i32 count; got {shard_tokens})",
            i32::MAX
        )));
    }
    Ok(())
}

pub(crate) fn check_name(name: &str) -> Result<()> {
    let ok_chars = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !ok_chars || name.starts_with('.') {
        return Err(DataError::InvalidArgument(format!(
            "dataset name {name:?} must be non-empty, not start with '.', and use only ASCII letters, digits, '-', \
             '_' and '.'"
        )));
    }
    // The split is recognised from the file name, so the name must not look like one.
    let shard = |split| crate::writer::shard_name(name, split, 0);
    if Split::Val.matches(&shard(Split::Train)) || Split::Train.matches(&shard(Split::Val)) {
        return Err(DataError::InvalidArgument(format!(
            "dataset name {name:?} contains the word \"train\" or \"val\", which would put its shards in both \
             splits: choose another name"
        )));
    }
    Ok(())
}
