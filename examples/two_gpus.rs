//! One engine per GPU, one thread each: a pipeline that uploads batches on GPU 0, computes on
//! them there, moves each result to GPU 1 over the peer route, computes again there and
//! downloads, with the host waiting once at the end.
//!
//! The producer thread drives GPU 0: a pinned upload, two kernels that read its destination while
//! it is still in flight, and a pending peer copy of the result into a tensor of GPU 1 (the one
//! step that borrows both engines, so it takes GPU 1's lock too, always after GPU 0's). It hands
//! the in-flight copy to the consumer thread, which drives GPU 1: a kernel on the copy's
//! destination (queued after the copy on GPU 1's stream) and a pending download of its result.
//! Nothing waits on the host until the consumer waits for the last download: every earlier
//! download, copy and upload is complete by then, through the engines' stream order and the
//! device-side waits the peer route queues, which the program checks without waiting.
//!
//! With one GPU both engines open on GPU 0 (the route then copies within the device). Exits
//! non-zero on any mismatch, and with a clear message on a machine without a GPU.
//! `--simulated` runs on a simulated machine of two devices (feature `sim`).

use cuferry::{
    CudaEngine, Pending, PinnedHostBuffer, download_pending, peer,
    peer::PeerCopy,
    pending::{Download, TryWait},
    upload_pending,
};
use std::process::ExitCode;
use std::sync::{Mutex, MutexGuard, PoisonError, mpsc};
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Batches per run, elements per batch, and how many copies may wait for the consumer.
const BATCHES: usize = 16;
const ELEMENTS: usize = 1 << 20;
const DEPTH: usize = 4;

/// Batch `k`'s input: element `i` is `k + (i % 1000)`, so a result of another batch is caught.
fn input(k: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (k + i % 1000) as f32).collect()
}

/// What the pipeline makes of batch `k`: `3x` on GPU 0, doubled on GPU 1.
fn expected(k: usize, n: usize) -> Vec<f32> {
    input(k, n).into_iter().map(|x| 6.0 * x).collect()
}

/// What one run found.
pub(crate) struct Report {
    /// Each batch's result, in order.
    pub results: Vec<Vec<f32>>,
    /// From the first submission to the end of the one host wait.
    pub elapsed: Duration,
}

/// An engine's lock (a thread that panicked while holding it left no half-made state behind:
/// every engine call is complete or refused).
fn lock(engine: &Mutex<CudaEngine>) -> MutexGuard<'_, CudaEngine> {
    engine.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `batches` batches of `n` elements through GPU 0, the peer route and GPU 1.
pub(crate) fn pipeline(
    gpu0: CudaEngine,
    gpu1: CudaEngine,
    batches: usize,
    n: usize,
) -> Result<Report, BoxError> {
    let (gpu0, gpu1) = (Mutex::new(gpu0), Mutex::new(gpu1));
    let (gpu0, gpu1) = (&gpu0, &gpu1);
    let (to_gpu1, arrivals) = mpsc::sync_channel::<Pending<PeerCopy<f32>>>(DEPTH);
    let start = Instant::now();
    let (downloads, copies) = std::thread::scope(|s| {
        // GPU 0's thread: upload, compute, and the copy to GPU 1.
        // It owns the sender: the consumer's loop ends when the producer returns.
        let producer = s.spawn(move || -> Result<(), BoxError> {
            for k in 0..batches {
                let mut g0 = lock(gpu0);
                let buffer = PinnedHostBuffer::from_slice(&mut g0, &input(k, n))?;
                let destination = g0.alloc_tensor::<f32>(&[n])?;
                let upload = upload_pending(&mut g0, buffer, destination)?;
                // Queued after the upload on GPU 0's stream: no host wait.
                let doubled = g0.scale(upload.tensor(), 2.0)?;
                let tripled = g0.add(&doubled, upload.tensor())?;
                // Detached: GPU 0's engine releases the pinned buffer once the upload is proven.
                drop(upload);
                let copy = {
                    let mut g1 = lock(gpu1);
                    let landing = g1.alloc_tensor::<f32>(&[n])?;
                    peer::copy_pending(&mut g0, tripled, &mut g1, landing)?
                };
                drop(g0);
                if to_gpu1.send(copy).is_err() {
                    break; // the consumer stopped: its error is the one reported
                }
            }
            Ok(())
        });
        // GPU 1's thread (this one): compute on each arrival, then a pending download.
        let consumer = || -> Result<_, BoxError> {
            let mut downloads: Vec<Pending<Download<f32>>> = Vec::with_capacity(batches);
            let mut copies = Vec::with_capacity(batches);
            for copy in arrivals {
                let mut g1 = lock(gpu1);
                // Queued after the peer copy on GPU 1's stream: reads what landed.
                let result = g1.add(copy.destination(), copy.destination())?;
                let buffer = PinnedHostBuffer::<f32>::new(&mut g1, n)?;
                downloads.push(download_pending(&mut g1, result, buffer)?);
                copies.push(copy);
            }
            Ok((downloads, copies))
        };
        let consumed = consumer();
        let produced = producer.join().expect("the producer thread panicked");
        produced.and(consumed)
    })?;
    let mut downloads = downloads.into_iter();
    let Some(last) = downloads.next_back() else {
        return Ok(Report {
            results: Vec::new(),
            elapsed: start.elapsed(),
        });
    };
    // The one host wait.
    let last = last.wait()?;
    let elapsed = start.elapsed();
    // Everything else is complete already: checked, not waited for.
    let mut results = Vec::with_capacity(batches);
    for download in downloads {
        match download.try_wait()? {
            TryWait::Returned(done) => results.push(done.buffer().as_slice().to_vec()),
            TryWait::InFlight(_) => return Err("a download was still in flight".into()),
        }
    }
    results.push(last.buffer().as_slice().to_vec());
    for copy in copies {
        if copy
            .try_wait()
            .map(|t| matches!(t, cuferry::pending::TryWait::InFlight(_)))?
        {
            return Err("a peer copy was still in flight".into());
        }
    }
    Ok(Report { results, elapsed })
}

fn engines(simulated: bool) -> Result<(CudaEngine, CudaEngine), BoxError> {
    if simulated {
        #[cfg(feature = "sim")]
        {
            use cuferry::sim::{SimConfig, SimDevice};
            println!("running on a simulated machine of two devices (--simulated): no GPU is used");
            let machine = SimDevice::new(SimConfig {
                devices: 2,
                ..SimConfig::default()
            });
            return Ok((
                CudaEngine::simulated_on_device(&machine, 0)?,
                CudaEngine::simulated_on_device(&machine, 1)?,
            ));
        }
        #[cfg(not(feature = "sim"))]
        return Err("--simulated needs the `sim` feature: cargo run --example two_gpus --features sim -- --simulated".into());
    }
    let gpu0 = CudaEngine::open(0)?;
    let gpu1 = match CudaEngine::open(1) {
        Ok(gpu1) => gpu1,
        Err(_) => {
            println!("one GPU: both engines on GPU 0");
            CudaEngine::open(0)?
        }
    };
    println!(
        "GPU 0: {} ({}); GPU 1: {} ({})",
        gpu0.device(),
        gpu0.device_name(),
        gpu1.device(),
        gpu1.device_name()
    );
    Ok((gpu0, gpu1))
}

fn main() -> ExitCode {
    let simulated = std::env::args().any(|a| a == "--simulated");
    let (mut gpu0, gpu1) = match engines(simulated) {
        Ok(pair) => pair,
        Err(e) => {
            eprintln!("two_gpus: cannot open the engines: {e}");
            return ExitCode::FAILURE;
        }
    };
    match peer::access(&mut gpu0, &gpu1) {
        Ok(true) => println!("peer access: enabled"),
        Ok(false) => {
            eprintln!(
                "two_gpus: the devices have no peer link (peer::copy_staged would copy through host memory)"
            );
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("two_gpus: peer access: {e}");
            return ExitCode::FAILURE;
        }
    }
    let n = if simulated { 4096 } else { ELEMENTS };
    let report = match pipeline(gpu0, gpu1, BATCHES, n) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("two_gpus: {e}");
            return ExitCode::FAILURE;
        }
    };
    for (k, got) in report.results.iter().enumerate() {
        if *got != expected(k, n) {
            eprintln!("two_gpus: batch {k} came back wrong");
            return ExitCode::FAILURE;
        }
    }
    let mib = (BATCHES * n * 4) as f64 / (1 << 20) as f64;
    println!(
        "{BATCHES} batches of {n} f32 ({mib:.1} MiB): upload and compute on GPU 0, peer copy, compute on GPU 1, download, one host wait: {:.2} ms, every result correct",
        report.elapsed.as_secs_f64() * 1e3
    );
    ExitCode::SUCCESS
}
