//! Elementwise kernels on the simulated device: results against the host reference for every
//! element type, typed refusals, the per-engine kernel cache, and stream ordering (a queued
//! kernel has written nothing until the device clock reaches it, and a chain waits for nothing).

use cuferry::sim::{SimConfig, SimOp};
use cuferry::{
    CudaEngine, DeviceTensor, Element, Error, download_tensor, error::DriverError, upload_tensor,
};

// Written once in `tests/bodies/kernels.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::kernels::tests!(sim);

fn engine() -> CudaEngine {
    CudaEngine::simulated(SimConfig::default())
}

/// A tensor's device address, for peeking at simulated device memory.
fn addr<T: Element>(_engine: &mut CudaEngine, t: &DeviceTensor<T>) -> u64 {
    t.sim_address()
}

// Simulator-only: holds the clock and peeks at device memory.
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

// Simulator-only: steps the device clock.
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

// Simulator-only: injects compile and launch failures.
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

// Simulator-only: injects a device fault.
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
