//! The simulated device: the device seam implemented in host memory, deterministically.
//!
//! It exists so that every route's lifecycle code runs in CI, which has no GPU, exactly as it
//! runs on a real device, and so users can test their own pipelines the same way. It models what
//! the lifecycle types must be right about:
//!
//! - **Asynchrony.** Copies, frees, launches, event records and waits are queued in call order
//!   and take effect only when the device clock advances ([`SimDevice::advance`]) or something
//!   waits (an event or stream synchronize). A copy that has not completed has not written its
//!   destination, and a host-to-device copy from page-locked memory (pinned, or registered with
//!   `host_register`) reads its source when it runs, not when it is queued. Copies with pageable
//!   host memory behave as CUDA documents: a host-to-device copy stages its source before the
//!   call returns, a device-to-host copy returns only once complete.
//! - **Streams.** Each driver (one per engine; several engines may share one device) owns three
//!   streams on the device, one per lane: host-to-device copies go on the upload stream,
//!   device-to-host copies on the download stream, everything else on the compute stream. Each
//!   stream runs its jobs in the order they were queued; nothing orders two streams but a wait:
//!   a `stream_wait` queues a wait on its lane that holds that stream until the event's
//!   last record (as of the call) has run, as `cuStreamWaitEvent` does. A wait for an event never
//!   recorded, or whose record has already run, holds nothing.
//! - **Schedules.** Each step of the clock runs the head of one stream whose head may run (its
//!   wait, if it is one, is satisfied). [`Schedule::InOrder`] (the default) picks the head queued
//!   first, which is exactly program order; [`Schedule::Interleaved`] picks one pseudo-randomly
//!   from a seed, as the copy engines and the SMs of a GPU run independently
//!   ([`SimDevice::set_schedule`]). A synchronize of one lane runs only that lane's stream and
//!   what it waits for.
//! - **Races.** Every job that runs records which device allocations it reads and writes (a copy
//!   its source and destination, a free its whole allocation, a launch whatever its emulation
//!   reads and writes). A job that writes an allocation a job queued after it has already read or
//!   written, or reads one that a job queued after it has already written, is a
//!   [violation](SimDevice::violations): the two were not ordered, so the device could run them
//!   either way round. A correct engine therefore computes, under any schedule, exactly what it
//!   computes with everything in program order on one stream.
//! - **Events.** A query reports completion only once the event's record has run, and a record
//!   runs only once everything queued before it on its stream (and what that waited for) has.
//! - **Faults.** [`SimDevice::fail_nth`] makes the n-th call of an operation return a driver
//!   error (a wait too: [`SimOp::StreamWait`]); [`SimDevice::fail_event`] makes a recorded event
//!   report an error once the device reaches it.
//! - **Wakes.** A wake registered on an event (what an awaited transfer asks for) is called when
//!   the device runs the event's record, or at once if it already has, failed or not; always
//!   after the device's lock is released, on the thread that ran the record. Registering one is
//!   a wait that does not block: unless the clock is held, it runs the device up to the event,
//!   as a host wait would.
//! - **Graphs.** A capture belongs to its driver's compute stream: between its begin and end,
//!   launches are recorded instead of queued, and any other operation on the compute lane fails
//!   and invalidates the capture; the upload and download lanes are not captured. A replay of
//!   an instantiated graph queues its launches in order on the compute stream, like eager
//!   launches ([`SimDevice::graph_launches`], [`SimDevice::graphs_live`]).
//! - **Stream-ordered allocation.** Device memory is allocated at the call and released when
//!   its queued free runs. An allocation that does not fit may take the memory of frees its
//!   driver has queued and the device has not run yet: its stream then waits for them, as CUDA's
//!   pools reuse memory through internal dependencies by default.
//! - **Use-after-free of DMA memory.** Freeing pinned host memory that a queued copy still names
//!   is recorded as a [violation](SimDevice::violations) and the memory is kept (never freed), so
//!   a lifecycle bug is reported by the tests instead of corrupting memory. Unregistering a
//!   registered range that a queued copy still names is a violation too, and is refused, so the
//!   caller keeps (leaks) the memory instead of freeing it under the copy.
//!
//! Contexts are modelled per thread, so the context-restoring rules of raw scopes are testable
//! too ([`thread_context`], [`set_thread_context`], [`SimDevice::foreign_context`]).

mod collective;
mod graph;
mod launch;
mod libs;

use super::launch::Emulation;
use super::{ContextHandle, DevicePtr, Driver, EventHandle, Lane, Waits, Wake};
use crate::error::{DeviceId, DeviceKind, DriverError};
use std::alloc::Layout;
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// How to build a simulated device.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The ordinal the device reports.
    pub ordinal: usize,
    /// Device memory capacity in bytes; allocations beyond it fail with
    /// `CUDA_ERROR_OUT_OF_MEMORY`. Memory whose free an engine has queued counts as available
    /// to that engine's allocations, which are then ordered after the free on the device (as
    /// CUDA's stream-ordered allocator reuses it).
    pub memory_bytes: usize,
    /// Page-locked host memory capacity in bytes, pinned allocations and registered ranges
    /// together; allocations and registrations beyond it fail likewise.
    pub pinned_bytes: usize,
    /// How many devices the simulated machine has (ordinals `ordinal`, `ordinal + 1`, ...), each
    /// with `memory_bytes` of its own, one clock for all, and every pair joined by a peer link
    /// unless [`SimDevice::set_peer_link`] removes it. An engine opens on one by its index
    /// (`simulated_on_device`).
    pub devices: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            ordinal: 0,
            memory_bytes: 4 << 30,
            pinned_bytes: 4 << 30,
            devices: 1,
        }
    }
}

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

/// A device operation, as fault injection and call counting name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum SimOp {
    /// Stream-ordered device allocation.
    Alloc,
    /// Stream-ordered device free.
    Free,
    /// Host-to-device copy enqueue.
    CopyHtoD,
    /// Device-to-host copy enqueue.
    CopyDtoH,
    /// Device-to-device copy enqueue.
    CopyDtoD,
    /// Event creation.
    EventCreate,
    /// Event record.
    EventRecord,
    /// Event query.
    EventQuery,
    /// Event synchronize (a host wait).
    EventSynchronize,
    /// Event destruction.
    EventDestroy,
    /// Pinned host allocation.
    HostAlloc,
    /// Pinned host free.
    HostFree,
    /// Registration (page-locking) of existing host memory.
    HostRegister,
    /// Unregistration of registered host memory.
    HostUnregister,
    /// Stream synchronize (a host wait).
    StreamSynchronize,
    /// Stream query.
    StreamQuery,
    /// Module compile and load (the simulator accepts only modules that carry an emulation).
    ModuleLoad,
    /// Kernel launch.
    Launch,
    /// Start of a stream capture.
    CaptureBegin,
    /// End of a stream capture (it ends the capture even when it fails).
    CaptureEnd,
    /// Instantiation of a captured graph.
    GraphInstantiate,
    /// Replacement of a kernel node's parameters in an instantiated graph.
    GraphSetParams,
    /// Replay of an instantiated graph.
    GraphLaunch,
    /// Destruction of a captured or an instantiated graph.
    GraphDestroy,
    /// Registration of a wake called once an event's work has completed (what awaiting a
    /// pending transfer asks for).
    NotifyAfter,
    /// A lane's wait for an event recorded on another (`cuStreamWaitEvent`).
    StreamWait,
    /// Creation of an event that only orders lanes (see `Driver::ordering_event_create`).
    OrderEventCreate,
    /// A record of such an event.
    OrderRecord,
    /// Enabling a context's access to a peer device's memory, or a pool's to a peer device.
    PeerEnable,
    /// Peer copy enqueue (between engines, on one device or across a peer link).
    CopyPeer,
    /// A rank's part of a collective, added to its group (`ncclAllReduce`, `ncclBroadcast`).
    /// A refused part leaves the group's other parts to be launched by its end.
    Collective,
    /// The making of communicators (`ncclCommInitAll`).
    CommInit,
    /// The start of a collective's group (`ncclGroupStart`).
    GroupStart,
    /// The end of a collective's group, which launches its parts (`ncclGroupEnd`). A refused end
    /// launches none of them.
    GroupEnd,
    /// The making of a library's handle, bound to the compute stream (`cublasCreate_v2`,
    /// `cusolverDnCreate`, `cutensorCreate`).
    LibraryOpen,
    /// A matrix product's enqueue (`cublas?gemm_v2`).
    Gemm,
    /// The query of a Cholesky factorisation's workspace (`cusolverDn?potrf_bufferSize`).
    SolverWorkspace,
    /// A Cholesky factorisation's enqueue (`cusolverDn?potrf`).
    Potrf,
    /// A Cholesky solve's enqueue (`cusolverDn?potrs`).
    Potrs,
    /// The planning of a tensor contraction (`cutensorCreatePlan` and what precedes it).
    ContractionPlan,
    /// A tensor contraction's enqueue (`cutensorContract`).
    Contract,
}

/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
const HOST_MEMORY_ALREADY_REGISTERED: u32 = 712;
/// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
const HOST_MEMORY_NOT_REGISTERED: u32 = 713;

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);
static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(0x5100_0000);

thread_local! {
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

/// The simulated context current on this thread (`None` when none is).
pub fn thread_context() -> Option<u64> {
    let c = CURRENT.with(Cell::get);
    (c != 0).then_some(c)
}

/// Makes a simulated context current on this thread, or unbinds with `None`.
pub fn set_thread_context(ctx: Option<u64>) {
    CURRENT.with(|c| c.set(ctx.unwrap_or(0)));
}

enum Job {
    HtoD {
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
    },
    /// A host-to-device copy from pageable memory, whose bytes were staged at the call.
    HtoDStaged {
        dst: DevicePtr,
        data: Vec<u8>,
    },
    DtoH {
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
    },
    DtoD {
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    },
    Free(DevicePtr),
    Marker,
    /// The record of an event that only orders lanes: it takes no device time, so it runs as
    /// soon as it reaches its stream's head, outside the clock.
    OrderMarker,
    /// A kernel launch, run by its module's emulation when the stream reaches it.
    Launch {
        emulation: Arc<dyn Emulation>,
        params: Vec<u64>,
    },
    /// A wait for another stream: it may run only once the job `for_seq` (an event record's
    /// marker) has run, and holds its stream until then. It takes no device time: it runs as
    /// soon as it can, outside the clock.
    Wait {
        for_seq: u64,
    },
    /// Rank `rank`'s part of collective `group`: it runs, with every other rank's part, once
    /// each has reached the head of its stream.
    Collective(collective::Part),
}

impl Job {
    /// The host range this job touches, if any.
    fn host_range(&self) -> Option<(usize, usize)> {
        match *self {
            Job::HtoD { src, bytes, .. } => Some((src as usize, bytes)),
            Job::DtoH { dst, bytes, .. } => Some((dst as usize, bytes)),
            _ => None,
        }
    }

    /// What the job is, for violations.
    fn kind(&self) -> &'static str {
        match self {
            Job::HtoD { .. } | Job::HtoDStaged { .. } => "host-to-device copy",
            Job::DtoH { .. } => "device-to-host copy",
            Job::DtoD { .. } => "device-to-device copy",
            Job::Free(_) => "free",
            Job::Marker => "event record",
            Job::OrderMarker => "ordering event record",
            Job::Launch { .. } => "kernel launch",
            Job::Wait { .. } => "wait",
            Job::Collective(_) => "collective",
        }
    }

    /// Whether the job only orders streams: it takes no device time and no step of the clock.
    fn orders_only(&self) -> bool {
        matches!(self, Job::OrderMarker | Job::Wait { .. })
    }
}

/// A stream of the device: driver `k` owns streams `3k..3k+3`, one per [`Lane`] by index.
type StreamId = usize;

/// The lane a stream serves.
fn lane_of(stream: StreamId) -> Lane {
    Lane::ALL[stream % Lane::ALL.len()]
}

/// A stream, for violations: its lane and its driver.
fn describe_stream(stream: StreamId) -> String {
    format!(
        "the {:?} lane of driver {}",
        lane_of(stream),
        stream / Lane::ALL.len()
    )
}

/// One step of splitmix64: a small, fast, deterministic generator, enough to pick a stream.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The accesses to one device allocation by the jobs that have run, for the race checker.
struct Touch {
    /// The allocation's length in bytes.
    len: usize,
    /// The device (index on the machine) that holds it.
    device: usize,
    /// The highest sequence number of a job that has read it.
    read: Option<u64>,
    /// The highest sequence number of a job that has written (or freed) it.
    write: Option<u64>,
}

/// The job running now, for the race checker: its sequence number, what it is, its stream.
#[derive(Clone, Copy)]
struct Running {
    seq: u64,
    kind: &'static str,
    stream: StreamId,
}

struct SimEvent {
    /// Whether it only orders lanes (made by `ordering_event_create`).
    ordering: bool,
    /// Sequence number of the marker of the last record, if recorded.
    recorded: Option<u64>,
    /// The error this record reports once the device reaches it.
    fault: Option<DriverError>,
}

struct State {
    instance: u64,
    ordinal: usize,
    /// Each device's context, by device index.
    ctxs: Vec<u64>,
    /// Whether two devices (by index) are joined by a peer link.
    peer_linked: Vec<Vec<bool>>,
    memory_bytes: usize,
    pinned_bytes: usize,
    mem: BTreeMap<DevicePtr, Vec<u8>>,
    /// Bytes allocated on each device.
    device_used: Vec<usize>,
    next_addr: DevicePtr,
    /// The streams that hold queued jobs (an empty stream is removed), each in queue order.
    streams: BTreeMap<StreamId, VecDeque<(u64, Job)>>,
    /// Every queued job's stream, by sequence number: a job queued and not here has run.
    pending: BTreeMap<u64, StreamId>,
    /// How many of the pending jobs only order streams (ordering records and waits).
    ordering_pending: usize,
    /// Sequence numbers are global: the order of the calls that queued the jobs.
    next_seq: u64,
    /// The first stream of the next driver made on the device.
    next_stream: StreamId,
    /// How the clock picks the next stream to run.
    schedule: Schedule,
    /// The state of [`Schedule::Interleaved`]'s generator.
    rng: u64,
    /// Every allocation's accesses by the jobs that have run, by base address (kept after the
    /// free: addresses are never reused).
    touches: BTreeMap<DevicePtr, Touch>,
    /// The job running now, while it runs.
    running: Option<Running>,
    events: HashMap<u64, SimEvent>,
    next_event: u64,
    host: HashMap<usize, usize>,
    host_used: usize,
    /// Registered host ranges: start and length.
    registered: BTreeMap<usize, usize>,
    registered_used: usize,
    calls: BTreeMap<SimOp, u64>,
    faults: Vec<(SimOp, u64, DriverError)>,
    /// Calls that panic instead of returning: (operation, call number).
    panics: Vec<(SimOp, u64)>,
    /// Calls that take effect and then panic: (operation, call number).
    panics_after: Vec<(SimOp, u64)>,
    /// The panic of an armed call that has taken effect, raised once the lock is released.
    panic_on_release: Option<String>,
    /// Whether only `advance` runs queued work (waits block instead).
    clock_held: bool,
    event_faults: Vec<(u64, DriverError)>,
    violations: Vec<String>,
    completed_jobs: u64,
    /// Loaded modules, by handle: the emulation of the one kernel each holds.
    modules: HashMap<u64, Arc<dyn Emulation>>,
    next_module: u64,
    /// The next collective's number.
    next_group: u64,
    /// Streams on which a part failed (a collective's part launched without its partners), with
    /// the failure that the next event record run there reports.
    failed_streams: HashMap<StreamId, DriverError>,
    /// The captures in progress, by the compute stream they capture.
    captures: HashMap<StreamId, graph::Capture>,
    /// Captured graphs and the executable graphs instantiated from them.
    graphs: graph::GraphTable,
    /// Registered wakes, by the sequence number of the record they wait for.
    wakes: BTreeMap<u64, Vec<Wake>>,
    /// Wakes whose record has run, to be called once the lock is released ([`Locked`]).
    woken: Vec<Wake>,
}

// SAFETY: the raw host pointers in queued jobs are addresses the engine guarantees (through the
// seam's unsafe contracts) to stay valid until the job runs, on whichever thread runs it; the
// state is only reached through the mutex.
unsafe impl Send for State {}

/// A handle to a simulated device: its clock, its fault injection and its accounting.
///
/// Clones share the device. The engine that drives it holds one; tests hold another (from the
/// engine's `sim` method) to advance the clock and inject faults between engine operations.
#[derive(Clone)]
pub struct SimDevice {
    inner: Arc<Inner>,
}

/// The device's state, and a signal for waits blocked on a held clock.
struct Inner {
    state: Mutex<State>,
    progress: Condvar,
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("SimDevice")
            .field("instance", &s.instance)
            .field("ordinal", &s.ordinal)
            .field("queued", &s.pending.len())
            .finish()
    }
}

impl SimDevice {
    /// Creates a simulated device.
    pub fn new(config: SimConfig) -> Self {
        let state = State {
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
            failed_streams: HashMap::new(),
            captures: HashMap::new(),
            graphs: graph::GraphTable::default(),
            wakes: BTreeMap::new(),
            woken: Vec::new(),
        };
        SimDevice {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                progress: Condvar::new(),
            }),
        }
    }

    fn lock(&self) -> Locked<'_> {
        Locked {
            guard: Some(self.inner.state.lock().unwrap_or_else(|e| e.into_inner())),
        }
    }

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

    /// Makes the `n`-th call of `op` from now (`n >= 1`) panic inside the driver, as a driver
    /// library with a missing symbol does, to test that no panic releases memory a queued copy
    /// may still touch.
    pub fn panic_nth(&self, op: SimOp, n: u64) {
        let mut s = self.lock();
        let at = s.nth_call_from_now(op, n);
        s.panics.push((op, at));
    }

    /// Makes the `n`-th call of `op` from now (`n >= 1`) take effect and then panic inside the
    /// driver, before it returns: a copy is queued (or memory allocated, an event recorded) and
    /// the caller never learns it. No panic may then release what the call's work may touch.
    pub fn panic_after_nth(&self, op: SimOp, n: u64) {
        let mut s = self.lock();
        let at = s.nth_call_from_now(op, n);
        s.panics_after.push((op, at));
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

    /// Makes the `n`-th call of `op` from now (`n >= 1`) fail with `error`.
    pub fn fail_nth(&self, op: SimOp, n: u64, error: DriverError) {
        let mut s = self.lock();
        let at = s.nth_call_from_now(op, n);
        s.faults.push((op, at, error));
    }

    /// Makes the event of the `n`-th event record from now (`n >= 1`) report `error` once the
    /// device reaches it, as a failed kernel or copy before it would.
    pub fn fail_event(&self, n: u64, error: DriverError) {
        let mut s = self.lock();
        let at = s.nth_call_from_now(SimOp::EventRecord, n);
        s.event_faults.push((at, error));
    }

    /// Removes every pending fault.
    pub fn clear_faults(&self) {
        let mut s = self.lock();
        s.faults.clear();
        s.event_faults.clear();
        s.panics.clear();
        s.panics_after.clear();
        s.panic_on_release = None;
    }

    /// How many times `op` has been called.
    pub fn calls(&self, op: SimOp) -> u64 {
        self.lock().calls.get(&op).copied().unwrap_or(0)
    }

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

    /// Live events (created and not destroyed).
    pub fn events_live(&self) -> usize {
        self.lock().events.values().filter(|e| !e.ordering).count()
    }

    /// Live events that only order one stream after another (the engine makes at most one per
    /// stream, and destroys them at teardown).
    pub fn ordering_events_live(&self) -> usize {
        self.lock().events.values().filter(|e| e.ordering).count()
    }

    /// Lifecycle violations the device observed, such as pinned memory freed while a queued copy
    /// still named it. A correct engine leaves this empty.
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// Whether `ptr` is the start of a live pinned host allocation of this device.
    pub fn is_pinned_live(&self, ptr: *const u8) -> bool {
        self.lock().host.contains_key(&(ptr as usize))
    }

    /// A fresh context that belongs to no engine, for testing that raw scopes restore whatever
    /// was current before them.
    pub fn foreign_context() -> u64 {
        NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed)
    }

    /// This device's own context handle (the first device's, on a machine of several).
    pub fn context(&self) -> u64 {
        self.lock().ctxs[0]
    }

    /// How many devices the simulated machine has.
    pub fn devices(&self) -> usize {
        self.lock().ctxs.len()
    }

    /// Joins (or, with `linked` false, separates) devices `a` and `b` (indices on the machine):
    /// peer copies between engines on them are possible only while they are linked.
    ///
    /// # Panics
    /// When `a` or `b` is not a device of the machine.
    pub fn set_peer_link(&self, a: usize, b: usize, linked: bool) {
        let mut s = self.lock();
        let n = s.ctxs.len();
        assert!(a < n && b < n, "devices {a} and {b} of a machine of {n}");
        s.peer_linked[a][b] = linked;
        s.peer_linked[b][a] = linked;
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

/// The device's state, locked. Dropping it releases the lock and then calls the wakes whose
/// records ran meanwhile, so a wake never runs under the device's lock (it may take other
/// locks, or register another wake).
struct Locked<'a> {
    /// `Some` except while [`wait`](Self::wait) has handed the guard to the condition variable.
    guard: Option<MutexGuard<'a, State>>,
}

impl Locked<'_> {
    /// Releases the lock until `progress` is signalled, then takes it again.
    fn wait(mut self, progress: &Condvar) -> Self {
        let guard = self.guard.take().expect("a live lock holds its guard");
        let guard = progress.wait(guard).unwrap_or_else(|e| e.into_inner());
        self.guard = Some(guard);
        self
    }
}

impl Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.guard.as_ref().expect("a live lock holds its guard")
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard.as_mut().expect("a live lock holds its guard")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let Some(mut guard) = self.guard.take() else {
            return;
        };
        if std::thread::panicking() {
            // Not while unwinding: the wakes stay for the next holder of the lock to call.
            return;
        }
        let woken = std::mem::take(&mut guard.woken);
        let panic = guard.panic_on_release.take();
        drop(guard);
        // Now, or once this thread holds no engine lock (see `driver::wakes`).
        super::wakes::call(woken);
        if let Some(message) = panic {
            // A call armed by `panic_after_nth`: it has taken effect, and now panics.
            panic!("{message}");
        }
    }
}

impl State {
    /// The number the `n`-th call of `op` from now (`n >= 1`) will have; saturates, never
    /// overflows.
    fn nth_call_from_now(&self, op: SimOp, n: u64) -> u64 {
        self.calls
            .get(&op)
            .copied()
            .unwrap_or(0)
            .saturating_add(n.max(1))
    }

    fn enter(&mut self, op: SimOp) -> Result<(), DriverError> {
        let n = self.calls.entry(op).or_insert(0);
        *n += 1;
        let n = *n;
        if let Some(i) = self.panics.iter().position(|p| *p == (op, n)) {
            self.panics.remove(i);
            panic!("simulated driver panic in {op:?} (call {n})");
        }
        if let Some(i) = self.panics_after.iter().position(|p| *p == (op, n)) {
            self.panics_after.remove(i);
            self.panic_on_release = Some(format!("simulated driver panic after {op:?} (call {n})"));
        }
        if let Some(i) = self.faults.iter().position(|f| f.0 == op && f.1 == n) {
            return Err(self.faults.remove(i).2);
        }
        Ok(())
    }

    /// As [`enter`](Self::enter), for an operation on `stream` that a capture cannot record:
    /// while the stream captures, it fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and
    /// invalidates the capture, as CUDA does.
    fn enter_stream(&mut self, op: SimOp, stream: StreamId) -> Result<(), DriverError> {
        self.enter(op)?;
        self.refuse_in_capture(stream)
    }

    /// Whether `addr..addr+bytes` lies inside one live pinned allocation or one registered range
    /// of this device: page-locked memory, which copies reach when they run.
    fn is_page_locked(&self, addr: usize, bytes: usize) -> bool {
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

    /// Queues `job` at the end of `stream`; returns its sequence number. An ordering job that
    /// can run at once (at its stream's head, and for a wait, what it waits for done) runs now.
    fn push(&mut self, stream: StreamId, job: Job) -> u64 {
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
    fn run_ordering(&mut self) {
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
    fn is_done(&self, seq: u64) -> bool {
        seq < self.next_seq && !self.pending.contains_key(&seq)
    }

    /// Whether every job queued on `streams` has run.
    fn streams_idle(&self, streams: impl IntoIterator<Item = StreamId>) -> bool {
        streams
            .into_iter()
            .all(|id| !self.streams.contains_key(&id))
    }

    /// The last job queued on `stream`, if it has any not yet run.
    fn last_on(&self, stream: StreamId) -> Option<u64> {
        self.streams.get(&stream)?.back().map(|(seq, _)| *seq)
    }

    /// The job a stream's head waits for and that has not run yet, if it is such a wait.
    fn blocked_on(&self, stream: StreamId) -> Option<u64> {
        match self.streams.get(&stream)?.front()? {
            (_, Job::Wait { for_seq }) if !self.is_done(*for_seq) => Some(*for_seq),
            (_, Job::Collective(part)) => self.collective_blocked_on(part),
            _ => None,
        }
    }

    fn block_mut(&mut self, ptr: DevicePtr, bytes: usize) -> Option<&mut [u8]> {
        let (base, block) = self.mem.range_mut(..=ptr).next_back()?;
        let off = usize::try_from(ptr - *base).ok()?;
        block.get_mut(off..off.checked_add(bytes)?)
    }

    /// Records that the running job reads (or writes) the allocation holding `ptr`, and reports
    /// a race when a job queued after it has already made a conflicting access: a write after a
    /// later read or write, or a read after a later write.
    fn access(&mut self, ptr: DevicePtr, write: bool) {
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
            (Some(w), _) => Some((w, "wrote")),
            (None, true) => later(touch.read).map(|r| (r, "read")),
            (None, false) => None,
        };
        let slot = if write {
            &mut touch.write
        } else {
            &mut touch.read
        };
        *slot = Some(slot.map_or(job.seq, |at| at.max(job.seq)));
        if let Some((other, verb)) = conflict {
            let violation = format!(
                "job #{} ({} on {}) used device block {base:#x} after later job #{other} {verb} it: \
                 the two are not ordered",
                job.seq,
                job.kind,
                describe_stream(job.stream)
            );
            if !self.violations.contains(&violation) {
                self.violations.push(violation);
            }
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
    fn run_one(&mut self) -> bool {
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
        match job {
            Job::HtoDStaged { dst, data } => {
                self.access(dst, true);
                match self.block_mut(dst, data.len()) {
                    Some(d) => d.copy_from_slice(&data),
                    None => self.violations.push(format!(
                        "host-to-device copy into unmapped device range {dst:#x}+{}",
                        data.len()
                    )),
                }
            }
            Job::HtoD { dst, src, bytes } => {
                self.access(dst, true);
                match self.block_mut(dst, bytes) {
                    Some(d) => {
                        // SAFETY: the seam's contract keeps `src..src+bytes` readable until this
                        // job has run; `d` is device memory owned by the simulator, disjoint
                        // from it.
                        unsafe { std::ptr::copy_nonoverlapping(src, d.as_mut_ptr(), bytes) }
                    }
                    None => self.violations.push(format!(
                        "host-to-device copy into unmapped device range {dst:#x}+{bytes}"
                    )),
                }
            }
            Job::DtoH { dst, src, bytes } => {
                self.access(src, false);
                match self.block_mut(src, bytes) {
                    Some(s) => {
                        // SAFETY: the seam's contract keeps `dst..dst+bytes` writable and
                        // untouched by the host until this job has run; `s` is simulator-owned
                        // memory.
                        unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), dst, bytes) }
                    }
                    None => self.violations.push(format!(
                        "device-to-host copy from unmapped device range {src:#x}+{bytes}"
                    )),
                }
            }
            Job::DtoD { dst, src, bytes } => {
                self.access(src, false);
                self.access(dst, true);
                let data = self.block_mut(src, bytes).map(|s| s.to_vec());
                match (data, self.block_mut(dst, bytes)) {
                    (Some(data), Some(d)) => d.copy_from_slice(&data),
                    _ => self.violations.push(format!(
                        "device-to-device copy {src:#x} -> {dst:#x} of {bytes} bytes touches unmapped memory"
                    )),
                }
            }
            Job::Free(ptr) => {
                self.access(ptr, true);
                match self.mem.remove(&ptr) {
                    Some(block) => {
                        let device = self.touches.get(&ptr).map_or(0, |t| t.device);
                        self.device_used[device] -= block.len();
                    }
                    None => self
                        .violations
                        .push(format!("free of unknown device pointer {ptr:#x}")),
                }
            }
            Job::Marker => self.report_stream_failure(seq, stream),
            Job::OrderMarker | Job::Wait { .. } => {}
            Job::Launch { emulation, params } => {
                if let Err(violation) = emulation.run(self, &params) {
                    self.violations.push(violation);
                }
            }
            Job::Collective(part) => self.run_collective(seq, stream, part),
        }
        self.running = None;
        if counted {
            self.completed_jobs += 1;
        }
        if let Some(wakes) = self.wakes.remove(&seq) {
            self.woken.extend(wakes);
        }
    }

    /// Runs steps of the clock, as the schedule picks them, until job `seq` has run.
    fn run_until(&mut self, seq: u64) {
        while !self.is_done(seq) && self.run_one() {}
    }

    /// Runs job `seq` and only what it must follow: the jobs before it on its stream, and what
    /// the waits among them wait for, transitively.
    fn run_through(&mut self, seq: u64) {
        let mut goals = vec![seq];
        while let Some(&goal) = goals.last() {
            let Some(&stream) = self.pending.get(&goal) else {
                goals.pop();
                continue;
            };
            match self.blocked_on(stream) {
                // Never given out: nothing can run it (a collective missing a part).
                Some(first) if first >= self.next_seq => return,
                Some(first) => goals.push(first),
                None => self.run_head(stream),
            }
        }
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

    fn event(&mut self, event: EventHandle) -> Result<&mut SimEvent, DriverError> {
        self.events
            .get_mut(&event.0)
            .ok_or(DriverError::INVALID_VALUE)
    }
}

impl SimDriver {
    /// Allocates `bytes` on device `index` of the machine, ordered on this driver's `lane`.
    fn alloc_on_device(
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
        block.resize(bytes, 0xA5);
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
        Ok(ptr)
    }
}

/// The driver half of a simulated device: what a simulated engine drives.
pub(crate) struct SimDriver {
    device: SimDevice,
    id: DeviceId,
    /// Which device of the machine the driver drives.
    index: usize,
    /// The devices (indices) granted access to this driver's memory.
    granted: Vec<usize>,
    ctx: u64,
    /// The driver's first stream on the device: its lanes' streams are `streams + lane index`.
    streams: StreamId,
    /// The contraction plans made on this driver, by handle (freed slots are `None`).
    plans: Vec<Option<libs::Plan>>,
}

impl SimDriver {
    /// A driver on the first device of the machine `device`, with three streams of its own there.
    pub(crate) fn new(device: SimDevice) -> Self {
        Self::on(device, 0).expect("a simulated machine has at least one device")
    }

    /// A driver on device `index` of the machine `device`, with three streams of its own there;
    /// `None` when the machine has no such device.
    pub(crate) fn on(device: SimDevice, index: usize) -> Option<Self> {
        let (instance, ordinal, ctx, streams) = {
            let mut s = device.lock();
            let ctx = *s.ctxs.get(index)?;
            let streams = s.next_stream;
            s.next_stream += Lane::ALL.len();
            (s.instance, s.ordinal + index, ctx, streams)
        };
        Some(SimDriver {
            device,
            id: DeviceId {
                kind: DeviceKind::Simulated,
                ordinal,
                instance,
            },
            index,
            granted: Vec::new(),
            ctx,
            streams,
            plans: Vec::new(),
        })
    }

    fn lock(&self) -> Locked<'_> {
        self.device.lock()
    }

    /// The index on the machine of device `peer`, when it is a device of this machine linked to
    /// this driver's (or this driver's own).
    fn linked(&self, s: &State, peer: DeviceId) -> Option<usize> {
        let index = peer.ordinal.checked_sub(s.ordinal)?;
        let ours = peer.kind == DeviceKind::Simulated && peer.instance == s.instance;
        (ours && s.peer_linked.get(self.index)?.get(index) == Some(&true)).then_some(index)
    }

    /// The device stream of one of the driver's lanes.
    fn stream(&self, lane: Lane) -> StreamId {
        self.streams + lane.index()
    }

    /// Creates an event, counted as `op`; `ordering` for one that only orders lanes.
    fn create_event(&mut self, op: SimOp, ordering: bool) -> Result<EventHandle, DriverError> {
        let mut s = self.lock();
        s.enter(op)?;
        let id = s.next_event;
        s.next_event += 1;
        s.events.insert(
            id,
            SimEvent {
                ordering,
                recorded: None,
                fault: None,
            },
        );
        Ok(EventHandle(id))
    }
}

impl Driver for SimDriver {
    fn device(&self) -> DeviceId {
        self.id
    }

    fn name(&self) -> &str {
        "cuferry simulated device"
    }

    fn context(&self) -> ContextHandle {
        ContextHandle(self.ctx)
    }

    fn stream_handle(&self) -> u64 {
        // Distinct for every driver's compute stream (the first driver's is `instance << 8 | 1`).
        (self.id.instance << 8 | 1) + ((self.streams as u64) << 32)
    }

    fn current_context(&self) -> Result<ContextHandle, DriverError> {
        Ok(ContextHandle(CURRENT.with(Cell::get)))
    }

    fn set_current_context(&self, ctx: ContextHandle) -> Result<(), DriverError> {
        CURRENT.with(|c| c.set(ctx.0));
        Ok(())
    }

    fn alloc(&mut self, lane: Lane, bytes: usize) -> Result<DevicePtr, DriverError> {
        self.alloc_on_device(lane, self.index, bytes)
    }

    fn pool(&self) -> u64 {
        // The machine's tag, and the device whose memory the pool holds.
        (self.id.instance << 16) | self.index as u64
    }

    fn alloc_from(
        &mut self,
        lane: Lane,
        pool: u64,
        bytes: usize,
    ) -> Result<DevicePtr, DriverError> {
        if pool >> 16 != self.id.instance {
            return Err(DriverError::INVALID_VALUE);
        }
        self.alloc_on_device(lane, (pool & 0xffff) as usize, bytes)
    }

    unsafe fn free(&mut self, lane: Lane, ptr: DevicePtr) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(lane);
        s.enter_stream(SimOp::Free, stream)?;
        s.push(stream, Job::Free(ptr));
        Ok(())
    }
    unsafe fn copy_htod(
        &mut self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(Lane::Upload);
        s.enter_stream(SimOp::CopyHtoD, stream)?;
        if s.is_page_locked(src as usize, bytes) {
            s.push(stream, Job::HtoD { dst, src, bytes });
        } else {
            // CUDA stages a pageable source before the call returns (after a sync), so the
            // caller may reuse it at once: model exactly that.
            while s.run_one() {}
            self.device.inner.progress.notify_all();
            // SAFETY: the seam's contract makes `src..src+bytes` readable for the call.
            let data = unsafe { std::slice::from_raw_parts(src, bytes) }.to_vec();
            s.push(stream, Job::HtoDStaged { dst, data });
        }
        Ok(())
    }

    unsafe fn copy_dtoh(
        &mut self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(Lane::Download);
        s.enter_stream(SimOp::CopyDtoH, stream)?;
        let pageable = !s.is_page_locked(dst as usize, bytes);
        let seq = s.push(stream, Job::DtoH { dst, src, bytes });
        if pageable {
            // CUDA returns from a copy into pageable memory only once it has completed.
            s.run_until(seq);
            self.device.inner.progress.notify_all();
        }
        Ok(())
    }

    unsafe fn copy_dtod(
        &mut self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(Lane::Compute);
        s.enter_stream(SimOp::CopyDtoD, stream)?;
        s.push(stream, Job::DtoD { dst, src, bytes });
        Ok(())
    }

    fn event_create(&mut self) -> Result<EventHandle, DriverError> {
        self.create_event(SimOp::EventCreate, false)
    }

    fn ordering_event_create(&mut self) -> Result<EventHandle, DriverError> {
        self.create_event(SimOp::OrderEventCreate, true)
    }

    fn event_record(&mut self, lane: Lane, event: EventHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(lane);
        if s.event(event)?.ordering {
            // An ordering record: no device time, no fault of the work before it (the proofs'
            // records model those), counted apart.
            s.enter_stream(SimOp::OrderRecord, stream)?;
            let seq = s.push(stream, Job::OrderMarker);
            s.event(event)?.recorded = Some(seq);
            return Ok(());
        }
        s.enter_stream(SimOp::EventRecord, stream)?;
        s.event(event)?;
        let n = s.calls[&SimOp::EventRecord];
        let fault = s
            .event_faults
            .iter()
            .position(|f| f.0 == n)
            .map(|i| s.event_faults.remove(i).1);
        let seq = s.push(stream, Job::Marker);
        let ev = s.event(event)?;
        ev.recorded = Some(seq);
        ev.fault = fault;
        Ok(())
    }

    fn stream_wait(&mut self, lane: Lane, event: EventHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(lane);
        s.enter_stream(SimOp::StreamWait, stream)?;
        // What the wait waits for is fixed now: the event's last record as of this call.
        if let Some(for_seq) = s.event(event)?.recorded {
            if !s.is_done(for_seq) {
                s.push(stream, Job::Wait { for_seq });
            }
        }
        Ok(())
    }

    fn can_access_peer(&self, peer: DeviceId) -> Result<bool, DriverError> {
        Ok(self.linked(&self.lock(), peer).is_some())
    }

    fn enable_peer_access(&mut self, peer: ContextHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::PeerEnable)?;
        match s.ctxs.iter().position(|&c| c == peer.0) {
            Some(index) if s.peer_linked[self.index][index] => Ok(()),
            _ => Err(DriverError::NOT_SUPPORTED),
        }
    }

    fn grant_peer_access(&mut self, peer: DeviceId) -> Result<(), DriverError> {
        let mut s = self.lock();
        let index = peer.ordinal.checked_sub(s.ordinal);
        if index == Some(self.index) || index.is_some_and(|i| self.granted.contains(&i)) {
            return Ok(());
        }
        s.enter(SimOp::PeerEnable)?;
        let granted = self.linked(&s, peer).ok_or(DriverError::NOT_SUPPORTED)?;
        drop(s);
        self.granted.push(granted);
        Ok(())
    }

    unsafe fn copy_peer(
        &mut self,
        lane: Lane,
        dst: DevicePtr,
        dst_ctx: ContextHandle,
        src: DevicePtr,
        src_ctx: ContextHandle,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(lane);
        s.enter_stream(SimOp::CopyPeer, stream)?;
        let index = |ctx: ContextHandle| s.ctxs.iter().position(|&c| c == ctx.0);
        let (Some(d), Some(from)) = (index(dst_ctx), index(src_ctx)) else {
            return Err(DriverError::INVALID_CONTEXT);
        };
        if !s.peer_linked[d][from] || (d != self.index && from != self.index) {
            return Err(DriverError::NOT_SUPPORTED);
        }
        // Each side must lie on the device its context names.
        let on = |ptr: DevicePtr| s.touches.range(..=ptr).next_back().map(|(_, t)| t.device);
        if on(dst) != Some(d) || on(src) != Some(from) {
            return Err(DriverError::INVALID_VALUE);
        }
        s.push(stream, Job::DtoD { dst, src, bytes });
        Ok(())
    }

    unsafe fn event_destroy(&mut self, event: EventHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::EventDestroy)?;
        s.events
            .remove(&event.0)
            .map(|_| ())
            .ok_or(DriverError::INVALID_VALUE)
    }

    fn notify_after(&mut self, event: EventHandle, wake: Wake) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::NotifyAfter)?;
        let recorded = s.event(event)?.recorded;
        match recorded {
            // Never recorded, or its record has run (a failed event counts: the device failed):
            // the wake is due now, once the lock is released.
            None => s.woken.push(wake),
            Some(seq) if s.is_done(seq) => s.woken.push(wake),
            Some(seq) => {
                s.wakes.entry(seq).or_default().push(wake);
                if !s.clock_held {
                    s.run_until(seq);
                    self.device.inner.progress.notify_all();
                }
            }
        }
        Ok(())
    }

    fn host_alloc(&mut self, bytes: usize) -> Result<*mut u8, DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::HostAlloc)?;
        let bytes = bytes.max(1);
        if s.page_locked_bytes().saturating_add(bytes) > s.pinned_bytes {
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
        s.host.insert(ptr as usize, bytes);
        s.host_used += bytes;
        Ok(ptr)
    }

    unsafe fn host_free(&mut self, ptr: *mut u8) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::HostFree)?;
        let addr = ptr as usize;
        let Some(&bytes) = s.host.get(&addr) else {
            s.violations
                .push(format!("free of unknown pinned pointer {addr:#x}"));
            return Err(DriverError::INVALID_VALUE);
        };
        if s.names_host(addr, bytes) {
            // Keep the memory: freeing it would let the queued copy touch freed memory.
            s.violations.push(format!(
                "pinned buffer {addr:#x} ({bytes} bytes) freed while a queued copy still names it"
            ));
            return Ok(());
        }
        s.host.remove(&addr);
        s.host_used -= bytes;
        let layout =
            Layout::from_size_align(bytes, 4096).map_err(|_| DriverError::INVALID_VALUE)?;
        // SAFETY: `ptr` was allocated by `host_alloc` with this layout and is freed once (it was
        // just removed from the live set).
        unsafe { std::alloc::dealloc(ptr, layout) };
        Ok(())
    }

    fn host_register(&mut self, ptr: *mut u8, bytes: usize) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::HostRegister)?;
        let addr = ptr as usize;
        if ptr.is_null() || bytes == 0 || addr.checked_add(bytes).is_none() {
            return Err(DriverError::INVALID_VALUE);
        }
        if s.overlaps_page_locked(addr, bytes) {
            return Err(DriverError::from_code(HOST_MEMORY_ALREADY_REGISTERED));
        }
        if s.page_locked_bytes().saturating_add(bytes) > s.pinned_bytes {
            return Err(DriverError::OUT_OF_MEMORY);
        }
        s.registered.insert(addr, bytes);
        s.registered_used += bytes;
        Ok(())
    }

    unsafe fn host_unregister(&mut self, ptr: *mut u8) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::HostUnregister)?;
        let addr = ptr as usize;
        let Some(&bytes) = s.registered.get(&addr) else {
            s.violations
                .push(format!("unregister of unknown host range {addr:#x}"));
            return Err(DriverError::from_code(HOST_MEMORY_NOT_REGISTERED));
        };
        if s.names_host(addr, bytes) {
            // Refuse: the caller then keeps the memory (leaks it) instead of freeing memory the
            // queued copy will still read or write.
            s.violations.push(format!(
                "registered range {addr:#x} ({bytes} bytes) unregistered while a queued copy still names it"
            ));
            return Err(DriverError::INVALID_VALUE);
        }
        s.registered.remove(&addr);
        s.registered_used -= bytes;
        Ok(())
    }

    fn waits(&self) -> Arc<dyn Waits> {
        Arc::new(SimWaits {
            device: self.device.clone(),
            streams: self.streams,
        })
    }

    fn hosts_cuda_runtimes(&self) -> bool {
        false
    }

    fn as_sim(&self) -> Option<SimDevice> {
        Some(self.device.clone())
    }
}

/// The waiting half of a simulated driver. A wait runs the device up to what it waits for,
/// unless the clock is held ([`SimDevice::hold_clock`]): then it blocks until another thread
/// advances the clock that far, as a real wait blocks until the device gets there.
struct SimWaits {
    device: SimDevice,
    /// The driver's first stream (see [`SimDriver`]).
    streams: StreamId,
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
        mut s: Locked<'a>,
        done: impl Fn(&State) -> bool,
        run: impl Fn(&mut State),
    ) -> Locked<'a> {
        if !s.clock_held {
            run(&mut s);
            self.device.inner.progress.notify_all();
            return s;
        }
        while !done(&s) {
            s = s.wait(&self.device.inner.progress);
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
        let mut s = self.device.lock();
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
        let mut s = self.device.lock();
        s.enter(SimOp::EventSynchronize)?;
        let Some(seq) = s.event(event)?.recorded else {
            return Ok(());
        };
        let mut s = self.wait_until(s, seq);
        s.event(event)?.fault.map_or(Ok(()), Err)
    }

    fn stream_synchronize(&self) -> Result<(), DriverError> {
        let mut s = self.device.lock();
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

    fn lane_synchronize(&self, lane: Lane) -> Result<(), DriverError> {
        let mut s = self.device.lock();
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
        let mut s = self.device.lock();
        s.enter_stream(SimOp::StreamQuery, self.streams + Lane::Compute.index())?;
        Ok(s.streams_idle(self.lanes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn driver() -> (SimDriver, SimDevice) {
        let dev = SimDevice::new(SimConfig::default());
        (SimDriver::new(dev.clone()), dev)
    }

    /// Pinned host memory of the simulated device, filled with `fill(i)`.
    fn pinned(d: &mut SimDriver, bytes: usize, fill: impl Fn(usize) -> u8) -> &'static mut [u8] {
        let ptr = d.host_alloc(bytes).unwrap();
        // SAFETY: a fresh allocation of `bytes` bytes, leaked for the test's duration.
        let slice = unsafe { std::slice::from_raw_parts_mut(ptr, bytes) };
        slice.iter_mut().enumerate().for_each(|(i, b)| *b = fill(i));
        slice
    }

    #[test]
    fn copies_complete_only_when_the_clock_advances() {
        let (mut d, dev) = driver();
        let src = pinned(&mut d, 64, |i| (i as u8).wrapping_mul(7).wrapping_add(3));
        let back = pinned(&mut d, 64, |_| 0xEE);
        let ptr = d.alloc(Lane::Compute, 64).unwrap();
        let uploaded = d.event_create().unwrap();
        // SAFETY: both host ranges are live pinned allocations; the test runs the jobs before
        // reading them.
        unsafe {
            d.copy_htod(ptr, src.as_ptr(), 64).unwrap();
            d.event_record(Lane::Upload, uploaded).unwrap();
            d.stream_wait(Lane::Download, uploaded).unwrap();
            d.copy_dtoh(back.as_mut_ptr(), ptr, 64).unwrap();
        }
        assert_eq!(
            dev.queued(),
            3,
            "two copies and a record (a wait takes no device time)"
        );
        assert_eq!(back, &[0xEE; 64][..], "nothing ran yet");
        assert_eq!(dev.advance(1), 1);
        assert_eq!(dev.peek(ptr, 64).unwrap(), src, "the upload ran");
        assert_eq!(back, &[0xEE; 64][..], "the download did not");
        dev.advance(2);
        assert_eq!(back, src);
        assert_eq!(dev.advance(5), 0);
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    #[test]
    fn an_upload_from_pinned_memory_reads_its_source_when_it_runs() {
        let (mut d, dev) = driver();
        let src = pinned(&mut d, 8, |_| 1);
        let ptr = d.alloc(Lane::Compute, 8).unwrap();
        // SAFETY: `src` is live pinned memory; the job runs below.
        unsafe { d.copy_htod(ptr, src.as_ptr(), 8).unwrap() };
        src.iter_mut().for_each(|b| *b = 9);
        dev.advance_all();
        assert_eq!(dev.peek(ptr, 8).unwrap(), vec![9; 8]);
    }

    #[test]
    fn pageable_copies_behave_as_cuda_documents() {
        let (mut d, dev) = driver();
        let ptr = d.alloc(Lane::Compute, 8).unwrap();
        let mut src = [1u8; 8];
        // SAFETY: `src` is readable for the call, which stages it.
        unsafe { d.copy_htod(ptr, src.as_ptr(), 8).unwrap() };
        src.iter_mut().for_each(|b| *b = 9);
        assert_eq!(dev.queued(), 1, "the DMA itself is still queued");
        dev.advance_all();
        assert_eq!(
            dev.peek(ptr, 8).unwrap(),
            vec![1; 8],
            "the staged bytes, not the later ones"
        );
        let mut back = [0u8; 8];
        // SAFETY: `back` is writable for the call, which completes the copy before returning.
        unsafe { d.copy_dtoh(back.as_mut_ptr(), ptr, 8).unwrap() };
        assert_eq!(back, [1; 8]);
        assert_eq!(dev.queued(), 0);
    }

    #[test]
    fn events_report_completion_in_stream_order() {
        let (mut d, dev) = driver();
        let a = d.event_create().unwrap();
        let b = d.event_create().unwrap();
        assert!(
            d.waits().event_query(a).unwrap(),
            "an unrecorded event is complete"
        );
        let ptr = d.alloc(Lane::Compute, 4).unwrap();
        let src = pinned(&mut d, 4, |i| i as u8 + 1);
        // SAFETY: `src` is live pinned memory.
        unsafe { d.copy_htod(ptr, src.as_ptr(), 4).unwrap() };
        d.event_record(Lane::Upload, a).unwrap();
        // SAFETY: as above.
        unsafe { d.copy_htod(ptr, src.as_ptr(), 4).unwrap() };
        d.event_record(Lane::Upload, b).unwrap();
        assert!(!d.waits().event_query(a).unwrap());
        assert!(!d.waits().event_query(b).unwrap());
        dev.advance(2);
        assert!(d.waits().event_query(a).unwrap());
        assert!(!d.waits().event_query(b).unwrap());
        d.waits().event_synchronize(b).unwrap();
        assert!(d.waits().event_query(b).unwrap());
        assert_eq!(dev.queued(), 0);
    }

    #[test]
    fn event_synchronize_runs_only_up_to_its_event() {
        let (mut d, dev) = driver();
        let a = d.event_create().unwrap();
        d.event_record(Lane::Compute, a).unwrap();
        let ptr = d.alloc(Lane::Compute, 4).unwrap();
        // SAFETY: `ptr` is live; the free is the last use.
        unsafe { d.free(Lane::Compute, ptr).unwrap() };
        d.waits().event_synchronize(a).unwrap();
        assert_eq!(dev.queued(), 1, "the later free is still queued");
        assert_eq!(dev.device_live(), (1, 4));
        d.waits().stream_synchronize().unwrap();
        assert_eq!(dev.device_live(), (0, 0));
    }

    #[test]
    fn the_nth_call_fails_with_the_injected_error() {
        let (mut d, dev) = driver();
        dev.fail_nth(SimOp::Alloc, 2, DriverError::OUT_OF_MEMORY);
        assert!(d.alloc(Lane::Compute, 8).is_ok());
        assert_eq!(d.alloc(Lane::Compute, 8), Err(DriverError::OUT_OF_MEMORY));
        assert!(d.alloc(Lane::Compute, 8).is_ok(), "a fault fires once");
        assert_eq!(dev.calls(SimOp::Alloc), 3);
    }

    #[test]
    fn an_event_fault_is_reported_once_the_device_reaches_it() {
        let (mut d, dev) = driver();
        let e = d.event_create().unwrap();
        dev.fail_event(1, DriverError::LAUNCH_FAILED);
        d.event_record(Lane::Compute, e).unwrap();
        assert_eq!(
            d.waits().event_query(e),
            Ok(false),
            "not reached: not ready, not failed"
        );
        dev.advance_all();
        assert_eq!(d.waits().event_query(e), Err(DriverError::LAUNCH_FAILED));
        assert_eq!(
            d.waits().event_synchronize(e),
            Err(DriverError::LAUNCH_FAILED)
        );
        d.event_record(Lane::Compute, e).unwrap();
        d.waits().event_synchronize(e).unwrap();
    }

    /// A wake that counts, and reads the device (which takes its lock) when called.
    fn counting_wake(dev: &SimDevice, count: &Arc<AtomicU64>) -> Wake {
        let (dev, count) = (dev.clone(), Arc::clone(count));
        Box::new(move || {
            let _ = dev.queued(); // would deadlock if called under the device's lock
            count.fetch_add(1, Ordering::SeqCst);
        })
    }

    #[test]
    fn a_wake_is_called_once_when_the_clock_runs_its_record() {
        let (mut d, dev) = driver();
        dev.hold_clock(true);
        let ptr = d.alloc(Lane::Compute, 4).unwrap();
        let src = pinned(&mut d, 4, |i| i as u8 + 1);
        let e = d.event_create().unwrap();
        // SAFETY: `src` is live pinned memory and `ptr` a live allocation of 4 bytes.
        unsafe { d.copy_htod(ptr, src.as_ptr(), 4).unwrap() };
        d.event_record(Lane::Upload, e).unwrap();
        // SAFETY: as above; queued after the record, so the wake does not wait for it.
        unsafe { d.copy_htod(ptr, src.as_ptr(), 4).unwrap() };
        let count = Arc::new(AtomicU64::new(0));
        d.notify_after(e, counting_wake(&dev, &count)).unwrap();
        d.event_record(Lane::Upload, e).unwrap(); // a later record does not move the wake
        assert_eq!(dev.calls(SimOp::NotifyAfter), 1);
        assert_eq!(dev.advance(1), 1);
        assert_eq!(
            count.load(Ordering::SeqCst),
            0,
            "the copy ran, not the record"
        );
        assert_eq!(dev.advance(1), 1);
        assert_eq!(count.load(Ordering::SeqCst), 1, "called by the record");
        dev.advance_all();
        assert_eq!(count.load(Ordering::SeqCst), 1, "once");
    }

    #[test]
    fn a_wake_on_a_reached_unrecorded_or_failed_event_is_called_at_once() {
        let (mut d, dev) = driver();
        dev.hold_clock(true);
        let count = Arc::new(AtomicU64::new(0));
        let never = d.event_create().unwrap();
        d.notify_after(never, counting_wake(&dev, &count)).unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 1, "never recorded: complete");
        let failed = d.event_create().unwrap();
        dev.fail_event(1, DriverError::LAUNCH_FAILED);
        d.event_record(Lane::Download, failed).unwrap();
        dev.advance_all();
        d.notify_after(failed, counting_wake(&dev, &count)).unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 2, "failed: due too");
        assert_eq!(
            d.waits().event_query(failed),
            Err(DriverError::LAUNCH_FAILED)
        );
    }

    #[test]
    fn registering_a_wake_with_a_free_clock_runs_the_stream_up_to_its_event() {
        let (mut d, dev) = driver();
        let e = d.event_create().unwrap();
        d.event_record(Lane::Compute, e).unwrap();
        let ptr = d.alloc(Lane::Compute, 4).unwrap();
        // SAFETY: `ptr` is live; the free is its last use.
        unsafe { d.free(Lane::Compute, ptr).unwrap() };
        let count = Arc::new(AtomicU64::new(0));
        d.notify_after(e, counting_wake(&dev, &count)).unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 1);
        assert_eq!(
            dev.queued(),
            1,
            "only up to the event: the free is still queued"
        );
    }

    #[test]
    fn a_refused_registration_drops_its_wake_uncalled() {
        let (mut d, dev) = driver();
        dev.hold_clock(true);
        let e = d.event_create().unwrap();
        d.event_record(Lane::Compute, e).unwrap();
        let count = Arc::new(AtomicU64::new(0));
        dev.fail_nth(SimOp::NotifyAfter, 1, DriverError::INVALID_VALUE);
        let wake = counting_wake(&dev, &count);
        assert_eq!(d.notify_after(e, wake), Err(DriverError::INVALID_VALUE));
        let unknown = EventHandle(u64::MAX);
        let wake = counting_wake(&dev, &count);
        assert_eq!(
            d.notify_after(unknown, wake),
            Err(DriverError::INVALID_VALUE)
        );
        dev.advance_all();
        assert_eq!(count.load(Ordering::SeqCst), 0);
        assert_eq!(Arc::strong_count(&count), 1, "both wakes were dropped");
    }

    #[test]
    fn freeing_pinned_memory_under_a_queued_copy_is_a_violation_and_keeps_it() {
        let (mut d, dev) = driver();
        let host = d.host_alloc(16).unwrap();
        let ptr = d.alloc(Lane::Compute, 16).unwrap();
        // SAFETY: `host` is a live sim allocation; the test checks the sim refuses to free it.
        unsafe {
            d.copy_dtoh(host, ptr, 16).unwrap();
            d.host_free(host).unwrap();
        }
        assert_eq!(dev.violations().len(), 1);
        assert!(dev.is_pinned_live(host));
        dev.advance_all();
        // SAFETY: the copy has run; nothing names the memory now.
        unsafe { d.host_free(host).unwrap() };
        assert!(!dev.is_pinned_live(host));
        assert_eq!(dev.pinned_live(), (0, 0));
    }

    #[test]
    fn copies_with_registered_memory_run_when_the_clock_reaches_them() {
        let (mut d, dev) = driver();
        let mut up = vec![1u8; 32];
        let mut down = vec![0xEEu8; 32];
        let (up, down) = (up.as_mut_ptr(), down.as_mut_ptr());
        d.host_register(up, 32).unwrap();
        d.host_register(down, 32).unwrap();
        assert_eq!(dev.registered_live(), (2, 64));
        assert!(dev.is_registered(up));
        let ptr = d.alloc(Lane::Compute, 32).unwrap();
        let uploaded = d.event_create().unwrap();
        // SAFETY: both ranges are live, registered and only reached through these pointers
        // until the jobs have run.
        unsafe {
            d.copy_htod(ptr, up, 32).unwrap();
            d.event_record(Lane::Upload, uploaded).unwrap();
            d.stream_wait(Lane::Download, uploaded).unwrap();
            d.copy_dtoh(down, ptr, 32).unwrap();
            std::ptr::write_bytes(up, 9, 32);
        }
        assert_eq!(dev.queued(), 3, "neither copy ran at its call");
        // SAFETY: `down` holds 32 initialised bytes; the download has not run.
        assert_eq!(unsafe { std::slice::from_raw_parts(down, 32) }, [0xEE; 32]);
        dev.advance_all();
        // SAFETY: as above; both jobs have run.
        assert_eq!(unsafe { std::slice::from_raw_parts(down, 32) }, [9; 32]);
        // SAFETY: registered above; nothing queued names them now.
        unsafe {
            d.host_unregister(up).unwrap();
            d.host_unregister(down).unwrap();
        }
        assert_eq!(dev.registered_live(), (0, 0));
        assert!(dev.violations().is_empty());
    }

    #[test]
    fn unregistering_under_a_queued_copy_is_a_violation_and_refused() {
        let (mut d, dev) = driver();
        let mut host = vec![3u8; 16];
        let host = host.as_mut_ptr();
        d.host_register(host, 16).unwrap();
        assert_eq!(
            d.host_register(host.wrapping_add(8), 4),
            Err(DriverError::from_code(HOST_MEMORY_ALREADY_REGISTERED)),
            "an overlapping registration is refused"
        );
        let ptr = d.alloc(Lane::Compute, 16).unwrap();
        // SAFETY: `host` is registered and outlives the job, which runs below.
        unsafe { d.copy_dtoh(host, ptr, 16).unwrap() };
        // SAFETY: the test checks that the simulator refuses this.
        assert!(unsafe { d.host_unregister(host) }.is_err());
        assert_eq!(dev.violations().len(), 1);
        assert!(dev.is_registered(host), "still registered");
        dev.advance_all();
        // SAFETY: the copy has run; nothing names the range now.
        unsafe { d.host_unregister(host).unwrap() };
        assert_eq!(
            // SAFETY: the test checks that an unknown range is refused.
            unsafe { d.host_unregister(host) },
            Err(DriverError::from_code(HOST_MEMORY_NOT_REGISTERED))
        );
        assert_eq!(dev.violations().len(), 2);
        assert_eq!(dev.calls(SimOp::HostRegister), 2);
        assert_eq!(dev.calls(SimOp::HostUnregister), 3);
    }

    #[test]
    fn device_memory_is_bounded() {
        let dev = SimDevice::new(SimConfig {
            memory_bytes: 100,
            ..SimConfig::default()
        });
        let mut d = SimDriver::new(dev);
        let a = d.alloc(Lane::Compute, 60).unwrap();
        assert_eq!(d.alloc(Lane::Compute, 60), Err(DriverError::OUT_OF_MEMORY));
        // SAFETY: `a` is live and unused.
        unsafe { d.free(Lane::Compute, a).unwrap() };
        d.waits().stream_synchronize().unwrap();
        assert!(d.alloc(Lane::Compute, 60).is_ok());
    }

    #[test]
    fn an_allocation_may_take_the_memory_of_a_queued_free_and_waits_for_it() {
        let dev = SimDevice::new(SimConfig {
            memory_bytes: 100,
            ..SimConfig::default()
        });
        let mut d = SimDriver::new(dev.clone());
        let mut other = SimDriver::new(dev.clone());
        let a = d.alloc(Lane::Compute, 60).unwrap();
        dev.hold_clock(true);
        // SAFETY: `a` is live and unused.
        unsafe { d.free(Lane::Compute, a).unwrap() };
        // Another driver's queued free makes no room for this one (another pool).
        assert_eq!(
            other.alloc(Lane::Upload, 60),
            Err(DriverError::OUT_OF_MEMORY)
        );
        // The free is still queued; an allocation on another lane takes its memory and its
        // lane waits for the free.
        let b = d.alloc(Lane::Upload, 60).unwrap();
        assert_eq!(dev.device_live(), (2, 120), "until the free runs");
        // A synchronize of the upload lane alone (only what it waits for runs) runs the free.
        dev.set_schedule(Schedule::Interleaved { seed: 1 });
        dev.hold_clock(false);
        d.waits().lane_synchronize(Lane::Upload).unwrap();
        assert_eq!(
            dev.device_live(),
            (1, 60),
            "the upload lane waited for the free"
        );
        assert!(dev.peek(b, 60).is_some());
        // Nothing more is queued to free: beyond capacity is out of memory again.
        assert_eq!(d.alloc(Lane::Compute, 60), Err(DriverError::OUT_OF_MEMORY));
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    #[test]
    fn contexts_are_per_thread() {
        let (d, _dev) = driver();
        set_thread_context(None);
        d.set_current_context(d.context()).unwrap();
        assert_eq!(thread_context(), Some(d.context().0));
        std::thread::spawn(|| assert_eq!(thread_context(), None))
            .join()
            .unwrap();
        set_thread_context(None);
    }

    /// A kernel the seam knows nothing about: copies `params[2]` bytes from `params[1]` to
    /// `params[0]`.
    struct CopyKernel;

    impl crate::driver::launch::Emulation for CopyKernel {
        fn name(&self) -> &str {
            "copy"
        }

        fn run(
            &self,
            memory: &mut dyn crate::driver::launch::DeviceMemory,
            params: &[u64],
        ) -> Result<(), String> {
            let &[dst, src, bytes] = params else {
                return Err("copy takes three parameters".into());
            };
            let data = memory
                .read(src, bytes as usize)
                .ok_or("copy reads unmapped memory")?;
            if memory.write(dst, &data) {
                Ok(())
            } else {
                Err("copy writes unmapped memory".into())
            }
        }
    }

    #[test]
    fn a_launch_runs_its_modules_emulation_when_the_clock_reaches_it() {
        use crate::driver::launch::{Launch, ModuleSource};
        let (mut d, dev) = driver();
        let refused = d.module_compile(&ModuleSource {
            name: "user",
            cuda: "",
            emulation: None,
        });
        assert!(
            matches!(
                refused,
                Err(crate::Error::Setup(
                    crate::error::SetupError::Unavailable { .. }
                ))
            ),
            "{refused:?}"
        );
        let module = d
            .module_compile(&ModuleSource {
                name: "copy",
                cuda: "",
                emulation: Some(Arc::new(CopyKernel)),
            })
            .unwrap();
        assert!(d.module_function(module, "other").is_err());
        let function = d.module_function(module, "copy").unwrap();
        let src = pinned(&mut d, 4, |i| i as u8 + 1);
        let a = d.alloc(Lane::Compute, 4).unwrap();
        let b = d.alloc(Lane::Compute, 4).unwrap();
        let uploaded = d.event_create().unwrap();
        // SAFETY: `src` is live pinned memory, `a` and `b` live allocations of 4 bytes; the test
        // runs every job before reading.
        unsafe {
            d.copy_htod(a, src.as_ptr(), 4).unwrap();
            d.event_record(Lane::Upload, uploaded).unwrap();
            d.stream_wait(Lane::Compute, uploaded).unwrap();
            d.launch(function, 1, 1, &[b, a, 4]).unwrap();
            d.launch(function, 1, 1, &[b, 0x10, 4]).unwrap();
        }
        assert_eq!(
            dev.advance(3),
            3,
            "the copy, its record and a launch (not the wait)"
        );
        assert_eq!(dev.peek(b, 4).unwrap(), [1, 2, 3, 4]);
        assert!(dev.violations().is_empty());
        dev.advance_all();
        assert_eq!(dev.violations(), ["copy reads unmapped memory"]);
        assert_eq!(dev.calls(SimOp::Launch), 2);
        // SAFETY: loaded above, unloaded once, and both launches have run.
        unsafe { d.module_unload(module).unwrap() };
    }

    /// Queues an upload of `src` into `dst` on the upload lane.
    fn upload(d: &mut SimDriver, dst: DevicePtr, src: &[u8]) {
        // SAFETY: every `src` in these tests is pinned memory of the device, leaked for the
        // test's duration, and `dst` a live allocation of at least its length.
        unsafe { d.copy_htod(dst, src.as_ptr(), src.len()).unwrap() };
    }

    /// Queues a download of `src` into `dst` on the download lane.
    fn download(d: &mut SimDriver, dst: &mut [u8], src: DevicePtr) {
        // SAFETY: as `upload`, for the destination.
        unsafe { d.copy_dtoh(dst.as_mut_ptr(), src, dst.len()).unwrap() };
    }

    /// Queues a device-to-device copy on the compute lane.
    fn copy(d: &mut SimDriver, dst: DevicePtr, src: DevicePtr, bytes: usize) {
        // SAFETY: the tests pass disjoint live allocations of at least `bytes` bytes.
        unsafe { d.copy_dtod(dst, src, bytes).unwrap() };
    }

    /// A driver on a fresh device with an interleaved schedule.
    fn interleaved(seed: u64) -> (SimDriver, SimDevice) {
        let (d, dev) = driver();
        dev.set_schedule(Schedule::Interleaved { seed });
        (d, dev)
    }

    #[test]
    fn a_wait_holds_its_stream_until_the_events_record_runs() {
        let mut overtaken = 0;
        for seed in 0..64 {
            let (mut d, dev) = interleaved(seed);
            let src = pinned(&mut d, 8, |i| i as u8 + 1);
            let back = pinned(&mut d, 8, |_| 0xEE);
            let ptr = d.alloc(Lane::Upload, 8).unwrap();
            let (x, y) = (
                d.alloc(Lane::Compute, 8).unwrap(),
                d.alloc(Lane::Compute, 8).unwrap(),
            );
            let e = d.event_create().unwrap();
            let fill = pinned(&mut d, 8, |i| i as u8 + 11);
            upload(&mut d, x, fill);
            d.waits().stream_synchronize().unwrap();
            upload(&mut d, ptr, src);
            upload(&mut d, ptr, src);
            d.event_record(Lane::Upload, e).unwrap();
            d.stream_wait(Lane::Download, e).unwrap();
            download(&mut d, back, ptr);
            copy(&mut d, y, x, 8);
            copy(&mut d, x, y, 8);
            let mut compute_ran_while_held = false;
            while dev.queued() > 0 {
                let recorded = d.waits().event_query(e).unwrap();
                let before = dev.completed();
                let copied = dev.peek(y, 8).unwrap() == fill;
                assert_eq!(dev.advance(1), 1);
                assert_eq!(dev.completed(), before + 1);
                if back[0] != 0xEE {
                    assert!(recorded || d.waits().event_query(e).unwrap(), "seed {seed}");
                }
                if !recorded && !copied && dev.peek(y, 8).unwrap() == fill {
                    compute_ran_while_held = true;
                }
            }
            assert_eq!(back, src, "seed {seed}");
            assert!(
                dev.violations().is_empty(),
                "seed {seed}: {:?}",
                dev.violations()
            );
            overtaken += usize::from(compute_ran_while_held);
        }
        assert!(
            overtaken > 0,
            "the compute lane runs while the download waits"
        );
    }

    /// A driver whose device interleaves its streams (only then does a lane run apart from
    /// program order), with a 4-byte pinned source (1, 2, 3, 4) and a 4-byte landing buffer.
    fn interleaved_with_buffers() -> (SimDriver, SimDevice, &'static mut [u8], &'static mut [u8]) {
        let (mut d, dev) = driver();
        dev.set_schedule(Schedule::Interleaved { seed: 1 });
        let src = pinned(&mut d, 4, |i| i as u8 + 1);
        let back = pinned(&mut d, 4, |_| 0xEE);
        (d, dev, src, back)
    }

    #[test]
    fn a_wait_is_fixed_when_it_is_queued() {
        let (mut d, dev, src, back) = interleaved_with_buffers();
        let (a, b) = (
            d.alloc(Lane::Upload, 4).unwrap(),
            d.alloc(Lane::Upload, 4).unwrap(),
        );
        let e = d.event_create().unwrap();
        d.stream_wait(Lane::Download, e).unwrap();
        assert_eq!(
            dev.queued(),
            0,
            "a wait for an event never recorded waits for nothing"
        );
        upload(&mut d, a, src);
        d.event_record(Lane::Upload, e).unwrap();
        d.stream_wait(Lane::Download, e).unwrap();
        upload(&mut d, b, src);
        d.event_record(Lane::Upload, e).unwrap(); // a later record: the wait keeps the first
        download(&mut d, back, a);
        assert_eq!(
            dev.queued(),
            5,
            "three copies and two records (a wait takes no device time)"
        );
        d.waits().lane_synchronize(Lane::Download).unwrap();
        assert_eq!(back, src);
        assert_eq!(
            dev.queued(),
            2,
            "the second upload and its record are still queued"
        );
        assert!(
            !d.waits().event_query(e).unwrap(),
            "the event's last record has not run"
        );
        d.waits().stream_synchronize().unwrap();
        assert!(d.waits().event_query(e).unwrap());
        d.stream_wait(Lane::Compute, e).unwrap();
        assert_eq!(
            dev.queued(),
            0,
            "a wait for a record that has run waits for nothing"
        );
        dev.fail_nth(SimOp::StreamWait, 1, DriverError::INVALID_VALUE);
        upload(&mut d, a, src);
        d.event_record(Lane::Upload, e).unwrap();
        assert_eq!(
            d.stream_wait(Lane::Download, e),
            Err(DriverError::INVALID_VALUE)
        );
        assert_eq!(dev.queued(), 2, "a refused wait queues nothing");
        assert_eq!(dev.calls(SimOp::StreamWait), 4);
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    #[test]
    fn a_lane_synchronize_runs_only_its_lane_and_what_it_waits_for() {
        let (mut d, dev, src, back) = interleaved_with_buffers();
        let (x, y) = (
            d.alloc(Lane::Compute, 4).unwrap(),
            d.alloc(Lane::Compute, 4).unwrap(),
        );
        let (a, c) = (
            d.alloc(Lane::Upload, 4).unwrap(),
            d.alloc(Lane::Upload, 4).unwrap(),
        );
        let e = d.event_create().unwrap();
        copy(&mut d, y, x, 4); // seq 0, compute
        upload(&mut d, a, src); // seq 1
        d.event_record(Lane::Upload, e).unwrap(); // seq 2
        upload(&mut d, c, src); // seq 3, after the record
        d.stream_wait(Lane::Download, e).unwrap(); // seq 4
        download(&mut d, back, a); // seq 5
        copy(&mut d, x, y, 4); // seq 6, compute
        d.waits().lane_synchronize(Lane::Download).unwrap();
        assert_eq!(back, src);
        assert_eq!(dev.queued(), 3, "both compute copies and the later upload");
        assert_eq!(
            dev.peek(c, 4).unwrap(),
            [0xA5; 4],
            "the later upload did not run"
        );
        assert_eq!(
            dev.peek(y, 4).unwrap(),
            [0xA5; 4],
            "the compute lane did not run"
        );
        assert!(!d.waits().stream_query().unwrap());
        d.waits().lane_synchronize(Lane::Upload).unwrap();
        assert_eq!(dev.queued(), 2);
        assert_eq!(dev.peek(c, 4).unwrap(), src);
        d.waits().lane_synchronize(Lane::Compute).unwrap();
        assert!(d.waits().stream_query().unwrap());
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    #[test]
    fn a_lane_synchronize_with_a_held_clock_waits_for_the_clock() {
        let (mut d, dev) = driver();
        let src = pinned(&mut d, 4, |i| i as u8 + 1);
        let a = d.alloc(Lane::Upload, 4).unwrap();
        dev.hold_clock(true);
        upload(&mut d, a, src);
        let waits = d.waits();
        let waiter = std::thread::spawn(move || waits.lane_synchronize(Lane::Upload));
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(dev.queued(), 1, "the wait does not run the clock");
        dev.advance_all();
        waiter.join().unwrap().unwrap();
        assert_eq!(dev.peek(a, 4).unwrap(), src);
    }

    #[test]
    fn an_interleaved_schedule_lets_an_upload_overtake_earlier_compute_work() {
        let overtakes = |dev: &SimDevice, d: &mut SimDriver| {
            let src = pinned(d, 4, |i| i as u8 + 1);
            let (x, y) = (
                d.alloc(Lane::Compute, 4).unwrap(),
                d.alloc(Lane::Compute, 4).unwrap(),
            );
            let a = d.alloc(Lane::Upload, 4).unwrap();
            copy(d, y, x, 4);
            upload(d, a, src);
            assert_eq!(dev.advance(1), 1);
            let overtook = dev.peek(a, 4).unwrap() == src;
            assert_eq!(dev.advance_all(), 1);
            overtook
        };
        let (mut d, dev) = driver();
        assert!(
            !overtakes(&dev, &mut d),
            "in order, the compute copy runs first"
        );
        let seed = (0..64)
            .find(|&seed| {
                let (mut d, dev) = interleaved(seed);
                overtakes(&dev, &mut d)
            })
            .expect("some seed runs the upload first");
        let (mut d, dev) = interleaved(seed);
        assert!(overtakes(&dev, &mut d), "the same seed, the same order");
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    /// Uploads into a block and downloads it on the other copy lane, ordered by a wait when
    /// `ordered`; returns whether the download ran first, the bytes it read and the violations.
    fn upload_then_download(seed: u64, ordered: bool) -> (bool, Vec<u8>, Vec<String>, DevicePtr) {
        let (mut d, dev) = interleaved(seed);
        let src = pinned(&mut d, 4, |i| i as u8 + 1);
        let back = pinned(&mut d, 4, |_| 0xEE);
        let a = d.alloc(Lane::Upload, 4).unwrap();
        let e = d.event_create().unwrap();
        upload(&mut d, a, src);
        if ordered {
            d.event_record(Lane::Upload, e).unwrap();
            d.stream_wait(Lane::Download, e).unwrap();
        }
        download(&mut d, back, a);
        let mut download_first = false;
        while dev.queued() > 0 {
            let uploaded = dev.peek(a, 4).unwrap() == src;
            dev.advance(1);
            download_first |= !uploaded && back[0] != 0xEE;
        }
        (download_first, back.to_vec(), dev.violations(), a)
    }

    #[test]
    fn the_race_checker_flags_an_unordered_write_and_read() {
        let seed = (0..64)
            .find(|&seed| upload_then_download(seed, false).0)
            .expect("some seed runs the download first");
        let (_, back, violations, a) = upload_then_download(seed, false);
        assert_eq!(
            back, [0xA5; 4],
            "the download read the block before the upload wrote it"
        );
        assert_eq!(
            violations,
            [format!(
                "job #0 (host-to-device copy on the Upload lane of driver 0) used device block \
                 {a:#x} after later job #1 read it: the two are not ordered"
            )]
        );
        // Ordered by a wait, no schedule lets the download run first.
        for seed in 0..64 {
            let (download_first, back, violations, _) = upload_then_download(seed, true);
            assert!(!download_first, "seed {seed}");
            assert_eq!(back, [1, 2, 3, 4], "seed {seed}");
            assert!(violations.is_empty(), "seed {seed}: {violations:?}");
        }
    }

    #[test]
    fn the_race_checker_sees_launches_and_frees() {
        use crate::driver::launch::{Launch, ModuleSource};
        let (mut d, dev) = driver();
        // Only an interleaved schedule runs a lane apart from program order.
        dev.set_schedule(Schedule::Interleaved { seed: 1 });
        let module = d
            .module_compile(&ModuleSource {
                name: "copy",
                cuda: "",
                emulation: Some(Arc::new(CopyKernel)),
            })
            .unwrap();
        let function = d.module_function(module, "copy").unwrap();
        let back = pinned(&mut d, 4, |_| 0xEE);
        let (a, b) = (
            d.alloc(Lane::Compute, 4).unwrap(),
            d.alloc(Lane::Compute, 4).unwrap(),
        );
        // SAFETY: `a` and `b` are live allocations of 4 bytes until the free runs, and the test
        // runs every job before reading.
        unsafe {
            d.launch(function, 1, 1, &[b, a, 4]).unwrap(); // seq 0: writes `b`
            d.copy_dtoh(back.as_mut_ptr(), b, 4).unwrap(); // seq 1: reads `b`, unordered
            d.free(Lane::Compute, b).unwrap(); // seq 2: frees `b`, unordered with the download
        }
        // The download's lane alone: it runs before the launch and the free.
        d.waits().lane_synchronize(Lane::Download).unwrap();
        assert!(dev.violations().is_empty(), "nothing ran out of order yet");
        d.waits().stream_synchronize().unwrap();
        assert_eq!(
            dev.violations(),
            [format!(
                "job #0 (kernel launch on the Compute lane of driver 0) used device block {b:#x} \
                 after later job #1 read it: the two are not ordered"
            )]
        );
        // A free that overtakes a download of its block: the download reads freed memory.
        let c = d.alloc(Lane::Compute, 4).unwrap();
        // SAFETY: `c` is live until the free runs; the test checks that the download, queued
        // before the free but not ordered before it, is reported.
        unsafe {
            d.copy_dtoh(back.as_mut_ptr(), c, 4).unwrap(); // seq 3
            d.free(Lane::Compute, c).unwrap(); // seq 4
        }
        d.waits().lane_synchronize(Lane::Compute).unwrap();
        assert_eq!(dev.device_live(), (1, 4), "the free ran");
        d.waits().stream_synchronize().unwrap();
        assert_eq!(
            dev.violations()[1..],
            [
                format!(
                    "job #3 (device-to-host copy on the Download lane of driver 0) used device \
                     block {c:#x} after later job #4 wrote it: the two are not ordered"
                ),
                format!("device-to-host copy from unmapped device range {c:#x}+4"),
            ]
        );
        // SAFETY: loaded above, unloaded once; the launch has run.
        unsafe { d.module_unload(module).unwrap() };
    }

    #[test]
    fn two_drivers_on_one_device_have_separate_streams() {
        let (mut d, dev) = driver();
        // Only an interleaved schedule runs a lane apart from program order.
        dev.set_schedule(Schedule::Interleaved { seed: 1 });
        let mut other = SimDriver::new(dev.clone());
        let src = pinned(&mut d, 4, |i| i as u8 + 1);
        let (a, b) = (
            d.alloc(Lane::Upload, 4).unwrap(),
            other.alloc(Lane::Upload, 4).unwrap(),
        );
        assert_ne!(d.stream_handle(), other.stream_handle());
        upload(&mut d, a, src); // seq 0, the first driver's upload lane
        upload(&mut other, b, src); // seq 1, the other's
        assert!(!d.waits().stream_query().unwrap());
        assert!(!other.waits().stream_query().unwrap());
        other.waits().lane_synchronize(Lane::Upload).unwrap();
        assert_eq!(dev.peek(b, 4).unwrap(), src);
        assert_eq!(
            dev.peek(a, 4).unwrap(),
            [0xA5; 4],
            "not the first driver's upload"
        );
        assert!(other.waits().stream_query().unwrap());
        assert!(!d.waits().stream_query().unwrap());
        other.waits().stream_synchronize().unwrap();
        assert_eq!(
            dev.queued(),
            1,
            "the other driver's streams were already idle"
        );
        d.waits().stream_synchronize().unwrap();
        assert_eq!(dev.peek(a, 4).unwrap(), src);
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }
}
