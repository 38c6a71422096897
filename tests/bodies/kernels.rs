//! Elementwise kernels, on either device: results against the host reference for every element
//! type each operation serves and every cast, typed refusals, the per-engine kernel cache, and a
//! chain of dependent kernels in stream order.

use super::Device;
use crate::support::{Reference, Rng, check_casts_from, check_ops};
use cuferry::error::UsageError;
use cuferry::sim::SimOp;
use cuferry::{CudaEngine, Error, download_tensor, upload_tensor};

fn ops_for<T: Reference>(dev: Device, seed: u64) {
    let mut engine = dev.engine();
    let mut rng = Rng::new(seed);
    for n in [0, 1, 2, 255, 256, 257, 1000, 100_003] {
        check_ops::<T>(&mut engine, &mut rng, n);
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn every_operation_matches_the_host_reference_for_every_element(dev: Device) {
    let mut seed = 1000;
    crate::for_each_element!(T => {
        seed += 1;
        ops_for::<T>(dev, seed);
    });
}

pub(crate) fn every_cast_matches_the_host_reference(dev: Device) {
    let mut engine = dev.engine();
    let mut rng = Rng::new(2000);
    crate::for_each_element!(T => {
        for n in [1, 300, 4099] {
            check_casts_from::<T>(&mut engine, &mut rng, n);
        }
    });
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn a_chain_of_dependent_adds_runs_without_a_host_wait_and_in_order(dev: Device) {
    let mut engine = dev.engine();
    let mut rng = Rng::new(3000);
    let n = 1 << 20;
    let host: Vec<f32> = (0..n).map(|_| (rng.unit() * 4.0) as f32).collect();
    let seed = upload_tensor(&mut engine, &host, &[n]).unwrap();
    let mut state = engine.add(&seed, &seed).unwrap();
    for _ in 0..9 {
        state = engine.add(&state, &state).unwrap();
    }
    engine.flush().unwrap();
    let got = download_tensor(&mut engine, &state).unwrap();
    let want: Vec<f32> = host.iter().map(|x| x * 1024.0).collect();
    assert_eq!(got, want);
    assert_eq!(engine.cached_kernels(), 1);
    Device::no_violations(&engine);
}

pub(crate) fn kernels_compile_once_per_engine_and_operation(dev: Device) {
    let mut engines = dev.engines(2);
    let (mut other, mut engine) = (engines.pop().unwrap(), engines.pop().unwrap());
    let sim = engine.sim();
    // Simulator only: the module loads are counted.
    let loads = || sim.as_ref().map(|sim| sim.calls(SimOp::ModuleLoad));
    let a = upload_tensor(&mut engine, &[1.0f64, 2.0], &[2]).unwrap();
    let before = loads();
    for _ in 0..4 {
        let _ = engine.add(&a, &a).unwrap();
    }
    assert_eq!(
        loads().zip(before).map(|(l, b)| l - b),
        sim.as_ref().map(|_| 1)
    );
    assert_eq!(engine.cached_kernels(), 1);
    let _ = engine.mul(&a, &a).unwrap();
    let _ = engine.cast::<f32>(&a).unwrap();
    let _ = engine.cast::<i32>(&a).unwrap();
    assert_eq!(
        loads().zip(before).map(|(l, b)| l - b),
        sim.as_ref().map(|_| 4)
    );
    assert_eq!(engine.cached_kernels(), 4);

    // A second engine on the same device compiles its own.
    let b = upload_tensor(&mut other, &[1.0f64], &[1]).unwrap();
    let _ = other.add(&b, &b).unwrap();
    assert_eq!(other.cached_kernels(), 1);
}

/// The kernel launches queued so far: counted on the simulator, `None` on a GPU.
fn launches(engine: &CudaEngine) -> Option<u64> {
    engine.sim().map(|sim| sim.calls(SimOp::Launch))
}

pub(crate) fn empty_tensors_queue_nothing(dev: Device) {
    let mut engine = dev.engine();
    let a = upload_tensor::<f32>(&mut engine, &[], &[0, 3]).unwrap();
    let before = launches(&engine);
    let out = engine.add(&a, &a).unwrap();
    assert_eq!(out.shape(), [0, 3]);
    assert_eq!(launches(&engine), before);
    assert!(download_tensor(&mut engine, &out).unwrap().is_empty());
}

pub(crate) fn mismatched_shapes_are_refused_before_anything_is_queued(dev: Device) {
    let mut engine = dev.engine();
    let a = upload_tensor(&mut engine, &[1.0f32; 6], &[2, 3]).unwrap();
    let b = upload_tensor(&mut engine, &[1.0f32; 6], &[3, 2]).unwrap();
    let before = launches(&engine);
    match engine.add(&a, &b) {
        // Shapes that do not broadcast (issue 37: `add` broadcasts, so the refusal names the
        // dimension that disagrees as well as both shapes).
        Err(Error::Usage(UsageError::NotBroadcastable {
            operation,
            left,
            right,
            dim,
        })) => {
            assert_eq!(
                (operation, left, right, dim),
                ("add", vec![2, 3], vec![3, 2], 0)
            );
        }
        other => panic!("expected NotBroadcastable, got {other:?}"),
    }
    assert_eq!(launches(&engine), before);
}

pub(crate) fn unsupported_elements_are_typed_errors_naming_operation_and_type(dev: Device) {
    let mut engine = dev.engine();
    let flags = upload_tensor(&mut engine, &[true, false], &[2]).unwrap();
    let err = engine.add(&flags, &flags).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Usage(UsageError::UnsupportedElement {
                operation: "add",
                dtype: cuferry::DType::Bool,
                ..
            })
        ),
        "{err:?}"
    );
    let ints = upload_tensor(&mut engine, &[4u16, 2], &[2]).unwrap();
    let err = engine.div(&ints, &ints).unwrap_err();
    assert!(
        err.to_string()
            .contains("div does not support element type u16"),
        "{err}"
    );
    let err = engine.neg(&ints).unwrap_err();
    assert!(matches!(
        err,
        Error::Usage(UsageError::UnsupportedElement {
            operation: "neg",
            ..
        })
    ));
    // Fill and cast serve bool.
    let mut t = engine.copy_tensor(&flags).unwrap();
    engine.fill(&mut t, true).unwrap();
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), [true, true]);
    let as_int = engine.cast::<i64>(&flags).unwrap();
    assert_eq!(download_tensor(&mut engine, &as_int).unwrap(), [1, 0]);
}

pub(crate) fn another_engines_tensor_is_refused(dev: Device) {
    let mut one = dev.engine();
    let mut two = dev.engine();
    let a = upload_tensor(&mut one, &[1.0f32], &[1]).unwrap();
    let b = upload_tensor(&mut two, &[1.0f32], &[1]).unwrap();
    assert!(matches!(
        one.add(&a, &b),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    // A second engine on the tensor's own device is another engine too.
    let mut three = dev.engines(1).pop().unwrap();
    if let Some(sim) = one.sim() {
        three = CudaEngine::simulated_on(&sim);
    }
    assert!(matches!(
        three.neg(&a),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; kernels::{
            every_operation_matches_the_host_reference_for_every_element,
            every_cast_matches_the_host_reference,
            a_chain_of_dependent_adds_runs_without_a_host_wait_and_in_order,
            kernels_compile_once_per_engine_and_operation,
            empty_tensors_queue_nothing,
            mismatched_shapes_are_refused_before_anything_is_queued,
            unsupported_elements_are_typed_errors_naming_operation_and_type,
            another_engines_tensor_is_refused,
        });
    };
}
pub(crate) use tests;
