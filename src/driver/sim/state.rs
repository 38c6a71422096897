//! The device's state, and the lock that every call takes.
//!
//! One mutex guards the whole simulated machine (its memory, streams, events, faults and the
//! race checker's records), so each call of the seam sees and changes the device at one instant;
//! the concern files add to [`State`] the operations of their concern. [`Locked`] is the guard:
//! dropping it releases the lock and only then calls the wakes whose records ran meanwhile (and
//! raises the panic of a call armed by `SimDevice::panic_after_nth`), so a wake never runs under
//! the device's lock.

use super::graph;
use super::{
    DevicePtr, DriverError, Emulation, Job, NEXT_CONTEXT, Running, Schedule, SimConfig, SimEvent,
    SimOp, StreamId, Touch, Violation, Wake,
};
use crate::sync::unlock_first::{UnlockFirst, Unlocking};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// The whole simulated machine, behind the device's lock.
pub(super) struct State {
    pub(super) instance: u64,
    pub(super) ordinal: usize,
    /// Each device's context, by device index.
    pub(super) ctxs: Vec<u64>,
    /// Whether two devices (by index) are joined by a peer link.
    pub(super) peer_linked: Vec<Vec<bool>>,
    pub(super) memory_bytes: usize,
    pub(super) pinned_bytes: usize,
    pub(super) mem: BTreeMap<DevicePtr, Vec<u8>>,
    /// Bytes allocated on each device.
    pub(super) device_used: Vec<usize>,
    pub(super) next_addr: DevicePtr,
    /// The streams that hold queued jobs (an empty stream is removed), each in queue order.
    pub(super) streams: BTreeMap<StreamId, VecDeque<(u64, Job)>>,
    /// Every queued job's stream, by sequence number: a job queued and not here has run.
    pub(super) pending: BTreeMap<u64, StreamId>,
    /// How many of the pending jobs only order streams (ordering records and waits).
    pub(super) ordering_pending: usize,
    /// Sequence numbers are global: the order of the calls that queued the jobs.
    pub(super) next_seq: u64,
    /// The first stream of the next driver made on the device.
    pub(super) next_stream: StreamId,
    /// How the clock picks the next stream to run.
    pub(super) schedule: Schedule,
    /// The state of [`Schedule::Interleaved`]'s generator.
    pub(super) rng: u64,
    /// Every allocation's accesses by the jobs that have run, by base address (kept after the
    /// free: addresses are never reused).
    pub(super) touches: BTreeMap<DevicePtr, Touch>,
    /// The job running now, while it runs.
    pub(super) running: Option<Running>,
    pub(super) events: HashMap<u64, SimEvent>,
    pub(super) next_event: u64,
    pub(super) host: HashMap<usize, usize>,
    pub(super) host_used: usize,
    /// Registered host ranges: start and length.
    pub(super) registered: BTreeMap<usize, usize>,
    pub(super) registered_used: usize,
    pub(super) calls: BTreeMap<SimOp, u64>,
    pub(super) faults: Vec<(SimOp, u64, DriverError)>,
    /// Calls that panic instead of returning: (operation, call number).
    pub(super) panics: Vec<(SimOp, u64)>,
    /// Calls that take effect and then panic: (operation, call number).
    pub(super) panics_after: Vec<(SimOp, u64)>,
    /// The panic of an armed call that has taken effect, raised once the lock is released.
    pub(super) panic_on_release: Option<String>,
    /// Whether only `advance` runs queued work (waits block instead).
    pub(super) clock_held: bool,
    pub(super) event_faults: Vec<(u64, DriverError)>,
    pub(super) violations: Vec<Violation>,
    pub(super) completed_jobs: u64,
    /// Loaded modules, by handle: the emulation of the one kernel each holds.
    pub(super) modules: HashMap<u64, Arc<dyn Emulation>>,
    pub(super) next_module: u64,
    /// The next collective's number.
    pub(super) next_group: u64,
    /// Communicators whose ranks join one by one (`ncclCommInitRank`), by their id's number:
    /// the world's size and the ranks joined so far.
    pub(super) joins: HashMap<u64, (usize, Vec<usize>)>,
    /// The collectives of joined communicators, by id number and sequence: the collective's
    /// number, how many ranks have queued their part, and the first part's shape.
    pub(super) joined_groups: HashMap<(u64, u64), super::collective::JoinedGroup>,
    /// The ranks whose communicators were aborted, by world number and world rank: their parts
    /// end alone, touching nothing.
    pub(super) aborted_ranks: std::collections::HashSet<(u64, usize)>,
    /// Sends and receives: how many each rank has queued to (or from) each peer, by world
    /// number, sender, receiver and direction (`true` for sends).
    pub(super) p2p_next: HashMap<(u64, usize, usize, bool), u64>,
    /// The sends queued and not run, by channel: their jobs.
    pub(super) p2p_sends: HashMap<super::collective::Channel, u64>,
    /// The receives queued and not run, by channel: their jobs.
    pub(super) p2p_posted: HashMap<super::collective::Channel, u64>,
    /// The bytes of sends that have run, waiting for their receives, by channel.
    pub(super) p2p_data: HashMap<super::collective::Channel, Vec<u8>>,
    /// Streams on which a part failed (a collective's part launched without its partners), with
    /// the failure that the next event record run there reports.
    pub(super) failed_streams: HashMap<StreamId, DriverError>,
    /// The captures in progress, by the compute stream they capture.
    pub(super) captures: HashMap<StreamId, graph::Capture>,
    /// Captured graphs and the executable graphs instantiated from them.
    pub(super) graphs: graph::GraphTable,
    /// Registered wakes, by the sequence number of the record they wait for.
    pub(super) wakes: BTreeMap<u64, Vec<Wake>>,
    /// Wakes whose record has run, to be called once the lock is released ([`Locked`]).
    pub(super) woken: Vec<Wake>,
    /// The simulated process whose driver holds the lock now, if a driver's call took it: a
    /// killed process's calls fail as they enter (see `share.rs`).
    pub(super) caller: Option<u32>,
    /// The machine's processes, and what they export, import and open (see `share.rs`).
    pub(super) share: super::share::ShareState,
}

// SAFETY: the raw host pointers in queued jobs are addresses the engine guarantees (through the
// seam's unsafe contracts) to stay valid until the job runs, on whichever thread runs it; the
// state is only reached through the mutex.
unsafe impl Send for State {}

impl State {
    /// A fresh machine as `config` describes it: nothing allocated, queued or recorded.
    pub(super) fn new(config: SimConfig) -> Self {
        State {
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            ordinal: config.ordinal,
            ctxs: (0..config.devices.max(1))
                .map(|_| NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed))
                .collect(),
            peer_linked: vec![vec![true; config.devices.max(1)]; config.devices.max(1)],
            memory_bytes: config.memory_bytes,
            pinned_bytes: config.pinned_bytes,
            mem: BTreeMap::new(),
            device_used: vec![0; config.devices.max(1)],
            next_addr: 0x7f00_0000_0000,
            streams: BTreeMap::new(),
            pending: BTreeMap::new(),
            ordering_pending: 0,
            next_seq: 0,
            next_stream: 0,
            schedule: Schedule::InOrder,
            rng: 0,
            touches: BTreeMap::new(),
            running: None,
            events: HashMap::new(),
            next_event: 1,
            host: HashMap::new(),
            host_used: 0,
            registered: BTreeMap::new(),
            registered_used: 0,
            calls: BTreeMap::new(),
            faults: Vec::new(),
            panics: Vec::new(),
            panics_after: Vec::new(),
            panic_on_release: None,
            clock_held: false,
            event_faults: Vec::new(),
            violations: Vec::new(),
            completed_jobs: 0,
            modules: HashMap::new(),
            next_module: 1,
            next_group: 1,
            joins: HashMap::new(),
            joined_groups: HashMap::new(),
            aborted_ranks: std::collections::HashSet::new(),
            p2p_next: HashMap::new(),
            p2p_sends: HashMap::new(),
            p2p_posted: HashMap::new(),
            p2p_data: HashMap::new(),
            failed_streams: HashMap::new(),
            captures: HashMap::new(),
            graphs: graph::GraphTable::default(),
            wakes: BTreeMap::new(),
            woken: Vec::new(),
            caller: None,
            share: Default::default(),
        }
    }
}

/// The device's state, locked. Dropping it releases the lock and then calls the wakes whose
/// records ran meanwhile, so a wake never runs under the device's lock (it may take other
/// locks, or register another wake).
pub(super) type Locked<'a> = UnlockFirst<'a, State>;

impl<'a> UnlockFirst<'a, State> {
    /// Takes the device's lock, even one poisoned by a panic.
    pub(super) fn new(state: &'a Mutex<State>) -> Self {
        Self::taken(state, None)
    }

    /// Takes the device's lock for a call of the driver of simulated process `pid`.
    pub(super) fn of(state: &'a Mutex<State>, pid: u32) -> Self {
        Self::taken(state, Some(pid))
    }

    /// Takes the device's lock, for `caller`'s call if any: [`State::caller`] while this holds
    /// the lock.
    fn taken(state: &'a Mutex<State>, caller: Option<u32>) -> Self {
        let mut locked = UnlockFirst::lock(state);
        locked.caller = caller;
        locked
    }

    /// Releases the lock until `progress` is signalled, then takes it again.
    pub(super) fn wait(self, progress: &Condvar) -> Self {
        self.relock(|mut guard| {
            let caller = guard.caller.take();
            let mut guard = progress.wait(guard).unwrap_or_else(|e| e.into_inner());
            guard.caller = caller;
            guard
        })
    }

    /// As [`wait`](Self::wait), for at most `within`.
    pub(super) fn wait_timeout(self, progress: &Condvar, within: std::time::Duration) -> Self {
        self.relock(|mut guard| {
            let caller = guard.caller.take();
            let (mut guard, _) = progress
                .wait_timeout(guard, within)
                .unwrap_or_else(|e| e.into_inner());
            guard.caller = caller;
            guard
        })
    }
}

impl Unlocking for State {
    /// The wakes that came due, and the panic a call armed by `panic_after_nth` owes.
    type Then = Option<(Vec<Wake>, Option<String>)>;

    fn on_unlock(&mut self, unwinding: bool) -> Self::Then {
        self.caller = None;
        if unwinding {
            // Not while unwinding: the wakes stay for the next holder of the lock to call.
            return None;
        }
        Some((
            std::mem::take(&mut self.woken),
            self.panic_on_release.take(),
        ))
    }

    fn after_unlock(then: Self::Then) {
        let Some((woken, panic)) = then else { return };
        // Now, or once this thread holds no engine lock (see `driver::callbacks`).
        crate::driver::callbacks::call(woken);
        if let Some(message) = panic {
            // A call armed by `panic_after_nth`: it has taken effect, and now panics.
            panic!("{message}");
        }
    }
}
