//! Interop with other GPU runtimes that share the engine's device.
//!
//! Such a runtime keeps its own streams and memory pools, so data crosses only through explicit
//! boundaries that order its stream against the engine's; each module says what its boundary
//! costs.

#[cfg(feature = "cubecl")]
pub mod cubecl;
