//! CubeCL interop on the simulated device (feature `cubecl`): CubeCL's CUDA runtime cannot drive
//! it, so `with_cubecl` is a typed `Unavailable`, and the closure never runs.
#![cfg(feature = "cubecl")]

use cuferry::error::SetupError;
use cuferry::sim::SimConfig;
use cuferry::{CudaEngine, Error};

// Simulator-only: the simulated device has no CubeCL runtime, so the refusal is its own (the GPU suite runs CubeCL kernels in `tests/gpu/cubecl.rs`).
#[test]
fn with_cubecl_on_the_simulated_device_is_unavailable() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut ran = false;
    let result = engine.with_cubecl(|_| {
        ran = true;
        Ok::<_, Error>(())
    });
    match result {
        Err(Error::Setup(SetupError::Unavailable { library, detail })) => {
            assert_eq!(library, "CubeCL");
            assert!(detail.contains("simulated device"));
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(!ran);
}
