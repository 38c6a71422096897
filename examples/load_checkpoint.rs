//! Loads a safetensors checkpoint onto the GPU, with a progress bar, and checks every tensor.
//!
//! The program writes a synthetic checkpoint of bf16 tensors with the `safetensors` crate's own
//! serializer (so the file comes from another implementation of the format), loads it with
//! `cuferry::checkpoint::load_with` while a progress bar shows the bytes moved (twice: the first
//! load on an engine also makes its staging slots), downloads every tensor and compares it with
//! what was written, and reports each load's rate. It then saves the
//! tensors back with `cuferry::checkpoint::save_with` and checks the new file is byte for byte
//! the serializer's. Exits non-zero on any mismatch, and with a clear message on a machine
//! without a GPU.
//!
//! ```text
//! cargo run --release --example load_checkpoint --features safetensors -- [--gib N] [--direct] [--simulated]
//! ```
//!
//! `--gib N` sets the checkpoint's size (default 1 GiB; 1/16 GiB with `--simulated`); `--direct`
//! loads with `O_DIRECT` reads (of a file just written, whose pages the system must first write
//! back, so at the storage's rate); `--simulated` runs on the simulated device (feature `sim`), for
//! machines without a GPU: the rates there say nothing about a GPU.

use cuferry::checkpoint::{self, LoadOptions, Progress, SaveOptions};
use cuferry::{CudaEngine, download_tensor};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::HashMap;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

type BoxError = Box<dyn std::error::Error>;

/// The largest tensor of the synthetic checkpoint.
const TENSOR_BYTES: usize = 64 << 20;

fn open(simulated: bool) -> Result<CudaEngine, BoxError> {
    if simulated {
        #[cfg(feature = "sim")]
        {
            println!("running on the simulated device (--simulated): no GPU is used");
            return Ok(CudaEngine::simulated(Default::default()));
        }
        #[cfg(not(feature = "sim"))]
        return Err("--simulated needs the `sim` feature: cargo run --example load_checkpoint --features safetensors,sim -- --simulated".into());
    }
    let engine = CudaEngine::open(0)?;
    println!("opened {} ({})", engine.device(), engine.device_name());
    Ok(engine)
}

/// Byte `j` of tensor `i`: distinct per tensor and per position, so a misplaced chunk shows.
fn byte(i: usize, j: usize) -> u8 {
    (j as u8).wrapping_mul(31).wrapping_add(i as u8) ^ (j >> 16) as u8
}

/// The synthetic tensors: `(name, bytes)`, `total` bytes in all.
fn synthetic(total: usize) -> Vec<(String, Vec<u8>)> {
    let count = total.div_ceil(TENSOR_BYTES).max(4);
    let each = (total / count) & !1; // bf16: an even number of bytes
    (0..count)
        .map(|i| {
            let bytes = (0..each).map(|j| byte(i, j)).collect();
            (format!("model.layers.{i:03}.weight"), bytes)
        })
        .collect()
}

/// Writes `tensors` to `path` with the `safetensors` crate's serializer.
fn write(path: &Path, tensors: &[(String, Vec<u8>)]) -> Result<(), BoxError> {
    let views = tensors
        .iter()
        .map(|(name, bytes)| {
            let shape = vec![bytes.len() / 2];
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape, bytes);
            Ok((name.clone(), view?))
        })
        .collect::<Result<Vec<_>, BoxError>>()?;
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, path)?;
    Ok(())
}

/// A progress bar of `total` bytes, labelled `what`.
fn bar(what: &'static str, total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(
        "{msg:>6} [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}",
    )
    .expect("a valid template")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what);
    bar
}

fn run(simulated: bool, gib: f64, direct: bool) -> Result<(), BoxError> {
    let mut engine = open(simulated)?;
    let dir = std::env::temp_dir().join(format!("cuferry-load-checkpoint-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = load_and_check(&mut engine, &dir, gib, direct);
    std::fs::remove_dir_all(&dir)?;
    result
}

fn load_and_check(
    engine: &mut CudaEngine,
    dir: &Path,
    gib: f64,
    direct: bool,
) -> Result<(), BoxError> {
    let path = dir.join("model.safetensors");
    let total = (gib * f64::from(1u32 << 30)) as usize;
    let tensors = synthetic(total);
    write(&path, &tensors)?;
    let file_bytes = std::fs::metadata(&path)?.len();
    println!(
        "wrote {} ({} bf16 tensors, {:.2} GiB) with the safetensors crate",
        path.display(),
        tensors.len(),
        file_bytes as f64 / f64::from(1u32 << 30)
    );

    let data: u64 = tensors.iter().map(|(_, b)| b.len() as u64).sum();
    // Twice: the first load on an engine also makes its staging slots (page-locked memory) and
    // grows the device's memory pool; the second finds both made.
    let mut loaded = None;
    for pass in ["first load", "again"] {
        drop(loaded.take());
        engine.synchronize()?;
        let progress = bar("load", data);
        let options = LoadOptions::new()
            .direct_io(direct)
            .progress(|p: Progress| progress.set_position(p.done));
        let start = Instant::now();
        let checkpoint = checkpoint::load_with(engine, &path, options)?;
        let secs = start.elapsed().as_secs_f64();
        progress.finish();
        println!(
            "{pass}: {} tensors in {:.3} s, {:.1} GiB/s{}",
            checkpoint.len(),
            secs,
            data as f64 / secs / f64::from(1u32 << 30),
            if direct { " (O_DIRECT reads)" } else { "" }
        );
        loaded = Some(checkpoint);
    }
    let loaded = loaded.expect("loaded twice");

    for (name, bytes) in &tensors {
        let tensor = loaded
            .get(name)
            .ok_or_else(|| format!("{name} is missing from the load"))?;
        // The typed view: bf16, of the file's shape.
        assert_eq!(
            (tensor.dtype(), tensor.shape()),
            (cuferry::DType::BF16, &[bytes.len() / 2][..])
        );
        let typed = tensor.as_typed::<cuferry::bf16>().ok_or("a bf16 tensor")?;
        let back: Vec<u8> = download_tensor(engine, typed)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        if &back != bytes {
            let at = back.iter().zip(bytes).position(|(a, b)| a != b);
            return Err(format!("{name} differs from the file at byte {at:?}").into());
        }
    }
    println!("every tensor equals the bytes written");

    let again = dir.join("again.safetensors");
    let named = loaded.named();
    let progress = bar("save", data);
    let options = SaveOptions::new().progress(|p: Progress| progress.set_position(p.done));
    let start = Instant::now();
    checkpoint::save_with(engine, &named, &again, options)?;
    let secs = start.elapsed().as_secs_f64();
    progress.finish();
    if std::fs::read(&again)? != std::fs::read(&path)? {
        return Err("the saved file differs from the serializer's".into());
    }
    println!(
        "saved them back in {:.3} s (flushed to storage): {:.2} GiB/s, byte for byte the serializer's file",
        secs,
        data as f64 / secs / f64::from(1u32 << 30)
    );
    engine.synchronize()?;
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let simulated = args.iter().any(|a| a == "--simulated");
    let direct = args.iter().any(|a| a == "--direct");
    let gib = match args.iter().position(|a| a == "--gib") {
        Some(at) => match args.get(at + 1).and_then(|v| v.parse::<f64>().ok()) {
            Some(gib) if gib > 0.0 => gib,
            _ => {
                eprintln!("--gib needs a size in GiB above zero, for example --gib 2");
                return ExitCode::FAILURE;
            }
        },
        None if simulated => 1.0 / 16.0,
        None => 1.0,
    };
    match run(simulated, gib, direct) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("load_checkpoint: {error}");
            ExitCode::FAILURE
        }
    }
}
