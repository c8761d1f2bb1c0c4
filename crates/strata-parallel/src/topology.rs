//! The machine as data: GPUs, the link between every pair of them, measured numbers when present.
//! Saved to and loaded from JSON (so the planner runs without GPUs) and printed like `nvidia-smi topo -m`.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Why a topology file could not be read, written or trusted.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("cannot read topology file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write topology file {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("topology file {path} is not valid topology JSON: {source} (write one with `strata topo --save FILE`)")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("topology {path}: {reason}")]
    Invalid { path: String, reason: String },
}

/// One GPU of a topology, as the driver reports it (the device handle is `strata_runtime::cuda::Gpu`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopologyGpu {
    /// Position in this topology (0-based, as CUDA and NVML number devices by default).
    pub index: usize,
    pub name: String,
    pub memory_total_mib: u64,
    pub memory_free_mib: u64,
    /// CUDA compute capability as "major.minor", e.g. "9.0".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_gen: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_width: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// PCI bus id, e.g. "00000000:18:00.0".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
}

/// How two GPUs are connected through PCIe (NVML's common ancestor), closest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum PcieRelation {
    /// Both on one board (e.g. a dual-GPU card).
    Internal,
    /// At most one PCIe switch between them.
    Pix,
    /// Several PCIe switches, no host bridge.
    Pxb,
    /// Through one CPU's PCIe host bridge.
    Phb,
    /// Through host bridges of one NUMA node.
    Node,
    /// Across CPU sockets (the inter-socket link, e.g. UPI or Infinity Fabric).
    Sys,
}

impl PcieRelation {
    /// The label `nvidia-smi topo -m` prints.
    pub fn label(self) -> &'static str {
        match self {
            PcieRelation::Internal => "INT",
            PcieRelation::Pix => "PIX",
            PcieRelation::Pxb => "PXB",
            PcieRelation::Phb => "PHB",
            PcieRelation::Node => "NODE",
            PcieRelation::Sys => "SYS",
        }
    }
}

/// The connection between GPUs `a` and `b` (`a < b`); links are symmetric.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub a: usize,
    pub b: usize,
    /// NVLink links between the two (directly or through NVSwitch); 0 when none.
    #[serde(default)]
    pub nvlink: u32,
    /// Whether one GPU can read the other's memory directly (CUDA peer access).
    pub p2p_read: bool,
    pub p2p_write: bool,
    pub pcie: PcieRelation,
    /// Measured one-way copy bandwidth in GB/s (`strata topo --measure`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_gbps: Option<f64>,
}

impl Link {
    /// Peer-to-peer in both directions (what NCCL's P2P transport needs).
    pub fn p2p(&self) -> bool {
        self.p2p_read && self.p2p_write
    }

    /// The matrix cell: `NV18` for NVLink, else the PCIe relation.
    pub fn label(&self) -> String {
        if self.nvlink > 0 {
            format!("NV{}", self.nvlink)
        } else {
            self.pcie.label().to_string()
        }
    }
}

/// A measured NCCL all-reduce over a group of GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllReduceMeasurement {
    pub gpus: Vec<usize>,
    /// Message size in bytes.
    pub bytes: u64,
    /// Mean time of one all-reduce in microseconds.
    pub latency_us: f64,
}

/// All GPUs of a machine and the links between them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Where this came from: "nvml", "measured", or a fixture's description.
    pub source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    pub gpus: Vec<TopologyGpu>,
    /// One entry per unordered pair of GPUs.
    pub links: Vec<Link>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub all_reduce: Vec<AllReduceMeasurement>,
}

impl Topology {
    /// Reads and checks a topology JSON file.
    pub fn load(path: &Path) -> Result<Self, TopologyError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::from_json(&text, &shown)
    }

    /// Parses and checks topology JSON; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, TopologyError> {
        let topology: Topology = serde_json::from_str(text).map_err(|source| TopologyError::Parse {
            path: origin.to_string(),
            source,
        })?;
        topology.validate().map_err(|reason| TopologyError::Invalid {
            path: origin.to_string(),
            reason,
        })?;
        Ok(topology)
    }

    /// Writes the topology as pretty JSON.
    pub fn save(&self, path: &Path) -> Result<(), TopologyError> {
        std::fs::write(path, self.to_json() + "\n").map_err(|source| TopologyError::Write {
            path: path.display().to_string(),
            source,
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Checks that GPUs are numbered 0..n and every pair has exactly one link.
    pub fn validate(&self) -> Result<(), String> {
        if self.gpus.is_empty() {
            return Err("no GPUs listed".into());
        }
        for (position, gpu) in self.gpus.iter().enumerate() {
            if gpu.index != position {
                return Err(format!("GPU at position {position} has index {}", gpu.index));
            }
            if gpu.memory_free_mib > gpu.memory_total_mib {
                return Err(format!("GPU{position}: free memory exceeds total"));
            }
        }
        let n = self.gpus.len();
        let mut seen = vec![false; n * n];
        for link in &self.links {
            if link.a >= link.b || link.b >= n {
                return Err(format!(
                    "link {}-{}: needs a < b < {n} (the number of GPUs)",
                    link.a, link.b
                ));
            }
            if std::mem::replace(&mut seen[link.a * n + link.b], true) {
                return Err(format!("link {}-{} is listed twice", link.a, link.b));
            }
        }
        for a in 0..n {
            for b in a + 1..n {
                if !seen[a * n + b] {
                    return Err(format!("no link listed between GPU{a} and GPU{b}"));
                }
            }
        }
        for group in &self.all_reduce {
            if group.gpus.iter().any(|&g| g >= n) || group.latency_us <= 0.0 {
                return Err(format!("all-reduce measurement over {:?} is out of range", group.gpus));
            }
        }
        Ok(())
    }

    /// The link between two different GPUs.
    pub fn link(&self, a: usize, b: usize) -> Option<&Link> {
        let (a, b) = (a.min(b), a.max(b));
        self.links.iter().find(|l| l.a == a && l.b == b)
    }

    /// The measured all-reduce latency over exactly this set of GPUs, if any.
    pub fn measured_all_reduce(&self, gpus: &[usize]) -> Option<&AllReduceMeasurement> {
        let mut wanted = gpus.to_vec();
        wanted.sort_unstable();
        self.all_reduce.iter().find(|m| {
            let mut have = m.gpus.clone();
            have.sort_unstable();
            have == wanted
        })
    }

    /// The matrix `nvidia-smi topo -m` prints, plus a GPU table, P2P, measurements and a legend.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let n = self.gpus.len();
        let _ = writeln!(out, "GPUs ({}):", self.source);
        for gpu in &self.gpus {
            let _ = writeln!(
                out,
                "  GPU{:<2} {:<28} {:>7.1} GiB total {:>7.1} GiB free  cc {:<4}  PCIe {}  NUMA {}",
                gpu.index,
                gpu.name,
                gpu.memory_total_mib as f64 / 1024.0,
                gpu.memory_free_mib as f64 / 1024.0,
                gpu.compute_capability.as_deref().unwrap_or("?"),
                match (gpu.pcie_gen, gpu.pcie_width) {
                    (Some(g), Some(w)) => format!("gen{g} x{w}"),
                    _ => "?".into(),
                },
                gpu.numa_node.map_or("?".to_string(), |n| n.to_string()),
            );
        }
        let header = |out: &mut String, title: &str| {
            let _ = write!(out, "\n{title:<8}");
            for b in 0..n {
                let _ = write!(out, "{:>7}", format!("GPU{b}"));
            }
        };
        header(&mut out, "Links");
        let _ = writeln!(out, "  NUMA");
        for a in 0..n {
            let _ = write!(out, "{:<8}", format!("GPU{a}"));
            for b in 0..n {
                let _ = write!(out, "{:>7}", self.cell(a, b, Link::label));
            }
            let numa = self.gpus[a].numa_node.map_or("?".to_string(), |n| n.to_string());
            let _ = writeln!(out, "  {numa}");
        }
        header(&mut out, "P2P");
        let _ = writeln!(out);
        for a in 0..n {
            let _ = write!(out, "{:<8}", format!("GPU{a}"));
            for b in 0..n {
                let _ = write!(out, "{:>7}", self.cell(a, b, p2p_label));
            }
            let _ = writeln!(out);
        }
        if self.links.iter().any(|l| l.measured_gbps.is_some()) {
            header(&mut out, "GB/s");
            let _ = writeln!(out, "  (measured peer copy)");
            for a in 0..n {
                let _ = write!(out, "{:<8}", format!("GPU{a}"));
                for b in 0..n {
                    let _ = write!(
                        out,
                        "{:>7}",
                        self.cell(a, b, |l| l.measured_gbps.map_or("-".into(), |g| format!("{g:.1}")))
                    );
                }
                let _ = writeln!(out);
            }
        }
        if !self.all_reduce.is_empty() {
            let _ = writeln!(out, "\nAll-reduce (NCCL, measured):");
            for m in &self.all_reduce {
                let gpus: Vec<String> = m.gpus.iter().map(|g| g.to_string()).collect();
                let _ = writeln!(
                    out,
                    "  GPUs {:<16} {:>9} bytes  {:>8.1} us",
                    gpus.join(","),
                    m.bytes,
                    m.latency_us
                );
            }
        }
        let _ = writeln!(
            out,
            "\nLegend:\n  X    = self\n  NV#  = connected by # NVLink links (directly or through NVSwitch)\n  \
             INT  = on one board\n  PIX  = at most one PCIe switch\n  PXB  = several PCIe switches, no host bridge\n  \
             PHB  = through a PCIe host bridge (one CPU)\n  NODE = between host bridges of one NUMA node\n  \
             SYS  = across CPU sockets\n  P2P: OK = peer read and write, R/W = one of them, -- = none (copies go through host memory)"
        );
        out
    }

    fn cell(&self, a: usize, b: usize, label: impl Fn(&Link) -> String) -> String {
        if a == b {
            return "X".into();
        }
        self.link(a, b).map_or("?".into(), label)
    }
}

fn p2p_label(link: &Link) -> String {
    match (link.p2p_read, link.p2p_write) {
        (true, true) => "OK",
        (true, false) => "R",
        (false, true) => "W",
        (false, false) => "--",
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_gpus(links: &str) -> String {
        format!(
            r#"{{"source":"test","gpus":[
                {{"index":0,"name":"A","memory_total_mib":1024,"memory_free_mib":1000}},
                {{"index":1,"name":"B","memory_total_mib":1024,"memory_free_mib":1000}}],
              "links":[{links}]}}"#
        )
    }

    #[test]
    fn json_round_trips_and_renders_the_matrix() {
        let text = two_gpus(r#"{"a":0,"b":1,"nvlink":18,"p2p_read":true,"p2p_write":true,"pcie":"SYS"}"#);
        let topology = Topology::from_json(&text, "test").unwrap();
        let again = Topology::from_json(&topology.to_json(), "again").unwrap();
        assert_eq!(topology, again);
        let shown = topology.render();
        assert!(shown.contains("NV18"), "{shown}");
        assert!(shown.contains("OK"), "{shown}");
    }

    #[test]
    fn missing_and_duplicate_links_are_rejected_with_the_pair() {
        let missing = Topology::from_json(&two_gpus(""), "t").unwrap_err().to_string();
        assert!(missing.contains("no link listed between GPU0 and GPU1"), "{missing}");
        let link = r#"{"a":0,"b":1,"p2p_read":false,"p2p_write":false,"pcie":"SYS"}"#;
        let twice = Topology::from_json(&two_gpus(&format!("{link},{link}")), "t")
            .unwrap_err()
            .to_string();
        assert!(twice.contains("listed twice"), "{twice}");
        let bad = Topology::from_json("{", "t").unwrap_err().to_string();
        assert!(bad.contains("strata topo --save"), "{bad}");
    }
}
