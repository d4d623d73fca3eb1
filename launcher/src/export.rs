//! `launcher export CKPT_DIR OUT.safetensors`: one sharded checkpoint as a Hugging Face GPT-2
//! `model.safetensors` ([`trainer::checkpoint::hf::export`]: verifies the checkpoint's files,
//! streams tensor by tensor, `GPT2LMHeadModel` names and Conv1D layouts, head tied to `wte`).
//! The output may not lie inside a checkpoint directory (`launcher export CKPT
//! CKPT/rank00000.safetensors` would overwrite the checkpoint's own shard), and the manifest
//! must be consistent ([`crate::resume::check_manifest`]); both are refused with exit code 2.

use crate::cli::ExportArgs;
use crate::setup::SetupError;
use anyhow::Context;
use std::path::{Path, PathBuf};
use trainer::checkpoint::CheckpointReader;

pub fn run(args: &ExportArgs) -> anyhow::Result<()> {
    let dir = &args.checkpoint;
    if !dir.is_dir() {
        anyhow::bail!("export {}: no such checkpoint directory (they are <checkpoint.dir>/step_*)", dir.display());
    }
    if let Some(hint) = root_hint(dir) {
        anyhow::bail!("export {}: {hint}", dir.display());
    }
    if let Some(inside) = checkpoint_holding(&args.out) {
        return Err(SetupError(format!(
            "export: {} is inside the checkpoint directory {}: writing it there would replace or mix with the \
             checkpoint's own files; write the model elsewhere, e.g. launcher export {} model.safetensors",
            args.out.display(),
            inside.display(),
            dir.display()
        ))
        .into());
    }
    if let Ok(reader) = CheckpointReader::open(dir, false) {
        crate::resume::check_manifest(&reader.dir, &reader.manifest)
            .map_err(|e| SetupError(format!("export {}: its manifest.json is inconsistent: {e}", dir.display())))?;
    }
    let summary = trainer::checkpoint::hf::export(dir, &args.out)
        .with_context(|| format!("export {} {}", dir.display(), args.out.display()))?;
    println!(
        "exported step {} of {}: {} tensors, {} parameters ({:.2} M) -> {}",
        summary.step,
        dir.display(),
        summary.tensors,
        summary.params,
        summary.params as f64 / 1e6,
        summary.path.display()
    );
    // The shape a transformers GPT2Config needs (not written: only the weights are).
    if let Ok(reader) = CheckpointReader::open(dir, false) {
        let m = &reader.manifest.model;
        println!(
            "Hugging Face GPT2LMHeadModel weights, float32 (lm_head is tied to transformer.wte); its GPT2Config: \
             n_layer={} n_head={} n_embd={} vocab_size={} n_positions={}",
            m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.seq_len
        );
    }
    Ok(())
}

/// The checkpoint directory (one with a `manifest.json`, or a save in progress,
/// `.step_*.partial`) that `out` would be written into, if any: its parent directory or
/// one above, symbolic links resolved.
fn checkpoint_holding(out: &Path) -> Option<PathBuf> {
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = std::fs::canonicalize(parent).ok()?;
    parent
        .ancestors()
        .find(|d| {
            let partial = d
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(".step_") && n.ends_with(".partial"));
            partial || d.join("manifest.json").is_file()
        })
        .map(Path::to_path_buf)
}

/// When `dir` is a directory of checkpoints rather than one, which one to export.
fn root_hint(dir: &Path) -> Option<String> {
    let (count, intact) = crate::resume::checkpoint_root(dir)?;
    let pick = match intact {
        Some(d) => format!("export one of them, e.g. launcher export {} OUT.safetensors", d.display()),
        None => "and none of them is intact".to_string(),
    };
    Some(format!("{} holds {count} checkpoints (step_* directories), it is not one: {pick}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_inside_a_checkpoint_are_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ck = dir.path().join("checkpoints/step_00000004");
        std::fs::create_dir_all(ck.join("sub")).expect("mkdir");
        std::fs::write(ck.join("manifest.json"), "{}").expect("manifest");
        let canon = std::fs::canonicalize(&ck).expect("canonical");
        assert_eq!(checkpoint_holding(&ck.join("rank00000.safetensors")), Some(canon.clone()));
        assert_eq!(checkpoint_holding(&ck.join("sub/model.safetensors")), Some(canon));
        assert_eq!(checkpoint_holding(&dir.path().join("model.safetensors")), None);
        assert_eq!(checkpoint_holding(&dir.path().join("checkpoints/model.safetensors")), None);
        let partial = dir.path().join("checkpoints/.step_00000006.partial");
        std::fs::create_dir_all(&partial).expect("mkdir");
        assert!(checkpoint_holding(&partial.join("x.safetensors")).is_some());
    }
}
