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
//! - [`Unproven`]: a copy was queued and an event recorded after it (the slot is
//!   [fenced](crate::lifecycle)). Nothing reaches the memory; the ways out are
//!   [`end_chunk`](StagingLease::end_chunk) (wait for the event: `Proven` again) and
//!   [`retire`](StagingLease::retire) (hand the slot, and any device resource, to the retirement
//!   queue, which returns them once the event proves completion). Dropping an `Unproven` lease
//!   retires it.
//! - [`Untracked`]: a copy was queued but neither an event nor a stream synchronize could prove
//!   it complete. The only way out is [`retire`](StagingLease::retire), which retains the slot
//!   for the engine's lifetime: there is no `end_chunk` to call.
//!
//! The ring's slots serve the blocking routes; leases taken with [`CudaEngine::staging_lease`]
//! draw on a budget of their own (`ring_depth` at a time), so leases held or forgotten by a
//! caller never starve the blocking routes.
//!
//! The lease is public so callers can build their own chunked pipelines.

// A failed begin hands the lease back by value inside its error, as `TrySendError<T>` does.
#![allow(clippy::result_large_err)]

use crate::driver::Driver;
use crate::element::Element;
use crate::engine::{CudaEngine, Shared, State};
use crate::error::{DriverError, Error, Result};
use crate::lifecycle::fence::{fence, Fenced, Fencing, IdleEvent, Untracked as Unfenced};
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

/// One pinned staging chunk.
pub(crate) struct Slot {
    ptr: NonNull<u8>,
    bytes: usize,
    kind: SlotKind,
}

/// Which budget a slot is drawn from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotKind {
    /// A chunk of the blocking routes' pipeline.
    Route,
    /// A chunk leased by a caller through [`CudaEngine::staging_lease`].
    User,
    /// The 16-byte slot of the smallest band.
    Scalar,
}

// SAFETY: a slot is exclusively owned memory (by the ring or by one lease); its pointer is not
// aliased across threads without that ownership moving with it.
unsafe impl Send for Slot {}
// SAFETY: shared access to a slot only reads through `&self` (`StagingLease<Proven>::as_bytes`);
// every write needs `&mut`.
unsafe impl Sync for Slot {}

/// Counters for the staging ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StagingStats {
    /// Chunk-sized slots allocated (idle, leased, or in flight).
    pub slots: usize,
    /// Slots out of the ring: leased, in flight, or retained (a slot whose chunk could not be
    /// proven complete never comes back, and stays counted here).
    pub leased: usize,
    /// Of those, leased by callers through [`CudaEngine::staging_lease`].
    pub user_leased: usize,
    /// Pinned bytes in chunk-sized slots.
    pub bytes: usize,
    /// Slots handed to the retirement queue by [`StagingLease::retire`].
    pub retired: u64,
    /// Whether the 16-byte slot of the smallest band is allocated and idle.
    pub scalar_slot: bool,
}

#[derive(Default)]
pub(crate) struct StagingRing {
    pub(crate) config: StagingConfig,
    idle: Vec<Slot>,
    /// Chunk-sized slots allocated and not freed.
    slots: usize,
    /// Slots leased by the blocking routes.
    route_out: usize,
    /// Slots leased by callers.
    user_out: usize,
    retired: u64,
    /// The 16-byte pinned slot of the smallest band.
    scalar: Option<Slot>,
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl StagingRing {
    pub(crate) fn stats(&self) -> StagingStats {
        StagingStats {
            slots: self.slots,
            leased: self.route_out + self.user_out,
            user_leased: self.user_out,
            bytes: self.slots * self.config.chunk_bytes,
            retired: self.retired,
            scalar_slot: self.scalar.is_some(),
        }
    }

    /// Frees idle slots (and the scalar slot); used at teardown after a successful wait and when
    /// the configuration changes. Returns the first refusal.
    pub(crate) fn free_idle(&mut self, driver: &mut dyn Driver) -> Result<()> {
        let mut first = Ok(());
        let idle = std::mem::take(&mut self.idle);
        for slot in idle.into_iter().chain(self.scalar.take()) {
            if slot.kind != SlotKind::Scalar {
                self.slots -= 1;
            }
            let freed = free_slot(driver, slot);
            if first.is_ok() {
                first = freed;
            }
        }
        first
    }

    /// Takes a slot back from a lease. Returns a slot to free (outside the ring) when it is not
    /// kept.
    fn put(&mut self, slot: Slot, torn_down: bool) -> Option<Slot> {
        match slot.kind {
            SlotKind::Scalar => {
                if torn_down || self.scalar.is_some() {
                    return Some(slot);
                }
                self.scalar = Some(slot);
                return None;
            }
            SlotKind::Route => self.route_out -= 1,
            SlotKind::User => self.user_out -= 1,
        }
        let keep = !torn_down
            && slot.bytes == self.config.chunk_bytes
            && self.idle.len() < self.config.ring_depth;
        if keep {
            self.idle.push(slot);
            None
        } else {
            self.slots -= 1;
            Some(slot)
        }
    }
}

fn free_slot(driver: &mut dyn Driver, slot: Slot) -> Result<()> {
    // SAFETY: a slot comes back to the ring only from a proven lease (or a record whose event
    // proved completion), so nothing queued names its memory; it is freed once.
    unsafe { driver.host_free(slot.ptr.as_ptr()) }.map_err(Error::driver("cuMemFreeHost"))
}

fn new_slot(st: &mut State, bytes: usize, kind: SlotKind) -> Result<Slot> {
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
    Ok(Slot { ptr, bytes, kind })
}

impl State {
    /// Takes a chunk-sized slot for `kind`: an idle one, or a new one. User leases are limited
    /// to `ring_depth` at a time; the blocking routes bound their own depth.
    fn take_slot(&mut self, kind: SlotKind) -> Result<Slot> {
        if kind == SlotKind::User && self.staging.user_out >= self.staging.config.ring_depth {
            return Err(Error::StagingExhausted {
                depth: self.staging.config.ring_depth,
            });
        }
        let mut slot = match self.staging.idle.pop() {
            Some(slot) => slot,
            None => {
                let slot = new_slot(self, self.staging.config.chunk_bytes, kind)?;
                self.staging.slots += 1;
                slot
            }
        };
        slot.kind = kind;
        match kind {
            SlotKind::User => self.staging.user_out += 1,
            _ => self.staging.route_out += 1,
        }
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
            None => new_slot(self, 16, SlotKind::Scalar),
        }
    }
}

/// A slot out of the ring. Dropping it returns the slot to the ring; it is dropped only where
/// no queued copy names the slot (a proven lease, or a retired record whose event proved
/// completion).
pub struct LeasedSlot {
    slot: Option<Slot>,
    owner: Arc<Shared>,
}

impl LeasedSlot {
    fn slot(&self) -> &Slot {
        // Invariant: `slot` is `Some` until `drop`.
        self.slot
            .as_ref()
            .expect("a live leased slot holds its slot")
    }
}

impl Drop for LeasedSlot {
    fn drop(&mut self) {
        let Some(slot) = self.slot.take() else {
            return;
        };
        let Some(mut st) = self.owner.lock_for_drop() else {
            return; // leaked: sound
        };
        let torn_down = st.torn_down;
        let Some(slot) = st.staging.put(slot, torn_down) else {
            return;
        };
        drop(st);
        if let Some(mut st) = self.owner.enter_for_drop() {
            if let Err(error) = free_slot(&mut *st.driver, slot) {
                st.defer(error);
            }
        }
    }
}

mod sealed {
    /// What a lease in this state holds.
    pub trait LeaseState {
        type Hold: Send + Sync;
    }
}

/// The state of a [`StagingLease`]. Sealed: [`Proven`], [`Unproven`] or [`Untracked`].
pub trait LeaseState: sealed::LeaseState + Send + Sync + 'static {
    /// A name for messages.
    const NAME: &'static str;
}

/// Lease state: no queued copy names the slot; its memory is reachable.
#[derive(Debug)]
pub enum Proven {}
/// Lease state: a copy was queued and an event recorded after it; the slot's memory is
/// unreachable until [`end_chunk`](StagingLease::end_chunk) proves it complete.
#[derive(Debug)]
pub enum Unproven {}
/// Lease state: a copy was queued and nothing could prove it complete; the lease can only be
/// [`retire`](StagingLease::retire)d, which retains the slot for the engine's lifetime.
#[derive(Debug)]
pub enum Untracked {}

/// A proven lease's parts: the slot, and the idle event of its last chunk, reused by the next.
pub struct ProvenSlot {
    slot: LeasedSlot,
    event: Option<IdleEvent>,
}

impl sealed::LeaseState for Proven {
    type Hold = ProvenSlot;
}
impl sealed::LeaseState for Unproven {
    type Hold = Fenced<LeasedSlot>;
}
impl sealed::LeaseState for Untracked {
    type Hold = Unfenced<LeasedSlot>;
}
impl LeaseState for Proven {
    const NAME: &'static str = "proven";
}
impl LeaseState for Unproven {
    const NAME: &'static str = "unproven";
}
impl LeaseState for Untracked {
    const NAME: &'static str = "untracked";
}

/// The exclusive use of one pinned staging slot of an engine, in state `S`.
///
/// Get one with [`CudaEngine::staging_lease`]. In state [`Proven`] no queued copy names the
/// slot: its memory is reachable and the lease can be released or begin a chunk. In state
/// [`Unproven`] a copy was queued: nothing reaches the memory, and the ways out are
/// [`end_chunk`](StagingLease::end_chunk) (wait: `Proven` again) and
/// [`retire`](StagingLease::retire) (to the retirement queue; dropping does the same). In state
/// [`Untracked`] only `retire` remains.
#[must_use = "a lease holds a staging slot; release a proven lease, end or retire an unproven one"]
pub struct StagingLease<S: LeaseState> {
    hold: <S as sealed::LeaseState>::Hold,
    _state: PhantomData<S>,
}

impl<S: LeaseState> std::fmt::Debug for StagingLease<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingLease")
            .field("state", &S::NAME)
            .finish()
    }
}

/// A [`StagingLease::begin_upload`] or [`StagingLease::begin_download`] that failed. Either
/// nothing is in flight, or the copy was queued and nothing can prove it complete: there is no
/// third outcome, so a match on the two variants is exhaustive.
#[derive(Debug, thiserror::Error)]
pub enum BeginError {
    /// Nothing is in flight: nothing was queued, or the copy was queued and a stream synchronize
    /// proved it complete after its event could not be recorded. The lease comes back proven.
    #[error("staging chunk not queued: {error}")]
    NotQueued {
        /// The lease, proven.
        lease: StagingLease<Proven>,
        /// What failed.
        error: Error,
    },
    /// The copy was queued but its event could not be recorded and the stream could not be
    /// synchronized: the lease can only be retired.
    #[error("staging chunk queued but not provable; retire the lease: {error}")]
    Untracked {
        /// The lease, untracked.
        lease: StagingLease<Untracked>,
        /// What failed.
        error: Error,
    },
}

impl BeginError {
    /// The underlying error.
    pub fn error(&self) -> &Error {
        match self {
            BeginError::NotQueued { error, .. } | BeginError::Untracked { error, .. } => error,
        }
    }
}

impl<S: LeaseState> StagingLease<S> {
    fn new(hold: <S as sealed::LeaseState>::Hold) -> Self {
        StagingLease {
            hold,
            _state: PhantomData,
        }
    }
}

impl StagingLease<Proven> {
    fn from_slot(slot: Slot, owner: &Arc<Shared>, event: Option<IdleEvent>) -> Self {
        StagingLease::new(ProvenSlot {
            slot: LeasedSlot {
                slot: Some(slot),
                owner: Arc::clone(owner),
            },
            event,
        })
    }

    fn slot(&self) -> &Slot {
        self.hold.slot.slot()
    }

    /// The slot's size in bytes.
    pub fn capacity(&self) -> usize {
        self.slot().bytes
    }

    /// The slot's memory.
    pub fn as_bytes(&self) -> &[u8] {
        let slot = self.slot();
        // SAFETY: the slot is `bytes` long, exclusively leased, and no queued copy names it
        // (state `Proven`); its bytes are initialised (`new_slot` zeroes fresh memory).
        unsafe { std::slice::from_raw_parts(slot.ptr.as_ptr(), slot.bytes) }
    }

    /// The slot's memory, mutably.
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        let slot = self.slot();
        // SAFETY: as in `as_bytes`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(slot.ptr.as_ptr(), slot.bytes) }
    }

    /// Returns the slot to the ring.
    pub fn release(self) {
        drop(self); // the slot's drop returns it
    }

    /// Queues a copy of the slot's first `len` elements' bytes into `destination`, starting at
    /// element `offset`, records an event after it, and yields the lease [`Unproven`].
    ///
    /// # Errors
    /// [`BeginError::NotQueued`] (lease back, proven) for an empty or out-of-range chunk, a lease
    /// or tensor of another engine, or a refused enqueue; [`BeginError::Untracked`] when the copy
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
    /// slot's first bytes, records an event after it, and yields the lease [`Unproven`].
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

    /// Why a chunk of `len` elements at `offset` of `tensor` cannot be queued, if it cannot.
    fn refusal<T: Element>(
        &self,
        engine: &CudaEngine,
        tensor: &DeviceTensor<T>,
        offset: usize,
        len: usize,
    ) -> Option<Error> {
        let owners = engine
            .shared
            .check(&self.hold.slot.owner)
            .and_then(|()| engine.shared.check(tensor.owner()));
        if let Err(error) = owners {
            return Some(error);
        }
        if len == 0 {
            return Some(Error::ZeroLength {
                what: "a staging chunk",
            });
        }
        let size = T::DTYPE.size_bytes();
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > tensor.len()) {
            return Some(Error::InvalidArgument {
                operation: "staging chunk",
                detail: format!(
                    "elements {offset}..{offset}+{len} lie outside the tensor's {} element(s)",
                    tensor.len()
                ),
            });
        }
        if len.saturating_mul(size) > self.capacity() {
            return Some(Error::InvalidArgument {
                operation: "staging chunk",
                detail: format!(
                    "{len} element(s) of {size} byte(s) exceed the slot's {} bytes",
                    self.capacity()
                ),
            });
        }
        None
    }

    fn begin<T: Element>(
        self,
        engine: &mut CudaEngine,
        tensor: &DeviceTensor<T>,
        offset: usize,
        len: usize,
        upload: bool,
    ) -> Result<StagingLease<Unproven>, BeginError> {
        if let Some(error) = self.refusal(engine, tensor, offset, len) {
            return Err(BeginError::NotQueued { lease: self, error });
        }
        let size = T::DTYPE.size_bytes();
        let bytes = len * size;
        let device = tensor.raw_ptr() + (offset * size) as u64;
        let host = self.slot().ptr.as_ptr();
        let owner = &engine.shared;
        let mut st = match owner.enter() {
            Ok(st) => st,
            Err(error) => return Err(BeginError::NotQueued { lease: self, error }),
        };
        let queued = if upload {
            // SAFETY: the slot holds at least `bytes` bytes and is fenced below (unreachable
            // until its event proves the copy complete); the device range lies in the tensor,
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
        let ProvenSlot { slot, event } = self.hold;
        let event = event.map(IdleEvent::into_raw);
        match fence(&mut st, owner, slot, event, "staging chunk") {
            Fencing::Fenced(fenced) => Ok(StagingLease::new(fenced)),
            Fencing::Proven(slot, error) => Err(BeginError::NotQueued {
                lease: StagingLease::new(ProvenSlot { slot, event: None }),
                error,
            }),
            Fencing::Untracked(untracked, error) => Err(BeginError::Untracked {
                lease: StagingLease::new(untracked),
                error,
            }),
        }
    }
}

impl StagingLease<Unproven> {
    /// Waits for the chunk's event, holding no engine lock, and yields the lease [`Proven`].
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when the device reports a failure of the chunk (or of earlier
    /// work): the slot is then retained for the engine's lifetime, never reused, and stays
    /// counted as leased (against the caller's lease budget, for a caller's lease).
    pub fn end_chunk(self) -> Result<StagingLease<Proven>> {
        let (slot, event) = self.hold.wait_parts()?;
        Ok(StagingLease::new(ProvenSlot {
            slot,
            event: Some(event),
        }))
    }

    /// Hands the slot to the engine's retirement queue, which returns it to the ring once the
    /// chunk's event proves completion. Dropping the lease does the same.
    pub fn retire(self) {
        self.retire_with(());
    }

    /// As [`retire`](Self::retire), keeping `resource` (for example the device tensor the chunk
    /// was copying into) alive until the same proof.
    pub fn retire_with<R: Send + Sync + 'static>(self, resource: R) {
        if let Some(mut st) = self.hold.owner().lock_for_drop() {
            st.staging.retired += 1;
        }
        drop(self.hold.attach(resource));
    }
}

impl StagingLease<Untracked> {
    /// Retains the slot for the engine's lifetime: nothing proved the chunk complete, so the
    /// slot is never reused or freed. It stays counted as leased in
    /// [`staging_stats`](CudaEngine::staging_stats) and as retained in
    /// [`retirement_stats`](CudaEngine::retirement_stats).
    pub fn retire(self) {
        self.retire_with(());
    }

    /// As [`retire`](Self::retire), retaining `resource` with it.
    pub fn retire_with<R: Send + Sync + 'static>(self, resource: R) {
        if let Some(mut st) = self.hold.owner().lock_for_drop() {
            st.staging.retired += 1;
        }
        self.hold.attach(resource).retain();
    }
}

impl CudaEngine {
    /// Leases one staging slot of the engine, for building a chunked pipeline by hand.
    ///
    /// Callers' leases draw on a budget of their own, `ring_depth` at a time, so they never
    /// starve the blocking routes.
    ///
    /// # Errors
    /// [`Error::StagingExhausted`] when `ring_depth` leases are out; [`Error::Driver`] when a new
    /// slot cannot be allocated.
    pub fn staging_lease(&mut self) -> Result<StagingLease<Proven>> {
        self.lease(SlotKind::User)
    }

    /// Leases a slot of the blocking routes' pipeline.
    pub(crate) fn route_lease(&mut self) -> Result<StagingLease<Proven>> {
        self.lease(SlotKind::Route)
    }

    fn lease(&mut self, kind: SlotKind) -> Result<StagingLease<Proven>> {
        let slot = self.enter()?.take_slot(kind)?;
        Ok(StagingLease::from_slot(slot, &self.shared, None))
    }

    /// Leases the 16-byte slot of the smallest band.
    pub(crate) fn scalar_lease(&mut self) -> Result<StagingLease<Proven>> {
        let slot = self.enter()?.take_scalar()?;
        Ok(StagingLease::from_slot(slot, &self.shared, None))
    }

    /// The engine's staging settings.
    pub fn staging_config(&self) -> StagingConfig {
        self.shared.lock().staging.config
    }

    /// Changes the staging settings. Idle slots of the old size are freed; the copy threads are
    /// rebuilt on next use.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] for a value out of range (the settings are then unchanged);
    /// [`Error::Driver`] when the driver refuses to free an idle slot (the settings change).
    pub fn set_staging_config(&mut self, config: StagingConfig) -> Result<()> {
        config.validate()?;
        let mut st = self.enter()?;
        let st = &mut *st;
        if st.staging.config.copy_threads != config.copy_threads {
            st.staging.pool = None;
        }
        st.staging.config = config;
        st.staging.free_idle(&mut *st.driver)
    }

    /// The staging ring's counters.
    pub fn staging_stats(&self) -> StagingStats {
        self.shared.lock().staging.stats()
    }
}
