//! The training data of a run, opened: `data.path` (one source) or `[[data.sources]]`
//! (a weighted mixture) as the epoch loader ([`data::BatchSampler`]), and the validation
//! split of each source that has one, with the end-of-text id that starts their documents
//! (`data.document_mask`). The launcher runs the same functions before any rank starts, so
//! a data problem stops the job there with the same message.

use crate::config::Config;
use crate::documents::end_of_text;
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
/// With `data.document_mask`, also the end-of-text id that starts documents
/// ([`end_of_text`]): every source must have one, and the same one, since a micro-batch
/// holds rows of any source and its document starts are read with one id.
pub fn open_loader(cfg: &Config, data_path: &Path, world: usize) -> Result<(BatchSampler, Option<u32>), TrainError> {
    let mut sources = Vec::new();
    let mut eot: Option<(String, u32)> = None;
    for spec in specs(cfg, data_path) {
        let dataset = Dataset::open(&spec.path, Split::Train).map_err(|e| named(&spec, cfg, e.into()))?;
        check_data_fits(cfg, &dataset, &spec.path).map_err(|e| named(&spec, cfg, e))?;
        check_tokenizer(cfg, &dataset, &spec.path).map_err(|e| named(&spec, cfg, e))?;
        if let Some(id) = end_of_text(cfg, &dataset, &spec.path).map_err(|e| named(&spec, cfg, e))? {
            match &eot {
                None => eot = Some((spec.name.clone(), id)),
                Some((first, other)) if *other != id => {
                    return Err(TrainError::Invalid(format!(
                        "data.document_mask = true reads document starts with one end-of-text id, but data source \
                         {first:?} begins its documents with {other} and {:?} with {id} (a tokenizer record in one, \
                         GPT-2's id assumed for the other's unrecorded shards, or two tokenizers): prepare every \
                         source with one tokenizer (`launcher prepare-data ... --tokenizer PATH/tokenizer.json`), \
                         or set data.document_mask = false",
                        spec.name
                    )));
                }
                Some(_) => {}
            }
        }
        sources.push(Source { name: spec.name, weight: spec.weight, dataset });
    }
    let mut sampler = BatchSampler::mixed(sources, cfg.model.seq_len, cfg.train.seed)?;
    let (rows, shape) = step_rows(cfg, world);
    sampler.check_batch(rows, &shape)?;
    sampler.set_vocab_limit(u32::try_from(cfg.model.vocab_size).unwrap_or(u32::MAX));
    Ok((sampler, eot.map(|(_, id)| id)))
}

/// A source's validation split.
#[derive(Debug)]
pub struct ValSource {
    pub name: String,
    pub dataset: Dataset,
    /// The end-of-text id starting its documents with `data.document_mask` ([`end_of_text`]):
    /// validation loss masks documents as training does.
    pub eot: Option<u32>,
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
        let in_val = |e| named(&spec, cfg, TrainError::Invalid(format!("the validation split: {e}")));
        check_data_fits(cfg, &v, &spec.path).map_err(in_val)?;
        let eot = end_of_text(cfg, &v, &spec.path).map_err(in_val)?;
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
        found.push(ValSource { name: spec.name, dataset: v, eot });
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
