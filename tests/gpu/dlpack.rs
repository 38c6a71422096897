//! DLPack exchange: the bodies of `tests/bodies/dlpack.rs` on the GPU, and the host time of one
//! exchange.

use cuferry::CudaEngine;
use cuferry::dlpack::{self, Ready, Stream, Strides, Version};
use std::time::{Duration, Instant};

crate::bodies::dlpack::tests!(gpu);

/// The host time of one export (the capsule, the event record and the consumer stream's wait)
/// and one import (the checks, the driver's allocation query, the join), each timed alone over
/// 20 000 exchanges between two engines of device 0; the record quotes the printed figures.
#[test]
#[ignore = "needs a CUDA device; a measurement"]
fn measure_dlpack_host_time() {
    let mut a = CudaEngine::open(0).unwrap();
    let mut b = CudaEngine::open(0).unwrap();
    // SAFETY: `b`'s own compute stream, live as long as `b`, which outlives every capsule here.
    let stream = unsafe { Stream::from_raw(dlpack::engine_stream(&b)) };
    let n = 20_000u32;
    let (mut export, mut import) = (Duration::ZERO, Duration::ZERO);
    for round in 0..n + 1000 {
        let t = a.alloc_tensor::<f32>(&[1024]).unwrap();
        let start = Instant::now();
        let capsule = dlpack::export(&mut a, t, Some(stream), Version::V1).unwrap();
        let middle = Instant::now();
        let y =
            dlpack::import::<f32>(&mut b, capsule, Ready::OnEngineStream, Strides::Refuse).unwrap();
        let end = Instant::now();
        if round >= 1000 {
            // The first thousand warm the pools and caches.
            export += middle - start;
            import += end - middle;
        }
        drop(y);
        if round % 256 == 0 {
            b.flush().unwrap();
            a.flush().unwrap();
        }
    }
    b.synchronize().unwrap();
    a.synchronize().unwrap();
    println!(
        "dlpack host time, {n} exchanges: export {:.2} us, import {:.2} us",
        export.as_secs_f64() * 1e6 / f64::from(n),
        import.as_secs_f64() * 1e6 / f64::from(n)
    );
}
