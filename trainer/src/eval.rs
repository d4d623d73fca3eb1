//! `launcher eval`: the mean loss of some weights on a dataset's validation split, over its
//! first N windows taken in order, with no sampling, so any tool can reproduce the number.
//!
//! The validation shards are read as one token stream, in file-name order; window `i`'s
//! inputs are tokens `i·T .. i·T + T` and its targets `i·T + 1 .. i·T + T + 1`. The loss is
//! the mean over every target token of every window (windows are of equal length, so also
//! the mean of their means). The weights are those `train.init_from` names (a Hugging Face
//! folder or a checkpoint), or a checkpoint given to `eval` itself. With
//! `data.document_mask` the windows are evaluated within documents, as training saw them.
//! Several datasets (a config's `[[data.sources]]`) are evaluated one after another with the
//! weights loaded once, a result each.

use crate::backend::Backend;
use crate::checkpoint::init::InitSource;
use crate::config::Config;
use crate::documents::{end_of_text, DocumentMask};
use crate::model::{step_micro_loss, ModelLayout, ModelOptions};
use crate::zero::{Engine, EngineComm, EngineOptions};
use crate::TrainError;
use data::{Dataset, Split};
use serde::Serialize;
use std::path::Path;

/// What an evaluation measured.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EvalResult {
    /// Mean loss per target token (nats).
    pub loss: f64,
    pub perplexity: f64,
    pub windows: usize,
    pub seq_len: usize,
    pub tokens: usize,
    /// Windows per forward pass (the largest divisor of `windows` within `train.micro_batch`).
    pub micro_batch: usize,
    /// Where the weights came from.
    pub weights: String,
    pub data: String,
    /// The `[[data.sources]]` entry's name, where the data is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// One dataset to evaluate on.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalData {
    /// A `[[data.sources]]` entry's name (`None`: `data.path`).
    pub name: Option<String>,
    pub path: std::path::PathBuf,
}

/// Whether `path` has a validation split: `Ok(false)` where it has no validation shards (a
/// `[[data.sources]]` entry may have none), the error for any other problem (a corrupt
/// shard, an unreadable directory).
pub fn has_val_split(path: &Path) -> Result<bool, TrainError> {
    match Dataset::open(path, Split::Val) {
        Ok(_) => Ok(true),
        Err(data::DataError::NoShards { .. } | data::DataError::NotFound { .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The first `windows` windows of `seq_len` tokens (and their targets) of `val`, in order.
pub fn windows(val: &Dataset, windows: usize, seq_len: usize) -> Result<(Vec<u32>, Vec<u32>), TrainError> {
    let need = windows * seq_len + 1;
    let mut stream: Vec<u32> = Vec::with_capacity(need);
    for shard in val.shards() {
        let take = (need - stream.len()).min(shard.len());
        shard.ids().slice(0..take).extend_u32(&mut stream);
        if stream.len() == need {
            break;
        }
    }
    if stream.len() < need {
        return Err(TrainError::Invalid(format!(
            "the validation split of {} holds {} tokens; {windows} windows of {seq_len} need {need}: ask for at most \
             {} windows (--windows)",
            val.source().display(),
            stream.len(),
            stream.len().saturating_sub(1) / seq_len
        )));
    }
    let inputs = stream[..windows * seq_len].to_vec();
    let targets = stream[1..].to_vec();
    Ok((inputs, targets))
}

/// Evaluate on one rank: the weights of `checkpoint` if given, else `train.init_from`, on
/// each of `data` in turn (the weights loaded once), a result each.
pub fn evaluate<B: Backend, C: EngineComm<B>>(
    cfg: &Config,
    be: &B,
    comm: &mut C,
    data: &[EvalData],
    n_windows: usize,
    checkpoint: Option<&Path>,
) -> Result<Vec<EvalResult>, TrainError> {
    if n_windows == 0 {
        return Err(TrainError::Invalid("--windows must be at least 1".into()));
    }
    if data.is_empty() {
        return Err(TrainError::Invalid("nothing to evaluate on: no dataset given (a bug)".into()));
    }
    let weights = checkpoint.or(cfg.train.init_from.as_deref()).ok_or_else(|| {
        TrainError::Invalid(
            "nothing to evaluate: give --checkpoint DIR, or set train.init_from to a Hugging Face folder or a \
             checkpoint (random weights have no loss worth measuring)"
                .into(),
        )
    })?;
    let t = cfg.model.seq_len;
    // Every dataset's windows first: a data problem is said before the weights load.
    let mut sets = Vec::with_capacity(data.len());
    for d in data {
        let named = |e: TrainError| match &d.name {
            Some(n) => TrainError::Invalid(format!("data source {n:?}: {e}")),
            None => e,
        };
        let val = Dataset::open(&d.path, Split::Val).map_err(|e| named(e.into()))?;
        crate::train::check_data_fits(cfg, &val, &d.path).map_err(named)?;
        if checkpoint.is_none() {
            crate::train::check_tokenizer(cfg, &val, &d.path).map_err(named)?;
        }
        let docs = DocumentMask::new(end_of_text(cfg, &val, &d.path).map_err(named)?, t);
        let (inputs, targets) = windows(&val, n_windows, t).map_err(named)?;
        sets.push((d, docs, inputs, targets));
    }
    let layout = ModelLayout::new(&cfg.model);
    let src = InitSource::open(weights)?;
    src.check(&layout, weights)?;
    let l2 = layout.clone();
    let mut engine =
        Engine::new(be, layout, EngineOptions::from_config(cfg), 0, 1, Some(&mut |u, r| src.values(&l2, u, r)))?;
    drop(src);
    let b = (1..=cfg.train.micro_batch.min(n_windows)).rev().find(|b| n_windows.is_multiple_of(*b)).unwrap_or(1);
    let opts = ModelOptions { micro_batch: b, ..ModelOptions::from_config(cfg) };
    let mut model = cfg.model.family.build(be, &engine.layout, &opts, &mut engine.ledger)?;
    let mut results = Vec::with_capacity(sets.len());
    for (d, mut docs, inputs, targets) in sets {
        let mut sum = 0.0f64;
        for (x, y) in inputs.chunks(b * t).zip(targets.chunks(b * t)) {
            sum += step_micro_loss(model.as_mut(), be, &mut engine, comm, &docs.batch(x, y), None)?;
        }
        let loss = sum / (n_windows / b) as f64;
        results.push(EvalResult {
            loss,
            perplexity: loss.exp(),
            windows: n_windows,
            seq_len: t,
            tokens: n_windows * t,
            micro_batch: b,
            weights: weights.display().to_string(),
            data: d.path.display().to_string(),
            source: d.name.clone(),
        });
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_run_on_across_shards_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a: Vec<u16> = (0..10).collect();
        let b: Vec<u16> = (10..30).collect();
        data::write_shard(dir.path().join("x_val_000000.bin"), &a).expect("shard");
        data::write_shard(dir.path().join("x_val_000001.bin"), &b).expect("shard");
        let val = Dataset::open(dir.path(), Split::Val).expect("val");
        let (x, y) = windows(&val, 3, 8).expect("windows");
        assert_eq!(x, (0..24).collect::<Vec<u32>>());
        assert_eq!(y, (1..25).collect::<Vec<u32>>());
        let e = windows(&val, 4, 8).unwrap_err().to_string();
        assert!(e.contains("at most 3 windows"), "{e}");
    }
}
