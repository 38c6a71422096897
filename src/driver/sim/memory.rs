//! Device memory and page-locked host memory.
//!
//! Device memory lives in host memory here, one block per allocation, each at an address of its
//! own that is never reused. It is allocated at the call and released when its queued free runs;
//! an allocation that does not fit may take the memory of frees its driver has queued and the
//! device has not run yet, and its stream then waits for them, as CUDA's stream-ordered allocator
//! reuses memory. Host memory is page-locked either by allocating it pinned or by registering an
//! existing range; copies reach page-locked memory when they run, so neither may be freed nor
//! unregistered while a queued copy still names it: that is recorded as a violation and refused.

use super::{
    DevicePtr, DriverError, Job, Lane, SimDevice, SimDriver, SimOp, State, StreamId, Touch,
    Violation,
};
use std::alloc::Layout;

/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
pub(super) const HOST_MEMORY_ALREADY_REGISTERED: u32 = 712;
/// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
pub(super) const HOST_MEMORY_NOT_REGISTERED: u32 = 713;

impl SimDevice {
    /// Live pinned host allocations: (count, bytes).
    pub fn pinned_live(&self) -> (usize, usize) {
        let s = self.lock();
        (s.host.len(), s.host_used)
    }

    /// Live registered host ranges: (count, bytes).
    pub fn registered_live(&self) -> (usize, usize) {
        let s = self.lock();
        (s.registered.len(), s.registered_used)
    }

    /// Whether `ptr` is the start of a registered host range of this device.
    pub fn is_registered(&self, ptr: *const u8) -> bool {
        self.lock().registered.contains_key(&(ptr as usize))
    }

    /// Live device allocations: (count, bytes), counting frees that have run.
    pub fn device_live(&self) -> (usize, usize) {
        let s = self.lock();
        (s.mem.len(), s.device_used.iter().sum())
    }

    /// Whether `ptr` is the start of a live pinned host allocation of this device.
    pub fn is_pinned_live(&self, ptr: *const u8) -> bool {
        self.lock().host.contains_key(&(ptr as usize))
    }

    /// Reads device memory directly, bypassing the streams (for assertions in tests): the bytes
    /// the device holds now, as of the operations that have run.
    pub fn peek(&self, ptr: u64, bytes: usize) -> Option<Vec<u8>> {
        let s = self.lock();
        let (base, block) = s.mem.range(..=ptr).next_back()?;
        let off = usize::try_from(ptr - base).ok()?;
        block.get(off..off.checked_add(bytes)?).map(<[u8]>::to_vec)
    }
}

impl State {
    /// Releases the live block at `ptr` (a free that has run): its memory returns to its
    /// device. `false` when no block starts there.
    pub(super) fn release_block(&mut self, ptr: DevicePtr) -> bool {
        let Some(block) = self.mem.remove(&ptr) else {
            return false;
        };
        let device = self.touches.get(&ptr).map_or(0, |t| t.device);
        self.device_used[device] -= block.len();
        self.share.freed(ptr);
        true
    }

    /// The bytes of device memory at `ptr..ptr+bytes`, inside one live block.
    pub(super) fn block_mut(&mut self, ptr: DevicePtr, bytes: usize) -> Option<&mut [u8]> {
        let (base, block) = self.mem.range_mut(..=ptr).next_back()?;
        let off = usize::try_from(ptr - *base).ok()?;
        block.get_mut(off..off.checked_add(bytes)?)
    }

    /// Whether `addr..addr+bytes` lies inside one live pinned allocation or one registered range
    /// of this device: page-locked memory, which copies reach when they run.
    pub(super) fn is_page_locked(&self, addr: usize, bytes: usize) -> bool {
        let inside =
            |(&start, &len): (&usize, &usize)| start <= addr && addr + bytes <= start + len;
        self.host.iter().any(inside)
            || self
                .registered
                .range(..=addr)
                .next_back()
                .is_some_and(inside)
    }

    /// Whether a queued job, on any stream, touches host memory in `addr..addr+bytes`.
    fn names_host(&self, addr: usize, bytes: usize) -> bool {
        self.streams.values().flatten().any(|(_, job)| {
            job.host_range()
                .is_some_and(|(a, n)| a < addr + bytes && addr < a + n.max(1))
        })
    }

    /// Whether `addr..addr+bytes` overlaps page-locked memory of this device.
    fn overlaps_page_locked(&self, addr: usize, bytes: usize) -> bool {
        let overlaps =
            |(&start, &len): (&usize, &usize)| start < addr + bytes && addr < start + len;
        self.host.iter().any(overlaps) || self.registered.iter().any(overlaps)
    }

    /// Page-locked bytes: pinned allocations and registered ranges.
    fn page_locked_bytes(&self) -> usize {
        self.host_used + self.registered_used
    }

    /// The frees queued on `streams` and not yet run of blocks on device `index`: their bytes
    /// in all, and each one's stream and sequence number.
    fn queued_frees(
        &self,
        streams: impl IntoIterator<Item = StreamId>,
        index: usize,
    ) -> (usize, Vec<(StreamId, u64)>) {
        let mut bytes = 0;
        let mut frees = Vec::new();
        for stream in streams {
            for (seq, job) in self.streams.get(&stream).into_iter().flatten() {
                let Job::Free(ptr) = job else { continue };
                let on_device = self.touches.get(ptr).is_some_and(|t| t.device == index);
                if let (true, Some(block)) = (on_device, self.mem.get(ptr)) {
                    bytes += block.len();
                    frees.push((stream, *seq));
                }
            }
        }
        (bytes, frees)
    }

    /// Allocates `bytes` of pinned host memory, poisoned (the driver's `host_alloc`).
    pub(super) fn alloc_pinned(&mut self, bytes: usize) -> Result<*mut u8, DriverError> {
        self.enter(SimOp::HostAlloc)?;
        let bytes = bytes.max(1);
        if self.page_locked_bytes().saturating_add(bytes) > self.pinned_bytes {
            return Err(DriverError::OUT_OF_MEMORY);
        }
        let layout =
            Layout::from_size_align(bytes, 4096).map_err(|_| DriverError::INVALID_VALUE)?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(DriverError::OUT_OF_MEMORY);
        }
        // Poison fresh memory so nothing can pass by reading what it never wrote.
        // SAFETY: `ptr` is a fresh allocation of `bytes` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0xCD, bytes) };
        self.host.insert(ptr as usize, bytes);
        self.host_used += bytes;
        Ok(ptr)
    }

    /// Frees pinned host memory (the driver's `host_free`), unless a queued copy still names
    /// it: that is a violation, and the memory is kept.
    ///
    /// # Safety
    /// As `Driver::host_free`: `ptr` came from [`alloc_pinned`](Self::alloc_pinned) and is
    /// freed once.
    pub(super) unsafe fn free_pinned(&mut self, ptr: *mut u8) -> Result<(), DriverError> {
        self.enter(SimOp::HostFree)?;
        let addr = ptr as usize;
        let Some(&bytes) = self.host.get(&addr) else {
            self.violations
                .push(Violation::UnknownPinnedFree { ptr: addr });
            return Err(DriverError::INVALID_VALUE);
        };
        if self.names_host(addr, bytes) {
            // Keep the memory: freeing it would let the queued copy touch freed memory.
            self.violations
                .push(Violation::PinnedFreedUnderCopy { ptr: addr, bytes });
            return Ok(());
        }
        self.host.remove(&addr);
        self.host_used -= bytes;
        let layout =
            Layout::from_size_align(bytes, 4096).map_err(|_| DriverError::INVALID_VALUE)?;
        // SAFETY: `ptr` was allocated by `alloc_pinned` with this layout and is freed once (it was
        // just removed from the live set).
        unsafe { std::alloc::dealloc(ptr, layout) };
        Ok(())
    }

    /// Page-locks `ptr..ptr+bytes` (the driver's `host_register`).
    pub(super) fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<(), DriverError> {
        self.enter(SimOp::HostRegister)?;
        let addr = ptr as usize;
        if ptr.is_null() || bytes == 0 || addr.checked_add(bytes).is_none() {
            return Err(DriverError::INVALID_VALUE);
        }
        if self.overlaps_page_locked(addr, bytes) {
            return Err(DriverError::from_code(HOST_MEMORY_ALREADY_REGISTERED));
        }
        if self.page_locked_bytes().saturating_add(bytes) > self.pinned_bytes {
            return Err(DriverError::OUT_OF_MEMORY);
        }
        self.registered.insert(addr, bytes);
        self.registered_used += bytes;
        Ok(())
    }

    /// Unregisters the range registered at `ptr` (the driver's `host_unregister`), unless a
    /// queued copy still names it: that is a violation, and the range stays registered.
    pub(super) fn unregister_host(&mut self, ptr: *mut u8) -> Result<(), DriverError> {
        self.enter(SimOp::HostUnregister)?;
        let addr = ptr as usize;
        let Some(&bytes) = self.registered.get(&addr) else {
            self.violations
                .push(Violation::UnknownUnregister { ptr: addr });
            return Err(DriverError::from_code(HOST_MEMORY_NOT_REGISTERED));
        };
        if self.names_host(addr, bytes) {
            // Refuse: the caller then keeps the memory (leaks it) instead of freeing memory the
            // queued copy will still read or write.
            self.violations
                .push(Violation::UnregisteredUnderCopy { ptr: addr, bytes });
            return Err(DriverError::INVALID_VALUE);
        }
        self.registered.remove(&addr);
        self.registered_used -= bytes;
        Ok(())
    }
}

impl SimDriver {
    /// Allocates `bytes` on device `index` of the machine, ordered on this driver's `lane`.
    pub(super) fn alloc_on_device(
        &mut self,
        lane: Lane,
        index: usize,
        bytes: usize,
    ) -> Result<DevicePtr, DriverError> {
        let mut s = self.lock();
        s.enter_stream(SimOp::Alloc, self.stream(lane))?;
        if index >= s.device_used.len() {
            return Err(DriverError::INVALID_VALUE);
        }
        let stream = self.stream(lane);
        let mut after = Vec::new();
        if s.device_used[index].saturating_add(bytes) > s.memory_bytes {
            // As CUDA's stream-ordered allocator (whose pools allow reuse through internal
            // dependencies by default): memory that frees this driver has queued will release
            // may serve the allocation, which is then ordered after those frees.
            let (freeing, frees) = s.queued_frees(Lane::ALL.map(|l| self.stream(l)), index);
            if s.device_used[index].saturating_add(bytes) > s.memory_bytes.saturating_add(freeing) {
                return Err(DriverError::OUT_OF_MEMORY);
            }
            after = frees
                .into_iter()
                .filter(|&(on, _)| on != stream)
                .map(|(_, seq)| seq)
                .collect();
        }
        // Device memory lives in host memory here: an allocation the host cannot back is the
        // device's out-of-memory, not an abort.
        let mut block = Vec::new();
        if block.try_reserve_exact(bytes).is_err() {
            return Err(DriverError::OUT_OF_MEMORY);
        }
        // Poisoned, so a read before a write shows; filled a page at a time, which is a memory
        // copy even in an unoptimized test build (a byte-wise `resize` was most of the panic
        // sweep's time there).
        const POISON: [u8; 4096] = [0xA5; 4096];
        while block.len() < bytes {
            let n = (bytes - block.len()).min(POISON.len());
            block.extend_from_slice(&POISON[..n]);
        }
        // The allocating stream waits for the frees whose memory it takes (one queued on the
        // same stream runs first anyway).
        for for_seq in after {
            s.push(stream, Job::Wait { for_seq });
        }
        let ptr = s.next_addr;
        // Keep allocations 256-byte aligned and apart, as the real allocator does.
        s.next_addr += (bytes as u64).div_ceil(256).max(1) * 256 + 256;
        s.mem.insert(ptr, block);
        s.touches.insert(
            ptr,
            Touch {
                len: bytes,
                device: index,
                read: None,
                write: None,
            },
        );
        s.device_used[index] += bytes;
        // The allocation is this driver's process's: it alone may export it (`share.rs`).
        s.share.allocated(ptr, self.process.pid);
        Ok(ptr)
    }
}
