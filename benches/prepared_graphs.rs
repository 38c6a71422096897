//! Prepared graphs beside the raw driver doing the same work, in the same run.
//!
//! Run on a GPU machine: `cargo bench --bench prepared_graphs`. The program is ten dependent
//! `f32` elementwise operations on one input (`y = x * x`, then `+ x`, `* 0.5`, `* x`, `+ x`,
//! `* 0.5`, `* x`, `+ x`, `* 0.5`, `* x`), which the compiler fuses into one kernel. The raw
//! baselines run on the engine's stream, inside a raw scope (`CudaEngine::with_raw`), with
//! kernels compiled here by NVRTC that round every operation (`__fmul_rn`, `__fadd_rn`), as the
//! crate's fused kernels do:
//!
//! - (a) `raw_eager_chain`: ten dependent launches of one-operation kernels;
//! - (b) `raw_graph_chain`: the same ten launches captured once into a CUDA graph, replayed;
//! - (c) `raw_fused`: one hand-written kernel doing all ten operations (one element per thread,
//!   blocks of 256), launched plainly;
//! - (d) `raw_graph_fused`: that kernel as a one-node graph, replayed.
//!
//! Groups:
//! - `host_per_run` (4 elements): the host time of one `engine.run` with a new output each run
//!   (dropped at once), against the host time of (a) to (d). Nothing waits in the timed loops:
//!   the stream is synchronized every [`BATCH`] iterations, outside the measured time, so the
//!   queue never fills (a full queue would make the host wait for the device);
//! - `run_and_sync_4`: `engine.run` + `engine.synchronize()` per iteration, against (b) and (d)
//!   each followed by `cuStreamSynchronize`;
//! - `bandwidth_16Mi`: 16 Mi elements, run + synchronize, against (a) and (c) + synchronize and a
//!   64 MiB `cuMemcpyDtoDAsync` + synchronize (the copy ceiling). Every case counts the same
//!   useful traffic, 128 MiB (one input read, one output written), though the eager chain moves
//!   far more;
//! - `prepare_cached`: `engine.prepare` of the program whose kernel is already in the engine's
//!   cache, timed alone and together with dropping the prepared program, against a raw stream
//!   capture of the fused kernel plus `cuGraphInstantiateWithFlags` (alone, and with the
//!   destruction of both graphs).
//!
//! Before measuring, each size's outputs (cuferry, (a), (c)) are checked bit for bit against
//! the host; a mismatch is printed (the measurements still run).
//!
//! Without a GPU (or without NVRTC) the bench prints a note and measures nothing.

// criterion's macros generate undocumented public items.
#![allow(missing_docs)]

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::sys;
use cuferry::graph::{GraphCompiler, Input, Prepared, Program, TracedTensor};
use cuferry::{CudaEngine, DType, DeviceTensor, download_tensor, upload_tensor};
use std::ffi::{CString, c_void};
use std::time::{Duration, Instant};

/// Host-time loops synchronize the stream after this many iterations, outside the measured
/// time: at most 1000 kernels (ten per eager-chain iteration) are ever queued.
const BATCH: u64 = 100;

/// Threads per block of every raw kernel.
const BLOCK: u32 = 256;

/// The small size: host cost dominates.
const SMALL: usize = 4;

/// The large size: 16 Mi `f32`s, 64 MiB per array.
const LARGE: usize = 16 << 20;

/// One operation of the ten-operation program; `y` is the running value, `x` the input.
#[derive(Clone, Copy)]
enum Op {
    /// `y * x`
    MulX,
    /// `y + x`
    AddX,
    /// `y * 0.5`
    Half,
}

/// The program, starting from `y = x`: exactly ten dependent operations.
const OPS: [Op; 10] = [
    Op::MulX,
    Op::AddX,
    Op::Half,
    Op::MulX,
    Op::AddX,
    Op::Half,
    Op::MulX,
    Op::AddX,
    Op::Half,
    Op::MulX,
];

/// The program traced and compiled for `n` elements.
fn program(n: usize) -> Program {
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let mut y = x.clone();
    for op in OPS {
        y = match op {
            Op::MulX => (&y * &x).unwrap(),
            Op::AddX => (&y + &x).unwrap(),
            Op::Half => y.scale(0.5f32).unwrap(),
        };
    }
    GraphCompiler::new()
        .compile_with_input_specs(&[&y], &[(&x, DType::F32, &[n])])
        .unwrap()
}

/// The program on the host: Rust rounds every `f32` operation and contracts nothing, as the
/// kernels do.
fn host_reference(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| {
            let mut y = v;
            for op in OPS {
                y = match op {
                    Op::MulX => y * v,
                    Op::AddX => y + v,
                    Op::Half => y * 0.5,
                };
            }
            y
        })
        .collect()
}

/// The input: small values, so ten operations stay finite.
fn input_values(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i % 17) as f32 * 0.0625).collect()
}

/// The raw kernels' source. Every kernel has the same parameters, `(a, b, out, s, n)`, so one
/// launch helper serves them all; unused ones are ignored.
fn kernel_source() -> String {
    let mut fused = String::new();
    for op in OPS {
        fused.push_str(match op {
            Op::MulX => "    y = __fmul_rn(y, v);\n",
            Op::AddX => "    y = __fadd_rn(y, v);\n",
            Op::Half => "    y = __fmul_rn(y, 0.5f);\n",
        });
    }
    format!(
        r#"
#define INDEX unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;
extern "C" __global__ void op_mul(const float* a, const float* b, float* out, float s, unsigned long long n) {{
    INDEX
    out[i] = __fmul_rn(a[i], b[i]);
}}
extern "C" __global__ void op_add(const float* a, const float* b, float* out, float s, unsigned long long n) {{
    INDEX
    out[i] = __fadd_rn(a[i], b[i]);
}}
extern "C" __global__ void op_scale(const float* a, const float* b, float* out, float s, unsigned long long n) {{
    INDEX
    out[i] = __fmul_rn(a[i], s);
}}
extern "C" __global__ void fused10(const float* a, const float* b, float* out, float s, unsigned long long n) {{
    INDEX
    float v = a[i];
    float y = v;
{fused}    out[i] = y;
}}
"#
    )
}

fn check(call: &str, code: sys::CUresult) {
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "{call} failed");
}

/// The raw kernels, loaded into the engine's context.
struct Kernels {
    module: sys::CUmodule,
    mul: sys::CUfunction,
    add: sys::CUfunction,
    scale: sys::CUfunction,
    fused: sys::CUfunction,
}

impl Kernels {
    /// Compiles and loads the kernels. Call inside a raw scope.
    fn load() -> Self {
        let source = kernel_source();
        let mut device = 0;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: called inside a raw scope, so the engine's context is current; out pointers
        // are valid.
        unsafe {
            check("cuCtxGetDevice", sys::cuCtxGetDevice(&mut device));
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(
                    &mut major,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    device,
                ),
            );
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(
                    &mut minor,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    device,
                ),
            );
        }
        // The device's own virtual architecture, as the crate targets; NVRTC's default when
        // this NVRTC does not know it.
        let options = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(&source, options)
            .or_else(|_| cudarc::nvrtc::compile_ptx(&source))
            .expect("the raw kernels compile");
        let image = CString::new(ptx.to_src()).expect("PTX has no NUL byte");
        let mut module = std::ptr::null_mut();
        // SAFETY: the engine's context is current; `image` is a NUL-terminated PTX image that
        // lives through the call (the driver copies it).
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>())
        });
        let function = |name: &str| {
            let name = CString::new(name).unwrap();
            let mut f = std::ptr::null_mut();
            // SAFETY: `module` was just loaded and is live; `name` is NUL-terminated.
            check("cuModuleGetFunction", unsafe {
                sys::cuModuleGetFunction(&mut f, module, name.as_ptr())
            });
            f
        };
        Kernels {
            module,
            mul: function("op_mul"),
            add: function("op_add"),
            scale: function("op_scale"),
            fused: function("fused10"),
        }
    }
}

/// Queues one raw kernel on `stream`: `grid` blocks of [`BLOCK`] threads over `n` elements.
///
/// # Safety
/// The engine's context is current; `f` is one of [`Kernels`]' functions, still loaded; `a`,
/// `out` (and `b`, for `op_mul` and `op_add`) hold `n` `f32`s and stay allocated until the
/// launch completes; `stream` is the engine's stream.
#[allow(clippy::too_many_arguments)]
unsafe fn launch(
    f: sys::CUfunction,
    stream: sys::CUstream,
    grid: u32,
    a: sys::CUdeviceptr,
    b: sys::CUdeviceptr,
    out: sys::CUdeviceptr,
    s: f32,
    n: u64,
) -> sys::CUresult {
    let (mut a, mut b, mut out, mut s, mut n) = (a, b, out, s, n);
    let mut params: [*mut c_void; 5] = [
        (&mut a as *mut sys::CUdeviceptr).cast(),
        (&mut b as *mut sys::CUdeviceptr).cast(),
        (&mut out as *mut sys::CUdeviceptr).cast(),
        (&mut s as *mut f32).cast(),
        (&mut n as *mut u64).cast(),
    ];
    // SAFETY: the caller's contract; each parameter pointer names a local of the kernel's
    // parameter type (two or three pointers, a `float`, an `unsigned long long`) that lives
    // through the call, which copies the values.
    unsafe {
        sys::cuLaunchKernel(
            f,
            grid,
            1,
            1,
            BLOCK,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}

/// A captured graph and its instantiation.
struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

impl Graph {
    /// Captures what `queue` queues on `stream` and instantiates it. Call inside a raw scope.
    fn capture(stream: sys::CUstream, queue: impl FnOnce()) -> Self {
        // SAFETY: the engine's context is current and `stream` is its stream, which is not
        // being captured; thread-local mode affects only this thread.
        check("cuStreamBeginCapture_v2", unsafe {
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        });
        queue();
        let mut graph = std::ptr::null_mut();
        // SAFETY: the capture begun above is ended here, once.
        check("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(stream, &mut graph)
        });
        let mut exec = std::ptr::null_mut();
        // SAFETY: `graph` was just captured and is live; out pointer valid.
        check("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        });
        Graph { graph, exec }
    }

    /// Queues one replay on `stream`.
    fn launch(&self, stream: sys::CUstream) {
        // SAFETY: `exec` is live; every buffer its kernels use stays allocated until the
        // stream is synchronized before they are freed (`RawSet::free`).
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, stream)
        });
    }

    /// Destroys both graphs. Call inside a raw scope, with no replay pending.
    fn destroy(self) {
        // SAFETY: both are live and destroyed once, the executable graph first; no replay is
        // pending (the caller synchronized the stream).
        unsafe {
            check("cuGraphExecDestroy", sys::cuGraphExecDestroy(self.exec));
            check("cuGraphDestroy", sys::cuGraphDestroy(self.graph));
        }
    }
}

/// Raw buffers and graphs for one size, on the engine's context and stream.
struct RawSet<'k> {
    kernels: &'k Kernels,
    stream: sys::CUstream,
    n: usize,
    grid: u32,
    x: sys::CUdeviceptr,
    tmp: [sys::CUdeviceptr; 2],
    out: sys::CUdeviceptr,
    chain: Option<Graph>,
    fused: Option<Graph>,
}

impl<'k> RawSet<'k> {
    /// Allocates the buffers, uploads `x` and captures (b) and (d). Call inside a raw scope.
    fn new(kernels: &'k Kernels, stream: sys::CUstream, x: &[f32]) -> Self {
        let n = x.len();
        let bytes = n * 4;
        let alloc = || {
            let mut ptr = 0;
            // SAFETY: the engine's context is current; out pointer valid.
            check("cuMemAlloc_v2", unsafe {
                sys::cuMemAlloc_v2(&mut ptr, bytes)
            });
            ptr
        };
        let mut set = RawSet {
            kernels,
            stream,
            n,
            grid: u32::try_from(n.div_ceil(BLOCK as usize)).unwrap(),
            x: alloc(),
            tmp: [alloc(), alloc()],
            out: alloc(),
            chain: None,
            fused: None,
        };
        // SAFETY: `set.x` holds `bytes` bytes, as does `x`; the copy is synchronous.
        check("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(set.x, x.as_ptr().cast(), bytes)
        });
        set.chain = Some(Graph::capture(stream, || set.eager_chain()));
        set.fused = Some(Graph::capture(stream, || set.fused_launch()));
        set
    }

    /// (a): ten dependent launches of one-operation kernels, the last writing `out`.
    fn eager_chain(&self) {
        let n = self.n as u64;
        let mut current = self.x;
        for (k, op) in OPS.iter().enumerate() {
            let dst = if k + 1 == OPS.len() {
                self.out
            } else {
                self.tmp[k % 2]
            };
            let (f, s) = match op {
                Op::MulX => (self.kernels.mul, 0.0),
                Op::AddX => (self.kernels.add, 0.0),
                Op::Half => (self.kernels.scale, 0.5),
            };
            // SAFETY: the context is current (every caller runs inside a raw scope); the
            // buffers hold `n` floats and are freed only after a synchronize; `current` and
            // `dst` differ (they alternate between `x`, `tmp[0]`, `tmp[1]` and `out`).
            check("cuLaunchKernel", unsafe {
                launch(f, self.stream, self.grid, current, self.x, dst, s, n)
            });
            current = dst;
        }
    }

    /// (c): the hand-written fused kernel, `x` to `out`.
    fn fused_launch(&self) {
        // SAFETY: as in `eager_chain`.
        check("cuLaunchKernel", unsafe {
            launch(
                self.kernels.fused,
                self.stream,
                self.grid,
                self.x,
                0,
                self.out,
                0.0,
                self.n as u64,
            )
        });
    }

    fn graph_chain(&self) {
        self.chain.as_ref().unwrap().launch(self.stream);
    }

    fn graph_fused(&self) {
        self.fused.as_ref().unwrap().launch(self.stream);
    }

    fn sync(&self) {
        // SAFETY: the engine's stream is live.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.stream)
        });
    }

    /// `out`, downloaded after a synchronize.
    fn read_out(&self) -> Vec<f32> {
        self.sync();
        let mut host = vec![0f32; self.n];
        // SAFETY: `out` and `host` hold `n` floats; the copy is synchronous.
        check("cuMemcpyDtoH_v2", unsafe {
            sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), self.out, self.n * 4)
        });
        host
    }

    /// Waits for the stream, then destroys the graphs and frees the buffers. Call inside a raw
    /// scope.
    fn free(mut self) {
        self.sync();
        for graph in [self.chain.take(), self.fused.take()].into_iter().flatten() {
            graph.destroy();
        }
        for ptr in [self.x, self.tmp[0], self.tmp[1], self.out] {
            // SAFETY: allocated in `new`, freed once; idle after the synchronize above.
            check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) });
        }
    }
}

/// Runs `f` inside a raw scope of the engine: its context current, as every raw call needs.
fn in_scope<R>(engine: &mut CudaEngine, f: impl FnOnce(sys::CUstream) -> R) -> R {
    engine
        .with_raw(|scope| Ok::<_, cuferry::Error>(f(scope.stream().as_raw())))
        .expect("the engine's context can be made current")
}

/// The host time of `iters` calls of `work`, synchronizing (untimed) every [`BATCH`] calls and
/// at the end.
fn host_time<S>(
    iters: u64,
    state: &mut S,
    mut work: impl FnMut(&mut S),
    mut sync: impl FnMut(&mut S),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        let batch = (iters - done).min(BATCH);
        let start = Instant::now();
        for _ in 0..batch {
            work(state);
        }
        total += start.elapsed();
        sync(state);
        done += batch;
    }
    total
}

/// One run with a new output, dropped at once.
fn run_once(engine: &mut CudaEngine, prepared: &mut Prepared, input: &DeviceTensor<f32>) {
    drop(engine.run(prepared, &[Input::from(input)]).unwrap());
}

/// Checks cuferry's output and raw (a) and (c) against the host, bit for bit; prints the
/// outcome.
fn verify(
    engine: &mut CudaEngine,
    prepared: &mut Prepared,
    input: &DeviceTensor<f32>,
    raw: &RawSet<'_>,
    x: &[f32],
) {
    let want = host_reference(x);
    let outputs = engine.run(prepared, &[Input::from(input)]).unwrap();
    let got = download_tensor(
        engine,
        outputs[0].as_tensor::<f32>().expect("an f32 output"),
    )
    .unwrap();
    drop(outputs);
    engine.synchronize().unwrap();
    let (chain, fused) = in_scope(engine, |_| {
        raw.eager_chain();
        let chain = raw.read_out();
        raw.fused_launch();
        (chain, raw.read_out())
    });
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let want = bits(&want);
    let mut mismatches = Vec::new();
    for (name, values) in [
        ("cuferry", &got),
        ("raw_eager_chain", &chain),
        ("raw_fused", &fused),
    ] {
        if bits(values) != want {
            mismatches.push(name);
        }
    }
    if mismatches.is_empty() {
        eprintln!(
            "prepared_graphs: {} elements: cuferry, raw_eager_chain and raw_fused agree with the host bit for bit",
            x.len()
        );
    } else {
        eprintln!(
            "prepared_graphs: {} elements: MISMATCH against the host in {mismatches:?}",
            x.len()
        );
    }
}

/// The host time of `work` (raw), synchronizing the stream outside the timing.
fn raw_host_case(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    raw: &RawSet<'_>,
    work: &dyn Fn(),
) {
    group.bench_function(name, |b| {
        b.iter_custom(|iters| host_time(iters, &mut (), |_| work(), |_| raw.sync()))
    });
}

fn host_per_run(
    c: &mut Criterion,
    engine: &mut CudaEngine,
    prepared: &mut Prepared,
    input: &DeviceTensor<f32>,
    raw: &RawSet<'_>,
) {
    let mut group = c.benchmark_group("host_per_run");
    group.bench_function("cuferry_run", |b| {
        b.iter_custom(|iters| {
            let mut state = (&mut *engine, &mut *prepared);
            host_time(
                iters,
                &mut state,
                |(engine, prepared)| run_once(engine, prepared, input),
                |(engine, _)| engine.synchronize().unwrap(),
            )
        })
    });
    in_scope(engine, |_| {
        raw_host_case(&mut group, "raw_eager_chain", raw, &|| raw.eager_chain());
        raw_host_case(&mut group, "raw_graph_chain", raw, &|| raw.graph_chain());
        raw_host_case(&mut group, "raw_fused", raw, &|| raw.fused_launch());
        raw_host_case(&mut group, "raw_graph_fused", raw, &|| raw.graph_fused());
    });
    group.finish();
}

fn run_and_sync(
    c: &mut Criterion,
    engine: &mut CudaEngine,
    prepared: &mut Prepared,
    input: &DeviceTensor<f32>,
    raw: &RawSet<'_>,
) {
    let mut group = c.benchmark_group("run_and_sync_4");
    group.bench_function("cuferry_run_sync", |b| {
        b.iter(|| {
            run_once(engine, prepared, input);
            engine.synchronize().unwrap();
        })
    });
    in_scope(engine, |_| {
        group.bench_function("raw_graph_chain_sync", |b| {
            b.iter(|| {
                raw.graph_chain();
                raw.sync();
            })
        });
        group.bench_function("raw_graph_fused_sync", |b| {
            b.iter(|| {
                raw.graph_fused();
                raw.sync();
            })
        });
        // What a new output costs on the stream: the same replay between a stream-ordered
        // allocation and its free, from a pool that keeps freed memory (as the engine's does).
        let pool = keeping_pool();
        group.bench_function("raw_alloc_graph_fused_free_sync", |b| {
            b.iter(|| {
                let mut ptr = 0;
                // SAFETY: the engine's context is current; `ptr` is a valid out pointer; the
                // pool is live.
                check("cuMemAllocFromPoolAsync", unsafe {
                    sys::cuMemAllocFromPoolAsync(&mut ptr, raw.n * 4, pool, raw.stream)
                });
                raw.graph_fused();
                // SAFETY: allocated just above on this stream, freed once, stream-ordered.
                check("cuMemFreeAsync", unsafe {
                    sys::cuMemFreeAsync(ptr, raw.stream)
                });
                raw.sync();
            })
        });
        raw.sync();
        // SAFETY: every allocation from the pool was freed and the stream is idle.
        check("cuMemPoolDestroy", unsafe { sys::cuMemPoolDestroy(pool) });
    });
    group.finish();
}

/// A device memory pool on device 0 that keeps freed memory for reuse (release threshold at
/// its maximum), as the engine's own pool does.
fn keeping_pool() -> sys::CUmemoryPool {
    // SAFETY: an all-zero `CUmemPoolProps` is its documented default; the fields that matter
    // are set below.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    let mut pool = std::ptr::null_mut();
    // SAFETY: `props` is a complete pool description; the out pointer is valid.
    check("cuMemPoolCreate", unsafe {
        sys::cuMemPoolCreate(&mut pool, &props)
    });
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the attribute takes a `cuuint64_t`, which `threshold` is.
    check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    });
    pool
}

/// A timing event on the engine's context.
fn timing_event() -> sys::CUevent {
    let mut event = std::ptr::null_mut();
    // SAFETY: the engine's context is current (called inside a raw scope); flags 0 keep timing.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut event, 0)
    });
    event
}

/// The device time of `iters` runs of `work`, each between two events on `stream`.
fn device_time(
    iters: u64,
    stream: sys::CUstream,
    events: (sys::CUevent, sys::CUevent),
    mut work: impl FnMut(),
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        // SAFETY: both events are live on the engine's context, which is current (the caller
        // runs inside a raw scope or the work enters it); recording and waiting are ordered
        // on the engine's stream.
        unsafe {
            check("cuEventRecord", sys::cuEventRecord(events.0, stream));
            work();
            check("cuEventRecord", sys::cuEventRecord(events.1, stream));
            check("cuEventSynchronize", sys::cuEventSynchronize(events.1));
            let mut ms = 0f32;
            check(
                "cuEventElapsedTime",
                sys::cuEventElapsedTime_v2(&mut ms, events.0, events.1),
            );
            total += Duration::from_secs_f64(f64::from(ms) / 1e3);
        }
    }
    total
}

/// Bandwidth at 16 Mi elements in device time (between events, so launch and wait latency are
/// not counted): the fused program against the raw kernels and the device-to-device copy.
fn bandwidth_device(
    c: &mut Criterion,
    engine: &mut CudaEngine,
    prepared: &mut Prepared,
    input: &DeviceTensor<f32>,
    raw: &RawSet<'_>,
) {
    let mut group = c.benchmark_group("bandwidth_16Mi_device");
    group.throughput(Throughput::Bytes(2 * (raw.n as u64) * 4));
    let (stream, events) = in_scope(engine, |stream| (stream, (timing_event(), timing_event())));
    group.bench_function("cuferry_run", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                in_scope(engine, |_| {
                    // SAFETY: as in `device_time`.
                    unsafe { check("cuEventRecord", sys::cuEventRecord(events.0, stream)) };
                });
                let outputs = engine.run(prepared, &[Input::from(input)]).unwrap();
                total += in_scope(engine, |_| {
                    // SAFETY: as in `device_time`.
                    unsafe {
                        check("cuEventRecord", sys::cuEventRecord(events.1, stream));
                        check("cuEventSynchronize", sys::cuEventSynchronize(events.1));
                        let mut ms = 0f32;
                        check(
                            "cuEventElapsedTime",
                            sys::cuEventElapsedTime_v2(&mut ms, events.0, events.1),
                        );
                        Duration::from_secs_f64(f64::from(ms) / 1e3)
                    }
                });
                drop(outputs);
            }
            total
        })
    });
    in_scope(engine, |_| {
        group.bench_function("raw_fused", |b| {
            b.iter_custom(|iters| device_time(iters, stream, events, || raw.fused_launch()))
        });
        group.bench_function("raw_copy_64MiB", |b| {
            b.iter_custom(|iters| {
                device_time(iters, stream, events, || {
                    // SAFETY: `x` and `out` are distinct live allocations of `n` floats.
                    check("cuMemcpyDtoDAsync_v2", unsafe {
                        sys::cuMemcpyDtoDAsync_v2(raw.out, raw.x, raw.n * 4, raw.stream)
                    });
                })
            })
        });
        // SAFETY: the events are idle (each measurement waited for its last record).
        unsafe {
            check("cuEventDestroy", sys::cuEventDestroy_v2(events.0));
            check("cuEventDestroy", sys::cuEventDestroy_v2(events.1));
        }
    });
    group.finish();
}

fn bandwidth(
    c: &mut Criterion,
    engine: &mut CudaEngine,
    prepared: &mut Prepared,
    input: &DeviceTensor<f32>,
    raw: &RawSet<'_>,
) {
    let mut group = c.benchmark_group("bandwidth_16Mi");
    // One input read and one output written: 128 MiB for every case.
    group.throughput(Throughput::Bytes(2 * (raw.n as u64) * 4));
    group.bench_function("cuferry_run_sync", |b| {
        b.iter(|| {
            run_once(engine, prepared, input);
            engine.synchronize().unwrap();
        })
    });
    in_scope(engine, |_| {
        group.bench_function("raw_eager_chain_sync", |b| {
            b.iter(|| {
                raw.eager_chain();
                raw.sync();
            })
        });
        group.bench_function("raw_fused_sync", |b| {
            b.iter(|| {
                raw.fused_launch();
                raw.sync();
            })
        });
        group.bench_function("raw_copy_64MiB_sync", |b| {
            b.iter(|| {
                // SAFETY: `x` and `out` are distinct live allocations of `n` floats, idle
                // until the synchronize below.
                check("cuMemcpyDtoDAsync_v2", unsafe {
                    sys::cuMemcpyDtoDAsync_v2(raw.out, raw.x, raw.n * 4, raw.stream)
                });
                raw.sync();
            })
        });
    });
    group.finish();
}

fn prepare_cached(c: &mut Criterion, engine: &mut CudaEngine, program: &Program, raw: &RawSet<'_>) {
    let mut group = c.benchmark_group("prepare_cached");
    // The kernel is in the engine's cache from here on.
    drop(engine.prepare(program).unwrap());
    engine.synchronize().unwrap();
    for (name, with_drop) in [
        ("cuferry_prepare", false),
        ("cuferry_prepare_and_drop", true),
    ] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for i in 0..iters {
                    let start = Instant::now();
                    let prepared = engine.prepare(program).unwrap();
                    if with_drop {
                        drop(prepared);
                        total += start.elapsed();
                    } else {
                        total += start.elapsed();
                        drop(prepared);
                    }
                    if (i + 1) % BATCH == 0 {
                        engine.synchronize().unwrap();
                    }
                }
                engine.synchronize().unwrap();
                total
            })
        });
    }
    in_scope(engine, |stream| {
        for (name, with_destroy) in [
            ("raw_capture_instantiate", false),
            ("raw_capture_instantiate_destroy", true),
        ] {
            group.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let start = Instant::now();
                        let graph = Graph::capture(stream, || raw.fused_launch());
                        if with_destroy {
                            graph.destroy();
                            total += start.elapsed();
                        } else {
                            total += start.elapsed();
                            graph.destroy();
                        }
                    }
                    total
                })
            });
        }
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    let mut engine = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("prepared_graphs: no CUDA device ({e}); nothing measured");
            return;
        }
    };
    let small_program = program(SMALL);
    let large_program = program(LARGE);
    let mut small = match engine.prepare(&small_program) {
        Ok(prepared) => prepared,
        Err(e) => {
            eprintln!("prepared_graphs: the program cannot be prepared ({e}); nothing measured");
            return;
        }
    };
    let mut large = engine.prepare(&large_program).unwrap();
    let small_x = input_values(SMALL);
    let large_x = input_values(LARGE);
    let small_input = upload_tensor(&mut engine, &small_x, &[SMALL]).unwrap();
    let large_input = upload_tensor(&mut engine, &large_x, &[LARGE]).unwrap();

    let kernels = in_scope(&mut engine, |_| Kernels::load());
    let (small_raw, large_raw) = in_scope(&mut engine, |stream| {
        (
            RawSet::new(&kernels, stream, &small_x),
            RawSet::new(&kernels, stream, &large_x),
        )
    });

    verify(&mut engine, &mut small, &small_input, &small_raw, &small_x);
    verify(&mut engine, &mut large, &large_input, &large_raw, &large_x);

    host_per_run(c, &mut engine, &mut small, &small_input, &small_raw);
    run_and_sync(c, &mut engine, &mut small, &small_input, &small_raw);
    bandwidth(c, &mut engine, &mut large, &large_input, &large_raw);
    bandwidth_device(c, &mut engine, &mut large, &large_input, &large_raw);
    prepare_cached(c, &mut engine, &small_program, &small_raw);

    engine.synchronize().unwrap();
    drop((small, large, small_input, large_input));
    engine.synchronize().unwrap();
    in_scope(&mut engine, |_| {
        small_raw.free();
        large_raw.free();
        // SAFETY: every launch of the module's kernels completed (the stream was synchronized
        // by `free`) and every graph that named them is destroyed; unloaded once.
        check("cuModuleUnload", unsafe {
            sys::cuModuleUnload(kernels.module)
        });
    });
    engine.synchronize().unwrap();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = prepared;
    config = config();
    targets = benches
}
criterion_main!(prepared);
