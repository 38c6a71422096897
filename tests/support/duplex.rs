//! The model of the engine's one order over its three streams, shared by the simulated-device
//! test (`tests/models/duplex.rs`) and the GPU test (`tests/gpu/duplex.rs`): operations on a few
//! tensor slots, beside a reference that runs everything in program order on one stream.
//!
//! Random interleavings of pending and blocking uploads and downloads, kernels (on resident
//! tensors and on in-flight destinations and sources), device copies, fills, raw scopes, waits,
//! detached transfers, drops, flushes and synchronizes run on a simulated engine whose device picks
//! the next stream to run at random (`Schedule::Interleaved`), so uploads, downloads and kernels
//! complete in every order the waits allow. The reference is plain host arithmetic in call order.
//! Checked after every step: the device saw no two operations on the same memory run out of the
//! order they were queued in (the simulator's race check), and every value the host reads back
//! (blocking downloads, waited downloads, the final read of every slot) is bit-identical to the
//! reference. On a real device the same steps run at full speed, and the reads back are the
//! check.

use cuferry::graph::{GraphCompiler, Input, Prepared, TracedTensor};
use cuferry::sim::{Schedule, SimConfig, SimDevice, Violation};
use cuferry::{
    CudaEngine, DType, DeviceTensor, Error, Pending, PinnedHostBuffer, download_pending,
    download_tensor,
    pending::{Download, Upload},
    upload_pending, upload_tensor_into,
};
use proptest::prelude::*;

/// Tensor slots the operations name.
pub(crate) const SLOTS: usize = 4;

/// One step of a case.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    /// A pending upload of fresh data into the slot's tensor.
    UploadPending {
        slot: usize,
        salt: u32,
    },
    /// A blocking upload into the slot's tensor.
    UploadBlocking {
        slot: usize,
        salt: u32,
    },
    /// A pending download of the slot's tensor.
    DownloadPending {
        slot: usize,
    },
    /// A blocking download of the slot's tensor (an in-flight one's device side included),
    /// checked against the reference.
    DownloadBlocking {
        slot: usize,
    },
    /// `out = a + b`, from resident or in-flight tensors, into a new tensor.
    Add {
        a: usize,
        b: usize,
        out: usize,
    },
    /// `out = a * 2`, likewise.
    Scale {
        a: usize,
        out: usize,
    },
    /// `dst = src`, a device-to-device copy into the existing tensor.
    CopyInto {
        src: usize,
        dst: usize,
    },
    /// Fills the slot's tensor with a value.
    Fill {
        slot: usize,
        value: u32,
    },
    /// `out = a * a + a` through a prepared program (a graph replay), from a resident or
    /// in-flight tensor, into a new tensor.
    Program {
        a: usize,
        out: usize,
    },
    /// A raw scope that lends the slot's tensor for writing (it queues nothing on a simulated
    /// device, but orders what follows).
    Raw {
        slot: usize,
    },
    /// Waits for the slot's transfer, checking a download's data.
    Wait {
        slot: usize,
    },
    /// Drops the slot's transfer in flight (detached) and its tensor with it.
    Detach {
        slot: usize,
    },
    /// Drops the slot's tensor.
    Drop {
        slot: usize,
    },
    /// A new tensor in an empty slot.
    Alloc {
        slot: usize,
    },
    /// Runs up to `n` operations on the device.
    Advance {
        n: usize,
    },
    Flush,
    Synchronize,
}

/// A random step.
pub(crate) fn op() -> impl Strategy<Value = Op> {
    let slot = 0..SLOTS;
    prop_oneof![
        3 => (slot.clone(), any::<u32>()).prop_map(|(slot, salt)| Op::UploadPending { slot, salt }),
        1 => (slot.clone(), any::<u32>()).prop_map(|(slot, salt)| Op::UploadBlocking { slot, salt }),
        3 => slot.clone().prop_map(|slot| Op::DownloadPending { slot }),
        1 => slot.clone().prop_map(|slot| Op::DownloadBlocking { slot }),
        2 => (slot.clone(), slot.clone(), slot.clone()).prop_map(|(a, b, out)| Op::Add { a, b, out }),
        2 => (slot.clone(), slot.clone()).prop_map(|(a, out)| Op::Scale { a, out }),
        1 => (slot.clone(), slot.clone()).prop_map(|(src, dst)| Op::CopyInto { src, dst }),
        1 => (slot.clone(), any::<u32>()).prop_map(|(slot, value)| Op::Fill { slot, value }),
        1 => (slot.clone(), slot.clone()).prop_map(|(a, out)| Op::Program { a, out }),
        1 => slot.clone().prop_map(|slot| Op::Raw { slot }),
        3 => slot.clone().prop_map(|slot| Op::Wait { slot }),
        1 => slot.clone().prop_map(|slot| Op::Detach { slot }),
        1 => slot.clone().prop_map(|slot| Op::Drop { slot }),
        2 => slot.clone().prop_map(|slot| Op::Alloc { slot }),
        2 => (1usize..6).prop_map(|n| Op::Advance { n }),
        1 => Just(Op::Flush),
        1 => Just(Op::Synchronize),
    ]
}

/// What a slot holds on the engine's side.
enum Slot {
    Empty,
    Idle(DeviceTensor<f32>),
    Up(Pending<Upload<f32>>),
    /// A download in flight, with the data it must bring back.
    Down(Pending<Download<f32>>, Vec<f32>),
}

impl Slot {
    /// The slot's device tensor, resident or lent by its transfer in flight.
    fn tensor(&self) -> Option<&DeviceTensor<f32>> {
        match self {
            Slot::Empty => None,
            Slot::Idle(t) => Some(t),
            Slot::Up(p) => Some(p.tensor()),
            Slot::Down(p, _) => Some(p.tensor()),
        }
    }
}

/// The data a salt names: distinct, exactly representable values.
fn data(len: usize, salt: u32) -> Vec<f32> {
    (0..len)
        .map(|i| ((salt as usize).wrapping_mul(31).wrapping_add(i * 7) % 65_521) as f32 - 1000.5)
        .collect()
}

/// The engine under test beside the reference.
pub(crate) struct Run {
    engine: CudaEngine,
    /// The simulated device behind the engine, if it is one: then the device's race check runs
    /// after every step.
    sim: Option<SimDevice>,
    len: usize,
    slots: Vec<Slot>,
    /// The reference: every slot's contents in program order (`None`: empty, or not known after
    /// an injected fault).
    model: Vec<Option<Vec<f32>>>,
    /// Whether faults are injected: then a failed step makes its slots unknown instead of
    /// failing the case.
    faults: bool,
    /// `x * x + x` prepared for the slots' length, once the first `Program` step needs it.
    program: Option<Prepared>,
}

impl Run {
    /// A run on a fresh simulated engine whose device interleaves its streams by `seed`;
    /// `faults` when the caller injects faults (a failed step then makes its slots unknown).
    pub(crate) fn simulated(len: usize, seed: u64, faults: bool) -> Self {
        let engine = CudaEngine::simulated(SimConfig::default());
        let sim = engine.sim().expect("a simulated engine");
        sim.set_schedule(Schedule::Interleaved { seed });
        Self::on(engine, len, faults)
    }

    /// A run on `engine` (a real device's, or a simulated one).
    pub(crate) fn on(engine: CudaEngine, len: usize, faults: bool) -> Self {
        let sim = engine.sim();
        Run {
            engine,
            sim,
            len,
            slots: (0..SLOTS).map(|_| Slot::Empty).collect(),
            model: vec![None; SLOTS],
            faults,
            program: None,
        }
    }

    /// A step's failure: a typed error is what an injected fault may cause; without faults, none
    /// is expected.
    fn failed(&mut self, what: &str, error: &dyn std::fmt::Display, slots: &[usize]) {
        assert!(self.faults, "{what}: unexpected failure {error}");
        for &slot in slots {
            self.model[slot] = None;
        }
    }

    fn check(&self, what: &str, got: &[f32], expected: &Option<Vec<f32>>) {
        if let Some(expected) = expected {
            let same = got
                .iter()
                .zip(expected)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same && got.len() == expected.len(),
                "{what}: read back {got:?}, the reference holds {expected:?}"
            );
        }
    }

    fn take_idle(&mut self, slot: usize) -> Option<DeviceTensor<f32>> {
        match std::mem::replace(&mut self.slots[slot], Slot::Empty) {
            Slot::Idle(t) => Some(t),
            other => {
                self.slots[slot] = other;
                None
            }
        }
    }

    /// The simulated device, for injecting faults.
    pub(crate) fn sim(&self) -> Option<&SimDevice> {
        self.sim.as_ref()
    }

    /// Runs one step on the engine and the reference, and checks what it can.
    pub(crate) fn apply(&mut self, op: &Op) {
        let len = self.len;
        match *op {
            Op::Alloc { slot } => {
                if let Slot::Empty = self.slots[slot] {
                    match self.engine.alloc_tensor::<f32>(&[len]) {
                        Ok(t) => {
                            self.slots[slot] = Slot::Idle(t);
                            // Unwritten: its contents are unspecified, so the reference holds
                            // nothing to compare until a write.
                            self.model[slot] = None;
                        }
                        Err(e) => self.failed("alloc", &e, &[slot]),
                    }
                }
            }
            Op::UploadPending { slot, salt } => {
                let Some(tensor) = self.take_idle(slot) else {
                    return;
                };
                let values = data(len, salt);
                let buffer = PinnedHostBuffer::from_slice(&mut self.engine, &values)
                    .expect("a pinned buffer");
                match upload_pending(&mut self.engine, buffer, tensor) {
                    Ok(p) => {
                        self.slots[slot] = Slot::Up(p);
                        self.model[slot] = Some(values);
                    }
                    Err(e) => {
                        let error = e.to_string();
                        if let Some(package) = e.into_input() {
                            self.slots[slot] = Slot::Idle(package.1);
                        }
                        self.failed("pending upload", &error, &[slot]);
                    }
                }
            }
            Op::UploadBlocking { slot, salt } => {
                let values = data(len, salt);
                let Slot::Idle(tensor) = &mut self.slots[slot] else {
                    return;
                };
                match upload_tensor_into(&mut self.engine, tensor, &values) {
                    Ok(()) => self.model[slot] = Some(values),
                    Err(e) => self.failed("blocking upload", &e, &[slot]),
                }
            }
            Op::DownloadPending { slot } => {
                let Some(tensor) = self.take_idle(slot) else {
                    return;
                };
                let buffer =
                    PinnedHostBuffer::<f32>::new(&mut self.engine, len).expect("a pinned buffer");
                match download_pending(&mut self.engine, tensor, buffer) {
                    Ok(p) => {
                        let expected = self.model[slot].clone().unwrap_or_default();
                        self.slots[slot] = Slot::Down(p, expected);
                    }
                    Err(e) => {
                        let error = e.to_string();
                        if let Some(package) = e.into_input() {
                            self.slots[slot] = Slot::Idle(package.0);
                        }
                        self.failed("pending download", &error, &[slot]);
                    }
                }
            }
            Op::DownloadBlocking { slot } => {
                let Some(tensor) = self.slots[slot].tensor() else {
                    return;
                };
                match download_tensor(&mut self.engine, tensor) {
                    Ok(got) => self.check("blocking download", &got, &self.model[slot]),
                    Err(e) => self.failed("blocking download", &e, &[slot]),
                }
            }
            Op::Add { .. } | Op::Scale { .. } => {
                let (add, a, b, out) = match *op {
                    Op::Add { a, b, out } => (true, a, b, out),
                    Op::Scale { a, out } => (false, a, a, out),
                    _ => unreachable!(),
                };
                if !matches!(self.slots[out], Slot::Empty | Slot::Idle(_)) {
                    return;
                }
                let (Some(x), Some(y)) = (self.slots[a].tensor(), self.slots[b].tensor()) else {
                    return;
                };
                let result = if add {
                    self.engine.add(x, y)
                } else {
                    self.engine.scale(x, 2.0)
                };
                let expected = match (&self.model[a], &self.model[b]) {
                    (Some(x), Some(y)) if add => {
                        Some(x.iter().zip(y).map(|(x, y)| x + y).collect())
                    }
                    (Some(x), _) if !add => Some(x.iter().map(|x| x * 2.0).collect()),
                    _ => None,
                };
                match result {
                    Ok(t) => {
                        self.slots[out] = Slot::Idle(t);
                        self.model[out] = expected;
                    }
                    Err(e) => self.failed("kernel", &e, &[]),
                }
            }
            Op::CopyInto { src, dst } => {
                if src == dst {
                    return;
                }
                let Some(mut target) = self.take_idle(dst) else {
                    return;
                };
                if let Some(source) = self.slots[src].tensor() {
                    match self.engine.copy_into(source, &mut target) {
                        Ok(()) => self.model[dst] = self.model[src].clone(),
                        Err(e) => self.failed("device copy", &e, &[dst]),
                    }
                }
                self.slots[dst] = Slot::Idle(target);
            }
            Op::Fill { slot, value } => {
                let value = (value % 1000) as f32 + 0.25;
                let Slot::Idle(tensor) = &mut self.slots[slot] else {
                    return;
                };
                match self.engine.fill(tensor, value) {
                    Ok(()) => self.model[slot] = Some(vec![value; len]),
                    Err(e) => self.failed("fill", &e, &[slot]),
                }
            }
            Op::Program { a, out } => {
                if !matches!(self.slots[out], Slot::Empty | Slot::Idle(_)) {
                    return;
                }
                if self.program.is_none() {
                    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
                    let y = (&(&x * &x).expect("traced") + &x).expect("traced");
                    let program = GraphCompiler::new()
                        .compile_with_input_specs(&[&y], &[(&x, DType::F32, &[len])])
                        .expect("a program");
                    match self.engine.prepare(&program) {
                        Ok(prepared) => self.program = Some(prepared),
                        Err(e) => return self.failed("prepare", &e, &[]),
                    }
                }
                let (Some(x), Some(prepared)) = (self.slots[a].tensor(), self.program.as_mut())
                else {
                    return;
                };
                let expected = self.model[a]
                    .as_ref()
                    .map(|x| x.iter().map(|v| v * v + v).collect());
                match self.engine.run(prepared, &[Input::from(x)]) {
                    Ok(outputs) => {
                        let result = outputs.into_iter().next().expect("one output");
                        let Ok(tensor) = result.into_tensor::<f32>() else {
                            panic!("the program's output is a new tensor")
                        };
                        self.slots[out] = Slot::Idle(tensor);
                        self.model[out] = expected;
                    }
                    Err(e) => self.failed("program", &e, &[]),
                }
            }
            Op::Raw { slot } => {
                let Slot::Idle(tensor) = &mut self.slots[slot] else {
                    return;
                };
                let lent = self.engine.with_raw(|raw| {
                    raw.device_ptr_mut(tensor)?;
                    Ok::<_, Error>(())
                });
                if let Err(e) = lent {
                    self.failed("raw scope", &e, &[]);
                }
            }
            Op::Wait { slot } => match std::mem::replace(&mut self.slots[slot], Slot::Empty) {
                Slot::Up(p) => match p.wait() {
                    Ok(r) => self.slots[slot] = Slot::Idle(r.into_parts().1),
                    Err(e) => self.failed("wait for an upload", &e, &[slot]),
                },
                Slot::Down(p, expected) => match p.wait() {
                    Ok(r) => {
                        let (tensor, buffer) = r.into_parts();
                        let known = self.model[slot].as_ref().map(|_| expected);
                        self.check("pending download", buffer.as_slice(), &known);
                        self.slots[slot] = Slot::Idle(tensor);
                    }
                    Err(e) => self.failed("wait for a download", &e, &[slot]),
                },
                other => self.slots[slot] = other,
            },
            Op::Detach { slot } => {
                if matches!(self.slots[slot], Slot::Up(_) | Slot::Down(..)) {
                    self.slots[slot] = Slot::Empty;
                    self.model[slot] = None;
                }
            }
            Op::Drop { slot } => {
                if self.take_idle(slot).is_some() {
                    self.model[slot] = None;
                }
            }
            Op::Advance { n } => {
                if let Some(sim) = &self.sim {
                    sim.advance(n);
                }
            }
            Op::Flush => {
                if let Err(e) = self.engine.flush() {
                    self.failed("flush", &e, &[]);
                }
            }
            Op::Synchronize => {
                if let Err(e) = self.engine.synchronize() {
                    self.failed("synchronize", &e, &[]);
                }
            }
        }
        if let Some(sim) = &self.sim {
            assert_eq!(
                sim.violations(),
                Vec::<Violation>::new(),
                "after {op:?}: operations on shared memory ran out of order"
            );
        }
    }

    /// Waits for everything, reads every slot back, and tears down: nothing out of order,
    /// nothing left allocated.
    pub(crate) fn finish(mut self) {
        for slot in 0..SLOTS {
            self.apply(&Op::Wait { slot });
        }
        let _ = self.engine.synchronize();
        for slot in 0..SLOTS {
            if let Slot::Idle(t) = &self.slots[slot] {
                match download_tensor(&mut self.engine, t) {
                    Ok(got) => {
                        self.check(&format!("slot {slot} at the end"), &got, &self.model[slot])
                    }
                    Err(e) => assert!(self.faults, "final read of slot {slot}: {e}"),
                }
            }
        }
        let retained = self.engine.retirement_stats().retained;
        let Run {
            engine,
            sim,
            slots,
            program,
            ..
        } = self;
        drop(slots);
        drop(program);
        drop(engine);
        let Some(sim) = sim else {
            return;
        };
        sim.advance_all();
        assert_eq!(sim.violations(), Vec::<Violation>::new(), "at teardown");
        if retained == 0 {
            assert_eq!(sim.device_live().0, 0, "device memory left allocated");
            assert_eq!(sim.pinned_live().0, 0, "pinned memory left allocated");
        }
    }
}
