//! `train.init_from`: where a run's initial weights come from when it does not start from
//! random values — a Hugging Face model folder or safetensors file ([`HfWeights`]), or a
//! shardtrain checkpoint directory (its fp32 master weights; the optimizer state and the
//! step are not taken: a fine-tuning run starts a fresh schedule, unlike `--resume`).
//! Either is read by range, so each rank reads only the elements it holds, on any number
//! of ranks and any ZeRO stage.
//!
//! The source also says what model it holds ([`source_model`]): a folder's `config.json`
//! or a checkpoint's manifest, which the config's `[model]` section may leave out. So
//! [`Config::load`] lives here, above `config/` (which imports nothing above `backend`):
//! it is [`Config::load_with`] given this reader.

use super::hf::{HfWeights, CONFIG_FILE};
use super::{CheckpointError, CheckpointReader};
use crate::config::{Config, ConfigError, ModelConfig};
use crate::model::{ModelFamily, ModelLayout};
use crate::TrainError;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// An opened `train.init_from`.
pub enum InitSource {
    Hf(HfWeights),
    Checkpoint(Box<CheckpointReader>),
}

/// Whether `path` is a shardtrain checkpoint directory (it has a manifest).
pub fn is_checkpoint(path: &Path) -> bool {
    path.join("manifest.json").is_file()
}

impl InitSource {
    /// Open `path`: a checkpoint directory (verified: sizes and CRC-32s) or Hugging Face
    /// weights.
    pub fn open(path: &Path) -> Result<InitSource, TrainError> {
        if is_checkpoint(path) {
            let reader = CheckpointReader::open(path, true).map_err(|e| init_err(path, e.to_string()))?;
            Ok(InitSource::Checkpoint(Box::new(reader)))
        } else {
            Ok(InitSource::Hf(HfWeights::open(path)?))
        }
    }

    /// Everything `layout` needs is there and readable: every Hugging Face tensor in a
    /// dtype import reads, or a checkpoint of the same tensors (the launcher checks this
    /// before any rank starts).
    pub fn check(&self, layout: &ModelLayout, path: &Path) -> Result<(), TrainError> {
        match self {
            InitSource::Hf(w) => w.check(layout),
            InitSource::Checkpoint(r) => {
                let theirs = ModelLayout::new(&r.manifest.model);
                let ours = layout.units.iter().flat_map(|u| &u.tensors);
                for (a, b) in ours.zip(theirs.units.iter().flat_map(|u| &u.tensors)) {
                    if a.name != b.name || a.shape != b.shape {
                        return Err(init_err(
                            path,
                            format!(
                                "the checkpoint's tensor {} {:?} is not the config's {} {:?}: its model differs \
                                 (leave [model] out to take the checkpoint's)",
                                b.name, b.shape, a.name, a.shape
                            ),
                        ));
                    }
                }
                if layout.num_params() != theirs.num_params() {
                    return Err(init_err(path, "the checkpoint holds another number of parameters".into()));
                }
                Ok(())
            }
        }
    }

    /// Elements `range` of unit `u` in our layout.
    pub fn values(&self, layout: &ModelLayout, u: usize, range: Range<usize>) -> Result<Vec<f32>, TrainError> {
        match self {
            InitSource::Hf(w) => w.unit_range(layout, u, range),
            InitSource::Checkpoint(r) => {
                let [master, _, _] = r.read_state(u, range.start, range.end)?;
                Ok(master)
            }
        }
    }
}

fn init_err(path: &Path, problem: String) -> TrainError {
    CheckpointError::Init { path: path.to_path_buf(), problem }.into()
}

impl Config {
    /// Read a file, apply `--set` overrides, fill `[model]` from `train.init_from`'s model
    /// ([`source_model`]), validate.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Config, ConfigError> {
        Config::load_with(path, overrides, source_model)
    }
}

/// The model `path` holds, if it says: a checkpoint's manifest, or a Hugging Face folder's
/// `config.json` read by the family its `model_type` names (with `seq_len` as the context
/// to train, which a config.json does not hold; unset: the family's default). `None` for a
/// lone safetensors file.
pub fn source_model(path: &Path, seq_len: Option<usize>) -> Result<Option<ModelConfig>, String> {
    if is_checkpoint(path) {
        let text = std::fs::read(path.join("manifest.json")).map_err(|e| format!("cannot read its manifest: {e}"))?;
        let m: super::Manifest = serde_json::from_slice(&text).map_err(|e| format!("manifest.json: {e}"))?;
        return Ok(Some(m.model));
    }
    let file: PathBuf = path.join(CONFIG_FILE);
    if !path.is_dir() || !file.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", file.display()))?;
    let model_type = json.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
    let family = ModelFamily::from_hf_model_type(model_type).ok_or_else(|| {
        format!(
            "{}'s model_type \"{model_type}\" is not a family shardtrain trains (\"gpt2\", \"llama\")",
            file.display()
        )
    })?;
    family.hf().model_config(&json, seq_len).map(Some).map_err(|e| format!("{}: {e}", file.display()))
}
