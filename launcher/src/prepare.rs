//! `launcher prepare-data INPUT.txt OUT_DIR [--append]`: tokenize a text file with the GPT-2
//! BPE into llm.c token shards (validation split first, then training) that `data.path` can
//! point at. An OUT_DIR that already holds shards is refused (exit code 2: training would mix
//! both texts) unless `--append` adds this text as another source; every source is recorded
//! in `OUT_DIR/dataset.json` (`data::sources`).

use crate::cli::PrepareDataArgs;
use crate::setup::SetupError;
use data::{DataError, Existing};

pub fn run(args: &PrepareDataArgs) -> anyhow::Result<()> {
    let name = match &args.name {
        Some(n) => n.clone(),
        None => default_name(&args.input),
    };
    let existing = if args.append { Existing::Append } else { Existing::Refuse };
    let summary = data::prepare_text(
        &args.input,
        &args.out_dir,
        &name,
        args.shard_tokens,
        data::ValSplit::Fraction(args.val_fraction),
        existing,
    )
    .map_err(|e| {
        let message = format!("prepare-data {} {}: {e}", args.input.display(), args.out_dir.display());
        match e {
            // What OUT_DIR holds, not a failure: refused before anything was written.
            DataError::ShardsExist { .. } | DataError::NameTaken { .. } | DataError::AlreadyPrepared { .. } => {
                anyhow::Error::from(SetupError(message))
            }
            _ => anyhow::anyhow!(message),
        }
    })?;
    println!("{summary}");
    println!(
        "train on it with: launcher --cpus N CONFIG --set data.path={} --set model.vocab_size={}",
        args.out_dir.display(),
        data::GPT2_VOCAB
    );
    Ok(())
}

/// The input's file stem with anything but ASCII letters, digits, `-`, `_`, `.` replaced by `_`.
fn default_name(input: &std::path::Path) -> String {
    let stem = input.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name: String =
        stem.chars().map(|c| if c.is_ascii_alphanumeric() || "-_".contains(c) { c } else { '_' }).collect();
    if name.is_empty() {
        "data".to_string()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn default_names_are_valid_shard_names() {
        use std::path::Path;
        assert_eq!(super::default_name(Path::new("/x/tiny shakespeare.txt")), "tiny_shakespeare");
        assert_eq!(super::default_name(Path::new("")), "data");
    }
}
