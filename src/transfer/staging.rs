//! Bounded pinned staging: the ring of chunks behind the blocking routes, and the
//! `StagingLease<Proven/Unproven>` typestate that makes its lifecycle a compile-time rule.
//!
//! A blocking route moves ordinary (pageable) host memory. The device's copy engines only reach
//! the PCIe limit from page-locked memory, so the route stages through pinned chunks: host
//! threads copy a chunk into a pinned slot while the DMA of the previous chunk runs. Each slot of
//! the per-engine ring has its own event; the ring has a fixed depth, so the engine never holds
//! more pinned staging memory than `depth × chunk` bytes.
//!
//! A [`StagingLease`] is the exclusive use of one slot. Its state says whether the slot's memory
//! may be touched:
//! - [`Proven`]: no queued copy names the slot. Its memory is reachable
//!   ([`as_bytes`](StagingLease::as_bytes), [`as_mut_bytes`](StagingLease::as_mut_bytes)), and it
//!   can be [`release`](StagingLease::release)d or used to begin a chunk.
//! - [`Unproven`]: a copy was queued. Nothing reaches the memory; the only ways out are
//!   [`end_chunk`](StagingLease::end_chunk) (wait for the slot's event: `Proven` again) and
//!   [`retire`](StagingLease::retire) (hand the slot, its event and any device resource to the
//!   retirement queue, which releases them once the event proves completion). Dropping an
//!   `Unproven` lease leaks its memory rather than free it.
//!
//! The lease is public so callers can build their own chunked pipelines.

use crate::driver::EventHandle;
use crate::element::Element;
use crate::engine::{CudaEngine, Shared, State};
use crate::error::{DriverError, Error, Result};
use crate::retire::Record;
use crate::tensor::DeviceTensor;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

/// The staging settings of an engine. Defaults were chosen by measurement on an H200 (PCIe
/// Gen5 x16, 16 host cores); see `docs/records/blocking-staging.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StagingConfig {
    /// Bytes per pinned staging chunk (one ring slot).
    pub chunk_bytes: usize,
    /// Slots in the ring: how many chunks may be in flight at once.
    pub ring_depth: usize,
    /// Host threads that copy into and out of staging chunks.
    pub copy_threads: usize,
    /// Transfers up to this many bytes go through one staged copy (one slot, no pipeline);
    /// larger ones through the pipeline.
    pub cutoff_bytes: usize,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            chunk_bytes: 16 << 20,
            ring_depth: 4,
            copy_threads: 12,
            cutoff_bytes: 1 << 20,
        }
    }
}

impl StagingConfig {
    fn validate(&self) -> Result<()> {
        let bad = |setting, value, reason| {
            Err(Error::InvalidSetting {
                setting,
                value,
                reason,
            })
        };
        if self.chunk_bytes < 4096 || self.chunk_bytes > 1 << 30 {
            return bad(
                "chunk_bytes",
                self.chunk_bytes,
                "must be between 4 KiB and 1 GiB",
            );
        }
        if self.ring_depth == 0 || self.ring_depth > 64 {
            return bad("ring_depth", self.ring_depth, "must be between 1 and 64");
        }
        if self.copy_threads == 0 || self.copy_threads > 256 {
            return bad(
                "copy_threads",
                self.copy_threads,
                "must be between 1 and 256",
            );
        }
        if self.cutoff_bytes > self.chunk_bytes {
            return bad(
                "cutoff_bytes",
                self.cutoff_bytes,
                "must not exceed chunk_bytes (a single staged copy uses one chunk)",
            );
        }
        Ok(())
    }
}

/// One ring slot: a pinned chunk and its event.
pub(crate) struct Slot {
    ptr: NonNull<u8>,
    bytes: usize,
    event: EventHandle,
    /// The 16-byte slot of the smallest band, outside the ring's accounting.
    scalar: bool,
}

// SAFETY: a slot is exclusively owned (by the ring or by one lease); its pointer is not aliased
// across threads without that ownership moving with it.
unsafe impl Send for Slot {}

/// Counters for the staging ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StagingStats {
    /// Slots allocated and owned by the ring (idle or leased).
    pub slots: usize,
    /// Slots currently leased.
    pub leased: usize,
    /// Pinned bytes owned by the ring.
    pub bytes: usize,
    /// Slots handed to the retirement queue (their replacements are allocated on demand).
    pub retired: u64,
    /// Whether the 16-byte slot of the smallest band is allocated and idle.
    pub scalar_slot: bool,
}

#[derive(Default)]
pub(crate) struct StagingRing {
    pub(crate) config: StagingConfig,
    idle: Vec<Slot>,
    slots: usize,
    leased: usize,
    retired: u64,
    /// The 16-byte pinned slot of the smallest band, with its own event.
    scalar: Option<Slot>,
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl StagingRing {
    pub(crate) fn stats(&self) -> StagingStats {
        StagingStats {
            slots: self.slots,
            leased: self.leased,
            bytes: self.slots * self.config.chunk_bytes,
            retired: self.retired,
            scalar_slot: self.scalar.is_some(),
        }
    }

    /// Frees idle slots (and the scalar slot); used at teardown after a successful wait and when
    /// the configuration changes.
    pub(crate) fn free_idle(&mut self, driver: &mut dyn crate::driver::Driver) {
        for slot in self.idle.drain(..) {
            free_slot(driver, slot);
            self.slots -= 1;
        }
        if let Some(slot) = self.scalar.take() {
            free_slot(driver, slot);
        }
    }

    /// Accounts for a slot leaving the ring for good (retired or leaked).
    fn forget_slot(&mut self, slot: &Slot) {
        if !slot.scalar {
            self.leased -= 1;
            self.slots -= 1;
        }
    }
}

fn free_slot(driver: &mut dyn crate::driver::Driver, slot: Slot) {
    // SAFETY: an idle slot's last copy was proven complete (leases only return `Proven`), so
    // nothing queued names its memory or event; both are freed once.
    unsafe {
        let _ = driver.host_free(slot.ptr.as_ptr());
        let _ = driver.event_destroy(slot.event);
    }
}

fn new_slot(st: &mut State, bytes: usize, scalar: bool) -> Result<Slot> {
    let ptr = st
        .driver
        .host_alloc(bytes)
        .map_err(Error::driver("cuMemHostAlloc (staging)"))?;
    let ptr = NonNull::new(ptr).ok_or(Error::Driver {
        call: "cuMemHostAlloc (staging)",
        source: DriverError::OUT_OF_MEMORY,
    })?;
    // SAFETY: a fresh allocation of `bytes` bytes; zeroed once so its contents are initialised.
    unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
    match st.driver.event_create() {
        Ok(event) => Ok(Slot {
            ptr,
            bytes,
            event,
            scalar,
        }),
        Err(source) => {
            // SAFETY: just allocated, never named by any copy.
            let _ = unsafe { st.driver.host_free(ptr.as_ptr()) };
            Err(Error::Driver {
                call: "cuEventCreate (staging)",
                source,
            })
        }
    }
}

impl State {
    /// Takes a ring slot: an idle one, or a new one while the ring is below its depth.
    fn take_slot(&mut self) -> Result<Slot> {
        if let Some(slot) = self.staging.idle.pop() {
            self.staging.leased += 1;
            return Ok(slot);
        }
        let depth = self.staging.config.ring_depth;
        if self.staging.slots >= depth {
            return Err(Error::StagingExhausted { depth });
        }
        let slot = new_slot(self, self.staging.config.chunk_bytes, false)?;
        self.staging.slots += 1;
        self.staging.leased += 1;
        Ok(slot)
    }

    /// The engine's host-copy thread pool, built on first use.
    pub(crate) fn copy_pool(&mut self) -> Result<Arc<rayon::ThreadPool>> {
        if let Some(pool) = &self.staging.pool {
            return Ok(Arc::clone(pool));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(self.staging.config.copy_threads)
            .thread_name(|i| format!("cuferry-copy-{i}"))
            .build()
            .map_err(|_| Error::InvalidSetting {
                setting: "copy_threads",
                value: self.staging.config.copy_threads,
                reason: "the host-copy threads could not be started",
            })?;
        let pool = Arc::new(pool);
        self.staging.pool = Some(Arc::clone(&pool));
        Ok(pool)
    }

    /// Takes the 16-byte scalar slot (made on first use).
    fn take_scalar(&mut self) -> Result<Slot> {
        match self.staging.scalar.take() {
            Some(slot) => Ok(slot),
            None => new_slot(self, 16, true),
        }
    }
}

mod sealed {
    pub trait LeaseState {}
}

/// The state of a [`StagingLease`]. Sealed: [`Proven`] or [`Unproven`].
pub trait LeaseState: sealed::LeaseState + Send + 'static {
    /// Whether a queued copy may still name the slot.
    const UNPROVEN: bool;
}

/// Lease state: no queued copy names the slot; its memory is reachable.
#[derive(Debug)]
pub enum Proven {}
/// Lease state: a copy was queued; the slot's memory is unreachable until proven.
#[derive(Debug)]
pub enum Unproven {}

impl sealed::LeaseState for Proven {}
impl sealed::LeaseState for Unproven {}
impl LeaseState for Proven {
    const UNPROVEN: bool = false;
}
impl LeaseState for Unproven {
    const UNPROVEN: bool = true;
}

/// The exclusive use of one pinned staging slot of an engine's ring, in state `S`.
///
/// Get one with [`CudaEngine::staging_lease`]. In state [`Proven`] no queued copy names the
/// slot: its memory is reachable and the lease can be released or begin a chunk. In state
/// [`Unproven`] a copy was queued: nothing reaches the memory, and the only ways out are
/// [`end_chunk`](StagingLease::end_chunk) (wait: `Proven` again) and
/// [`retire`](StagingLease::retire) (to the retirement queue). Dropping an `Unproven` lease leaks
/// its slot rather than free it.
#[must_use = "a lease holds a staging slot; release a proven lease, retire an unproven one"]
pub struct StagingLease<S: LeaseState> {
    /// `Some` until a transition or drop moves it out.
    slot: Option<Slot>,
    owner: Arc<Shared>,
    /// The error the slot's event reported, if `end_chunk` failed: retiring then retains the
    /// slot for good.
    failed: Option<DriverError>,
    _state: PhantomData<S>,
}

impl<S: LeaseState> std::fmt::Debug for StagingLease<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingLease")
            .field("unproven", &S::UNPROVEN)
            .field("capacity", &self.slot.as_ref().map_or(0, |s| s.bytes))
            .field("failed", &self.failed)
            .finish()
    }
}

/// A [`StagingLease::begin_upload`] or [`StagingLease::begin_download`] that failed. Either
/// nothing was queued, or the copy was queued and cannot be proven: there is no third outcome,
/// so a match on the two variants is exhaustive.
#[derive(Debug, thiserror::Error)]
pub enum BeginError {
    /// Nothing was queued: the lease comes back proven.
    #[error("staging chunk not queued: {error}")]
    NotQueued {
        /// The lease, still proven.
        lease: StagingLease<Proven>,
        /// What failed.
        error: Error,
    },
    /// The copy was queued but its event could not be recorded and the stream could not be
    /// proven idle: retire the lease.
    #[error("staging chunk queued but not provable; retire the lease: {error}")]
    Unproven {
        /// The lease, unproven.
        lease: StagingLease<Unproven>,
        /// What failed.
        error: Error,
    },
}

impl BeginError {
    /// The underlying error.
    pub fn error(&self) -> &Error {
        match self {
            BeginError::NotQueued { error, .. } | BeginError::Unproven { error, .. } => error,
        }
    }
}

impl<S: LeaseState> StagingLease<S> {
    fn with(slot: Slot, owner: Arc<Shared>, failed: Option<DriverError>) -> Self {
        StagingLease {
            slot: Some(slot),
            owner,
            failed,
            _state: PhantomData,
        }
    }

    fn take(mut self) -> (Slot, Arc<Shared>, Option<DriverError>) {
        let slot = self.slot.take().expect("a live lease holds its slot");
        (slot, Arc::clone(&self.owner), self.failed)
    }

    fn slot(&self) -> &Slot {
        self.slot.as_ref().expect("a live lease holds its slot")
    }

    /// The slot's size in bytes.
    pub fn capacity(&self) -> usize {
        self.slot().bytes
    }
}

impl StagingLease<Proven> {
    /// The slot's memory.
    pub fn as_bytes(&self) -> &[u8] {
        let slot = self.slot();
        // SAFETY: the slot is `bytes` long, exclusively leased, and no queued copy names it
        // (state `Proven`); its bytes are initialised: `new_slot` memory is zeroed on first lease
        // (`CudaEngine::staging_lease` and the routes write before they read).
        unsafe { std::slice::from_raw_parts(slot.ptr.as_ptr(), slot.bytes) }
    }

    /// The slot's memory, mutably.
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        let slot = self.slot();
        // SAFETY: as in `as_bytes`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(slot.ptr.as_ptr(), slot.bytes) }
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.slot().ptr.as_ptr()
    }

    /// Returns the slot to the ring.
    pub fn release(self) {
        drop(self); // a proven lease's drop returns it
    }

    /// Queues a copy of the slot's first `len` elements' bytes into `destination`, starting at
    /// element `offset`, records the slot's event, and yields the lease [`Unproven`].
    ///
    /// # Errors
    /// [`BeginError::NotQueued`] (lease back, proven) for a range outside the tensor or the slot,
    /// a tensor of another engine, or a refused enqueue; [`BeginError::Unproven`] when the copy
    /// was queued but cannot be tracked.
    pub fn begin_upload<T: Element>(
        self,
        engine: &mut CudaEngine,
        destination: &mut DeviceTensor<T>,
        offset: usize,
        len: usize,
    ) -> Result<StagingLease<Unproven>, BeginError> {
        self.begin(engine, destination, offset, len, true)
    }

    /// Queues a copy of `len` elements of `source`, starting at element `offset`, into the
    /// slot's first bytes, records the slot's event, and yields the lease [`Unproven`].
    ///
    /// # Errors
    /// As [`begin_upload`](Self::begin_upload).
    pub fn begin_download<T: Element>(
        self,
        engine: &mut CudaEngine,
        source: &DeviceTensor<T>,
        offset: usize,
        len: usize,
    ) -> Result<StagingLease<Unproven>, BeginError> {
        self.begin(engine, source, offset, len, false)
    }

    fn begin<T: Element>(
        self,
        engine: &mut CudaEngine,
        tensor: &DeviceTensor<T>,
        offset: usize,
        len: usize,
        upload: bool,
    ) -> Result<StagingLease<Unproven>, BeginError> {
        let size = T::DTYPE.size_bytes();
        let in_range = offset
            .checked_add(len)
            .is_some_and(|end| end <= tensor.len())
            && len * size <= self.capacity();
        if !in_range {
            let error = Error::LengthMismatch {
                what: "staging chunk range (offset + len) against the tensor length",
                left: offset.saturating_add(len),
                right: tensor.len(),
            };
            return Err(BeginError::NotQueued { lease: self, error });
        }
        if let Err(error) = tensor.check_engine(engine) {
            return Err(BeginError::NotQueued { lease: self, error });
        }
        let bytes = len * size;
        let device = tensor.raw_ptr() + (offset * size) as u64;
        let host = self.ptr();
        let mut st = match engine.enter() {
            Ok(st) => st,
            Err(error) => return Err(BeginError::NotQueued { lease: self, error }),
        };
        let queued = if upload {
            // SAFETY: the slot holds `bytes` bytes and becomes unreachable (state `Unproven`)
            // until its event proves the copy complete; the device range lies in the tensor,
            // whose free is stream-ordered after this copy.
            unsafe { st.driver.copy_htod(device, host, bytes) }
                .map_err(Error::driver("cuMemcpyHtoDAsync"))
        } else {
            // SAFETY: as above, in the other direction.
            unsafe { st.driver.copy_dtoh(host, device, bytes) }
                .map_err(Error::driver("cuMemcpyDtoHAsync"))
        };
        if let Err(error) = queued {
            drop(st);
            return Err(BeginError::NotQueued { lease: self, error });
        }
        let event = self.slot().event;
        match st.driver.event_record(event) {
            Ok(()) => {
                drop(st);
                let (slot, owner, _) = self.take();
                Ok(StagingLease::with(slot, owner, None))
            }
            Err(source) => {
                let error = Error::Driver {
                    call: "cuEventRecord (staging)",
                    source,
                };
                // Prove the untracked copy complete the hard way, or hand the lease back
                // unproven for retirement.
                let proven = st.driver.stream_synchronize();
                drop(st);
                let (slot, owner, _) = self.take();
                match proven {
                    Ok(()) => Err(BeginError::NotQueued {
                        lease: StagingLease::with(slot, owner, None),
                        error,
                    }),
                    Err(wait) => Err(BeginError::Unproven {
                        lease: StagingLease::with(slot, owner, Some(wait)),
                        error,
                    }),
                }
            }
        }
    }
}

impl StagingLease<Unproven> {
    /// Waits for the slot's event and yields the lease [`Proven`].
    ///
    /// # Errors
    /// When the wait fails, the lease comes back [`Unproven`] with the error: retire it (it is
    /// then retained for the engine's lifetime, since its event failed).
    pub fn end_chunk(self) -> Result<StagingLease<Proven>, (StagingLease<Unproven>, Error)> {
        let event = self.slot().event;
        let waited = match self.owner.enter() {
            Ok(mut st) => st.driver.event_synchronize(event).map_err(|source| {
                (
                    Some(source),
                    Error::DeviceFault {
                        what: "staging chunk",
                        source,
                    },
                )
            }),
            Err(e) => Err((None, e)),
        };
        let (slot, owner, _) = self.take();
        match waited {
            Ok(()) => Ok(StagingLease::with(slot, owner, None)),
            Err((source, error)) => Err((StagingLease::with(slot, owner, source), error)),
        }
    }

    /// Hands the slot and its event to the engine's retirement queue, which releases them once
    /// the event proves completion (or retains them for good if it reported an error). The ring
    /// allocates a replacement slot on demand.
    pub fn retire(self) {
        self.retire_with(());
    }

    /// As [`retire`](Self::retire), keeping `resource` (for example the device tensor the chunk
    /// was copying into) alive until the same proof.
    pub fn retire_with<R: Send + 'static>(self, resource: R) {
        let (slot, owner, failed) = self.take();
        let event = slot.event;
        let retired = RetiredSlot {
            ptr: slot.ptr,
            owner: Arc::clone(&owner),
        };
        let record = Record {
            event,
            resources: Box::new((retired, resource)),
            what: "staging chunk",
        };
        let mut st = owner.lock_raw();
        st.staging.forget_slot(&slot);
        st.staging.retired += 1;
        match failed {
            Some(error) => st.retire.retain_failed(record, error),
            None => st.retire.push(record),
        }
    }
}

/// A retired slot's memory: freed when its record is released (its event proved completion).
struct RetiredSlot {
    ptr: NonNull<u8>,
    owner: Arc<Shared>,
}

// SAFETY: exclusively owned memory that no host code touches; only freed, once.
unsafe impl Send for RetiredSlot {}

impl Drop for RetiredSlot {
    fn drop(&mut self) {
        if let Some(mut st) = self.owner.enter_for_drop() {
            // SAFETY: reached only when the record's event proved every copy naming the slot
            // complete (records with failed events are forgotten, never dropped).
            let _ = unsafe { st.driver.host_free(self.ptr.as_ptr()) };
        }
    }
}

impl<S: LeaseState> Drop for StagingLease<S> {
    fn drop(&mut self) {
        let Some(slot) = self.slot.take() else {
            return;
        };
        let mut st = self.owner.lock_raw();
        if S::UNPROVEN {
            // A copy may still name the slot: leak it, never free or reuse it.
            st.staging.forget_slot(&slot);
            return;
        }
        if slot.scalar && !st.torn_down && st.staging.scalar.is_none() {
            st.staging.scalar = Some(slot);
            return;
        }
        let fits = !slot.scalar && slot.bytes == st.staging.config.chunk_bytes && !st.torn_down;
        if fits {
            st.staging.leased -= 1;
            st.staging.idle.push(slot);
        } else {
            if !slot.scalar {
                st.staging.leased -= 1;
                st.staging.slots -= 1;
            }
            drop(st);
            if let Some(mut st) = self.owner.enter_for_drop() {
                free_slot(&mut *st.driver, slot);
            }
        }
    }
}

impl CudaEngine {
    /// Leases one slot of the engine's staging ring, for building a chunked pipeline by hand.
    ///
    /// # Errors
    /// [`Error::StagingExhausted`] when every slot is leased; [`Error::Driver`] when a new slot
    /// cannot be allocated.
    pub fn staging_lease(&mut self) -> Result<StagingLease<Proven>> {
        let slot = {
            let mut st = self.enter()?;
            st.take_slot()?
        };
        Ok(StagingLease::with(slot, Arc::clone(&self.shared), None))
    }

    /// Leases the 16-byte slot of the smallest band.
    pub(crate) fn scalar_lease(&mut self) -> Result<StagingLease<Proven>> {
        let slot = self.enter()?.take_scalar()?;
        Ok(StagingLease::with(slot, Arc::clone(&self.shared), None))
    }

    /// The engine's staging settings.
    pub fn staging_config(&self) -> StagingConfig {
        self.shared.lock_raw().staging.config
    }

    /// Changes the staging settings. Idle slots of the old size are freed; the copy threads are
    /// rebuilt on next use.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] for a value out of range (the settings are then unchanged).
    pub fn set_staging_config(&mut self, config: StagingConfig) -> Result<()> {
        config.validate()?;
        let mut st = self.enter()?;
        let st = &mut *st;
        st.staging.free_idle(&mut *st.driver);
        if st.staging.config.copy_threads != config.copy_threads {
            st.staging.pool = None;
        }
        st.staging.config = config;
        Ok(())
    }

    /// The staging ring's counters.
    pub fn staging_stats(&self) -> StagingStats {
        self.shared.lock_raw().staging.stats()
    }
}
