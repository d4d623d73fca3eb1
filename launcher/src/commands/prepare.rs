//! `launcher prepare-data INPUT... OUT_DIR [--tokenizer gpt2|PATH] [--text-field NAME] ...`:
//! tokenise text, JSON-lines and Parquet inputs (plain, `.gz`, `.zst`) on every core into
//! llm.c token shards (`data::prepare`: a validation split by documents, then training)
//! that `data.path` can point at, with progress on the way (`prepare_progress`). An OUT_DIR
//! that already holds shards is refused (exit code 2: training would mix both datasets)
//! unless `--append` adds these inputs as another source; every source is recorded in
//! `OUT_DIR/dataset.json` (`data::sources`).

use clap::Args;
use data::{Existing, OnBad, PrepareOptions, TokenizerSpec, TxtDocs};
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct PrepareDataArgs {
    /// Input files, directories (walked) and quoted patterns ('data/*.jsonl.gz') of .txt, .jsonl and .parquet
    /// files, plain or .gz/.zst; then the directory to write the shards into (created if missing; point
    /// `data.path` at it).
    #[arg(value_name = "INPUT... OUT_DIR", required = true, num_args = 2..)]
    pub paths: Vec<PathBuf>,
    /// `gpt2` (the GPT-2 BPE, built in) or a Hugging Face tokenizer.json (or the model folder holding it,
    /// e.g. a Llama folder). Vocabularies above 65536 ids are stored as u32 (llm.c's Llama 3 layout).
    #[arg(long, value_name = "gpt2|PATH", default_value = "gpt2")]
    pub tokenizer: String,
    /// The token placed before every document (default: the eos_token of a tokenizer_config.json beside the
    /// tokenizer.json, else `<|endoftext|>`, `<|end_of_text|>`, `</s>` or `<eos>`, whichever it has).
    #[arg(long, value_name = "TOKEN")]
    pub eot: Option<String>,
    /// The field of a .jsonl line, and the column of a .parquet file, that holds the text.
    #[arg(long, value_name = "NAME", default_value = "text")]
    pub text_field: String,
    /// How a .txt file is cut into documents: `file` (the whole file; a literal <|endoftext|> in it separates
    /// documents), `line` (every non-blank line) or `paragraph` (runs of non-blank lines).
    #[arg(long, value_enum, default_value_t = TxtDocsArg::File)]
    pub txt_docs: TxtDocsArg,
    /// Records that are not documents (malformed JSON lines, missing or null fields, invalid UTF-8, empty
    /// text): `skip` counts them and names the first of each kind in the summary and dataset.json; `refuse`
    /// stops at the first one, writing nothing.
    #[arg(long, value_enum, default_value_t = OnBadArg::Skip)]
    pub on_bad: OnBadArg,
    /// Fraction of the documents that become the validation split: document i (from 0, in input order) goes
    /// to validation when floor((i+1)·F) > floor(i·F), so exactly floor(n·F) of n, evenly spread.
    #[arg(long, value_name = "F", default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Token ids per shard file.
    #[arg(long, value_name = "N", default_value_t = 100_000_000)]
    pub shard_tokens: usize,
    /// Name prefix of the shard files (default: the first input's name without its suffixes).
    #[arg(long)]
    pub name: Option<String>,
    /// Add these inputs to an OUT_DIR that already holds shards (training then samples both; the tokenizer
    /// must be the same); every source is recorded in OUT_DIR/dataset.json. Without it such an OUT_DIR is
    /// refused.
    #[arg(long)]
    pub append: bool,
}

/// `--txt-docs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TxtDocsArg {
    File,
    Line,
    Paragraph,
}

/// `--on-bad`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnBadArg {
    Skip,
    Refuse,
}

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

    let result =
        crate::commands::prepare_progress::while_running(|progress| data::prepare(inputs, out_dir, &opts, progress));
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
