//! Where the time of a 16-byte peer copy goes: the raw copy with each step the crate's route
//! adds, one at a time, and the route itself, in the same run (medians of 2000 runs).
//!
//! - push: `cuMemcpyPeerAsync` on a stream of GPU 0's context, event record, event wait
//!   (the baseline of `benches/peer_routes.rs`);
//! - pull: the same on a stream of GPU 1's context;
//! - pull, pool memory: between two tensors of the engines (their memory pools) instead of
//!   `cuMemAlloc` buffers;
//! - pull, stream synchronize: the wait a stream synchronize instead of an event;
//! - pull, query of the other context: first, GPU 0's context made current and three of its
//!   streams queried (the route's "is the source engine idle" check), then GPU 1's made current;
//! - `peer::copy_into` and `peer::copy` themselves.
//!
//! Run on a machine with two GPUs: `cargo bench --bench peer_anatomy`.

mod raw;

use cudarc::driver::sys;
use cuferry::{peer, upload_tensor};
use raw::{check, context, event, stream};
use std::time::{Duration, Instant};

fn median(mut f: impl FnMut()) -> Duration {
    for _ in 0..200 {
        f();
    }
    let mut times: Vec<Duration> = (0..2000)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort_unstable();
    times[times.len() / 2]
}

fn main() {
    let Some((mut a, mut b)) = raw::two_gpus("peer_anatomy") else {
        return;
    };
    assert!(peer::access(&mut b, &a).unwrap() && peer::access(&mut a, &b).unwrap());
    let (ca, cb) = (context(&mut a), context(&mut b));
    let (sa, ea) = (stream(ca), event(ca));
    let (sb, eb) = (stream(cb), event(cb));
    let idle: Vec<sys::CUstream> = (0..3).map(|_| stream(ca)).collect();
    let x = upload_tensor(&mut a, &[1.5f32; 4], &[4]).unwrap();
    let mut landing = b.alloc_tensor::<f32>(&[4]).unwrap();
    let pool_src = a
        .with_raw(|r| Ok::<_, cuferry::Error>(r.device_ptr(&x)?.as_raw()))
        .unwrap();
    let pool_dst = b
        .with_raw(|r| Ok::<_, cuferry::Error>(r.device_ptr(&landing)?.as_raw()))
        .unwrap();
    let bytes = 16;
    let (mut src, mut dst) = (0, 0);
    let mut rows: Vec<(&str, Duration)> = Vec::new();
    // SAFETY: live contexts, streams and events; each buffer holds 16 bytes and is idle once
    // each wait returns; the engines' tensors outlive the raw copies between them.
    unsafe {
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ca));
        check("cuMemAlloc", sys::cuMemAlloc_v2(&mut src, bytes));
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(cb));
        check("cuMemAlloc", sys::cuMemAlloc_v2(&mut dst, bytes));
        let copy = |s: sys::CUstream, d: u64, sr: u64| {
            check(
                "cuMemcpyPeerAsync",
                sys::cuMemcpyPeerAsync(d, cb, sr, ca, bytes, s),
            );
        };
        let wait = |s: sys::CUstream, e: sys::CUevent| {
            check("cuEventRecord", sys::cuEventRecord(e, s));
            check("cuEventSynchronize", sys::cuEventSynchronize(e));
        };
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ca));
        rows.push((
            "push",
            median(|| {
                copy(sa, dst, src);
                wait(sa, ea);
            }),
        ));
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(cb));
        rows.push((
            "pull",
            median(|| {
                copy(sb, dst, src);
                wait(sb, eb);
            }),
        ));
        rows.push((
            "pull, pool memory",
            median(|| {
                copy(sb, pool_dst, pool_src);
                wait(sb, eb);
            }),
        ));
        rows.push((
            "pull, stream synchronize",
            median(|| {
                copy(sb, dst, src);
                check("cuStreamSynchronize", sys::cuStreamSynchronize(sb));
            }),
        ));
        rows.push((
            "pull, query of the other context",
            median(|| {
                check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ca));
                for &s in &idle {
                    check("cuStreamQuery", sys::cuStreamQuery(s));
                }
                check("cuCtxSetCurrent", sys::cuCtxSetCurrent(cb));
                copy(sb, dst, src);
                wait(sb, eb);
            }),
        ));
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ca));
        rows.push((
            "push, pool memory",
            median(|| {
                copy(sa, pool_dst, pool_src);
                wait(sa, ea);
            }),
        ));
        check("cuMemFree", sys::cuMemFree_v2(src));
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(cb));
        check("cuMemFree", sys::cuMemFree_v2(dst));
    }
    rows.push((
        "peer::copy_into",
        median(|| peer::copy_into(&mut a, &x, &mut b, &mut landing).unwrap()),
    ));
    rows.push((
        "peer::copy",
        median(|| drop(peer::copy(&mut a, &x, &mut b).unwrap())),
    ));
    let base = rows[0].1;
    for (label, t) in rows {
        println!(
            "{label:>36}: {:7.2} µs ({:.3}× push)",
            t.as_secs_f64() * 1e6,
            t.as_secs_f64() / base.as_secs_f64()
        );
    }
}
