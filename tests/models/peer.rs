//! Peer copies and signals between engines, checked on a simulated machine of two or three
//! devices against a reference that holds every tensor's values on the host.
//!
//! Random sequences of uploads, kernels (scale, fill), peer copies into new and existing tensors
//! between every pair of engines (some pairs without a peer link), signals and waits between
//! engines, drops and clock steps run under `Schedule::Interleaved`, so the streams of all the
//! engines complete in every order their waits allow. Checked: every copy between unlinked
//! devices is refused and changes nothing; every value read back is bit-identical to the
//! reference; the device never saw two operations on the same memory run out of the order they
//! were queued in; and after teardown no device memory is left. A second property injects a
//! fault into one call of the routes (peer copies, waits, records, synchronizes, peer access):
//! every failure is a typed error, and nothing runs out of order or leaks.

use cuferry::error::SetupError;
use cuferry::sim::{Schedule, SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, DeviceTensor, Error, Pending, SubmitError, download_tensor, engine::Signal,
    error::DriverError, peer, peer::PeerCopy, upload_tensor,
};
use proptest::prelude::*;

/// Tensor slots per engine.
const SLOTS: usize = 3;

#[derive(Clone, Debug)]
enum Op {
    Upload {
        e: usize,
        slot: usize,
        salt: u32,
    },
    Scale {
        e: usize,
        slot: usize,
    },
    Fill {
        e: usize,
        slot: usize,
        value: u32,
    },
    Copy {
        from: usize,
        slot: usize,
        to: usize,
        into: usize,
    },
    CopyInto {
        from: usize,
        slot: usize,
        to: usize,
        into: usize,
    },
    /// A pending copy of `from`'s `slot` into `to`'s existing `into` (both move into it).
    Pending {
        from: usize,
        slot: usize,
        to: usize,
        into: usize,
    },
    /// The destination engine scales the in-flight copy `i`'s destination into its `slot`.
    Handoff {
        i: usize,
        slot: usize,
    },
    /// The in-flight copy `i` waited for (its tensors back in their slots) or dropped.
    Settle {
        i: usize,
        wait: bool,
    },
    Signal {
        e: usize,
    },
    Wait {
        e: usize,
        signal: usize,
    },
    Drop {
        e: usize,
        slot: usize,
    },
    Read {
        e: usize,
        slot: usize,
    },
    Advance {
        n: usize,
    },
}

fn op(engines: usize) -> impl Strategy<Value = Op> {
    let e = 0..engines;
    let s = 0..SLOTS;
    prop_oneof![
        3 => (e.clone(), s.clone(), any::<u32>()).prop_map(|(e, slot, salt)| Op::Upload { e, slot, salt }),
        2 => (e.clone(), s.clone()).prop_map(|(e, slot)| Op::Scale { e, slot }),
        1 => (e.clone(), s.clone(), 0u32..1000).prop_map(|(e, slot, value)| Op::Fill { e, slot, value }),
        3 => (e.clone(), s.clone(), e.clone(), s.clone()).prop_map(|(from, slot, to, into)| Op::Copy { from, slot, to, into }),
        3 => (e.clone(), s.clone(), e.clone(), s.clone()).prop_map(|(from, slot, to, into)| Op::CopyInto { from, slot, to, into }),
        3 => (e.clone(), s.clone(), e.clone(), s.clone()).prop_map(|(from, slot, to, into)| Op::Pending { from, slot, to, into }),
        2 => (0usize..3, s.clone()).prop_map(|(i, slot)| Op::Handoff { i, slot }),
        2 => (0usize..3, any::<bool>()).prop_map(|(i, wait)| Op::Settle { i, wait }),
        1 => e.clone().prop_map(|e| Op::Signal { e }),
        1 => (e.clone(), 0usize..4).prop_map(|(e, signal)| Op::Wait { e, signal }),
        1 => (e.clone(), s.clone()).prop_map(|(e, slot)| Op::Drop { e, slot }),
        2 => (e.clone(), s.clone()).prop_map(|(e, slot)| Op::Read { e, slot }),
        1 => (1usize..6).prop_map(|n| Op::Advance { n }),
    ]
}

/// A pending copy in flight: its handle, where its tensors came from, and what the source held.
struct InFlightCopy {
    copy: Pending<PeerCopy<u32>>,
    from: (usize, usize),
    to: (usize, usize),
    values: Option<Vec<u32>>,
}

/// One run: the machine, its engines (the last one shares device 0 with the first), their
/// slots, and the reference.
struct Model {
    sim: SimDevice,
    engines: Vec<CudaEngine>,
    slots: Vec<Vec<Option<DeviceTensor<u32>>>>,
    /// The values each slot must read back; `None` where a fault left them unspecified.
    reference: Vec<Vec<Option<Vec<u32>>>>,
    signals: Vec<Signal>,
    /// Pending copies in flight, oldest first.
    in_flight: Vec<InFlightCopy>,
    len: usize,
    faults: bool,
    /// Whether the first and the last device have no peer link.
    unlinked: bool,
}

impl Model {
    fn new(devices: usize, unlinked: bool, seed: u64, len: usize, faults: bool) -> Self {
        let sim = SimDevice::new(SimConfig {
            devices,
            ..SimConfig::default()
        });
        sim.set_schedule(Schedule::Interleaved { seed });
        if unlinked {
            sim.set_peer_link(0, devices - 1, false);
        }
        let mut engines: Vec<CudaEngine> = (0..devices)
            .map(|d| CudaEngine::simulated_on_device(&sim, d).unwrap())
            .collect();
        engines.push(CudaEngine::simulated_on_device(&sim, 0).unwrap());
        let n = engines.len();
        Model {
            sim,
            engines,
            slots: (0..n).map(|_| (0..SLOTS).map(|_| None).collect()).collect(),
            reference: vec![vec![None; SLOTS]; n],
            signals: Vec::new(),
            in_flight: Vec::new(),
            len,
            faults,
            unlinked,
        }
    }

    /// Two distinct engines, mutably.
    fn pair(&mut self, a: usize, b: usize) -> (&mut CudaEngine, &mut CudaEngine) {
        assert_ne!(a, b);
        if a < b {
            let (left, right) = self.engines.split_at_mut(b);
            (&mut left[a], &mut right[0])
        } else {
            let (left, right) = self.engines.split_at_mut(a);
            (&mut right[0], &mut left[b])
        }
    }

    fn linked(&self, a: usize, b: usize) -> bool {
        let device = |e: usize| self.engines[e].device();
        !self.unlinked_pair(device(a).ordinal(), device(b).ordinal())
    }

    fn unlinked_pair(&self, x: usize, y: usize) -> bool {
        let last = self.sim.devices() - 1;
        self.unlinked && ((x == 0 && y == last) || (x == last && y == 0))
    }

    /// A failure: allowed only with faults, and only typed.
    fn failed(&self, what: &str, error: &Error) {
        assert!(self.faults, "{what}: unexpected failure {error}");
        assert!(
            matches!(
                error,
                Error::Driver { .. } | Error::DeviceFault { .. } | Error::Deferred { .. }
            ),
            "{what}: an untyped failure {error:?}"
        );
    }

    fn apply(&mut self, op: &Op) {
        let len = self.len;
        match *op {
            Op::Upload { e, slot, salt } => {
                let data: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(31) ^ salt).collect();
                match upload_tensor(&mut self.engines[e], &data, &[len]) {
                    Ok(t) => {
                        self.slots[e][slot] = Some(t);
                        self.reference[e][slot] = Some(data);
                    }
                    Err(error) => self.failed("upload", &error),
                }
            }
            Op::Scale { e, slot } => {
                let Some(t) = &self.slots[e][slot] else {
                    return;
                };
                match self.engines[e].scale(t, 3) {
                    Ok(out) => {
                        self.slots[e][slot] = Some(out);
                        let r = &mut self.reference[e][slot];
                        *r = r
                            .take()
                            .map(|v| v.iter().map(|x| x.wrapping_mul(3)).collect());
                    }
                    Err(error) => self.failed("scale", &error),
                }
            }
            Op::Fill { e, slot, value } => {
                let Some(t) = &mut self.slots[e][slot] else {
                    return;
                };
                match self.engines[e].fill(t, value) {
                    Ok(()) => self.reference[e][slot] = Some(vec![value; len]),
                    Err(error) => {
                        self.failed("fill", &error);
                        self.reference[e][slot] = None;
                    }
                }
            }
            Op::Copy {
                from,
                slot,
                to,
                into,
            }
            | Op::CopyInto {
                from,
                slot,
                to,
                into,
            } => {
                if from == to || self.slots[from][slot].is_none() {
                    return;
                }
                let existing = matches!(op, Op::CopyInto { .. });
                if existing && self.slots[to][into].is_none() {
                    return;
                }
                let linked = self.linked(from, to);
                let src = self.slots[from][slot].take().unwrap();
                let mut dst = if existing {
                    self.slots[to][into].take()
                } else {
                    None
                };
                let (a, b) = self.pair(from, to);
                let outcome = match &mut dst {
                    Some(d) => peer::copy_into(a, &src, b, d).map(|()| None),
                    None => peer::copy(a, &src, b).map(Some),
                };
                self.slots[from][slot] = Some(src);
                if existing {
                    self.slots[to][into] = dst;
                }
                match outcome {
                    Ok(new) => {
                        assert!(linked, "a copy between unlinked devices went through");
                        if let Some(new) = new {
                            self.slots[to][into] = Some(new);
                        }
                        self.reference[to][into] = self.reference[from][slot].clone();
                    }
                    Err(Error::Setup(SetupError::Unreachable { .. })) => {
                        assert!(!linked, "a copy between linked devices was refused");
                    }
                    Err(error) => {
                        self.failed("peer copy", &error);
                        if existing {
                            self.reference[to][into] = None;
                        }
                    }
                }
            }
            Op::Pending {
                from,
                slot,
                to,
                into,
            } => {
                if from == to || self.slots[from][slot].is_none() || self.slots[to][into].is_none()
                {
                    return;
                }
                let linked = self.linked(from, to);
                let src = self.slots[from][slot].take().unwrap();
                let dst = self.slots[to][into].take().unwrap();
                let values = self.reference[from][slot].take();
                self.reference[to][into] = None;
                let (a, b) = self.pair(from, to);
                match peer::copy_pending(a, src, b, dst) {
                    Ok(copy) => {
                        assert!(linked, "a copy between unlinked devices went through");
                        self.in_flight.push(InFlightCopy {
                            copy,
                            from: (from, slot),
                            to: (to, into),
                            values,
                        });
                    }
                    Err(refused) => {
                        match refused.error() {
                            Error::Setup(SetupError::Unreachable { .. }) => {
                                assert!(!linked, "a linked copy refused")
                            }
                            error => self.failed("pending peer copy", error),
                        }
                        let retained = matches!(refused, SubmitError::Retained { .. });
                        match refused.into_input() {
                            Some(package) => {
                                // Handed back untouched: the source as it was, the destination's
                                // contents unspecified only if the copy may have run.
                                self.slots[from][slot] = Some(package.0);
                                self.reference[from][slot] = values;
                                self.slots[to][into] = Some(package.1);
                            }
                            _ => {
                                assert!(retained);
                            }
                        }
                    }
                }
            }
            Op::Handoff { i, slot } => {
                let Some(flight) = self.in_flight.get(i) else {
                    return;
                };
                let to = flight.to.0;
                let values = flight.values.clone();
                match self.engines[to].scale(flight.copy.destination(), 3) {
                    Ok(out) => {
                        self.slots[to][slot] = Some(out);
                        self.reference[to][slot] =
                            values.map(|v| v.iter().map(|x| x.wrapping_mul(3)).collect());
                    }
                    Err(error) => self.failed("scale of an in-flight destination", &error),
                }
            }
            Op::Settle { i, wait } => {
                if i >= self.in_flight.len() {
                    return;
                }
                let flight = self.in_flight.remove(i);
                if !wait {
                    return; // detached: the destination engine releases both once proven
                }
                match flight.copy.wait() {
                    Ok(returned) => {
                        let (src, dst) = returned.into_parts();
                        let ((f, fs), (t, ts)) = (flight.from, flight.to);
                        self.slots[f][fs] = Some(src);
                        self.reference[f][fs] = flight.values.clone();
                        self.slots[t][ts] = Some(dst);
                        self.reference[t][ts] = flight.values;
                    }
                    Err(error) => self.failed("wait of a pending peer copy", &error),
                }
            }
            Op::Signal { e } => match self.engines[e].signal() {
                Ok(signal) => {
                    self.signals.push(signal);
                    if self.signals.len() > 4 {
                        drop(self.signals.remove(0));
                    }
                }
                Err(error) => self.failed("signal", &error),
            },
            Op::Wait { e, signal } => {
                let Some(signal) = self.signals.get(signal) else {
                    return;
                };
                if let Err(error) = self.engines[e].wait_signal(signal) {
                    self.failed("wait_signal", &error);
                }
            }
            Op::Drop { e, slot } => {
                self.slots[e][slot] = None;
                self.reference[e][slot] = None;
            }
            Op::Read { e, slot } => self.read(e, slot),
            Op::Advance { n } => {
                self.sim.advance(n);
            }
        }
        assert!(
            self.sim.violations().is_empty(),
            "after {op:?}: {:?}",
            self.sim.violations()
        );
    }

    fn read(&mut self, e: usize, slot: usize) {
        let Some(t) = &self.slots[e][slot] else {
            return;
        };
        match download_tensor(&mut self.engines[e], t) {
            Ok(got) => {
                if let Some(want) = &self.reference[e][slot] {
                    assert_eq!(&got, want, "engine {e} slot {slot}");
                }
            }
            Err(error) => {
                self.failed("read", &error);
                self.reference[e][slot] = None;
            }
        }
    }

    fn finish(mut self) {
        for e in 0..self.engines.len() {
            for slot in 0..SLOTS {
                self.read(e, slot);
            }
        }
        let Model {
            sim,
            engines,
            slots,
            signals,
            in_flight,
            ..
        } = self;
        drop(in_flight);
        drop(signals);
        drop(slots);
        let retained: usize = engines.iter().map(|e| e.retirement_stats().retained).sum();
        drop(engines);
        // A pending copy released by its destination engine's teardown frees its source on the
        // source engine's stream, which may have been torn down first: the device runs it still.
        sim.advance_all();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        if retained == 0 {
            assert_eq!(sim.device_live().0, 0, "device memory left allocated");
            assert_eq!(sim.pinned_live().0, 0, "pinned memory left allocated");
        }
    }
}

/// The faults the second property injects: one call of each kind the routes make.
fn fault() -> impl Strategy<Value = (SimOp, DriverError)> {
    prop_oneof![
        Just((SimOp::CopyPeer, DriverError::INVALID_VALUE)),
        Just((SimOp::PeerEnable, DriverError::NOT_SUPPORTED)),
        Just((SimOp::StreamWait, DriverError::INVALID_VALUE)),
        Just((SimOp::EventRecord, DriverError::UNKNOWN)),
        Just((SimOp::StreamSynchronize, DriverError::LAUNCH_FAILED)),
        Just((SimOp::EventSynchronize, DriverError::LAUNCH_FAILED)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(debug_assertions) { 512 } else { 1024 },
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    })]

    /// Every interleaving reads what the reference holds; unlinked pairs are refused; nothing
    /// runs out of order or leaks.
    #[test]
    fn peer_copies_and_signals_keep_every_engines_order(
        devices in 2usize..=3,
        unlinked in any::<bool>(),
        seed in any::<u64>(),
        len in prop_oneof![Just(1usize), Just(17), Just(1025)],
        ops in proptest::collection::vec(op(4), 1..40),
    ) {
        let mut model = Model::new(devices, unlinked, seed, len, false);
        for op in &ops {
            if op_fits(op, model.engines.len()) {
                model.apply(op);
            }
        }
        model.finish();
    }

    /// One refused or failing call of the routes is a typed error; nothing runs out of order or
    /// leaks.
    #[test]
    fn a_fault_in_the_routes_is_reported_and_loses_nothing(
        seed in any::<u64>(),
        (op_kind, error) in fault(),
        nth in 1u64..6,
        ops in proptest::collection::vec(op(4), 1..30),
    ) {
        let mut model = Model::new(3, false, seed, 17, true);
        model.sim.fail_nth(op_kind, nth, error);
        for op in &ops {
            model.apply(op);
        }
        model.sim.clear_faults();
        model.finish();
    }
}

/// Whether `op` names only engines the run has (the strategy draws for the larger machine).
fn op_fits(op: &Op, engines: usize) -> bool {
    let ok = |e: usize| e < engines;
    match *op {
        Op::Upload { e, .. }
        | Op::Scale { e, .. }
        | Op::Fill { e, .. }
        | Op::Signal { e }
        | Op::Wait { e, .. }
        | Op::Drop { e, .. }
        | Op::Read { e, .. } => ok(e),
        Op::Copy { from, to, .. }
        | Op::CopyInto { from, to, .. }
        | Op::Pending { from, to, .. } => ok(from) && ok(to),
        Op::Handoff { .. } | Op::Settle { .. } => true,
        Op::Advance { .. } => true,
    }
}

/// The sequence the pending route's order hangs on, under 64 interleavings: a pending copy
/// whose source a kernel still queued on the source engine writes, then read on the
/// destination engine.
#[test]
fn a_pending_copy_waits_for_its_sources_queued_writer() {
    for seed in 0..64 {
        let mut model = Model::new(2, false, seed, 1025, false);
        for op in [
            Op::Upload {
                e: 0,
                slot: 0,
                salt: 1,
            },
            Op::Upload {
                e: 1,
                slot: 0,
                salt: 2,
            },
            Op::Scale { e: 0, slot: 0 },
            Op::Pending {
                from: 0,
                slot: 0,
                to: 1,
                into: 0,
            },
            Op::Settle { i: 0, wait: true },
            Op::Read { e: 1, slot: 0 },
        ] {
            model.apply(&op);
        }
        model.finish();
    }
}
