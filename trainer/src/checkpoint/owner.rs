//! Which run a checkpoint belongs to.
//!
//! The launcher gives every run directory an identity, `<output.dir>/run.json`, whose
//! `run_id` names the run that owns it. Rank 0 copies that id into every manifest it
//! writes, so a checkpoint directory tells its own run's checkpoints from anyone else's:
//! `--resume latest` ([`super::load::find_latest_of`]) and pruning to `checkpoint.keep`
//! consider only the owner's checkpoints. A checkpoint without a run id was saved before
//! run ids existed (or outside a launcher's run directory): it is taken as the owner's, so
//! old runs still resume.

use super::{io_err, CheckpointError};
use std::path::Path;

/// The run identity file in a run directory (written by the launcher).
pub const RUN_FILE: &str = "run.json";

/// The `run_id` of `<out_dir>/run.json`, `None` when there is no such file.
pub fn run_id_of_dir(out_dir: &Path) -> Result<Option<String>, CheckpointError> {
    let path = out_dir.join(RUN_FILE);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path)(e)),
    };
    let id = serde_json::from_slice::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("run_id").and_then(|i| i.as_str()).map(str::to_string));
    id.map(Some).ok_or_else(|| CheckpointError::Invalid {
        dir: out_dir.to_path_buf(),
        problem: format!(
            "{} has no run id (it is not JSON with a \"run_id\" string): it names the run that owns this \
             directory; restore it, or move the directory aside and start again",
            path.display()
        ),
    })
}

/// The run id recorded in the manifest of checkpoint `dir`, read without validating the
/// checkpoint (`Err` with the reason when the manifest cannot be read).
pub fn run_id_of_checkpoint(dir: &Path) -> Result<Option<String>, String> {
    let text = std::fs::read(dir.join("manifest.json")).map_err(|e| format!("manifest.json: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| format!("manifest.json does not parse: {e}"))?;
    Ok(v.get("run_id").and_then(|i| i.as_str()).map(str::to_string))
}

/// Whether a checkpoint of run `saved` belongs to the run `owner` (no owner: any run's does;
/// a checkpoint without a run id is taken as the owner's).
pub fn belongs_to(saved: Option<&str>, owner: Option<&str>) -> bool {
    match (saved, owner) {
        (Some(s), Some(o)) => s == o,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_read_from_the_run_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(run_id_of_dir(dir.path()).expect("no file"), None);
        std::fs::write(dir.path().join(RUN_FILE), r#"{"run_id": "r1", "host": "h"}"#).expect("write");
        assert_eq!(run_id_of_dir(dir.path()).expect("id").as_deref(), Some("r1"));
        std::fs::write(dir.path().join(RUN_FILE), "{}").expect("write");
        let e = run_id_of_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("run.json") && e.contains("restore it"), "{e}");
        assert!(belongs_to(Some("a"), Some("a")) && !belongs_to(Some("a"), Some("b")));
        assert!(belongs_to(None, Some("a")) && belongs_to(Some("a"), None));
    }
}
