//! Elementwise kernels on the simulated device: results against the host reference for every
//! element type, typed refusals, the per-engine kernel cache, and stream ordering (a queued
//! kernel has written nothing until the device clock reaches it, and a chain waits for nothing).

use crate::support::{Reference, Rng, check_casts_from, check_ops};
use cuferry::error::UsageError;
use cuferry::sim::{SimConfig, SimOp};
use cuferry::{
    CudaEngine, DeviceTensor, Element, Error, download_tensor, error::DriverError, upload_tensor,
};

fn engine() -> CudaEngine {
    CudaEngine::simulated(SimConfig::default())
}

/// A tensor's device address, for peeking at simulated device memory.
fn addr<T: Element>(_engine: &mut CudaEngine, t: &DeviceTensor<T>) -> u64 {
    t.sim_address()
}

fn ops_for<T: Reference>(seed: u64) {
    let mut engine = engine();
    let mut rng = Rng::new(seed);
    for n in [0, 1, 2, 257, 1000] {
        check_ops::<T>(&mut engine, &mut rng, n);
    }
    engine.synchronize().unwrap();
    let sim = engine.sim().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn every_operation_matches_the_host_reference_for_every_element() {
    let mut seed = 11;
    for_each_element!(T => {
        seed += 1;
        ops_for::<T>(seed);
    });
}

#[test]
fn every_cast_matches_the_host_reference() {
    let mut engine = engine();
    let mut rng = Rng::new(99);
    for_each_element!(T => {
        for n in [1, 300] {
            check_casts_from::<T>(&mut engine, &mut rng, n);
        }
    });
    engine.synchronize().unwrap();
    assert!(engine.sim().unwrap().violations().is_empty());
}

#[test]
fn a_chain_of_adds_waits_for_nothing_and_writes_nothing_until_the_clock_reaches_it() {
    let mut engine = engine();
    let sim = engine.sim().unwrap();
    let seed_host = [1.0f32, -2.0, 3.5, 0.25];
    let seed = upload_tensor(&mut engine, &seed_host, &[4]).unwrap();
    let waits_before = sim.calls(SimOp::StreamSynchronize) + sim.calls(SimOp::EventSynchronize);
    let launches_before = sim.calls(SimOp::Launch);

    let mut state = engine.add(&seed, &seed).unwrap();
    for _ in 0..2 {
        state = engine.add(&state, &state).unwrap();
    }
    engine.flush().unwrap();

    // Three launches queued, no host wait, nothing run.
    assert_eq!(sim.calls(SimOp::Launch) - launches_before, 3);
    assert_eq!(
        sim.calls(SimOp::StreamSynchronize) + sim.calls(SimOp::EventSynchronize),
        waits_before
    );
    let last = addr(&mut engine, &state);
    assert_eq!(
        sim.peek(last, 16).unwrap(),
        vec![0xA5; 16],
        "written before it ran"
    );

    engine.synchronize().unwrap();
    let want: Vec<f32> = seed_host.iter().map(|x| x * 8.0).collect();
    assert_eq!(download_tensor(&mut engine, &state).unwrap(), want);
}

#[test]
fn a_kernel_runs_in_stream_order_when_the_clock_advances() {
    let mut engine = engine();
    let sim = engine.sim().unwrap();
    let a = upload_tensor(&mut engine, &[3i32, -4, 5], &[3]).unwrap();
    let b = upload_tensor(&mut engine, &[10i32, 20, 30], &[3]).unwrap();
    sim.advance_all();
    let sum = engine.add(&a, &b).unwrap();
    let doubled = engine.scale(&sum, 2).unwrap();
    let ptr = addr(&mut engine, &doubled);
    let sum_ptr = addr(&mut engine, &sum);
    assert_eq!(sim.peek(ptr, 12).unwrap(), vec![0xA5; 12]);
    // The first kernel runs; the second has not yet.
    while sim.peek(sum_ptr, 12).unwrap() == vec![0xA5; 12] {
        assert_eq!(sim.advance(1), 1);
    }
    assert_eq!(sim.peek(ptr, 12).unwrap(), vec![0xA5; 12]);
    sim.advance_all();
    let bytes = sim.peek(ptr, 12).unwrap();
    let got: Vec<i32> = bytes
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, [26, 32, 70]);
}

#[test]
fn kernels_compile_once_per_engine_and_operation() {
    let mut engine = engine();
    let sim = engine.sim().unwrap();
    let a = upload_tensor(&mut engine, &[1.0f64, 2.0], &[2]).unwrap();
    let loads = sim.calls(SimOp::ModuleLoad);
    for _ in 0..4 {
        let _ = engine.add(&a, &a).unwrap();
    }
    assert_eq!(sim.calls(SimOp::ModuleLoad) - loads, 1);
    let _ = engine.mul(&a, &a).unwrap();
    let _ = engine.cast::<f32, _>(&a).unwrap();
    let _ = engine.cast::<i32, _>(&a).unwrap();
    assert_eq!(sim.calls(SimOp::ModuleLoad) - loads, 4);
    assert_eq!(engine.cached_kernels(), 4);

    // A second engine on the same device compiles its own.
    let mut other = CudaEngine::simulated_on(&sim);
    let b = upload_tensor(&mut other, &[1.0f64], &[1]).unwrap();
    let _ = other.add(&b, &b).unwrap();
    assert_eq!(other.cached_kernels(), 1);
}

#[test]
fn empty_tensors_queue_nothing() {
    let mut engine = engine();
    let sim = engine.sim().unwrap();
    let a = upload_tensor::<f32>(&mut engine, &[], &[0, 3]).unwrap();
    let launches = sim.calls(SimOp::Launch);
    let out = engine.add(&a, &a).unwrap();
    assert_eq!(out.shape(), [0, 3]);
    assert_eq!(sim.calls(SimOp::Launch), launches);
    assert!(download_tensor(&mut engine, &out).unwrap().is_empty());
}

#[test]
fn mismatched_shapes_are_refused_before_anything_is_queued() {
    let mut engine = engine();
    let sim = engine.sim().unwrap();
    let a = upload_tensor(&mut engine, &[1.0f32; 6], &[2, 3]).unwrap();
    let b = upload_tensor(&mut engine, &[1.0f32; 6], &[3, 2]).unwrap();
    let launches = sim.calls(SimOp::Launch);
    match engine.add(&a, &b) {
        Err(Error::Usage(UsageError::ShapeMismatch {
            operation,
            expected,
            found,
        })) => {
            assert_eq!(
                (operation, expected, found),
                ("add", vec![2, 3], vec![3, 2])
            );
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
    assert_eq!(sim.calls(SimOp::Launch), launches);
}

#[test]
fn unsupported_elements_are_typed_errors_naming_operation_and_type() {
    let mut engine = engine();
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
    let as_int = engine.cast::<i64, _>(&flags).unwrap();
    assert_eq!(download_tensor(&mut engine, &as_int).unwrap(), [1, 0]);
}

#[test]
fn another_engines_tensor_is_refused() {
    let mut one = engine();
    let mut two = engine();
    let a = upload_tensor(&mut one, &[1.0f32], &[1]).unwrap();
    let b = upload_tensor(&mut two, &[1.0f32], &[1]).unwrap();
    assert!(matches!(
        one.add(&a, &b),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    let mut three = CudaEngine::simulated_on(&one.sim().unwrap());
    assert!(matches!(
        three.neg(&a),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
}

#[test]
fn compile_and_launch_failures_are_driver_errors() {
    let mut engine = engine();
    let sim = engine.sim().unwrap();
    let a = upload_tensor(&mut engine, &[1.0f32, 2.0], &[2]).unwrap();
    sim.fail_nth(SimOp::ModuleLoad, 1, DriverError::INVALID_VALUE);
    assert!(matches!(
        engine.add(&a, &a),
        Err(Error::Driver {
            call: "cuModuleLoadData",
            ..
        })
    ));
    assert_eq!(engine.cached_kernels(), 0);
    sim.fail_nth(SimOp::Launch, 1, DriverError::LAUNCH_FAILED);
    assert!(matches!(
        engine.add(&a, &a),
        Err(Error::Driver {
            call: "cuLaunchKernel",
            ..
        })
    ));
    // The kernel compiled on the second try is cached; the next launch succeeds.
    let sum = engine.add(&a, &a).unwrap();
    assert_eq!(download_tensor(&mut engine, &sum).unwrap(), [2.0, 4.0]);
    assert_eq!(engine.cached_kernels(), 1);
}

#[test]
fn a_device_fault_after_a_kernel_surfaces_at_synchronize() {
    let mut engine = engine();
    let sim = engine.sim().unwrap();
    // 32 bytes: the download fences its chunk with an event, the one made to fail.
    let a = upload_tensor(&mut engine, &[1u8; 32], &[32]).unwrap();
    let _sum = engine.add(&a, &a).unwrap();
    sim.fail_event(1, DriverError::ILLEGAL_ADDRESS);
    let err = download_tensor(&mut engine, &a).unwrap_err();
    assert!(matches!(err, Error::DeviceFault { .. }), "{err:?}");
    // 16 bytes or fewer are proven by a stream synchronize, which reports the fault the same way.
    let b = upload_tensor(&mut engine, &[1u8, 2], &[2]).unwrap();
    let _sum = engine.add(&b, &b).unwrap();
    sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::ILLEGAL_ADDRESS);
    let err = download_tensor(&mut engine, &b).unwrap_err();
    assert!(matches!(err, Error::DeviceFault { .. }), "{err:?}");
}
