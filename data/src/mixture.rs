//! Which source a global row comes from when several datasets are mixed by weight.
//!
//! Rows are numbered by one global counter (the rows consumed since the run began,
//! whatever the world size or batch shape), and row `a` goes to the source whose share is
//! furthest behind: the `s` maximising `(a + 1) * w_s - c_s`, where `w_s` are the
//! normalised weights and `c_s` the rows source `s` got among rows `0..a` (ties to the
//! lower index). This is smooth weighted round-robin with real weights: the deficits
//! `a * w_s - c_s` stay within one row, so over any prefix the realised counts match the
//! weights within a row per source, and the choice is a pure function of the counts —
//! which the checkpoint stores — so a resume on any number of ranks continues it exactly.

use crate::error::{DataError, Result};

/// Normalised mixture weights; see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct Mixture {
    weights: Vec<f64>,
}

impl Mixture {
    /// Weights as given (any positive finite numbers; they are normalised to sum to 1).
    /// `names` label the sources in errors.
    pub fn new(weights: &[f64], names: &[String]) -> Result<Mixture> {
        if weights.is_empty() {
            return Err(DataError::InvalidArgument("a mixture needs at least one source".into()));
        }
        for (i, &w) in weights.iter().enumerate() {
            if !(w.is_finite() && w > 0.0) {
                let name = names.get(i).map_or_else(|| format!("source {i}"), |n| format!("source {n:?}"));
                return Err(DataError::InvalidArgument(format!(
                    "{name} has weight {w}: every data source's weight must be a positive finite number (weights \
                     are relative: 3 and 1 give 75% and 25% of the rows)"
                )));
            }
        }
        let total: f64 = weights.iter().sum();
        if !total.is_finite() {
            return Err(DataError::InvalidArgument(format!(
                "the data source weights sum to {total}: use smaller weights"
            )));
        }
        Ok(Mixture { weights: weights.iter().map(|w| w / total).collect() })
    }

    /// The normalised weights.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// The source of the next row, given how many rows each source has had so far.
    pub fn pick(&self, counts: &[u64]) -> usize {
        debug_assert_eq!(counts.len(), self.weights.len());
        if self.weights.len() == 1 {
            return 0;
        }
        let next = counts.iter().sum::<u64>() as f64 + 1.0;
        let mut best = (0, f64::NEG_INFINITY);
        for (s, (&w, &c)) in self.weights.iter().zip(counts).enumerate() {
            let deficit = next * w - c as f64;
            if deficit > best.1 {
                best = (s, deficit);
            }
        }
        best.0
    }

    /// The counts after `rows` rows from the start (a simulation: `rows × sources` work).
    pub fn counts_after(&self, rows: u64) -> Vec<u64> {
        let mut counts = vec![0u64; self.weights.len()];
        for _ in 0..rows {
            let s = self.pick(&counts);
            counts[s] += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("s{i}")).collect()
    }

    #[test]
    fn realised_shares_stay_within_one_row_of_the_weights() {
        let mut rng = SplitMix64::new(3);
        let mut cases: Vec<Vec<f64>> = vec![vec![3.0, 1.0], vec![1.0, 1.0, 1.0], vec![0.7, 0.2, 0.1], vec![1e-3, 1.0]];
        for _ in 0..40 {
            let n = rng.range(2, 7);
            cases.push((0..n).map(|_| (rng.below(1000) + 1) as f64 / 7.0).collect());
        }
        for w in cases {
            let m = Mixture::new(&w, &names(w.len())).unwrap();
            let mut counts = vec![0u64; w.len()];
            for a in 1..=5000u64 {
                let s = m.pick(&counts);
                counts[s] += 1;
                for (s, (&c, &ws)) in counts.iter().zip(m.weights()).enumerate() {
                    let dev = c as f64 - a as f64 * ws;
                    assert!(dev.abs() < 1.0, "weights {w:?}: source {s} has {c} of {a} rows (share {ws})");
                }
            }
            assert_eq!(m.counts_after(5000), counts);
        }
    }

    #[test]
    fn bad_weights_are_refused_naming_the_source() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = Mixture::new(&[1.0, bad], &names(2)).unwrap_err().to_string();
            assert!(e.contains("\"s1\"") && e.contains("positive finite"), "{e}");
        }
        assert!(Mixture::new(&[], &[]).is_err());
        assert!(Mixture::new(&[f64::MAX, f64::MAX], &names(2)).is_err(), "overflowing sum");
    }
}
