//! CubeCL interop on the GPU: a real CubeCL kernel on data that came from the engine, its result
//! brought back into a `DeviceTensor`, with engine work queued (and not waited for) on both
//! sides of the boundary; the data proves the order.

use crate::engine;
use crate::reference::Rng;
use cuferry::cubecl::runtime::prelude::*;
use cuferry::{download_tensor, upload_tensor};

#[cube(launch)]
fn affine(input: &Array<f32>, output: &mut Array<f32>) {
    if ABSOLUTE_POS < input.len() {
        output[ABSOLUTE_POS] = input[ABSOLUTE_POS] * 3.0 + 1.0;
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_cubecl_kernel_runs_between_eager_operations_in_order() {
    let mut engine = engine();
    let mut rng = Rng::new(6000);
    let n = 100_003usize;
    let host: Vec<f32> = (0..n).map(|_| (rng.unit() * 10.0) as f32).collect();
    let x = upload_tensor(&mut engine, &host, &[n]).unwrap();
    // Queued on the engine's stream; the import must see it.
    let y = engine.scale(&x, 2.0).unwrap();
    let z = engine
        .with_cubecl(|scope| -> Result<_, cuferry::Error> {
            let input = scope.import(&y)?;
            let client = scope.client().clone();
            let output = client.empty(n * std::mem::size_of::<f32>());
            let blocks = (n as u32).div_ceil(256);
            // SAFETY: both buffers hold `n` f32 values, as the raw parts claim.
            unsafe {
                affine::launch(
                    &client,
                    CubeCount::Static(blocks, 1, 1),
                    CubeDim::new_1d(256),
                    ArrayArg::from_raw_parts(input, n),
                    ArrayArg::from_raw_parts(output.clone(), n),
                );
            }
            // The export must see the CubeCL kernel.
            scope.export::<f32>(&output, &[n])
        })
        .unwrap();
    // Queued after the export on the engine's stream.
    let w = engine.add(&z, &x).unwrap();
    let got = download_tensor(&mut engine, &w).unwrap();
    let want: Vec<f32> = host.iter().map(|&v| (v * 2.0) * 3.0 + 1.0 + v).collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        // CubeCL may fuse the multiply-add; allow one rounding of difference.
        assert!(
            (g - w).abs() <= w.abs() * 1e-6 + 1e-6,
            "element {i}: {g} vs {w}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn with_cubecl_restores_the_callers_context() {
    use cudarc::driver::result::ctx;
    let mut engine = engine();
    // SAFETY: a null context unbinds the calling thread.
    unsafe { ctx::set_current(std::ptr::null_mut()) }.unwrap();
    engine.with_cubecl(|_| Ok::<_, cuferry::Error>(())).unwrap();
    assert_eq!(ctx::get_current().unwrap(), None);
    let err = engine.with_cubecl(|_| -> Result<(), cuferry::Error> {
        Err(cuferry::Error::Usage(
            cuferry::error::UsageError::ZeroLength { what: "test" },
        ))
    });
    assert!(err.is_err());
    assert_eq!(ctx::get_current().unwrap(), None);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_cubecl_import_of_an_in_flight_destination_sees_the_landed_data() {
    let mut engine = engine();
    let n = 16usize << 20; // 64 MiB of f32: the copy is still running when the import is asked for
    let host: Vec<f32> = (0..n).map(|i| (i % 4093) as f32).collect();
    let source = cuferry::PinnedHostBuffer::from_slice(&mut engine, &host).unwrap();
    let destination = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let upload = cuferry::upload_pending(&mut engine, source, destination).unwrap();
    let on_device = upload.tensor();
    let back = engine
        .with_cubecl(|scope| -> Result<_, cuferry::Error> {
            // Queued on the engine's stream after the upload, then waited for on the host.
            let handle = scope.import(on_device)?;
            scope.export::<f32>(&handle, &[n])
        })
        .unwrap();
    assert_eq!(download_tensor(&mut engine, &back).unwrap(), host);
    drop(upload.wait().unwrap());
}
