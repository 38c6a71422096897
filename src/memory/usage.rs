//! What an engine holds, asked of the engine: the snapshot by owner, a watch for other threads,
//! the peaks' reset and the allocation history.
//!
//! The figures are the ledger's (`crate::ledger`), which every allocation and free of the levels
//! above the core tells under the engine's lock; this module only hands them out. Reading them
//! takes no lock that a transfer holds: the snapshot copies the ledger's atomics and asks the
//! driver's waiting half for the device's figures.

use super::tensor::device_memory;
use crate::core::engine::{CudaEngine, Shared};
use crate::device::DeviceMemory;
use crate::ledger::{AllocationEvent, MemoryUse, MemoryWatch};
use std::sync::Arc;

impl Shared {
    /// The device's figures, when the driver can say: the pool's asked now, the device's free
    /// and total reused from a reading no older than the driver's
    /// [`device_figures_max_age`](crate::driver::Waits::device_figures_max_age) (on CUDA,
    /// `cuMemGetInfo` costs microseconds; on the simulator every snapshot asks).
    fn device_figures(&self) -> Option<DeviceMemory> {
        let max_age = self.waits.device_figures_max_age();
        if let Some((free, total)) = self.cells.recent_device(max_age) {
            let (pool_reserved, pool_in_use) = self.waits.pool_usage().ok()?;
            return Some(DeviceMemory {
                free,
                total,
                pool_reserved,
                pool_in_use,
            });
        }
        let report = self.waits.memory_report().ok()?;
        self.cells.device_read(report.free, report.total);
        Some(device_memory(report))
    }
}

impl CudaEngine {
    /// Every kind of memory the engine holds, device and host, by owner (tensors, workspaces,
    /// exports, imports, the pinned pool, the staging ring, registered memory, retired work),
    /// with peaks, beside the device's free and total memory and the engine's pool
    /// ([`MemoryUse`]; its `Display` is a table). Takes no lock that a transfer holds; to read it
    /// from another thread while this one drives the engine, take a
    /// [`memory_watch`](Self::memory_watch).
    ///
    /// The engine's own figures and the pool's are read at the call. The device's free and
    /// total memory come from `cuMemGetInfo`, which asks the kernel driver and costs several
    /// microseconds, so a snapshot reuses a reading up to a millisecond old;
    /// [`device_memory`](Self::device_memory) always asks.
    pub fn memory(&self) -> MemoryUse {
        let mut memory = self.shared.cells.read();
        memory.device = self.shared.device_figures();
        memory
    }

    /// A handle that reads this engine's memory from any thread
    /// ([`MemoryWatch::snapshot`]), without the engine and without a lock that a transfer
    /// holds: for a thread that reports a service's memory while another drives the engine.
    pub fn memory_watch(&self) -> MemoryWatch {
        let (device, reset) = (Arc::clone(&self.shared), Arc::clone(&self.shared));
        MemoryWatch {
            cells: Arc::clone(&self.shared.cells),
            device: Arc::new(move || device.device_figures()),
            reset: Arc::new(move || {
                // Refused inside a wake (as every engine call is): the lock may be held by a
                // thread that waits for the wake's callback.
                reset.enter()?.ledger.reset_peaks();
                Ok(())
            }),
        }
    }

    /// Makes every peak of [`memory`](Self::memory) the figure now, so later peaks cover only
    /// what comes after (as [`MemoryWatch::reset_peaks`]).
    pub fn reset_peak_memory(&mut self) {
        self.shared.lock().ledger.reset_peaks();
    }

    /// Keeps the engine's last `last` allocations and frees, with their size, owner and the
    /// caller's location, from now on; `0` turns the history off and forgets it (the default:
    /// off, where it costs one branch per allocation). An out-of-memory error then carries the
    /// history ([`OutOfMemory::history`](crate::error::OutOfMemory)), and
    /// [`allocation_history`](Self::allocation_history) reads it.
    ///
    /// The location is the caller's for the methods that allocate on a caller's behalf and
    /// track their caller ([`alloc_tensor`](Self::alloc_tensor),
    /// [`upload_tensor`](crate::upload_tensor), [`PinnedHostBuffer::new`](crate::PinnedHostBuffer::new),
    /// [`RegisteredBuffer::register`](crate::RegisteredBuffer::register), ...), and the crate's
    /// own line for memory a route or a drop takes or gives back.
    pub fn record_allocations(&mut self, last: usize) {
        self.shared.lock().ledger.record_history(last);
    }

    /// The allocations and frees the history keeps, oldest first; empty when it is off
    /// ([`record_allocations`](Self::record_allocations)).
    pub fn allocation_history(&self) -> Vec<AllocationEvent> {
        self.shared.lock().ledger.history()
    }
}
