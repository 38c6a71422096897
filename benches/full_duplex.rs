//! Full duplex: whether uploads and downloads run at the same time, beside the raw driver, in the
//! same run.
//!
//! PCIe carries both directions at once, and the H200 has one copy engine per direction, so a
//! host-to-device copy and a device-to-host copy queued on two streams can overlap: together
//! they should take about as long as the longer of the two, not their sum. Queued on one stream
//! they run one after the other. This bench measures how close the crate's pending routes come
//! to the raw two-stream figure, and what ordering work across streams costs on the host.
//!
//! Run on a GPU machine: `cargo bench --bench full_duplex`. Groups:
//! - `duplex_256MiB`: 256 MiB transfers from and to pinned memory, each submitted and waited:
//!   the crate's pending upload alone, pending download alone, and both submitted back to back
//!   then both waited (`cuferry_upload_and_download`, the headline case); beside the raw pinned
//!   `cuMemcpyHtoDAsync` alone, `cuMemcpyDtoHAsync` alone, both on two streams at once
//!   (`raw_two_streams`, the overlapped baseline) and both on one stream (`raw_one_stream`, the
//!   serialised baseline). Throughput counts every byte moved (512 MiB for the pairs). The bench
//!   prints each pair's overlap: 0 when the pair takes the sum of its directions alone, 1 when it
//!   takes only the longer of them;
//! - `streaming_loop_64MiB`: [`BATCHES`] batches of 64 MiB of `f32`; each step uploads batch
//!   `k + 1` (pending, from pinned memory), scales batch `k` on the device (one elementwise
//!   kernel, read from the upload's in-flight destination), and downloads result `k - 1`
//!   (pending, into pinned memory), with at most [`UPLOAD_SLOTS`] uploads and [`RESULT_SLOTS`]
//!   downloads in flight, each waited only when its buffer is needed again. The crate's loop
//!   (`cuferry`) beside the same loop written raw, with an equivalent NVRTC-compiled scale kernel,
//!   on one stream (`raw_one_stream`) and on three streams ordered by events (`raw_three_streams`:
//!   upload, compute and download streams). Throughput counts bytes uploaded plus downloaded;
//!   the kernel reads and writes 64 MiB of device memory, which takes far less time than moving
//!   64 MiB across PCIe, so the loop is bound by the copies. The crate's kernel allocates a new
//!   output per batch (stream-ordered), the raw loop writes into preallocated outputs;
//! - `ordering_cost`: host time only, the waits excluded. `upload_submit_16B`: submitting a
//!   16-byte pending upload (resubmission, as `transfer_paths`' `submit_16B`);
//!   `launch_resident`: one elementwise kernel on a 16-byte tensor last written by a kernel
//!   (nothing to order across streams), while a 16-byte upload of another tensor is in flight;
//!   `launch_in_flight_destination`: the same kernel on that upload's in-flight destination
//!   (`Pending::tensor`), whose first use orders the kernel after the copy: the difference
//!   between the two is the host cost of one cross-stream dependency;
//!   `download_submit_16B_after_kernel`: submitting a 16-byte pending download of a tensor a
//!   kernel has just written (one dependency), beside `download_submit_16B_resident`, the same
//!   submission of a tensor written long ago (none); `raw_record_and_stream_wait`: the two driver
//!   calls one dependency takes, raw (`cuEventRecord` on one stream, `cuStreamWaitEvent` on
//!   another). The bench prints both differences and the raw figure.
//!
//! The raw baselines run on streams of their own (`CU_STREAM_NON_BLOCKING`) in the engine's
//! context, so they do not depend on how many streams the engine uses.
//!
//! Without a GPU the bench prints a note and measures nothing.

// criterion's macros generate undocumented public items.
#![allow(missing_docs)]

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::sys;
use cuferry::{
    CudaEngine, DeviceTensor, Pending, PinnedHostBuffer, download_pending,
    pending::{Download, Returned, Upload},
    upload_pending,
};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::{CString, c_void};
use std::time::{Duration, Instant};

/// The size of each direction in `duplex_256MiB`.
const DUPLEX_BYTES: usize = 256 << 20;

/// Batches per run of the streaming loop.
const BATCHES: usize = 8;

/// The size of one batch of the streaming loop.
const BATCH_BYTES: usize = 64 << 20;

/// `f32`s per batch.
const BATCH_LEN: usize = BATCH_BYTES / 4;

/// Upload slots (pinned source and device destination) of the streaming loop: at most this many
/// uploads in flight or waiting for their batch's kernel.
const UPLOAD_SLOTS: usize = 3;

/// Result slots (pinned destination) of the streaming loop: at most this many downloads in
/// flight.
const RESULT_SLOTS: usize = 3;

/// What the streaming loop's kernel multiplies every element by.
const FACTOR: f32 = 3.0;

/// Threads per block of the raw kernel, as the crate's elementwise kernels use.
const BLOCK: u32 = 256;

/// The crate's elementwise kernels' grid cap (they loop over the rest), matched by the raw one.
const MAX_BLOCKS: u32 = 1 << 20;

/// The raw stand-in for `CudaEngine::scale` on `f32`: `out = a * s`, a grid-stride loop as the
/// crate's kernels are.
const SCALE_SOURCE: &str = r#"
extern "C" __global__ void scale(const float* a, float* out, float s, unsigned long long n) {
    unsigned long long stride = (unsigned long long)blockDim.x * (unsigned long long)gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = __fmul_rn(a[i], s);
    }
}
"#;

/// Panics with the call's name unless `code` is success.
fn check(call: &str, code: sys::CUresult) {
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "{call} failed");
}

/// Raw driver resources for the baselines, in the engine's context, made current on this thread.
/// Everything made through it is freed when it drops, after the context is synchronized.
struct Raw {
    streams: RefCell<Vec<sys::CUstream>>,
    events: RefCell<Vec<sys::CUevent>>,
    device: RefCell<Vec<sys::CUdeviceptr>>,
    pinned: RefCell<Vec<*mut u8>>,
    modules: RefCell<Vec<sys::CUmodule>>,
}

impl Raw {
    /// Makes the engine's context current on this thread, which the engine's own operations
    /// accept (they find their context current).
    fn new(engine: &mut CudaEngine) -> Self {
        let ctx = engine
            .with_raw(|r| Ok::<_, cuferry::Error>(r.context().as_raw() as usize))
            .unwrap();
        // SAFETY: `ctx` is the engine's live context, which outlives every `Raw`.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(ctx as sys::CUcontext)
        });
        Raw {
            streams: RefCell::default(),
            events: RefCell::default(),
            device: RefCell::default(),
            pinned: RefCell::default(),
            modules: RefCell::default(),
        }
    }

    /// A new stream that does not synchronize with the legacy default stream.
    fn stream(&self) -> sys::CUstream {
        let mut stream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: the engine's context is current (`new`); out pointer valid.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, flags)
        });
        self.streams.borrow_mut().push(stream);
        stream
    }

    /// A new event without timing.
    fn event(&self) -> sys::CUevent {
        let mut event = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: the engine's context is current; out pointer valid.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut event, flags)
        });
        self.events.borrow_mut().push(event);
        event
    }

    /// `bytes` of device memory.
    fn device(&self, bytes: usize) -> sys::CUdeviceptr {
        let mut ptr = 0;
        // SAFETY: the engine's context is current; out pointer valid.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) });
        self.device.borrow_mut().push(ptr);
        ptr
    }

    /// `bytes` of page-locked host memory, filled so the copies move real data.
    fn pinned(&self, bytes: usize) -> *mut u8 {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: out pointer valid.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut ptr, bytes, 0)
        });
        let ptr = ptr.cast::<u8>();
        // SAFETY: a fresh allocation of `bytes` bytes, not yet seen by the device.
        unsafe { std::ptr::write_bytes(ptr, 0x3C, bytes) };
        self.pinned.borrow_mut().push(ptr);
        ptr
    }

    /// The raw scale kernel ([`SCALE_SOURCE`]), compiled by NVRTC for this device and loaded;
    /// `None` (with a note) when it cannot be compiled.
    fn scale_kernel(&self) -> Option<sys::CUfunction> {
        let mut device = 0;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the engine's context is current; out pointers are valid.
        unsafe {
            check("cuCtxGetDevice", sys::cuCtxGetDevice(&mut device));
            let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR;
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(&mut major, attribute, device),
            );
            let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR;
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(&mut minor, attribute, device),
            );
        }
        // The device's own virtual architecture; NVRTC's default when this NVRTC does not know it.
        let options = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
            ..Default::default()
        };
        let ptx = match cudarc::nvrtc::compile_ptx_with_opts(SCALE_SOURCE, options)
            .or_else(|_| cudarc::nvrtc::compile_ptx(SCALE_SOURCE))
        {
            Ok(ptx) => ptx,
            Err(e) => {
                eprintln!("full_duplex: the raw scale kernel does not compile ({e:?})");
                return None;
            }
        };
        let image = CString::new(ptx.to_src()).expect("PTX has no NUL byte");
        let mut module = std::ptr::null_mut();
        // SAFETY: the engine's context is current; `image` is a NUL-terminated PTX image that
        // lives through the call (the driver copies it).
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>())
        });
        self.modules.borrow_mut().push(module);
        let mut function = std::ptr::null_mut();
        // SAFETY: `module` was just loaded; the name is NUL-terminated.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut function, module, c"scale".as_ptr())
        });
        Some(function)
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: the context is current; once it is synchronized no queued work touches
        // anything made here, and each handle is freed once.
        unsafe {
            check("cuCtxSynchronize", sys::cuCtxSynchronize());
            for &module in self.modules.borrow().iter() {
                sys::cuModuleUnload(module);
            }
            for &ptr in self.pinned.borrow().iter() {
                sys::cuMemFreeHost(ptr.cast());
            }
            for &ptr in self.device.borrow().iter() {
                sys::cuMemFree_v2(ptr);
            }
            for &event in self.events.borrow().iter() {
                sys::cuEventDestroy_v2(event);
            }
            for &stream in self.streams.borrow().iter() {
                sys::cuStreamDestroy_v2(stream);
            }
        }
    }
}

/// Queues `cuMemcpyHtoDAsync` of `bytes` on `stream`.
///
/// # Safety
/// `dst` and `src` hold `bytes` bytes (`src` page-locked) and stay allocated, untouched by the
/// host, until the copy completes.
unsafe fn htod(dst: sys::CUdeviceptr, src: *const u8, bytes: usize, stream: sys::CUstream) {
    // SAFETY: the caller's contract.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), bytes, stream)
    });
}

/// Queues `cuMemcpyDtoHAsync` of `bytes` on `stream`.
///
/// # Safety
/// As [`htod`], `dst` being the page-locked side.
unsafe fn dtoh(dst: *mut u8, src: sys::CUdeviceptr, bytes: usize, stream: sys::CUstream) {
    // SAFETY: the caller's contract.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, bytes, stream)
    });
}

/// Records `event` on `stream`.
fn record(event: sys::CUevent, stream: sys::CUstream) {
    // SAFETY: both are live handles of the current context.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event, stream)
    });
}

/// Blocks the host until `event`'s last record has completed (at once if never recorded).
fn sync_event(event: sys::CUevent) {
    // SAFETY: the event is live.
    check("cuEventSynchronize", unsafe {
        sys::cuEventSynchronize(event)
    });
}

/// Makes `stream`'s later work wait for `event`'s last record (no wait if never recorded).
fn stream_wait(stream: sys::CUstream, event: sys::CUevent) {
    // SAFETY: both are live handles of the current context.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(stream, event, 0)
    });
}

/// Blocks the host until everything queued on `stream` has completed.
fn sync_stream(stream: sys::CUstream) {
    // SAFETY: the stream is live.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream)
    });
}

/// Per-iteration times of one bench function, as criterion measured them.
#[derive(Default)]
struct Samples(RefCell<Vec<Duration>>);

impl Samples {
    /// Keeps the per-iteration mean of `total` over `iters` and hands `total` back to criterion.
    fn push(&self, total: Duration, iters: u64) -> Duration {
        self.0.borrow_mut().push(total.div_f64(iters.max(1) as f64));
        total
    }

    /// Times `iters` runs of `f` for criterion and keeps the per-iteration mean.
    fn time(&self, iters: u64, mut f: impl FnMut()) -> Duration {
        let start = Instant::now();
        for _ in 0..iters {
            f();
        }
        self.push(start.elapsed(), iters)
    }

    /// The median per-iteration time.
    fn median(&self) -> Duration {
        let mut all = self.0.borrow().clone();
        all.sort();
        all.get(all.len() / 2).copied().unwrap_or_default()
    }
}

/// Benches `f` under `name` and returns its median time per iteration.
fn bench(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, mut f: impl FnMut()) -> Duration {
    let samples = Samples::default();
    group.bench_function(name, |b| b.iter_custom(|iters| samples.time(iters, &mut f)));
    samples.median()
}

/// How much of the shorter direction a pair of copies hid under the longer one: 0 when the pair
/// took the sum of its directions alone, 1 when it took only the longer of them.
fn overlap(pair: Duration, up: Duration, down: Duration) -> f64 {
    let (up, down, pair) = (up.as_secs_f64(), down.as_secs_f64(), pair.as_secs_f64());
    (up + down - pair) / up.min(down)
}

/// A pinned buffer of `len` `f32`s holding a ramp, so the copies move real data.
fn ramp(engine: &mut CudaEngine, len: usize) -> PinnedHostBuffer<f32> {
    let mut buffer = PinnedHostBuffer::<f32>::new(engine, len).unwrap();
    for (i, v) in buffer.as_mut_slice().iter_mut().enumerate() {
        *v = (i % 1021) as f32;
    }
    buffer
}

/// `duplex_256MiB`: each direction alone and both at once, the crate's pending routes beside
/// the raw copies on two streams and on one.
fn duplex(c: &mut Criterion, engine: &mut CudaEngine) {
    let n = DUPLEX_BYTES / 4;
    let one = Throughput::Bytes(DUPLEX_BYTES as u64);
    let both = Throughput::Bytes(2 * DUPLEX_BYTES as u64);
    let mut group = c.benchmark_group("duplex_256MiB");

    // Two independent transfers: the upload writes one tensor, the download reads another.
    let source = ramp(engine, n);
    let destination = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let mut up = Some(
        upload_pending(engine, source, destination)
            .unwrap()
            .wait()
            .unwrap(),
    );
    let value = engine.full::<f32>(&[n], 1.5).unwrap();
    let landing = PinnedHostBuffer::<f32>::new(engine, n).unwrap();
    let mut down = Some(
        download_pending(engine, value, landing)
            .unwrap()
            .wait()
            .unwrap(),
    );

    group.throughput(one.clone());
    let crate_up = bench(&mut group, "cuferry_upload_alone", || {
        let r = up.take().unwrap();
        up = Some(r.resubmit(engine).unwrap().wait().unwrap());
    });
    let crate_down = bench(&mut group, "cuferry_download_alone", || {
        let r = down.take().unwrap();
        down = Some(r.resubmit(engine).unwrap().wait().unwrap());
    });
    group.throughput(both.clone());
    let crate_both = bench(&mut group, "cuferry_upload_and_download", || {
        let u = up.take().unwrap().resubmit(engine).unwrap();
        let d = down.take().unwrap().resubmit(engine).unwrap();
        up = Some(u.wait().unwrap());
        down = Some(d.wait().unwrap());
    });
    drop((up, down));

    let raw = Raw::new(engine);
    let (s1, s2) = (raw.stream(), raw.stream());
    let (e1, e2) = (raw.event(), raw.event());
    let (host_src, host_dst) = (raw.pinned(DUPLEX_BYTES), raw.pinned(DUPLEX_BYTES));
    let (dev_dst, dev_src) = (raw.device(DUPLEX_BYTES), raw.device(DUPLEX_BYTES));
    let bytes = DUPLEX_BYTES;
    // Every copy below: the four buffers hold `bytes` bytes each, are freed only when `raw`
    // drops (after a context synchronize), and each copy is waited before the next iteration
    // queues another over the same memory.
    group.throughput(one);
    let raw_up = bench(&mut group, "raw_upload_alone", || {
        // SAFETY: see above.
        unsafe { htod(dev_dst, host_src, bytes, s1) };
        record(e1, s1);
        sync_event(e1);
    });
    let raw_down = bench(&mut group, "raw_download_alone", || {
        // SAFETY: see above.
        unsafe { dtoh(host_dst, dev_src, bytes, s2) };
        record(e2, s2);
        sync_event(e2);
    });
    group.throughput(both);
    let raw_two = bench(&mut group, "raw_two_streams", || {
        // SAFETY: see above.
        unsafe { htod(dev_dst, host_src, bytes, s1) };
        record(e1, s1);
        // SAFETY: see above.
        unsafe { dtoh(host_dst, dev_src, bytes, s2) };
        record(e2, s2);
        sync_event(e1);
        sync_event(e2);
    });
    let raw_one = bench(&mut group, "raw_one_stream", || {
        // SAFETY: see above.
        unsafe { htod(dev_dst, host_src, bytes, s1) };
        // SAFETY: see above.
        unsafe { dtoh(host_dst, dev_src, bytes, s1) };
        record(e1, s1);
        sync_event(e1);
    });
    group.finish();
    drop(raw);

    println!(
        "full_duplex: duplex_256MiB overlap (0 = serial, 1 = full duplex): cuferry {:.2} \
         ({crate_both:?} for both, {crate_up:?} up, {crate_down:?} down); raw two streams {:.2} \
         ({raw_two:?}); raw one stream {:.2} ({raw_one:?}); raw up {raw_up:?}, down {raw_down:?}",
        overlap(crate_both, crate_up, crate_down),
        overlap(raw_two, raw_up, raw_down),
        overlap(raw_one, raw_up, raw_down),
    );
}

/// The crate's streaming loop: its reusable parts between runs.
struct CrateLoop {
    /// Returned uploads, each a pinned source and its device destination, ready to resubmit.
    idle_uploads: Vec<Pending<Upload<f32>, Returned>>,
    /// Pinned result buffers not in use.
    idle_results: Vec<PinnedHostBuffer<f32>>,
}

impl CrateLoop {
    /// Allocates every slot and runs one upload through each.
    fn new(engine: &mut CudaEngine) -> Self {
        let idle_uploads = (0..UPLOAD_SLOTS)
            .map(|_| {
                let source = ramp(engine, BATCH_LEN);
                let destination = engine.alloc_tensor::<f32>(&[BATCH_LEN]).unwrap();
                let upload = upload_pending(engine, source, destination).unwrap();
                upload.wait().unwrap()
            })
            .collect();
        let idle_results = (0..RESULT_SLOTS)
            .map(|_| PinnedHostBuffer::<f32>::new(engine, BATCH_LEN).unwrap())
            .collect();
        CrateLoop {
            idle_uploads,
            idle_results,
        }
    }

    /// Submits the next batch's upload from a free slot; when none is free, waits for the
    /// oldest upload whose batch's kernel is already queued (`spent`), and reuses its slot.
    /// (A real loop would refill the source here; the bench leaves it as it is, so the host's
    /// own copy does not hide the device's.)
    fn upload(
        &mut self,
        engine: &mut CudaEngine,
        spent: &mut VecDeque<Pending<Upload<f32>>>,
    ) -> Pending<Upload<f32>> {
        let slot = match self.idle_uploads.pop() {
            Some(slot) => slot,
            None => spent.pop_front().expect("a slot in use").wait().unwrap(),
        };
        slot.resubmit(engine).unwrap()
    }

    /// Submits the download of `result` into a free result buffer; when none is free, waits
    /// for the oldest download in flight and reuses its buffer (dropping its tensor).
    fn download(
        &mut self,
        engine: &mut CudaEngine,
        result: DeviceTensor<f32>,
        downloads: &mut VecDeque<Pending<Download<f32>>>,
    ) {
        let buffer = match self.idle_results.pop() {
            Some(buffer) => buffer,
            None => {
                let oldest = downloads.pop_front().expect("a download in flight");
                oldest.wait().unwrap().into_parts().1
            }
        };
        downloads.push_back(download_pending(engine, result, buffer).unwrap());
    }

    /// One run: [`BATCHES`] batches up, scaled, and down, then every transfer waited.
    fn run(&mut self, engine: &mut CudaEngine) {
        // Uploads whose batch's kernel is queued, oldest first; downloads in flight, oldest first.
        let mut spent = VecDeque::new();
        let mut downloads = VecDeque::new();
        let mut current = Some(self.upload(engine, &mut spent));
        let mut computed: Option<DeviceTensor<f32>> = None;
        for k in 0..BATCHES {
            let next = (k + 1 < BATCHES).then(|| self.upload(engine, &mut spent));
            let batch = current.take().expect("batch k is uploaded");
            // Read from the upload's destination while the upload may still be in flight.
            let result = engine.scale(batch.tensor(), FACTOR).unwrap();
            spent.push_back(batch);
            if let Some(previous) = computed.replace(result) {
                self.download(engine, previous, &mut downloads);
            }
            current = next;
        }
        let last = computed.take().expect("the last batch is computed");
        self.download(engine, last, &mut downloads);
        for upload in spent {
            self.idle_uploads.push(upload.wait().unwrap());
        }
        for download in downloads {
            self.idle_results
                .push(download.wait().unwrap().into_parts().1);
        }
    }
}

/// The raw streaming loop: the same slots, steps and waits as [`CrateLoop`], on one stream or on
/// three (upload, compute, download) ordered by events.
struct RawLoop {
    /// The upload, compute and download streams: one stream three times, or three streams.
    upload: sys::CUstream,
    compute: sys::CUstream,
    download: sys::CUstream,
    /// Whether all three are one stream, which orders everything with no event waits.
    one_stream: bool,
    scale: sys::CUfunction,
    sources: [*mut u8; UPLOAD_SLOTS],
    inputs: [sys::CUdeviceptr; UPLOAD_SLOTS],
    outputs: [sys::CUdeviceptr; RESULT_SLOTS],
    results: [*mut u8; RESULT_SLOTS],
    /// Recorded after each upload slot's copy, and after the kernel that read it.
    uploaded: [sys::CUevent; UPLOAD_SLOTS],
    computed: [sys::CUevent; UPLOAD_SLOTS],
    /// Recorded after each result slot's copy.
    downloaded: [sys::CUevent; RESULT_SLOTS],
}

impl RawLoop {
    /// Allocates the slots through `raw`; `three_streams` picks the stream layout.
    fn new(raw: &Raw, scale: sys::CUfunction, three_streams: bool) -> Self {
        let upload = raw.stream();
        let (compute, download) = if three_streams {
            (raw.stream(), raw.stream())
        } else {
            (upload, upload)
        };
        RawLoop {
            upload,
            compute,
            download,
            one_stream: !three_streams,
            scale,
            sources: std::array::from_fn(|_| raw.pinned(BATCH_BYTES)),
            inputs: std::array::from_fn(|_| raw.device(BATCH_BYTES)),
            outputs: std::array::from_fn(|_| raw.device(BATCH_BYTES)),
            results: std::array::from_fn(|_| raw.pinned(BATCH_BYTES)),
            uploaded: std::array::from_fn(|_| raw.event()),
            computed: std::array::from_fn(|_| raw.event()),
            downloaded: std::array::from_fn(|_| raw.event()),
        }
    }

    /// Orders `stream`'s later work after `event`; nothing to do on one stream.
    fn after(&self, stream: sys::CUstream, event: sys::CUevent) {
        if !self.one_stream {
            stream_wait(stream, event);
        }
    }

    /// Uploads batch `k` into its slot.
    fn upload(&self, k: usize) {
        let s = k % UPLOAD_SLOTS;
        // The host reuses the pinned source once its last upload has completed (as the crate's
        // loop waits for it); the device reuses the input once the kernel that read it has run.
        sync_event(self.uploaded[s]);
        self.after(self.upload, self.computed[s]);
        // SAFETY: both slots hold `BATCH_BYTES`; the source's last copy has completed and the
        // input's last reader is ordered before this copy; both live until `raw` drops.
        unsafe { htod(self.inputs[s], self.sources[s], BATCH_BYTES, self.upload) };
        record(self.uploaded[s], self.upload);
    }

    /// Scales batch `k` from its input slot into its result slot's device output.
    fn compute(&self, k: usize) {
        let (s, o) = (k % UPLOAD_SLOTS, k % RESULT_SLOTS);
        self.after(self.compute, self.uploaded[s]);
        self.after(self.compute, self.downloaded[o]);
        let (mut a, mut out, mut factor, mut n) =
            (self.inputs[s], self.outputs[o], FACTOR, BATCH_LEN as u64);
        let mut params: [*mut c_void; 4] = [
            (&mut a as *mut sys::CUdeviceptr).cast(),
            (&mut out as *mut sys::CUdeviceptr).cast(),
            (&mut factor as *mut f32).cast(),
            (&mut n as *mut u64).cast(),
        ];
        let grid = (BATCH_LEN as u64)
            .div_ceil(u64::from(BLOCK))
            .min(u64::from(MAX_BLOCKS)) as u32;
        // SAFETY: `scale` is loaded until `raw` drops; its parameters are two pointers, a float
        // and an unsigned long long, named by locals that live through the call (which copies
        // them); both slots hold `BATCH_LEN` floats, the input's copy and the output's last
        // reader ordered before the launch.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.scale,
                grid,
                1,
                1,
                BLOCK,
                1,
                1,
                0,
                self.compute,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        });
        record(self.computed[s], self.compute);
    }

    /// Downloads batch `k`'s result into its result slot.
    fn download(&self, k: usize) {
        let o = k % RESULT_SLOTS;
        // The host reuses the pinned result once its last download has completed.
        sync_event(self.downloaded[o]);
        self.after(self.download, self.computed[k % UPLOAD_SLOTS]);
        // SAFETY: both slots hold `BATCH_BYTES`; the result's last copy has completed and the
        // output's kernel is ordered before this copy; both live until `raw` drops.
        unsafe { dtoh(self.results[o], self.outputs[o], BATCH_BYTES, self.download) };
        record(self.downloaded[o], self.download);
    }

    /// One run, step for step as [`CrateLoop::run`].
    fn run(&self) {
        self.upload(0);
        for k in 0..BATCHES {
            if k + 1 < BATCHES {
                self.upload(k + 1);
            }
            self.compute(k);
            if k > 0 {
                self.download(k - 1);
            }
        }
        self.download(BATCHES - 1);
        for stream in [self.upload, self.compute, self.download] {
            sync_stream(stream);
        }
    }
}

/// `streaming_loop_64MiB`: the crate's loop beside the raw loop on one stream and on three.
fn streaming_loop(c: &mut Criterion, engine: &mut CudaEngine) {
    let raw = Raw::new(engine);
    let Some(scale) = raw.scale_kernel() else {
        eprintln!("full_duplex: streaming_loop_64MiB not measured");
        return;
    };
    let mut group = c.benchmark_group("streaming_loop_64MiB");
    group.throughput(Throughput::Bytes(2 * (BATCHES * BATCH_BYTES) as u64));

    let mut slots = CrateLoop::new(engine);
    slots.run(engine); // compiles the crate's kernel and warms the pools
    let crate_loop = bench(&mut group, "cuferry", || slots.run(engine));
    drop(slots);
    engine.synchronize().unwrap();

    let one = RawLoop::new(&raw, scale, false);
    let raw_one = bench(&mut group, "raw_one_stream", || one.run());
    let three = RawLoop::new(&raw, scale, true);
    let raw_three = bench(&mut group, "raw_three_streams", || three.run());
    group.finish();
    drop(raw);

    let per_batch = |t: Duration| t / BATCHES as u32;
    println!(
        "full_duplex: streaming_loop_64MiB per batch: cuferry {:?}, raw one stream {:?}, raw \
         three streams {:?}; cuferry takes {:.2}x the three-stream loop's time and {:.2}x the \
         one-stream loop's",
        per_batch(crate_loop),
        per_batch(raw_one),
        per_batch(raw_three),
        crate_loop.as_secs_f64() / raw_three.as_secs_f64(),
        crate_loop.as_secs_f64() / raw_one.as_secs_f64(),
    );
}

/// `ordering_cost`: the host time of 16-byte submissions and of kernel launches, with and
/// without a dependency on work of another stream. Only the call named by each case is timed.
fn ordering_cost(c: &mut Criterion, engine: &mut CudaEngine) {
    let mut group = c.benchmark_group("ordering_cost");

    // A 16-byte upload, resubmitted around every launch below; a resident tensor last written by
    // a kernel (so nothing orders a launch that reads it after another stream); a landing
    // buffer for the downloads.
    let source = PinnedHostBuffer::<f32>::from_slice(engine, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let destination = engine.alloc_tensor::<f32>(&[4]).unwrap();
    let mut upload = Some(
        upload_pending(engine, source, destination)
            .unwrap()
            .wait()
            .unwrap(),
    );
    let resident = engine.full::<f32>(&[4], 0.5).unwrap();
    drop(engine.scale(&resident, 2.0).unwrap()); // compiles the kernel
    engine.synchronize().unwrap();

    // As `transfer_paths`' `submit_16B`: the submission timed, its wait not.
    let submit = Samples::default();
    group.bench_function("upload_submit_16B", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let r = upload.take().unwrap();
                let start = Instant::now();
                let in_flight = r.resubmit(engine).unwrap();
                total += start.elapsed();
                upload = Some(in_flight.wait().unwrap());
            }
            submit.push(total, iters)
        })
    });

    // The two launch cases do the same work around the timed launch: resubmit the upload, launch,
    // drop the output, wait for the upload. Only the launch's input differs.
    let mut launch = |in_flight_destination: bool| {
        let samples = Samples::default();
        let name = if in_flight_destination {
            "launch_in_flight_destination"
        } else {
            "launch_resident"
        };
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let in_flight = upload.take().unwrap().resubmit(engine).unwrap();
                    let input = if in_flight_destination {
                        in_flight.tensor()
                    } else {
                        &resident
                    };
                    let start = Instant::now();
                    let out = engine.scale(input, 2.0).unwrap();
                    total += start.elapsed();
                    drop(out);
                    upload = Some(in_flight.wait().unwrap());
                }
                samples.push(total, iters)
            })
        });
        samples.median()
    };
    let launch_resident = launch(false);
    let launch_in_flight = launch(true);

    // Downloads: of a tensor a kernel has just written (the submission orders the copy after
    // the kernel), and of the resident tensor (written long ago: nothing to order).
    let mut landing = Some(PinnedHostBuffer::<f32>::new(engine, 4).unwrap());
    let after_kernel = Samples::default();
    group.bench_function("download_submit_16B_after_kernel", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let written = engine.scale(&resident, 2.0).unwrap();
                let buffer = landing.take().unwrap();
                let start = Instant::now();
                let in_flight = download_pending(engine, written, buffer).unwrap();
                total += start.elapsed();
                landing = Some(in_flight.wait().unwrap().into_parts().1);
            }
            after_kernel.push(total, iters)
        })
    });
    let mut resident = Some(resident);
    let idle_source = Samples::default();
    group.bench_function("download_submit_16B_resident", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (tensor, buffer) = (resident.take().unwrap(), landing.take().unwrap());
                let start = Instant::now();
                let in_flight = download_pending(engine, tensor, buffer).unwrap();
                total += start.elapsed();
                let (tensor, buffer) = in_flight.wait().unwrap().into_parts();
                (resident, landing) = (Some(tensor), Some(buffer));
            }
            idle_source.push(total, iters)
        })
    });
    // The raw price of one dependency between two streams: an event record on one and a wait
    // for it on the other, the two driver calls the engine makes for it.
    let raw = Raw::new(engine);
    let (from, to, event) = (raw.stream(), raw.stream(), raw.event());
    let raw_dependency = Samples::default();
    group.bench_function("raw_record_and_stream_wait", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                record(event, from);
                stream_wait(to, event);
            }
            raw_dependency.push(start.elapsed(), iters)
        })
    });
    group.finish();
    sync_stream(to);
    drop(raw);

    let (after_kernel, idle_source) = (after_kernel.median(), idle_source.median());
    println!(
        "full_duplex: ordering_cost: upload submit {:?}; launch {launch_resident:?} on a \
         resident tensor, {launch_in_flight:?} on an in-flight destination (one dependency: \
         {:+.2} us); download submit {after_kernel:?} after a kernel, {idle_source:?} of a \
         resident tensor (one dependency: {:+.2} us); raw event record + stream wait {:?}",
        submit.median(),
        (launch_in_flight.as_secs_f64() - launch_resident.as_secs_f64()) * 1e6,
        (after_kernel.as_secs_f64() - idle_source.as_secs_f64()) * 1e6,
        raw_dependency.median(),
    );
}

fn benches(c: &mut Criterion) {
    let mut engine = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("full_duplex: no CUDA device ({e}); nothing measured");
            return;
        }
    };
    duplex(c, &mut engine);
    streaming_loop(c, &mut engine);
    ordering_cost(c, &mut engine);
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = duplex_group;
    config = config();
    targets = benches
}
criterion_main!(duplex_group);
