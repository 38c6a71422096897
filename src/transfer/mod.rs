//! The routes that move data between host and device.
//!
//! Blocking routes ([`upload_tensor`], [`download_tensor`], [`download_tensor_into`]) take
//! ordinary host memory and return when the host memory may be reused.

pub(crate) mod blocking;

pub use blocking::{download_tensor, download_tensor_into, upload_tensor};
