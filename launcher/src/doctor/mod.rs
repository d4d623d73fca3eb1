//! `launcher doctor`: a pre-flight check of the network a job will train over. It starts
//! the job's ranks exactly as training would (`--cpus N` / `--gpus N`, `--nnodes`,
//! `--node-rank`, `--master-addr`, `--one-rank`, the Slurm and torchrun-style environments:
//! `job::setup::place`), and instead of training each rank
//! - times all-reduce and all-gather over the whole job at a few sizes (`measure.rs`);
//! - times every pair of ranks on its own, in rounds of disjoint pairs exchanging both ways at
//!   once, so one slow rank or link shows up as itself (`measure.rs`);
//! - reads what its hardware should give (`hardware.rs`: the GPU's NVLink or PCIe link from
//!   the driver and sysfs, the node's NICs from `/sys/class/infiniband` and `/sys/class/net`).
//!
//! Node 0's launcher gets every rank's numbers, prints the tables and a verdict that names
//! the slow rank or link (`report.rs`), and exits with [`SLOW_EXIT`] when a measurement is
//! below `--threshold` of what is expected (the hardware's figure, or `--expect-gbps`), or a
//! link below `--threshold` of the best link of its kind. That catches a mis-configured
//! network (a job running across nodes at a fraction of the NICs' speed, a GPU on a narrow PCIe
//! link, a node on the wrong interface) before a long run.
//!
//! The command (its flags, and the run) is `commands/doctor.rs`; here is what the ranks
//! measure (`spec.rs` says what, `measure.rs`, `gpu.rs` and `hardware.rs` do it) and how node
//! 0 judges it (`report.rs`). May import only the leaves (`signals`): the job's layout
//! (`job/`), the supervisor (`run/`) and the rank (`rank/`) call into it, never the reverse.

pub mod gpu;
pub mod hardware;
pub mod measure;
pub mod report;
pub mod spec;

pub use spec::{read_spec, Spec};

/// Exit code of a doctor run that found the network slower than the threshold.
pub const SLOW_EXIT: u8 = 4;

/// The config the ranks of a doctor run read: only its watchdog and flight-recorder
/// settings matter (no model is built, no data read).
pub const CONFIG: &str = "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nvocab_size = 64\nseq_len = 8\n";

/// The node of each rank: its launcher's (`local_ranks` per node), or with `--one-rank` (a
/// launcher per rank) the ranks sharing a host name.
pub fn nodes_of(reports: &[report::RankReport], local_ranks: usize, one_rank: bool) -> Vec<usize> {
    if !one_rank {
        return (0..reports.len()).map(|r| r / local_ranks.max(1)).collect();
    }
    let mut hosts: Vec<&str> = Vec::new();
    reports
        .iter()
        .map(|r| {
            let h = r.hardware.host.as_str();
            hosts.iter().position(|x| *x == h).unwrap_or_else(|| {
                hosts.push(h);
                hosts.len() - 1
            })
        })
        .collect()
}

/// What a rank needs to measure.
pub struct RankRun<'a> {
    pub spec: &'a Spec,
    /// GPU ranks measure over NCCL on `gpu`; CPU ranks over `comm`.
    pub on_gpu: bool,
    /// The job's TCP group (CPU ranks measure over it; GPU ranks keep it open, unused, as
    /// in training).
    pub comm: collectives::tcp::TcpComm,
    pub rank: usize,
    pub world: usize,
    pub gpu: usize,
    pub nccl_id: Option<&'a [u8]>,
    /// Test-only (`SHARDTRAIN_FAULT` kind `throttle`): hold a CPU rank's traffic to this rate.
    pub throttle: Option<f64>,
    pub progress: &'a std::sync::Arc<collectives::progress::Progress>,
}

/// One rank's measurements and its hardware.
pub fn rank(run: RankRun) -> Result<report::RankReport, String> {
    let gpu = run.on_gpu;
    let hardware = hardware::Hardware::of_this_rank(gpu.then_some(run.gpu).and_then(self::gpu::links_of));
    let measured = if run.world < 2 {
        // Nothing crosses a link: no communicator to make (the report says so).
        measure::Measured::default()
    } else if gpu {
        let _host_group = run.comm;
        let id = run.nccl_id.ok_or("the launcher sent no NCCL id for a GPU job")?;
        gpu::measure_rank(run.spec, run.rank, run.world, run.gpu, id, run.progress)?
    } else {
        let mut net = measure::TcpNet::new(run.comm, run.spec, run.throttle);
        // About 64 MiB per timed size: 4 calls of 16 MiB, 20 of 1 MiB.
        measure::run(&mut net, run.spec, 64 << 20, run.progress)?
    };
    trainer::log_line!(
        "rank {}: measured {} collective size(s) and {} link(s)",
        run.rank,
        measured.collectives.len(),
        measured.links.len()
    );
    Ok(report::RankReport { hardware, collectives: measured.collectives, links: measured.links })
}
