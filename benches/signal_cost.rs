//! What ordering one engine after another costs the host: `signal` + `wait_signal`, beside the
//! raw driver calls the same dependency takes.
//!
//! Two engines on device 0, and one on device 0 and one on device 1 when there is a second GPU.
//! Each round queues a small kernel on the first engine (so its signal is not already complete),
//! then times, on the host only, `a.signal()` followed by `b.wait_signal(&signal)`; the raw
//! baseline times `cuEventRecord` on one stream and `cuStreamWaitEvent` on three streams (the
//! waiting engine has three), on streams of their own. Both engines are synchronized between
//! rounds, untimed. Prints the median of 2000 rounds of each. Run on a GPU machine: `cargo bench
//! --bench signal_cost`. Without a GPU it prints a note and measures nothing.

mod raw;

use cudarc::driver::sys;
use cuferry::CudaEngine;
use raw::{check, context, event, stream};
use std::time::{Duration, Instant};

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}

/// The host time of `a.signal()` + `b.wait_signal()`, per round.
fn crate_cost(a: &mut CudaEngine, b: &mut CudaEngine) -> Duration {
    let x = a.full::<f32>(&[4], 1.0).unwrap();
    let times = (0..2000)
        .map(|_| {
            let y = a.scale(&x, 2.0).unwrap();
            let start = Instant::now();
            let signal = a.signal().unwrap();
            b.wait_signal(&signal).unwrap();
            let took = start.elapsed();
            drop(y);
            a.synchronize().unwrap();
            b.synchronize().unwrap();
            took
        })
        .collect();
    median(times)
}

/// The same dependency raw: one record on a stream of `a`'s context, three waits on streams of
/// `b`'s context.
fn raw_cost(a: &mut CudaEngine, b: &mut CudaEngine) -> Duration {
    let (ca, cb) = (context(a), context(b));
    let sa = stream(ca);
    let sb: Vec<sys::CUstream> = (0..3).map(|_| stream(cb)).collect();
    let event = event(ca);
    let times = (0..2000)
        .map(|_| {
            // SAFETY: the event and the streams are live, made in the engines' live contexts.
            unsafe {
                check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ca));
                let start = Instant::now();
                check("cuEventRecord", sys::cuEventRecord(event, sa));
                check("cuCtxSetCurrent", sys::cuCtxSetCurrent(cb));
                for &s in &sb {
                    check("cuStreamWaitEvent", sys::cuStreamWaitEvent(s, event, 0));
                }
                let took = start.elapsed();
                for &s in &sb {
                    check("cuStreamSynchronize", sys::cuStreamSynchronize(s));
                }
                took
            }
        })
        .collect();
    median(times)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // nothing for the test harness to list
    }
    let mut a = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("signal_cost: no CUDA device ({e}); nothing measured");
            return;
        }
    };
    let mut pairs = vec![("two engines on device 0", CudaEngine::open(0).unwrap())];
    if let Ok(second) = CudaEngine::open(1) {
        pairs.push(("device 0 then device 1", second));
    }
    for (what, mut b) in pairs {
        let ours = crate_cost(&mut a, &mut b);
        let raw = raw_cost(&mut a, &mut b);
        println!(
            "{what}: signal + wait_signal {:.2} µs, raw record + 3 waits {:.2} µs, difference {:.2} µs",
            ours.as_secs_f64() * 1e6,
            raw.as_secs_f64() * 1e6,
            (ours.as_secs_f64() - raw.as_secs_f64()) * 1e6
        );
    }
}
