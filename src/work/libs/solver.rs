//! cuSOLVER on the engine's compute stream: the Cholesky solve of a symmetric positive definite system.
//!
//! [`CudaEngine::cholesky_solve`] factors `A = L·Lᵀ` (`potrf`) and solves `A·X = B` (`potrs`)
//! in place, queued on the engine's compute stream with a workspace drawn from the engine's
//! stream-ordered allocator. Whether the matrix was positive definite is only known on the
//! device, so the call returns a [`SolverStatus`] holding cuSOLVER's device-side `info` instead
//! of waiting for it; [`SolverStatus::check`] reads it when the caller chooses to wait.

use super::handles::CUSOLVER;
use super::{cusolver, dim, BlasElement};
use crate::core::engine::CudaEngine;
use crate::core::order::Use;
use crate::driver::Lane;
use crate::error::{Error, LibraryError, Result, UsageError};
use crate::memory::tensor::DeviceTensor;
use crate::routes::download_tensor;

pub(super) mod calls {
    use cudarc::cusolver::result::CusolverError;
    use cudarc::cusolver::sys::{self, cublasFillMode_t, cusolverDnHandle_t};

    /// The per-type cuSOLVER entry points. Not nameable outside the crate; its one item is a
    /// [`Potrf`] table whose fields only the crate can read, so no cudarc type reaches the
    /// public API through the sealed [`BlasElement`](super::BlasElement) bound.
    pub trait PotrfCall: Sized {
        /// The table.
        const POTRF: Potrf;
    }

    /// `cusolverDn?potrf_bufferSize`: handle, `n`, `A`, `lda`.
    ///
    /// # Safety
    /// cuSOLVER's contract: a live handle and a device matrix of `n × n` with `lda`.
    pub(in crate::work::libs) type BufferSizeFn =
        unsafe fn(cusolverDnHandle_t, i32, u64, i32) -> Result<i32, CusolverError>;

    /// `cusolverDn?potrf`, lower triangle: handle, `n`, `A`, `lda`, workspace, `lwork`, `info`.
    ///
    /// # Safety
    /// As [`BufferSizeFn`], plus a device workspace of `lwork` elements and a device `int`.
    pub(in crate::work::libs) type PotrfFn =
        unsafe fn(cusolverDnHandle_t, i32, u64, i32, u64, i32, u64) -> Result<(), CusolverError>;

    /// `cusolverDn?potrs`, lower triangle: handle, `n`, `nrhs`, `A`, `lda`, `B`, `ldb`, `info`.
    ///
    /// # Safety
    /// As [`PotrfFn`], plus a device right-hand side of `n × nrhs` with `ldb`.
    pub(in crate::work::libs) type PotrsFn = unsafe fn(
        cusolverDnHandle_t,
        i32,
        i32,
        u64,
        i32,
        u64,
        i32,
        u64,
    ) -> Result<(), CusolverError>;

    /// What `cholesky_solve` needs to know of one element type. Device pointers are addresses.
    pub struct Potrf {
        /// The names of the calls, for errors: buffer size, factor, solve.
        pub(in crate::work::libs) names: [&'static str; 3],
        /// `cusolverDn?potrf_bufferSize`.
        pub(in crate::work::libs) buffer_size: BufferSizeFn,
        /// `cusolverDn?potrf`.
        pub(in crate::work::libs) potrf: PotrfFn,
        /// `cusolverDn?potrs`.
        pub(in crate::work::libs) potrs: PotrsFn,
    }

    impl std::fmt::Debug for Potrf {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Potrf")
                .field("names", &self.names)
                .finish_non_exhaustive()
        }
    }

    fn check(status: sys::cusolverStatus_t) -> Result<(), CusolverError> {
        if status == sys::cusolverStatus_t::CUSOLVER_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(CusolverError(status))
        }
    }

    const LOWER: cublasFillMode_t = cublasFillMode_t::CUBLAS_FILL_MODE_LOWER;

    macro_rules! potrf_call {
        ($t:ty, $size:ident, $potrf:ident, $potrs:ident) => {
            impl PotrfCall for $t {
                const POTRF: Potrf = {
                    /// # Safety
                    /// As [`BufferSizeFn`].
                    unsafe fn buffer_size(
                        handle: cusolverDnHandle_t,
                        n: i32,
                        a: u64,
                        lda: i32,
                    ) -> Result<i32, CusolverError> {
                        let mut lwork = 0;
                        // SAFETY: forwarded from the caller; `lwork` is a valid out pointer.
                        check(unsafe {
                            sys::$size(handle, LOWER, n, a as *mut $t, lda, &mut lwork)
                        })?;
                        Ok(lwork)
                    }
                    /// # Safety
                    /// As [`PotrfFn`].
                    unsafe fn potrf(
                        handle: cusolverDnHandle_t,
                        n: i32,
                        a: u64,
                        lda: i32,
                        work: u64,
                        lwork: i32,
                        info: u64,
                    ) -> Result<(), CusolverError> {
                        // SAFETY: forwarded from the caller.
                        check(unsafe {
                            sys::$potrf(
                                handle,
                                LOWER,
                                n,
                                a as *mut $t,
                                lda,
                                work as *mut $t,
                                lwork,
                                info as *mut i32,
                            )
                        })
                    }
                    /// # Safety
                    /// As [`PotrsFn`].
                    #[allow(clippy::too_many_arguments)]
                    unsafe fn potrs(
                        handle: cusolverDnHandle_t,
                        n: i32,
                        nrhs: i32,
                        a: u64,
                        lda: i32,
                        b: u64,
                        ldb: i32,
                        info: u64,
                    ) -> Result<(), CusolverError> {
                        // SAFETY: forwarded from the caller.
                        check(unsafe {
                            sys::$potrs(
                                handle,
                                LOWER,
                                n,
                                nrhs,
                                a as *const $t,
                                lda,
                                b as *mut $t,
                                ldb,
                                info as *mut i32,
                            )
                        })
                    }
                    Potrf {
                        names: [stringify!($size), stringify!($potrf), stringify!($potrs)],
                        buffer_size,
                        potrf,
                        potrs,
                    }
                };
            }
        };
    }

    potrf_call!(
        f32,
        cusolverDnSpotrf_bufferSize,
        cusolverDnSpotrf,
        cusolverDnSpotrs
    );
    potrf_call!(
        f64,
        cusolverDnDpotrf_bufferSize,
        cusolverDnDpotrf,
        cusolverDnDpotrs
    );
}

/// The outcome of a queued cuSOLVER routine, still on the device: cuSOLVER's `info` values.
///
/// Reading it is a host wait, so it is deferred to [`check`](Self::check), which the caller
/// invokes when it chooses to wait. Dropping it unread is allowed: the solve still ran.
#[must_use = "the solve may have failed; `check` reads cuSOLVER's verdict"]
#[derive(Debug)]
pub struct SolverStatus {
    operation: &'static str,
    /// `[potrf info, potrs info]`.
    info: DeviceTensor<i32>,
}

impl SolverStatus {
    /// Waits for the routine and reports its verdict.
    ///
    /// # Errors
    /// [`LibraryError::NotPositiveDefinite`](crate::error::LibraryError::NotPositiveDefinite) when the factorisation found a leading minor that is not
    /// positive definite (the solution is then meaningless); [`LibraryError::InvalidParameter`](crate::error::LibraryError::InvalidParameter)
    /// when cuSOLVER reports an invalid parameter; whatever the download reports.
    pub fn check(self, engine: &mut CudaEngine) -> Result<()> {
        let info = download_tensor(engine, &self.info)?;
        for (step, &value) in info.iter().enumerate() {
            if value > 0 && step == 0 {
                return Err(Error::Library(LibraryError::NotPositiveDefinite {
                    operation: self.operation,
                    order: i64::from(value),
                }));
            }
            if value != 0 {
                return Err(Error::Library(LibraryError::InvalidParameter {
                    operation: self.operation,
                    library: "cuSOLVER",
                    parameter: -i64::from(value),
                }));
            }
        }
        Ok(())
    }

    /// The raw `info` values on the device: `[potrf, potrs]`.
    pub fn into_info(self) -> DeviceTensor<i32> {
        self.info
    }
}

impl CudaEngine {
    /// Solves `A·X = B` for a symmetric positive definite `A` by Cholesky factorisation, in
    /// place, on the engine's compute stream. Queued; does not wait.
    ///
    /// - `a` is `n × n` (shape `[n, n]`). Only its lower triangle (column-major) is read, which,
    ///   `A` being symmetric, is the same matrix in row-major terms. It is overwritten with the
    ///   factor `L`.
    /// - `b` holds `nrhs` right-hand sides of `n` elements each, one after another (column-major
    ///   `n × nrhs`, which is row-major shape `[nrhs, n]`); `nrhs = b.len() / n`. It is
    ///   overwritten with the solutions.
    ///
    /// The workspace comes from the engine's compute stream-ordered allocator and is released, ordered
    /// after the solve, before this returns.
    ///
    /// # Errors
    /// [`UsageError::NotSquare`](crate::error::UsageError::NotSquare) when `a` is not square,
    /// [`UsageError::NotAMultiple`](crate::error::UsageError::NotAMultiple) when `b`'s length is not a
    /// positive multiple of `n`, [`UsageError::ExceedsLimit`](crate::error::UsageError::ExceedsLimit)
    /// when `n` or `nrhs` exceeds 32 bits; [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) for another engine's
    /// tensor; [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when cuSOLVER is missing or the engine is simulated;
    /// [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when cuSOLVER refuses. A matrix that is not positive definite is
    /// reported by [`SolverStatus::check`].
    pub fn cholesky_solve<T: BlasElement>(
        &mut self,
        a: &mut DeviceTensor<T>,
        b: &mut DeviceTensor<T>,
    ) -> Result<SolverStatus> {
        const OP: &str = "cholesky_solve";
        a.check_engine(self)?;
        b.check_engine(self)?;
        let n = match *a.shape() {
            [rows, cols] if rows == cols && rows > 0 => rows,
            _ => {
                return Err(Error::Usage(UsageError::NotSquare {
                    operation: OP,
                    what: "A",
                    shape: a.shape().to_vec(),
                }))
            }
        };
        if b.is_empty() || !b.len().is_multiple_of(n) {
            return Err(Error::Usage(UsageError::NotAMultiple {
                operation: OP,
                what: "B",
                len: b.len(),
                order: n,
            }));
        }
        let nrhs = b.len() / n;
        let (n32, nrhs32) = (dim(OP, "n", n)?, dim(OP, "nrhs", nrhs)?);
        // Checked before allocating, so a missing library is reported as such.
        {
            let mut st = self.enter()?;
            cusolver(&mut st)?;
        }
        let info = DeviceTensor::<i32>::alloc(self, &[2])?;
        let mut st = self.enter()?;
        let handle = cusolver(&mut st)?;
        let uses = [
            Use::Write(a.raw_ptr()),
            Use::Write(b.raw_ptr()),
            Use::Write(info.raw_ptr()),
        ];
        st.order_uses(Lane::Compute, &uses)?;
        let calls = T::POTRF;
        let [size_call, potrf_call, potrs_call] = calls.names;
        let status = |call| {
            move |e: cudarc::cusolver::result::CusolverError| CUSOLVER.status(call, e.0, e.0 as i64)
        };
        let a_ptr = a.raw_ptr();
        // SAFETY: the handle is the engine's with its context current; `a` is a live `n × n`
        // allocation (checked above). The query reads no device memory.
        let lwork = unsafe { (calls.buffer_size)(handle, n32, a_ptr, n32) };
        let lwork = lwork.map_err(status(size_call))?;
        let lwork_elems = usize::try_from(lwork.max(1)).unwrap_or(1);
        let work_bytes = crate::memory::element::byte_len::<T>(lwork_elems, "cuSOLVER workspace")?;
        let work = st
            .driver
            .alloc(Lane::Compute, work_bytes)
            .map_err(Error::driver("cuMemAllocFromPoolAsync"))?;
        // SAFETY: every pointer names a live allocation of this engine large enough for the
        // call (a: n×n, b: n×nrhs, work: lwork elements, info: 2 ints); `a` and `b` are borrowed
        // exclusively and `info` is owned here, so nothing else touches them; their frees are
        // queued (if at all) after these calls, on the same stream the handle is bound to.
        let solved = unsafe {
            (calls.potrf)(handle, n32, a.raw_ptr(), n32, work, lwork, info.raw_ptr())
                .map_err(status(potrf_call))
                .and_then(|()| {
                    (calls.potrs)(
                        handle,
                        n32,
                        nrhs32,
                        a.raw_ptr(),
                        n32,
                        b.raw_ptr(),
                        n32,
                        info.raw_ptr() + 4,
                    )
                    .map_err(status(potrs_call))
                })
        };
        // SAFETY: `work` came from `alloc` above and is freed once, ordered after the calls that
        // use it.
        if let Err(source) = unsafe { st.driver.free(Lane::Compute, work) } {
            st.defer(Error::Driver {
                call: "cuMemFreeAsync",
                source,
            });
        }
        solved?;
        drop(st);
        Ok(SolverStatus {
            operation: OP,
            info,
        })
    }
}
