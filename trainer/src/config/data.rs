//! `[data]` and `[[data.sources]]`: where tokens come from.

use super::ConfigError;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where tokens come from.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Directory (or single file) of llm.c token shards. Unset (and no `sources`): the
    /// built-in generated corpus. The one-source shorthand of `[[data.sources]]`.
    pub path: Option<PathBuf>,
    /// Attention stops at document boundaries inside a packed sequence, and positions
    /// (GPT-2's learned ones, Llama's RoPE) restart at each document. A document starts at
    /// every input that is the data's end-of-text token (from the shards' tokenizer record;
    /// GPT-2's 50256 for shards without one, `trainer::documents`), and at each sequence's
    /// first token. Training and validation loss both use it. The sources of a mixture must
    /// share the id (they share a tokenizer).
    pub document_mask: bool,
    /// Several datasets mixed by weight (`[[data.sources]]`); exclusive with `path`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceConfig>,
    /// Resume from a checkpoint whose data differs from this run's (other shards, weights,
    /// seq_len or seed): each source continues from its saved row count, matched by name.
    /// Off: such a resume is refused, naming what changed.
    pub allow_changed_data: bool,
}

/// One dataset of a mixture.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// Its shards, as for `data.path` (directory, shard file or pattern).
    pub path: PathBuf,
    /// Relative share of the training rows (a positive number; 3 and 1 give 75% / 25%).
    #[serde(default = "one")]
    pub weight: f64,
    /// The name in metrics, logs and checkpoints; default: the path's last component.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

fn one() -> f64 {
    1.0
}

impl SourceConfig {
    /// The configured name, or the path's last component (its parent's, for a pattern).
    pub fn display_name(&self) -> String {
        if let Some(n) = &self.name {
            return n.clone();
        }
        let p = &self.path;
        let last = p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        if last.contains(['*', '?']) || last.is_empty() {
            if let Some(parent) = p.parent().and_then(|q| q.file_name()) {
                return parent.to_string_lossy().into_owned();
            }
        }
        if last.is_empty() {
            p.display().to_string()
        } else {
            last
        }
    }
}

impl DataConfig {
    /// `[[data.sources]]`: not with `data.path`; positive finite weights; distinct names.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let d = self;
        let bad = |value: String, message: String| ConfigError::Invalid { key: "data.sources", value, message };
        if let (Some(p), false) = (&d.path, d.sources.is_empty()) {
            return Err(bad(
                format!("{} entries", d.sources.len()),
                format!(
                    "cannot be given with data.path = {} (data.path is the one-source shorthand): put that path in a \
                     [[data.sources]] entry, or remove the entries",
                    p.display()
                ),
            ));
        }
        let mut names: Vec<String> = Vec::new();
        for s in &d.sources {
            let name = s.display_name();
            if !(s.weight.is_finite() && s.weight > 0.0) {
                return Err(bad(
                    format!("weight = {} of source {name:?}", s.weight),
                    "every source's weight must be a positive finite number (weights are relative: 3 and 1 give \
                     75% and 25% of the rows)"
                        .into(),
                ));
            }
            if names.contains(&name) {
                return Err(bad(
                    format!("two sources named {name:?}"),
                    "give each [[data.sources]] entry its own name = \"...\"".into(),
                ));
            }
            names.push(name);
        }
        Ok(())
    }
}
