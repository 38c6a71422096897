//! Model test: pending transfers, the retirement queue and the pinned pool, against a pure
//! reference model, on the simulated device.
//!
//! The reference model keeps, for each engine the test opened, the device clock (operations
//! queued and run), the retirement queue in order, and the fate of every pinned buffer: held by
//! the test, retired (detached, waiting for its event), retained (its event failed), leaked
//! (`mem::forget`, or proof impossible), back in the pool, or freed. Each case runs either with a
//! zero pool budget, so a buffer the engine releases is freed at once and "released" is
//! observable on the simulated device buffer by buffer, or with the default budget, so released
//! blocks are kept and reused, and "released" is observable in the pool's counters.
//!
//! After every step the test checks that the simulated device's live pinned allocations are
//! exactly the buffers the model says are owned, plus the pool's idle blocks (so nothing is
//! released before its event completed, nothing whose event failed is ever released, and
//! completed records are released by the next drain), that the pool's and the retirement queue's
//! counters balance, that events are neither leaked nor lost (created, pooled, destroyed), that
//! the device clock agrees, and that the device saw no lifecycle violation (a free under a
//! queued copy).
//!
//! Faults are injected through the simulated device: an event that reports a failure once the
//! device reaches it, a copy enqueue that fails, an event record that fails, a stream
//! synchronize that fails (in `synchronize`, in the teardown's final wait, or in the fallback
//! wait after a failed event record, which leaves the submission retained).

use cuferry::error::UsageError;
use cuferry::sim::{SimConfig, SimDevice, SimOp, Violation};
use cuferry::{
    CudaEngine, DeviceTensor, Error, Pending, PinnedHostBuffer, SubmitError, download_pending,
    error::DriverError,
    pending::{InFlight, Operation, Returned, TryWait},
    upload_pending,
};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use std::collections::VecDeque;

// ---------------------------------------------------------------------------------------------
// The reference model.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Up,
    Down,
}

/// Where a pinned buffer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// In one of the test's slots: an idle buffer and tensor, or a transfer.
    Held,
    /// Detached into its engine's retirement queue, waiting for its event.
    Retired,
    /// Its event reported a failure: kept by the engine, never freed.
    Retained,
    /// Forgotten with its transfer, or a dropped transfer whose failure was found after
    /// teardown: never freed.
    Leaked,
    /// Released to its engine's pool: the block is idle there, or reused by a later buffer.
    Pooled,
    /// Freed back to the driver.
    Freed,
}

impl Fate {
    /// Whether someone (the test, a transfer, the engine's retirement queue) still owns the
    /// buffer, so its memory must be live.
    fn owned(self) -> bool {
        !matches!(self, Fate::Pooled | Fate::Freed)
    }
}

/// Every buffer of this test is one granule of pinned memory.
const BLOCK_BYTES: usize = 4096;

#[derive(Clone, Debug)]
struct Buf {
    /// The engine (index into `Model::engines`) whose pool it came from.
    engine: usize,
    fate: Fate,
}

/// What the test holds at one index. Each slot owns one buffer and a tensor of the same length
/// (the pair travels together); `pair` is the buffer's index in `Model::bufs`.
#[derive(Clone, Debug)]
enum Slot {
    Gone,
    Idle {
        pair: usize,
    },
    InFlight {
        pair: usize,
        dir: Dir,
        marker: u64,
        faulty: bool,
    },
    Returned {
        pair: usize,
        dir: Dir,
    },
}

#[derive(Clone, Debug)]
struct Record {
    pair: usize,
    marker: u64,
    faulty: bool,
}

/// One engine and its simulated device.
#[derive(Clone, Debug, Default)]
struct Engine {
    /// Operations queued on the device so far (the next operation's sequence number).
    next_seq: u64,
    /// Operations run so far: every operation with a smaller sequence number has run.
    done_seq: u64,
    /// Detached transfers waiting for their event, oldest first.
    retire: VecDeque<Record>,
    /// Records whose event failed.
    retained: usize,
    released: u64,
    allocations: u64,
    frees: u64,
    torn_down: bool,
    /// The next event record reports a failure once the device reaches it.
    fault_next: bool,
    /// The next copy enqueue fails, per direction (`Dir as usize`).
    fail_copy: [bool; 2],
    /// The next event record call fails.
    fail_record: bool,
    /// The next stream synchronize fails.
    fail_stream_sync: bool,
    /// Whether the pinned pool keeps released blocks (default budget) instead of freeing them
    /// at once (zero budget).
    pooled: bool,
    /// Idle blocks in the pinned pool.
    idle_blocks: usize,
    reuses: u64,
    /// Events created by the engine, idle in its pool, and alive on the device.
    events_created: u64,
    events_idle: usize,
    events_live: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Query {
    NotReady,
    Ready,
    Failed,
}

impl Engine {
    fn query(&self, marker: u64, faulty: bool) -> Query {
        match (marker < self.done_seq, faulty) {
            (false, _) => Query::NotReady,
            (true, false) => Query::Ready,
            (true, true) => Query::Failed,
        }
    }

    fn take_event(&mut self) {
        if self.events_idle > 0 {
            self.events_idle -= 1;
        } else {
            self.events_created += 1;
            self.events_live += 1;
        }
    }

    /// A transfer's completed event goes back to the pool, or is destroyed after teardown.
    fn release_event(&mut self) {
        if self.torn_down {
            self.events_live -= 1;
        } else {
            self.events_idle += 1;
        }
    }

    /// A submission that passed validation: takes an event unless it brings its own, queues
    /// the copy and records the event.
    fn submit(&mut self, dir: Dir, own_event: bool) -> Submitted {
        if std::mem::take(&mut self.fail_copy[dir as usize]) {
            // Nothing was taken from the pool; a resubmission's own event goes back to it.
            if own_event {
                self.events_idle += 1;
            }
            return Submitted::Failed;
        }
        if !own_event {
            self.take_event();
        }
        self.next_seq += 1;
        if std::mem::take(&mut self.fail_record) {
            // The failed record call still counts, so an event fault aimed at it is lost; the
            // event was not recorded, so it goes back to the pool. The engine proves the queued
            // copy complete with a stream synchronize, or retains the package.
            self.fault_next = false;
            self.events_idle += 1;
            if std::mem::take(&mut self.fail_stream_sync) {
                self.retained += 1;
                return Submitted::Retained;
            }
            self.done_seq = self.next_seq;
            return Submitted::Failed;
        }
        let marker = self.next_seq;
        self.next_seq += 1;
        Submitted::Queued {
            marker,
            faulty: std::mem::take(&mut self.fault_next),
        }
    }
}

/// What a submission that passed validation did.
enum Submitted {
    Queued {
        marker: u64,
        faulty: bool,
    },
    /// The driver refused: the package comes back, the event goes to the pool.
    Failed,
    /// Queued but untracked and unprovable: the engine retains package and event.
    Retained,
}

#[derive(Clone, Debug)]
struct Model {
    /// Every engine opened; the last is the current one, the others are torn down.
    engines: Vec<Engine>,
    /// Whether engines keep released pinned blocks for reuse (see `Engine::pooled`).
    pooled: bool,
    bufs: Vec<Buf>,
    slots: Vec<Slot>,
}

#[derive(Clone, Debug)]
enum Transition {
    /// A fresh buffer (from the pool) and tensor, handed to a transfer.
    SubmitFresh {
        dir: Dir,
        len: usize,
    },
    /// An idle buffer and tensor handed to a transfer (refused if they belong to a torn-down
    /// engine).
    SubmitIdle {
        slot: usize,
        dir: Dir,
    },
    /// A returned transfer queued again (refused if it belongs to a torn-down engine).
    Resubmit {
        slot: usize,
    },
    /// Drop whatever the slot holds: an in-flight transfer detaches into the retirement queue.
    Drop {
        slot: usize,
    },
    /// `mem::forget` an in-flight transfer.
    Forget {
        slot: usize,
    },
    IsReady {
        slot: usize,
    },
    Wait {
        slot: usize,
    },
    TryWait {
        slot: usize,
    },
    IntoParts {
        slot: usize,
    },
    /// Run up to `ops` queued device operations.
    Advance {
        ops: usize,
    },
    /// The next event record reports `CUDA_ERROR_LAUNCH_FAILED` once the device reaches it.
    FailNextEvent,
    /// The next copy enqueue in direction `dir` fails.
    FailNextCopy {
        dir: Dir,
    },
    /// The next event record call fails.
    FailNextRecord,
    /// The next stream synchronize fails (a `synchronize`, a teardown, or the fallback wait of
    /// a failed event record).
    FailNextStreamSync,
    Synchronize,
    /// Drop the engine (handles may outlive it) and open a new one.
    Teardown,
}

impl Model {
    fn current(&self) -> usize {
        self.engines.len() - 1
    }

    fn engine_of(&self, pair: usize) -> usize {
        self.bufs[pair].engine
    }

    /// The buffer and tensor are dropped: the buffer goes back to its pool (kept idle, or
    /// freed at once with a zero budget or after teardown), the tensor's free is queued on its
    /// device.
    fn drop_pair(&mut self, pair: usize) {
        let e = self.bufs[pair].engine;
        let engine = &mut self.engines[e];
        if engine.pooled && !engine.torn_down {
            engine.idle_blocks += 1;
            self.bufs[pair].fate = Fate::Pooled;
        } else {
            engine.frees += 1;
            self.bufs[pair].fate = Fate::Freed;
        }
        engine.next_seq += 1;
    }

    /// The retirement queue's poll: releases completed records, retains failed ones; with
    /// `front_only`, stops at the first record that is not complete. Returns the released
    /// pairs, which the engine drops once it has let go of its lock (`drop_pair`).
    #[must_use]
    fn poll(&mut self, e: usize, front_only: bool) -> Vec<usize> {
        let mut keep = VecDeque::new();
        let mut release = Vec::new();
        let engine = &mut self.engines[e];
        while let Some(record) = engine.retire.pop_front() {
            match engine.query(record.marker, record.faulty) {
                Query::Ready => {
                    engine.released += 1;
                    engine.events_idle += 1;
                    release.push(record.pair);
                }
                Query::Failed if !front_only => {
                    engine.retained += 1;
                    self.bufs[record.pair].fate = Fate::Retained;
                }
                Query::Failed | Query::NotReady => {
                    keep.push_back(record);
                    if front_only {
                        break;
                    }
                }
            }
        }
        keep.append(&mut engine.retire);
        engine.retire = keep;
        release
    }

    /// Submits `pair` on the current engine; returns what the slot holds afterwards.
    fn submit_pair(&mut self, pair: usize, dir: Dir, own_event: bool) -> Slot {
        let cur = self.current();
        match self.engines[cur].submit(dir, own_event) {
            Submitted::Queued { marker, faulty } => Slot::InFlight {
                pair,
                dir,
                marker,
                faulty,
            },
            Submitted::Failed => Slot::Idle { pair },
            Submitted::Retained => {
                self.bufs[pair].fate = Fate::Retained;
                Slot::Gone
            }
        }
    }

    fn drop_pairs(&mut self, pairs: Vec<usize>) {
        for pair in pairs {
            self.drop_pair(pair);
        }
    }

    fn slots_where(&self, f: impl Fn(&Slot) -> bool) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| f(&self.slots[i]))
            .collect()
    }
}

fn is_idle(s: &Slot) -> bool {
    matches!(s, Slot::Idle { .. })
}
fn is_in_flight(s: &Slot) -> bool {
    matches!(s, Slot::InFlight { .. })
}
fn is_returned(s: &Slot) -> bool {
    matches!(s, Slot::Returned { .. })
}
fn is_held(s: &Slot) -> bool {
    !matches!(s, Slot::Gone)
}

fn dir() -> impl Strategy<Value = Dir> {
    prop_oneof![Just(Dir::Up), Just(Dir::Down)]
}

struct RetirementModel;

impl ReferenceStateMachine for RetirementModel {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        any::<bool>()
            .prop_map(|pooled| Model {
                engines: vec![Engine {
                    pooled,
                    ..Engine::default()
                }],
                pooled,
                bufs: Vec::new(),
                slots: Vec::new(),
            })
            .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Transition> {
        use Transition as T;
        let mut choices: Vec<(u32, BoxedStrategy<T>)> = vec![
            (
                4,
                (dir(), 1..=64usize)
                    .prop_map(|(dir, len)| T::SubmitFresh { dir, len })
                    .boxed(),
            ),
            (4, (0..6usize).prop_map(|ops| T::Advance { ops }).boxed()),
            (2, Just(T::Synchronize).boxed()),
            (2, Just(T::Teardown).boxed()),
        ];
        let engine = &state.engines[state.current()];
        if !engine.fault_next {
            choices.push((2, Just(T::FailNextEvent).boxed()));
        }
        if !engine.fail_record {
            choices.push((1, Just(T::FailNextRecord).boxed()));
        }
        if !engine.fail_stream_sync {
            choices.push((1, Just(T::FailNextStreamSync).boxed()));
        }
        let dirs: Vec<Dir> = [Dir::Up, Dir::Down]
            .into_iter()
            .filter(|&d| !engine.fail_copy[d as usize])
            .collect();
        if !dirs.is_empty() {
            choices.push((
                1,
                select(dirs).prop_map(|dir| T::FailNextCopy { dir }).boxed(),
            ));
        }
        let idle = state.slots_where(is_idle);
        let in_flight = state.slots_where(is_in_flight);
        let returned = state.slots_where(is_returned);
        let held = state.slots_where(is_held);
        if !idle.is_empty() {
            choices.push((
                4,
                (select(idle), dir())
                    .prop_map(|(slot, dir)| T::SubmitIdle { slot, dir })
                    .boxed(),
            ));
        }
        if !in_flight.is_empty() {
            let s = || select(in_flight.clone());
            choices.push((2, s().prop_map(|slot| T::IsReady { slot }).boxed()));
            choices.push((4, s().prop_map(|slot| T::Wait { slot }).boxed()));
            choices.push((3, s().prop_map(|slot| T::TryWait { slot }).boxed()));
            choices.push((1, s().prop_map(|slot| T::Forget { slot }).boxed()));
        }
        if !returned.is_empty() {
            let s = || select(returned.clone());
            choices.push((4, s().prop_map(|slot| T::Resubmit { slot }).boxed()));
            choices.push((3, s().prop_map(|slot| T::IntoParts { slot }).boxed()));
        }
        if !held.is_empty() {
            choices.push((3, select(held).prop_map(|slot| T::Drop { slot }).boxed()));
        }
        proptest::strategy::Union::new_weighted(choices).boxed()
    }

    fn preconditions(state: &Model, t: &Transition) -> bool {
        let slot = |i: usize| state.slots.get(i);
        match *t {
            Transition::SubmitIdle { slot: i, .. } => slot(i).is_some_and(is_idle),
            Transition::Resubmit { slot: i } | Transition::IntoParts { slot: i } => {
                slot(i).is_some_and(is_returned)
            }
            Transition::Drop { slot: i } => slot(i).is_some_and(is_held),
            Transition::Forget { slot: i }
            | Transition::IsReady { slot: i }
            | Transition::Wait { slot: i }
            | Transition::TryWait { slot: i } => slot(i).is_some_and(is_in_flight),
            Transition::FailNextEvent => !state.engines[state.current()].fault_next,
            Transition::FailNextRecord => !state.engines[state.current()].fail_record,
            Transition::FailNextStreamSync => !state.engines[state.current()].fail_stream_sync,
            Transition::FailNextCopy { dir } => {
                !state.engines[state.current()].fail_copy[dir as usize]
            }
            Transition::SubmitFresh { .. }
            | Transition::Advance { .. }
            | Transition::Synchronize
            | Transition::Teardown => true,
        }
    }

    fn apply(mut state: Model, t: &Transition) -> Model {
        let cur = state.current();
        match *t {
            Transition::SubmitFresh { dir, .. } => {
                // `PinnedHostBuffer::new` polls the front of the retirement queue first; what
                // that releases goes back to the pool only after the new block is chosen.
                let released = state.poll(cur, true);
                let engine = &mut state.engines[cur];
                if engine.idle_blocks > 0 {
                    engine.idle_blocks -= 1;
                    engine.reuses += 1;
                } else {
                    engine.allocations += 1;
                }
                state.drop_pairs(released);
                let pair = state.bufs.len();
                state.bufs.push(Buf {
                    engine: cur,
                    fate: Fate::Held,
                });
                let slot = state.submit_pair(pair, dir, false);
                state.slots.push(slot);
            }
            Transition::SubmitIdle { slot, dir } => {
                let Slot::Idle { pair } = state.slots[slot] else {
                    unreachable!()
                };
                // Refused (another engine's pair): the pair stays idle.
                if state.engine_of(pair) == cur {
                    state.slots[slot] = state.submit_pair(pair, dir, false);
                }
            }
            Transition::Resubmit { slot } => {
                let Slot::Returned { pair, dir } = state.slots[slot] else {
                    unreachable!()
                };
                let e = state.engine_of(pair);
                state.slots[slot] = if e == cur {
                    state.submit_pair(pair, dir, true)
                } else {
                    // Refused: the package comes back, the event goes home.
                    state.engines[e].release_event();
                    Slot::Idle { pair }
                };
            }
            Transition::Drop { slot } => {
                match std::mem::replace(&mut state.slots[slot], Slot::Gone) {
                    Slot::Idle { pair } => state.drop_pair(pair),
                    Slot::Returned { pair, .. } => {
                        let e = state.engine_of(pair);
                        state.engines[e].release_event();
                        state.drop_pair(pair);
                    }
                    Slot::InFlight {
                        pair,
                        marker,
                        faulty,
                        ..
                    } => {
                        let e = state.engine_of(pair);
                        if !state.engines[e].torn_down {
                            state.bufs[pair].fate = Fate::Retired;
                            state.engines[e].retire.push_back(Record {
                                pair,
                                marker,
                                faulty,
                            });
                        } else {
                            // After teardown the drop waits for the event itself; a failure
                            // leaks the transfer.
                            let engine = &mut state.engines[e];
                            engine.done_seq = engine.done_seq.max(marker + 1);
                            if faulty {
                                state.bufs[pair].fate = Fate::Leaked;
                            } else {
                                engine.events_live -= 1;
                                state.drop_pair(pair);
                            }
                        }
                    }
                    Slot::Gone => unreachable!(),
                }
            }
            Transition::Forget { slot } => {
                let Slot::InFlight { pair, .. } =
                    std::mem::replace(&mut state.slots[slot], Slot::Gone)
                else {
                    unreachable!()
                };
                state.bufs[pair].fate = Fate::Leaked;
            }
            Transition::IsReady { .. } => {}
            Transition::Wait { slot } => {
                let Slot::InFlight {
                    pair,
                    dir,
                    marker,
                    faulty,
                } = state.slots[slot]
                else {
                    unreachable!()
                };
                let e = state.engine_of(pair);
                let engine = &mut state.engines[e];
                engine.done_seq = engine.done_seq.max(marker + 1);
                state.slots[slot] = if faulty {
                    engine.retained += 1;
                    state.bufs[pair].fate = Fate::Retained;
                    Slot::Gone
                } else {
                    Slot::Returned { pair, dir }
                };
            }
            Transition::TryWait { slot } => {
                let Slot::InFlight {
                    pair,
                    dir,
                    marker,
                    faulty,
                } = state.slots[slot]
                else {
                    unreachable!()
                };
                let e = state.engine_of(pair);
                match state.engines[e].query(marker, faulty) {
                    Query::NotReady => {}
                    Query::Ready => state.slots[slot] = Slot::Returned { pair, dir },
                    Query::Failed => {
                        state.engines[e].retained += 1;
                        state.bufs[pair].fate = Fate::Retained;
                        state.slots[slot] = Slot::Gone;
                    }
                }
            }
            Transition::IntoParts { slot } => {
                let Slot::Returned { pair, .. } = state.slots[slot] else {
                    unreachable!()
                };
                let e = state.engine_of(pair);
                state.engines[e].release_event();
                state.slots[slot] = Slot::Idle { pair };
            }
            Transition::Advance { ops } => {
                let engine = &mut state.engines[cur];
                engine.done_seq = (engine.done_seq + ops as u64).min(engine.next_seq);
            }
            Transition::FailNextEvent => state.engines[cur].fault_next = true,
            Transition::FailNextRecord => state.engines[cur].fail_record = true,
            Transition::FailNextStreamSync => state.engines[cur].fail_stream_sync = true,
            Transition::FailNextCopy { dir } => state.engines[cur].fail_copy[dir as usize] = true,
            Transition::Synchronize => {
                let engine = &mut state.engines[cur];
                if std::mem::take(&mut engine.fail_stream_sync) {
                    return state; // the wait fails: nothing runs, nothing is released
                }
                engine.done_seq = engine.next_seq;
                let released = state.poll(cur, false);
                state.drop_pairs(released);
            }
            Transition::Teardown if state.engines[cur].fail_stream_sync => {
                // The final wait fails: every detached record is leaked, nothing is released or
                // freed (idle blocks and events included), and the queue stays as it is.
                let engine = &mut state.engines[cur];
                engine.torn_down = true;
                for record in std::mem::take(&mut engine.retire) {
                    state.bufs[record.pair].fate = Fate::Leaked;
                }
                state.engines.push(Engine {
                    pooled: state.pooled,
                    ..Engine::default()
                });
            }
            Transition::Teardown => {
                let engine = &mut state.engines[cur];
                engine.torn_down = true;
                engine.done_seq = engine.next_seq;
                let released = state.poll(cur, false);
                // Idle events and idle pinned blocks are destroyed; those of live transfers stay
                // until released. Then the released pairs drop, freed at once.
                let engine = &mut state.engines[cur];
                engine.events_live -= std::mem::take(&mut engine.events_idle);
                engine.frees += std::mem::take(&mut engine.idle_blocks) as u64;
                for buf in &mut state.bufs {
                    if buf.engine == cur && buf.fate == Fate::Pooled {
                        buf.fate = Fate::Freed;
                    }
                }
                state.drop_pairs(released);
                state.engines.push(Engine {
                    pooled: state.pooled,
                    ..Engine::default()
                });
            }
        }
        state
    }
}

// ---------------------------------------------------------------------------------------------
// The system under test.
// ---------------------------------------------------------------------------------------------

type Tensor = DeviceTensor<f32>;
type Buffer = PinnedHostBuffer<f32>;

enum SutSlot {
    Gone,
    Idle(Buffer, Tensor),
    UpInFlight(Pending<cuferry::pending::Upload<f32>, InFlight>),
    DownInFlight(Pending<cuferry::pending::Download<f32>, InFlight>),
    UpReturned(Pending<cuferry::pending::Upload<f32>, Returned>),
    DownReturned(Pending<cuferry::pending::Download<f32>, Returned>),
}

struct Sut {
    engine: CudaEngine,
    /// The simulated device of every engine opened, by engine index.
    sims: Vec<SimDevice>,
    slots: Vec<SutSlot>,
    /// The address of every buffer, by buffer index.
    ptrs: Vec<usize>,
}

fn open_engine(pooled: bool) -> (CudaEngine, SimDevice) {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    if !pooled {
        // With no idle budget every released buffer is freed at once, so release is
        // observable on the device buffer by buffer.
        engine.set_pinned_pool_budget(0).unwrap();
    }
    let sim = engine.sim().expect("a simulated engine");
    (engine, sim)
}

/// Per-index distinct values, never zero.
fn distinct(len: usize) -> Vec<f32> {
    (0..len).map(|i| i as f32 * 0.75 + 1.25).collect()
}

fn in_flight_slot<D: Operation>(p: Pending<D, InFlight>) -> SutSlot {
    // Dispatch on the direction marker through `Any`: the two directions are distinct types.
    let any: Box<dyn std::any::Any> = Box::new(p);
    match any.downcast::<Pending<cuferry::pending::Upload<f32>, InFlight>>() {
        Ok(up) => SutSlot::UpInFlight(*up),
        Err(any) => SutSlot::DownInFlight(
            *any.downcast()
                .expect("a pending transfer is an upload or a download"),
        ),
    }
}

fn returned_slot<D: Operation>(p: Pending<D, Returned>) -> SutSlot {
    let any: Box<dyn std::any::Any> = Box::new(p);
    match any.downcast::<Pending<cuferry::pending::Upload<f32>, Returned>>() {
        Ok(up) => SutSlot::UpReturned(*up),
        Err(any) => SutSlot::DownReturned(
            *any.downcast()
                .expect("a pending transfer is an upload or a download"),
        ),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Queued,
    /// Refused: the pair belongs to a torn-down engine.
    Rejected,
    /// The injected driver failure (copy enqueue or event record).
    Failed,
    /// Queued, then untrackable: the engine keeps the package.
    Retained,
}

/// What the model says a submission did, from the slot it left behind.
fn expected_outcome(model: &Model, after: &Slot) -> Outcome {
    match *after {
        Slot::InFlight { .. } => Outcome::Queued,
        Slot::Idle { pair } if model.engine_of(pair) == model.current() => Outcome::Failed,
        Slot::Idle { .. } => Outcome::Rejected,
        Slot::Gone => Outcome::Retained,
        Slot::Returned { .. } => panic!("a submission leaves {after:?}"),
    }
}

/// What a refused or failed submission hands back.
type Refused = SubmitError<(PinnedHostBuffer<f32>, DeviceTensor<f32>)>;

fn settle(submitted: Result<SutSlot, Refused>) -> (SutSlot, Outcome) {
    match submitted {
        Ok(slot) => (slot, Outcome::Queued),
        Err(SubmitError::Rejected {
            input: package,
            error: Error::Usage(UsageError::WrongEngine { .. }),
        }) => (SutSlot::Idle(package.0, package.1), Outcome::Rejected),
        Err(SubmitError::Failed {
            input: package,
            error:
                Error::Driver {
                    source: DriverError::INVALID_VALUE,
                    ..
                },
        }) => (SutSlot::Idle(package.0, package.1), Outcome::Failed),
        Err(SubmitError::Retained {
            error:
                Error::Driver {
                    source: DriverError::INVALID_VALUE,
                    ..
                },
        }) => (SutSlot::Gone, Outcome::Retained),
        Err(other) => panic!("unexpected submission failure: {other}"),
    }
}

fn submit(engine: &mut CudaEngine, dir: Dir, buffer: Buffer, tensor: Tensor) -> (SutSlot, Outcome) {
    settle(match dir {
        Dir::Up => upload_pending(engine, buffer, tensor).map(in_flight_slot),
        // A download's refusal hands back its input source first: put as an upload's.
        Dir::Down => download_pending(engine, tensor, buffer)
            .map(in_flight_slot)
            .map_err(|e| e.map_input(|(t, b)| (b, t))),
    })
}

/// The injected fault, reported directly or (for detached work found failed at a boundary) as
/// the first of the deferred failures.
fn expect_fault(e: &Error) {
    let fault = match e {
        Error::Deferred { first, .. } => first,
        e => e,
    };
    assert!(
        matches!(
            fault,
            Error::DeviceFault {
                source: DriverError::LAUNCH_FAILED,
                ..
            }
        ),
        "expected the injected fault, got {e}"
    );
}

/// Waits on an in-flight transfer; the model says whether it comes back.
fn wait<D: Operation>(p: Pending<D, InFlight>, comes_back: bool) -> SutSlot {
    match p.wait() {
        Ok(r) => {
            assert!(comes_back, "wait succeeded on a failed event");
            returned_slot(r)
        }
        Err(e) => {
            assert!(!comes_back, "wait failed: {e}");
            expect_fault(&e);
            SutSlot::Gone
        }
    }
}

fn try_wait<D: Operation>(p: Pending<D, InFlight>, expected: &Slot) -> SutSlot {
    match (p.try_wait(), expected) {
        (Ok(TryWait::InFlight(p)), Slot::InFlight { .. }) => in_flight_slot(p),
        (Ok(TryWait::Returned(r)), Slot::Returned { .. }) => returned_slot(r),
        (Err(e), Slot::Gone) => {
            expect_fault(&e);
            SutSlot::Gone
        }
        (Ok(TryWait::InFlight(_)), _) => panic!("try_wait: not ready, model says {expected:?}"),
        (Ok(TryWait::Returned(_)), _) => panic!("try_wait: returned, model says {expected:?}"),
        (Err(e), _) => panic!("try_wait failed ({e}), model says {expected:?}"),
    }
}

fn is_ready<D: Operation>(p: &mut Pending<D, InFlight>, expected: Query) {
    match (p.is_ready(), expected) {
        (Ok(false), Query::NotReady) | (Ok(true), Query::Ready) => {}
        (Err(e), Query::Failed) => expect_fault(&e),
        (got, _) => panic!("is_ready returned {got:?}, model says {expected:?}"),
    }
}

struct RetirementTest;

impl StateMachineTest for RetirementTest {
    type SystemUnderTest = Sut;
    type Reference = RetirementModel;

    fn init_test(model: &Model) -> Sut {
        let (engine, sim) = open_engine(model.pooled);
        Sut {
            engine,
            sims: vec![sim],
            slots: Vec::new(),
            ptrs: Vec::new(),
        }
    }

    fn apply(mut sut: Sut, model: &Model, t: Transition) -> Sut {
        match t {
            Transition::SubmitFresh { dir, len } => {
                let buffer = Buffer::from_slice(&mut sut.engine, &distinct(len)).unwrap();
                sut.ptrs.push(buffer.as_slice().as_ptr() as usize);
                let tensor = sut.engine.alloc_tensor::<f32>(&[len]).unwrap();
                let (got, outcome) = submit(&mut sut.engine, dir, buffer, tensor);
                let expected = expected_outcome(model, model.slots.last().unwrap());
                assert_eq!(outcome, expected, "fresh submission");
                sut.slots.push(got);
            }
            Transition::SubmitIdle { slot, dir } => {
                let SutSlot::Idle(buffer, tensor) =
                    std::mem::replace(&mut sut.slots[slot], SutSlot::Gone)
                else {
                    panic!("slot {slot} is not idle")
                };
                let (got, outcome) = submit(&mut sut.engine, dir, buffer, tensor);
                let expected = expected_outcome(model, &model.slots[slot]);
                assert_eq!(outcome, expected, "submission of idle slot {slot}");
                sut.slots[slot] = got;
            }
            Transition::Resubmit { slot } => {
                let (got, outcome) = settle(
                    match std::mem::replace(&mut sut.slots[slot], SutSlot::Gone) {
                        SutSlot::UpReturned(r) => {
                            r.resubmit(&mut sut.engine).map(SutSlot::UpInFlight)
                        }
                        SutSlot::DownReturned(r) => r
                            .resubmit(&mut sut.engine)
                            .map(SutSlot::DownInFlight)
                            .map_err(|e| e.map_input(|(t, b)| (b, t))),
                        _ => panic!("slot {slot} is not returned"),
                    },
                );
                let expected = expected_outcome(model, &model.slots[slot]);
                assert_eq!(outcome, expected, "resubmission of slot {slot}");
                sut.slots[slot] = got;
            }
            Transition::Drop { slot } => {
                let held = std::mem::replace(&mut sut.slots[slot], SutSlot::Gone);
                assert!(!matches!(held, SutSlot::Gone));
                drop(held);
            }
            Transition::Forget { slot } => {
                match std::mem::replace(&mut sut.slots[slot], SutSlot::Gone) {
                    SutSlot::UpInFlight(p) => std::mem::forget(p),
                    SutSlot::DownInFlight(p) => std::mem::forget(p),
                    _ => panic!("slot {slot} is not in flight"),
                }
            }
            Transition::IsReady { slot } => {
                let Slot::InFlight {
                    pair,
                    marker,
                    faulty,
                    ..
                } = model.slots[slot]
                else {
                    panic!("model slot {slot} is not in flight")
                };
                let expected = model.engines[model.engine_of(pair)].query(marker, faulty);
                match &mut sut.slots[slot] {
                    SutSlot::UpInFlight(p) => is_ready(p, expected),
                    SutSlot::DownInFlight(p) => is_ready(p, expected),
                    _ => panic!("slot {slot} is not in flight"),
                }
            }
            Transition::Wait { slot } => {
                let comes_back = is_returned(&model.slots[slot]);
                sut.slots[slot] = match std::mem::replace(&mut sut.slots[slot], SutSlot::Gone) {
                    SutSlot::UpInFlight(p) => wait(p, comes_back),
                    SutSlot::DownInFlight(p) => wait(p, comes_back),
                    _ => panic!("slot {slot} is not in flight"),
                };
            }
            Transition::TryWait { slot } => {
                let expected = &model.slots[slot];
                sut.slots[slot] = match std::mem::replace(&mut sut.slots[slot], SutSlot::Gone) {
                    SutSlot::UpInFlight(p) => try_wait(p, expected),
                    SutSlot::DownInFlight(p) => try_wait(p, expected),
                    _ => panic!("slot {slot} is not in flight"),
                };
            }
            Transition::IntoParts { slot } => {
                let (buffer, tensor) = match std::mem::replace(&mut sut.slots[slot], SutSlot::Gone)
                {
                    SutSlot::UpReturned(r) => r.into_parts(),
                    // A download's parts come back source first.
                    SutSlot::DownReturned(r) => {
                        let (tensor, buffer) = r.into_parts();
                        (buffer, tensor)
                    }
                    _ => panic!("slot {slot} is not returned"),
                };
                sut.slots[slot] = SutSlot::Idle(buffer, tensor);
            }
            Transition::Advance { ops } => {
                let sim = sut.sims.last().unwrap();
                let queued = sim.queued();
                assert_eq!(sim.advance(ops), ops.min(queued));
            }
            Transition::FailNextEvent => {
                sut.sims
                    .last()
                    .unwrap()
                    .fail_event(1, DriverError::LAUNCH_FAILED);
            }
            Transition::FailNextCopy { dir } => {
                let op = match dir {
                    Dir::Up => SimOp::CopyHtoD,
                    Dir::Down => SimOp::CopyDtoH,
                };
                let sim = sut.sims.last().unwrap();
                sim.fail_nth(op, 1, DriverError::INVALID_VALUE);
            }
            Transition::FailNextRecord => {
                let sim = sut.sims.last().unwrap();
                sim.fail_nth(SimOp::EventRecord, 1, DriverError::INVALID_VALUE);
            }
            Transition::FailNextStreamSync => {
                let sim = sut.sims.last().unwrap();
                sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::LAUNCH_FAILED);
            }
            Transition::Synchronize => {
                // Whether it fails (an injected stream-synchronize fault) shows in the clock and
                // the retirement counters, which the invariants compare with the model.
                if let Err(e) = sut.engine.synchronize() {
                    expect_fault(&e);
                }
            }
            Transition::Teardown => {
                let (engine, sim) = open_engine(model.pooled);
                drop(std::mem::replace(&mut sut.engine, engine));
                sut.sims.push(sim);
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, model: &Model) {
        assert_eq!(sut.sims.len(), model.engines.len());
        for (e, (sim, engine)) in sut.sims.iter().zip(&model.engines).enumerate() {
            assert_eq!(sim.violations(), Vec::<Violation>::new(), "engine {e}");
            assert_eq!(
                sim.queued() as u64,
                engine.next_seq - engine.done_seq,
                "engine {e}: device clock"
            );
            let mine = || (0..model.bufs.len()).filter(|&b| model.bufs[b].engine == e);
            let live: Vec<usize> = mine().filter(|&b| model.bufs[b].fate.owned()).collect();
            for &b in &live {
                assert!(
                    sim.is_pinned_live(sut.ptrs[b] as *const u8),
                    "engine {e}: buffer {b} ({:?}) was freed",
                    model.bufs[b].fate
                );
            }
            let live_ptrs: Vec<usize> = live.iter().map(|&b| sut.ptrs[b]).collect();
            for b in mine().filter(|&b| model.bufs[b].fate == Fate::Freed) {
                if !live_ptrs.contains(&sut.ptrs[b]) {
                    assert!(
                        !sim.is_pinned_live(sut.ptrs[b] as *const u8),
                        "engine {e}: buffer {b} should have been released"
                    );
                }
            }
            assert_eq!(
                sim.pinned_live().0,
                live.len() + engine.idle_blocks,
                "engine {e}: live pinned blocks"
            );
            assert_eq!(
                sim.events_live(),
                engine.events_live,
                "engine {e}: live events"
            );
        }

        let engine = model.engines.last().unwrap();
        let live = model
            .bufs
            .iter()
            .filter(|b| b.engine == model.current() && b.fate.owned())
            .count();
        let pool = sut.engine.pinned_pool_stats();
        assert_eq!(pool.idle_blocks, engine.idle_blocks, "idle blocks");
        assert_eq!(
            pool.idle_bytes,
            engine.idle_blocks * BLOCK_BYTES,
            "idle bytes"
        );
        assert_eq!(pool.reuses, engine.reuses, "reuses");
        assert_eq!(pool.leased_blocks, live, "leased blocks");
        assert_eq!(pool.allocations, engine.allocations, "allocations");
        assert_eq!(pool.frees, engine.frees, "frees");
        assert_eq!(
            sut.engine.events_created(),
            engine.events_created,
            "events created"
        );
        let retire = sut.engine.retirement_stats();
        assert_eq!(retire.pending, engine.retire.len(), "pending records");
        assert_eq!(retire.retained, engine.retained, "retained records");
        assert_eq!(retire.released, engine.released, "released records");
        assert_eq!(
            retire.first_failure.is_some(),
            engine.retained > 0,
            "first failure"
        );
    }

    fn teardown(sut: Sut) {
        let Sut {
            engine,
            sims,
            slots,
            ..
        } = sut;
        // The engine goes first, so every remaining handle outlives it.
        drop(engine);
        drop(slots);
        for (e, sim) in sims.iter().enumerate() {
            assert_eq!(sim.violations(), Vec::<Violation>::new(), "engine {e}");
        }
    }
}

prop_state_machine! {
    #![proptest_config(Config {
        cases: 128,
        failure_persistence: None,
        ..Config::default()
    })]

    #[test]
    fn retirement_follows_the_reference_model(sequential 1..30 => RetirementTest);
}
