//! The vendor libraries (cuBLAS, cuSOLVER, cuTENSOR), on either device, against host
//! references: on a GPU the libraries themselves, on the simulator its emulations with BLAS's
//! and LAPACK's semantics. cuTENSOR is not installed on every machine: where it is absent the
//! call must be a typed `Unavailable` naming it.

use super::Device;
use crate::support::{Rng, gemm_configs, gemm_operands};
use cuferry::error::{LibraryError, SetupError, UsageError};
use cuferry::{
    CudaEngine, Error, download_tensor,
    libs::{BlasElement, GemmConfig, Transpose},
    upload_tensor,
};

/// Whether `contract` can run: always on the simulator (it emulates cuTENSOR), and on a GPU where
/// the cuTENSOR library is installed.
fn cutensor_present(dev: Device) -> bool {
    // SAFETY: probing only `dlopen`s candidate library names.
    dev == Device::Sim || unsafe { cudarc::cutensor::sys::is_culib_present() }
}

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

pub(crate) fn gemm_matches_the_host_reference_for_f32_and_f64(dev: Device) {
    let mut engine = dev.engine();
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

pub(crate) fn matmul_multiplies_row_major_tensors(dev: Device) {
    let mut engine = dev.engine();
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

pub(crate) fn cholesky_solve_solves_symmetric_positive_definite_systems(dev: Device) {
    let mut engine = dev.engine();
    let mut rng = Rng::new(4200);
    cholesky_case::<f32>(&mut engine, &mut rng);
    cholesky_case::<f64>(&mut engine, &mut rng);
}

pub(crate) fn cholesky_solve_reports_a_matrix_that_is_not_positive_definite(dev: Device) {
    let mut engine = dev.engine();
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

pub(crate) fn vendor_calls_are_ordered_with_eager_kernels_without_a_host_wait(dev: Device) {
    // fill → gemm → scale → gemm, no synchronize in between: the data proves the order.
    let mut engine = dev.engine();
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

pub(crate) fn cutensor_contracts_where_present_and_is_a_typed_unavailable_where_absent(
    dev: Device,
) {
    let mut engine = dev.engine();
    let (i, k, j) = (4, 6, 5);
    let a: Vec<f32> = (0..i * k).map(|x| x as f32 * 0.5 - 3.0).collect();
    let b: Vec<f32> = (0..k * j).map(|x| 1.0 - x as f32 * 0.25).collect();
    let da = upload_tensor(&mut engine, &a, &[i, k]).unwrap();
    let db = upload_tensor(&mut engine, &b, &[k, j]).unwrap();
    let mut dc = engine.full(&[i, j], 1.0f32).unwrap();
    let present = cutensor_present(dev);
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

/// BLAS's `gemm`, column-major, summed over `k` in order: the simulator's stated semantics.
fn gemm_reference(g: &GemmConfig<f64>, a: &[f64], b: &[f64], c: &mut [f64]) {
    for j in 0..g.n {
        for i in 0..g.m {
            let mut sum = 0.0;
            for q in 0..g.k {
                let x = match g.transa {
                    Transpose::No => a[i + q * g.lda],
                    Transpose::Yes => a[q + i * g.lda],
                };
                let y = match g.transb {
                    Transpose::No => b[q + j * g.ldb],
                    Transpose::Yes => b[j + q * g.ldb],
                };
                sum += x * y;
            }
            let old = c[i + j * g.ldc];
            c[i + j * g.ldc] = if g.beta == 0.0 {
                g.alpha * sum
            } else {
                g.alpha * sum + g.beta * old
            };
        }
    }
}

/// The row-major product of `a` (`m × k`) and `b` (`k × n`).
pub(crate) fn product(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|q| a[i * k + q] * b[q * n + j]).sum();
        }
    }
    out
}

/// Small integers (exact in every sum here), never all zero.
pub(crate) fn values(n: usize, salt: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7 + salt * 3) % 11) as f64 - 4.0)
        .collect()
}

/// A symmetric positive definite matrix: `M·Mᵀ + n·I`, row-major (which is column-major too).
pub(crate) fn spd(n: usize) -> Vec<f64> {
    let m = values(n * n, 6);
    let mut a = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            a[i * n + j] = (0..n).map(|q| m[i * n + q] * m[j * n + q]).sum::<f64>();
        }
        a[i * n + i] += n as f64;
    }
    a
}

pub(crate) fn gemm_follows_blas_with_transposes_leading_dimensions_and_scales(dev: Device) {
    let mut engine = dev.engine();
    for (alpha, beta) in [(1.0, 0.0), (2.0, 0.5), (-1.5, 1.0)] {
        for config in gemm_configs(3, 4, 5, alpha, beta) {
            let [(_, a_cols), (_, b_cols)] = gemm_operands(&config);
            let a = values(config.lda * a_cols, 1);
            let b = values(config.ldb * b_cols, 2);
            let mut want = values(config.ldc * config.n, 3);
            let ta = upload_tensor(&mut engine, &a, &[a.len()]).unwrap();
            let tb = upload_tensor(&mut engine, &b, &[b.len()]).unwrap();
            let mut tc = upload_tensor(&mut engine, &want, &[want.len()]).unwrap();
            engine.gemm(&config, &ta, &tb, &mut tc).unwrap();
            gemm_reference(&config, &a, &b, &mut want);
            let (ta, tb) = (config.transa, config.transb);
            assert_eq!(
                download_tensor(&mut engine, &tc).unwrap(),
                want,
                "{ta:?} {tb:?} alpha {alpha} beta {beta}"
            );
        }
    }
    // A zero beta ignores C, NaNs included; f32 runs in f32.
    let a = [1.0f32, 2.0, 3.0, 4.0];
    let ta = upload_tensor(&mut engine, &a, &[2, 2]).unwrap();
    let mut tc = upload_tensor(&mut engine, &[f32::NAN; 4], &[2, 2]).unwrap();
    engine
        .gemm(&GemmConfig::new(2, 2, 2, 1.0, 0.0), &ta, &ta, &mut tc)
        .unwrap();
    // Column-major [[1, 3], [2, 4]] squared is [[7, 15], [10, 22]].
    assert_eq!(
        download_tensor(&mut engine, &tc).unwrap(),
        [7.0, 10.0, 15.0, 22.0]
    );
    Device::no_violations(&engine);
}
pub(crate) fn matmul_is_the_row_major_product_in_both_precisions(dev: Device) {
    let mut engine = dev.engine();
    let (m, k, n) = (3, 5, 2);
    let (a, b) = (values(m * k, 4), values(k * n, 5));
    let ta = upload_tensor(&mut engine, &a, &[m, k]).unwrap();
    let tb = upload_tensor(&mut engine, &b, &[k, n]).unwrap();
    let c = engine.matmul(&ta, &tb).unwrap();
    assert_eq!(c.shape(), [m, n]);
    assert_eq!(
        download_tensor(&mut engine, &c).unwrap(),
        product(&a, &b, m, k, n)
    );
    let a32: Vec<f32> = a.iter().map(|&x| x as f32).collect();
    let b32: Vec<f32> = b.iter().map(|&x| x as f32).collect();
    let ta = upload_tensor(&mut engine, &a32, &[m, k]).unwrap();
    let tb = upload_tensor(&mut engine, &b32, &[k, n]).unwrap();
    let c = engine.matmul(&ta, &tb).unwrap();
    let want: Vec<f32> = product(&a, &b, m, k, n).iter().map(|&x| x as f32).collect();
    assert_eq!(download_tensor(&mut engine, &c).unwrap(), want);
    // An empty inner dimension: zeros.
    let ta = upload_tensor(&mut engine, &[0.0f64; 0], &[2, 0]).unwrap();
    let tb = upload_tensor(&mut engine, &[0.0f64; 0], &[0, 3]).unwrap();
    let c = engine.matmul(&ta, &tb).unwrap();
    assert_eq!(download_tensor(&mut engine, &c).unwrap(), [0.0; 6]);
}
pub(crate) fn cholesky_solve_leaves_the_factor_and_solves_in_both_precisions(dev: Device) {
    let mut engine = dev.engine();
    let n = 5;
    let a = spd(n);
    // Two right-hand sides, one after the other.
    let b = values(2 * n, 7);
    let mut ta = upload_tensor(&mut engine, &a, &[n, n]).unwrap();
    let mut tb = upload_tensor(&mut engine, &b, &[2, n]).unwrap();
    engine
        .cholesky_solve(&mut ta, &mut tb)
        .unwrap()
        .check(&mut engine)
        .unwrap();
    let x = download_tensor(&mut engine, &tb).unwrap();
    for r in 0..2 {
        for i in 0..n {
            let ax: f64 = (0..n).map(|j| a[i * n + j] * x[r * n + j]).sum();
            assert!(
                (ax - b[r * n + i]).abs() < 1e-9,
                "row {i} of system {r}: {ax}"
            );
        }
    }
    // The factor L is left in the lower triangle (column-major): L·Lᵀ is A.
    let l = download_tensor(&mut engine, &ta).unwrap();
    let at = |i: usize, j: usize| if i >= j { l[i + j * n] } else { 0.0 };
    for i in 0..n {
        for j in 0..=i {
            let llt: f64 = (0..n).map(|q| at(i, q) * at(j, q)).sum();
            assert!((llt - a[i + j * n]).abs() < 1e-9, "({i}, {j})");
        }
    }
    // The workspace was freed after the solve ran, never under it.
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
    let f32_a: Vec<f32> = a.iter().map(|&x| x as f32).collect();
    let f32_b: Vec<f32> = b.iter().map(|&x| x as f32).collect();
    let mut ta = upload_tensor(&mut engine, &f32_a, &[n, n]).unwrap();
    let mut tb = upload_tensor(&mut engine, &f32_b, &[2, n]).unwrap();
    engine
        .cholesky_solve(&mut ta, &mut tb)
        .unwrap()
        .check(&mut engine)
        .unwrap();
    let x32 = download_tensor(&mut engine, &tb).unwrap();
    for (got, want) in x32.iter().zip(&x) {
        assert!((f64::from(*got) - want).abs() < 1e-4, "{got} vs {want}");
    }
}
pub(crate) fn a_matrix_that_is_not_positive_definite_is_reported_by_check_with_its_order(
    dev: Device,
) {
    let mut engine = dev.engine();
    // The leading 1×1 minor is positive, the 2×2 one is not (determinant 1 - 4 < 0).
    let mut a = upload_tensor(&mut engine, &[1.0f64, 2.0, 2.0, 1.0], &[2, 2]).unwrap();
    let mut b = upload_tensor(&mut engine, &[1.0f64, 1.0], &[2]).unwrap();
    let status = engine.cholesky_solve(&mut a, &mut b).unwrap();
    let err = status.check(&mut engine).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Library(LibraryError::NotPositiveDefinite {
                operation: "cholesky_solve",
                order: 2
            })
        ),
        "{err:?}"
    );
}
pub(crate) fn contract_sums_over_the_modes_the_output_lacks(dev: Device) {
    if !cutensor_present(dev) {
        println!("cuTENSOR is absent: `cutensor_contracts_where_present_...` checks the refusal");
        return;
    }
    let mut engine = dev.engine();
    let (i, k, j) = (3, 4, 2);
    let (a, b) = (values(i * k, 8), values(k * j, 9));
    let ta = upload_tensor(&mut engine, &a, &[i, k]).unwrap();
    let tb = upload_tensor(&mut engine, &b, &[k, j]).unwrap();
    // A matrix product, as matmul computes it.
    let mut tc = upload_tensor(&mut engine, &[f64::NAN; 6], &[i, j]).unwrap();
    engine
        .contract("ik,kj->ij", 1.0, &ta, &tb, 0.0, &mut tc)
        .unwrap();
    assert_eq!(
        download_tensor(&mut engine, &tc).unwrap(),
        product(&a, &b, i, k, j)
    );
    // The transposed product, accumulated: C = 2·(A·B)ᵀ + C.
    let old = values(j * i, 10);
    let mut tt = upload_tensor(&mut engine, &old, &[j, i]).unwrap();
    engine
        .contract("ik,kj->ji", 2.0, &ta, &tb, 1.0, &mut tt)
        .unwrap();
    let ab = product(&a, &b, i, k, j);
    let want: Vec<f64> = (0..j * i)
        .map(|x| {
            let (r, c) = (x / i, x % i);
            2.0 * ab[c * j + r] + old[x]
        })
        .collect();
    assert_eq!(download_tensor(&mut engine, &tt).unwrap(), want);
    // A batch of products over a leading mode, in f32: "abk,kc->abc".
    let (p, q) = (2, 3);
    let x = values(p * q * k, 11);
    let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let b32: Vec<f32> = b.iter().map(|&v| v as f32).collect();
    let tx = upload_tensor(&mut engine, &x32, &[p, q, k]).unwrap();
    let tb32 = upload_tensor(&mut engine, &b32, &[k, j]).unwrap();
    let mut ty = upload_tensor(&mut engine, &vec![0.0f32; p * q * j], &[p, q, j]).unwrap();
    engine
        .contract("abk,kc->abc", 1.0, &tx, &tb32, 0.0, &mut ty)
        .unwrap();
    let want: Vec<f32> = product(&x, &b, p * q, k, j)
        .iter()
        .map(|&v| v as f32)
        .collect();
    assert_eq!(download_tensor(&mut engine, &ty).unwrap(), want);
}

/// Another engine's tensor is refused as such, before the library is asked.
pub(crate) fn a_foreign_operand_is_refused_before_the_library_is_asked(dev: Device) {
    let mut engine = dev.engine();
    let mut other = dev.engine();
    let a = upload_tensor(&mut engine, &[1.0f64; 4], &[2, 2]).unwrap();
    let mut c = upload_tensor(&mut engine, &[0.0f64; 4], &[2, 2]).unwrap();
    let foreign = upload_tensor(&mut other, &[1.0f64; 4], &[2, 2]).unwrap();
    let mut foreign_rhs = upload_tensor(&mut other, &[1.0f64; 2], &[2]).unwrap();
    let mut own = upload_tensor(&mut engine, &[4.0f64, 1.0, 1.0, 3.0], &[2, 2]).unwrap();
    let wrong_device = |r: Result<(), Error>| {
        assert!(
            matches!(r, Err(Error::Usage(UsageError::WrongEngine { .. }))),
            "{r:?}"
        );
    };
    wrong_device(engine.gemm(&GemmConfig::new(2, 2, 2, 1.0, 0.0), &a, &foreign, &mut c));
    wrong_device(engine.matmul(&foreign, &a).map(drop));
    wrong_device(engine.cholesky_solve(&mut own, &mut foreign_rhs).map(drop));
    wrong_device(engine.contract("ik,kj->ij", 1.0, &a, &foreign, 0.0, &mut c));
}

pub(crate) fn vendor_arguments_are_validated_before_the_library_is_asked(dev: Device) {
    let mut engine = dev.engine();
    let a = upload_tensor(&mut engine, &[1.0f64; 6], &[2, 3]).unwrap();
    let mut c = upload_tensor(&mut engine, &[0.0f64; 4], &[2, 2]).unwrap();
    // A is 2×3 with lda = 2: 6 elements; asking for k = 4 needs 8.
    let err = engine
        .gemm(&GemmConfig::new(2, 2, 4, 1.0, 0.0), &a, &a, &mut c)
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Usage(UsageError::MatrixExceedsTensor {
                operation: "gemm",
                needed: 8,
                ..
            })
        ),
        "{err}"
    );
    let err = engine.matmul(&a, &a).unwrap_err();
    assert!(err.to_string().contains("inner dimensions differ"), "{err}");
    let mut not_square = upload_tensor(&mut engine, &[1.0f64; 6], &[2, 3]).unwrap();
    let mut rhs = upload_tensor(&mut engine, &[1.0f64; 2], &[2]).unwrap();
    assert!(matches!(
        engine.cholesky_solve(&mut not_square, &mut rhs),
        Err(Error::Usage(UsageError::NotSquare { .. }))
    ));
    let b = upload_tensor(&mut engine, &[1.0f64; 4], &[2, 2]).unwrap();
    let err = engine
        .contract("ik,kj", 1.0, &b, &b, 0.0, &mut c)
        .unwrap_err();
    assert!(matches!(
        err,
        Error::Usage(UsageError::Expression {
            operation: "contract",
            ..
        })
    ));
    let err = engine
        .contract("ik,kj->ij", 1.0, &a, &b, 0.0, &mut c)
        .unwrap_err();
    assert!(
        err.to_string().contains("mode 'k' has extents 3 and 2"),
        "{err}"
    );
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; vendor::{
            gemm_matches_the_host_reference_for_f32_and_f64,
            matmul_multiplies_row_major_tensors,
            cholesky_solve_solves_symmetric_positive_definite_systems,
            cholesky_solve_reports_a_matrix_that_is_not_positive_definite,
            vendor_calls_are_ordered_with_eager_kernels_without_a_host_wait,
            cutensor_contracts_where_present_and_is_a_typed_unavailable_where_absent,
            gemm_follows_blas_with_transposes_leading_dimensions_and_scales,
            matmul_is_the_row_major_product_in_both_precisions,
            cholesky_solve_leaves_the_factor_and_solves_in_both_precisions,
            a_matrix_that_is_not_positive_definite_is_reported_by_check_with_its_order,
            contract_sums_over_the_modes_the_output_lacks,
            a_foreign_operand_is_refused_before_the_library_is_asked,
            vendor_arguments_are_validated_before_the_library_is_asked,
        });
    };
}
pub(crate) use tests;
