//! cuTENSOR contractions on the engine's compute stream, where the library is installed.
//!
//! [`CudaEngine::contract`] takes an Einstein-notation expression such as `"ik,kj->ij"` and
//! computes `C = alpha * contraction(A, B) + beta * C` for row-major tensors (the last mode
//! varies fastest, as a tensor's shape says). cuTENSOR is not installed on every CUDA machine;
//! where it is absent the call is a typed [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) naming it.

use super::handles::CUTENSOR;
use super::{cutensor, BlasElement};
use crate::core::engine::CudaEngine;
use crate::core::order::Use;
use crate::driver::Lane;
use crate::error::{Error, LibraryError, Result, SetupError, UsageError};
use crate::memory::tensor::DeviceTensor;
use cudarc::cutensor::sys;
use std::collections::HashMap;
use std::ffi::c_void;

pub(super) mod calls {
    use cudarc::cutensor::sys::cudaDataType_t;

    /// The per-type cuTENSOR constants. Not nameable outside the crate; its one item is a
    /// [`TensorConsts`] table whose fields only the crate can read, so no cudarc type reaches
    /// the public API through the sealed [`TensorElement`](super::TensorElement) bound.
    pub trait TensorType {
        /// The table.
        const TENSOR: TensorConsts;
    }

    /// What a contraction needs to know of one element type.
    pub struct TensorConsts {
        /// The element's data type.
        pub(in crate::work::libs) data_type: cudaDataType_t,
        /// The exported compute-descriptor symbol, NUL-terminated.
        pub(in crate::work::libs) compute_symbol: &'static [u8],
    }

    impl std::fmt::Debug for TensorConsts {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("TensorConsts").finish_non_exhaustive()
        }
    }

    impl TensorType for f32 {
        const TENSOR: TensorConsts = TensorConsts {
            data_type: cudaDataType_t::CUDA_R_32F,
            compute_symbol: b"CUTENSOR_COMPUTE_DESC_32F\0",
        };
    }

    impl TensorType for f64 {
        const TENSOR: TensorConsts = TensorConsts {
            data_type: cudaDataType_t::CUDA_R_64F,
            compute_symbol: b"CUTENSOR_COMPUTE_DESC_64F\0",
        };
    }
}

/// An element type cuTENSOR contractions serve here: `f32` and `f64`. Sealed.
pub trait TensorElement: BlasElement + calls::TensorType {}

impl TensorElement for f32 {}
impl TensorElement for f64 {}

/// The alignment, in bytes, cuTENSOR may assume of every operand (allocations from the engine's
/// pool are at least this aligned).
const ALIGNMENT: u32 = 128;

/// Parses `"ab,bc->ac"` into three mode lists.
fn parse(expression: &str) -> Result<[Vec<char>; 3]> {
    let bad = |reason: &'static str| {
        Error::Usage(UsageError::Expression {
            operation: "contract",
            expression: expression.to_owned(),
            reason,
        })
    };
    let (inputs, output) = expression
        .split_once("->")
        .ok_or_else(|| bad("expected the form \"ik,kj->ij\""))?;
    let (a, b) = inputs
        .split_once(',')
        .ok_or_else(|| bad("expected two operands separated by ','"))?;
    let modes = |s: &str| -> Result<Vec<char>> {
        let m: Vec<char> = s.trim().chars().collect();
        if m.iter().any(|c| !c.is_ascii_alphabetic()) {
            return Err(bad("modes must be ASCII letters"));
        }
        let mut seen = m.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != m.len() {
            return Err(bad("a mode repeats within one operand"));
        }
        Ok(m)
    };
    Ok([modes(a)?, modes(b)?, modes(output)?])
}

/// Row-major strides for `shape`.
fn strides(shape: &[usize]) -> Vec<i64> {
    let mut out = vec![0i64; shape.len()];
    let mut stride = 1i64;
    for (o, &d) in out.iter_mut().zip(shape).rev() {
        *o = stride;
        stride = stride.saturating_mul(i64::try_from(d).unwrap_or(i64::MAX));
    }
    out
}

/// Destroys what cuTENSOR made, on every path.
struct Made {
    descriptors: Vec<sys::cutensorTensorDescriptor_t>,
    operation: Option<sys::cutensorOperationDescriptor_t>,
    preference: Option<sys::cutensorPlanPreference_t>,
    plan: Option<sys::cutensorPlan_t>,
}

impl Drop for Made {
    fn drop(&mut self) {
        // SAFETY: each object was created by cuTENSOR in `contract` and is destroyed once here;
        // the contraction that used them has been enqueued (cuTENSOR captures what it needs at
        // enqueue time), or was never enqueued.
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

impl CudaEngine {
    /// A cuTENSOR contraction on the engine's compute stream: `C = alpha * Σ A·B + beta * C`, with modes
    /// named by an Einstein-notation expression such as `"ik,kj->ij"` (matrix product) or
    /// `"abk,kc->abc"`. Modes that appear in both inputs but not the output are summed over.
    /// Tensors are row-major. Queued; does not wait.
    ///
    /// # Errors
    /// [`UsageError::Expression`](crate::error::UsageError::Expression) for a malformed
    /// expression, [`UsageError::ModeCount`](crate::error::UsageError::ModeCount) for a mode count
    /// that differs from a tensor's rank, [`UsageError::ModeExtents`](crate::error::UsageError::ModeExtents)
    /// for one mode with two extents, [`UsageError::ExceedsLimit`](crate::error::UsageError::ExceedsLimit)
    /// for an extent past 32 bits; [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine)
    /// for another engine's tensor; [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when cuTENSOR is not installed or
    /// the engine is simulated; [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when cuTENSOR refuses.
    pub fn contract<T: TensorElement>(
        &mut self,
        expression: &str,
        alpha: T,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
        beta: T,
        c: &mut DeviceTensor<T>,
    ) -> Result<()> {
        const OP: &str = "contract";
        let modes = parse(expression)?;
        a.check_engine(self)?;
        b.check_engine(self)?;
        c.check_engine(self)?;
        let shapes = [a.shape(), b.shape(), c.shape()];
        let mut extents: HashMap<char, usize> = HashMap::new();
        for ((m, shape), operand) in modes.iter().zip(shapes).zip(['A', 'B', 'C']) {
            if m.len() != shape.len() {
                return Err(Error::Usage(UsageError::ModeCount {
                    operation: OP,
                    expression: expression.to_owned(),
                    operand,
                    modes: m.len(),
                    rank: shape.len(),
                }));
            }
            for (&mode, &extent) in m.iter().zip(shape) {
                if *extents.entry(mode).or_insert(extent) != extent {
                    return Err(Error::Usage(UsageError::ModeExtents {
                        operation: OP,
                        expression: expression.to_owned(),
                        mode,
                        first: extents[&mode],
                        second: extent,
                    }));
                }
            }
        }
        let mut st = self.enter()?;
        let handle = cutensor(&mut st)?;
        if c.is_empty() {
            return Ok(());
        }
        {
            let uses = [
                Use::Read(a.raw_ptr()),
                Use::Read(b.raw_ptr()),
                Use::Write(c.raw_ptr()),
            ];
            st.order_uses(Lane::Compute, &uses)?;
        }
        let fail = |call: &'static str| {
            move |e: cudarc::cutensor::result::CutensorError| CUTENSOR.status(call, e.0, e.0 as i64)
        };
        // SAFETY: cuTENSOR is present (checked by `cutensor`); the symbol is a global variable
        // of type `cutensorComputeDescriptor_t` that cuTENSOR 2 exports, read once here.
        let compute: sys::cutensorComputeDescriptor_t = unsafe {
            let lib = sys::culib();
            let symbol = lib
                .get::<*const sys::cutensorComputeDescriptor_t>(T::TENSOR.compute_symbol)
                .map_err(|e| {
                    Error::Setup(SetupError::Unavailable {
                        library: "cuTENSOR",
                        detail: format!("compute descriptor symbol missing: {e}"),
                    })
                })?;
            **symbol
        };
        let mut made = Made {
            descriptors: Vec::new(),
            operation: None,
            preference: None,
            plan: None,
        };
        let mut mode_ids: Vec<Vec<i32>> = Vec::new();
        for (m, shape) in modes.iter().zip(shapes) {
            let extent: Vec<i64> = shape
                .iter()
                .map(|&d| i64::try_from(d).unwrap_or(i64::MAX))
                .collect();
            let stride = strides(shape);
            let rank = u32::try_from(shape.len()).unwrap_or(u32::MAX);
            // SAFETY: the handle is live; `extent` and `stride` hold `rank` entries each.
            let desc = unsafe {
                cudarc::cutensor::result::create_tensor_descriptor(
                    handle,
                    rank,
                    extent.as_ptr(),
                    stride.as_ptr(),
                    T::TENSOR.data_type,
                    ALIGNMENT,
                )
            }
            .map_err(fail("cutensorCreateTensorDescriptor"))?;
            made.descriptors.push(desc);
            mode_ids.push(m.iter().map(|&ch| ch as i32).collect());
        }
        let identity = sys::cutensorOperator_t::CUTENSOR_OP_IDENTITY;
        let (da, db, dc) = (
            made.descriptors[0],
            made.descriptors[1],
            made.descriptors[2],
        );
        // SAFETY: the descriptors are live and each mode list matches its descriptor's rank;
        // C doubles as D (cuTENSOR allows them to be identical).
        let operation = unsafe {
            cudarc::cutensor::result::create_contraction(
                handle,
                da,
                mode_ids[0].as_ptr(),
                identity,
                db,
                mode_ids[1].as_ptr(),
                identity,
                dc,
                mode_ids[2].as_ptr(),
                identity,
                dc,
                mode_ids[2].as_ptr(),
                compute,
            )
        }
        .map_err(fail("cutensorCreateContraction"))?;
        made.operation = Some(operation);
        // SAFETY: the handle is live.
        let preference = unsafe {
            cudarc::cutensor::result::create_plan_preference(
                handle,
                sys::cutensorAlgo_t::CUTENSOR_ALGO_DEFAULT,
                sys::cutensorJitMode_t::CUTENSOR_JIT_MODE_NONE,
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
                sys::cutensorWorksizePreference_t::CUTENSOR_WORKSPACE_DEFAULT,
            )
        }
        .map_err(fail("cutensorEstimateWorkspaceSize"))?;
        // SAFETY: as above.
        let plan = unsafe {
            cudarc::cutensor::result::create_plan(handle, operation, preference, workspace)
        }
        .map_err(fail("cutensorCreatePlan"))?;
        made.plan = Some(plan);
        let work_bytes = usize::try_from(workspace).map_err(|_| LibraryError::Workspace {
            operation: OP,
            library: "cuTENSOR",
            bytes: workspace,
        })?;
        let work = if work_bytes == 0 {
            0
        } else {
            st.driver
                .alloc(Lane::Compute, work_bytes)
                .map_err(Error::driver("cuMemAllocFromPoolAsync"))?
        };
        let stream = st.driver.stream_handle() as sys::cudaStream_t;
        // SAFETY: the plan was made for these descriptors, which match the tensors' shapes; the
        // tensors are live allocations of this engine (a, b borrowed, c exclusively) whose frees
        // are queued after this call on the same stream; the workspace holds `workspace` bytes
        // and is freed, stream-ordered, after the call; alpha and beta are host scalars.
        let result = unsafe {
            cudarc::cutensor::result::contract(
                handle,
                plan,
                (&alpha as *const T).cast::<c_void>(),
                a.raw_ptr() as *const c_void,
                b.raw_ptr() as *const c_void,
                (&beta as *const T).cast::<c_void>(),
                c.raw_ptr() as *const c_void,
                c.raw_ptr() as *mut c_void,
                work as *mut c_void,
                workspace,
                stream,
            )
        }
        .map_err(fail("cutensorContract"));
        if work != 0 {
            // SAFETY: `work` came from `alloc` above and is freed once, after the call using it.
            if let Err(source) = unsafe { st.driver.free(Lane::Compute, work) } {
                st.defer(Error::Driver {
                    call: "cuMemFreeAsync",
                    source,
                });
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expressions_parse_into_modes() {
        let [a, b, c] = parse("ik,kj->ij").unwrap();
        assert_eq!((a, b, c), (vec!['i', 'k'], vec!['k', 'j'], vec!['i', 'j']));
        assert!(parse("ik,kj").is_err());
        assert!(parse("ii,kj->ij").is_err());
        assert!(parse("i1,kj->ij").is_err());
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(strides(&[2, 3, 4]), [12, 4, 1]);
        assert_eq!(strides(&[]), Vec::<i64>::new());
    }
}
