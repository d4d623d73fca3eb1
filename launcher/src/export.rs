//! `launcher export CKPT_DIR OUT.safetensors`: one sharded checkpoint as a Hugging Face GPT-2
//! `model.safetensors` ([`trainer::checkpoint::hf::export`]: verifies the checkpoint's files,
//! streams tensor by tensor, `GPT2LMHeadModel` names and Conv1D layouts, head tied to `wte`).

use crate::cli::ExportArgs;
use anyhow::Context;
use std::path::Path;
use trainer::checkpoint::CheckpointReader;

pub fn run(args: &ExportArgs) -> anyhow::Result<()> {
    let dir = &args.checkpoint;
    if !dir.is_dir() {
        anyhow::bail!("export {}: no such checkpoint directory (they are <checkpoint.dir>/step_*)", dir.display());
    }
    if let Some(hint) = root_hint(dir) {
        anyhow::bail!("export {}: {hint}", dir.display());
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

/// When `dir` is a directory of checkpoints rather than one, which one to export.
fn root_hint(dir: &Path) -> Option<String> {
    let (count, intact) = crate::resume::checkpoint_root(dir)?;
    let pick = match intact {
        Some(d) => format!("export one of them, e.g. launcher export {} OUT.safetensors", d.display()),
        None => "and none of them is intact".to_string(),
    };
    Some(format!("{} holds {count} checkpoints (step_* directories), it is not one: {pick}", dir.display()))
}
