//! The engine's rules on a real device.

use crate::common::{ForeignContext, current_context, distinct_f32, open};
use cuferry::error::{SetupError, UsageError};
use cuferry::{CudaEngine, Error, download_tensor, upload_tensor};

// Written once in `tests/bodies/engine.rs`, run here on device 0 and by the simulator binary.
crate::bodies::engine::tests!(gpu);

#[test]
#[ignore = "needs a CUDA device"]
fn a_missing_ordinal_is_a_typed_error() {
    let count = CudaEngine::device_count().unwrap();
    match CudaEngine::open(count + 7) {
        Err(Error::Setup(SetupError::NoSuchDevice { ordinal, count: c })) => {
            assert_eq!(ordinal, count + 7);
            assert_eq!(c, count);
        }
        other => panic!("expected NoSuchDevice, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn with_raw_restores_a_foreign_context_on_return_err_and_unwind() {
    let foreign = ForeignContext::new();
    let mut engine = open();
    assert_eq!(
        current_context(),
        foreign.0,
        "open restores the caller's context"
    );

    let inside = engine
        .with_raw(|raw| {
            assert_eq!(current_context(), raw.context().as_raw());
            Ok::<_, Error>(raw.context().as_raw())
        })
        .unwrap();
    assert_ne!(inside, foreign.0);
    assert_eq!(current_context(), foreign.0, "restored on return");

    let r: Result<(), Error> =
        engine.with_raw(|_| Err(Error::Usage(UsageError::ZeroLength { what: "test" })));
    assert!(r.is_err());
    assert_eq!(current_context(), foreign.0, "restored on Err");

    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ =
            engine.with_raw(|_| -> Result<(), Error> { panic!("unwinding out of a raw scope") });
    }));
    assert!(caught.is_err());
    assert_eq!(current_context(), foreign.0, "restored on unwind");

    // Ordinary operations leave the caller's context current too.
    let x = upload_tensor(&mut engine, &distinct_f32(10), &[10]).unwrap();
    assert_eq!(download_tensor(&mut engine, &x).unwrap(), distinct_f32(10));
    assert_eq!(current_context(), foreign.0);
    drop(x);
    drop(engine);
    assert_eq!(current_context(), foreign.0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn with_raw_exposes_the_engine_stream_and_pointers() {
    let mut engine = open();
    let x = upload_tensor(&mut engine, &distinct_f32(64), &[64]).unwrap();
    let (stream, ptr, bytes) = engine
        .with_raw(|raw| {
            let p = raw.device_ptr(&x)?;
            Ok::<_, Error>((raw.stream().as_raw() as usize, p.as_raw(), p.bytes()))
        })
        .unwrap();
    assert_ne!(
        stream, 0,
        "the engine's own stream, not the legacy default stream"
    );
    assert_ne!(ptr, 0);
    assert_eq!(bytes, 256);
}

/// The device's memory as the driver reports it: a freed tensor's memory stays in the engine's
/// pool until the pool is trimmed, and an allocation past the device's memory is an error that
/// says where the memory is, after which the engine works on.
#[test]
#[ignore = "needs a CUDA device"]
fn device_memory_is_reported_kept_trimmed_and_explained_when_it_runs_out() {
    const GIB: u64 = 1 << 30;
    let mut engine = crate::engine();
    let before = engine.device_memory().unwrap();
    assert!(
        before.total > 0 && before.free <= before.total,
        "{before:?}"
    );
    let t = engine.alloc_tensor::<u8>(&[(4 * GIB) as usize]).unwrap();
    engine.synchronize().unwrap();
    let holding = engine.device_memory().unwrap();
    assert!(holding.pool_in_use >= 4 * GIB, "{holding:?}");
    drop(t);
    engine.synchronize().unwrap();
    let kept = engine.device_memory().unwrap();
    assert!(
        kept.pool_reserved >= 4 * GIB,
        "the pool keeps what was freed: {kept:?}"
    );
    assert!(kept.pool_in_use < GIB, "{kept:?}");
    engine.trim_device_pool(0).unwrap();
    let trimmed = engine.device_memory().unwrap();
    assert!(trimmed.pool_reserved < GIB, "{trimmed:?}");
    assert!(
        trimmed.free >= kept.free + 3 * GIB,
        "{kept:?} then {trimmed:?}"
    );
    println!(
        "device memory: before {before:?}; holding 4 GiB {holding:?}; freed {kept:?}; trimmed {trimmed:?}"
    );
    let asked = (before.total + GIB) as usize;
    let err = engine.alloc_tensor::<u8>(&[asked]).unwrap_err();
    println!("{err}");
    let cuferry::Error::OutOfMemory(oom) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(oom.asked, asked);
    let memory = oom.memory.expect("CUDA reports the device's memory");
    assert_eq!(memory.total, before.total);
    assert!(
        err.to_string()
            .starts_with("out of device memory: asked for "),
        "{err}"
    );
    // The engine works on.
    let back = cuferry::upload_tensor(&mut engine, &[1u32, 2, 3], &[3]).unwrap();
    assert_eq!(
        cuferry::download_tensor(&mut engine, &back).unwrap(),
        [1, 2, 3]
    );
}

/// The host time of a 256 MiB allocation and its free, in a loop: the engine's
/// (`alloc_tensor`, then the drop) beside the raw pair (`cuMemAllocFromPoolAsync` /
/// `cuMemFreeAsync` on a stream of the engine's context, the release threshold at its maximum)
/// on two pools of the test's own: one of the engine's settings (its blocks exportable to other
/// processes as POSIX descriptors, as the engine's pool is where the device can) and a plain one;
/// and the engine's pool's reserved bytes around its loop.
#[test]
#[ignore = "needs a CUDA device"]
fn measure_device_allocation_against_the_raw_pool() {
    use cuferry::raw::cudarc::driver::sys;
    use std::time::Instant;
    const BYTES: usize = 256 << 20;
    const PAIRS: u32 = 2000;
    let check = |call: &str, code: sys::CUresult| {
        assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "{call}");
    };
    let mut engine = crate::engine();
    let ctx = engine
        .with_raw(|r| Ok::<_, cuferry::Error>(r.context().as_raw() as usize))
        .unwrap() as sys::CUcontext;
    // SAFETY: the engine's live context, made current on this thread for the raw calls below.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) });
    let mut stream = std::ptr::null_mut();
    // SAFETY: one out pointer; the stream is the test's, destroyed once below.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(
            &mut stream,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
        )
    });
    let make_pool = |exportable: bool| {
        let mut pool = std::ptr::null_mut();
        // SAFETY: an all-zero description is the documented default; the fields that matter
        // are set; every out pointer is valid; the pool is the test's, destroyed once below.
        unsafe {
            let mut props: sys::CUmemPoolProps = std::mem::zeroed();
            props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = 0;
            if exportable {
                props.handleTypes =
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            }
            check("cuMemPoolCreate", sys::cuMemPoolCreate(&mut pool, &props));
            let mut threshold = u64::MAX;
            check(
                "cuMemPoolSetAttribute",
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut threshold as *mut u64).cast(),
                ),
            );
        }
        pool
    };
    let (exportable, plain) = (make_pool(true), make_pool(false));
    let raw_pair = |pool: sys::CUmemoryPool| {
        let mut ptr = 0;
        // SAFETY: the test's live pool and stream, in the engine's context (current); the
        // allocation is freed at once, stream-ordered, and never touched.
        unsafe {
            check(
                "cuMemAllocFromPoolAsync",
                sys::cuMemAllocFromPoolAsync(&mut ptr, BYTES, pool, stream),
            );
            check("cuMemFreeAsync", sys::cuMemFreeAsync(ptr, stream));
        }
    };
    let engine_pair = |engine: &mut cuferry::CudaEngine| {
        drop(engine.alloc_tensor::<u8>(&[BYTES]).unwrap());
    };
    for _ in 0..100 {
        raw_pair(exportable);
        raw_pair(plain);
        engine_pair(&mut engine);
    }
    engine.synchronize().unwrap();
    let time = |pair: &mut dyn FnMut()| {
        let start = Instant::now();
        for _ in 0..PAIRS {
            pair();
        }
        start.elapsed() / PAIRS
    };
    // Rounds of each, interleaved, so all see the same machine; the medians compared.
    let (mut ours, mut same, mut plains) = (Vec::new(), Vec::new(), Vec::new());
    let before = engine.device_memory().unwrap();
    for _ in 0..7 {
        same.push(time(&mut || raw_pair(exportable)));
        plains.push(time(&mut || raw_pair(plain)));
        ours.push(time(&mut || engine_pair(&mut engine)));
    }
    let after = engine.device_memory().unwrap();
    // What entering the engine costs the pair: two context queries (one per call).
    let query = {
        let start = Instant::now();
        for _ in 0..PAIRS {
            let mut current = std::ptr::null_mut();
            // SAFETY: one out pointer, valid for a write.
            check("cuCtxGetCurrent", unsafe {
                sys::cuCtxGetCurrent(&mut current)
            });
        }
        start.elapsed() / PAIRS
    };
    // SAFETY: the test's own stream and pools, idle once the stream is synchronized, each
    // destroyed once.
    unsafe {
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
        check("cuStreamSynchronize", sys::cuStreamSynchronize(stream));
        check("cuStreamDestroy", sys::cuStreamDestroy_v2(stream));
        check("cuMemPoolDestroy", sys::cuMemPoolDestroy(exportable));
        check("cuMemPoolDestroy", sys::cuMemPoolDestroy(plain));
    }
    engine.synchronize().unwrap();
    for rounds in [&mut ours, &mut same, &mut plains] {
        rounds.sort();
    }
    let ratio = |a: std::time::Duration, b: std::time::Duration| a.as_secs_f64() / b.as_secs_f64();
    println!(
        "256 MiB allocation and free, host time per pair (median of 7 rounds of {PAIRS}): engine \
         {:?}; raw on a pool of the engine's settings (exportable) {:?}: {:.2}x; raw on a plain \
         pool {:?}: {:.2}x; rounds: engine {ours:?}, exportable {same:?}, plain {plains:?}; one \
         cuCtxGetCurrent: {query:?}",
        ours[3],
        same[3],
        ratio(ours[3], same[3]),
        plains[3],
        ratio(ours[3], plains[3]),
    );
    println!(
        "the engine's pool around {} pairs: reserved {} then {} bytes, in use {} then {}",
        7 * PAIRS,
        before.pool_reserved,
        after.pool_reserved,
        before.pool_in_use,
        after.pool_in_use
    );
    assert!(
        after.pool_reserved <= before.pool_reserved + BYTES as u64,
        "{before:?} {after:?}"
    );
}

/// The cost of `memory()`, and of a watch's read on another thread while this one runs a large
/// upload (the target: at most 5 µs, and no lock a transfer holds); the snapshot's
/// figures beside the pool's on a real device.
#[test]
#[ignore = "needs a CUDA device"]
fn measure_memory_snapshots_and_check_them_against_the_pool() {
    use std::time::{Duration, Instant};
    const READS: u32 = 20_000;
    let mut engine = crate::engine();
    let tensors: Vec<_> = (1..=8usize)
        .map(|i| engine.alloc_tensor::<f32>(&[i << 20]).unwrap())
        .collect();
    let pinned = cuferry::PinnedHostBuffer::<u8>::new(&mut engine, 64 << 20).unwrap();
    engine.synchronize().unwrap();
    let m = engine.memory();
    println!("{m}");
    let device = m.device.unwrap();
    assert_eq!(m.tensors.in_use, (36 * 4) << 20);
    assert_eq!(m.tensors.count, 8);
    assert_eq!(m.pinned.in_use, 64 << 20);
    assert!(device.pool_in_use >= m.tensors.in_use, "{device:?}");
    let per = |read: &dyn Fn()| {
        for _ in 0..1000 {
            read();
        }
        let start = Instant::now();
        for _ in 0..READS {
            read();
        }
        start.elapsed() / READS
    };
    let snapshot = per(&|| {
        std::hint::black_box(engine.memory());
    });
    let watch = engine.memory_watch();
    let held = per(&|| {
        std::hint::black_box(watch.held());
    });
    let device_memory = per(&|| {
        let _ = std::hint::black_box(engine.device_memory());
    });
    println!(
        "memory(): {snapshot:?} per call (the ledger alone, held(): {held:?}; device_memory(): \
         {device_memory:?})"
    );
    // A watch on another thread while this one uploads 1 GiB: its reads never wait for the
    // transfer.
    let data = vec![1u8; 1 << 30];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = std::thread::spawn({
        let (watch, stop) = (watch.clone(), std::sync::Arc::clone(&stop));
        move || {
            let (mut reads, mut worst, mut worst_held) = (0u64, Duration::ZERO, Duration::ZERO);
            let start = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                std::hint::black_box(watch.held());
                let held = t.elapsed();
                std::hint::black_box(watch.snapshot());
                worst = worst.max(t.elapsed() - held);
                worst_held = worst_held.max(held);
                reads += 1;
            }
            (reads, start.elapsed(), worst, worst_held)
        }
    });
    let start = Instant::now();
    let uploaded = cuferry::upload_tensor(&mut engine, &data, &[data.len()]).unwrap();
    let upload = start.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (reads, over, worst, worst_held) = reader.join().unwrap();
    println!(
        "during a 1 GiB upload ({upload:?}): {reads} reads on another thread (the ledger, then a \
         snapshot), {:?} each pair on average; the slowest ledger read {worst_held:?}, the \
         slowest snapshot {worst:?}",
        over / reads.max(1) as u32
    );
    assert!(reads > 0);
    drop((tensors, pinned, uploaded));
    engine.synchronize().unwrap();
    assert_eq!(engine.memory().tensors.in_use, 0);
}
