//! The vendor libraries on the simulated device: `gemm`, `matmul`, `cholesky_solve` and
//! `contract` run there, through the same seam and the same lifecycle code as on a GPU, with
//! BLAS's and LAPACK's semantics (see the simulator's `libs` module): results against host
//! references, stream order under interleaved schedules, a typed failure and nothing lost at a
//! fault of every library call, and arguments refused before the library is asked.

use crate::support::{gemm_configs, gemm_operands};
use cuferry::error::{DriverError, LibraryError, UsageError};
use cuferry::libs::{GemmConfig, Transpose};
use cuferry::sim::{Schedule, SimConfig, SimDevice, SimOp};
use cuferry::{CudaEngine, DeviceTensor, Error, download_tensor, upload_tensor};

/// Every operation the stream has been given so far, run or not.
fn enqueued(sim: &SimDevice) -> u64 {
    sim.completed() + sim.queued() as u64
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
fn product(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|q| a[i * k + q] * b[q * n + j]).sum();
        }
    }
    out
}

/// Small integers (exact in every sum here), never all zero.
fn values(n: usize, salt: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7 + salt * 3) % 11) as f64 - 4.0)
        .collect()
}

#[test]
fn gemm_follows_blas_with_transposes_leading_dimensions_and_scales() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().unwrap();
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
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn matmul_is_the_row_major_product_in_both_precisions() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
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

/// A symmetric positive definite matrix: `M·Mᵀ + n·I`, row-major (which is column-major too).
fn spd(n: usize) -> Vec<f64> {
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

#[test]
fn cholesky_solve_solves_symmetric_positive_definite_systems() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().unwrap();
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
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
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

#[test]
fn a_matrix_that_is_not_positive_definite_is_reported_by_check_with_its_order() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
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

#[test]
fn contract_sums_over_the_modes_the_output_lacks() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
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

/// Uploads on one stream, the library call on another, the download on a third: the engine's
/// order makes every schedule compute what program order computes, with no race.
#[test]
fn library_calls_are_ordered_with_the_copies_under_any_schedule() {
    let n = 4;
    let a = spd(n);
    let rhs = values(n, 12);
    let mut want = None;
    for seed in 0..12 {
        let mut engine = CudaEngine::simulated(SimConfig::default());
        let sim = engine.sim().unwrap();
        if seed > 0 {
            sim.set_schedule(Schedule::Interleaved { seed });
        }
        let ta = upload_tensor(&mut engine, &a, &[n, n]).unwrap();
        let c = engine.matmul(&ta, &ta).unwrap();
        let mut d = upload_tensor(&mut engine, &vec![0.0; n * n], &[n, n]).unwrap();
        engine
            .contract("ik,kj->ij", 1.0, &c, &ta, 0.0, &mut d)
            .unwrap();
        let mut factor = upload_tensor(&mut engine, &a, &[n, n]).unwrap();
        let mut x = upload_tensor(&mut engine, &rhs, &[n]).unwrap();
        let status = engine.cholesky_solve(&mut factor, &mut x).unwrap();
        let got = (
            download_tensor(&mut engine, &d).unwrap(),
            download_tensor(&mut engine, &x).unwrap(),
        );
        status.check(&mut engine).unwrap();
        drop((ta, c, d, factor, x));
        engine.synchronize().unwrap();
        assert!(
            sim.violations().is_empty(),
            "seed {seed}: {:?}",
            sim.violations()
        );
        assert_eq!(sim.device_live().0, 0, "seed {seed}: memory left");
        match &want {
            None => want = Some(got),
            Some(want) => assert_eq!(&got, want, "seed {seed}"),
        }
    }
}

/// The library calls and what they allocate, with the failure a real one could report.
const OPS: [(SimOp, DriverError); 9] = [
    (SimOp::LibraryOpen, DriverError::UNKNOWN),
    (SimOp::Gemm, DriverError::LAUNCH_FAILED),
    (SimOp::SolverWorkspace, DriverError::INVALID_VALUE),
    (SimOp::Potrf, DriverError::LAUNCH_FAILED),
    (SimOp::Potrs, DriverError::LAUNCH_FAILED),
    (SimOp::ContractionPlan, DriverError::OUT_OF_MEMORY),
    (SimOp::Contract, DriverError::LAUNCH_FAILED),
    (SimOp::Alloc, DriverError::INVALID_VALUE),
    (SimOp::Free, DriverError::INVALID_VALUE),
];

/// Every library operation once, with its result checked. Returns the first error (stopping
/// there, dropping what it holds, as a caller's `?` would).
fn workload(engine: &mut CudaEngine) -> Result<(), Error> {
    let n = 3;
    let a = spd(n);
    let ta = upload_tensor(engine, &a, &[n, n])?;
    let c = engine.matmul(&ta, &ta)?;
    assert_eq!(download_tensor(engine, &c)?, product(&a, &a, n, n, n));
    let mut d: DeviceTensor<f64> = engine.alloc_tensor(&[n, n])?;
    engine.gemm(&GemmConfig::new(n, n, n, 1.0, 0.0), &ta, &ta, &mut d)?;
    assert_eq!(download_tensor(engine, &d)?, product(&a, &a, n, n, n));
    engine.contract("ik,kj->ij", 1.0, &ta, &c, 0.0, &mut d)?;
    let mut factor = upload_tensor(engine, &a, &[n, n])?;
    let mut x = upload_tensor(engine, &[1.0, 2.0, 3.0], &[n])?;
    engine.cholesky_solve(&mut factor, &mut x)?.check(engine)?;
    let x = download_tensor(engine, &x)?;
    for i in 0..n {
        let ax: f64 = (0..n).map(|j| a[i * n + j] * x[j]).sum();
        assert!((ax - (i + 1) as f64).abs() < 1e-9);
    }
    Ok(())
}

/// One run of the workload with `arm` applied to a fresh engine: whether a failure was
/// reported; panics on a wrong result, an untyped error, a violation or a leak. A refused free
/// leaves its memory with the driver (`refused_frees` of them), never freed under queued work.
fn faulted(refused_frees: usize, arm: impl FnOnce(&SimDevice)) -> bool {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().unwrap();
    arm(&sim);
    let mut failed = match workload(&mut engine) {
        Ok(()) => false,
        Err(Error::Library(LibraryError::Vendor { .. }))
        | Err(Error::Driver { .. })
        | Err(Error::Deferred { .. }) => true,
        Err(other) => panic!("an untyped failure: {other:?}"),
    };
    sim.clear_faults();
    failed |= engine.synchronize().is_err();
    // The engine works on.
    workload(&mut engine).unwrap();
    let retained = engine.retirement_stats().retained;
    drop(engine);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    if retained == 0 {
        assert_eq!(
            sim.device_live().0,
            refused_frees,
            "device memory left allocated"
        );
    }
    failed
}

#[test]
fn a_fault_at_every_library_call_is_reported_and_loses_nothing() {
    let counts: Vec<u64> = {
        let mut engine = CudaEngine::simulated(SimConfig::default());
        let sim = engine.sim().unwrap();
        let before: Vec<u64> = OPS.iter().map(|&(op, _)| sim.calls(op)).collect();
        workload(&mut engine).unwrap();
        OPS.iter()
            .zip(before)
            .map(|(&(op, _), before)| sim.calls(op) - before)
            .collect()
    };
    // Each library call is reached (a workload that skipped one would sweep nothing there).
    for (&(op, _), &count) in OPS.iter().zip(&counts).take(7) {
        assert!(count >= 1, "{op:?} not reached");
    }
    let mut runs = 0;
    for (&(op, error), &count) in OPS.iter().zip(&counts) {
        for n in 1..=count {
            let refused_frees = usize::from(op == SimOp::Free);
            assert!(
                faulted(refused_frees, |sim| sim.fail_nth(op, n, error)),
                "a fault at {op:?} call {n} was not reported"
            );
            runs += 1;
        }
    }
    assert!(runs >= 20, "{runs} runs");
}

/// A library that cannot be opened is the library's typed failure, reported before anything is
/// allocated or queued, and every operand is left as it was.
#[test]
fn a_library_that_cannot_be_opened_refuses_before_anything_is_queued() {
    const A: [f32; 4] = [1.0, 2.0, 3.0, 4.0];
    const B: [f32; 4] = [0.5, -1.5, 2.5, -3.5];
    const C: [f32; 4] = [-7.25, 11.5, -13.75, 17.0];
    const A64: [f64; 4] = [4.0, 1.0, 1.0, 3.0];
    const B64: [f64; 2] = [-2.5, 6.25];
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().unwrap();
    let a = upload_tensor(&mut engine, &A, &[2, 2]).unwrap();
    let b = upload_tensor(&mut engine, &B, &[2, 2]).unwrap();
    let mut c = upload_tensor(&mut engine, &C, &[2, 2]).unwrap();
    let mut a64 = upload_tensor(&mut engine, &A64, &[2, 2]).unwrap();
    let mut b64 = upload_tensor(&mut engine, &B64, &[2]).unwrap();
    engine.synchronize().unwrap();
    let (allocs, ops, live) = (sim.calls(SimOp::Alloc), enqueued(&sim), sim.device_live());
    let refused = |result: Result<(), Error>, library: &str, call: &str| match result {
        Err(Error::Library(LibraryError::Vendor {
            library: l,
            call: c,
            ..
        })) => assert_eq!((l, c), (library, call)),
        other => panic!("expected {library}'s refusal, got {other:?}"),
    };
    let closed = || sim.fail_nth(SimOp::LibraryOpen, 1, DriverError::UNKNOWN);
    closed();
    refused(
        engine.gemm(&GemmConfig::new(2, 2, 2, 1.0, 0.0), &a, &b, &mut c),
        "cuBLAS",
        "cublasCreate_v2",
    );
    closed();
    refused(
        engine.cholesky_solve(&mut a64, &mut b64).map(drop),
        "cuSOLVER",
        "cusolverDnCreate",
    );
    closed();
    refused(
        engine.contract("ik,kj->ij", 1.0, &a, &b, 0.0, &mut c),
        "cuTENSOR",
        "cutensorCreate",
    );
    assert_eq!(sim.calls(SimOp::Alloc), allocs, "nothing was allocated");
    assert_eq!(enqueued(&sim), ops, "nothing was queued");
    closed();
    refused(engine.matmul(&a, &b).map(drop), "cuBLAS", "cublasCreate_v2");
    engine.synchronize().unwrap();
    assert_eq!(sim.device_live(), live, "matmul's output was freed");

    assert_eq!(download_tensor(&mut engine, &c).unwrap(), C, "C untouched");
    assert_eq!(download_tensor(&mut engine, &a).unwrap(), A);
    assert_eq!(download_tensor(&mut engine, &b).unwrap(), B);
    assert_eq!(download_tensor(&mut engine, &a64).unwrap(), A64);
    assert_eq!(download_tensor(&mut engine, &b64).unwrap(), B64);
    assert!(sim.violations().is_empty());
}

/// Another engine's tensor is refused as such, before the library is asked.
#[test]
fn a_foreign_operand_is_refused_before_the_library_is_asked() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut other = CudaEngine::simulated(SimConfig::default());
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

#[test]
fn vendor_arguments_are_validated_before_the_library_is_asked() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
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
