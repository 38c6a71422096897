//! Vendor libraries on the simulated device: every call is a typed `Unavailable` naming the
//! library ("simulated device"), only after its arguments are validated, and it leaves every
//! operand as it was.

use cuferry::error::{SetupError, UsageError};
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{download_tensor, libs::GemmConfig, upload_tensor, CudaEngine, Error};

fn unavailable(result: Result<impl std::fmt::Debug, Error>, library: &str) {
    match result {
        Err(Error::Setup(SetupError::Unavailable { library: l, detail })) => {
            assert_eq!(l, library);
            assert!(detail.contains("simulated device"), "{detail}");
        }
        other => panic!("expected Unavailable for {library}, got {other:?}"),
    }
}

/// Every operation the stream has been given so far, run or not.
fn enqueued(sim: &SimDevice) -> u64 {
    sim.completed() + sim.queued() as u64
}

/// Outputs hold distinct, non-zero values before each call (so a call that zeroed, scaled or
/// wrote them is seen), and are read back afterwards: an `Unavailable` call must leave them, and
/// its inputs, exactly as they were. `gemm`, `cholesky_solve` and `contract` check the library
/// before they allocate (a workspace, cuSOLVER's `info`) or queue anything; `matmul` allocates
/// its output first, and must free it.
#[test]
fn vendor_calls_on_the_simulated_device_are_unavailable_and_touch_nothing() {
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

    unavailable(
        engine.gemm(&GemmConfig::new(2, 2, 2, 1.0, 0.0), &a, &b, &mut c),
        "cuBLAS",
    );
    unavailable(engine.cholesky_solve(&mut a64, &mut b64), "cuSOLVER");
    unavailable(
        engine.contract("ik,kj->ij", 1.0, &a, &b, 0.0, &mut c),
        "cuTENSOR",
    );
    assert_eq!(sim.calls(SimOp::Alloc), allocs, "nothing was allocated");
    assert_eq!(enqueued(&sim), ops, "nothing was queued");

    unavailable(engine.matmul(&a, &b), "cuBLAS");
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
