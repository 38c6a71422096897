//! What memory an engine holds, by owner: counted where the engine allocates and frees it, and
//! read by anyone at any time without a lock that a transfer holds.
//!
//! Every path that takes memory from the driver or gives it back (a tensor's allocation and
//! free, a library's workspace, a pinned block or a staging slot leased, kept idle or given
//! back, a registration, an import, an export) does so under the engine's lock, and tells the
//! engine's [`Ledger`] there, naming the [`Owner`]. So the ledger has exactly one writer at a
//! time, and its figures can live in plain atomics behind a sequence lock ([`Cells`]): a reader
//! ([`CudaEngine::memory`](crate::CudaEngine::memory), a
//! [`MemoryWatch`](crate::engine::MemoryWatch) on another thread) copies them out whole,
//! retrying only when a write fell in the middle, and never waits for the engine's lock.
//!
//! The ledger also keeps, when asked ([`CudaEngine::record_allocations`]), the last allocations
//! and frees with the caller's location, for an out-of-memory error to show. Off, it costs one
//! branch per change.
//!
//! It sits at the base, below every level, because the errors carry what it reports (an
//! [`OutOfMemory`](crate::error::OutOfMemory) shows the engine's memory by owner and the
//! history) and every level from the core up writes it.
//!
//! [`CudaEngine::record_allocations`]: crate::CudaEngine::record_allocations

use crate::device::{DeviceMemory, human};
use std::collections::VecDeque;
use std::fmt;
use std::panic::Location;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering, fence};

/// Who holds memory an engine accounts for ([`MemoryUse`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Owner {
    /// Device memory of the engine's tensors: allocated tensors, uploads, outputs of kernels,
    /// libraries and prepared programs (with the blocks a prepared program keeps for its next
    /// run's outputs), checkpoints' tensors (small ones share a block), peer copies into this
    /// engine. Memory lent by another library (adopted through cudarc or DLPack) is that
    /// library's, not counted.
    Tensors,
    /// Device memory the engine allocates for a library call's workspace (cuSOLVER, cuTENSOR),
    /// freed, stream-ordered, when the call is queued. cuBLAS's own workspace is the library's
    /// and is not counted.
    Workspaces,
    /// Device memory of this engine exported to other processes: counted here from the export
    /// on, and until the last importer has unmapped it, after its tensor is gone too.
    Exported,
    /// Device memory another process exported, mapped here.
    Imported,
    /// Page-locked host memory of the pinned pool: [`PinnedHostBuffer`](crate::PinnedHostBuffer)s
    /// in use, and idle blocks kept for reuse.
    Pinned,
    /// Page-locked host memory of the staging ring: the slots of the blocking routes, leases
    /// and checkpoint loads, in use and idle.
    Staging,
    /// Host memory of the caller's page-locked in place
    /// ([`RegisteredBuffer`](crate::RegisteredBuffer)).
    Registered,
}

impl Owner {
    /// Every owner, device memory first.
    pub const ALL: [Owner; 7] = [
        Owner::Tensors,
        Owner::Workspaces,
        Owner::Exported,
        Owner::Imported,
        Owner::Pinned,
        Owner::Staging,
        Owner::Registered,
    ];

    /// Whether the owner's memory is the device's (else the host's).
    pub fn on_device(self) -> bool {
        matches!(
            self,
            Owner::Tensors | Owner::Workspaces | Owner::Exported | Owner::Imported
        )
    }

    /// The owner's name, as [`MemoryUse`]'s table prints it.
    pub fn name(self) -> &'static str {
        match self {
            Owner::Tensors => "tensors",
            Owner::Workspaces => "workspaces",
            Owner::Exported => "exported",
            Owner::Imported => "imported",
            Owner::Pinned => "pinned",
            Owner::Staging => "staging",
            Owner::Registered => "registered",
        }
    }

    const fn index(self) -> usize {
        match self {
            Owner::Tensors => 0,
            Owner::Workspaces => 1,
            Owner::Exported => 2,
            Owner::Imported => 3,
            Owner::Pinned => 4,
            Owner::Staging => 5,
            Owner::Registered => 6,
        }
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one owner holds, or the device or the host in all ([`MemoryUse`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holding {
    /// Bytes in live allocations: tensors, buffers and slots in use.
    pub in_use: u64,
    /// Bytes held from the driver: in use, and kept idle for reuse (the pinned pool's idle
    /// blocks, the staging ring's idle slots). Equal to `in_use` for the other owners.
    pub reserved: u64,
    /// Allocations in use: a pool's idle blocks and slots are not counted, and a block of
    /// small checkpoint tensors counts once.
    pub count: u64,
    /// The most `in_use` has been since the engine opened or since the last
    /// [`reset_peaks`](MemoryWatch::reset_peaks).
    pub peak_in_use: u64,
    /// The most `reserved` has been, over the same time.
    pub peak_reserved: u64,
}

/// Retired work: operations whose owner let go of them before their proof of completion (a
/// detached transfer, a dropped pending copy, a staging chunk), whose memory the engine releases
/// once the device proves them done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retired {
    /// Records waiting for their proof.
    pub records: u64,
    /// The bytes they hold, device and host (also counted under their owners).
    pub bytes: u64,
    /// Records whose work the device reported failed: held for the engine's life, never freed.
    pub retained: u64,
}

/// One snapshot of every kind of memory an engine holds, device and host, by owner, beside the
/// device's own figures: [`CudaEngine::memory`](crate::CudaEngine::memory) and
/// [`MemoryWatch::snapshot`].
///
/// Each figure is exact when no other thread changes the engine's memory meanwhile: the owners'
/// figures are copied out together, never half of one change. Its `Display` is a table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryUse {
    /// The device's free and total memory, and what the engine's pool holds of it; `None`
    /// when the driver could not say. The pool's figures are read with the snapshot; the
    /// device's free and total may come from a reading up to a millisecond old on CUDA, where
    /// asking costs microseconds ([`CudaEngine::device_memory`](crate::CudaEngine::device_memory)
    /// always asks).
    pub device: Option<DeviceMemory>,
    /// The engine's tensors ([`Owner::Tensors`]).
    pub tensors: Holding,
    /// Library workspaces ([`Owner::Workspaces`]).
    pub workspaces: Holding,
    /// Memory exported to other processes ([`Owner::Exported`]).
    pub exported: Holding,
    /// Memory imported from other processes ([`Owner::Imported`]).
    pub imported: Holding,
    /// The pinned pool ([`Owner::Pinned`]).
    pub pinned: Holding,
    /// The staging ring ([`Owner::Staging`]).
    pub staging: Holding,
    /// Registered host memory ([`Owner::Registered`]).
    pub registered: Holding,
    /// The device owners together, with their own peaks (the peak of a sum, not a sum of
    /// peaks).
    pub device_total: Holding,
    /// The host owners together, likewise.
    pub host_total: Holding,
    /// Work retired but not yet proven complete, and what it holds.
    pub retired: Retired,
    /// What NCCL's communicators hold. Always `None`: NCCL has no query for it (a
    /// communicator's buffers come from the driver directly, outside the engine's pool; the
    /// device's `free` falls by them).
    pub nccl: Option<Holding>,
}

impl MemoryUse {
    /// What `owner` holds.
    pub fn of(&self, owner: Owner) -> Holding {
        match owner {
            Owner::Tensors => self.tensors,
            Owner::Workspaces => self.workspaces,
            Owner::Exported => self.exported,
            Owner::Imported => self.imported,
            Owner::Pinned => self.pinned,
            Owner::Staging => self.staging,
            Owner::Registered => self.registered,
        }
    }

    fn owner_mut(&mut self, owner: Owner) -> &mut Holding {
        match owner {
            Owner::Tensors => &mut self.tensors,
            Owner::Workspaces => &mut self.workspaces,
            Owner::Exported => &mut self.exported,
            Owner::Imported => &mut self.imported,
            Owner::Pinned => &mut self.pinned,
            Owner::Staging => &mut self.staging,
            Owner::Registered => &mut self.registered,
        }
    }
}

impl fmt::Display for MemoryUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, name: &str, h: &Holding| {
            writeln!(
                f,
                "{name:<12} {:>11} {:>11} {:>11} {:>11} {:>7}",
                human(h.in_use),
                human(h.reserved),
                human(h.peak_in_use),
                human(h.peak_reserved),
                h.count
            )
        };
        writeln!(
            f,
            "{:<12} {:>11} {:>11} {:>11} {:>11} {:>7}",
            "", "in use", "reserved", "peak used", "peak held", "count"
        )?;
        for owner in Owner::ALL.iter().filter(|o| o.on_device()) {
            row(f, owner.name(), &self.of(*owner))?;
        }
        row(f, "device", &self.device_total)?;
        for owner in Owner::ALL.iter().filter(|o| !o.on_device()) {
            row(f, owner.name(), &self.of(*owner))?;
        }
        row(f, "host", &self.host_total)?;
        writeln!(
            f,
            "retired: {} record(s) holding {}, {} retained",
            self.retired.records,
            human(self.retired.bytes),
            self.retired.retained
        )?;
        match &self.device {
            Some(d) => write!(
                f,
                "device: {} free of {}; the engine's pool holds {}, {} in use",
                human(d.free),
                human(d.total),
                human(d.pool_reserved),
                human(d.pool_in_use)
            ),
            None => write!(f, "device: the driver could not report its memory"),
        }
    }
}

/// What one change to an engine's memory was ([`AllocationEvent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Change {
    /// Memory taken from the driver.
    Allocated,
    /// Memory given back to the driver (for device memory: its free queued, stream-ordered).
    Freed,
    /// An idle block or slot kept by a pool leased again.
    Reused,
    /// A block or slot back in its pool, idle, kept for reuse.
    Kept,
    /// An idle block or slot given back to the driver.
    Released,
    /// Memory that changed owner (a tensor exported): counted under the event's owner from
    /// here on.
    MovedFrom(Owner),
}

/// One allocation or free in an engine's allocation history
/// ([`CudaEngine::record_allocations`](crate::CudaEngine::record_allocations)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocationEvent {
    /// Its place in the engine's changes, counted from one since the history was turned on.
    pub sequence: u64,
    /// What happened.
    pub change: Change,
    /// Whose memory.
    pub owner: Owner,
    /// How many bytes.
    pub bytes: u64,
    /// Where: the caller's code for an allocation made through a method that tracks its caller
    /// (allocating, uploading, pinning, registering), else the crate's code that made the
    /// change (a drop's free, a route's staging).
    pub location: &'static Location<'static>,
}

impl fmt::Display for AllocationEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let change = match self.change {
            Change::Allocated => "allocated".to_owned(),
            Change::Freed => "freed".to_owned(),
            Change::Reused => "reused".to_owned(),
            Change::Kept => "kept idle".to_owned(),
            Change::Released => "released".to_owned(),
            Change::MovedFrom(from) => format!("moved from {from}"),
        };
        write!(
            f,
            "#{} {} {} {} at {}",
            self.sequence,
            self.owner,
            change,
            human(self.bytes),
            self.location
        )
    }
}

/// The lines of [`Cells`]: one per owner, then the device's and the host's totals.
const LINES: usize = 9;
const DEVICE: usize = 7;
const HOST: usize = 8;

/// One [`Holding`] as atomics.
#[derive(Default)]
struct Line {
    in_use: AtomicU64,
    reserved: AtomicU64,
    count: AtomicU64,
    peak_in_use: AtomicU64,
    peak_reserved: AtomicU64,
}

impl Line {
    fn read(&self) -> Holding {
        Holding {
            in_use: self.in_use.load(Ordering::Relaxed),
            reserved: self.reserved.load(Ordering::Relaxed),
            count: self.count.load(Ordering::Relaxed),
            peak_in_use: self.peak_in_use.load(Ordering::Relaxed),
            peak_reserved: self.peak_reserved.load(Ordering::Relaxed),
        }
    }

    /// Applies one change. Only the ledger's one writer calls it, inside a write of the
    /// sequence lock, so plain loads and stores suffice. Every step takes back what an earlier
    /// one added, so no figure goes below zero (a debug build checks).
    fn apply(&self, in_use: i64, reserved: i64, count: i64) {
        let step = |cell: &AtomicU64, delta: i64| {
            let value = cell.load(Ordering::Relaxed).wrapping_add_signed(delta);
            debug_assert!(value <= i64::MAX as u64, "a figure below zero");
            cell.store(value, Ordering::Relaxed);
            value
        };
        let used = step(&self.in_use, in_use);
        let held = step(&self.reserved, reserved);
        step(&self.count, count);
        let peak = self.peak_in_use.load(Ordering::Relaxed).max(used);
        self.peak_in_use.store(peak, Ordering::Relaxed);
        let peak = self.peak_reserved.load(Ordering::Relaxed).max(held);
        self.peak_reserved.store(peak, Ordering::Relaxed);
    }

    fn reset_peaks(&self) {
        let used = self.in_use.load(Ordering::Relaxed);
        let held = self.reserved.load(Ordering::Relaxed);
        self.peak_in_use.store(used, Ordering::Relaxed);
        self.peak_reserved.store(held, Ordering::Relaxed);
    }
}

/// The ledger's figures, shared with its readers: atomics behind a sequence lock whose one
/// writer is the engine's [`Ledger`].
#[derive(Default)]
pub(crate) struct Cells {
    /// Odd while a write is under way; each write adds two.
    sequence: AtomicU64,
    lines: [Line; LINES],
    retired_records: AtomicU64,
    retired_bytes: AtomicU64,
    retained: AtomicU64,
    /// The device's free and total memory as last read by a snapshot, and when (nanoseconds
    /// after `opened`, plus one; zero: never), for a snapshot that may reuse a recent reading.
    device_free: AtomicU64,
    device_total: AtomicU64,
    device_read: AtomicU64,
    opened: OnceInstant,
}

/// The instant the cells were made.
struct OnceInstant(std::time::Instant);

impl Default for OnceInstant {
    fn default() -> Self {
        OnceInstant(std::time::Instant::now())
    }
}

impl Cells {
    /// The device's free and total memory as read within `max_age`, if a snapshot read them
    /// that recently. Racing readings may mix one reading's free with another's time: both
    /// are recent.
    pub(crate) fn recent_device(&self, max_age: std::time::Duration) -> Option<(u64, u64)> {
        let read = self.device_read.load(Ordering::Acquire);
        if read == 0 || max_age.is_zero() {
            return None;
        }
        let age = (self.opened.0.elapsed().as_nanos() as u64).saturating_sub(read - 1);
        (age <= max_age.as_nanos() as u64).then(|| {
            (
                self.device_free.load(Ordering::Relaxed),
                self.device_total.load(Ordering::Relaxed),
            )
        })
    }

    /// Keeps a reading of the device's free and total memory, made now.
    pub(crate) fn device_read(&self, free: u64, total: u64) {
        self.device_free.store(free, Ordering::Relaxed);
        self.device_total.store(total, Ordering::Relaxed);
        let now = self.opened.0.elapsed().as_nanos() as u64 + 1;
        self.device_read.store(now, Ordering::Release);
    }

    /// Every figure, copied out between two writes (never half of one). Takes no lock: a reader
    /// that meets a write under way tries again.
    pub(crate) fn read(&self) -> MemoryUse {
        loop {
            let before = self.sequence.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let mut memory = MemoryUse::default();
            for owner in Owner::ALL {
                *memory.owner_mut(owner) = self.lines[owner.index()].read();
            }
            memory.device_total = self.lines[DEVICE].read();
            memory.host_total = self.lines[HOST].read();
            memory.retired = Retired {
                records: self.retired_records.load(Ordering::Relaxed),
                bytes: self.retired_bytes.load(Ordering::Relaxed),
                retained: self.retained.load(Ordering::Relaxed),
            };
            // Orders the loads above before the check below: a write that began meanwhile
            // shows in the sequence.
            fence(Ordering::Acquire);
            if self.sequence.load(Ordering::Relaxed) == before {
                return memory;
            }
        }
    }
}

/// The last allocations and frees, when the history is on.
struct History {
    capacity: usize,
    events: VecDeque<AllocationEvent>,
    next: u64,
}

/// The writing half of an engine's accounting: held in the engine's locked state, so there is
/// one writer at a time; its [`Cells`] are read from anywhere.
#[derive(Default)]
pub(crate) struct Ledger {
    cells: Arc<Cells>,
    history: Option<History>,
}

impl Ledger {
    /// The figures, for readers.
    pub(crate) fn cells(&self) -> &Arc<Cells> {
        &self.cells
    }

    /// One write of the sequence lock around `change`.
    fn write(&mut self, change: impl FnOnce(&Cells)) {
        let cells = &*self.cells;
        let sequence = cells.sequence.load(Ordering::Relaxed);
        cells
            .sequence
            .store(sequence.wrapping_add(1), Ordering::Relaxed);
        // Orders the odd sequence before the figures' stores: a reader that sees any of them
        // sees the write under way.
        fence(Ordering::Release);
        change(cells);
        cells
            .sequence
            .store(sequence.wrapping_add(2), Ordering::Release);
    }

    /// Applies a change of `owner`'s figures and its total's, and records it in the history.
    fn change(
        &mut self,
        owner: Owner,
        (in_use, reserved, count): (i64, i64, i64),
        change: Change,
        bytes: u64,
        at: &'static Location<'static>,
    ) {
        let total = if owner.on_device() { DEVICE } else { HOST };
        self.write(|cells| {
            cells.lines[owner.index()].apply(in_use, reserved, count);
            cells.lines[total].apply(in_use, reserved, count);
        });
        if let Some(history) = &mut self.history {
            history.push(change, owner, bytes, at);
        }
    }

    /// `bytes` taken from the driver for `owner`, in use.
    pub(crate) fn allocated(&mut self, owner: Owner, bytes: usize, at: &'static Location<'static>) {
        let b = signed(bytes);
        self.change(owner, (b, b, 1), Change::Allocated, bytes as u64, at);
    }

    /// `bytes` of `owner` in use given back to the driver.
    pub(crate) fn freed(&mut self, owner: Owner, bytes: usize, at: &'static Location<'static>) {
        let b = signed(bytes);
        self.change(owner, (-b, -b, -1), Change::Freed, bytes as u64, at);
    }

    /// An idle block or slot of `owner`'s pool, `bytes` long, leased again.
    pub(crate) fn reused(&mut self, owner: Owner, bytes: usize, at: &'static Location<'static>) {
        let b = signed(bytes);
        self.change(owner, (b, 0, 1), Change::Reused, bytes as u64, at);
    }

    /// A block or slot of `owner`'s pool, `bytes` long, back in the pool, idle.
    pub(crate) fn kept(&mut self, owner: Owner, bytes: usize, at: &'static Location<'static>) {
        let b = signed(bytes);
        self.change(owner, (-b, 0, -1), Change::Kept, bytes as u64, at);
    }

    /// An idle block or slot of `owner`'s pool, `bytes` long, given back to the driver.
    pub(crate) fn released(&mut self, owner: Owner, bytes: usize, at: &'static Location<'static>) {
        let b = signed(bytes);
        self.change(owner, (0, -b, 0), Change::Released, bytes as u64, at);
    }

    /// A block or slot of `owner`'s pool, `bytes` long, given back to the driver: an idle one
    /// ([`released`](Self::released)) or one in use ([`freed`](Self::freed)).
    pub(crate) fn gave_back(
        &mut self,
        owner: Owner,
        bytes: usize,
        idle: bool,
        at: &'static Location<'static>,
    ) {
        if idle {
            self.released(owner, bytes, at);
        } else {
            self.freed(owner, bytes, at);
        }
    }

    /// One live allocation of `bytes` moved from `from` to `to`.
    pub(crate) fn moved(
        &mut self,
        from: Owner,
        to: Owner,
        bytes: usize,
        at: &'static Location<'static>,
    ) {
        let b = signed(bytes);
        let (lines, totals) = ((from.index(), to.index()), (total_of(from), total_of(to)));
        self.write(|cells| {
            cells.lines[lines.0].apply(-b, -b, -1);
            cells.lines[totals.0].apply(-b, -b, -1);
            cells.lines[lines.1].apply(b, b, 1);
            cells.lines[totals.1].apply(b, b, 1);
        });
        if let Some(history) = &mut self.history {
            history.push(Change::MovedFrom(from), to, bytes as u64, at);
        }
    }

    /// The retirement queue's records now: waiting, the bytes they hold, and retained.
    pub(crate) fn retired(&mut self, records: usize, bytes: u64, retained: usize) {
        self.write(|cells| {
            cells
                .retired_records
                .store(records as u64, Ordering::Relaxed);
            cells.retired_bytes.store(bytes, Ordering::Relaxed);
            cells.retained.store(retained as u64, Ordering::Relaxed);
        });
    }

    /// Makes every peak the figure now.
    pub(crate) fn reset_peaks(&mut self) {
        self.write(|cells| cells.lines.iter().for_each(Line::reset_peaks));
    }

    /// Keeps the last `capacity` changes from now on (`0`: none, and forgets those kept).
    pub(crate) fn record_history(&mut self, capacity: usize) {
        self.history = (capacity > 0).then(|| History {
            capacity,
            events: VecDeque::with_capacity(capacity.min(1 << 16)),
            next: 1,
        });
    }

    /// The changes kept, oldest first; empty when the history is off.
    pub(crate) fn history(&self) -> Vec<AllocationEvent> {
        self.history
            .as_ref()
            .map(|history| history.events.iter().copied().collect())
            .unwrap_or_default()
    }
}

impl History {
    fn push(&mut self, change: Change, owner: Owner, bytes: u64, at: &'static Location<'static>) {
        if self.events.len() == self.capacity {
            self.events.pop_front();
        }
        self.events.push_back(AllocationEvent {
            sequence: self.next,
            change,
            owner,
            bytes,
            location: at,
        });
        self.next += 1;
    }
}

fn total_of(owner: Owner) -> usize {
    if owner.on_device() { DEVICE } else { HOST }
}

/// `bytes` as a signed step: one allocation holds at most `isize::MAX` bytes.
fn signed(bytes: usize) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// A live view of an engine's memory for any thread: [`snapshot`](Self::snapshot) reads the
/// engine's ledger without a lock that a transfer holds, so a monitoring thread can watch an
/// engine that another thread drives.
///
/// It keeps the engine's shared state alive as a tensor does (not the engine: its teardown runs
/// when the engine is dropped), so a snapshot after the teardown shows what is left.
#[derive(Clone)]
pub struct MemoryWatch {
    pub(crate) cells: Arc<Cells>,
    /// The device's figures, when they can be asked (the engine's driver's waiting half).
    pub(crate) device: Arc<dyn Fn() -> Option<DeviceMemory> + Send + Sync>,
    /// Resets the peaks (under the engine's lock, the ledger's one writer).
    pub(crate) reset: Arc<dyn Fn() -> crate::error::Result<()> + Send + Sync>,
}

impl fmt::Debug for MemoryWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWatch").finish_non_exhaustive()
    }
}

impl MemoryWatch {
    /// Everything the engine holds now, by owner, beside the device's figures
    /// ([`MemoryUse`]). Takes no lock of the engine's.
    pub fn snapshot(&self) -> MemoryUse {
        let mut memory = self.cells.read();
        memory.device = (self.device)();
        memory
    }

    /// What the engine holds now, by owner, without asking the driver: only the engine's own
    /// figures ([`MemoryUse::device`] is `None`). The cheapest read, for a tight loop.
    pub fn held(&self) -> MemoryUse {
        self.cells.read()
    }

    /// Makes every peak the figure now, so the next snapshot's peaks cover only what comes
    /// after. Takes the engine's lock for the moment of the reset.
    ///
    /// # Errors
    /// [`UsageError::InDeviceCallback`](crate::error::UsageError::InDeviceCallback) inside a
    /// wake (a waker run as the device's callback), where the engine's lock may be held by a
    /// thread that waits for that very callback; nothing is reset then.
    pub fn reset_peaks(&self) -> crate::error::Result<()> {
        (self.reset)()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_keep_in_use_reserved_counts_and_peaks() {
        let at = Location::caller();
        let mut ledger = Ledger::default();
        ledger.allocated(Owner::Tensors, 100, at);
        ledger.allocated(Owner::Pinned, 4096, at);
        ledger.kept(Owner::Pinned, 4096, at);
        ledger.allocated(Owner::Tensors, 50, at);
        ledger.freed(Owner::Tensors, 100, at);
        let m = ledger.cells().read();
        assert_eq!((m.tensors.in_use, m.tensors.count), (50, 1));
        assert_eq!(
            (m.tensors.peak_in_use, m.device_total.peak_in_use),
            (150, 150)
        );
        assert_eq!(
            (m.pinned.in_use, m.pinned.reserved, m.pinned.count),
            (0, 4096, 0)
        );
        assert_eq!(
            (m.host_total.reserved, m.host_total.peak_in_use),
            (4096, 4096)
        );
        ledger.reused(Owner::Pinned, 4096, at);
        ledger.moved(Owner::Tensors, Owner::Exported, 50, at);
        ledger.reset_peaks();
        let m = ledger.cells().read();
        assert_eq!(
            (m.tensors.in_use, m.exported.in_use, m.exported.count),
            (0, 50, 1)
        );
        assert_eq!((m.tensors.peak_in_use, m.device_total.peak_in_use), (0, 50));
        assert_eq!(m.pinned.in_use, 4096);
        ledger.released(Owner::Staging, 0, at);
        assert_eq!(ledger.cells().read().staging, Holding::default());
    }

    #[test]
    fn the_history_keeps_the_last_changes_only_when_on() {
        let at = Location::caller();
        let mut ledger = Ledger::default();
        ledger.allocated(Owner::Tensors, 1, at);
        assert!(ledger.history().is_empty());
        ledger.record_history(2);
        for bytes in 1..=3 {
            ledger.allocated(Owner::Tensors, bytes, at);
        }
        let history = ledger.history();
        assert_eq!(history.len(), 2);
        assert_eq!((history[0].sequence, history[0].bytes), (2, 2));
        assert_eq!(
            (history[1].sequence, history[1].location.line()),
            (3, at.line())
        );
        ledger.record_history(0);
        assert!(ledger.history().is_empty());
    }

    #[test]
    fn a_reader_never_sees_half_a_change() {
        // One writer moves bytes between two owners; every snapshot must show their sum whole.
        let mut ledger = Ledger::default();
        let at = Location::caller();
        ledger.allocated(Owner::Tensors, 1 << 20, at);
        let cells = Arc::clone(ledger.cells());
        let reader = std::thread::spawn(move || {
            for _ in 0..20_000 {
                let m = cells.read();
                assert_eq!(m.tensors.in_use + m.exported.in_use, 1 << 20);
                assert_eq!(m.device_total.in_use, 1 << 20);
            }
        });
        for _ in 0..20_000 {
            ledger.moved(Owner::Tensors, Owner::Exported, 1 << 20, at);
            ledger.moved(Owner::Exported, Owner::Tensors, 1 << 20, at);
        }
        reader.join().unwrap();
    }
}
