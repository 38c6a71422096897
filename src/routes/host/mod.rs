//! The host routes: tensors between host memory and one engine's device.
//!
//! - [`blocking`]: ordinary host memory, through the engine's pipelined pinned staging; each call
//!   returns once the host memory may be reused.
//! - [`pending`]: page-locked buffers (pinned or registered) handed over by value, returned as an
//!   operation in flight, [`Pending`](crate::Pending).
//!
//! The module exists because both share a caller and a direction, but nothing else: the blocking
//! routes prove each chunk through staging leases, the pending ones through one fence.

pub(crate) mod blocking;
pub(crate) mod pending;
