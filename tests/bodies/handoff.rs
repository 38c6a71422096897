//! The in-flight handoff, on either device: a transfer still in flight belongs to its engine.

use super::Device;
use cuferry::error::UsageError;
use cuferry::{Error, PinnedHostBuffer, download_tensor, upload_pending};

pub(crate) fn another_engine_refuses_an_in_flight_tensor(dev: Device) {
    let mut engine = dev.engine();
    let mut other = dev.engine();
    let other_sim = other.sim();
    let source = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0]).unwrap();
    let destination = engine.alloc_tensor::<f32>(&[2]).unwrap();
    let upload = upload_pending(&mut engine, source, destination).unwrap();
    // Simulator only: what the other engine has queued is read from its device.
    let queued = other_sim.as_ref().map(|sim| sim.queued());
    assert!(matches!(
        other.copy_tensor(upload.tensor()),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    assert!(matches!(
        other.add(upload.tensor(), upload.tensor()),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    assert!(matches!(
        download_tensor(&mut other, upload.tensor()),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    assert_eq!(
        other_sim.as_ref().map(|sim| sim.queued()),
        queued,
        "the other engine queued nothing"
    );
    let upload = upload.wait().unwrap();
    assert_eq!(
        download_tensor(&mut engine, upload.tensor()).unwrap(),
        [1.0, 2.0]
    );
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; handoff::{
            another_engine_refuses_an_in_flight_tensor,
        });
    };
}
pub(crate) use tests;
