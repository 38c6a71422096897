//! The retirement queue and the event pool.
//!
//! Memory that a queued copy may still touch must not be freed or reused until an event recorded
//! after the copy proves it complete. When the value that owned such memory goes away before
//! that proof (an in-flight transfer handle dropped, a chunked upload that failed mid-way), its
//! resources move here as a [`Record`]: the event and everything the device may touch.
//!
//! Records are released only after their event reports completion, and retained for the
//! engine's lifetime when it reports an error (the device's state is then unknown, so nothing it
//! might still touch is freed). The queue is drained at `synchronize`, when the pinned pool is
//! under pressure, opportunistically at cheap points (a non-blocking query of the oldest record),
//! and at teardown; a teardown whose final wait fails forgets every record rather than free it.
//!
//! Draining hands released records back to the caller instead of dropping them, because dropping
//! their resources takes the engine's lock, which the drainer holds.

use crate::driver::{Driver, EventHandle};
use crate::error::{DriverError, Error, Result};
use std::any::Any;
use std::collections::VecDeque;

/// Resources owned by a record: dropped when the record is released, forgotten when retained.
pub(crate) type Resources = Box<dyn Any + Send>;

/// An event and the resources the work before it may still touch.
pub(crate) struct Record {
    pub(crate) event: EventHandle,
    pub(crate) resources: Resources,
    pub(crate) what: &'static str,
}

/// Counters for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetirementStats {
    /// Records waiting for their event.
    pub pending: usize,
    /// Records whose event reported an error: retained for the engine's lifetime.
    pub retained: usize,
    /// Records released since the engine was opened.
    pub released: u64,
    /// The first retained record's work and the error its event reported.
    pub first_failure: Option<(&'static str, DriverError)>,
}

#[derive(Default)]
pub(crate) struct RetireQueue {
    pending: VecDeque<Record>,
    /// Records whose event failed: never released. Their resources are forgotten at teardown.
    failed: Vec<(Record, DriverError)>,
    released: u64,
}

impl RetireQueue {
    pub(crate) fn push(&mut self, record: Record) {
        self.pending.push_back(record);
    }

    /// Keeps a record whose event already reported `error`.
    pub(crate) fn retain_failed(&mut self, record: Record, error: DriverError) {
        self.failed.push((record, error));
    }

    pub(crate) fn stats(&self) -> RetirementStats {
        RetirementStats {
            pending: self.pending.len(),
            retained: self.failed.len(),
            released: self.released,
            first_failure: self.failed.first().map(|(r, e)| (r.what, *e)),
        }
    }

    /// Releases every record whose event has completed, without waiting. With `front_only`, stops
    /// at the first record that is not complete (a cheap poll); otherwise queries them all.
    /// Returns the released resources for the caller to drop after unlocking, and puts the
    /// events back into `events`.
    pub(crate) fn poll(
        &mut self,
        driver: &mut dyn Driver,
        events: &mut EventPool,
        front_only: bool,
    ) -> Vec<Resources> {
        let mut released = Vec::new();
        let mut keep = VecDeque::with_capacity(self.pending.len());
        while let Some(record) = self.pending.pop_front() {
            match driver.event_query(record.event) {
                Ok(true) => {
                    events.put(record.event);
                    released.push(record.resources);
                    self.released += 1;
                }
                Ok(false) => {
                    keep.push_back(record);
                    if front_only {
                        break;
                    }
                }
                Err(error) => self.failed.push((record, error)),
            }
        }
        keep.append(&mut self.pending);
        self.pending = keep;
        released
    }

    /// After the stream has been synchronised successfully: every pending record's work is
    /// complete unless its event reports an error.
    pub(crate) fn drain_all(
        &mut self,
        driver: &mut dyn Driver,
        events: &mut EventPool,
    ) -> Vec<Resources> {
        self.poll(driver, events, false)
    }

    /// Teardown after a failed final wait: nothing may be released, so every record's resources
    /// are forgotten (leaked), never dropped.
    pub(crate) fn forget_all(&mut self) {
        for record in self.pending.drain(..) {
            std::mem::forget(record.resources);
        }
        self.forget_failed();
    }

    /// Forgets the resources of records whose event failed (teardown only).
    pub(crate) fn forget_failed(&mut self) {
        for (record, _) in self.failed.drain(..) {
            std::mem::forget(record.resources);
        }
    }
}

impl Drop for RetireQueue {
    fn drop(&mut self) {
        // Reached only when the engine's shared state goes away; anything still here was never
        // proven complete (or failed), so it is leaked rather than freed.
        self.forget_all();
    }
}

/// Events with timing disabled, reused across transfers: creating one costs a driver call, and
/// transfers need one each.
#[derive(Default)]
pub(crate) struct EventPool {
    free: Vec<EventHandle>,
    created: u64,
}

impl EventPool {
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

    pub(crate) fn created(&self) -> u64 {
        self.created
    }

    /// Destroys the idle events (teardown, after a successful wait).
    pub(crate) fn destroy_all(&mut self, driver: &mut dyn Driver) {
        for event in self.free.drain(..) {
            // SAFETY: idle pool events are not recorded again and are destroyed once.
            let _ = unsafe { driver.event_destroy(event) };
        }
    }
}
