//! The routes level: the ways data moves between host and device, and between engines.
//!
//! Blocking routes ([`upload_tensor`], [`upload_tensor_into`], [`download_tensor`],
//! [`download_tensor_into`]) take ordinary host memory and return when the host memory may be
//! reused. Pending routes ([`upload_pending`], [`download_pending`]) take page-locked buffers
//! (pinned or registered) by value and return an operation in flight ([`pending`]), which can
//! also be awaited. Peer routes ([`peer`]) move a tensor of one engine to another. Checkpoint
//! files (`checkpoint`, feature `safetensors`) move named tensors between files and engines, and
//! sharing (`share`, Linux) lends an engine's tensors to other processes of the host.
//!
//! The level exists so a route is only a composition: it moves values the memory level defines
//! (tensors, pinned buffers, staging slots) under the proofs the lifecycle level defines
//! (fences, leases), and adds no proof of its own. It may depend on everything below it (the
//! seam, the core, memory, lifecycle) and on the errors; nothing below it depends on a route.

pub(crate) mod blocking;
#[cfg(feature = "safetensors")]
pub(crate) mod checkpoint;
pub mod peer;
pub(crate) mod pending;
mod scalar;
#[cfg(target_os = "linux")]
pub(crate) mod share;

pub use blocking::{download_tensor, download_tensor_into, upload_tensor, upload_tensor_into};
pub use pending::{download_pending, upload_pending};
