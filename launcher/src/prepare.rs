//! `launcher prepare-data INPUT... OUT_DIR [--tokenizer gpt2|PATH] [--text-field NAME] ...`:
//! tokenise text, JSON-lines and Parquet inputs (plain, `.gz`, `.zst`) on every core into
//! llm.c token shards (`data::prepare`: a validation split by documents, then training)
//! that `data.path` can point at, with progress on the way (`prepare_progress`). An OUT_DIR
//! that already holds shards is refused (exit code 2: training would mix both datasets)
//! unless `--append` adds these inputs as another source; every source is recorded in
//! `OUT_DIR/dataset.json` (`data::sources`).

use crate::cli::{OnBadArg, PrepareDataArgs, TxtDocsArg};
use data::{Existing, OnBad, PrepareOptions, TokenizerSpec, TxtDocs};
use std::path::{Path, PathBuf};

pub fn run(args: &PrepareDataArgs) -> anyhow::Result<()> {
    let Some((out_dir, inputs)) = args.paths.split_last() else {
        anyhow::bail!("prepare-data needs INPUT... OUT_DIR");
    };
    let name = match &args.name {
        Some(n) => n.clone(),
        None => default_name(&inputs[0]),
    };
    let mut opts = PrepareOptions::new(&name);
    opts.tokenizer = TokenizerSpec::parse(&args.tokenizer);
    opts.eot = args.eot.clone();
    opts.text_field = args.text_field.clone();
    opts.txt_docs = match args.txt_docs {
        TxtDocsArg::File => TxtDocs::File,
        TxtDocsArg::Line => TxtDocs::Line,
        TxtDocsArg::Paragraph => TxtDocs::Paragraph,
    };
    opts.on_bad = match args.on_bad {
        OnBadArg::Skip => OnBad::Skip,
        OnBadArg::Refuse => OnBad::Refuse,
    };
    opts.val_fraction = args.val_fraction;
    opts.shard_tokens = args.shard_tokens;
    opts.existing = if args.append { Existing::Append } else { Existing::Refuse };

    let result = crate::prepare_progress::while_running(|progress| data::prepare(inputs, out_dir, &opts, progress));
    let summary = result.map_err(|e| {
        let given: Vec<String> = args.paths.iter().map(|p| p.display().to_string()).collect();
        anyhow::anyhow!("prepare-data {}: {e}", given.join(" "))
    })?;
    for line in summary.to_string().lines() {
        crate::out::say(line);
    }
    crate::out::say(&format!(
        "train on it with: launcher --cpus N CONFIG --set data.path='\"{}\"' --set model.vocab_size={}",
        out_dir.display(),
        summary.tokenizer.vocab_size
    ));
    Ok(())
}

/// The first input's name without its suffixes (`a.jsonl.gz` → `a`), with anything but ASCII
/// letters, digits, `-`, `_` replaced by `_`; a pattern's or a nameless input's: `data`.
fn default_name(input: &Path) -> String {
    if input.to_string_lossy().contains(['*', '?']) {
        return "data".into();
    }
    let mut stem = PathBuf::from(input.file_name().unwrap_or_default());
    while let Some(s) = stem.file_stem().filter(|_| stem.extension().is_some()) {
        stem = PathBuf::from(s);
    }
    let name: String = stem
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "-_".contains(c) { c } else { '_' })
        .collect();
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
        assert_eq!(super::default_name(Path::new("/x/web-00001.jsonl.zst")), "web-00001");
        assert_eq!(super::default_name(Path::new("/x/corpus")), "corpus");
        assert_eq!(super::default_name(Path::new("/x/*.parquet")), "data");
        assert_eq!(super::default_name(Path::new("")), "data");
    }
}
