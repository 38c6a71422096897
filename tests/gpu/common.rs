//! Helpers shared by the GPU tests.

use cuferry::CudaEngine;

/// Opens device 0, which every GPU test runs on.
pub(crate) fn open() -> CudaEngine {
    CudaEngine::open(0).expect("a CUDA device at ordinal 0")
}

/// Per-index distinct values: never zeros, never repeating within 2^24.
pub(crate) fn distinct_f32(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i % (1 << 24)) as f32 * 0.5 + 1.0).collect()
}

/// A context that belongs to no engine, made current on this thread; destroyed on drop.
pub(crate) struct ForeignContext(pub cudarc::driver::sys::CUcontext);

impl ForeignContext {
    pub(crate) fn new() -> Self {
        use cudarc::driver::{result, sys};
        let dev = result::device::get(0).unwrap();
        let mut ctx = std::mem::MaybeUninit::uninit();
        // SAFETY: `dev` is a valid device; null creation parameters ask for defaults. The new
        // context is pushed current on this thread.
        let code = unsafe { sys::cuCtxCreate_v4(ctx.as_mut_ptr(), std::ptr::null_mut(), 0, dev) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
        // SAFETY: written by the successful call above.
        ForeignContext(unsafe { ctx.assume_init() })
    }
}

impl Drop for ForeignContext {
    fn drop(&mut self) {
        // SAFETY: the context was created above and is destroyed once.
        unsafe { cudarc::driver::sys::cuCtxDestroy_v2(self.0) };
    }
}

/// The context current on this thread (null for none).
pub(crate) fn current_context() -> cudarc::driver::sys::CUcontext {
    cudarc::driver::result::ctx::get_current()
        .unwrap()
        .unwrap_or(std::ptr::null_mut())
}
