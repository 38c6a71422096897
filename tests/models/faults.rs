//! A fault model of every transfer route: faults injected at every step, two or more often landing
//! in one transfer, checked against a reference that states the rules of the routes rather than
//! the code that keeps them.
//!
//! Each case is a generated program of steps. Before each step, zero or more faults are armed on
//! the simulated device (the n-th call of an operation from now fails with a chosen error, or the
//! n-th event recorded from now reports `CUDA_ERROR_LAUNCH_FAILED` once the device reaches it);
//! then one operation runs: pinned buffers made and dropped, pending uploads and downloads
//! submitted, polled, waited, resubmitted, taken apart, dropped in flight or forgotten, staging
//! leases taken, filled, begun in both directions, ended, released, retired or dropped unproven,
//! blocking uploads and downloads of sizes on both sides of the staging boundaries, the device
//! clock advanced, `flush` and `synchronize`. Each case ends with a quiet `synchronize` and the
//! engine's teardown (with more faults armed), some values dropped before it and some after.
//!
//! The operations pick their operands with selectors resolved against what the test holds when
//! the step runs (a step with nothing to act on does nothing), so a failing program shrinks step
//! by step without preconditions.
//!
//! # The reference
//!
//! The reference model knows no queue order, no event pool and no poll mode. It reads two facts
//! off the simulated device, as a test on a real GPU would read them off the hardware: which
//! armed faults landed in an operation (by the device's call counters), and how far the device
//! clock has run (every queued job at a position below `completed()` has run). From them it
//! states what the engine may do:
//!
//! 1. **Memory a copy may still touch is untouchable.** A pinned buffer or staging slot named by
//!    a queued copy is never freed (the device is asked at every step whether it is still a live
//!    allocation, and it records a violation if it is freed under a queued copy), never handed
//!    out again (every new buffer and lease is compared by address against everything the model
//!    knows is held, in flight, detached before its copy ran, retained or forgotten), and never
//!    readable: a `Returned` transfer, a `Proven` lease, or a package handed back after its copy
//!    was queued exists only once the device has run that copy, and then holds the right bytes
//!    (a download: the tensor's contents as of the copy; a staging download: the source chunk).
//!    Memory whose proof failed (its event reported a failure, or a wait or try-wait on it failed,
//!    or its event could not be recorded and the stream could not be synchronized) is never
//!    released at all, and a pinned block whose free the driver refused stays pinned and is
//!    never handed out again (a block the test gave back in a step that had a pinned free
//!    refused, and that is still pinned once the pool holds no idle block, is such a block).
//!    Everything the test holds is read at every step and must still hold what the test last
//!    put there, and every live tensor's device memory must hold what the copies the device has
//!    run put there.
//! 2. **What is not retained is released, and what is retained stays counted.** After a
//!    `synchronize` whose stream wait succeeded nothing waits in the retirement queue,
//!    `retirement_stats().retained` counts exactly the transfers and chunks whose proof failed,
//!    the pinned pool has exactly the blocks out that the test holds or that are retained or
//!    forgotten, the staging ring has exactly the route slots out that were retained, and device
//!    memory holds exactly the live tensors and those retained with failed work. A caller's lease
//!    counts against the lease budget (`staging_stats().user_leased`, and `leased`) while it is
//!    held, forgotten or retained, however its failure was found (a failed `end_chunk`, an
//!    untracked chunk's `retire`, or the retirement queue for a lease dropped unproven), so
//!    `ring_depth` of them exhaust `staging_lease`; a lease dropped unproven counts until the
//!    retirement queue releases it. The pinned pool counts a refused free among its
//!    `refused_frees`, never among its `frees`.
//! 3. **Every refusal or failure is typed, names its cause, and is reported once.** An error is
//!    returned only when a fault landed in the operation (or, at a boundary, since the last one)
//!    and it names that fault's call and code; a submission that is rejected or fails hands back
//!    its package intact (same buffer, same tensor, same contents, or for a copy that ran, the
//!    contents it made); nothing returns wrong data; `is_ready`, `try_wait` and `flush` never
//!    wait. A refused free (pinned or device) is one failure recorded for the next boundary,
//!    which reports it in its `Error::Deferred` with every other failure recorded since the last
//!    boundary that reported (the count is checked); a refused free of a release the boundary
//!    made itself is reported by that same boundary. A failing transfer or chunk detached into
//!    the retirement queue is reported by the next `synchronize` whose stream wait succeeds, one
//!    failure each; `flush` never judges it, and a failed event query in a poll is no verdict
//!    and is never reported. A `synchronize` whose stream wait fails reports that wait alone,
//!    and everything owed before it stays owed to the next boundary. A boundary reports a
//!    failure once, not again.
//! 4. **Teardown leaves only what is kept.** When the engine's final wait succeeds, once every
//!    value is gone the device holds no pinned memory but what was retained, forgotten, or whose
//!    free the driver refused, and it saw no violation.
//!
//! Where the rules leave the engine a choice the model allows every outcome the rules allow and
//! no other: a detached transfer or lease may be released at any poll after its copy ran; a
//! failed blocking upload keeps its destination tensor only if a chunk it retired was failing;
//! failing detached work is reported with its event's failure or with a failed query of the
//! `synchronize` that settled it (a failed query is asked again, and a failing event answered
//! by a failed query is still the device's verdict).
//!
//! Two rules about the blocking routes are stated because the route's failures can only be
//! counted through them: a route proves its chunks in the order it queued them, with one wait
//! each, and stops at the first failed proof. Injected event-query failures are kept apart by at
//! least one call, because two query failures in a row while `synchronize` settles a record are
//! the device's verdict on it (a failing event gives that verdict at every query).
//!
//! The rules the model once found broken (a refused pinned free went unreported, a failed stream
//! wait in `synchronize` dropped the failures recorded before it, a retained caller lease counted
//! against the lease budget only when the retirement queue found it) are stated by tests at the
//! end of this file, with a fourth: when the pinned pool frees several idle blocks at once and the
//! driver refuses more than one, every refusal is reported.
//!
//! Each run also counts the outcomes it reached (every kind of submission and chunk outcome,
//! failed proofs, failing detached work, failed routes, two or more faults in one transfer,
//! exhausted leases, a failed teardown wait, values dropped in flight after the engine) and
//! fails if a full run missed one, so the model cannot pass by never meeting what it checks.

// Refused submissions hand their package back by value, as the engine's own APIs do.
#![allow(clippy::result_large_err)]

use cuferry::error::{StagingError, UsageError};
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, DeviceTensor, Error, Pending, PinnedHostBuffer, SubmitError, download_pending,
    download_tensor, download_tensor_into,
    engine::PinnedPoolStats,
    error::DriverError,
    pending::{Download, Returned, TryWait, Upload},
    staging::{Proven, StagingConfig, StagingLease, Unproven},
    upload_pending, upload_tensor,
};
/// What a refused or failed host submission hands back.
type TransferRefused = SubmitError<(PinnedHostBuffer<u32>, DeviceTensor<u32>)>;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};

// ---------------------------------------------------------------------------------------------
// What is generated: faults and operations.
// ---------------------------------------------------------------------------------------------

/// Every device operation the routes use, in the order the call counters are kept.
const FAULTABLE: [SimOp; 13] = [
    SimOp::CopyHtoD,
    SimOp::CopyDtoH,
    SimOp::EventCreate,
    SimOp::EventRecord,
    SimOp::EventQuery,
    SimOp::EventSynchronize,
    SimOp::StreamSynchronize,
    SimOp::StreamQuery,
    SimOp::HostAlloc,
    SimOp::HostFree,
    SimOp::Alloc,
    SimOp::Free,
    SimOp::EventDestroy,
];

/// Codes for injected call failures: anything but `LAUNCH_FAILED`, which is the failing event's,
/// so an error always tells which fault caused it.
const CODES: [DriverError; 6] = [
    DriverError::INVALID_VALUE,
    DriverError::ILLEGAL_ADDRESS,
    DriverError::UNKNOWN,
    DriverError::NOT_SUPPORTED,
    DriverError::INVALID_CONTEXT,
    DriverError::OUT_OF_MEMORY,
];

/// The staging settings of every case: a 4 KiB chunk and a 1 KiB single-copy cutoff, so the
/// boundaries (16 bytes, the cutoff, one chunk, a full ring, beyond) are a few elements apart.
const CHUNK_BYTES: usize = 4096;
const CUTOFF_BYTES: usize = 1024;
/// Elements (`u32`) of one staging slot.
const SLOT_ELEMS: usize = CHUNK_BYTES / 4;

/// Element counts on both sides of every staging boundary, for `u32`: the 16-byte scalar band,
/// the cutoff, one chunk, two to four chunks (the ring depths) and beyond.
const LENS: [usize; 15] = [
    1, 3, 4, 5, 255, 256, 257, 1023, 1024, 1025, 2048, 2049, 3073, 4097, 6144,
];

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// The n-th call of the operation from now fails with the code.
    Call(SimOp, u64, DriverError),
    /// The event of the n-th record from now reports `LAUNCH_FAILED` once reached.
    Event(u64),
}

#[derive(Clone, Copy, Debug)]
enum ChunkShape {
    Valid,
    Empty,
    OutOfRange,
    TooLong,
}

#[derive(Clone, Debug)]
enum Op {
    NewBuffer {
        len: usize,
        from_slice: bool,
    },
    /// A blocking upload into a new tensor.
    NewTensor {
        len: usize,
    },
    /// A buffer and a tensor of one length.
    NewPair {
        len: usize,
    },
    DropBuffer(usize),
    DropTensor(usize),
    Submit {
        upload: bool,
        buffer: usize,
        tensor: usize,
        mismatch: bool,
    },
    IsReady(usize),
    TryWait(usize),
    Wait(usize),
    Resubmit {
        transfer: usize,
        refill: bool,
    },
    IntoParts(usize),
    DropTransfer(usize),
    ForgetTransfer(usize),
    Lease,
    Begin {
        lease: usize,
        tensor: usize,
        upload: bool,
        offset: usize,
        len: usize,
        shape: ChunkShape,
    },
    EndChunk(usize),
    Release(usize),
    Retire {
        lease: usize,
        with_tensor: Option<usize>,
    },
    DropLease {
        lease: usize,
        proven: bool,
    },
    ForgetLease {
        lease: usize,
        proven: bool,
    },
    /// A blocking download of a tensor.
    Download {
        tensor: usize,
        into: bool,
    },
    Advance(usize),
    Flush,
    Synchronize,
}

#[derive(Clone, Debug)]
struct Step {
    faults: Vec<Fault>,
    op: Op,
}

#[derive(Clone, Debug)]
struct Case {
    ring_depth: usize,
    copy_threads: usize,
    /// A zero pinned-pool budget frees every released buffer at once (so a release is a free);
    /// otherwise released buffers are kept and handed out again (so a release is a reuse).
    pool_budget_zero: bool,
    /// Buffers, tensors and leases made before any fault is armed.
    setup: Vec<Op>,
    steps: Vec<Step>,
    teardown_faults: Vec<Fault>,
    /// Bit i set: the i-th value still held at the end is dropped after the engine, not before.
    drop_after_teardown: u64,
}

fn single_fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        5 => (select(FAULTABLE.to_vec()), 1u64..=4, select(CODES.to_vec()))
            .prop_map(|(op, n, code)| Fault::Call(op, n, code)),
        1 => (1u64..=4).prop_map(Fault::Event),
    ]
}

/// Faults meant to land in one transfer together (`None` is a failing event), shifted together
/// so they also land in later chunks of a blocking route.
fn combo() -> impl Strategy<Value = Vec<Fault>> {
    use SimOp::*;
    let combos: Vec<Vec<(Option<SimOp>, u64)>> = vec![
        vec![(Some(EventRecord), 1), (Some(StreamSynchronize), 1)],
        vec![(Some(EventCreate), 1), (Some(StreamSynchronize), 1)],
        vec![(Some(EventRecord), 2), (Some(StreamSynchronize), 1)],
        vec![(None, 1), (Some(EventSynchronize), 1)],
        vec![(None, 2), (Some(EventSynchronize), 1)],
        vec![(None, 1), (None, 2)],
        vec![
            (None, 1),
            (Some(EventRecord), 2),
            (Some(StreamSynchronize), 1),
        ],
        vec![(Some(EventSynchronize), 1), (Some(HostFree), 1)],
        vec![
            (Some(EventSynchronize), 2),
            (Some(HostFree), 1),
            (Some(Free), 1),
        ],
        vec![(Some(CopyHtoD), 1), (Some(EventRecord), 1)],
        vec![(Some(CopyDtoH), 2), (None, 1)],
        vec![(Some(HostAlloc), 1), (Some(HostAlloc), 2)],
        vec![(Some(HostAlloc), 2), (None, 1)],
        vec![(Some(EventQuery), 1), (Some(EventSynchronize), 1)],
        vec![(Some(EventQuery), 1), (None, 1)],
        vec![(Some(Alloc), 1), (Some(Alloc), 2)],
        vec![(Some(Free), 1), (Some(HostFree), 2)],
        vec![(Some(StreamQuery), 1), (Some(Free), 1)],
        vec![(None, 1), (Some(StreamSynchronize), 1)],
        vec![
            (Some(EventRecord), 1),
            (Some(StreamSynchronize), 1),
            (Some(HostFree), 1),
        ],
        vec![(Some(EventCreate), 1), (Some(EventRecord), 1)],
        vec![(None, 1), (Some(EventQuery), 1)],
    ];
    (select(combos), 0u64..=3, vec(select(CODES.to_vec()), 3)).prop_map(|(combo, shift, codes)| {
        combo
            .into_iter()
            .zip(codes.into_iter().cycle())
            .map(|((op, n), code)| match op {
                Some(op) => Fault::Call(op, n + shift, code),
                None => Fault::Event(n + shift),
            })
            .collect()
    })
}

fn faults() -> impl Strategy<Value = Vec<Fault>> {
    prop_oneof![
        8 => Just(Vec::new()),
        2 => vec(single_fault(), 1..=3),
        3 => combo(),
    ]
}

fn setup() -> impl Strategy<Value = Vec<Op>> {
    vec(
        prop_oneof![
            4 => len().prop_map(|len| Op::NewPair { len }),
            1 => Just(Op::Lease),
        ],
        1..=5,
    )
}

fn len() -> impl Strategy<Value = usize> {
    select(LENS.to_vec())
}

fn op() -> impl Strategy<Value = Op> {
    let sel = || 0usize..16;
    prop_oneof![
        3 => (len(), any::<bool>()).prop_map(|(len, from_slice)| Op::NewBuffer { len, from_slice }),
        3 => len().prop_map(|len| Op::NewTensor { len }),
        5 => len().prop_map(|len| Op::NewPair { len }),
        1 => sel().prop_map(Op::DropBuffer),
        1 => sel().prop_map(Op::DropTensor),
        8 => (any::<bool>(), sel(), sel(), prop::bool::weighted(0.1)).prop_map(
            |(upload, buffer, tensor, mismatch)| Op::Submit { upload, buffer, tensor, mismatch }
        ),
        2 => sel().prop_map(Op::IsReady),
        3 => sel().prop_map(Op::TryWait),
        3 => sel().prop_map(Op::Wait),
        2 => (sel(), any::<bool>()).prop_map(|(transfer, refill)| Op::Resubmit { transfer, refill }),
        2 => sel().prop_map(Op::IntoParts),
        2 => sel().prop_map(Op::DropTransfer),
        1 => sel().prop_map(Op::ForgetTransfer),
        3 => Just(Op::Lease),
        5 => (
            sel(),
            sel(),
            any::<bool>(),
            any::<usize>(),
            any::<usize>(),
            prop_oneof![
                12 => Just(ChunkShape::Valid),
                1 => Just(ChunkShape::Empty),
                1 => Just(ChunkShape::OutOfRange),
                1 => Just(ChunkShape::TooLong),
            ],
        )
            .prop_map(|(lease, tensor, upload, offset, len, shape)| Op::Begin {
                lease,
                tensor,
                upload,
                offset,
                len,
                shape,
            }),
        3 => sel().prop_map(Op::EndChunk),
        1 => sel().prop_map(Op::Release),
        2 => (sel(), prop::option::of(sel()))
            .prop_map(|(lease, with_tensor)| Op::Retire { lease, with_tensor }),
        1 => (sel(), any::<bool>()).prop_map(|(lease, proven)| Op::DropLease { lease, proven }),
        1 => (sel(), any::<bool>()).prop_map(|(lease, proven)| Op::ForgetLease { lease, proven }),
        3 => (sel(), any::<bool>()).prop_map(|(tensor, into)| Op::Download { tensor, into }),
        3 => (1usize..=6).prop_map(Op::Advance),
        1 => Just(Op::Flush),
        2 => Just(Op::Synchronize),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (
        2usize..=4,
        1usize..=2,
        any::<bool>(),
        setup(),
        vec(
            (faults(), op()).prop_map(|(faults, op)| Step { faults, op }),
            1..=40,
        ),
        faults(),
        any::<u64>(),
    )
        .prop_map(
            |(ring_depth, copy_threads, pool_budget_zero, setup, steps, teardown_faults, after)| {
                Case {
                    ring_depth,
                    copy_threads,
                    pool_budget_zero,
                    setup,
                    steps,
                    teardown_faults,
                    drop_after_teardown: after,
                }
            },
        )
}

// ---------------------------------------------------------------------------------------------
// What the device tells: faults that landed, and its clock.
// ---------------------------------------------------------------------------------------------

type Calls = [u64; FAULTABLE.len()];

fn slot(op: SimOp) -> usize {
    FAULTABLE
        .iter()
        .position(|o| *o == op)
        .expect("a faultable operation")
}

fn calls(sim: &SimDevice) -> Calls {
    std::array::from_fn(|i| sim.calls(FAULTABLE[i]))
}

/// A cause the device can give for an error: an injected call failure, or (`None`) the failure
/// a failing event reports once the device reaches it.
type Cause = (Option<SimOp>, DriverError);

/// A fault that landed in an operation: which call (`None` for a failing event, counted among
/// event records), its index among the operation's calls of that kind, and its code.
#[derive(Clone, Copy, Debug)]
struct Fired {
    op: Option<SimOp>,
    index: u64,
    code: DriverError,
}

/// What the device saw during one operation.
#[derive(Debug)]
struct Obs {
    fired: Vec<Fired>,
    /// Calls made during the operation, per kind.
    delta: Calls,
    /// The device position of the first job the operation queued.
    next: u64,
    completed_before: u64,
    completed_after: u64,
    queued_after: u64,
    /// The pinned pool's counters before and after, while the engine is open.
    pool: Option<(PinnedPoolStats, PinnedPoolStats)>,
}

impl Obs {
    fn call(&self, op: SimOp) -> Option<Fired> {
        self.fired.iter().find(|f| f.op == Some(op)).copied()
    }

    /// Indices (among the operation's event records) of the records whose event fails.
    fn failing_events(&self) -> BTreeSet<u64> {
        self.fired
            .iter()
            .filter(|f| f.op.is_none())
            .map(|f| f.index)
            .collect()
    }

    fn calls(&self, op: SimOp) -> u64 {
        self.delta[slot(op)]
    }

    fn causes(&self) -> Vec<Cause> {
        self.fired.iter().map(|f| (f.op, f.code)).collect()
    }

    /// Whether nothing was queued.
    fn queued_nothing(&self) -> bool {
        self.next == self.completed_after + self.queued_after
    }

    /// Whether the operation neither waited nor let the device run.
    fn waited(&self) -> bool {
        self.completed_before != self.completed_after
            || self.calls(SimOp::EventSynchronize) > 0
            || self.calls(SimOp::StreamSynchronize) > 0
    }
}

/// The driver call an engine error names for a failure of `op`.
fn call_name(op: SimOp) -> Option<&'static str> {
    Some(match op {
        SimOp::CopyHtoD => "cuMemcpyHtoDAsync",
        SimOp::CopyDtoH => "cuMemcpyDtoHAsync",
        SimOp::EventCreate => "cuEventCreate",
        SimOp::EventRecord => "cuEventRecord",
        SimOp::HostAlloc => "cuMemHostAlloc",
        SimOp::HostFree => "cuMemFreeHost",
        SimOp::Alloc => "cuMemAllocFromPoolAsync",
        SimOp::Free => "cuMemFreeAsync",
        SimOp::EventDestroy => "cuEventDestroy",
        _ => return None,
    })
}

/// Whether `error` names one of `causes`: a driver error names the failed call and its code, a
/// device fault the code of a failed wait or query, or of a failing event, and an
/// out-of-memory error a device allocation refused for want of memory.
fn explains(causes: &[Cause], error: &Error) -> bool {
    match error {
        Error::OutOfMemory(_) => causes
            .iter()
            .any(|&(op, code)| op == Some(SimOp::Alloc) && code == DriverError::OUT_OF_MEMORY),
        Error::Driver { call, source } => causes.iter().any(|&(op, code)| {
            code == *source && op.and_then(call_name).is_some_and(|n| call.starts_with(n))
        }),
        Error::DeviceFault { source, .. } => causes.iter().any(|&(op, code)| {
            code == *source
                && matches!(
                    op,
                    None | Some(
                        SimOp::EventQuery
                            | SimOp::EventSynchronize
                            | SimOp::StreamSynchronize
                            | SimOp::StreamQuery
                    )
                )
        }),
        Error::Deferred { count, first } => *count >= 1 && explains(causes, first),
        _ => false,
    }
}

macro_rules! ensure {
    ($cond:expr_2021, $($msg:tt)+) => {
        if !$cond {
            return Err(TestCaseError::fail(format!($($msg)+)));
        }
    };
}

type Check = Result<(), TestCaseError>;

/// Outcomes the generator must reach, so the model cannot pass by never meeting them.
#[derive(Clone, Copy, Debug)]
enum Seen {
    SubmitInFlight,
    SubmitFailingEvent,
    SubmitRejected,
    SubmitNotQueued,
    SubmitProvenByStreamWait,
    SubmitUntracked,
    Resubmitted,
    ChunkInFlight,
    ChunkNotQueued,
    ChunkUntracked,
    ChunkProven,
    ReturnedByTryWait,
    ReturnedByWait,
    ProofFailed,
    DetachedFailing,
    RouteFailed,
    RouteRetiredFailingChunk,
    TwoFaultsInOneTransfer,
    LeasesExhausted,
    ExhaustedByRetainedLease,
    TeardownWaitFailed,
    DroppedInFlightAfterTeardown,
    DeferredReported,
    BoundaryReportedOwnRefusal,
    FailedWaitKeptFailures,
    RefusedBlockKept,
}

const ALL_SEEN: [Seen; 26] = {
    use Seen::*;
    [
        SubmitInFlight,
        SubmitFailingEvent,
        SubmitRejected,
        SubmitNotQueued,
        SubmitProvenByStreamWait,
        SubmitUntracked,
        Resubmitted,
        ChunkInFlight,
        ChunkNotQueued,
        ChunkUntracked,
        ChunkProven,
        ReturnedByTryWait,
        ReturnedByWait,
        ProofFailed,
        DetachedFailing,
        RouteFailed,
        RouteRetiredFailingChunk,
        TwoFaultsInOneTransfer,
        LeasesExhausted,
        ExhaustedByRetainedLease,
        TeardownWaitFailed,
        DroppedInFlightAfterTeardown,
        DeferredReported,
        BoundaryReportedOwnRefusal,
        FailedWaitKeptFailures,
        RefusedBlockKept,
    ]
};

static COVERAGE: [AtomicU32; ALL_SEEN.len()] = [const { AtomicU32::new(0) }; ALL_SEEN.len()];

fn seen(what: Seen) {
    COVERAGE[what as usize].fetch_add(1, Ordering::Relaxed);
}

// ---------------------------------------------------------------------------------------------
// The reference model.
// ---------------------------------------------------------------------------------------------

/// Where a pinned allocation the test knows about stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    /// Readable by the test: an idle buffer, a returned transfer's buffer, a proven lease.
    Held,
    /// Named by a copy queued at device position `copy`, inside a value the test holds.
    Lent { copy: u64, faulty: bool },
    /// Named by a copy queued at `copy`, handed to the engine before its proof.
    Detached { copy: u64, faulty: bool },
    /// Its proof failed: kept for the engine's lifetime.
    Retained,
    /// Forgotten by the test, or kept after the engine's teardown: never released.
    Leaked,
    /// Given back with nothing queued on it.
    Released,
    /// A pinned block given back whose free the driver refused: it stays pinned and is never
    /// handed out again.
    Refused,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mem {
    /// A pinned buffer's block, from the pinned pool.
    Block,
    /// A staging slot.
    Slot,
}

#[derive(Debug)]
struct Host {
    addr: usize,
    mem: Mem,
    hold: Hold,
    /// What the memory holds while it is readable, as bytes and (for a buffer) as elements.
    content: Vec<u8>,
    words: Vec<u32>,
}

impl Host {
    fn set(&mut self, bytes: Vec<u8>) {
        self.words = to_words(&bytes);
        self.content = bytes;
    }

    fn patch(&mut self, at: usize, bytes: &[u8]) {
        let mut content = std::mem::take(&mut self.content);
        content[at..at + bytes.len()].copy_from_slice(bytes);
        self.set(content);
    }

    /// Whether the memory may not be freed or handed out again when the device has run every
    /// job below `completed`.
    fn busy(&self, completed: u64) -> bool {
        match self.hold {
            Hold::Held | Hold::Lent { .. } | Hold::Retained | Hold::Leaked | Hold::Refused => true,
            Hold::Detached { copy, faulty } => faulty || completed <= copy,
            Hold::Released => false,
        }
    }
}

#[derive(Debug)]
struct Tensor {
    ptr: u64,
    len: usize,
    base: Vec<u32>,
    /// Copies into the tensor: device position, first element, data.
    writes: Vec<(u64, usize, Vec<u32>)>,
    /// Held by the test, idle or in a transfer it holds.
    live: bool,
    /// The bytes once every copy below `cache_at` has run, and how many writes that applies.
    cache: Vec<u8>,
    cache_at: u64,
    applied: usize,
}

impl Tensor {
    /// The bytes once every copy below `completed` has run. Copies are recorded in queue order
    /// and never below a position the device had reached, so this only moves forward.
    fn current(&mut self, completed: u64) -> &[u8] {
        while let Some((pos, offset, words)) = self.writes.get(self.applied) {
            if *pos >= completed {
                break;
            }
            self.cache[offset * 4..(offset + words.len()) * 4].copy_from_slice(&to_bytes(words));
            self.applied += 1;
        }
        self.cache_at = self.cache_at.max(completed);
        &self.cache
    }

    /// The contents once every copy queued below `at` has run.
    fn before(&self, at: u64) -> Vec<u32> {
        let mut data = self.base.clone();
        for (pos, offset, words) in &self.writes {
            if *pos < at {
                data[*offset..*offset + words.len()].copy_from_slice(words);
            }
        }
        data
    }
}

#[derive(Debug)]
struct Transfer {
    upload: bool,
    host: usize,
    tensor: usize,
    copy: u64,
    faulty: bool,
}

#[derive(Debug)]
struct Chunk {
    copy: u64,
    faulty: bool,
    /// For a download: the bytes that land at the start of the slot.
    arrives: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Lease {
    host: usize,
    chunk: Option<Chunk>,
}

/// How a submission (a pending transfer, a staging chunk) may end, by the faults that landed.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Refused before anything was queued.
    Refused,
    /// The copy was not queued.
    NotQueued(Cause),
    /// The copy was queued, its event not recorded, and a stream wait proved it.
    Proven(Cause),
    /// The copy was queued and nothing could prove it: retained.
    Untracked(Cause),
    /// In flight, its event failing or not.
    InFlight { faulty: bool },
}

fn expect_submission(obs: &Obs, copy_op: SimOp, valid: bool) -> Expect {
    if !valid {
        return Expect::Refused;
    }
    if let Some(f) = obs.call(copy_op) {
        return Expect::NotQueued((Some(copy_op), f.code));
    }
    let record = [SimOp::EventCreate, SimOp::EventRecord]
        .into_iter()
        .find_map(|op| obs.call(op).map(|f| (Some(op), f.code)));
    match record {
        Some(cause) if obs.call(SimOp::StreamSynchronize).is_some() => Expect::Untracked(cause),
        Some(cause) => Expect::Proven(cause),
        None => Expect::InFlight {
            faulty: !obs.failing_events().is_empty(),
        },
    }
}

/// A readiness answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Ready,
    NotReady,
    Failed,
}

/// Whether a readiness answer for a copy queued at `copy` (its event recorded right after it) is
/// allowed when the device has run every job below `completed`.
fn verdict_allowed(copy: u64, faulty: bool, completed: u64, got: Verdict) -> bool {
    let ran = completed > copy;
    let reached = completed > copy + 1;
    match got {
        Verdict::Ready => ran && !faulty,
        Verdict::NotReady => !reached,
        Verdict::Failed => faulty && reached,
    }
}

#[derive(Debug, Default)]
struct Model {
    depth: usize,
    armed: Vec<(SimOp, u64, DriverError)>,
    armed_events: Vec<u64>,
    hosts: Vec<Host>,
    tensors: Vec<Tensor>,
    transfers: Vec<Transfer>,
    leases: Vec<Lease>,
    /// Work the engine must count as retained.
    retained: usize,
    /// Pinned allocations that outlive everything: retained, forgotten, or refused a free.
    pinned_kept: usize,
    /// Device allocations likewise, and those a failed blocking upload may keep.
    device_kept: usize,
    device_maybe: usize,
    /// Caller leases forgotten (they never return to the lease budget).
    forgotten_leases: usize,
    /// Caller leases detached unproven: their copy position and whether their event fails.
    detached_leases: Vec<(u64, bool)>,
    /// Caller leases retained: each counts against the lease budget for the engine's lifetime.
    retained_leases: usize,
    /// Pinned frees refused in the current step, and the hosts given back before it.
    refused_pinned_in_step: usize,
    released_before: BTreeSet<usize>,
    /// Route chunks (beyond the scalar band) retained: each stays counted as a leased slot.
    route_retained: usize,
    /// Failures recorded for the next boundary, one deferred error each.
    must: Vec<Cause>,
    /// Detached work whose event fails, not yet settled by a `synchronize` whose stream wait
    /// succeeded: the next such `synchronize` retains and reports each once.
    unsettled: usize,
    salt: u32,
}

impl Model {
    fn new(depth: usize) -> Self {
        Model {
            depth,
            ..Model::default()
        }
    }

    fn salt(&mut self) -> u32 {
        self.salt += 1;
        self.salt
    }

    /// Arms faults on the device and remembers them by absolute call number.
    fn inject(&mut self, sim: &SimDevice, faults: &[Fault]) {
        for &fault in faults {
            match fault {
                Fault::Call(op, n, code) => {
                    let at = sim.calls(op) + n;
                    let clash = self.armed.iter().any(|&(o, a, _)| {
                        o == op && (a == at || (op == SimOp::EventQuery && a.abs_diff(at) <= 1))
                    });
                    if !clash {
                        sim.fail_nth(op, n, code);
                        self.armed.push((op, at, code));
                    }
                }
                Fault::Event(n) => {
                    let at = sim.calls(SimOp::EventRecord) + n;
                    if !self.armed_events.contains(&at) {
                        sim.fail_event(n, DriverError::LAUNCH_FAILED);
                        self.armed_events.push(at);
                    }
                }
            }
        }
    }

    fn disarm(&mut self, sim: &SimDevice) {
        sim.clear_faults();
        self.armed.clear();
        self.armed_events.clear();
    }

    /// The armed faults whose call came between two readings of the device's counters. A failing
    /// event whose own record call failed never fires.
    fn observe(&mut self, before: &Calls, after: &Calls) -> Vec<Fired> {
        let mut fired = Vec::new();
        let mut failed_records = BTreeSet::new();
        self.armed.retain(|&(op, at, code)| {
            let i = slot(op);
            if before[i] < at && at <= after[i] {
                fired.push(Fired {
                    op: Some(op),
                    index: at - before[i] - 1,
                    code,
                });
                if op == SimOp::EventRecord {
                    failed_records.insert(at);
                }
                return false;
            }
            at > after[i]
        });
        let r = slot(SimOp::EventRecord);
        self.armed_events.retain(|&at| {
            if before[r] < at && at <= after[r] {
                if !failed_records.contains(&at) {
                    fired.push(Fired {
                        op: None,
                        index: at - before[r] - 1,
                        code: DriverError::LAUNCH_FAILED,
                    });
                }
                return false;
            }
            at > after[r]
        });
        fired
    }

    /// A new buffer or lease: its memory must not be anything a copy may still touch, or anything
    /// held, retained or forgotten.
    fn add_host(
        &mut self,
        addr: usize,
        mem: Mem,
        content: Vec<u8>,
        completed: u64,
    ) -> Result<usize, TestCaseError> {
        if let Some(old) = self
            .hosts
            .iter()
            .find(|h| h.addr == addr && h.busy(completed))
        {
            return Err(TestCaseError::fail(format!(
                "a new {mem:?} was handed memory {addr:#x} that is still {:?} (device at {completed})",
                old.hold
            )));
        }
        self.hosts.push(Host {
            addr,
            mem,
            hold: Hold::Held,
            words: to_words(&content),
            content,
        });
        Ok(self.hosts.len() - 1)
    }

    fn add_tensor(&mut self, ptr: u64, data: Vec<u32>) -> usize {
        self.tensors.push(Tensor {
            ptr,
            len: data.len(),
            cache: to_bytes(&data),
            cache_at: 0,
            applied: 0,
            base: data,
            writes: Vec::new(),
            live: true,
        });
        self.tensors.len() - 1
    }

    /// A copy of the host memory's first `len` elements into `tensor` at `offset`, queued at `at`.
    fn write(&mut self, tensor: usize, at: u64, offset: usize, host: usize, len: usize) {
        let words = to_words(&self.hosts[host].content[..len * 4]);
        let t = &mut self.tensors[tensor];
        debug_assert!(at >= t.cache_at, "copies are recorded in queue order");
        t.writes.push((at, offset, words));
    }

    /// Lease budget: (at least, at most) caller leases counted as out, given `held` and the
    /// device at `completed`. Forgotten and retained leases count for good; a detached lease
    /// counts until it is released, which may happen at any poll after its copy ran unless its
    /// event fails (then it is retained and counts for good).
    fn leases_out(&self, held: usize, completed: u64) -> (usize, usize) {
        let sure = self
            .detached_leases
            .iter()
            .filter(|&&(copy, faulty)| faulty || completed <= copy)
            .count();
        let lo = held + self.forgotten_leases + self.retained_leases + sure;
        (lo, lo + self.detached_leases.len() - sure)
    }

    /// Blocks out of the pinned pool: held by the test, lent, retained or forgotten.
    fn blocks_out(&self) -> usize {
        self.hosts
            .iter()
            .filter(|h| h.mem == Mem::Block)
            .filter(|h| match h.hold {
                Hold::Held | Hold::Lent { .. } | Hold::Retained | Hold::Leaked => true,
                Hold::Detached { faulty, .. } => faulty,
                Hold::Released | Hold::Refused => false,
            })
            .count()
    }

    fn retain_transfer(&mut self, host: usize, tensor: usize) {
        self.hosts[host].hold = Hold::Retained;
        self.tensors[tensor].live = false;
        self.retained += 1;
        self.pinned_kept += 1;
        self.device_kept += 1;
    }

    fn detach_transfer(&mut self, x: usize) {
        let t = &self.transfers[x];
        let (host, tensor, copy, faulty) = (t.host, t.tensor, t.copy, t.faulty);
        self.hosts[host].hold = Hold::Detached { copy, faulty };
        self.tensors[tensor].live = false;
        if faulty {
            seen(Seen::DetachedFailing);
            self.retained += 1;
            self.pinned_kept += 1;
            self.device_kept += 1;
            self.unsettled += 1;
        }
    }

    fn forget_transfer(&mut self, x: usize) {
        let (host, tensor) = (self.transfers[x].host, self.transfers[x].tensor);
        self.hosts[host].hold = Hold::Leaked;
        self.tensors[tensor].live = false;
        self.pinned_kept += 1;
        self.device_kept += 1;
    }

    fn retain_lease(&mut self, lease: usize, tensor: Option<usize>) {
        let host = self.leases[lease].host;
        self.hosts[host].hold = Hold::Retained;
        self.retained += 1;
        self.pinned_kept += 1;
        self.retained_leases += 1;
        if let Some(t) = tensor {
            self.tensors[t].live = false;
            self.device_kept += 1;
        }
    }

    fn detach_lease(&mut self, lease: usize, tensor: Option<usize>) {
        let host = self.leases[lease].host;
        let chunk = self.leases[lease]
            .chunk
            .as_ref()
            .expect("an unproven lease has a chunk");
        let (copy, faulty) = (chunk.copy, chunk.faulty);
        self.hosts[host].hold = Hold::Detached { copy, faulty };
        self.detached_leases.push((copy, faulty));
        if faulty {
            seen(Seen::DetachedFailing);
        }
        if let Some(t) = tensor {
            self.tensors[t].live = false;
            if faulty {
                self.device_kept += 1;
            }
        }
        if faulty {
            self.retained += 1;
            self.pinned_kept += 1;
            self.unsettled += 1;
        }
    }

    fn forget_lease(&mut self, lease: usize) {
        let host = self.leases[lease].host;
        self.hosts[host].hold = Hold::Leaked;
        self.pinned_kept += 1;
        self.forgotten_leases += 1;
    }

    /// Faults that landed where the operation's own rules do not speak of them. A refused free
    /// (pinned or device) keeps its memory and is one failure recorded for a boundary, as is a
    /// refused event destroy (only ever made at teardown, when no boundary follows); a failed
    /// event query in a poll is no verdict (the poll asks again later) and is never reported;
    /// anything else landing there means the operation made a call it has no business making.
    ///
    /// The pinned pool counts a refused free among its refusals, never among its frees.
    fn absorb(&mut self, obs: &Obs, handled: &[Option<SimOp>]) -> Check {
        let refused_pinned = obs
            .fired
            .iter()
            .filter(|f| f.op == Some(SimOp::HostFree) && !handled.contains(&f.op))
            .count();
        self.refused_pinned_in_step += refused_pinned;
        for f in &obs.fired {
            if handled.contains(&f.op) {
                continue;
            }
            let cause = (f.op, f.code);
            match f.op {
                Some(SimOp::HostFree) => {
                    self.pinned_kept += 1;
                    self.must.push(cause);
                }
                Some(SimOp::Free) => {
                    self.device_kept += 1;
                    self.must.push(cause);
                }
                Some(SimOp::EventDestroy) => self.must.push(cause),
                Some(SimOp::EventQuery) => {}
                _ => {
                    return Err(TestCaseError::fail(format!(
                        "a fault landed in a call this operation has no business making: {f:?}"
                    )));
                }
            }
        }
        if let Some((before, after)) = obs.pool {
            let refused = obs
                .fired
                .iter()
                .filter(|f| f.op == Some(SimOp::HostFree))
                .count() as u64;
            let freed = obs.calls(SimOp::HostFree) - refused;
            ensure!(
                after.refused_frees - before.refused_frees <= refused,
                "the pinned pool counts {} refused free(s); {refused} cuMemFreeHost call(s) were \
                 refused",
                after.refused_frees - before.refused_frees
            );
            ensure!(
                after.frees - before.frees <= freed,
                "the pinned pool counts {} free(s); only {freed} cuMemFreeHost call(s) succeeded",
                after.frees - before.frees
            );
        }
        Ok(())
    }

    /// The rules of a blocking route (upload or download), given the faults that landed in it.
    /// `scalar`: the transfer goes through the 16-byte slot, which no lease count covers.
    fn route(&mut self, obs: &Obs, upload: bool, scalar: bool, error: Option<&Error>) -> Check {
        use SimOp::*;
        let fatal: Vec<Fired> = obs
            .fired
            .iter()
            .filter(|f| match f.op {
                None => true,
                Some(Alloc | HostAlloc) => f.code != DriverError::OUT_OF_MEMORY,
                Some(op) => matches!(
                    op,
                    CopyHtoD
                        | CopyDtoH
                        | EventCreate
                        | EventRecord
                        | EventSynchronize
                        | StreamSynchronize
                ),
            })
            .copied()
            .collect();
        // An allocation (device memory or a staging slot) refused for want of memory is retried
        // once the retired work is released and idle pinned memory freed.
        let oom = obs.fired.iter().any(|f| {
            matches!(f.op, Some(Alloc | HostAlloc)) && f.code == DriverError::OUT_OF_MEMORY
        });
        match error {
            None => ensure!(
                fatal.is_empty(),
                "the route succeeded although these faults landed in it: {fatal:?}"
            ),
            Some(e) => {
                seen(Seen::RouteFailed);
                ensure!(
                    !fatal.is_empty() || oom,
                    "the route failed with no fault to explain it: {e}"
                );
                ensure!(
                    explains(&obs.causes(), e),
                    "the route's error names no fault that landed in it ({:?}): {e:?}",
                    obs.fired
                );
            }
        }
        // Chunk k is recorded by the route's k-th event record and proven by its k-th wait; the
        // route stops at the first failed proof and retires the chunks still in flight.
        let failing = obs.failing_events();
        let waits = obs.calls(EventSynchronize);
        let failed_wait = obs
            .call(EventSynchronize)
            .map(|f| f.index)
            .or_else(|| waits.checked_sub(1).filter(|w| failing.contains(w)));
        let retired_failing = failing.iter().filter(|&&j| Some(j) != failed_wait).count();
        let untracked = obs.call(StreamSynchronize).is_some();
        let kept = retired_failing + usize::from(failed_wait.is_some()) + usize::from(untracked);
        self.retained += kept;
        self.pinned_kept += kept;
        if !scalar {
            self.route_retained += kept;
        }
        if obs.fired.len() >= 2 {
            seen(Seen::TwoFaultsInOneTransfer);
        }
        if retired_failing > 0 {
            seen(Seen::RouteRetiredFailingChunk);
            self.unsettled += retired_failing;
            if upload {
                // The destination goes with the newest chunk retired; kept if that one fails.
                self.device_maybe += 1;
            }
        }
        Ok(())
    }

    /// What a boundary owes: the failures recorded since the last boundary that reported, those
    /// of releases the boundary made itself (already absorbed into `must`), and, at a
    /// `synchronize` whose wait succeeded, the failing detached work. It must report them all,
    /// each once, in one `Error::Deferred` naming one of them first.
    ///
    /// Failing detached work is named by its event's failure, or by a failed query of the same
    /// `synchronize`: a record whose query fails is asked again, and a failing event answered by
    /// a failed query (before or after its own failure) is still the device's verdict on it.
    fn report(&self, obs: &Obs, what: &str, result: &Result<(), Error>, settles: bool) -> Check {
        let mut causes = self.must.clone();
        let mut count = self.must.len();
        if settles && self.unsettled > 0 {
            causes.push((None, DriverError::LAUNCH_FAILED));
            causes.extend(
                obs.fired
                    .iter()
                    .filter(|f| f.op == Some(SimOp::EventQuery))
                    .map(|f| (f.op, f.code)),
            );
            count += self.unsettled;
        }
        if count == 0 {
            return Ok(());
        }
        match result {
            Err(Error::Deferred { count: got, first }) => {
                ensure!(
                    *got == count,
                    "{what} reported {got} failure(s); the rules say {count} ({:?} and {} failing \
                     detached transfer(s) or chunk(s))",
                    self.must,
                    if settles { self.unsettled } else { 0 }
                );
                ensure!(
                    explains(&causes, first),
                    "{what} reported a failure nothing explains first: {first:?} (owed {causes:?})"
                );
                seen(Seen::DeferredReported);
                Ok(())
            }
            other => Err(TestCaseError::fail(format!(
                "{what} must report {:?} and {} failing detached transfer(s) or chunk(s), but \
                 gave {other:?}",
                self.must,
                if settles { self.unsettled } else { 0 }
            ))),
        }
    }

    /// A `flush`: it releases what has completed, then reports every failure recorded so far
    /// (those of its own releases too); with none, a failed stream query. It never waits and
    /// never judges failing detached work (that is for `synchronize`).
    fn flush(&mut self, obs: &Obs, result: &Result<(), Error>) -> Check {
        ensure!(!obs.waited(), "flush waited for the device");
        let owed_before = self.must.len();
        self.absorb(obs, &[Some(SimOp::StreamQuery)])?;
        if self.must.len() > owed_before {
            seen(Seen::BoundaryReportedOwnRefusal);
        }
        let query = obs.call(SimOp::StreamQuery);
        if self.must.is_empty() {
            match (query, result) {
                (None, Ok(())) => {}
                (Some(q), Err(Error::DeviceFault { source, .. })) if *source == q.code => {}
                (query, result) => {
                    return Err(TestCaseError::fail(format!(
                        "flush owed nothing (stream query fault: {query:?}), but gave {result:?}"
                    )));
                }
            }
        } else {
            self.report(obs, "flush", result, false)?;
        }
        self.must.clear();
        Ok(())
    }

    /// A `synchronize`. Returns whether the stream wait succeeded, so the retirement queue was
    /// settled.
    fn synchronize(
        &mut self,
        obs: &Obs,
        result: &Result<(), Error>,
    ) -> Result<bool, TestCaseError> {
        if let Some(f) = obs.call(SimOp::StreamSynchronize) {
            ensure!(
                matches!(result, Err(Error::DeviceFault { source, .. }) if *source == f.code),
                "a failed stream wait must fail synchronize with its code: {result:?}"
            );
            // The failures recorded before the wait stay for the next boundary.
            if !self.must.is_empty() || self.unsettled > 0 {
                seen(Seen::FailedWaitKeptFailures);
            }
            self.absorb(obs, &[Some(SimOp::StreamSynchronize)])?;
            return Ok(false);
        }
        let owed_before = self.must.len();
        self.absorb(obs, &[])?;
        if self.must.len() > owed_before {
            seen(Seen::BoundaryReportedOwnRefusal);
        }
        if self.must.is_empty() && self.unsettled == 0 {
            ensure!(
                result.is_ok(),
                "synchronize owed nothing but reported {result:?}"
            );
        } else {
            self.report(obs, "synchronize", result, true)?;
        }
        self.must.clear();
        self.unsettled = 0;
        // Detached leases are now released, or retained if their event failed.
        let failing = self.detached_leases.iter().filter(|l| l.1).count();
        self.retained_leases += failing;
        self.detached_leases.clear();
        Ok(true)
    }
}

// ---------------------------------------------------------------------------------------------
// The system under test.
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
enum Xfer {
    Up(Pending<Upload<u32>>),
    Down(Pending<Download<u32>>),
    UpBack(Pending<Upload<u32>, Returned>),
    DownBack(Pending<Download<u32>, Returned>),
}

impl Xfer {
    fn in_flight(&self) -> bool {
        matches!(self, Xfer::Up(_) | Xfer::Down(_))
    }

    fn returned_buffer(&self) -> Option<&PinnedHostBuffer<u32>> {
        match self {
            Xfer::UpBack(r) => Some(r.buffer()),
            Xfer::DownBack(r) => Some(r.buffer()),
            _ => None,
        }
    }

    fn is_ready(&mut self) -> Result<bool, Error> {
        match self {
            Xfer::Up(p) => p.is_ready(),
            Xfer::Down(p) => p.is_ready(),
            _ => unreachable!("only in-flight transfers are polled"),
        }
    }

    fn try_wait(self) -> Result<Xfer, Error> {
        Ok(match self {
            Xfer::Up(p) => match p.try_wait()? {
                TryWait::Returned(r) => Xfer::UpBack(r),
                TryWait::InFlight(p) => Xfer::Up(p),
            },
            Xfer::Down(p) => match p.try_wait()? {
                TryWait::Returned(r) => Xfer::DownBack(r),
                TryWait::InFlight(p) => Xfer::Down(p),
            },
            other => other,
        })
    }

    fn wait(self) -> Result<Xfer, Error> {
        Ok(match self {
            Xfer::Up(p) => Xfer::UpBack(p.wait()?),
            Xfer::Down(p) => Xfer::DownBack(p.wait()?),
            other => other,
        })
    }
}

fn to_bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn to_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Distinct, never-zero values for one object.
fn pattern(salt: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (salt << 20) ^ i.wrapping_mul(2_654_435_761) ^ 0x5A5A_0001)
        .collect()
}

fn addr(b: &PinnedHostBuffer<u32>) -> usize {
    b.as_slice().as_ptr() as usize
}

fn device_ptr(_engine: &mut CudaEngine, t: &DeviceTensor<u32>) -> u64 {
    t.sim_address()
}

/// A pending submission, for checking what came back.
#[derive(Clone, Copy, Debug)]
struct Submission {
    host: usize,
    tensor: usize,
    upload: bool,
    valid: bool,
    resubmit: bool,
}

struct Sut {
    engine: Option<CudaEngine>,
    sim: SimDevice,
    /// Idle pinned buffers (host id).
    buffers: Vec<(usize, PinnedHostBuffer<u32>)>,
    /// Idle tensors (tensor id).
    tensors: Vec<(usize, DeviceTensor<u32>)>,
    /// Pending transfers (transfer id).
    transfers: Vec<(usize, Xfer)>,
    /// Leases (lease id).
    proven: Vec<(usize, StagingLease<Proven>)>,
    unproven: Vec<(usize, StagingLease<Unproven>)>,
}

impl Sut {
    fn engine(&mut self) -> &mut CudaEngine {
        self.engine.as_mut().expect("the engine is open")
    }

    /// Runs one operation and reads what the device saw.
    fn run<T>(&mut self, m: &mut Model, f: impl FnOnce(&mut Self) -> T) -> (T, Obs) {
        let before = calls(&self.sim);
        let completed_before = self.sim.completed();
        let next = completed_before + self.sim.queued() as u64;
        let pool_before = self.engine.as_ref().map(CudaEngine::pinned_pool_stats);
        let out = f(self);
        let after = calls(&self.sim);
        let pool_after = self.engine.as_ref().map(CudaEngine::pinned_pool_stats);
        let fired = m.observe(&before, &after);
        let obs = Obs {
            fired,
            delta: std::array::from_fn(|i| after[i] - before[i]),
            next,
            completed_before,
            completed_after: self.sim.completed(),
            queued_after: self.sim.queued() as u64,
            pool: pool_before.zip(pool_after),
        };
        (out, obs)
    }

    fn step(&mut self, m: &mut Model, op: &Op) -> Check {
        match *op {
            Op::NewBuffer { len, from_slice } => {
                self.new_buffer(m, len, from_slice)?;
            }
            Op::NewTensor { len } => {
                self.new_tensor(m, len)?;
            }
            Op::NewPair { len } => {
                self.new_buffer(m, len, true)?;
                self.new_tensor(m, len)?;
            }
            Op::DropBuffer(sel) => {
                if self.buffers.is_empty() {
                    return Ok(());
                }
                let (host, buffer) = self.buffers.swap_remove(sel % self.buffers.len());
                let ((), obs) = self.run(m, |_| drop(buffer));
                m.hosts[host].hold = Hold::Released;
                ensure!(!obs.waited(), "dropping a buffer waited");
                m.absorb(&obs, &[])?;
            }
            Op::DropTensor(sel) => {
                if self.tensors.is_empty() {
                    return Ok(());
                }
                let (tensor, t) = self.tensors.swap_remove(sel % self.tensors.len());
                let ((), obs) = self.run(m, |_| drop(t));
                m.tensors[tensor].live = false;
                m.absorb(&obs, &[])?;
            }
            Op::Submit {
                upload,
                buffer,
                tensor,
                mismatch,
            } => self.submit(m, upload, buffer, tensor, mismatch)?,
            Op::IsReady(sel) => self.is_ready(m, sel)?,
            Op::TryWait(sel) => self.try_wait(m, sel)?,
            Op::Wait(sel) => self.wait(m, sel)?,
            Op::Resubmit { transfer, refill } => self.resubmit(m, transfer, refill)?,
            Op::IntoParts(sel) => {
                let Some(i) = self.pick(sel, |x| !x.in_flight()) else {
                    return Ok(());
                };
                let (x, handle) = self.transfers.swap_remove(i);
                let (buffer, tensor) = match handle {
                    Xfer::UpBack(r) => r.into_parts(),
                    // A download's parts come back source first.
                    Xfer::DownBack(r) => {
                        let (tensor, buffer) = r.into_parts();
                        (buffer, tensor)
                    }
                    _ => unreachable!("picked a returned transfer"),
                };
                let t = &m.transfers[x];
                ensure!(
                    addr(&buffer) == m.hosts[t.host].addr,
                    "into_parts gave back another buffer"
                );
                self.buffers.push((t.host, buffer));
                self.tensors.push((t.tensor, tensor));
            }
            Op::DropTransfer(sel) => {
                if self.transfers.is_empty() {
                    return Ok(());
                }
                let (x, handle) = self.transfers.swap_remove(sel % self.transfers.len());
                let in_flight = handle.in_flight();
                let ((), obs) = self.run(m, |_| drop(handle));
                ensure!(!obs.waited(), "dropping a transfer waited");
                if in_flight {
                    m.detach_transfer(x);
                } else {
                    let t = &m.transfers[x];
                    let (host, tensor) = (t.host, t.tensor);
                    m.hosts[host].hold = Hold::Released;
                    m.tensors[tensor].live = false;
                }
                m.absorb(&obs, &[])?;
            }
            Op::ForgetTransfer(sel) => {
                let Some(i) = self.pick(sel, Xfer::in_flight) else {
                    return Ok(());
                };
                let (x, handle) = self.transfers.swap_remove(i);
                let ((), obs) = self.run(m, |_| std::mem::forget(handle));
                ensure!(
                    obs.delta.iter().all(|&n| n == 0),
                    "forgetting a transfer called the driver"
                );
                m.forget_transfer(x);
            }
            Op::Lease => self.lease(m)?,
            Op::Begin {
                lease,
                tensor,
                upload,
                offset,
                len,
                shape,
            } => self.begin(m, lease, tensor, upload, (offset, len, shape))?,
            Op::EndChunk(sel) => self.end_chunk(m, sel)?,
            Op::Release(sel) => {
                if self.proven.is_empty() {
                    return Ok(());
                }
                let (l, lease) = self.proven.swap_remove(sel % self.proven.len());
                let ((), obs) = self.run(m, |_| lease.release());
                ensure!(!obs.waited(), "releasing a lease waited");
                let host = m.leases[l].host;
                m.hosts[host].hold = Hold::Released;
                m.absorb(&obs, &[])?;
            }
            Op::Retire { lease, with_tensor } => {
                if self.unproven.is_empty() {
                    return Ok(());
                }
                let (l, unproven) = self.unproven.swap_remove(lease % self.unproven.len());
                let tensor = match with_tensor {
                    Some(sel) if !self.tensors.is_empty() => {
                        Some(self.tensors.swap_remove(sel % self.tensors.len()))
                    }
                    _ => None,
                };
                let id = tensor.as_ref().map(|t| t.0);
                let ((), obs) = self.run(m, |_| match tensor {
                    Some((_, t)) => unproven.retire_with(t),
                    None => unproven.retire(),
                });
                ensure!(!obs.waited(), "retiring a lease waited");
                m.detach_lease(l, id);
                m.absorb(&obs, &[])?;
            }
            Op::DropLease { lease, proven } => {
                if proven && !self.proven.is_empty() {
                    let (l, p) = self.proven.swap_remove(lease % self.proven.len());
                    let ((), obs) = self.run(m, |_| drop(p));
                    let host = m.leases[l].host;
                    m.hosts[host].hold = Hold::Released;
                    m.absorb(&obs, &[])?;
                } else if !proven && !self.unproven.is_empty() {
                    let (l, u) = self.unproven.swap_remove(lease % self.unproven.len());
                    let ((), obs) = self.run(m, |_| drop(u));
                    ensure!(!obs.waited(), "dropping an unproven lease waited");
                    m.detach_lease(l, None);
                    m.absorb(&obs, &[])?;
                }
            }
            Op::ForgetLease { lease, proven } => {
                let l = if proven && !self.proven.is_empty() {
                    let (l, p) = self.proven.swap_remove(lease % self.proven.len());
                    std::mem::forget(p);
                    l
                } else if !proven && !self.unproven.is_empty() {
                    let (l, u) = self.unproven.swap_remove(lease % self.unproven.len());
                    std::mem::forget(u);
                    l
                } else {
                    return Ok(());
                };
                m.forget_lease(l);
            }
            Op::Download { tensor, into } => self.download(m, tensor, into)?,
            Op::Advance(n) => {
                self.sim.advance(n);
            }
            Op::Flush => {
                let (result, obs) = self.run(m, |s| s.engine().flush());
                m.flush(&obs, &result)?;
            }
            Op::Synchronize => self.synchronize(m)?,
        }
        Ok(())
    }

    /// Index of a transfer matching `f`, chosen by `sel`.
    fn pick(&self, sel: usize, f: impl Fn(&Xfer) -> bool) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.transfers.len())
            .filter(|&i| f(&self.transfers[i].1))
            .collect();
        (!candidates.is_empty()).then(|| candidates[sel % candidates.len()])
    }

    fn new_buffer(&mut self, m: &mut Model, len: usize, from_slice: bool) -> Check {
        let words = pattern(m.salt(), len);
        let (result, obs) = self.run(m, |s| {
            if from_slice {
                PinnedHostBuffer::from_slice(s.engine(), &words)
            } else {
                PinnedHostBuffer::new(s.engine(), len)
            }
        });
        ensure!(!obs.waited(), "making a pinned buffer waited");
        match result {
            Ok(mut buffer) => {
                if !from_slice {
                    buffer.as_mut_slice().copy_from_slice(&words);
                }
                ensure!(
                    buffer.as_slice() == &words[..],
                    "from_slice copied wrong data"
                );
                let host = m.add_host(
                    addr(&buffer),
                    Mem::Block,
                    to_bytes(&words),
                    obs.completed_after,
                )?;
                self.buffers.push((host, buffer));
            }
            Err(e) => {
                ensure!(
                    obs.call(SimOp::HostAlloc).is_some() && explains(&obs.causes(), &e),
                    "a pinned buffer was refused with no pinned allocation failing: {e:?}"
                );
            }
        }
        m.absorb(&obs, &[Some(SimOp::HostAlloc)])
    }

    fn new_tensor(&mut self, m: &mut Model, len: usize) -> Check {
        let data = pattern(m.salt(), len);
        let (result, obs) = self.run(m, |s| upload_tensor(s.engine(), &data, &[len]));
        m.route(&obs, true, len * 4 <= 16, result.as_ref().err())?;
        m.absorb(&obs, ROUTE_CALLS)?;
        if let Ok(tensor) = result {
            let ptr = device_ptr(self.engine(), &tensor);
            ensure!(
                self.sim.peek(ptr, len * 4) == Some(to_bytes(&data)),
                "upload_tensor returned before its data arrived on the device"
            );
            let id = m.add_tensor(ptr, data);
            self.tensors.push((id, tensor));
        }
        Ok(())
    }

    fn download(&mut self, m: &mut Model, sel: usize, into: bool) -> Check {
        if self.tensors.is_empty() {
            return Ok(());
        }
        let i = sel % self.tensors.len();
        let id = self.tensors[i].0;
        // Stream order: the download sees every copy queued before it.
        let want = m.tensors[id].before(u64::MAX);
        let (result, obs) = self.run(m, |s| {
            let (engine, tensor) = (s.engine.as_mut().expect("open"), &s.tensors[i].1);
            if into {
                download_tensor_into(engine, tensor, vec![0xDEAD_BEEF_u32; 3]).map_err(Error::from)
            } else {
                download_tensor(engine, tensor)
            }
        });
        let scalar = m.tensors[id].len * 4 <= 16;
        m.route(&obs, false, scalar, result.as_ref().err())?;
        m.absorb(&obs, ROUTE_CALLS)?;
        if let Ok(got) = result {
            ensure!(got == want, "a blocking download returned wrong data");
        }
        Ok(())
    }

    fn submit(
        &mut self,
        m: &mut Model,
        upload: bool,
        buffer: usize,
        tensor: usize,
        mismatch: bool,
    ) -> Check {
        if self.buffers.is_empty() {
            return Ok(());
        }
        let bi = buffer % self.buffers.len();
        let len = m.hosts[self.buffers[bi].0].content.len() / 4;
        let candidates: Vec<usize> = (0..self.tensors.len())
            .filter(|&i| (m.tensors[self.tensors[i].0].len == len) != mismatch)
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let ti = candidates[tensor % candidates.len()];
        let (host, b) = self.buffers.swap_remove(bi);
        let (tid, t) = self.tensors.swap_remove(ti);
        let (result, obs) = self.run(m, |s| {
            let engine = s.engine();
            if upload {
                upload_pending(engine, b, t).map(Xfer::Up)
            } else {
                // A download's refusal hands back its input source first: put as an upload's.
                download_pending(engine, t, b)
                    .map(Xfer::Down)
                    .map_err(|e| e.map_input(|(t, b)| (b, t)))
            }
        });
        let sub = Submission {
            host,
            tensor: tid,
            upload,
            valid: !mismatch,
            resubmit: false,
        };
        self.settle_submission(m, result, &obs, sub)
    }

    fn resubmit(&mut self, m: &mut Model, sel: usize, refill: bool) -> Check {
        let Some(i) = self.pick(sel, |x| !x.in_flight()) else {
            return Ok(());
        };
        let (x, mut handle) = self.transfers.swap_remove(i);
        let (host, tensor, upload) = (
            m.transfers[x].host,
            m.transfers[x].tensor,
            m.transfers[x].upload,
        );
        if refill && let Xfer::UpBack(r) = &mut handle {
            let words = pattern(m.salt(), r.buffer().len());
            r.buffer_mut().as_mut_slice().copy_from_slice(&words);
            m.hosts[host].set(to_bytes(&words));
        }
        let (result, obs) = self.run(m, |s| {
            let engine = s.engine();
            match handle {
                Xfer::UpBack(r) => r.resubmit(engine).map(Xfer::Up),
                Xfer::DownBack(r) => r
                    .resubmit(engine)
                    .map(Xfer::Down)
                    .map_err(|e| e.map_input(|(t, b)| (b, t))),
                _ => unreachable!("picked a returned transfer"),
            }
        });
        let sub = Submission {
            host,
            tensor,
            upload,
            valid: true,
            resubmit: true,
        };
        self.settle_submission(m, result, &obs, sub)
    }

    /// Checks a submission's outcome against the rules and records it.
    fn settle_submission(
        &mut self,
        m: &mut Model,
        result: Result<Xfer, TransferRefused>,
        obs: &Obs,
        sub: Submission,
    ) -> Check {
        let copy_op = if sub.upload {
            SimOp::CopyHtoD
        } else {
            SimOp::CopyDtoH
        };
        if obs.fired.len() >= 2 {
            seen(Seen::TwoFaultsInOneTransfer);
        }
        let expect = expect_submission(obs, copy_op, sub.valid);
        let at = obs.next;
        let len = m.tensors[sub.tensor].len;
        match (expect, result) {
            (Expect::InFlight { faulty }, Ok(handle)) => {
                seen(if faulty {
                    Seen::SubmitFailingEvent
                } else {
                    Seen::SubmitInFlight
                });
                if sub.resubmit {
                    seen(Seen::Resubmitted);
                }
                ensure!(handle.in_flight(), "a submission came back returned");
                ensure!(!obs.waited(), "a submission waited for the device");
                m.hosts[sub.host].hold = Hold::Lent { copy: at, faulty };
                if sub.upload {
                    m.write(sub.tensor, at, 0, sub.host, len);
                }
                m.transfers.push(Transfer {
                    upload: sub.upload,
                    host: sub.host,
                    tensor: sub.tensor,
                    copy: at,
                    faulty,
                });
                self.transfers.push((m.transfers.len() - 1, handle));
            }
            (
                Expect::Refused,
                Err(SubmitError::Rejected {
                    input: package,
                    error,
                }),
            ) => {
                seen(Seen::SubmitRejected);
                ensure!(
                    matches!(error, Error::Usage(UsageError::LengthMismatch { .. })),
                    "a mismatched pair was rejected for another reason: {error:?}"
                );
                ensure!(obs.queued_nothing(), "a rejected submission queued work");
                self.take_back(m, sub, package.0, package.1)?;
            }
            (
                Expect::NotQueued(cause),
                Err(SubmitError::Failed {
                    input: package,
                    error,
                }),
            ) => {
                seen(Seen::SubmitNotQueued);
                ensure!(
                    explains(&[cause], &error),
                    "a refused copy failed the submission with {error:?}, not {cause:?}"
                );
                ensure!(obs.queued_nothing(), "a refused copy left work queued");
                self.take_back(m, sub, package.0, package.1)?;
            }
            (
                Expect::Proven(cause),
                Err(SubmitError::Failed {
                    input: package,
                    error,
                }),
            ) => {
                seen(Seen::SubmitProvenByStreamWait);
                ensure!(
                    explains(&[cause], &error),
                    "an unrecorded event failed the submission with {error:?}, not {cause:?}"
                );
                ensure!(
                    obs.completed_after > at,
                    "a package came back before the device ran the copy queued on it"
                );
                if sub.upload {
                    m.write(sub.tensor, at, 0, sub.host, len);
                } else {
                    let data = m.tensors[sub.tensor].before(at);
                    m.hosts[sub.host].set(to_bytes(&data));
                }
                self.take_back(m, sub, package.0, package.1)?;
            }
            (Expect::Untracked(cause), Err(SubmitError::Retained { error })) => {
                seen(Seen::SubmitUntracked);
                ensure!(
                    explains(&[cause], &error),
                    "an untracked submission reported {error:?}, not {cause:?}"
                );
                m.retain_transfer(sub.host, sub.tensor);
            }
            (expect, result) => {
                return Err(TestCaseError::fail(format!(
                    "submission {sub:?}: the rules expect {expect:?} (faults {:?}), the engine gave {result:?}",
                    obs.fired
                )));
            }
        }
        let mut handled = vec![
            Some(copy_op),
            Some(SimOp::EventRecord),
            Some(SimOp::StreamSynchronize),
            None,
        ];
        if !sub.resubmit {
            // A resubmission reuses its own event: it never creates one.
            handled.push(Some(SimOp::EventCreate));
        }
        m.absorb(obs, &handled)
    }

    /// A package that came back: the same buffer with the contents the model expects, and the
    /// same tensor.
    fn take_back(
        &mut self,
        m: &Model,
        sub: Submission,
        buffer: PinnedHostBuffer<u32>,
        tensor: DeviceTensor<u32>,
    ) -> Check {
        let host = &m.hosts[sub.host];
        ensure!(
            addr(&buffer) == host.addr,
            "a package came back with another buffer"
        );
        ensure!(
            buffer.as_slice() == &host.words[..],
            "a package came back with other contents in its buffer"
        );
        let ptr = device_ptr(self.engine(), &tensor);
        ensure!(
            ptr == m.tensors[sub.tensor].ptr,
            "a package came back with another tensor"
        );
        self.buffers.push((sub.host, buffer));
        self.tensors.push((sub.tensor, tensor));
        Ok(())
    }

    /// A transfer that returned: its buffer now holds what the copy carried.
    fn returned(&mut self, m: &mut Model, x: usize, handle: Xfer) -> Check {
        let t = &m.transfers[x];
        let (host, tensor, upload, copy) = (t.host, t.tensor, t.upload, t.copy);
        if !upload {
            let data = to_bytes(&m.tensors[tensor].before(copy));
            m.hosts[host].set(data);
        }
        m.hosts[host].hold = Hold::Held;
        let buffer = handle.returned_buffer().expect("a returned transfer");
        ensure!(
            addr(buffer) == m.hosts[host].addr,
            "a transfer returned another buffer"
        );
        ensure!(
            buffer.as_slice() == &m.hosts[host].words[..],
            "a returned {} holds wrong data",
            if upload { "upload" } else { "download" }
        );
        self.transfers.push((x, handle));
        Ok(())
    }

    fn is_ready(&mut self, m: &mut Model, sel: usize) -> Check {
        let Some(i) = self.pick(sel, Xfer::in_flight) else {
            return Ok(());
        };
        let x = self.transfers[i].0;
        let (result, obs) = self.run(m, |s| s.transfers[i].1.is_ready());
        ensure!(!obs.waited(), "is_ready waited for the device");
        let t = &m.transfers[x];
        match (obs.call(SimOp::EventQuery), result) {
            (Some(f), Err(e)) => ensure!(
                explains(&[(f.op, f.code)], &e),
                "is_ready reported {e:?} for a failed query {f:?}"
            ),
            (Some(f), Ok(r)) => {
                return Err(TestCaseError::fail(format!(
                    "is_ready answered {r} although its query failed ({f:?})"
                )));
            }
            (None, result) => {
                let verdict = match &result {
                    Ok(true) => Verdict::Ready,
                    Ok(false) => Verdict::NotReady,
                    Err(Error::DeviceFault { source, .. })
                        if *source == DriverError::LAUNCH_FAILED =>
                    {
                        Verdict::Failed
                    }
                    Err(e) => {
                        return Err(TestCaseError::fail(format!(
                            "is_ready failed untyped: {e:?}"
                        )));
                    }
                };
                ensure!(
                    verdict_allowed(t.copy, t.faulty, obs.completed_after, verdict),
                    "is_ready answered {verdict:?} for a copy at {} (failing event: {}) with the device at {}",
                    t.copy,
                    t.faulty,
                    obs.completed_after
                );
            }
        }
        m.absorb(&obs, &[Some(SimOp::EventQuery)])
    }

    fn try_wait(&mut self, m: &mut Model, sel: usize) -> Check {
        let Some(i) = self.pick(sel, Xfer::in_flight) else {
            return Ok(());
        };
        let (x, handle) = self.transfers.swap_remove(i);
        let (result, obs) = self.run(m, |_| handle.try_wait());
        ensure!(!obs.waited(), "try_wait waited for the device");
        let (copy, faulty) = (m.transfers[x].copy, m.transfers[x].faulty);
        match (obs.call(SimOp::EventQuery), result) {
            (Some(f), Err(e)) => {
                ensure!(
                    explains(&[(f.op, f.code)], &e),
                    "try_wait reported {e:?} for a failed query {f:?}"
                );
                // A failed wait retains the transfer: nothing proved the copy complete.
                let (host, tensor) = (m.transfers[x].host, m.transfers[x].tensor);
                m.retain_transfer(host, tensor);
            }
            (Some(f), Ok(h)) => {
                return Err(TestCaseError::fail(format!(
                    "try_wait answered {h:?} although its query failed ({f:?})"
                )));
            }
            (None, Err(e)) => {
                ensure!(
                    matches!(e, Error::DeviceFault { source, .. } if source == DriverError::LAUNCH_FAILED)
                        && verdict_allowed(copy, faulty, obs.completed_after, Verdict::Failed),
                    "try_wait failed with {e:?} for a copy at {copy} (failing event: {faulty}), device at {}",
                    obs.completed_after
                );
                let (host, tensor) = (m.transfers[x].host, m.transfers[x].tensor);
                m.retain_transfer(host, tensor);
            }
            (None, Ok(handle)) => {
                let verdict = if handle.in_flight() {
                    Verdict::NotReady
                } else {
                    Verdict::Ready
                };
                ensure!(
                    verdict_allowed(copy, faulty, obs.completed_after, verdict),
                    "try_wait answered {verdict:?} for a copy at {copy} (failing event: {faulty}), device at {}",
                    obs.completed_after
                );
                if handle.in_flight() {
                    self.transfers.push((x, handle));
                } else {
                    seen(Seen::ReturnedByTryWait);
                    self.returned(m, x, handle)?;
                }
            }
        }
        m.absorb(&obs, &[Some(SimOp::EventQuery)])
    }

    fn wait(&mut self, m: &mut Model, sel: usize) -> Check {
        let Some(i) = self.pick(sel, Xfer::in_flight) else {
            return Ok(());
        };
        let (x, handle) = self.transfers.swap_remove(i);
        let (result, obs) = self.run(m, |_| handle.wait());
        let (copy, faulty) = (m.transfers[x].copy, m.transfers[x].faulty);
        let sync = obs.call(SimOp::EventSynchronize);
        match result {
            Ok(handle) => {
                ensure!(
                    sync.is_none() && !faulty,
                    "wait returned although its wait failed ({sync:?}) or its event fails ({faulty})"
                );
                ensure!(
                    obs.completed_after > copy,
                    "wait returned before the device ran the copy"
                );
                seen(Seen::ReturnedByWait);
                self.returned(m, x, handle)?;
            }
            Err(e) => {
                let mut causes: Vec<Cause> = sync.iter().map(|f| (f.op, f.code)).collect();
                if faulty {
                    causes.push((None, DriverError::LAUNCH_FAILED));
                }
                ensure!(
                    explains(&causes, &e),
                    "wait failed with {e:?}, explained by none of {causes:?}"
                );
                seen(Seen::ProofFailed);
                let (host, tensor) = (m.transfers[x].host, m.transfers[x].tensor);
                m.retain_transfer(host, tensor);
            }
        }
        m.absorb(&obs, &[Some(SimOp::EventSynchronize)])
    }

    fn lease(&mut self, m: &mut Model) -> Check {
        let held = self.proven.len() + self.unproven.len();
        let (lo, hi) = m.leases_out(held, self.sim.completed());
        let (result, obs) = self.run(m, |s| s.engine().staging_lease());
        ensure!(!obs.waited(), "taking a lease waited");
        match result {
            Ok(mut lease) => {
                ensure!(
                    lo < m.depth,
                    "a lease was handed out with {lo} of {} caller leases out",
                    m.depth
                );
                let salt = m.salt();
                let bytes: Vec<u8> = (0..lease.capacity())
                    .map(|i| (salt as usize * 131 + i * 7 + 1) as u8)
                    .collect();
                lease.as_mut_bytes().copy_from_slice(&bytes);
                let a = lease.as_bytes().as_ptr() as usize;
                let host = m.add_host(a, Mem::Slot, bytes, obs.completed_after)?;
                m.leases.push(Lease { host, chunk: None });
                self.proven.push((m.leases.len() - 1, lease));
            }
            Err(Error::Staging(StagingError::Exhausted { depth })) => {
                seen(Seen::LeasesExhausted);
                if m.retained_leases > 0 {
                    seen(Seen::ExhaustedByRetainedLease);
                }
                ensure!(
                    depth == m.depth && hi >= depth,
                    "staging_lease refused with at most {hi} of {depth} caller leases out"
                );
            }
            Err(e) => ensure!(
                obs.call(SimOp::HostAlloc).is_some() && explains(&obs.causes(), &e),
                "staging_lease failed with no pinned allocation failing: {e:?}"
            ),
        }
        m.absorb(&obs, &[Some(SimOp::HostAlloc)])
    }

    fn begin(
        &mut self,
        m: &mut Model,
        lease: usize,
        tensor: usize,
        upload: bool,
        (offset, len, shape): (usize, usize, ChunkShape),
    ) -> Check {
        if self.proven.is_empty() || self.tensors.is_empty() {
            return Ok(());
        }
        let (l, proven) = self.proven.swap_remove(lease % self.proven.len());
        let ti = tensor % self.tensors.len();
        let tid = self.tensors[ti].0;
        let tlen = m.tensors[tid].len;
        let (offset, len) = match shape {
            ChunkShape::Valid => {
                let offset = offset % tlen;
                (offset, 1 + len % SLOT_ELEMS.min(tlen - offset))
            }
            ChunkShape::Empty => (0, 0),
            ChunkShape::OutOfRange => (tlen, 1),
            ChunkShape::TooLong if tlen > SLOT_ELEMS => (0, SLOT_ELEMS + 1),
            ChunkShape::TooLong => (0, tlen + 1),
        };
        let valid = matches!(shape, ChunkShape::Valid);
        let (result, obs) = self.run(m, |s| {
            let Sut {
                engine, tensors, ..
            } = s;
            let (engine, t) = (engine.as_mut().expect("open"), &mut tensors[ti].1);
            if upload {
                proven.begin_upload(engine, t, offset, len)
            } else {
                proven.begin_download(engine, t, offset, len)
            }
        });
        let copy_op = if upload {
            SimOp::CopyHtoD
        } else {
            SimOp::CopyDtoH
        };
        if obs.fired.len() >= 2 {
            seen(Seen::TwoFaultsInOneTransfer);
        }
        let expect = expect_submission(&obs, copy_op, valid);
        let at = obs.next;
        let host = m.leases[l].host;
        match (expect, result) {
            (Expect::InFlight { faulty }, Ok(unproven)) => {
                seen(Seen::ChunkInFlight);
                ensure!(!obs.waited(), "beginning a chunk waited");
                m.hosts[host].hold = Hold::Lent { copy: at, faulty };
                let arrives = if upload {
                    m.write(tid, at, offset, host, len);
                    None
                } else {
                    let data = m.tensors[tid].before(at);
                    Some(to_bytes(&data[offset..offset + len]))
                };
                m.leases[l].chunk = Some(Chunk {
                    copy: at,
                    faulty,
                    arrives,
                });
                self.unproven.push((l, unproven));
            }
            (
                Expect::Refused,
                Err(SubmitError::Rejected {
                    input: lease,
                    error,
                }),
            ) => {
                ensure!(
                    matches!(
                        (shape, &error),
                        (
                            ChunkShape::Empty,
                            Error::Usage(UsageError::ZeroLength { .. })
                        ) | (
                            ChunkShape::OutOfRange | ChunkShape::TooLong,
                            Error::Staging(
                                StagingError::ChunkOutOfRange { .. }
                                    | StagingError::ChunkTooLarge { .. }
                            )
                        )
                    ),
                    "a {shape:?} chunk was refused with {error:?}"
                );
                ensure!(obs.queued_nothing(), "a refused chunk queued work");
                self.lease_back(m, l, lease)?;
            }
            (
                Expect::NotQueued(cause),
                Err(SubmitError::Failed {
                    input: lease,
                    error,
                }),
            ) => {
                seen(Seen::ChunkNotQueued);
                ensure!(
                    explains(&[cause], &error),
                    "a refused copy failed the chunk with {error:?}, not {cause:?}"
                );
                ensure!(
                    obs.queued_nothing(),
                    "a refused chunk copy left work queued"
                );
                self.lease_back(m, l, lease)?;
            }
            (
                Expect::Proven(cause),
                Err(SubmitError::Failed {
                    input: lease,
                    error,
                }),
            ) => {
                ensure!(
                    explains(&[cause], &error),
                    "an unrecorded chunk event failed the chunk with {error:?}, not {cause:?}"
                );
                ensure!(
                    obs.completed_after > at,
                    "a lease came back proven before the device ran its chunk"
                );
                if upload {
                    m.write(tid, at, offset, host, len);
                } else {
                    let data = m.tensors[tid].before(at);
                    m.hosts[host].patch(0, &to_bytes(&data[offset..offset + len]));
                }
                self.lease_back(m, l, lease)?;
            }
            (Expect::Untracked(cause), Err(SubmitError::Retained { error })) => {
                seen(Seen::ChunkUntracked);
                ensure!(
                    explains(&[cause], &error),
                    "an untracked chunk reported {error:?}, not {cause:?}"
                );
                if upload {
                    m.write(tid, at, offset, host, len);
                }
                // Retained by the engine at once: nothing comes back to reach the slot.
                m.retain_lease(l, None);
            }
            (expect, result) => {
                return Err(TestCaseError::fail(format!(
                    "chunk ({}, {offset}+{len} of {tlen}): the rules expect {expect:?} (faults {:?}), \
                     the engine gave {result:?}",
                    if upload { "upload" } else { "download" },
                    obs.fired
                )));
            }
        }
        m.absorb(
            &obs,
            &[
                Some(copy_op),
                Some(SimOp::EventCreate),
                Some(SimOp::EventRecord),
                Some(SimOp::StreamSynchronize),
                None,
            ],
        )
    }

    /// A lease handed back proven after a failed begin: the same slot, with what it holds.
    fn lease_back(&mut self, m: &mut Model, l: usize, lease: StagingLease<Proven>) -> Check {
        let host = &m.hosts[m.leases[l].host];
        ensure!(
            lease.as_bytes().as_ptr() as usize == host.addr,
            "a lease came back with another slot"
        );
        ensure!(
            lease.as_bytes() == &host.content[..],
            "a lease came back with other contents"
        );
        m.leases[l].chunk = None;
        self.proven.push((l, lease));
        Ok(())
    }

    fn end_chunk(&mut self, m: &mut Model, sel: usize) -> Check {
        if self.unproven.is_empty() {
            return Ok(());
        }
        let (l, unproven) = self.unproven.swap_remove(sel % self.unproven.len());
        let (result, obs) = self.run(m, |_| unproven.end_chunk());
        let chunk = m.leases[l]
            .chunk
            .take()
            .expect("an unproven lease has a chunk");
        let sync = obs.call(SimOp::EventSynchronize);
        let host = m.leases[l].host;
        match result {
            Ok(proven) => {
                seen(Seen::ChunkProven);
                ensure!(
                    sync.is_none() && !chunk.faulty,
                    "end_chunk proved a chunk whose wait failed ({sync:?}) or whose event fails ({})",
                    chunk.faulty
                );
                ensure!(
                    obs.completed_after > chunk.copy,
                    "end_chunk proved a chunk the device has not run"
                );
                if let Some(bytes) = &chunk.arrives {
                    m.hosts[host].patch(0, bytes);
                }
                m.hosts[host].hold = Hold::Held;
                ensure!(
                    proven.as_bytes() == &m.hosts[host].content[..],
                    "a proven lease holds wrong data"
                );
                self.proven.push((l, proven));
            }
            Err(e) => {
                let mut causes: Vec<Cause> = sync.iter().map(|f| (f.op, f.code)).collect();
                if chunk.faulty {
                    causes.push((None, DriverError::LAUNCH_FAILED));
                }
                ensure!(
                    explains(&causes, &e),
                    "end_chunk failed with {e:?}, explained by none of {causes:?}"
                );
                seen(Seen::ProofFailed);
                m.leases[l].chunk = Some(chunk);
                m.retain_lease(l, None);
            }
        }
        m.absorb(&obs, &[Some(SimOp::EventSynchronize)])
    }

    fn synchronize(&mut self, m: &mut Model) -> Check {
        let (result, obs) = self.run(m, |s| s.engine().synchronize());
        if m.synchronize(&obs, &result)? {
            self.check_settled(m)?;
        }
        Ok(())
    }

    /// Rule 2: after a settling synchronize nothing waits, and what is retained is exactly what
    /// the model says could not be proven.
    fn check_settled(&mut self, m: &Model) -> Check {
        let engine = self.engine();
        let stats = engine.retirement_stats();
        ensure!(
            stats.pending == 0,
            "{} record(s) still wait after synchronize",
            stats.pending
        );
        ensure!(
            stats.retained == m.retained,
            "the engine retains {} transfer(s)/chunk(s); the rules say {}",
            stats.retained,
            m.retained
        );
        let staging = engine.staging_stats();
        ensure!(
            staging.leased - staging.user_leased == m.route_retained,
            "{} route slot(s) out of the ring after synchronize; the rules say {} (retained)",
            staging.leased - staging.user_leased,
            m.route_retained
        );
        let pool = engine.pinned_pool_stats();
        ensure!(
            pool.leased_blocks == m.blocks_out(),
            "{} pinned block(s) out of the pool; the rules say {} (held, lent, retained or forgotten)",
            pool.leased_blocks,
            m.blocks_out()
        );
        Ok(())
    }

    /// Rule 1 and the data, after every step.
    fn check(&mut self, m: &mut Model) -> Check {
        let violations = self.sim.violations();
        ensure!(
            violations.is_empty(),
            "the device saw violations: {violations:?}"
        );
        let completed = self.sim.completed();
        // A step that gave blocks back and had a pinned free refused, leaving no idle block in
        // the pool: each of those blocks was freed or refused a free, and one still pinned is
        // refused, never to be handed out again.
        let refused = std::mem::take(&mut m.refused_pinned_in_step) > 0;
        if refused && self.engine().pinned_pool_stats().idle_blocks == 0 {
            for i in 0..m.hosts.len() {
                let h = &m.hosts[i];
                if h.mem == Mem::Block
                    && h.hold == Hold::Released
                    && !m.released_before.contains(&i)
                    && self.sim.is_pinned_live(h.addr as *const u8)
                {
                    seen(Seen::RefusedBlockKept);
                    m.hosts[i].hold = Hold::Refused;
                }
            }
        }
        m.released_before = (0..m.hosts.len())
            .filter(|&i| m.hosts[i].hold == Hold::Released)
            .collect();
        for h in &m.hosts {
            if h.busy(completed) {
                ensure!(
                    self.sim.is_pinned_live(h.addr as *const u8),
                    "pinned memory {:#x} ({:?}, {:?}) was freed",
                    h.addr,
                    h.mem,
                    h.hold
                );
            }
        }
        for (host, buffer) in &self.buffers {
            ensure!(
                buffer.as_slice() == &m.hosts[*host].words[..],
                "an idle pinned buffer changed under the test"
            );
        }
        for (x, handle) in &self.transfers {
            if let Some(buffer) = handle.returned_buffer() {
                ensure!(
                    buffer.as_slice() == &m.hosts[m.transfers[*x].host].words[..],
                    "a returned transfer's buffer changed under the test"
                );
            }
        }
        for (l, lease) in &self.proven {
            ensure!(
                lease.as_bytes() == &m.hosts[m.leases[*l].host].content[..],
                "a proven lease's slot changed under the test"
            );
        }
        for t in m.tensors.iter_mut().filter(|t| t.live) {
            let got = self.sim.peek(t.ptr, t.len * 4);
            ensure!(
                got.as_deref() == Some(t.current(completed)),
                "tensor {:#x} does not hold what the copies the device ran put there",
                t.ptr
            );
        }
        let (lo, hi) = m.leases_out(self.proven.len() + self.unproven.len(), completed);
        let out = self.engine().staging_stats().user_leased;
        ensure!(
            lo <= out && out <= hi,
            "{out} caller lease(s) out; the rules say between {lo} and {hi}"
        );
        Ok(())
    }

    /// A quiet synchronize: no faults, the device run dry, everything settled and checked.
    fn quiesce(&mut self, m: &mut Model) -> Check {
        m.disarm(&self.sim);
        self.sim.advance_all();
        let (result, obs) = self.run(m, |s| s.engine().synchronize());
        ensure!(
            m.synchronize(&obs, &result)?,
            "a quiet synchronize did not settle"
        );
        if result.is_err() {
            let (again, obs) = self.run(m, |s| s.engine().synchronize());
            ensure!(again.is_ok(), "a failure was reported twice: {again:?}");
            m.synchronize(&obs, &again)?;
        }
        self.check_settled(m)?;
        // Released tensors' frees are queued: let them run.
        self.sim.advance_all();
        let live = m.tensors.iter().filter(|t| t.live).count();
        let (device, _) = self.sim.device_live();
        ensure!(
            live + m.device_kept <= device && device <= live + m.device_kept + m.device_maybe,
            "{device} device allocation(s) live; the rules say {live} held + {} kept (+ up to {} \
             kept by failed uploads)",
            m.device_kept,
            m.device_maybe
        );
        self.check(m)
    }

    /// Drops one value the test holds (before or after the engine), by the rules of its kind.
    fn drop_one(&mut self, m: &mut Model, torn_down: bool) -> Check {
        if let Some((host, buffer)) = self.buffers.pop() {
            let ((), obs) = self.run(m, |_| drop(buffer));
            m.hosts[host].hold = Hold::Released;
            return m.absorb(&obs, &[]);
        }
        if let Some((tensor, t)) = self.tensors.pop() {
            let ((), obs) = self.run(m, |_| drop(t));
            m.tensors[tensor].live = false;
            return m.absorb(&obs, &[]);
        }
        if let Some((l, lease)) = self.proven.pop() {
            let ((), obs) = self.run(m, |_| drop(lease));
            let host = m.leases[l].host;
            m.hosts[host].hold = Hold::Released;
            return m.absorb(&obs, &[]);
        }
        if let Some((x, handle)) = self.transfers.pop() {
            let in_flight = handle.in_flight();
            if in_flight && torn_down {
                seen(Seen::DroppedInFlightAfterTeardown);
            }
            let ((), obs) = self.run(m, |_| drop(handle));
            let t = &m.transfers[x];
            let (host, tensor, faulty) = (t.host, t.tensor, t.faulty);
            if !in_flight {
                m.hosts[host].hold = Hold::Released;
                m.tensors[tensor].live = false;
            } else if !torn_down {
                m.detach_transfer(x);
            } else if faulty || obs.call(SimOp::EventSynchronize).is_some() {
                // After the engine, a drop proves the copy itself, or keeps everything.
                m.hosts[host].hold = Hold::Leaked;
                m.tensors[tensor].live = false;
                m.pinned_kept += 1;
                m.device_kept += 1;
            } else {
                m.hosts[host].hold = Hold::Released;
                m.tensors[tensor].live = false;
            }
            return m.absorb(&obs, &[Some(SimOp::EventSynchronize)]);
        }
        if let Some((l, lease)) = self.unproven.pop() {
            let ((), obs) = self.run(m, |_| drop(lease));
            let faulty = m.leases[l].chunk.as_ref().is_some_and(|c| c.faulty);
            if !torn_down {
                m.detach_lease(l, None);
            } else if faulty || obs.call(SimOp::EventSynchronize).is_some() {
                let host = m.leases[l].host;
                m.hosts[host].hold = Hold::Leaked;
                m.pinned_kept += 1;
            } else {
                let host = m.leases[l].host;
                m.hosts[host].hold = Hold::Released;
            }
            return m.absorb(&obs, &[Some(SimOp::EventSynchronize)]);
        }
        Ok(())
    }

    fn held(&self) -> usize {
        self.buffers.len()
            + self.tensors.len()
            + self.proven.len()
            + self.transfers.len()
            + self.unproven.len()
    }

    /// Rule 4: teardown with faults armed, some values dropped before the engine and some after.
    fn teardown(&mut self, m: &mut Model, faults: &[Fault], after: u64) -> Check {
        m.inject(&self.sim, faults);
        // Values are dropped in a fixed order; those whose bit is clear go before the engine.
        let mut kept = Sut {
            engine: None,
            sim: self.sim.clone(),
            buffers: Vec::new(),
            tensors: Vec::new(),
            transfers: Vec::new(),
            proven: Vec::new(),
            unproven: Vec::new(),
        };
        let mut bit = 0;
        while self.held() > 0 {
            let later = after >> (bit % 64) & 1 == 1;
            bit += 1;
            if later {
                // Move the next value (in drop order) to the after-teardown set.
                match self.buffers.pop() {
                    Some(v) => {
                        kept.buffers.push(v);
                    }
                    _ => match self.tensors.pop() {
                        Some(v) => {
                            kept.tensors.push(v);
                        }
                        _ => match self.proven.pop() {
                            Some(v) => {
                                kept.proven.push(v);
                            }
                            _ => match self.transfers.pop() {
                                Some(v) => {
                                    kept.transfers.push(v);
                                }
                                _ => {
                                    if let Some(v) = self.unproven.pop() {
                                        kept.unproven.push(v);
                                    }
                                }
                            },
                        },
                    },
                }
            } else {
                self.drop_one(m, false)?;
            }
        }
        let engine = self.engine.take().expect("the engine is open");
        let ((), obs) = self.run(m, |_| drop(engine));
        let final_wait = obs.call(SimOp::StreamSynchronize).is_none();
        if !final_wait {
            seen(Seen::TeardownWaitFailed);
        }
        m.absorb(&obs, &[Some(SimOp::StreamSynchronize)])?;
        while kept.held() > 0 {
            kept.drop_one(m, true)?;
        }
        self.sim.advance_all();
        let violations = self.sim.violations();
        ensure!(
            violations.is_empty(),
            "the device saw violations: {violations:?}"
        );
        let completed = self.sim.completed();
        for h in m.hosts.iter().filter(|h| h.busy(completed)) {
            ensure!(
                self.sim.is_pinned_live(h.addr as *const u8),
                "pinned memory {:#x} ({:?}, {:?}) was freed at teardown",
                h.addr,
                h.mem,
                h.hold
            );
        }
        if final_wait {
            let (pinned, _) = self.sim.pinned_live();
            ensure!(
                pinned == m.pinned_kept,
                "{pinned} pinned allocation(s) outlive the engine; the rules say {} (retained, \
                 forgotten, or refused a free)",
                m.pinned_kept
            );
            let (device, _) = self.sim.device_live();
            ensure!(
                m.device_kept <= device && device <= m.device_kept + m.device_maybe,
                "{device} device allocation(s) outlive the engine; the rules say {} (+ up to {})",
                m.device_kept,
                m.device_maybe
            );
        }
        Ok(())
    }
}

/// The calls a blocking route's rules speak of.
const ROUTE_CALLS: &[Option<SimOp>] = &[
    Some(SimOp::CopyHtoD),
    Some(SimOp::CopyDtoH),
    Some(SimOp::EventCreate),
    Some(SimOp::EventRecord),
    Some(SimOp::EventSynchronize),
    Some(SimOp::StreamSynchronize),
    Some(SimOp::HostAlloc),
    Some(SimOp::Alloc),
    None,
];

/// Cases per run: about ten seconds of one core in a debug build. `PROPTEST_CASES` overrides
/// it for a longer soak.
const CASES: u32 = 1024;

fn run_case(case: &Case) -> Check {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().expect("a simulated engine");
    let mut config = StagingConfig::default();
    config.chunk_bytes = CHUNK_BYTES;
    config.cutoff_bytes = CUTOFF_BYTES;
    config.ring_depth = case.ring_depth;
    config.copy_threads = case.copy_threads;
    engine
        .set_staging_config(config)
        .map_err(|e| TestCaseError::fail(format!("staging config: {e}")))?;
    if case.pool_budget_zero {
        engine
            .set_pinned_pool_budget(0)
            .map_err(|e| TestCaseError::fail(format!("pool budget: {e}")))?;
    }
    let mut m = Model::new(case.ring_depth);
    let mut sut = Sut {
        engine: Some(engine),
        sim,
        buffers: Vec::new(),
        tensors: Vec::new(),
        transfers: Vec::new(),
        proven: Vec::new(),
        unproven: Vec::new(),
    };
    let context = |what: String| {
        move |e: TestCaseError| match e {
            TestCaseError::Fail(reason) => {
                TestCaseError::fail(format!("{what}: {}", reason.message()))
            }
            other => other,
        }
    };
    for (i, op) in case.setup.iter().enumerate() {
        sut.step(&mut m, op)
            .and_then(|()| sut.check(&mut m))
            .map_err(context(format!("setup {i} ({op:?})")))?;
    }
    for (i, step) in case.steps.iter().enumerate() {
        m.inject(&sut.sim, &step.faults);
        sut.step(&mut m, &step.op)
            .and_then(|()| sut.check(&mut m))
            .map_err(context(format!(
                "step {i} ({:?}, faults {:?})",
                step.op, step.faults
            )))?;
    }
    sut.quiesce(&mut m)
        .map_err(context("the quiet synchronize".into()))?;
    sut.teardown(&mut m, &case.teardown_faults, case.drop_after_teardown)
        .map_err(context(format!(
            "teardown (faults {:?})",
            case.teardown_faults
        )))
}

#[test]
fn every_route_keeps_the_rules_under_injected_faults() {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES);
    let mut runner = TestRunner::new(Config {
        cases,
        source_file: Some(file!()),
        ..Config::default()
    });
    if let Err(failure) = runner.run(&case(), |case| run_case(&case)) {
        panic!("{failure}");
    }
    if cases >= CASES {
        let missed: Vec<Seen> = ALL_SEEN
            .into_iter()
            .filter(|&s| COVERAGE[s as usize].load(Ordering::Relaxed) == 0)
            .collect();
        assert!(
            missed.is_empty(),
            "{cases} cases never reached these outcomes, so the model could not check them: {missed:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The rules the model once found broken, each in its smallest case.
// ---------------------------------------------------------------------------------------------

/// A staging configuration with the model's small chunks and `ring_depth` slots.
fn small_staging(engine: &mut CudaEngine, ring_depth: usize) {
    let mut config = StagingConfig::default();
    config.chunk_bytes = CHUNK_BYTES;
    config.cutoff_bytes = CUTOFF_BYTES;
    config.ring_depth = ring_depth;
    engine.set_staging_config(config).unwrap();
}

/// Whether `result` is one deferred failure of `call` with `code`.
fn one_deferred(result: &Result<(), Error>, call: &str, code: DriverError) -> bool {
    let Err(Error::Deferred { count: 1, first }) = result else {
        return false;
    };
    matches!(&**first, Error::Driver { call: c, source } if *c == call && *source == code)
}

/// Rule 3: a refused free is reported at the next boundary, once. A refused `cuMemFreeHost`
/// keeps its memory pinned, is counted among the pool's refused frees (not its frees), and the
/// memory is never handed out again.
#[test]
fn a_refused_pinned_free_is_reported_at_the_next_boundary() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().expect("a simulated engine");
    engine.set_pinned_pool_budget(0).unwrap(); // a released buffer is freed at once
    let buffer = PinnedHostBuffer::<u32>::new(&mut engine, 16).unwrap();
    let refused = addr(&buffer);
    sim.fail_nth(SimOp::HostFree, 1, DriverError::INVALID_VALUE);
    drop(buffer);
    assert_eq!(sim.pinned_live().0, 1, "the refused free kept the memory");
    let stats = engine.pinned_pool_stats();
    assert_eq!(
        (stats.frees, stats.refused_frees),
        (0, 1),
        "a refused free is counted as refused, not freed"
    );
    let first = engine.flush();
    assert!(
        one_deferred(&first, "cuMemFreeHost", DriverError::INVALID_VALUE),
        "the refused cuMemFreeHost is reported at the next boundary: {first:?}"
    );
    assert!(engine.flush().is_ok(), "a failure is reported once");
    let again = PinnedHostBuffer::<u32>::new(&mut engine, 16).unwrap();
    assert_ne!(
        addr(&again),
        refused,
        "memory whose free was refused was handed out again"
    );
    assert_eq!(sim.pinned_live().0, 2);
}

/// Rule 3: a boundary reports the failures recorded since the last one. When the stream wait of
/// `synchronize` fails, it reports the wait, and the failures recorded before it stay for the
/// next boundary.
#[test]
fn a_failed_stream_wait_does_not_drop_earlier_failures() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().expect("a simulated engine");
    let tensor = upload_tensor(&mut engine, &[1u32, 2], &[2]).unwrap();
    sim.fail_nth(SimOp::Free, 1, DriverError::INVALID_VALUE);
    drop(tensor); // the refused free waits for the next boundary
    sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::UNKNOWN);
    let first = engine.synchronize();
    assert!(
        matches!(first, Err(Error::DeviceFault { source, .. }) if source == DriverError::UNKNOWN),
        "the failed wait is reported: {first:?}"
    );
    let second = engine.synchronize();
    assert!(
        one_deferred(&second, "cuMemFreeAsync", DriverError::INVALID_VALUE),
        "the refused cuMemFreeAsync recorded before the failed wait is reported next: {second:?}"
    );
    assert!(engine.synchronize().is_ok(), "a failure is reported once");
}

/// Rule 3: a boundary that releases retired work reports the refused frees of those releases
/// itself, not one boundary later: `flush` once the device ran the work, `synchronize` after
/// its wait.
#[test]
fn a_boundary_reports_the_refused_frees_of_its_own_releases() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().expect("a simulated engine");
    engine.set_pinned_pool_budget(0).unwrap(); // a released buffer is freed at once
    for boundary in ["flush", "synchronize"] {
        let buffer = PinnedHostBuffer::from_slice(&mut engine, &[3u32; 4]).unwrap();
        let tensor = engine.alloc_tensor::<u32>(&[4]).unwrap();
        drop(upload_pending(&mut engine, buffer, tensor).unwrap()); // detached in flight
        sim.fail_nth(SimOp::HostFree, 1, DriverError::INVALID_VALUE);
        let result = if boundary == "flush" {
            sim.advance_all();
            engine.flush()
        } else {
            engine.synchronize()
        };
        assert_eq!(
            engine.retirement_stats().pending,
            0,
            "{boundary} released the work"
        );
        assert!(
            one_deferred(&result, "cuMemFreeHost", DriverError::INVALID_VALUE),
            "{boundary} reports the refused free of the buffer it released: {result:?}"
        );
        assert!(engine.synchronize().is_ok(), "a failure is reported once");
    }
    assert_eq!(engine.pinned_pool_stats().refused_frees, 2);
}

/// Rule 3: a failed event query while `flush` polls the retirement queue is no verdict: the
/// record waits for a later poll and nothing is reported or retained.
#[test]
fn a_failed_query_in_a_flush_is_no_verdict() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().expect("a simulated engine");
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &[5u32; 4]).unwrap();
    let tensor = engine.alloc_tensor::<u32>(&[4]).unwrap();
    drop(upload_pending(&mut engine, buffer, tensor).unwrap());
    sim.advance_all();
    sim.fail_nth(SimOp::EventQuery, 1, DriverError::UNKNOWN);
    let flushed = engine.flush();
    assert!(flushed.is_ok(), "a failed query was reported: {flushed:?}");
    let stats = engine.retirement_stats();
    assert_eq!((stats.pending, stats.retained), (1, 0), "the record waits");
    assert!(engine.flush().is_ok());
    let stats = engine.retirement_stats();
    assert_eq!(
        (stats.pending, stats.retained),
        (0, 0),
        "a later poll released it"
    );
}

/// Rule 1: a caller's lease whose chunk cannot be proven is retained for the engine's lifetime
/// and stays counted as leased however the failure was found: by `end_chunk`, by an untracked
/// chunk's `retire`, or by the retirement queue for a lease dropped unproven. `ring_depth` such
/// leases exhaust `staging_lease` for good.
#[test]
fn a_retained_lease_counts_against_the_budget_in_every_case() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().expect("a simulated engine");
    small_staging(&mut engine, 3);
    let mut tensor = upload_tensor(&mut engine, &[7u32; 8], &[8]).unwrap();
    let counted = |engine: &CudaEngine| {
        let stats = engine.staging_stats();
        (stats.user_leased, stats.leased)
    };
    // Found by the caller's wait.
    let lease = engine.staging_lease().unwrap();
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    let chunk = lease.begin_upload(&mut engine, &mut tensor, 0, 8).unwrap();
    assert!(chunk.end_chunk().is_err());
    assert_eq!(
        counted(&engine),
        (1, 1),
        "a failed end_chunk keeps its slot counted"
    );
    // Neither an event nor a stream wait could track the chunk.
    let lease = engine.staging_lease().unwrap();
    sim.fail_nth(SimOp::EventRecord, 1, DriverError::INVALID_VALUE);
    sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::UNKNOWN);
    match lease.begin_upload(&mut engine, &mut tensor, 0, 8) {
        Err(SubmitError::Retained { .. }) => {}
        other => panic!("the chunk is untracked: {other:?}"),
    }
    assert_eq!(
        counted(&engine),
        (2, 2),
        "an untracked retire keeps its slot counted"
    );
    // Found by the retirement queue.
    let lease = engine.staging_lease().unwrap();
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    drop(lease.begin_upload(&mut engine, &mut tensor, 0, 8).unwrap());
    assert!(engine.synchronize().is_err());
    assert_eq!(engine.retirement_stats().retained, 3);
    assert_eq!(
        counted(&engine),
        (3, 3),
        "a failing dropped lease keeps its slot counted"
    );
    for _ in 0..2 {
        assert!(
            matches!(
                engine.staging_lease(),
                Err(Error::Staging(StagingError::Exhausted { depth: 3 }))
            ),
            "three retained leases exhaust a budget of three"
        );
        assert!(engine.synchronize().is_ok());
    }
}

// ---------------------------------------------------------------------------------------------
// Breaches of the rules the model found in the engine, each reduced to its smallest case; each is
// fixed, and its test stays to keep it fixed.
// ---------------------------------------------------------------------------------------------

/// Rule 3: every refused pinned free is a deferred failure. When an allocation fails and the
/// pool frees its idle blocks to make room, a trim that the driver refuses twice reports both
/// refusals (it used to record only the first).
#[test]
fn every_refused_free_of_a_pool_trim_is_reported() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().expect("a simulated engine");
    let a = PinnedHostBuffer::<u32>::new(&mut engine, 1024).unwrap();
    let b = PinnedHostBuffer::<u32>::new(&mut engine, 2048).unwrap();
    drop((a, b)); // two idle blocks in the pool
    sim.fail_nth(SimOp::HostAlloc, 1, DriverError::OUT_OF_MEMORY); // the pool trims to zero
    sim.fail_nth(SimOp::HostFree, 1, DriverError::INVALID_VALUE);
    sim.fail_nth(SimOp::HostFree, 2, DriverError::INVALID_VALUE);
    let _c = PinnedHostBuffer::<u32>::new(&mut engine, 1 << 16).unwrap();
    assert_eq!(engine.pinned_pool_stats().refused_frees, 2);
    let reported = match engine.flush() {
        Err(Error::Deferred { count, .. }) => count,
        Err(_) => 1,
        Ok(()) => 0,
    };
    assert_eq!(
        reported, 2,
        "two refused cuMemFreeHost calls, {reported} reported"
    );
}
