//! The core level: the engine itself.
//!
//! [`engine`] holds `CudaEngine` (open, flush, synchronize and the drop rules), the state it
//! shares with the values it hands out, and the lock that serialises every use of the driver;
//! [`context`] holds the guard that makes the engine's context current for a scope and restores
//! the caller's, on which the raw and CubeCL scopes are built; [`order`] orders the engine's
//! three streams against each other where a value is shared.
//!
//! The level exists so that there is one owner of the driver and one lock around it, and every
//! level above reaches the device through it. It depends on the device seam
//! ([`driver`](crate::driver)) and on the errors, and on nothing above, with one exception:
//! the engine *holds* the state of the subsystems above it, so `engine.rs` names their state
//! types:
//!
//! - the pinned pool (`memory::pool`) and the staging ring (`memory::ring`),
//! - the retirement queue and event pool (`lifecycle::retire`),
//! - the kernel cache (`work::kernels::cache`).
//!
//! Those files are plain state: each depends only on the seam, the errors and engine-free files
//! of its own level, and never on the engine, so no file-level cycle runs through the core. The
//! code that *uses* that state on behalf of a caller (pinned buffers, staging leases, kernels,
//! library calls) lives in its own level and depends on the engine, as a level above should.
//! `tests/levels.rs` checks all of this on every test run.

pub(crate) mod context;
pub(crate) mod engine;
pub(crate) mod order;
