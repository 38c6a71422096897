//! What a built-in elementwise kernel computes, and how it is launched.
//!
//! These are the work level's own types: the device seam knows only functions, grids, blocks
//! and 8-byte parameters, so this module turns a spec and its operands into exactly that.

use crate::driver::DevicePtr;
use crate::dtype::DType;

/// Threads per block of the built-in elementwise kernels.
pub(crate) const BLOCK: u32 = 256;
/// The most blocks an elementwise launch uses; the kernels loop over the rest (grid stride).
pub(crate) const MAX_BLOCKS: u32 = 1 << 20;

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

    /// Whether the kernel reads its first operand `a` (every operation but `fill`).
    pub(crate) fn reads_a(self) -> bool {
        self != ElementwiseOp::Fill
    }

    /// Whether the kernel reads its second operand `b` (the binary operations).
    pub(crate) fn reads_b(self) -> bool {
        matches!(
            self,
            ElementwiseOp::Add | ElementwiseOp::Sub | ElementwiseOp::Mul | ElementwiseOp::Div
        )
    }
}

/// Why `op` does not serve element type `dtype`, if it does not: no arithmetic on `bool`,
/// division only for floats, negation only for floats and signed integers.
pub(crate) fn unsupported(op: ElementwiseOp, dtype: DType) -> Option<&'static str> {
    let float = matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16);
    let signed = matches!(dtype, DType::I8 | DType::I16 | DType::I32 | DType::I64);
    match op {
        ElementwiseOp::Fill | ElementwiseOp::Cast => None,
        _ if dtype == DType::Bool => Some("arithmetic on bool is not defined"),
        ElementwiseOp::Div if !float => Some(
            "integer division by zero has no defined result on the device; cast to a float type first",
        ),
        ElementwiseOp::Neg if !float && !signed => Some("an unsigned type has no negation"),
        _ => None,
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

/// The arguments of every built-in elementwise kernel, whatever its operation:
/// `(out, a, b, scalar_bits, len)`. Unused operands are zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

impl ElementwiseArgs {
    /// How many 8-byte parameters every elementwise kernel takes.
    pub(crate) const PARAMS: usize = 5;

    /// The kernel's parameters, in its order: `(out, a, b, scalar_bits, len)`.
    pub(crate) fn params(&self) -> [u64; Self::PARAMS] {
        [self.out, self.a, self.b, self.scalar, self.len]
    }

    /// The arguments the parameters of a launch carry, if there are exactly
    /// [`PARAMS`](Self::PARAMS) of them.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn from_params(params: &[u64]) -> Option<Self> {
        let &[out, a, b, scalar, len] = params else {
            return None;
        };
        Some(ElementwiseArgs {
            out,
            a,
            b,
            scalar,
            len,
        })
    }

    /// Blocks of [`BLOCK`] threads for `len` elements: one thread per element, up to
    /// [`MAX_BLOCKS`] (the kernels loop over the rest). At least one.
    pub(crate) fn grid(&self) -> u32 {
        let blocks = self
            .len
            .div_ceil(u64::from(BLOCK))
            .clamp(1, u64::from(MAX_BLOCKS));
        u32::try_from(blocks).unwrap_or(MAX_BLOCKS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_covers_every_element_up_to_the_block_limit() {
        let args = |len| ElementwiseArgs {
            out: 0,
            a: 0,
            b: 0,
            scalar: 0,
            len,
        };
        assert_eq!(args(1).grid(), 1);
        assert_eq!(args(256).grid(), 1);
        assert_eq!(args(257).grid(), 2);
        assert_eq!(
            args(u64::from(BLOCK) * u64::from(MAX_BLOCKS) * 4).grid(),
            MAX_BLOCKS
        );
    }

    #[test]
    fn parameters_round_trip_in_kernel_order() {
        let args = ElementwiseArgs {
            out: 1,
            a: 2,
            b: 3,
            scalar: 4,
            len: 5,
        };
        assert_eq!(args.params(), [1, 2, 3, 4, 5]);
        assert_eq!(ElementwiseArgs::from_params(&args.params()), Some(args));
        assert_eq!(ElementwiseArgs::from_params(&[1, 2, 3]), None);
    }
}
