//! Peer copies between engines beside the raw driver, in the same run.
//!
//! For 16 B, 8 MiB, 64 MiB, 256 MiB and 1 GiB: the median time of `peer::copy` (a tensor of the
//! engine on GPU 0 into a new tensor of the engine on GPU 1, returned once the copy is proven
//! complete), of `peer::copy_into` (into one existing tensor of GPU 1's engine) and of
//! `peer::copy_pending` and its `wait` (the same pair of tensors each time, handed back) against
//! the raw `cuMemcpyPeerAsync` between two preallocated buffers on a stream of GPU 0's context,
//! followed by an event record and its wait; and the same raw copy queued on a stream of GPU 1's
//! context ("raw, on GPU 1"), the stream the copies into an existing tensor use. With one GPU, both engines are
//! on GPU 0. Prints each pair with its ratio. Run on a GPU machine: `cargo bench --bench
//! peer_routes`. Without a GPU it prints a note and measures nothing.

mod raw;

use cudarc::driver::sys;
use cuferry::{CudaEngine, peer};
use raw::{check, context, event, stream};
use std::time::Duration;

/// The median time of `f`: see `raw::median_within`.
fn median(f: impl FnMut()) -> Duration {
    raw::median_within(Duration::from_millis(500), 2000, f)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // nothing for the test harness to list
    }
    let mut a = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("peer_routes: no CUDA device ({e}); nothing measured");
            return;
        }
    };
    let (mut b, pair) = match CudaEngine::open(1) {
        Ok(b) => (b, "GPU 0 to GPU 1"),
        Err(_) => (CudaEngine::open(0).unwrap(), "two engines on GPU 0"),
    };
    println!("{pair}: peer access {}", peer::access(&mut a, &b).unwrap());
    let (ca, cb) = (context(&mut a), context(&mut b));
    let (stream_b, event_b) = (stream(cb), event(cb));
    let (stream, event) = (stream(ca), event(ca));
    for (bytes, label) in [
        (16usize, "16 B"),
        (8 << 20, "8 MiB"),
        (64 << 20, "64 MiB"),
        (256 << 20, "256 MiB"),
        (1 << 30, "1 GiB"),
    ] {
        let n = bytes / 4;
        let x = cuferry::upload_tensor(&mut a, &vec![1.5f32; n], &[n]).unwrap();
        let ours = median(|| drop(peer::copy(&mut a, &x, &mut b).unwrap()));
        let mut landing = b.alloc_tensor::<f32>(&[n]).unwrap();
        let into = median(|| peer::copy_into(&mut a, &x, &mut b, &mut landing).unwrap());
        let mut pair = Some((x, landing));
        let pending = median(|| {
            let (x, landing) = pair.take().unwrap();
            let copy = peer::copy_pending(&mut a, x, &mut b, landing).unwrap();
            pair = Some(copy.wait().unwrap().into_parts());
        });
        drop(pair);
        let (mut src, mut dst) = (0, 0);
        // SAFETY: contexts live; out pointers valid; the buffers hold `bytes` bytes and are idle
        // once each wait returns.
        let raw = unsafe {
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ca));
            check("cuMemAlloc", sys::cuMemAlloc_v2(&mut src, bytes));
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(cb));
            check("cuMemAlloc", sys::cuMemAlloc_v2(&mut dst, bytes));
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ca));
            let raw = median(|| {
                check(
                    "cuMemcpyPeerAsync",
                    sys::cuMemcpyPeerAsync(dst, cb, src, ca, bytes, stream),
                );
                check("cuEventRecord", sys::cuEventRecord(event, stream));
                check("cuEventSynchronize", sys::cuEventSynchronize(event));
            });
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(cb));
            let pull = median(|| {
                check(
                    "cuMemcpyPeerAsync",
                    sys::cuMemcpyPeerAsync(dst, cb, src, ca, bytes, stream_b),
                );
                check("cuEventRecord", sys::cuEventRecord(event_b, stream_b));
                check("cuEventSynchronize", sys::cuEventSynchronize(event_b));
            });
            check("cuMemFree", sys::cuMemFree_v2(src));
            check("cuMemFree", sys::cuMemFree_v2(dst));
            (raw, pull)
        };
        let (raw, pull) = raw;
        let gib = |t: Duration| bytes as f64 / t.as_secs_f64() / (1u64 << 30) as f64;
        println!(
            "{label:>8}: peer::copy {:10.2} µs ({:6.1} GiB/s), raw cuMemcpyPeerAsync + wait {:10.2} µs ({:6.1} GiB/s): {:.3}× the raw time",
            ours.as_secs_f64() * 1e6,
            gib(ours),
            raw.as_secs_f64() * 1e6,
            gib(raw),
            ours.as_secs_f64() / raw.as_secs_f64()
        );
        println!(
            "{label:>8}: peer::copy_into {:10.2} µs ({:6.1} GiB/s): {:.3}× the raw time",
            into.as_secs_f64() * 1e6,
            gib(into),
            into.as_secs_f64() / raw.as_secs_f64()
        );
        println!(
            "{label:>8}: peer::copy_pending + wait {:10.2} µs ({:6.1} GiB/s): {:.3}× the raw time; raw, on GPU 1 {:10.2} µs ({:6.1} GiB/s)",
            pending.as_secs_f64() * 1e6,
            gib(pending),
            pending.as_secs_f64() / raw.as_secs_f64(),
            pull.as_secs_f64() * 1e6,
            gib(pull),
        );
    }
}
