//! Topology discovery through NVML, loaded at run time (libnvidia-ml.so.1), so the binary runs without a driver.
//! Reads each GPU's memory, compute capability, PCIe link and NUMA node, and each pair's NVLink, P2P and PCIe path.

use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus, TopologyLevel};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use crate::topology::{Link, PcieRelation, Topology, TopologyGpu};

/// Why the GPUs could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("no NVIDIA driver found (looked for libnvidia-ml.so.1); pass --topology FILE to plan for another machine")]
    NoDriver,
    #[error("the NVIDIA driver is installed but not loaded (NVML: {0}); check `nvidia-smi`")]
    DriverNotLoaded(String),
    #[error("NVML {what}: {source}")]
    Nvml {
        what: String,
        #[source]
        source: NvmlError,
    },
    #[error("NVML reports no GPUs")]
    NoGpus,
}

fn nvml_err(what: impl Into<String>) -> impl FnOnce(NvmlError) -> DiscoveryError {
    let what = what.into();
    move |source| DiscoveryError::Nvml { what, source }
}

/// Lists this machine's GPUs and the links between them.
pub fn discover() -> Result<Topology, DiscoveryError> {
    let nvml = Nvml::init().map_err(|e| match e {
        NvmlError::LibloadingError(_) | NvmlError::FailedToLoadSymbol(_) => DiscoveryError::NoDriver,
        NvmlError::DriverNotLoaded | NvmlError::LibraryNotFound => DiscoveryError::DriverNotLoaded(e.to_string()),
        other => DiscoveryError::Nvml {
            what: "init".into(),
            source: other,
        },
    })?;
    let count = nvml.device_count().map_err(nvml_err("device count"))?;
    if count == 0 {
        return Err(DiscoveryError::NoGpus);
    }
    let devices = (0..count)
        .map(|i| nvml.device_by_index(i).map_err(nvml_err(format!("GPU{i}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let gpus = devices
        .iter()
        .enumerate()
        .map(|(index, device)| gpu_info(index, device))
        .collect::<Result<Vec<_>, _>>()?;
    let bus_ids: Vec<Option<String>> = gpus.iter().map(|g| g.pci_bus_id.clone()).collect();
    let nvlink_ports: Vec<Vec<NvLinkPort>> = devices.iter().map(|d| nvlink_ports(d, &bus_ids)).collect();
    let mut links = Vec::new();
    for a in 0..devices.len() {
        for b in a + 1..devices.len() {
            links.push(pair_link(&nvml, &devices, a, b, &nvlink_ports)?);
        }
    }
    Ok(Topology {
        source: "nvml".into(),
        driver_version: nvml.sys_driver_version().ok(),
        gpus,
        links,
        all_reduce: Vec::new(),
    })
}

fn gpu_info(index: usize, device: &Device) -> Result<TopologyGpu, DiscoveryError> {
    let memory = device.memory_info().map_err(nvml_err(format!("GPU{index} memory")))?;
    let pci_bus_id = device.pci_info().ok().map(|p| p.bus_id);
    let numa_node = device
        .numa_node_id()
        .ok()
        .or_else(|| pci_bus_id.as_deref().and_then(numa_node_from_sysfs));
    Ok(TopologyGpu {
        index,
        name: device.name().map_err(nvml_err(format!("GPU{index} name")))?,
        memory_total_mib: memory.total / (1 << 20),
        memory_free_mib: memory.free / (1 << 20),
        compute_capability: device
            .cuda_compute_capability()
            .ok()
            .map(|cc| format!("{}.{}", cc.major, cc.minor)),
        pcie_gen: device.max_pcie_link_gen().ok(),
        pcie_width: device.max_pcie_link_width().ok(),
        numa_node,
        pci_bus_id,
    })
}

/// NUMA node from `/sys/bus/pci/devices/<domain:bus:dev.fn>/numa_node` (-1 there means none).
fn numa_node_from_sysfs(bus_id: &str) -> Option<u32> {
    // NVML writes an 8-digit domain ("00000000:18:00.0"); sysfs uses 4 ("0000:18:00.0").
    let short = match bus_id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => format!("{}:{rest}", &domain[domain.len() - 4..]),
        _ => bus_id.to_string(),
    };
    let path = format!("/sys/bus/pci/devices/{}/numa_node", short.to_lowercase());
    std::fs::read_to_string(path)
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()?
        .try_into()
        .ok()
}

/// NVML's NVML_NVLINK_MAX_LINKS: ports per GPU that may carry NVLink.
const MAX_NVLINK_PORTS: u32 = 18;

/// Where one active NVLink port of a GPU leads.
enum NvLinkPort {
    /// Straight to another GPU of this machine (by index).
    Gpu(usize),
    /// To an NVSwitch (or anything that is not one of our GPUs).
    Switch,
}

fn nvlink_ports(device: &Device, bus_ids: &[Option<String>]) -> Vec<NvLinkPort> {
    (0..MAX_NVLINK_PORTS)
        .filter_map(|port| {
            let link = device.link_wrapper_for(port);
            if !link.is_active().ok()? {
                return None;
            }
            let remote = link.remote_pci_info().ok()?.bus_id.to_lowercase();
            let peer = bus_ids
                .iter()
                .position(|id| id.as_deref().is_some_and(|id| id.to_lowercase() == remote));
            Some(peer.map_or(NvLinkPort::Switch, NvLinkPort::Gpu))
        })
        .collect()
}

fn pair_link(
    nvml: &Nvml,
    devices: &[Device],
    a: usize,
    b: usize,
    ports: &[Vec<NvLinkPort>],
) -> Result<Link, DiscoveryError> {
    let (da, db) = (&devices[a], &devices[b]);
    let p2p = |index| matches!(da.p2p_status(db, index), Ok(P2pStatus::Ok));
    let direct = ports[a]
        .iter()
        .filter(|p| matches!(p, NvLinkPort::Gpu(peer) if *peer == b))
        .count();
    let switched = |g: usize| ports[g].iter().filter(|p| matches!(p, NvLinkPort::Switch)).count();
    // Through NVSwitch every GPU reaches every other with all its switch ports (nvidia-smi prints NV18 on HGX H100).
    let nvlink = if direct > 0 {
        direct
    } else if p2p(P2pCapabilitiesIndex::NvLink) {
        switched(a).min(switched(b))
    } else {
        0
    };
    // NVML takes the second device by value; a fresh handle to the same GPU costs nothing.
    let other = nvml.device_by_index(b as u32).map_err(nvml_err(format!("GPU{b}")))?;
    let level = da
        .topology_common_ancestor(other)
        .map_err(nvml_err(format!("PCIe path GPU{a}-GPU{b}")))?;
    Ok(Link {
        a,
        b,
        nvlink: nvlink as u32,
        p2p_read: p2p(P2pCapabilitiesIndex::Read),
        p2p_write: p2p(P2pCapabilitiesIndex::Write),
        pcie: match level {
            TopologyLevel::Internal => PcieRelation::Internal,
            TopologyLevel::Single => PcieRelation::Pix,
            TopologyLevel::Multiple => PcieRelation::Pxb,
            TopologyLevel::HostBridge => PcieRelation::Phb,
            TopologyLevel::Node => PcieRelation::Node,
            TopologyLevel::System => PcieRelation::Sys,
        },
        measured_gbps: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_path_uses_the_short_domain() {
        // No such device on a test machine: the lookup answers None instead of failing.
        assert_eq!(numa_node_from_sysfs("00000000:FF:1F.7"), None);
    }

    #[test]
    fn discovery_without_a_driver_says_so() {
        match discover() {
            Err(DiscoveryError::NoDriver) => {
                let text = DiscoveryError::NoDriver.to_string();
                assert!(text.contains("looked for libnvidia-ml.so.1"), "{text}");
            }
            Err(other) => println!("NVML present but unusable here: {other}"),
            Ok(topology) => assert!(!topology.gpus.is_empty()),
        }
    }
}
