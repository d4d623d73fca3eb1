//! Training, the default command (`launcher --cpus N CONFIG`): its flags, then the launch
//! itself: everything checked once (`job::setup`), then the job run and watched on a small
//! async runtime (`run::supervise`).

use crate::job::fit::parse_gib;
use crate::job::flags::JobArgs;
use crate::job::setup::Launch;
use clap::Args;
use std::path::PathBuf;

/// Options of a training launch (the default command).
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// The TOML config file.
    #[arg(value_name = "CONFIG", required = true)]
    pub config: Option<PathBuf>,
    /// Override one config value, e.g. `--set zero.stage=3 --set train.steps=20`. Repeatable.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// The job's ranks and nodes.
    #[command(flatten)]
    pub job: JobArgs,
    /// Continue from a checkpoint: its directory (`<checkpoint.dir>/step_00000100`) or `latest`, the
    /// newest intact one in checkpoint.dir of the run that owns output.dir. Verified (every file's size and CRC-32, the model shape)
    /// before any rank starts; --cpus and zero.stage may differ from the run that saved it.
    /// metrics.jsonl and the rank logs of the run directory are continued, not replaced.
    #[arg(long, value_name = "DIR|latest")]
    pub resume: Option<PathBuf>,
    /// Start a new run in an output.dir that holds another run: that run (and a
    /// checkpoint.dir outside output.dir that holds checkpoints) is first renamed to
    /// `<dir>.prev-<run id>`, never deleted. Without it such a launch is refused.
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Host memory this node's ranks may use, in GiB, for the launch's fit check (default:
    /// MemAvailable). State it where memory grows as it is used (a VM whose memory is plugged
    /// in on demand shows a small MemAvailable at start).
    #[arg(long, value_name = "GIB", value_parser = parse_gib)]
    pub host_mem: Option<f64>,
    /// Launch even when the predicted memory of a rank exceeds its GPU or this node's host
    /// memory (the fit check's refusal names what does not fit; the prediction may be wrong
    /// where memory is plugged in as it is used).
    #[arg(long)]
    pub skip_fit_check: bool,
    /// Every rank waits for the device between the phases of each step (zeroing gradients,
    /// forward+backward, optimizer, loss) and prints their times to its log; rank 0 also lists
    /// per shape the GEMM algorithms `train.gemm_tuning` picked. The waits perturb the overlap
    /// a little: for finding where time goes.
    #[arg(long)]
    pub profile: bool,
}

/// Check everything, then run the job on a small async runtime (it only waits on sockets and processes).
pub fn run(args: &LaunchArgs) -> anyhow::Result<()> {
    let plan = crate::job::setup::plan(&Launch {
        job: &args.job,
        config: args.config.as_deref(),
        overrides: &args.overrides,
        resume: args.resume.as_deref(),
        overwrite: args.overwrite,
        host_mem: args.host_mem,
        skip_fit_check: args.skip_fit_check,
        profile: args.profile,
    })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("cannot start the launcher's async runtime: {e}"))?;
    let result = runtime.block_on(crate::run::supervise::run(&plan));
    // The run directories stay locked until every rank is reaped and the summary written.
    drop(plan.locks);
    result
}
