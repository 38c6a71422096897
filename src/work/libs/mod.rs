//! NVIDIA's libraries bound to the engine's compute stream: cuBLAS, cuSOLVER and cuTENSOR.
//!
//! The engine owns one handle per library, created the first time an operation needs it and
//! bound to the engine's compute stream, so library calls are ordered with every other operation and none
//! waits for the host. The handles are destroyed when the engine is dropped, after its streams
//! have drained.
//!
//! The libraries are loaded at run time. cudarc panics when a dynamically loaded library is
//! missing, so each one is probed first (once per process) and an absent library is a typed
//! [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) naming it (cuTENSOR, for example, is not
//! installed on every CUDA machine). On the simulated device every library operation returns
//! [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) with the detail "simulated device": the
//! simulator does not emulate library numerics, and nothing falls back to a CPU implementation.
//!
//! Matrices are column-major, as in BLAS and LAPACK: element `(i, j)` of a matrix with leading
//! dimension `ld` is at index `i + j * ld`. [`CudaEngine::matmul`](crate::CudaEngine::matmul)
//! is the exception: it takes row-major 2-D tensors, the usual meaning of a tensor's shape, and
//! maps them onto cuBLAS.
//!
//! Each library has its own module: `blas` (cuBLAS: [`CudaEngine::gemm`](crate::CudaEngine::gemm),
//! [`CudaEngine::matmul`](crate::CudaEngine::matmul)), `solver` (cuSOLVER:
//! [`CudaEngine::cholesky_solve`](crate::CudaEngine::cholesky_solve)) and `cutensor` (cuTENSOR:
//! [`CudaEngine::contract`](crate::CudaEngine::contract)); the handles and the probes are
//! `handles`, an engine part that knows only the device seam.

pub(crate) mod blas;
pub(crate) mod cutensor;
pub(crate) mod handles;
pub(crate) mod solver;

pub use blas::{BlasElement, GemmConfig, Transpose};
pub use cutensor::TensorElement;
pub use solver::SolverStatus;

use crate::core::engine::Entered;
use crate::error::{Result, UsageError};
use handles::LibraryHandles;

/// The engine's cuBLAS handle, made and bound to the compute stream on first use.
pub(crate) fn cublas(st: &mut Entered<'_>) -> Result<cudarc::cublas::sys::cublasHandle_t> {
    let st = &mut **st;
    st.parts.get_mut::<LibraryHandles>().cublas(&*st.driver)
}

/// The engine's dense cuSOLVER handle, made and bound to the compute stream on first use.
pub(crate) fn cusolver(st: &mut Entered<'_>) -> Result<cudarc::cusolver::sys::cusolverDnHandle_t> {
    let st = &mut **st;
    st.parts.get_mut::<LibraryHandles>().cusolver(&*st.driver)
}

/// The engine's cuTENSOR handle, made on first use (cuTENSOR takes the compute stream per call).
pub(crate) fn cutensor(st: &mut Entered<'_>) -> Result<cudarc::cutensor::sys::cutensorHandle_t> {
    let st = &mut **st;
    st.parts.get_mut::<LibraryHandles>().cutensor(&*st.driver)
}

/// Converts a dimension to the `int` vendor APIs take.
pub(crate) fn dim(operation: &'static str, what: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| {
        UsageError::ExceedsLimit {
            operation,
            what,
            value,
            limit: i32::MAX as usize,
        }
        .into()
    })
}
