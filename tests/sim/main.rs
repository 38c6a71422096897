//! The simulated-device tests, in one binary with a module per feature: every route, lifecycle
//! and subsystem against the deterministic simulated device (feature `sim`), so CI checks what
//! the GPU runs without a GPU. The staged routes run with four copy threads (`support::
//! copy_threads`), so their parallel paths run on any machine. The tests written once in
//! `tests/bodies/` run here (through `bodies!`) and on CUDA device 0 in the GPU suite
//! (`tests/gpu/`), under the same names; what stays here needs the simulator (its fault
//! injection, its clock, its queue or its record of violations).

#[path = "../support/copy_threads.rs"]
mod copy_threads;
// The bodies run on both devices (`tests/bodies/`): here on the simulated device.
#[path = "../bodies/mod.rs"]
mod bodies;
#[macro_use]
#[path = "../support/mod.rs"]
mod support;

// Host transfers: the blocking routes, and the pending ones with their buffers.
// Checkpoint files (feature `safetensors`).
// DLPack exchange with other libraries (feature `dlpack`).
#[cfg(feature = "safetensors")]
mod checkpoint;
#[cfg(feature = "dlpack")]
mod dlpack;
mod handoff;
#[cfg(feature = "safetensors")]
mod landing;
mod pending;
mod registered;
mod transfers;
mod upload_into;
// `.await` on operations in flight.
mod awaiting;
// Staging leases and the lifecycles behind every route.
mod lifecycle;
mod staging;
// Several engines: signals, peer copies, the two-GPU pipeline, collectives (in one process, and
// across ranks that join one by one, with the multi-process example).
mod across_processes;
mod bootstrap;
mod collectives;
mod multi_process;
mod peer;
mod peer_pending;
#[cfg(target_os = "linux")]
mod sharing;
mod signals;
mod two_gpus;
// Work on the device: kernels, libraries, prepared graphs, raw scopes, CubeCL.
mod broadcast;
mod cubecl;
mod graphs;
mod kernels;
mod libs;
mod raw_scope;
// The engine itself, the Send/Sync design, and the bugs that were found.
mod engine;
mod fault_sweep;
mod memory;
mod regressions;
mod send_sync;
