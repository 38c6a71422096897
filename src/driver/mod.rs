//! The device seam: the one trait through which every device operation goes.
//!
//! Everything above this module speaks to a [`Driver`], never to the CUDA driver API itself. Two
//! implementations exist: [`cuda::CudaDriver`] over `cudarc::driver::result` for real GPUs, and
//! (feature `sim`) the simulated device in [`sim`], which keeps device memory in host memory,
//! runs its streams only when its clock advances, and injects faults on request. Because the
//! lifecycle code above the seam is the same for both, CI without a GPU checks what the GPU runs.
//!
//! A driver object is one device, one context and three streams, the engine's [`Lane`]s:
//! host-to-device copies run on the upload lane, device-to-host copies on the download lane, and
//! everything else (kernels, library calls, device copies, frees, graph replays) on the compute
//! lane, so an upload, a download and a kernel can run at once on the GPU's two copy engines and
//! its SMs. Nothing orders the lanes but events: [`Driver::stream_wait`] makes one lane wait for
//! an event recorded on another, and the engine inserts those waits where a value is shared
//! (`core::order`). Its methods take `&mut self` because the engine serialises access to it.
//!
//! Besides the memory, copy and event operations of [`Driver`] itself, the seam has five halves
//! that are supertraits of it: [`launch::Launch`] compiles, loads and launches kernels;
//! [`graph::Graphs`] captures queued launches into graphs, instantiates them, updates their
//! kernel nodes' parameters and replays them on the compute stream; [`libs::Libraries`] queues
//! the dense linear algebra the crate offers (cuBLAS, cuSOLVER and cuTENSOR on a GPU); and
//! [`collective::Collectives`] makes communicators across devices, whose groups queue
//! collectives on every rank's stream (NCCL on a GPU); and [`share::Sharing`] exports memory and
//! events to other processes and imports theirs. Nothing above this module calls CUDA, a
//! vendor library or NCCL, or asks which of the two implementations it runs on.

pub(crate) mod callbacks;
pub(crate) mod collective;
pub(crate) mod cuda;
pub(crate) mod graph;
pub(crate) mod launch;
pub(crate) mod libs;
pub(crate) mod share;
#[cfg(any(test, feature = "sim"))]
pub(crate) mod sim;

use crate::device::DeviceId;
use crate::error::DriverError;
use std::sync::Arc;

/// A device address.
pub(crate) type DevicePtr = u64;

/// Whether an engine on `to` can wait on the device for work of an engine on `from`: any two
/// CUDA devices can (through events), and the devices of one simulated machine, which share its
/// clock; nothing else can.
pub(crate) fn reachable(from: DeviceId, to: DeviceId) -> Result<(), &'static str> {
    use crate::device::DeviceKind;
    match (from.kind, to.kind) {
        (DeviceKind::Cuda, DeviceKind::Cuda) => Ok(()),
        (DeviceKind::Simulated, DeviceKind::Simulated) if from.instance == to.instance => Ok(()),
        (DeviceKind::Simulated, DeviceKind::Simulated) => {
            Err("separate simulated machines share no clock, so one cannot wait for the other")
        }
        _ => Err("a real and a simulated device cannot wait for each other"),
    }
}

/// An event owned by a driver. Created by [`Driver::event_create`], valid until
/// [`Driver::event_destroy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct EventHandle(pub(crate) u64);

/// A device's memory, and what one driver's pool holds of it ([`Waits::memory_report`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct MemoryReport {
    /// The device's free bytes.
    pub(crate) free: u64,
    /// The device's bytes in all.
    pub(crate) total: u64,
    /// The bytes the pool holds from the device (in use, and kept for reuse).
    pub(crate) reserved: u64,
    /// The bytes of the pool's live allocations.
    pub(crate) used: u64,
    /// The largest allocation that would succeed now, where the driver can say.
    pub(crate) largest: Option<u64>,
}

/// One of the engine's three streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Lane {
    /// Kernels, library calls, device-to-device copies, frees and graph replays; the stream a raw
    /// scope hands out.
    Compute,
    /// Host-to-device copies.
    Upload,
    /// Device-to-host copies.
    Download,
}

impl Lane {
    /// The three lanes, in index order.
    pub(crate) const ALL: [Lane; 3] = [Lane::Compute, Lane::Upload, Lane::Download];

    /// The lane's index into per-lane arrays.
    pub(crate) const fn index(self) -> usize {
        self as usize
    }

    /// The lane a host copy runs on: upload for host to device, else download.
    pub(crate) const fn of_copy(upload: bool) -> Lane {
        if upload { Lane::Upload } else { Lane::Download }
    }
}

#[cfg(feature = "dlpack")]
/// A device allocation, as the driver reports it ([`Driver::allocation_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Allocation {
    /// Its first address.
    pub(crate) base: DevicePtr,
    /// Its length in bytes.
    pub(crate) bytes: u64,
    /// The ordinal of the device whose memory it is.
    pub(crate) ordinal: usize,
}

/// The raw handle of the CUDA legacy default stream (`CU_STREAM_LEGACY`), as the DLPack protocol
/// names it: work on it waits for, and is waited for by, every blocking stream of the context.
pub(crate) const LEGACY_STREAM: u64 = 1;
/// The raw handle of the calling thread's default stream (`CU_STREAM_PER_THREAD`), as the DLPack
/// protocol names it.
pub(crate) const PER_THREAD_STREAM: u64 = 2;

/// A closure the device calls once, on a thread of its choosing: see [`Driver::notify_after`].
pub(crate) type Wake = Box<dyn FnOnce() + Send + 'static>;

/// A context, as the raw handle value (`CUcontext` for CUDA). Zero means "no context".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ContextHandle(pub(crate) u64);

/// Queues a copy between host memory and device memory: host to device when `upload`, else
/// device to host. Errors name the driver call.
///
/// # Safety
/// As [`Driver::copy_htod`] for an upload and [`Driver::copy_dtoh`] for a download: `host` and
/// `device` each hold `bytes` bytes and stay valid, untouched by the host, until the copy has
/// completed.
pub(crate) unsafe fn copy_host(
    driver: &mut dyn Driver,
    upload: bool,
    device: DevicePtr,
    host: *mut u8,
    bytes: usize,
) -> Result<(), crate::error::Error> {
    use crate::error::Error;
    if upload {
        // SAFETY: the caller's contract, for the host-to-device direction.
        unsafe { driver.copy_htod(device, host, bytes) }.map_err(Error::driver("cuMemcpyHtoDAsync"))
    } else {
        // SAFETY: the caller's contract, for the device-to-host direction.
        unsafe { driver.copy_dtoh(host, device, bytes) }.map_err(Error::driver("cuMemcpyDtoHAsync"))
    }
}

/// The half of the seam that asks about or waits for queued work: callable from any thread,
/// without the engine's lock, so a host wait never blocks the engine's other users.
///
/// Each call makes the driver's context current for its duration when it needs one, and
/// restores the caller's.
pub(crate) trait Waits: Send + Sync {
    /// Whether the work before the event's last record has completed. Never waits.
    /// `Ok(false)` means not yet; `Err` means the device reported a failure.
    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError>;
    /// Waits until the work before the event's last record has completed.
    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError>;
    /// Waits at most about `within` for the work before the event's last record: `Ok(true)`
    /// once it has completed, `Ok(false)` when `within` passed first. Asks the event with
    /// pauses that grow to a millisecond (a device has no timed wait on an event).
    fn event_wait_within(
        &self,
        event: EventHandle,
        within: std::time::Duration,
    ) -> Result<bool, DriverError> {
        let start = std::time::Instant::now();
        let mut pause = std::time::Duration::from_micros(5);
        loop {
            if self.event_query(event)? {
                return Ok(true);
            }
            let left = within.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Ok(false);
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(std::time::Duration::from_millis(1));
        }
    }
    /// Waits until everything queued on every lane has completed.
    fn stream_synchronize(&self) -> Result<(), DriverError>;
    #[cfg(feature = "dlpack")]
    /// Waits until everything queued on every stream of the driver's context has completed, the
    /// streams of other libraries included (`cuCtxSynchronize`): the one proof that covers work
    /// whose stream nobody named.
    fn context_synchronize(&self) -> Result<(), DriverError>;
    /// Waits until everything queued on one lane has completed.
    fn lane_synchronize(&self, lane: Lane) -> Result<(), DriverError>;
    /// Whether everything queued on every lane has completed. Never waits.
    fn stream_query(&self) -> Result<bool, DriverError>;
    /// The device's memory as the driver reports it (`cuMemGetInfo`), and what this driver's
    /// pool holds (`cuMemPoolGetAttribute`). Never waits, and takes no lock of the engine's.
    fn memory_report(&self) -> Result<MemoryReport, DriverError>;
    /// What this driver's pool holds, reserved and in use (`cuMemPoolGetAttribute`): the cheap
    /// half of [`memory_report`](Self::memory_report).
    fn pool_usage(&self) -> Result<(u64, u64), DriverError>;
    /// How old the device's free and total memory may be in a snapshot that is asked for often
    /// ([`memory_report`](Self::memory_report)'s `cuMemGetInfo` asks the kernel driver and costs
    /// microseconds); zero where asking costs nothing (the simulator, whose figures are then
    /// always exact).
    fn device_figures_max_age(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
    /// How long an awaited transfer that is not complete at its first poll keeps asking its
    /// event before it asks the device for a wake: about one wake's latency on a real device,
    /// so a copy about to finish resolves as fast as a host wait would; zero where time does not
    /// move the device (the simulator's clock runs only when it is advanced).
    fn spin_before_wake(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

/// One device, one context and three streams (the [`Lane`]s), behind a seam with two
/// implementations.
///
/// Asynchronous operations are queued on their lane in call order; lanes are ordered against
/// each other only by [`Driver::stream_wait`]. Their `unsafe` contracts are CUDA's: memory named
/// by a queued operation must stay valid until the operation has completed, which only an event
/// recorded after it on its lane (or a stream synchronize) proves, and work on one lane that
/// reads what work on another writes (or writes what it reads) must be ordered after it by a
/// wait.
///
/// Compiling, loading and launching kernels is the [`launch::Launch`] half of the seam;
/// capturing queued launches into graphs and replaying them is the [`graph::Graphs`] half.
pub(crate) trait Driver:
    Send + launch::Launch + graph::Graphs + libs::Libraries + collective::Collectives + share::Sharing
{
    /// The device this driver drives.
    fn device(&self) -> DeviceId;
    /// The device's name, as the driver reports it.
    fn name(&self) -> &str;
    /// The engine's context.
    fn context(&self) -> ContextHandle;
    /// The engine's compute lane's stream, as the raw handle value.
    fn stream_handle(&self) -> u64;
    /// The context current on the calling thread.
    fn current_context(&self) -> Result<ContextHandle, DriverError>;
    /// Makes `ctx` current on the calling thread (`NONE` unbinds).
    fn set_current_context(&self, ctx: ContextHandle) -> Result<(), DriverError>;

    /// Allocates `bytes` of device memory, ordered on `lane`: work queued on that lane later
    /// may use it at once, work on another lane only after a wait for an event recorded on
    /// `lane` after the allocation.
    fn alloc(&mut self, lane: Lane, bytes: usize) -> Result<DevicePtr, DriverError>;
    /// This driver's memory pool, for another driver of the machine to allocate from
    /// ([`Driver::alloc_from`]).
    fn pool(&self) -> u64;
    /// Gives the memory this driver's pool holds unused back to the device, down to `keep`
    /// bytes (`cuMemPoolTrimTo`): memory that backs an allocation, or a free not yet complete,
    /// stays.
    fn trim_pool(&mut self, keep: usize) -> Result<(), DriverError>;
    /// Allocates `bytes` from `pool`, another driver's ([`Driver::pool`], possibly of another
    /// device), ordered on this driver's `lane` (`cuMemAllocFromPoolAsync` allows a pool of a
    /// device other than the stream's). The memory is the pool's driver's: it frees it, after
    /// the allocation has completed.
    fn alloc_from(&mut self, lane: Lane, pool: u64, bytes: usize)
    -> Result<DevicePtr, DriverError>;
    /// Frees an allocation, ordered on `lane`.
    ///
    /// # Safety
    /// `ptr` came from [`Driver::alloc`] on this driver and is not freed twice; no operation
    /// queued later uses it, and the allocation and every operation on another lane that uses
    /// it are ordered before the free (by a wait on `lane`, or by a host wait).
    unsafe fn free(&mut self, lane: Lane, ptr: DevicePtr) -> Result<(), DriverError>;
    /// Queues a host-to-device copy on the upload lane.
    ///
    /// # Safety
    /// `src..src+bytes` is readable host memory and `dst..dst+bytes` lies in one live allocation;
    /// both stay valid, and the source unchanged, until the copy completes.
    unsafe fn copy_htod(
        &mut self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), DriverError>;
    /// Queues a device-to-host copy on the download lane.
    ///
    /// # Safety
    /// `dst..dst+bytes` is writable host memory that nothing reads or writes until the copy
    /// completes; `src..src+bytes` lies in one live allocation.
    unsafe fn copy_dtoh(
        &mut self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError>;
    /// Queues a device-to-device copy on the compute lane.
    ///
    /// # Safety
    /// Both ranges lie in live allocations and do not overlap.
    unsafe fn copy_dtod(
        &mut self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError>;

    /// Creates an event with timing disabled.
    fn event_create(&mut self) -> Result<EventHandle, DriverError>;
    /// Creates an event that only orders one lane after another: it is recorded and waited on
    /// with [`Driver::stream_wait`], never queried or waited for by the host. A real device
    /// makes an ordinary event; the simulator runs such an event's records, and every lane's
    /// waits, outside its clock (they take no device time), and counts them apart from the
    /// proofs' records.
    fn ordering_event_create(&mut self) -> Result<EventHandle, DriverError> {
        self.event_create()
    }
    /// Records `event` at the current end of `lane`.
    fn event_record(&mut self, lane: Lane, event: EventHandle) -> Result<(), DriverError>;
    /// Makes work queued on `lane` from now on wait until the work before `event`'s last record
    /// (as of this call) has completed. Never waits on the host; a later record of `event` does
    /// not change what this wait waits for. `event` may be another driver's (a signal), on this
    /// device or, for a real device, another one.
    fn stream_wait(&mut self, lane: Lane, event: EventHandle) -> Result<(), DriverError>;

    #[cfg(feature = "dlpack")]
    /// The live device allocation that holds `ptr`, as the driver reports it: for memory another
    /// library allocated, whose extent nothing else vouches for. `Err` when `ptr` lies in no
    /// device allocation the driver knows.
    fn allocation_of(&self, ptr: DevicePtr) -> Result<Allocation, DriverError>;

    /// Records `event` at the current end of `stream`, a stream that is not one of the engine's
    /// lanes: another library's (a DLPack consumer's or producer's, a cudarc stream), given by
    /// its raw handle, or [`LEGACY_STREAM`] or [`PER_THREAD_STREAM`].
    ///
    /// # Safety
    /// `stream` is [`LEGACY_STREAM`], [`PER_THREAD_STREAM`], or a live stream of this driver's
    /// context, which stays live until the call returns.
    unsafe fn foreign_record(&mut self, stream: u64, event: EventHandle)
    -> Result<(), DriverError>;
    /// Makes work queued on `stream` (not one of the engine's lanes) from now on wait until the
    /// work before `event`'s last record (as of this call) has completed. Never waits on the
    /// host.
    ///
    /// # Safety
    /// As [`Driver::foreign_record`].
    unsafe fn foreign_wait(&mut self, stream: u64, event: EventHandle) -> Result<(), DriverError>;

    /// Whether this device reaches the memory of device `peer` directly (a peer link), so a
    /// [`copy_peer`](Driver::copy_peer) between them runs device to device. The same device:
    /// `true`.
    fn can_access_peer(&self, peer: DeviceId) -> Result<bool, DriverError>;

    /// Lets this driver's context reach the memory of the context `peer` (another driver's, on
    /// a device [`can_access_peer`](Driver::can_access_peer) reaches). Enabling it again is not
    /// an error.
    fn enable_peer_access(&mut self, peer: ContextHandle) -> Result<(), DriverError>;

    /// Lets device `peer` read and write the memory this driver allocates (its memory pool's
    /// blocks are reachable only by the devices the pool names, whatever the contexts allow).
    /// Granting it again is not an error.
    fn grant_peer_access(&mut self, peer: DeviceId) -> Result<(), DriverError>;

    /// Queues on `lane` a copy of `bytes` from `src`, memory of the context `src_ctx`, to `dst`,
    /// memory of the context `dst_ctx`: one of them this driver's, the other a peer's (or the
    /// same device's).
    ///
    /// # Safety
    /// Both ranges lie in live allocations that stay live until the copy completes, and do not
    /// overlap.
    unsafe fn copy_peer(
        &mut self,
        lane: Lane,
        dst: DevicePtr,
        dst_ctx: ContextHandle,
        src: DevicePtr,
        src_ctx: ContextHandle,
        bytes: usize,
    ) -> Result<(), DriverError>;
    /// Destroys an event.
    ///
    /// # Safety
    /// `event` came from [`Driver::event_create`] on this driver and is not used afterwards.
    unsafe fn event_destroy(&mut self, event: EventHandle) -> Result<(), DriverError>;

    /// Calls `wake` exactly once, on some thread, once the work before `event`'s last record
    /// (as of this call) has completed, or the device has failed. Never waits.
    ///
    /// This is how a host task learns, without a thread blocked in a wait and without polling,
    /// that queued work is done: the device itself calls back. The call may come at once (on
    /// the calling thread, once it holds no engine lock) when the work is already complete, and
    /// is not delayed by work queued on the stream after the record. Every driver hands its
    /// wakes to [`callbacks::call`], so a wake never runs under an engine's lock and always runs
    /// marked as the device's callback. `wake` should only signal. It says
    /// nothing about the outcome: whoever is woken asks the event ([`Waits::event_query`]),
    /// which tells completion from failure.
    ///
    /// When this returns `Err`, `wake` was dropped without being called and never will be.
    fn notify_after(&mut self, event: EventHandle, wake: Wake) -> Result<(), DriverError>;

    /// Allocates `bytes` of page-locked host memory.
    fn host_alloc(&mut self, bytes: usize) -> Result<*mut u8, DriverError>;
    /// Frees page-locked host memory.
    ///
    /// # Safety
    /// `ptr` came from [`Driver::host_alloc`] on this driver, is freed once, and no queued
    /// operation may still touch it.
    unsafe fn host_free(&mut self, ptr: *mut u8) -> Result<(), DriverError>;
    /// Page-locks `bytes` of existing host memory starting at `ptr` for this driver's context,
    /// so that copies from and to it run asynchronously at the copy engines' speed, as from
    /// [`Driver::host_alloc`] memory. The driver locks the pages and neither reads nor writes
    /// them; a range it cannot lock (unmapped, empty, already registered) is refused with an
    /// error.
    fn host_register(&mut self, ptr: *mut u8, bytes: usize) -> Result<(), DriverError>;
    /// Unlocks a range registered with [`Driver::host_register`]: from then on a copy from or to
    /// it is a pageable copy again.
    ///
    /// # Safety
    /// `ptr` is the start of a range registered on this driver and not yet unregistered, and no
    /// queued operation may still touch it.
    unsafe fn host_unregister(&mut self, ptr: *mut u8) -> Result<(), DriverError>;

    /// The waiting half of this driver, for waits made without the engine's lock.
    fn waits(&self) -> Arc<dyn Waits>;

    /// Whether another CUDA runtime in the process (CubeCL's, say) can drive this device through
    /// its primary context, the one the driver's streams belong to. A real device: yes; the
    /// simulated one has no CUDA context to share.
    #[cfg(feature = "cubecl")]
    fn hosts_cuda_runtimes(&self) -> bool {
        true
    }
}
