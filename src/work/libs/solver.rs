//! cuSOLVER on the engine's compute stream: the Cholesky solve of a symmetric positive definite system.
//!
//! [`CudaEngine::cholesky_solve`] factors `A = L·Lᵀ` (`potrf`) and solves `A·X = B` (`potrs`)
//! in place, queued on the engine's compute stream with a workspace drawn from the engine's
//! stream-ordered allocator. Whether the matrix was positive definite is only known on the
//! device, so the call returns a [`SolverStatus`] holding cuSOLVER's device-side `info` instead
//! of waiting for it; [`SolverStatus::check`] reads it when the caller chooses to wait.

use super::{BlasElement, dim};
use crate::core::engine::{Charge, CudaEngine};
use crate::core::order::Use;
use crate::driver::Lane;
use crate::driver::libs::{Library, Spd};
use crate::error::{Error, LibraryError, Result, UsageError};
use crate::ledger::Owner;
use crate::lifecycle::scalar::{ScalarHost, scalar_transfer};
use crate::memory::tensor::DeviceTensor;

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
        // Two `i32`s: the scalar band's one synchronized copy, as a blocking download of them.
        let mut bytes = [0u8; 8];
        scalar_transfer(engine, &self.info, ScalarHost::Download(&mut bytes))?;
        let info = [
            i32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            i32::from_ne_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
        ];
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
    /// tensor; [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when cuSOLVER is missing;
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
                }));
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
        self.enter()?.driver.library_open(Library::Solver)?;
        let info = DeviceTensor::<i32>::alloc(self, &[2])?;
        let matrix = Spd {
            dtype: T::DTYPE,
            n: n32,
            a: a.raw_ptr(),
            lda: n32,
        };
        let mut st = self.enter()?;
        let uses = [
            Use::Write(a.raw_ptr()),
            Use::Write(b.raw_ptr()),
            Use::Write(info.raw_ptr()),
        ];
        st.order_uses(Lane::Compute, &uses)?;
        let lwork = st.driver.potrf_workspace(&matrix)?;
        let work_bytes = crate::memory::element::byte_len::<T>(lwork, "cuSOLVER workspace")?;
        let work = st
            .alloc_for(Lane::Compute, work_bytes, Owner::Workspaces)
            .map_err(Error::driver("cuMemAllocFromPoolAsync"))?;
        // SAFETY: every pointer names a live allocation of this engine large enough for the
        // call (a: n×n, b: n×nrhs, work: lwork elements, info: 2 ints), none overlapping another;
        // `a` and `b` are borrowed exclusively and `info` is owned here, so nothing else touches
        // them; their frees are queued (if at all) after these calls, ordered after them by the
        // uses just recorded.
        let solved = unsafe {
            st.driver
                .potrf(&matrix, work, lwork, info.raw_ptr())
                .and_then(|()| {
                    st.driver
                        .potrs(&matrix, nrhs32, b.raw_ptr(), n32, info.raw_ptr() + 4)
                })
        };
        let charge = Charge::new(Owner::Workspaces, work_bytes);
        // SAFETY: `work` came from `alloc_for` above on the compute lane and is freed once,
        // ordered after the calls that use it (on the same lane).
        unsafe { st.free_on_lane(Lane::Compute, work, charge) };
        solved?;
        drop(st);
        Ok(SolverStatus {
            operation: OP,
            info,
        })
    }
}
