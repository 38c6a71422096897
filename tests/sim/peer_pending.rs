//! The pending peer route on a simulated machine of several devices: the right bytes for every
//! element type at the size boundaries, the destination handed to the next operation of its
//! engine while the copy is in flight, refusals that hand both tensors back, detach on drop into
//! the destination engine's queue, `mem::forget`, a failed wait that retains both tensors,
//! resubmission, `.await`, and a fault at every driver call of the route.

use crate::support::{engines_on as engines, sim_machine as machine};
use cuferry::error::{SetupError, UsageError};
use cuferry::sim::{Schedule, SimDevice, SimOp};
use cuferry::{
    CudaEngine, DeviceTensor, Error, PinnedHostBuffer, SubmitError, download_tensor,
    error::DriverError, peer, pending::TryWait, upload_pending, upload_tensor,
};

// The pending route's bodies (`tests/bodies/peer.rs`) run with the peer route's, in `peer.rs`.

// Simulator-only: runs 32 interleavings of the streams under the race checker.
#[test]
fn the_copy_follows_the_source_engines_queued_writes_and_precedes_the_destinations_next_work() {
    for seed in 0..32 {
        let sim = machine(2);
        sim.set_schedule(Schedule::Interleaved { seed });
        let (mut a, mut b) = engines(&sim, 0, 1);
        let data: Vec<u32> = (0..4099).map(|i| i * 3 + 1).collect();
        let x = upload_tensor(&mut a, &data, &[4099]).unwrap();
        // Queued on the source engine, not waited for: the copy must wait for it on the device.
        let y = a.scale(&x, 5).unwrap();
        let landing = b.alloc_tensor::<u32>(&[4099]).unwrap();
        let copy = peer::copy_pending(&mut a, y, &mut b, landing).unwrap();
        // Queued on the destination engine after the copy: reads what landed.
        let z = b.scale(copy.destination(), 2).unwrap();
        // The source engine may read the source beside the copy.
        let w = a.scale(copy.source(), 1).unwrap();
        let expected: Vec<u32> = data.iter().map(|v| v * 10).collect();
        assert_eq!(
            download_tensor(&mut b, &z).unwrap(),
            expected,
            "seed {seed}"
        );
        let fives: Vec<u32> = data.iter().map(|v| v * 5).collect();
        assert_eq!(download_tensor(&mut a, &w).unwrap(), fives, "seed {seed}");
        drop(copy.wait().unwrap());
        drop((x, z, w, a, b));
        assert!(
            sim.violations().is_empty(),
            "seed {seed}: {:?}",
            sim.violations()
        );
        assert_eq!(sim.device_live().0, 0, "seed {seed}");
    }
}

/// What tells a tensor pair apart here (each engine's tensors differ in length or device).
fn ptrs<T: cuferry::Element>(
    x: &DeviceTensor<T>,
    y: &DeviceTensor<T>,
) -> (
    usize,
    cuferry::engine::DeviceId,
    usize,
    cuferry::engine::DeviceId,
) {
    (x.len(), x.device(), y.len(), y.device())
}

// Simulator-only: removes the peer link and counts the copies queued.
#[test]
fn refusals_hand_both_tensors_back_untouched_with_nothing_queued() {
    let sim = machine(2);
    sim.set_peer_link(0, 1, false);
    let (mut a, mut b) = engines(&sim, 0, 1);
    let mut c = CudaEngine::simulated_on_device(&sim, 0).unwrap();
    let copies = || sim.calls(SimOp::CopyPeer);
    let before = copies();
    let check = |refused: Result<_, SubmitError<(DeviceTensor<u32>, DeviceTensor<u32>)>>,
                 expected: (
        usize,
        cuferry::engine::DeviceId,
        usize,
        cuferry::engine::DeviceId,
    ),
                 is: fn(&Error) -> bool| {
        let Err(refused) = refused else {
            panic!("a refusal went through");
        };
        assert!(is(refused.error()), "{refused:?}");
        assert!(matches!(refused, SubmitError::Rejected { .. }));
        let package = refused.into_input().expect("handed back");
        assert_eq!(ptrs(&package.0, &package.1), expected);
        package
    };
    // No peer link between devices 0 and 1.
    let x = upload_tensor(&mut a, &[1u32, 2, 3], &[3]).unwrap();
    let y = b.alloc_tensor::<u32>(&[3]).unwrap();
    let p = ptrs(&x, &y);
    let back = check(peer::copy_pending(&mut a, x, &mut b, y), p, |e| {
        matches!(e, Error::Setup(SetupError::Unreachable { .. }))
    });
    // A tensor named beside the wrong engine.
    let p = ptrs(&back.0, &back.1);
    let back = check(peer::copy_pending(&mut b, back.0, &mut a, back.1), p, |e| {
        matches!(e, Error::Usage(UsageError::WrongEngine { .. }))
    });
    // Lengths that differ.
    let short = c.alloc_tensor::<u32>(&[2]).unwrap();
    let p = ptrs(&back.0, &short);
    let mismatched = check(peer::copy_pending(&mut a, back.0, &mut c, short), p, |e| {
        matches!(
            e,
            Error::Usage(UsageError::LengthMismatch {
                found: 3,
                expected: 2,
                ..
            })
        )
    });
    // Nothing to copy.
    let (e0, e1) = (
        a.alloc_tensor::<u32>(&[0]).unwrap(),
        c.alloc_tensor::<u32>(&[0]).unwrap(),
    );
    let p = ptrs(&e0, &e1);
    check(peer::copy_pending(&mut a, e0, &mut c, e1), p, |e| {
        matches!(e, Error::Usage(UsageError::ZeroLength { .. }))
    });
    assert_eq!(copies(), before, "nothing was queued");
    // The same tensors go through once the route is possible.
    let landing = c.alloc_tensor::<u32>(&[3]).unwrap();
    let copy = peer::copy_pending(&mut a, mismatched.0, &mut c, landing).unwrap();
    let (_, there) = copy.wait().unwrap().into_parts();
    assert_eq!(download_tensor(&mut c, &there).unwrap(), [1, 2, 3]);
    drop((back.1, mismatched.1, there, a, b, c));
    assert_eq!(sim.device_live().0, 0);
}

// Simulator-only: holds the device clock.
#[test]
fn in_flight_until_the_device_runs_it() {
    let sim = machine(2);
    let (mut a, mut b) = engines(&sim, 0, 1);
    let x = upload_tensor(&mut a, &[7u64; 100], &[100]).unwrap();
    let landing = b.alloc_tensor::<u64>(&[100]).unwrap();
    sim.hold_clock(true);
    let mut copy = peer::copy_pending(&mut a, x, &mut b, landing).unwrap();
    assert!(!copy.is_ready().unwrap());
    let copy = match copy.try_wait().unwrap() {
        TryWait::InFlight(copy) => copy,
        TryWait::Returned(_) => panic!("returned before the device ran the copy"),
    };
    sim.hold_clock(false);
    sim.advance_all();
    let copy = match copy.try_wait().unwrap() {
        TryWait::Returned(copy) => copy,
        TryWait::InFlight(_) => panic!("still in flight after the device ran it"),
    };
    assert_eq!(
        download_tensor(&mut b, copy.destination()).unwrap(),
        [7; 100]
    );
    drop((copy, a, b));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

// Simulator-only: holds the device clock and reads the live allocations.
#[test]
fn dropped_in_flight_it_detaches_into_the_destination_engines_queue() {
    let sim = machine(2);
    let (mut a, mut b) = engines(&sim, 0, 1);
    let x = upload_tensor(&mut a, &[1.5f32; 4096], &[4096]).unwrap();
    let landing = b.alloc_tensor::<f32>(&[4096]).unwrap();
    let live = sim.device_live().0;
    sim.hold_clock(true);
    drop(peer::copy_pending(&mut a, x, &mut b, landing).unwrap());
    assert_eq!(
        b.retirement_stats().pending,
        1,
        "the carrying engine holds it"
    );
    assert_eq!(a.retirement_stats().pending, 0);
    a.flush().unwrap();
    b.flush().unwrap();
    assert_eq!(
        sim.device_live().0,
        live,
        "neither tensor freed under the copy"
    );
    sim.hold_clock(false);
    b.synchronize().unwrap();
    assert_eq!(b.retirement_stats().released, 1);
    // Each tensor's free is queued on its own engine's stream once the copy is proven.
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert_eq!(sim.device_live().0, live - 2, "both freed once proven");
    drop((a, b));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0);
}

// Simulator-only: reads the leaked allocations.
#[test]
fn forgotten_in_flight_it_is_never_released() {
    let sim = machine(2);
    let (mut a, mut b) = engines(&sim, 0, 1);
    let x = upload_tensor(&mut a, &[3u16; 64], &[64]).unwrap();
    let landing = b.alloc_tensor::<u16>(&[64]).unwrap();
    std::mem::forget(peer::copy_pending(&mut a, x, &mut b, landing).unwrap());
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    drop((a, b));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 2, "both tensors leaked in place");
}

// Simulator-only: injects a failed event.
#[test]
fn a_failed_wait_retains_both_tensors_and_says_why() {
    let sim = machine(2);
    let (mut a, mut b) = engines(&sim, 0, 1);
    let x = upload_tensor(&mut a, &[9u32; 64], &[64]).unwrap();
    let landing = b.alloc_tensor::<u32>(&[64]).unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    // The next event recorded on the machine is the copy's.
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    let err = peer::copy_pending(&mut a, x, &mut b, landing)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::DeviceFault {
                what: "peer copy",
                source: DriverError::LAUNCH_FAILED
            }
        ),
        "{err:?}"
    );
    let _ = b.synchronize();
    assert_eq!(b.retirement_stats().retained, 1);
    drop((a, b));
    assert_eq!(
        sim.device_live().0,
        2,
        "retained for good, even at teardown"
    );
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// The route's driver calls, and the failure each is given in the sweep.
const OPS: [(SimOp, DriverError); 7] = [
    (SimOp::PeerEnable, DriverError::NOT_SUPPORTED),
    (SimOp::CopyPeer, DriverError::INVALID_VALUE),
    (SimOp::EventRecord, DriverError::UNKNOWN),
    (SimOp::StreamWait, DriverError::INVALID_VALUE),
    (SimOp::OrderRecord, DriverError::UNKNOWN),
    (SimOp::StreamSynchronize, DriverError::LAUNCH_FAILED),
    (SimOp::StreamQuery, DriverError::LAUNCH_FAILED),
];

/// The source engine's work still queued at the copy, when `busy`.
fn keep_busy(
    a: &mut CudaEngine,
    busy: bool,
) -> Option<cuferry::Pending<cuferry::pending::Upload<u32>>> {
    busy.then(|| {
        let buffer = PinnedHostBuffer::from_slice(a, &[5u32; 64]).unwrap();
        let tensor = a.alloc_tensor::<u32>(&[64]).unwrap();
        upload_pending(a, buffer, tensor).unwrap()
    })
}

/// One pending copy of 1000 `u32`s from device 0 to 1 with `arm` applied just before it.
/// Returns whether a failure was reported, by the route, its wait or the next boundary of
/// either engine; panics on wrong data, a lost tensor, a violation or a leak.
fn faulted_copy(busy: bool, arm: impl FnOnce(&SimDevice)) -> bool {
    let sim = machine(2);
    sim.set_schedule(Schedule::Interleaved { seed: 11 });
    let (mut a, mut b) = engines(&sim, 0, 1);
    let data: Vec<u32> = (0..1000).map(|i| i * 7 + 1).collect();
    let x = upload_tensor(&mut a, &data, &[1000]).unwrap();
    let y = a.scale(&x, 2).unwrap();
    let queued = keep_busy(&mut a, busy);
    let landing = b.alloc_tensor::<u32>(&[1000]).unwrap();
    arm(&sim);
    let submitted = peer::copy_pending(&mut a, y, &mut b, landing);
    let mut failed = false;
    let mut kept = None;
    match submitted {
        Ok(copy) => {
            let z = b.scale(copy.destination(), 1);
            match copy.wait() {
                Ok(returned) => {
                    let expected: Vec<u32> = data.iter().map(|v| v * 2).collect();
                    match z.and_then(|z| download_tensor(&mut b, &z)) {
                        Ok(got) => assert_eq!(got, expected),
                        Err(_) => failed = true,
                    }
                    kept = Some(returned.into_parts());
                }
                Err(Error::DeviceFault { .. }) => failed = true,
                Err(other) => panic!("an untyped failure: {other:?}"),
            }
        }
        Err(refused) => {
            failed = true;
            assert!(
                matches!(
                    refused.error(),
                    Error::Driver { .. } | Error::DeviceFault { .. } | Error::Deferred { .. }
                ),
                "an untyped failure: {refused:?}"
            );
            let retained = matches!(refused, SubmitError::Retained { .. });
            assert_eq!(
                refused.into_input().is_none(),
                retained,
                "handed back unless retained"
            );
        }
    }
    sim.clear_faults();
    drop((x, queued, kept));
    let reported = [a.synchronize(), b.synchronize()];
    let failed = failed || reported.iter().any(Result::is_err);
    let retained = a.retirement_stats().retained + b.retirement_stats().retained;
    drop((a, b));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    if retained == 0 {
        assert_eq!(sim.device_live().0, 0, "device memory left allocated");
    }
    failed
}

// Simulator-only: injects a fault at every driver call.
#[test]
fn a_fault_at_every_call_of_the_route_is_reported_and_loses_nothing() {
    let mut runs = 0;
    for busy in [false, true] {
        // How often each call runs in a clean copy, from the submission to its wait.
        let counts: Vec<u64> = {
            let sim = machine(2);
            let (mut a, mut b) = engines(&sim, 0, 1);
            let x = upload_tensor(&mut a, &[1u32; 1000], &[1000]).unwrap();
            let y = a.scale(&x, 2).unwrap();
            let queued = keep_busy(&mut a, busy);
            let landing = b.alloc_tensor::<u32>(&[1000]).unwrap();
            let before: Vec<u64> = OPS.iter().map(|&(op, _)| sim.calls(op)).collect();
            let copy = peer::copy_pending(&mut a, y, &mut b, landing).unwrap();
            let z = b.scale(copy.destination(), 1).unwrap();
            drop((copy.wait().unwrap(), z, queued));
            OPS.iter()
                .zip(before)
                .map(|(&(op, _), before)| sim.calls(op) - before)
                .collect()
        };
        assert_eq!(counts[1], 1, "one peer copy");
        for (&(op, error), &count) in OPS.iter().zip(&counts) {
            for n in 1..=count {
                let failed = faulted_copy(busy, |sim| sim.fail_nth(op, n, error));
                // A refused query only makes the route wait on the device when it need not.
                if op != SimOp::StreamQuery {
                    assert!(
                        failed,
                        "busy={busy}: a fault at {op:?} call {n} was not reported"
                    );
                }
                runs += 1;
            }
        }
        for n in 1..=3 {
            let failed = faulted_copy(busy, |sim| sim.fail_event(n, DriverError::LAUNCH_FAILED));
            assert!(
                failed,
                "busy={busy}: an event fault at record {n} was not reported"
            );
            runs += 1;
        }
    }
    assert!(runs >= 12, "only {runs} runs");
}
