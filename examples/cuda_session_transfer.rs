//! The session flow end to end on a real GPU: open the engine, a chain of dependent adds and a
//! flush (no host wait), a pinned upload observed in flight, a pending download, a blocking
//! `download_tensor_into` in a loop, and the final synchronize. Exits non-zero on any mismatch,
//! and with a clear message on a machine without a GPU.
//!
//! `--simulated` runs the whole flow on the simulated device (feature `sim`), for machines
//! without a GPU.

use cuferry::{
    CudaEngine, PinnedHostBuffer, download_pending, download_tensor_into, upload_pending,
    upload_tensor,
};
use std::process::ExitCode;

fn open(simulated: bool) -> Result<CudaEngine, Box<dyn std::error::Error>> {
    if simulated {
        #[cfg(feature = "sim")]
        {
            println!("running on the simulated device (--simulated): no GPU is used");
            return Ok(CudaEngine::simulated(Default::default()));
        }
        #[cfg(not(feature = "sim"))]
        return Err("--simulated needs the `sim` feature: cargo run --example cuda_session_transfer --features sim -- --simulated".into());
    }
    let engine = CudaEngine::open(0)?;
    println!("opened {} ({})", engine.device(), engine.device_name());
    Ok(engine)
}

fn run(simulated: bool) -> Result<(), Box<dyn std::error::Error>> {
    let mut engine = open(simulated)?;

    let n = 1 << 20;
    let seed: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 + 1.0).collect();
    let seed_tensor = upload_tensor(&mut engine, &seed, &[n])?;
    // state = seed + seed, then doubled twice more: each add reads the previous result, in
    // stream order, with no host wait between them.
    let mut state = engine.add(&seed_tensor, &seed_tensor)?;
    for _ in 0..2 {
        state = engine.add(&state, &state)?;
    }
    engine.flush()?;
    println!("queued a chain of 3 dependent adds, flushed (no wait)");
    let expected: Vec<f32> = seed.iter().map(|x| x * 8.0).collect();

    let mut source = PinnedHostBuffer::<f32>::new(&mut engine, n)?;
    source.as_mut_slice().copy_from_slice(&seed);
    let destination = engine.alloc_tensor::<f32>(&[n])?;
    let mut upload = upload_pending(&mut engine, source, destination)?;
    let observed_in_flight = !upload.is_ready()?;
    let (reusable, uploaded) = upload.wait()?.into_parts();
    println!(
        "pinned upload of {} MiB: observed in flight before wait = {observed_in_flight}",
        (n * 4) >> 20
    );

    let filled = download_pending(&mut engine, uploaded, reusable)?.wait()?;
    if filled.buffer().as_slice() != seed.as_slice() {
        return Err("pending download does not match the uploaded data".into());
    }
    println!("pending download matches");

    let mut out = Vec::with_capacity(n);
    for round in 0..4 {
        out = download_tensor_into(&mut engine, &state, out)?;
        if out != expected {
            return Err(format!("download_tensor_into round {round} does not match").into());
        }
    }
    println!("download_tensor_into x4 into one reused Vec: the chain computed 8 x seed");
    engine.synchronize()?;
    println!("synchronized; all checks passed");
    Ok(())
}

fn main() -> ExitCode {
    let simulated = std::env::args().skip(1).any(|a| a == "--simulated");
    match run(simulated) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuda_session_transfer: {e}");
            if matches!(
                e.downcast_ref::<cuferry::Error>(),
                Some(cuferry::Error::Setup(
                    cuferry::error::SetupError::NoDriver { .. }
                ))
            ) {
                eprintln!(
                    "this example needs a machine with an NVIDIA GPU and driver; pass --simulated to run it on the simulated device"
                );
            }
            ExitCode::FAILURE
        }
    }
}
