//! The per-engine pool of pinned host blocks behind [`PinnedHostBuffer`](crate::PinnedHostBuffer).
//!
//! `cuMemHostAlloc` of 8 MiB takes milliseconds, far longer than the copy it enables, so blocks
//! are reused: a buffer's block comes back here when the buffer is dropped, and the pool keeps at
//! most a byte budget of idle memory, freeing the rest. The pool is an engine part
//! (`core::parts`): the engine holds it behind its lock, made on first use, and frees its idle
//! blocks first at teardown; the pool itself knows only the driver seam and the part trait.

use crate::core::parts::{Part, Teardown};
use crate::driver::Driver;
use crate::error::{DriverError, Error};
use crate::ledger::{Ledger, Owner};
use std::collections::BTreeMap;
use std::panic::Location;
use std::ptr::NonNull;

/// Pinned allocations are made in multiples of this, so nearby sizes share blocks.
pub(crate) const GRANULE: usize = 4096;

/// One pinned host allocation.
pub(crate) struct Block {
    ptr: NonNull<u8>,
    capacity: usize,
    /// How many leading bytes have been written at least once (fresh memory is uninitialised).
    pub(crate) init: usize,
}

// SAFETY: a block is exclusively owned memory (by the pool or by one buffer); the raw pointer is
// not aliased across threads without that ownership moving with it.
unsafe impl Send for Block {}
// SAFETY: shared access to a block only reads through `&self` (`PinnedHostBuffer::as_slice`,
// whose `T` is `Sync`); every write needs `&mut`.
unsafe impl Sync for Block {}

impl Block {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The block's size in bytes.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Counters for the pinned pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedPoolStats {
    /// Idle blocks kept for reuse.
    pub idle_blocks: usize,
    /// Bytes in idle blocks.
    pub idle_bytes: usize,
    /// Blocks handed out (in buffers, in flight, or retained).
    pub leased_blocks: usize,
    /// The idle-byte budget the pool trims to.
    pub budget_bytes: usize,
    /// Fresh `cuMemHostAlloc` calls made.
    pub allocations: u64,
    /// Requests served from idle blocks.
    pub reuses: u64,
    /// Blocks freed back to the driver.
    pub frees: u64,
    /// Frees the driver refused: that memory stays pinned, is never reused, and each refusal
    /// is reported at the next boundary.
    pub refused_frees: u64,
}

/// The engine's pinned host memory: idle blocks kept for reuse within a byte budget, and the
/// counters of [`PinnedPoolStats`].
pub(crate) struct PinnedPool {
    idle: BTreeMap<usize, Vec<Block>>,
    idle_bytes: usize,
    leased: usize,
    budget: usize,
    allocations: u64,
    reuses: u64,
    frees: u64,
    refused_frees: u64,
}

/// The default idle budget: enough for a deep staging ring and a few large pending buffers.
pub(crate) const DEFAULT_PINNED_BUDGET: usize = 1 << 30;

impl Default for PinnedPool {
    fn default() -> Self {
        PinnedPool {
            idle: BTreeMap::new(),
            idle_bytes: 0,
            leased: 0,
            budget: DEFAULT_PINNED_BUDGET,
            allocations: 0,
            reuses: 0,
            frees: 0,
            refused_frees: 0,
        }
    }
}

impl Part for PinnedPool {
    /// First: idle host memory goes before the core's events.
    const TEARDOWN: Teardown = Teardown::BeforeEvents(0);

    /// Frees every idle block; a refused free leaves its memory with the driver.
    fn teardown(&mut self, driver: &mut dyn Driver, ledger: &mut Ledger) {
        self.trim_to(driver, ledger, 0, &mut Vec::new());
    }
}

impl PinnedPool {
    /// The pool's counters.
    pub(crate) fn stats(&self) -> PinnedPoolStats {
        PinnedPoolStats {
            idle_blocks: self.idle.values().map(Vec::len).sum(),
            idle_bytes: self.idle_bytes,
            leased_blocks: self.leased,
            budget_bytes: self.budget,
            allocations: self.allocations,
            reuses: self.reuses,
            frees: self.frees,
            refused_frees: self.refused_frees,
        }
    }

    /// Leases the smallest idle block that holds `bytes`, if one is no more than twice that
    /// size.
    /// Counted on `ledger` as reused by the caller at `at`.
    pub(crate) fn reuse(
        &mut self,
        ledger: &mut Ledger,
        bytes: usize,
        at: &'static Location<'static>,
    ) -> Option<Block> {
        let limit = bytes.saturating_mul(2).max(GRANULE);
        let (&capacity, _) = self.idle.range(bytes..=limit).next()?;
        let list = self.idle.get_mut(&capacity)?;
        let block = list.pop()?;
        if list.is_empty() {
            self.idle.remove(&capacity);
        }
        self.idle_bytes -= capacity;
        self.reuses += 1;
        self.leased += 1;
        ledger.reused(Owner::Pinned, capacity, at);
        Some(block)
    }

    /// Leases a fresh block of `capacity` bytes (a multiple of [`GRANULE`]) from the driver.
    /// `Ok(None)` when the driver returned a null pointer.
    /// Counted on `ledger` as allocated by the caller at `at`.
    pub(crate) fn allocate(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
        capacity: usize,
        at: &'static Location<'static>,
    ) -> Result<Option<Block>, DriverError> {
        let Some(ptr) = NonNull::new(driver.host_alloc(capacity)?) else {
            return Ok(None);
        };
        self.allocations += 1;
        self.leased += 1;
        ledger.allocated(Owner::Pinned, capacity, at);
        Ok(Some(Block {
            ptr,
            capacity,
            init: 0,
        }))
    }

    /// Frees a block, idle (`idle`) or in use, and counts it on `ledger` as given back. A
    /// refusal leaves the memory with the driver (it is not counted as freed, and never reused)
    /// and is returned for the caller to report.
    fn free_block(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
        block: Block,
        idle: bool,
    ) -> Result<(), Error> {
        // SAFETY: idle blocks are owned by the pool alone and no queued copy names them: a block
        // only becomes idle when its buffer is dropped, which transfers make impossible while a
        // copy may still touch it.
        match unsafe { driver.host_free(block.ptr()) } {
            Ok(()) => {
                self.frees += 1;
                ledger.gave_back(Owner::Pinned, block.capacity, idle, Location::caller());
                Ok(())
            }
            Err(source) => {
                self.refused_frees += 1;
                Err(Error::Driver {
                    call: "cuMemFreeHost",
                    source,
                })
            }
        }
    }

    /// Frees idle blocks, largest first, until at most `target` idle bytes remain. Every
    /// refused free goes onto `refused`, for the caller to report; the trim goes on past it.
    pub(crate) fn trim_to(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
        target: usize,
        refused: &mut Vec<Error>,
    ) {
        while self.idle_bytes > target {
            let Some(mut entry) = self.idle.last_entry() else {
                break;
            };
            let block = entry.get_mut().pop();
            if entry.get().is_empty() {
                entry.remove();
            }
            if let Some(block) = block {
                self.idle_bytes -= block.capacity;
                refused.extend(self.free_block(driver, ledger, block, true).err());
            }
        }
    }

    /// Sets the idle budget and trims to it; refused frees go onto `refused`.
    pub(crate) fn set_budget(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
        budget: usize,
        refused: &mut Vec<Error>,
    ) {
        self.budget = budget;
        self.trim_to(driver, ledger, budget, refused);
    }

    /// Takes a block back. After teardown it is freed at once. Refused frees go onto `refused`.
    pub(crate) fn put(
        &mut self,
        driver: &mut dyn Driver,
        ledger: &mut Ledger,
        block: Block,
        torn_down: bool,
        refused: &mut Vec<Error>,
    ) {
        self.leased -= 1;
        if torn_down || block.capacity > self.budget {
            refused.extend(self.free_block(driver, ledger, block, false).err());
            return;
        }
        ledger.kept(Owner::Pinned, block.capacity, Location::caller());
        self.idle_bytes += block.capacity;
        self.idle.entry(block.capacity).or_default().push(block);
        self.trim_to(driver, ledger, self.budget, refused);
    }
}
