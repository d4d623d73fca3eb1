//! `launcher eval CONFIG [--checkpoint DIR] [--windows N] [--device cpu|gpu] [--json]`: the
//! mean loss and perplexity of `train.init_from`'s weights (a Hugging Face folder or a
//! checkpoint), or of `--checkpoint DIR`, on the first N windows of the config's validation
//! split (with `[[data.sources]]`, the first source's), taken in order (`trainer::eval`
//! defines the windows), on one CPU rank or one GPU.
//! It starts no job and writes nothing but the built-in corpus, when the config uses it.

use crate::cli::EvalArgs;
use crate::device::Device;
use crate::setup::{resolve_data, SetupError};
use anyhow::Context;
use collectives::tcp::TcpComm;
use trainer::backend::cpu::{CpuBackend, HostComm};
use trainer::Config;

pub fn run(args: &EvalArgs) -> anyhow::Result<()> {
    let cfg = Config::load(&args.config, &args.overrides).map_err(|e| SetupError(e.to_string()))?;
    // With [[data.sources]]: the first source's validation split (the result names it).
    let data = match cfg.data.sources.first() {
        Some(first) => first.path.clone(),
        None => resolve_data(cfg.data.path.as_deref(), &cfg.output.dir)?,
    };
    let windows = args.windows as usize;
    let ckpt = args.checkpoint.as_deref();
    let result = match args.device {
        Device::Cpu => {
            let comm = TcpComm::local_group(1).context("a one-rank group")?.remove(0);
            trainer::eval::evaluate(&cfg, &CpuBackend::new(), &mut HostComm(comm), &data, windows, ckpt)?
        }
        Device::Gpu => crate::gpu::eval_rank(&cfg, &data, windows, ckpt, args.gpu as usize)?,
    };
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!(
            "eval: loss {:.6} (perplexity {:.3}) over {} windows of {} tokens ({} targets) of {}'s validation split; \
             weights {}",
            result.loss, result.perplexity, result.windows, result.seq_len, result.tokens, result.data, result.weights
        );
    }
    Ok(())
}
