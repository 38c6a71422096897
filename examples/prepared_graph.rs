//! Prepared graphs end to end: trace a computation once, compile it for fixed shapes, prepare it
//! for the engine, and run it many times on new inputs.
//!
//! 1. The seed flow: `y = x * x` on four `f64`s, prepare, run, drop the outputs, synchronize.
//! 2. A longer program with a matrix product (`f32`): elementwise work fused into kernels around
//!    a cuBLAS product, checked against the host.
//! 3. The host cost of a run: a ten-operation `f32` elementwise program, one graph launch per
//!    run, timed with and without the wait.
//!
//! `--simulated` runs the whole flow on the simulated device (feature `sim`), for machines
//! without a GPU. Exits non-zero on any mismatch.

use cuferry::error::SetupError;
use cuferry::graph::{GraphCompiler, Input, TracedTensor};
use cuferry::{CudaEngine, DType, Error, download_tensor, upload_tensor};
use std::process::ExitCode;
use std::time::Instant;

type Failure = Box<dyn std::error::Error>;

fn open(simulated: bool) -> Result<CudaEngine, Failure> {
    if simulated {
        #[cfg(feature = "sim")]
        {
            println!(
                "running on the simulated device (--simulated): no GPU is used, timings are the simulator's"
            );
            return Ok(CudaEngine::simulated(Default::default()));
        }
        #[cfg(not(feature = "sim"))]
        return Err("--simulated needs the `sim` feature: cargo run --example prepared_graph --features sim -- --simulated".into());
    }
    let engine = CudaEngine::open(0)?;
    println!("opened {} ({})", engine.device(), engine.device_name());
    Ok(engine)
}

/// The seed's flow: `y = x * x`.
fn square(engine: &mut CudaEngine) -> Result<(), Failure> {
    let x = TracedTensor::input_symbolic_shape(DType::F64, 1);
    let y = (&x * &x)?;
    let program =
        GraphCompiler::new().compile_with_input_specs(&[&y], &[(&x, DType::F64, &[4])])?;
    let mut prepared = engine.prepare(&program)?;
    let seed = upload_tensor(engine, &[1.5f64, -2.0, 3.0, 0.25], &[4])?;
    let outputs = engine.run(&mut prepared, &[Input::from(&seed)])?;
    assert_eq!(outputs.len(), 1);
    let y = outputs[0].as_tensor::<f64>().ok_or("y is an f64 tensor")?;
    let got = download_tensor(engine, y)?;
    if got != [2.25, 4.0, 9.0, 0.0625] {
        return Err(format!("y = x * x gave {got:?}").into());
    }
    drop(outputs);
    engine.synchronize()?;
    println!("y = x * x: prepared once, ran, outputs dropped, synchronized: {got:?}");
    Ok(())
}

/// `out = relu-free MLP-ish chain`: `h = (a * a - a) * 0.5`, `z = h · w`, `out = (z + bias) * z`.
fn with_product(engine: &mut CudaEngine) -> Result<(), Failure> {
    let (m, k, n) = (64usize, 48usize, 32usize);
    let a = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let w = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let bias = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let h = (&(&a * &a)? - &a)?.scale(0.5f32)?;
    let z = h.matmul(&w)?;
    let out = (&(&z + &bias)? * &z)?;
    let program = GraphCompiler::new().compile_with_input_specs(
        &[&out, &z],
        &[
            (&a, DType::F32, &[m, k]),
            (&w, DType::F32, &[k, n]),
            (&bias, DType::F32, &[m, n]),
        ],
    )?;
    let stats = program.stats();
    let mut prepared = engine.prepare(&program)?;
    for round in 0..3 {
        let av: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 + round) % 13) as f32 * 0.25 - 1.0)
            .collect();
        let wv: Vec<f32> = (0..k * n)
            .map(|i| ((i * 5 + round) % 11) as f32 * 0.125 - 0.5)
            .collect();
        let bv: Vec<f32> = (0..m * n).map(|i| (i % 3) as f32 - 1.0).collect();
        let at = upload_tensor(engine, &av, &[m, k])?;
        let wt = upload_tensor(engine, &wv, &[k, n])?;
        let bt = upload_tensor(engine, &bv, &[m, n])?;
        let outputs = engine.run(&mut prepared, &[(&at).into(), (&wt).into(), (&bt).into()])?;
        let got = download_tensor(engine, outputs[0].as_tensor::<f32>().ok_or("f32 output")?)?;
        let hv: Vec<f32> = av.iter().map(|&x| (x * x - x) * 0.5).collect();
        for i in 0..m {
            for j in 0..n {
                let zij: f32 = (0..k).map(|q| hv[i * k + q] * wv[q * n + j]).sum();
                let want = (zij + bv[i * n + j]) * zij;
                let g = got[i * n + j];
                if (g - want).abs() > 1e-3 * want.abs().max(1.0) {
                    return Err(
                        format!("round {round}: out[{i}][{j}] = {g}, expected {want}").into(),
                    );
                }
            }
        }
    }
    engine.synchronize()?;
    let s = prepared.stats();
    println!(
        "product program: {} operations, {} fused kernels, {} product(s), {} graph(s); 3 runs checked against the host ({} graph launches, {} eager library calls)",
        stats.operations,
        stats.fused_kernels,
        stats.matmuls,
        s.graphs,
        s.graph_launches,
        s.eager_calls
    );
    Ok(())
}

/// Ten dependent `f32` operations, fused into one kernel: the host cost of a run.
fn host_cost(engine: &mut CudaEngine) -> Result<(), Failure> {
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let mut y = x.clone();
    for i in 0..10 {
        y = match i % 3 {
            0 => (&y * &x)?,
            1 => (&y + &x)?,
            _ => y.scale(0.5f32)?,
        };
    }
    let program =
        GraphCompiler::new().compile_with_input_specs(&[&y], &[(&x, DType::F32, &[4])])?;
    let mut prepared = engine.prepare(&program)?;
    let input = upload_tensor(engine, &[1.0f32, 2.0, 3.0, 4.0], &[4])?;
    let runs = 2000;
    for _ in 0..100 {
        drop(engine.run(&mut prepared, &[(&input).into()])?);
    }
    engine.synchronize()?;
    // Host time only: batches of 100 runs, each followed by an untimed synchronize, so the
    // device's launch queue never fills and makes the host wait.
    let mut queued = std::time::Duration::ZERO;
    for _ in 0..runs / 100 {
        let start = Instant::now();
        for _ in 0..100 {
            drop(engine.run(&mut prepared, &[(&input).into()])?);
        }
        queued += start.elapsed();
        engine.synchronize()?;
    }
    let start = Instant::now();
    for _ in 0..runs {
        drop(engine.run(&mut prepared, &[(&input).into()])?);
        engine.synchronize()?;
    }
    let waited = start.elapsed();
    println!(
        "ten-operation program at 4 elements: {:.2} us of host time per run, {:.2} us per run plus synchronize ({} kernel(s), {} parameter updates over {} runs)",
        queued.as_secs_f64() * 1e6 / runs as f64,
        waited.as_secs_f64() * 1e6 / runs as f64,
        program.stats().fused_kernels,
        prepared.stats().parameter_updates,
        prepared.stats().runs,
    );
    Ok(())
}

fn run(simulated: bool) -> Result<(), Failure> {
    let mut engine = open(simulated)?;
    square(&mut engine)?;
    with_product(&mut engine)?;
    host_cost(&mut engine)?;
    engine.synchronize()?;
    println!("synchronized; all checks passed");
    Ok(())
}

fn main() -> ExitCode {
    let simulated = std::env::args().skip(1).any(|a| a == "--simulated");
    match run(simulated) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prepared_graph: {e}");
            if matches!(
                e.downcast_ref::<Error>(),
                Some(Error::Setup(SetupError::NoDriver { .. }))
            ) {
                eprintln!(
                    "this example needs an NVIDIA GPU and driver; pass --simulated to run it on the simulated device"
                );
            }
            ExitCode::FAILURE
        }
    }
}
