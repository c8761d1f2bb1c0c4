//! NCCL communicators between the GPUs of one process: creating them together, the operations
//! strata uses (f32 sum all-reduce, f32 send/recv) on a GPU's stream, and abort for the watchdog.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::nccl::{result, sys};

use super::libraries::{self, LibrarySearch};
use super::{CudaError, DeviceBuffer, Gpu};

fn nccl(op: &'static str) -> impl FnOnce(result::NcclError) -> CudaError {
    move |e| CudaError::Nccl {
        op,
        err: format!("{:?}", e.0),
    }
}

/// Checks that libnccl can be loaded (cudarc would panic on first use without it).
pub fn check_nccl(search: &LibrarySearch) -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Missing(search.explain_missing(&[libraries::NCCL])))
    }
}

/// The identity every member of one communicator is created with.
#[derive(Clone, Copy)]
pub struct NcclId(sys::ncclUniqueId);

// SAFETY: a unique id is plain bytes.
unsafe impl Send for NcclId {}

impl NcclId {
    pub fn new() -> Result<NcclId, CudaError> {
        result::get_uniqueid().map(NcclId).map_err(nccl("ncclGetUniqueId"))
    }
}

/// One rank's member of a communicator, bound to one GPU.
pub struct Communicator {
    comm: sys::ncclComm_t,
    aborted: Arc<AtomicBool>,
    pub rank: usize,
    pub size: usize,
}

// SAFETY: a communicator is used from its worker thread; `CommAbort` may abort it from another,
// which NCCL allows (that is what ncclCommAbort is for).
unsafe impl Send for Communicator {}

/// Aborts a communicator from another thread (the watchdog), once.
#[derive(Clone)]
pub struct CommAbort {
    comm: usize,
    aborted: Arc<AtomicBool>,
}

impl CommAbort {
    /// Aborts the communicator: its pending operations end and later ones fail.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: the communicator was created by ncclCommInitRank and is destroyed only when
            // not aborted (see `Drop for Communicator`).
            let _ = unsafe { result::comm_abort(self.comm as sys::ncclComm_t) };
        }
    }
}

impl Communicator {
    /// Joins communicator `id` as `rank` of `size` on `gpu`. Blocks until every rank has joined,
    /// so each rank calls this from its own thread.
    pub fn init(gpu: &Gpu, id: NcclId, size: usize, rank: usize) -> Result<Communicator, CudaError> {
        gpu.bind()?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out pointer; the id was made by ncclGetUniqueId.
        unsafe { result::comm_init_rank(&mut comm, size as i32, id.0, rank as i32) }
            .map_err(nccl("ncclCommInitRank"))?;
        Ok(Communicator {
            comm,
            aborted: Arc::new(AtomicBool::new(false)),
            rank,
            size,
        })
    }

    /// A handle that aborts this communicator from any thread.
    pub fn abort_handle(&self) -> CommAbort {
        CommAbort {
            comm: self.comm as usize,
            aborted: Arc::clone(&self.aborted),
        }
    }

    fn live(&self, op: &'static str) -> Result<(), CudaError> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(CudaError::Nccl {
                op,
                err: "the communicator was aborted".into(),
            });
        }
        Ok(())
    }

    /// In-place sum of `count` f32 values at `buf` byte `offset` over all ranks, queued on `gpu`'s stream.
    pub fn all_reduce_sum_f32(&self, gpu: &Gpu, buf: &DeviceBuffer, count: usize) -> Result<(), CudaError> {
        self.live("ncclAllReduce")?;
        assert!(count * 4 <= buf.bytes(), "all-reduce past the end of a device buffer");
        let p = buf.ptr() as *mut std::ffi::c_void;
        // SAFETY: the buffer holds `count` f32 values (checked); the stream belongs to this GPU.
        unsafe {
            result::all_reduce(
                p,
                p,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                gpu.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(nccl("ncclAllReduce"))
    }

    /// Gathers `count` f32 values from `send` on every rank into `recv`, rank by rank
    /// (`recv[r * count..]` is rank r's), on `gpu`'s stream.
    pub fn all_gather_f32(
        &self,
        gpu: &Gpu,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        count: usize,
    ) -> Result<(), CudaError> {
        self.live("ncclAllGather")?;
        assert!(
            count * 4 <= send.bytes() && count * 4 * self.size <= recv.bytes(),
            "all-gather past the end of a device buffer"
        );
        // SAFETY: the buffers hold `count` and `size * count` f32 values (checked); the stream
        // belongs to this GPU.
        unsafe {
            result::all_gather(
                send.ptr() as *const std::ffi::c_void,
                recv.ptr() as *mut std::ffi::c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                self.comm,
                gpu.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(nccl("ncclAllGather"))
    }

    /// Sends `count` f32 values from `buf` to rank `peer`, queued on `gpu`'s stream.
    pub fn send_f32(&self, gpu: &Gpu, buf: &DeviceBuffer, count: usize, peer: usize) -> Result<(), CudaError> {
        self.point_to_point(gpu, buf, count, peer, true)
    }

    /// Receives `count` f32 values from rank `peer` into `buf`, queued on `gpu`'s stream.
    pub fn recv_f32(&self, gpu: &Gpu, buf: &DeviceBuffer, count: usize, peer: usize) -> Result<(), CudaError> {
        self.point_to_point(gpu, buf, count, peer, false)
    }

    fn point_to_point(
        &self,
        gpu: &Gpu,
        buf: &DeviceBuffer,
        count: usize,
        peer: usize,
        send: bool,
    ) -> Result<(), CudaError> {
        let op = if send { "ncclSend" } else { "ncclRecv" };
        self.live(op)?;
        assert!(count * 4 <= buf.bytes(), "{op} past the end of a device buffer");
        let (dtype, stream) = (
            sys::ncclDataType_t::ncclFloat32,
            gpu.stream.cu_stream() as sys::cudaStream_t,
        );
        let p = buf.ptr() as *mut std::ffi::c_void;
        // SAFETY: the buffer holds `count` f32 values (checked); the stream belongs to this GPU.
        unsafe {
            if send {
                result::send(p, count, dtype, peer as i32, self.comm, stream)
            } else {
                result::recv(p, count, dtype, peer as i32, self.comm, stream)
            }
        }
        .map(|_| ())
        .map_err(nccl(op))
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: created by ncclCommInitRank, released once (an aborted one is already freed).
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}
