//! Vendor libraries on the simulated device: every call is a typed `Unavailable` naming the
//! library ("simulated device"), after argument validation, and nothing is queued.

use cuferry::sim::{SimConfig, SimOp};
use cuferry::{upload_tensor, CudaEngine, Error, GemmConfig};

fn unavailable(result: Result<impl std::fmt::Debug, Error>, library: &str) {
    match result {
        Err(Error::Unavailable { library: l, detail }) => {
            assert_eq!(l, library);
            assert!(detail.contains("simulated device"), "{detail}");
        }
        other => panic!("expected Unavailable for {library}, got {other:?}"),
    }
}

#[test]
fn vendor_calls_on_the_simulated_device_are_unavailable() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().unwrap();
    let a = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let b = upload_tensor(&mut engine, &[1.0f32, 0.0, 0.0, 1.0], &[2, 2]).unwrap();
    let mut c = upload_tensor(&mut engine, &[0.0f32; 4], &[2, 2]).unwrap();

    unavailable(
        engine.gemm(&GemmConfig::new(2, 2, 2, 1.0, 0.0), &a, &b, &mut c),
        "cuBLAS",
    );
    unavailable(engine.matmul(&a, &b), "cuBLAS");
    let mut a64 = upload_tensor(&mut engine, &[4.0f64, 1.0, 1.0, 3.0], &[2, 2]).unwrap();
    let mut b64 = upload_tensor(&mut engine, &[1.0f64, 2.0], &[2]).unwrap();
    unavailable(engine.cholesky_solve(&mut a64, &mut b64), "cuSOLVER");
    unavailable(
        engine.contract("ik,kj->ij", 1.0, &a, &b, 0.0, &mut c),
        "cuTENSOR",
    );
    // Nothing was launched or queued for the device to compute.
    assert_eq!(sim.calls(SimOp::Launch), 0);
    assert_eq!(sim.calls(SimOp::ModuleLoad), 0);
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
        matches!(&err, Error::InvalidArgument { operation: "gemm", detail } if detail.contains("needs 8")),
        "{err}"
    );
    let err = engine.matmul(&a, &a).unwrap_err();
    assert!(err.to_string().contains("inner dimensions differ"), "{err}");
    let mut not_square = upload_tensor(&mut engine, &[1.0f64; 6], &[2, 3]).unwrap();
    let mut rhs = upload_tensor(&mut engine, &[1.0f64; 2], &[2]).unwrap();
    assert!(matches!(
        engine.cholesky_solve(&mut not_square, &mut rhs),
        Err(Error::InvalidArgument { .. })
    ));
    let b = upload_tensor(&mut engine, &[1.0f64; 4], &[2, 2]).unwrap();
    let err = engine
        .contract("ik,kj", 1.0, &b, &b, 0.0, &mut c)
        .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidArgument {
            operation: "contract",
            ..
        }
    ));
    let err = engine
        .contract("ik,kj->ij", 1.0, &a, &b, 0.0, &mut c)
        .unwrap_err();
    assert!(
        err.to_string().contains("mode 'k' has extents 3 and 2"),
        "{err}"
    );
}
