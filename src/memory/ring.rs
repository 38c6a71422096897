//! The staging ring's state: the pinned chunks behind the blocking routes, their settings and
//! their counters.
//!
//! A blocking route moves ordinary (pageable) host memory. The device's copy engines only reach
//! the PCIe limit from page-locked memory, so the route stages through pinned chunks: host
//! threads copy a chunk into a pinned slot while the DMA of the previous chunk runs. The ring has
//! a fixed depth, so the blocking routes never hold more pinned staging memory than
//! `depth × chunk` bytes. The checkpoint routes (feature `safetensors`) stage through slots of
//! the same size up to a budget of their own (`staging_bytes`), and the ring keeps that many idle
//! for their next use. Leases taken by callers draw on a budget of their own (`ring_depth` at a
//! time), so leases held or forgotten by a caller never starve the routes.
//!
//! The ring is an engine part (`core::parts`): the engine holds it behind its lock, made on first
//! use, and frees its idle slots at teardown, right after the pinned pool's; it knows only the
//! driver seam and the part trait. Who may touch a slot's memory, and when, is the lease's
//! typestate (`lifecycle::lease`).

use crate::core::parts::{Part, Teardown};
use crate::driver::Driver;
use crate::error::{DriverError, Error, Result, StagingError, UsageError};
use crate::ledger::{Ledger, Owner};
use crate::sync::copy_pool::MAX_THREADS;
use std::panic::Location;
use std::ptr::NonNull;

/// The staging settings of an engine. Defaults were chosen by measurement; see
/// `docs/records/blocking-staging.md`. The default of
/// `copy_threads` follows the process's shared copy pool ([`copy_threads()`](crate::staging::copy_threads)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StagingConfig {
    /// Bytes per pinned staging chunk (one ring slot).
    pub chunk_bytes: usize,
    /// Slots in the ring: how many chunks may be in flight at once.
    pub ring_depth: usize,
    /// The most host-copy threads one transfer of this engine splits its host copies across.
    ///
    /// The threads themselves are one pool shared by every engine in the process (its size is
    /// [`copy_threads()`](crate::staging::copy_threads), set with
    /// [`set_copy_threads`](crate::staging::set_copy_threads) or `CUFERRY_COPY_THREADS`); this setting
    /// caps one engine's share of it: a transfer splits into at most
    /// `min(copy_threads, pool size)` parts. 1 to 256; a value above the pool's size is accepted
    /// and means the whole pool. Default: the pool's size when the settings are made, so a
    /// transfer may use every shared thread.
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
            copy_threads: crate::sync::copy_pool::copy_threads(),
            cutoff_bytes: 1 << 20,
        }
    }
}

impl StagingConfig {
    /// Checks every setting's range.
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |setting, value, reason| {
            Err(Error::Usage(UsageError::InvalidSetting {
                setting,
                value,
                reason,
            }))
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
        if self.copy_threads == 0 || self.copy_threads > MAX_THREADS {
            return bad(
                "copy_threads",
                self.copy_threads,
                "must be between 1 and 256 (a cap on the shared copy threads one transfer uses)",
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

impl Slot {
    /// The chunk's memory.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The chunk's size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Which budget a slot is drawn from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotKind {
    /// A chunk of the blocking routes' pipeline.
    Route,
    /// A chunk leased by a caller, as a [`StagingLease`](crate::staging::StagingLease).
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
    /// Of those, leased by callers as [`StagingLease`](crate::staging::StagingLease)s.
    pub user_leased: usize,
    /// Pinned bytes in chunk-sized slots.
    pub bytes: usize,
    /// Slots handed to the retirement queue by
    /// [`StagingLease::retire`](crate::staging::StagingLease::retire).
    pub retired: u64,
    /// Whether the 16-byte slot of the smallest band is allocated and idle.
    pub scalar_slot: bool,
}

/// The engine's staging ring: its settings, its idle slots, and the counts of slots out on each
/// budget. (The host-copy threads are the process's, in `sync::copy_pool`.)
#[derive(Default)]
pub(crate) struct StagingRing {
    config: StagingConfig,
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
    /// Idle slots kept beyond `ring_depth`: the most a file route (a checkpoint load or save)
    /// staged through, so the next one finds its slots made.
    reserve: usize,
}

impl Part for StagingRing {
    /// After the pinned pool, before the core's events.
    const TEARDOWN: Teardown = Teardown::BeforeEvents(1);

    /// Frees the idle slots and the scalar slot; a refused free leaves its memory with the
    /// driver.
    fn teardown(&mut self, driver: &mut dyn Driver, ledger: &mut Ledger) {
        let _ = self.free_idle(driver, ledger);
    }
}

impl StagingRing {
    /// The settings.
    pub(crate) fn config(&self) -> StagingConfig {
        self.config
    }

    /// Changes the settings (already validated). Idle slots of the old size are freed.
    ///
    /// # Errors
    /// The first refusal to free an idle slot (the settings change regardless).
    pub(crate) fn reconfigure(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
        config: StagingConfig,
    ) -> Result<()> {
        self.config = config;
        self.free_idle(driver, ledger)
    }

    /// The ring's counters.
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
    pub(crate) fn free_idle(&mut self, driver: &mut dyn Driver, ledger: &mut Ledger) -> Result<()> {
        let mut refused = Vec::new();
        self.free_idle_into(driver, ledger, &mut refused);
        refused.into_iter().next().map_or(Ok(()), Err)
    }

    /// As [`free_idle`](Self::free_idle), with every refusal put onto `refused` (for an
    /// allocation under pressure, which reports each at the next boundary).
    pub(crate) fn free_idle_into(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
        refused: &mut Vec<Error>,
    ) {
        let idle = std::mem::take(&mut self.idle);
        for slot in idle.into_iter().chain(self.scalar.take()) {
            if slot.kind != SlotKind::Scalar {
                self.slots -= 1;
            }
            refused.extend(free_slot(driver, ledger, slot, true).err());
        }
    }

    /// Whether the ring keeps an idle chunk-sized slot.
    pub(crate) fn has_idle(&self) -> bool {
        !self.idle.is_empty()
    }

    /// Keeps up to `slots` idle slots from now on (at least `ring_depth`), for a route that
    /// stages through that many: its next use finds them made.
    #[cfg(feature = "safetensors")]
    pub(crate) fn reserve(&mut self, slots: usize) {
        self.reserve = self.reserve.max(slots);
    }

    /// Counts a slot handed to the retirement queue by a lease.
    pub(crate) fn count_retired(&mut self) {
        self.retired += 1;
    }

    /// Takes a slot back from a lease. Returns a slot to free (outside the ring) when it is not
    /// kept.
    /// A slot kept is counted idle on `ledger`; one handed back stays counted in use until the
    /// caller frees it ([`free_slot`]).
    pub(crate) fn put(&mut self, ledger: &mut Ledger, slot: Slot, torn_down: bool) -> Option<Slot> {
        let here = Location::caller();
        match slot.kind {
            SlotKind::Scalar => {
                if torn_down || self.scalar.is_some() {
                    return Some(slot);
                }
                ledger.kept(Owner::Staging, slot.bytes, here);
                self.scalar = Some(slot);
                return None;
            }
            SlotKind::Route => self.route_out -= 1,
            SlotKind::User => self.user_out -= 1,
        }
        let keep = !torn_down
            && slot.bytes == self.config.chunk_bytes
            && self.idle.len() < self.config.ring_depth.max(self.reserve);
        if keep {
            ledger.kept(Owner::Staging, slot.bytes, here);
            self.idle.push(slot);
            None
        } else {
            self.slots -= 1;
            Some(slot)
        }
    }
}

/// Frees a slot's pinned memory, and counts it on `ledger` as given back: an idle slot's
/// (`idle`) or one in use. A refused free leaves the memory with the driver, still counted.
pub(crate) fn free_slot(
    driver: &mut dyn Driver,
    ledger: &mut Ledger,
    slot: Slot,
    idle: bool,
) -> Result<()> {
    // SAFETY: a slot comes back to the ring only from a proven lease (or a record whose event
    // proved completion), so nothing queued names its memory; it is freed once.
    unsafe { driver.host_free(slot.ptr.as_ptr()) }.map_err(Error::driver("cuMemFreeHost"))?;
    ledger.gave_back(Owner::Staging, slot.bytes, idle, Location::caller());
    Ok(())
}

fn new_slot(
    driver: &mut dyn Driver,
    ledger: &mut Ledger,
    bytes: usize,
    kind: SlotKind,
) -> Result<Slot> {
    let ptr = driver
        .host_alloc(bytes)
        .map_err(Error::driver("cuMemHostAlloc (staging)"))?;
    let ptr = NonNull::new(ptr).ok_or(Error::Driver {
        call: "cuMemHostAlloc (staging)",
        source: DriverError::OUT_OF_MEMORY,
    })?;
    ledger.allocated(Owner::Staging, bytes, Location::caller());
    // SAFETY: a fresh allocation of `bytes` bytes; zeroed once so its contents are initialised.
    unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
    Ok(Slot { ptr, bytes, kind })
}

impl StagingRing {
    /// Takes a chunk-sized slot for `kind`: an idle one, or a new one. User leases are limited
    /// to `ring_depth` at a time; the blocking routes bound their own depth.
    pub(crate) fn take_slot(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
        kind: SlotKind,
    ) -> Result<Slot> {
        if kind == SlotKind::User && self.user_out >= self.config.ring_depth {
            return Err(Error::Staging(StagingError::Exhausted {
                depth: self.config.ring_depth,
            }));
        }
        let mut slot = match self.idle.pop() {
            Some(slot) => {
                ledger.reused(Owner::Staging, slot.bytes, Location::caller());
                slot
            }
            None => {
                let slot = new_slot(driver, ledger, self.config.chunk_bytes, kind)?;
                self.slots += 1;
                slot
            }
        };
        slot.kind = kind;
        match kind {
            SlotKind::User => self.user_out += 1,
            _ => self.route_out += 1,
        }
        Ok(slot)
    }

    /// Takes the 16-byte scalar slot (made on first use).
    pub(crate) fn take_scalar(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
    ) -> Result<Slot> {
        match self.scalar.take() {
            Some(slot) => {
                ledger.reused(Owner::Staging, slot.bytes, Location::caller());
                Ok(slot)
            }
            None => new_slot(driver, ledger, 16, SlotKind::Scalar),
        }
    }
}
