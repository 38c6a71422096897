//! The engine's rules, on either device.

use super::Device;
use crate::support::distinct_f32 as distinct;
use cuferry::error::UsageError;
use cuferry::{DType, Error, download_tensor, download_tensor_into, upload_tensor};

pub(crate) fn open_flush_synchronize_and_drop(dev: Device) {
    let mut engine = dev.engine();
    assert!(!engine.device_name().is_empty());
    let x = upload_tensor(&mut engine, &distinct(1 << 16), &[256, 256]).unwrap();
    let _y = engine.copy_tensor(&x).unwrap();
    engine.flush().unwrap();
    engine.synchronize().unwrap();
    let sim = engine.sim();
    drop(engine);
    // A tensor that outlives its engine is still freed on its device.
    drop(x);
    if let Some(sim) = sim {
        sim.advance_all();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }
}

pub(crate) fn device_to_device_copy_round_trips_distinct_values(dev: Device) {
    let mut engine = dev.engine();
    for n in [0usize, 1, 2, 1000, (1 << 20) + 3] {
        let data = distinct(n);
        let x = upload_tensor(&mut engine, &data, &[n]).unwrap();
        let y = engine.copy_tensor(&x).unwrap();
        drop(x);
        assert_eq!(download_tensor(&mut engine, &y).unwrap(), data, "n = {n}");
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn a_device_to_device_copy_round_trips(dev: Device) {
    let mut engine = dev.engine();
    let data = distinct(1000);
    let x = upload_tensor(&mut engine, &data, &[10, 100]).unwrap();
    let y = engine.copy_tensor(&x).unwrap();
    assert_eq!(y.shape(), &[10, 100]);
    assert_eq!(y.dtype(), DType::F32);
    drop(x);
    assert_eq!(download_tensor(&mut engine, &y).unwrap(), data);
}

pub(crate) fn a_copy_into_a_shorter_tensor_is_refused(dev: Device) {
    let mut engine = dev.engine();
    let x = upload_tensor(&mut engine, &distinct(8), &[8]).unwrap();
    let mut y = engine.alloc_tensor::<f32>(&[7]).unwrap();
    assert!(matches!(
        engine.copy_into(&x, &mut y),
        Err(Error::Usage(UsageError::LengthMismatch {
            found: 8,
            expected: 7,
            ..
        }))
    ));
}

pub(crate) fn a_shape_that_does_not_match_the_data_is_refused(dev: Device) {
    let mut engine = dev.engine();
    let err = upload_tensor(&mut engine, &distinct(6), &[2, 4]).unwrap_err();
    assert!(matches!(
        err,
        Error::Usage(UsageError::LengthMismatch {
            expected: 8,
            found: 6,
            ..
        })
    ));
    assert!(err.to_string().contains("[2, 4]"), "{err}");
}

pub(crate) fn tensors_of_another_engine_are_refused(dev: Device) {
    let mut a = dev.engine();
    let mut b = dev.engine();
    let x = upload_tensor(&mut a, &distinct(4), &[4]).unwrap();
    assert!(matches!(
        download_tensor(&mut b, &x),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    // Simulator only: a second engine on the tensor's own simulated device is another engine.
    if let Some(sim) = a.sim() {
        let mut c = cuferry::CudaEngine::simulated_on(&sim);
        assert!(matches!(
            download_tensor(&mut c, &x),
            Err(Error::Usage(UsageError::WrongEngine { .. }))
        ));
    }
}

pub(crate) fn with_raw_refuses_another_engines_tensor(dev: Device) {
    let mut a = dev.engine();
    let mut b = dev.engine();
    let x = upload_tensor(&mut a, &distinct(4), &[4]).unwrap();
    let r = b.with_raw(|raw| raw.device_ptr(&x).map(|p| p.bytes()));
    assert!(matches!(
        r,
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
}

pub(crate) fn zero_and_one_element_tensors_round_trip(dev: Device) {
    let mut engine = dev.engine();
    let empty = upload_tensor::<f64>(&mut engine, &[], &[0]).unwrap();
    assert!(empty.is_empty());
    assert_eq!(
        download_tensor(&mut engine, &empty).unwrap(),
        Vec::<f64>::new()
    );
    let one = upload_tensor(&mut engine, &[7.5f64], &[]).unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(download_tensor(&mut engine, &one).unwrap(), [7.5]);
}

pub(crate) fn bool_tensors_are_decoded_and_refused_by_download_into(dev: Device) {
    let mut engine = dev.engine();
    let data: Vec<bool> = (0..33).map(|i| i % 3 == 0).collect();
    let t = upload_tensor(&mut engine, &data, &[33]).unwrap();
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), data);
    let mut mine = Vec::with_capacity(7);
    mine.push(true);
    let err = download_tensor_into(&mut engine, &t, mine).unwrap_err();
    assert!(matches!(
        err.error(),
        Error::Usage(UsageError::UnsupportedElement {
            dtype: DType::Bool,
            ..
        })
    ));
    let mine = err.into_input().expect("handed back");
    assert_eq!(
        (mine.as_slice(), mine.capacity()),
        (&[true][..], 7),
        "handed back untouched"
    );
}

pub(crate) fn reshape_keeps_the_element_count(dev: Device) {
    let mut engine = dev.engine();
    let t = upload_tensor(&mut engine, &distinct(12), &[3, 4]).unwrap();
    let t = t.reshape(&[2, 6]).unwrap();
    assert_eq!(t.shape(), &[2, 6]);
    let refused = t.reshape(&[5]).unwrap_err();
    assert!(matches!(
        refused.error(),
        Error::Usage(UsageError::LengthMismatch { .. })
    ));
    let t = refused.into_input().expect("handed back");
    assert_eq!(t.shape(), &[2, 6], "handed back unchanged");
    // A zero dimension holds no elements, whatever the others are: a mismatch.
    let refused = t.reshape(&[usize::MAX, 2, 0, 3]).unwrap_err();
    assert!(
        matches!(
            refused.error(),
            Error::Usage(UsageError::LengthMismatch { expected: 0, .. })
        ),
        "{refused}"
    );
    // A product past usize is the shape's overflow.
    let refused = refused
        .into_input()
        .expect("handed back")
        .reshape(&[usize::MAX, 2, 3])
        .unwrap_err();
    assert!(
        matches!(refused.error(), Error::Usage(UsageError::ShapeOverflow { shape }) if shape == &[usize::MAX, 2, 3]),
        "{refused}"
    );
    assert_eq!(
        download_tensor(&mut engine, &refused.into_input().expect("handed back"))
            .unwrap()
            .len(),
        12
    );
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; engine::{
            a_device_to_device_copy_round_trips,
            a_copy_into_a_shorter_tensor_is_refused,
            a_shape_that_does_not_match_the_data_is_refused,
            tensors_of_another_engine_are_refused,
            open_flush_synchronize_and_drop,
            device_to_device_copy_round_trips_distinct_values,
            with_raw_refuses_another_engines_tensor,
            zero_and_one_element_tensors_round_trip,
            bool_tensors_are_decoded_and_refused_by_download_into,
            reshape_keeps_the_element_count,
        });
    };
}
pub(crate) use tests;
