//! The numbers behind the planner's estimates: GPU memory bandwidth by name, link speed and latency by kind.
//! Measured numbers from `strata topo --measure` replace the table values wherever they exist.

use crate::topology::{Link, PcieRelation, Topology, TopologyGpu};

/// Fraction of the datasheet memory bandwidth a decode step reaches (weights streamed once per step).
pub const DECODE_BANDWIDTH_EFFICIENCY: f64 = 0.8;

/// Datasheet HBM/GDDR bandwidth in GB/s, matched on the NVML name (first match wins).
const MEMORY_BANDWIDTH_GBPS: [(&str, f64); 20] = [
    ("H200", 4800.0),
    ("GH200", 4000.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("A30", 933.0),
    ("A40", 696.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10", 600.0),
    ("RTX 6000 Ada", 960.0),
    ("RTX A6000", 768.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
    ("V100", 900.0),
    ("T4", 320.0),
];

/// Memory bandwidth in GB/s and where the number came from.
pub fn memory_bandwidth_gbps(gpu: &TopologyGpu) -> (f64, &'static str) {
    if let Some((_, gbps)) = MEMORY_BANDWIDTH_GBPS.iter().find(|(name, _)| gpu.name.contains(name)) {
        return (*gbps, "datasheet");
    }
    // Unknown card: a guess from its memory size (HBM parts are the big ones).
    let gib = gpu.memory_total_mib as f64 / 1024.0;
    let gbps = match gib {
        g if g >= 120.0 => 4000.0,
        g if g >= 70.0 => 2000.0,
        g if g >= 40.0 => 800.0,
        g if g >= 20.0 => 900.0,
        _ => 450.0,
    };
    (gbps, "guessed from memory size")
}

/// How data moves between two GPUs, for the estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkCost {
    /// One-way bandwidth in GB/s.
    pub gbps: f64,
    /// Latency of one step of a collective over this link, in microseconds.
    pub step_latency_us: f64,
    pub kind: LinkKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LinkKind {
    NvLink,
    PcieP2p,
    /// No P2P: NCCL stages every transfer through host memory.
    HostStaged,
    /// No P2P and across CPU sockets.
    HostStagedCrossSocket,
}

impl LinkKind {
    pub fn describe(self) -> &'static str {
        match self {
            LinkKind::NvLink => "NVLink",
            LinkKind::PcieP2p => "PCIe P2P",
            LinkKind::HostStaged => "PCIe without P2P (through host memory)",
            LinkKind::HostStagedCrossSocket => "SYS without P2P (through host memory, across sockets)",
        }
    }
}

/// NVLink 3/4 carry 25 GB/s per link and direction (NV12 on A100: 300 GB/s, NV18 on H100/H200: 450 GB/s).
const NVLINK_GBPS_PER_LINK: f64 = 25.0;
/// Usable PCIe bandwidth per lane in GB/s after encoding and protocol overhead, by generation.
fn pcie_lane_gbps(generation: u32) -> f64 {
    match generation {
        0..=2 => 0.4,
        3 => 0.8,
        4 => 1.6,
        5 => 3.2,
        _ => 6.4,
    }
}

/// The estimate for one link; a measured copy bandwidth replaces the bandwidth figure.
pub fn link_cost(topology: &Topology, link: &Link) -> LinkCost {
    let (ga, gb) = (&topology.gpus[link.a], &topology.gpus[link.b]);
    let generation = ga.pcie_gen.unwrap_or(4).min(gb.pcie_gen.unwrap_or(4));
    let width = ga.pcie_width.unwrap_or(16).min(gb.pcie_width.unwrap_or(16));
    let pcie_gbps = pcie_lane_gbps(generation) * width as f64;
    let mut cost = if link.nvlink > 0 {
        LinkCost {
            gbps: NVLINK_GBPS_PER_LINK * link.nvlink as f64,
            step_latency_us: 1.5,
            kind: LinkKind::NvLink,
        }
    } else if link.p2p() {
        LinkCost {
            gbps: pcie_gbps,
            step_latency_us: 4.0,
            kind: LinkKind::PcieP2p,
        }
    } else if link.pcie == PcieRelation::Sys {
        LinkCost {
            gbps: pcie_gbps * 0.3,
            step_latency_us: 25.0,
            kind: LinkKind::HostStagedCrossSocket,
        }
    } else {
        LinkCost {
            gbps: pcie_gbps * 0.4,
            step_latency_us: 15.0,
            kind: LinkKind::HostStaged,
        }
    };
    if let Some(measured) = link.measured_gbps.filter(|g| *g > 0.0) {
        cost.gbps = measured;
    }
    cost
}

/// Fixed cost of launching one collective, in microseconds.
pub const COLLECTIVE_LAUNCH_US: f64 = 3.0;

/// The slowest link inside a group of GPUs (what a ring all-reduce is paced by).
pub fn slowest_link(topology: &Topology, gpus: &[usize]) -> Option<LinkCost> {
    let mut slowest: Option<LinkCost> = None;
    for (i, &a) in gpus.iter().enumerate() {
        for &b in &gpus[i + 1..] {
            let Some(link) = topology.link(a, b) else { continue };
            let cost = link_cost(topology, link);
            if slowest.is_none_or(|s| (cost.kind, -cost.gbps) > (s.kind, -s.gbps)) {
                slowest = Some(cost);
            }
        }
    }
    slowest
}

/// Microseconds of one ring all-reduce of `bytes` over `gpus`: 2(t-1) steps, each a latency and bytes/t.
/// A measured latency for this group (at its message size) replaces the latency part.
pub fn all_reduce_us(topology: &Topology, gpus: &[usize], bytes: u64) -> f64 {
    let t = gpus.len();
    if t < 2 {
        return 0.0;
    }
    let Some(link) = slowest_link(topology, gpus) else {
        return 0.0;
    };
    let steps = 2.0 * (t as f64 - 1.0);
    let transfer_us = steps * (bytes as f64 / t as f64) / (link.gbps * 1e3);
    match topology.measured_all_reduce(gpus) {
        Some(m) => {
            // The measurement already holds latency plus its own transfer; scale the transfer part.
            let measured_transfer = steps * (m.bytes as f64 / t as f64) / (link.gbps * 1e3);
            (m.latency_us - measured_transfer).max(0.0) + transfer_us
        }
        None => COLLECTIVE_LAUNCH_US + steps * link.step_latency_us + transfer_us,
    }
}

/// Microseconds to hand `bytes` from one pipeline stage to the next over the best link between them.
pub fn hand_off_us(topology: &Topology, from: &[usize], to: &[usize], bytes: u64) -> f64 {
    let best = from
        .iter()
        .flat_map(|&a| to.iter().filter_map(move |&b| topology.link(a, b)))
        .map(|l| link_cost(topology, l))
        .min_by(|x, y| {
            (x.kind, -x.gbps)
                .partial_cmp(&(y.kind, -y.gbps))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
    match best {
        Some(link) => COLLECTIVE_LAUNCH_US + link.step_latency_us + bytes as f64 / (link.gbps * 1e3),
        None => 0.0,
    }
}
