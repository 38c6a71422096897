//! Raw scopes on the simulated device: the caller's context is restored on return, on `Err` and
//! on unwind; entering a scope is not a host barrier; work queued around a scope keeps its order.

use cuferry::error::UsageError;
use cuferry::sim::{SimConfig, SimDevice, SimOp, set_thread_context, thread_context};
use cuferry::{CudaEngine, Error, download_tensor, upload_tensor};

// Simulator-only: sets and reads the simulated thread context (the GPU suite checks the CUDA context in `tests/gpu/engine.rs`).
#[test]
fn with_raw_restores_the_callers_context_on_return_err_and_unwind() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let ours = engine.sim().unwrap().context();
    let foreign = SimDevice::foreign_context();

    set_thread_context(Some(foreign));
    let inside = engine
        .with_raw(|_| Ok::<_, Error>(thread_context()))
        .unwrap();
    assert_eq!(inside, Some(ours));
    assert_eq!(thread_context(), Some(foreign), "after return");

    let err = engine.with_raw(|_| -> Result<(), Error> {
        Err(Error::Usage(UsageError::ZeroLength { what: "test" }))
    });
    assert!(matches!(
        err,
        Err(Error::Usage(UsageError::ZeroLength { .. }))
    ));
    assert_eq!(thread_context(), Some(foreign), "after Err");

    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = engine.with_raw(|_| -> Result<(), Error> { panic!("inside a raw scope") });
    }));
    assert!(unwound.is_err());
    assert_eq!(thread_context(), Some(foreign), "after unwind");

    set_thread_context(None);
    engine.with_raw(|_| Ok::<_, Error>(())).unwrap();
    assert_eq!(thread_context(), None, "no context before, none after");
}

// Simulator-only: counts the host waits and reads the queue.
#[test]
fn entering_a_raw_scope_between_kernels_is_not_a_host_barrier() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().unwrap();
    let x = upload_tensor(&mut engine, &[1i64, -2, 3], &[3]).unwrap();
    let waits =
        |s: &SimDevice| s.calls(SimOp::StreamSynchronize) + s.calls(SimOp::EventSynchronize);
    let before = waits(&sim);
    let y = engine.scale(&x, 5).unwrap();
    let queued = sim.queued();
    engine
        .with_raw(|raw| {
            let _ = raw.device_ptr(&y)?;
            Ok::<_, Error>(())
        })
        .unwrap();
    let z = engine.add(&y, &x).unwrap();
    assert_eq!(waits(&sim), before, "no host wait");
    assert!(
        sim.queued() > queued,
        "the kernel after the scope is queued behind the one before"
    );
    assert_eq!(download_tensor(&mut engine, &z).unwrap(), [6, -12, 18]);
}
