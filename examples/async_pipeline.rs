//! A tokio program that keeps several batches in flight at once: each batch's pinned upload, the
//! kernels that read its destination while the upload is still in flight, and the download of
//! the result are all queued with no host wait; the program awaits the oldest batch only when it
//! needs its buffers back, and checks every result on a blocking-pool thread while the device
//! works on later batches.
//!
//! It runs the same batches twice, one at a time (`wait` after each batch) and pipelined with
//! `.await`, and prints the overlap the pipeline achieved. Exits non-zero on any mismatch, and
//! with a clear message on a machine without a GPU.
//!
//! `--simulated` runs on the simulated device (feature `sim`), for machines without a GPU; the
//! timings there say nothing about a GPU.

use cuferry::{
    download_pending, upload_pending, CudaEngine, PendingDownload, PendingUpload, PinnedHostBuffer,
    Result,
};
use std::collections::VecDeque;
use std::future::IntoFuture;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Batches per run, and how many may be in flight at once.
const BATCHES: usize = 24;
const DEPTH: usize = 4;

fn open(simulated: bool) -> std::result::Result<CudaEngine, Box<dyn std::error::Error>> {
    if simulated {
        #[cfg(feature = "sim")]
        {
            println!("running on the simulated device (--simulated): no GPU is used");
            return Ok(CudaEngine::simulated(Default::default()));
        }
        #[cfg(not(feature = "sim"))]
        return Err("--simulated needs the `sim` feature: cargo run --example async_pipeline --features sim -- --simulated".into());
    }
    let engine = CudaEngine::open(0)?;
    println!("opened {} ({})", engine.device(), engine.device_name());
    Ok(engine)
}

/// The host half of producing batch `k`: fills `out` with its input.
fn fill(out: &mut [f32], k: usize) {
    for (i, v) in out.iter_mut().enumerate() {
        *v = ((i + 31 * k) % 1021) as f32 - 510.0;
    }
}

/// Whether `got` is batch `k`'s input, tripled (what the kernels compute).
fn verify(got: &[f32], k: usize) -> bool {
    got.iter()
        .enumerate()
        .all(|(i, &g)| g == 3.0 * (((i + 31 * k) % 1021) as f32 - 510.0))
}

/// The buffers one batch uses, handed from batch to batch.
struct Slot {
    source: PinnedHostBuffer<f32>,
    result: PinnedHostBuffer<f32>,
}

impl Slot {
    fn new(engine: &mut CudaEngine, n: usize) -> Result<Self> {
        Ok(Slot {
            source: PinnedHostBuffer::new(engine, n)?,
            result: PinnedHostBuffer::new(engine, n)?,
        })
    }
}

/// Queues batch `k` in `slot` with no host wait: the upload, `y = 2x` and `z = y + x` on the
/// upload's destination while it is in flight, and the download of `z`. Returns the in-flight
/// upload and download.
fn submit(
    engine: &mut CudaEngine,
    mut slot: Slot,
    k: usize,
) -> std::result::Result<(PendingUpload<f32>, PendingDownload<f32>), Box<dyn std::error::Error>> {
    let n = slot.source.len();
    fill(slot.source.as_mut_slice(), k);
    let destination = engine.alloc_tensor::<f32>(&[n])?;
    let upload = upload_pending(engine, slot.source, destination).map_err(|e| e.into_error())?;
    let x = upload.device_tensor();
    let y = engine.scale(x, 2.0f32)?;
    let z = engine.add(&y, x)?;
    let download = download_pending(engine, z, slot.result).map_err(|e| e.into_error())?;
    Ok((upload, download))
}

/// One batch at a time: submit, then wait for both transfers, then check, then the next.
fn one_at_a_time(
    engine: &mut CudaEngine,
    slots: &mut Vec<Slot>,
) -> std::result::Result<Duration, Box<dyn std::error::Error>> {
    let start = Instant::now();
    let mut slot = slots.pop().expect("a slot");
    for k in 0..BATCHES {
        let (upload, download) = submit(engine, slot, k)?;
        let (result, _) = download.wait()?.into_parts();
        let (source, _) = upload.wait()?.into_parts();
        if !verify(result.as_slice(), k) {
            return Err(format!("batch {k}: wrong result (one at a time)").into());
        }
        slot = Slot { source, result };
    }
    slots.push(slot);
    Ok(start.elapsed())
}

/// Up to `DEPTH` batches in flight; the oldest is awaited only when its buffers are needed, and
/// its result is checked on the blocking pool while the later batches run on the device.
async fn pipelined(
    engine: &mut CudaEngine,
    slots: &mut Vec<Slot>,
) -> std::result::Result<Duration, Box<dyn std::error::Error>> {
    let start = Instant::now();
    let mut in_flight: VecDeque<(usize, PendingUpload<f32>, PendingDownload<f32>)> =
        VecDeque::new();
    for k in 0..BATCHES {
        if slots.is_empty() {
            let (j, upload, download) = in_flight.pop_front().expect("a batch in flight");
            // Both transfers of batch j resolve together: the download was queued after the
            // upload on the same stream.
            let (upload, download) =
                tokio::try_join!(upload.into_future(), download.into_future())?;
            let (source, _) = upload.into_parts();
            let (result, _) = download.into_parts();
            // Check on the blocking pool while the device works on the later batches; the
            // buffers come back with the verdict.
            let (ok, slot) = tokio::task::spawn_blocking(move || {
                (verify(result.as_slice(), j), Slot { source, result })
            })
            .await?;
            if !ok {
                return Err(format!("batch {j}: wrong result (pipelined)").into());
            }
            slots.push(slot);
        }
        let slot = slots.pop().expect("a free slot");
        let (upload, download) = submit(engine, slot, k)?;
        in_flight.push_back((k, upload, download));
    }
    while let Some((j, upload, download)) = in_flight.pop_front() {
        let (upload, download) = tokio::try_join!(upload.into_future(), download.into_future())?;
        let (source, _) = upload.into_parts();
        let (result, _) = download.into_parts();
        if !verify(result.as_slice(), j) {
            return Err(format!("batch {j}: wrong result (pipelined)").into());
        }
        slots.push(Slot { source, result });
    }
    Ok(start.elapsed())
}

async fn run(simulated: bool) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut engine = open(simulated)?;
    // 16 MiB of f32 per batch on a GPU; 64 KiB on the simulated device.
    let n = if simulated { 16 << 10 } else { 4 << 20 };
    let mut slots = Vec::new();
    for _ in 0..DEPTH {
        slots.push(Slot::new(&mut engine, n)?);
    }
    // Warm up: kernels compiled, pools filled.
    one_at_a_time(&mut engine, &mut slots)?;

    let serial = one_at_a_time(&mut engine, &mut slots)?;
    let piped = pipelined(&mut engine, &mut slots).await?;
    engine.synchronize()?;

    let mib = (BATCHES * n * 4) as f64 / (1 << 20) as f64;
    let rate = |t: Duration| mib / 1024.0 / t.as_secs_f64();
    println!(
        "{BATCHES} batches of {} KiB, each: upload, 2 kernels on the in-flight destination, download",
        (n * 4) >> 10
    );
    println!(
        "one at a time (wait after each batch): {:.2} ms, {:.1} GiB/s each way",
        serial.as_secs_f64() * 1e3,
        rate(serial)
    );
    println!(
        "pipelined ({DEPTH} in flight, awaited): {:.2} ms, {:.1} GiB/s each way",
        piped.as_secs_f64() * 1e3,
        rate(piped)
    );
    println!(
        "overlap: the pipeline took {:.0}% of the one-at-a-time time ({:.2}x); all {} results checked",
        100.0 * piped.as_secs_f64() / serial.as_secs_f64(),
        serial.as_secs_f64() / piped.as_secs_f64(),
        BATCHES * 2
    );
    Ok(())
}

fn main() -> ExitCode {
    let simulated = std::env::args().any(|a| a == "--simulated");
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("async_pipeline: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(simulated)) {
        Ok(()) => {
            println!("async_pipeline: all checks passed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("async_pipeline: {e}");
            ExitCode::FAILURE
        }
    }
}
