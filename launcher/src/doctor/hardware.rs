//! What a rank's hardware should give, read without running any tool: the node's network
//! interfaces from sysfs (`/sys/class/infiniband/*/ports/*/{rate,state}`,
//! `/sys/class/net/*/{speed,operstate}`) and, for a GPU rank, its GPU's link (`gpu.rs`: the
//! driver's name, PCI address and peer access, the PCIe link from sysfs).
//!
//! Rates are GB/s (10⁹ bytes) per direction throughout. NVLink has no driver attribute for its
//! bandwidth: a GPU whose every peer is reachable directly (peer access) and whose name is in
//! [`NVLINK_GBPS`] is taken to have that figure; any other GPU is judged by its PCIe link.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// NVLink bandwidth per GPU and direction (GB/s) of the SXM parts, by name fragment (the
/// vendors' figures: NVLink 3 600 GB/s, NVLink 4 900 GB/s, NVLink 5 1.8 TB/s, both ways).
/// PCIe cards of the same names are told apart by "PCIe" in their name.
// Read by the GPU side only (`gpu.rs`, the `cuda` feature).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub const NVLINK_GBPS: [(&str, f64); 6] =
    [("A100", 300.0), ("H100", 450.0), ("H200", 450.0), ("H800", 200.0), ("B200", 900.0), ("GB200", 900.0)];

/// A rank's view of its hardware.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    /// The node's host name (reports name nodes by it).
    pub host: String,
    /// GPU ranks: the GPU's links.
    pub gpu: Option<GpuLinks>,
    /// The node's network interfaces that are up, with a known rate.
    pub nics: Vec<Nic>,
}

/// A GPU's links as the driver and sysfs describe them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuLinks {
    pub name: String,
    /// `0000:18:00.0`.
    pub pci: String,
    /// The PCIe link's current rate per direction (GB/s), and how it was read.
    pub pcie_gbps: Option<f64>,
    pub pcie: Option<String>,
    /// Every other GPU this process sees is reachable by peer access.
    pub peer_access: bool,
    /// NVLink per direction (GB/s), where the name is in [`NVLINK_GBPS`] and peers are reachable.
    pub nvlink_gbps: Option<f64>,
}

impl GpuLinks {
    /// What a link to another GPU of this node should give per direction, and why.
    pub fn expected(&self) -> Option<(f64, String)> {
        if let Some(g) = self.nvlink_gbps {
            return Some((g, format!("NVLink of the {} ({g:.0} GB/s per direction)", self.name)));
        }
        let p = self.pcie_gbps?;
        Some((
            p,
            format!("PCIe {} of GPU {} ({p:.1} GB/s per direction)", self.pcie.as_deref().unwrap_or("?"), self.pci),
        ))
    }
}

/// A network interface.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Nic {
    /// `mlx5_0 port 1` or `eth0`.
    pub name: String,
    pub infiniband: bool,
    /// Per direction, GB/s.
    pub gbps: f64,
}

impl Hardware {
    /// This node as a rank sees it, with its GPU's links (`gpu::links_of`; `None` for CPU ranks).
    pub fn of_this_rank(gpu: Option<GpuLinks>) -> Hardware {
        let host =
            std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
        let mut nics = infiniband_ports(Path::new("/sys/class/infiniband"));
        nics.extend(net_interfaces(Path::new("/sys/class/net")));
        Hardware { host, gpu, nics }
    }

    /// The node's total over its active InfiniBand ports, else its fastest interface: what
    /// traffic leaving the node should reach (GB/s), and why.
    pub fn node_network(&self) -> Option<(f64, String)> {
        let ib: Vec<&Nic> = self.nics.iter().filter(|n| n.infiniband).collect();
        if !ib.is_empty() {
            let total: f64 = ib.iter().map(|n| n.gbps).sum();
            return Some((
                total,
                format!("{} InfiniBand port(s) of {} ({total:.1} GB/s together)", ib.len(), self.host),
            ));
        }
        self.fastest_nic()
    }

    /// The fastest single interface (one connection, e.g. a pair of ranks, uses one).
    pub fn fastest_nic(&self) -> Option<(f64, String)> {
        self.nics
            .iter()
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
            .map(|n| (n.gbps, format!("{} of {} ({:.1} GB/s)", n.name, self.host, n.gbps)))
    }
}

/// `400 Gb/sec (4X NDR)` → 50 GB/s.
pub fn parse_ib_rate(text: &str) -> Option<f64> {
    let gbit: f64 = text.split_whitespace().next()?.parse().ok()?;
    (gbit > 0.0).then_some(gbit / 8.0)
}

/// `/sys/class/net/*/speed` in Mb/s (`-1` or unreadable when unknown) → GB/s.
pub fn parse_net_speed(text: &str) -> Option<f64> {
    let mbit: f64 = text.trim().parse().ok()?;
    (mbit > 0.0).then_some(mbit / 8000.0)
}

/// Active InfiniBand (or RoCE) ports under `root` (`/sys/class/infiniband`).
pub fn infiniband_ports(root: &Path) -> Vec<Nic> {
    let mut out = Vec::new();
    for dev in sorted_entries(root) {
        for port in sorted_entries(&root.join(&dev).join("ports")) {
            let dir = root.join(&dev).join("ports").join(&port);
            let active = read(&dir.join("state")).is_some_and(|s| s.contains("ACTIVE"));
            if let (true, Some(gbps)) = (active, read(&dir.join("rate")).as_deref().and_then(parse_ib_rate)) {
                out.push(Nic { name: format!("{dev} port {port}"), infiniband: true, gbps });
            }
        }
    }
    out
}

/// Interfaces under `root` (`/sys/class/net`) that are up and say their speed (not `lo`).
pub fn net_interfaces(root: &Path) -> Vec<Nic> {
    sorted_entries(root)
        .into_iter()
        .filter(|name| name != "lo")
        .filter_map(|name| {
            let dir = root.join(&name);
            let up = read(&dir.join("operstate")).is_some_and(|s| s.trim() == "up");
            let gbps = read(&dir.join("speed")).as_deref().and_then(parse_net_speed)?;
            up.then_some(Nic { name, infiniband: false, gbps })
        })
        .collect()
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

fn sorted_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|it| it.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// The NVLink figure for a GPU named `name` (SXM parts only), if known.
// Read by the GPU side only (`gpu.rs`, the `cuda` feature).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn nvlink_of(name: &str) -> Option<f64> {
    if name.contains("PCIe") || name.contains("NVL") {
        return None;
    }
    NVLINK_GBPS.iter().filter(|(frag, _)| name.contains(frag)).map(|(_, g)| *g).next_back()
}

/// `current_link_speed` (`32.0 GT/s PCIe`) and `current_link_width` (`16`) → GB/s per
/// direction (128b/130b encoding from 8 GT/s on, 8b/10b below).
// Read by the GPU side only (`gpu.rs`, the `cuda` feature).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn pcie_gbps(speed: &str, width: &str) -> Option<f64> {
    let gt: f64 = speed.split_whitespace().next()?.parse().ok()?;
    let lanes: f64 = width.trim().parse().ok()?;
    let encoding = if gt >= 8.0 { 128.0 / 130.0 } else { 0.8 };
    (gt > 0.0 && lanes > 0.0).then_some(gt * lanes * encoding / 8.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse() {
        assert_eq!(parse_ib_rate("400 Gb/sec (4X NDR)\n"), Some(50.0));
        assert_eq!(parse_ib_rate("garbage"), None);
        assert_eq!(parse_net_speed("25000\n"), Some(3.125));
        assert_eq!(parse_net_speed("-1"), None);
        let g5 = pcie_gbps("32.0 GT/s PCIe\n", "16\n").expect("gen5");
        assert!((g5 - 63.0).abs() < 0.1, "{g5}");
        let g1 = pcie_gbps("2.5 GT/s PCIe", "8").expect("gen1");
        assert!((g1 - 2.0).abs() < 1e-9, "{g1}");
        assert_eq!(nvlink_of("NVIDIA H100 80GB HBM3"), Some(450.0));
        assert_eq!(nvlink_of("NVIDIA H100 PCIe"), None);
        assert_eq!(nvlink_of("NVIDIA H200"), Some(450.0));
        assert_eq!(nvlink_of("NVIDIA GB200"), Some(900.0));
        assert_eq!(nvlink_of("NVIDIA GeForce RTX 4090"), None);
    }

    /// A fake sysfs: active and down IB ports, an interface that is up, one down, `lo`.
    #[test]
    fn interfaces_are_read_from_sysfs() {
        let d = tempfile::tempdir().expect("tempdir");
        let put = |p: &str, text: &str| {
            let path = d.path().join(p);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        };
        put("ib/mlx5_0/ports/1/rate", "400 Gb/sec (4X NDR)\n");
        put("ib/mlx5_0/ports/1/state", "4: ACTIVE\n");
        put("ib/mlx5_1/ports/1/rate", "400 Gb/sec (4X NDR)\n");
        put("ib/mlx5_1/ports/1/state", "1: DOWN\n");
        put("net/eth0/speed", "100000\n");
        put("net/eth0/operstate", "up\n");
        put("net/eth1/speed", "100000\n");
        put("net/eth1/operstate", "down\n");
        put("net/lo/operstate", "unknown\n");
        let ib = infiniband_ports(&d.path().join("ib"));
        assert_eq!(ib, vec![Nic { name: "mlx5_0 port 1".into(), infiniband: true, gbps: 50.0 }]);
        let net = net_interfaces(&d.path().join("net"));
        assert_eq!(net, vec![Nic { name: "eth0".into(), infiniband: false, gbps: 12.5 }]);
        let hw = Hardware { host: "n1".into(), gpu: None, nics: [ib, net].concat() };
        assert_eq!(hw.node_network().map(|(g, _)| g), Some(50.0), "InfiniBand first");
        assert_eq!(hw.fastest_nic().map(|(g, _)| g), Some(50.0));
        assert!(infiniband_ports(&d.path().join("nowhere")).is_empty());
    }
}
