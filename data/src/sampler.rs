//! Deterministic, world-size-invariant batch sampling for training.
//!
//! The window of global row `g` of optimizer step `s` is a pure function of
//! `(seed, s, g)`: a counter-based SplitMix64 hash (see [`crate::rng`]; hand-written, not
//! the `rand` crate, so the stream never changes across crate versions) picks one of all
//! valid windows of the dataset uniformly — i.e. a shard weighted by its number of
//! windows, then a start offset in `[0, len - seq_len - 1]`.
//!
//! Rank `r` of `W` ranks at micro-step `a` takes global rows
//! `g = (a * W + r) * micro_batch + i`, `i < micro_batch`. A run on one rank with
//! `grad_accum * W` micro-steps takes rows `g = a' * micro_batch + i` for
//! `a' < grad_accum * W`: the same set. So the rows of a global batch — hence the
//! averaged gradient, up to summation order — do not depend on the world size.
//! Nothing depends on call order either: resuming at step `s` replays step `s` exactly.

use crate::dataset::{fill_row, Dataset};
use crate::error::{DataError, Result};
use crate::rng::{below, hash3, splitmix64};

/// Domain separator so the sampling stream differs from other uses of the same seed.
const SAMPLER_DOMAIN: u64 = 0x5348_4152_4453_4D50; // "SHARDSMP"

/// Draws training windows from a [`Dataset`]; see the module docs.
#[derive(Debug)]
pub struct BatchSampler {
    dataset: Dataset,
    seq_len: usize,
    seed: u64,
    /// `ends[i]`: number of windows in shards `0..=i` (exclusive prefix end).
    ends: Vec<u64>,
}

impl BatchSampler {
    /// A sampler of `seq_len`-token windows.
    ///
    /// Errors if `seq_len` is 0, the dataset has no shards, or any shard holds fewer than
    /// `seq_len + 1` tokens (a window needs `seq_len` inputs and one more target); the
    /// error names the shard.
    pub fn new(dataset: Dataset, seq_len: usize, seed: u64) -> Result<BatchSampler> {
        if seq_len == 0 {
            return Err(DataError::InvalidArgument("seq_len must be at least 1".into()));
        }
        if dataset.shards().is_empty() {
            return Err(DataError::InvalidArgument(format!(
                "dataset {} ({} split) has no shards",
                dataset.source().display(),
                dataset.split()
            )));
        }
        let mut ends = Vec::with_capacity(dataset.shards().len());
        let mut total = 0u64;
        for s in dataset.shards() {
            let needed = seq_len.saturating_add(1);
            if s.len() < needed {
                return Err(DataError::ShardTooShort { path: s.path().to_owned(), tokens: s.len(), needed, seq_len });
            }
            total += (s.len() - seq_len) as u64;
            ends.push(total);
        }
        Ok(BatchSampler { dataset, seq_len, seed, ends })
    }

    /// The dataset sampled from.
    pub fn dataset(&self) -> &Dataset {
        &self.dataset
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The sampling seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The global row index of row `i` of micro-step `micro_step` on `rank` of `world`:
    /// `(micro_step * world + rank) * micro_batch + i`.
    pub fn global_row(rank: usize, world: usize, micro_step: usize, micro_batch: usize, i: usize) -> Option<u64> {
        let (r, w, a, b, i) = (rank as u64, world as u64, micro_step as u64, micro_batch as u64, i as u64);
        a.checked_mul(w)?.checked_add(r)?.checked_mul(b)?.checked_add(i)
    }

    /// The window of `(step, global_row)`: `(shard index, start offset)`. Tokens
    /// `start..start + seq_len + 1` of that shard are the row's inputs and targets.
    pub fn window(&self, step: u64, global_row: u64) -> (usize, usize) {
        let total = *self.ends.last().expect("BatchSampler::new rejects empty datasets");
        let h = hash3(self.seed ^ SAMPLER_DOMAIN, splitmix64(step), global_row);
        let k = below(h, total);
        let shard = self.ends.partition_point(|&end| end <= k);
        let start = if shard == 0 { 0 } else { self.ends[shard - 1] };
        (shard, (k - start) as usize)
    }

    /// Fill one row: `seq_len` inputs and their `seq_len` next-token targets (the inputs
    /// shifted by one) for global row `global_row` of optimizer step `step`.
    pub fn row(&self, step: u64, global_row: u64, out_inputs: &mut [u32], out_targets: &mut [u32]) -> Result<()> {
        let t = self.seq_len;
        if out_inputs.len() != t || out_targets.len() != t {
            return Err(DataError::InvalidArgument(format!(
                "row buffers must hold seq_len = {t} tokens (got {} inputs, {} targets)",
                out_inputs.len(),
                out_targets.len()
            )));
        }
        let (shard, start) = self.window(step, global_row);
        let window = self.dataset.shards()[shard].ids().slice(start..start + t + 1);
        fill_row(window, out_inputs, out_targets);
        Ok(())
    }

    /// Fill the `micro_batch * seq_len` inputs and targets (row-major) that `rank` of
    /// `world` trains on at micro-step `micro_step` of optimizer step `step`: global rows
    /// `(micro_step * world + rank) * micro_batch + i`, `i < micro_batch`.
    #[allow(clippy::too_many_arguments)]
    pub fn micro_batch(
        &self,
        step: u64,
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
            let g = Self::global_row(rank, world, micro_step, micro_batch, i).ok_or_else(|| {
                DataError::InvalidArgument(format!(
                    "global row index overflows u64 (micro_step {micro_step}, world {world}, micro_batch {micro_batch})"
                ))
            })?;
            self.row(step, g, inp, tgt)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::Split;
    use crate::shard::write_shard;
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

    /// All rows (inputs) of one optimizer step over `world` ranks with `accum` micro-steps, sorted.
    fn step_rows(s: &BatchSampler, step: u64, world: usize, accum: usize, mb: usize) -> Vec<Vec<u32>> {
        let t = s.seq_len();
        let mut rows = Vec::new();
        for rank in 0..world {
            for micro in 0..accum {
                let (mut inp, mut tgt) = (vec![0; mb * t], vec![0; mb * t]);
                s.micro_batch(step, rank, world, micro, mb, &mut inp, &mut tgt).unwrap();
                rows.extend(inp.chunks(t).map(|c| c.to_vec()));
            }
        }
        rows.sort();
        rows
    }

    #[test]
    fn sampling_is_deterministic_and_seed_dependent() {
        let (_d1, a) = sampler(&[3000, 5000], 16, 42);
        let (_d2, b) = sampler(&[3000, 5000], 16, 42);
        let (_d3, c) = sampler(&[3000, 5000], 16, 43);
        let rows = |s: &BatchSampler, step| {
            let (mut i, mut t) = (vec![0; 8 * 16], vec![0; 8 * 16]);
            s.micro_batch(step, 1, 2, 3, 8, &mut i, &mut t).unwrap();
            (i, t)
        };
        assert_eq!(rows(&a, 7), rows(&b, 7));
        assert_eq!(rows(&a, 7), rows(&a, 7), "no hidden state");
        assert_ne!(rows(&a, 7), rows(&c, 7), "different seeds give different rows");
        assert_ne!(rows(&a, 7), rows(&a, 8), "different steps give different rows");
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let (_d, s) = sampler(&[100, 57, 300], 8, 1);
        let (mut inp, mut tgt) = (vec![0; 8], vec![0; 8]);
        for g in 0..500 {
            s.row(3, g, &mut inp, &mut tgt).unwrap();
            let (shard, start) = s.window(3, g);
            let toks = s.dataset().shards()[shard].ids();
            assert!(start + 9 <= toks.len());
            for j in 0..8 {
                assert_eq!(Some(inp[j]), toks.get(start + j));
                assert_eq!(Some(tgt[j]), toks.get(start + j + 1));
            }
            assert_eq!(&inp[1..], &tgt[..7]);
        }
    }

    #[test]
    fn windows_cover_every_shard_and_offset_range() {
        // Shard lengths 9, 10, 30 with seq_len 8: 1, 2 and 22 windows.
        let (_d, s) = sampler(&[9, 10, 30], 8, 5);
        let mut seen = std::collections::HashSet::new();
        for g in 0..5000 {
            let (shard, start) = s.window(0, g);
            let len = s.dataset().shards()[shard].len();
            assert!(start <= len - 9, "start {start} out of range for shard {shard}");
            seen.insert((shard, start));
        }
        assert_eq!(seen.len(), 1 + 2 + 22, "every window is reachable");
    }

    #[test]
    fn global_batch_is_world_size_invariant() {
        let (_d, s) = sampler(&[4000, 2500, 7000], 12, 1234);
        let mb = 3;
        for accum in [1, 2] {
            for world in [2, 3] {
                for step in [0u64, 1, 99] {
                    let single = step_rows(&s, step, 1, accum * world, mb);
                    let multi = step_rows(&s, step, world, accum, mb);
                    assert_eq!(single.len(), accum * world * mb);
                    assert_eq!(single, multi, "world {world}, accum {accum}, step {step}");
                }
            }
        }
        // And the formula itself: rank r, micro-step a, row i.
        assert_eq!(BatchSampler::global_row(2, 3, 1, 4, 1), Some(((3 + 2) * 4 + 1) as u64));
    }

    #[test]
    fn short_shard_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let ds = make_dataset(dir.path(), &[100, 16]);
        let e = BatchSampler::new(ds, 16, 0).unwrap_err();
        assert!(matches!(e, DataError::ShardTooShort { tokens: 16, needed: 17, .. }), "{e}");
        assert!(e.to_string().contains("t_train_000001.bin"), "{e}");
    }

    #[test]
    fn bad_arguments_are_errors_not_panics() {
        let (_d, s) = sampler(&[100], 8, 0);
        let (mut i, mut t) = (vec![0; 16], vec![0; 16]);
        assert!(s.micro_batch(0, 2, 2, 0, 2, &mut i, &mut t).is_err(), "rank >= world");
        assert!(s.micro_batch(0, 0, 0, 0, 2, &mut i, &mut t).is_err(), "world 0");
        assert!(s.micro_batch(0, 0, 1, 0, 3, &mut i, &mut t).is_err(), "buffer size");
        assert!(s.row(0, 0, &mut i, &mut t).is_err(), "row buffer size");
        let dir = tempfile::tempdir().unwrap();
        assert!(BatchSampler::new(make_dataset(dir.path(), &[100]), 0, 0).is_err(), "seq_len 0");
    }
}
