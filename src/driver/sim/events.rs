//! Events and waits.
//!
//! An event's record is a marker queued on a stream: a query reports completion only once the
//! marker has run, and a marker runs only once everything queued before it on its stream (and
//! what that waited for) has. A stream's wait for an event is a job that holds its stream until
//! the event's last record as of the call has run. A wake registered on an event is called once
//! the device runs the record (or at once if it already has), after the device's lock is
//! released. The host waits ([`SimWaits`]: event and stream synchronize, and the queries) run the
//! clock up to what they wait for, or, while the clock is held, block until another thread
//! advances it that far.

use super::{
    DriverError, EventHandle, Job, Lane, Locked, Schedule, SimDevice, SimOp, State, StreamId,
    Waits, Wake,
};
use crate::driver::MemoryReport;

/// The stream the legacy default stream handle names on every simulated machine (the per-thread
/// handle's is the one below it): far above the streams drivers take (`next_stream`).
pub(super) const LEGACY_STREAM: StreamId = StreamId::MAX / 2;

/// An event of the device.
pub(super) struct SimEvent {
    /// Whether it only orders lanes (made by `ordering_event_create`).
    pub(super) ordering: bool,
    /// Sequence number of the marker of the last record, if recorded.
    pub(super) recorded: Option<u64>,
    /// The error this record reports once the device reaches it.
    pub(super) fault: Option<DriverError>,
    /// The simulated process whose driver made it (`None` when none did): a killed process's
    /// events went with its context.
    pub(super) owner: Option<u32>,
}

impl SimDevice {
    /// Live events (created and not destroyed), inter-process events opened from another
    /// process's included; those of a killed process went with its context and are not counted.
    pub fn events_live(&self) -> usize {
        let s = self.lock();
        s.events
            .values()
            .filter(|e| !e.ordering && !s.killed(e.owner))
            .count()
    }

    /// Live events that only order one stream after another (the engine makes at most one per
    /// stream, and destroys them at teardown); a killed process's are not counted.
    pub fn ordering_events_live(&self) -> usize {
        let s = self.lock();
        s.events
            .values()
            .filter(|e| e.ordering && !s.killed(e.owner))
            .count()
    }
}

impl State {
    /// Reports a part's failure on `stream`, if one is pending there, through the event whose
    /// record is job `seq`, which has just run.
    pub(super) fn report_stream_failure(&mut self, seq: u64, stream: StreamId) {
        let Some(failure) = self.failed_streams.remove(&stream) else {
            return;
        };
        if let Some(event) = self.events.values_mut().find(|e| e.recorded == Some(seq)) {
            event.fault.get_or_insert(failure);
        }
    }

    /// The live event `event`; `CUDA_ERROR_INVALID_VALUE` when there is none. Using an opened
    /// inter-process event whose exporter has destroyed its own is a violation (`share.rs`).
    pub(super) fn event(&mut self, event: EventHandle) -> Result<&mut SimEvent, DriverError> {
        self.check_opened(event);
        self.events
            .get_mut(&event.0)
            .ok_or(DriverError::INVALID_VALUE)
    }

    /// Creates an event, counted as `op`; `ordering` for one that only orders lanes.
    pub(super) fn create_event(
        &mut self,
        op: SimOp,
        ordering: bool,
    ) -> Result<EventHandle, DriverError> {
        self.enter(op)?;
        let id = self.next_event;
        self.next_event += 1;
        self.events.insert(
            id,
            SimEvent {
                ordering,
                recorded: None,
                fault: None,
                owner: self.caller,
            },
        );
        Ok(EventHandle(id))
    }

    /// Records `event` on `stream` (the driver's `event_record`): its marker is queued there, and
    /// the event takes the fault `fail_event` armed for this record, if any.
    pub(super) fn record_event(
        &mut self,
        stream: StreamId,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        if self.event(event)?.ordering {
            // An ordering record: no device time, no fault of the work before it (the proofs'
            // records model those), counted apart.
            self.enter_stream(SimOp::OrderRecord, stream)?;
            let seq = self.push(stream, Job::OrderMarker);
            self.event(event)?.recorded = Some(seq);
            return Ok(());
        }
        self.enter_stream(SimOp::EventRecord, stream)?;
        self.event(event)?;
        let n = self.calls[&SimOp::EventRecord];
        let fault = self
            .event_faults
            .iter()
            .position(|f| f.0 == n)
            .map(|i| self.event_faults.remove(i).1);
        let seq = self.push(stream, Job::Marker);
        let ev = self.event(event)?;
        ev.recorded = Some(seq);
        ev.fault = fault;
        // An inter-process event's record is every process's that has it open (`share.rs`).
        self.share_record(event);
        Ok(())
    }

    /// The device stream a foreign stream handle names (`Driver::foreign_record`): the compute
    /// stream of a driver of this machine (its raw handle), or one of the machine's two default
    /// streams for the legacy and per-thread handles. Any other handle is
    /// `CUDA_ERROR_INVALID_HANDLE`, where a real device's behaviour is undefined. The default
    /// streams are plain streams here: the legacy stream's implicit waits for the other
    /// blocking streams are not simulated (the engine's streams do not block on it either).
    pub(super) fn foreign_stream(&self, handle: u64) -> Result<StreamId, DriverError> {
        match handle {
            crate::driver::LEGACY_STREAM => Ok(LEGACY_STREAM),
            crate::driver::PER_THREAD_STREAM => Ok(LEGACY_STREAM - 1),
            _ => self
                .compute_stream_of(handle)
                .ok_or(DriverError::INVALID_HANDLE),
        }
    }

    /// Queues on `stream` a wait for `event`'s last record as of now (the driver's
    /// `stream_wait`); nothing when that record has run, or the event was never recorded.
    pub(super) fn wait_event(
        &mut self,
        stream: StreamId,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        self.enter_stream(SimOp::StreamWait, stream)?;
        // What the wait waits for is fixed now: the event's last record as of this call.
        if let Some(for_seq) = self.event(event)?.recorded
            && !self.is_done(for_seq)
        {
            self.push(stream, Job::Wait { for_seq });
        }
        Ok(())
    }

    /// Destroys `event` (the driver's `event_destroy`).
    pub(super) fn destroy_event(&mut self, event: EventHandle) -> Result<(), DriverError> {
        self.enter(SimOp::EventDestroy)?;
        self.events
            .remove(&event.0)
            .map(|_| self.forget_opened(event))
            .ok_or(DriverError::INVALID_VALUE)
    }

    /// Registers `wake` for `event`'s last record (the driver's `notify_after`). It is due at
    /// once (called when the lock is released) when the record has run or the event was never
    /// recorded; otherwise the record's run calls it, and unless the clock is held the device
    /// runs up to the record now. Returns whether it ran the clock, for the caller to signal
    /// the waits blocked on it.
    pub(super) fn register_wake(
        &mut self,
        event: EventHandle,
        wake: Wake,
    ) -> Result<bool, DriverError> {
        self.enter(SimOp::NotifyAfter)?;
        let recorded = self.event(event)?.recorded;
        match recorded {
            // Never recorded, or its record has run (a failed event counts: the device failed):
            // the wake is due now, once the lock is released.
            None => self.woken.push(wake),
            Some(seq) if self.is_done(seq) => self.woken.push(wake),
            Some(seq) => {
                self.wakes.entry(seq).or_default().push(wake);
                if !self.clock_held {
                    self.run_until(seq);
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }
}

/// The waiting half of a simulated driver. A wait runs the device up to what it waits for,
/// unless the clock is held ([`SimDevice::hold_clock`]): then it blocks until another thread
/// advances the clock that far, as a real wait blocks until the device gets there.
pub(super) struct SimWaits {
    pub(super) device: SimDevice,
    /// The driver's first stream (see [`SimDriver`](super::SimDriver)).
    pub(super) streams: StreamId,
    /// The driver's simulated process: once it is killed, every wait fails.
    pub(super) pid: u32,
    /// Which device of the machine the driver drives.
    pub(super) index: usize,
}

impl SimWaits {
    /// The device streams of the driver's lanes.
    fn lanes(&self) -> impl Iterator<Item = StreamId> + '_ {
        Lane::ALL
            .into_iter()
            .map(|lane| self.streams + lane.index())
    }

    /// Waits until `done` holds, running the clock with `run` (which must make progress towards
    /// it) unless the clock is held.
    fn wait_for<'a>(
        &'a self,
        s: Locked<'a>,
        done: impl Fn(&State) -> bool,
        run: impl Fn(&mut State),
    ) -> Locked<'a> {
        self.wait_for_until(s, done, run, None)
    }

    /// As [`wait_for`](Self::wait_for), giving up at `deadline`, if any.
    fn wait_for_until<'a>(
        &'a self,
        mut s: Locked<'a>,
        done: impl Fn(&State) -> bool,
        run: impl Fn(&mut State),
        deadline: Option<std::time::Instant>,
    ) -> Locked<'a> {
        let progress = &self.device.inner.progress;
        // Blocks until another thread makes progress, or the deadline; `None` once it passed.
        let block = |s: Locked<'a>| -> Result<Locked<'a>, Locked<'a>> {
            match deadline {
                None => Ok(s.wait(progress)),
                Some(at) => {
                    let left = at.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        Err(s)
                    } else {
                        Ok(s.wait_timeout(progress, left))
                    }
                }
            }
        };
        if !s.clock_held {
            loop {
                run(&mut s);
                progress.notify_all();
                // A collective of ranks that joined one by one may wait for the parts of ranks
                // on other threads, which have yet to queue them: wait until they do.
                if done(&s) || !s.awaits_peers() {
                    return s;
                }
                s = match block(s) {
                    Ok(s) => s,
                    Err(s) => return s,
                };
            }
        }
        while !done(&s) {
            s = match block(s) {
                Ok(s) => s,
                Err(s) => return s,
            };
        }
        s
    }

    /// Waits until job `seq` has run, running the clock as the schedule picks unless it is held.
    fn wait_until<'a>(&'a self, s: Locked<'a>, seq: u64) -> Locked<'a> {
        self.wait_for(s, |s| s.is_done(seq), |s| s.run_until(seq))
    }
}

impl Waits for SimWaits {
    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        let mut s = self.device.lock_as(self.pid);
        s.enter(SimOp::EventQuery)?;
        let Some(seq) = s.event(event)?.recorded else {
            return Ok(true);
        };
        if !s.is_done(seq) {
            return Ok(false);
        }
        s.event(event)?.fault.map_or(Ok(true), Err)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        let mut s = self.device.lock_as(self.pid);
        s.enter(SimOp::EventSynchronize)?;
        let Some(seq) = s.event(event)?.recorded else {
            return Ok(());
        };
        let mut s = self.wait_until(s, seq);
        s.event(event)?.fault.map_or(Ok(()), Err)
    }

    fn event_wait_within(
        &self,
        event: EventHandle,
        within: std::time::Duration,
    ) -> Result<bool, DriverError> {
        let mut s = self.device.lock_as(self.pid);
        s.enter(SimOp::EventSynchronize)?;
        let Some(seq) = s.event(event)?.recorded else {
            return Ok(true);
        };
        // A `within` too large for an instant waits for ever, as the device's default does.
        let deadline = std::time::Instant::now().checked_add(within);
        let mut s = self.wait_for_until(s, |s| s.is_done(seq), |s| s.run_until(seq), deadline);
        if !s.is_done(seq) {
            return Ok(false);
        }
        s.event(event)?.fault.map_or(Ok(true), Err)
    }

    fn stream_synchronize(&self) -> Result<(), DriverError> {
        let mut s = self.device.lock_as(self.pid);
        s.enter_stream(
            SimOp::StreamSynchronize,
            self.streams + Lane::Compute.index(),
        )?;
        let lanes: Vec<StreamId> = self.lanes().collect();
        let done = |s: &State| s.streams_idle(lanes.iter().copied());
        let run = |s: &mut State| {
            for &stream in &lanes {
                if let Some(last) = s.last_on(stream) {
                    s.run_until(last);
                }
            }
        };
        drop(self.wait_for(s, done, run));
        Ok(())
    }

    #[cfg(feature = "dlpack")]
    fn context_synchronize(&self) -> Result<(), DriverError> {
        let mut s = self.device.lock_as(self.pid);
        s.enter_stream(
            SimOp::StreamSynchronize,
            self.streams + Lane::Compute.index(),
        )?;
        // Every job queued so far on every stream of the machine: the simulator does not tell
        // contexts' streams apart.
        let last = s.next_seq;
        let done = move |s: &State| s.pending.range(..last).next().is_none();
        let run = move |s: &mut State| {
            while let Some(&seq) = s.pending.range(..last).next().map(|(seq, _)| seq) {
                s.run_until(seq);
                if s.pending.contains_key(&seq) {
                    return; // blocked for good (a collective missing a part)
                }
            }
        };
        drop(self.wait_for(s, done, run));
        Ok(())
    }

    fn lane_synchronize(&self, lane: Lane) -> Result<(), DriverError> {
        let mut s = self.device.lock_as(self.pid);
        let stream = self.streams + lane.index();
        s.enter_stream(SimOp::StreamSynchronize, stream)?;
        let done = |s: &State| s.streams_idle([stream]);
        let run = |s: &mut State| {
            if let Some(last) = s.last_on(stream) {
                match s.schedule {
                    // Program order: everything queued before the lane's last job runs first,
                    // as on one stream.
                    Schedule::InOrder => s.run_until(last),
                    // Only the lane and what it waits for, as a GPU runs it.
                    Schedule::Interleaved { .. } => s.run_through(last),
                }
            }
        };
        drop(self.wait_for(s, done, run));
        Ok(())
    }

    fn stream_query(&self) -> Result<bool, DriverError> {
        let mut s = self.device.lock_as(self.pid);
        s.enter_stream(SimOp::StreamQuery, self.streams + Lane::Compute.index())?;
        Ok(s.streams_idle(self.lanes()))
    }

    fn pool_usage(&self) -> Result<(u64, u64), DriverError> {
        let report = self.memory_report()?;
        Ok((report.reserved, report.used))
    }

    fn memory_report(&self) -> Result<MemoryReport, DriverError> {
        let mut s = self.device.lock_as(self.pid);
        s.enter(SimOp::MemoryReport)?;
        // The simulated pool keeps nothing unused: it holds exactly what is allocated on its
        // device (by every driver of the machine there).
        let used = s.device_used[self.index] as u64;
        let free = (s.memory_bytes as u64).saturating_sub(used);
        Ok(MemoryReport {
            free,
            total: s.memory_bytes as u64,
            reserved: used,
            used,
            // The simulated device's memory is never split: all that is free can be had.
            largest: Some(free),
        })
    }
}
