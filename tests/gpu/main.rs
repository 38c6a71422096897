//! GPU tests, in one integration target so one binary carries them all. Every test needs a CUDA
//! device and is `#[ignore = "needs a CUDA device"]`: run them on a GPU machine with
//! `cargo test --release --test gpu -- --ignored --test-threads=1`. Each opens device 0. The tests
//! written once in `tests/bodies/` run here (through `bodies!`) and on the simulated device in
//! `tests/sim/`, under the same names.

mod awaiting;
mod broadcast;
// DLPack exchange with other libraries (feature `dlpack`).
#[cfg(feature = "safetensors")]
mod checkpoint;
// The sweep behind the checkpoint loader's defaults.
#[cfg(feature = "safetensors")]
mod checkpoint_defaults;
mod collective;
mod common;
#[cfg(feature = "dlpack")]
mod dlpack;
// cudarc interop: lends to cudarc streams, adopted cudarc slices.
mod cudarc;
#[path = "../support/mod.rs"]
mod reference;
// The bodies name the shared helpers `crate::support`, as the simulator binary does.
use reference as support;

#[cfg(feature = "cubecl")]
mod cubecl;
mod duplex;
mod engine;
mod graphs;
mod handoff;
mod kernels;
mod lifecycle;
mod peer;
mod pending;
mod raw_scope;
mod registered;
#[cfg(target_os = "linux")]
mod sharing;
mod signal;
mod staging;
mod transfers;
mod vendor;

// The bodies run on both devices (`tests/bodies/`): here on device 0, each ignored unless asked
// for. The staged routes run with four copy threads, as on the simulator.
#[path = "../bodies/mod.rs"]
mod bodies;
#[path = "../support/copy_threads.rs"]
mod copy_threads;

/// Opens device 0, or fails the test with the reason.
pub fn engine() -> cuferry::CudaEngine {
    cuferry::CudaEngine::open(0).expect("CUDA device 0")
}
