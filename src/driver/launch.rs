//! The kernel half of the device seam: compiling, loading and launching device code.
//!
//! It is a supertrait of [`Driver`](super::Driver) rather than more methods on it, so the two
//! halves of the seam can grow independently. It names device operations only: a module is CUDA
//! C++ source, a launch is a function, a grid, a block and the kernel's parameters. What a kernel
//! computes is the business of the level that wrote it.
//!
//! A real device compiles the source with NVRTC, loads the PTX into the engine's context and
//! launches it on the engine's compute stream. A device that cannot run PTX (the simulator) runs
//! the module's [`Emulation`] instead, which the code that builds the module registers in its
//! [`ModuleSource`]: the simulator queues it on the compute stream, so it runs at the same point in
//! stream order as the kernel would, against the device's own memory. A module without an
//! emulation (a user kernel) is refused there with a typed error.

#[cfg(any(test, feature = "sim"))]
use super::DevicePtr;
use crate::error::{DriverError, Error};
#[cfg(any(test, feature = "sim"))]
use std::sync::Arc;

/// A loaded module, as the raw handle value (`CUmodule` for CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ModuleHandle(pub(crate) u64);

/// A kernel inside a loaded module, as the raw handle value (`CUfunction` for CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct FunctionHandle(pub(crate) u64);

/// Source for one module.
pub(crate) struct ModuleSource<'a> {
    /// The program name, for logs and errors.
    pub(crate) name: &'a str,
    /// Self-contained CUDA C++ (no `#include`).
    pub(crate) cuda: &'a str,
    /// How a device that cannot run PTX runs the module's one kernel, if it can. A real device
    /// ignores it.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) emulation: Option<Arc<dyn Emulation>>,
}

/// Device memory as an [`Emulation`] sees it while its launch runs: the bytes the device holds
/// at that point in stream order.
#[cfg(any(test, feature = "sim"))]
pub(crate) trait DeviceMemory {
    /// The `bytes` bytes at `ptr`, if they lie inside one live allocation.
    fn read(&mut self, ptr: DevicePtr, bytes: usize) -> Option<Vec<u8>>;
    /// Writes `data` at `ptr`. `false` (and nothing written) unless the range lies inside one
    /// live allocation.
    fn write(&mut self, ptr: DevicePtr, data: &[u8]) -> bool;
}

/// A host implementation of a module's one kernel, for devices that cannot run PTX.
///
/// Registered by the code that builds the module (in [`ModuleSource::emulation`]), so the
/// seam names no kernel: the simulator only runs what it is given.
#[cfg(any(test, feature = "sim"))]
pub(crate) trait Emulation: Send + Sync {
    /// The name of the kernel it stands for, as [`Launch::module_function`] looks it up.
    fn name(&self) -> &str;
    /// Runs the kernel once over the whole grid with `params`, the launch's parameters.
    ///
    /// # Errors
    /// What went wrong (it touched memory outside every live allocation, or the parameters do
    /// not fit the kernel), for the device to record as a violation.
    fn run(&self, memory: &mut dyn DeviceMemory, params: &[u64]) -> Result<(), String>;
}

/// Compiling, loading and launching device code, on the driver's context and stream.
pub(crate) trait Launch {
    /// Compiles `source` and loads it into the engine's context.
    ///
    /// # Errors
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when NVRTC is missing (or, on the simulated device, when the module
    /// carries no emulation); [`LibraryError::Compile`](crate::error::LibraryError::Compile) with NVRTC's log; [`Error::Driver`] when the
    /// driver refuses the PTX.
    fn module_compile(&mut self, source: &ModuleSource<'_>) -> Result<ModuleHandle, Error>;

    /// Looks up a kernel by name in a loaded module.
    fn module_function(
        &mut self,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError>;

    /// Unloads a module.
    ///
    /// # Safety
    /// `module` came from [`Launch::module_compile`] on this driver, is unloaded once, and no
    /// queued launch of one of its kernels is still pending.
    unsafe fn module_unload(&mut self, module: ModuleHandle) -> Result<(), DriverError>;

    /// Queues `function` on the stream over `grid` blocks of `block` threads (one-dimensional),
    /// with `params` as its parameters: every parameter is one 8-byte word (a device pointer, or
    /// a scalar's bits zero-extended), in the kernel's order.
    ///
    /// # Safety
    /// `function` came from [`Launch::module_function`] on this driver and its module is still
    /// loaded; the kernel's signature is exactly `params.len()` 8-byte parameters; `grid` and
    /// `block` are non-zero and within the device's limits; every device range the kernel reads
    /// or writes with these parameters lies in a live allocation that stays live until the
    /// launch completes, and what it writes is not read or written by other queued work
    /// meanwhile unless that work is ordered after it.
    unsafe fn launch(
        &mut self,
        function: FunctionHandle,
        grid: u32,
        block: u32,
        params: &[u64],
    ) -> Result<(), DriverError>;
}
