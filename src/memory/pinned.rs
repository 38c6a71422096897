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

use super::element::{Element, byte_len};
use super::host::{HostBuffer, sealed::HostMemory};
use super::pool::{Block, GRANULE, PinnedPool, PinnedPoolStats};
use super::pressure::Memory;
use crate::core::engine::{CudaEngine, Shared, State};
use crate::core::retire::Held;
use crate::device::DeviceId;
use crate::driver::Waits;
use crate::error::{DriverError, Error, Result, UsageError};
use std::marker::PhantomData;
use std::panic::Location;
use std::sync::Arc;

impl State {
    /// One attempt at a pinned block of at least `bytes`: from the pool, or freshly allocated
    /// with `capacity` bytes. `under_pressure` (the retry after an allocation ran out of memory
    /// and the retirement queue released what it had proven): a block that came back serves
    /// first, and otherwise the idle page-locked memory is freed before allocating.
    fn try_acquire_pinned(
        &mut self,
        waits: &dyn Waits,
        bytes: usize,
        capacity: usize,
        under_pressure: bool,
        at: &'static Location<'static>,
    ) -> Result<Block> {
        // A cheap poll: release the oldest detached records if they are done.
        self.release_completed_front(waits);
        let pool = self.parts.get_mut::<PinnedPool>();
        if let Some(block) = pool.reuse(&mut self.ledger, bytes, at) {
            return Ok(block);
        }
        if under_pressure {
            self.free_idle_pinned();
        }
        match self.parts.get_mut::<PinnedPool>().allocate(
            &mut *self.driver,
            &mut self.ledger,
            capacity,
            at,
        ) {
            Ok(Some(block)) => Ok(block),
            Ok(None) => Err(Error::Driver {
                call: "cuMemHostAlloc",
                source: DriverError::OUT_OF_MEMORY,
            }),
            Err(source) => Err(Error::Driver {
                call: "cuMemHostAlloc",
                source,
            }),
        }
    }
}

/// A pinned block of at least `bytes` for `engine`: from its pool, freshly allocated, or, when
/// allocation runs out of memory, after releasing completed retirement records and idle
/// page-locked memory (`memory::pressure`).
#[track_caller]
fn acquire_pinned(engine: &mut CudaEngine, bytes: usize) -> Result<Block> {
    let at = Location::caller();
    let capacity =
        bytes
            .checked_next_multiple_of(GRANULE)
            .ok_or(Error::Usage(UsageError::SizeOverflow {
                what: "pinned buffer",
                count: bytes,
                element_bytes: 1,
            }))?;
    let shared = &*engine.shared;
    let (_st, block) = shared.allocate(Memory::PageLocked, |st, under_pressure| {
        st.try_acquire_pinned(&*shared.waits, bytes, capacity, under_pressure, at)
    })?;
    Ok(block)
}

impl CudaEngine {
    /// The pinned pool's idle-byte budget: idle pinned memory beyond it is freed.
    pub fn pinned_pool_budget(&self) -> usize {
        self.pinned_pool_stats().budget_bytes
    }

    /// Sets the pinned pool's idle-byte budget and trims the pool to it at once. A free the
    /// driver refuses leaves that block pinned and unused, and is reported at the next `flush` or
    /// `synchronize`, like every refused free.
    ///
    /// # Errors
    /// [`Error::Driver`] when the engine's context cannot be made current.
    pub fn set_pinned_pool_budget(&mut self, bytes: usize) -> Result<()> {
        let mut st = self.enter()?;
        let st = &mut *st;
        st.parts.get_mut::<PinnedPool>().set_budget(
            &mut *st.driver,
            &mut st.ledger,
            bytes,
            &mut st.deferred,
        );
        Ok(())
    }

    /// Gives back every page-locked host block the engine keeps idle for reuse: the pinned
    /// pool's idle blocks and the staging ring's idle slots (their memory counted as
    /// `reserved` beyond `in_use` in [`memory`](Self::memory)). Memory in use stays; the next
    /// transfer that stages allocates its slots again. A free the driver refuses leaves that
    /// memory pinned, and is reported at the next `flush` or `synchronize`.
    ///
    /// # Errors
    /// [`Error::Driver`] when the engine's context cannot be made current.
    pub fn trim_host_memory(&mut self) -> Result<()> {
        self.enter()?.free_idle_pinned();
        Ok(())
    }

    /// The pinned pool's counters.
    pub fn pinned_pool_stats(&self) -> PinnedPoolStats {
        self.shared.lock().parts.get_mut::<PinnedPool>().stats()
    }
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
    /// [`UsageError::ZeroLength`](crate::error::UsageError::ZeroLength) for `len == 0`; [`UsageError::SizeOverflow`](crate::error::UsageError::SizeOverflow) for a size that cannot be
    /// addressed; [`Error::Driver`] when pinned memory cannot be allocated (out of memory: only
    /// after the memory of retired work the device has finished was released, the engine's
    /// idle pinned memory freed, and the allocation tried once more).
    #[track_caller]
    pub fn new(engine: &mut CudaEngine, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::Usage(UsageError::ZeroLength {
                what: "a pinned host buffer",
            }));
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
    #[track_caller]
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

    /// The start of the memory, for the transfer routes.
    pub(crate) fn raw_ptr(&self) -> *mut u8 {
        self.block().ptr()
    }
}

impl<T: Element> HostMemory for PinnedHostBuffer<T> {
    const KIND: &'static str = "pinned";

    fn host_ptr(&self) -> *mut u8 {
        self.raw_ptr()
    }

    fn host_len(&self) -> usize {
        self.len
    }

    fn host_engine(&self) -> (DeviceId, u64) {
        (self.owner.device, self.owner.engine_id)
    }

    fn page_locked_bytes(&self) -> u64 {
        self.block
            .as_ref()
            .map_or(0, |block| block.capacity() as u64)
    }
}

impl<T: Element> HostBuffer<T> for PinnedHostBuffer<T> {}

/// The block's bytes: the pinned pool's memory the buffer holds.
impl<T: Element> Held for PinnedHostBuffer<T> {
    fn held_bytes(&self) -> u64 {
        self.page_locked_bytes()
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
            st.parts.get_mut::<PinnedPool>().put(
                &mut *st.driver,
                &mut st.ledger,
                block,
                torn_down,
                &mut st.deferred,
            );
        }
    }
}
