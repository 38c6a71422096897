//! The library half of the seam on the simulated device: GEMM, Cholesky factor and solve, and
//! tensor contraction, each run as an emulated launch on the compute stream.
//!
//! A call is checked and counted when it is made (and fails there when a fault is injected for
//! it, as the library's own failure), then queued like a kernel launch: it runs when the clock
//! reaches it, reading and writing the device's memory at that point in stream order, its
//! accesses checked for races like any job's, and while the compute stream captures it is
//! recorded into the capture, so a product inside a prepared graph runs the same emulation as an
//! eager one.
//!
//! The semantics are BLAS's and LAPACK's, stated here because the tests rely on them:
//!
//! - **GEMM** is column-major `C = alpha * op(A) * op(B) + beta * C`. Each element of the
//!   product is summed over `k` in order, in the element type, one rounding per multiply and per
//!   add; it is then scaled by `alpha`, and `beta * C` is added unless `beta` is zero, in which
//!   case `C` is not read (NaNs in it are ignored).
//! - **Cholesky** (`potrf`) factors the lower triangle column by column (the diagonal element
//!   `sqrt(A[j][j] - Σ L[j][q]²)`, then the column below it); the upper triangle is not touched. A pivot that
//!   is not positive (or is NaN) stops it with `info = j + 1`, the order of the leading minor
//!   that is not positive definite, leaving the columns before it factored. It writes its
//!   workspace, so a workspace freed too early is a race the checker sees.
//! - **Solve** (`potrs`) solves `L·Lᵀ·X = B` for each right-hand side by forward then backward
//!   substitution, and writes `info = 0`.
//! - **Contraction** sums, for each element of `C`, over every mode of `A` and `B` that `C`
//!   lacks, in the order of the modes' first appearance (`A`'s, then `B`'s), innermost last;
//!   then scales and adds `beta * C` as GEMM does. Its plan asks for a small workspace, which the
//!   run writes, for the same reason as `potrf`'s.
//!
//! An injected fault is reported as the library's failure ([`LibraryError::Vendor`]), with the
//! injected driver error's code and name as the status, and nothing is queued.

use super::{Job, SimDriver, SimOp, State, StreamId};
use crate::driver::launch::{DeviceMemory, Emulation, FunctionHandle};
use crate::driver::libs::{Contraction, ContractionPlan, Gemm, Libraries, Library, Spd};
use crate::driver::{DevicePtr, Lane};
use crate::dtype::DType;
use crate::error::{DriverError, Error, LibraryError};
use std::collections::HashMap;
use std::sync::Arc;

/// The function handle library launches carry: no module's (modules are numbered from one), so
/// a graph replay never looks for a module behind them.
pub(super) const LIBRARY_FUNCTION: FunctionHandle = FunctionHandle(u64::MAX);

/// The workspace a simulated contraction plan asks for, in bytes.
const CONTRACTION_WORKSPACE: usize = 256;

/// A planned contraction: what its run needs.
#[derive(Clone, Debug)]
pub(super) struct Plan {
    dtype: DType,
    modes: [Vec<i32>; 3],
    extents: [Vec<i64>; 3],
    strides: [Vec<i64>; 3],
}

/// The library's failure for call `call`: an injected fault or a refused argument.
fn vendor(library: Library, call: &'static str, error: DriverError) -> Error {
    Error::Library(LibraryError::Vendor {
        library: library.name(),
        call,
        status: i64::from(error.code()),
        name: format!("{error} (simulated)"),
    })
}

/// `call`'s name for `dtype`: its single-precision name, or the double-precision one.
fn typed(dtype: DType, single: &'static str, double: &'static str) -> &'static str {
    if dtype == DType::F64 { double } else { single }
}

/// Refuses an element type the libraries do not serve.
fn float(library: Library, call: &'static str, dtype: DType) -> Result<(), Error> {
    match dtype {
        DType::F32 | DType::F64 => Ok(()),
        _ => Err(vendor(library, call, DriverError::NOT_SUPPORTED)),
    }
}

/// The elements of the real types the libraries serve, for the emulations.
trait Real:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    const SIZE: usize;
    const ZERO: Self;
    fn from_f64(x: f64) -> Self;
    fn sqrt(self) -> Self;
    fn read(bytes: &[u8]) -> Self;
    fn write(self, out: &mut [u8]);
}

macro_rules! real {
    ($t:ty, $n:expr_2021) => {
        impl Real for $t {
            const SIZE: usize = $n;
            const ZERO: Self = 0.0;
            fn from_f64(x: f64) -> Self {
                // Exact: the scalar was widened from this type.
                x as $t
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn read(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("one element's bytes"))
            }
            fn write(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
        }
    };
}

real!(f32, 4);
real!(f64, 8);

/// A column-major matrix of `T` read from the device: `rows × cols` with leading dimension `ld`.
struct Matrix<T> {
    ptr: DevicePtr,
    bytes: Vec<u8>,
    ld: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Real> Matrix<T> {
    /// Reads the matrix; `None` (named `what`) unless it lies in one live allocation.
    fn read(
        memory: &mut dyn DeviceMemory,
        what: &str,
        ptr: DevicePtr,
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> Result<Self, String> {
        let elems = if rows == 0 || cols == 0 {
            0
        } else {
            ld * (cols - 1) + rows
        };
        let bytes = memory
            .read(ptr, elems * T::SIZE)
            .ok_or_else(|| format!("{what} lies outside every allocation ({ptr:#x})"))?;
        Ok(Matrix {
            ptr,
            bytes,
            ld,
            _t: std::marker::PhantomData,
        })
    }

    fn at(&self, i: usize, j: usize) -> T {
        let at = (i + j * self.ld) * T::SIZE;
        T::read(&self.bytes[at..at + T::SIZE])
    }

    fn set(&mut self, i: usize, j: usize, value: T) {
        let at = (i + j * self.ld) * T::SIZE;
        value.write(&mut self.bytes[at..at + T::SIZE]);
    }

    /// Writes the matrix back where it was read from.
    fn write(self, memory: &mut dyn DeviceMemory, what: &str) -> Result<(), String> {
        if memory.write(self.ptr, &self.bytes) {
            Ok(())
        } else {
            Err(format!(
                "{what} lies outside every allocation ({:#x})",
                self.ptr
            ))
        }
    }
}

/// Writes one `i32` (an `info`).
fn write_info(memory: &mut dyn DeviceMemory, ptr: DevicePtr, value: i32) -> Result<(), String> {
    if memory.write(ptr, &value.to_le_bytes()) {
        Ok(())
    } else {
        Err(format!("info lies outside every allocation ({ptr:#x})"))
    }
}

/// Overwrites `bytes` of workspace at `ptr`, as the library's kernels do.
fn scribble(memory: &mut dyn DeviceMemory, ptr: DevicePtr, bytes: usize) -> Result<(), String> {
    if bytes == 0 || memory.write(ptr, &vec![0xa5; bytes]) {
        Ok(())
    } else {
        Err(format!(
            "the workspace lies outside every allocation ({ptr:#x})"
        ))
    }
}

/// `alpha * sum + beta * c`, where a zero `beta` ignores `c`.
fn scale<T: Real>(alpha: T, sum: T, beta: T, c: impl FnOnce() -> T) -> T {
    if beta == T::ZERO {
        alpha * sum
    } else {
        alpha * sum + beta * c()
    }
}

/// A queued GEMM.
struct GemmRun(Gemm);

impl GemmRun {
    fn run_typed<T: Real>(&self, memory: &mut dyn DeviceMemory) -> Result<(), String> {
        let g = &self.0;
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (a_rows, a_cols) = if g.transa { (k, m) } else { (m, k) };
        let (b_rows, b_cols) = if g.transb { (n, k) } else { (k, n) };
        let a = Matrix::<T>::read(memory, "gemm's A", g.a, a_rows, a_cols, g.lda as usize)?;
        let b = Matrix::<T>::read(memory, "gemm's B", g.b, b_rows, b_cols, g.ldb as usize)?;
        let mut c = Matrix::<T>::read(memory, "gemm's C", g.c, m, n, g.ldc as usize)?;
        let (alpha, beta) = (T::from_f64(g.alpha), T::from_f64(g.beta));
        for j in 0..n {
            for i in 0..m {
                let mut sum = T::ZERO;
                for q in 0..k {
                    let x = if g.transa { a.at(q, i) } else { a.at(i, q) };
                    let y = if g.transb { b.at(j, q) } else { b.at(q, j) };
                    sum = sum + x * y;
                }
                let value = scale(alpha, sum, beta, || c.at(i, j));
                c.set(i, j, value);
            }
        }
        c.write(memory, "gemm's C")
    }
}

/// A queued Cholesky factorisation.
struct PotrfRun {
    matrix: Spd,
    work: DevicePtr,
    work_bytes: usize,
    info: DevicePtr,
}

impl PotrfRun {
    fn run_typed<T: Real>(&self, memory: &mut dyn DeviceMemory) -> Result<(), String> {
        let n = self.matrix.n as usize;
        let what = "potrf's A";
        let mut a = Matrix::<T>::read(memory, what, self.matrix.a, n, n, self.matrix.lda as usize)?;
        scribble(memory, self.work, self.work_bytes)?;
        let mut info = 0;
        for j in 0..n {
            let mut d = a.at(j, j);
            for q in 0..j {
                d = d - a.at(j, q) * a.at(j, q);
            }
            // Not positive, or NaN: the leading minor of order j + 1 is not positive definite.
            if d.partial_cmp(&T::ZERO) != Some(std::cmp::Ordering::Greater) {
                info = j as i32 + 1;
                break;
            }
            let d = d.sqrt();
            a.set(j, j, d);
            for i in j + 1..n {
                let mut x = a.at(i, j);
                for q in 0..j {
                    x = x - a.at(i, q) * a.at(j, q);
                }
                a.set(i, j, x / d);
            }
        }
        a.write(memory, what)?;
        write_info(memory, self.info, info)
    }
}

/// A queued solve with a Cholesky factor.
struct PotrsRun {
    matrix: Spd,
    nrhs: usize,
    b: DevicePtr,
    ldb: usize,
    info: DevicePtr,
}

impl PotrsRun {
    fn run_typed<T: Real>(&self, memory: &mut dyn DeviceMemory) -> Result<(), String> {
        let n = self.matrix.n as usize;
        let l = Matrix::<T>::read(
            memory,
            "potrs's A",
            self.matrix.a,
            n,
            n,
            self.matrix.lda as usize,
        )?;
        let mut b = Matrix::<T>::read(memory, "potrs's B", self.b, n, self.nrhs, self.ldb)?;
        for r in 0..self.nrhs {
            // L·y = b, then Lᵀ·x = y.
            for i in 0..n {
                let mut x = b.at(i, r);
                for q in 0..i {
                    x = x - l.at(i, q) * b.at(q, r);
                }
                b.set(i, r, x / l.at(i, i));
            }
            for i in (0..n).rev() {
                let mut x = b.at(i, r);
                for q in i + 1..n {
                    x = x - l.at(q, i) * b.at(q, r);
                }
                b.set(i, r, x / l.at(i, i));
            }
        }
        b.write(memory, "potrs's B")?;
        write_info(memory, self.info, 0)
    }
}

/// A queued contraction.
struct ContractRun {
    plan: Plan,
    alpha: f64,
    beta: f64,
    ptrs: [DevicePtr; 3],
    work: DevicePtr,
}

impl ContractRun {
    fn run_typed<T: Real>(&self, memory: &mut dyn DeviceMemory) -> Result<(), String> {
        let p = &self.plan;
        // Each mode's extent, and the modes summed over (in A's, then B's, order).
        let mut extent: HashMap<i32, usize> = HashMap::new();
        let mut summed: Vec<i32> = Vec::new();
        for t in 0..3 {
            for (&mode, &e) in p.modes[t].iter().zip(&p.extents[t]) {
                extent.insert(mode, e as usize);
                if t < 2 && !p.modes[2].contains(&mode) && !summed.contains(&mode) {
                    summed.push(mode);
                }
            }
        }
        // Each tensor's span in elements, read whole.
        let span = |t: usize| -> usize {
            if p.extents[t].contains(&0) {
                return 0;
            }
            1 + p.extents[t]
                .iter()
                .zip(&p.strides[t])
                .map(|(&e, &s)| (e as usize - 1) * s as usize)
                .sum::<usize>()
        };
        let names = ["contract's A", "contract's B", "contract's C"];
        let mut data = Vec::with_capacity(3);
        for (t, name) in names.iter().enumerate() {
            let bytes = span(t) * T::SIZE;
            data.push(
                memory
                    .read(self.ptrs[t], bytes)
                    .ok_or_else(|| format!("{name} lies outside every allocation"))?,
            );
        }
        scribble(memory, self.work, CONTRACTION_WORKSPACE)?;
        let offset = |t: usize, index: &HashMap<i32, usize>| -> usize {
            p.modes[t]
                .iter()
                .zip(&p.strides[t])
                .map(|(m, &s)| index[m] * s as usize)
                .sum()
        };
        let element = |t: usize, at: usize| T::read(&data[t][at * T::SIZE..(at + 1) * T::SIZE]);
        let (alpha, beta) = (T::from_f64(self.alpha), T::from_f64(self.beta));
        let mut out = data[2].clone();
        // Every output index, row-major over C's modes.
        let out_modes = &p.modes[2];
        let total: usize = out_modes.iter().map(|m| extent[m]).product();
        let inner: usize = summed.iter().map(|m| extent[m]).product();
        let mut index: HashMap<i32, usize> = extent.keys().map(|&m| (m, 0)).collect();
        for flat in 0..total {
            let mut rest = flat;
            for m in out_modes.iter().rev() {
                index.insert(*m, rest % extent[m]);
                rest /= extent[m];
            }
            let mut sum = T::ZERO;
            for flat_k in 0..inner {
                let mut rest = flat_k;
                for m in summed.iter().rev() {
                    index.insert(*m, rest % extent[m]);
                    rest /= extent[m];
                }
                sum = sum + element(0, offset(0, &index)) * element(1, offset(1, &index));
            }
            let at = offset(2, &index);
            let value = scale(alpha, sum, beta, || element(2, at));
            value.write(&mut out[at * T::SIZE..(at + 1) * T::SIZE]);
        }
        if memory.write(self.ptrs[2], &out) {
            Ok(())
        } else {
            Err("contract's C lies outside every allocation".into())
        }
    }
}

/// Implements [`Emulation`] for a library call's run: its name, as the call's in each
/// precision, and its `run_typed` at the element type.
macro_rules! library_emulation {
    ($run:ty, |$r:ident| $dtype:expr_2021, $single:literal, $double:literal) => {
        impl Emulation for $run {
            fn name(&self) -> &str {
                let $r = self;
                typed($dtype, $single, $double)
            }

            fn run(&self, memory: &mut dyn DeviceMemory, _params: &[u64]) -> Result<(), String> {
                let $r = self;
                match $dtype {
                    DType::F64 => $r.run_typed::<f64>(memory),
                    _ => $r.run_typed::<f32>(memory),
                }
            }
        }
    };
}

library_emulation!(GemmRun, |r| r.0.dtype, "cublasSgemm_v2", "cublasDgemm_v2");
library_emulation!(
    PotrfRun,
    |r| r.matrix.dtype,
    "cusolverDnSpotrf",
    "cusolverDnDpotrf"
);
library_emulation!(
    PotrsRun,
    |r| r.matrix.dtype,
    "cusolverDnSpotrs",
    "cusolverDnDpotrs"
);
library_emulation!(
    ContractRun,
    |r| r.plan.dtype,
    "cutensorContract",
    "cutensorContract"
);

impl State {
    /// Counts call `op` of `library` (named `call`), failing it as the library when a fault is
    /// injected for it.
    fn enter_library(
        &mut self,
        op: SimOp,
        library: Library,
        call: &'static str,
    ) -> Result<(), Error> {
        self.enter(op).map_err(|e| vendor(library, call, e))
    }

    /// Queues a library call's emulation on `stream`, or records it into the stream's capture.
    fn queue_library(
        &mut self,
        stream: StreamId,
        library: Library,
        call: &'static str,
        emulation: Arc<dyn Emulation>,
    ) -> Result<(), Error> {
        let captured = self
            .capture_launch(stream, LIBRARY_FUNCTION, &emulation, &[])
            .map_err(|e| vendor(library, call, e))?;
        if !captured {
            self.push(
                stream,
                Job::Launch {
                    emulation,
                    params: Vec::new(),
                },
            );
        }
        Ok(())
    }
}

/// Refuses a negative dimension, as the libraries do (`INVALID_VALUE`).
fn dims(library: Library, call: &'static str, values: &[i32]) -> Result<(), Error> {
    if values.iter().any(|&v| v < 0) {
        return Err(vendor(library, call, DriverError::INVALID_VALUE));
    }
    Ok(())
}

impl Libraries for SimDriver {
    fn library_open(&mut self, library: Library) -> Result<(), Error> {
        let call = match library {
            Library::Blas => "cublasCreate_v2",
            Library::Solver => "cusolverDnCreate",
            Library::Tensor => "cutensorCreate",
        };
        self.lock().enter_library(SimOp::LibraryOpen, library, call)
    }

    unsafe fn gemm(&mut self, gemm: &Gemm) -> Result<(), Error> {
        const LIB: Library = Library::Blas;
        let call = typed(gemm.dtype, "cublasSgemm_v2", "cublasDgemm_v2");
        let stream = self.stream(Lane::Compute);
        let mut s = self.lock();
        s.enter_library(SimOp::Gemm, LIB, call)?;
        float(LIB, call, gemm.dtype)?;
        dims(
            LIB,
            call,
            &[gemm.m, gemm.n, gemm.k, gemm.lda, gemm.ldb, gemm.ldc],
        )?;
        s.queue_library(stream, LIB, call, Arc::new(GemmRun(*gemm)))
    }

    fn potrf_workspace(&mut self, matrix: &Spd) -> Result<usize, Error> {
        const LIB: Library = Library::Solver;
        let call = typed(
            matrix.dtype,
            "cusolverDnSpotrf_bufferSize",
            "cusolverDnDpotrf_bufferSize",
        );
        let mut s = self.lock();
        s.enter_library(SimOp::SolverWorkspace, LIB, call)?;
        float(LIB, call, matrix.dtype)?;
        dims(LIB, call, &[matrix.n, matrix.lda])?;
        Ok((matrix.n as usize).max(1))
    }

    unsafe fn potrf(
        &mut self,
        matrix: &Spd,
        work: DevicePtr,
        lwork: usize,
        info: DevicePtr,
    ) -> Result<(), Error> {
        const LIB: Library = Library::Solver;
        let call = typed(matrix.dtype, "cusolverDnSpotrf", "cusolverDnDpotrf");
        let stream = self.stream(Lane::Compute);
        let mut s = self.lock();
        s.enter_library(SimOp::Potrf, LIB, call)?;
        float(LIB, call, matrix.dtype)?;
        dims(LIB, call, &[matrix.n, matrix.lda])?;
        let run = PotrfRun {
            matrix: *matrix,
            work,
            work_bytes: lwork * matrix.dtype.size_bytes(),
            info,
        };
        s.queue_library(stream, LIB, call, Arc::new(run))
    }

    unsafe fn potrs(
        &mut self,
        matrix: &Spd,
        nrhs: i32,
        b: DevicePtr,
        ldb: i32,
        info: DevicePtr,
    ) -> Result<(), Error> {
        const LIB: Library = Library::Solver;
        let call = typed(matrix.dtype, "cusolverDnSpotrs", "cusolverDnDpotrs");
        let stream = self.stream(Lane::Compute);
        let mut s = self.lock();
        s.enter_library(SimOp::Potrs, LIB, call)?;
        float(LIB, call, matrix.dtype)?;
        dims(LIB, call, &[matrix.n, matrix.lda, nrhs, ldb])?;
        let run = PotrsRun {
            matrix: *matrix,
            nrhs: nrhs as usize,
            b,
            ldb: ldb as usize,
            info,
        };
        s.queue_library(stream, LIB, call, Arc::new(run))
    }

    fn contraction_plan(&mut self, c: &Contraction<'_>) -> Result<ContractionPlan, Error> {
        const LIB: Library = Library::Tensor;
        const CALL: &str = "cutensorCreatePlan";
        self.lock()
            .enter_library(SimOp::ContractionPlan, LIB, CALL)?;
        float(LIB, CALL, c.dtype)?;
        let consistent = (0..3).all(|t| {
            c.modes[t].len() == c.extents[t].len()
                && c.modes[t].len() == c.strides[t].len()
                && c.extents[t].iter().chain(c.strides[t]).all(|&x| x >= 0)
        });
        if !consistent {
            return Err(vendor(LIB, CALL, DriverError::INVALID_VALUE));
        }
        let plan = Plan {
            dtype: c.dtype,
            modes: c.modes.map(<[i32]>::to_vec),
            extents: c.extents.map(<[i64]>::to_vec),
            strides: c.strides.map(<[i64]>::to_vec),
        };
        Ok(ContractionPlan {
            handle: self.plans.insert(plan),
            workspace: CONTRACTION_WORKSPACE,
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
        const LIB: Library = Library::Tensor;
        const CALL: &str = "cutensorContract";
        let stream = self.stream(Lane::Compute);
        let Some(planned) = self.plans.get(plan.handle).cloned() else {
            return Err(vendor(LIB, CALL, DriverError::INVALID_VALUE));
        };
        let mut s = self.lock();
        s.enter_library(SimOp::Contract, LIB, CALL)?;
        let run = ContractRun {
            plan: planned,
            alpha,
            beta,
            ptrs: [a, b, c],
            work,
        };
        s.queue_library(stream, LIB, CALL, Arc::new(run))
    }

    fn contraction_plan_destroy(&mut self, plan: ContractionPlan) {
        self.plans.remove(plan.handle);
    }

    fn libraries_release(&mut self) {
        self.plans.clear();
    }
}
