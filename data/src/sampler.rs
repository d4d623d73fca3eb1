//! The training loader: epochs of non-overlapping windows, without replacement, from one
//! dataset or a weighted mixture, with a position that is one count per source.
//!
//! **Windows.** Each shard of a source is cut into `(len - 1) / seq_len` windows of
//! `seq_len + 1` tokens at stride `seq_len` (as llm.c's loader and the val walk do: a
//! window's last target is the next window's first input, so every token after a shard's
//! first is a target exactly once per epoch; the `(len - 1) % seq_len` tokens at a
//! shard's end, and shards shorter than a window, are not trained on). A source's windows are numbered across its shards in
//! order.
//!
//! **Order.** Epoch `e` of source `s` visits its windows in the order of
//! [`EpochOrder`]`(seed, s, e)`, a stateless seeded bijection: the `c`-th row a source
//! serves is window `order(c % n)` of epoch `c / n`. A small source in a mixture runs
//! through more epochs; each is a fresh order.
//!
//! **Rows.** Training consumes rows in one global sequence `0, 1, 2, …` across steps;
//! with several sources each row goes to a source by the [`Mixture`] rule, a pure
//! function of the rows each source has had. Within one optimizer step, rank `r` of `W`
//! ranks at micro-step `a` takes the step's rows `g = (a * W + r) * micro_batch + i`,
//! `i < micro_batch`. A run on one rank with `grad_accum * W` micro-steps takes rows
//! `g = a' * micro_batch + i`, `a' < grad_accum * W`: the same set, so the rows of a
//! global batch — hence the averaged gradient, up to summation order — do not depend on
//! the world size.
//!
//! **Position.** The loader's whole state is the rows each source has served
//! ([`LoaderState`], saved in every checkpoint with what identifies the data). Rows
//! consumed are a count, not a step number, so a run resumed with another world size,
//! micro-batch or accumulation continues at exactly the next row: an uninterrupted run
//! and an interrupted one see the same rows in the same order, and each window of an
//! epoch is trained on once.

use serde::{Deserialize, Serialize};

use crate::dataset::{fill_row, Dataset};
use crate::epoch::EpochOrder;
use crate::error::{DataError, Result};
use crate::header::HEADER_BYTES;
use crate::mixture::Mixture;

/// One dataset of a mixture.
#[derive(Debug)]
pub struct Source {
    /// How the source is named in errors, metrics and checkpoints (unique in a mixture).
    pub name: String,
    /// Relative share of the rows (any positive finite number).
    pub weight: f64,
    /// The source's training shards.
    pub dataset: Dataset,
}

/// A source's windows: the prefix counts over its shards.
#[derive(Debug)]
struct Windows {
    name: String,
    dataset: Dataset,
    /// `ends[i]`: windows in shards `0..=i`.
    ends: Vec<u64>,
}

impl Windows {
    fn total(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }
}

/// Where one row of a step comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WindowRef {
    /// Index of the source in the mixture.
    pub source: usize,
    /// The source's epoch this row belongs to.
    pub epoch: u64,
    /// Shard index within the source, and the window's first token in it.
    pub shard: usize,
    pub start: usize,
}

/// One shard as a checkpoint remembers it: file name (not the directory: data may move)
/// and token count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub file: String,
    pub tokens: u64,
}

/// One source's position and identity, as saved in a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceState {
    pub name: String,
    /// The weight as configured (not normalised).
    pub weight: f64,
    /// The path the source was read from (informative: a moved dataset still resumes).
    pub path: String,
    /// Rows this source has served since the run began.
    pub rows: u64,
    /// Windows in one epoch of this source.
    pub windows: u64,
    /// Completed epochs (`rows / windows`; informative).
    pub epochs: u64,
    pub shards: Vec<ShardEntry>,
}

/// The loader's exact position and the identity of its data: what a checkpoint stores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoaderState {
    pub seq_len: usize,
    pub seed: u64,
    /// Global rows consumed (the sum over the sources).
    pub rows: u64,
    pub sources: Vec<SourceState>,
}

/// Draws training rows from one dataset or a mixture; see the module docs.
#[derive(Debug)]
pub struct BatchSampler {
    sources: Vec<Windows>,
    weights: Vec<f64>,
    mixture: Mixture,
    seq_len: usize,
    seed: u64,
    /// Rows each source has served before the current step.
    counts: Vec<u64>,
    /// The current (or last) step's rows, in global-row order.
    plan: Vec<WindowRef>,
    /// Whether `plan` is the current step (begun and not yet ended).
    in_step: bool,
    /// Token ids must be below this (the model's vocabulary); checked per row.
    vocab: Option<u32>,
}

impl BatchSampler {
    /// A loader over one dataset (named "data").
    pub fn new(dataset: Dataset, seq_len: usize, seed: u64) -> Result<BatchSampler> {
        BatchSampler::mixed(vec![Source { name: "data".into(), weight: 1.0, dataset }], seq_len, seed)
    }

    /// A loader over a weighted mixture of sources.
    ///
    /// Errors if `seq_len` is 0, a weight is not positive and finite, two sources share a
    /// name, a source has no shards or no shard of `seq_len + 1` tokens (a window needs
    /// `seq_len` inputs and one more target: the error names its longest shard), or two
    /// sources were made by different tokenizers. Shorter shards add no windows.
    pub fn mixed(sources: Vec<Source>, seq_len: usize, seed: u64) -> Result<BatchSampler> {
        if seq_len == 0 {
            return Err(DataError::InvalidArgument("seq_len must be at least 1".into()));
        }
        let names: Vec<String> = sources.iter().map(|s| s.name.clone()).collect();
        let weights: Vec<f64> = sources.iter().map(|s| s.weight).collect();
        let mixture = Mixture::new(&weights, &names)?;
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(DataError::InvalidArgument(format!(
                    "two data sources are named {n:?}: give each [[data.sources]] entry its own name"
                )));
            }
        }
        check_same_tokenizer(&sources)?;
        let mut windows = Vec::with_capacity(sources.len());
        for s in sources {
            let ds = s.dataset;
            if ds.shards().is_empty() {
                return Err(DataError::InvalidArgument(format!(
                    "dataset {} ({} split) has no shards",
                    ds.source().display(),
                    ds.split()
                )));
            }
            let mut ends = Vec::with_capacity(ds.shards().len());
            let mut total = 0u64;
            // A shard shorter than a window (the last of a prepared split, often) adds none.
            for sh in ds.shards() {
                total += (sh.len().saturating_sub(1) / seq_len) as u64;
                ends.push(total);
            }
            if total == 0 {
                let longest = ds.shards().iter().max_by_key(|sh| sh.len()).expect("not empty");
                return Err(DataError::ShardTooShort {
                    path: longest.path().to_owned(),
                    tokens: longest.len(),
                    needed: seq_len.saturating_add(1),
                    seq_len,
                });
            }
            windows.push(Windows { name: s.name, dataset: ds, ends });
        }
        let n = windows.len();
        Ok(BatchSampler {
            sources: windows,
            weights,
            mixture,
            seq_len,
            seed,
            counts: vec![0; n],
            plan: Vec::new(),
            in_step: false,
            vocab: None,
        })
    }

    /// The first source's dataset (the only one without mixing).
    pub fn dataset(&self) -> &Dataset {
        &self.sources[0].dataset
    }

    /// Source `i`'s dataset.
    pub fn source_dataset(&self, i: usize) -> &Dataset {
        &self.sources[i].dataset
    }

    /// The sources' names, in order.
    pub fn source_names(&self) -> Vec<&str> {
        self.sources.iter().map(|s| s.name.as_str()).collect()
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The sampling seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Windows in one epoch of each source.
    pub fn windows(&self) -> Vec<u64> {
        self.sources.iter().map(Windows::total).collect()
    }

    /// Global rows consumed so far (the steps ended).
    pub fn rows(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Rows each source has served so far.
    pub fn source_rows(&self) -> &[u64] {
        &self.counts
    }

    /// Refuse token ids at or above `vocab` (the model's vocabulary) when a row is filled:
    /// a corrupt shard is then named with the offset of the bad id instead of reaching
    /// the embedding.
    pub fn set_vocab_limit(&mut self, vocab: u32) {
        self.vocab = Some(vocab);
    }

    /// Refuse a global batch of `rows` rows that one epoch of the data cannot fill
    /// without repeating a window, naming the numbers.
    pub fn check_batch(&self, rows: u64, shape: &str) -> Result<()> {
        let have: u64 = self.windows().iter().sum();
        if rows > have {
            let tokens: usize = self.sources.iter().map(|s| s.dataset.total_tokens()).sum();
            return Err(DataError::TooLittleData {
                tokens,
                windows: have,
                seq_len: self.seq_len,
                rows,
                shape: shape.into(),
            });
        }
        Ok(())
    }

    /// The global row number `(micro_step * world + rank) * micro_batch + i` within a step.
    pub fn global_row(rank: usize, world: usize, micro_step: usize, micro_batch: usize, i: usize) -> Option<u64> {
        let (r, w, a, b, i) = (rank as u64, world as u64, micro_step as u64, micro_batch as u64, i as u64);
        a.checked_mul(w)?.checked_add(r)?.checked_mul(b)?.checked_add(i)
    }

    /// The window of the `row`-th row source `source` serves (counting from the run's start).
    pub fn window(&self, source: usize, row: u64) -> WindowRef {
        let w = &self.sources[source];
        let n = w.total();
        let (epoch, pos) = (row / n, row % n);
        let k = EpochOrder::new(n, self.seed, source as u64, epoch).at(pos);
        let shard = w.ends.partition_point(|&end| end <= k);
        let first = if shard == 0 { 0 } else { w.ends[shard - 1] };
        WindowRef { source, epoch, shard, start: ((k - first) as usize) * self.seq_len }
    }

    /// Start a step of `rows` global rows: assign each to a source and a window.
    /// Every rank plans the whole step (a few operations per row), so they agree.
    pub fn begin_step(&mut self, rows: usize) {
        self.plan.clear();
        let mut counts = self.counts.clone();
        // One EpochOrder per source and epoch would be cheaper; the rows of a step are few.
        for _ in 0..rows {
            let s = self.mixture.pick(&counts);
            self.plan.push(self.window(s, counts[s]));
            counts[s] += 1;
        }
        self.in_step = true;
    }

    /// End the step begun: its rows count as consumed.
    pub fn end_step(&mut self) {
        if self.in_step {
            for w in &self.plan {
                self.counts[w.source] += 1;
            }
            self.in_step = false;
        }
    }

    /// The rows of the current step (after [`Self::begin_step`]) or of the last one ended.
    pub fn step_windows(&self) -> &[WindowRef] {
        &self.plan
    }

    /// Fill one row from its window: `seq_len` inputs and their next-token targets.
    pub fn fill(&self, w: WindowRef, out_inputs: &mut [u32], out_targets: &mut [u32]) -> Result<()> {
        let t = self.seq_len;
        if out_inputs.len() != t || out_targets.len() != t {
            return Err(DataError::InvalidArgument(format!(
                "row buffers must hold seq_len = {t} tokens (got {} inputs, {} targets)",
                out_inputs.len(),
                out_targets.len()
            )));
        }
        let shard = &self.sources[w.source].dataset.shards()[w.shard];
        let window = shard.ids().slice(w.start..w.start + t + 1);
        fill_row(window, out_inputs, out_targets);
        if let Some(vocab) = self.vocab {
            let last = out_targets.last().copied().into_iter();
            if let Some(j) = out_inputs.iter().copied().chain(last).position(|id| id >= vocab) {
                let offset = w.start + j;
                return Err(DataError::TokenOutOfRange {
                    path: shard.path().to_owned(),
                    offset,
                    byte: (HEADER_BYTES + offset * shard.width().bytes()) as u64,
                    id: window.get(j).unwrap_or(0),
                    vocab,
                });
            }
        }
        Ok(())
    }

    /// Fill the `micro_batch * seq_len` inputs and targets (row-major) that `rank` of
    /// `world` trains on at micro-step `micro_step` of the current step: the step's rows
    /// `(micro_step * world + rank) * micro_batch + i`, `i < micro_batch`.
    pub fn micro_batch(
        &self,
        rank: usize,
        world: usize,
        micro_step: usize,
        micro_batch: usize,
        inputs: &mut [u32],
        targets: &mut [u32],
    ) -> Result<()> {
        if world == 0 || rank >= world {
            return Err(DataError::InvalidArgument(format!("rank {rank} is not in a world of {world} ranks")));
        }
        let t = self.seq_len;
        let n = micro_batch.checked_mul(t);
        if n != Some(inputs.len()) || n != Some(targets.len()) {
            return Err(DataError::InvalidArgument(format!(
                "micro-batch buffers must hold micro_batch * seq_len = {micro_batch} * {t} tokens (got {} inputs, {} \
                 targets)",
                inputs.len(),
                targets.len()
            )));
        }
        for (i, (inp, tgt)) in inputs.chunks_exact_mut(t).zip(targets.chunks_exact_mut(t)).enumerate() {
            let g = Self::global_row(rank, world, micro_step, micro_batch, i);
            let w =
                g.and_then(|g| self.plan.get(usize::try_from(g).ok()?)).filter(|_| self.in_step).ok_or_else(|| {
                    DataError::InvalidArgument(format!(
                    "row {i} of micro-step {micro_step} on rank {rank} of {world} is not in the step begun ({} rows; \
                     call begin_step with micro_batch * grad_accum * world rows)",
                    if self.in_step { self.plan.len() } else { 0 }
                ))
                })?;
            self.fill(*w, inp, tgt)?;
        }
        Ok(())
    }

    /// The position and identity of the data, for a checkpoint.
    pub fn state(&self) -> LoaderState {
        let sources = self
            .sources
            .iter()
            .zip(&self.weights)
            .zip(&self.counts)
            .map(|((w, &weight), &rows)| SourceState {
                name: w.name.clone(),
                weight,
                path: w.dataset.source().display().to_string(),
                rows,
                windows: w.total(),
                epochs: rows / w.total().max(1),
                shards: w
                    .dataset
                    .shards()
                    .iter()
                    .map(|s| ShardEntry {
                        file: s.path().file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
                        tokens: s.len() as u64,
                    })
                    .collect(),
            })
            .collect();
        LoaderState { seq_len: self.seq_len, seed: self.seed, rows: self.rows(), sources }
    }

    /// What differs between a saved loader's data and this one's, one phrase each
    /// (empty: the same data, the saved position applies exactly). Paths are not
    /// compared: a dataset moved to another disk is the same data.
    pub fn differences(&self, saved: &LoaderState) -> Vec<String> {
        let now = self.state();
        let mut d = Vec::new();
        if saved.seq_len != now.seq_len {
            d.push(format!("model.seq_len was {}, is {}", saved.seq_len, now.seq_len));
        }
        if saved.seed != now.seed {
            d.push(format!("train.seed was {}, is {}", saved.seed, now.seed));
        }
        for s in &saved.sources {
            match now.sources.iter().find(|n| n.name == s.name) {
                None => d.push(format!("source {:?} ({}) is gone", s.name, s.path)),
                Some(n) => {
                    if s.weight != n.weight {
                        d.push(format!("source {:?}'s weight was {}, is {}", s.name, s.weight, n.weight));
                    }
                    if s.shards != n.shards {
                        d.push(format!(
                            "source {:?}'s shards changed ({})",
                            s.name,
                            shard_change(&s.shards, &n.shards)
                        ));
                    }
                }
            }
        }
        for n in &now.sources {
            if !saved.sources.iter().any(|s| s.name == n.name) {
                d.push(format!("source {:?} ({}) is new", n.name, n.path));
            }
        }
        let order = |st: &LoaderState| st.sources.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        if d.is_empty() && order(saved) != order(&now) {
            d.push(format!("the sources' order was {:?}, is {:?}", order(saved), order(&now)));
        }
        d
    }

    /// Continue from a saved position. With the same data (see [`Self::differences`])
    /// the position applies exactly; otherwise this errors naming what changed, unless
    /// `allow_changed`: then each source continues from its saved rows (matched by name;
    /// a new source starts at 0), and the changed parts' epochs are no longer
    /// exactly-once. Returns the differences accepted.
    pub fn restore(&mut self, saved: &LoaderState, allow_changed: bool) -> Result<Vec<String>> {
        let diff = self.differences(saved);
        if !diff.is_empty() && !allow_changed {
            return Err(DataError::DataChanged { changes: diff.join("; ") });
        }
        for (w, c) in self.sources.iter().zip(self.counts.iter_mut()) {
            *c = saved.sources.iter().find(|s| s.name == w.name).map_or(0, |s| s.rows);
        }
        self.plan.clear();
        self.in_step = false;
        Ok(diff)
    }

    /// Continue after `rows` global rows from the start, for checkpoints saved before the
    /// loader's position was recorded (their data position was their step).
    pub fn restore_rows(&mut self, rows: u64) {
        self.counts = self.mixture.counts_after(rows);
        self.plan.clear();
        self.in_step = false;
    }
}

/// Sources of a mixture must share a tokenizer (the same id must mean the same text).
fn check_same_tokenizer(sources: &[Source]) -> Result<()> {
    let mut first: Option<(&str, &crate::shard::ShardInfo)> = None;
    for s in sources {
        let Some(info) = s.dataset.tokenizer()? else { continue };
        match first {
            None => first = Some((&s.name, info)),
            Some((name, f)) if f.fingerprint != info.fingerprint => {
                return Err(DataError::InvalidArgument(format!(
                    "data sources {name:?} and {:?} were made by different tokenizers ({} and {}): the same id \
                     would mean different text; prepare every source with one tokenizer",
                    s.name, f.tokenizer, info.tokenizer
                )));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// A short account of how two shard lists differ.
fn shard_change(was: &[ShardEntry], is: &[ShardEntry]) -> String {
    let tokens = |v: &[ShardEntry]| v.iter().map(|s| s.tokens).sum::<u64>();
    if was.len() != is.len() {
        return format!("{} shards of {} tokens, now {} of {}", was.len(), tokens(was), is.len(), tokens(is));
    }
    match was.iter().zip(is).find(|(a, b)| a != b) {
        Some((a, b)) => format!("{} with {} tokens, now {} with {}", a.file, a.tokens, b.file, b.tokens),
        None => "the same".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::Split;
    use crate::shard::write_shard;
    use std::collections::HashSet;
    use std::path::Path;

    /// Shards whose tokens encode (shard, position) so a row identifies its window.
    fn make_dataset(dir: &Path, lens: &[usize]) -> Dataset {
        for (s, &len) in lens.iter().enumerate() {
            let toks: Vec<u16> = (0..len).map(|i| (s * 10_000 + i) as u16).collect();
            write_shard(dir.join(format!("t_train_{s:06}.bin")), &toks).unwrap();
        }
        Dataset::open(dir, Split::Train).unwrap()
    }

    fn sampler(lens: &[usize], seq_len: usize, seed: u64) -> (tempfile::TempDir, BatchSampler) {
        let dir = tempfile::tempdir().unwrap();
        let ds = make_dataset(dir.path(), lens);
        let s = BatchSampler::new(ds, seq_len, seed).unwrap();
        (dir, s)
    }

    /// All rows (inputs) of one step over `world` ranks with `accum` micro-steps, sorted.
    fn step_rows(s: &mut BatchSampler, world: usize, accum: usize, mb: usize) -> Vec<Vec<u32>> {
        let t = s.seq_len();
        s.begin_step(world * accum * mb);
        let mut rows = Vec::new();
        for rank in 0..world {
            for micro in 0..accum {
                let (mut inp, mut tgt) = (vec![0; mb * t], vec![0; mb * t]);
                s.micro_batch(rank, world, micro, mb, &mut inp, &mut tgt).unwrap();
                rows.extend(inp.chunks(t).map(|c| c.to_vec()));
            }
        }
        s.end_step();
        rows.sort();
        rows
    }

    #[test]
    fn an_epoch_visits_every_window_once_in_a_seeded_order() {
        // Shard lengths 9, 10, 30 with seq_len 8: 1, 1 and 3 windows (stride 8).
        let (_d, mut s) = sampler(&[9, 10, 30], 8, 5);
        assert_eq!(s.windows(), vec![5]);
        s.begin_step(10);
        let plan = s.step_windows().to_vec();
        let first: HashSet<_> = plan[..5].iter().map(|w| (w.shard, w.start)).collect();
        let want: HashSet<_> = [(0, 0), (1, 0), (2, 0), (2, 8), (2, 16)].into_iter().collect();
        assert_eq!(first, want);
        assert!(plan[..5].iter().all(|w| w.epoch == 0) && plan[5..].iter().all(|w| w.epoch == 1));
        let second: HashSet<_> = plan[5..].iter().map(|w| (w.shard, w.start)).collect();
        assert_eq!(second, want, "the next epoch, again each once");
        let (_d2, mut other) = sampler(&[9, 10, 30], 8, 6);
        other.begin_step(5);
        assert_ne!(other.step_windows(), &plan[..5], "another seed, another order");
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let (_d, mut s) = sampler(&[100, 57, 300], 8, 1);
        s.begin_step(50);
        let (mut inp, mut tgt) = (vec![0; 8], vec![0; 8]);
        for &w in s.step_windows() {
            s.fill(w, &mut inp, &mut tgt).unwrap();
            let toks = s.dataset().shards()[w.shard].ids();
            assert!(w.start + 9 <= toks.len() && w.start % 8 == 0);
            for j in 0..8 {
                assert_eq!(Some(inp[j]), toks.get(w.start + j));
                assert_eq!(Some(tgt[j]), toks.get(w.start + j + 1));
            }
        }
    }

    #[test]
    fn global_batch_is_world_size_invariant() {
        let mb = 3;
        for accum in [1, 2] {
            for world in [2, 3] {
                let (_a, mut single) = sampler(&[4000, 2500, 7000], 12, 1234);
                let (_b, mut multi) = sampler(&[4000, 2500, 7000], 12, 1234);
                for step in 0..3 {
                    let one = step_rows(&mut single, 1, accum * world, mb);
                    assert_eq!(one.len(), accum * world * mb);
                    assert_eq!(one, step_rows(&mut multi, world, accum, mb), "world {world} accum {accum} step {step}");
                }
            }
        }
        assert_eq!(BatchSampler::global_row(2, 3, 1, 4, 1), Some(((3 + 2) * 4 + 1) as u64));
    }

    #[test]
    fn position_is_rows_whatever_the_batch_shape() {
        let (_a, mut a) = sampler(&[900, 700], 10, 9);
        let (_b, mut b) = sampler(&[900, 700], 10, 9);
        // a: steps of 6 rows; b: 4 rows, then restored from a's state into steps of 9.
        let mut seen_a = Vec::new();
        for _ in 0..6 {
            a.begin_step(6);
            seen_a.extend_from_slice(a.step_windows());
            a.end_step();
        }
        let mut seen_b = Vec::new();
        for _ in 0..3 {
            b.begin_step(4);
            seen_b.extend_from_slice(b.step_windows());
            b.end_step();
        }
        let saved = b.state();
        assert_eq!(saved.rows, 12);
        let (_c, mut c) = sampler(&[900, 700], 10, 9);
        assert!(c.restore(&saved, false).unwrap().is_empty());
        for _ in 0..3 {
            c.begin_step(8);
            seen_b.extend_from_slice(c.step_windows());
            c.end_step();
        }
        assert_eq!(seen_a, seen_b);
    }

    #[test]
    fn changed_data_is_named_and_refused_unless_allowed() {
        let (_a, mut a) = sampler(&[900, 700], 10, 9);
        a.begin_step(7);
        a.end_step();
        let saved = a.state();
        let (_b, mut b) = sampler(&[900, 710], 10, 9);
        let e = b.restore(&saved, false).unwrap_err().to_string();
        assert!(e.contains("t_train_000001.bin with 700 tokens, now t_train_000001.bin with 710"), "{e}");
        assert!(e.contains("allow_changed_data"), "{e}");
        assert_eq!(b.restore(&saved, true).unwrap().len(), 1);
        assert_eq!(b.rows(), 7);
        let (_c, mut c) = sampler(&[900, 700], 12, 10);
        let e = c.restore(&saved, false).unwrap_err().to_string();
        assert!(e.contains("model.seq_len was 10, is 12") && e.contains("train.seed was 9, is 10"), "{e}");
    }

    #[test]
    fn mixtures_hold_their_weights_and_small_sources_repeat() {
        let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
        let lens: [&[usize]; 3] = [&[2000], &[450], &[90]];
        let weights = [5.0, 3.0, 2.0];
        let sources = (0..3)
            .map(|i| Source {
                name: format!("s{i}"),
                weight: weights[i],
                dataset: make_dataset(dirs[i].path(), lens[i]),
            })
            .collect();
        let mut s = BatchSampler::mixed(sources, 9, 4).unwrap();
        assert_eq!(s.windows(), vec![222, 49, 9]);
        let mut per_source: Vec<Vec<WindowRef>> = vec![Vec::new(); 3];
        for step in 1..=40u64 {
            s.begin_step(7);
            for w in s.step_windows() {
                per_source[w.source].push(*w);
            }
            s.end_step();
            for (i, &c) in s.source_rows().iter().enumerate() {
                let want = (step * 7) as f64 * weights[i] / 10.0;
                assert!((c as f64 - want).abs() < 1.0, "source {i}: {c} rows of {}, want {want}", step * 7);
            }
        }
        // The smallest source ran through 56 / 9 epochs, each a permutation of its windows.
        let small = &per_source[2];
        assert_eq!(small.len(), 56);
        for e in 0..6 {
            let ep: HashSet<_> = small.iter().filter(|w| w.epoch == e).map(|w| w.start).collect();
            assert_eq!(ep.len(), 9, "epoch {e} of the small source");
        }
        assert_eq!(s.state().sources[2].epochs, 6);
    }

    #[test]
    fn mixtures_refuse_bad_weights_duplicate_names_and_other_tokenizers() {
        let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let src = |name: &str, w: f64, dir: &Path| Source {
            name: name.into(),
            weight: w,
            dataset: make_dataset(dir, &[100]),
        };
        for w in [0.0, -2.0, f64::NAN] {
            let e = BatchSampler::mixed(vec![src("a", 1.0, d1.path()), src("b", w, d2.path())], 8, 0).unwrap_err();
            assert!(e.to_string().contains("\"b\" has weight"), "{e}");
        }
        let e = BatchSampler::mixed(vec![src("a", 1.0, d1.path()), src("a", 1.0, d2.path())], 8, 0).unwrap_err();
        assert!(e.to_string().contains("two data sources are named \"a\""), "{e}");

        use crate::ids::Ids;
        use crate::shard::{write_shard_ids, ShardInfo};
        let info = |fp: u64| ShardInfo {
            vocab_size: 300,
            eot_id: 1,
            max_id: Some(200),
            fingerprint: fp,
            tokenizer: format!("tok{fp}"),
        };
        let (e1, e2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let ids: Vec<u16> = (0..100).collect();
        write_shard_ids(e1.path().join("x_train_000000.bin"), Ids::U16(&ids), Some(&info(1)), None).unwrap();
        write_shard_ids(e2.path().join("x_train_000000.bin"), Ids::U16(&ids), Some(&info(2)), None).unwrap();
        let open = |d: &Path| Dataset::open(d, Split::Train).unwrap();
        let e = BatchSampler::mixed(
            vec![
                Source { name: "a".into(), weight: 1.0, dataset: open(e1.path()) },
                Source { name: "b".into(), weight: 1.0, dataset: open(e2.path()) },
            ],
            8,
            0,
        )
        .unwrap_err();
        assert!(e.to_string().contains("tok1") && e.to_string().contains("tok2"), "{e}");
    }

    #[test]
    fn too_little_data_and_out_of_range_ids_are_named() {
        let (_d, mut s) = sampler(&[41], 8, 0); // 5 windows
        s.check_batch(5, "1 x 5 x 1").unwrap();
        let e = s.check_batch(6, "micro_batch 2 x grad_accum 3 x 1 ranks").unwrap_err().to_string();
        assert!(e.contains("41 tokens") && e.contains("5 windows") && e.contains("6 rows"), "{e}");
        assert!(e.contains("micro_batch 2 x grad_accum 3 x 1 ranks"), "{e}");
        s.set_vocab_limit(30);
        s.begin_step(5);
        let (mut i, mut t) = (vec![0; 8], vec![0; 8]);
        let bad = s.step_windows().iter().find(|w| w.start >= 24).copied().unwrap();
        let e = s.fill(bad, &mut i, &mut t).unwrap_err().to_string();
        assert!(e.contains("t_train_000000.bin") && e.contains(&format!("token {}", bad.start.max(30))), "{e}");
    }

    #[test]
    fn short_shards_add_no_windows_and_data_without_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = BatchSampler::new(make_dataset(dir.path(), &[100, 16]), 16, 0).unwrap();
        assert_eq!(s.windows(), vec![6], "the 16-token shard holds no window of 17");
        s.begin_step(6);
        assert!(s.step_windows().iter().all(|w| w.shard == 0));
        let dir = tempfile::tempdir().unwrap();
        let e = BatchSampler::new(make_dataset(dir.path(), &[10, 16]), 16, 0).unwrap_err();
        assert!(matches!(e, DataError::ShardTooShort { tokens: 16, needed: 17, .. }), "{e}");
        assert!(e.to_string().contains("t_train_000001.bin"), "{e}");
    }

    #[test]
    fn bad_arguments_are_errors_not_panics() {
        let (_d, mut s) = sampler(&[100], 8, 0);
        let (mut i, mut t) = (vec![0; 16], vec![0; 16]);
        assert!(s.micro_batch(0, 1, 0, 2, &mut i, &mut t).is_err(), "no step begun");
        s.begin_step(2);
        assert!(s.micro_batch(0, 1, 0, 2, &mut i, &mut t).is_ok());
        assert!(s.micro_batch(1, 2, 0, 2, &mut i, &mut t).is_err(), "beyond the step's rows");
        assert!(s.micro_batch(2, 2, 0, 2, &mut i, &mut t).is_err(), "rank >= world");
        assert!(s.micro_batch(0, 0, 0, 2, &mut i, &mut t).is_err(), "world 0");
        assert!(s.micro_batch(0, 1, 0, 3, &mut i, &mut t).is_err(), "buffer size");
        let w = s.step_windows()[0];
        assert!(s.fill(w, &mut i, &mut t).is_err(), "row buffer size");
        let dir = tempfile::tempdir().unwrap();
        assert!(BatchSampler::new(make_dataset(dir.path(), &[100]), 0, 0).is_err(), "seq_len 0");
    }
}
