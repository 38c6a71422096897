//! Peer copies between engines, on either device: two engines on one device, and two devices
//! where the machine has a second (the simulated machine has three).

use super::Device;
use crate::support::{Reference, Rng, assert_same, random_vec, sim_machine};
use cuferry::sim::{Schedule, SimDevice, SimOp};
use cuferry::{CudaEngine, download_tensor, peer, upload_tensor};

/// The devices a body opens engines on: a simulated machine of three devices, or the machine's
/// CUDA devices.
struct Machine(Option<SimDevice>);

impl Machine {
    fn new(dev: Device) -> Self {
        Machine(match dev {
            Device::Sim => Some(sim_machine(3)),
            Device::Gpu => None,
        })
    }

    /// An engine on device `ordinal`, or `None` where the machine has no such device.
    fn open(&self, ordinal: usize) -> Option<CudaEngine> {
        match &self.0 {
            Some(sim) => CudaEngine::simulated_on_device(sim, ordinal).ok(),
            None => CudaEngine::open(ordinal).ok(),
        }
    }

    /// On the simulated machine, asserts it saw no rule broken and holds no device memory.
    fn no_violations_or_leaks(&self) {
        if let Some(sim) = &self.0 {
            assert!(sim.violations().is_empty(), "{:?}", sim.violations());
            assert_eq!(sim.device_live().0, 0);
        }
    }
}

/// The pairs of devices the bodies copy between: within one device, across two, and (on the
/// simulated machine) a third to the first and two engines on the second.
const PAIRS: [(usize, usize); 4] = [(0, 0), (0, 1), (2, 0), (1, 1)];

/// The largest copy of each element type's round trip, in bytes: 4 MiB on a GPU, 1 MiB on the
/// simulator, whose copies run on the host (the sizes each suite checked before its bodies were
/// shared).
fn largest(dev: Device) -> usize {
    if dev == Device::Gpu { 4 << 20 } else { 1 << 20 }
}

fn round_trip<T: Reference>(dev: Device, a: &mut CudaEngine, b: &mut CudaEngine, rng: &mut Rng) {
    let size = std::mem::size_of::<T>();
    let mut sizes = vec![0, 1, 16 / size, 16 / size + 1, (1 << 20) / size + 3];
    sizes.push(largest(dev) / size + 3);
    sizes.dedup();
    for n in sizes {
        let data = random_vec::<T>(rng, n);
        let x = upload_tensor(a, &data, &[n]).unwrap();
        let there = peer::copy(a, &x, b).unwrap();
        assert_eq!(there.shape(), &[n]);
        let what = format!("{} n={n}", T::DTYPE);
        assert_same(&what, &download_tensor(b, &there).unwrap(), &data);
        // And back, into a tensor the first engine already has.
        let mut back = a.alloc_tensor::<T>(&[n]).unwrap();
        peer::copy_into(b, &there, a, &mut back).unwrap();
        assert_same(&what, &download_tensor(a, &back).unwrap(), &data);
    }
}

pub(crate) fn every_element_type_crosses_between_engines(dev: Device) {
    let machine = Machine::new(dev);
    let mut rng = Rng::new(0x9ee7);
    for (a, b) in PAIRS {
        let (Some(mut x), Some(mut y)) = (machine.open(a), machine.open(b)) else {
            println!("no device {a} or {b}: the pair ({a}, {b}) is not checked");
            continue;
        };
        if (a, b) == (0, 1) {
            assert!(
                peer::access(&mut x, &y).unwrap(),
                "the devices have a peer link"
            );
        }
        crate::for_each_element!(T => {
            round_trip::<T>(dev, &mut x, &mut y, &mut rng);
        });
    }
    machine.no_violations_or_leaks();
}

pub(crate) fn peer_copies_in_each_direction_at_once(dev: Device) {
    let machine = Machine::new(dev);
    if machine.open(1).is_none() {
        println!("one device: the two-direction case needs two");
        return;
    }
    // Large on a GPU, so the two directions overlap; smaller on the simulator, whose copies run
    // on the host.
    let n = if dev == Device::Gpu {
        16 << 20
    } else {
        1 << 20
    };
    let data0: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let data1: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
    let one_way = |from: usize, to: usize, data: &[f32]| {
        let (mut a, mut b) = (machine.open(from).unwrap(), machine.open(to).unwrap());
        let x = upload_tensor(&mut a, data, &[data.len()]).unwrap();
        for _ in 0..8 {
            let there = peer::copy(&mut a, &x, &mut b).unwrap();
            assert_eq!(download_tensor(&mut b, &there).unwrap(), data);
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| one_way(0, 1, &data0));
        s.spawn(|| one_way(1, 0, &data1));
    });
    machine.no_violations_or_leaks();
}

fn pending_round_trip<T: Reference>(
    dev: Device,
    a: &mut CudaEngine,
    b: &mut CudaEngine,
    rng: &mut Rng,
) {
    let size = std::mem::size_of::<T>();
    let mut sizes = vec![1, 16 / size, 16 / size + 1, (1 << 20) / size + 3];
    sizes.push(largest(dev) / size + 3);
    sizes.dedup();
    for n in sizes {
        let data = random_vec::<T>(rng, n);
        let x = upload_tensor(a, &data, &[n]).unwrap();
        let landing = b.alloc_tensor::<T>(&[n]).unwrap();
        let copy = peer::copy_pending(a, x, b, landing).unwrap();
        let what = format!("pending {} n={n}", T::DTYPE);
        // Handed to the destination engine in flight: its download (on another of its streams)
        // runs after the copy.
        assert_same(
            &what,
            &download_tensor(b, copy.destination()).unwrap(),
            &data,
        );
        let (x, there) = copy.wait().unwrap().into_parts();
        assert_same(&what, &download_tensor(a, &x).unwrap(), &data);
        assert_same(&what, &download_tensor(b, &there).unwrap(), &data);
    }
}

pub(crate) fn every_element_type_crosses_pending_between_engines(dev: Device) {
    let machine = Machine::new(dev);
    // Simulator only: the streams' operations run interleaved.
    if let Some(sim) = &machine.0 {
        sim.set_schedule(Schedule::Interleaved { seed: 3 });
    }
    let mut rng = Rng::new(0x9ee8);
    for (a, b) in PAIRS.into_iter().chain([(1, 0)]) {
        let (Some(mut x), Some(mut y)) = (machine.open(a), machine.open(b)) else {
            println!("no device {a} or {b}: the pair ({a}, {b}) is not checked");
            continue;
        };
        crate::for_each_element!(T => {
            pending_round_trip::<T>(dev, &mut x, &mut y, &mut rng);
        });
    }
    machine.no_violations_or_leaks();
}

pub(crate) fn a_pending_copy_follows_the_sources_queued_kernels_and_precedes_the_destinations(
    dev: Device,
) {
    let machine = Machine::new(dev);
    let mut a = machine.open(0).unwrap();
    let mut b = machine.open(1).unwrap_or_else(|| machine.open(0).unwrap());
    // Large on a GPU, so the kernels are still running when the copy is queued; smaller on the
    // simulator, whose race checker sees the order at any size.
    let n = if dev == Device::Gpu {
        32 << 20
    } else {
        1 << 18
    };
    let data: Vec<f32> = (0..n).map(|i| (i % 4099) as f32).collect();
    let x = upload_tensor(&mut a, &data, &[n]).unwrap();
    for round in 0..4 {
        // A chain of kernels still running on the source engine when the copy is queued.
        let mut y = a.scale(&x, 2.0).unwrap();
        for _ in 0..8 {
            y = a.add(&y, &x).unwrap();
        }
        let landing = b.alloc_tensor::<f32>(&[n]).unwrap();
        let copy = peer::copy_pending(&mut a, y, &mut b, landing).unwrap();
        let z = b.scale(copy.destination(), 0.5).unwrap();
        drop(copy); // detached into the destination engine's queue
        let got = download_tensor(&mut b, &z).unwrap();
        let wrong = got
            .iter()
            .zip(&data)
            .filter(|(g, d)| **g != **d * 5.0)
            .count();
        assert_eq!(wrong, 0, "round {round}: {wrong} elements wrong");
    }
    b.synchronize().unwrap();
    assert_eq!(b.retirement_stats().pending, 0);
    drop((x, a, b));
    machine.no_violations_or_leaks();
}

pub(crate) fn resubmission_copies_again_with_nothing_allocated(dev: Device) {
    let machine = Machine::new(dev);
    let mut a = machine.open(0).unwrap();
    let mut b = machine.open(1).unwrap_or_else(|| machine.open(0).unwrap());
    let x = upload_tensor(&mut a, &[1i32; 256], &[256]).unwrap();
    let landing = b.alloc_tensor::<i32>(&[256]).unwrap();
    let mut copy = peer::copy_pending(&mut a, x, &mut b, landing)
        .unwrap()
        .wait()
        .unwrap();
    // Simulator only: the driver calls are counted.
    let counts = || {
        machine
            .0
            .as_ref()
            .map(|sim| (sim.calls(SimOp::Alloc), sim.calls(SimOp::EventCreate)))
    };
    for step in 2..6 {
        // The source changes hands to be rewritten, then the pair is copied anew.
        let (mut x, mut landing) = copy.into_parts();
        a.fill(&mut x, step).unwrap();
        b.fill(&mut landing, 0).unwrap();
        copy = peer::copy_pending(&mut a, x, &mut b, landing)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(
            download_tensor(&mut b, copy.destination()).unwrap(),
            [step; 256]
        );
        // The same copy again: no allocation, no new event.
        let before = counts();
        copy = copy.resubmit(&mut a, &mut b).unwrap().wait().unwrap();
        assert_eq!(counts(), before, "no allocation, and the event is reused");
        assert_eq!(
            download_tensor(&mut b, copy.destination()).unwrap(),
            [step; 256]
        );
    }
    drop((copy, a, b));
    machine.no_violations_or_leaks();
}

pub(crate) fn awaited_on_any_executor(dev: Device) {
    let machine = Machine::new(dev);
    let mut a = machine.open(0).unwrap();
    let mut b = machine.open(1).unwrap_or_else(|| machine.open(0).unwrap());
    let x = upload_tensor(&mut a, &[4u8; 33], &[33]).unwrap();
    let landing = b.alloc_tensor::<u8>(&[33]).unwrap();
    let copy = peer::copy_pending(&mut a, x, &mut b, landing).unwrap();
    let returned = futures_lite::future::block_on(async { copy.await }).unwrap();
    assert_eq!(
        download_tensor(&mut b, returned.destination()).unwrap(),
        [4; 33]
    );
    let landing = b.alloc_tensor::<u8>(&[33]).unwrap();
    let (x, _) = returned.into_parts();
    // A future dropped before it resolves detaches like the handle (on the simulator, surely
    // before: its clock is held).
    if let Some(sim) = &machine.0 {
        sim.hold_clock(true);
    }
    let copy = peer::copy_pending(&mut a, x, &mut b, landing).unwrap();
    drop(std::future::IntoFuture::into_future(copy));
    assert_eq!(b.retirement_stats().pending, 1);
    if let Some(sim) = &machine.0 {
        sim.hold_clock(false);
    }
    b.synchronize().unwrap();
    drop((a, b));
    machine.no_violations_or_leaks();
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; peer::{
            every_element_type_crosses_between_engines,
            peer_copies_in_each_direction_at_once,
            every_element_type_crosses_pending_between_engines,
            a_pending_copy_follows_the_sources_queued_kernels_and_precedes_the_destinations,
            resubmission_copies_again_with_nothing_allocated,
            awaited_on_any_executor,
        });
    };
}
pub(crate) use tests;
