//! The training data of a run, opened: `data.path` (one source) or `[[data.sources]]`
//! (a weighted mixture) as the epoch loader ([`data::BatchSampler`]), and the validation
//! split of each source that has one. The launcher runs the same functions before any
//! rank starts, so a data problem stops the job there with the same message.

use crate::config::Config;
use crate::train::{check_data_fits, check_tokenizer};
use crate::TrainError;
use data::{BatchSampler, Dataset, Source, Split};
use std::path::{Path, PathBuf};

/// One source as configured, its path resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceSpec {
    pub name: String,
    pub path: PathBuf,
    pub weight: f64,
}

/// The sources of a run: `[[data.sources]]` (relative paths taken from `data_path`), or
/// `data_path` itself as the one source "data" when there are none.
pub fn specs(cfg: &Config, data_path: &Path) -> Vec<SourceSpec> {
    if cfg.data.sources.is_empty() {
        return vec![SourceSpec { name: "data".into(), path: data_path.to_owned(), weight: 1.0 }];
    }
    cfg.data
        .sources
        .iter()
        .map(|s| SourceSpec { name: s.display_name(), path: data_path.join(&s.path), weight: s.weight })
        .collect()
}

/// The rows one optimizer step takes, and how they are made up (for messages).
pub fn step_rows(cfg: &Config, world: usize) -> (u64, String) {
    let t = &cfg.train;
    let rows = (t.micro_batch * t.grad_accum * world) as u64;
    (rows, format!("train.micro_batch {} x train.grad_accum {} x {world} ranks", t.micro_batch, t.grad_accum))
}

/// Open every source's training split as one loader, refusing data the model cannot read
/// (ids beyond `model.vocab_size`, another tokenizer than `train.init_from`'s or than
/// another source's) and data whose epoch cannot fill one global batch of `world` ranks.
pub fn open_loader(cfg: &Config, data_path: &Path, world: usize) -> Result<BatchSampler, TrainError> {
    let mut sources = Vec::new();
    for spec in specs(cfg, data_path) {
        let dataset = Dataset::open(&spec.path, Split::Train).map_err(|e| named(&spec, cfg, e.into()))?;
        check_data_fits(cfg, &dataset, &spec.path).map_err(|e| named(&spec, cfg, e))?;
        check_tokenizer(cfg, &dataset, &spec.path).map_err(|e| named(&spec, cfg, e))?;
        sources.push(Source { name: spec.name, weight: spec.weight, dataset });
    }
    let mut sampler = BatchSampler::mixed(sources, cfg.model.seq_len, cfg.train.seed)?;
    let (rows, shape) = step_rows(cfg, world);
    sampler.check_batch(rows, &shape)?;
    sampler.set_vocab_limit(u32::try_from(cfg.model.vocab_size).unwrap_or(u32::MAX));
    Ok(sampler)
}

/// A source's validation split.
#[derive(Debug)]
pub struct ValSource {
    pub name: String,
    pub dataset: Dataset,
}

/// The validation split of every source that has one, each able to give each of the
/// `world` ranks a batch. Errors when no source has one (with evaluation on), naming the
/// fix. Sources without a validation split are listed in the second value.
pub fn open_val(cfg: &Config, data_path: &Path, world: usize) -> Result<(Vec<ValSource>, Vec<String>), TrainError> {
    let (mut found, mut missing, mut first_err) = (Vec::new(), Vec::new(), None);
    let mixed = !cfg.data.sources.is_empty();
    for spec in specs(cfg, data_path) {
        let v = match Dataset::open(&spec.path, Split::Val) {
            Ok(v) => v,
            Err(e @ (data::DataError::NoShards { .. } | data::DataError::NotFound { .. })) if mixed => {
                first_err.get_or_insert(e.to_string());
                missing.push(spec.name);
                continue;
            }
            Err(e) => return Err(no_val(cfg, &format!("{}{e}", prefix(&spec, cfg)))),
        };
        check_data_fits(cfg, &v, &spec.path)
            .map_err(|e| named(&spec, cfg, TrainError::Invalid(format!("the validation split: {e}"))))?;
        // Fail now, not at the first evaluation, if it cannot give every rank a batch.
        let have = v
            .val_batches(cfg.train.micro_batch, cfg.model.seq_len, world)
            .map_err(|e| named(&spec, cfg, e.into()))?
            .len();
        if have < world {
            return Err(TrainError::Invalid(format!(
                "the validation split of {} holds {have} batches of micro_batch × seq_len tokens but {world} ranks \
                 need one each: add validation data or lower train.micro_batch",
                spec.path.display()
            )));
        }
        found.push(ValSource { name: spec.name, dataset: v });
    }
    if found.is_empty() {
        return Err(no_val(cfg, &first_err.unwrap_or_default()));
    }
    Ok((found, missing))
}

fn no_val(cfg: &Config, why: &str) -> TrainError {
    TrainError::Invalid(format!(
        "train.eval_every = {} needs a validation split: {why} (set train.eval_every = 0 to train without evaluation)",
        cfg.train.eval_every
    ))
}

/// "data source NAME: " in front of a mixture's errors.
fn prefix(spec: &SourceSpec, cfg: &Config) -> String {
    if cfg.data.sources.is_empty() {
        String::new()
    } else {
        format!("data source {:?}: ", spec.name)
    }
}

fn named(spec: &SourceSpec, cfg: &Config, e: TrainError) -> TrainError {
    let p = prefix(spec, cfg);
    if p.is_empty() {
        e
    } else {
        TrainError::Invalid(format!("{p}{e}"))
    }
}
