//! The routes level: the ways data moves between host and device.
//!
//! Blocking routes ([`upload_tensor`], [`upload_tensor_into`], [`download_tensor`],
//! [`download_tensor_into`]) take ordinary host memory and return when the host memory may be
//! reused. Pending routes ([`upload_pending`], [`download_pending`]) take page-locked buffers
//! (pinned or registered) by value and return a handle whose state is a type, which can also be
//! awaited ([`PendingFuture`]). Peer routes ([`peer_copy`], [`peer_copy_into`],
//! [`peer_copy_staged`], and the pending [`peer_copy_pending`]) move a tensor of one engine to
//! another.
//!
//! The level exists so a route is only a composition: it moves values the memory level defines
//! (tensors, pinned buffers, staging slots) under the proofs the lifecycle level defines
//! (fences, leases), and adds no proof of its own. It may depend on everything below it (the
//! seam, the core, memory, lifecycle) and on the errors; nothing below it depends on a route.

pub(crate) mod blocking;
pub(crate) mod peer;
pub(crate) mod pending;

pub use blocking::{download_tensor, download_tensor_into, upload_tensor, upload_tensor_into};
pub use peer::{
    peer_copy, peer_copy_into, peer_copy_pending, peer_copy_staged, PeerFuture, PeerPackage,
    PeerSubmitError, PeerTryWait, PendingPeer,
};
pub use pending::{
    download_pending, upload_pending, Direction, Download, InFlight, Pending, PendingDownload,
    PendingFuture, PendingUpload, Returned, TransferPackage, TransferState, TransferSubmitError,
    TryWait, Upload,
};
