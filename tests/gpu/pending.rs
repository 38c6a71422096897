//! Pinned buffers and pending transfers on a real device: the bodies in `tests/bodies/pending.rs`
//! (which the simulator binary runs too), and what only the driver's own probe of page-locked
//! memory shows.

use crate::common::{distinct_f32, open};
use cuferry::{PinnedHostBuffer, download_pending, upload_pending, upload_tensor};

// Written once in `tests/bodies/pending.rs`, run here on device 0 and by the simulator binary.
crate::bodies::pending::tests!(gpu);

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
