//! Pinned buffers and pending transfers on the simulated device.

use crate::support::{distinct_u32 as distinct, sim_engine as engine};
use cuferry::error::UsageError;
use cuferry::sim::{SimConfig, SimOp};
use cuferry::{
    CudaEngine, Error, PinnedHostBuffer, SubmitError, download_pending, download_tensor,
    download_tensor_into, error::DriverError, pending::TryWait, upload_pending, upload_tensor,
};

#[test]
fn a_zero_length_pinned_buffer_is_a_typed_error() {
    let (mut engine, _) = engine();
    assert!(matches!(
        PinnedHostBuffer::<f32>::new(&mut engine, 0),
        Err(Error::Usage(UsageError::ZeroLength { .. }))
    ));
}

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

#[test]
fn rejected_packages_come_back_untouched() {
    let (mut engine, sim) = engine();
    let data = distinct(10);
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[11]).unwrap();
    let queued = sim.queued();
    let err = upload_pending(&mut engine, buffer, dest).unwrap_err();
    assert_eq!(sim.queued(), queued, "nothing was queued");
    let SubmitError::Rejected {
        input: package,
        error,
    } = err
    else {
        panic!("expected a rejection");
    };
    assert!(
        matches!(
            error,
            Error::Usage(UsageError::LengthMismatch {
                found: 10,
                expected: 11,
                ..
            })
        ),
        "{error}"
    );
    assert_eq!(package.0.as_slice(), &data[..]);
    assert_eq!(package.1.len(), 11);

    // Another engine's tensor.
    let mut other = CudaEngine::simulated(SimConfig::default());
    let foreign = other.alloc_tensor::<u32>(&[10]).unwrap();
    let err = download_pending(&mut engine, foreign, package.0).unwrap_err();
    assert!(matches!(
        err,
        SubmitError::Rejected {
            error: Error::Usage(UsageError::WrongEngine { .. }),
            ..
        }
    ));
    let package = err.into_input().unwrap();
    assert_eq!(package.0.as_slice(), &data[..]);

    // bool downloads expose raw bytes: refused.
    let flags = upload_tensor(&mut engine, &[true, false], &[2]).unwrap();
    let bbuf = PinnedHostBuffer::<bool>::new(&mut engine, 2).unwrap();
    assert!(matches!(
        download_pending(&mut engine, flags, bbuf),
        Err(SubmitError::Rejected {
            error: Error::Usage(UsageError::UnsupportedElement { .. }),
            ..
        })
    ));
}

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

#[test]
fn download_tensor_into_reuses_capacity() {
    let (mut engine, _) = engine();
    let data = distinct(1000);
    let t = upload_tensor(&mut engine, &data, &[1000]).unwrap();
    let mut out = Vec::with_capacity(4096);
    out.extend_from_slice(&[7u32; 17]);
    let ptr = out.as_ptr();
    let out = download_tensor_into(&mut engine, &t, out).unwrap();
    assert_eq!(out, data);
    assert_eq!(out.as_ptr(), ptr, "no reallocation");
    let small = upload_tensor(&mut engine, &distinct(3), &[3]).unwrap();
    let out = download_tensor_into(&mut engine, &small, out).unwrap();
    assert_eq!(out, distinct(3));
    assert_eq!(out.as_ptr(), ptr);
}
