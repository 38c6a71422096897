//! Fused elementwise kernels: one kernel for a whole group of same-length elementwise
//! operations, generated from the group's canonical expression.
//!
//! A prepared program (`work::graph`) groups each maximal run of elementwise operations over the
//! same element count and describes it as a [`FusedKernel`]: a straight-line program over one
//! element index. This module turns that description into CUDA C++ (one NVRTC kernel per
//! description, cached by the engine's kernel cache under the description itself), into launch
//! parameters, and (for the simulated device) into a host emulation.
//!
//! Every operation keeps the eager kernels' semantics bit for bit (see [`kernels`](super)):
//! each intermediate value is rounded to its storage type exactly as if it had been written to
//! memory by the eager kernel, `f32`/`f64` arithmetic uses the `_rn` intrinsics so no multiply
//! and add are ever contracted into an FMA, and integers wrap.

use super::spec::ElementwiseOp;
use crate::dtype::DType;

/// One operation of a fused kernel. Operands name earlier values by their index in
/// [`FusedKernel::body`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum FusedOp {
    /// Element `i` of input parameter `n` (of type [`FusedKernel::inputs`]`[n]`).
    Load(usize),
    /// A constant of `dtype`: the element's bits, zero-extended.
    Const { dtype: DType, bits: u64 },
    /// `a op b` for `Add`, `Sub`, `Mul` or `Div`; both of the same type.
    Binary { op: ElementwiseOp, a: usize, b: usize },
    /// `-a`.
    Neg(usize),
    /// `a * factor`, the factor's bits (of `a`'s type) zero-extended.
    Scale { a: usize, bits: u64 },
    /// `a as to` (Rust's `as`, as the eager `cast`).
    Cast { a: usize, to: DType },
}

/// A fused elementwise kernel, described by what it computes for one element index.
///
/// Its launch parameters are the output pointers (one per entry of `outputs`, in order), then
/// the input pointers (one per entry of `inputs`), then the element count: all 8-byte words.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct FusedKernel {
    /// The element type of each input parameter.
    pub(crate) inputs: Vec<DType>,
    /// The operations, in order; value `k` is operation `k`'s result.
    pub(crate) body: Vec<FusedOp>,
    /// The values stored to the output parameters, in parameter order (one value may be stored
    /// to several outputs).
    pub(crate) outputs: Vec<usize>,
}
