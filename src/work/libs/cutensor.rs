//! cuTENSOR contractions on the engine's compute stream, where the library is installed.
//!
//! [`CudaEngine::contract`] takes an Einstein-notation expression such as `"ik,kj->ij"` and
//! computes `C = alpha * contraction(A, B) + beta * C` for row-major tensors (the last mode
//! varies fastest, as a tensor's shape says). cuTENSOR is not installed on every CUDA machine;
//! where it is absent the call is a typed [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) naming it.

use super::BlasElement;
use crate::core::engine::{Charge, CudaEngine};
use crate::core::order::Use;
use crate::driver::Lane;
use crate::driver::libs::{Contraction, Library};
use crate::error::{Error, Result, UsageError};
use crate::ledger::Owner;
use crate::memory::tensor::DeviceTensor;
use std::collections::HashMap;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// An element type cuTENSOR contractions serve here: `f32` and `f64`. Sealed.
pub trait TensorElement: BlasElement + sealed::Sealed {}

impl TensorElement for f32 {}
impl TensorElement for f64 {}

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
    /// for another engine's tensor; [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when cuTENSOR is not installed;
    /// [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when cuTENSOR refuses.
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
        let mode_ids: Vec<Vec<i32>> = modes
            .iter()
            .map(|m| m.iter().map(|&ch| ch as i32).collect())
            .collect();
        let extents: Vec<Vec<i64>> = shapes
            .iter()
            .map(|shape| {
                shape
                    .iter()
                    .map(|&d| i64::try_from(d).unwrap_or(i64::MAX))
                    .collect()
            })
            .collect();
        let strides: Vec<Vec<i64>> = shapes.iter().map(|shape| strides(shape)).collect();
        let contraction = Contraction {
            dtype: T::DTYPE,
            modes: [&mode_ids[0], &mode_ids[1], &mode_ids[2]],
            extents: [&extents[0], &extents[1], &extents[2]],
            strides: [&strides[0], &strides[1], &strides[2]],
        };
        let mut st = self.enter()?;
        st.driver.library_open(Library::Tensor)?;
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
        let plan = st.driver.contraction_plan(&contraction)?;
        let work = if plan.workspace == 0 {
            Ok(0)
        } else {
            st.alloc_for(Lane::Compute, plan.workspace, Owner::Workspaces)
                .map_err(Error::driver("cuMemAllocFromPoolAsync"))
        };
        let result = work.and_then(|work| {
            // SAFETY: the plan was made for these tensors' shapes; they are live allocations of
            // this engine (a, b borrowed, c exclusively, so c overlaps neither) whose frees are
            // queued after this call, ordered by the uses recorded above; the workspace holds
            // the plan's bytes and is freed, stream-ordered, after the call.
            let queued = unsafe {
                st.driver.contract(
                    &plan,
                    alpha.widen(),
                    beta.widen(),
                    a.raw_ptr(),
                    b.raw_ptr(),
                    c.raw_ptr(),
                    work,
                )
            };
            if work != 0 {
                let charge = Charge::new(Owner::Workspaces, plan.workspace);
                // SAFETY: `work` came from `alloc_for` above on the compute lane and is freed
                // once, after the call using it on the same lane.
                unsafe { st.free_on_lane(Lane::Compute, work, charge) };
            }
            queued
        });
        st.driver.contraction_plan_destroy(plan);
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
