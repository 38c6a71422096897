//! The engine's rules, checked on the simulated device.

use crate::support::{distinct_f32 as distinct, sim_engine as engine};
use cuferry::error::{SetupError, UsageError};
use cuferry::sim::{SimDevice, SimOp, set_thread_context, thread_context};
use cuferry::{CudaEngine, Error, download_tensor, error::DriverError, upload_tensor};

// Written once in `tests/bodies/engine.rs`, run here on the simulated device and by the GPU suite
// on device 0.
crate::bodies::engine::tests!(sim);

#[test]
fn flush_does_not_wait_and_synchronize_does() {
    let (mut engine, sim) = engine();
    let x = upload_tensor(&mut engine, &distinct(16), &[4, 4]).unwrap();
    let _y = engine.copy_tensor(&x).unwrap();
    let queued = sim.queued();
    assert!(queued > 0, "the copy is queued");
    engine.flush().unwrap();
    assert_eq!(sim.queued(), queued, "flush is not a host barrier");
    engine.synchronize().unwrap();
    assert_eq!(sim.queued(), 0, "synchronize is");
}

#[test]
fn dropping_a_tensor_frees_it_in_stream_order() {
    let (mut engine, sim) = engine();
    let x = upload_tensor(&mut engine, &distinct(256), &[256]).unwrap();
    let _y = engine.copy_tensor(&x).unwrap();
    drop(x);
    assert_eq!(sim.device_live().0, 2, "the free waits behind the copy");
    engine.synchronize().unwrap();
    assert_eq!(sim.device_live(), (1, 1024));
}

#[test]
fn tensors_outliving_their_engine_are_freed_on_its_device() {
    let (mut engine, sim) = engine();
    let x = upload_tensor(&mut engine, &distinct(4), &[4]).unwrap();
    drop(engine);
    drop(x);
    sim.advance_all();
    assert_eq!(sim.device_live(), (0, 0));
    assert!(sim.violations().is_empty());
}

#[test]
fn with_raw_restores_the_context_on_return() {
    let (mut engine, sim) = engine();
    let foreign = SimDevice::foreign_context();
    set_thread_context(Some(foreign));
    let seen = engine
        .with_raw(|raw| {
            assert_eq!(thread_context(), Some(raw.context().as_raw() as u64));
            Ok::<_, Error>(raw.context().as_raw() as u64)
        })
        .unwrap();
    assert_eq!(seen, sim.context());
    assert_eq!(thread_context(), Some(foreign));
    set_thread_context(None);
    engine.with_raw(|_| Ok::<_, Error>(())).unwrap();
    assert_eq!(thread_context(), None, "no context before, none after");
}

#[test]
fn with_raw_restores_the_context_on_err() {
    let (mut engine, sim) = engine();
    let foreign = SimDevice::foreign_context();
    set_thread_context(Some(foreign));
    let r: Result<(), Error> = engine.with_raw(|_| {
        assert_eq!(thread_context(), Some(sim.context()));
        Err(Error::Usage(UsageError::ZeroLength { what: "test" }))
    });
    assert!(matches!(
        r,
        Err(Error::Usage(UsageError::ZeroLength { .. }))
    ));
    assert_eq!(thread_context(), Some(foreign));
    set_thread_context(None);
}

#[test]
fn with_raw_restores_the_context_on_unwind() {
    let (mut engine, _sim) = engine();
    let foreign = SimDevice::foreign_context();
    set_thread_context(Some(foreign));
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = engine.with_raw(|_| -> Result<(), Error> { panic!("inside the raw scope") });
    }));
    assert!(caught.is_err());
    assert_eq!(thread_context(), Some(foreign));
    set_thread_context(None);
    // The engine is still usable after the unwind.
    engine.synchronize().unwrap();
}

#[test]
fn with_raw_is_not_a_host_barrier() {
    let (mut engine, sim) = engine();
    let x = upload_tensor(&mut engine, &distinct(4), &[4]).unwrap();
    let _y = engine.copy_tensor(&x).unwrap();
    let queued = sim.queued();
    let bytes = engine
        .with_raw(|raw| Ok::<_, Error>(raw.device_ptr(&x)?.bytes()))
        .unwrap();
    assert_eq!(bytes, 16);
    assert_eq!(sim.queued(), queued);
}

#[test]
fn flush_reports_a_failed_free_recorded_at_drop() {
    let (mut engine, sim) = engine();
    let x = upload_tensor(&mut engine, &distinct(4), &[4]).unwrap();
    sim.fail_nth(SimOp::Free, 1, DriverError::INVALID_VALUE);
    drop(x);
    let err = engine.flush().unwrap_err();
    assert!(matches!(err, Error::Deferred { count: 1, .. }), "{err}");
    engine.flush().unwrap();
}

#[test]
fn synchronize_reports_a_device_fault() {
    let (mut engine, sim) = engine();
    sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::ILLEGAL_ADDRESS);
    let err = engine.synchronize().unwrap_err();
    assert!(matches!(
        err,
        Error::DeviceFault {
            source: DriverError::ILLEGAL_ADDRESS,
            ..
        }
    ));
    assert!(
        err.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{err}"
    );
}

#[test]
fn flush_reports_an_asynchronous_failure_without_waiting() {
    let (mut engine, sim) = engine();
    let x = upload_tensor(&mut engine, &distinct(4), &[4]).unwrap();
    let _y = engine.copy_tensor(&x).unwrap();
    sim.fail_nth(SimOp::StreamQuery, 1, DriverError::LAUNCH_FAILED);
    assert!(matches!(engine.flush(), Err(Error::DeviceFault { .. })));
    assert_eq!(sim.queued(), 1);
}

#[test]
fn a_failed_allocation_is_a_typed_error() {
    let (mut engine, sim) = engine();
    sim.fail_nth(SimOp::Alloc, 1, DriverError::INVALID_VALUE);
    let err = engine.alloc_tensor::<u64>(&[3]).unwrap_err();
    assert!(matches!(
        err,
        Error::Driver {
            source: DriverError::INVALID_VALUE,
            ..
        }
    ));
}

/// An allocation the driver refuses for want of memory is tried again once the pool has given
/// its unused memory back; one past the device's memory is an error that says where the memory
/// is: the size asked, the device's free and total, the pool's, the retired work still waiting
/// for its proof, and the largest allocation that would succeed.
#[test]
fn out_of_memory_trims_the_pool_retries_and_then_explains() {
    // A one-off refusal: the pool is trimmed and the retry succeeds.
    let (mut engine, sim) = engine();
    sim.fail_nth(SimOp::Alloc, 1, DriverError::OUT_OF_MEMORY);
    let trims = sim.calls(SimOp::TrimPool);
    engine.alloc_tensor::<u64>(&[3]).unwrap();
    assert_eq!(sim.calls(SimOp::TrimPool), trims + 1);

    // A device of 1 MiB: 600 KiB held, 100 KiB in a detached upload the device has not run.
    let sim = SimDevice::new(cuferry::sim::SimConfig {
        memory_bytes: 1 << 20,
        ..cuferry::sim::SimConfig::default()
    });
    let mut engine = CudaEngine::simulated_on(&sim);
    let held = engine.alloc_tensor::<u8>(&[600 << 10]).unwrap();
    sim.hold_clock(true);
    let buffer = cuferry::PinnedHostBuffer::from_slice(&mut engine, &[7u8; 100 << 10]).unwrap();
    let target = engine.alloc_tensor::<u8>(&[100 << 10]).unwrap();
    drop(cuferry::upload_pending(&mut engine, buffer, target).unwrap());
    let report = engine.device_memory().unwrap();
    assert_eq!(
        (
            report.free,
            report.total,
            report.pool_reserved,
            report.pool_in_use
        ),
        (324 << 10, 1 << 20, 700 << 10, 700 << 10)
    );
    let err = engine.alloc_tensor::<u8>(&[512 << 10]).unwrap_err();
    let text = err.to_string();
    let Error::OutOfMemory(oom) = err else {
        panic!("{err:?}")
    };
    assert_eq!(oom.asked, 512 << 10);
    assert_eq!(oom.memory, Some(report));
    assert_eq!(oom.waiting, 1);
    assert_eq!(oom.largest, Some(324 << 10));
    assert_eq!(
        text,
        "out of device memory: asked for 512.00 KiB; the device has 324.00 KiB free of 1.00 MiB; \
         this engine's pool holds 700.00 KiB, 700.00 KiB of it in live allocations; 1 retired \
         operation still waits for its proof of completion; the largest allocation that would \
         succeed: 324.00 KiB; the engine's device memory: tensors 700.00 KiB"
    );
    // A refused trim changes nothing; a driver that cannot report its memory leaves it out.
    sim.fail_nth(SimOp::TrimPool, 1, DriverError::UNKNOWN);
    sim.fail_nth(SimOp::MemoryReport, 1, DriverError::UNKNOWN);
    match engine.alloc_tensor::<u8>(&[512 << 10]) {
        Err(Error::OutOfMemory(oom)) => {
            assert_eq!((oom.memory, oom.largest), (None, None));
            assert!(
                Error::OutOfMemory(oom)
                    .to_string()
                    .contains("the driver could not report the device's memory")
            );
        }
        other => panic!("{other:?}"),
    }
    // A panic in the trim leaks nothing and leaves the engine working.
    sim.panic_nth(SimOp::TrimPool, 1);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        engine.alloc_tensor::<u8>(&[512 << 10])
    }));
    assert!(panicked.is_err());
    // Once the device has run the upload, its memory comes back and the allocation fits.
    sim.hold_clock(false);
    engine.synchronize().unwrap();
    let fits = engine.alloc_tensor::<u8>(&[400 << 10]).unwrap();
    drop((held, fits));
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn a_failed_download_wait_leaks_rather_than_frees() {
    let (mut engine, sim) = engine();
    let x = upload_tensor(&mut engine, &distinct(64), &[64]).unwrap();
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    let err = download_tensor(&mut engine, &x).unwrap_err();
    assert!(matches!(err, Error::DeviceFault { .. }), "{err}");
    assert!(sim.violations().is_empty());
}

#[test]
fn dropping_the_engine_waits_and_never_panics_even_when_the_wait_fails() {
    let (mut engine, sim) = engine();
    let x = upload_tensor(&mut engine, &distinct(4), &[4]).unwrap();
    let _y = engine.copy_tensor(&x).unwrap();
    sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::LAUNCH_FAILED);
    drop(engine);
    assert_eq!(sim.queued(), 1, "the failed wait left the copy queued");
    drop(x);
    sim.advance_all();
    assert!(sim.violations().is_empty());
}

#[test]
fn opening_a_real_device_without_a_driver_says_so() {
    match CudaEngine::open(0) {
        Err(Error::Setup(SetupError::NoDriver { detail })) => {
            assert!(detail.contains("libcuda"), "{detail}")
        }
        // On a GPU machine the driver is present: opening succeeds or names the ordinal.
        Ok(_) | Err(Error::Setup(SetupError::NoSuchDevice { .. })) => {}
        Err(other) => panic!("unexpected error {other}"),
    }
}
