//! `strata topo`: the GPUs and the links between them (NVLink, P2P, PCIe, NUMA), as a matrix or JSON.
//! Discovered through NVML, or read from a saved file; `--measure` adds copy bandwidth and all-reduce latency.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use strata_parallel::Topology;

#[derive(Args, Debug)]
pub struct TopoArgs {
    /// Also measure peer copy bandwidth per pair and NCCL all-reduce latency per group (needs a build with --features cuda).
    #[arg(long)]
    pub measure: bool,
    /// Print JSON instead of the matrix.
    #[arg(long)]
    pub json: bool,
    /// Write the topology as JSON to FILE (for `strata plan --topology FILE`).
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Read the topology from FILE instead of asking the driver.
    #[arg(long, value_name = "FILE")]
    pub topology: Option<PathBuf>,
}

/// This machine's topology (NVML), or the one saved in `file`.
pub fn load_topology(file: Option<&PathBuf>) -> anyhow::Result<Topology> {
    Ok(match file {
        Some(path) => Topology::load(path)?,
        None => strata_parallel::nvml::discover()?,
    })
}

pub fn topo(args: TopoArgs) -> anyhow::Result<()> {
    let mut topology = load_topology(args.topology.as_ref())?;
    if args.measure {
        measure(&mut topology)?;
    }
    if let Some(path) = &args.save {
        topology.save(path)?;
    }
    if args.json {
        println!("{}", topology.to_json());
    } else {
        print!("{}", topology.render());
    }
    if let Some(path) = &args.save {
        eprintln!("saved to {}", path.display());
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub fn measure(topology: &mut Topology) -> anyhow::Result<()> {
    strata_parallel::measure::measure(topology).context("measuring the links")
}

#[cfg(not(feature = "cuda"))]
pub fn measure(_topology: &mut Topology) -> anyhow::Result<()> {
    Err(anyhow::anyhow!("this strata was built without CUDA"))
        .context("--measure needs GPUs: rebuild with `cargo build --release --features cuda`")
}
