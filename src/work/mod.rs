//! The work level: what runs on the device on the engine's compute stream.
//!
//! - `kernels`: the elementwise kernels, their cache, their CUDA source and the emulations the
//!   simulator runs in their place.
//! - [`libs`]: the GEMM, Cholesky solve and contraction of cuBLAS, cuSOLVER and cuTENSOR, on the
//!   engine's compute stream.
//! - [`interop`]: CubeCL kernels on engine data (the public `cubecl` module).
//! - [`graph`]: traced programs, compiled, prepared for an engine and replayed as CUDA graphs.
//! - [`raw`]: raw scopes, for code that calls CUDA itself.
//!
//! The level exists so the device seam names device operations only: a kernel is a function, a
//! grid, a block and parameters there; what it computes, and how a device that cannot run PTX
//! emulates it, is decided here and registered with the module. The vendor libraries and NCCL
//! are halves of the seam itself (`driver::libs`, `driver::collective`): this level checks the
//! arguments, orders the operands and owns what is in flight, and never calls them directly.
//!
//! Everything here is compute on one engine: what crosses an engine's edge (to the host, a peer,
//! other ranks, other processes, a file) is a route, the level above. This level may depend on
//! every level below it, never on a route. The kernel cache is the engine's state and depends only on the
//! seam, the errors and engine-free files of this level (see [`core`](crate::core)).

pub mod graph;
pub(crate) mod interop;
pub(crate) mod kernels;
pub mod libs;
pub(crate) mod raw;
