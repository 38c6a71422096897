//! A tokio program that keeps several batches in flight at once: each batch's pinned upload, the
//! kernels that read its destination while the upload is still in flight, and the download of
//! the result are all queued with no host wait. Each batch's transfers are awaited on a task of
//! their own, which then checks the whole result on tokio's blocking pool and hands the batch's
//! buffers back; the submitting task waits only when every buffer is in use.
//!
//! It runs the same batches twice, one at a time (`wait`, then check, after each batch) and
//! pipelined with `.await`, and prints the overlap the pipeline achieved. Exits non-zero on any
//! mismatch, and with a clear message on a machine without a GPU.
//!
//! `--simulated` runs on the simulated device (feature `sim`), for machines without a GPU; the
//! timings there say nothing about a GPU.

use cuferry::{
    CudaEngine, Pending, PinnedHostBuffer, Result, download_pending,
    pending::{Download, Upload},
    upload_pending,
};
use std::future::IntoFuture;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Batches per run, and how many may be in flight (transfers, kernels or the check) at once.
const BATCHES: usize = 32;
const DEPTH: usize = 4;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn open(simulated: bool) -> std::result::Result<CudaEngine, BoxError> {
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

/// What every batch starts from. Batch `k` differs in its first element, which is `k`, so a
/// result that belongs to another batch is caught.
struct Pattern {
    base: Vec<f32>,
    /// `base`, tripled: what the kernels make of it.
    tripled: Vec<f32>,
}

impl Pattern {
    fn new(n: usize) -> Self {
        let base: Vec<f32> = (0..n).map(|i| (i % 1021) as f32 - 510.0).collect();
        let tripled = base.iter().map(|v| 3.0 * v).collect();
        Pattern { base, tripled }
    }

    /// Whether `got` is batch `k`'s result.
    fn check(&self, got: &[f32], k: usize) -> bool {
        got[0] == 3.0 * k as f32 && got[1..] == self.tripled[1..]
    }
}

/// The pinned buffers one batch uses, handed from batch to batch. The source holds the pattern;
/// a batch only stamps its number into the first element.
struct Slot {
    source: PinnedHostBuffer<f32>,
    result: PinnedHostBuffer<f32>,
}

impl Slot {
    fn new(engine: &mut CudaEngine, pattern: &Pattern) -> Result<Self> {
        Ok(Slot {
            source: PinnedHostBuffer::from_slice(engine, &pattern.base)?,
            result: PinnedHostBuffer::new(engine, pattern.base.len())?,
        })
    }
}

/// One batch in flight: its upload and its download.
type InFlightBatch = (Pending<Upload<f32>>, Pending<Download<f32>>);

/// Queues batch `k` in `slot` with no host wait: the upload, `y = 2x` and `z = y + x` on the
/// upload's destination while it is in flight, and the download of `z`. Returns the in-flight
/// upload and download.
fn submit(
    engine: &mut CudaEngine,
    mut slot: Slot,
    k: usize,
) -> std::result::Result<InFlightBatch, BoxError> {
    slot.source.as_mut_slice()[0] = k as f32;
    let n = slot.source.len();
    let destination = engine.alloc_tensor::<f32>(&[n])?;
    let upload = upload_pending(engine, slot.source, destination).map_err(|e| e.into_error())?;
    let x = upload.tensor();
    let y = engine.scale(x, 2.0f32)?;
    let z = engine.add(&y, x)?;
    let download = download_pending(engine, z, slot.result).map_err(|e| e.into_error())?;
    Ok((upload, download))
}

/// One batch at a time: submit, wait for both transfers, check, then the next batch.
fn one_at_a_time(
    engine: &mut CudaEngine,
    slots: &mut Vec<Slot>,
    pattern: &Pattern,
) -> std::result::Result<Duration, BoxError> {
    let start = Instant::now();
    let mut slot = slots.pop().ok_or("no slot")?;
    for k in 0..BATCHES {
        let (upload, download) = submit(engine, slot, k)?;
        let (_, result) = download.wait()?.into_parts();
        let (source, _) = upload.wait()?.into_parts();
        if !pattern.check(result.as_slice(), k) {
            return Err(format!("batch {k}: wrong result (one at a time)").into());
        }
        slot = Slot { source, result };
    }
    slots.push(slot);
    Ok(start.elapsed())
}

/// Awaits batch `k`'s transfers, then checks its result on the blocking pool; gives the slot
/// back, or says what was wrong.
async fn finish(
    upload: Pending<Upload<f32>>,
    download: Pending<Download<f32>>,
    k: usize,
    pattern: Arc<Pattern>,
) -> std::result::Result<Slot, BoxError> {
    // Both resolve at about the same time: the download was queued after the upload on the
    // engine's one stream.
    let (upload, download) = tokio::try_join!(upload.into_future(), download.into_future())?;
    let (source, _) = upload.into_parts();
    let (_, result) = download.into_parts();
    let (ok, result) =
        tokio::task::spawn_blocking(move || (pattern.check(result.as_slice(), k), result)).await?;
    if !ok {
        return Err(format!("batch {k}: wrong result (pipelined)").into());
    }
    Ok(Slot { source, result })
}

/// Up to `DEPTH` batches in flight: the submitting task queues a batch whenever a slot is free;
/// a task per batch awaits it, checks it and sends its slot back.
async fn pipelined(
    engine: &mut CudaEngine,
    slots: &mut Vec<Slot>,
    pattern: &Arc<Pattern>,
) -> std::result::Result<Duration, BoxError> {
    let start = Instant::now();
    let (done_tx, mut done_rx) = mpsc::channel(DEPTH);
    let mut outstanding = 0usize;
    for k in 0..BATCHES {
        let slot = match slots.pop() {
            Some(slot) => slot,
            None => {
                outstanding -= 1;
                done_rx.recv().await.ok_or("a batch task vanished")??
            }
        };
        let (upload, download) = submit(engine, slot, k)?;
        outstanding += 1;
        let done_tx = done_tx.clone();
        let pattern = Arc::clone(pattern);
        tokio::spawn(async move {
            // The receiver outlives every batch task (it waits for all of them).
            let _ = done_tx
                .send(finish(upload, download, k, pattern).await)
                .await;
        });
    }
    while outstanding > 0 {
        slots.push(done_rx.recv().await.ok_or("a batch task vanished")??);
        outstanding -= 1;
    }
    Ok(start.elapsed())
}

async fn run(simulated: bool) -> std::result::Result<(), BoxError> {
    let mut engine = open(simulated)?;
    // 16 MiB of f32 per batch on a GPU; 64 KiB on the simulated device.
    let n = if simulated { 16 << 10 } else { 4 << 20 };
    let pattern = Arc::new(Pattern::new(n));
    let mut slots = Vec::new();
    for _ in 0..DEPTH {
        slots.push(Slot::new(&mut engine, &pattern)?);
    }
    // Warm up: kernels compiled, pools filled.
    pipelined(&mut engine, &mut slots, &pattern).await?;

    let serial = one_at_a_time(&mut engine, &mut slots, &pattern)?;
    let piped = pipelined(&mut engine, &mut slots, &pattern).await?;
    engine.synchronize()?;

    let mib = (BATCHES * n * 4) as f64 / (1 << 20) as f64;
    let rate = |t: Duration| mib / 1024.0 / t.as_secs_f64();
    println!(
        "{BATCHES} batches of {} KiB, each: upload, 2 kernels on the in-flight destination, download, check",
        (n * 4) >> 10
    );
    println!(
        "one at a time (wait, then check, after each batch): {:.2} ms, {:.1} GiB/s each way",
        serial.as_secs_f64() * 1e3,
        rate(serial)
    );
    println!(
        "pipelined (up to {DEPTH} batches in flight, awaited): {:.2} ms, {:.1} GiB/s each way",
        piped.as_secs_f64() * 1e3,
        rate(piped)
    );
    println!(
        "overlap: the pipeline took {:.0}% of the one-at-a-time time ({:.2}x); all {BATCHES} results checked in each run",
        100.0 * piped.as_secs_f64() / serial.as_secs_f64(),
        serial.as_secs_f64() / piped.as_secs_f64(),
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
