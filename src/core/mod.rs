//! The core level: the engine itself.
//!
//! [`engine`] holds `CudaEngine` (open, flush, synchronize and the drop rules), the state it
//! shares with the values it hands out, and the lock that serialises every use of the driver;
//! [`context`] holds the guard that makes the engine's context current for a scope and restores
//! the caller's, on which the raw and CubeCL scopes are built; [`order`] orders the engine's
//! three streams against each other where a value is shared; [`retire`] holds the retirement
//! queue and the event pool, which the engine polls at every boundary and settles first at its
//! teardown; [`parts`] holds the state that the levels above keep per engine.
//!
//! The level exists so that there is one owner of the driver and one lock around it, and every
//! level above reaches the device through it. It depends on the device seam
//! ([`driver`](crate::driver)) and on the errors, and on nothing above, without exception.
//!
//! The state behind the lock includes the subsystems' state above the core (the memory level's
//! pinned pool and staging ring, the work level's kernel cache, for example), but the core does
//! not name it: each of those is a [`Part`](parts::Part), a type of its own level that the
//! engine holds by type, makes the first time its level asks for it, and releases at the place
//! in the teardown the part names. The code that uses a part on behalf of a caller (pinned
//! buffers, staging leases, kernels, library calls) lives in the part's level too, and depends
//! on the engine, as a level above should. `tests/levels.rs` checks on every test run that no
//! file names a level above its own.

pub(crate) mod context;
pub(crate) mod engine;
pub(crate) mod order;
pub(crate) mod parts;
pub(crate) mod retire;
