//! Regression tests for lifecycle bugs found by the model tests, each reduced to its scenario.

use cuferry::sim::{SimConfig, SimOp};
use cuferry::{upload_pending, CudaEngine, PinnedHostBuffer, RejectReason, TransferSubmitError};

fn distinct(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 1.5 + 0.25).collect()
}

/// A returned transfer resubmitted on an engine of another device is refused; the transfer's
/// event belongs to the engine that made it and must go back to that engine's pool, not into
/// the refusing engine's, whose driver does not know it.
#[test]
fn a_refused_resubmission_does_not_hand_its_event_to_the_refusing_engine() {
    let mut a = CudaEngine::simulated(SimConfig::default());
    let mut b = CudaEngine::simulated(SimConfig::default());
    let buffer = PinnedHostBuffer::from_slice(&mut a, &distinct(4)).unwrap();
    let tensor = a.alloc_tensor::<f32>(&[4]).unwrap();
    let returned = upload_pending(&mut a, buffer, tensor)
        .unwrap()
        .wait()
        .unwrap();
    let refused = returned.resubmit(&mut b).unwrap_err();
    assert!(matches!(
        refused,
        TransferSubmitError::Rejected {
            reason: RejectReason::WrongDevice { .. },
            ..
        }
    ));
    drop(refused);

    // The refusing engine's own transfers record events of its own device.
    let sim_b = b.sim().unwrap();
    let buffer = PinnedHostBuffer::from_slice(&mut b, &distinct(4)).unwrap();
    let tensor = b.alloc_tensor::<f32>(&[4]).unwrap();
    let pending = upload_pending(&mut b, buffer, tensor).expect("b's own upload is queued");
    assert_eq!(sim_b.calls(SimOp::EventCreate), 1, "b made its own event");
    let (_buffer, _tensor) = pending.wait().unwrap().into_parts();
}

/// The same, between two engines of one device (refused for the wrong engine): the event goes
/// back to the engine that made it, which reuses it.
#[test]
fn a_refused_resubmission_returns_its_event_to_its_own_engine() {
    let mut a = CudaEngine::simulated(SimConfig::default());
    let mut b = CudaEngine::simulated_on(&a.sim().unwrap());
    let buffer = PinnedHostBuffer::from_slice(&mut a, &distinct(4)).unwrap();
    let tensor = a.alloc_tensor::<f32>(&[4]).unwrap();
    let returned = upload_pending(&mut a, buffer, tensor)
        .unwrap()
        .wait()
        .unwrap();
    let refused = returned.resubmit(&mut b).unwrap_err();
    assert!(matches!(
        refused,
        TransferSubmitError::Rejected {
            reason: RejectReason::WrongEngine { .. },
            ..
        }
    ));
    let package = refused.into_package().unwrap();
    let (_buffer, _tensor) = upload_pending(&mut a, package.buffer, package.tensor)
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_eq!(a.events_created(), 1, "a reused its own event");
    assert_eq!(b.events_created(), 0);
}
