//! Peer copies between engines on a simulated machine of several devices: the right bytes for
//! every element type at the size boundaries, between devices and within one; the order kept
//! under interleaved streams; refusals where there is no link; a fault at every driver call of the
//! route reported, with nothing freed under the copy and nothing leaked.

use crate::support::{engines_on as engines, sim_machine as machine};
use cuferry::error::{SetupError, UsageError};
use cuferry::sim::{Schedule, SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, Error, PinnedHostBuffer, download_tensor, error::DriverError, peer, upload_pending,
    upload_tensor,
};

// Written once in `tests/bodies/peer.rs` (the blocking and the pending peer routes), run here on
// the simulated device and by the GPU suite on device 0.
crate::bodies::peer::tests!(sim);

// Simulator-only: counts the peer-access driver calls.
#[test]
fn peer_access_is_enabled_once_per_pair_and_reported() {
    let sim = machine(2);
    let (mut a, mut b) = engines(&sim, 0, 1);
    assert!(peer::access(&mut a, &b).unwrap());
    assert!(peer::access(&mut a, &b).unwrap());
    let x = upload_tensor(&mut a, &[1u32, 2, 3], &[3]).unwrap();
    drop(peer::copy(&mut a, &x, &mut b).unwrap());
    drop(peer::copy(&mut a, &x, &mut b).unwrap());
    // One direction, once: the context's access, and the other engine's pool's.
    assert_eq!(sim.calls(SimOp::PeerEnable), 2);
    assert!(peer::access(&mut b, &a).unwrap());
    assert_eq!(sim.calls(SimOp::PeerEnable), 4);
    // Two engines on one device need no peer access.
    let mut c = CudaEngine::simulated_on_device(&sim, 1).unwrap();
    assert!(peer::access(&mut b, &c).unwrap());
    let seven = upload_tensor(&mut b, &[7u8], &[1]).unwrap();
    drop(peer::copy(&mut b, &seven, &mut c).unwrap());
    assert_eq!(sim.calls(SimOp::PeerEnable), 4);
    // Another engine on a linked device has a pool of its own to grant; the contexts' access
    // is already enabled.
    assert!(peer::access(&mut a, &c).unwrap());
    assert_eq!(sim.calls(SimOp::PeerEnable), 5);
}

// Simulator-only: removes the peer link (`set_peer_link`).
#[test]
fn without_a_link_the_copy_is_refused_and_the_staged_copy_is_taken_by_name() {
    let sim = machine(2);
    sim.set_peer_link(0, 1, false);
    let (mut a, mut b) = engines(&sim, 0, 1);
    assert!(!peer::access(&mut a, &b).unwrap());
    let data = vec![1.5f32, 2.5, 3.5];
    let x = upload_tensor(&mut a, &data, &[3]).unwrap();
    let copies = sim.calls(SimOp::CopyPeer);
    let refused = peer::copy(&mut a, &x, &mut b);
    assert!(
        matches!(refused, Err(Error::Setup(SetupError::Unreachable { from, to, .. })) if from == b.device() && to == a.device()),
        "{refused:?}"
    );
    assert_eq!(sim.calls(SimOp::CopyPeer), copies, "nothing queued");
    let staged = peer::copy_staged(&mut a, &x, &mut b).unwrap();
    assert_eq!(download_tensor(&mut b, &staged).unwrap(), data);
    // Separate machines share nothing at all.
    let mut other = CudaEngine::simulated(SimConfig::default());
    assert!(matches!(
        peer::copy(&mut a, &x, &mut other),
        Err(Error::Setup(SetupError::Unreachable { .. }))
    ));
    assert!(matches!(
        peer::access(&mut a, &other),
        Err(Error::Setup(SetupError::Unreachable { .. }))
    ));
    // A tensor of another engine is refused before anything else.
    assert!(matches!(
        peer::copy(&mut b, &x, &mut a),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    let (mut c, mut d) = engines(&sim, 0, 0);
    let mut other = c.alloc_tensor::<f32>(&[3]).unwrap();
    assert!(matches!(
        peer::copy_into(&mut a, &x, &mut d, &mut other),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    let mut short = d.alloc_tensor::<f32>(&[2]).unwrap();
    assert!(matches!(
        peer::copy_into(&mut a, &x, &mut d, &mut short),
        Err(Error::Usage(UsageError::LengthMismatch {
            found: 3,
            expected: 2,
            ..
        }))
    ));
    let mut unlinked = b.alloc_tensor::<f32>(&[3]).unwrap();
    assert!(matches!(
        peer::copy_into(&mut a, &x, &mut b, &mut unlinked),
        Err(Error::Setup(SetupError::Unreachable { .. }))
    ));
    drop((other, short, unlinked, c));
}

// Simulator-only: removes the peer link after first use.
/// A link removed after the pair's first copy: the next copy on each route is refused as
/// unreachable (not as the driver's refusal), the pair is asked again from then on (refused
/// with nothing queued), and once the link is back the copies run again.
#[test]
fn a_link_removed_after_first_use_is_unreachable_and_asked_again() {
    let sim = machine(2);
    let (mut a, mut b) = engines(&sim, 0, 1);
    let data = vec![1u32, 2, 3];
    let x = upload_tensor(&mut a, &data, &[3]).unwrap();
    let mut landing = b.alloc_tensor::<u32>(&[3]).unwrap();
    // First use of both directions: access asked, enabled and remembered.
    drop(peer::copy(&mut a, &x, &mut b).unwrap());
    let pending = cuferry::peer::copy_pending(&mut a, x, &mut b, landing).unwrap();
    let (x, back) = pending.wait().unwrap().into_parts();
    landing = back;
    sim.set_peer_link(0, 1, false);
    let unreachable = |e: &Error, reached: &CudaEngine, reaching: &CudaEngine| {
        matches!(e, Error::Setup(SetupError::Unreachable { from, to, reason })
            if *from == reached.device() && *to == reaching.device() && reason.contains("peer link"))
    };
    // The remembered pair: the copy reaches the driver, whose refusal says why.
    let e = peer::copy(&mut a, &x, &mut b).unwrap_err();
    assert!(unreachable(&e, &b, &a), "{e:?}");
    // Asked again: refused before the copy is queued.
    let copies = sim.calls(SimOp::CopyPeer);
    let e = peer::copy_into(&mut a, &x, &mut b, &mut landing).unwrap_err();
    assert!(unreachable(&e, &b, &a), "{e:?}");
    assert!(!peer::access(&mut a, &b).unwrap());
    assert_eq!(sim.calls(SimOp::CopyPeer), copies, "nothing queued");
    // The pending route, carried by the destination engine: its remembered pair too.
    let refused = cuferry::peer::copy_pending(&mut a, x, &mut b, landing).unwrap_err();
    assert!(unreachable(refused.error(), &a, &b), "{refused:?}");
    assert!(
        matches!(refused, cuferry::SubmitError::Rejected { .. }),
        "{refused:?}"
    );
    let package = refused.into_input().unwrap();
    let (x, landing) = (package.0, package.1);
    assert!(!peer::access(&mut b, &a).unwrap());
    // Linked again: both directions copy, asked once more.
    sim.set_peer_link(0, 1, true);
    let there = peer::copy(&mut a, &x, &mut b).unwrap();
    assert_eq!(download_tensor(&mut b, &there).unwrap(), data);
    let copy = cuferry::peer::copy_pending(&mut a, x, &mut b, landing).unwrap();
    let (_, landing) = copy.wait().unwrap().into_parts();
    assert_eq!(download_tensor(&mut b, &landing).unwrap(), data);
    drop((there, landing));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

// Simulator-only: runs every interleaving of the streams under the race checker.
/// Under interleaved streams: a kernel writes the source, the copy takes it, a later fill
/// overwrites the source, and a kernel on the other engine reads the copy. The copy holds the
/// kernel's values, the fill never reaches it, and the race checker finds nothing.
#[test]
fn the_copy_keeps_the_order_of_both_engines_under_every_interleaving() {
    for seed in 0..32 {
        let sim = machine(2);
        sim.set_schedule(Schedule::Interleaved { seed });
        let (mut a, mut b) = engines(&sim, 0, 1);
        let data: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        let x = upload_tensor(&mut a, &data, &[4096]).unwrap();
        let mut y = a.scale(&x, 3.0).unwrap();
        let there = peer::copy(&mut a, &y, &mut b).unwrap();
        a.fill(&mut y, -1.0).unwrap();
        let z = b.scale(&there, 2.0).unwrap();
        let expected: Vec<f32> = data.iter().map(|v| v * 6.0).collect();
        assert_eq!(
            download_tensor(&mut b, &z).unwrap(),
            expected,
            "seed {seed}"
        );
        assert!(
            download_tensor(&mut a, &y)
                .unwrap()
                .iter()
                .all(|&v| v == -1.0)
        );
        // A source still being uploaded on the other stream: the copy waits for it.
        let buffer = PinnedHostBuffer::from_slice(&mut a, &data).unwrap();
        let fresh = a.alloc_tensor::<f32>(&[4096]).unwrap();
        let in_flight = upload_pending(&mut a, buffer, fresh).unwrap();
        let landed = peer::copy(&mut a, in_flight.tensor(), &mut b).unwrap();
        assert_eq!(
            download_tensor(&mut b, &landed).unwrap(),
            data,
            "seed {seed}"
        );
        drop(in_flight.wait().unwrap());
        drop((x, y, there, z, landed));
        drop((a, b));
        assert!(
            sim.violations().is_empty(),
            "seed {seed}: {:?}",
            sim.violations()
        );
        assert_eq!(sim.device_live().0, 0, "seed {seed}");
    }
}

/// The route's driver calls, and the failure each is given in the sweep.
const OPS: [(SimOp, DriverError); 8] = [
    (SimOp::Alloc, DriverError::INVALID_VALUE),
    (SimOp::PeerEnable, DriverError::NOT_SUPPORTED),
    (SimOp::CopyPeer, DriverError::INVALID_VALUE),
    (SimOp::EventRecord, DriverError::UNKNOWN),
    (SimOp::EventSynchronize, DriverError::LAUNCH_FAILED),
    (SimOp::StreamWait, DriverError::INVALID_VALUE),
    (SimOp::OrderRecord, DriverError::UNKNOWN),
    (SimOp::StreamSynchronize, DriverError::LAUNCH_FAILED),
];

/// The destination engine's work still queued at the copy, when `busy` (so the copy waits for
/// its allocation on the device instead of finding the engine idle).
fn keep_busy(
    b: &mut CudaEngine,
    busy: bool,
) -> Option<cuferry::Pending<cuferry::pending::Upload<u32>>> {
    busy.then(|| {
        let buffer = PinnedHostBuffer::from_slice(b, &[5u32; 64]).unwrap();
        let tensor = b.alloc_tensor::<u32>(&[64]).unwrap();
        upload_pending(b, buffer, tensor).unwrap()
    })
}

/// One copy of 1000 `u32`s from device 0 to 1 with `arm` applied after the source is uploaded.
/// Returns whether a failure was reported, by the route or at the next boundary of either
/// engine; panics on wrong data, a violation or a leak.
fn faulted_copy(busy: bool, into: bool, arm: impl FnOnce(&SimDevice)) -> bool {
    let sim = machine(2);
    sim.set_schedule(Schedule::Interleaved { seed: 7 });
    let (mut a, mut b) = engines(&sim, 0, 1);
    let data: Vec<u32> = (0..1000).map(|i| i * 7 + 1).collect();
    let x = upload_tensor(&mut a, &data, &[1000]).unwrap();
    let mut y = a.scale(&x, 2).unwrap();
    let queued = keep_busy(&mut b, busy);
    let mut existing = into.then(|| b.alloc_tensor::<u32>(&[1000]).unwrap());
    arm(&sim);
    let outcome = match &mut existing {
        Some(dst) => peer::copy_into(&mut a, &y, &mut b, dst).map(|()| existing.take().unwrap()),
        None => peer::copy(&mut a, &y, &mut b),
    };
    sim.clear_faults();
    let failed = match outcome {
        Ok(there) => {
            let expected: Vec<u32> = data.iter().map(|v| v * 2).collect();
            assert_eq!(download_tensor(&mut b, &there).unwrap(), expected);
            false
        }
        Err(
            Error::Driver { .. }
            | Error::DeviceFault { .. }
            | Error::Deferred { .. }
            | Error::Setup(SetupError::Unreachable { .. }),
        ) => true,
        Err(other) => panic!("an untyped failure: {other:?}"),
    };
    // The source is overwritten and freed right after: never under the copy.
    let _ = a.fill(&mut y, 0);
    drop((x, y, queued, existing));
    let reported = [a.synchronize(), b.synchronize()];
    let failed = failed || reported.iter().any(Result::is_err);
    drop((a, b));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0, "device memory left allocated");
    failed
}

// Simulator-only: injects a fault at every driver call.
#[test]
fn a_fault_at_every_call_of_the_route_is_reported_and_loses_nothing() {
    let mut runs = 0;
    for (busy, into) in [(false, false), (true, false), (false, true), (true, true)] {
        // How often each call runs in a clean copy.
        let counts: Vec<u64> = {
            let sim = machine(2);
            let (mut a, mut b) = engines(&sim, 0, 1);
            let x = upload_tensor(&mut a, &[1u32; 1000], &[1000]).unwrap();
            let y = a.scale(&x, 2).unwrap();
            let queued = keep_busy(&mut b, busy);
            let mut existing = b.alloc_tensor::<u32>(&[1000]).unwrap();
            let before: Vec<u64> = OPS.iter().map(|&(op, _)| sim.calls(op)).collect();
            if into {
                peer::copy_into(&mut a, &y, &mut b, &mut existing).unwrap();
            } else {
                drop(peer::copy(&mut a, &y, &mut b).unwrap());
            }
            drop((queued, existing));
            OPS.iter()
                .zip(before)
                .map(|(&(op, _), before)| sim.calls(op) - before)
                .collect()
        };
        assert_eq!(counts[2], 1, "one peer copy per route");
        for (&(op, error), &count) in OPS.iter().zip(&counts) {
            for n in 1..=count {
                let failed = faulted_copy(busy, into, |sim| sim.fail_nth(op, n, error));
                assert!(
                    failed,
                    "busy={busy} into={into}: a fault at {op:?} call {n} was not reported"
                );
                runs += 1;
            }
        }
        // A device fault of the work the copy follows (the next recorded event fails when
        // reached).
        for n in 1..=counts[3] {
            let failed = faulted_copy(busy, into, |sim| {
                sim.fail_event(n, DriverError::LAUNCH_FAILED)
            });
            assert!(
                failed,
                "busy={busy} into={into}: an event fault at record {n} was not reported"
            );
            runs += 1;
        }
    }
    assert!(runs >= 24, "only {runs} runs");
}

// Simulator-only: injects a driver panic.
/// A driver panic at any of the proving calls of a peer route (after the copy is queued) unwinds
/// without freeing either side under the copy: the new destination of `peer::copy` and the
/// existing one of `peer::copy_into` are leaked, and a pending copy's tensors never reach a free.
#[test]
fn a_panic_after_the_copy_is_queued_frees_nothing_under_it() {
    for route in 0..3 {
        for seed in 0..16 {
            let sim = machine(2);
            sim.set_schedule(Schedule::Interleaved { seed });
            let (mut a, mut b) = engines(&sim, 0, 1);
            let x = upload_tensor(&mut a, &[3u32; 4096], &[4096]).unwrap();
            let mut existing = b.alloc_tensor::<u32>(&[4096]).unwrap();
            a.synchronize().unwrap();
            b.synchronize().unwrap();
            sim.hold_clock(true);
            sim.panic_nth(
                match route {
                    2 => SimOp::EventRecord,
                    _ => SimOp::StreamSynchronize,
                },
                1,
            );
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match route {
                0 => drop(peer::copy(&mut a, &x, &mut b)),
                1 => drop(peer::copy_into(&mut a, &x, &mut b, &mut existing)),
                _ => {
                    let landing = b.alloc_tensor::<u32>(&[4096]).unwrap();
                    let x = upload_tensor(&mut a, &[5u32; 4096], &[4096]).unwrap();
                    drop(cuferry::peer::copy_pending(&mut a, x, &mut b, landing));
                }
            }));
            assert!(
                unwound.is_err(),
                "route {route}: the driver's panic surfaces"
            );
            sim.clear_faults();
            // The caller's tensors go; the held clock then runs in every order it allows.
            drop((x, existing));
            sim.hold_clock(false);
            let _ = (a.synchronize(), b.synchronize());
            drop((a, b));
            sim.advance_all();
            assert!(
                sim.violations().is_empty(),
                "route {route}, seed {seed}: {:?}",
                sim.violations()
            );
        }
    }
}
