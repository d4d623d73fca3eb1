//! `launcher export CKPT_DIR OUT_DIR`: one sharded checkpoint as a Hugging Face model folder
//! that transformers' `from_pretrained(OUT_DIR)` loads as it is
//! ([`trainer::checkpoint::hf::export`]: verifies the checkpoint's files, writes the family's
//! `config.json` and streams the weights tensor by tensor, in the family's names and
//! layouts, e.g. `GPT2LMHeadModel`'s with its Conv1D layouts and the head tied to `wte`;
//! above `--max-shard-size` in shards with their index). `OUT_DIR` must be new or empty,
//! may not lie inside a checkpoint directory (it would replace or mix with the
//! checkpoint's own files), and the manifest must be consistent
//! ([`crate::rundir::resume::check_manifest`]); every refusal, like any failure of the tool, exits
//! with code 2.

use crate::errors::SetupError;
use anyhow::Context;
use clap::Args;
use std::path::{Path, PathBuf};
use trainer::checkpoint::CheckpointReader;

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// One checkpoint directory, e.g. runs/tiny/checkpoints/step_00000100.
    #[arg(value_name = "CKPT_DIR")]
    pub checkpoint: PathBuf,
    /// The folder to write: config.json and model.safetensors (or shards and their index). It
    /// must not exist, or be empty.
    #[arg(value_name = "OUT_DIR")]
    pub out: PathBuf,
    /// The largest weights file, e.g. 5GB, 500MB, 100KB (1 KB = 1000 bytes) or bytes: above
    /// it the weights are split into model-0000K-of-0000N.safetensors with
    /// model.safetensors.index.json, as transformers' save_pretrained(max_shard_size) does.
    #[arg(long, value_name = "SIZE", default_value = "5GB", value_parser = parse_size)]
    pub max_shard_size: u64,
}

/// A size in bytes: a number with an optional KB, MB or GB (powers of 1000, as transformers).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let (num, unit) = [("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0)]
        .iter()
        .find_map(|(suffix, unit)| upper.strip_suffix(suffix).map(|n| (n.trim().to_string(), *unit)))
        .unwrap_or((upper.clone(), 1.0));
    match num.parse::<f64>() {
        Ok(n) if n.is_finite() && n * unit >= 1.0 && n * unit < 1e18 => Ok((n * unit) as u64),
        _ => Err(format!("{s:?} is not a size: give e.g. 5GB, 500MB, 100KB or a number of bytes")),
    }
}

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
            "export: OUT_DIR {} is inside the checkpoint directory {}: writing it there would replace or mix with \
             the checkpoint's own files; write the model elsewhere, e.g. launcher export {} model",
            args.out.display(),
            inside.display(),
            dir.display()
        ))
        .into());
    }
    check_out(&args.out, dir)?;
    if let Ok(reader) = CheckpointReader::open(dir, false) {
        crate::rundir::resume::check_manifest(&reader.dir, &reader.manifest)
            .map_err(|e| SetupError(format!("export {}: its manifest.json is inconsistent: {e}", dir.display())))?;
    }
    let summary = trainer::checkpoint::hf::export(dir, &args.out, args.max_shard_size)
        .with_context(|| format!("export {} {}", dir.display(), args.out.display()))?;
    println!(
        "exported step {} of {}: {} tensors, {} parameters ({:.2} M), float32 -> {}: config.json, {}{}",
        summary.step,
        dir.display(),
        summary.tensors,
        summary.params,
        summary.params as f64 / 1e6,
        summary.dir.display(),
        summary.files.join(", "),
        if summary.files.len() > 1 { format!(", {}", trainer::checkpoint::hf::INDEX_FILE) } else { String::new() }
    );
    println!(
        "load it with transformers: AutoModelForCausalLM.from_pretrained({:?}); as train.init_from it starts a run",
        summary.dir.display().to_string()
    );
    Ok(())
}

/// `OUT_DIR` must be a folder to make: new, or an empty directory.
fn check_out(out: &Path, ckpt: &Path) -> Result<(), SetupError> {
    let is_file = out.exists() && !out.is_dir();
    let nonempty = std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
    if out.extension().is_some_and(|e| e == "safetensors") && !out.is_dir() {
        let folder = out.with_extension("");
        return Err(SetupError(format!(
            "export: OUT_DIR {} names a .safetensors file, but export writes a Hugging Face model folder \
             (config.json and model.safetensors, which transformers' from_pretrained loads): give a folder, e.g. \
             launcher export {} {}",
            out.display(),
            ckpt.display(),
            folder.display()
        )));
    }
    if is_file || nonempty {
        return Err(SetupError(format!(
            "export: OUT_DIR {} {}: export writes a new folder and never mixes with or replaces other files; give \
             a path that does not exist yet (or an empty folder), or remove it first",
            out.display(),
            if is_file { "is a file" } else { "exists and is not empty" }
        )));
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
    let (count, intact) = crate::rundir::resume::checkpoint_root(dir)?;
    let pick = match intact {
        Some(d) => format!("export one of them, e.g. launcher export {} OUT_DIR", d.display()),
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

    #[test]
    fn only_a_new_or_empty_folder_is_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ck = dir.path().join("ck");
        check_out(&dir.path().join("new"), &ck).expect("a new folder");
        std::fs::create_dir(dir.path().join("empty")).expect("mkdir");
        check_out(&dir.path().join("empty"), &ck).expect("an empty folder");
        std::fs::write(dir.path().join("empty/x"), b"").expect("write");
        let e = check_out(&dir.path().join("empty"), &ck).unwrap_err().0;
        assert!(e.contains("OUT_DIR") && e.contains("not empty"), "{e}");
        let e = check_out(&dir.path().join("model.safetensors"), &ck).unwrap_err().0;
        assert!(e.contains("names a .safetensors file") && e.contains("model"), "{e}");
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("100 kb"), Ok(100_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err() && parse_size("lots").is_err());
    }
}
