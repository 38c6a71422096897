//! The routes that move data between host and device.
//!
//! Blocking routes ([`upload_tensor`], [`download_tensor`], [`download_tensor_into`]) take
//! ordinary host memory and return when the host memory may be reused. Pending routes
//! ([`upload_pending`], [`download_pending`]) take pinned buffers by value and return a handle
//! whose state is a type.

pub(crate) mod blocking;
pub(crate) mod pending;
pub(crate) mod staging;

pub use blocking::{download_tensor, download_tensor_into, upload_tensor};
pub use pending::{
    download_pending, upload_pending, Direction, Download, InFlight, Pending, PendingDownload,
    PendingUpload, Returned, TransferPackage, TransferState, TransferSubmitError, TryWait, Upload,
};
pub use staging::{
    BeginError, LeaseState, Proven, StagingConfig, StagingLease, StagingStats, Unproven, Untracked,
};
