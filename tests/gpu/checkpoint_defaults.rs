//! The measurement behind the checkpoint loader's defaults (`docs/records/checkpoints.md`).
//!
//! Three files, each from the page cache: 8 GiB of 64 bf16 tensors, 1 GiB of 64, and 2,000
//! small tensors of 1 to 64 KiB (as norms and biases are). Each is loaded five times with no
//! setting given and three times through each setting of a grid (the engine's slot size, the
//! load's staging and readers), beside the same-run limit for that file (the best 16-thread read
//! into pinned memory, see [`limit`]) and PyTorch's `pin_memory` path (`python/bench/pin_memory.py`, where
//! `python3` with torch is there).
//!
//! And the rest of the loader's figures for ranks (`measure_checkpoints_for_every_rank`): a
//! rank's slice of the 8 GiB file by columns and by rows, the bytes it read against its share
//! and its rate against a whole-file load; a shared load in a world of one; a converting load.

use super::checkpoint::{rates, read_rate_in, timed_load, warm};
use crate::bodies::checkpoint::{Scratch, tensors, write_with_the_formats_serializer};
use crate::engine;
use cuferry::CudaEngine;
use cuferry::checkpoint::{self, LoadOptions, TensorParallel};
use std::path::Path;

const GIB: f64 = (1u64 << 30) as f64;

/// Named tensors' bytes, as the test files hold them.
type Named = Vec<(String, Vec<u8>)>;

/// A test file: what it holds, and how to make its tensors.
type File = (&'static str, fn() -> Named);

/// 2,000 bf16 tensors of 1 to 64 KiB, distinct bytes each.
fn small_tensors() -> Named {
    (0..2000u32)
        .map(|i| {
            let bytes = 1024 * (1 + (i as usize * 37) % 64);
            let data = (0..bytes)
                .map(|j| (j as u32 ^ i.wrapping_mul(97)) as u8)
                .collect();
            (format!("block.{i:04}.norm"), data)
        })
        .collect()
}

/// The median of `r`.
fn median(r: &[f64]) -> f64 {
    let mut r = r.to_vec();
    r.sort_by(f64::total_cmp);
    r[r.len() / 2]
}

/// The same-run limit for `path`: the best of three reads of the whole file by 16 threads into
/// pinned memory, each thread reading pieces of 16 MiB (or a sixteenth of a smaller file) into
/// a region of its own: GiB/s.
///
/// Smaller pieces read faster (a 256 KiB region per thread stays in the core's cache), but
/// that measures the cache, not memory the device's copy engines read from; a staging slot is
/// never that small.
fn limit(engine: &mut CudaEngine, path: &Path) -> f64 {
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len();
    let piece = (16usize << 20)
        .min((len / 16) as usize / 4096 * 4096)
        .max(4096);
    let r: Vec<f64> = (0..3)
        .map(|_| read_rate_in(engine, &f, len, 16, piece))
        .collect();
    println!(
        "  limit: 16 threads into pinned memory, {} KiB pieces: {} GiB/s",
        piece >> 10,
        rates(r.clone())
    );
    r.into_iter().fold(0.0, f64::max)
}

/// The same-run ceiling of the copies behind any load: 1 GiB copied from pinned memory to the
/// device in one transfer, best of three, GiB/s. A load can run no faster than its copies,
/// whatever its reads do.
fn copy_ceiling(engine: &mut CudaEngine) -> f64 {
    const BYTES: usize = 1 << 30;
    let mut source = Some(cuferry::PinnedHostBuffer::<u8>::new(engine, BYTES).unwrap());
    let mut tensor = Some(engine.alloc_tensor::<u8>(&[BYTES]).unwrap());
    let r: Vec<f64> = (0..4)
        .map(|_| {
            engine.synchronize().unwrap();
            let start = std::time::Instant::now();
            let pending =
                cuferry::upload_pending(engine, source.take().unwrap(), tensor.take().unwrap())
                    .unwrap();
            let (buffer, back) = pending.wait().unwrap().into_parts();
            let secs = start.elapsed().as_secs_f64();
            source = Some(buffer);
            tensor = Some(back);
            BYTES as f64 / secs / GIB
        })
        .skip(1)
        .collect();
    println!(
        "  copies: 1 GiB from pinned memory to the device: {} GiB/s",
        rates(r.clone())
    );
    r.into_iter().fold(0.0, f64::max)
}

/// PyTorch's `pin_memory` path on `path`, five loads: GiB/s each, or none where it cannot run.
fn torch_pin_memory(path: &Path) -> Vec<f64> {
    let script = Path::new("python/bench/pin_memory.py");
    if !script.exists() {
        println!(
            "  pin_memory path: not measured ({} is not here)",
            script.display()
        );
        return Vec::new();
    }
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(path)
        .args(["--repeats", "5"])
        .output();
    let Some(out) = out.ok().filter(|o| o.status.success()) else {
        println!("  pin_memory path: not measured (python3 with torch did not run)");
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.rsplit(", ").next()?.strip_suffix(" GiB/s")?.parse().ok())
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn measure_checkpoint_defaults() {
    let dir = Scratch::new("checkpoint-defaults");
    let mut engine = engine();
    let default_config = engine.staging_config();
    let files: [File; 3] = [
        ("8 GiB, 64 bf16 tensors of 128 MiB", || {
            tensors(64, 128 << 20)
        }),
        ("1 GiB, 64 bf16 tensors of 16 MiB", || tensors(64, 16 << 20)),
        ("64 MiB, 2,000 bf16 tensors of 1-64 KiB", small_tensors),
    ];
    for (k, (what, make)) in files.into_iter().enumerate() {
        let path = dir.0.join(format!("file{k}.safetensors"));
        write_with_the_formats_serializer(&path, &make());
        let len = std::fs::metadata(&path).unwrap().len() as f64;
        warm(&path);
        println!("file: {what} ({:.3} GiB)", len / GIB);
        let limit = limit(&mut engine, &path);
        let ceiling = copy_ceiling(&mut engine);
        // A load not timed first: the engine makes its staging slots once.
        timed_load(&mut engine, &path, LoadOptions::new(), len);
        let defaults: Vec<f64> = (0..5)
            .map(|_| timed_load(&mut engine, &path, LoadOptions::new(), len))
            .collect();
        let torch = torch_pin_memory(&path);
        let m = median(&defaults);
        println!(
            "  load, no setting given: {} GiB/s; median {m:.2} = {:.2}x the limit {limit:.1}, {:.2}x the copies' {ceiling:.1}",
            rates(defaults.clone()),
            m / limit,
            m / ceiling
        );
        if !torch.is_empty() {
            println!(
                "  pin_memory path: {} GiB/s; the default's median = {:.2}x its median",
                rates(torch.clone()),
                m / median(&torch)
            );
        }
        for chunk in [4usize << 20, 8 << 20, 16 << 20] {
            let mut config = default_config;
            config.chunk_bytes = chunk;
            engine.set_staging_config(config).unwrap();
            for staging in [64usize << 20, 128 << 20, 256 << 20] {
                for readers in [8usize, 16, 24, 32] {
                    let options = || LoadOptions::new().staging_bytes(staging).readers(readers);
                    timed_load(&mut engine, &path, options(), len);
                    let r: Vec<f64> = (0..3)
                        .map(|_| timed_load(&mut engine, &path, options(), len))
                        .collect();
                    let m = median(&r);
                    println!(
                        "  sweep: slot {:>2} MiB, staging {:>3} MiB, {readers:>2} readers: median {m:5.1} GiB/s = {:.2}x ({})",
                        chunk >> 20,
                        staging >> 20,
                        m / limit,
                        rates(r)
                    );
                }
            }
        }
        engine.set_staging_config(default_config).unwrap();
        println!(
            "  limit again: {:.1} GiB/s",
            self::limit(&mut engine, &path)
        );
        std::fs::remove_file(&path).unwrap();
    }
}

/// A file's reader that counts the bytes its positioned reads return.
struct Counted<'f> {
    file: &'f std::fs::File,
    bytes: std::sync::atomic::AtomicU64,
}

impl checkpoint::ReadAt for Counted<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let n = std::os::unix::fs::FileExt::read_at(self.file, buf, offset)?;
        self.bytes
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(n)
    }
}

/// A file's reader with no reader of its own to give: every thread reads through the one
/// open file description (the loader's reads before `ReadAt::reopen`).
struct Shared<'f>(&'f std::fs::File);

impl checkpoint::ReadAt for Shared<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self.0, buf, offset)
    }
}

/// The same-run limit for a rank's columns: `threads` threads, each with the file opened again
/// (a description of its own), reading `run` bytes at `skip` of every `row`-byte row of the
/// `tensors` tensors of `tensor_bytes` each from `data` on, into 16 MiB of pinned memory each;
/// best of three, GiB/s of bytes read.
fn column_limit(
    engine: &mut CudaEngine,
    path: &Path,
    (data, tensors, tensor_bytes): (u64, u64, u64),
    (row, run, skip): (u64, usize, u64),
    threads: usize,
) -> f64 {
    const SLOT: usize = 16 << 20;
    let mut pinned = cuferry::PinnedHostBuffer::<u8>::new(engine, threads * SLOT).unwrap();
    let rows = tensors * tensor_bytes / row;
    (0..3)
        .map(|_| {
            let start = std::time::Instant::now();
            std::thread::scope(|s| {
                for (t, slot) in pinned.as_mut_slice().chunks_mut(SLOT).enumerate() {
                    let f = std::fs::File::open(path).unwrap();
                    s.spawn(move || {
                        let per = rows.div_ceil(threads as u64);
                        let mut out = 0;
                        for r in t as u64 * per..((t as u64 + 1) * per).min(rows) {
                            if out + run > SLOT {
                                out = 0;
                            }
                            let at = data + r * row + skip;
                            std::os::unix::fs::FileExt::read_exact_at(
                                &f,
                                &mut slot[out..out + run],
                                at,
                            )
                            .unwrap();
                            out += run;
                        }
                    });
                }
            });
            (rows * run as u64) as f64 / start.elapsed().as_secs_f64() / GIB
        })
        .fold(0.0, f64::max)
}

/// Times `load` three times (the engine synchronized before each, the loaded tensors dropped
/// after): seconds each.
fn timed(engine: &mut CudaEngine, mut load: impl FnMut(&mut CudaEngine)) -> Vec<f64> {
    (0..3)
        .map(|_| {
            engine.synchronize().unwrap();
            let start = std::time::Instant::now();
            load(engine);
            let secs = start.elapsed().as_secs_f64();
            engine.synchronize().unwrap();
            secs
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn measure_checkpoints_for_every_rank() {
    let dir = Scratch::new("checkpoint-ranks");
    let path = dir.0.join("model.safetensors");
    // 64 bf16 tensors of [8192, 8192]: 8 GiB.
    {
        let data: Named = tensors(64, 128 << 20);
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, b)| {
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::BF16,
                    vec![8192, 8192],
                    b,
                );
                (n.clone(), view.unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
    }
    let f = std::fs::File::open(&path).unwrap();
    let len = f.metadata().unwrap().len();
    let tensor_bytes = 64u64 * (128 << 20);
    warm(&path);
    let mut engine = engine();
    let limit = limit(&mut engine, &path);
    timed_load(&mut engine, &path, LoadOptions::new(), len as f64);
    let whole = timed(&mut engine, |e| {
        drop(checkpoint::load(e, &path).unwrap());
    });
    let whole_rate = tensor_bytes as f64 / median(&whole) / GIB;
    println!(
        "whole file, no setting given: median {whole_rate:.1} GiB/s ({:.2}x the limit {limit:.1})",
        whole_rate / limit
    );
    // Rank 3 of a world of 8: columns of every tensor, then rows.
    for (what, plan) in [
        ("columns", TensorParallel::new(3, 8).unwrap().columns("*")),
        ("rows", TensorParallel::new(3, 8).unwrap().rows("*")),
    ] {
        let counted = Counted {
            file: &f,
            bytes: Default::default(),
        };
        let options = || LoadOptions::new().tensor_parallel(plan.clone());
        // The bytes read, counted by a reader that wraps the file; the timed loads read the
        // file itself (each reader thread through a descriptor of its own, which a wrapper that
        // adds to one counter from every thread would not show).
        drop(checkpoint::load_from(&mut engine, &path, &counted, len, options()).unwrap());
        let read = counted.bytes.swap(0, std::sync::atomic::Ordering::Relaxed);
        let share = tensor_bytes / 8;
        if what == "columns" {
            let header = len - tensor_bytes;
            for threads in [16, 24] {
                let rate = column_limit(
                    &mut engine,
                    &path,
                    (header, 64, 128 << 20),
                    (8192 * 2, 1024 * 2, 3 * 1024 * 2),
                    threads,
                );
                println!(
                    "rank 3 of 8, columns, raw: {threads} threads, a descriptor each, 2 KiB of each row into pinned memory: {rate:.1} GiB/s"
                );
            }
            let shared = Shared(&f);
            let secs = timed(&mut engine, |e| {
                drop(checkpoint::load_from(e, &path, &shared, len, options()).unwrap());
            });
            let rate = share as f64 / median(&secs) / GIB;
            println!(
                "rank 3 of 8, columns, every thread through one descriptor: median {rate:.1} GiB/s ({})",
                rates(secs.iter().map(|s| share as f64 / s / GIB).collect())
            );
        }
        for readers in [None, Some(16), Some(32)] {
            let options = || match readers {
                Some(n) => options().readers(n),
                None => options(),
            };
            let secs = timed(&mut engine, |e| {
                let loaded = checkpoint::load_with(e, &path, options()).unwrap();
                assert_eq!(loaded.get("layer.00.weight").unwrap().len(), 8192 * 1024);
            });
            let rate = share as f64 / median(&secs) / GIB;
            println!(
                "rank 3 of 8, {what}, readers {readers:?}: read {read} bytes = {:.4}x its share ({share}); median {rate:.1} GiB/s of bytes read = {:.2}x the whole-file load's rate ({})",
                read as f64 / share as f64,
                rate / whole_rate,
                rates(secs.iter().map(|s| share as f64 / s / GIB).collect())
            );
        }
    }
    // Every tensor's columns checked against the file, for one rank.
    {
        let plan = TensorParallel::new(7, 8).unwrap().columns("*");
        let loaded =
            checkpoint::load_with(&mut engine, &path, LoadOptions::new().tensor_parallel(plan))
                .unwrap();
        let header = len - tensor_bytes;
        let mut row = vec![0u8; 8192 * 2];
        for (i, (name, t)) in loaded.iter().enumerate() {
            let back = crate::support::any_tensor::any_bytes(&mut engine, t).unwrap();
            for r in [0usize, 4095, 8191] {
                let at = header + i as u64 * (128 << 20) + (r * 8192 * 2) as u64;
                std::os::unix::fs::FileExt::read_exact_at(&f, &mut row, at).unwrap();
                let want = &row[7 * 1024 * 2..];
                assert!(&back[r * 2048..(r + 1) * 2048] == want, "{name} row {r}");
            }
        }
        println!("rank 7 of 8, columns: rows 0, 4095 and 8191 of every tensor equal the file's");
    }
    // A shared load in a world of one, and a converting load (bf16 -> f32 on the device).
    let comm = cuferry::collective::Communicator::new(&mut [&mut engine]);
    match comm {
        Ok(comm) => {
            let secs = timed(&mut engine, |e| {
                drop(checkpoint::load_shared(&comm, &mut [e], &path, LoadOptions::new()).unwrap());
            });
            let rate = tensor_bytes as f64 / median(&secs) / GIB;
            println!(
                "load_shared, a world of one: median {rate:.1} GiB/s = {:.2}x the whole-file load",
                rate / whole_rate
            );
        }
        Err(e) => println!("load_shared: not measured ({e})"),
    }
    let secs = timed(&mut engine, |e| {
        let options = LoadOptions::new().convert(|_, _| cuferry::DType::F32);
        drop(checkpoint::load_with(e, &path, options).unwrap());
    });
    let rate = tensor_bytes as f64 / median(&secs) / GIB;
    println!(
        "load converting bf16 to f32 on the device: median {rate:.1} GiB/s of file = {:.2}x the whole-file load",
        rate / whole_rate
    );
}

/// A file's reader that adds up the time its positioned reads take, across threads.
struct Timed<'f> {
    file: &'f std::fs::File,
    nanos: std::sync::atomic::AtomicU64,
    reads: std::sync::atomic::AtomicU64,
}

impl checkpoint::ReadAt for Timed<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let start = std::time::Instant::now();
        let n = std::os::unix::fs::FileExt::read_at(self.file, buf, offset)?;
        let spent = start.elapsed().as_nanos() as u64;
        self.nanos
            .fetch_add(spent, std::sync::atomic::Ordering::Relaxed);
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(n)
    }
}

/// A reader that notes when each read starts and ends (nanoseconds from `start`) and how many
/// bytes it moved, through a descriptor of each thread's own as the file itself gives one.
struct Timeline<'f> {
    file: &'f dyn checkpoint::ReadAt,
    /// This thread's own reader, once asked for.
    own: Option<Box<dyn checkpoint::ReadAt + 'f>>,
    start: std::time::Instant,
    reads: &'f std::sync::Mutex<Vec<(u64, u64, usize)>>,
}

impl Timeline<'_> {
    fn note(&self, read: impl FnOnce() -> std::io::Result<usize>) -> std::io::Result<usize> {
        let from = self.start.elapsed().as_nanos() as u64;
        let n = read()?;
        let to = self.start.elapsed().as_nanos() as u64;
        self.reads.lock().unwrap().push((from, to, n));
        Ok(n)
    }

    fn reader(&self) -> &dyn checkpoint::ReadAt {
        self.own.as_deref().unwrap_or(self.file)
    }
}

impl checkpoint::ReadAt for Timeline<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        self.note(|| self.reader().read_at(buf, offset))
    }
    fn read_vectored_at(
        &self,
        bufs: &mut [std::io::IoSliceMut<'_>],
        offset: u64,
    ) -> std::io::Result<usize> {
        self.note(|| self.reader().read_vectored_at(bufs, offset))
    }
    fn reopen(&self) -> Option<Box<dyn checkpoint::ReadAt + '_>> {
        let again = self.file.reopen()?;
        Some(Box::new(Timeline {
            file: self.file,
            own: Some(again),
            start: self.start,
            reads: self.reads,
        }))
    }
}

/// Where one load of `path` spends its time: its reads (each thread's, through a descriptor of
/// its own) and the moments its chunks' copies are queued, from the load's start.
fn timeline(engine: &mut CudaEngine, path: &std::path::Path) -> String {
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len();
    let reads = std::sync::Mutex::new(Vec::new());
    engine.synchronize().unwrap();
    let start = std::time::Instant::now();
    let file = Timeline {
        file: &f,
        own: None,
        start,
        reads: &reads,
    };
    let mut landed = Vec::new();
    let options = LoadOptions::new().progress(|_| landed.push(start.elapsed().as_nanos() as u64));
    let loaded = checkpoint::load_from(engine, path, &file, len, options).unwrap();
    let end = start.elapsed().as_nanos() as u64;
    drop(loaded);
    drop(file);
    let reads = reads.into_inner().unwrap();
    let ms = |ns: u64| ns as f64 / 1e6;
    // The header's reads come first; the data's are the large ones.
    let data: Vec<_> = reads.iter().filter(|r| r.2 >= 4096).collect();
    let mut ends: Vec<u64> = data.iter().map(|r| r.1).collect();
    ends.sort_unstable();
    let first = data.iter().map(|r| r.0).min().unwrap_or(0);
    let busy: u64 = data.iter().map(|r| r.1 - r.0).sum();
    let q = |f: f64| {
        ends.get(((ends.len() as f64 - 1.0) * f) as usize)
            .copied()
            .unwrap_or(0)
    };
    format!(
        "{} reads ({} of data, {:.2} ms of threads' time); the first data read starts at {:.2} ms, \
         data reads end at {:.2} / {:.2} / {:.2} / {:.2} / {:.2} ms (first, quartiles, last); \
         copies queued at {:?} ms; returned at {:.2} ms",
        reads.len(),
        data.len(),
        ms(busy),
        ms(first),
        ms(q(0.0)),
        ms(q(0.25)),
        ms(q(0.5)),
        ms(q(0.75)),
        ms(q(1.0)),
        landed
            .iter()
            .map(|&t| (ms(t) * 100.0).round() / 100.0)
            .collect::<Vec<_>>(),
        ms(end)
    )
}

#[test]
#[ignore = "needs a CUDA device"]
fn measure_small_tensors() {
    let dir = Scratch::new("checkpoint-small");
    let path = dir.0.join("small.safetensors");
    write_with_the_formats_serializer(&path, &small_tensors());
    let f = std::fs::File::open(&path).unwrap();
    let len = f.metadata().unwrap().len();
    warm(&path);
    let mut engine = engine();
    let limit = limit(&mut engine, &path);
    timed_load(&mut engine, &path, LoadOptions::new(), len as f64);
    // Three loads, each timed until it returns, and the checkpoint's drop (2,000 frees) timed
    // on its own.
    let loads = |engine: &mut CudaEngine, readers: usize| {
        let (mut loads, mut drops) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            engine.synchronize().unwrap();
            let start = std::time::Instant::now();
            let options = LoadOptions::new().readers(readers);
            let loaded = checkpoint::load_with(engine, &path, options).unwrap();
            loads.push(start.elapsed().as_secs_f64());
            let start = std::time::Instant::now();
            drop(loaded);
            drops.push(start.elapsed().as_secs_f64());
        }
        (loads, drops)
    };
    let (whole, dropped) = loads(&mut engine, checkpoint::DEFAULT_READERS);
    let plan = timed(&mut engine, |e| {
        drop(checkpoint::load_with(e, &path, LoadOptions::new().select(|_| false)).unwrap())
    });
    println!(
        "2,000 small tensors: load median {:.2} ms ({:.1} GiB/s, {:.2}x the limit {limit:.1}); the header alone {:.2} ms; the checkpoint's drop {:.2} ms",
        median(&whole) * 1e3,
        len as f64 / median(&whole) / GIB,
        len as f64 / median(&whole) / GIB / limit,
        median(&plan) * 1e3,
        median(&dropped) * 1e3
    );
    // The landing (the default for this file) against the load that plans first (a selection
    // of every tensor is never landed), in turns, with the limit read again after them.
    let (mut landed, mut planned) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        for (times, select) in [(&mut landed, false), (&mut planned, true)] {
            engine.synchronize().unwrap();
            let start = std::time::Instant::now();
            let options = if select {
                LoadOptions::new().select(|_| true)
            } else {
                LoadOptions::new()
            };
            let loaded = checkpoint::load_with(&mut engine, &path, options).unwrap();
            times.push(start.elapsed().as_secs_f64());
            drop(loaded);
        }
    }
    let after = self::limit(&mut engine, &path);
    let rate = |t: &[f64]| len as f64 / median(t) / GIB;
    println!(
        "  landed vs planned first, in turns: landed median {:.2} ms ({:.1} GiB/s, {:.2}x the limit before, {:.2}x the limit after {after:.1}); planned first {:.2} ms ({:.1} GiB/s, {:.2}x, {:.2}x)",
        median(&landed) * 1e3,
        rate(&landed),
        rate(&landed) / limit,
        rate(&landed) / after,
        median(&planned) * 1e3,
        rate(&planned),
        rate(&planned) / limit,
        rate(&planned) / after,
    );
    let reader = Timed {
        file: &f,
        nanos: Default::default(),
        reads: Default::default(),
    };
    let secs = timed(&mut engine, |e| {
        drop(checkpoint::load_from(e, &path, &reader, len, LoadOptions::new()).unwrap())
    });
    let reads = reader.reads.load(std::sync::atomic::Ordering::Relaxed) / 3;
    let in_reads = reader.nanos.load(std::sync::atomic::Ordering::Relaxed) as f64 / 3e6;
    println!(
        "  through a timed reader: {:.2} ms each; {reads} reads taking {in_reads:.2} ms of threads' time",
        median(&secs) * 1e3
    );
    for _ in 0..3 {
        println!("  timeline: {}", timeline(&mut engine, &path));
    }
    // When each tensor is handed over.
    for _ in 0..3 {
        engine.synchronize().unwrap();
        let start = std::time::Instant::now();
        let mut first = None;
        let mut last = 0.0;
        checkpoint::load_each(&mut engine, &path, LoadOptions::new(), |_, _, t| {
            let at = start.elapsed().as_secs_f64();
            first.get_or_insert(at);
            last = at;
            drop(t);
            Ok(())
        })
        .unwrap();
        let end = start.elapsed().as_secs_f64();
        println!(
            "  load_each: first tensor at {:.2} ms, last at {:.2} ms, returned at {:.2} ms",
            first.unwrap() * 1e3,
            last * 1e3,
            end * 1e3
        );
    }
    for readers in [8, 12, 16, 32] {
        let (secs, _) = loads(&mut engine, readers);
        println!(
            "  {readers} readers: median {:.2} ms ({:.1} GiB/s)",
            median(&secs) * 1e3,
            len as f64 / median(&secs) / GIB
        );
    }
    for chunk in [1usize << 20, 4 << 20] {
        let mut config = engine.staging_config();
        config.chunk_bytes = chunk;
        engine.set_staging_config(config).unwrap();
        timed_load(&mut engine, &path, LoadOptions::new(), len as f64);
        let secs = timed(&mut engine, |e| drop(checkpoint::load(e, &path).unwrap()));
        println!(
            "  {} MiB slots: median {:.2} ms ({:.1} GiB/s)",
            chunk >> 20,
            median(&secs) * 1e3,
            len as f64 / median(&secs) / GIB
        );
    }
}
