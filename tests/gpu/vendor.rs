//! cuBLAS, cuSOLVER and cuTENSOR on the GPU: the bodies in `tests/bodies/vendor.rs` (which the
//! simulator binary runs too) against host references, and the GPU's libraries against the
//! simulator's emulations.

use crate::engine;
use crate::reference::Rng;
use cuferry::error::SetupError;
use cuferry::{CudaEngine, Error, download_tensor, upload_tensor};

// Written once in `tests/bodies/vendor.rs`, run here on device 0 and by the simulator binary.
crate::bodies::vendor::tests!(gpu);

/// `n` values in [-1, 1), never zero.
fn random(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let v = rng.unit();
            if v == 0.0 { 0.5 } else { v }
        })
        .collect()
}

// GPU only: it compares the GPU's libraries with the simulator's, so it needs both.
/// The simulator's library emulations (what CI runs) against the GPU's libraries, on the same
/// inputs: they agree up to rounding, so a lifecycle test that checks results on the simulator
/// checks what the GPU computes.
#[cfg(feature = "sim")]
#[test]
#[ignore = "needs a CUDA device"]
fn the_simulator_computes_what_the_gpu_libraries_compute() {
    use cuferry::sim::SimConfig;
    let mut gpu = engine();
    let mut sim = CudaEngine::simulated(SimConfig::default());
    let mut rng = Rng::new(0x11b5);
    let close = |what: &str, gpu: &[f64], sim: &[f64], scale: f64| {
        assert_eq!(gpu.len(), sim.len(), "{what}");
        for (i, (g, s)) in gpu.iter().zip(sim).enumerate() {
            assert!(
                (g - s).abs() <= 1e-9 * scale,
                "{what}[{i}]: GPU {g}, simulator {s}"
            );
        }
    };
    // gemm, every transpose, with leading dimensions past the rows and both scales.
    let k = 23;
    for config in crate::reference::gemm_configs(17, 9, k, 1.25, -0.5) {
        let [(_, a_cols), (_, b_cols)] = crate::reference::gemm_operands(&config);
        let a: Vec<f64> = random(&mut rng, config.lda * a_cols);
        let b: Vec<f64> = random(&mut rng, config.ldb * b_cols);
        let c: Vec<f64> = random(&mut rng, config.ldc * config.n);
        let mut out = Vec::new();
        for engine in [&mut gpu, &mut sim] {
            let ta = upload_tensor(engine, &a, &[a.len()]).unwrap();
            let tb = upload_tensor(engine, &b, &[b.len()]).unwrap();
            let mut tc = upload_tensor(engine, &c, &[c.len()]).unwrap();
            engine.gemm(&config, &ta, &tb, &mut tc).unwrap();
            out.push(download_tensor(engine, &tc).unwrap());
        }
        let what = format!("gemm {:?} {:?}", config.transa, config.transb);
        close(&what, &out[0], &out[1], k as f64);
    }
    // The Cholesky solve of a well-conditioned system, and its factor.
    let order = 12;
    let g: Vec<f64> = random(&mut rng, order * order);
    let mut spd = vec![0.0; order * order];
    for i in 0..order {
        for j in 0..order {
            spd[i * order + j] = (0..order)
                .map(|q| g[i * order + q] * g[j * order + q])
                .sum();
        }
        spd[i * order + i] += order as f64;
    }
    let rhs: Vec<f64> = random(&mut rng, 3 * order);
    let mut out = Vec::new();
    for engine in [&mut gpu, &mut sim] {
        let mut ta = upload_tensor(engine, &spd, &[order, order]).unwrap();
        let mut tb = upload_tensor(engine, &rhs, &[3, order]).unwrap();
        engine
            .cholesky_solve(&mut ta, &mut tb)
            .unwrap()
            .check(engine)
            .unwrap();
        out.push(download_tensor(engine, &tb).unwrap());
    }
    close("cholesky_solve", &out[0], &out[1], 1.0);
    // A contraction, where cuTENSOR is installed.
    let (p, q, r, s) = (3, 4, 5, 6);
    let x: Vec<f64> = random(&mut rng, p * q * r);
    let y: Vec<f64> = random(&mut rng, r * s);
    let mut out = Vec::new();
    for engine in [&mut gpu, &mut sim] {
        let tx = upload_tensor(engine, &x, &[p, q, r]).unwrap();
        let ty = upload_tensor(engine, &y, &[r, s]).unwrap();
        let mut tz = engine.full(&[p, s, q], 0.5f64).unwrap();
        match engine.contract("abk,kc->acb", 2.0, &tx, &ty, 1.0, &mut tz) {
            Err(Error::Setup(SetupError::Unavailable {
                library: "cuTENSOR",
                ..
            })) => return,
            other => other.unwrap(),
        }
        out.push(download_tensor(engine, &tz).unwrap());
    }
    close("contract", &out[0], &out[1], r as f64);
}
