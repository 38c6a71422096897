//! The kernel half of the device seam: compiling, loading and launching device code.
//!
//! It is a supertrait of [`Driver`](super::Driver) rather than more methods on it, so the two
//! halves of the seam can grow independently. A real device compiles CUDA C++ with NVRTC, loads
//! the PTX into the engine's context and launches it on the engine's stream. The simulated device
//! cannot run PTX, so every module carries a description of the built-in kernel it holds
//! ([`ElementwiseSpec`]); the simulator queues a host emulation of that kernel on its stream,
//! which runs at the same point in stream order as the kernel would. Modules without such a
//! description (user kernels) are refused there with a typed error.

use super::DevicePtr;
use crate::element::DType;
use crate::error::{DriverError, Error};

/// A loaded module, as the raw handle value (`CUmodule` for CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ModuleHandle(pub(crate) u64);

/// A kernel inside a loaded module, as the raw handle value (`CUfunction` for CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct FunctionHandle(pub(crate) u64);

/// The operation a built-in elementwise kernel performs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum ElementwiseOp {
    /// `out = a + b`
    Add,
    /// `out = a - b`
    Sub,
    /// `out = a * b`
    Mul,
    /// `out = a / b`
    Div,
    /// `out = -a`
    Neg,
    /// `out = a * scalar`
    Scale,
    /// `out = scalar`
    Fill,
    /// `out = a as Output`
    Cast,
}

impl ElementwiseOp {
    /// The operation's name, as kernel names and errors spell it.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            ElementwiseOp::Add => "add",
            ElementwiseOp::Sub => "sub",
            ElementwiseOp::Mul => "mul",
            ElementwiseOp::Div => "div",
            ElementwiseOp::Neg => "neg",
            ElementwiseOp::Scale => "scale",
            ElementwiseOp::Fill => "fill",
            ElementwiseOp::Cast => "cast",
        }
    }
}

/// What a built-in elementwise kernel computes: the operation, the element type it reads and the
/// element type it writes (equal except for casts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ElementwiseSpec {
    pub(crate) op: ElementwiseOp,
    pub(crate) input: DType,
    pub(crate) output: DType,
}

/// Source for one module.
pub(crate) struct ModuleSource<'a> {
    /// The program name, for logs and errors.
    pub(crate) name: &'a str,
    /// Self-contained CUDA C++ (no `#include`).
    pub(crate) cuda: &'a str,
    /// The built-in kernel the module holds, for devices that emulate instead of running PTX.
    pub(crate) builtin: Option<ElementwiseSpec>,
}

/// The arguments of every built-in elementwise kernel, whatever its operation:
/// `(out, a, b, scalar_bits, len)`. Unused operands are zero.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ElementwiseArgs {
    /// The output, `len` elements of the spec's output type.
    pub(crate) out: DevicePtr,
    /// The first operand, `len` elements of the input type (unused by `fill`).
    pub(crate) a: DevicePtr,
    /// The second operand (`add`, `sub`, `mul`, `div` only).
    pub(crate) b: DevicePtr,
    /// The scalar of `scale` and `fill`: the element's bits, zero-extended to 64 bits.
    pub(crate) scalar: u64,
    /// The element count.
    pub(crate) len: u64,
}

/// Compiling, loading and launching device code, on the driver's context and stream.
pub(crate) trait Launch {
    /// Compiles `source` and loads it into the engine's context.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when NVRTC is missing (or, on the simulated device, when the module
    /// is not a built-in kernel); [`Error::Compile`] with NVRTC's log; [`Error::Driver`] when the
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

    /// Queues a built-in elementwise kernel on the stream.
    ///
    /// # Safety
    /// `function` came from a module compiled from a built-in [`ElementwiseSpec`] on this
    /// driver; every pointer the spec's operation reads or writes names a live allocation of at
    /// least `len` elements of its type, and stays live until the launch completes; `out` does
    /// not overlap `a` or `b` unless it is identical to them.
    unsafe fn launch_elementwise(
        &mut self,
        function: FunctionHandle,
        args: &ElementwiseArgs,
    ) -> Result<(), DriverError>;
}
