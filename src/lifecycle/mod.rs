//! Lifecycles: how the crate proves that the device is done with memory before anything safe
//! can reach it again.
//!
//! - [`fence`]: the one proof of completion, `Fenced<R>`, and the two other outcomes of trying to
//!   make one (proven at once, or untracked and retained).
//! - [`retire`]: where fenced resources wait when their owner went away before the proof, and
//!   the pool of events the proofs are recorded with.
//!
//! Pending transfers, staging leases, the CubeCL boundary and every detached value are built on
//! these two, so the rules (no host wait under the engine's lock; a panic leaks, never
//! releases; a failure retains and is reported once) are written here and nowhere else.

pub(crate) mod fence;
pub(crate) mod retire;
