//! cudarc interop on the GPU: tensors lent to cudarc kernels on cudarc streams, and cudarc
//! slices taken in as tensors, with no host wait between the two sides (the engine's reads come
//! right after the lend ends), no copy (an adopted tensor has the slice's address), and the
//! refusals typed (another context, the per-thread stream, a wrong length). The thread's
//! current context is the caller's after every call.

use crate::common::{ForeignContext, current_context, distinct_f32, open};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cuferry::error::UsageError;
use cuferry::{Error, SubmitError, cudarc_interop, download_tensor, upload_tensor};
use std::sync::Arc;

const KERNELS: &str = r#"
extern "C" __global__ void affine(float* x, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 3.0f + 1.0f;
}
extern "C" __global__ void copy_slowly(const float* x, float* y, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        // Long enough that an engine write not ordered after this read would overtake it.
        for (int k = 0; k < 2000; ++k) v = v * 1.0000001f;
        y[i] = x[i];
    }
}
"#;

/// Device 0's primary context (the engine's), a stream of its own, and the test kernels.
fn cudarc_side() -> (
    Arc<CudaContext>,
    Arc<CudaStream>,
    CudaFunction,
    CudaFunction,
) {
    // SAFETY: probing only `dlopen`s candidate library names.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    assert!(nvrtc, "NVRTC is needed to compile the test kernels");
    let ctx = CudaContext::new(0).expect("device 0's primary context");
    let stream = ctx.new_stream().unwrap();
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).expect("NVRTC compiles the test kernels");
    let module = ctx.load_module(ptx).unwrap();
    let affine = module.load_function("affine").unwrap();
    let copy = module.load_function("copy_slowly").unwrap();
    (ctx, stream, affine, copy)
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_cudarc_kernel_writes_a_lent_tensor_and_the_engine_reads_it_with_no_host_wait() {
    let mut engine = open();
    let (_ctx, stream, affine, _) = cudarc_side();
    let n = 1 << 22;
    let host = distinct_f32(n);
    let mut x = upload_tensor(&mut engine, &host, &[n]).unwrap();
    // An engine read queued before the lend: the cudarc write waits for it.
    let doubled = engine.scale(&x, 2.0).unwrap();
    {
        let mut lent = cudarc_interop::lend_mut(&mut engine, &mut x, &stream).unwrap();
        assert_eq!(lent.shape(), [n]);
        let mut view = lent.view_mut();
        assert_eq!(view.len(), n);
        let len = n as u64;
        let mut launch = stream.launch_builder(&affine);
        launch.arg(&mut view).arg(&len);
        // SAFETY: `affine` takes (float*, u64) and touches the view's `n` floats only.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    }
    // No synchronize: the engine's streams wait for the cudarc stream on the device.
    let got = download_tensor(&mut engine, &x).unwrap();
    let want: Vec<f32> = host.iter().map(|v| v * 3.0 + 1.0).collect();
    assert!(
        got == want,
        "the engine read the lent tensor before cudarc wrote it"
    );
    let want: Vec<f32> = host.iter().map(|v| v * 2.0).collect();
    assert!(
        download_tensor(&mut engine, &doubled).unwrap() == want,
        "cudarc wrote the tensor before the engine's earlier read"
    );
    engine.synchronize().unwrap();
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_engines_write_after_a_shared_lend_waits_for_the_cudarc_read() {
    let mut engine = open();
    let (_ctx, stream, _, copy) = cudarc_side();
    let n = 1 << 22;
    let host = distinct_f32(n);
    let mut x = upload_tensor(&mut engine, &host, &[n]).unwrap();
    let mut out = stream.alloc_zeros::<f32>(n).unwrap();
    {
        let lent = cudarc_interop::lend(&mut engine, &mut x, &stream).unwrap();
        let view = lent.view();
        let len = n as u64;
        let mut launch = stream.launch_builder(&copy);
        launch.arg(&view).arg(&mut out).arg(&len);
        // SAFETY: `copy_slowly` takes (const float*, float*, u64), reads the view's `n` floats
        // and writes `out`'s `n`.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    }
    // At once, no host wait: the engine overwrites what the slow kernel still reads.
    engine.fill(&mut x, -1.0).unwrap();
    let copied = stream.clone_dtoh(&out).unwrap();
    assert!(copied == host, "the engine's write overtook cudarc's read");
    assert_eq!(download_tensor(&mut engine, &x).unwrap(), vec![-1.0f32; n]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_view_used_on_another_cudarc_stream_is_ordered_both_ways() {
    let mut engine = open();
    let (ctx, stream, affine, _) = cudarc_side();
    let other = ctx.new_stream().unwrap();
    let n = 1 << 22;
    let host = distinct_f32(n);
    let mut x = upload_tensor(&mut engine, &host, &[n]).unwrap();
    {
        let mut lent = cudarc_interop::lend_mut(&mut engine, &mut x, &stream).unwrap();
        let mut view = lent.view_mut();
        let len = n as u64;
        // On another stream than the lend's: cudarc's event tracking orders it after the lend's
        // stream (which waits for the upload), and the lend's end after it.
        let mut launch = other.launch_builder(&affine);
        launch.arg(&mut view).arg(&len);
        // SAFETY: as in the first test.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    }
    let got = download_tensor(&mut engine, &x).unwrap();
    let want: Vec<f32> = host.iter().map(|v| v * 3.0 + 1.0).collect();
    assert!(got == want, "the other stream's kernel was not ordered");
    other.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_lend_to_the_legacy_default_stream_serves_and_the_callers_context_stays_current() {
    let mut engine = open();
    let (ctx, _, affine, _) = cudarc_side();
    let legacy = ctx.default_stream();
    let n = 1 << 16;
    let host = distinct_f32(n);
    let mut x = upload_tensor(&mut engine, &host, &[n]).unwrap();
    let foreign = ForeignContext::new();
    {
        let mut lent = cudarc_interop::lend_mut(&mut engine, &mut x, &legacy).unwrap();
        assert_eq!(
            current_context(),
            foreign.0,
            "the lend restores the caller's context"
        );
        let mut view = lent.view_mut();
        let len = n as u64;
        let mut launch = legacy.launch_builder(&affine);
        launch.arg(&mut view).arg(&len);
        // SAFETY: as in the first test.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
        // cudarc's launch made its context current; the caller's again before the lend ends.
        // SAFETY: the foreign context is live (held above).
        unsafe { cudarc::driver::result::ctx::set_current(foreign.0) }.unwrap();
    }
    assert_eq!(current_context(), foreign.0, "the lend's end restores it");
    let got = download_tensor(&mut engine, &x).unwrap();
    let want: Vec<f32> = host.iter().map(|v| v * 3.0 + 1.0).collect();
    assert!(got == want);
    assert_eq!(current_context(), foreign.0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_adopted_cudarc_slice_is_the_engines_tensor_without_a_copy() {
    let mut engine = open();
    let (_ctx, stream, _, _) = cudarc_side();
    let n = 1 << 20;
    let host = distinct_f32(n);
    // cudarc fills the slice on its stream; nothing waits on the host.
    let slice = stream.clone_htod(&host).unwrap();
    let address = slice.device_ptr(&stream).0;
    let mut t = cudarc_interop::adopt(&mut engine, slice, &[1024, n / 1024]).unwrap();
    assert_eq!(t.shape(), [1024, n / 1024]);
    let seen = engine
        .with_raw(|raw| raw.device_ptr(&t).map(|p| p.as_raw()))
        .unwrap();
    assert_eq!(seen, address, "the tensor views the slice's memory");
    let sum = engine.add(&t, &t).unwrap();
    let want: Vec<f32> = host.iter().map(|v| v * 2.0).collect();
    assert!(download_tensor(&mut engine, &sum).unwrap() == want);
    // The engine writes it, and drops it at once: cudarc frees it on its stream after that.
    engine.fill(&mut t, 7.0).unwrap();
    drop(t);
    engine.synchronize().unwrap();
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_adoption_of_the_wrong_length_hands_the_slice_back() {
    let mut engine = open();
    let (_ctx, stream, _, _) = cudarc_side();
    let host = distinct_f32(10);
    let slice = stream.clone_htod(&host).unwrap();
    match cudarc_interop::adopt(&mut engine, slice, &[3, 4]) {
        Err(SubmitError::Rejected {
            input,
            error:
                Error::Usage(UsageError::LengthMismatch {
                    expected: 12,
                    found: 10,
                    ..
                }),
        }) => assert_eq!(stream.clone_dtoh(&input).unwrap(), host),
        other => panic!(
            "expected a length refusal, got {:?}",
            other.map(|t| t.shape().to_vec())
        ),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn another_context_and_the_per_thread_stream_are_refused() {
    let mut engine = open();
    let (ctx, _, _, _) = cudarc_side();
    let mut x = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3]).unwrap();

    let per_thread = ctx.per_thread_stream();
    let refused = cudarc_interop::lend(&mut engine, &mut x, &per_thread);
    assert!(matches!(
        refused.err(),
        Some(Error::Usage(UsageError::PerThreadStream { .. }))
    ));

    let own = CudaContext::new_non_primary(0, 0).expect("a context of its own on device 0");
    let theirs = own.new_stream().unwrap();
    let refused = cudarc_interop::lend_mut(&mut engine, &mut x, &theirs);
    assert!(matches!(
        refused.err(),
        Some(Error::Usage(UsageError::ForeignContext { .. }))
    ));
    let slice = theirs.clone_htod(&[1.0f32, 2.0]).unwrap();
    match cudarc_interop::adopt(&mut engine, slice, &[2]) {
        Err(SubmitError::Rejected {
            input,
            error: Error::Usage(UsageError::ForeignContext { .. }),
        }) => assert_eq!(input.len(), 2),
        other => panic!(
            "expected a context refusal, got {:?}",
            other.map(|t| t.len())
        ),
    }
    // The tensor kept its memory through every refusal.
    assert_eq!(download_tensor(&mut engine, &x).unwrap(), [1.0, 2.0, 3.0]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_forgotten_lend_leaves_the_tensor_empty() {
    let mut engine = open();
    let (_ctx, stream, _, _) = cudarc_side();
    let mut x = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
    std::mem::forget(cudarc_interop::lend_mut(&mut engine, &mut x, &stream).unwrap());
    assert_eq!((x.len(), x.shape()), (0, &[0][..]));
    assert_eq!(download_tensor(&mut engine, &x).unwrap(), Vec::<f32>::new());
}
