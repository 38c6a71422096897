//! The device clock: streams, schedules, and running their heads.
//!
//! Nothing queued takes effect until the clock runs it. Each step of the clock runs the head of
//! one stream whose head may run, as the [`Schedule`] picks it; ordering jobs (the records of
//! ordering events, and waits) take no step and run as soon as they can. Host waits run the
//! clock only as far as they need: [`run_until`](State::run_until) steps it in the schedule's
//! order up to a job, [`run_through`](State::run_through) runs only what a job must follow.
//! What each job does when it runs is in `jobs.rs`.

use super::{Job, Lane, Running, SimDevice, State};

/// How the simulated device picks, at each step of its clock, which stream runs next.
///
/// Each step runs the head of one stream whose head may run: any job but a wait, and a wait once
/// the event record it waits for has run. Jobs of one stream always run in the order they were
/// queued; the schedule decides only how the streams (three per engine) interleave.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// The head queued first: everything runs in program order (the order of the calls that
    /// queued it), as if every engine had one stream. The default, so a test that steps the
    /// clock with [`SimDevice::advance`] knows which job each step runs.
    #[default]
    InOrder,
    /// A head picked pseudo-randomly at each step by a small deterministic generator seeded with
    /// `seed`, as a GPU's copy engines and SMs run independently: work on one lane may overtake
    /// earlier work on another unless a wait orders them. The same seed and the same calls give
    /// the same order, so a failure reproduces.
    Interleaved {
        /// The generator's seed.
        seed: u64,
    },
}

/// A stream of the device: driver `k` owns streams `3k..3k+3`, one per [`Lane`] by index.
pub(super) type StreamId = usize;

/// The lane a stream serves.
pub(super) fn lane_of(stream: StreamId) -> Lane {
    Lane::ALL[stream % Lane::ALL.len()]
}

/// One step of splitmix64: a small, fast, deterministic generator, enough to pick a stream.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SimDevice {
    /// Runs up to `n` queued operations, one per step, each the head of a stream picked by the
    /// [schedule](Self::set_schedule) (by default, in program order). Returns how many ran. The
    /// wakes registered on the event records among them are called on this thread, once the
    /// device's lock is released, before this returns.
    pub fn advance(&self, n: usize) -> usize {
        let mut s = self.lock();
        let mut ran = 0;
        while ran < n && s.run_one() {
            ran += 1;
        }
        self.inner.progress.notify_all();
        ran
    }

    /// Sets how each step of the clock picks the stream that runs next, from now on (it restarts
    /// the generator of an interleaved schedule from its seed). Jobs already queued keep their
    /// order within their streams.
    pub fn set_schedule(&self, schedule: Schedule) {
        let mut s = self.lock();
        s.schedule = schedule;
        if let Schedule::Interleaved { seed } = schedule {
            s.rng = seed;
        }
    }

    /// Holds the device clock: from now on only [`advance`](Self::advance) (from any thread)
    /// runs queued work, and host waits (event and stream synchronize) block until the clock
    /// reaches what they wait for, as waits on a busy GPU do. A wake registered on an event (an
    /// awaited transfer's) is then called only once the clock runs the event's record. Copies
    /// with pageable host memory still complete within their call, as CUDA documents. `false`
    /// lets waits and wake registrations run the stream themselves again.
    pub fn hold_clock(&self, held: bool) {
        self.lock().clock_held = held;
        self.inner.progress.notify_all();
    }

    /// Runs every queued operation.
    pub fn advance_all(&self) -> usize {
        self.advance(usize::MAX)
    }

    /// How many operations are queued and not yet run, on every stream. Ordering records and
    /// cross-stream waits take no device time and are not counted: they run as soon as they can.
    pub fn queued(&self) -> usize {
        let s = self.lock();
        s.pending.len() - s.ordering_pending
    }

    /// How many queued operations have run since the device was made.
    pub fn completed(&self) -> u64 {
        self.lock().completed_jobs
    }
}

impl State {
    /// Queues `job` at the end of `stream`; returns its sequence number. An ordering job that
    /// can run at once (at its stream's head, and for a wait, what it waits for done) runs now.
    pub(super) fn push(&mut self, stream: StreamId, job: Job) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if job.orders_only() {
            self.ordering_pending += 1;
        }
        self.streams
            .entry(stream)
            .or_default()
            .push_back((seq, job));
        self.pending.insert(seq, stream);
        self.run_ordering();
        seq
    }

    /// Runs every ordering job that can run: a stream head that is an ordering record, or a
    /// wait whose record has run. They take no device time, so no step of the clock.
    pub(super) fn run_ordering(&mut self) {
        loop {
            let ready: Vec<StreamId> = self
                .streams
                .iter()
                .filter(|(_, queue)| match queue.front() {
                    Some((_, Job::OrderMarker)) => true,
                    Some((_, Job::Wait { for_seq })) => self.is_done(*for_seq),
                    _ => false,
                })
                .map(|(&id, _)| id)
                .collect();
            if ready.is_empty() {
                return;
            }
            for stream in ready {
                self.run_job(stream);
            }
        }
    }

    /// Whether job `seq` has run (a number never given out has not).
    pub(super) fn is_done(&self, seq: u64) -> bool {
        seq < self.next_seq && !self.pending.contains_key(&seq)
    }

    /// Whether every job queued on `streams` has run.
    pub(super) fn streams_idle(&self, streams: impl IntoIterator<Item = StreamId>) -> bool {
        streams
            .into_iter()
            .all(|id| !self.streams.contains_key(&id))
    }

    /// The last job queued on `stream`, if it has any not yet run.
    pub(super) fn last_on(&self, stream: StreamId) -> Option<u64> {
        self.streams.get(&stream)?.back().map(|(seq, _)| *seq)
    }

    /// The job a stream's head waits for and that has not run yet, if it is such a wait.
    fn blocked_on(&self, stream: StreamId) -> Option<u64> {
        match self.streams.get(&stream)?.front()? {
            (_, Job::Wait { for_seq }) if !self.is_done(*for_seq) => Some(*for_seq),
            (_, Job::Collective(part)) => self.collective_blocked_on(part),
            (_, Job::P2p(p)) => self.p2p_blocked_on(p),
            _ => None,
        }
    }

    /// The stream whose head the next step runs, as the schedule picks it; `None` when nothing
    /// is queued.
    fn pick(&mut self) -> Option<StreamId> {
        match self.schedule {
            // The job queued first can always run: whatever it waits for was queued before it.
            // (Or, where it is a collective's part, the first one that can: its other parts
            // were queued right after it.)
            Schedule::InOrder => self
                .pending
                .values()
                .copied()
                .find(|&stream| self.blocked_on(stream).is_none()),
            Schedule::Interleaved { .. } => {
                let ready: Vec<StreamId> = self
                    .streams
                    .keys()
                    .copied()
                    .filter(|&id| self.blocked_on(id).is_none())
                    .collect();
                if ready.is_empty() {
                    return None;
                }
                let at = splitmix64(&mut self.rng) % ready.len() as u64;
                Some(ready[at as usize])
            }
        }
    }

    /// Runs one step of the clock. `false` when nothing is queued.
    pub(super) fn run_one(&mut self) -> bool {
        match self.pick() {
            Some(stream) => {
                self.run_head(stream);
                true
            }
            None => false,
        }
    }

    /// Runs the head of `stream`, which must be able to run, then the ordering jobs it lets
    /// run.
    fn run_head(&mut self, stream: StreamId) {
        self.run_job(stream);
        self.run_ordering();
    }

    /// Runs the head of `stream`, which must be able to run.
    fn run_job(&mut self, stream: StreamId) {
        let Some(queue) = self.streams.get_mut(&stream) else {
            return;
        };
        let Some((seq, job)) = queue.pop_front() else {
            return;
        };
        if queue.is_empty() {
            self.streams.remove(&stream);
        }
        self.pending.remove(&seq);
        let counted = !job.orders_only();
        if !counted {
            self.ordering_pending -= 1;
        }
        self.running = Some(Running {
            seq,
            kind: job.kind(),
            stream,
        });
        self.execute(seq, stream, job);
        self.running = None;
        if counted {
            self.completed_jobs += 1;
        }
        if let Some(wakes) = self.wakes.remove(&seq) {
            self.woken.extend(wakes);
        }
    }

    /// Runs steps of the clock, as the schedule picks them, until job `seq` has run.
    pub(super) fn run_until(&mut self, seq: u64) {
        while !self.is_done(seq) && self.run_one() {}
    }

    /// Runs job `seq` and only what it must follow: the jobs before it on its stream, and what
    /// the waits among them wait for, transitively.
    pub(super) fn run_through(&mut self, seq: u64) {
        let mut goals = vec![seq];
        while let Some(&goal) = goals.last() {
            let Some(&stream) = self.pending.get(&goal) else {
                goals.pop();
                continue;
            };
            match self.blocked_on(stream) {
                // Never given out: nothing can run it (a collective missing a part).
                Some(first) if first >= self.next_seq => return,
                // Waits that wait for each other (parts of ranks queued in orders that cross):
                // a deadlock on the device, which nothing here can run either.
                Some(first) if goals.contains(&first) => return,
                Some(first) => goals.push(first),
                None => self.run_head(stream),
            }
        }
    }
}
