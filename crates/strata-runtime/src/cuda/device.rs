//! One GPU: its context and the stream everything runs on, device buffers, kernel launches.
//! Raw device pointers keep kernels and CUDA-graph capture simple; all unsafe stays in this crate.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaStream};

use super::libraries::{self, LibrarySearch};
use super::{driver, CudaError};

/// What the GPU is.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub memory_total: usize,
    pub memory_free: usize,
    /// Streaming multiprocessors.
    pub multiprocessors: usize,
}

/// A GPU with its context and one stream.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: GpuInfo,
    /// Kernels launch with programmatic dependent launch (compute capability 9.0 and later;
    /// `STRATA_PDL=0` turns it off, `STRATA_PDL=late` delays each launch until the previous
    /// kernel has finished, for measurements): each may start while the one before it runs,
    /// and waits for it in its code (common.cuh's `wait_for_previous_kernel`). The
    /// model turns it off for shards that talk to other GPUs (not yet measured there).
    pub programmatic_launch: bool,
    /// Bytes of the device buffers of this context alive now.
    allocated: Arc<AtomicUsize>,
}

/// Checks that the libraries the CUDA backend needs can be loaded, before cudarc would panic on
/// a missing one.
pub fn check_libraries(search: &LibrarySearch) -> Result<(), CudaError> {
    // SAFETY: these only try to dlopen the library.
    let present = unsafe {
        [
            (libraries::DRIVER, cudarc::driver::sys::is_culib_present()),
            (libraries::NVRTC, cudarc::nvrtc::sys::is_culib_present()),
            (libraries::CUBLASLT, cudarc::cublaslt::sys::is_culib_present()),
        ]
    };
    let missing: Vec<_> = present.iter().filter(|(_, ok)| !ok).map(|(l, _)| *l).collect();
    if missing.is_empty() {
        Ok(())
    } else if missing.contains(&libraries::DRIVER) {
        Err(CudaError::NoDevice(
            "no NVIDIA driver (libcuda.so.1) on this machine; use --device cpu".into(),
        ))
    } else {
        Err(CudaError::Missing(search.explain_missing(&missing)))
    }
}

impl Gpu {
    /// Number of CUDA devices, or why there are none.
    pub fn count(search: &LibrarySearch) -> Result<usize, CudaError> {
        check_libraries(search)?;
        result::init().map_err(|e| CudaError::NoDevice(format!("the NVIDIA driver did not start: {e}")))?;
        let n = CudaContext::device_count().map_err(driver("cuDeviceGetCount"))?;
        Ok(n.max(0) as usize)
    }

    /// Opens GPU `ordinal` with a stream of its own.
    pub fn open(ordinal: usize, search: &LibrarySearch) -> Result<Gpu, CudaError> {
        let n = Gpu::count(search)?;
        if ordinal >= n {
            return Err(CudaError::NoDevice(format!("GPU {ordinal} asked for, {n} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("cuCtxCreate"))?;
        // One stream per GPU: cudarc's cross-stream event tracking only costs time here.
        // SAFETY: no buffers exist yet on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let (memory_free, memory_total) = ctx.mem_get_info().map_err(driver("cuMemGetInfo"))?;
        let info = GpuInfo {
            ordinal,
            name: ctx.name().map_err(driver("cuDeviceGetName"))?,
            compute_capability: capped_capability(ctx.compute_capability().map_err(driver("cuDeviceGetAttribute"))?)?,
            memory_total,
            memory_free,
            multiprocessors: ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(driver("cuDeviceGetAttribute"))?
                .max(1) as usize,
        };
        let programmatic_launch =
            info.compute_capability.0 >= 9 && std::env::var("STRATA_PDL").map_or(true, |v| v != "0");
        Ok(Gpu {
            ctx,
            stream,
            info,
            programmatic_launch,
            allocated: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))
    }

    /// Free and total device memory now.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().map_err(driver("cuMemGetInfo"))
    }

    /// Bytes of this GPU's device buffers alive now: what strata itself holds, against which a
    /// fall in free memory also shows what others (libraries, other processes) took.
    pub fn allocated_bytes(&self) -> usize {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Allocates `bytes` of device memory for `what` (named in the error when it runs out).
    pub fn alloc(&self, bytes: usize, what: &str) -> Result<DeviceBuffer, CudaError> {
        self.bind()?;
        // SAFETY: plain allocation, freed on drop.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| CudaError::OutOfMemory {
            what: what.to_string(),
            bytes,
            err: e.to_string(),
        })?;
        self.allocated.fetch_add(bytes, Ordering::Relaxed);
        Ok(DeviceBuffer {
            ptr,
            bytes,
            ctx: Arc::clone(&self.ctx),
            allocated: Arc::clone(&self.allocated),
        })
    }

    /// Allocates and fills with `data`.
    pub fn upload<T: Copy>(&self, data: &[T], what: &str) -> Result<DeviceBuffer, CudaError> {
        let buf = self.alloc(std::mem::size_of_val(data), what)?;
        self.write(&buf, 0, data)?;
        Ok(buf)
    }

    /// Copies `data` into `buf` at byte `offset`, synchronously.
    pub fn write<T: Copy>(&self, buf: &DeviceBuffer, offset: usize, data: &[T]) -> Result<(), CudaError> {
        let n = std::mem::size_of_val(data);
        assert!(offset + n <= buf.bytes, "write past the end of a device buffer");
        if n == 0 {
            return Ok(());
        }
        // SAFETY: bounds checked above; the copy completes before returning.
        unsafe {
            result::memcpy_htod_async(buf.ptr + offset as u64, data, self.stream.cu_stream())
                .map_err(driver("cuMemcpyHtoD"))?;
        }
        self.sync()
    }

    /// Copies `buf[offset..]` into `out`, synchronously.
    pub fn read<T: Copy>(&self, buf: &DeviceBuffer, offset: usize, out: &mut [T]) -> Result<(), CudaError> {
        let n = std::mem::size_of_val(out);
        assert!(offset + n <= buf.bytes, "read past the end of a device buffer");
        if n == 0 {
            return Ok(());
        }
        // SAFETY: bounds checked above; the stream is synchronised before `out` is used.
        unsafe {
            result::memcpy_dtoh_async(out, buf.ptr + offset as u64, self.stream.cu_stream())
                .map_err(driver("cuMemcpyDtoH"))?;
        }
        self.sync()
    }

    /// Page-locked host memory for `len` values of `T`, zeroed: what the stream copies to and
    /// from without waiting ([`Self::write_async`], [`Self::read_async`]).
    pub fn alloc_pinned<T: Copy + Default>(&self, len: usize, what: &str) -> Result<PinnedBuffer<T>, CudaError> {
        self.bind()?;
        let bytes = (len * std::mem::size_of::<T>()).max(1);
        // SAFETY: plain allocation, filled below before any read, freed on drop.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.map_err(|e| CudaError::OutOfMemory {
            what: format!("{what} (pinned host memory)"),
            bytes,
            err: e.to_string(),
        })? as *mut T;
        // SAFETY: `ptr` holds `len` values of T.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }.fill(T::default());
        Ok(PinnedBuffer {
            ptr,
            len,
            ctx: Arc::clone(&self.ctx),
        })
    }

    /// Queues a copy of `src[..n]` into `buf` at byte `offset` behind the stream's work and
    /// returns at once.
    ///
    /// # Safety
    /// `src[..n]` must stay unchanged, and `src` alive, until the stream has done the copy (an
    /// event marked after this call has completed).
    pub unsafe fn write_async<T: Copy>(
        &self,
        buf: &DeviceBuffer,
        offset: usize,
        src: &PinnedBuffer<T>,
        n: usize,
    ) -> Result<(), CudaError> {
        assert!(
            offset + n * std::mem::size_of::<T>() <= buf.bytes,
            "write past the end of a device buffer"
        );
        if n == 0 {
            return Ok(());
        }
        result::memcpy_htod_async(buf.ptr + offset as u64, &src[..n], self.stream.cu_stream())
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// Queues a copy of `buf[offset..]` into `dst[..n]` behind the stream's work and returns at
    /// once.
    ///
    /// # Safety
    /// `dst` must stay alive and unread until the stream has done the copy (an event marked
    /// after this call has completed).
    pub unsafe fn read_async<T: Copy>(
        &self,
        buf: &DeviceBuffer,
        offset: usize,
        dst: &mut PinnedBuffer<T>,
        n: usize,
    ) -> Result<(), CudaError> {
        assert!(
            offset + n * std::mem::size_of::<T>() <= buf.bytes,
            "read past the end of a device buffer"
        );
        if n == 0 {
            return Ok(());
        }
        result::memcpy_dtoh_async(&mut dst[..n], buf.ptr + offset as u64, self.stream.cu_stream())
            .map_err(driver("cuMemcpyDtoHAsync"))
    }

    /// Sets `bytes` bytes of `buf` from `offset` to zero, asynchronously on the stream.
    pub fn zero(&self, buf: &DeviceBuffer, offset: usize, bytes: usize) -> Result<(), CudaError> {
        assert!(offset + bytes <= buf.bytes, "memset past the end of a device buffer");
        // SAFETY: bounds checked above.
        unsafe { result::memset_d8_async(buf.ptr + offset as u64, 0, bytes, self.stream.cu_stream()) }
            .map_err(driver("cuMemsetD8"))
    }

    /// Waits for all work queued on the stream.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver("cuStreamSynchronize"))
    }

    /// Launches `f` on the stream. `args` are pointers to each kernel argument, in order.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every
    /// pointer argument must be valid for what the kernel touches.
    pub unsafe fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        if !self.programmatic_launch {
            return result::launch_kernel(
                f.cu_function(),
                grid,
                (block, 1, 1),
                shared,
                self.stream.cu_stream(),
                args,
            )
            .map_err(driver("cuLaunchKernel"));
        }
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: an all-zero attribute value is valid; the field set is the one `id` names.
            value: std::mem::zeroed(),
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        sys::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut())
            .result()
            .map_err(driver("cuLaunchKernelEx"))
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read plus bytes written), best of `reps`
    /// copies of `bytes` bytes: the memory roofline strata's benchmarks report against.
    pub fn copy_bandwidth_gb_s(&self, bytes: usize, reps: usize) -> Result<f64, CudaError> {
        let src = self.alloc(bytes, "the bandwidth probe")?;
        let dst = self.alloc(bytes, "the bandwidth probe")?;
        let mut best = 0.0f64;
        for _ in 0..reps.max(2) {
            self.sync()?;
            let t = std::time::Instant::now();
            // SAFETY: both buffers hold `bytes` bytes.
            unsafe { result::memcpy_dtod_async(dst.ptr, src.ptr, bytes, self.stream.cu_stream()) }
                .map_err(driver("cuMemcpyDtoD"))?;
            self.sync()?;
            best = best.max(2.0 * bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        Ok(best)
    }

    /// Marks the point the stream has reached, for timing.
    pub fn record_event(&self) -> Result<Event, CudaError> {
        self.stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map(Event)
            .map_err(driver("cuEventRecord"))
    }

    /// Marks the point the stream has reached, to wait for it ([`Event::synchronize`]).
    pub fn mark(&self) -> Result<Event, CudaError> {
        self.stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map(Event)
            .map_err(driver("cuEventRecord"))
    }

    /// Starts recording the stream's work into a graph instead of running it.
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("cuStreamBeginCapture"))
    }

    /// Ends a capture and instantiates the graph.
    pub fn end_capture(&self) -> Result<Graph, CudaError> {
        self.stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver("cuStreamEndCapture"))?
            .map(Graph)
            .ok_or_else(|| CudaError::Driver {
                op: "cuStreamEndCapture",
                err: "empty graph".into(),
            })
    }
}

/// A timing mark in a GPU's stream.
pub struct Event(CudaEvent);

impl Event {
    /// GPU milliseconds from `self` to `end` (waits for both).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32, CudaError> {
        self.0.elapsed_ms(&end.0).map_err(driver("cuEventElapsedTime"))
    }

    /// Waits until the stream has passed this mark.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.0.synchronize().map_err(driver("cuEventSynchronize"))
    }
}

/// Page-locked host memory ([`Gpu::alloc_pinned`]), freed on drop; reads and writes like a slice.
pub struct PinnedBuffer<T: Copy> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the memory is owned by this value alone; the context is thread-safe.
unsafe impl<T: Copy + Send> Send for PinnedBuffer<T> {}

impl<T: Copy> std::ops::Deref for PinnedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised values for as long as self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: Copy> std::ops::DerefMut for PinnedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in deref, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host in alloc_pinned, freed once.
            let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
        }
    }
}

/// A captured, instantiated CUDA graph that replays on the stream it was captured on.
pub struct Graph(CudaGraph);

// SAFETY: graph handles may be used from any thread; the owner launches from one at a time.
unsafe impl Send for Graph {}

impl Graph {
    /// Replays the graph.
    pub fn launch(&self) -> Result<(), CudaError> {
        self.0.launch().map_err(driver("cuGraphLaunch"))
    }
}

/// Device memory, freed on drop.
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
    /// Its GPU's count of live buffer bytes ([`Gpu::allocated_bytes`]).
    allocated: Arc<AtomicUsize>,
}

// SAFETY: a device pointer is plain data; the context is thread-safe.
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// The device address of byte `offset`.
    pub fn at(&self, offset: usize) -> CUdeviceptr {
        debug_assert!(offset <= self.bytes);
        self.ptr + offset as u64
    }

    /// The device address of the start.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({} bytes)", self.bytes)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync on this context, freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
        self.allocated.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Builds the argument pointer list of a kernel launch from local variables.
#[macro_export]
macro_rules! kernel_args {
    ($($a:expr),* $(,)?) => {
        [$(&$a as *const _ as *mut ::std::ffi::c_void),*]
    };
}

/// `cc`, or less under `STRATA_GPU_CAPABILITY=8.0` (or 8.6, 8.9): kernels are then compiled for
/// that architecture and every capability check takes its fallback (no fp8 conversions below 8.9,
/// no programmatic dependent launch below 9.0), to run an Ampere card's paths on a newer GPU.
fn capped_capability(cc: (i32, i32)) -> Result<(i32, i32), CudaError> {
    let Ok(v) = std::env::var("STRATA_GPU_CAPABILITY") else {
        return Ok(cc);
    };
    let parsed = v
        .split_once('.')
        .and_then(|(a, b)| Some((a.trim().parse::<i32>().ok()?, b.trim().parse::<i32>().ok()?)));
    match parsed {
        Some(cap) if cap >= (7, 5) => Ok(cap.min(cc)),
        _ => Err(CudaError::NoDevice(format!(
            "STRATA_GPU_CAPABILITY={v:?} is not a compute capability like 8.0 or 8.6 (7.5 at least)"
        ))),
    }
}
