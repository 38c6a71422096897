//! GPU tests, in one integration target so one binary carries them all. Every test needs a CUDA
//! device and is ignored by default: run them with `cargo test --test gpu -- --ignored` on a
//! machine with a GPU. Each opens `CudaEngine::open(0)`.

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "cubecl")]
mod cubecl;
mod kernels;
mod raw_scope;
mod vendor;

/// Opens device 0, or fails the test with the reason.
pub fn engine() -> cuferry::CudaEngine {
    cuferry::CudaEngine::open(0).expect("CUDA device 0")
}
