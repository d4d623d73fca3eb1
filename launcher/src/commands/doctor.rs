//! `launcher doctor`: its flags and what it runs. The ranks of a job are placed as training
//! would place them (`job::setup::plan_doctor`) and started by the same supervisor
//! (`run::supervise`); what they measure and how node 0 judges it is `doctor/`.

use crate::doctor::Spec;
use crate::job::device::Device;
use crate::job::flags::JobArgs;
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

/// `launcher doctor`'s command line: the job's layout as for training, and what to measure.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// The job's ranks and nodes, as for training.
    #[command(flatten)]
    pub job: JobArgs,
    /// Message sizes for the all-reduce and all-gather, e.g. `1M,64M,1G` (suffixes K, M, G:
    /// powers of 1024). Default 1M,16M,256M,1G on GPUs, 64K,1M,16M on CPU ranks. The verdict
    /// judges the largest; the others show how latency weighs at smaller sizes.
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Bytes each pair of ranks exchanges each way in the link test (default 256M on GPUs,
    /// 16M on CPU ranks).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub link_size: Option<u64>,
    /// What the links should give, in GB/s (per direction; for the collectives, bus
    /// bandwidth): overrides what the hardware says (or stands in where it says nothing, as for
    /// CPU ranks on one node).
    #[arg(long, value_name = "GB/S", value_parser = parse_gbps)]
    pub expect_gbps: Option<f64>,
    /// A measurement below this fraction of what is expected is a failure (exit code 4); so
    /// is a link below this fraction of the best link of its kind (within a node, or across
    /// nodes).
    #[arg(long, value_name = "FRACTION", default_value_t = 0.5, value_parser = parse_fraction)]
    pub threshold: f64,
    /// Where the ranks' logs go (default: a fresh directory under the system's temp dir).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Also write node 0's report as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// What the ranks measure, from the flags (defaults by device).
fn spec_of(args: &DoctorArgs, device: Device) -> Spec {
    let gpu = device == Device::Gpu;
    let mut sizes = if args.sizes.is_empty() {
        if gpu {
            vec![MIB, 16 * MIB, 256 * MIB, GIB]
        } else {
            vec![64 * KIB, MIB, 16 * MIB]
        }
    } else {
        args.sizes.clone()
    };
    sizes.sort_unstable();
    sizes.dedup();
    let link_bytes = args.link_size.unwrap_or(if gpu { 256 * MIB } else { 16 * MIB });
    Spec { sizes, link_bytes, expect_gbps: args.expect_gbps, threshold: args.threshold, json: args.json.clone() }
}

/// Run the check: place the ranks as training would, start them, print node 0's report.
pub fn run(args: &DoctorArgs) -> anyhow::Result<()> {
    let (device, _) = args.job.device().map_err(crate::errors::SetupError)?;
    let spec = spec_of(args, device);
    let out = match &args.out {
        Some(d) => d.clone(),
        None => {
            let d = std::env::temp_dir().join(format!("shardtrain-doctor-{}", std::process::id()));
            std::fs::create_dir_all(&d).with_context(|| {
                format!("cannot make {} for the ranks' logs: give a directory with --out DIR", d.display())
            })?;
            d
        }
    };
    let plan = crate::job::setup::plan_doctor(&args.job, spec, &out)?;
    crate::out::say(&format!(
        "launcher doctor: {} {} rank(s) on {} of {}; logs in {}",
        plan.local_ranks,
        plan.device.name().to_uppercase(),
        plan.launcher_name(plan.node_rank),
        plan.world / plan.local_ranks.max(1),
        plan.logs_dir.display()
    ));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("cannot start the launcher's async runtime: {e}"))?;
    runtime.block_on(crate::run::supervise::run(&plan))
}

/// `1M`, `64K`, `1G`, `4096`: bytes, a positive multiple of 4 (f32 elements) up to 16 GiB.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, unit) = match t.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => (&t[..i], &t[i..]),
        None => (t, ""),
    };
    let mult = match unit.to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => 1,
        "K" => KIB,
        "M" => MIB,
        "G" => GIB,
        _ => return Err(format!("{s:?} is not a size: use bytes or a K, M or G suffix, e.g. 64K, 16M, 1G")),
    };
    let n: u64 = num.trim().parse().map_err(|_| format!("{s:?} is not a size: e.g. 64K, 16M, 1G"))?;
    let bytes = n.checked_mul(mult).filter(|&b| b > 0 && b <= 16 * GIB);
    match bytes {
        Some(b) if b % 4 == 0 => Ok(b),
        Some(_) => Err(format!("{s:?}: sizes are whole f32 elements, a multiple of 4 bytes")),
        None => Err(format!("{s:?}: give a size between 4 bytes and 16G")),
    }
}

fn parse_gbps(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(g) if g.is_finite() && g > 0.0 => Ok(g),
        _ => Err(format!("{s:?} is not a bandwidth: give GB/s as a positive number, e.g. 25 or 400")),
    }
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!("{s:?} is not a fraction: give a number in (0, 1], e.g. 0.5")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes_and_refuse_nonsense() {
        assert_eq!(parse_size("64K"), Ok(64 * 1024));
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("3").unwrap_err().contains("multiple of 4"));
        assert!(parse_size("1T").unwrap_err().contains("K, M or G"));
        assert!(parse_size("0").is_err() && parse_size("-1M").is_err() && parse_size("32G").is_err());
        assert!(parse_fraction("0").is_err() && parse_fraction("1.5").is_err() && parse_fraction("0.25").is_ok());
        assert!(parse_gbps("0").is_err() && parse_gbps("nan").is_err() && parse_gbps("12.5").is_ok());
    }
}
