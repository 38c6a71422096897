//! The library half of the device seam: the dense linear algebra the crate offers, queued on the
//! driver's compute stream.
//!
//! Like [`launch`](super::launch) and [`graph`](super::graph), it is a supertrait of
//! [`Driver`](super::Driver) and names device operations only: a general matrix product
//! ([`Libraries::gemm`]), a Cholesky factorisation and the solve that uses it
//! ([`Libraries::potrf`], [`Libraries::potrs`]), and a tensor contraction planned once and run
//! ([`Libraries::contraction_plan`], [`Libraries::contract`]). Matrices are column-major, as in
//! BLAS and LAPACK; device memory is addresses; dimensions are the `int`s the vendor APIs take,
//! checked by the caller.
//!
//! A real device calls cuBLAS, cuSOLVER and cuTENSOR, loaded at run time, with one handle per
//! library made on first use and bound to the compute stream (so a call made while the stream
//! captures is recorded into the graph). The simulated device runs each call as an emulated
//! launch on its compute stream: at the same place in stream order, reading and writing its own
//! memory when the clock reaches it, recorded into a capture like any launch, and refused (or
//! failed) when a fault is injected for it.
//!
//! Every call returns the crate's [`Error`]: a missing library is
//! [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) naming it, a refused call
//! [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) with the library's status.

use super::DevicePtr;
use crate::dtype::DType;
use crate::error::Error;

/// One of the libraries behind this half of the seam.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Library {
    /// Matrix products (cuBLAS).
    Blas,
    /// Dense factorisations (cuSOLVER).
    Solver,
    /// Tensor contractions (cuTENSOR).
    Tensor,
}

impl Library {
    /// The vendor library's name, as errors give it.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Library::Blas => "cuBLAS",
            Library::Solver => "cuSOLVER",
            Library::Tensor => "cuTENSOR",
        }
    }
}

/// A column-major `C = alpha * op(A) * op(B) + beta * C`, where `op(A)` is `m × k`, `op(B)` is
/// `k × n` and `C` is `m × n`: BLAS's `gemm`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Gemm {
    /// The element type: `F32` or `F64`.
    pub(crate) dtype: DType,
    /// Whether `A` is used transposed.
    pub(crate) transa: bool,
    /// Whether `B` is used transposed.
    pub(crate) transb: bool,
    pub(crate) m: i32,
    pub(crate) n: i32,
    pub(crate) k: i32,
    /// The scale of the product, in the element type (an `f32` widened exactly, for `F32`).
    pub(crate) alpha: f64,
    /// The scale of `C`'s previous contents; zero ignores them, NaNs included.
    pub(crate) beta: f64,
    pub(crate) a: DevicePtr,
    pub(crate) lda: i32,
    pub(crate) b: DevicePtr,
    pub(crate) ldb: i32,
    pub(crate) c: DevicePtr,
    pub(crate) ldc: i32,
}

/// A symmetric positive definite `n × n` matrix, column-major with leading dimension `lda`, of
/// which only the lower triangle is read: the operand of [`Libraries::potrf`] and
/// [`Libraries::potrs`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spd {
    /// The element type: `F32` or `F64`.
    pub(crate) dtype: DType,
    pub(crate) n: i32,
    pub(crate) a: DevicePtr,
    pub(crate) lda: i32,
}

/// A contraction `C = alpha * Σ A·B + beta * C` over named modes, each tensor given by its
/// modes, extents and strides (in elements), outermost first.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Contraction<'a> {
    /// The element type: `F32` or `F64`.
    pub(crate) dtype: DType,
    /// Each tensor's modes (`A`, `B`, `C`): a mode is a number, the same in every tensor that
    /// has it. A mode of `A` and `B` that `C` lacks is summed over.
    pub(crate) modes: [&'a [i32]; 3],
    /// Each tensor's extent along each of its modes.
    pub(crate) extents: [&'a [i64]; 3],
    /// Each tensor's stride along each of its modes.
    pub(crate) strides: [&'a [i64]; 3],
}

/// A contraction planned by [`Libraries::contraction_plan`]: valid until
/// [`Libraries::contraction_plan_destroy`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ContractionPlan {
    /// The driver's handle for it.
    pub(crate) handle: u64,
    /// The device workspace [`Libraries::contract`] needs, in bytes (zero: none).
    pub(crate) workspace: usize,
}

/// The contraction plans a driver has made, by the handle each [`ContractionPlan`] carries; a
/// destroyed plan's slot is reused.
#[derive(Debug)]
pub(crate) struct Plans<P> {
    slots: Vec<Option<P>>,
}

impl<P> Default for Plans<P> {
    fn default() -> Self {
        Plans { slots: Vec::new() }
    }
}

impl<P> Plans<P> {
    /// Keeps `plan`, and returns its handle.
    pub(crate) fn insert(&mut self, plan: P) -> u64 {
        let at = match self.slots.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[at] = Some(plan);
        at as u64
    }

    /// The plan of `handle`, while it is kept.
    pub(crate) fn get(&self, handle: u64) -> Option<&P> {
        self.slots.get(usize::try_from(handle).ok()?)?.as_ref()
    }

    /// Drops the plan of `handle`, if it is kept.
    pub(crate) fn remove(&mut self, handle: u64) {
        if let Some(slot) = usize::try_from(handle)
            .ok()
            .and_then(|at| self.slots.get_mut(at))
        {
            *slot = None;
        }
    }

    /// Drops every plan.
    pub(crate) fn clear(&mut self) {
        self.slots.clear();
    }
}

/// The dense linear algebra the crate offers, on the driver's context and compute stream.
pub(crate) trait Libraries {
    /// Makes `library` ready on this driver (loads it, makes its handle and binds it to the
    /// compute stream) if it is not already. Every call below does this itself; asking first
    /// tells a missing library apart before anything is allocated.
    fn library_open(&mut self, library: Library) -> Result<(), Error>;

    /// Queues `gemm` on the compute stream (or records it into the stream's capture).
    ///
    /// # Safety
    /// `A`, `B` and `C` hold the elements the product reads and writes under its dimensions and
    /// leading dimensions, in live allocations that stay live until it completes; `C` overlaps
    /// neither operand.
    unsafe fn gemm(&mut self, gemm: &Gemm) -> Result<(), Error>;

    /// The workspace [`potrf`](Self::potrf) needs for `matrix`, in elements (at least one).
    /// Reads no device memory.
    fn potrf_workspace(&mut self, matrix: &Spd) -> Result<usize, Error>;

    /// Queues the Cholesky factorisation `A = L·Lᵀ` of `matrix` in place (its lower triangle
    /// becomes `L`), writing LAPACK's `info` to the `i32` at `info`: zero, or the order of the
    /// first leading minor that is not positive definite.
    ///
    /// # Safety
    /// `matrix` lies in a live allocation, `work` holds `lwork` elements of its type (from
    /// [`potrf_workspace`](Self::potrf_workspace)) and `info` one `i32`, all live until the
    /// factorisation completes, and none overlaps another.
    unsafe fn potrf(
        &mut self,
        matrix: &Spd,
        work: DevicePtr,
        lwork: usize,
        info: DevicePtr,
    ) -> Result<(), Error>;

    /// Queues the solve `A·X = B` with the factor [`potrf`](Self::potrf) left in `matrix`: `B`,
    /// `n × nrhs` with leading dimension `ldb`, is overwritten with `X`; `info` receives zero or
    /// minus the index of an invalid parameter.
    ///
    /// # Safety
    /// As [`potrf`](Self::potrf), for `matrix`, `B` and `info`.
    unsafe fn potrs(
        &mut self,
        matrix: &Spd,
        nrhs: i32,
        b: DevicePtr,
        ldb: i32,
        info: DevicePtr,
    ) -> Result<(), Error>;

    /// Plans `contraction` (and says how much workspace running it takes).
    fn contraction_plan(&mut self, contraction: &Contraction<'_>)
    -> Result<ContractionPlan, Error>;

    /// Queues the planned contraction on the compute stream: `C = alpha * Σ A·B + beta * C`
    /// (`alpha` and `beta` in the element type, widened exactly), with `work` holding the plan's
    /// workspace.
    ///
    /// # Safety
    /// `plan` came from [`contraction_plan`](Self::contraction_plan) on this driver and is live;
    /// `a`, `b` and `c` hold the tensors the plan describes, and `work` `plan.workspace` bytes,
    /// in live allocations that stay live until the contraction completes; `c` overlaps neither
    /// input.
    #[allow(clippy::too_many_arguments)]
    unsafe fn contract(
        &mut self,
        plan: &ContractionPlan,
        alpha: f64,
        beta: f64,
        a: DevicePtr,
        b: DevicePtr,
        c: DevicePtr,
        work: DevicePtr,
    ) -> Result<(), Error>;

    /// Destroys a plan. A contraction already queued with it is not affected.
    fn contraction_plan_destroy(&mut self, plan: ContractionPlan);

    /// Destroys the libraries' handles. Call only once nothing queued on the stream by a library
    /// is pending (the engine's teardown, after its streams have drained); a library used after
    /// this makes its handle again.
    fn libraries_release(&mut self);
}
