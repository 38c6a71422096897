//! The engine's rules on a real device.

use crate::common::{ForeignContext, current_context, distinct_f32, open};
use cuferry::error::{SetupError, UsageError};
use cuferry::{CudaEngine, Error, download_tensor, upload_tensor};

// Written once in `tests/bodies/engine.rs`, run here on device 0 and by the simulator binary.
crate::bodies::engine::tests!(gpu);

#[test]
#[ignore = "needs a CUDA device"]
fn a_missing_ordinal_is_a_typed_error() {
    let count = CudaEngine::device_count().unwrap();
    match CudaEngine::open(count + 7) {
        Err(Error::Setup(SetupError::NoSuchDevice { ordinal, count: c })) => {
            assert_eq!(ordinal, count + 7);
            assert_eq!(c, count);
        }
        other => panic!("expected NoSuchDevice, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn with_raw_restores_a_foreign_context_on_return_err_and_unwind() {
    let foreign = ForeignContext::new();
    let mut engine = open();
    assert_eq!(
        current_context(),
        foreign.0,
        "open restores the caller's context"
    );

    let inside = engine
        .with_raw(|raw| {
            assert_eq!(current_context(), raw.context().as_raw());
            Ok::<_, Error>(raw.context().as_raw())
        })
        .unwrap();
    assert_ne!(inside, foreign.0);
    assert_eq!(current_context(), foreign.0, "restored on return");

    let r: Result<(), Error> =
        engine.with_raw(|_| Err(Error::Usage(UsageError::ZeroLength { what: "test" })));
    assert!(r.is_err());
    assert_eq!(current_context(), foreign.0, "restored on Err");

    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ =
            engine.with_raw(|_| -> Result<(), Error> { panic!("unwinding out of a raw scope") });
    }));
    assert!(caught.is_err());
    assert_eq!(current_context(), foreign.0, "restored on unwind");

    // Ordinary operations leave the caller's context current too.
    let x = upload_tensor(&mut engine, &distinct_f32(10), &[10]).unwrap();
    assert_eq!(download_tensor(&mut engine, &x).unwrap(), distinct_f32(10));
    assert_eq!(current_context(), foreign.0);
    drop(x);
    drop(engine);
    assert_eq!(current_context(), foreign.0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn with_raw_exposes_the_engine_stream_and_pointers() {
    let mut engine = open();
    let x = upload_tensor(&mut engine, &distinct_f32(64), &[64]).unwrap();
    let (stream, ptr, bytes) = engine
        .with_raw(|raw| {
            let p = raw.device_ptr(&x)?;
            Ok::<_, Error>((raw.stream().as_raw() as usize, p.as_raw(), p.bytes()))
        })
        .unwrap();
    assert_ne!(
        stream, 0,
        "the engine's own stream, not the legacy default stream"
    );
    assert_ne!(ptr, 0);
    assert_eq!(bytes, 256);
}

/// The device's memory as the driver reports it: a freed tensor's memory stays in the engine's
/// pool until the pool is trimmed, and an allocation past the device's memory is an error that
/// says where the memory is, after which the engine works on.
#[test]
#[ignore = "needs a CUDA device"]
fn device_memory_is_reported_kept_trimmed_and_explained_when_it_runs_out() {
    const GIB: u64 = 1 << 30;
    let mut engine = crate::engine();
    let before = engine.device_memory().unwrap();
    assert!(
        before.total > 0 && before.free <= before.total,
        "{before:?}"
    );
    let t = engine.alloc_tensor::<u8>(&[(4 * GIB) as usize]).unwrap();
    engine.synchronize().unwrap();
    let holding = engine.device_memory().unwrap();
    assert!(holding.pool_in_use >= 4 * GIB, "{holding:?}");
    drop(t);
    engine.synchronize().unwrap();
    let kept = engine.device_memory().unwrap();
    assert!(
        kept.pool_reserved >= 4 * GIB,
        "the pool keeps what was freed: {kept:?}"
    );
    assert!(kept.pool_in_use < GIB, "{kept:?}");
    engine.trim_device_pool(0).unwrap();
    let trimmed = engine.device_memory().unwrap();
    assert!(trimmed.pool_reserved < GIB, "{trimmed:?}");
    assert!(
        trimmed.free >= kept.free + 3 * GIB,
        "{kept:?} then {trimmed:?}"
    );
    println!(
        "device memory: before {before:?}; holding 4 GiB {holding:?}; freed {kept:?}; trimmed {trimmed:?}"
    );
    let asked = (before.total + GIB) as usize;
    let err = engine.alloc_tensor::<u8>(&[asked]).unwrap_err();
    println!("{err}");
    let cuferry::Error::OutOfMemory(oom) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(oom.asked, asked);
    let memory = oom.memory.expect("CUDA reports the device's memory");
    assert_eq!(memory.total, before.total);
    assert!(
        err.to_string()
            .starts_with("out of device memory: asked for "),
        "{err}"
    );
    // The engine works on.
    let back = cuferry::upload_tensor(&mut engine, &[1u32, 2, 3], &[3]).unwrap();
    assert_eq!(
        cuferry::download_tensor(&mut engine, &back).unwrap(),
        [1, 2, 3]
    );
}
