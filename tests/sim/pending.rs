//! Pinned buffers and pending transfers on the simulated device.

use crate::support::{distinct_u32 as distinct, sim_engine as engine};
use cuferry::error::UsageError;
use cuferry::sim::{SimConfig, SimOp};
use cuferry::{
    CudaEngine, Error, PinnedHostBuffer, SubmitError, download_pending, download_tensor,
    error::DriverError, pending::TryWait, upload_pending, upload_tensor,
};

// Written once in `tests/bodies/pending.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::pending::tests!(sim);

// Simulator-only: counts the pinned allocations.
// Simulator-only: counts the pinned allocations.
#[test]
fn a_warm_pool_reuses_pinned_memory() {
    let (mut engine, sim) = engine();
    let a = PinnedHostBuffer::<u8>::new(&mut engine, 8 << 20).unwrap();
    let ptr = a.as_slice().as_ptr();
    drop(a);
    let b = PinnedHostBuffer::<u8>::new(&mut engine, 8 << 20).unwrap();
    assert_eq!(b.as_slice().as_ptr(), ptr);
    assert_eq!(sim.calls(SimOp::HostAlloc), 1);
    let stats = engine.pinned_pool_stats();
    assert_eq!(
        (stats.allocations, stats.reuses, stats.leased_blocks),
        (1, 1, 1)
    );
}

// Simulator-only: reads the live pinned memory.
#[test]
fn the_pool_trims_to_its_budget() {
    let (mut engine, sim) = engine();
    let bufs: Vec<_> = (0..4)
        .map(|_| PinnedHostBuffer::<u8>::new(&mut engine, 1 << 20).unwrap())
        .collect();
    engine.set_pinned_pool_budget(2 << 20).unwrap();
    drop(bufs);
    let stats = engine.pinned_pool_stats();
    assert_eq!(stats.idle_bytes, 2 << 20);
    assert_eq!(stats.frees, 2);
    assert_eq!(sim.pinned_live(), (2, 2 << 20));
    engine.set_pinned_pool_budget(0).unwrap();
    assert_eq!(sim.pinned_live(), (0, 0));
}

// Simulator-only: reads the pool reuse of pinned bytes.
/// A `bool` buffer drawn from a pooled block whose last user left other bytes starts all
/// `false`. Its bytes are never read as `bool` here (reading a byte other than 0 or 1 as `bool`
/// is undefined behaviour, so such a test could only fail by luck): the buffer is uploaded
/// untouched and the device's copy is read back as bytes.
#[test]
fn a_bool_buffer_over_reused_bytes_holds_only_zero_bytes() {
    let (mut engine, sim) = engine();
    let mut bytes = PinnedHostBuffer::<u8>::new(&mut engine, 64).unwrap();
    bytes.as_mut_slice().fill(0xFF);
    drop(bytes);
    let flags = PinnedHostBuffer::<bool>::new(&mut engine, 64).unwrap();
    let stats = engine.pinned_pool_stats();
    assert_eq!(
        (stats.allocations, stats.reuses),
        (1, 1),
        "the bool buffer reuses the block the u8 buffer filled"
    );
    // Fresh device memory is poisoned (0xA5), so zeros there come from the copy.
    let dest = engine.alloc_tensor::<bool>(&[64]).unwrap();
    let returned = upload_pending(&mut engine, flags, dest)
        .unwrap()
        .wait()
        .unwrap();
    let addr = engine
        .with_raw(|raw| Ok::<_, Error>(raw.device_ptr(returned.tensor())?.as_raw()))
        .unwrap();
    assert_eq!(sim.peek(addr, 64).unwrap(), [0u8; 64]);
}

// Simulator-only: steps the device clock.
#[test]
fn a_pending_upload_is_in_flight_until_the_device_advances() {
    let (mut engine, sim) = engine();
    let data = distinct(1024);
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[1024]).unwrap();
    let mut pending = upload_pending(&mut engine, source, dest).unwrap();
    assert!(!pending.is_ready().unwrap());
    let pending = match pending.try_wait().unwrap() {
        TryWait::InFlight(p) => p,
        TryWait::Returned(_) => panic!("nothing ran yet"),
    };
    sim.advance_all();
    let returned = match pending.try_wait().unwrap() {
        TryWait::Returned(r) => r,
        TryWait::InFlight(_) => panic!("the copy ran"),
    };
    assert_eq!(returned.buffer().as_slice(), &data[..]);
    let (_buffer, tensor) = returned.into_parts();
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), data);
}

// Simulator-only: steps the device clock.
#[test]
fn a_pending_download_delivers_only_after_it_returns() {
    let (mut engine, sim) = engine();
    let data = distinct(4096);
    let tensor = upload_tensor(&mut engine, &data, &[64, 64]).unwrap();
    let buffer = PinnedHostBuffer::<u32>::new(&mut engine, 4096).unwrap();
    let mut pending = download_pending(&mut engine, tensor, buffer).unwrap();
    assert!(!pending.is_ready().unwrap());
    // Not ready until everything queued before its event, and the event, have run.
    while sim.queued() > 0 {
        assert!(!pending.is_ready().unwrap());
        sim.advance(1);
    }
    assert!(pending.is_ready().unwrap());
    let returned = pending.wait().unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..]);
    assert_eq!(returned.tensor().shape(), &[64, 64]);
}

// Simulator-only: counts the allocations.
#[test]
fn resubmission_allocates_nothing() {
    let (mut engine, sim) = engine();
    let dest = engine.alloc_tensor::<u32>(&[256]).unwrap();
    let source = PinnedHostBuffer::<u32>::new(&mut engine, 256).unwrap();
    let mut returned = upload_pending(&mut engine, source, dest)
        .unwrap()
        .wait()
        .unwrap();
    download_tensor(&mut engine, returned.tensor()).unwrap(); // warms the blocking route's event
    let (allocs, host, events) = (
        sim.calls(SimOp::Alloc),
        sim.calls(SimOp::HostAlloc),
        sim.calls(SimOp::EventCreate),
    );
    for round in 0..5u32 {
        let data: Vec<u32> = (0..256).map(|i| i * 7 + round + 1).collect();
        returned.buffer_mut().as_mut_slice().copy_from_slice(&data);
        returned = returned.resubmit(&mut engine).unwrap().wait().unwrap();
        assert_eq!(
            download_tensor(&mut engine, returned.tensor()).unwrap(),
            data
        );
    }
    assert_eq!(sim.calls(SimOp::Alloc), allocs);
    assert_eq!(sim.calls(SimOp::HostAlloc), host);
    assert_eq!(sim.calls(SimOp::EventCreate), events);
}

// Simulator-only: injects a failed enqueue.
#[test]
fn a_failed_enqueue_returns_the_package() {
    let (mut engine, sim) = engine();
    let buffer = PinnedHostBuffer::<u32>::new(&mut engine, 8).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[8]).unwrap();
    sim.fail_nth(SimOp::CopyHtoD, 1, DriverError::INVALID_VALUE);
    match upload_pending(&mut engine, buffer, dest) {
        Err(SubmitError::Failed {
            input: package,
            error,
        }) => {
            assert_eq!(package.0.len(), 8);
            assert!(error.to_string().contains("cuMemcpyHtoDAsync"), "{error}");
        }
        other => panic!("expected Failed, got {other:?}"),
    }
}

// Simulator-only: holds the device clock and reads the live pinned memory.
#[test]
fn dropping_an_in_flight_handle_detaches_it_until_its_event_proves_completion() {
    let (mut engine, sim) = engine();
    engine.set_pinned_pool_budget(0).unwrap();
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &distinct(64)).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    let dest = engine.alloc_tensor::<u32>(&[64]).unwrap();
    drop(upload_pending(&mut engine, buffer, dest).unwrap());
    assert_eq!(engine.retirement_stats().pending, 1);
    assert!(
        sim.is_pinned_live(ptr),
        "not released while the copy is queued"
    );
    engine.flush().unwrap();
    assert!(sim.is_pinned_live(ptr), "flush does not retire");
    engine.synchronize().unwrap();
    assert!(
        !sim.is_pinned_live(ptr),
        "released by the drain after completion"
    );
    assert_eq!(engine.retirement_stats().released, 1);
    assert!(sim.violations().is_empty());
}

// Simulator-only: reads the leaked pinned memory.
#[test]
fn forgetting_an_in_flight_handle_never_releases() {
    let (mut engine, sim) = engine();
    engine.set_pinned_pool_budget(0).unwrap();
    let buffer = PinnedHostBuffer::<u32>::new(&mut engine, 64).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    let value = upload_tensor(&mut engine, &distinct(64), &[64]).unwrap();
    std::mem::forget(download_pending(&mut engine, value, buffer).unwrap());
    engine.synchronize().unwrap();
    drop(engine);
    assert!(sim.is_pinned_live(ptr));
    assert!(sim.violations().is_empty());
}

// Simulator-only: injects a failed event.
#[test]
fn a_failed_wait_retains_everything_and_says_why() {
    let (mut engine, sim) = engine();
    engine.set_pinned_pool_budget(0).unwrap();
    let buffer = PinnedHostBuffer::<u32>::new(&mut engine, 64).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    let value = upload_tensor(&mut engine, &distinct(64), &[64]).unwrap();
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    let err = download_pending(&mut engine, value, buffer)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(matches!(
        err,
        Error::DeviceFault {
            source: DriverError::LAUNCH_FAILED,
            ..
        }
    ));
    engine.synchronize().unwrap();
    let stats = engine.retirement_stats();
    assert_eq!(stats.retained, 1);
    assert_eq!(stats.first_failure.unwrap().1, DriverError::LAUNCH_FAILED);
    drop(engine);
    assert!(
        sim.is_pinned_live(ptr),
        "retained for good, even at teardown"
    );
    let (live, _) = sim.device_live();
    assert_eq!(live, 1, "the device value is retained too");
}

// Simulator-only: injects a failed event.
#[test]
fn a_detached_record_whose_event_fails_is_never_released() {
    let (mut engine, sim) = engine();
    engine.set_pinned_pool_budget(0).unwrap();
    let buffer = PinnedHostBuffer::<u32>::new(&mut engine, 16).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    let dest = engine.alloc_tensor::<u32>(&[16]).unwrap();
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    drop(upload_pending(&mut engine, buffer, dest).unwrap());
    // The failure of detached work is reported once, at the next boundary, naming the work.
    match engine.synchronize() {
        Err(Error::Deferred { count: 1, first }) => assert!(
            matches!(
                *first,
                Error::DeviceFault {
                    what: "pending upload",
                    source: DriverError::LAUNCH_FAILED
                }
            ),
            "{first}"
        ),
        other => panic!("expected the detached failure to be reported, got {other:?}"),
    }
    engine.synchronize().expect("reported once");
    engine.flush().expect("reported once");
    assert_eq!(engine.retirement_stats().retained, 1);
    drop(engine);
    assert!(sim.is_pinned_live(ptr));
}

// Simulator-only: steps the device clock.
#[test]
fn two_transfers_complete_independently() {
    let (mut engine, sim) = engine();
    let a = PinnedHostBuffer::from_slice(&mut engine, &distinct(32)).unwrap();
    let b = PinnedHostBuffer::from_slice(&mut engine, &distinct(48)).unwrap();
    let ta = engine.alloc_tensor::<u32>(&[32]).unwrap();
    let tb = engine.alloc_tensor::<u32>(&[48]).unwrap();
    let mut pa = upload_pending(&mut engine, a, ta).unwrap();
    let mut pb = upload_pending(&mut engine, b, tb).unwrap();
    sim.advance(2); // the first copy and its event
    assert!(pa.is_ready().unwrap());
    assert!(!pb.is_ready().unwrap());
    let ra = pa.wait().unwrap();
    assert!(
        !pb.is_ready().unwrap(),
        "waiting for one leaves the other in flight"
    );
    let rb = pb.wait().unwrap();
    assert_eq!(
        download_tensor(&mut engine, ra.tensor()).unwrap(),
        distinct(32)
    );
    assert_eq!(
        download_tensor(&mut engine, rb.tensor()).unwrap(),
        distinct(48)
    );
}

// Simulator-only: holds the device clock over the teardown.
#[test]
fn an_engine_dropped_with_transfers_in_flight_resolves_them() {
    let (mut engine, sim) = engine();
    let data = distinct(128);
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[128]).unwrap();
    let detached_buf = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let detached_dest = engine.alloc_tensor::<u32>(&[128]).unwrap();
    let pending = upload_pending(&mut engine, buffer, dest).unwrap();
    drop(upload_pending(&mut engine, detached_buf, detached_dest).unwrap());
    drop(engine);
    let mut pending = pending;
    assert!(
        pending.is_ready().unwrap(),
        "teardown waited for the stream"
    );
    let returned = pending.wait().unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..]);
    drop(returned);
    sim.advance_all();
    assert_eq!(sim.pinned_live(), (0, 0), "everything freed after teardown");
    assert_eq!(sim.device_live(), (0, 0));
    assert!(sim.violations().is_empty());
}

// Simulator-only: counts what was queued.
/// Every refusal of a pending transfer names the route and its direction, and a length
/// mismatch gives the tensor's shape; each hands both values back, source first.
#[test]
fn a_refused_pending_transfer_names_its_route_direction_and_shape() {
    let (mut engine, sim) = engine();
    let queued = sim.queued();
    // A download's buffer two elements short of its tensor.
    let tensor = upload_tensor(&mut engine, &distinct(8), &[2, 4]).unwrap();
    let short = PinnedHostBuffer::<u32>::new(&mut engine, 6).unwrap();
    let (tensor, short) = match download_pending(&mut engine, tensor, short) {
        Err(SubmitError::Rejected {
            input: (tensor, buffer),
            error,
        }) => {
            let message = error.to_string();
            match error {
                Error::Usage(UsageError::LengthMismatch {
                    what,
                    expected: 8,
                    found: 6,
                    shape: Some(shape),
                }) => {
                    assert_eq!(
                        what,
                        "download_pending (device to host): buffer for the tensor"
                    );
                    assert_eq!(shape, [2, 4]);
                }
                other => panic!("expected a length mismatch, got {other:?}"),
            }
            assert!(
                message.starts_with("download_pending (device to host)"),
                "{message}"
            );
            assert!(message.contains("[2, 4]"), "{message}");
            (tensor, buffer)
        }
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), distinct(8));
    assert_eq!(short.len(), 6);
    // An upload's: the same, the other way.
    let (short, tensor) = match upload_pending(&mut engine, short, tensor) {
        Err(SubmitError::Rejected { input, error }) => {
            let message = error.to_string();
            assert!(
                message.starts_with("upload_pending (host to device): buffer for the tensor"),
                "{message}"
            );
            assert!(
                matches!(
                    error,
                    Error::Usage(UsageError::LengthMismatch { shape: Some(ref s), .. }) if s == &[2, 4]
                ),
                "{error:?}"
            );
            input
        }
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Both handed back as they were.
    assert_eq!((short.len(), tensor.shape()), (6, &[2, 4][..]));
    // A tensor of another engine, and a buffer of another engine: which one, named.
    let mut other = CudaEngine::simulated(SimConfig::default());
    let foreign = other.alloc_tensor::<u32>(&[6]).unwrap();
    let (foreign, short) = match download_pending(&mut engine, foreign, short) {
        Err(SubmitError::Rejected {
            input,
            error: Error::Usage(UsageError::WrongEngine { what, .. }),
        }) => {
            assert_eq!(what, "download_pending (device to host): the tensor");
            input
        }
        other => panic!("expected a wrong engine, got {other:?}"),
    };
    let err = upload_pending(&mut other, short, foreign).unwrap_err();
    let message = err.error().to_string();
    assert!(
        message.starts_with("upload_pending (host to device): the buffer belongs to engine"),
        "{message}"
    );
    let (short, foreign) = err.into_input().unwrap();
    drop(foreign);
    // An empty tensor.
    let empty = engine.alloc_tensor::<u32>(&[0]).unwrap();
    match upload_pending(&mut engine, short, empty) {
        Err(SubmitError::Rejected {
            error: Error::Usage(UsageError::ZeroLength { what }),
            ..
        }) => assert_eq!(what, "upload_pending (host to device): the tensor"),
        other => panic!("expected a zero length, got {other:?}"),
    }
    // bool downloads: refused, the route and direction named.
    let flags = upload_tensor(&mut engine, &[true, false], &[2]).unwrap();
    let bbuf = PinnedHostBuffer::<bool>::new(&mut engine, 2).unwrap();
    match download_pending(&mut engine, flags, bbuf) {
        Err(SubmitError::Rejected {
            input: (flags, bbuf),
            error: Error::Usage(UsageError::UnsupportedElement { operation, .. }),
        }) => {
            assert_eq!(operation, "download_pending (device to host)");
            assert_eq!((flags.len(), bbuf.len()), (2, 2));
        }
        other => panic!("expected an unsupported element, got {other:?}"),
    }
    assert_eq!(sim.queued(), queued + 1, "nothing queued but the upload");
}

// Simulator-only: reads the device addresses.
/// A download hands its parts back in the order it took them, source first: the tensor, then
/// the buffer, from `into_parts` as from a refusal.
// Simulator-only: the device's clock is held to keep the work in flight.
#[test]
fn wait_for_hands_an_unfinished_transfer_back_and_returns_a_finished_one() {
    let sim = cuferry::sim::SimDevice::new(SimConfig::default());
    let mut engine = CudaEngine::simulated_on(&sim);
    let source = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0, 3.0]).unwrap();
    let destination = engine.alloc_tensor::<f32>(&[3]).unwrap();
    // The device runs nothing while its clock is held: the upload cannot complete.
    sim.hold_clock(true);
    let upload = upload_pending(&mut engine, source, destination).unwrap();
    let start = std::time::Instant::now();
    let upload = match upload
        .wait_for(std::time::Duration::from_millis(30))
        .unwrap()
    {
        TryWait::InFlight(upload) => upload,
        TryWait::Returned(_) => panic!("returned while the device's clock was held"),
    };
    assert!(start.elapsed() >= std::time::Duration::from_millis(30));
    sim.hold_clock(false);
    let returned = match upload.wait_for(std::time::Duration::from_secs(20)).unwrap() {
        TryWait::Returned(returned) => returned,
        TryWait::InFlight(_) => panic!("still in flight with the clock running"),
    };
    let (buffer, tensor) = returned.into_parts();
    assert_eq!(buffer.as_slice(), [1.0, 2.0, 3.0]);
    assert_eq!(
        download_tensor(&mut engine, &tensor).unwrap(),
        [1.0, 2.0, 3.0]
    );
}

// Simulator-only: the device's clock is held to keep the work in flight.
#[test]
fn wait_for_a_peer_copy_times_out_hands_back_and_duration_max_is_no_bound() {
    let sim = cuferry::sim::SimDevice::new(SimConfig::default());
    let mut a = CudaEngine::simulated_on(&sim);
    let mut b = CudaEngine::simulated_on(&sim);
    let source = a.full(&[64], 4.0f32).unwrap();
    let destination = b.full(&[64], 0.0f32).unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    sim.hold_clock(true);
    let copy = cuferry::peer::copy_pending(&mut a, source, &mut b, destination).unwrap();
    let copy = match copy.wait_for(std::time::Duration::ZERO).unwrap() {
        TryWait::InFlight(copy) => copy,
        TryWait::Returned(_) => panic!("returned while the device's clock was held"),
    };
    let copy = match copy.wait_for(std::time::Duration::from_millis(20)).unwrap() {
        TryWait::InFlight(copy) => copy,
        TryWait::Returned(_) => panic!("returned while the device's clock was held"),
    };
    sim.hold_clock(false);
    // No bound, and no panic on an instant too large to represent.
    let returned = match copy.wait_for(std::time::Duration::MAX).unwrap() {
        TryWait::Returned(returned) => returned,
        TryWait::InFlight(_) => panic!("a wait with no bound hands nothing back"),
    };
    let (_source, destination) = returned.into_parts();
    assert_eq!(
        download_tensor(&mut b, &destination).unwrap(),
        vec![4.0; 64]
    );
}
