//! cuBLAS general matrix multiply on the engine's compute stream.
//!
//! [`CudaEngine::gemm`] is BLAS's `gemm`, column-major with explicit leading dimensions;
//! [`CudaEngine::matmul`] multiplies row-major 2-D tensors into a new one,
//! [`CudaEngine::matmul_t`] with either operand transposed, and [`CudaEngine::linear`] is
//! PyTorch's `x · wᵀ + bias`. Both validate every
//! dimension against the tensors' lengths before anything is queued, so a bad argument is a
//! typed error, never an out-of-bounds read on the device.

use super::dim;
use crate::core::engine::CudaEngine;
use crate::core::order::Use;
use crate::driver::libs::{Gemm, Library};
use crate::driver::{DevicePtr, Lane};
use crate::error::{Error, Result, UsageError};
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;

pub(super) mod private {
    /// What the libraries need of an element type: its one, and its value as the `f64` the
    /// device seam carries scalars in (exactly, for `f32`). Not nameable outside the crate, so
    /// [`BlasElement`](super::BlasElement) stays sealed.
    pub trait Scalar: Sized {
        /// One.
        const ONE: Self;
        /// The value, widened exactly.
        fn widen(self) -> f64;
    }

    impl Scalar for f32 {
        const ONE: f32 = 1.0;
        fn widen(self) -> f64 {
            f64::from(self)
        }
    }

    impl Scalar for f64 {
        const ONE: f64 = 1.0;
        fn widen(self) -> f64 {
            self
        }
    }
}

/// An element type cuBLAS and cuSOLVER serve here: `f32` and `f64`. Sealed.
pub trait BlasElement: Element + private::Scalar {}

impl BlasElement for f32 {}
impl BlasElement for f64 {}

/// Whether a matrix operand is used as stored or transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Transpose {
    /// Use the matrix as stored.
    #[default]
    No,
    /// Use its transpose.
    Yes,
}

/// A column-major `C = alpha * op(A) * op(B) + beta * C`, where `op(A)` is `m × k`, `op(B)` is
/// `k × n` and `C` is `m × n`.
///
/// Leading dimensions are the distance between columns, in elements: a stored matrix with `r`
/// rows needs `ld >= max(1, r)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmConfig<T> {
    /// How `A` is used.
    pub transa: Transpose,
    /// How `B` is used.
    pub transb: Transpose,
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// The scale of the product.
    pub alpha: T,
    /// The scale of `C`'s previous contents (zero ignores them, NaNs included).
    pub beta: T,
    /// `A`'s leading dimension.
    pub lda: usize,
    /// `B`'s leading dimension.
    pub ldb: usize,
    /// `C`'s leading dimension.
    pub ldc: usize,
}

impl<T: BlasElement> GemmConfig<T> {
    /// A packed, untransposed product: `lda = m`, `ldb = k`, `ldc = m`.
    pub fn new(m: usize, n: usize, k: usize, alpha: T, beta: T) -> Self {
        GemmConfig {
            transa: Transpose::No,
            transb: Transpose::No,
            m,
            n,
            k,
            alpha,
            beta,
            lda: m.max(1),
            ldb: k.max(1),
            ldc: m.max(1),
        }
    }
}

/// Checks that a column-major `rows × cols` operand with leading dimension `ld` fits in `len`
/// elements.
fn check_operand(
    operation: &'static str,
    name: char,
    rows: usize,
    cols: usize,
    ld: usize,
    len: usize,
) -> Result<()> {
    if ld < rows.max(1) {
        return Err(Error::Usage(UsageError::LeadingDimension {
            operation,
            matrix: name,
            leading_dimension: ld,
            rows,
        }));
    }
    let needed = if rows == 0 || cols == 0 {
        0
    } else {
        ld.checked_mul(cols - 1)
            .and_then(|x| x.checked_add(rows))
            .ok_or(Error::Usage(UsageError::MatrixOverflow {
                operation,
                matrix: name,
                rows,
                cols,
                leading_dimension: ld,
            }))?
    };
    if len < needed {
        return Err(Error::Usage(UsageError::MatrixExceedsTensor {
            operation,
            matrix: name,
            leading_dimension: ld,
            needed,
            available: len,
        }));
    }
    Ok(())
}

impl CudaEngine {
    /// cuBLAS `gemm` on the engine's compute stream: `C = alpha * op(A) * op(B) + beta * C`,
    /// column-major (see [`GemmConfig`]). Queued; does not wait.
    ///
    /// # Errors
    /// [`UsageError::LeadingDimension`](crate::error::UsageError::LeadingDimension) when a leading
    /// dimension is below its rows, [`UsageError::MatrixExceedsTensor`](crate::error::UsageError::MatrixExceedsTensor)
    /// when an operand (under its [`Transpose`]) does not fit its tensor,
    /// [`UsageError::MatrixOverflow`](crate::error::UsageError::MatrixOverflow) when its extent
    /// overflows `usize`,
    /// [`UsageError::ExceedsLimit`](crate::error::UsageError::ExceedsLimit) when a dimension exceeds
    /// 32 bits; [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) for another engine's
    /// tensor; [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when cuBLAS is missing;
    /// [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when cuBLAS refuses.
    pub fn gemm<T: BlasElement>(
        &mut self,
        config: &GemmConfig<T>,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
        c: &mut DeviceTensor<T>,
    ) -> Result<()> {
        const OP: &str = "gemm";
        a.check_engine(self)?;
        b.check_engine(self)?;
        c.check_engine(self)?;
        let GemmConfig { m, n, k, .. } = *config;
        let (a_rows, a_cols) = match config.transa {
            Transpose::No => (m, k),
            Transpose::Yes => (k, m),
        };
        let (b_rows, b_cols) = match config.transb {
            Transpose::No => (k, n),
            Transpose::Yes => (n, k),
        };
        check_operand(OP, 'A', a_rows, a_cols, config.lda, a.len())?;
        check_operand(OP, 'B', b_rows, b_cols, config.ldb, b.len())?;
        check_operand(OP, 'C', m, n, config.ldc, c.len())?;
        let dims = (
            dim(OP, "m", m)?,
            dim(OP, "n", n)?,
            dim(OP, "k", k)?,
            dim(OP, "lda", config.lda)?,
            dim(OP, "ldb", config.ldb)?,
            dim(OP, "ldc", config.ldc)?,
        );
        let gemm = Gemm {
            dtype: T::DTYPE,
            transa: config.transa == Transpose::Yes,
            transb: config.transb == Transpose::Yes,
            m: dims.0,
            n: dims.1,
            k: dims.2,
            alpha: config.alpha.widen(),
            beta: config.beta.widen(),
            a: a.raw_ptr(),
            lda: dims.3,
            b: b.raw_ptr(),
            ldb: dims.4,
            c: c.raw_ptr(),
            ldc: dims.5,
        };
        let mut st = self.enter()?;
        st.driver.library_open(Library::Blas)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let uses = [
            Use::Read(a.raw_ptr()),
            Use::Read(b.raw_ptr()),
            Use::Write(c.raw_ptr()),
        ];
        st.order_uses(Lane::Compute, &uses)?;
        // SAFETY: every operand was checked above to hold the elements the product reads or
        // writes under its dimensions; `a` and `b` stay borrowed for the call and `c`
        // exclusively (so `c` overlaps neither), and their frees are queued (if at all) after
        // this call, ordered after it by the uses just recorded.
        unsafe { st.driver.gemm(&gemm) }
    }

    /// The row-major product of 2-D tensors: `a` of shape `[m, k]` times `b` of shape `[k, n]`,
    /// into a new tensor of shape `[m, n]`. Queued; does not wait. The same as
    /// [`matmul_t`](Self::matmul_t) with neither operand transposed.
    ///
    /// cuBLAS is column-major, so this computes `Cᵀ = Bᵀ·Aᵀ`, which in column-major storage is
    /// exactly row-major `C = A·B`; no data is transposed.
    ///
    /// # Errors
    /// [`UsageError::NotAMatrix`](crate::error::UsageError::NotAMatrix) when a tensor is not 2-D,
    /// [`UsageError::InnerDimensions`](crate::error::UsageError::InnerDimensions) when the inner
    /// dimensions differ;
    /// otherwise as [`gemm`](Self::gemm).
    pub fn matmul<T: BlasElement>(
        &mut self,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
    ) -> Result<DeviceTensor<T>> {
        self.matmul_t(a, Transpose::No, b, Transpose::No)
    }

    /// The row-major product `op(a) · op(b)` of 2-D tensors, where `op` is the identity or the
    /// transpose as `ta` and `tb` say: `op(a)` is `[m, k]` and `op(b)` is `[k, n]`, into a new
    /// tensor of shape `[m, n]`. Queued; does not wait. Nothing is transposed in memory: cuBLAS
    /// reads the operands transposed, and the leading dimensions are the tensors' own.
    ///
    /// ```
    /// # fn main() -> Result<(), cuferry::Error> {
    /// use cuferry::libs::Transpose;
    /// # let mut engine = cuferry::CudaEngine::simulated(Default::default());
    /// let x = cuferry::upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// let w = cuferry::upload_tensor(&mut engine, &[1.0f32, 0.0, 1.0, 0.0, 1.0, 0.0], &[2, 3])?;
    /// let y = engine.matmul_t(&x, Transpose::No, &w, Transpose::Yes)?; // x · wᵀ
    /// assert_eq!(y.shape(), &[2, 2]);
    /// assert_eq!(cuferry::download_tensor(&mut engine, &y)?, [4.0, 2.0, 10.0, 5.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`UsageError::NotAMatrix`](crate::error::UsageError::NotAMatrix) when a tensor is not 2-D,
    /// [`UsageError::InnerDimensions`](crate::error::UsageError::InnerDimensions) when the inner
    /// dimensions of `op(a)` and `op(b)` differ (it gives their shapes as used, after the
    /// transposes); otherwise as [`gemm`](Self::gemm).
    pub fn matmul_t<T: BlasElement>(
        &mut self,
        a: &DeviceTensor<T>,
        ta: Transpose,
        b: &DeviceTensor<T>,
        tb: Transpose,
    ) -> Result<DeviceTensor<T>> {
        const OP: &str = "matmul";
        let (&[ar, ac], &[br, bc]) = (a.shape(), b.shape()) else {
            let (what, shape) = if a.shape().len() != 2 {
                ("A", a.shape())
            } else {
                ("B", b.shape())
            };
            return Err(Error::Usage(UsageError::NotAMatrix {
                operation: OP,
                what,
                shape: shape.to_vec(),
            }));
        };
        let (m, k) = ta.apply([ar, ac]);
        let (k2, n) = tb.apply([br, bc]);
        if k != k2 {
            return Err(Error::Usage(UsageError::InnerDimensions {
                operation: OP,
                left: [m, k],
                right: [k2, n],
            }));
        }
        a.check_engine(self)?;
        b.check_engine(self)?;
        let mut c = DeviceTensor::alloc(self, &[m, n])?;
        self.product_into(a, ac, ta, b, bc, tb, [m, k, n], &mut c)?;
        Ok(c)
    }

    /// A fully connected layer in PyTorch's layout: `x · wᵀ + bias`, where `x` is `[.., in]`
    /// (any number of leading dimensions, flattened into rows), `w` is `[out, in]` and `bias`,
    /// if any, is `[out]` (or anything that broadcasts onto `[.., out]`); the result is
    /// `[.., out]`. Queued; does not wait. No leading dimension is written by hand: `w` is read
    /// transposed by cuBLAS, and the bias added by the broadcasting [`add`](Self::add).
    ///
    /// ```
    /// # fn main() -> Result<(), cuferry::Error> {
    /// # let mut engine = cuferry::CudaEngine::simulated(Default::default());
    /// let x = cuferry::upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// let w = cuferry::upload_tensor(&mut engine, &[1.0f32, 1.0, 0.0, 2.0, 1.0, 0.0], &[3, 2])?;
    /// let b = cuferry::upload_tensor(&mut engine, &[0.5f32, 0.0, -1.0], &[3])?;
    /// let y = engine.linear(&x, &w, Some(&b))?;
    /// assert_eq!(y.shape(), &[2, 3]);
    /// assert_eq!(cuferry::download_tensor(&mut engine, &y)?, [3.5, 4.0, 0.0, 7.5, 8.0, 2.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`UsageError::NotAMatrix`](crate::error::UsageError::NotAMatrix) when `x` has no
    /// dimension or `w` is not 2-D; [`UsageError::InnerDimensions`](crate::error::UsageError::InnerDimensions)
    /// (operation `linear`, shapes `[rows, in]` and `[in of w, out]`) when the widths differ;
    /// [`UsageError::NotBroadcastable`](crate::error::UsageError::NotBroadcastable) (operation
    /// `linear`) when the bias does not broadcast onto the result; otherwise as
    /// [`gemm`](Self::gemm) and [`add`](Self::add). Every shape is checked before anything is
    /// queued.
    pub fn linear<T: BlasElement>(
        &mut self,
        x: &DeviceTensor<T>,
        w: &DeviceTensor<T>,
        bias: Option<&DeviceTensor<T>>,
    ) -> Result<DeviceTensor<T>> {
        const OP: &str = "linear";
        let (Some((&inf, lead)), &[outf, winf]) = (x.shape().split_last(), w.shape()) else {
            let (what, shape) = if x.shape().is_empty() {
                ("x", x.shape())
            } else {
                ("w", w.shape())
            };
            return Err(Error::Usage(UsageError::NotAMatrix {
                operation: OP,
                what,
                shape: shape.to_vec(),
            }));
        };
        let rows: usize = lead.iter().product();
        if inf != winf {
            return Err(Error::Usage(UsageError::InnerDimensions {
                operation: OP,
                left: [rows, inf],
                right: [winf, outf],
            }));
        }
        let mut shape = lead.to_vec();
        shape.push(outf);
        if let Some(bias) = bias {
            let joined = crate::work::kernels::broadcast(OP, &shape, bias.shape())?;
            if joined.shape != shape {
                return Err(Error::Usage(UsageError::NotBroadcastable {
                    operation: OP,
                    left: shape,
                    right: bias.shape().to_vec(),
                    dim: 0,
                }));
            }
            bias.check_engine(self)?;
        }
        x.check_engine(self)?;
        w.check_engine(self)?;
        let mut c = DeviceTensor::alloc(self, &shape)?;
        self.product_into(
            x,
            inf,
            Transpose::No,
            w,
            winf,
            Transpose::Yes,
            [rows, inf, outf],
            &mut c,
        )?;
        match bias {
            Some(bias) => self.add(&c, bias),
            None => Ok(c),
        }
    }

    /// `c = op(a) · op(b)`, row-major, for operands already checked: `a` and `b` have
    /// `a_cols` and `b_cols` columns as stored, `[m, k, n]` are the product's dimensions and
    /// `c` holds `m × n` elements.
    #[allow(clippy::too_many_arguments)]
    fn product_into<T: BlasElement>(
        &mut self,
        a: &DeviceTensor<T>,
        a_cols: usize,
        ta: Transpose,
        b: &DeviceTensor<T>,
        b_cols: usize,
        tb: Transpose,
        [m, k, n]: [usize; 3],
        c: &mut DeviceTensor<T>,
    ) -> Result<()> {
        let zero = T::default();
        if k == 0 {
            // An empty sum: C is zero. (cuBLAS would scale C by beta = 0 too.)
            return self.fill(c, zero);
        }
        // Row-major `C = op(A)·op(B)` is column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`, and a row-major
        // matrix read column-major is its transpose: so `B` goes first with `tb`, `A` second
        // with `ta`, each with its stored column count as its leading dimension.
        let config = GemmConfig {
            transa: tb,
            transb: ta,
            m: n,
            n: m,
            k,
            alpha: T::ONE,
            beta: zero,
            lda: b_cols.max(1),
            ldb: a_cols.max(1),
            ldc: n.max(1),
        };
        self.gemm(&config, b, a, c)
    }
}

impl Transpose {
    /// The `[rows, cols]` of a stored `[rows, cols]` matrix as this operand uses it.
    pub(crate) fn apply(self, [rows, cols]: [usize; 2]) -> (usize, usize) {
        match self {
            Transpose::No => (rows, cols),
            Transpose::Yes => (cols, rows),
        }
    }
}

/// Queues the row-major product `c[m×n] = op(a)[m×k] · op(b)[k×n]` on the engine's stream (or
/// into the stream's capture): `Cᵀ = op(B)ᵀ·op(A)ᵀ` in column-major terms, as
/// [`CudaEngine::matmul_t`] does. For prepared programs, which hold addresses rather than
/// tensors.
///
/// # Safety
/// `a`, `b` and `c` hold `m×k`, `k×n` and `m×n` elements of `dtype` in live allocations of the
/// engine that stay live until the product completes, and `c` overlaps neither operand.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn row_major_product(
    st: &mut crate::core::engine::Entered<'_>,
    dtype: crate::dtype::DType,
    [ta, tb]: [Transpose; 2],
    m: usize,
    k: usize,
    n: usize,
    a: DevicePtr,
    b: DevicePtr,
    c: DevicePtr,
) -> Result<()> {
    const OP: &str = "matmul";
    // The stored column counts: `op(a)` is `[m, k]`, so `a` is stored `[m, k]` or `[k, m]`.
    let a_cols = if ta == Transpose::No { k } else { m };
    let b_cols = if tb == Transpose::No { n } else { k };
    let (m, k, n) = (dim(OP, "m", m)?, dim(OP, "k", k)?, dim(OP, "n", n)?);
    let (a_cols, b_cols) = (dim(OP, "lda", a_cols)?, dim(OP, "ldb", b_cols)?);
    let gemm = Gemm {
        dtype,
        transa: tb == Transpose::Yes,
        transb: ta == Transpose::Yes,
        m: n,
        n: m,
        k,
        alpha: 1.0,
        beta: 0.0,
        a: b,
        lda: b_cols.max(1),
        b: a,
        ldb: a_cols.max(1),
        c,
        ldc: n.max(1),
    };
    // SAFETY: the caller guarantees the operands' extents, lifetimes and disjointness, which are
    // the column-major product's under the swap above.
    unsafe { st.driver.gemm(&gemm) }
}
