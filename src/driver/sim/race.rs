//! The race checker.
//!
//! Every job that runs records which device allocations it reads and writes ([`Touch`]); a job
//! that writes an allocation that a job queued after it has already read or written, or reads one
//! that a job queued after it has already written, ran in an order its streams did not impose:
//! the two were not ordered, so the device could have run them either way round. That is
//! recorded as a [`Violation::Race`] for the tests to assert on.

use super::{DevicePtr, State, StreamId, Violation, driver_lane};

/// The accesses to one device allocation by the jobs that have run, for the race checker.
pub(super) struct Touch {
    /// The allocation's length in bytes.
    pub(super) len: usize,
    /// The device (index on the machine) that holds it.
    pub(super) device: usize,
    /// The highest sequence number of a job that has read it.
    pub(super) read: Option<u64>,
    /// The highest sequence number of a job that has written (or freed) it.
    pub(super) write: Option<u64>,
}

/// The job running now, for the race checker: its sequence number, what it is, its stream.
#[derive(Clone, Copy)]
pub(super) struct Running {
    pub(super) seq: u64,
    pub(super) kind: &'static str,
    pub(super) stream: StreamId,
}

impl State {
    /// Records that the running job reads (or writes) the allocation holding `ptr`, and reports
    /// a race when a job queued after it has already made a conflicting access: a write after a
    /// later read or write, or a read after a later write.
    pub(super) fn access(&mut self, ptr: DevicePtr, write: bool) {
        let Some(job) = self.running else {
            return;
        };
        let Some((&base, touch)) = self.touches.range_mut(..=ptr).next_back() else {
            return;
        };
        if ptr - base >= (touch.len as u64).max(1) {
            return;
        }
        let later = |at: Option<u64>| at.filter(|&at| at > job.seq);
        let conflict = match (later(touch.write), write) {
            (Some(w), _) => Some((w, true)),
            (None, true) => later(touch.read).map(|r| (r, false)),
            (None, false) => None,
        };
        let slot = if write {
            &mut touch.write
        } else {
            &mut touch.read
        };
        *slot = Some(slot.map_or(job.seq, |at| at.max(job.seq)));
        if let Some((later, later_wrote)) = conflict {
            let (driver, lane) = driver_lane(job.stream);
            let violation = Violation::Race {
                job: job.seq,
                kind: job.kind,
                driver,
                lane,
                block: base,
                later,
                later_wrote,
            };
            if !self.violations.contains(&violation) {
                self.violations.push(violation);
            }
        }
        // An import used by its process after the process released it (`share.rs`).
        self.check_released(job, base);
    }
}
