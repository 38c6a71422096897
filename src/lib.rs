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
//!   pointers ([`raw`]) inside a scope that restores the caller's context on return, error and
//!   unwind.
//! - [`DeviceTensor`]: a compact, shaped, stream-ordered device allocation of an [`Element`].
//! - Blocking routes: [`upload_tensor`], [`upload_tensor_into`], [`download_tensor`],
//!   [`download_tensor_into`], through the engine's pipelined pinned staging ([`staging`]).
//! - Pending routes over page-locked buffers handed over by value: [`upload_pending`] and
//!   [`download_pending`] take a [`PinnedHostBuffer`] (the engine's page-locked memory) or a
//!   [`RegisteredBuffer`] (a `Vec` of yours, page-locked in place) and return an operation in
//!   flight.
//! - One lifecycle for everything the device finishes later: a [`Pending<Op, S>`](Pending),
//!   [`InFlight`](pending::InFlight) until a proof makes it [`Returned`](pending::Returned), with
//!   the same verbs for host transfers, peer copies and collectives ([`pending`]): `is_ready`,
//!   `wait`, `try_wait`, `.await` on any executor (woken by the device), detach on drop,
//!   `into_parts`, `resubmit`. A call that takes something by value and does not go through
//!   hands back what it can in one error, [`SubmitError`].
//! - Work on the engine's compute stream, with no host wait: elementwise kernels compiled once
//!   per engine ([`CudaEngine::add`] and the rest; [the guide](guide::kernels) lists types and
//!   semantics), cuBLAS, cuSOLVER and cuTENSOR bound to that stream ([`libs`]), and CubeCL kernels
//!   (feature `cubecl`, module `cubecl`).
//! - Prepared graphs ([`graph`]): a computation traced once, compiled for fixed shapes into fused
//!   kernels and cuBLAS products, prepared for an engine ([`CudaEngine::prepare`]) and replayed as
//!   a CUDA graph ([`CudaEngine::run`]) for about the host cost of one graph launch.
//! - Several engines, several GPUs: a [`Signal`](engine::Signal) orders one engine's work after
//!   another's on the device ([`CudaEngine::signal`], [`CudaEngine::wait_signal`]); [`peer`]
//!   copies a tensor to another engine, device to device; a
//!   [`Communicator`](collective::Communicator) runs NCCL's collectives (all-reduce, broadcast,
//!   reduce, all-gather, reduce-scatter, send and receive) over one engine per GPU, or one rank
//!   per process joined across processes and hosts ([`collective`]).
//! - Other libraries on the same device: a tensor lent to cudarc code as a `CudaView` or
//!   `CudaViewMut` on a cudarc stream ([`cudarc_interop::lend`],
//!   [`cudarc_interop::lend_mut`]), and a cudarc `CudaSlice` taken in as a tensor
//!   ([`cudarc_interop::adopt`]), without a copy and ordered both ways on the device
//!   ([`cudarc_interop`]).
//!
//! Every route runs against a deterministic simulated device (feature `sim`, module `sim`) with
//! fault injection, so lifecycle code is tested without a GPU.
//!
//! The [`guide`] explains the engine, its routes and the rules they keep, chapter by chapter;
//! [its API chapter](guide::api) states the rule every item follows (what is a method, what is a
//! free function, which module holds what) and lists every item renamed as the layout changed.
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

// The levels, lowest first; a module never imports a level above its own (`tests/levels.rs`
// checks it). `device`, `error`, `dtype`, `fd_passing`, `ledger` and `sync` sit below them all.
//
// The seam: the one trait that names device operations, and its two implementations.
mod driver;

// The engine: one owner of the driver, one lock around it, the retirement queue it polls, and
// the parts it holds for the levels above.
mod core;

// What the engine hands out: tensors, pinned buffers, and the pool and ring behind them.
mod memory;

// The proofs that the device is done with memory: fences, wakes, staging leases, signals.
mod lifecycle;

// Everything that crosses an engine's edge: host, peer, collective, share and checkpoint routes.
mod routes;

// What runs on the device: kernels, libraries, CubeCL, raw scopes.
mod work;

// The name of the device an engine drives (public at `engine::DeviceId`).
mod device;
mod dtype;
pub mod error;
// Descriptors beside bytes on a Unix socket (`SCM_RIGHTS`), for the share route and the
// simulator alike.
mod fd_passing;
pub mod guide;
mod ledger;
// The host concurrency: the atomics, threads and cells of the hand-written concurrency (`std`'s,
// or loom's when the loom models are built), and the process's host-copy threads.
mod sync;

// The root: the engine, its values, the error, and the host routes of the seed. Everything
// else lives in a module named for what it holds.
pub use crate::core::engine::CudaEngine;
pub use dtype::DType;
pub use error::{Error, Result, SubmitError};
pub use lifecycle::pending::Pending;
pub use memory::any_tensor::AnyTensor;
pub use memory::element::Element;
pub use memory::pinned::PinnedHostBuffer;
pub use memory::registered::RegisteredBuffer;
pub use memory::tensor::DeviceTensor;
pub use routes::{
    download_pending, download_tensor, download_tensor_into, upload_pending, upload_tensor,
    upload_tensor_into,
};

/// `f16` and `bf16`, re-exported from the `half` crate.
pub use half::{bf16, f16};

pub use routes::collective;
pub use routes::cudarc_interop;
#[cfg(feature = "dlpack")]
pub use routes::dlpack;
pub use routes::peer;
pub use work::{graph, libs};

/// What the engine reports about itself and its device: the device's identity, its memory by owner
/// ([`MemoryUse`](engine::MemoryUse), [`MemoryWatch`](engine::MemoryWatch)), the
/// retirement queue's and the pinned pool's statistics, and the [`Signal`](engine::Signal) that
/// orders one engine's work after another's.
pub mod engine {
    pub use crate::core::retire::RetirementStats;
    pub use crate::device::{DeviceId, DeviceKind, DeviceMemory};
    pub use crate::ledger::{
        AllocationEvent, Change, Holding, MemoryUse, MemoryWatch, Owner, Retired,
    };
    pub use crate::lifecycle::signal::Signal;
    pub use crate::memory::pool::PinnedPoolStats;
}

/// Operations in flight: the states, operations, future and host-buffer trait of
/// [`Pending`].
///
/// Everything the device finishes later is a `Pending<Op, S>`: host transfers (`upload_pending`,
/// `download_pending`), peer copies (`peer::copy_pending`) and collectives
/// (`comm.group().all_reduce(..).submit(..)`, and every other collective), and what sharing
/// between processes hands back later (`share::Loan`, `share::Reclaim`, `share::Departure`,
/// proven by the importers rather than by an event). Each has the same verbs: `is_ready`
/// (never waits), `wait`, `try_wait` (hands the value back if not done), `wait_for` (bounded), `.await`
/// ([`PendingFuture`](crate::pending::PendingFuture)), detach on drop, `mem::forget` a sound leak, the device side lent shared
/// to the engine that carries the work, `into_parts` once [`Returned`](crate::pending::Returned), and `resubmit` with the
/// same event. [The guide](crate::guide::lifecycles) tells the story.
pub mod pending {
    pub use crate::lifecycle::pending::{
        InFlight, Operation, PendingFuture, Returned, State, TryWait,
    };
    pub use crate::memory::host::HostBuffer;
    pub use crate::routes::host::pending::{Download, Upload};
}

/// Pinned staging for the blocking routes: the ring's configuration and statistics, the copy
/// threads, and the [`StagingLease`](staging::StagingLease) typestate for chunked pipelines
/// built by hand.
pub mod staging {
    pub use crate::lifecycle::lease::{KeepAlive, LeaseState, Proven, StagingLease, Unproven};
    pub use crate::memory::ring::{StagingConfig, StagingStats};
    pub use crate::sync::copy_pool::{copy_threads, set_copy_threads};
}

/// Raw scopes ([`CudaEngine::with_raw`]): the engine's context, compute stream and device
/// pointers for code that calls CUDA itself, and the cudarc release they speak.
pub mod raw {
    pub use crate::work::raw::{RawContext, RawDevicePtr, RawScope, RawStream};

    /// The cudarc release the raw scopes speak, re-exported: cudarc 0.19 (`cudarc = "0.19"`,
    /// one `0.19.x` per build), with its bindings for CUDA 13.0 (feature `cuda-13000`) and the
    /// `driver`, `nvrtc`, `cublas`, `cusolver` and `cutensor` modules, loaded at run time.
    ///
    /// The crate's own API names no cudarc type: errors are
    /// [`DriverError`](crate::error::DriverError), a plain CUDA result code. The one exception
    /// is the raw handles of [`CudaEngine::with_raw`](crate::CudaEngine::with_raw):
    /// [`RawContext::as_raw`], [`RawStream::as_raw`] and [`RawDevicePtr::as_raw`] return
    /// `cudarc::driver::sys::CUcontext`, `CUstream` and `CUdeviceptr` through this re-export.
    /// Code that calls CUDA inside a raw scope should name cudarc as `cuferry::raw::cudarc` (or
    /// depend on the same `0.19` line, which Cargo unifies with this one), so its handle types
    /// are the ones the scope hands out; another cudarc release has types of the same names that
    /// do not match. Moving to another cudarc minor version is therefore a breaking change of
    /// this crate.
    pub use cudarc;
}

/// Checkpoint files in the safetensors format (feature `safetensors`): [`load`](checkpoint::load)
/// named device tensors from a file and [`save`](checkpoint::save) them to one, through pinned
/// staging, every bad file a typed [`MalformedError`](crate::error::MalformedError) naming it.
#[cfg(feature = "safetensors")]
pub mod checkpoint {
    pub use crate::routes::checkpoint::{
        Checkpoint, DEFAULT_READERS, DEFAULT_STAGING_BYTES, DEFAULT_WRITERS, LoadOptions, Progress,
        ReadAt, SMALL_LOAD_READERS, SaveOptions, SaveTensor, Slice, TensorParallel, WriteAt, load,
        load_each, load_from, load_shared, load_with, read_into, read_pending, save, save_with,
        write_from, write_returned,
    };
}

/// Device tensors shared between processes on one host (Linux), with lifetimes that hold
/// across them.
///
/// The exporting process binds a [`ShareListener`](share::ShareListener), accepts an
/// [`Importer`](share::Importer) per importing process, and either offers a tensor read-only
/// ([`CudaEngine::export_tensor`], then [`Importer::offer`](share::Importer::offer)) or lends
/// it exclusively ([`Importer::lend`](share::Importer::lend)). The importing process connects a
/// [`ShareLink`](share::ShareLink) and takes each offer as a [`ReadOnly`](share::ReadOnly)
/// tensor (which cannot be written) or an exclusive [`DeviceTensor`] (whose drop hands it
/// back). The exporter's memory is freed, or written again, only once every importer has
/// released it or its process has ended; each side's streams wait for the other's writes on the
/// device. See the guide's chapter [Sharing between processes](crate::guide::sharing).
#[cfg(target_os = "linux")]
pub mod share {
    pub use crate::routes::share::{
        Departure, Exported, Importer, Loan, ReadOnly, Reclaim, ShareLink, ShareListener,
    };
}

/// The simulated device (feature `sim`).
///
/// Open an engine on a fresh one with [`CudaEngine::simulated`], or several engines on one with
/// [`CudaEngine::simulated_on`]; [`CudaEngine::sim`] hands out the [`SimDevice`](sim::SimDevice)
/// behind an engine, to advance its clock and inject faults between engine operations, and
/// whose [`violations`](sim::SimDevice::violations) list what the device saw go wrong, each a
/// [`Violation`](sim::Violation) (a correct program leaves it empty).
#[cfg(any(test, feature = "sim"))]
pub mod sim {
    pub use crate::driver::sim::{
        Schedule, SimConfig, SimDevice, SimOp, Violation, set_thread_context, thread_context,
    };
}

#[cfg(feature = "cubecl")]
pub use work::interop::cubecl;
