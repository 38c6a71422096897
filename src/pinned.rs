//! `PinnedHostBuffer<T>`: page-locked host memory drawn from a per-engine pool.
//!
//! Page-locked (pinned) memory is what the device's copy engines read and write directly, so it
//! is what makes a copy asynchronous and fast. It is also expensive to get: `cuMemHostAlloc` of
//! 8 MiB takes milliseconds, far longer than the copy it enables. So every buffer comes from the
//! engine's pool and goes back to it when dropped, and reuse is the default: a warm pool hands out
//! a buffer in microseconds. The pool keeps at most a byte budget of idle memory and frees the
//! rest.
//!
//! A buffer is handed to a transfer by value, so nothing can read or write it while a copy may
//! still touch it; it comes back from the transfer. Dropping it returns it to the pool, which is
//! only reachable once no copy can touch it.

use crate::driver::Waits;
use crate::element::{byte_len, Element};
use crate::engine::{CudaEngine, Shared, State};
use crate::error::{Error, Result};
use crate::lifecycle::retire::Poll;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

/// Pinned allocations are made in multiples of this, so nearby sizes share blocks.
const GRANULE: usize = 4096;

/// One pinned host allocation.
pub(crate) struct Block {
    ptr: NonNull<u8>,
    capacity: usize,
    /// How many leading bytes have been written at least once (fresh memory is uninitialised).
    init: usize,
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
    /// was reported at a boundary.
    pub refused_frees: u64,
}

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

impl PinnedPool {
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

    /// The smallest idle block that holds `bytes`, if one is no more than twice that size.
    fn take_idle(&mut self, bytes: usize) -> Option<Block> {
        let limit = bytes.saturating_mul(2).max(GRANULE);
        let (&capacity, _) = self.idle.range(bytes..=limit).next()?;
        let list = self.idle.get_mut(&capacity)?;
        let block = list.pop()?;
        if list.is_empty() {
            self.idle.remove(&capacity);
        }
        self.idle_bytes -= capacity;
        Some(block)
    }

    /// Frees a block. A refusal leaves the memory with the driver (it is not counted as freed,
    /// and never reused) and is returned for the caller to report.
    fn free_block(&mut self, driver: &mut dyn crate::driver::Driver, block: Block) -> Result<()> {
        // SAFETY: idle blocks are owned by the pool alone and no queued copy names them: a block
        // only becomes idle when its buffer is dropped, which transfers make impossible while a
        // copy may still touch it.
        match unsafe { driver.host_free(block.ptr()) } {
            Ok(()) => {
                self.frees += 1;
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

    /// Frees idle blocks, largest first, until at most `target` idle bytes remain. Returns the
    /// first refusal; the trim goes on past it.
    pub(crate) fn trim_to(
        &mut self,
        driver: &mut dyn crate::driver::Driver,
        target: usize,
    ) -> Result<()> {
        let mut first = Ok(());
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
                let freed = self.free_block(driver, block);
                if first.is_ok() {
                    first = freed;
                }
            }
        }
        first
    }

    pub(crate) fn set_budget(
        &mut self,
        driver: &mut dyn crate::driver::Driver,
        budget: usize,
    ) -> Result<()> {
        self.budget = budget;
        self.trim_to(driver, budget)
    }

    /// Takes a block back. After teardown it is freed at once. Returns a refused free.
    pub(crate) fn put(
        &mut self,
        driver: &mut dyn crate::driver::Driver,
        block: Block,
        torn_down: bool,
    ) -> Result<()> {
        self.leased -= 1;
        if torn_down || block.capacity > self.budget {
            return self.free_block(driver, block);
        }
        self.idle_bytes += block.capacity;
        self.idle.entry(block.capacity).or_default().push(block);
        self.trim_to(driver, self.budget)
    }
}

impl State {
    /// One attempt at a pinned block of at least `bytes`: from the pool, or freshly allocated.
    ///
    /// `Ok(None)` means the allocation failed on a first attempt: everything the retirement
    /// queue has proven is released (its blocks return to the pool once the lock is released)
    /// and the caller tries once more `under_pressure`, which takes from the pool first, then
    /// frees idle blocks to make room.
    fn try_acquire_pinned(
        &mut self,
        waits: &dyn Waits,
        bytes: usize,
        capacity: usize,
        under_pressure: bool,
    ) -> Result<Option<Block>> {
        // A cheap poll: release the oldest detached records if they are done.
        self.poll_retired(waits, Poll::Front);
        if let Some(block) = self.pinned.take_idle(bytes) {
            self.pinned.reuses += 1;
            self.pinned.leased += 1;
            return Ok(Some(block));
        }
        if under_pressure {
            if let Err(error) = self.pinned.trim_to(&mut *self.driver, 0) {
                self.defer(error);
            }
        }
        let ptr = match self.driver.host_alloc(capacity) {
            Ok(ptr) => NonNull::new(ptr),
            Err(_) if !under_pressure => {
                self.poll_retired(waits, Poll::All);
                return Ok(None);
            }
            Err(source) => {
                return Err(Error::Driver {
                    call: "cuMemHostAlloc",
                    source,
                })
            }
        };
        let Some(ptr) = ptr else {
            return Err(Error::Driver {
                call: "cuMemHostAlloc",
                source: crate::DriverError::OUT_OF_MEMORY,
            });
        };
        self.pinned.allocations += 1;
        self.pinned.leased += 1;
        Ok(Some(Block {
            ptr,
            capacity,
            init: 0,
        }))
    }
}

/// A pinned block of at least `bytes` for `engine`: from its pool, freshly allocated, or, when
/// allocation fails, after releasing completed retirement records and idle blocks.
fn acquire_pinned(engine: &mut CudaEngine, bytes: usize) -> Result<Block> {
    let capacity = bytes
        .checked_next_multiple_of(GRANULE)
        .ok_or(Error::SizeOverflow {
            what: "pinned buffer",
            count: bytes,
            element_bytes: 1,
        })?;
    let shared = &*engine.shared;
    for under_pressure in [false, true] {
        // Released records drop when the lock does: their buffers go back to the pool before
        // the second attempt.
        let outcome =
            shared
                .enter()?
                .try_acquire_pinned(&*shared.waits, bytes, capacity, under_pressure);
        if let Some(block) = outcome? {
            return Ok(block);
        }
    }
    Err(Error::Driver {
        call: "cuMemHostAlloc",
        source: crate::DriverError::OUT_OF_MEMORY,
    })
}

/// Page-locked host memory holding `len` elements of `T`, drawn from an engine's pool.
///
/// Fill and read it with [`as_mut_slice`](Self::as_mut_slice) and [`as_slice`](Self::as_slice)
/// while you hold it; hand it to [`upload_pending`](crate::upload_pending) or
/// [`download_pending`](crate::download_pending) by value, and it comes back from the transfer.
/// Dropping it returns the memory to the pool.
///
/// A fresh buffer's contents are unspecified but initialised (zeros, or whatever the last user of
/// the pooled memory left); a `bool` buffer always starts all `false`.
pub struct PinnedHostBuffer<T: Element> {
    block: Option<Block>,
    len: usize,
    owner: Arc<Shared>,
    _element: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for PinnedHostBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHostBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .finish()
    }
}

impl<T: Element> PinnedHostBuffer<T> {
    /// A pinned buffer of `len` elements from `engine`'s pool.
    ///
    /// # Errors
    /// [`Error::ZeroLength`] for `len == 0`; [`Error::SizeOverflow`] for a size that cannot be
    /// addressed; [`Error::Driver`] when pinned memory cannot be allocated.
    pub fn new(engine: &mut CudaEngine, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::ZeroLength {
                what: "a pinned host buffer",
            });
        }
        let bytes = byte_len::<T>(len, "pinned buffer")?;
        let mut block = acquire_pinned(engine, bytes)?;
        let start = if T::DTYPE.any_bit_pattern() {
            block.init
        } else {
            0
        };
        if start < bytes {
            // SAFETY: `start..bytes` lies inside the block, which this thread owns exclusively.
            unsafe { std::ptr::write_bytes(block.ptr().add(start), 0, bytes - start) };
        }
        block.init = block.init.max(bytes);
        Ok(PinnedHostBuffer {
            block: Some(block),
            len,
            owner: Arc::clone(&engine.shared),
            _element: PhantomData,
        })
    }

    /// A pinned buffer holding a copy of `data`.
    ///
    /// # Errors
    /// As [`PinnedHostBuffer::new`].
    pub fn from_slice(engine: &mut CudaEngine, data: &[T]) -> Result<Self> {
        let mut buffer = Self::new(engine, data.len())?;
        buffer.as_mut_slice().copy_from_slice(data);
        Ok(buffer)
    }

    fn block(&self) -> &Block {
        // Invariant: `block` is `Some` until `drop`.
        self.block.as_ref().expect("a live buffer holds its block")
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a pinned buffer holds at least one element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * T::DTYPE.size_bytes()
    }

    /// The contents.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: the block holds `len` elements' bytes, all initialised (`new` zeroes what was
        // never written), suitably aligned (page-aligned allocation), and valid `T` values: any
        // bit pattern for non-bool types, and only 0/1 bytes for bool (`new` zeroes bool buffers
        // and downloads into bool buffers are refused). Shared access follows `&self`.
        unsafe { std::slice::from_raw_parts(self.block().ptr().cast::<T>(), self.len) }
    }

    /// The contents, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`; exclusive access follows `&mut self`, and no copy can touch
        // the buffer while the caller holds it (transfers take it by value).
        unsafe { std::slice::from_raw_parts_mut(self.block().ptr().cast::<T>(), self.len) }
    }

    /// The engine whose pool the buffer came from.
    pub(crate) fn owner(&self) -> &Shared {
        &self.owner
    }

    /// The start of the memory, for the transfer routes.
    pub(crate) fn raw_ptr(&self) -> *mut u8 {
        self.block().ptr()
    }
}

impl<T: Element> Drop for PinnedHostBuffer<T> {
    fn drop(&mut self) {
        let Some(block) = self.block.take() else {
            return;
        };
        // The pool is an engine resource; taking it does not need the context current, but
        // freeing does, so enter the context.
        // When the context cannot be entered, the block is leaked (never freed).
        if let Some(mut st) = self.owner.enter_for_drop() {
            let st = &mut *st;
            let torn_down = st.torn_down;
            if let Err(error) = st.pinned.put(&mut *st.driver, block, torn_down) {
                st.defer(error);
            }
        }
    }
}
