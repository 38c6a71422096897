//! The library half of the seam on a CUDA device: cuBLAS, cuSOLVER and cuTENSOR through cudarc's
//! `result` and `sys` modules.
//!
//! One handle per library, made the first time a call needs it and bound to the driver's compute
//! stream (cuTENSOR takes the stream per call instead), destroyed by
//! [`Libraries::libraries_release`] once the engine's streams have drained.
//!
//! The libraries are loaded at run time. cudarc panics when a dynamically loaded library is
//! missing, so each one is probed first (once per process) and an absent library is a typed
//! [`SetupError::Unavailable`] naming it (cuTENSOR, for example, is not installed on every CUDA
//! machine).

use super::CudaDriver;
use crate::driver::libs::{Contraction, ContractionPlan, Gemm, Libraries, Library, Plans, Spd};
use crate::driver::{DevicePtr, Driver};
use crate::dtype::DType;
use crate::error::{Error, LibraryError, SetupError, UsageError};
use cudarc::cublas::sys::{cublasHandle_t, cublasOperation_t};
use cudarc::cusolver::sys::{cublasFillMode_t, cusolverDnHandle_t, cusolverStatus_t};
use cudarc::cutensor::sys as tsys;
use std::ffi::c_void;
use std::sync::OnceLock;

/// The library handles of one driver, each made on first use.
#[derive(Default)]
pub(super) struct LibraryHandles {
    cublas: Option<cublasHandle_t>,
    cusolver: Option<cusolverDnHandle_t>,
    cutensor: Option<tsys::cutensorHandle_t>,
    /// Live contraction plans, by the handle [`ContractionPlan`] carries.
    plans: Plans<Planned>,
}

/// What cuTENSOR made for one contraction: destroyed together, on every path.
#[derive(Default)]
struct Planned {
    descriptors: Vec<tsys::cutensorTensorDescriptor_t>,
    operation: Option<tsys::cutensorOperationDescriptor_t>,
    preference: Option<tsys::cutensorPlanPreference_t>,
    plan: Option<tsys::cutensorPlan_t>,
    /// The workspace the plan was made for, in bytes.
    workspace: u64,
    /// Whether the element type is `f64` (else `f32`): the type of the scalars.
    double: bool,
}

impl Drop for Planned {
    fn drop(&mut self) {
        // SAFETY: each object was created by cuTENSOR for this plan and is destroyed once here;
        // a contraction already enqueued with them is not affected (cuTENSOR captures what it
        // needs at enqueue time).
        unsafe {
            if let Some(plan) = self.plan.take() {
                let _ = cudarc::cutensor::result::destroy_plan(plan);
            }
            if let Some(pref) = self.preference.take() {
                let _ = cudarc::cutensor::result::destroy_plan_preference(pref);
            }
            if let Some(op) = self.operation.take() {
                let _ = cudarc::cutensor::result::destroy_operation_descriptor(op);
            }
            for desc in self.descriptors.drain(..) {
                let _ = cudarc::cutensor::result::destroy_tensor_descriptor(desc);
            }
        }
    }
}

impl LibraryHandles {
    /// Destroys every handle and plan. Call only with the driver's context current and its
    /// stream idle.
    fn release(&mut self) {
        self.plans.clear();
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

/// Whether `library` can be loaded on this machine, probed once per process.
fn present(library: Library) -> bool {
    static CUBLAS: OnceLock<bool> = OnceLock::new();
    static CUSOLVER: OnceLock<bool> = OnceLock::new();
    static CUTENSOR: OnceLock<bool> = OnceLock::new();
    match library {
        Library::Blas => *CUBLAS.get_or_init(|| {
            // SAFETY: `is_culib_present` only attempts to `dlopen` candidate library names.
            unsafe { cudarc::cublas::sys::is_culib_present() }
        }),
        Library::Solver => *CUSOLVER.get_or_init(|| {
            // SAFETY: as above.
            unsafe { cudarc::cusolver::sys::is_culib_present() }
        }),
        Library::Tensor => *CUTENSOR.get_or_init(|| {
            // SAFETY: as above.
            unsafe { cudarc::cutensor::sys::is_culib_present() }
        }),
    }
}

/// Refuses a library that cannot be loaded, naming the files tried.
fn check_present(library: Library) -> Result<(), Error> {
    if present(library) {
        return Ok(());
    }
    let base = match library {
        Library::Blas => "cublas",
        Library::Solver => "cusolver",
        Library::Tensor => "cutensor",
    };
    Err(Error::Setup(SetupError::Unavailable {
        library: library.name(),
        detail: format!(
            "none of {:?} could be loaded",
            cudarc::get_lib_name_candidates(base)
        ),
    }))
}

/// A failure status of `library`'s `call` as an error.
fn vendor(library: Library, call: &'static str, status: impl std::fmt::Debug, code: i64) -> Error {
    Error::Library(LibraryError::Vendor {
        library: library.name(),
        call,
        status: code,
        name: format!("{status:?}"),
    })
}

fn op(transposed: bool) -> cublasOperation_t {
    if transposed {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// The element type as one the libraries serve here, or a typed refusal naming `operation`.
fn float(operation: &'static str, dtype: DType) -> Result<bool, Error> {
    match dtype {
        DType::F32 => Ok(false),
        DType::F64 => Ok(true),
        other => Err(Error::Usage(UsageError::UnsupportedElement {
            operation,
            dtype: other,
            reason: "the libraries serve f32 and f64 here",
        })),
    }
}

fn solver_status(call: &'static str, status: cusolverStatus_t) -> Result<(), Error> {
    if status == cusolverStatus_t::CUSOLVER_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(vendor(Library::Solver, call, status, status as i64))
    }
}

const LOWER: cublasFillMode_t = cublasFillMode_t::CUBLAS_FILL_MODE_LOWER;

impl CudaDriver {
    /// The cuBLAS handle, made and bound to the compute stream on first use.
    fn cublas(&mut self) -> Result<cublasHandle_t, Error> {
        check_present(Library::Blas)?;
        if let Some(handle) = self.libs.cublas {
            return Ok(handle);
        }
        let handle = cudarc::cublas::result::create_handle()
            .map_err(|e| vendor(Library::Blas, "cublasCreate_v2", e.0, e.0 as i64))?;
        let stream = Driver::stream_handle(self) as cudarc::cublas::sys::cudaStream_t;
        // SAFETY: `handle` is fresh; the stream belongs to this driver's context, which the
        // engine made current around the call.
        if let Err(e) = unsafe { cudarc::cublas::result::set_stream(handle, stream) } {
            // SAFETY: the fresh handle is destroyed once and was never used.
            let _ = unsafe { cudarc::cublas::result::destroy_handle(handle) };
            return Err(vendor(Library::Blas, "cublasSetStream_v2", e.0, e.0 as i64));
        }
        self.libs.cublas = Some(handle);
        Ok(handle)
    }

    /// The dense cuSOLVER handle, made and bound to the compute stream on first use.
    fn cusolver(&mut self) -> Result<cusolverDnHandle_t, Error> {
        check_present(Library::Solver)?;
        if let Some(handle) = self.libs.cusolver {
            return Ok(handle);
        }
        let handle = cudarc::cusolver::result::dn_create()
            .map_err(|e| vendor(Library::Solver, "cusolverDnCreate", e.0, e.0 as i64))?;
        let stream = Driver::stream_handle(self) as cudarc::cusolver::sys::cudaStream_t;
        // SAFETY: `handle` is fresh; the stream belongs to this driver's context, current.
        if let Err(e) = unsafe { cudarc::cusolver::result::dn_set_stream(handle, stream) } {
            // SAFETY: the fresh handle is destroyed once and was never used.
            let _ = unsafe { cudarc::cusolver::result::dn_destroy(handle) };
            return Err(vendor(
                Library::Solver,
                "cusolverDnSetStream",
                e.0,
                e.0 as i64,
            ));
        }
        self.libs.cusolver = Some(handle);
        Ok(handle)
    }

    /// The cuTENSOR handle, made on first use (cuTENSOR takes the stream per call).
    fn cutensor(&mut self) -> Result<tsys::cutensorHandle_t, Error> {
        check_present(Library::Tensor)?;
        if let Some(handle) = self.libs.cutensor {
            return Ok(handle);
        }
        let handle = cudarc::cutensor::result::create_handle()
            .map_err(|e| vendor(Library::Tensor, "cutensorCreate", e.0, e.0 as i64))?;
        self.libs.cutensor = Some(handle);
        Ok(handle)
    }
}

impl Libraries for CudaDriver {
    fn library_open(&mut self, library: Library) -> Result<(), Error> {
        match library {
            Library::Blas => self.cublas().map(drop),
            Library::Solver => self.cusolver().map(drop),
            Library::Tensor => self.cutensor().map(drop),
        }
    }

    unsafe fn gemm(&mut self, g: &Gemm) -> Result<(), Error> {
        let double = float("gemm", g.dtype)?;
        let handle = self.cublas()?;
        let (ta, tb) = (op(g.transa), op(g.transb));
        if double {
            // SAFETY: the handle is this driver's, bound to its stream, with its context
            // current; the caller guarantees the operands' extents and lifetimes; alpha and
            // beta are host scalars (the handle's default pointer mode), read before the call
            // returns.
            unsafe {
                cudarc::cublas::result::dgemm(
                    handle,
                    ta,
                    tb,
                    g.m,
                    g.n,
                    g.k,
                    &g.alpha,
                    g.a as *const f64,
                    g.lda,
                    g.b as *const f64,
                    g.ldb,
                    &g.beta,
                    g.c as *mut f64,
                    g.ldc,
                )
            }
            .map_err(|e| vendor(Library::Blas, "cublasDgemm_v2", e.0, e.0 as i64))
        } else {
            // The scalars were widened from f32: narrowing them back is exact.
            let (alpha, beta) = (g.alpha as f32, g.beta as f32);
            // SAFETY: as above, for f32.
            unsafe {
                cudarc::cublas::result::sgemm(
                    handle,
                    ta,
                    tb,
                    g.m,
                    g.n,
                    g.k,
                    &alpha,
                    g.a as *const f32,
                    g.lda,
                    g.b as *const f32,
                    g.ldb,
                    &beta,
                    g.c as *mut f32,
                    g.ldc,
                )
            }
            .map_err(|e| vendor(Library::Blas, "cublasSgemm_v2", e.0, e.0 as i64))
        }
    }

    fn potrf_workspace(&mut self, m: &Spd) -> Result<usize, Error> {
        use cudarc::cusolver::sys;
        let double = float("cholesky_solve", m.dtype)?;
        let handle = self.cusolver()?;
        let mut lwork = 0;
        // SAFETY: the handle is live with its context current; the query reads no device
        // memory; `lwork` is a valid out pointer.
        let status = unsafe {
            if double {
                sys::cusolverDnDpotrf_bufferSize(
                    handle,
                    LOWER,
                    m.n,
                    m.a as *mut f64,
                    m.lda,
                    &mut lwork,
                )
            } else {
                sys::cusolverDnSpotrf_bufferSize(
                    handle,
                    LOWER,
                    m.n,
                    m.a as *mut f32,
                    m.lda,
                    &mut lwork,
                )
            }
        };
        let call = if double {
            "cusolverDnDpotrf_bufferSize"
        } else {
            "cusolverDnSpotrf_bufferSize"
        };
        solver_status(call, status)?;
        Ok(usize::try_from(lwork.max(1)).unwrap_or(1))
    }

    unsafe fn potrf(
        &mut self,
        m: &Spd,
        work: DevicePtr,
        lwork: usize,
        info: DevicePtr,
    ) -> Result<(), Error> {
        use cudarc::cusolver::sys;
        let double = float("cholesky_solve", m.dtype)?;
        let handle = self.cusolver()?;
        let lwork = i32::try_from(lwork).map_err(|_| {
            Error::Library(LibraryError::Workspace {
                operation: "cholesky_solve",
                library: "cuSOLVER",
                bytes: lwork as u64,
            })
        })?;
        // SAFETY: the handle is this driver's, bound to its stream, context current; the caller
        // guarantees the matrix, the workspace and `info` are live and large enough.
        let status = unsafe {
            if double {
                sys::cusolverDnDpotrf(
                    handle,
                    LOWER,
                    m.n,
                    m.a as *mut f64,
                    m.lda,
                    work as *mut f64,
                    lwork,
                    info as *mut i32,
                )
            } else {
                sys::cusolverDnSpotrf(
                    handle,
                    LOWER,
                    m.n,
                    m.a as *mut f32,
                    m.lda,
                    work as *mut f32,
                    lwork,
                    info as *mut i32,
                )
            }
        };
        let call = if double {
            "cusolverDnDpotrf"
        } else {
            "cusolverDnSpotrf"
        };
        solver_status(call, status)
    }

    unsafe fn potrs(
        &mut self,
        m: &Spd,
        nrhs: i32,
        b: DevicePtr,
        ldb: i32,
        info: DevicePtr,
    ) -> Result<(), Error> {
        use cudarc::cusolver::sys;
        let double = float("cholesky_solve", m.dtype)?;
        let handle = self.cusolver()?;
        // SAFETY: as in `potrf`, for the factor, the right-hand sides and `info`.
        let status = unsafe {
            if double {
                sys::cusolverDnDpotrs(
                    handle,
                    LOWER,
                    m.n,
                    nrhs,
                    m.a as *const f64,
                    m.lda,
                    b as *mut f64,
                    ldb,
                    info as *mut i32,
                )
            } else {
                sys::cusolverDnSpotrs(
                    handle,
                    LOWER,
                    m.n,
                    nrhs,
                    m.a as *const f32,
                    m.lda,
                    b as *mut f32,
                    ldb,
                    info as *mut i32,
                )
            }
        };
        let call = if double {
            "cusolverDnDpotrs"
        } else {
            "cusolverDnSpotrs"
        };
        solver_status(call, status)
    }

    fn contraction_plan(&mut self, c: &Contraction<'_>) -> Result<ContractionPlan, Error> {
        let double = float("contract", c.dtype)?;
        let handle = self.cutensor()?;
        let fail = |call: &'static str| {
            move |e: cudarc::cutensor::result::CutensorError| {
                vendor(Library::Tensor, call, e.0, e.0 as i64)
            }
        };
        let (data_type, symbol): (_, &[u8]) = if double {
            (
                tsys::cudaDataType_t::CUDA_R_64F,
                b"CUTENSOR_COMPUTE_DESC_64F\0",
            )
        } else {
            (
                tsys::cudaDataType_t::CUDA_R_32F,
                b"CUTENSOR_COMPUTE_DESC_32F\0",
            )
        };
        // SAFETY: cuTENSOR is present (checked by `cutensor`); the symbol is a global variable
        // of type `cutensorComputeDescriptor_t` that cuTENSOR 2 exports, read once here.
        let compute: tsys::cutensorComputeDescriptor_t = unsafe {
            let symbol = tsys::culib()
                .get::<*const tsys::cutensorComputeDescriptor_t>(symbol)
                .map_err(|e| {
                    Error::Setup(SetupError::Unavailable {
                        library: "cuTENSOR",
                        detail: format!("compute descriptor symbol missing: {e}"),
                    })
                })?;
            **symbol
        };
        let mut made = Planned::default();
        for i in 0..3 {
            let rank = u32::try_from(c.extents[i].len()).unwrap_or(u32::MAX);
            // SAFETY: the handle is live; the extents and strides hold `rank` entries each.
            let desc = unsafe {
                cudarc::cutensor::result::create_tensor_descriptor(
                    handle,
                    rank,
                    c.extents[i].as_ptr(),
                    c.strides[i].as_ptr(),
                    data_type,
                    ALIGNMENT,
                )
            }
            .map_err(fail("cutensorCreateTensorDescriptor"))?;
            made.descriptors.push(desc);
        }
        let identity = tsys::cutensorOperator_t::CUTENSOR_OP_IDENTITY;
        let (da, db, dc) = (
            made.descriptors[0],
            made.descriptors[1],
            made.descriptors[2],
        );
        // SAFETY: the descriptors are live and each mode list matches its descriptor's rank; C
        // doubles as D (cuTENSOR allows them to be identical).
        let operation = unsafe {
            cudarc::cutensor::result::create_contraction(
                handle,
                da,
                c.modes[0].as_ptr(),
                identity,
                db,
                c.modes[1].as_ptr(),
                identity,
                dc,
                c.modes[2].as_ptr(),
                identity,
                dc,
                c.modes[2].as_ptr(),
                compute,
            )
        }
        .map_err(fail("cutensorCreateContraction"))?;
        made.operation = Some(operation);
        // SAFETY: the handle is live.
        let preference = unsafe {
            cudarc::cutensor::result::create_plan_preference(
                handle,
                tsys::cutensorAlgo_t::CUTENSOR_ALGO_DEFAULT,
                tsys::cutensorJitMode_t::CUTENSOR_JIT_MODE_NONE,
            )
        }
        .map_err(fail("cutensorCreatePlanPreference"))?;
        made.preference = Some(preference);
        // SAFETY: handle, operation and preference are live.
        let workspace = unsafe {
            cudarc::cutensor::result::estimate_workspace_size(
                handle,
                operation,
                preference,
                tsys::cutensorWorksizePreference_t::CUTENSOR_WORKSPACE_DEFAULT,
            )
        }
        .map_err(fail("cutensorEstimateWorkspaceSize"))?;
        // SAFETY: as above.
        let plan = unsafe {
            cudarc::cutensor::result::create_plan(handle, operation, preference, workspace)
        }
        .map_err(fail("cutensorCreatePlan"))?;
        made.plan = Some(plan);
        made.workspace = workspace;
        made.double = double;
        let bytes = usize::try_from(workspace).map_err(|_| LibraryError::Workspace {
            operation: "contract",
            library: "cuTENSOR",
            bytes: workspace,
        })?;
        Ok(ContractionPlan {
            handle: self.libs.plans.insert(made),
            workspace: bytes,
        })
    }

    unsafe fn contract(
        &mut self,
        plan: &ContractionPlan,
        alpha: f64,
        beta: f64,
        a: DevicePtr,
        b: DevicePtr,
        c: DevicePtr,
        work: DevicePtr,
    ) -> Result<(), Error> {
        let handle = self.cutensor()?;
        let stream = Driver::stream_handle(self) as tsys::cudaStream_t;
        let Some(made) = self.libs.plans.get(plan.handle) else {
            return Err(Error::driver("cutensorContract")(
                crate::error::DriverError::INVALID_VALUE,
            ));
        };
        let (Some(p), workspace, double) = (made.plan, made.workspace, made.double) else {
            unreachable!("a stored plan is complete");
        };
        let (a32, b32) = (alpha as f32, beta as f32);
        let (alpha, beta): (*const c_void, *const c_void) = if double {
            ((&alpha as *const f64).cast(), (&beta as *const f64).cast())
        } else {
            ((&a32 as *const f32).cast(), (&b32 as *const f32).cast())
        };
        // SAFETY: the plan was made for these tensors (the caller's contract), which are live
        // allocations whose frees are queued after this call on the same stream; the workspace
        // holds `workspace` bytes; alpha and beta point at host scalars of the element type,
        // read before the call returns.
        unsafe {
            cudarc::cutensor::result::contract(
                handle,
                p,
                alpha,
                a as *const c_void,
                b as *const c_void,
                beta,
                c as *const c_void,
                c as *mut c_void,
                work as *mut c_void,
                workspace,
                stream,
            )
        }
        .map_err(|e| vendor(Library::Tensor, "cutensorContract", e.0, e.0 as i64))
    }

    fn contraction_plan_destroy(&mut self, plan: ContractionPlan) {
        self.libs.plans.remove(plan.handle);
    }

    fn libraries_release(&mut self) {
        self.libs.release();
    }
}

/// The alignment, in bytes, cuTENSOR may assume of every operand (allocations from the engine's
/// pool are at least this aligned).
const ALIGNMENT: u32 = 128;
