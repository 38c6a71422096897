//! cuBLAS, cuSOLVER and cuTENSOR on the GPU, against host references. cuTENSOR is not installed
//! on every machine: where it is absent the call must be a typed `Unavailable` naming it.

use crate::engine;
use crate::reference::Rng;
use cuferry::error::{LibraryError, SetupError, UsageError};
use cuferry::{
    CudaEngine, Error, download_tensor,
    libs::{BlasElement, GemmConfig, Transpose},
    upload_tensor,
};

/// Column-major host gemm, accumulated in f64.
#[allow(clippy::too_many_arguments)]
fn host_gemm(
    ta: Transpose,
    tb: Transpose,
    m: usize,
    n: usize,
    k: usize,
    alpha: f64,
    a: &[f64],
    lda: usize,
    b: &[f64],
    ldb: usize,
    beta: f64,
    c: &mut [f64],
    ldc: usize,
) {
    let at = |i: usize, p: usize| match ta {
        Transpose::No => a[i + p * lda],
        Transpose::Yes => a[p + i * lda],
    };
    let bt = |p: usize, j: usize| match tb {
        Transpose::No => b[p + j * ldb],
        Transpose::Yes => b[j + p * ldb],
    };
    for j in 0..n {
        for i in 0..m {
            let sum: f64 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
            c[i + j * ldc] = alpha * sum + beta * c[i + j * ldc];
        }
    }
}

trait Real: BlasElement + Copy {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    const TOLERANCE: f64;
}

impl Real for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    const TOLERANCE: f64 = 1e-4;
}

impl Real for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    const TOLERANCE: f64 = 1e-11;
}

fn random<T: Real>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| {
            let v = rng.unit();
            T::from_f64(if v == 0.0 { 0.5 } else { v })
        })
        .collect()
}

fn assert_close<T: Real>(what: &str, got: &[T], want: &[f64], scale: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g.to_f64() - w).abs();
        assert!(
            err <= T::TOLERANCE * scale.max(1.0),
            "{what}: element {i} is {}, expected {w} (error {err})",
            g.to_f64()
        );
    }
}

fn gemm_case<T: Real>(engine: &mut CudaEngine, rng: &mut Rng, ta: Transpose, tb: Transpose) {
    let (m, n, k) = (37, 29, 43);
    let (ar, ac) = if ta == Transpose::No { (m, k) } else { (k, m) };
    let (br, bc) = if tb == Transpose::No { (k, n) } else { (n, k) };
    // Leading dimensions larger than the row counts, so padding is exercised.
    let (lda, ldb, ldc) = (ar + 3, br + 1, m + 5);
    let a: Vec<T> = random(rng, lda * ac);
    let b: Vec<T> = random(rng, ldb * bc);
    let c: Vec<T> = random(rng, ldc * n);
    let (alpha, beta) = (T::from_f64(1.5), T::from_f64(-0.25));
    let da = upload_tensor(engine, &a, &[a.len()]).unwrap();
    let db = upload_tensor(engine, &b, &[b.len()]).unwrap();
    let mut dc = upload_tensor(engine, &c, &[c.len()]).unwrap();
    let config = GemmConfig {
        transa: ta,
        transb: tb,
        m,
        n,
        k,
        alpha,
        beta,
        lda,
        ldb,
        ldc,
    };
    engine.gemm(&config, &da, &db, &mut dc).unwrap();
    let got = download_tensor(engine, &dc).unwrap();
    let f = |v: &[T]| v.iter().map(|x| x.to_f64()).collect::<Vec<_>>();
    let mut want = f(&c);
    host_gemm(
        ta,
        tb,
        m,
        n,
        k,
        1.5,
        &f(&a),
        lda,
        &f(&b),
        ldb,
        -0.25,
        &mut want,
        ldc,
    );
    assert_close(&format!("gemm {ta:?}/{tb:?}"), &got, &want, k as f64);
}

#[test]
#[ignore = "needs a CUDA device"]
fn gemm_matches_the_host_reference_for_f32_and_f64() {
    let mut engine = engine();
    let mut rng = Rng::new(4000);
    for ta in [Transpose::No, Transpose::Yes] {
        for tb in [Transpose::No, Transpose::Yes] {
            gemm_case::<f32>(&mut engine, &mut rng, ta, tb);
            gemm_case::<f64>(&mut engine, &mut rng, ta, tb);
        }
    }
    engine.synchronize().unwrap();
}

fn matmul_case<T: Real>(engine: &mut CudaEngine, rng: &mut Rng) {
    let (m, k, n) = (5, 7, 3);
    let a: Vec<T> = random(rng, m * k);
    let b: Vec<T> = random(rng, k * n);
    let da = upload_tensor(engine, &a, &[m, k]).unwrap();
    let db = upload_tensor(engine, &b, &[k, n]).unwrap();
    let dc = engine.matmul(&da, &db).unwrap();
    assert_eq!(dc.shape(), [m, n]);
    let got = download_tensor(engine, &dc).unwrap();
    let mut want = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            want[i * n + j] = (0..k)
                .map(|p| a[i * k + p].to_f64() * b[p * n + j].to_f64())
                .sum();
        }
    }
    assert_close("matmul (row-major)", &got, &want, k as f64);
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_multiplies_row_major_tensors() {
    let mut engine = engine();
    let mut rng = Rng::new(4100);
    matmul_case::<f32>(&mut engine, &mut rng);
    matmul_case::<f64>(&mut engine, &mut rng);
    let a = upload_tensor(&mut engine, &[1.0f32; 6], &[2, 3]).unwrap();
    assert!(matches!(
        engine.matmul(&a, &a),
        Err(Error::Usage(UsageError::InnerDimensions { .. }))
    ));
}

fn cholesky_case<T: Real>(engine: &mut CudaEngine, rng: &mut Rng) {
    let n = 24;
    let nrhs = 3;
    // A = M·Mᵀ + n·I is symmetric positive definite.
    let m: Vec<f64> = (0..n * n).map(|_| rng.unit()).collect();
    let mut a = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            a[i + j * n] = (0..n).map(|p| m[i + p * n] * m[j + p * n]).sum::<f64>()
                + if i == j { n as f64 } else { 0.0 };
        }
    }
    let b: Vec<f64> = (0..n * nrhs).map(|_| rng.unit()).collect();
    let to_t = |v: &[f64]| v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>();
    let mut da = upload_tensor(engine, &to_t(&a), &[n, n]).unwrap();
    let mut db = upload_tensor(engine, &to_t(&b), &[nrhs, n]).unwrap();
    let status = engine.cholesky_solve(&mut da, &mut db).unwrap();
    status.check(engine).unwrap();
    let x = download_tensor(engine, &db).unwrap();
    // A·X must reproduce B.
    for r in 0..nrhs {
        for i in 0..n {
            let ax: f64 = (0..n).map(|j| a[i + j * n] * x[j + r * n].to_f64()).sum();
            let err = (ax - b[i + r * n]).abs();
            assert!(
                err <= T::TOLERANCE * 1e3 * n as f64,
                "cholesky_solve {}: row {i} of rhs {r}: A·x = {ax}, b = {} (error {err})",
                std::any::type_name::<T>(),
                b[i + r * n]
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cholesky_solve_solves_symmetric_positive_definite_systems() {
    let mut engine = engine();
    let mut rng = Rng::new(4200);
    cholesky_case::<f32>(&mut engine, &mut rng);
    cholesky_case::<f64>(&mut engine, &mut rng);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cholesky_solve_reports_a_matrix_that_is_not_positive_definite() {
    let mut engine = engine();
    // diag(1, -1, 1): the leading minor of order 2 is not positive definite.
    let a = [1.0f64, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 1.0];
    let mut da = upload_tensor(&mut engine, &a, &[3, 3]).unwrap();
    let mut db = upload_tensor(&mut engine, &[1.0f64, 2.0, 3.0], &[3]).unwrap();
    let status = engine.cholesky_solve(&mut da, &mut db).unwrap();
    match status.check(&mut engine) {
        Err(Error::Library(LibraryError::NotPositiveDefinite { order, .. })) => {
            assert_eq!(order, 2)
        }
        other => panic!("expected NotPositiveDefinite, got {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn vendor_calls_are_ordered_with_eager_kernels_without_a_host_wait() {
    // fill → gemm → scale → gemm, no synchronize in between: the data proves the order.
    let mut engine = engine();
    let n = 64;
    let mut a = engine.full(&[n, n], 0.0f64).unwrap();
    engine.fill(&mut a, 2.0).unwrap();
    let b = engine.full(&[n, n], 0.5f64).unwrap();
    let c = engine.matmul(&a, &b).unwrap(); // every element 2·0.5·64 = 64
    let c = engine.scale(&c, 0.25).unwrap(); // 16
    let d = engine.matmul(&c, &b).unwrap(); // 16·0.5·64 = 512
    let got = download_tensor(&mut engine, &d).unwrap();
    assert!(got.iter().all(|&x| x == 512.0), "first element {}", got[0]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cutensor_contracts_where_present_and_is_a_typed_unavailable_where_absent() {
    let mut engine = engine();
    let (i, k, j) = (4, 6, 5);
    let a: Vec<f32> = (0..i * k).map(|x| x as f32 * 0.5 - 3.0).collect();
    let b: Vec<f32> = (0..k * j).map(|x| 1.0 - x as f32 * 0.25).collect();
    let da = upload_tensor(&mut engine, &a, &[i, k]).unwrap();
    let db = upload_tensor(&mut engine, &b, &[k, j]).unwrap();
    let mut dc = engine.full(&[i, j], 1.0f32).unwrap();
    // SAFETY: probing only `dlopen`s candidate library names.
    let present = unsafe { cudarc::cutensor::sys::is_culib_present() };
    let result = engine.contract("ik,kj->ij", 2.0, &da, &db, 0.5, &mut dc);
    if !present {
        match result {
            Err(Error::Setup(SetupError::Unavailable { library, detail })) => {
                assert_eq!(library, "cuTENSOR");
                assert!(detail.contains("cutensor"), "{detail}");
            }
            other => panic!("cuTENSOR is absent: expected Unavailable, got {other:?}"),
        }
        return;
    }
    result.unwrap();
    let got = download_tensor(&mut engine, &dc).unwrap();
    for r in 0..i {
        for c in 0..j {
            let want: f32 = 2.0 * (0..k).map(|p| a[r * k + p] * b[p * j + c]).sum::<f32>() + 0.5;
            let g = got[r * j + c];
            assert!((g - want).abs() < 1e-3, "({r}, {c}): {g} vs {want}");
        }
    }
}

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
