//! The lifecycles behind every route, on either device: staging leases under pressure and the
//! errors that name what was wrong.

use super::Device;
use crate::support::distinct_u32 as distinct;
use cuferry::error::{StagingError, UsageError};
use cuferry::{Error, SubmitError, download_tensor, staging::StagingConfig, upload_tensor};

/// Leases a caller holds, or forgets, draw on their own budget: the blocking routes go on.
pub(crate) fn held_and_forgotten_leases_never_starve_the_blocking_routes(dev: Device) {
    let mut engine = dev.engine();
    let mut config = StagingConfig::default();
    config.chunk_bytes = 4096;
    config.cutoff_bytes = 1024;
    config.ring_depth = 2;
    engine.set_staging_config(config).unwrap();
    let held = engine.staging_lease().unwrap();
    std::mem::forget(engine.staging_lease().unwrap());
    assert!(matches!(
        engine.staging_lease(),
        Err(Error::Staging(StagingError::Exhausted { depth: 2 }))
    ));
    let data = distinct(10_000); // ten chunks
    for _ in 0..3 {
        let t = upload_tensor(&mut engine, &data, &[data.len()]).unwrap();
        assert_eq!(download_tensor(&mut engine, &t).unwrap(), data);
        engine.synchronize().unwrap();
    }
    held.release();
    let again = engine.staging_lease().unwrap();
    again.release();
}

/// Error messages state the values and the limit they broke; the shape check does not depend on
/// the order of the dimensions.
pub(crate) fn errors_name_the_values_and_the_shape_check_is_order_independent(dev: Device) {
    let mut engine = dev.engine();
    let t = engine.alloc_tensor::<u8>(&[16]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let capacity = lease.capacity();
    let big = engine.alloc_tensor::<u8>(&[capacity + 8]).unwrap();
    let lease = match lease.begin_download(&mut engine, &big, 0, capacity + 8) {
        Err(SubmitError::Rejected {
            input: lease,
            error,
        }) => {
            let message = error.to_string();
            assert!(
                message.contains(&format!("{}", capacity + 8))
                    && message.contains(&format!("{capacity}")),
                "{message}"
            );
            lease
        }
        other => panic!("expected a refusal, got {other:?}"),
    };
    match lease.begin_download(&mut engine, &t, usize::MAX, 1) {
        Err(SubmitError::Rejected {
            input: lease,
            error,
        }) => {
            let message = error.to_string();
            assert!(message.contains(&usize::MAX.to_string()), "{message}");
            assert!(message.contains("16 element"), "{message}");
            lease.release();
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Zero dimensions make an empty tensor whatever the other dimensions are, in any order.
    for shape in [[0, usize::MAX, 2], [usize::MAX, 2, 0], [2, 0, usize::MAX]] {
        let t = engine.alloc_tensor::<u8>(&shape).unwrap();
        assert!(t.is_empty(), "{shape:?}");
    }
    // Without a zero, an overflowing product is refused in any order, naming the shape.
    for shape in [[usize::MAX, 2, 3], [3, 2, usize::MAX], [2, usize::MAX, 3]] {
        match engine.alloc_tensor::<u8>(&shape) {
            Err(e @ Error::Usage(UsageError::ShapeOverflow { .. })) => {
                assert!(e.to_string().contains(&format!("{shape:?}")), "{e}")
            }
            other => panic!("{shape:?}: expected ShapeOverflow, got {other:?}"),
        }
    }
    // A byte size past the addressable limit names the count and the element size.
    match engine.alloc_tensor::<u64>(&[usize::MAX / 4]) {
        Err(e @ Error::Usage(UsageError::SizeOverflow { .. })) => {
            let message = e.to_string();
            assert!(message.contains(&(usize::MAX / 4).to_string()), "{message}");
            assert!(message.contains("8 byte"), "{message}");
        }
        other => panic!("expected SizeOverflow, got {other:?}"),
    }
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; lifecycle::{
            held_and_forgotten_leases_never_starve_the_blocking_routes,
            errors_name_the_values_and_the_shape_check_is_order_independent,
        });
    };
}
pub(crate) use tests;
