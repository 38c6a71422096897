//! The lifecycle level: how the crate proves that the device is done with memory before anything
//! safe can reach it again.
//!
//! - [`fence`]: the one proof of completion, `Fenced<R>`, and the two other outcomes of trying to
//!   make one (proven at once, or untracked and retained).
//! - [`fence_future`]: a future over a fence, woken by the device once the work has completed or
//!   failed.
//! - [`pending`]: `Pending<Op, S>`, the one typestate of everything the device finishes later
//!   (host transfers, peer copies, collectives), its future and its waits, generic over how an
//!   operation proves its completion.
//! - [`scalar`]: a transfer of at most 16 bytes proven by a synchronize, the readback the levels
//!   above need for a verdict (a solver's status) and the blocking routes' smallest band.
//! - [`lease`]: the `StagingLease<Proven/Unproven>` typestate over the staging ring's
//!   slots, public for hand-built chunked pipelines.
//! - [`signal`]: the same proof handed to another engine, whose streams wait for it on the
//!   device.
//!
//! A fence whose owner goes away before the proof detaches into the engine's retirement queue,
//! which the core keeps, with the pool of events the proofs are recorded with, because the
//! engine polls it at every boundary ([`core::retire`](crate::core::retire)).
//!
//! Pending transfers, staging leases, the CubeCL boundary and every detached value are built on
//! the fence and the retirement queue, so the rules (no host wait under the engine's lock; a
//! panic leaks, never releases; a failure retains and is reported once) are written in those
//! two places and nowhere else.
//!
//! The level exists so those proofs sit apart from both the memory they guard (below: the
//! memory level) and the routes that use them (above). It depends on the seam, the core, the
//! memory level and the errors.

pub(crate) mod fence;
pub(crate) mod fence_future;
pub(crate) mod lease;
pub(crate) mod pending;
pub(crate) mod scalar;
pub(crate) mod signal;
pub(crate) mod timer;
