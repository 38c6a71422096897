//! NVIDIA's libraries bound to the engine's compute stream: cuBLAS, cuSOLVER and cuTENSOR.
//!
//! Every call is queued on the engine's compute stream, so library calls are ordered with every
//! other operation and none waits for the host. The library handles behind them belong to the
//! engine's driver, made on first use and destroyed when the engine is dropped, after its
//! streams have drained.
//!
//! The calls go through the library half of the device seam (`driver::libs`): on a GPU,
//! cuBLAS, cuSOLVER and cuTENSOR, loaded at run time, an absent library being a typed
//! [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) naming it (cuTENSOR, for
//! example, is not installed on every CUDA machine); on the simulated device, emulations with
//! the same place in stream order, the same arguments and the same results up to rounding, so
//! the lifecycle of every library call is tested without a GPU.
//!
//! Matrices are column-major, as in BLAS and LAPACK: element `(i, j)` of a matrix with leading
//! dimension `ld` is at index `i + j * ld`. [`CudaEngine::matmul`](crate::CudaEngine::matmul)
//! is the exception: it takes row-major 2-D tensors, the usual meaning of a tensor's shape, and
//! maps them onto cuBLAS.
//!
//! Each library has its own module: `blas` (cuBLAS: [`CudaEngine::gemm`](crate::CudaEngine::gemm),
//! [`CudaEngine::matmul`](crate::CudaEngine::matmul)), `solver` (cuSOLVER:
//! [`CudaEngine::cholesky_solve`](crate::CudaEngine::cholesky_solve)) and `cutensor` (cuTENSOR:
//! [`CudaEngine::contract`](crate::CudaEngine::contract)).

pub(crate) mod blas;
pub(crate) mod cutensor;
pub(crate) mod solver;

pub use blas::{BlasElement, GemmConfig, Transpose};
pub use cutensor::TensorElement;
pub use solver::SolverStatus;

use crate::error::{Result, UsageError};

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
