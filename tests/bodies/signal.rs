//! Signals between two engines on one device, on either device: the waiting engine's streams
//! wait on the device, and a signal outlives its engine.

use super::Device;
use cuferry::{PinnedHostBuffer, download_tensor, upload_pending, upload_tensor};

pub(crate) fn a_wait_for_a_signal_orders_another_engines_streams_on_the_device(dev: Device) {
    let mut engines = dev.engines(2);
    let (mut b, mut a) = (engines.pop().unwrap(), engines.pop().unwrap());
    let sim = a.sim();
    // Long work on A: on a GPU a 256 MiB upload and eight kernels over it (tens of
    // milliseconds); on the simulator less, with its clock held while the wait is queued.
    let n = if dev == Device::Gpu {
        64 << 20
    } else {
        1 << 16
    };
    let x = upload_tensor(&mut a, &vec![1.0f32; n], &[n]).unwrap();
    a.synchronize().unwrap();
    if let Some(sim) = &sim {
        sim.hold_clock(true);
    }
    let mut y = a.scale(&x, 2.0).unwrap();
    for _ in 0..7 {
        y = a.scale(&y, 1.0).unwrap();
    }
    let signal = a.signal().unwrap();
    b.wait_signal(&signal).unwrap();
    let ready = signal.is_ready().unwrap();
    if let Some(sim) = &sim {
        sim.hold_clock(false);
    }
    assert!(
        !ready,
        "the host did not wait: A's kernels are still running"
    );
    let buffer = PinnedHostBuffer::from_slice(&mut b, &[3.0f32, 4.0]).unwrap();
    let tensor = b.alloc_tensor::<f32>(&[2]).unwrap();
    let pending = upload_pending(&mut b, buffer, tensor).unwrap();
    // B's upload waits on the device for A's kernels: once it is done, so are they.
    let returned = pending.wait().unwrap();
    assert!(
        signal.is_ready().unwrap(),
        "B's work ran before A's signalled work"
    );
    assert_eq!(
        download_tensor(&mut b, returned.tensor()).unwrap(),
        [3.0, 4.0]
    );
    let head = download_tensor(&mut a, &y).unwrap();
    assert!(head.iter().all(|&v| v == 2.0));
    signal.wait().unwrap();
    Device::no_violations(&a);
}

pub(crate) fn signals_outlive_their_engine_and_leak_nothing(dev: Device) {
    let mut engines = dev.engines(2);
    let (mut b, mut a) = (engines.pop().unwrap(), engines.pop().unwrap());
    let sim = a.sim();
    let data: Vec<f32> = (0..16).map(|i| i as f32 * 0.5 + 1.0).collect();
    let buffer = PinnedHostBuffer::from_slice(&mut a, &data).unwrap();
    let tensor = a.alloc_tensor::<f32>(&[16]).unwrap();
    let pending = upload_pending(&mut a, buffer, tensor).unwrap();
    let kept = a.signal().unwrap();
    let dropped = a.signal().unwrap();
    let forgotten = a.signal().unwrap();
    drop(dropped); // detached: its event returns once complete
    std::mem::forget(forgotten); // leaks its event, nothing else
    drop(pending.wait().unwrap());
    drop(a); // teardown completes everything a queued
    b.wait_signal(&kept).unwrap();
    assert!(kept.is_ready().unwrap());
    drop(kept);
    drop(b);
    // Simulator only: what the device still holds.
    if let Some(sim) = sim {
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        assert_eq!(sim.device_live().0, 0);
        assert_eq!(sim.pinned_live().0, 0);
    }
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; signal::{
            a_wait_for_a_signal_orders_another_engines_streams_on_the_device,
            signals_outlive_their_engine_and_leak_nothing,
        });
    };
}
pub(crate) use tests;
