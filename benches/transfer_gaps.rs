//! Mid-size blocking transfers back to back, and after the copy threads have gone idle.
//!
//! For 1 to 16 MiB, the median of 300 runs of `upload_tensor_into` (into an existing tensor) and
//! `download_tensor_into` (into a reused `Vec`), first back to back, then with a 1 ms sleep
//! before each run, so the shared copy threads have parked and each transfer pays their wake-up.
//! `SIZES=4096,8192` (KiB) picks the sizes. Prints every figure. Run on a GPU machine: `cargo
//! bench --bench transfer_gaps`. Without a GPU it prints a note and measures nothing.

use cuferry::{CudaEngine, download_tensor_into, upload_tensor_into};
use std::time::{Duration, Instant};

/// The median, in microseconds, of 300 runs of `f`, each after `gap` (one untimed run first).
fn median_us(mut f: impl FnMut(), gap: Duration) -> f64 {
    f();
    let mut times: Vec<f64> = (0..300)
        .map(|_| {
            if !gap.is_zero() {
                std::thread::sleep(gap);
            }
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // nothing for the test harness to list
    }
    let mut engine = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("transfer_gaps: no CUDA device ({e}); nothing measured");
            return;
        }
    };
    let sizes: Vec<usize> = std::env::var("SIZES")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384]);
    println!("copy threads {}", cuferry::staging::copy_threads());
    for kib in sizes {
        let n = kib * 256;
        let data: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut tensor = engine.alloc_tensor::<f32>(&[n]).unwrap();
        let mut out = Some(Vec::<f32>::with_capacity(n));
        let gib_per_s = |us: f64| kib as f64 * 1024.0 / us * 1e6 / (1u64 << 30) as f64;
        for gap in [Duration::ZERO, Duration::from_millis(1)] {
            let up = median_us(
                || upload_tensor_into(&mut engine, &mut tensor, &data).unwrap(),
                gap,
            );
            let down = median_us(
                || {
                    let reused = out.take().unwrap();
                    out = Some(download_tensor_into(&mut engine, &tensor, reused).unwrap());
                },
                gap,
            );
            println!(
                "{kib:>6} KiB, {:>4} µs idle before each: upload_tensor_into {up:8.1} µs ({:5.1} GiB/s), download_tensor_into {down:8.1} µs ({:5.1} GiB/s)",
                gap.as_micros(),
                gib_per_s(up),
                gib_per_s(down)
            );
        }
        assert_eq!(
            out.as_deref(),
            Some(&data[..]),
            "{kib} KiB came back changed"
        );
    }
}
