//! `CudaEngine`: one device, one context, one order of work, held by the caller.
//!
//! The engine is the unit of ownership. It holds the driver (behind the device seam) with its
//! three streams (upload, download, compute), the order between them (`core::order`), and the
//! per-engine caches and pools. Operations borrow it
//! `&mut`, so a chain of dependent operations is a chain of calls with no entry protocol and no
//! implicit host barrier: [`CudaEngine::flush`] is a submission boundary that reports failures
//! without waiting, and [`CudaEngine::synchronize`] is the one explicit host barrier.
//!
//! Values the engine hands out (tensors, pinned buffers, pending transfers) keep the engine's
//! shared core alive through an `Arc`, so a value dropped after the engine still frees its memory
//! on the right device, stream-ordered, and never early.
//!
//! The state behind the lock ([`State`]) holds, beside the driver, the core's own bookkeeping
//! (the lane order, the retirement queue and the event pool, the failures deferred to the next
//! boundary) and the [`Parts`]: the state the levels above keep per engine (the pinned pool, the
//! staging ring, the kernel cache, ...), held by type and opaque here (`core::parts`). The code
//! that uses a part on a caller's behalf lives in the part's own level, as `impl CudaEngine` or
//! `impl State` blocks.
//!
//! Dropping the engine tears it down in a fixed order: after a wait proves the streams idle, it
//! settles the retirement queue, releases the parts placed before the core's events (idle pinned
//! memory), destroys the pooled events and the lane order's, then releases the parts placed after
//! them (compiled modules among them). When the wait fails, nothing is released.

use super::order::{Order, Proven, Use};
use super::parts::Parts;
use super::retire::{EventPool, Poll, Resources, RetireQueue, RetirementStats};
use crate::device::DeviceId;
use crate::driver::{ContextHandle, DevicePtr, Driver, Lane, Waits, callbacks};
use crate::error::{DriverError, Error, Result, UsageError};
use crate::ledger::{Cells, Ledger, Owner};
use crate::sync::unlock_first::{UnlockFirst, Unlocking};
use std::ops::{Deref, DerefMut};
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// The state shared between an engine and the values it handed out.
pub(crate) struct Shared {
    /// Unique per engine, so values are never used on another engine's streams.
    pub(crate) engine_id: u64,
    pub(crate) device: DeviceId,
    /// The driver's waiting half: host waits go through it without the lock.
    pub(crate) waits: Arc<dyn Waits>,
    /// What host waits have proven complete, per lane (shared with the lane order).
    pub(crate) proven: Arc<Proven>,
    /// The figures of the state's ledger, read without the lock.
    pub(crate) cells: Arc<Cells>,
    state: Mutex<State>,
    /// Failures met inside wakes (values dropped there, leaked), for the next boundary. Its own
    /// lock, held for a push or a take only: a wake never waits for the state's lock, which a
    /// thread may hold across a driver call that waits for the device's callbacks.
    in_wake: Mutex<Vec<Error>>,
}

/// What the mutex guards: the driver and everything that must change together with it.
pub(crate) struct State {
    pub(crate) driver: Box<dyn Driver>,
    /// Failures recorded where they could not be reported (drops), for the next boundary.
    pub(crate) deferred: Vec<Error>,
    /// Set once the engine has been dropped.
    pub(crate) torn_down: bool,
    /// Set once the teardown's wait for the streams has succeeded: everything queued before it
    /// is proven complete. A failed wait leaves it unset (being torn down proves nothing).
    pub(crate) settled: bool,
    /// Idle events for reuse.
    pub(crate) events: EventPool,
    /// Resources waiting for their event before release.
    pub(crate) retire: RetireQueue,
    /// Resources proven free while the lock was held, dropped as soon as it is released (their
    /// drops take the lock).
    pub(crate) released: Vec<Resources>,
    /// The order of the three lanes: which value was last used where, and the waits between.
    pub(crate) order: Order,
    /// The engines (by id) whose memory this engine's device reaches with every access a peer
    /// copy needs already enabled (see `peer::access`).
    pub(crate) peers: Vec<u64>,
    /// The state the levels above keep for this engine, by type, each made on first use.
    pub(crate) parts: Parts,
    /// What memory the engine holds, by owner: told by every allocation and free, under this
    /// lock (its one writer), and read from anywhere through [`Shared::cells`].
    pub(crate) ledger: Ledger,
}

/// What a device allocation is counted as, for its free to take off the ledger again: its
/// owner and its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Charge {
    pub(crate) owner: Owner,
    pub(crate) bytes: usize,
}

impl Charge {
    /// `bytes` of `owner`'s.
    pub(crate) fn new(owner: Owner, bytes: usize) -> Self {
        Charge { owner, bytes }
    }
}

impl State {
    /// Queues one operation on `lane` that makes `uses` of device values: first the waits that
    /// order it after the work on other lanes it must follow, then the record of its uses, then
    /// `op`. When a wait or `op` fails, nothing of the operation is queued (a wait already queued
    /// only delays the lane, and a recorded use of nothing only orders more than needed).
    pub(crate) fn queue<R>(
        &mut self,
        lane: Lane,
        uses: &[Use],
        op: impl FnOnce(&mut dyn Driver) -> Result<R>,
    ) -> Result<R> {
        self.order.prepare(&mut *self.driver, lane, uses)?;
        // Marked before the operation is queued (the lock is held throughout, so no ordering
        // record can fall between): a driver call that panics after queueing leaves the use
        // recorded, and a refused one only a mark of nothing, which orders nothing wrongly.
        self.order.mark(lane, uses);
        op(&mut *self.driver)
    }

    /// Allocates `bytes` of device memory ordered on `lane` for `owner`, records the allocation
    /// in the lane order (work on another lane waits for it) and counts it on the ledger. Its
    /// free, [`free_device`](Self::free_device), takes the same [`Charge`].
    #[track_caller]
    pub(crate) fn alloc_for(
        &mut self,
        lane: Lane,
        bytes: usize,
        owner: Owner,
    ) -> std::result::Result<DevicePtr, DriverError> {
        self.alloc_at(lane, bytes, owner, Location::caller())
    }

    /// As [`alloc_for`](Self::alloc_for), counted as made by the code at `at` (for a caller
    /// whose own caller's line cannot pass through a closure).
    pub(crate) fn alloc_at(
        &mut self,
        lane: Lane,
        bytes: usize,
        owner: Owner,
        at: &'static Location<'static>,
    ) -> std::result::Result<DevicePtr, DriverError> {
        let ptr = self.driver.alloc(lane, bytes)?;
        self.order.mark(lane, &[Use::Alloc(ptr)]);
        self.ledger.allocated(owner, bytes, at);
        Ok(ptr)
    }

    /// Frees, on `lane`, device memory of `charge` allocated on `lane` whose every use was
    /// queued there (a library call's workspace): no wait is needed. A refusal leaves the memory
    /// allocated and counted, and is recorded for the next boundary.
    ///
    /// # Safety
    /// `ptr` came from [`alloc_for`](Self::alloc_for) on `lane`, is freed once (here), every
    /// use of it was queued on `lane`, and no operation queued later names it.
    #[track_caller]
    pub(crate) unsafe fn free_on_lane(&mut self, lane: Lane, ptr: DevicePtr, charge: Charge) {
        // SAFETY: the caller's contract.
        match unsafe { self.driver.free(lane, ptr) } {
            Ok(()) => {
                self.order.forget(ptr);
                self.ledger
                    .freed(charge.owner, charge.bytes, Location::caller());
            }
            Err(source) => self.defer(Error::Driver {
                call: "cuMemFreeAsync",
                source,
            }),
        }
    }

    /// Orders the work this lock hold is about to queue on `lane` with `uses`: queues its waits
    /// and records its uses. The caller queues the work before releasing the lock (so no later
    /// record covers the uses before the work), and a wait that fails refuses the work.
    pub(crate) fn order_uses(&mut self, lane: Lane, uses: &[Use]) -> Result<()> {
        self.order.prepare(&mut *self.driver, lane, uses)?;
        self.order.mark(lane, uses);
        Ok(())
    }

    /// Frees device memory ordered after every use of it: on the one lane that has used it
    /// since the host last proved that lane complete (no wait needed), else on the compute lane
    /// after cross-lane waits, or, when one is refused, after a host wait for every lane (the
    /// refusal is recorded for the next boundary). When neither works, or the free itself is
    /// refused, the memory is left allocated (never freed under work that may still use it) and
    /// the failure recorded.
    ///
    /// Once the free is queued, the ledger counts `charge` (what the allocation was counted
    /// as) as freed; memory left allocated stays counted.
    ///
    /// # Safety
    /// `ptr` came from this driver's `alloc`, is freed once (here), and no operation queued
    /// later names it.
    #[track_caller]
    pub(crate) unsafe fn free_device(&mut self, waits: &dyn Waits, ptr: DevicePtr, charge: Charge) {
        // SAFETY: the caller's contract, for the driver's free.
        unsafe {
            // `free_ordered` orders every use of `ptr` before this free on `lane`.
            self.free_ordered(
                waits,
                ptr,
                Some(charge),
                "cuMemFreeAsync",
                |driver, lane| driver.free(lane, ptr),
            )
        };
    }

    /// What [`free_device`](Self::free_device) does, with `release` (the driver call `call`) in
    /// place of the driver's free: for memory another process exports, which this driver
    /// releases by unmapping it. Returns the lane the release was queued on, or `None` when it
    /// was not queued (the memory is left mapped and the failure recorded).
    ///
    /// # Safety
    /// As [`free_device`](Self::free_device), for `release`'s memory; `release` queues the
    /// release of `ptr` on the lane it is given.
    #[track_caller]
    pub(crate) unsafe fn free_ordered(
        &mut self,
        waits: &dyn Waits,
        ptr: DevicePtr,
        charge: Option<Charge>,
        call: &'static str,
        release: impl FnOnce(&mut dyn Driver, Lane) -> std::result::Result<(), DriverError>,
    ) -> Option<Lane> {
        let (lane, prepared) = self.order.prepare_free(&mut *self.driver, ptr);
        if let Err(refused) = prepared {
            self.defer(refused);
            let upto = self.order.positions();
            if let Err(source) = waits.stream_synchronize() {
                self.defer(Error::DeviceFault {
                    what: "work before a device free",
                    source,
                });
                return None;
            }
            self.order.settled(upto);
        }
        // Every use of `ptr` on another lane is ordered before the release, by the waits just
        // queued or by the host wait.
        match release(&mut *self.driver, lane) {
            Ok(()) => {
                self.order.forget(ptr);
                if let Some(charge) = charge {
                    self.ledger
                        .freed(charge.owner, charge.bytes, Location::caller());
                }
                Some(lane)
            }
            Err(source) => {
                self.defer(Error::Driver { call, source });
                None
            }
        }
    }

    /// Queues a copy between host memory and device memory inside the tensor at `tensor` on the
    /// copy lane of its direction (upload when `upload`), ordered after the tensor's uses on the
    /// other lanes, and records the copy's use of it. Returns the lane, where the caller fences
    /// the copy. Nothing is queued when a wait or the copy is refused.
    ///
    /// # Safety
    /// As [`copy_host`](crate::driver::copy_host); `device..device+bytes` lies in the tensor.
    pub(crate) unsafe fn queue_host_copy(
        &mut self,
        upload: bool,
        tensor: DevicePtr,
        device: DevicePtr,
        host: *mut u8,
        bytes: usize,
    ) -> Result<Lane> {
        // SAFETY: the caller's contract.
        unsafe {
            self.queue_host_copy_of(upload, &[Use::of_copy(upload, tensor)], device, host, bytes)
        }
    }

    /// As [`queue_host_copy`](Self::queue_host_copy), for a copy that uses the values `uses`
    /// (one allocation and the tensors that are parts of it, say): ordered after each of their
    /// uses on the other lanes, and recorded as a use of each.
    ///
    /// # Safety
    /// As [`copy_host`](crate::driver::copy_host); `device..device+bytes` lies in the values
    /// `uses` names, and every value it reaches there is in `uses`.
    pub(crate) unsafe fn queue_host_copy_of(
        &mut self,
        upload: bool,
        uses: &[Use],
        device: DevicePtr,
        host: *mut u8,
        bytes: usize,
    ) -> Result<Lane> {
        let lane = Lane::of_copy(upload);
        self.order.prepare(&mut *self.driver, lane, uses)?;
        // Marked first, as in `queue`: a copy queued by a driver call that then panics is still
        // waited for by later work on the tensor.
        self.order.mark(lane, uses);
        // SAFETY: the caller's contract.
        unsafe { crate::driver::copy_host(&mut *self.driver, upload, device, host, bytes) }?;
        Ok(lane)
    }

    /// Records a failure for the next `flush` or `synchronize`.
    pub(crate) fn defer(&mut self, error: Error) {
        self.deferred.push(error);
    }

    /// Releases what the retirement queue has proven complete, without waiting. The resources
    /// are dropped once the lock is released.
    fn poll_retired(&mut self, waits: &dyn Waits, mode: Poll) {
        let mut proved = [0; 3];
        self.retire.poll(
            waits,
            &mut self.events,
            &mut self.released,
            &mut proved,
            mode,
        );
        self.retire.tell(&mut self.ledger);
        // Each released record's event proved its lane complete up to its record.
        self.order.settled(proved);
    }

    /// Releases every retired record whose event reports completion, without waiting (a query
    /// that fails is retried at a later poll). The resources are dropped once the lock is
    /// released.
    pub(crate) fn release_completed(&mut self, waits: &dyn Waits) {
        self.poll_retired(waits, Poll::All);
    }

    /// Releases the oldest retired records, up to the first that is not complete: a cheap check
    /// for hot paths.
    pub(crate) fn release_completed_front(&mut self, waits: &dyn Waits) {
        self.poll_retired(waits, Poll::Front);
    }

    /// Every failure recorded since the last boundary, as one error.
    fn take_deferred(&mut self) -> Result<()> {
        let mut errors = std::mem::take(&mut self.deferred);
        errors.extend(self.retire.take_unreported());
        if errors.is_empty() {
            return Ok(());
        }
        let count = errors.len();
        Err(Error::Deferred {
            count,
            first: Box::new(errors.swap_remove(0)),
        })
    }
}

/// The engine's state, locked. Dropping it releases the lock first, then drops the resources
/// released meanwhile, so their drops (which take the lock) never run under it, on unwind too.
pub(crate) type Locked<'a> = UnlockFirst<'a, State>;

impl Unlocking for State {
    type Then = Vec<Resources>;

    fn on_unlock(&mut self, _unwinding: bool) -> Vec<Resources> {
        std::mem::take(&mut self.released)
    }

    fn after_unlock(released: Vec<Resources>) {
        callbacks::engine_lock_released();
        drop(released);
        // The device's wakes that came due under the lock run now, with no lock held.
        callbacks::run_deferred();
    }
}

/// The engine's state, locked, with the engine's context current on this thread. Dropping it
/// restores whatever context was current before.
pub(crate) struct Entered<'a> {
    locked: Locked<'a>,
    previous: Option<ContextHandle>,
}

impl Deref for Entered<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.locked
    }
}

impl DerefMut for Entered<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.locked
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        if let Some(previous) = self.previous
            && let Err(source) = self.locked.driver.set_current_context(previous)
        {
            self.locked.defer(Error::Driver {
                call: "cuCtxSetCurrent (restore)",
                source,
            });
        }
    }
}

impl Shared {
    /// Locks the state.
    pub(crate) fn lock(&self) -> Locked<'_> {
        let locked = UnlockFirst::lock(&self.state);
        callbacks::engine_lock_taken();
        locked
    }

    /// Locks the state for a drop path: `None` when this thread already holds an engine lock
    /// (a panic is unwinding through a locked section), or runs a wake (the device's callback,
    /// where nothing may be released: the drop is reported at the next boundary), and the
    /// caller then leaks instead.
    pub(crate) fn lock_for_drop(&self) -> Option<Locked<'_>> {
        if callbacks::in_wake() {
            self.report_in_wake(Error::Usage(UsageError::InDeviceCallback {
                what: "a value of the engine was dropped, and leaked,",
            }));
            return None;
        }
        if callbacks::engine_locks_held() > 0 {
            // Outside an unwind this is a bug: a value dropped under the lock would leak.
            debug_assert!(
                std::thread::panicking(),
                "a value of an engine was dropped while an engine lock was held"
            );
            return None;
        }
        Some(self.lock())
    }

    /// Records a failure met inside a wake for the next boundary, without the state's lock.
    pub(crate) fn report_in_wake(&self, error: Error) {
        self.in_wake
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(error);
    }

    /// Locks the state and makes the engine's context current for the duration.
    ///
    /// # Errors
    /// [`UsageError::InDeviceCallback`](crate::error::UsageError::InDeviceCallback) inside a wake, where the driver refuses every call (nothing
    /// is locked then); the driver's refusal to make the context current.
    pub(crate) fn enter(&self) -> Result<Entered<'_>> {
        if callbacks::in_wake() {
            return Err(Error::Usage(UsageError::InDeviceCallback {
                what: "an engine call",
            }));
        }
        Self::enter_locked(self.lock())
    }

    fn enter_locked(locked: Locked<'_>) -> Result<Entered<'_>> {
        let ctx = locked.driver.context();
        let current = locked
            .driver
            .current_context()
            .map_err(Error::driver("cuCtxGetCurrent"))?;
        let previous = if current == ctx {
            None
        } else {
            locked
                .driver
                .set_current_context(ctx)
                .map_err(Error::driver("cuCtxSetCurrent"))?;
            Some(current)
        };
        Ok(Entered { locked, previous })
    }

    /// Like [`Shared::enter`], for drop paths: on failure the caller leaks what it would have
    /// released, and the failure is recorded for the next boundary.
    pub(crate) fn enter_for_drop(&self) -> Option<Entered<'_>> {
        match Self::enter_locked(self.lock_for_drop()?) {
            Ok(entered) => Some(entered),
            Err(error) => {
                self.lock().defer(error);
                None
            }
        }
    }

    /// A boundary's bookkeeping: releases what the retirement queue has proven (polled by
    /// `mode`), then reports every failure recorded so far, those of the releases' own drops
    /// included. Released resources drop outside the lock (their drops take it), so the lock is
    /// taken a second time only when something was released.
    fn release_and_report(&self, mode: Poll) -> Result<()> {
        let mut st = self.enter()?;
        st.poll_retired(&*self.waits, mode);
        if !st.released.is_empty() {
            drop(st);
            st = self.enter()?;
        }
        let in_wake = std::mem::take(&mut *self.in_wake.lock().unwrap_or_else(|e| e.into_inner()));
        st.deferred.extend(in_wake);
        st.take_deferred()
    }

    /// Checks that a value made by engine `engine_id` on `device` may be used on this engine.
    pub(crate) fn check_owner(&self, device: DeviceId, engine_id: u64) -> Result<()> {
        if engine_id != self.engine_id {
            return Err(Error::Usage(UsageError::WrongEngine {
                what: "the value",
                expected: self.engine_id,
                expected_device: self.device,
                found: engine_id,
                found_device: device,
            }));
        }
        Ok(())
    }

    /// Checks that `value` (anything that knows its engine) belongs to this engine.
    pub(crate) fn check(&self, value: &Shared) -> Result<()> {
        self.check_owner(value.device, value.engine_id)
    }
}

/// A CUDA device, its primary context and three streams, held by the caller.
///
/// Open one per device and per independent stream of work, keep it, and pass it `&mut` to every
/// operation. Nothing waits for the device unless you ask: uploads queue on the engine's upload
/// stream, downloads on its download stream and everything else on its compute stream, in call
/// order, with an event wait on the device wherever two of them share a tensor (the exact
/// promise: [the rules](crate::guide::rules#one-order-three-streams)); [`flush`](Self::flush)
/// reports failures at a boundary you choose without waiting; [`synchronize`](Self::synchronize)
/// is the host barrier.
///
/// Dropping the engine waits for its streams, releases what it retained, and never panics or
/// reports. If that final wait fails, everything the device may still touch is leaked rather
/// than freed.
///
/// # Methods by topic
///
/// Every method of the engine, wherever its code lives (each level implements the methods over
/// its own state); `tests/engine_methods.rs` checks that the table and the code agree.
///
/// | topic | method | what it is for |
/// | --- | --- | --- |
/// | Open and devices | [`open`](CudaEngine::open) | opens CUDA device `ordinal` (its primary context and the engine's three streams) |
/// |  | [`device_count`](CudaEngine::device_count) | how many CUDA devices this machine has |
/// |  | [`device`](CudaEngine::device) | the device this engine drives |
/// |  | [`device_name`](CudaEngine::device_name) | the device's name, as the driver reports it |
/// |  | [`id`](CudaEngine::id) | a number unique to this engine in the process |
/// | Order: boundaries, barriers, signals | [`flush`](CudaEngine::flush) | a submission boundary: reports queued failures without waiting |
/// |  | [`synchronize`](CudaEngine::synchronize) | the host barrier: waits for everything queued, then reports |
/// |  | [`signal`](CudaEngine::signal) | a [`Signal`](crate::engine::Signal) after everything queued so far, for another engine or stream to wait on |
/// |  | [`wait_signal`](CudaEngine::wait_signal) | makes this engine's later work wait, on the device, for a signal |
/// |  | [`stream_waits`](CudaEngine::stream_waits) | how many cross-stream waits the order has queued (a counter) |
/// |  | [`events_created`](CudaEngine::events_created) | how many events the engine has created (a counter) |
/// |  | [`retirement_stats`](CudaEngine::retirement_stats) | the retirement queue's counters |
/// | Memory and staging | [`alloc_tensor`](CudaEngine::alloc_tensor) | a device tensor of a shape, contents unspecified until written |
/// |  | [`device_memory`](CudaEngine::device_memory) | the device's free and total memory, and what the engine's pool holds |
/// |  | [`trim_device_pool`](CudaEngine::trim_device_pool) | gives the pool's unused memory back to the device |
/// |  | [`pinned_pool_budget`](CudaEngine::pinned_pool_budget) | the pinned pool's idle-byte budget |
/// |  | [`set_pinned_pool_budget`](CudaEngine::set_pinned_pool_budget) | sets that budget and trims the pool to it |
/// |  | [`pinned_pool_stats`](CudaEngine::pinned_pool_stats) | the pinned pool's counters |
/// |  | [`trim_host_memory`](CudaEngine::trim_host_memory) | gives back the idle page-locked memory of the pinned pool and the staging ring |
/// |  | [`memory`](CudaEngine::memory) | everything the engine holds, device and host, by owner, with peaks |
/// |  | [`memory_watch`](CudaEngine::memory_watch) | a handle that reads the same from any thread |
/// |  | [`reset_peak_memory`](CudaEngine::reset_peak_memory) | makes every peak the figure now |
/// |  | [`record_allocations`](CudaEngine::record_allocations) | keeps the last allocations and frees with their callers' lines |
/// |  | [`allocation_history`](CudaEngine::allocation_history) | reads that history |
/// |  | [`staging_lease`](CudaEngine::staging_lease) | leases a staging slot, for a chunked pipeline built by hand |
/// |  | [`staging_config`](CudaEngine::staging_config) | the staging ring's settings |
/// |  | [`set_staging_config`](CudaEngine::set_staging_config) | changes the staging ring's settings |
/// |  | [`staging_stats`](CudaEngine::staging_stats) | the staging ring's counters |
/// | Transfers (host routes are the free functions [`upload_tensor`](crate::upload_tensor), [`download_tensor`](crate::download_tensor) and their pending forms; peers in [`peer`](crate::peer), ranks in [`collective`](crate::collective)) | [`copy_tensor`](CudaEngine::copy_tensor) | a device-to-device copy into a new tensor |
/// |  | [`copy_into`](CudaEngine::copy_into) | a device-to-device copy into an existing tensor |
/// | Compute: elementwise | [`add`](CudaEngine::add) | `a + b`, broadcasting |
/// |  | [`sub`](CudaEngine::sub) | `a - b`, broadcasting |
/// |  | [`mul`](CudaEngine::mul) | `a * b`, broadcasting |
/// |  | [`div`](CudaEngine::div) | `a / b` for float types, broadcasting |
/// |  | [`neg`](CudaEngine::neg) | `-a` |
/// |  | [`scale`](CudaEngine::scale) | `a * factor` |
/// |  | [`cast`](CudaEngine::cast) | every element converted with Rust's `as` |
/// |  | [`fill`](CudaEngine::fill) | writes one value into every element |
/// |  | [`full`](CudaEngine::full) | a new tensor with one value in every element |
/// |  | [`cached_kernels`](CudaEngine::cached_kernels) | how many elementwise kernels the engine has compiled |
/// | Compute: libraries | [`matmul`](CudaEngine::matmul) | the row-major product `a · b` (cuBLAS) |
/// |  | [`matmul_t`](CudaEngine::matmul_t) | `op(a) · op(b)`, each read as stored or transposed |
/// |  | [`linear`](CudaEngine::linear) | PyTorch's `x · wᵀ + bias` |
/// |  | [`gemm`](CudaEngine::gemm) | cuBLAS `gemm` in place, column-major, with alpha and beta |
/// |  | [`contract`](CudaEngine::contract) | a cuTENSOR contraction in Einstein notation |
/// |  | [`cholesky_solve`](CudaEngine::cholesky_solve) | solves `A·X = B` for a symmetric positive definite `A` (cuSOLVER) |
/// | Raw scopes and vendor handles | [`with_raw`](CudaEngine::with_raw) | runs a closure with the raw context, stream and pointers |
/// |  | [`with_cubecl`](CudaEngine::with_cubecl) | runs a closure with a CubeCL client on this device (feature `cubecl`) |
/// | Prepared graphs | [`prepare`](CudaEngine::prepare) | compiles a [`Program`](crate::graph::Program)'s kernels and captures its graphs |
/// |  | [`run`](CudaEngine::run) | runs a prepared program on new inputs |
/// | Sharing between processes | [`export_tensor`](CudaEngine::export_tensor) | makes a tensor shareable read-only with importer processes |
/// | Simulator (feature `sim`) | [`simulated`](CudaEngine::simulated) | opens an engine on a fresh simulated device |
/// |  | [`simulated_on`](CudaEngine::simulated_on) | opens another engine on an existing simulated device |
/// |  | [`simulated_on_device`](CudaEngine::simulated_on_device) | opens an engine on one device of a simulated machine |
/// |  | [`sim`](CudaEngine::sim) | the simulated device behind this engine: its clock, faults and accounting |
pub struct CudaEngine {
    pub(crate) shared: Arc<Shared>,
    /// The simulated machine the engine was opened on, if it was (its test handle).
    #[cfg(any(test, feature = "sim"))]
    sim: Option<crate::driver::sim::SimDevice>,
}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine")
            .field("device", &self.shared.device)
            .field("engine", &self.shared.engine_id)
            .finish()
    }
}

impl CudaEngine {
    /// Opens CUDA device `ordinal`: retains its primary context and creates the engine's
    /// streams.
    ///
    /// # Errors
    /// [`SetupError::NoDriver`](crate::error::SetupError::NoDriver) when the machine has no CUDA driver library, [`SetupError::NoSuchDevice`](crate::error::SetupError::NoSuchDevice)
    /// when the ordinal does not exist, [`Error::Driver`] when the driver refuses.
    pub fn open(ordinal: usize) -> Result<Self> {
        let driver = crate::driver::cuda::CudaDriver::open(ordinal)?;
        Ok(Self::from_driver(Box::new(driver)))
    }

    /// Opens an engine on a fresh simulated device (feature `sim`).
    #[cfg(any(test, feature = "sim"))]
    pub fn simulated(config: crate::driver::sim::SimConfig) -> Self {
        Self::simulated_on(&crate::driver::sim::SimDevice::new(config))
    }

    /// Opens another engine on an existing simulated device (feature `sim`), as
    /// [`open`](Self::open) twice with one ordinal opens two engines on one GPU.
    #[cfg(any(test, feature = "sim"))]
    pub fn simulated_on(device: &crate::driver::sim::SimDevice) -> Self {
        let driver = crate::driver::sim::SimDriver::new(device.clone());
        Self::from_driver(Box::new(driver)).on_machine(device)
    }

    /// Opens an engine on device `index` of a simulated machine of several devices (feature
    /// `sim`; [`SimConfig::devices`](crate::sim::SimConfig::devices)): the engines of one machine
    /// share its clock, so they can wait for each other's [`Signal`](crate::engine::Signal)s and, where
    /// the devices are linked, copy between each other.
    ///
    /// # Errors
    /// [`SetupError::NoSuchDevice`](crate::error::SetupError::NoSuchDevice) when the machine has no device `index`.
    #[cfg(any(test, feature = "sim"))]
    pub fn simulated_on_device(
        device: &crate::driver::sim::SimDevice,
        index: usize,
    ) -> Result<Self> {
        match crate::driver::sim::SimDriver::on(device.clone(), index) {
            Some(driver) => Ok(Self::from_driver(Box::new(driver)).on_machine(device)),
            None => Err(Error::Setup(crate::error::SetupError::NoSuchDevice {
                ordinal: index,
                count: device.devices(),
            })),
        }
    }

    fn from_driver(driver: Box<dyn Driver>) -> Self {
        let device = driver.device();
        let order = Order::default();
        let ledger = Ledger::default();
        CudaEngine {
            shared: Arc::new(Shared {
                engine_id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
                device,
                waits: driver.waits(),
                proven: Arc::clone(order.proven()),
                cells: Arc::clone(ledger.cells()),
                state: Mutex::new(State {
                    driver,
                    deferred: Vec::new(),
                    torn_down: false,
                    settled: false,
                    events: EventPool::default(),
                    retire: RetireQueue::default(),
                    released: Vec::new(),
                    order,
                    peers: Vec::new(),
                    parts: Parts::default(),
                    ledger,
                }),
                in_wake: Mutex::new(Vec::new()),
            }),
            #[cfg(any(test, feature = "sim"))]
            sim: None,
        }
    }

    /// Records the simulated machine the engine's driver runs on, for [`sim`](Self::sim).
    #[cfg(any(test, feature = "sim"))]
    fn on_machine(mut self, device: &crate::driver::sim::SimDevice) -> Self {
        self.sim = Some(device.clone());
        self
    }

    /// The number of CUDA devices on this machine.
    ///
    /// # Errors
    /// [`SetupError::NoDriver`](crate::error::SetupError::NoDriver) when the machine has no CUDA driver library.
    pub fn device_count() -> Result<usize> {
        crate::driver::cuda::device_count()
    }

    /// The device this engine drives.
    pub fn device(&self) -> DeviceId {
        self.shared.device
    }

    /// The device's name, as the driver reports it.
    pub fn device_name(&self) -> String {
        self.shared.lock().driver.name().to_owned()
    }

    /// A number unique to this engine among the engines of this process.
    pub fn id(&self) -> u64 {
        self.shared.engine_id
    }

    /// The simulated device behind this engine, if it is one (feature `sim`): advance its clock,
    /// inject faults and read its accounting through it.
    #[cfg(any(test, feature = "sim"))]
    pub fn sim(&self) -> Option<crate::driver::sim::SimDevice> {
        self.sim.clone()
    }

    pub(crate) fn enter(&mut self) -> Result<Entered<'_>> {
        self.shared.enter()
    }

    /// A submission boundary: reports failures queued since the last boundary without waiting
    /// for the device.
    ///
    /// It releases whatever the retirement queue has proven complete, reports failures recorded
    /// since the last boundary (refused frees in drops, detached work that
    /// [`synchronize`](Self::synchronize) or an allocation found failed), and asks the streams
    /// (without waiting) whether earlier work failed asynchronously. A detached transfer whose
    /// event query fails is not judged here: a single failed query is retried, and the verdict
    /// comes with the next `synchronize`.
    ///
    /// # Errors
    /// [`Error::Deferred`] for recorded failures, [`Error::DeviceFault`] when the device reports a
    /// failure of queued work.
    pub fn flush(&mut self) -> Result<()> {
        let shared = &*self.shared;
        shared.release_and_report(Poll::All)?;
        shared
            .waits
            .stream_query()
            .map_err(|source| Error::DeviceFault {
                what: "work queued on the engine's streams",
                source,
            })?;
        Ok(())
    }

    /// The host barrier: waits until everything queued on the engine's streams has completed,
    /// then reports any failure.
    ///
    /// The wait holds no lock: values of this engine used on other threads meanwhile are not
    /// blocked by it. After the wait it releases every retired record whose event proved
    /// completion; a record whose event reports a failure is retained and reported.
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when queued work failed, [`Error::Deferred`] for failures recorded
    /// since the last boundary.
    pub fn synchronize(&mut self) -> Result<()> {
        let shared = &*self.shared;
        let upto = shared.lock().order.positions();
        // A failed wait is reported first; failures recorded before it stay for the next
        // boundary rather than being lost behind it.
        shared
            .waits
            .stream_synchronize()
            .map_err(|source| Error::DeviceFault {
                what: "work queued on the engine's streams",
                source,
            })?;
        // What was queued before the wait is complete: later work needs no wait for it.
        shared.lock().order.settled(upto);
        shared.release_and_report(Poll::Settle)
    }

    /// The retirement queue's counters.
    pub fn retirement_stats(&self) -> RetirementStats {
        self.shared.lock().retire.stats()
    }

    /// How many events the engine has created (events are pooled and reused).
    pub fn events_created(&self) -> u64 {
        self.shared.lock().events.created()
    }

    /// How many cross-stream waits the engine has queued so far: one each time work on one of
    /// its streams had to follow work on another because they share a value (see the guide's
    /// rules chapter). Work on values no other stream touches queues none.
    pub fn stream_waits(&self) -> u64 {
        self.shared.lock().order.waits()
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        let shared = &*self.shared;
        // From here on values dropped elsewhere settle themselves instead of joining the queue.
        let upto = match shared.lock_for_drop() {
            Some(mut st) => {
                st.torn_down = true;
                st.order.positions()
            }
            None => return,
        };
        // Never panics, never reports. The wait holds no lock. If it fails, the device may
        // still touch memory that queued work names: every record stays in the queue, where it
        // is never released.
        let waited = shared.waits.stream_synchronize();
        let Some(mut guard) = shared.enter_for_drop() else {
            return;
        };
        let st = &mut *guard;
        if waited.is_err() {
            return;
        }
        // Everything queued before the wait is complete: frees from here on need no waits.
        st.settled = true;
        st.order.settled(upto);
        st.poll_retired(&*shared.waits, Poll::Settle);
        // Teardown never reports: refused frees leave their memory with the driver. First the
        // parts placed before the events (idle pinned memory), then the core's events, then the
        // driver's library handles and the rest of the parts: the streams are idle, so no kernel
        // or library call queued on them is pending.
        st.parts
            .teardown_before_events(&mut *st.driver, &mut st.ledger);
        let _ = st.events.destroy_all(&mut *st.driver);
        st.order.release(&mut *st.driver);
        st.driver.libraries_release();
        st.parts
            .teardown_after_events(&mut *st.driver, &mut st.ledger);
        // Released resources drop once the lock is gone; buffers among them are freed at once
        // since the engine is torn down.
    }
}
