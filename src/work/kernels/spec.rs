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
/// element type it writes (equal except for casts), and for a binary operation whose operands
/// broadcast, the rank of its collapsed index space (0 for equal shapes: no index math).
///
/// The broadcast rank is part of the kernel's identity (its name and the cache's key), so the
/// equal-shape kernel and each broadcasting one are separate modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ElementwiseSpec {
    pub(crate) op: ElementwiseOp,
    pub(crate) input: DType,
    pub(crate) output: DType,
    /// Dimensions of the collapsed broadcast layout the kernel walks; 0: operands and output
    /// have the same element order, indexed by `i` alone.
    pub(crate) broadcast: u8,
}

/// One dimension of a collapsed broadcast: its extent in the output and each operand's stride in
/// elements along it (0 where the operand is broadcast).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BroadcastDim {
    pub(crate) extent: u64,
    pub(crate) a_stride: u64,
    pub(crate) b_stride: u64,
}

/// How two operand shapes broadcast (NumPy's rule).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Broadcast {
    /// The result's shape: the longer rank, each dimension the larger of the pair.
    pub(crate) shape: Vec<usize>,
    /// The collapsed index space, outermost first: adjacent dimensions in which each operand is
    /// either broadcast in both or in neither are merged, and dimensions of extent 1 dropped.
    /// Empty when the operands have the same elements in the same order (equal shapes up to
    /// leading 1s), which is the equal-shape kernel's case.
    pub(crate) dims: Vec<BroadcastDim>,
}

impl Broadcast {
    /// How `a` and `b` broadcast, or the index (into the longer shape) of the first dimension
    /// where they disagree: aligned at the trailing dimension, each pair must be equal or one of
    /// them 1; a missing leading dimension counts as 1.
    pub(crate) fn of(a: &[usize], b: &[usize]) -> Result<Broadcast, usize> {
        let rank = a.len().max(b.len());
        let padded = |s: &[usize]| -> Vec<usize> {
            let mut v = vec![1; rank - s.len()];
            v.extend_from_slice(s);
            v
        };
        let (pa, pb) = (padded(a), padded(b));
        let mut shape = Vec::with_capacity(rank);
        for d in 0..rank {
            shape.push(match (pa[d], pb[d]) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => return Err(d),
            });
        }
        if pa == pb {
            return Ok(Broadcast {
                shape,
                dims: Vec::new(),
            });
        }
        // (extent, a broadcast, b broadcast), merged where the pattern repeats.
        let mut merged: Vec<(u64, bool, bool)> = Vec::new();
        for d in 0..rank {
            if shape[d] == 1 {
                continue;
            }
            let pattern = (pa[d] == 1, pb[d] == 1);
            match merged.last_mut() {
                Some(last) if (last.1, last.2) == pattern => last.0 *= shape[d] as u64,
                _ => merged.push((shape[d] as u64, pattern.0, pattern.1)),
            }
        }
        let mut dims = vec![
            BroadcastDim {
                extent: 0,
                a_stride: 0,
                b_stride: 0,
            };
            merged.len()
        ];
        let (mut sa, mut sb) = (1u64, 1u64);
        for (slot, &(extent, a_bc, b_bc)) in dims.iter_mut().zip(&merged).rev() {
            *slot = BroadcastDim {
                extent,
                a_stride: if a_bc { 0 } else { sa },
                b_stride: if b_bc { 0 } else { sb },
            };
            if !a_bc {
                sa = sa.saturating_mul(extent);
            }
            if !b_bc {
                sb = sb.saturating_mul(extent);
            }
        }
        Ok(Broadcast { shape, dims })
    }

    /// The kernel parameters after the five common ones: `(extent, a_stride, b_stride)` per
    /// collapsed dimension, outermost first.
    pub(crate) fn params(&self) -> Vec<u64> {
        self.dims
            .iter()
            .flat_map(|d| [d.extent, d.a_stride, d.b_stride])
            .collect()
    }
}

/// The element each operand contributes to output element `i`, under the collapsed broadcast
/// `dims` (the index math the broadcasting kernels do), for the simulated device's emulation.
#[cfg(any(test, feature = "sim"))]
pub(crate) fn broadcast_index(dims: &[BroadcastDim], i: u64) -> (u64, u64) {
    let (mut rem, mut ia, mut ib) = (i, 0u64, 0u64);
    for d in dims.iter().rev() {
        let c = rem % d.extent;
        rem /= d.extent;
        ia += c * d.a_stride;
        ib += c * d.b_stride;
    }
    (ia, ib)
}

/// How many elements an operand spans under `dims`, given the output has `len > 0` elements:
/// one past its largest index. `a` selects the first operand's strides.
#[cfg(any(test, feature = "sim"))]
pub(crate) fn broadcast_extent(dims: &[BroadcastDim], a: bool) -> u64 {
    1 + dims
        .iter()
        .map(|d| (d.extent - 1) * if a { d.a_stride } else { d.b_stride })
        .sum::<u64>()
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
    fn broadcasts_follow_numpy_and_collapse_their_index_space() {
        let bc = |a: &[usize], b: &[usize]| Broadcast::of(a, b);
        let dim = |extent, a_stride, b_stride| BroadcastDim {
            extent,
            a_stride,
            b_stride,
        };
        assert_eq!(bc(&[3, 4], &[3, 4]).unwrap().dims, []);
        assert_eq!(bc(&[1, 3, 4], &[3, 4]).unwrap().shape, [1, 3, 4]);
        assert_eq!(bc(&[1, 3, 4], &[3, 4]).unwrap().dims, []);
        let bias = bc(&[2, 3, 4], &[4]).unwrap();
        assert_eq!(bias.shape, [2, 3, 4]);
        assert_eq!(bias.dims, [dim(6, 4, 0), dim(4, 1, 1)]);
        let column = bc(&[3, 1], &[3, 4]).unwrap();
        assert_eq!(column.dims, [dim(3, 1, 4), dim(4, 0, 1)]);
        assert_eq!(bc(&[], &[5]).unwrap().dims, [dim(5, 0, 1)]);
        assert_eq!(bc(&[3, 4], &[3]), Err(1));
        assert_eq!(bc(&[2, 3, 4], &[5, 1, 4]), Err(0));
        let outer = bc(&[3, 1], &[1, 4]).unwrap();
        assert_eq!(outer.shape, [3, 4]);
        let index: Vec<_> = (0..12).map(|i| broadcast_index(&outer.dims, i)).collect();
        assert_eq!(index[5], (1, 1));
        assert_eq!(broadcast_extent(&outer.dims, true), 3);
        assert_eq!(broadcast_extent(&outer.dims, false), 4);
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
