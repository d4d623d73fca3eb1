//! Reading a config: the TOML text, `--set section.key=value` overrides, and the `[model]`
//! section filled from `train.init_from`'s model (read by `checkpoint::init`, above this
//! module: [`Config::load`] is defined there and passes it in as a [`ModelSource`]).

use super::{Config, ConfigError, ModelConfig, MODEL_KEYS};
use std::path::{Path, PathBuf};

/// What model a `train.init_from` path holds, if it says (`checkpoint::init::source_model`):
/// `(path, the config's model.seq_len)` to the source's `[model]` section, or a message
/// naming what could not be read.
pub type ModelSource = fn(&Path, Option<usize>) -> Result<Option<ModelConfig>, String>;

impl Config {
    /// Parse TOML text; `origin` names the source in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse { origin: origin.to_string(), message: e.to_string() })
    }

    /// Read a file, apply `--set` overrides, fill `[model]` from `train.init_from`'s model
    /// (read by `source`), validate. [`Config::load`] passes the checkpoint module's reader.
    pub fn load_with(path: &Path, overrides: &[String], source: ModelSource) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        let mut value: toml::Table = toml::from_str(&text)
            .map_err(|e| ConfigError::Parse { origin: path.display().to_string(), message: e.to_string() })?;
        for o in overrides {
            apply_override(&mut value, o)?;
        }
        model_from_init(&mut value, source)?;
        let origin = if overrides.is_empty() {
            path.display().to_string()
        } else {
            format!("{} (with --set overrides)", path.display())
        };
        let cfg: Config = toml::Value::Table(value)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse { origin, message: e.to_string() })?;
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Where `train.init_from` names a source that says what model it holds (a Hugging Face
/// folder's config.json, a checkpoint's manifest), fill the raw `[model]` section from it:
/// keys the config leaves out come from the source; keys it gives must agree (but
/// `seq_len`, the context to train, is the config's, and `vocab_size` may be larger: an
/// embedding padded for speed), or the run is refused naming the key.
fn model_from_init(table: &mut toml::Table, source_model: ModelSource) -> Result<(), ConfigError> {
    let Some(path) = table.get("train").and_then(|t| t.get("init_from")).and_then(|v| v.as_str()) else {
        return Ok(());
    };
    let path = PathBuf::from(path);
    let given = match table.get("model") {
        None => toml::Table::new(),
        Some(toml::Value::Table(t)) => t.clone(),
        Some(_) => return Err(ConfigError::Parse { origin: "[model]".into(), message: "must be a table".into() }),
    };
    let seq_len = given.get("seq_len").and_then(|v| v.as_integer()).map(|v| v.max(0) as usize);
    let source = source_model(&path, seq_len).map_err(|message| ConfigError::Invalid {
        key: "train.init_from",
        value: path.display().to_string(),
        message,
    })?;
    let Some(source) = source else { return Ok(()) };
    let theirs = match toml::Value::try_from(&source) {
        Ok(toml::Value::Table(t)) => t,
        _ => return Err(ConfigError::Parse { origin: path.display().to_string(), message: "model section".into() }),
    };
    let mut merged = theirs.clone();
    for (k, v) in &given {
        merged.insert(k.clone(), v.clone());
    }
    // Compare as the typed config reads them (500000 and 500000.0 are one value), key by key.
    let typed = |t: &toml::Table| -> Option<toml::Table> {
        let m: ModelConfig = toml::Value::Table(t.clone()).try_into().ok()?;
        match toml::Value::try_from(&m) {
            Ok(toml::Value::Table(t)) => Some(t),
            _ => None,
        }
    };
    if let (Some(ours), Some(src)) = (typed(&merged), typed(&theirs)) {
        for (k, v) in &ours {
            let agree = match k.as_str() {
                "seq_len" => true,
                "vocab_size" => v.as_integer() >= src.get(k).and_then(|s| s.as_integer()),
                _ => src.get(k) == Some(v),
            };
            if !agree && given.contains_key(k) {
                let key: &'static str = MODEL_KEYS.iter().find(|n| n[6..] == **k).copied().unwrap_or("model");
                return Err(ConfigError::Invalid {
                    key,
                    value: v.to_string(),
                    message: format!(
                        "train.init_from = {} holds a model with {k} = {}: delete the key (the model comes from \
                         there) or point train.init_from at weights of this shape",
                        path.display(),
                        src.get(k).map_or("unset".to_string(), |s| s.to_string())
                    ),
                });
            }
        }
    }
    table.insert("model".into(), toml::Value::Table(merged));
    Ok(())
}

/// Apply one `section.key=value` override to the raw TOML table. The value is parsed
/// as TOML (so `3`, `1e-4`, `true`, `"text"` work); bare words fall back to strings.
pub fn apply_override(table: &mut toml::Table, arg: &str) -> Result<(), ConfigError> {
    let err = |message: String| ConfigError::Override { arg: arg.to_string(), message };
    let (key, raw) =
        arg.split_once('=').ok_or_else(|| err("expected section.key=value, e.g. --set zero.stage=3".into()))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(err(format!("`{key}` is not of the form section.key (e.g. train.lr)")));
    }
    let raw = raw.trim();
    let value: toml::Value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").unwrap_or(toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let section = table.entry(parts[0].to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let section =
        section.as_table_mut().ok_or_else(|| err(format!("`{}` is not a section in the config", parts[0])))?;
    section.insert(parts[1].to_string(), value);
    Ok(())
}
