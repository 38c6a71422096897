//! `with_raw` on the GPU: a raw NVRTC kernel and a raw cuBLAS call, both queued by the test
//! itself on the engine's stream inside raw scopes, interleaved with eager operations and no
//! host barrier; the data the chain computes proves the order. The caller's context is restored
//! on return, on `Err` and on unwind.

use crate::engine;
use crate::reference::Rng;
use cudarc::driver::{result, sys};
use cuferry::error::UsageError;
use cuferry::{CudaEngine, Error, download_tensor, upload_tensor};
use std::ffi::{CString, c_void};

type TestError = Box<dyn std::error::Error + Send + Sync>;

const ADD_ONE: &str = r#"
extern "C" __global__ void add_one(float* x, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"#;

fn current() -> Option<sys::CUcontext> {
    result::ctx::get_current().expect("cuCtxGetCurrent")
}

fn unbind() {
    // SAFETY: a null context unbinds the calling thread.
    unsafe { result::ctx::set_current(std::ptr::null_mut()) }.expect("cuCtxSetCurrent");
}

#[test]
#[ignore = "needs a CUDA device"]
fn raw_kernels_and_raw_cublas_interleave_with_eager_operations_in_stream_order() {
    // SAFETY: probing only `dlopen`s candidate library names.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    // SAFETY: as above.
    let cublas = unsafe { cudarc::cublas::sys::is_culib_present() };
    assert!(
        nvrtc && cublas,
        "NVRTC present: {nvrtc}, cuBLAS present: {cublas}"
    );
    let mut engine = engine();
    let mut rng = Rng::new(5000);
    let n = 1 << 18;
    let host: Vec<f32> = (0..n).map(|_| (rng.unit() * 50.0) as f32).collect();
    let x = upload_tensor(&mut engine, &host, &[n]).unwrap();

    let ptx = cudarc::nvrtc::compile_ptx(ADD_ONE).expect("NVRTC compiles the raw kernel");
    let ptx = CString::new(ptx.to_src()).unwrap();

    // 1. eager: y = 2x
    let mut y = engine.scale(&x, 2.0).unwrap();
    // 2. raw NVRTC kernel on the engine's stream: y += 1
    let module = engine
        .with_raw(|raw| -> Result<sys::CUmodule, TestError> {
            let ptr = raw.device_ptr_mut(&mut y)?;
            assert_eq!(current(), Some(raw.context().as_raw()));
            // SAFETY: the PTX is NUL-terminated and the engine's context is current; the kernel
            // takes (float*, u64), which the parameters are; `y` holds `n` floats and stays
            // alive (and unmoved) until the final download, which orders after the kernel.
            unsafe {
                let module = result::module::load_data(ptx.as_ptr().cast())?;
                let f = result::module::get_function(module, CString::new("add_one")?)?;
                let mut p = ptr.as_raw();
                let mut len = n as u64;
                let mut params = [
                    (&mut p as *mut u64).cast::<c_void>(),
                    (&mut len as *mut u64).cast::<c_void>(),
                ];
                let blocks = (n as u32).div_ceil(256);
                result::launch_kernel(
                    f,
                    (blocks, 1, 1),
                    (256, 1, 1),
                    0,
                    raw.stream().as_raw(),
                    &mut params,
                )?;
                Ok(module)
            }
        })
        .unwrap();
    // 3. eager: z = y + x
    let mut z = engine.add(&y, &x).unwrap();
    // 4. raw cuBLAS on the engine's stream: z *= 3
    let handle = engine
        .with_raw(|raw| -> Result<_, TestError> {
            let ptr = raw.device_ptr_mut(&mut z)?;
            let handle = cudarc::cublas::result::create_handle()?;
            let alpha = 3.0f32;
            // SAFETY: a fresh handle bound to the engine's stream (current context is the
            // engine's); `z` holds `n` floats and outlives the call's completion (downloaded
            // below, stream-ordered after it); alpha is a host scalar read during the call.
            unsafe {
                cudarc::cublas::result::set_stream(handle, raw.stream().as_raw() as _)?;
                let status = cudarc::cublas::sys::cublasSscal_v2(
                    handle,
                    n as i32,
                    &alpha,
                    ptr.as_raw() as *mut f32,
                    1,
                );
                assert_eq!(
                    status,
                    cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                );
            }
            Ok(handle)
        })
        .unwrap();
    // 5. eager: w = -z
    let w = engine.neg(&z).unwrap();
    // The first host wait of the chain.
    let got = download_tensor(&mut engine, &w).unwrap();
    let want: Vec<f32> = host
        .iter()
        .map(|&v| {
            let y = v * 2.0 + 1.0;
            -((y + v) * 3.0)
        })
        .collect();
    assert_eq!(got, want, "the chain ran out of order");

    engine.synchronize().unwrap();
    engine
        .with_raw(|_| -> Result<(), TestError> {
            // SAFETY: the stream is idle (synchronized); both are destroyed once.
            unsafe {
                cudarc::cublas::result::destroy_handle(handle)?;
                result::module::unload(module)?;
            }
            Ok(())
        })
        .unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn with_raw_restores_the_callers_context_on_return_err_and_unwind() {
    let mut engine: CudaEngine = engine();
    let t = upload_tensor(&mut engine, &[1.0f32, 2.0], &[2]).unwrap();

    unbind();
    let inside = engine
        .with_raw(|raw| Ok::<_, Error>((current(), raw.context().as_raw())))
        .unwrap();
    assert_eq!(
        inside.0,
        Some(inside.1),
        "the engine's context is current inside"
    );
    assert_eq!(current(), None, "restored after return");

    let err = engine.with_raw(|_| -> Result<(), Error> {
        Err(Error::Usage(UsageError::ZeroLength { what: "test" }))
    });
    assert!(matches!(
        err,
        Err(Error::Usage(UsageError::ZeroLength { .. }))
    ));
    assert_eq!(current(), None, "restored after Err");

    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = engine.with_raw(|_| -> Result<(), Error> { panic!("inside a raw scope") });
    }));
    assert!(unwound.is_err());
    assert_eq!(current(), None, "restored after unwind");

    // The engine still works, whatever the thread's context.
    let doubled = engine.add(&t, &t).unwrap();
    assert_eq!(download_tensor(&mut engine, &doubled).unwrap(), [2.0, 4.0]);
    assert_eq!(current(), None);
}
