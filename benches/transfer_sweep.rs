//! The blocking routes across sizes, beside the raw driver, with a plot.
//!
//! For every power of four from 16 B to 1 GiB, the median time of:
//! - `upload_tensor_into` (into an existing tensor) and `download_tensor_into` (into a reused
//!   `Vec`);
//! - the raw pageable copies, `cuMemcpyHtoD` / `cuMemcpyDtoH` (synchronous), from and to the same
//!   ordinary memory;
//! - the raw pinned copies, `cuMemcpy{HtoD,DtoH}Async` from page-locked memory plus an event
//!   wait: the DMA's own limit.
//!
//! Then the aggregate of four engines on four threads, each uploading and downloading 64 MiB at
//! once, against one engine alone.
//!
//! Writes `transfer_sweep.csv` and `transfer_sweep.svg` into `$OUT` (or the current directory),
//! and prints every figure; `--plot FILE.csv` redraws the SVG from a CSV, with no GPU. Run on a
//! GPU machine: `cargo bench --bench transfer_sweep`. Without a GPU it prints a note and measures
//! nothing.

use cudarc::driver::sys;
use cuferry::{CudaEngine, download_tensor_into, upload_tensor, upload_tensor_into};
use std::ffi::c_void;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// 16 B to 1 GiB, powers of four.
fn sizes() -> Vec<usize> {
    (0..14).map(|i| 16usize << (2 * i)).collect()
}

fn label(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{}GiB", b >> 30),
        b if b >= 1 << 20 => format!("{}MiB", b >> 20),
        b if b >= 1 << 10 => format!("{}KiB", b >> 10),
        b => format!("{b}B"),
    }
}

fn check(call: &str, code: sys::CUresult) {
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "{call}");
}

/// The median of repeated runs of `f`: at least 5 and until 0.3 s have passed (at most 2000).
fn median(mut f: impl FnMut()) -> Duration {
    f(); // warm
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 5 || (start.elapsed() < Duration::from_millis(300) && times.len() < 2000) {
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    }
    times.sort_unstable();
    times[times.len() / 2]
}

fn gib_per_s(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / (1u64 << 30) as f64
}

struct Series {
    name: &'static str,
    color: &'static str,
    points: Vec<(usize, f64)>,
}

fn all_series() -> [Series; 6] {
    [
        Series {
            name: "upload_tensor_into",
            color: "#1f77b4",
            points: vec![],
        },
        Series {
            name: "download_tensor_into",
            color: "#d62728",
            points: vec![],
        },
        Series {
            name: "raw pageable up",
            color: "#aec7e8",
            points: vec![],
        },
        Series {
            name: "raw pageable down",
            color: "#ff9896",
            points: vec![],
        },
        Series {
            name: "raw pinned up",
            color: "#2ca02c",
            points: vec![],
        },
        Series {
            name: "raw pinned down",
            color: "#98df8a",
            points: vec![],
        },
    ]
}

/// The plot's title.
const TITLE: &str = "cuferry blocking routes vs the raw driver (H200, median of repeated runs)";

/// Redraws the plot from a sweep's CSV (`--plot FILE`), writing the SVG beside it.
fn plot_from_csv(path: &str) {
    let text = std::fs::read_to_string(path).expect("a sweep CSV");
    let mut series = all_series();
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let (Some(bytes), Some(name), Some(gib)) = (fields.first(), fields.get(1), fields.get(3))
        else {
            continue;
        };
        if let (Some(s), Ok(bytes), Ok(gib)) = (
            series.iter_mut().find(|s| s.name == *name),
            bytes.parse::<usize>(),
            gib.parse::<f64>(),
        ) {
            s.points.push((bytes, gib));
        }
    }
    let out = std::path::Path::new(path).with_extension("svg");
    std::fs::write(&out, svg(&series, TITLE)).expect("the SVG written");
    println!("wrote {}", out.display());
}

/// A log-log plot of GiB/s against size.
fn svg(series: &[Series], title: &str) -> String {
    let (w, h, left, right, top, bottom) = (900.0, 540.0, 70.0, 230.0, 40.0, 60.0);
    let sizes = sizes();
    let (x0, x1) = (
        (sizes[0] as f64).log2(),
        (*sizes.last().unwrap() as f64).log2(),
    );
    let (y0, y1) = (-4.0f64, 7.0f64); // 1/16 GiB/s to 128 GiB/s, log2
    let x = |b: usize| left + ((b as f64).log2() - x0) / (x1 - x0) * (w - left - right);
    let y = |g: f64| top + (1.0 - (g.max(1e-9).log2() - y0) / (y1 - y0)) * (h - top - bottom);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{left}" y="24" font-size="15">{title}</text>"#
    );
    for e in (y0 as i32)..=(y1 as i32) {
        let gy = y(2f64.powi(e));
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{gy}" y2="{gy}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
            w - right,
            left - 6.0,
            gy + 4.0,
            2f64.powi(e)
        );
    }
    for &b in &sizes {
        let gx = x(b);
        let _ = writeln!(
            s,
            r##"<line x1="{gx}" x2="{gx}" y1="{top}" y2="{}" stroke="#eee"/><text x="{gx}" y="{}" text-anchor="middle">{}</text>"##,
            h - bottom,
            h - bottom + 16.0,
            label(b)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">transfer size</text><text x="18" y="{}" transform="rotate(-90 18 {})" text-anchor="middle">GiB/s (log scale)</text>"#,
        (left + w - right) / 2.0,
        h - 18.0,
        h / 2.0,
        h / 2.0
    );
    for (i, series) in series.iter().enumerate() {
        let points: Vec<String> = series
            .points
            .iter()
            .map(|&(b, g)| format!("{:.1},{:.1}", x(b), y(g)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
            series.color,
            points.join(" ")
        );
        let ly = top + 20.0 + 20.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            w - right + 10.0,
            w - right + 34.0,
            series.color,
            w - right + 40.0,
            ly + 4.0,
            series.name
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Backs `bytes` of fresh memory at `base` as `download_tensor` backs a fresh `Vec`: huge pages
/// asked for, then populated in 16 MiB parts on `pool`'s threads (`MADV_POPULATE_WRITE`).
#[cfg(target_os = "linux")]
fn populate_like_the_route(pool: &rayon::ThreadPool, base: usize, bytes: usize) {
    let start = base.next_multiple_of(4096);
    let end = (base + bytes) & !4095;
    // SAFETY: the range lies in the caller's allocation of `bytes` bytes; madvise only changes
    // how the kernel backs it.
    unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    pool.scope(|s| {
        let mut at = start;
        while at < end {
            let len = (16usize << 20).min(end - at);
            // SAFETY: as above; populating never changes contents.
            s.spawn(move |_| unsafe {
                libc::madvise(at as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE);
            });
            at += len;
        }
    });
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // nothing for the test harness to list
    }
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--plot") {
        return plot_from_csv(args.get(at + 1).expect("--plot FILE"));
    }
    let mut engine = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("transfer_sweep: no CUDA device ({e}); nothing measured");
            return;
        }
    };
    let (ctx, stream) = engine
        .with_raw(|r| {
            Ok::<_, cuferry::Error>((r.context().as_raw() as usize, r.stream().as_raw() as usize))
        })
        .unwrap();
    let stream = stream as sys::CUstream;
    let mut event = std::ptr::null_mut();
    // SAFETY: `ctx` is the engine's live context, left current on this thread (the engine's
    // operations accept finding it current); out pointer valid.
    unsafe {
        check(
            "cuCtxSetCurrent",
            sys::cuCtxSetCurrent(ctx as sys::CUcontext),
        );
        check(
            "cuEventCreate",
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            ),
        );
    }
    let mut series = all_series();
    let mut csv = String::from("bytes,case,median_us,gib_per_s\n");
    for bytes in sizes() {
        let n = bytes / 4;
        let host: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
        let mut tensor = upload_tensor(&mut engine, &host, &[n]).unwrap();
        let mut out = Some(Vec::<f32>::with_capacity(n));
        let mut pageable = host.clone();
        let mut dev = 0;
        let mut pinned = std::ptr::null_mut();
        // SAFETY: the context is current; out pointers valid.
        unsafe {
            check("cuMemAlloc", sys::cuMemAlloc_v2(&mut dev, bytes));
            check("cuMemHostAlloc", sys::cuMemHostAlloc(&mut pinned, bytes, 0));
            std::ptr::write_bytes(pinned.cast::<u8>(), 0x5A, bytes);
        }
        let times = [
            median(|| upload_tensor_into(&mut engine, &mut tensor, &host).unwrap()),
            median(|| {
                out = Some(download_tensor_into(&mut engine, &tensor, out.take().unwrap()).unwrap())
            }),
            // The raw cases: `dev`, `pageable` and `pinned` hold `bytes` bytes and stay live;
            // the synchronous copies return when done, the async ones are waited.
            median(|| {
                // SAFETY: as said above.
                check("cuMemcpyHtoD", unsafe {
                    sys::cuMemcpyHtoD_v2(dev, pageable.as_ptr().cast(), bytes)
                })
            }),
            median(|| {
                // SAFETY: as said above.
                check("cuMemcpyDtoH", unsafe {
                    sys::cuMemcpyDtoH_v2(pageable.as_mut_ptr().cast(), dev, bytes)
                })
            }),
            // SAFETY: as said above.
            median(|| unsafe {
                check(
                    "cuMemcpyHtoDAsync",
                    sys::cuMemcpyHtoDAsync_v2(dev, pinned as *const c_void, bytes, stream),
                );
                check("cuEventRecord", sys::cuEventRecord(event, stream));
                check("cuEventSynchronize", sys::cuEventSynchronize(event));
            }),
            // SAFETY: as said above.
            median(|| unsafe {
                check(
                    "cuMemcpyDtoHAsync",
                    sys::cuMemcpyDtoHAsync_v2(pinned, dev, bytes, stream),
                );
                check("cuEventRecord", sys::cuEventRecord(event, stream));
                check("cuEventSynchronize", sys::cuEventSynchronize(event));
            }),
        ];
        assert_eq!(
            out.as_deref(),
            Some(&host[..]),
            "download_tensor_into at {}",
            label(bytes)
        );
        for (s, t) in series.iter_mut().zip(times) {
            let g = gib_per_s(bytes, t);
            s.points.push((bytes, g));
            let _ = writeln!(
                csv,
                "{bytes},{},{:.3},{g:.3}",
                s.name,
                t.as_secs_f64() * 1e6
            );
            println!(
                "{:>8} {:<22} {:>12.2} us {:>8.2} GiB/s",
                label(bytes),
                s.name,
                t.as_secs_f64() * 1e6,
                g
            );
        }
        // SAFETY: allocated above, idle after the last wait.
        unsafe {
            check("cuMemFree", sys::cuMemFree_v2(dev));
            check("cuMemFreeHost", sys::cuMemFreeHost(pinned));
        }
    }
    let dir = std::env::var("OUT").unwrap_or_else(|_| ".".into());
    std::fs::write(format!("{dir}/transfer_sweep.csv"), &csv).unwrap();
    std::fs::write(format!("{dir}/transfer_sweep.svg"), svg(&series, TITLE)).unwrap();

    // Four engines on four threads against one alone: 64 MiB up and down each.
    let n = (64 << 20) / 4;
    let host: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
    let round = |engine: &mut CudaEngine,
                 tensor: &mut cuferry::DeviceTensor<f32>,
                 out: &mut Option<Vec<f32>>| {
        upload_tensor_into(engine, tensor, &host).unwrap();
        *out = Some(download_tensor_into(engine, tensor, out.take().unwrap()).unwrap());
    };
    let mut one = (
        upload_tensor(&mut engine, &host, &[n]).unwrap(),
        Some(Vec::with_capacity(n)),
    );
    let alone = median(|| round(&mut engine, &mut one.0, &mut one.1));
    let mut engines: Vec<CudaEngine> = (0..4).map(|_| CudaEngine::open(0).unwrap()).collect();
    let mut state: Vec<_> = engines
        .iter_mut()
        .map(|e| {
            (
                upload_tensor(e, &host, &[n]).unwrap(),
                Some(Vec::<f32>::with_capacity(n)),
            )
        })
        .collect();
    let together = median(|| {
        std::thread::scope(|s| {
            for (engine, (tensor, out)) in engines.iter_mut().zip(state.iter_mut()) {
                let round = &round;
                s.spawn(move || round(engine, tensor, out));
            }
        })
    });
    let bytes = 2 * n * 4;
    let (g1, g4) = (gib_per_s(bytes, alone), gib_per_s(4 * bytes, together));
    println!(
        "four engines: one alone {g1:.2} GiB/s (64 MiB up + down), four at once {g4:.2} GiB/s aggregate: {:.0}% of one alone; copy threads {}",
        100.0 * g4 / g1,
        engine.staging_config().copy_threads
    );
    drop(state);
    drop(one);

    // Fresh downloads (a new `Vec` each time) against the host's own limit: allocating the same
    // bytes and touching every page with the same number of threads as the copy pool.
    let threads = engine.staging_config().copy_threads;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    for bytes in [256usize << 20, 1 << 30] {
        let n = bytes / 4;
        let host: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
        let tensor = upload_tensor(&mut engine, &host, &[n]).unwrap();
        let fresh = median(|| drop(cuferry::download_tensor(&mut engine, &tensor).unwrap()));
        let touch = median(|| {
            let mut v: Vec<u8> = Vec::with_capacity(bytes);
            let base = v.as_mut_ptr() as usize;
            let part = bytes.div_ceil(threads).next_multiple_of(4096);
            pool.scope(|s| {
                for t in 0..threads {
                    s.spawn(move |_| {
                        let start = (t * part).min(bytes);
                        let end = ((t + 1) * part).min(bytes);
                        let mut at = start;
                        while at < end {
                            // SAFETY: inside the vector's capacity; one byte per page, written
                            // by exactly one thread.
                            unsafe { ((base + at) as *mut u8).write_volatile(0) };
                            at += 4096;
                        }
                    });
                }
            });
            drop(v);
        });
        // The same with the pages backed as the route backs them: huge pages asked for, then
        // populated in 16 MiB parts on the same threads (`MADV_POPULATE_WRITE`).
        #[cfg(target_os = "linux")]
        let populate = median(|| {
            let mut v: Vec<u8> = Vec::with_capacity(bytes);
            populate_like_the_route(&pool, v.as_mut_ptr() as usize, bytes);
            drop(v);
        });
        #[cfg(not(target_os = "linux"))]
        let populate = touch;
        // The whole host half of a fresh download, with no DMA at all: allocate, populate as the
        // route does, and copy the bytes in from pinned memory, the same threads for both. The
        // route does at least this much host work; its DMA can only overlap it.
        let mut staged: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: a plain page-locked allocation, freed below.
        unsafe { check("cuMemHostAlloc", sys::cuMemHostAlloc(&mut staged, bytes, 0)) };
        let staged_addr = staged as usize;
        let host_half = median(|| {
            let mut v: Vec<u8> = Vec::with_capacity(bytes);
            let base = v.as_mut_ptr() as usize;
            #[cfg(target_os = "linux")]
            populate_like_the_route(&pool, base, bytes);
            let part = bytes.div_ceil(threads);
            pool.scope(|s| {
                for t in 0..threads {
                    let start = (t * part).min(bytes);
                    let len = part.min(bytes - start);
                    // SAFETY: disjoint parts of the vector's capacity and of the idle pinned
                    // block, each written by one task.
                    s.spawn(move |_| unsafe {
                        std::ptr::copy_nonoverlapping(
                            (staged_addr + start) as *const u8,
                            (base + start) as *mut u8,
                            len,
                        )
                    });
                }
            });
            // SAFETY: every byte was written above.
            unsafe { v.set_len(bytes) };
            drop(v);
        });
        // SAFETY: allocated above; idle.
        unsafe { check("cuMemFreeHost", sys::cuMemFreeHost(staged)) };
        let mut reused = Some(Vec::<f32>::with_capacity(n));
        let into = median(|| {
            reused =
                Some(download_tensor_into(&mut engine, &tensor, reused.take().unwrap()).unwrap())
        });
        println!(
            "fresh download {}: download_tensor {:.2} GiB/s, download_tensor_into (reused Vec) {:.2} GiB/s; host limits with {threads} threads: allocate and touch every 4 KiB page {:.2} GiB/s, allocate and populate as the route does (huge pages) {:.2} GiB/s, allocate + populate + copy in from pinned (the host half, no DMA) {:.2} GiB/s",
            label(bytes),
            gib_per_s(bytes, fresh),
            gib_per_s(bytes, into),
            gib_per_s(bytes, touch),
            gib_per_s(bytes, populate),
            gib_per_s(bytes, host_half),
        );
    }
    // SAFETY: the event is idle (every use was waited).
    unsafe { check("cuEventDestroy", sys::cuEventDestroy_v2(event)) };
}
