//! Registered buffers (a `Vec` page-locked in place) and the pending transfers over them, on the
//! simulated device: when the copies touch the caller's memory, detach-on-drop, `mem::forget`,
//! and a fault at every driver call of the lifecycle. The round trips and refusals both devices
//! show are in `tests/bodies/registered.rs`.

use crate::support::{Fault, distinct_u32 as distinct, sim_engine};
use cuferry::sim::{SimConfig, SimOp};
use cuferry::{
    CudaEngine, Element, Error, RegisteredBuffer, SubmitError, download_pending, download_tensor,
    error::DriverError, pending::TryWait, upload_pending, upload_tensor,
};

// Written once in `tests/bodies/registered.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::registered::tests!(sim);

/// The device address of a tensor, for reading it with `SimDevice::peek`.
fn device_addr<T: Element>(_engine: &mut CudaEngine, tensor: &cuferry::DeviceTensor<T>) -> u64 {
    tensor.sim_address()
}

fn as_bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_ne_bytes()).collect()
}

// Simulator-only: reads what the device has registered.
#[test]
fn a_dropped_buffer_is_unregistered() {
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(10)).unwrap();
    assert_eq!(sim.registered_live(), (1, 40));
    drop(buffer);
    assert_eq!(sim.registered_live(), (0, 0));
    engine.synchronize().unwrap();
}

// Simulator-only: reads what the device has registered after the engine is gone.
#[test]
fn a_buffer_outliving_its_engine_is_unregistered_when_dropped() {
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(10)).unwrap();
    drop(engine);
    assert_eq!(sim.registered_live(), (1, 40));
    assert_eq!(buffer.into_vec().unwrap(), distinct(10));
    let buffer = {
        let mut engine = CudaEngine::simulated_on(&sim);
        RegisteredBuffer::register(&mut engine, distinct(3)).unwrap()
    };
    drop(buffer);
    assert_eq!(sim.registered_live(), (0, 0));
    assert!(sim.violations().is_empty());
}

// Simulator-only: holds the device clock between the call and the copy.
/// An upload reads the caller's memory when the device runs the copy: bytes written there after
/// the call (through a pointer the test kept, as only unsafe code could) are the bytes that land.
#[test]
fn an_upload_reads_the_callers_memory_when_the_copy_runs() {
    let (mut engine, sim) = sim_engine();
    sim.hold_clock(true);
    let mut buffer = RegisteredBuffer::register(&mut engine, distinct(64)).unwrap();
    let kept = buffer.as_mut_slice().as_mut_ptr();
    let dest = engine.alloc_tensor::<u32>(&[64]).unwrap();
    let addr = device_addr(&mut engine, &dest);
    let queued = sim.queued();
    let mut pending = upload_pending(&mut engine, buffer, dest).unwrap();
    assert_eq!(sim.queued(), queued + 2, "the copy and its event, queued");
    assert!(!pending.is_ready().unwrap());
    let later: Vec<u32> = (0..64).map(|i| 7_000 + i).collect();
    // SAFETY: `kept` points at the 64 elements of the registered memory, which the queued copy
    // only reads when the clock runs it (below); nothing else reads or writes them meanwhile.
    unsafe { std::ptr::copy_nonoverlapping(later.as_ptr(), kept, 64) };
    assert_ne!(sim.peek(addr, 256).unwrap(), as_bytes(&later), "not yet");
    sim.advance_all();
    assert_eq!(sim.peek(addr, 256).unwrap(), as_bytes(&later));
    sim.hold_clock(false);
    let (buffer, _) = pending.wait().unwrap().into_parts();
    assert_eq!(buffer.into_vec().unwrap(), later);
    assert!(sim.violations().is_empty());
}

// Simulator-only: holds the device clock between the call and the copy.
/// A download writes the caller's memory when the device runs the copy, not at the call.
#[test]
fn a_download_writes_the_callers_memory_when_the_copy_runs() {
    let (mut engine, sim) = sim_engine();
    let value = upload_tensor(&mut engine, &distinct(64), &[64]).unwrap();
    sim.hold_clock(true);
    let poison = vec![0xDEAD_BEEFu32; 64];
    let mut buffer = RegisteredBuffer::register(&mut engine, poison.clone()).unwrap();
    let kept = buffer.as_mut_slice().as_ptr();
    let mut pending = download_pending(&mut engine, value, buffer).unwrap();
    let read = || {
        // SAFETY: `kept` points at the 64 elements of the registered memory; the queued copy
        // writes them only while the clock runs, which this thread does not do during the read.
        unsafe { std::slice::from_raw_parts(kept, 64) }.to_vec()
    };
    assert_eq!(read(), poison, "nothing written at the call");
    assert_eq!(sim.queued(), 2);
    sim.advance(1);
    assert_eq!(read(), distinct(64), "written when the copy ran");
    assert!(!pending.is_ready().unwrap(), "its event is still queued");
    sim.advance(1);
    assert!(pending.is_ready().unwrap());
    sim.hold_clock(false);
    let returned = match pending.try_wait().unwrap() {
        TryWait::Returned(returned) => returned,
        TryWait::InFlight(_) => panic!("the event has run"),
    };
    assert_eq!(returned.buffer().as_slice(), distinct(64));
}

// Simulator-only: holds the device clock and reads what is registered.
#[test]
fn dropping_an_in_flight_transfer_unregisters_only_after_its_event() {
    for upload in [true, false] {
        let (mut engine, sim) = sim_engine();
        let tensor = upload_tensor(&mut engine, &distinct(64), &[64]).unwrap();
        let buffer = RegisteredBuffer::register(&mut engine, vec![1u32; 64]).unwrap();
        let ptr = buffer.as_slice().as_ptr().cast::<u8>();
        sim.hold_clock(true);
        if upload {
            drop(upload_pending(&mut engine, buffer, tensor).unwrap());
        } else {
            drop(download_pending(&mut engine, tensor, buffer).unwrap());
        }
        assert_eq!(engine.retirement_stats().pending, 1);
        engine.flush().unwrap();
        assert!(
            sim.is_registered(ptr),
            "not released while the copy is queued"
        );
        assert_eq!(sim.calls(SimOp::HostUnregister), 0);
        sim.advance(1); // the copy, not its event
        engine.flush().unwrap();
        assert!(sim.is_registered(ptr), "not before the event proves it");
        sim.advance_all();
        sim.hold_clock(false);
        engine.flush().unwrap();
        assert!(
            !sim.is_registered(ptr),
            "released by the poll after the event"
        );
        assert_eq!(sim.registered_live(), (0, 0));
        assert_eq!(engine.retirement_stats().released, 1);
        assert!(sim.violations().is_empty());
    }
}

// Simulator-only: reads what the device has registered after the engine is gone.
#[test]
fn an_engine_dropped_with_a_detached_transfer_unregisters_after_its_wait() {
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(32)).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[32]).unwrap();
    drop(upload_pending(&mut engine, buffer, dest).unwrap());
    drop(engine);
    sim.advance_all();
    assert_eq!(sim.registered_live(), (0, 0));
    assert_eq!(sim.device_live(), (0, 0));
    assert!(sim.violations().is_empty());
}

// Simulator-only: reads the leaked registration.
#[test]
fn forgetting_a_buffer_leaks_its_registration() {
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(16)).unwrap();
    std::mem::forget(buffer);
    engine.synchronize().unwrap();
    drop(engine);
    assert_eq!(sim.registered_live(), (1, 64), "leaked, never unregistered");
    assert!(sim.violations().is_empty());
}

// Simulator-only: reads the leaked registration.
#[test]
fn forgetting_an_in_flight_transfer_never_unregisters() {
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, vec![0u32; 64]).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    let value = upload_tensor(&mut engine, &distinct(64), &[64]).unwrap();
    std::mem::forget(download_pending(&mut engine, value, buffer).unwrap());
    engine.synchronize().unwrap();
    drop(engine);
    assert!(sim.is_registered(ptr));
    assert_eq!(sim.calls(SimOp::HostUnregister), 0);
    assert!(sim.violations().is_empty());
}

// Simulator-only: injects a refused registration.
#[test]
fn a_refused_registration_gives_the_vec_back() {
    let (mut engine, sim) = sim_engine();
    let data = distinct(100);
    let ptr = data.as_ptr();
    sim.fail_nth(SimOp::HostRegister, 1, DriverError::OUT_OF_MEMORY);
    let refused = RegisteredBuffer::register(&mut engine, data).unwrap_err();
    assert!(
        matches!(
            refused.error(),
            Error::Driver {
                call: "cuMemHostRegister",
                source: DriverError::OUT_OF_MEMORY
            }
        ),
        "{refused}"
    );
    let back = refused.into_input().expect("handed back");
    assert_eq!((back.as_ptr(), &back), (ptr, &distinct(100)));
    assert_eq!(sim.registered_live(), (0, 0));

    // Memory the device already page-locks cannot be registered twice.
    let buffer = RegisteredBuffer::register(&mut engine, back).unwrap();
    let small = SimConfig {
        pinned_bytes: 1000,
        ..SimConfig::default()
    };
    let mut tight = CudaEngine::simulated(small);
    let refused = RegisteredBuffer::register(&mut tight, distinct(300)).unwrap_err();
    assert!(
        matches!(
            refused.error(),
            Error::Driver {
                source: DriverError::OUT_OF_MEMORY,
                ..
            }
        ),
        "page-locked memory is bounded: {refused}"
    );
    drop(buffer);
}

// Simulator-only: injects a refused unregistration.
#[test]
fn a_refused_unregistration_in_into_vec_retains_the_memory() {
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(8)).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    sim.fail_nth(SimOp::HostUnregister, 1, DriverError::UNKNOWN);
    match buffer.into_vec() {
        Err(Error::Driver {
            call: "cuMemHostUnregister",
            source: DriverError::UNKNOWN,
        }) => {}
        other => panic!("expected the unregistration's failure, got {other:?}"),
    }
    assert!(sim.is_registered(ptr), "still registered: retained");
    assert_eq!(sim.registered_live(), (1, 32));
    engine.synchronize().expect("reported once, by into_vec");
    drop(engine);
    assert!(sim.is_registered(ptr), "never unregistered, never freed");
}

// Simulator-only: injects a refused unregistration.
#[test]
fn a_refused_unregistration_in_drop_leaks_and_is_reported_at_the_next_boundary() {
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(8)).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    sim.fail_nth(SimOp::HostUnregister, 1, DriverError::UNKNOWN);
    drop(buffer);
    assert!(sim.is_registered(ptr), "leaked, not freed");
    match engine.flush() {
        Err(Error::Deferred { count: 1, first }) => assert!(
            matches!(
                *first,
                Error::Driver {
                    call: "cuMemHostUnregister",
                    source: DriverError::UNKNOWN
                }
            ),
            "{first}"
        ),
        other => panic!("expected the deferred failure, got {other:?}"),
    }
    engine.flush().expect("reported once");
}

// Simulator-only: injects a refused unregistration.
#[test]
fn a_refused_unregistration_of_a_released_transfer_is_reported_by_that_boundary() {
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(8)).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    let dest = engine.alloc_tensor::<u32>(&[8]).unwrap();
    drop(upload_pending(&mut engine, buffer, dest).unwrap());
    sim.fail_nth(SimOp::HostUnregister, 1, DriverError::UNKNOWN);
    match engine.synchronize() {
        Err(Error::Deferred { count: 1, first }) => assert!(
            matches!(
                *first,
                Error::Driver {
                    call: "cuMemHostUnregister",
                    ..
                }
            ),
            "{first}"
        ),
        other => panic!("expected the release's refused unregistration, got {other:?}"),
    }
    assert!(sim.is_registered(ptr));
    assert_eq!(engine.retirement_stats().released, 1);
    assert!(sim.violations().is_empty());
}

// Simulator-only: injects a failed enqueue or event record.
#[test]
fn a_failed_enqueue_or_event_record_hands_the_buffer_back() {
    for (op, upload) in [
        (SimOp::CopyHtoD, true),
        (SimOp::CopyDtoH, false),
        (SimOp::EventRecord, true),
        (SimOp::EventRecord, false),
    ] {
        let (mut engine, sim) = sim_engine();
        let value = upload_tensor(&mut engine, &[5u32; 16], &[16]).unwrap();
        let buffer = RegisteredBuffer::register(&mut engine, distinct(16)).unwrap();
        sim.fail_nth(op, 1, DriverError::INVALID_VALUE);
        let submitted = if upload {
            upload_pending(&mut engine, buffer, value).map(drop)
        } else {
            // Source first: the tensor, then the buffer, put as an upload's.
            download_pending(&mut engine, value, buffer)
                .map(drop)
                .map_err(|e| e.map_input(|(tensor, buffer)| (buffer, tensor)))
        };
        let (package, error) = match submitted {
            Err(SubmitError::Failed {
                input: package,
                error,
            }) => (package, error),
            other => panic!("{op:?}: expected Failed, got {other:?}"),
        };
        assert!(
            matches!(
                error,
                Error::Driver {
                    source: DriverError::INVALID_VALUE,
                    ..
                }
            ),
            "{op:?}: {error}"
        );
        // A failed event record is followed by a stream synchronize that proves the copy done:
        // a download's data has landed; a failed enqueue queued nothing.
        let expected = if op == SimOp::EventRecord && !upload {
            vec![5; 16]
        } else {
            distinct(16)
        };
        assert_eq!(package.0.into_vec().unwrap(), expected, "{op:?}");
        assert_eq!(sim.registered_live(), (0, 0));
        assert!(sim.violations().is_empty());
    }
}

// Simulator-only: injects an untrackable copy.
#[test]
fn an_unprovable_copy_retains_the_registered_memory_for_good() {
    // The event reports a failure: the wait fails and everything is retained.
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(16)).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    let value = upload_tensor(&mut engine, &[5u32; 16], &[16]).unwrap();
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    let err = download_pending(&mut engine, value, buffer)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(matches!(
        err,
        Error::DeviceFault {
            what: "pending download",
            source: DriverError::LAUNCH_FAILED
        }
    ));
    engine.synchronize().unwrap();
    assert_eq!(engine.retirement_stats().retained, 1);
    drop(engine);
    assert!(
        sim.is_registered(ptr),
        "retained for good, even at teardown"
    );
    assert_eq!(sim.calls(SimOp::HostUnregister), 0);

    // Neither an event nor a stream synchronize: the submission itself is retained.
    let (mut engine, sim) = sim_engine();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(16)).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[16]).unwrap();
    Fault::Untracked(1).arm(&sim);
    assert!(matches!(
        upload_pending(&mut engine, buffer, dest),
        Err(SubmitError::Retained { .. })
    ));
    sim.clear_faults();
    drop(engine);
    assert_eq!(sim.registered_live(), (1, 64));
    assert!(sim.violations().is_empty());
}

/// Where the registered memory ended up after one lifecycle under a fault.
#[derive(Debug)]
enum End {
    /// The `Vec` came back (from `into_vec`, or from a refused registration), holding this.
    Back(Vec<u32>),
    /// The test dropped the buffer on an error path: unregistered and freed.
    Dropped,
    /// Retained: registered for good, never handed back.
    Retained,
}

/// Registers a `Vec`, uploads it, checks the upload, downloads `value` into the same buffer and
/// takes the `Vec` back, stopping at the first failure, which it returns with where the memory
/// ended up. A submission that fails hands the buffer back, and its `Vec` is taken back.
fn lifecycle(engine: &mut CudaEngine, value: cuferry::DeviceTensor<u32>) -> (End, Option<Error>) {
    let buffer = match RegisteredBuffer::register(engine, distinct(64)) {
        Ok(buffer) => buffer,
        Err(SubmitError::Rejected { input, error } | SubmitError::Failed { input, error }) => {
            return (End::Back(input), Some(error));
        }
        Err(other) => panic!("a registration is never retained: {other}"),
    };
    let settle = |err: SubmitError<(RegisteredBuffer<u32>, cuferry::DeviceTensor<u32>)>| match err {
        SubmitError::Retained { error } => (End::Retained, Some(error)),
        SubmitError::Rejected {
            input: package,
            error,
        }
        | SubmitError::Failed {
            input: package,
            error,
        } => match package.0.into_vec() {
            Ok(back) => (End::Back(back), Some(error)),
            Err(unregister) => (End::Retained, Some(unregister)),
        },
    };
    let dest = match engine.alloc_tensor::<u32>(&[64]) {
        Ok(dest) => dest,
        Err(error) => return (End::Dropped, Some(error)),
    };
    let upload = match upload_pending(engine, buffer, dest) {
        Ok(upload) => upload,
        Err(err) => return settle(err),
    };
    let (buffer, tensor) = match upload.wait() {
        Ok(returned) => returned.into_parts(),
        Err(error) => return (End::Retained, Some(error)),
    };
    match download_tensor(engine, &tensor) {
        Ok(landed) => assert_eq!(landed, distinct(64)),
        Err(error) => return (End::Dropped, Some(error)),
    }
    let download = match download_pending(engine, value, buffer) {
        Ok(download) => download,
        // Source first: the tensor, then the buffer, put as an upload's for `settle`.
        Err(err) => return settle(err.map_input(|(tensor, buffer)| (buffer, tensor))),
    };
    let buffer = match download.wait() {
        Ok(returned) => returned.into_parts().1,
        Err(error) => return (End::Retained, Some(error)),
    };
    match buffer.into_vec() {
        Ok(back) => (End::Back(back), None),
        Err(error) => (End::Retained, Some(error)),
    }
}

// Simulator-only: injects a fault at every driver call.
/// A fault at every driver call of the lifecycle in turn: every failure is typed and names the
/// injected error, a `Vec` that comes back holds either its own data or the downloaded data,
/// memory whose completion cannot be proven (or whose unregistration failed) stays registered,
/// everything else is unregistered, and the device sees no violation.
#[test]
fn a_fault_at_every_step_keeps_the_rules() {
    let ops = [
        SimOp::HostRegister,
        SimOp::Alloc,
        SimOp::CopyHtoD,
        SimOp::CopyDtoH,
        SimOp::EventCreate,
        SimOp::EventRecord,
        SimOp::EventSynchronize,
        SimOp::HostUnregister,
    ];
    let mut faults: Vec<Fault> = Vec::new();
    for op in ops {
        for n in 1..=3 {
            faults.push(Fault::Call(op, n, DriverError::INVALID_VALUE));
        }
    }
    for n in 1..=4 {
        faults.push(Fault::Untracked(n));
        faults.push(Fault::Event(n));
    }
    let downloaded: Vec<u32> = (0..64).map(|i| 90_000 + i).collect();
    let mut fired = Vec::new();
    for fault in faults {
        let (mut engine, sim) = sim_engine();
        let value = upload_tensor(&mut engine, &downloaded, &[64]).unwrap();
        engine.synchronize().unwrap();
        fault.arm(&sim);
        let (end, error) = lifecycle(&mut engine, value);
        sim.clear_faults();
        if let Some(error) = &error {
            fired.push(format!("{fault:?}"));
            let reported = fault.reported().to_string();
            assert!(error.to_string().contains(&reported), "{fault:?}: {error}");
        }
        if let End::Back(back) = &end {
            assert!(
                *back == distinct(64) || *back == downloaded,
                "{fault:?}: the Vec came back holding {:?}…",
                &back[..4]
            );
            if error.is_none() {
                assert_eq!(*back, downloaded, "{fault:?}: a whole lifecycle downloads");
            }
        }
        // Whatever a boundary reports, it reports once.
        let _ = engine.synchronize();
        engine.synchronize().unwrap();
        drop(engine);
        sim.advance_all();
        assert!(
            sim.violations().is_empty(),
            "{fault:?}: {:?}",
            sim.violations()
        );
        let expected = usize::from(matches!(end, End::Retained));
        assert_eq!(
            sim.registered_live().0,
            expected,
            "{fault:?} ended {end:?}: retained memory stays registered, nothing else does"
        );
    }
    // The first call of every operation the lifecycle makes fails it (events come from the
    // engine's pool, which the setup filled, so no event is created).
    for op in ops.iter().filter(|&&op| op != SimOp::EventCreate) {
        let first = format!("{:?}", Fault::Call(*op, 1, DriverError::INVALID_VALUE));
        assert!(fired.contains(&first), "{first} never failed the lifecycle");
    }
    for fault in [Fault::Untracked(1), Fault::Event(1), Fault::Event(2)] {
        let fault = format!("{fault:?}");
        assert!(fired.contains(&fault), "{fault} never failed the lifecycle");
    }
}
