//! Checkpoint files on the GPU.
//!
//! - A file the format's own serializer wrote loads bit for bit and saves back byte for byte:
//!   the body in `tests/bodies/checkpoint.rs`, which the simulator binary runs too.
//! - The measurement behind `docs/records/checkpoints.md`: an 8 GiB file of 64 bf16 tensors,
//!   loaded warm and cold and saved, each beside the limit it is judged against, measured in
//!   the same run (reads into pinned memory, buffered and `O_DIRECT`; writes from pinned
//!   memory), with the peak pinned and resident memory.

use crate::bodies::checkpoint::{Scratch, tensors, write_with_the_formats_serializer};
use crate::engine;

// Written once in `tests/bodies/checkpoint.rs`, run here on device 0 and by the simulator binary.
crate::bodies::checkpoint::tests!(gpu);
use cuferry::checkpoint::{self, LoadOptions, SaveOptions};
use cuferry::{CudaEngine, PinnedHostBuffer};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

const GIB: f64 = (1u64 << 30) as f64;

/// `threads` threads reading all of `file` (`len` bytes) in 16 MiB pieces, each into a pinned
/// region of its own (pieces of 4 KiB blocks, so an `O_DIRECT` file reads them too); the rate
/// in GiB/s.
pub(crate) fn read_rate(
    engine: &mut CudaEngine,
    file: &std::fs::File,
    len: u64,
    threads: usize,
) -> f64 {
    read_rate_in(engine, file, len, threads, 16 << 20)
}

/// As [`read_rate`], in pieces of `piece` bytes.
pub(crate) fn read_rate_in(
    engine: &mut CudaEngine,
    file: &std::fs::File,
    len: u64,
    threads: usize,
    piece: usize,
) -> f64 {
    let mut pinned = PinnedHostBuffer::<u8>::new(engine, threads * piece).unwrap();
    let pieces = len.div_ceil(piece as u64) as usize;
    let start = Instant::now();
    std::thread::scope(|s| {
        for (t, region) in pinned.as_mut_slice().chunks_mut(piece).enumerate() {
            s.spawn(move || {
                for p in (t..pieces).step_by(threads) {
                    let at = (p * piece) as u64;
                    let mut got = 0;
                    let want = (len - at).min(piece as u64) as usize;
                    while got < want {
                        let n = file.read_at(&mut region[got..], at + got as u64).unwrap();
                        assert!(n > 0, "read at {at}");
                        got += n;
                    }
                }
            });
        }
    });
    len as f64 / start.elapsed().as_secs_f64() / GIB
}

/// 16 threads writing `len` bytes from pinned memory to a new file at `path` in 16 MiB pieces,
/// then `sync_all`: the rate in GiB/s.
fn write_rate(engine: &mut CudaEngine, path: &Path, len: u64) -> f64 {
    const PIECE: usize = 16 << 20;
    const THREADS: usize = 16;
    let mut pinned = PinnedHostBuffer::<u8>::new(engine, THREADS * PIECE).unwrap();
    for (i, b) in pinned.as_mut_slice().iter_mut().enumerate() {
        *b = i as u8;
    }
    let pieces = len.div_ceil(PIECE as u64) as usize;
    let start = Instant::now();
    let file = std::fs::File::create(path).unwrap();
    std::thread::scope(|s| {
        for (t, region) in pinned.as_slice().chunks(PIECE).enumerate() {
            let file = &file;
            s.spawn(move || {
                for p in (t..pieces).step_by(THREADS) {
                    let at = (p * PIECE) as u64;
                    let n = (len - at).min(PIECE as u64) as usize;
                    file.write_all_at(&region[..n], at).unwrap();
                }
            });
        }
    });
    file.sync_all().unwrap();
    let rate = len as f64 / start.elapsed().as_secs_f64() / GIB;
    std::fs::remove_file(path).unwrap();
    rate
}

/// Drops the page cache (as root); false where that is not allowed.
fn drop_page_cache() -> bool {
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Reads `path` once, so its pages are in the cache.
pub(crate) fn warm(path: &Path) {
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len();
    let mut buf = vec![0u8; 64 << 20];
    let mut at = 0;
    while at < len {
        at += f.read_at(&mut buf, at).unwrap() as u64;
    }
}

/// This process's peak resident memory since the last reset, in MiB, and resets it.
fn peak_resident_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    hwm / 1024.0
}

/// Times one load of `path` with `options` (the tensors dropped after): GiB/s.
pub(crate) fn timed_load(
    engine: &mut CudaEngine,
    path: &Path,
    options: LoadOptions<'_>,
    len: f64,
) -> f64 {
    engine.synchronize().unwrap();
    let start = Instant::now();
    let loaded = checkpoint::load_with(engine, path, options).unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert!(!loaded.is_empty());
    drop(loaded);
    engine.synchronize().unwrap();
    len / secs / GIB
}

/// The rates of `runs` loads, best first, as text.
pub(crate) fn rates(mut r: Vec<f64>) -> String {
    r.sort_by(|a, b| b.total_cmp(a));
    r.iter()
        .map(|x| format!("{x:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[test]
#[ignore = "needs a CUDA device"]
fn measure_an_8_gib_checkpoint_against_the_storage_limits() {
    let dir = Scratch::new("checkpoint-8g");
    let path = dir.0.join("model.safetensors");
    {
        // 64 bf16 tensors of 128 MiB, written by the format's serializer.
        let tensors = tensors(64, 128 << 20);
        write_with_the_formats_serializer(&path, &tensors);
    }
    let f = std::fs::File::open(&path).unwrap();
    let len = f.metadata().unwrap().len();
    let total = len as f64;
    println!("file: {:.2} GiB, 64 bf16 tensors of 128 MiB", total / GIB);
    let mut engine = engine();

    // Warm page cache: the limits, then the loads.
    warm(&path);
    for threads in [1, 4, 8, 16] {
        let r = read_rate(&mut engine, &f, len, threads);
        println!("limit: {threads} threads reading into pinned memory (page cache): {r:.1} GiB/s");
    }
    let limit: Vec<f64> = (0..3)
        .map(|_| read_rate(&mut engine, &f, len, 16))
        .collect();
    {
        let mut buffer = PinnedHostBuffer::<u8>::new(&mut engine, 1 << 30).unwrap();
        buffer.as_mut_slice().fill(1);
        let tensor = engine.alloc_tensor::<u8>(&[1 << 30]).unwrap();
        let mut parts = (buffer, tensor);
        let mut best = 0f64;
        for _ in 0..3 {
            let start = Instant::now();
            let pending = cuferry::upload_pending(&mut engine, parts.0, parts.1).unwrap();
            parts = pending.wait().unwrap().into_parts();
            best = best.max(1.0 / start.elapsed().as_secs_f64());
        }
        println!("limit: pinned memory to device (1 GiB): {best:.1} GiB/s");
    }
    let peak_before = peak_resident_mib();
    println!("resident before the loads: {peak_before:.0} MiB (peak since start)");
    // The first load on a fresh engine makes its staging slots as it goes.
    let first = timed_load(&mut engine, &path, LoadOptions::new(), total);
    println!("load, default staging, first on the engine (slots made during it): {first:.1} GiB/s");
    println!("staging after the first load: {:?}", engine.staging_stats());
    let peak = peak_resident_mib();
    println!("peak resident during the first load: {peak:.0} MiB");
    let mut warm_default = Vec::new();
    for _ in 0..5 {
        warm_default.push(timed_load(&mut engine, &path, LoadOptions::new(), total));
    }
    let peak = peak_resident_mib();
    println!(
        "load, default staging ({} MiB, {} readers), warm: {} GiB/s; peak resident {peak:.0} MiB",
        checkpoint::DEFAULT_STAGING_BYTES >> 20,
        checkpoint::DEFAULT_READERS,
        rates(warm_default.clone())
    );
    println!(
        "limit again: 16 threads into pinned memory: {} GiB/s",
        rates(limit.clone())
    );
    let best_limit = limit.iter().copied().fold(0.0, f64::max);
    let best = warm_default.iter().copied().fold(0.0, f64::max);
    let mut sorted = warm_default.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    println!(
        "warm: best {best:.1} GiB/s = {:.2}x, median {median:.1} GiB/s = {:.2}x the best 16-thread read",
        best / best_limit,
        median / best_limit
    );
    // Other settings: the engine's chunk size (one slot), the load's staging and readers.
    let default_config = engine.staging_config();
    for (chunk, staging, readers) in [
        (16usize << 20, 256usize << 20, 16usize),
        (16 << 20, 256 << 20, 24),
        (16 << 20, 256 << 20, 48),
        (16 << 20, 512 << 20, 32),
        (8 << 20, 256 << 20, 32),
        (8 << 20, 256 << 20, 24),
    ] {
        let mut config = default_config;
        config.chunk_bytes = chunk;
        engine.set_staging_config(config).unwrap();
        let options = || LoadOptions::new().staging_bytes(staging).readers(readers);
        drop(checkpoint::load_with(&mut engine, &path, options()).unwrap());
        let r: Vec<f64> = (0..3)
            .map(|_| timed_load(&mut engine, &path, options(), total))
            .collect();
        println!(
            "load, {} MiB slots, {} MiB staging, {readers} readers, warm: {} GiB/s",
            chunk >> 20,
            staging >> 20,
            rates(r)
        );
    }
    engine.set_staging_config(default_config).unwrap();
    println!(
        "limit again: 16 threads into pinned memory: {:.1} GiB/s",
        read_rate(&mut engine, &f, len, 16)
    );
    // Every tensor of a load, checked against the file.
    {
        let loaded = checkpoint::load(&mut engine, &path).unwrap();
        let mut host = vec![0u8; 128 << 20];
        for (name, t) in loaded.iter() {
            let i: usize = name["layer.".len()..]["00".len() - 2..2].parse().unwrap();
            let back = crate::support::any_tensor::any_bytes(&mut engine, t).unwrap();
            let at = (len - (64u64 << 27)) + (i as u64) * (128 << 20);
            f.read_exact_at(&mut host, at).unwrap();
            assert!(back == host, "{name}");
        }
        println!("every tensor of the load equals the file's bytes");
    }

    // Cold: the page cache dropped before each read of the file.
    if drop_page_cache() {
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap();
        let limit = read_rate(&mut engine, &direct, len, 16);
        println!("limit, cold: 16 threads of O_DIRECT reads into pinned memory: {limit:.2} GiB/s");
        drop_page_cache();
        let buffered = read_rate(&mut engine, &f, len, 16);
        println!(
            "limit, cold: 16 threads of buffered reads into pinned memory: {buffered:.2} GiB/s"
        );
        drop_page_cache();
        let d = timed_load(
            &mut engine,
            &path,
            LoadOptions::new().direct_io(true),
            total,
        );
        println!(
            "load, cold, direct_io: {d:.2} GiB/s = {:.2}x the O_DIRECT read",
            d / limit
        );
        drop_page_cache();
        let b = timed_load(&mut engine, &path, LoadOptions::new(), total);
        println!(
            "load, cold, buffered: {b:.2} GiB/s = {:.2}x the O_DIRECT read",
            b / limit
        );
    } else {
        println!("cold: not measured (the page cache cannot be dropped: not root)");
    }

    // Save: the loaded tensors to a new file (flushed), beside 16 threads writing the same
    // number of bytes from pinned memory (flushed).
    let loaded = checkpoint::load(&mut engine, &path).unwrap();
    let named = loaded.named();
    let out = dir.0.join("saved.safetensors");
    let limit = write_rate(&mut engine, &dir.0.join("limit.bin"), len);
    println!("limit: 16 threads writing from pinned memory, then sync_all: {limit:.2} GiB/s");
    let _ = peak_resident_mib();
    let start = Instant::now();
    checkpoint::save_with(&mut engine, &named, &out, SaveOptions::new()).unwrap();
    let s = total / start.elapsed().as_secs_f64() / GIB;
    let peak = peak_resident_mib();
    println!(
        "save (flushed): {s:.2} GiB/s = {:.2}x the write from pinned memory; peak resident {peak:.0} MiB",
        s / limit
    );
    assert_eq!(std::fs::metadata(&out).unwrap().len(), len);
    std::fs::remove_file(&out).unwrap();
    let limit = write_rate(&mut engine, &dir.0.join("limit.bin"), len);
    println!("limit again: {limit:.2} GiB/s");
    println!("staging at the end: {:?}", engine.staging_stats());
}
