//! The order of the engine's three lanes: cross-lane waits, inserted only where a value is shared.
//!
//! An engine queues host-to-device copies on its upload lane, device-to-host copies on its
//! download lane and everything else on its compute lane (see [`Lane`]), so an upload, a download
//! and a kernel can run at once. The engine still promises that work runs in the order it was
//! queued *as seen through its values*: whatever reads a device value sees every write queued
//! before it, and nothing queued later overwrites a value before an earlier read of it has run.
//! This module keeps that promise with the fewest waits:
//!
//! - Every operation declares the device values it reads and writes ([`Use`]), by allocation.
//!   [`Order::prepare`] makes the operation's lane wait for the last write of each value it uses
//!   on another lane, and, when it writes, for the last reads of it on the other lanes too.
//!   [`Order::mark`] then records the operation's own uses at the lane's next position.
//! - A wait is one `cuStreamWaitEvent` on an event recorded on the other lane. Each lane has one
//!   ordering event, re-recorded only when a wait needs a later point than its last record
//!   covers (CUDA fixes what a wait waits for when the wait is queued, so re-recording is safe),
//!   and a lane that has already waited for a point of another lane never waits for it again:
//!   a value used on one lane only costs nothing, and a chain of uses on the same two lanes
//!   costs one wait per hand-over.
//! - What the host has proven complete needs no wait at all: a synchronize proves every lane up
//!   to where it began, and every proof of completion (an event that reports its work done)
//!   proves its lane up to its record, since a lane runs in order ([`Proven`]).
//! - A raw scope, whose work the engine cannot see, begins with a join: the compute lane waits
//!   for everything queued on the copy lanes so far ([`Order::join`]). The tensors it lends are
//!   marked as used on the compute lane when it ends, so later copies that share one wait for it.
//!
//! Positions count the operations marked on a lane; `0` means "none", so a use at position `p`
//! is covered by a wait for any point `>= p`.

use crate::driver::{DevicePtr, Driver, EventHandle, Lane};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// How an operation uses a device value: its allocation's base address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Use {
    /// The operation reads the value.
    Read(DevicePtr),
    /// The operation writes (or frees) the value.
    Write(DevicePtr),
    /// The operation allocates the value (stream-ordered). Work on another lane that writes or
    /// frees it waits for the allocation; a read does not, since the contents of memory no
    /// operation has written yet are unspecified anyway.
    Alloc(DevicePtr),
}

impl Use {
    /// What a host copy does to its device value: an upload writes it, a download reads it.
    pub(crate) const fn of_copy(upload: bool, ptr: DevicePtr) -> Use {
        if upload {
            Use::Write(ptr)
        } else {
            Use::Read(ptr)
        }
    }

    fn ptr(self) -> DevicePtr {
        match self {
            Use::Read(ptr) | Use::Write(ptr) | Use::Alloc(ptr) => ptr,
        }
    }
}

/// The last uses of one value: its allocation until its first write, its last write, and its
/// last read on each lane since then.
#[derive(Clone, Copy, Debug, Default)]
struct Touch {
    /// The lane and position of the allocation, until the first write (which is ordered after
    /// it) replaces it.
    alloc: (usize, u64),
    /// The lane and position of the last write (position 0: never written by a marked
    /// operation).
    write: (usize, u64),
    /// The position of the last read on each lane since that write (0: none).
    reads: [u64; 3],
}

/// Hashes a device address (allocations are 256-byte aligned and distinct): a multiply is
/// enough, and it keeps the lookup on every operation cheap.
#[derive(Default)]
pub(crate) struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (n >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

impl Touch {
    /// Each lane's last use of the value (its allocation, its last write, its reads since):
    /// what a write or a free of it must follow.
    fn last(&self) -> [u64; 3] {
        let mut last = self.reads;
        for (lane, pos) in [self.alloc, self.write] {
            last[lane] = last[lane].max(pos);
        }
        last
    }
}

/// The positions the host has proven complete, per lane. Shared between the engine's order and
/// the proofs of completion it hands out, which record what they prove without the engine's
/// lock (a stale read only costs a wait that was not needed).
#[derive(Debug, Default)]
pub(crate) struct Proven([AtomicU64; 3]);

impl Proven {
    /// Everything marked on `lane` up to position `upto` has completed.
    pub(crate) fn prove(&self, lane: Lane, upto: u64) {
        self.0[lane.index()].fetch_max(upto, Ordering::Relaxed);
    }

    fn get(&self, lane: usize) -> u64 {
        self.0[lane].load(Ordering::Relaxed)
    }
}

/// The engine's lane order: positions, the ordering events, and each value's last uses.
#[derive(Default)]
pub(crate) struct Order {
    /// Operations marked on each lane so far.
    next: [u64; 3],
    /// Each lane's ordering event, made on first need.
    events: [Option<EventHandle>; 3],
    /// The position each lane's ordering event's last record covers.
    recorded: [u64; 3],
    /// What the recording lane had itself waited for when its event was last recorded: a lane
    /// that waits for the event has waited for that too.
    recorded_seen: [[u64; 3]; 3],
    /// `seen[a][b]`: lane `a` has waited for lane `b`'s operations up to this position.
    seen: [[u64; 3]; 3],
    /// Positions the host has proven complete, per lane.
    proven: Arc<Proven>,
    /// Each value's last uses, by allocation.
    touches: HashMap<DevicePtr, Touch, BuildHasherDefault<AddressHasher>>,
    /// Cross-lane waits queued so far.
    waits: u64,
    /// The ordering event recorded on streams that are not the engine's (another library's),
    /// for a lane to wait on: made on first need.
    foreign: Option<EventHandle>,
}

impl Order {
    /// Makes `lane` wait for what `uses` must follow on the other lanes. Nothing is queued when
    /// nothing is shared.
    ///
    /// # Errors
    /// [`Error::Driver`] when an event record or a wait is refused; the operation must then not
    /// be queued.
    pub(crate) fn prepare(
        &mut self,
        driver: &mut dyn Driver,
        lane: Lane,
        uses: &[Use],
    ) -> Result<()> {
        let need = self.needs(uses);
        self.wait_for_needs(driver, lane, need)
    }

    /// Makes `lane` wait for each other lane up to `need` (its position there), where it has
    /// not already waited that far and the host has not proven it.
    // Inlined: it runs on every tensor's free, where a call of its own cost more than its loop.
    #[inline(always)]
    fn wait_for_needs(
        &mut self,
        driver: &mut dyn Driver,
        lane: Lane,
        need: [u64; 3],
    ) -> Result<()> {
        let me = lane.index();
        for other in Lane::ALL {
            let o = other.index();
            if o != me && need[o] > self.seen[me][o].max(self.proven.get(o)) {
                self.wait_for(driver, lane, other)?;
            }
        }
        Ok(())
    }

    /// The position on each lane that work using `uses` must follow.
    fn needs(&self, uses: &[Use]) -> [u64; 3] {
        let mut need = [0u64; 3];
        for &u in uses {
            let Some(touch) = self.touches.get(&u.ptr()) else {
                continue;
            };
            let after = match u {
                // A read follows the last write only.
                Use::Read(_) => {
                    let mut write = [0; 3];
                    write[touch.write.0] = touch.write.1;
                    write
                }
                Use::Write(_) | Use::Alloc(_) => touch.last(),
            };
            for (need, after) in need.iter_mut().zip(after) {
                *need = (*need).max(after);
            }
        }
        need
    }

    /// Whether work outside this engine's lanes (another engine's stream) may make `uses` now,
    /// with no wait: every use of this engine's that it must follow is proven complete.
    pub(crate) fn settled_for(&self, uses: &[Use]) -> bool {
        let need = self.needs(uses);
        Lane::ALL
            .into_iter()
            .all(|lane| need[lane.index()] <= self.proven.get(lane.index()))
    }

    /// Makes `lane` wait for everything queued on the other lanes so far.
    ///
    /// # Errors
    /// As [`Order::prepare`].
    pub(crate) fn join(&mut self, driver: &mut dyn Driver, lane: Lane) -> Result<()> {
        self.wait_for_needs(driver, lane, self.next)
    }

    /// Records `uses` as made by the operation just queued on `lane`.
    pub(crate) fn mark(&mut self, lane: Lane, uses: &[Use]) {
        self.next[lane.index()] += 1;
        self.record(lane, uses);
    }

    /// Records `uses` as made by the work queued on `lane` so far, at the lane's position now
    /// (no new one): for memory that work wrote as part of a larger value, which becomes a
    /// value of its own only now. Later work that must follow the uses waits for the lane up
    /// to its position now, which covers that work.
    #[cfg(feature = "safetensors")]
    pub(crate) fn mark_queued(&mut self, lane: Lane, uses: &[Use]) {
        // Thousands of uses at once (a landed file's tensors): room made once.
        self.touches.reserve(uses.len());
        self.record(lane, uses);
    }

    /// Records `uses` at `lane`'s position now.
    fn record(&mut self, lane: Lane, uses: &[Use]) {
        let me = lane.index();
        let pos = self.next[me];
        for &u in uses {
            if u.ptr() == 0 {
                continue;
            }
            let touch = self.touches.entry(u.ptr()).or_default();
            match u {
                Use::Read(_) => touch.reads[me] = pos,
                Use::Write(_) => {
                    *touch = Touch {
                        alloc: (0, 0),
                        write: (me, pos),
                        reads: [0; 3],
                    }
                }
                Use::Alloc(_) => {
                    *touch = Touch {
                        alloc: (me, pos),
                        ..Touch::default()
                    }
                }
            }
        }
    }

    /// The lane to free a value on, given each lane's `last` use of it: the one lane whose uses
    /// the host has not proven complete, which needs no wait for them; the compute lane when
    /// none or several have.
    fn free_lane_after(&self, last: [u64; 3]) -> Lane {
        let mut unproven = Lane::ALL
            .into_iter()
            .filter(|lane| last[lane.index()] > self.proven.get(lane.index()));
        match (unproven.next(), unproven.next()) {
            (Some(lane), None) => lane,
            _ => Lane::Compute,
        }
    }

    /// Chooses the lane to free the value at `ptr` on ([`free_lane_after`](Self::free_lane_after)) and
    /// makes it wait for the value's uses on the other lanes (as [`prepare`](Self::prepare) with
    /// a write of it): one lookup for both. Returns the lane, and the refusal of a wait when
    /// one was refused (the free must then not be queued without another proof).
    pub(crate) fn prepare_free(
        &mut self,
        driver: &mut dyn Driver,
        ptr: DevicePtr,
    ) -> (Lane, Result<()>) {
        // A free follows every use of the value, as a write does.
        let last = self.touches.get(&ptr).map_or([0; 3], Touch::last);
        let lane = self.free_lane_after(last);
        (lane, self.wait_for_needs(driver, lane, last))
    }

    /// Folds the uses of the value `from` into those of `into`, and forgets `from`: for a
    /// tensor that is part of a larger allocation (`into`'s), dropped while the allocation
    /// lives on. The allocation's free then waits for every use of the part, as for its own;
    /// each of the part's uses counts as a read of the allocation, which is all a free asks of
    /// it.
    #[cfg(feature = "safetensors")]
    pub(crate) fn fold(&mut self, from: DevicePtr, into: DevicePtr) {
        if from == into {
            return;
        }
        let Some(part) = self.touches.remove(&from) else {
            return;
        };
        let whole = self.touches.entry(into).or_default();
        for (read, pos) in whole.reads.iter_mut().zip(part.last()) {
            *read = (*read).max(pos);
        }
    }

    /// Forgets a value whose free has just been queued (after [`Order::prepare`] with a write):
    /// its address may come back from a later allocation, as a new value.
    pub(crate) fn forget(&mut self, ptr: DevicePtr) {
        self.touches.remove(&ptr);
    }

    /// How many values the order tracks.
    #[cfg(test)]
    pub(crate) fn values(&self) -> usize {
        self.touches.len()
    }

    /// Each lane's position now: what a host wait that starts now covers.
    pub(crate) fn positions(&self) -> [u64; 3] {
        self.next
    }

    /// `lane`'s position now: what an event recorded on it now covers.
    pub(crate) fn position(&self, lane: Lane) -> u64 {
        self.next[lane.index()]
    }

    /// Where proofs of completion record what they prove.
    pub(crate) fn proven(&self) -> &Arc<Proven> {
        &self.proven
    }

    /// The host has proven every lane complete up to `upto` (taken with [`Order::positions`]
    /// before a synchronize): nothing queued before needs a wait any more.
    pub(crate) fn settled(&mut self, upto: [u64; 3]) {
        for (lane, upto) in Lane::ALL.into_iter().zip(upto) {
            self.proven.prove(lane, upto);
        }
    }

    /// How many cross-lane waits have been queued.
    pub(crate) fn waits(&self) -> u64 {
        self.waits
    }

    /// Destroys the ordering events, for the engine's teardown once every lane is idle.
    pub(crate) fn release(&mut self, driver: &mut dyn Driver) {
        let foreign = self.foreign.take();
        for event in self
            .events
            .iter_mut()
            .filter_map(Option::take)
            .chain(foreign)
        {
            // SAFETY: the event was made by `wait_for` on this driver and is not used again;
            // every lane is idle, so no queued wait refers to it.
            let _ = unsafe { driver.event_destroy(event) };
        }
    }

    /// Makes `stream`, a stream that is not one of the engine's lanes, wait for what `uses` must
    /// follow: the compute lane first waits for their uses on the copy lanes, takes a mark of
    /// them (so its ordering event's next record covers the hand-over), and `stream` waits for
    /// that record. Never waits on the host.
    ///
    /// # Errors
    /// As [`Order::prepare`]; the hand-over is then not made.
    ///
    /// # Safety
    /// As [`Driver::foreign_wait`] for `stream`.
    pub(crate) unsafe fn hand_over(
        &mut self,
        driver: &mut dyn Driver,
        stream: u64,
        uses: &[Use],
    ) -> Result<()> {
        self.prepare(driver, Lane::Compute, uses)?;
        self.mark(Lane::Compute, uses);
        let event = self.recorded_event(driver, Lane::Compute)?;
        // SAFETY: the caller's contract for `stream`; the event is this order's, live until the
        // teardown.
        unsafe { driver.foreign_wait(stream, event) }.map_err(Error::driver("cuStreamWaitEvent"))
    }

    /// Makes `lane` wait for everything queued on `stream` (not one of the engine's lanes) so
    /// far, and marks `uses` as made on `lane` then: later work on the values, on any lane,
    /// follows the other stream's. Never waits on the host.
    ///
    /// # Errors
    /// [`Error::Driver`] when the event cannot be made or recorded, or the wait is refused.
    ///
    /// # Safety
    /// As [`Driver::foreign_record`] for `stream`.
    pub(crate) unsafe fn take_back(
        &mut self,
        driver: &mut dyn Driver,
        stream: u64,
        lane: Lane,
        uses: &[Use],
    ) -> Result<()> {
        let event = match self.foreign {
            Some(event) => event,
            None => {
                let event = driver
                    .ordering_event_create()
                    .map_err(Error::driver("cuEventCreate"))?;
                self.foreign = Some(event);
                event
            }
        };
        // SAFETY: the caller's contract for `stream`; the event is this order's.
        unsafe { driver.foreign_record(stream, event) }.map_err(Error::driver("cuEventRecord"))?;
        driver
            .stream_wait(lane, event)
            .map_err(Error::driver("cuStreamWaitEvent"))?;
        self.waits += 1;
        self.mark(lane, uses);
        Ok(())
    }

    /// `lane`'s ordering event, recorded now unless its last record already covers everything
    /// marked on the lane so far.
    fn recorded_event(&mut self, driver: &mut dyn Driver, lane: Lane) -> Result<EventHandle> {
        let o = lane.index();
        let event = match self.events[o] {
            Some(event) => event,
            None => {
                let event = driver
                    .ordering_event_create()
                    .map_err(Error::driver("cuEventCreate"))?;
                self.events[o] = Some(event);
                event
            }
        };
        if self.recorded[o] < self.next[o] {
            driver
                .event_record(lane, event)
                .map_err(Error::driver("cuEventRecord"))?;
            self.recorded[o] = self.next[o];
            self.recorded_seen[o] = self.seen[o];
        }
        Ok(event)
    }

    /// Queues one wait of `lane` for everything marked on `other` so far (recording `other`'s
    /// ordering event first when its last record does not cover that).
    fn wait_for(&mut self, driver: &mut dyn Driver, lane: Lane, other: Lane) -> Result<()> {
        let (me, o) = (lane.index(), other.index());
        let event = self.recorded_event(driver, other)?;
        driver
            .stream_wait(lane, event)
            .map_err(Error::driver("cuStreamWaitEvent"))?;
        self.waits += 1;
        let covered = self.recorded[o];
        self.seen[me][o] = self.seen[me][o].max(covered);
        for x in 0..3 {
            if x != me {
                self.seen[me][x] = self.seen[me][x].max(self.recorded_seen[o][x]);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_hasher_spreads_aligned_addresses() {
        let hash = |ptr: u64| {
            let mut h = AddressHasher::default();
            h.write_u64(ptr);
            h.finish()
        };
        assert_ne!(hash(0x7f00_0000_0000), hash(0x7f00_0000_0100));
    }

    /// A part's uses folded into its allocation: the allocation's free follows each of them,
    /// on every lane, and the part is forgotten.
    #[cfg(feature = "safetensors")]
    #[test]
    fn a_folded_part_orders_its_allocations_free() {
        let (block, part) = (0x1000, 0x1100);
        let (upload, compute, download) = (Lane::Upload, Lane::Compute, Lane::Download);
        let mut order = Order::default();
        order.mark(upload, &[Use::Alloc(block)]);
        order.mark(upload, &[Use::Write(block), Use::Write(part)]);
        order.mark(compute, &[Use::Read(part)]);
        order.mark(compute, &[Use::Write(part)]);
        order.mark(download, &[Use::Read(part)]);
        // Before the fold, the free of the allocation follows only its own uses.
        assert_eq!(order.needs(&[Use::Write(block)]), [0, 2, 0]);
        order.fold(part, block);
        assert!(!order.touches.contains_key(&part));
        let [c, u, d] = [compute, upload, download].map(Lane::index);
        let mut want = [0; 3];
        (want[c], want[u], want[d]) = (2, 2, 1);
        assert_eq!(order.needs(&[Use::Write(block)]), want);
        // Folding a value into itself, or one with no uses, changes nothing.
        order.fold(block, block);
        order.fold(0x2000, block);
        assert_eq!(order.needs(&[Use::Write(block)]), want);
    }
}
