//! What crossing between the engine and CubeCL costs (feature `cubecl`), beside the engine doing
//! the same device-to-device copy on its own stream, in the same run.
//!
//! Run on a GPU machine: `cargo bench --features cubecl --bench cubecl_boundary`. Groups:
//! - `cubecl_scope`: entering and leaving `with_cubecl` with nothing inside;
//! - `cubecl_boundary/{import,export}_4MiB`: one crossing of 4 MiB each way;
//! - `cubecl_boundary/engine_copy_4MiB`: `copy_tensor` + `synchronize`, the same bytes moved
//!   without a boundary.

// criterion's macros generate undocumented public items.
#![allow(missing_docs)]

use criterion::{Criterion, criterion_group, criterion_main};
use cuferry::{CudaEngine, Error, upload_tensor};
use std::time::Duration;

fn benches(c: &mut Criterion) {
    let mut engine = match CudaEngine::open(0) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("cubecl_boundary: no CUDA device ({e}); nothing measured");
            return;
        }
    };
    let n = (4 << 20) / 4;
    let host: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
    let x = upload_tensor(&mut engine, &host, &[n]).unwrap();
    c.bench_function("cubecl_scope/enter_and_leave", |b| {
        b.iter(|| engine.with_cubecl(|_| Ok::<_, Error>(())).unwrap())
    });
    let mut group = c.benchmark_group("cubecl_boundary");
    group.bench_function("engine_copy_4MiB", |b| {
        b.iter(|| {
            let y = engine.copy_tensor(&x).unwrap();
            engine.synchronize().unwrap();
            drop(y);
        })
    });
    group.bench_function("import_4MiB", |b| {
        b.iter(|| {
            engine
                .with_cubecl(|scope| scope.import(&x).map(drop))
                .unwrap()
        })
    });
    group.bench_function("import_and_export_4MiB", |b| {
        b.iter(|| {
            engine
                .with_cubecl(|scope| {
                    let handle = scope.import(&x)?;
                    scope.export::<f32>(&handle, &[n]).map(drop)
                })
                .unwrap()
        })
    });
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1000))
}

criterion_group! {
    name = boundary;
    config = config();
    targets = benches
}
criterion_main!(boundary);
