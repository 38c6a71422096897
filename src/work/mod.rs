//! The work level: what runs on the device on the engine's compute stream.
//!
//! - `kernels`: the elementwise kernels, their cache, their CUDA source and the emulations the
//!   simulator runs in their place.
//! - [`libs`]: cuBLAS, cuSOLVER and cuTENSOR bound to the engine's compute stream, and their handles.
//! - [`interop`]: CubeCL kernels on engine data (the public `cubecl` module).
//! - [`graph`]: traced programs, compiled, prepared for an engine and replayed as CUDA graphs.
//! - [`raw`]: raw scopes, for code that calls CUDA itself.
//! - [`collective`]: NCCL all-reduce and broadcast over one engine per GPU.
//!
//! The level exists so the device seam names device operations only: a kernel is a function, a
//! grid, a block and parameters there; what it computes, and how a device that cannot run PTX
//! emulates it, is decided here and registered with the module. It sits at the top and may
//! depend on every level below. The kernel cache and the library handles are the engine's state
//! and depend only on the seam, the errors and engine-free files of this level (see
//! [`core`](crate::core)).

pub mod collective;
pub mod graph;
pub(crate) mod interop;
pub(crate) mod kernels;
pub mod libs;
pub(crate) mod raw;
