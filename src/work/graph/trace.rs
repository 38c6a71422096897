//! Tracing: describing a computation once, with symbolic inputs.
//!
//! A [`TracedTensor`] is a node of an expression DAG. Inputs have an element type and a rank but
//! no shape yet; operators (`&x * &x`, `+`, `-`, `/`, unary `-`) and methods (`scale`, `cast`,
//! `full_like`, `matmul`, `reshape`) build new nodes. Every element type and rank rule is checked
//! here, when the node is made, so an ill-typed program never reaches compilation: shapes are
//! the only thing left for [`GraphCompiler`](super::GraphCompiler) to check.
//!
//! Nodes are immutable and shared (`Arc`), so a subexpression used twice is one node, and a
//! traced value is cheap to clone and `Send + Sync`.

use crate::dtype::DType;
use crate::error::{Error, ProgramError, Result, UsageError};
use crate::memory::element::Element;
use crate::work::kernels::scalar_bits;
use crate::work::kernels::spec::ElementwiseOp;
use crate::work::kernels::spec::unsupported;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_NODE: AtomicU64 = AtomicU64::new(1);

/// A value in a traced computation: a symbolic input, or an operation on traced values.
///
/// Made with [`TracedTensor::input_symbolic_shape`] and combined with operators on references
/// (each returns a `Result`, because operands of different element types or ranks are refused
/// here, at trace time):
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
    /// `a op b`, elementwise.
    Binary {
        op: ElementwiseOp,
        a: TracedTensor,
        b: TracedTensor,
    },
    /// `-a`.
    Neg(TracedTensor),
    /// `a * factor`.
    Scale { a: TracedTensor, bits: u64 },
    /// `a as dtype`.
    Cast(TracedTensor),
    /// The row-major product of two matrices.
    Matmul { a: TracedTensor, b: TracedTensor },
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
        if self.rank() != rhs.rank() {
            return Err(mismatch(
                op.name(),
                format!("operands have rank {} and {}", self.rank(), rhs.rank()),
            ));
        }
        supported(op, self.dtype())?;
        Ok(TracedTensor::new(
            self.dtype(),
            self.rank(),
            Op::Binary {
                op,
                a: self.clone(),
                b: rhs.clone(),
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
            /// Elementwise; refused at trace time when the operands' element types or ranks
            /// differ, or the element type does not support the operation.
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
