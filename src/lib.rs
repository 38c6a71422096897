//! # cuferry
//!
//! A safe CUDA engine and the routes that move data between host and device, with their
//! lifecycles encoded in types.
//!
//! - [`CudaEngine`]: one device, one context, held by the caller, with three streams underneath
//!   (uploads, downloads, compute) and one order for the caller: work that shares a tensor runs
//!   in call order, ordered by event waits on the device; work that shares none runs at once
//!   ([the rules](guide::rules#one-order-three-streams)). Operations borrow it `&mut`;
//!   [`CudaEngine::flush`] is a submission boundary, [`CudaEngine::synchronize`] the explicit
//!   host barrier; [`CudaEngine::with_raw`] hands out the raw context, compute stream and device
//!   pointers inside a scope that restores the caller's context on return, error and unwind.
//! - [`DeviceTensor`]: a compact, shaped, stream-ordered device allocation of an [`Element`].
//! - Blocking routes: [`upload_tensor`], [`upload_tensor_into`], [`download_tensor`],
//!   [`download_tensor_into`], whose host copies run on one pool of threads shared by the
//!   process's engines ([`copy_threads`], [`set_copy_threads`]).
//! - Pending routes over page-locked buffers handed over by value: [`upload_pending`],
//!   [`download_pending`], returning a [`Pending`] transfer in state [`InFlight`] until it is
//!   [`Returned`]. The buffer is a [`PinnedHostBuffer`] (the engine's page-locked memory) or a
//!   [`RegisteredBuffer`] (a `Vec` of yours, page-locked in place); both are [`HostBuffer`]s. An
//!   in-flight transfer can be `.await`ed on any executor ([`PendingFuture`]), woken by the
//!   device.
//! - [`StagingLease`]: the `Proven/Unproven` typestate behind the blocking routes' bounded,
//!   pipelined pinned staging, public for hand-built chunked pipelines.
//! - Work on the engine's compute stream, with no host wait: elementwise kernels compiled once per engine
//!   ([`CudaEngine::add`] and the rest; semantics and supported types in [`kernels`]), cuBLAS,
//!   cuSOLVER and cuTENSOR bound to that stream ([`libs`]), and CubeCL kernels (feature
//!   `cubecl`, [`interop`]).
//! - Prepared graphs ([`graph`]): a computation traced once, compiled for fixed shapes into fused
//!   kernels and cuBLAS products, prepared for an engine ([`CudaEngine::prepare`]) and replayed as
//!   a CUDA graph ([`CudaEngine::run`]) for about the host cost of one graph launch.
//! - Several engines, several GPUs: a [`Signal`] orders one engine's work after another's on the
//!   device ([`CudaEngine::signal`], [`CudaEngine::wait_signal`]); [`peer_copy`],
//!   [`peer_copy_into`] and the pending [`peer_copy_pending`] copy a tensor to another engine,
//!   device to device ([`peer_copy_staged`] through host memory, when asked for by name); a
//!   [`Communicator`] runs NCCL's [`all_reduce`] and [`broadcast`] over one engine per GPU.
//!
//! Every route runs against a deterministic simulated device (feature `sim`, module [`sim`]) with
//! fault injection, so lifecycle code is tested without a GPU.
//!
//! The [`guide`] explains the engine, its routes and the rules they keep, chapter by chapter.
//!
//! ```
//! # fn main() -> Result<(), cuferry::Error> {
//! use cuferry::{download_tensor, upload_tensor, CudaEngine};
//! # let mut engine = CudaEngine::simulated(Default::default());
//! # /*
//! let mut engine = CudaEngine::open(0)?;
//! # */
//! let x = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
//! let y = engine.copy_tensor(&x)?; // queued device-to-device copy, no host wait
//! engine.flush()?; // reports failures so far, does not wait
//! assert_eq!(download_tensor(&mut engine, &y)?, [1.0, 2.0, 3.0, 4.0]);
//! engine.synchronize()?; // the explicit host barrier
//! # Ok(()) }
//! ```

#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

// The levels, lowest first; a module never imports a level above its own (`tests/levels.rs`
// checks it). `error`, `dtype` and `sync` sit below them all.
//
// The seam: the one trait that names device operations, and its two implementations.
mod driver;

// The engine: one owner of the driver, one lock around it.
mod core;

// What the engine hands out: tensors, pinned buffers, and the pool and ring behind them.
mod memory;

// The proofs that the device is done with memory: fences, retirement, staging leases.
mod lifecycle;

// The host/device routes.
mod routes;

// What runs on the device: kernels, libraries, CubeCL, raw scopes.
mod work;

mod dtype;
// The errors, nested by domain: public, so the domain enums are named `cuferry::error::*`.
pub mod error;
// The atomics, threads and cells of the hand-written concurrency: `std`'s, or loom's when the
// loom models are built.
pub mod guide;
mod sync;

pub use work::{graph, interop, kernels, libs};

pub use crate::core::engine::CudaEngine;
pub use dtype::DType;
pub use error::{DeviceId, DeviceKind, DriverError, Error, Refused, Result};
pub use lifecycle::lease::{
    BeginError, KeepAlive, LeaseState, Proven, StagingLease, Unproven, Untracked,
};
pub use lifecycle::retire::RetirementStats;
pub use lifecycle::signal::Signal;
pub use memory::copy_pool::{copy_threads, set_copy_threads};
pub use memory::element::Element;
pub use memory::host::HostBuffer;
pub use memory::pinned::PinnedHostBuffer;
pub use memory::pool::PinnedPoolStats;
pub use memory::registered::RegisteredBuffer;
pub use memory::ring::{StagingConfig, StagingStats};
pub use memory::tensor::DeviceTensor;
pub use routes::{
    download_pending, download_tensor, download_tensor_into, peer_copy, peer_copy_into,
    peer_copy_pending, peer_copy_staged, upload_pending, upload_tensor, upload_tensor_into,
    Direction, Download, InFlight, PeerFuture, PeerPackage, PeerSubmitError, PeerTryWait, Pending,
    PendingDownload, PendingFuture, PendingPeer, PendingUpload, Returned, TransferPackage,
    TransferState, TransferSubmitError, TryWait, Upload,
};
pub use work::collective::{
    all_reduce, broadcast, CollectiveElement, CollectiveSubmitError, Communicator,
    PendingCollective, ReduceOp,
};
pub use work::libs::{BlasElement, GemmConfig, SolverStatus, TensorElement, Transpose};
pub use work::raw::{RawContext, RawDevicePtr, RawScope, RawStream};

/// The simulated device (feature `sim`).
///
/// Open an engine on a fresh one with [`CudaEngine::simulated`], or several engines on one with
/// [`CudaEngine::simulated_on`]; [`CudaEngine::sim`] hands out the [`SimDevice`](sim::SimDevice)
/// behind an engine, to advance its clock and inject faults between engine operations.
#[cfg(any(test, feature = "sim"))]
pub mod sim {
    pub use crate::driver::sim::{
        set_thread_context, thread_context, Schedule, SimConfig, SimDevice, SimOp,
    };
}

#[cfg(feature = "cubecl")]
pub use work::interop::cubecl::{runtime as cubecl, CubeclScope};

/// The cudarc release the raw scopes speak, re-exported: cudarc 0.19 (`cudarc = "0.19"`, one
/// `0.19.x` per build), with its bindings for CUDA 13.0 (feature `cuda-13000`) and the `driver`,
/// `nvrtc`, `cublas`, `cusolver` and `cutensor` modules, loaded at run time.
///
/// The crate's own API names no cudarc type: errors are [`DriverError`], a plain CUDA result code.
/// The one exception is the raw handles of [`CudaEngine::with_raw`]: [`RawContext::as_raw`],
/// [`RawStream::as_raw`] and [`RawDevicePtr::as_raw`] return `cudarc::driver::sys::CUcontext`,
/// `CUstream` and `CUdeviceptr` through this re-export. Code that calls CUDA inside a raw scope
/// should name cudarc as `cuferry::cudarc` (or depend on the same `0.19` line, which Cargo
/// unifies with this one), so its handle types are the ones the scope hands out; another cudarc
/// release has types of the same names that do not match. Moving to another cudarc minor
/// version is therefore a breaking change of this crate.
pub use cudarc;

/// `f16` and `bf16`, re-exported from the `half` crate.
pub use half::{bf16, f16};
