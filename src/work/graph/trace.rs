//! Tracing: describing a computation once, with symbolic inputs.
//!
//! A [`TracedTensor`] is a node of an expression DAG. Inputs have an element type and a rank but
//! no shape yet; operators (`&x * &x`, `+`, `-`, `/`, unary `-`) and methods (`scale`, `cast`,
//! `full_like`, `matmul`, `linear`, `reshape`) build new nodes. Every element type and rank rule
//! is checked here, when the node is made, so an ill-typed program never reaches compilation:
//! shapes are the only thing left for [`GraphCompiler`](super::GraphCompiler) to check
//! (including whether the operands of an elementwise operation broadcast: operands of
//! different ranks are traced, and their shapes are checked when they are fixed).
//!
//! Nodes are immutable and shared (`Arc`), so a subexpression used twice is one node, and a
//! traced value is cheap to clone and `Send + Sync`.

use crate::dtype::DType;
use crate::error::{Error, ProgramError, Result, UsageError};
use crate::memory::element::Element;
use crate::work::kernels::scalar_bits;
use crate::work::kernels::spec::ElementwiseOp;
use crate::work::kernels::spec::unsupported;
use crate::work::libs::Transpose;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_NODE: AtomicU64 = AtomicU64::new(1);

/// A value in a traced computation: a symbolic input, or an operation on traced values.
///
/// Made with [`TracedTensor::input_symbolic_shape`] and combined with operators on references
/// (each returns a `Result`, because operands of different element types are refused here, at
/// trace time; operands of different ranks broadcast, as the eager operations do):
///
/// ```
/// # fn main() -> Result<(), cuferry::Error> {
/// use cuferry::graph::TracedTensor;
/// use cuferry::DType;
/// let x = TracedTensor::input_symbolic_shape(DType::F64, 1);
/// let y = (&x * &x)?;
/// let z = (&(&y + &x)? - &TracedTensor::full_like(&x, 1.0f64))?;
/// assert_eq!((z.dtype(), z.rank()), (DType::F64, 1));
///
/// let n = TracedTensor::input_symbolic_shape(DType::I32, 1);
/// assert!((&x + &n).is_err()); // f64 + i32: refused when traced
///
/// let batch = TracedTensor::input_symbolic_shape(DType::F64, 2);
/// assert_eq!((&batch + &x)?.rank(), 2); // a `[N]` row onto `[B, N]`: shapes checked when compiled
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct TracedTensor {
    pub(crate) node: Arc<Node>,
}

/// One node of the traced DAG.
pub(crate) struct Node {
    /// Unique per node in the process: the identity inputs are matched by.
    pub(crate) id: u64,
    pub(crate) dtype: DType,
    pub(crate) rank: usize,
    pub(crate) op: Op,
}

/// What a node computes.
pub(crate) enum Op {
    /// A symbolic input.
    Input,
    /// `bits` (an element of the node's type) in every element, shaped like `like`.
    Full { like: TracedTensor, bits: u64 },
    /// `a op b`, elementwise, broadcasting as the eager operations do (NumPy's rule).
    Binary {
        op: ElementwiseOp,
        a: TracedTensor,
        b: TracedTensor,
        /// `Some(operation)` when `b` is added onto `a` for `operation` (the bias of
        /// `linear`): errors name `operation`, and the result must keep `a`'s shape, as the
        /// eager operation requires.
        onto: Option<&'static str>,
    },
    /// `-a`.
    Neg(TracedTensor),
    /// `a * factor`.
    Scale { a: TracedTensor, bits: u64 },
    /// `a as dtype`.
    Cast(TracedTensor),
    /// The row-major product `op(a) · op(b)` of two matrices, each read as stored or
    /// transposed.
    Matmul {
        a: TracedTensor,
        b: TracedTensor,
        trans: [Transpose; 2],
    },
    /// `a`'s elements, in order, with another shape.
    Reshape { a: TracedTensor, shape: Vec<usize> },
}

impl fmt::Debug for TracedTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match &self.node.op {
            Op::Input => "input",
            Op::Full { .. } => "full_like",
            Op::Binary { op, .. } => op.name(),
            Op::Neg(_) => "neg",
            Op::Scale { .. } => "scale",
            Op::Cast(_) => "cast",
            Op::Matmul { .. } => "matmul",
            Op::Reshape { .. } => "reshape",
        };
        f.debug_struct("TracedTensor")
            .field("id", &self.node.id)
            .field("op", &op)
            .field("dtype", &self.node.dtype)
            .field("rank", &self.node.rank)
            .finish()
    }
}

fn mismatch(operation: &'static str, detail: String) -> Error {
    Error::Program(ProgramError::Trace { operation, detail })
}

impl TracedTensor {
    fn new(dtype: DType, rank: usize, op: Op) -> Self {
        TracedTensor {
            node: Arc::new(Node {
                id: NEXT_NODE.fetch_add(1, Ordering::Relaxed),
                dtype,
                rank,
                op,
            }),
        }
    }

    /// A symbolic input of element type `dtype` and `rank` dimensions. Its shape is given when
    /// the program is compiled.
    pub fn input_symbolic_shape(dtype: DType, rank: usize) -> Self {
        TracedTensor::new(dtype, rank, Op::Input)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.node.dtype
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.node.rank
    }

    /// Whether this is a symbolic input.
    pub fn is_input(&self) -> bool {
        matches!(self.node.op, Op::Input)
    }

    /// A tensor shaped like `like` with every element `value` (of any element type).
    pub fn full_like<T: Element>(like: &TracedTensor, value: T) -> Self {
        TracedTensor::new(
            T::DTYPE,
            like.rank(),
            Op::Full {
                like: like.clone(),
                bits: scalar_bits(value),
            },
        )
    }

    fn binary(&self, op: ElementwiseOp, rhs: &TracedTensor) -> Result<Self> {
        if self.dtype() != rhs.dtype() {
            return Err(mismatch(
                op.name(),
                format!(
                    "operands are {} and {}; cast one first",
                    self.dtype(),
                    rhs.dtype()
                ),
            ));
        }
        supported(op, self.dtype())?;
        // The shapes broadcast (or are refused) when they are fixed, at compilation; the
        // result has the longer rank.
        Ok(TracedTensor::new(
            self.dtype(),
            self.rank().max(rhs.rank()),
            Op::Binary {
                op,
                a: self.clone(),
                b: rhs.clone(),
                onto: None,
            },
        ))
    }

    /// `self * factor`, elementwise; `factor` must be of the tensor's element type.
    ///
    /// # Errors
    /// [`ProgramError::Trace`](crate::error::ProgramError::Trace) when `T` is not the element type; [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) for
    /// `bool`.
    pub fn scale<T: Element>(&self, factor: T) -> Result<Self> {
        if T::DTYPE != self.dtype() {
            return Err(mismatch(
                "scale",
                format!(
                    "the factor is {} but the tensor is {}",
                    T::DTYPE,
                    self.dtype()
                ),
            ));
        }
        supported(ElementwiseOp::Scale, self.dtype())?;
        Ok(TracedTensor::new(
            self.dtype(),
            self.rank(),
            Op::Scale {
                a: self.clone(),
                bits: scalar_bits(factor),
            },
        ))
    }

    /// Every element converted to `dtype`, with Rust's `as` semantics (as
    /// [`CudaEngine::cast`](crate::CudaEngine::cast)). Every pair of types is served; a cast to
    /// the tensor's own type is the tensor itself.
    pub fn cast(&self, dtype: DType) -> Self {
        if dtype == self.dtype() {
            return self.clone();
        }
        TracedTensor::new(dtype, self.rank(), Op::Cast(self.clone()))
    }

    /// The row-major matrix product `self · rhs` through cuBLAS, as
    /// [`CudaEngine::matmul`](crate::CudaEngine::matmul): both 2-D, `[m, k]` times `[k, n]`.
    ///
    /// # Errors
    /// [`ProgramError::Trace`](crate::error::ProgramError::Trace) when the operands are not both 2-D or differ in element type;
    /// [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) for types other than `f32` and `f64`. The inner dimensions
    /// are checked when the program is compiled.
    pub fn matmul(&self, rhs: &TracedTensor) -> Result<Self> {
        self.matmul_t(Transpose::No, rhs, Transpose::No)
    }

    /// The row-major product `op(self) · op(rhs)` through cuBLAS, as
    /// [`CudaEngine::matmul_t`](crate::CudaEngine::matmul_t): `op(self)` is `[m, k]` and
    /// `op(rhs)` is `[k, n]`, each operand read as stored or transposed (nothing is transposed
    /// in memory).
    ///
    /// # Errors
    /// As [`matmul`](Self::matmul); the inner dimensions, after the transposes, are checked when
    /// the program is compiled.
    pub fn matmul_t(&self, ta: Transpose, rhs: &TracedTensor, tb: Transpose) -> Result<Self> {
        if self.rank() != 2 || rhs.rank() != 2 {
            return Err(mismatch(
                "matmul",
                format!(
                    "operands must be 2-D, got rank {} and {}",
                    self.rank(),
                    rhs.rank()
                ),
            ));
        }
        if self.dtype() != rhs.dtype() {
            return Err(mismatch(
                "matmul",
                format!("operands are {} and {}", self.dtype(), rhs.dtype()),
            ));
        }
        if !matches!(self.dtype(), DType::F32 | DType::F64) {
            return Err(Error::Usage(UsageError::UnsupportedElement {
                operation: "matmul",
                dtype: self.dtype(),
                reason: "cuBLAS serves f32 and f64 here",
            }));
        }
        Ok(TracedTensor::new(
            self.dtype(),
            2,
            Op::Matmul {
                a: self.clone(),
                b: rhs.clone(),
                trans: [ta, tb],
            },
        ))
    }

    /// A fully connected layer in PyTorch's layout, as
    /// [`CudaEngine::linear`](crate::CudaEngine::linear): `self · wᵀ + bias`, with `self` a
    /// 2-D `[rows, in]`, `w` `[out, in]` and `bias`, if any, `[out]` (or anything that
    /// broadcasts onto `[rows, out]` without growing it), giving `[rows, out]`. (Reshape a
    /// batch of more dimensions to 2-D first.) The bias is added by the broadcasting add, fused
    /// into the kernel that follows the product.
    ///
    /// # Errors
    /// As [`matmul_t`](Self::matmul_t), and [`ProgramError::Trace`](crate::error::ProgramError::Trace)
    /// when the bias has another element type or more than two dimensions. The widths, and
    /// whether the bias broadcasts onto the result
    /// ([`UsageError::NotBroadcastable`](crate::error::UsageError::NotBroadcastable), operation
    /// `linear`, as the eager `linear` says it), are checked when the program is compiled.
    pub fn linear(&self, w: &TracedTensor, bias: Option<&TracedTensor>) -> Result<Self> {
        let y = self.matmul_t(Transpose::No, w, Transpose::Yes)?;
        let Some(bias) = bias else {
            return Ok(y);
        };
        if bias.dtype() != y.dtype() {
            return Err(mismatch(
                "linear",
                format!(
                    "the bias is {} but the product is {}",
                    bias.dtype(),
                    y.dtype()
                ),
            ));
        }
        if bias.rank() > y.rank() {
            return Err(mismatch(
                "linear",
                format!(
                    "the bias has rank {}, more than the result's {}: it would grow the result",
                    bias.rank(),
                    y.rank()
                ),
            ));
        }
        Ok(TracedTensor::new(
            y.dtype(),
            y.rank(),
            Op::Binary {
                op: ElementwiseOp::Add,
                a: y,
                b: bias.clone(),
                onto: Some("linear"),
            },
        ))
    }

    /// The same elements, in order, with shape `shape`: a view, which costs nothing. The element
    /// counts must agree; that is checked when the program is compiled.
    pub fn reshape(&self, shape: &[usize]) -> Self {
        TracedTensor::new(
            self.dtype(),
            shape.len(),
            Op::Reshape {
                a: self.clone(),
                shape: shape.to_vec(),
            },
        )
    }
}

fn supported(op: ElementwiseOp, dtype: DType) -> Result<()> {
    match unsupported(op, dtype) {
        Some(reason) => Err(Error::Usage(UsageError::UnsupportedElement {
            operation: op.name(),
            dtype,
            reason,
        })),
        None => Ok(()),
    }
}

macro_rules! binary_operator {
    ($trait:ident, $method:ident, $op:ident) => {
        impl std::ops::$trait<&TracedTensor> for &TracedTensor {
            type Output = Result<TracedTensor>;
            /// Elementwise, broadcasting as the eager operation does (NumPy's rule: a `[N]`
            /// bias onto `[B, N]`, a `[B, 1]` column, a scalar); refused at trace time when
            /// the operands' element types differ or the element type does not support the
            /// operation, and when the program is compiled with
            /// [`UsageError::NotBroadcastable`](crate::error::UsageError::NotBroadcastable)
            /// (naming both shapes) when the shapes do not broadcast.
            fn $method(self, rhs: &TracedTensor) -> Result<TracedTensor> {
                self.binary(ElementwiseOp::$op, rhs)
            }
        }
    };
}

binary_operator!(Add, add, Add);
binary_operator!(Sub, sub, Sub);
binary_operator!(Mul, mul, Mul);
binary_operator!(Div, div, Div);

impl std::ops::Neg for &TracedTensor {
    type Output = Result<TracedTensor>;
    /// Elementwise negation; refused at trace time for unsigned integers and `bool`.
    fn neg(self) -> Result<TracedTensor> {
        supported(ElementwiseOp::Neg, self.dtype())?;
        Ok(TracedTensor::new(
            self.dtype(),
            self.rank(),
            Op::Neg(self.clone()),
        ))
    }
}
