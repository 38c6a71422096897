//! Vendor libraries bound to the engine's stream: cuBLAS, cuSOLVER and cuTENSOR.
//!
//! The engine owns one handle per library, created the first time an operation needs it and
//! bound to the engine's stream, so vendor calls are ordered with every other operation and none
//! waits for the host. The handles are destroyed when the engine is dropped, after its stream
//! has drained.
//!
//! The libraries are loaded at run time. cudarc panics when a dynamically loaded library is
//! missing, so each one is probed first (once per process) and an absent library is a typed
//! [`Error::Unavailable`] naming it (cuTENSOR, for example, is not installed on every CUDA
//! machine). On the simulated device every vendor operation returns [`Error::Unavailable`] with
//! the detail "simulated device": the simulator does not emulate vendor numerics, and nothing
//! falls back to a CPU implementation.
//!
//! Matrices are column-major, as in BLAS and LAPACK: element `(i, j)` of a matrix with leading
//! dimension `ld` is at index `i + j * ld`. [`CudaEngine::matmul`](crate::CudaEngine::matmul) is the exception: it takes
//! row-major 2-D tensors, the usual meaning of a tensor's shape, and maps them onto cuBLAS.

pub(crate) mod blas;
pub(crate) mod solver;
pub(crate) mod tensor;

pub use blas::{BlasElement, GemmConfig, Transpose};
pub use solver::SolverStatus;
pub use tensor::TensorElement;

use crate::engine::Entered;
use crate::error::{DeviceKind, Error, Result};
use std::sync::OnceLock;

/// The engine's vendor handles, each made on first use.
#[derive(Default)]
pub(crate) struct VendorHandles {
    cublas: Option<cudarc::cublas::sys::cublasHandle_t>,
    cusolver: Option<cudarc::cusolver::sys::cusolverDnHandle_t>,
    cutensor: Option<cudarc::cutensor::sys::cutensorHandle_t>,
}

// SAFETY: the handles are opaque library handles, usable from any thread as long as calls on one
// handle are serialised and the engine's context is current; the engine's mutex serialises every
// use and `Shared::enter` makes the context current around it.
unsafe impl Send for VendorHandles {}

impl VendorHandles {
    /// Destroys every handle. Call only with the engine's context current and its stream idle.
    pub(crate) fn release(&mut self) {
        if let Some(handle) = self.cublas.take() {
            // SAFETY: the handle was created by `cublasCreate_v2` and is destroyed once (taken);
            // the stream is idle, so no call that uses it is pending.
            let _ = unsafe { cudarc::cublas::result::destroy_handle(handle) };
        }
        if let Some(handle) = self.cusolver.take() {
            // SAFETY: as above, for `cusolverDnCreate`.
            let _ = unsafe { cudarc::cusolver::result::dn_destroy(handle) };
        }
        if let Some(handle) = self.cutensor.take() {
            // SAFETY: as above, for `cutensorCreate`.
            let _ = unsafe { cudarc::cutensor::result::destroy_handle(handle) };
        }
    }
}

/// A vendor library: its name and how to probe for it.
#[derive(Clone, Copy)]
pub(crate) struct Library {
    name: &'static str,
    /// The base name cudarc loads (`cublas`, `cusolver`, `cutensor`).
    base: &'static str,
    present: fn() -> bool,
    cache: &'static OnceLock<bool>,
}

fn cublas_present() -> bool {
    // SAFETY: `is_culib_present` only attempts to `dlopen` candidate library names.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

fn cusolver_present() -> bool {
    // SAFETY: as in `cublas_present`.
    unsafe { cudarc::cusolver::sys::is_culib_present() }
}

fn cutensor_present() -> bool {
    // SAFETY: as in `cublas_present`.
    unsafe { cudarc::cutensor::sys::is_culib_present() }
}

static CUBLAS_PRESENT: OnceLock<bool> = OnceLock::new();
static CUSOLVER_PRESENT: OnceLock<bool> = OnceLock::new();
static CUTENSOR_PRESENT: OnceLock<bool> = OnceLock::new();

pub(crate) const CUBLAS: Library = Library {
    name: "cuBLAS",
    base: "cublas",
    present: cublas_present,
    cache: &CUBLAS_PRESENT,
};

pub(crate) const CUSOLVER: Library = Library {
    name: "cuSOLVER",
    base: "cusolver",
    present: cusolver_present,
    cache: &CUSOLVER_PRESENT,
};

pub(crate) const CUTENSOR: Library = Library {
    name: "cuTENSOR",
    base: "cutensor",
    present: cutensor_present,
    cache: &CUTENSOR_PRESENT,
};

impl Library {
    /// Checks that the library can be called from this engine: a real device, and the library
    /// loadable on this machine.
    pub(crate) fn check(self, st: &Entered<'_>) -> Result<()> {
        if st.driver.device().kind() == DeviceKind::Simulated {
            return Err(Error::Unavailable {
                library: self.name,
                detail: "simulated device: vendor libraries run only on a CUDA device".into(),
            });
        }
        if !*self.cache.get_or_init(self.present) {
            return Err(Error::Unavailable {
                library: self.name,
                detail: format!(
                    "none of {:?} could be loaded",
                    cudarc::get_lib_name_candidates(self.base)
                ),
            });
        }
        Ok(())
    }

    /// A failure status of this library as an error.
    pub(crate) fn status(
        self,
        call: &'static str,
        status: impl std::fmt::Debug,
        code: i64,
    ) -> Error {
        Error::Vendor {
            library: self.name,
            call,
            status: code,
            name: format!("{status:?}"),
        }
    }
}

/// The engine's cuBLAS handle, made and bound to the stream on first use.
pub(crate) fn cublas(st: &mut Entered<'_>) -> Result<cudarc::cublas::sys::cublasHandle_t> {
    CUBLAS.check(st)?;
    if let Some(handle) = st.vendor.cublas {
        return Ok(handle);
    }
    let handle = cudarc::cublas::result::create_handle()
        .map_err(|e| CUBLAS.status("cublasCreate_v2", e.0, e.0 as i64))?;
    let stream = st.driver.stream_handle() as cudarc::cublas::sys::cudaStream_t;
    // SAFETY: `handle` is fresh; the stream belongs to the engine's context, current here.
    if let Err(e) = unsafe { cudarc::cublas::result::set_stream(handle, stream) } {
        // SAFETY: the fresh handle is destroyed once and was never used.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(handle) };
        return Err(CUBLAS.status("cublasSetStream_v2", e.0, e.0 as i64));
    }
    st.vendor.cublas = Some(handle);
    Ok(handle)
}

/// The engine's dense cuSOLVER handle, made and bound to the stream on first use.
pub(crate) fn cusolver(st: &mut Entered<'_>) -> Result<cudarc::cusolver::sys::cusolverDnHandle_t> {
    CUSOLVER.check(st)?;
    if let Some(handle) = st.vendor.cusolver {
        return Ok(handle);
    }
    let handle = cudarc::cusolver::result::dn_create()
        .map_err(|e| CUSOLVER.status("cusolverDnCreate", e.0, e.0 as i64))?;
    let stream = st.driver.stream_handle() as cudarc::cusolver::sys::cudaStream_t;
    // SAFETY: `handle` is fresh; the stream belongs to the engine's context, current here.
    if let Err(e) = unsafe { cudarc::cusolver::result::dn_set_stream(handle, stream) } {
        // SAFETY: the fresh handle is destroyed once and was never used.
        let _ = unsafe { cudarc::cusolver::result::dn_destroy(handle) };
        return Err(CUSOLVER.status("cusolverDnSetStream", e.0, e.0 as i64));
    }
    st.vendor.cusolver = Some(handle);
    Ok(handle)
}

/// The engine's cuTENSOR handle, made on first use (cuTENSOR takes the stream per call).
pub(crate) fn cutensor(st: &mut Entered<'_>) -> Result<cudarc::cutensor::sys::cutensorHandle_t> {
    CUTENSOR.check(st)?;
    if let Some(handle) = st.vendor.cutensor {
        return Ok(handle);
    }
    let handle = cudarc::cutensor::result::create_handle()
        .map_err(|e| CUTENSOR.status("cutensorCreate", e.0, e.0 as i64))?;
    st.vendor.cutensor = Some(handle);
    Ok(handle)
}

/// Converts a dimension to the `int` vendor APIs take.
pub(crate) fn dim(operation: &'static str, what: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::InvalidArgument {
        operation,
        detail: format!("{what} = {value} exceeds the library's 32-bit limit"),
    })
}
