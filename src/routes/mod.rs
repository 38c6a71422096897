//! The routes level: everything that crosses an engine's edge.
//!
//! - [`host`]: blocking routes ([`upload_tensor`], [`upload_tensor_into`], [`download_tensor`],
//!   [`download_tensor_into`]) over ordinary host memory, which return when the host memory may
//!   be reused, and pending routes ([`upload_pending`], [`download_pending`]) over page-locked
//!   buffers (pinned or registered) taken by value, which return an operation in flight
//!   ([`Pending`](crate::Pending)) that can also be awaited.
//! - [`peer`]: a tensor of one engine to another, device to device.
//! - [`collective`]: NCCL's collectives over one engine per GPU, or one rank per process joined
//!   across processes and hosts, each a `Pending` operation.
//! - `share` (Linux): an engine's tensors lent to other processes of the host.
//! - `checkpoint` (feature `safetensors`): named tensors between files and engines.
//! - [`cudarc_interop`]: tensors lent to cudarc code on its streams, and cudarc's slices taken
//!   in, without a copy.
//!
//! The level exists so a route is only a composition: it moves values the memory level defines
//! (tensors, pinned buffers, staging slots) under the proofs the lifecycle level defines
//! (fences, leases, `Pending`), and adds no proof of its own. It sits at the top and may depend
//! on every level below it (the seam, the core, memory, lifecycle, and the work level's compute)
//! and on the errors; nothing below it depends on a route.

#[cfg(feature = "safetensors")]
pub(crate) mod checkpoint;
pub mod collective;
pub mod cudarc_interop;
#[cfg(feature = "dlpack")]
pub mod dlpack;
pub(crate) mod host;
pub mod peer;
#[cfg(target_os = "linux")]
pub(crate) mod share;

pub use host::blocking::{
    download_tensor, download_tensor_into, upload_tensor, upload_tensor_into,
};
pub use host::pending::{download_pending, upload_pending};
