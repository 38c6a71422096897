//! Transfer routes beside the raw driver doing the same copy, in the same run.
//!
//! Run on a GPU machine: `cargo bench --bench transfer_paths`. Groups:
//! - `pending_upload`, `pending_download`: resubmit-and-wait of a pinned transfer against
//!   `cuMemcpy{HtoD,DtoH}Async` + `cuEventRecord` + `cuEventSynchronize` on the same stream;
//! - `download_into`: `download_tensor_into` with a reused `Vec` against a raw pageable
//!   `cuMemcpyDtoHAsync` into the same `Vec` + wait;
//! - `submit_16B`: the host time of submitting a 16-byte pending upload against the raw async
//!   copy plus event record (the waits are excluded from both);
//! - `pinned_8MiB`: a `PinnedHostBuffer` from a warm pool against a fresh `cuMemHostAlloc`.
//!
//! - `blocking_upload`, `blocking_download`: `upload_tensor` / `download_tensor` from and to
//!   ordinary `Vec`s, and `upload_tensor_into` / `download_tensor_into` with the tensor and the
//!   `Vec` reused (`cuferry_into`), beside the raw pageable `cuMemcpy{HtoD,DtoH}` (synchronous) and the raw
//!   pinned async copy + event wait, at 16 B to 1 GiB;
//! - `blocking_4_threads`: four threads, each with its own engine, each uploading and
//!   downloading 64 MiB;
//! - `host_copy`: the host's own pageable-to-pinned copy bandwidth with one and with the staging
//!   default's number of threads, the ceiling of a staged upload's host half;
//! - `staging_sweep`: `upload_tensor` / `download_tensor` at 256 MiB under several staging
//!   settings (chunk size, copy threads), which is how the defaults were chosen;
//! - `midsize_sweep`: 8 MiB transfers under several ring depths and copy-thread counts.
//! - `await_16B`: a 16-byte pending upload awaited on a tokio current-thread runtime against
//!   the same transfer's `wait()` (target: await at most 1.5 times the wait); the medians and
//!   their ratio are also printed;
//! - `wake_16B`: the two ways a host task can be woken after a 16-byte copy, raw, in the same
//!   run: a stream callback on a side stream after `cuStreamWaitEvent` (what `.await` uses),
//!   against a watcher thread blocked in `cuEventSynchronize` on a `CU_EVENT_BLOCKING_SYNC`
//!   event, with the plain spinning `cuEventSynchronize` beside them;
//! - `await_256MiB_cpu` (printed, not a criterion group): the process's CPU time while awaiting
//!   256 MiB pending uploads on a current-thread runtime, as a share of one core over the wall
//!   time (target: under 5%), beside the same share while `wait()` blocks.
//! - `registered_upload`, `registered_download`: resubmit-and-wait of a pending transfer over a
//!   `RegisteredBuffer` (a `Vec` page-locked in place) against the blocking routes' staged copy
//!   into what the caller already has (`upload_tensor_into`, `download_tensor_into`) at 8, 64 and
//!   256 MiB, and at 256 MiB against the raw pinned copy (`cuMemHostAlloc` memory,
//!   `cuMemcpy{HtoD,DtoH}Async` + event wait); `registration`: `RegisteredBuffer::register` +
//!   `into_vec` (`cuMemHostRegister` + `cuMemHostUnregister`) of the same sizes. The bench prints
//!   the registered route's ratio to the raw copy, and for each size and direction the break-even
//!   count: the number of transfers after which registering once beats the staged route.
//!
//! The copy threads are one pool per process (`cuferry::staging::copy_threads()`, sized from the machine),
//! and an engine's `copy_threads` only caps its share: sweep rows asking for more threads than the
//! pool has are skipped. Run with `CUFERRY_COPY_THREADS=16` to measure them.
//!
//! Without a GPU the bench prints a note and measures nothing.

// criterion's macros generate undocumented public items.
#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::sys;
use cuferry::{
    CudaEngine, DeviceTensor, Pending, PinnedHostBuffer, RegisteredBuffer, download_pending,
    download_tensor_into,
    pending::{Operation, Returned},
    upload_pending, upload_tensor_into,
};
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const SIZES: [(usize, &str); 5] = [
    (16, "16B"),
    (64, "64B"),
    (32 << 10, "32KiB"),
    (8 << 20, "8MiB"),
    (256 << 20, "256MiB"),
];

/// Raw driver resources for the baselines, on the engine's context and stream.
struct Raw {
    stream: sys::CUstream,
    event: sys::CUevent,
}

impl Raw {
    fn new(engine: &mut CudaEngine) -> Self {
        let (ctx, stream) = engine
            .with_raw(|r| {
                Ok::<_, cuferry::Error>((
                    r.context().as_raw() as usize,
                    r.stream().as_raw() as usize,
                ))
            })
            .unwrap();
        let mut event = std::ptr::null_mut();
        // SAFETY: `ctx` is the engine's live context; it stays current on this thread for the
        // bench, which the engine's own operations accept (they find their context current).
        unsafe {
            assert_eq!(
                sys::cuCtxSetCurrent(ctx as sys::CUcontext),
                sys::CUresult::CUDA_SUCCESS
            );
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            assert_eq!(
                sys::cuEventCreate(&mut event, flags),
                sys::CUresult::CUDA_SUCCESS
            );
        }
        Raw {
            stream: stream as sys::CUstream,
            event,
        }
    }

    fn device(&self, bytes: usize) -> sys::CUdeviceptr {
        let mut ptr = 0;
        // SAFETY: the engine's context is current; out pointer valid.
        let code = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
        ptr
    }

    fn pinned(&self, bytes: usize) -> *mut u8 {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: out pointer valid.
        let code = unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, 0) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
        // SAFETY: fresh allocation of `bytes` bytes; filled so the copies move real data.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0x5A, bytes) };
        ptr.cast()
    }

    fn htod(&self, dst: sys::CUdeviceptr, src: *const u8, bytes: usize) {
        // SAFETY: `dst` and `src` hold `bytes` bytes and outlive the wait in `wait`.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), bytes, self.stream) };
        // SAFETY: the event and stream are live.
        unsafe { sys::cuEventRecord(self.event, self.stream) };
    }

    fn dtoh(&self, dst: *mut u8, src: sys::CUdeviceptr, bytes: usize) {
        // SAFETY: as in `htod`.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, bytes, self.stream) };
        // SAFETY: the event and stream are live.
        unsafe { sys::cuEventRecord(self.event, self.stream) };
    }

    /// Benches the raw pinned copy of `bytes` between `host` and `dev` plus its wait, under
    /// `raw_pinned/label`, then frees both. Returns the median time per copy.
    fn bench_pinned_and_free(
        &self,
        group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        label: &str,
        upload: bool,
        host: *mut u8,
        dev: sys::CUdeviceptr,
        bytes: usize,
    ) -> Duration {
        let samples = Samples::default();
        group.bench_function(BenchmarkId::new("raw_pinned", label), |b| {
            b.iter_custom(|iters| {
                samples.time(iters, || {
                    if upload {
                        self.htod(dev, host, bytes)
                    } else {
                        self.dtoh(host, dev, bytes)
                    }
                    self.wait();
                })
            })
        });
        // SAFETY: both were allocated by this `Raw` and are idle after the last wait.
        unsafe {
            sys::cuMemFreeHost(host.cast());
            sys::cuMemFree_v2(dev);
        }
        samples.median()
    }

    fn wait(&self) {
        // SAFETY: the event is live.
        let code = unsafe { sys::cuEventSynchronize(self.event) };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    }
}

fn pending(c: &mut Criterion, engine: &mut CudaEngine, raw: &Raw) {
    for upload in [true, false] {
        let mut group = c.benchmark_group(if upload {
            "pending_upload"
        } else {
            "pending_download"
        });
        for (bytes, label) in SIZES {
            group.throughput(Throughput::Bytes(bytes as u64));
            let n = bytes / 4;
            let buffer = PinnedHostBuffer::<f32>::from_slice(engine, &vec![1.5; n]).unwrap();
            let tensor = engine.alloc_tensor::<f32>(&[n]).unwrap();
            let mut returned = Some(if upload {
                Either::Up(
                    upload_pending(engine, buffer, tensor)
                        .unwrap()
                        .wait()
                        .unwrap(),
                )
            } else {
                Either::Down(
                    download_pending(engine, tensor, buffer)
                        .unwrap()
                        .wait()
                        .unwrap(),
                )
            });
            group.bench_function(BenchmarkId::new("cuferry", label), |b| {
                b.iter(|| {
                    let r = returned.take().unwrap();
                    returned = Some(match r {
                        Either::Up(r) => Either::Up(r.resubmit(engine).unwrap().wait().unwrap()),
                        Either::Down(r) => {
                            Either::Down(r.resubmit(engine).unwrap().wait().unwrap())
                        }
                    });
                });
            });
            drop(returned);
            let host = raw.pinned(bytes);
            let dev = raw.device(bytes);
            let _ = raw.bench_pinned_and_free(&mut group, label, upload, host, dev, bytes);
        }
        group.finish();
    }
}

enum Either {
    Up(cuferry::Pending<cuferry::pending::Upload<f32>, cuferry::pending::Returned>),
    Down(cuferry::Pending<cuferry::pending::Download<f32>, cuferry::pending::Returned>),
}

fn download_into(c: &mut Criterion, engine: &mut CudaEngine, raw: &Raw) {
    let mut group = c.benchmark_group("download_into");
    for (bytes, label) in SIZES {
        group.throughput(Throughput::Bytes(bytes as u64));
        let n = bytes / 4;
        let tensor = cuferry::upload_tensor(engine, &vec![2.5f32; n], &[n]).unwrap();
        let mut out = Some(Vec::<f32>::with_capacity(n));
        group.bench_function(BenchmarkId::new("cuferry", label), |b| {
            b.iter(|| {
                out = Some(download_tensor_into(engine, &tensor, out.take().unwrap()).unwrap())
            })
        });
        let dev = raw.device(bytes);
        let mut host = vec![0f32; n];
        group.bench_function(BenchmarkId::new("raw_pageable", label), |b| {
            b.iter(|| {
                raw.dtoh(host.as_mut_ptr().cast(), dev, bytes);
                raw.wait();
            })
        });
        // SAFETY: allocated above, idle after the last wait.
        unsafe { sys::cuMemFree_v2(dev) };
    }
    group.finish();
}

fn submit_cost(c: &mut Criterion, engine: &mut CudaEngine, raw: &Raw) {
    let mut group = c.benchmark_group("submit_16B");
    let buffer = PinnedHostBuffer::<f32>::from_slice(engine, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[4]).unwrap();
    let mut returned = Some(
        upload_pending(engine, buffer, tensor)
            .unwrap()
            .wait()
            .unwrap(),
    );
    group.bench_function("cuferry_upload_pending", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let r = returned.take().unwrap();
                let start = Instant::now();
                let in_flight = r.resubmit(engine).unwrap();
                total += start.elapsed();
                returned = Some(in_flight.wait().unwrap());
            }
            total
        })
    });
    let host = raw.pinned(16);
    let dev = raw.device(16);
    group.bench_function("raw_copy_and_record", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                raw.htod(dev, host, 16);
                total += start.elapsed();
                raw.wait();
            }
            total
        })
    });
    group.finish();
}

fn pinned_alloc(c: &mut Criterion, engine: &mut CudaEngine, raw: &Raw) {
    let mut group = c.benchmark_group("pinned_8MiB");
    drop(PinnedHostBuffer::<u8>::new(engine, 8 << 20).unwrap()); // warm the pool
    group.bench_function("cuferry_warm_pool", |b| {
        b.iter(|| drop(PinnedHostBuffer::<u8>::new(engine, 8 << 20).unwrap()))
    });
    group.bench_function("raw_cuMemHostAlloc", |b| {
        b.iter(|| {
            let mut ptr = std::ptr::null_mut();
            // SAFETY: out pointer valid; the allocation is freed at once.
            unsafe {
                assert_eq!(
                    sys::cuMemHostAlloc(&mut ptr, 8 << 20, 0),
                    sys::CUresult::CUDA_SUCCESS
                );
                sys::cuMemFreeHost(ptr);
            }
        })
    });
    let _ = raw;
    group.finish();
}

const BLOCKING_SIZES: [(usize, &str); 8] = [
    (16, "16B"),
    (64, "64B"),
    (32 << 10, "32KiB"),
    (8 << 20, "8MiB"),
    ((8 << 20) + 8, "8MiB+8B"),
    (64 << 20, "64MiB"),
    (256 << 20, "256MiB"),
    (1 << 30, "1GiB"),
];

fn blocking(c: &mut Criterion, engine: &mut CudaEngine, raw: &Raw) {
    for upload in [true, false] {
        let mut group = c.benchmark_group(if upload {
            "blocking_upload"
        } else {
            "blocking_download"
        });
        for (bytes, label) in BLOCKING_SIZES {
            group.throughput(Throughput::Bytes(bytes as u64));
            let n = bytes / 4;
            let host: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
            let tensor = cuferry::upload_tensor(engine, &host, &[n]).unwrap();
            group.bench_function(BenchmarkId::new("cuferry", label), |b| {
                if upload {
                    b.iter(|| drop(cuferry::upload_tensor(engine, &host, &[n]).unwrap()))
                } else {
                    b.iter(|| drop(cuferry::download_tensor(engine, &tensor).unwrap()))
                }
            });
            let mut tensor = tensor;
            if upload {
                // Into the tensor the caller already has: no allocation on the path.
                group.bench_function(BenchmarkId::new("cuferry_into", label), |b| {
                    b.iter(|| cuferry::upload_tensor_into(engine, &mut tensor, &host).unwrap())
                });
            } else {
                let mut out = Some(Vec::<f32>::with_capacity(n));
                group.bench_function(BenchmarkId::new("cuferry_into", label), |b| {
                    b.iter(|| {
                        out = Some(
                            download_tensor_into(engine, &tensor, out.take().unwrap()).unwrap(),
                        )
                    })
                });
            }
            drop(tensor);
            let dev = raw.device(bytes);
            let mut pageable = host.clone();
            group.bench_function(BenchmarkId::new("raw_pageable", label), |b| {
                b.iter(|| {
                    // SAFETY: `dev` and `pageable` hold `bytes` bytes; the synchronous copies
                    // return when done.
                    let code = unsafe {
                        if upload {
                            sys::cuMemcpyHtoD_v2(dev, pageable.as_ptr().cast(), bytes)
                        } else {
                            sys::cuMemcpyDtoH_v2(pageable.as_mut_ptr().cast(), dev, bytes)
                        }
                    };
                    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
                })
            });
            let pinned = raw.pinned(bytes);
            let _ = raw.bench_pinned_and_free(&mut group, label, upload, pinned, dev, bytes);
        }
        group.finish();
    }
}

fn four_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("blocking_4_threads");
    let n = (64 << 20) / 4;
    group.throughput(Throughput::Bytes(4 * 2 * (n as u64) * 4));
    let host: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
    let mut engines: Vec<CudaEngine> = (0..4).map(|_| CudaEngine::open(0).unwrap()).collect();
    group.bench_function("cuferry_64MiB_up_and_down", |b| {
        b.iter(|| {
            std::thread::scope(|s| {
                for engine in engines.iter_mut() {
                    let host = &host;
                    s.spawn(move || {
                        let t = cuferry::upload_tensor(engine, host, &[n]).unwrap();
                        drop(cuferry::download_tensor(engine, &t).unwrap());
                    });
                }
            })
        })
    });
    group.finish();
}

/// Whether the shared copy pool has `threads` threads for one transfer; says so when not.
fn pool_has(threads: usize) -> bool {
    let pool = cuferry::staging::copy_threads();
    if threads > pool {
        eprintln!("transfer_paths: skipping {threads} copy threads (the pool has {pool})");
    }
    threads <= pool
}

fn staging_sweep(c: &mut Criterion, engine: &mut CudaEngine) {
    let mut group = c.benchmark_group("staging_sweep");
    let bytes = 256 << 20;
    let n = bytes / 4;
    group.throughput(Throughput::Bytes(bytes as u64));
    let host: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
    let original = engine.staging_config();
    for (chunk_mib, threads) in [(4, 12), (8, 12), (16, 8), (16, 12), (16, 16), (32, 12)] {
        if !pool_has(threads) {
            continue;
        }
        let mut config = original;
        config.chunk_bytes = chunk_mib << 20;
        config.copy_threads = threads;
        engine.set_staging_config(config).unwrap();
        let label = format!("chunk{chunk_mib}MiB_threads{threads}");
        let tensor = cuferry::upload_tensor(engine, &host, &[n]).unwrap();
        group.bench_function(BenchmarkId::new("upload", &label), |b| {
            b.iter(|| drop(cuferry::upload_tensor(engine, &host, &[n]).unwrap()))
        });
        group.bench_function(BenchmarkId::new("download", &label), |b| {
            b.iter(|| drop(cuferry::download_tensor(engine, &tensor).unwrap()))
        });
        let mut out = Some(Vec::<f32>::with_capacity(n));
        group.bench_function(BenchmarkId::new("download_into", &label), |b| {
            b.iter(|| {
                out = Some(download_tensor_into(engine, &tensor, out.take().unwrap()).unwrap())
            })
        });
    }
    engine.set_staging_config(original).unwrap();
    group.finish();
}

/// The host's own copy bandwidth from pageable into pinned memory, with one thread and with as
/// many threads as the staging defaults use: the ceiling of the staged upload's host half.
fn host_copy(c: &mut Criterion, raw: &Raw) {
    let mut group = c.benchmark_group("host_copy");
    let bytes = 256 << 20;
    group.throughput(Throughput::Bytes(bytes as u64));
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let dst = raw.pinned(bytes);
    let threads = cuferry::staging::StagingConfig::default().copy_threads;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let dst_addr = dst as usize;
    group.bench_function("pageable_to_pinned_1_thread", |b| {
        // SAFETY: `dst` holds `bytes` bytes and is idle.
        b.iter(|| unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst_addr as *mut u8, bytes)
        })
    });
    group.bench_function(format!("pageable_to_pinned_{threads}_threads"), |b| {
        b.iter(|| {
            let part = bytes / threads;
            pool.scope(|s| {
                for t in 0..threads {
                    let src = &src[t * part..(t + 1) * part];
                    // SAFETY: each task writes its own disjoint part of `dst`.
                    s.spawn(move |_| unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr(),
                            (dst_addr + t * part) as *mut u8,
                            part,
                        )
                    });
                }
            })
        })
    });
    group.bench_function(format!("pinned_to_pageable_{threads}_threads"), |b| {
        let mut out = vec![0u8; bytes];
        b.iter(|| {
            let part = bytes / threads;
            pool.scope(|s| {
                for (t, chunk) in out.chunks_mut(part).enumerate() {
                    // SAFETY: each task reads its own disjoint part of `dst`, which is idle.
                    s.spawn(move |_| unsafe {
                        std::ptr::copy_nonoverlapping(
                            (dst_addr + t * part) as *const u8,
                            chunk.as_mut_ptr(),
                            chunk.len(),
                        )
                    });
                }
            })
        })
    });
    // SAFETY: allocated above, idle.
    unsafe { sys::cuMemFreeHost(dst.cast()) };
    group.finish();
}

/// What waking the copy threads costs at 8 MiB: the same parallel pageable-to-pinned copy (one
/// part per thread, as the routes split it) timed back to back, where the threads are still
/// spinning from the last copy, and after 300 µs of idling (about the tail of an 8 MiB DMA),
/// where they have gone to sleep. Only the copies are timed. The difference is the wake-up a
/// mid-size transfer pays before its host half can start.
fn copy_wake(c: &mut Criterion, raw: &Raw) {
    let mut group = c.benchmark_group("copy_wake_8MiB");
    let bytes = 8 << 20;
    group.throughput(Throughput::Bytes(bytes as u64));
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let dst = raw.pinned(bytes);
    let threads = cuferry::staging::copy_threads();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let dst_addr = dst as usize;
    let copy = || {
        let part = bytes.div_ceil(threads);
        pool.scope(|s| {
            for (t, from) in src.chunks(part).enumerate() {
                // SAFETY: each task writes its own disjoint part of `dst`, which is idle.
                s.spawn(move |_| unsafe {
                    std::ptr::copy_nonoverlapping(
                        from.as_ptr(),
                        (dst_addr + t * part) as *mut u8,
                        from.len(),
                    )
                });
            }
        })
    };
    group.bench_function(format!("back_to_back_{threads}_threads"), |b| {
        b.iter(copy);
    });
    group.bench_function(format!("after_300us_idle_{threads}_threads"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                std::thread::sleep(Duration::from_micros(300));
                let start = Instant::now();
                copy();
                total += start.elapsed();
            }
            total
        })
    });
    group.bench_function("one_thread", |b| {
        // SAFETY: `dst` holds `bytes` bytes and is idle.
        b.iter(|| unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst_addr as *mut u8, bytes)
        })
    });
    // SAFETY: allocated above, idle.
    unsafe { sys::cuMemFreeHost(dst.cast()) };
    group.finish();
}

/// Where an 8 MiB staged upload's (and download's) time goes, in one run: the route
/// (`upload_tensor_into`, `download_tensor_into`) beside
/// a raw replica of its one-region plan (4 chunks of 2 MiB of pinned memory, each copied by all
/// copy threads in chunk order, each queued with its own event as soon as its parts have landed,
/// by a thread of the same pool), the same host copy and DMA one after the other, and each half
/// alone. The replica shows what the plan itself costs on this host, without the crate's
/// bookkeeping.
fn midsize_anatomy(c: &mut Criterion, engine: &mut CudaEngine, raw: &Raw) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut group = c.benchmark_group("midsize_anatomy_8MiB");
    let bytes: usize = 8 << 20;
    let chunks = 4;
    let chunk = bytes / chunks;
    group.throughput(Throughput::Bytes(bytes as u64));
    let threads = cuferry::staging::copy_threads();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let ctx = engine
        .with_raw(|r| Ok::<_, cuferry::Error>(r.context().as_raw() as usize))
        .unwrap();
    let n = bytes / 4;
    let host: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
    let mut tensor = cuferry::upload_tensor(engine, &host, &[n]).unwrap();
    group.bench_function("cuferry_upload_into", |b| {
        b.iter(|| cuferry::upload_tensor_into(engine, &mut tensor, &host).unwrap())
    });
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let pinned = raw.pinned(bytes) as usize;
    let dev = raw.device(bytes);
    let stream = raw.stream as usize;
    let mut events = [std::ptr::null_mut(); 4];
    for event in &mut events {
        // SAFETY: the engine's context is current on this thread (`Raw::new`).
        let code = unsafe {
            sys::cuEventCreate(event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        };
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    }
    let events_addr: [usize; 4] = events.map(|e| e as usize);
    let part_of = |len: usize| len.div_ceil(threads);
    /// The host copy of `len` bytes from `from` to `to`, split into parts of `part` bytes
    /// across the pool, in FIFO order; `left` counts the parts not yet landed.
    fn spawn_copy<'s>(
        s: &rayon::ScopeFifo<'s>,
        from: usize,
        to: usize,
        len: usize,
        part: usize,
        left: &'s AtomicUsize,
    ) {
        let mut at = 0;
        while at < len {
            let this = part.min(len - at);
            let (f, t) = (from + at, to + at);
            s.spawn_fifo(move |_| {
                // SAFETY: disjoint parts of the source and of the idle pinned block.
                unsafe { std::ptr::copy_nonoverlapping(f as *const u8, t as *mut u8, this) };
                left.fetch_sub(1, Ordering::Release);
            });
            at += this;
        }
    }
    let src_addr = src.as_ptr() as usize;
    let parts = |len: usize| len.div_ceil(part_of(len));
    group.bench_function("raw_dma_alone", |b| {
        b.iter(|| {
            raw.htod(dev, pinned as *const u8, bytes);
            raw.wait();
        })
    });
    group.bench_function("raw_copy_alone", |b| {
        b.iter(|| {
            let left = AtomicUsize::new(parts(bytes));
            pool.scope_fifo(|s| spawn_copy(s, src_addr, pinned, bytes, part_of(bytes), &left));
        })
    });
    group.bench_function("raw_copy_then_dma", |b| {
        b.iter(|| {
            let left = AtomicUsize::new(parts(bytes));
            pool.scope_fifo(|s| spawn_copy(s, src_addr, pinned, bytes, part_of(bytes), &left));
            raw.htod(dev, pinned as *const u8, bytes);
            raw.wait();
        })
    });
    group.bench_function("raw_one_region", |b| {
        b.iter(|| {
            let left: Vec<AtomicUsize> = (0..chunks)
                .map(|_| AtomicUsize::new(parts(chunk)))
                .collect();
            pool.scope_fifo(|s| {
                for (k, left) in left.iter().enumerate() {
                    spawn_copy(
                        s,
                        src_addr + k * chunk,
                        pinned + k * chunk,
                        chunk,
                        part_of(chunk),
                        left,
                    );
                }
                // SAFETY: the engine's context, made current on this pool thread for the calls.
                unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) };
                for (k, left) in left.iter().enumerate() {
                    while left.load(Ordering::Acquire) != 0 {
                        std::hint::spin_loop();
                    }
                    // SAFETY: the chunk's parts have landed; both ranges hold `chunk` bytes and
                    // stay valid until the wait below.
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            dev + (k * chunk) as u64,
                            (pinned + k * chunk) as *const c_void,
                            chunk,
                            stream as sys::CUstream,
                        );
                        sys::cuEventRecord(events_addr[k] as sys::CUevent, stream as sys::CUstream);
                    }
                }
            });
            // SAFETY: recorded above on the live stream.
            unsafe { sys::cuEventSynchronize(events_addr[chunks - 1] as sys::CUevent) };
        })
    });
    // The same anatomy for an 8 MiB download into a reused `Vec`: the route, each half alone,
    // the DMA then the copy-out, and a raw replica of the one-region plan (every chunk's DMA
    // queued with its own event, then each chunk copied out by all copy threads once its event
    // has completed).
    let mut reused = Some(Vec::<f32>::with_capacity(n));
    group.bench_function("download_cuferry_into", |b| {
        b.iter(|| {
            reused = Some(
                cuferry::download_tensor_into(engine, &tensor, reused.take().unwrap()).unwrap(),
            )
        })
    });
    let mut out = vec![0u8; bytes];
    let out_addr = out.as_mut_ptr() as usize;
    group.bench_function("download_raw_dma_alone", |b| {
        b.iter(|| {
            raw.dtoh(pinned as *mut u8, dev, bytes);
            raw.wait();
        })
    });
    group.bench_function("download_raw_copy_out_alone", |b| {
        b.iter(|| {
            let left = AtomicUsize::new(parts(bytes));
            pool.scope_fifo(|s| spawn_copy(s, pinned, out_addr, bytes, part_of(bytes), &left));
        })
    });
    group.bench_function("download_raw_dma_then_copy_out", |b| {
        b.iter(|| {
            raw.dtoh(pinned as *mut u8, dev, bytes);
            raw.wait();
            let left = AtomicUsize::new(parts(bytes));
            pool.scope_fifo(|s| spawn_copy(s, pinned, out_addr, bytes, part_of(bytes), &left));
        })
    });
    group.bench_function("download_raw_one_region", |b| {
        b.iter(|| {
            for (k, &event) in events_addr.iter().enumerate() {
                // SAFETY: both ranges hold `chunk` bytes and stay valid until the waits below;
                // the engine's context is current on this thread (`Raw::new`).
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(
                        (pinned + k * chunk) as *mut c_void,
                        dev + (k * chunk) as u64,
                        chunk,
                        stream as sys::CUstream,
                    );
                    sys::cuEventRecord(event as sys::CUevent, stream as sys::CUstream);
                }
            }
            let left: Vec<AtomicUsize> = (0..chunks)
                .map(|_| AtomicUsize::new(parts(chunk)))
                .collect();
            pool.scope_fifo(|s| {
                // SAFETY: the engine's context, made current on this pool thread for the waits.
                unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) };
                for (k, left) in left.iter().enumerate() {
                    // SAFETY: recorded above on the live stream.
                    unsafe { sys::cuEventSynchronize(events_addr[k] as sys::CUevent) };
                    spawn_copy(
                        s,
                        pinned + k * chunk,
                        out_addr + k * chunk,
                        chunk,
                        part_of(chunk),
                        left,
                    );
                }
            });
        })
    });
    drop(out);
    // SAFETY: every use above was waited for; nothing uses them again.
    unsafe {
        for event in events {
            sys::cuEventDestroy_v2(event);
        }
        sys::cuMemFreeHost(pinned as *mut c_void);
        sys::cuMemFree_v2(dev);
    }
    group.finish();
}

/// Mid-size transfers (8 MiB) under several ring depths and copy-thread counts: a transfer
/// smaller than the ring is split into `ring_depth` chunks, so the depth sets the overlap.
fn midsize_sweep(c: &mut Criterion, engine: &mut CudaEngine) {
    let mut group = c.benchmark_group("midsize_sweep");
    let bytes = 8 << 20;
    let n = bytes / 4;
    group.throughput(Throughput::Bytes(bytes as u64));
    let host: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
    let original = engine.staging_config();
    let tensor = cuferry::upload_tensor(engine, &host, &[n]).unwrap();
    for (depth, threads) in [(4, 12), (8, 12), (4, 16), (8, 16)] {
        if !pool_has(threads) {
            continue;
        }
        let mut config = original;
        config.ring_depth = depth;
        config.copy_threads = threads;
        engine.set_staging_config(config).unwrap();
        let label = format!("depth{depth}_threads{threads}");
        group.bench_function(BenchmarkId::new("upload", &label), |b| {
            b.iter(|| drop(cuferry::upload_tensor(engine, &host, &[n]).unwrap()))
        });
        let mut out = Some(Vec::<f32>::with_capacity(n));
        group.bench_function(BenchmarkId::new("download_into", &label), |b| {
            b.iter(|| {
                out = Some(download_tensor_into(engine, &tensor, out.take().unwrap()).unwrap())
            })
        });
    }
    engine.set_staging_config(original).unwrap();
    group.finish();
}

fn benches(c: &mut Criterion) {
    let mut engine = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("transfer_paths: no CUDA device ({e}); nothing measured");
            return;
        }
    };
    let raw = Raw::new(&mut engine);
    pending(c, &mut engine, &raw);
    download_into(c, &mut engine, &raw);
    submit_cost(c, &mut engine, &raw);
    pinned_alloc(c, &mut engine, &raw);
    host_copy(c, &raw);
    copy_wake(c, &raw);
    midsize_anatomy(c, &mut engine, &raw);
    blocking(c, &mut engine, &raw);
    staging_sweep(c, &mut engine);
    midsize_sweep(c, &mut engine);
    four_threads(c);
}

/// Per-iteration times of one bench function, as criterion measured them.
#[derive(Default)]
struct Samples(RefCell<Vec<Duration>>);

impl Samples {
    /// Times `iters` runs of `f` for criterion and keeps the per-iteration mean.
    fn time(&self, iters: u64, mut f: impl FnMut()) -> Duration {
        let start = Instant::now();
        for _ in 0..iters {
            f();
        }
        let total = start.elapsed();
        self.0.borrow_mut().push(total.div_f64(iters.max(1) as f64));
        total
    }

    /// The median per-iteration time.
    fn median(&self) -> Duration {
        let mut all = self.0.borrow().clone();
        all.sort();
        all.get(all.len() / 2).copied().unwrap_or_default()
    }
}

const REGISTERED_SIZES: [(usize, &str); 3] = [
    (8 << 20, "8MiB"),
    (64 << 20, "64MiB"),
    (256 << 20, "256MiB"),
];

/// Queues a returned transfer again: `Pending::resubmit` of an upload or a download.
type Resubmit<D> = fn(Pending<D, Returned>, &mut CudaEngine) -> Pending<D>;

/// A registered transfer's parts in one order, whatever order its direction hands them back in.
type RegisteredParts = (RegisteredBuffer<f32>, DeviceTensor<f32>);

/// Resubmit-and-wait of a returned transfer over a registered buffer, under `cuferry_registered`;
/// gives back the transfer's parts and the median time.
fn bench_registered<D: Operation>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    engine: &mut CudaEngine,
    label: &str,
    transfer: Pending<D, Returned>,
    resubmit: Resubmit<D>,
    parts: fn(D::Parts) -> RegisteredParts,
) -> (RegisteredBuffer<f32>, DeviceTensor<f32>, Duration) {
    let samples = Samples::default();
    let mut transfer = Some(transfer);
    group.bench_function(BenchmarkId::new("cuferry_registered", label), |b| {
        b.iter_custom(|iters| {
            samples.time(iters, || {
                let r = transfer.take().unwrap();
                transfer = Some(resubmit(r, engine).wait().unwrap());
            })
        })
    });
    let (buffer, tensor) = parts(transfer.unwrap().into_parts());
    (buffer, tensor, samples.median())
}

/// Registered buffers: the pending routes over a `Vec` page-locked in place, against the staged
/// blocking route and the raw pinned copy, and what registering costs.
fn registered(c: &mut Criterion) {
    let mut engine = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("transfer_paths: no CUDA device ({e}); registered buffers not measured");
            return;
        }
    };
    let engine = &mut engine;
    let raw = Raw::new(engine);
    // (direction, size) -> (registered, staged) medians.
    let mut per_transfer = Vec::new();
    for upload in [true, false] {
        let direction = if upload { "upload" } else { "download" };
        let mut group = c.benchmark_group(format!("registered_{direction}"));
        for (bytes, label) in REGISTERED_SIZES {
            group.throughput(Throughput::Bytes(bytes as u64));
            let n = bytes / 4;
            let data: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
            let buffer = RegisteredBuffer::register(engine, data.clone()).unwrap();
            let tensor = engine.alloc_tensor::<f32>(&[n]).unwrap();
            let (_buffer, mut tensor, registered) = if upload {
                let first = upload_pending(engine, buffer, tensor).unwrap();
                bench_registered(
                    &mut group,
                    engine,
                    label,
                    first.wait().unwrap(),
                    |r, e| r.resubmit(e).unwrap(),
                    |parts| parts,
                )
            } else {
                // A download's parts come back source first: the tensor, then the buffer.
                let first = download_pending(engine, tensor, buffer).unwrap();
                bench_registered(
                    &mut group,
                    engine,
                    label,
                    first.wait().unwrap(),
                    |r, e| r.resubmit(e).unwrap(),
                    |(tensor, buffer)| (buffer, tensor),
                )
            };
            let staged = Samples::default();
            if upload {
                group.bench_function(BenchmarkId::new("cuferry_staged_into", label), |b| {
                    b.iter_custom(|iters| {
                        staged.time(iters, || {
                            upload_tensor_into(engine, &mut tensor, &data).unwrap()
                        })
                    })
                });
            } else {
                let mut out = Some(Vec::<f32>::with_capacity(n));
                group.bench_function(BenchmarkId::new("cuferry_staged_into", label), |b| {
                    b.iter_custom(|iters| {
                        staged.time(iters, || {
                            out = Some(
                                download_tensor_into(engine, &tensor, out.take().unwrap()).unwrap(),
                            )
                        })
                    })
                });
            }
            per_transfer.push((direction, bytes, label, registered, staged.median()));
            if bytes == 256 << 20 {
                let host = raw.pinned(bytes);
                let dev = raw.device(bytes);
                let pinned = raw.bench_pinned_and_free(&mut group, label, upload, host, dev, bytes);
                println!(
                    "transfer_paths: registered {direction} {label}: {registered:?} per transfer, \
                     raw pinned copy {:?}: {:.3}x the raw copy's speed (target 0.97x)",
                    pinned,
                    pinned.as_secs_f64() / registered.as_secs_f64()
                );
            }
        }
        group.finish();
    }

    let mut group = c.benchmark_group("registration");
    let mut cost = Vec::new();
    for (bytes, label) in REGISTERED_SIZES {
        group.throughput(Throughput::Bytes(bytes as u64));
        // Touched, so the registration measures locking pages, not faulting them in.
        let mut data = Some(vec![1.0f32; bytes / 4]);
        let samples = Samples::default();
        group.bench_function(BenchmarkId::new("register_and_unregister", label), |b| {
            b.iter_custom(|iters| {
                samples.time(iters, || {
                    let buffer = RegisteredBuffer::register(engine, data.take().unwrap()).unwrap();
                    data = Some(buffer.into_vec().unwrap());
                })
            })
        });
        cost.push((bytes, samples.median()));
    }
    group.finish();

    for (direction, bytes, label, registered, staged) in per_transfer {
        let Some(&(_, registration)) = cost.iter().find(|(b, _)| *b == bytes) else {
            continue;
        };
        let verdict = if staged > registered {
            let saved = (staged - registered).as_secs_f64();
            let count = (registration.as_secs_f64() / saved).ceil();
            format!("registering once pays off from transfer {count}")
        } else {
            "the staged route is no slower: registering never pays off".to_owned()
        };
        println!(
            "transfer_paths: break-even {direction} {label}: register + unregister \
             {registration:?}, registered {registered:?} vs staged {staged:?} per transfer: \
             {verdict}"
        );
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1200))
}

/// Host threads woken by the raw wake mechanisms of `wake_16B`: a flag and the thread to unpark.
struct Waiter {
    done: AtomicBool,
    thread: std::thread::Thread,
}

impl Waiter {
    fn new() -> Arc<Self> {
        Arc::new(Waiter {
            done: AtomicBool::new(false),
            thread: std::thread::current(),
        })
    }

    fn signal(&self) {
        self.done.store(true, Ordering::Release);
        self.thread.unpark();
    }

    /// Parks the waiting thread until signalled, then re-arms.
    fn wait(&self) {
        while !self.done.load(Ordering::Acquire) {
            std::thread::park();
        }
        self.done.store(false, Ordering::Relaxed);
    }
}

/// The stream callback of `wake_16B`: signals the `Waiter` it was given.
unsafe extern "C" fn raw_wake(_stream: sys::CUstream, _status: sys::CUresult, data: *mut c_void) {
    // SAFETY: `data` is the bench's `Waiter`, which outlives every callback (the side stream is
    // synchronized before it is dropped).
    let waiter = unsafe { &*data.cast::<Waiter>() };
    waiter.signal();
}

/// The median of `samples`, in microseconds.
fn median_us(samples: &mut [Duration]) -> f64 {
    samples.sort_unstable();
    samples[samples.len() / 2].as_secs_f64() * 1e6
}

/// The CPU time this process has used so far, every thread counted.
#[cfg(target_os = "linux")]
fn process_cpu_time() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is valid for one write; the clock id is a constant the kernel knows.
    let code = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    (code == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(not(target_os = "linux"))]
fn process_cpu_time() -> Option<Duration> {
    None
}

/// `await_16B`, `wake_16B` and `await_256MiB_cpu`, on an engine of their own.
fn awaiting(c: &mut Criterion) {
    let mut engine = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("transfer_paths: no CUDA device ({e}); awaiting not measured");
            return;
        }
    };
    let raw = Raw::new(&mut engine);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    await_16b(c, &mut engine, &rt);
    wake_16b(c, &mut engine, &raw);
    await_cpu(&mut engine, &rt);
}

fn await_16b(c: &mut Criterion, engine: &mut CudaEngine, rt: &tokio::runtime::Runtime) {
    let buffer = PinnedHostBuffer::<f32>::from_slice(engine, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[4]).unwrap();
    let mut returned = Some(
        upload_pending(engine, buffer, tensor)
            .unwrap()
            .wait()
            .unwrap(),
    );
    let mut group = c.benchmark_group("await_16B");
    group.bench_function("wait", |b| {
        b.iter(|| {
            let r = returned.take().unwrap();
            returned = Some(r.resubmit(engine).unwrap().wait().unwrap());
        })
    });
    group.bench_function("await_current_thread", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let r = returned.take().unwrap();
                    returned = Some(r.resubmit(engine).unwrap().await.unwrap());
                }
                start.elapsed()
            })
        })
    });
    group.finish();

    // The same two, as medians of single transfers, and their ratio.
    let rounds = 5000;
    let mut waits = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let r = returned.take().unwrap();
        let start = Instant::now();
        returned = Some(r.resubmit(engine).unwrap().wait().unwrap());
        waits.push(start.elapsed());
    }
    let mut awaits = rt.block_on(async {
        let mut awaits = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let r = returned.take().unwrap();
            let start = Instant::now();
            returned = Some(r.resubmit(engine).unwrap().await.unwrap());
            awaits.push(start.elapsed());
        }
        awaits
    });
    let (wait, awaited) = (median_us(&mut waits), median_us(&mut awaits));
    eprintln!(
        "await_16B: median over {rounds}: wait {wait:.2} us, await (tokio current-thread) \
         {awaited:.2} us, ratio {:.2} (target <= 1.5)",
        awaited / wait
    );
}

fn wake_16b(c: &mut Criterion, engine: &mut CudaEngine, raw: &Raw) {
    let ctx = engine
        .with_raw(|r| Ok::<_, cuferry::Error>(r.context().as_raw() as usize))
        .unwrap() as sys::CUcontext;
    let host = raw.pinned(16);
    let dev = raw.device(16);
    let waiter = Waiter::new();
    let mut group = c.benchmark_group("wake_16B");

    // The spinning wait, for reference.
    group.bench_function("event_synchronize", |b| {
        b.iter(|| {
            raw.htod(dev, host, 16);
            raw.wait();
        })
    });

    // A stream callback on a side stream that waits for the copy's event.
    let mut side = std::ptr::null_mut();
    // SAFETY: the engine's context is current (`Raw::new`); out pointer valid.
    let code = unsafe {
        sys::cuStreamCreate(
            &mut side,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
        )
    };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    let data = Arc::as_ptr(&waiter).cast_mut().cast::<c_void>();
    group.bench_function("stream_callback", |b| {
        b.iter(|| {
            raw.htod(dev, host, 16);
            // SAFETY: the side stream and the event are live; `raw_wake` only signals the
            // waiter, which outlives the side stream's work (synchronized below).
            unsafe {
                assert_eq!(
                    sys::cuStreamWaitEvent(side, raw.event, 0),
                    sys::CUresult::CUDA_SUCCESS
                );
                assert_eq!(
                    sys::cuStreamAddCallback(side, Some(raw_wake), data, 0),
                    sys::CUresult::CUDA_SUCCESS
                );
            }
            waiter.wait();
        })
    });
    // SAFETY: the side stream was made above; its callbacks have all run once it is idle.
    unsafe {
        sys::cuStreamSynchronize(side);
        sys::cuStreamDestroy_v2(side);
    }

    // A watcher thread blocked in `cuEventSynchronize` on a blocking-sync event.
    let mut blocking = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: the engine's context is current; out pointer valid.
    let code = unsafe { sys::cuEventCreate(&mut blocking, flags) };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    let (go, requests) = std::sync::mpsc::channel::<()>();
    let watcher = {
        let waiter = Arc::clone(&waiter);
        let (ctx, event) = (ctx as usize, blocking as usize);
        std::thread::spawn(move || {
            // SAFETY: the engine's context and the event outlive this thread (joined below).
            unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) };
            while requests.recv().is_ok() {
                // SAFETY: as above.
                let code = unsafe { sys::cuEventSynchronize(event as sys::CUevent) };
                assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
                waiter.signal();
            }
        })
    };
    group.bench_function("watcher_blocking_sync", |b| {
        b.iter(|| {
            // SAFETY: `dev` and `host` hold 16 bytes and outlive the wait; the event is live.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(dev, host.cast::<c_void>(), 16, raw.stream);
                sys::cuEventRecord(blocking, raw.stream);
            }
            go.send(()).unwrap();
            waiter.wait();
        })
    });
    drop(go);
    watcher.join().unwrap();
    group.finish();
    // SAFETY: everything here was made above and is idle: the watcher is gone and every wait
    // has returned.
    unsafe {
        sys::cuEventDestroy_v2(blocking);
        sys::cuMemFreeHost(host.cast());
        sys::cuMemFree_v2(dev);
    }
}

/// Prints the process's CPU time over the wall time while awaiting, then while waiting for,
/// 256 MiB pending uploads.
fn await_cpu(engine: &mut CudaEngine, rt: &tokio::runtime::Runtime) {
    let n = (256 << 20) / 4;
    let buffer = PinnedHostBuffer::<f32>::from_slice(engine, &vec![1.5; n]).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let mut returned = Some(
        upload_pending(engine, buffer, tensor)
            .unwrap()
            .wait()
            .unwrap(),
    );
    let rounds = 20;
    let mut measure = |label: &str, awaited: bool| {
        let (Some(cpu0), start) = (process_cpu_time(), Instant::now()) else {
            eprintln!("await_256MiB_cpu: no process CPU clock here; not measured");
            return;
        };
        for _ in 0..rounds {
            let r = returned.take().unwrap();
            let in_flight = r.resubmit(engine).unwrap();
            returned = Some(if awaited {
                rt.block_on(async { in_flight.await }).unwrap()
            } else {
                in_flight.wait().unwrap()
            });
        }
        let wall = start.elapsed();
        let cpu = process_cpu_time().unwrap_or(cpu0) - cpu0;
        eprintln!(
            "await_256MiB_cpu: {label}: {rounds} transfers, wall {:.2} ms, process CPU {:.2} ms, \
             {:.1}% of one core{}",
            wall.as_secs_f64() * 1e3,
            cpu.as_secs_f64() * 1e3,
            100.0 * cpu.as_secs_f64() / wall.as_secs_f64(),
            if awaited { " (target < 5%)" } else { "" }
        );
    };
    measure("await (tokio current-thread)", true);
    measure("wait", false);
}

criterion_group! {
    name = transfer;
    config = config();
    targets = benches, awaiting, registered
}
criterion_main!(transfer);
