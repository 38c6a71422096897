//! The vendor libraries on the simulated device: `gemm`, `matmul`, `cholesky_solve` and
//! `contract` run there, through the same seam and the same lifecycle code as on a GPU, with
//! BLAS's and LAPACK's semantics (see the simulator's `libs` module): results against host
//! references, stream order under interleaved schedules, a typed failure and nothing lost at a
//! fault of every library call, and arguments refused before the library is asked.

use cuferry::error::{DriverError, LibraryError};
use cuferry::libs::GemmConfig;
use cuferry::sim::{Schedule, SimConfig, SimDevice, SimOp};
use cuferry::{CudaEngine, DeviceTensor, Error, download_tensor, upload_tensor};

// The host references the bodies use, shared with the simulator-only tests below.
use crate::bodies::vendor::{product, spd, values};

/// Written once in `tests/bodies/vendor.rs`, run here on the simulated device and by the GPU
/// suite on device 0 (in a module of their own: both suites had a Cholesky test of one name).
mod shared {
    crate::bodies::vendor::tests!(sim);
}

/// Every operation the stream has been given so far, run or not.
fn enqueued(sim: &SimDevice) -> u64 {
    sim.completed() + sim.queued() as u64
}

// Simulator-only: runs the streams under interleaved schedules and the race checker.
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

// Simulator-only: injects a fault at every library call.
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

// Simulator-only: makes a library fail to open.
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
