//! Raw-driver helpers shared by the benches that compare two engines with the raw driver.

use cudarc::driver::sys;
use cuferry::CudaEngine;

/// Panics, naming `call`, unless `code` is success.
pub(crate) fn check(call: &str, code: sys::CUresult) {
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "{call}");
}

/// The engine's context, for raw calls beside it.
pub(crate) fn context(engine: &mut CudaEngine) -> sys::CUcontext {
    engine
        .with_raw(|r| Ok::<_, cuferry::Error>(r.context().as_raw() as usize))
        .unwrap() as sys::CUcontext
}

/// A new non-blocking stream of `ctx` (made current).
pub(crate) fn stream(ctx: sys::CUcontext) -> sys::CUstream {
    let mut s = std::ptr::null_mut();
    // SAFETY: `ctx` is an engine's live context; out pointer valid.
    unsafe {
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
        check(
            "cuStreamCreate",
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
        );
    }
    s
}

/// A new event of `ctx` with timing disabled (the context made current).
pub(crate) fn event(ctx: sys::CUcontext) -> sys::CUevent {
    let mut e = std::ptr::null_mut();
    // SAFETY: as in `stream`.
    unsafe {
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
        check(
            "cuEventCreate",
            sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
        );
    }
    e
}

/// The median time of `f`: one warm-up run, then at least 5 runs, and more until `budget` has
/// passed or `most` runs are in.
#[allow(dead_code)] // not every bench that shares this module times with it
pub(crate) fn median_within(
    budget: std::time::Duration,
    most: usize,
    mut f: impl FnMut(),
) -> std::time::Duration {
    use std::time::Instant;
    f();
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 5 || (start.elapsed() < budget && times.len() < most) {
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    }
    times.sort_unstable();
    times[times.len() / 2]
}

/// Engines on GPU 0 and GPU 1, or `None` (after saying so, as `bench`) when the machine has
/// fewer than two GPUs, or when the test harness only lists the benches (`--list`).
#[allow(dead_code)] // not every bench that shares this module needs two GPUs
pub(crate) fn two_gpus(bench: &str) -> Option<(CudaEngine, CudaEngine)> {
    if std::env::args().any(|a| a == "--list") {
        return None;
    }
    match (CudaEngine::open(0), CudaEngine::open(1)) {
        (Ok(a), Ok(b)) => Some((a, b)),
        _ => {
            eprintln!("{bench}: two CUDA devices are needed; nothing measured");
            None
        }
    }
}
