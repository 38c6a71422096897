//! GPU tests, in one integration target so one binary carries them all. Every test needs a CUDA
//! device and is `#[ignore = "needs a CUDA device"]`: run them on a GPU machine with
//! `cargo test --release --test gpu -- --ignored --test-threads=1`. Each opens device 0.

mod awaiting;
#[cfg(feature = "safetensors")]
mod checkpoint;
mod collective;
mod common;
#[path = "../support/mod.rs"]
mod reference;

#[cfg(feature = "cubecl")]
mod cubecl;
mod duplex;
mod engine;
mod handoff;
mod kernels;
mod peer;
mod pending;
mod raw_scope;
mod registered;
#[cfg(target_os = "linux")]
mod sharing;
mod signal;
mod staging;
mod vendor;

/// Opens device 0, or fails the test with the reason.
pub fn engine() -> cuferry::CudaEngine {
    cuferry::CudaEngine::open(0).expect("CUDA device 0")
}
