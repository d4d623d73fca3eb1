//! `launcher eval CONFIG [--checkpoint DIR] [--windows N] [--source NAME] [--device cpu|gpu]
//! [--json]`: the mean loss and perplexity of `train.init_from`'s weights (a Hugging Face
//! folder or a checkpoint), or of `--checkpoint DIR`, on the first N windows of the config's
//! validation split, taken in order (`trainer::eval` defines the windows), on one CPU rank or
//! one GPU. With `[[data.sources]]`: every source that has a validation split (or the one
//! `--source` names), a result each, the weights loaded once; sources without one are named.
//! It starts no job and writes nothing but the built-in corpus, when the config uses it.

use crate::errors::SetupError;
use crate::job::device::Device;
use crate::job::setup::resolve_data;
use anyhow::Context;
use clap::Args;
use collectives::tcp::TcpComm;
use std::path::PathBuf;
use trainer::backend::cpu::{CpuBackend, HostComm};
use trainer::eval::{has_val_split, EvalData};
use trainer::Config;

/// `launcher eval`: the loss of some weights on the validation split's first windows.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The TOML config file (its data.path's validation split, model.seq_len, train.init_from).
    #[arg(value_name = "CONFIG")]
    pub config: PathBuf,
    /// Evaluate this checkpoint directory (`.../step_00000100`) instead of train.init_from.
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// How many windows of model.seq_len tokens, from the start of the validation split.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    pub windows: u64,
    /// With [[data.sources]]: evaluate only the source of this name (default: every source
    /// that has a validation split, one result each).
    #[arg(long, value_name = "NAME")]
    pub source: Option<String>,
    /// Compute on the CPU (the f32 reference) or on one GPU.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// With --device gpu: which GPU.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub gpu: u32,
    /// Override one config value, as for training. Repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What `eval` evaluates on: `data.path`, or the sources with a validation split (and the
/// names of those without one).
fn datasets(cfg: &Config, args: &EvalArgs) -> anyhow::Result<(Vec<EvalData>, Vec<String>)> {
    if cfg.data.sources.is_empty() {
        if let Some(name) = &args.source {
            return Err(SetupError(format!(
                "--source {name:?}: the config has no [[data.sources]] (it reads data.path)"
            ))
            .into());
        }
        let path = resolve_data(cfg.data.path.as_deref(), &cfg.output.dir)?;
        return Ok((vec![EvalData { name: None, path }], Vec::new()));
    }
    let names: Vec<String> = cfg.data.sources.iter().map(|s| s.display_name()).collect();
    let picked: Vec<_> = match &args.source {
        Some(n) => {
            let s = cfg.data.sources.iter().filter(|s| &s.display_name() == n).collect::<Vec<_>>();
            if s.is_empty() {
                return Err(SetupError(format!(
                    "--source {n:?}: no such data source; the config has {}",
                    names.join(", ")
                ))
                .into());
            }
            s
        }
        None => cfg.data.sources.iter().collect(),
    };
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for s in picked {
        let name = s.display_name();
        let has = has_val_split(&s.path).map_err(|e| SetupError(format!("data source {name:?}: {e}")))?;
        match has {
            true => with.push(EvalData { name: Some(name), path: s.path.clone() }),
            false => without.push(name),
        }
    }
    if with.is_empty() {
        return Err(SetupError(format!(
            "no validation split to evaluate on: data source(s) {} have none (`launcher prepare-data` splits \
             one off with --val-fraction)",
            without.join(", ")
        ))
        .into());
    }
    Ok((with, without))
}

pub fn run(args: &EvalArgs) -> anyhow::Result<()> {
    let cfg = Config::load(&args.config, &args.overrides).map_err(|e| SetupError(e.to_string()))?;
    let (data, without) = datasets(&cfg, args)?;
    let windows = args.windows as usize;
    let ckpt = args.checkpoint.as_deref();
    let results = match args.device {
        Device::Cpu => {
            let comm = TcpComm::local_group(1).context("a one-rank group")?.remove(0);
            trainer::eval::evaluate(&cfg, &CpuBackend::new(), &mut HostComm(comm), &data, windows, ckpt)?
        }
        Device::Gpu => crate::job::gpu::eval_rank(&cfg, &data, windows, ckpt, args.gpu as usize)?,
    };
    if !without.is_empty() {
        eprintln!("eval: data source(s) without a validation split, not evaluated: {}", without.join(", "));
    }
    if args.json {
        // One object for data.path, as it always was; with sources one per line.
        for r in &results {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        for r in &results {
            let of = match &r.source {
                Some(n) => format!("data source {n:?} ({})", r.data),
                None => r.data.clone(),
            };
            println!(
                "eval: loss {:.6} (perplexity {:.3}) over {} windows of {} tokens ({} targets) of {of}'s validation \
                 split; weights {}",
                r.loss, r.perplexity, r.windows, r.seq_len, r.tokens, r.weights
            );
        }
    }
    Ok(())
}
