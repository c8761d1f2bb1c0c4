//! Measuring the links on real GPUs (feature `cuda`): peer copy bandwidth per pair and NCCL all-reduce latency per group.
//! libcuda and libnccl are dlopened; their absence is a clear error, never cudarc's panic.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DriverError};
use cudarc::nccl::{Comm, ReduceOp};

use crate::topology::{AllReduceMeasurement, Topology};

/// Bytes copied per timed peer transfer.
const COPY_BYTES: usize = 64 << 20;
const COPY_REPEATS: usize = 10;
/// All-reduce message sizes: one decode token of an 8192-wide model in bf16, and a 64-token batch of it.
pub const ALL_REDUCE_BYTES: [usize; 2] = [16 << 10, 1 << 20];
const ALL_REDUCE_REPEATS: usize = 50;

/// Why measuring failed.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    #[error("libcuda.so (the NVIDIA driver's CUDA library) was not found; install the driver or add its folder to LD_LIBRARY_PATH")]
    NoCudaDriver,
    #[error("libnccl.so was not found (cudarc opens the bare name `libnccl.so`); add the folder holding it (e.g. site-packages/nvidia/nccl/lib, after linking libnccl.so to libnccl.so.2) to LD_LIBRARY_PATH")]
    NoNccl,
    #[error("CUDA {what}: {source:?}")]
    Cuda { what: String, source: DriverError },
    #[error("NCCL {what}: error code {code}")]
    Nccl { what: String, code: String },
    #[error("CUDA sees {cuda} GPUs but the topology lists {listed}; check CUDA_VISIBLE_DEVICES")]
    CountMismatch { cuda: usize, listed: usize },
}

fn cuda_err(what: impl Into<String>) -> impl FnOnce(DriverError) -> MeasureError {
    let what = what.into();
    move |source| MeasureError::Cuda { what, source }
}

fn nccl_err(what: impl Into<String>) -> impl FnOnce(cudarc::nccl::result::NcclError) -> MeasureError {
    let what = what.into();
    move |e| MeasureError::Nccl {
        what,
        code: format!("{:?}", e.0),
    }
}

/// Adds measured copy bandwidth to every link and all-reduce latencies for the groups a planner would use.
pub fn measure(topology: &mut Topology) -> Result<(), MeasureError> {
    // SAFETY: these only try to dlopen the libraries; cudarc would panic on first use without them.
    if !unsafe { sys::is_culib_present() } {
        return Err(MeasureError::NoCudaDriver);
    }
    let count = CudaContext::device_count().map_err(cuda_err("device count"))? as usize;
    if count != topology.gpus.len() {
        return Err(MeasureError::CountMismatch {
            cuda: count,
            listed: topology.gpus.len(),
        });
    }
    let contexts = (0..count)
        .map(|i| CudaContext::new(i).map_err(cuda_err(format!("context on GPU{i}"))))
        .collect::<Result<Vec<_>, _>>()?;
    for link in topology.links.iter_mut() {
        let gbps = copy_bandwidth(&contexts[link.a], &contexts[link.b])?;
        link.measured_gbps = Some((gbps * 10.0).round() / 10.0);
    }
    if count >= 2 {
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(MeasureError::NoNccl);
        }
        topology.all_reduce = all_reduce_groups(count)
            .into_iter()
            .map(|group| all_reduce_latency(&contexts, &group))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .flatten()
            .collect();
    }
    topology.source = "nvml + measured".into();
    Ok(())
}

/// Consecutive groups of every power-of-two size: {0,1} {2,3} ... {0..3} ... all GPUs.
fn all_reduce_groups(count: usize) -> Vec<Vec<usize>> {
    let mut groups = Vec::new();
    let mut size = 2;
    while size <= count {
        for start in (0..=count - size).step_by(size) {
            groups.push((start..start + size).collect());
        }
        size *= 2;
    }
    groups
}

/// Enables direct peer access from `from` to `to` when CUDA says it is possible (else copies go through the host).
fn enable_peer_access(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<(), MeasureError> {
    let mut can = 0i32;
    // SAFETY: plain driver queries on valid device handles; the context is bound to this thread first.
    unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, from.cu_device(), to.cu_device())
            .result()
            .map_err(cuda_err("peer access query"))?;
        if can == 1 {
            from.bind_to_thread().map_err(cuda_err("bind context"))?;
            let status = sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0);
            if status != sys::CUresult::CUDA_SUCCESS && status != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            {
                return Err(MeasureError::Cuda {
                    what: "enable peer access".into(),
                    source: DriverError(status),
                });
            }
        }
    }
    Ok(())
}

/// GB/s of copies from GPU `a` into GPU `b`, timed with events on `b`'s stream.
fn copy_bandwidth(a: &Arc<CudaContext>, b: &Arc<CudaContext>) -> Result<f64, MeasureError> {
    enable_peer_access(b, a)?;
    enable_peer_access(a, b)?;
    let src_stream = a.default_stream();
    let dst_stream = b.new_stream().map_err(cuda_err("stream"))?;
    let src: CudaSlice<u8> = src_stream.alloc_zeros(COPY_BYTES).map_err(cuda_err("source buffer"))?;
    let mut dst: CudaSlice<u8> = dst_stream.alloc_zeros(COPY_BYTES).map_err(cuda_err("target buffer"))?;
    src_stream.synchronize().map_err(cuda_err("sync"))?;
    dst_stream
        .memcpy_dtod(&src, &mut dst)
        .map_err(cuda_err("warm-up copy"))?;
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = b.new_event(timing).map_err(cuda_err("event"))?;
    let end = b.new_event(timing).map_err(cuda_err("event"))?;
    start.record(&dst_stream).map_err(cuda_err("event record"))?;
    for _ in 0..COPY_REPEATS {
        dst_stream.memcpy_dtod(&src, &mut dst).map_err(cuda_err("peer copy"))?;
    }
    end.record(&dst_stream).map_err(cuda_err("event record"))?;
    let ms = start.elapsed_ms(&end).map_err(cuda_err("event timing"))? as f64;
    Ok((COPY_BYTES * COPY_REPEATS) as f64 / (ms / 1e3) / 1e9)
}

/// Mean microseconds of one in-place sum all-reduce over `group`, at each message size (f32 elements;
/// NCCL has no bf16 type in cudarc without its f16 feature, and the cost is set by the bytes).
fn all_reduce_latency(
    contexts: &[Arc<CudaContext>],
    group: &[usize],
) -> Result<Vec<AllReduceMeasurement>, MeasureError> {
    let streams: Vec<Arc<CudaStream>> = group
        .iter()
        .map(|&g| contexts[g].new_stream().map_err(cuda_err(format!("stream on GPU{g}"))))
        .collect::<Result<_, _>>()?;
    let comms = Comm::from_devices(streams.clone()).map_err(nccl_err(format!("init over GPUs {group:?}")))?;
    let mut results = Vec::new();
    for bytes in ALL_REDUCE_BYTES {
        let mut buffers: Vec<CudaSlice<f32>> = streams
            .iter()
            .map(|s| s.alloc_zeros::<f32>(bytes / 4).map_err(cuda_err("all-reduce buffer")))
            .collect::<Result<_, _>>()?;
        let mut run = |repeats: usize| -> Result<std::time::Duration, MeasureError> {
            let started = std::time::Instant::now();
            for _ in 0..repeats {
                cudarc::nccl::result::group_start().map_err(nccl_err("group start"))?;
                for (comm, buffer) in comms.iter().zip(buffers.iter_mut()) {
                    comm.all_reduce_in_place(buffer, &ReduceOp::Sum)
                        .map_err(nccl_err("all-reduce"))?;
                }
                cudarc::nccl::result::group_end().map_err(nccl_err("group end"))?;
            }
            for stream in &streams {
                stream.synchronize().map_err(cuda_err("sync after all-reduce"))?;
            }
            Ok(started.elapsed())
        };
        run(5)?;
        let elapsed = run(ALL_REDUCE_REPEATS)?;
        results.push(AllReduceMeasurement {
            gpus: group.to_vec(),
            bytes: bytes as u64,
            latency_us: elapsed.as_secs_f64() * 1e6 / ALL_REDUCE_REPEATS as f64,
        });
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_consecutive_powers_of_two() {
        assert_eq!(all_reduce_groups(2), vec![vec![0, 1]]);
        assert_eq!(all_reduce_groups(4), vec![vec![0, 1], vec![2, 3], vec![0, 1, 2, 3]]);
        assert!(all_reduce_groups(1).is_empty());
    }
}
