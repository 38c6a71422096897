//! The library handles an engine holds, and the probes for the libraries behind them.
//!
//! One handle per library, created the first time an operation needs it and bound to the
//! engine's compute stream, destroyed when the engine is dropped, after its streams have
//! drained. This is an engine part (`core::parts`), held by the engine and locked with the
//! driver; it knows only the driver seam and the part trait.
//!
//! The libraries are loaded at run time. cudarc panics when a dynamically loaded library is
//! missing, so each one is probed first (once per process) and an absent library is a typed
//! [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) naming it.

use crate::core::parts::{Part, Teardown};
use crate::driver::Driver;
use crate::error::{DeviceKind, Error, LibraryError, Result, SetupError};
use std::sync::OnceLock;

/// The library handles of one engine, each made on first use.
#[derive(Default)]
pub(crate) struct LibraryHandles {
    cublas: Option<cudarc::cublas::sys::cublasHandle_t>,
    cusolver: Option<cudarc::cusolver::sys::cusolverDnHandle_t>,
    cutensor: Option<cudarc::cutensor::sys::cutensorHandle_t>,
}

impl Part for LibraryHandles {
    /// After the core's events, before the kernel cache.
    const TEARDOWN: Teardown = Teardown::AfterEvents(0);

    /// Destroys every handle.
    fn teardown(&mut self, _driver: &mut dyn Driver) {
        self.release();
    }
}

// SAFETY: the handles are opaque library handles, usable from any thread as long as calls on one
// handle are serialised and the engine's context is current; the engine's mutex serialises every
// use and `Shared::enter` makes the context current around it.
unsafe impl Send for LibraryHandles {}

impl LibraryHandles {
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

/// A library: its name and how to probe for it.
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
    /// Checks that the library can be called on `driver`'s device: a real device, and the
    /// library loadable on this machine.
    pub(crate) fn check(self, driver: &dyn Driver) -> Result<()> {
        if driver.device().kind() == DeviceKind::Simulated {
            return Err(Error::Setup(SetupError::Unavailable {
                library: self.name,
                detail: "simulated device: vendor libraries run only on a CUDA device".into(),
            }));
        }
        if !*self.cache.get_or_init(self.present) {
            return Err(Error::Setup(SetupError::Unavailable {
                library: self.name,
                detail: format!(
                    "none of {:?} could be loaded",
                    cudarc::get_lib_name_candidates(self.base)
                ),
            }));
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
        Error::Library(LibraryError::Vendor {
            library: self.name,
            call,
            status: code,
            name: format!("{status:?}"),
        })
    }
}

impl LibraryHandles {
    /// The cuBLAS handle, made and bound to `driver`'s stream on first use. Call with the
    /// driver's context current.
    pub(crate) fn cublas(
        &mut self,
        driver: &dyn Driver,
    ) -> Result<cudarc::cublas::sys::cublasHandle_t> {
        CUBLAS.check(driver)?;
        if let Some(handle) = self.cublas {
            return Ok(handle);
        }
        let handle = cudarc::cublas::result::create_handle()
            .map_err(|e| CUBLAS.status("cublasCreate_v2", e.0, e.0 as i64))?;
        let stream = driver.stream_handle() as cudarc::cublas::sys::cudaStream_t;
        // SAFETY: `handle` is fresh; the stream belongs to the driver's context, which the caller
        // made current.
        if let Err(e) = unsafe { cudarc::cublas::result::set_stream(handle, stream) } {
            // SAFETY: the fresh handle is destroyed once and was never used.
            let _ = unsafe { cudarc::cublas::result::destroy_handle(handle) };
            return Err(CUBLAS.status("cublasSetStream_v2", e.0, e.0 as i64));
        }
        self.cublas = Some(handle);
        Ok(handle)
    }

    /// The dense cuSOLVER handle, made and bound to `driver`'s stream on first use. Call with
    /// the driver's context current.
    pub(crate) fn cusolver(
        &mut self,
        driver: &dyn Driver,
    ) -> Result<cudarc::cusolver::sys::cusolverDnHandle_t> {
        CUSOLVER.check(driver)?;
        if let Some(handle) = self.cusolver {
            return Ok(handle);
        }
        let handle = cudarc::cusolver::result::dn_create()
            .map_err(|e| CUSOLVER.status("cusolverDnCreate", e.0, e.0 as i64))?;
        let stream = driver.stream_handle() as cudarc::cusolver::sys::cudaStream_t;
        // SAFETY: `handle` is fresh; the stream belongs to the driver's context, which the caller
        // made current.
        if let Err(e) = unsafe { cudarc::cusolver::result::dn_set_stream(handle, stream) } {
            // SAFETY: the fresh handle is destroyed once and was never used.
            let _ = unsafe { cudarc::cusolver::result::dn_destroy(handle) };
            return Err(CUSOLVER.status("cusolverDnSetStream", e.0, e.0 as i64));
        }
        self.cusolver = Some(handle);
        Ok(handle)
    }

    /// The cuTENSOR handle, made on first use (cuTENSOR takes the stream per call). Call with
    /// the driver's context current.
    pub(crate) fn cutensor(
        &mut self,
        driver: &dyn Driver,
    ) -> Result<cudarc::cutensor::sys::cutensorHandle_t> {
        CUTENSOR.check(driver)?;
        if let Some(handle) = self.cutensor {
            return Ok(handle);
        }
        let handle = cudarc::cutensor::result::create_handle()
            .map_err(|e| CUTENSOR.status("cutensorCreate", e.0, e.0 as i64))?;
        self.cutensor = Some(handle);
        Ok(handle)
    }
}
