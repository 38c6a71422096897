//! Pinned buffers and pending transfers on a real device.

use crate::common::{distinct_f32, open};
use cuferry::error::UsageError;
use cuferry::{
    CudaEngine, Element, Error, PinnedHostBuffer, SubmitError, bf16, download_pending,
    download_tensor, download_tensor_into, f16, upload_pending, upload_tensor,
};

const BIG: usize = 64 << 20; // bytes

/// Whether `ptr` is still page-locked memory the driver knows (asked with device 0's primary
/// context current, then the thread's context restored).
///
/// A deliberate probe: for memory that was freed, `cuMemHostGetFlags` answers
/// `CUDA_ERROR_INVALID_VALUE`, which is what the caller hopes to see. compute-sanitizer's memcheck
/// reports that answer as an API error, so the sanitizer run skips the test that probes:
/// `bash .gpu/run sanitize --skip pending::drop_resolves_before_releasing`.
fn is_pinned(ptr: *const u8) -> bool {
    use cudarc::driver::sys;
    let previous = crate::common::current_context();
    let mut ctx = std::ptr::null_mut();
    let mut flags = 0u32;
    // SAFETY: device 0 exists (the test opened it); the primary context is retained for the
    // query and released after; cuMemHostGetFlags only inspects the address and writes `flags`.
    unsafe {
        assert_eq!(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, 0),
            sys::CUresult::CUDA_SUCCESS
        );
        sys::cuCtxSetCurrent(ctx);
        let code = sys::cuMemHostGetFlags(&mut flags, ptr as *mut _);
        sys::cuCtxSetCurrent(previous);
        sys::cuDevicePrimaryCtxRelease_v2(0);
        code == sys::CUresult::CUDA_SUCCESS
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_64_mib_pending_download_is_seen_in_flight_then_correct() {
    let mut engine = open();
    let n = BIG / 4;
    let data = distinct_f32(n);
    let value = upload_tensor(&mut engine, &data, &[n]).unwrap();
    let mut buffer = PinnedHostBuffer::<f32>::new(&mut engine, n).unwrap();
    buffer.as_mut_slice().fill(-1.0); // poison
    let mut pending = download_pending(&mut engine, value, buffer).unwrap();
    assert!(
        !pending.is_ready().unwrap(),
        "a 64 MiB copy cannot finish before the first poll"
    );
    let returned = pending.wait().unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_64_mib_pending_upload_is_seen_in_flight_then_correct() {
    let mut engine = open();
    let n = BIG / 4;
    let data = distinct_f32(n);
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let mut pending = upload_pending(&mut engine, source, dest).unwrap();
    assert!(!pending.is_ready().unwrap());
    let (_, tensor) = pending.wait().unwrap().into_parts();
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), data);
}

#[test]
#[ignore = "needs a CUDA device"]
fn forget_never_releases() {
    // A second engine keeps the primary context alive after the first is dropped: destroying
    // the context would free every host allocation made in it, leaked or not.
    let _keeps_context = open();
    let mut engine = open();
    engine.set_pinned_pool_budget(0).unwrap();
    let n = BIG / 4;
    let buffer = PinnedHostBuffer::<f32>::new(&mut engine, n).unwrap();
    let ptr = buffer.as_slice().as_ptr().cast::<u8>();
    let value = upload_tensor(&mut engine, &distinct_f32(n), &[n]).unwrap();
    std::mem::forget(download_pending(&mut engine, value, buffer).unwrap());
    engine.synchronize().unwrap();
    assert_eq!(engine.retirement_stats().pending, 0);
    drop(engine);
    assert!(
        is_pinned(ptr),
        "a forgotten transfer's buffer is leaked, never freed"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn drop_resolves_before_releasing() {
    let mut engine = open();
    engine.set_pinned_pool_budget(0).unwrap();
    let n = BIG / 4;
    let source = PinnedHostBuffer::from_slice(&mut engine, &distinct_f32(n)).unwrap();
    let ptr = source.as_slice().as_ptr().cast::<u8>();
    let dest = engine.alloc_tensor::<f32>(&[n]).unwrap();
    drop(upload_pending(&mut engine, source, dest).unwrap());
    assert_eq!(engine.retirement_stats().pending, 1);
    assert!(is_pinned(ptr), "still pinned while the copy may run");
    engine.synchronize().unwrap();
    let stats = engine.retirement_stats();
    assert_eq!((stats.pending, stats.released), (0, 1));
    assert!(
        !is_pinned(ptr),
        "released (budget 0 frees it) once its event proved completion"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn two_transfers_in_flight_complete_independently() {
    let mut engine = open();
    let n = BIG / 4;
    let a = distinct_f32(n);
    let b: Vec<f32> = a.iter().map(|x| -x).collect();
    let ta = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let tb = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let pa = PinnedHostBuffer::from_slice(&mut engine, &a).unwrap();
    let pb = PinnedHostBuffer::from_slice(&mut engine, &b).unwrap();
    let first = upload_pending(&mut engine, pa, ta).unwrap();
    let mut second = upload_pending(&mut engine, pb, tb).unwrap();
    let first = first.wait().unwrap();
    // The second may or may not be done; either way it completes on its own wait.
    let _ = second.is_ready().unwrap();
    let second = second.wait().unwrap();
    assert_eq!(download_tensor(&mut engine, first.tensor()).unwrap(), a);
    assert_eq!(download_tensor(&mut engine, second.tensor()).unwrap(), b);
}

#[test]
#[ignore = "needs a CUDA device"]
fn rejected_packages_come_back_untouched() {
    let mut engine = open();
    let data = distinct_f32(1000);
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<f32>(&[999]).unwrap();
    let err = upload_pending(&mut engine, buffer, dest).unwrap_err();
    let SubmitError::Rejected {
        input: package,
        error,
    } = err
    else {
        panic!("expected a rejection, got {err}");
    };
    assert!(
        matches!(
            error,
            Error::Usage(UsageError::LengthMismatch {
                found: 1000,
                expected: 999,
                ..
            })
        ),
        "{error}"
    );
    assert_eq!(package.0.as_slice(), &data[..]);
    let mut other = open();
    let err = download_pending(&mut other, package.1, package.0).unwrap_err();
    assert!(matches!(
        err,
        SubmitError::Rejected {
            error: Error::Usage(UsageError::WrongEngine { .. }),
            ..
        }
    ));
    assert_eq!(err.into_input().unwrap().0.as_slice(), &data[..]);
}

fn round_trip<T: Element>(engine: &mut CudaEngine, make: impl Fn(usize) -> T) {
    for n in [1usize, 3, 4096 + 5] {
        let data: Vec<T> = (0..n).map(&make).collect();
        let source = PinnedHostBuffer::from_slice(engine, &data).unwrap();
        let dest = engine.alloc_tensor::<T>(&[n]).unwrap();
        let (_, tensor) = upload_pending(engine, source, dest)
            .unwrap()
            .wait()
            .unwrap()
            .into_parts();
        if T::DTYPE.any_bit_pattern() {
            let buffer = PinnedHostBuffer::<T>::new(engine, n).unwrap();
            let back = download_pending(engine, tensor, buffer)
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(back.buffer().as_slice(), &data[..], "{} n={n}", T::DTYPE);
        } else {
            assert_eq!(
                download_tensor(engine, &tensor).unwrap(),
                data,
                "{} n={n}",
                T::DTYPE
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_bytes_round_trip_for_every_element() {
    let mut e = open();
    round_trip(&mut e, |i| i as f32 * 0.75 + 1.0);
    round_trip(&mut e, |i| i as f64 * -1.25 + 3.0);
    round_trip(&mut e, |i| f16::from_f32((i % 1000) as f32 * 0.5 + 1.0));
    round_trip(&mut e, |i| bf16::from_f32((i % 1000) as f32 * 0.5 + 1.0));
    round_trip(&mut e, |i| (i % 251) as i8 - 120);
    round_trip(&mut e, |i| (i * 7) as i16 - 1000);
    round_trip(&mut e, |i| (i * 13) as i32 - 100_000);
    round_trip(&mut e, |i| (i as i64) * -1_000_003 + 5);
    round_trip(&mut e, |i| (i * 3 + 1) as u8);
    round_trip(&mut e, |i| (i * 5 + 1) as u16);
    round_trip(&mut e, |i| (i as u32).wrapping_mul(2_654_435_761) | 1);
    round_trip(&mut e, |i| (i as u64) << 33 | 7);
    round_trip(&mut e, |i| i % 3 == 1);
}

#[test]
#[ignore = "needs a CUDA device"]
fn download_tensor_into_reuses_its_capacity() {
    let mut engine = open();
    let n = (8 << 20) / 4;
    let data = distinct_f32(n);
    let t = upload_tensor(&mut engine, &data, &[n]).unwrap();
    let mut out = Vec::with_capacity(n);
    out.push(-1.0f32);
    let ptr = out.as_ptr();
    for _ in 0..3 {
        out = download_tensor_into(&mut engine, &t, out).unwrap();
        assert_eq!(out, data);
        assert_eq!(out.as_ptr(), ptr);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_engine_dropped_while_handles_are_in_flight() {
    let mut engine = open();
    let n = BIG / 4;
    let data = distinct_f32(n);
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let kept = upload_pending(&mut engine, source, dest).unwrap();
    let value = upload_tensor(&mut engine, &data, &[n]).unwrap();
    let buffer = PinnedHostBuffer::<f32>::new(&mut engine, n).unwrap();
    let detached = download_pending(&mut engine, value, buffer).unwrap();
    drop(detached);
    drop(engine);
    let returned = kept.wait().unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..]);
    let (buffer, tensor) = returned.into_parts();
    drop(tensor);
    drop(buffer);
}
