//! The retirement queue and the event pool: the core's record of work that is still owed its
//! proof of completion.
//!
//! When a value that holds fenced resources goes away before its proof (an in-flight transfer
//! dropped, a staging chunk retired), its fence (the lifecycle level's `Fenced`) detaches into
//! this queue as a [`Record`]: the event and, type-erased, everything the device may still
//! touch.
//!
//! A record is released only after its event reports completion. Dropping a record leaks its
//! resources instead (they are held in `ManuallyDrop`), so no panic and no teardown path can
//! release what was never proven. A record whose event reports a failure is retained for the
//! engine's lifetime and reported once, at the next `flush` or `synchronize`.
//!
//! The queue is polled without waiting at `flush`, cheaply (the oldest records only) when a
//! pinned buffer is requested, and in full before any allocation that ran out of memory (device
//! memory, a pinned buffer, a registration, a staging slot) is retried once
//! (`memory::pressure`); `synchronize` and teardown settle it
//! after waiting for the streams, outside the engine's lock. Released resources are not dropped
//! here: they go to the engine's release list, dropped once its lock is released, because their
//! drops take that lock.
//!
//! The queue is the core's own because the engine drives it: every boundary polls it and
//! reports what it found, the teardown settles it before anything else is released, and the
//! allocation paths of the levels above (memory among them) poll it under pressure. The event
//! pool sits with it: a released record's event goes back there, and the teardown destroys the
//! pool's events after settling the queue. Both depend only on the seam and the errors; the
//! lifecycle level builds its records (`lifecycle::fence`).

use crate::driver::{Driver, EventHandle, Lane, Waits};
use crate::error::{DriverError, Error, Result};
use crate::ledger::Ledger;
use std::any::Any;
use std::collections::VecDeque;
use std::mem::ManuallyDrop;

/// Resources released from a record, to be dropped outside the engine's lock.
pub(crate) type Resources = Box<dyn Any + Send>;

/// An event and the resources the work before it may still touch. Dropping a record leaks the
/// resources: only [`RetireQueue`] releases them, after the event proved completion.
pub(crate) struct Record {
    event: EventHandle,
    resources: ManuallyDrop<Resources>,
    what: &'static str,
    /// What the event's completion proves: its lane, up to this position of the lane order.
    covers: (Lane, u64),
    /// The bytes of memory the resources hold ([`Held`]).
    bytes: u64,
}

/// What memory a value that queued work may still touch holds, for the retirement queue's
/// figures ([`MemoryUse::retired`](crate::engine::MemoryUse)): the bytes the engine releases
/// once the work is proven complete. Values that hold no memory of the engine's keep the
/// default, none.
pub(crate) trait Held {
    /// The bytes of device and page-locked host memory held.
    fn held_bytes(&self) -> u64 {
        0
    }
}

impl Held for () {}

impl<A: Held, B: Held> Held for (A, B) {
    fn held_bytes(&self) -> u64 {
        self.0.held_bytes() + self.1.held_bytes()
    }
}

impl<A: Held> Held for Vec<A> {
    fn held_bytes(&self) -> u64 {
        self.iter().map(Held::held_bytes).sum()
    }
}

impl<A: Held> Held for Option<A> {
    fn held_bytes(&self) -> u64 {
        self.as_ref().map_or(0, Held::held_bytes)
    }
}

impl<A: Held + ?Sized> Held for Box<A> {
    fn held_bytes(&self) -> u64 {
        (**self).held_bytes()
    }
}

impl<A: ?Sized + Send + Sync> Held for std::sync::Arc<A> {}

impl Record {
    /// A record of `resources`, still unproven, fenced by `event`, whose completion proves
    /// `covers` (a lane, up to a position).
    pub(crate) fn new<R: Send + 'static>(
        event: EventHandle,
        resources: ManuallyDrop<R>,
        what: &'static str,
        covers: (Lane, u64),
        bytes: u64,
    ) -> Self {
        let boxed: Resources = Box::new(ManuallyDrop::into_inner(resources));
        Record {
            event,
            resources: ManuallyDrop::new(boxed),
            what,
            covers,
            bytes,
        }
    }
}

/// Counters for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetirementStats {
    /// Records waiting for their event.
    pub pending: usize,
    /// Work whose completion could not be proven (its event reported an error, or no event could
    /// be recorded and the stream could not be synchronized): its resources are retained for the
    /// engine's lifetime.
    pub retained: usize,
    /// Records released since the engine was opened.
    pub released: u64,
    /// The first retained work and the error that made it unprovable.
    pub first_failure: Option<(&'static str, DriverError)>,
}

/// How thoroughly a poll looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Poll {
    /// The oldest records, up to the first that is not complete: a cheap check on hot paths.
    Front,
    /// Every record. A query that fails is retried at a later poll.
    All,
    /// Every record, after the stream was synchronized: a query that fails twice is the
    /// device's verdict, so the record is retained and the failure reported.
    Settle,
}

/// An engine's retirement queue: records waiting for their event, records whose event failed,
/// work that was never fenced, and the failures still to report.
#[derive(Default)]
pub(crate) struct RetireQueue {
    pending: VecDeque<Record>,
    /// The bytes the pending records hold.
    pending_bytes: u64,
    /// Records whose event failed: never released. Dropping them leaks their resources.
    failed: Vec<(Record, DriverError)>,
    /// Work that was never fenced: what it was and why.
    untracked: Vec<(&'static str, DriverError)>,
    released: u64,
    /// Failures found after the fact, for the next boundary to report once.
    unreported: Vec<Error>,
}

impl RetireQueue {
    /// Queues a record, to be released once its event reports completion.
    pub(crate) fn push(&mut self, record: Record) {
        self.pending_bytes += record.bytes;
        self.pending.push_back(record);
    }

    /// Keeps a record whose event reported `error` to a caller who was told.
    pub(crate) fn retain_failed(&mut self, record: Record, error: DriverError) {
        self.failed.push((record, error));
    }

    /// Counts work whose completion could not be tracked (its resources are leaked in place).
    pub(crate) fn count_untracked(&mut self, what: &'static str, error: DriverError) {
        self.untracked.push((what, error));
    }

    /// The queue's counters.
    pub(crate) fn stats(&self) -> RetirementStats {
        let first_failed = self.failed.first().map(|(r, e)| (r.what, *e));
        RetirementStats {
            pending: self.pending.len(),
            retained: self.failed.len() + self.untracked.len(),
            released: self.released,
            first_failure: first_failed.or_else(|| self.untracked.first().copied()),
        }
    }

    /// Tells `ledger` the queue's figures now: records waiting and the bytes they hold, and
    /// records retained. Called after every change to the queue.
    pub(crate) fn tell(&self, ledger: &mut Ledger) {
        let retained = self.failed.len() + self.untracked.len();
        ledger.retired(self.pending.len(), self.pending_bytes, retained);
    }

    /// Failures found since the last call, to be reported once.
    pub(crate) fn take_unreported(&mut self) -> Vec<Error> {
        std::mem::take(&mut self.unreported)
    }

    /// Whether records are waiting for their event.
    pub(crate) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Releases every record whose event has completed, without waiting: its event goes back to
    /// `events` and its resources onto `released`, for the caller to drop after unlocking.
    ///
    /// A record stays in the queue while its event is queried, so a panic inside a driver call
    /// leaves every record in place (and a record dropped by the unwinding leaks).
    pub(crate) fn poll(
        &mut self,
        waits: &dyn Waits,
        events: &mut EventPool,
        released: &mut Vec<Resources>,
        proved: &mut [u64; 3],
        mode: Poll,
    ) {
        let mut i = 0;
        while let Some(record) = self.pending.get(i) {
            let mut answer = waits.event_query(record.event);
            if mode == Poll::Settle && answer.is_err() {
                answer = waits.event_query(record.event);
            }
            match answer {
                Ok(true) => {
                    let record = self.pending.remove(i).expect("the record at `i` exists");
                    self.pending_bytes -= record.bytes;
                    let (lane, upto) = record.covers;
                    proved[lane.index()] = proved[lane.index()].max(upto);
                    events.put(record.event);
                    released.push(ManuallyDrop::into_inner(record.resources));
                    self.released += 1;
                }
                Ok(false) | Err(_) if mode == Poll::Front => return,
                Ok(false) => i += 1,
                Err(_) if mode == Poll::All => i += 1,
                Err(source) => {
                    let record = self.pending.remove(i).expect("the record at `i` exists");
                    self.pending_bytes -= record.bytes;
                    self.unreported.push(Error::DeviceFault {
                        what: record.what,
                        source,
                    });
                    self.failed.push((record, source));
                }
            }
        }
    }
}

/// Events with timing disabled, reused across transfers: creating one costs a driver call, and
/// most operations need one.
#[derive(Default)]
pub(crate) struct EventPool {
    free: Vec<EventHandle>,
    created: u64,
}

impl EventPool {
    /// An idle event: a pooled one, or a fresh one from the driver.
    pub(crate) fn take(&mut self, driver: &mut dyn Driver) -> Result<EventHandle> {
        if let Some(event) = self.free.pop() {
            return Ok(event);
        }
        let event = driver
            .event_create()
            .map_err(Error::driver("cuEventCreate"))?;
        self.created += 1;
        Ok(event)
    }

    /// Returns an event whose last record is complete (or that was never recorded).
    pub(crate) fn put(&mut self, event: EventHandle) {
        self.free.push(event);
    }

    /// How many events the pool has created.
    pub(crate) fn created(&self) -> u64 {
        self.created
    }

    /// Destroys the idle events (teardown, after a successful wait). Returns the first refusal.
    pub(crate) fn destroy_all(&mut self, driver: &mut dyn Driver) -> Result<()> {
        let mut first = Ok(());
        for event in self.free.drain(..) {
            // SAFETY: idle pool events are not recorded again and are destroyed once.
            if let Err(source) = unsafe { driver.event_destroy(event) }
                && first.is_ok()
            {
                first = Err(Error::Driver {
                    call: "cuEventDestroy",
                    source,
                });
            }
        }
        first
    }
}
