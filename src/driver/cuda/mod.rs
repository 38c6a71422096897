//! The device seam over the CUDA driver API (`cudarc::driver::result` and `sys`), with the
//! vendor libraries (`libs`) and NCCL (`nccl`) beside it.
//!
//! This and its children are the only modules that call the driver, a vendor library or NCCL. The library is
//! loaded at run time, so the crate builds and its simulated tests run on machines without CUDA;
//! [`CudaDriver::open`] probes for the library first, because cudarc panics when a dynamically
//! loaded library is missing.

mod graph;
mod launch;
mod libs;
mod nccl;
mod notify;
mod share;

pub(crate) use nccl::nccl_version;

#[cfg(test)]
pub(crate) use launch::{compile_check, nvrtc_present};

use super::{ContextHandle, DevicePtr, Driver, EventHandle, Lane, MemoryReport, Waits, Wake};
use crate::device::{DeviceId, DeviceKind};
use crate::error::{DriverError, Error, SetupError};
use cudarc::driver::{result, sys};
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;

/// One CUDA device's primary context, three non-blocking streams (compute, upload, download:
/// the engine's [`Lane`]s) and a memory pool of its own, and the side streams on which the device
/// calls the host back.
pub(crate) struct CudaDriver {
    device: sys::CUdevice,
    id: DeviceId,
    name: String,
    ctx: sys::CUcontext,
    /// The lanes' streams, by [`Lane::index`].
    streams: Streams,
    pool: sys::CUmemoryPool,
    /// The devices (ordinals) the pool lets read and write its memory, besides this one.
    granted: Vec<usize>,
    waits: Arc<CudaWaits>,
    /// Where [`Driver::notify_after`] queues its waits and callbacks; made on first use.
    side: notify::SideStreams,
    /// The library handles and contraction plans, made on first use.
    libs: libs::LibraryHandles,
    /// The device's UUID, which names it to other processes.
    uuid: [u8; 16],
    /// Whether the pool was made exportable (the device supports POSIX descriptors for pools).
    exportable: bool,
    /// The pool's exported descriptor, once exported; closed when the driver is dropped.
    pool_fd: Option<std::os::fd::OwnedFd>,
    /// Pools imported from other processes, destroyed when the driver is dropped.
    imported_pools: Vec<sys::CUmemoryPool>,
}

// SAFETY: the handles are plain driver handles that the CUDA driver API accepts from any thread
// once the owning context is current; the engine makes its context current around every call
// (see `engine::Shared::enter`) and serialises calls through a mutex.
unsafe impl Send for CudaDriver {}

/// Whether the CUDA driver library can be loaded on this machine.
pub(crate) fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only attempts to `dlopen` candidate library names; it does not
    // call into the library.
    unsafe { sys::is_culib_present() }
}

/// Number of CUDA devices, after making sure the driver is present and initialised.
pub(crate) fn device_count() -> Result<usize, Error> {
    if !driver_present() {
        return Err(Error::Setup(SetupError::NoDriver {
            detail: format!(
                "none of {:?} could be loaded",
                cudarc::get_lib_name_candidates("cuda")
            ),
        }));
    }
    result::init().map_err(|e| Error::Driver {
        call: "cuInit",
        source: DriverError::from_raw(e.0),
    })?;
    let count = result::device::get_count().map_err(|e| Error::Driver {
        call: "cuDeviceGetCount",
        source: DriverError::from_raw(e.0),
    })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The one place a cudarc `CUresult` becomes the crate's own [`DriverError`]; crate-private, so
/// no cudarc type reaches the public error API.
impl DriverError {
    /// Converts a raw driver result. `CUDA_SUCCESS` is mapped to `CUDA_ERROR_UNKNOWN`, since
    /// success is not an error.
    pub(crate) fn from_raw(code: sys::CUresult) -> Self {
        // `CUresult` is a `#[repr(u32)]` enum whose discriminants are the CUDA result codes.
        Self::from_code(code as u32)
    }

    /// Converts a raw driver result: `Ok(())` for success.
    pub(crate) fn check(code: sys::CUresult) -> Result<(), Self> {
        if code == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(Self::from_raw(code))
        }
    }
}

fn check(call: &'static str, code: sys::CUresult) -> Result<(), Error> {
    DriverError::check(code).map_err(Error::driver(call))
}

impl CudaDriver {
    /// Opens device `ordinal`: retains its primary context, creates a non-blocking stream and a
    /// device memory pool that keeps freed memory for reuse.
    pub(crate) fn open(ordinal: usize) -> Result<Self, Error> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::Setup(SetupError::NoSuchDevice { ordinal, count }));
        }
        let raw_ordinal = i32::try_from(ordinal)
            .map_err(|_| Error::Setup(SetupError::NoSuchDevice { ordinal, count }))?;
        let device = result::device::get(raw_ordinal).map_err(|e| Error::Driver {
            call: "cuDeviceGet",
            source: DriverError::from_raw(e.0),
        })?;
        let name = result::device::get_name(device).unwrap_or_else(|_| "unknown".into());
        let uuid = share::uuid_of(device).map_err(Error::driver("cuDeviceGetUuid"))?;
        // A pool exported as a POSIX descriptor lets another process map its blocks
        // (`routes::share`); where the device cannot, the pool is made without it.
        let exportable = cfg!(target_os = "linux")
            // SAFETY: `device` came from `cuDeviceGet`; the attribute is an integer.
            && unsafe {
                result::device::get_attribute(
                    device,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                )
            }
            .is_ok_and(|supported| supported != 0);

        let mut ctx = MaybeUninit::uninit();
        // SAFETY: `device` came from `cuDeviceGet`; the out pointer is valid for one write.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(ctx.as_mut_ptr(), device)
        })?;
        // SAFETY: written by the successful call above.
        let ctx = unsafe { ctx.assume_init() };

        let mut this = CudaDriver {
            device,
            id: DeviceId {
                kind: DeviceKind::Cuda,
                ordinal,
                instance: 0,
            },
            name,
            ctx,
            streams: [std::ptr::null_mut(); 3],
            pool: std::ptr::null_mut(),
            granted: Vec::new(),
            side: notify::SideStreams::default(),
            libs: libs::LibraryHandles::default(),
            uuid,
            exportable,
            pool_fd: None,
            imported_pools: Vec::new(),
            waits: Arc::new(CudaWaits {
                ctx,
                streams: [std::ptr::null_mut(); 3],
                pool: std::ptr::null_mut(),
            }),
        };
        // From here on, `Drop` releases what was made if a later step fails.
        let previous = current_raw().map_err(Error::driver("cuCtxGetCurrent"))?;
        // SAFETY: `ctx` is the retained primary context.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })?;
        let made = this.make_stream_and_pool();
        // SAFETY: `previous` was current on this thread a moment ago (or null, which unbinds).
        let restored = check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(previous) });
        made?;
        restored?;
        this.waits = Arc::new(CudaWaits {
            ctx,
            streams: this.streams,
            pool: this.pool,
        });
        Ok(this)
    }

    fn make_stream_and_pool(&mut self) -> Result<(), Error> {
        for stream in &mut self.streams {
            *stream =
                result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| {
                    Error::Driver {
                        call: "cuStreamCreate",
                        source: DriverError::from_raw(e.0),
                    }
                })?;
        }
        // SAFETY: an all-zero `CUmemPoolProps` is its documented default (reserved bytes zero);
        // the fields that matter are set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = if self.exportable {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = self.device;
        let mut pool = MaybeUninit::uninit();
        // SAFETY: `props` is a fully initialised pool description; out pointer valid.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(pool.as_mut_ptr(), &props)
        })?;
        // SAFETY: written by the successful call above.
        self.pool = unsafe { pool.assume_init() };
        // Keep freed memory in the pool instead of returning it to the OS at every synchronize:
        // a stream-ordered allocator is only fast while it reuses.
        let mut threshold: u64 = u64::MAX;
        // SAFETY: the attribute takes a `cuuint64_t`, which `threshold` is.
        check("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                self.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast::<c_void>(),
            )
        })
    }
}

fn current_raw() -> Result<sys::CUcontext, DriverError> {
    let mut ctx = MaybeUninit::uninit();
    // SAFETY: out pointer valid for one write.
    DriverError::check(unsafe { sys::cuCtxGetCurrent(ctx.as_mut_ptr()) })?;
    // SAFETY: written by the successful call above.
    Ok(unsafe { ctx.assume_init() })
}

/// `bytes` rounded up to whole 16-byte vectors: library kernels read a buffer's tail with vector
/// loads (NCCL's all-reduce reads 4 bytes of a 1-byte buffer), so every allocation covers the
/// vectors its last byte lies in. The pool hands out 256-byte aligned blocks anyway, so this
/// costs no memory, and it makes those reads lie inside the allocation for memory checkers too.
fn whole_vectors(bytes: usize) -> Result<usize, DriverError> {
    bytes
        .checked_next_multiple_of(16)
        .ok_or(DriverError::OUT_OF_MEMORY)
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        // Errors are ignored: drop never reports. The engine has already synchronised the stream
        // on its successful teardown path; the driver releases the stream and pool lazily if work
        // is still pending (as cuStreamDestroy and cuMemPoolDestroy document).
        let previous = current_raw().unwrap_or(std::ptr::null_mut());
        // SAFETY: `ctx` is retained until the release below.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx);
        }
        // The side streams wait only for events of the engine's lanes, which are idle by now:
        // their pending callbacks run at once, before the context can go away.
        self.side.release();
        for &stream in &self.streams {
            if !stream.is_null() {
                // SAFETY: the stream was created by this driver and is destroyed once.
                unsafe {
                    sys::cuStreamDestroy_v2(stream);
                }
            }
        }
        if !self.pool.is_null() {
            // SAFETY: the pool was created by this driver and is destroyed once.
            unsafe {
                sys::cuMemPoolDestroy(self.pool);
            }
        }
        for &pool in &self.imported_pools {
            // SAFETY: imported by this driver and destroyed once; the engine released every
            // import of it before its teardown dropped the driver (a pool keeps what is still
            // mapped until it is freed, as `cuMemPoolDestroy` documents).
            unsafe {
                sys::cuMemPoolDestroy(pool);
            }
        }
        // The pool's exported descriptor, if any, closes as `pool_fd` drops.
        // SAFETY: restores whatever was current before (null unbinds), then releases the one
        // primary-context reference this driver retained.
        unsafe {
            sys::cuCtxSetCurrent(if previous == self.ctx {
                std::ptr::null_mut()
            } else {
                previous
            });
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

impl Driver for CudaDriver {
    fn device(&self) -> DeviceId {
        self.id
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn context(&self) -> ContextHandle {
        ContextHandle(self.ctx as u64)
    }

    fn stream_handle(&self) -> u64 {
        self.streams[Lane::Compute.index()] as u64
    }

    fn current_context(&self) -> Result<ContextHandle, DriverError> {
        current_raw().map(|c| ContextHandle(c as u64))
    }

    fn set_current_context(&self, ctx: ContextHandle) -> Result<(), DriverError> {
        // SAFETY: the handle is either null (unbinds), this driver's retained context, or one the
        // caller observed current on this thread.
        DriverError::check(unsafe { sys::cuCtxSetCurrent(ctx.0 as sys::CUcontext) })
    }

    fn alloc(&mut self, lane: Lane, bytes: usize) -> Result<DevicePtr, DriverError> {
        // The pool reuses memory freed on another lane only after the free has completed, by
        // its default reuse policy (it inserts the dependency itself).
        self.alloc_from(lane, self.pool(), bytes)
    }

    fn pool(&self) -> u64 {
        self.pool as u64
    }

    fn trim_pool(&mut self, keep: usize) -> Result<(), DriverError> {
        // SAFETY: the pool is this driver's, live while it is; trimming never releases memory
        // that backs an allocation or a free still pending (as `cuMemPoolTrimTo` documents).
        DriverError::check(unsafe { sys::cuMemPoolTrimTo(self.pool, keep) })
    }

    fn alloc_from(
        &mut self,
        lane: Lane,
        pool: u64,
        bytes: usize,
    ) -> Result<DevicePtr, DriverError> {
        let bytes = whole_vectors(bytes)?;
        let mut ptr = MaybeUninit::uninit();
        // SAFETY: `pool` is a live driver's pool (this one's, or another's: the caller's contract
        // on `pool()`'s value) and the stream is this driver's, whose context the engine made
        // current.
        DriverError::check(unsafe {
            sys::cuMemAllocFromPoolAsync(
                ptr.as_mut_ptr(),
                bytes,
                pool as sys::CUmemoryPool,
                self.lane(lane),
            )
        })?;
        // SAFETY: written by the successful call above.
        Ok(unsafe { ptr.assume_init() })
    }

    unsafe fn free(&mut self, lane: Lane, ptr: DevicePtr) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees `ptr` is a live allocation of this driver, ordered
        // before this free on `lane` with every use of it.
        DriverError::check(unsafe { sys::cuMemFreeAsync(ptr, self.lane(lane)) })
    }

    unsafe fn copy_htod(
        &mut self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees both ranges stay valid until the copy completes.
        DriverError::check(unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), bytes, self.lane(Lane::Upload))
        })
    }

    unsafe fn copy_dtoh(
        &mut self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees both ranges stay valid until the copy completes.
        DriverError::check(unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, bytes, self.lane(Lane::Download))
        })
    }

    unsafe fn copy_dtod(
        &mut self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees both ranges are live and disjoint.
        DriverError::check(unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.lane(Lane::Compute))
        })
    }

    fn event_create(&mut self) -> Result<EventHandle, DriverError> {
        let mut ev = MaybeUninit::uninit();
        // SAFETY: out pointer valid; the flag disables timing, which makes record and query cheaper.
        DriverError::check(unsafe {
            sys::cuEventCreate(
                ev.as_mut_ptr(),
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        })?;
        // SAFETY: written by the successful call above.
        Ok(EventHandle(unsafe { ev.assume_init() } as u64))
    }

    fn event_record(&mut self, lane: Lane, event: EventHandle) -> Result<(), DriverError> {
        // SAFETY: handles of this driver only reach here (`EventHandle` is crate-private and
        // minted by `event_create`); the event is live until `event_destroy`.
        DriverError::check(unsafe { sys::cuEventRecord(event.0 as sys::CUevent, self.lane(lane)) })
    }

    fn stream_wait(&mut self, lane: Lane, event: EventHandle) -> Result<(), DriverError> {
        // SAFETY: the stream belongs to this driver and the event is live (the caller holds it,
        // this driver's or another's: CUDA waits on events of other contexts and devices); CUDA
        // captures the event's last record at this call, so a later record does not change the
        // wait.
        DriverError::check(unsafe {
            sys::cuStreamWaitEvent(self.lane(lane), event.0 as sys::CUevent, 0)
        })
    }

    #[cfg(feature = "dlpack")]
    fn allocation_of(&self, ptr: DevicePtr) -> Result<crate::driver::Allocation, DriverError> {
        use sys::CUpointer_attribute as A;
        let mut base: sys::CUdeviceptr = 0;
        let mut bytes: usize = 0;
        let mut ordinal: std::os::raw::c_int = -1;
        for (attribute, out) in [
            (
                A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                (&raw mut base).cast::<std::ffi::c_void>(),
            ),
            (
                A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                (&raw mut bytes).cast::<std::ffi::c_void>(),
            ),
            (
                A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                (&raw mut ordinal).cast::<std::ffi::c_void>(),
            ),
        ] {
            // SAFETY: each attribute writes one value of the type its output was declared with
            // above (`CUdeviceptr`, `size_t`, `int`, as the driver API documents); an address the
            // driver does not know is an error, not undefined behaviour.
            DriverError::check(unsafe { sys::cuPointerGetAttribute(out, attribute, ptr) })?;
        }
        Ok(crate::driver::Allocation {
            base,
            bytes: bytes as u64,
            ordinal: usize::try_from(ordinal).map_err(|_| DriverError::INVALID_VALUE)?,
        })
    }

    unsafe fn foreign_record(
        &mut self,
        stream: u64,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        // SAFETY: the event is this driver's and live; the caller guarantees `stream` is the
        // legacy or per-thread default stream (whose handle values CUDA defines) or a live
        // stream of this context.
        DriverError::check(unsafe {
            sys::cuEventRecord(event.0 as sys::CUevent, stream as sys::CUstream)
        })
    }

    unsafe fn foreign_wait(&mut self, stream: u64, event: EventHandle) -> Result<(), DriverError> {
        // SAFETY: as `foreign_record`; CUDA captures the event's last record at this call.
        DriverError::check(unsafe {
            sys::cuStreamWaitEvent(stream as sys::CUstream, event.0 as sys::CUevent, 0)
        })
    }

    fn can_access_peer(&self, peer: DeviceId) -> Result<bool, DriverError> {
        if peer == self.id {
            return Ok(true);
        }
        let ordinal = i32::try_from(peer.ordinal).map_err(|_| DriverError::INVALID_VALUE)?;
        let mut device = MaybeUninit::uninit();
        let mut can = 0;
        // SAFETY: out pointers valid; `ordinal` is checked by the driver.
        unsafe {
            DriverError::check(sys::cuDeviceGet(device.as_mut_ptr(), ordinal))?;
            DriverError::check(sys::cuDeviceCanAccessPeer(
                &mut can,
                self.device,
                device.assume_init(),
            ))?;
        }
        Ok(can != 0)
    }

    fn enable_peer_access(&mut self, peer: ContextHandle) -> Result<(), DriverError> {
        /// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`.
        const ALREADY_ENABLED: u32 = 704;
        // SAFETY: this driver's context is current (the engine enters it around every call) and
        // `peer` is another live primary context.
        match DriverError::check(unsafe { sys::cuCtxEnablePeerAccess(peer.0 as sys::CUcontext, 0) })
        {
            Err(e) if e.code() == ALREADY_ENABLED => Ok(()),
            other => other,
        }
    }

    fn grant_peer_access(&mut self, peer: DeviceId) -> Result<(), DriverError> {
        if peer == self.id || self.granted.contains(&peer.ordinal) {
            return Ok(());
        }
        let id = i32::try_from(peer.ordinal).map_err(|_| DriverError::INVALID_VALUE)?;
        // SAFETY: an all-zero descriptor is a valid start; every field is set below.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = id;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the pool belongs to this driver; one descriptor, valid for the call.
        DriverError::check(unsafe { sys::cuMemPoolSetAccess(self.pool, &desc, 1) })?;
        self.granted.push(peer.ordinal);
        Ok(())
    }

    unsafe fn copy_peer(
        &mut self,
        lane: Lane,
        dst: DevicePtr,
        dst_ctx: ContextHandle,
        src: DevicePtr,
        src_ctx: ContextHandle,
        bytes: usize,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees both ranges are live until the copy completes and
        // disjoint; both contexts are live primary contexts.
        DriverError::check(unsafe {
            sys::cuMemcpyPeerAsync(
                dst,
                dst_ctx.0 as sys::CUcontext,
                src,
                src_ctx.0 as sys::CUcontext,
                bytes,
                self.lane(lane),
            )
        })
    }

    unsafe fn event_destroy(&mut self, event: EventHandle) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the event is live and not used again.
        DriverError::check(unsafe { sys::cuEventDestroy_v2(event.0 as sys::CUevent) })
    }

    fn notify_after(&mut self, event: EventHandle, wake: Wake) -> Result<(), DriverError> {
        self.side.notify_after(event, wake)
    }

    fn host_alloc(&mut self, bytes: usize) -> Result<*mut u8, DriverError> {
        let mut ptr = MaybeUninit::uninit();
        // SAFETY: out pointer valid. PORTABLE makes the memory pinned for every context, so a
        // buffer stays usable whichever context is current when it is used.
        DriverError::check(unsafe {
            sys::cuMemHostAlloc(
                ptr.as_mut_ptr(),
                bytes.max(1),
                sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        })?;
        // SAFETY: written by the successful call above.
        Ok(unsafe { ptr.assume_init() }.cast::<u8>())
    }

    unsafe fn host_free(&mut self, ptr: *mut u8) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees `ptr` came from `host_alloc` and is idle.
        DriverError::check(unsafe { sys::cuMemFreeHost(ptr.cast::<c_void>()) })
    }

    fn host_register(&mut self, ptr: *mut u8, bytes: usize) -> Result<(), DriverError> {
        // SAFETY: registration locks the pages of `ptr..ptr+bytes` and does not read or write
        // them; a range that is not mapped memory of this process is refused with an error.
        // Flags 0: the range is page-locked for this driver's context, which the engine makes
        // current around every copy that uses it.
        DriverError::check(unsafe { sys::cuMemHostRegister_v2(ptr.cast::<c_void>(), bytes, 0) })
    }

    unsafe fn host_unregister(&mut self, ptr: *mut u8) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees `ptr` starts a range registered by `host_register` and
        // that no queued copy still touches it.
        DriverError::check(unsafe { sys::cuMemHostUnregister(ptr.cast::<c_void>()) })
    }

    fn waits(&self) -> Arc<dyn Waits> {
        Arc::clone(&self.waits) as Arc<dyn Waits>
    }
}

/// A driver's three streams, by [`Lane::index`].
type Streams = [sys::CUstream; 3];

impl CudaDriver {
    /// The stream of `lane`.
    fn lane(&self, lane: Lane) -> sys::CUstream {
        self.streams[lane.index()]
    }
}

/// The waiting half of a [`CudaDriver`]: its context and streams, for waits made from any thread
/// without the engine's lock.
pub(crate) struct CudaWaits {
    ctx: sys::CUcontext,
    streams: Streams,
    /// The driver's memory pool, for its figures.
    pool: sys::CUmemoryPool,
}

// SAFETY: CUDA driver handles may be used from any thread; every call below makes the context
// current on the calling thread for its duration. The stream and context outlive this value:
// the driver that owns them is dropped only after the engine's shared state, which holds the
// only other reference, is gone (see `engine::Shared`).
unsafe impl Send for CudaWaits {}
// SAFETY: as above; the calls are thread-safe driver calls that take no `&mut` state.
unsafe impl Sync for CudaWaits {}

impl CudaWaits {
    /// Runs `f` with the driver's context current, restoring the caller's afterwards.
    fn in_context<R>(&self, f: impl FnOnce() -> Result<R, DriverError>) -> Result<R, DriverError> {
        let previous = current_raw()?;
        if previous == self.ctx {
            return f();
        }
        // SAFETY: `ctx` is the driver's retained primary context.
        DriverError::check(unsafe { sys::cuCtxSetCurrent(self.ctx) })?;
        let result = f();
        // SAFETY: `previous` was current on this thread a moment ago (or null, which unbinds).
        let restored = DriverError::check(unsafe { sys::cuCtxSetCurrent(previous) });
        let value = result?;
        restored.map(|()| value)
    }
}

/// A query's answer: success is done, `NOT_READY` is not yet, anything else a failure.
fn ready(code: sys::CUresult) -> Result<bool, DriverError> {
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(DriverError::from_raw(other)),
    }
}

impl Waits for CudaWaits {
    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        // SAFETY: the event was created by this driver and is live while a caller holds it.
        self.in_context(|| ready(unsafe { sys::cuEventQuery(event.0 as sys::CUevent) }))
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        self.in_context(|| {
            // SAFETY: as in `event_query`.
            DriverError::check(unsafe { sys::cuEventSynchronize(event.0 as sys::CUevent) })
        })
    }

    #[cfg(feature = "dlpack")]
    fn context_synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: `in_context` makes the driver's context current for the call.
        self.in_context(|| DriverError::check(unsafe { sys::cuCtxSynchronize() }))
    }

    fn stream_synchronize(&self) -> Result<(), DriverError> {
        self.in_context(|| {
            // Every lane is waited for even when one reports a failure; the first is reported.
            let mut outcome = Ok(());
            for &stream in &self.streams {
                // SAFETY: the streams are live for the driver's lifetime.
                let waited = DriverError::check(unsafe { sys::cuStreamSynchronize(stream) });
                outcome = outcome.and(waited);
            }
            outcome
        })
    }

    fn lane_synchronize(&self, lane: Lane) -> Result<(), DriverError> {
        let stream = self.streams[lane.index()];
        self.in_context(|| {
            // SAFETY: the stream is live for the driver's lifetime.
            DriverError::check(unsafe { sys::cuStreamSynchronize(stream) })
        })
    }

    fn memory_report(&self) -> Result<MemoryReport, DriverError> {
        let (mut free, mut total) = (0usize, 0usize);
        self.in_context(|| {
            // SAFETY: two out pointers valid for one write each; `in_context` makes the
            // driver's context current for the call.
            let code = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
            DriverError::check(code)
        })?;
        let (reserved, used) = self.pool_usage()?;
        Ok(MemoryReport {
            free: free as u64,
            total: total as u64,
            reserved,
            used,
            // CUDA has no query for it: free memory may be split, and other pools may grow.
            largest: None,
        })
    }

    fn pool_usage(&self) -> Result<(u64, u64), DriverError> {
        let attribute = |attribute| {
            let mut value = 0u64;
            // SAFETY: the attribute is one of the pool's `cuuint64_t` counters, which `value`
            // is; the pool is the driver's, live while this value is (see `CudaWaits`). A pool
            // handle needs no current context.
            DriverError::check(unsafe {
                sys::cuMemPoolGetAttribute(
                    self.pool,
                    attribute,
                    (&mut value as *mut u64).cast::<c_void>(),
                )
            })
            .map(|()| value)
        };
        use sys::CUmemPool_attribute as A;
        Ok((
            attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            attribute(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        ))
    }

    /// 1 ms: `cuMemGetInfo` asks the kernel driver (5 to 7 µs on an H100,
    /// `docs/records/memory.md`), so a snapshot asked for often reuses a reading up to a
    /// millisecond old; the pool's figures are asked each time.
    fn device_figures_max_age(&self) -> std::time::Duration {
        std::time::Duration::from_millis(1)
    }

    fn stream_query(&self) -> Result<bool, DriverError> {
        self.in_context(|| {
            for &stream in &self.streams {
                // SAFETY: the streams are live for the driver's lifetime.
                if !ready(unsafe { sys::cuStreamQuery(stream) })? {
                    return Ok(false);
                }
            }
            Ok(true)
        })
    }

    /// 20 µs: about one stream callback's latency, which is several times a spinning event
    /// wait's (`wake_16B` in `benches/transfer_paths.rs`;
    /// `docs/records/async-registered-handoff.md`). Asking the event that long first lets a small
    /// copy resolve at the host wait's latency, and costs a large one 20 µs of one core.
    fn spin_before_wake(&self) -> std::time::Duration {
        std::time::Duration::from_micros(20)
    }
}

#[cfg(test)]
mod tests {
    use super::sys::CUresult;
    use crate::error::DriverError;

    #[test]
    fn driver_errors_match_cudarcs_result_enum() {
        let samples = [
            CUresult::CUDA_ERROR_INVALID_VALUE,
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            CUresult::CUDA_ERROR_NOT_INITIALIZED,
            CUresult::CUDA_ERROR_STUB_LIBRARY,
            CUresult::CUDA_ERROR_NO_DEVICE,
            CUresult::CUDA_ERROR_INVALID_CONTEXT,
            CUresult::CUDA_ERROR_INVALID_PTX,
            CUresult::CUDA_ERROR_INVALID_HANDLE,
            CUresult::CUDA_ERROR_NOT_FOUND,
            CUresult::CUDA_ERROR_NOT_READY,
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            CUresult::CUDA_ERROR_LAUNCH_FAILED,
            CUresult::CUDA_ERROR_NOT_SUPPORTED,
            CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
            CUresult::CUDA_ERROR_KEY_ROTATION,
            CUresult::CUDA_ERROR_UNKNOWN,
        ];
        for raw in samples {
            let e = DriverError::from_raw(raw);
            assert_eq!(e.code(), raw as u32);
            assert_eq!(e.name(), format!("{raw:?}"), "code {}", raw as u32);
            assert_eq!(DriverError::check(raw), Err(e));
        }
        assert_eq!(DriverError::check(CUresult::CUDA_SUCCESS), Ok(()));
        assert_eq!(
            DriverError::from_raw(CUresult::CUDA_SUCCESS),
            DriverError::UNKNOWN
        );
        assert_eq!(
            DriverError::from_raw(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            DriverError::OUT_OF_MEMORY
        );
        assert_eq!(
            DriverError::from_raw(CUresult::CUDA_ERROR_LAUNCH_FAILED),
            DriverError::LAUNCH_FAILED
        );
        assert_eq!(
            DriverError::from_raw(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
            DriverError::ILLEGAL_ADDRESS
        );
        assert_eq!(
            DriverError::from_raw(CUresult::CUDA_ERROR_NOT_SUPPORTED),
            DriverError::NOT_SUPPORTED
        );
    }
}
