//! Elementwise kernels on the engine's compute stream: add, sub, mul, div, neg, scale, fill and cast,
//! and (crate-private, in [`gather`]) the strided gather that copies a foreign strided view into a
//! compact tensor.
//!
//! They exist so a chain of dependent operations is a chain of calls: each call validates its
//! operands, allocates its output stream-ordered, queues one kernel on the engine's compute stream and
//! returns without waiting for the device. Nothing waits until [`CudaEngine::synchronize`] or a
//! blocking download.
//!
//! Each kernel is compiled with NVRTC the first time an engine needs it and cached in the engine
//! by operation, element type(s) and broadcast rank, so steady-state calls cost one launch. The source is
//! generated per type and is self-contained (see the semantics documented below).
//!
//! # Which element types each operation serves
//!
//! | operation | element types |
//! | --- | --- |
//! | [`add`](CudaEngine::add), [`sub`](CudaEngine::sub), [`mul`](CudaEngine::mul), [`scale`](CudaEngine::scale) | every type but `bool` |
//! | [`div`](CudaEngine::div) | `f32`, `f64`, `f16`, `bf16` |
//! | [`neg`](CudaEngine::neg) | `f32`, `f64`, `f16`, `bf16` and the signed integers |
//! | [`fill`](CudaEngine::fill), [`full`](CudaEngine::full) | every type |
//! | [`cast`](CudaEngine::cast) | every pair of types |
//!
//! Any other combination is [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement), before anything is queued. Integer
//! division is left out because division by zero has no defined result on the device; cast to a
//! float type first.
//!
//! # Semantics
//!
//! - `add`, `sub`, `mul` and `div` broadcast as NumPy does (trailing dimensions aligned, each
//!   pair equal or 1); equal shapes run the kernel without index math. See
//!   [the guide](crate::guide::kernels).
//! - Integer arithmetic wraps (two's complement), like Rust's `wrapping_*`.
//! - `f32`/`f64` arithmetic is IEEE 754 with round-to-nearest-even, no fused operations and no
//!   flushing of subnormals, so it matches the host bit for bit.
//! - `f16`/`bf16` arithmetic is computed in `f32` and rounded once, as the `half` crate does.
//! - Casts follow Rust's `as`: float to integer truncates toward zero and saturates, NaN
//!   becoming 0; integer to integer wraps; anything to `bool` tests `!= 0`; `bool` is 0 or 1.
//!   Conversions to `f16`/`bf16` round through `f32`.
//!
//! # On the simulated device
//!
//! The simulator cannot run PTX. Each module this module compiles carries a host emulation of its
//! kernel, which the simulator runs on its own memory when its stream reaches the launch, so
//! ordering and results are tested without a GPU. The device seam knows nothing about these
//! kernels: a launch is a function, a grid, a block and five 8-byte parameters.

pub(crate) mod cache;
#[cfg(any(test, feature = "sim"))]
pub(crate) mod emulate;
pub(crate) mod fused;
#[cfg(any(test, feature = "dlpack"))]
pub(crate) mod gather;
#[cfg(test)]
mod host_check;
pub(crate) mod source;
pub(crate) mod spec;

use crate::core::engine::{CudaEngine, State};
use crate::core::order::Use;
use crate::driver::Lane;
use crate::dtype::DType;
use crate::error::{Error, Result, UsageError};
use crate::memory::element::{Element, as_bytes};
use crate::memory::tensor::DeviceTensor;
use cache::KernelCache;
use spec::{BLOCK, Broadcast, ElementwiseArgs, ElementwiseOp, ElementwiseSpec, unsupported};

/// How `a` and `b` broadcast for `operation`, or the typed error naming both shapes and the
/// dimension that disagrees.
pub(crate) fn broadcast(operation: &'static str, a: &[usize], b: &[usize]) -> Result<Broadcast> {
    Broadcast::of(a, b).map_err(|dim| {
        Error::Usage(UsageError::NotBroadcastable {
            operation,
            left: a.to_vec(),
            right: b.to_vec(),
            dim,
        })
    })
}

fn spec(op: ElementwiseOp, input: DType, output: DType) -> Result<ElementwiseSpec> {
    if let Some(reason) = unsupported(op, input) {
        return Err(Error::Usage(UsageError::UnsupportedElement {
            operation: op.name(),
            dtype: input,
            reason,
        }));
    }
    Ok(ElementwiseSpec {
        op,
        input,
        output,
        broadcast: 0,
    })
}

/// The bits of a scalar, zero-extended to 64 bits (little-endian element bytes).
pub(crate) fn scalar_bits<T: Element>(value: T) -> u64 {
    let mut bytes = [0u8; 8];
    let raw = as_bytes(std::slice::from_ref(&value));
    bytes[..raw.len()].copy_from_slice(raw);
    u64::from_le_bytes(bytes)
}

impl CudaEngine {
    /// Queues the kernel for `spec` with `args`, compiling it on first use.
    ///
    /// `broadcast` is a broadcasting kernel's `(extent, a_stride, b_stride)` per dimension
    /// ([`Broadcast::params`]), empty for every other kernel.
    ///
    /// # Safety
    /// Every pointer the spec's operation reads or writes names a live allocation of this
    /// engine of at least `len` elements of its type (for a broadcast operand, at least the
    /// elements its strides reach), whose free is queued (if at all) after this launch; `out`
    /// does not overlap `a` or `b` unless it is identical to them; `broadcast` holds
    /// `3 * spec.broadcast` values whose extents multiply to `len`.
    unsafe fn launch_elementwise(
        &mut self,
        spec: ElementwiseSpec,
        args: ElementwiseArgs,
        broadcast: &[u64],
    ) -> Result<()> {
        if args.len == 0 {
            return Ok(());
        }
        let mut st = self.enter()?;
        let State {
            driver,
            parts,
            order,
            ..
        } = &mut *st;
        let function = parts
            .get_mut::<KernelCache>()
            .function(driver.as_mut(), spec)?;
        // Reads first, the write last: an output identical to an operand ends up written. An
        // operand the kernel does not read is named as address 0, which the order skips.
        let read = |used: bool, ptr| Use::Read(if used { ptr } else { 0 });
        let uses = [
            read(spec.op.reads_a(), args.a),
            read(spec.op.reads_b(), args.b),
            Use::Write(args.out),
        ];
        order.prepare(driver.as_mut(), Lane::Compute, &uses)?;
        order.mark(Lane::Compute, &uses);
        let mut params = args.params().to_vec();
        params.extend_from_slice(broadcast);
        // SAFETY: `function` is the cached kernel compiled for `spec` (still loaded: the cache
        // unloads only at teardown), whose signature is the five 8-byte parameters `args`
        // packs plus the broadcast's three per dimension (the caller's contract); the grid is
        // between 1 and `MAX_BLOCKS` blocks of `BLOCK` threads; the caller guarantees the
        // pointer contract.
        unsafe { driver.launch(function, args.grid(), BLOCK, &params) }
            .map_err(Error::driver("cuLaunchKernel"))
    }

    fn binary<T: Element>(
        &mut self,
        op: ElementwiseOp,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
    ) -> Result<DeviceTensor<T>> {
        let mut spec = spec(op, T::DTYPE, T::DTYPE)?;
        a.check_engine(self)?;
        b.check_engine(self)?;
        let layout = broadcast(op.name(), a.shape(), b.shape())?;
        // Equal shapes (up to leading 1s) keep the kernel without index math.
        spec.broadcast = u8::try_from(layout.dims.len()).map_err(|_| {
            Error::Usage(UsageError::ShapeMismatch {
                operation: op.name(),
                expected: a.shape().to_vec(),
                found: b.shape().to_vec(),
            })
        })?;
        let out = DeviceTensor::alloc(self, &layout.shape)?;
        let args = ElementwiseArgs {
            out: out.raw_ptr(),
            a: a.raw_ptr(),
            b: b.raw_ptr(),
            scalar: 0,
            len: out.len() as u64,
        };
        // SAFETY: `a`, `b` and `out` are live allocations of this engine; `out` has `len`
        // elements of `T`, and `a` and `b` either `len` too (no broadcast) or exactly the
        // elements the broadcast's strides reach (they are the strides of their own shapes,
        // 0 on broadcast dimensions), whose extents multiply to `len`; `a` and `b` stay
        // borrowed for the call and `out` is returned to the caller, so every free is queued
        // after the launch; `out` is fresh, so it overlaps neither operand.
        unsafe { self.launch_elementwise(spec, args, &layout.params()) }?;
        Ok(out)
    }

    /// `a + b`, elementwise, into a new tensor. Queued on the engine's compute stream; does not wait.
    ///
    /// The operands broadcast as in NumPy and PyTorch: their shapes are aligned at the trailing
    /// dimension, and each pair of dimensions must be equal or one of them 1 (a missing leading
    /// dimension counts as 1), so a `[N]` bias adds onto `[B, N]`, a `[B, 1]` column onto
    /// `[B, N]`, and a scalar (`[]` or `[1]`) onto anything, on either side. The result has the
    /// broadcast shape. Equal shapes run the kernel without index math.
    ///
    /// ```
    /// # fn main() -> Result<(), cuferry::Error> {
    /// # let mut engine = cuferry::CudaEngine::simulated(Default::default());
    /// let x = cuferry::upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// let bias = cuferry::upload_tensor(&mut engine, &[10.0f32, 20.0, 30.0], &[3])?;
    /// let y = engine.add(&x, &bias)?;
    /// assert_eq!(y.shape(), &[2, 3]);
    /// assert_eq!(cuferry::download_tensor(&mut engine, &y)?, [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// ```
    /// # fn main() -> Result<(), cuferry::Error> {
    /// # let mut engine = cuferry::CudaEngine::simulated(Default::default());
    /// let seed = cuferry::upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0], &[4])?;
    /// let mut state = engine.add(&seed, &seed)?;
    /// for _ in 0..2 {
    ///     state = engine.add(&state, &state)?; // no host wait between links
    /// }
    /// engine.flush()?;
    /// assert_eq!(cuferry::download_tensor(&mut engine, &state)?, [8.0, 16.0, 24.0, 32.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) for `bool`; [`UsageError::NotBroadcastable`](crate::error::UsageError::NotBroadcastable) when the shapes do not broadcast (it names both and the dimension);
    /// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) for another engine's tensor;
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when NVRTC is missing; [`LibraryError::Compile`](crate::error::LibraryError::Compile) or [`Error::Driver`] when
    /// the kernel cannot be built or queued.
    pub fn add<T: Element>(
        &mut self,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
    ) -> Result<DeviceTensor<T>> {
        self.binary(ElementwiseOp::Add, a, b)
    }

    /// `a - b`, elementwise, into a new tensor. Queued; does not wait.
    ///
    /// # Errors
    /// As [`add`](Self::add).
    pub fn sub<T: Element>(
        &mut self,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
    ) -> Result<DeviceTensor<T>> {
        self.binary(ElementwiseOp::Sub, a, b)
    }

    /// `a * b`, elementwise, into a new tensor. Queued; does not wait.
    ///
    /// # Errors
    /// As [`add`](Self::add).
    pub fn mul<T: Element>(
        &mut self,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
    ) -> Result<DeviceTensor<T>> {
        self.binary(ElementwiseOp::Mul, a, b)
    }

    /// `a / b`, elementwise, into a new tensor, for float types. Queued; does not wait.
    ///
    /// # Errors
    /// [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) for integers and `bool`; otherwise as [`add`](Self::add).
    pub fn div<T: Element>(
        &mut self,
        a: &DeviceTensor<T>,
        b: &DeviceTensor<T>,
    ) -> Result<DeviceTensor<T>> {
        self.binary(ElementwiseOp::Div, a, b)
    }

    /// `-a`, elementwise, into a new tensor, for float and signed integer types. Queued; does
    /// not wait.
    ///
    /// # Errors
    /// [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) for unsigned integers and `bool`; otherwise as
    /// [`add`](Self::add).
    pub fn neg<T: Element>(&mut self, a: &DeviceTensor<T>) -> Result<DeviceTensor<T>> {
        self.unary(spec(ElementwiseOp::Neg, T::DTYPE, T::DTYPE)?, a, 0)
    }

    /// `a * factor`, elementwise, into a new tensor. Queued; does not wait.
    ///
    /// # Errors
    /// [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) for `bool`; otherwise as [`add`](Self::add).
    pub fn scale<T: Element>(&mut self, a: &DeviceTensor<T>, factor: T) -> Result<DeviceTensor<T>> {
        let spec = spec(ElementwiseOp::Scale, T::DTYPE, T::DTYPE)?;
        self.unary(spec, a, scalar_bits(factor))
    }

    /// Converts every element to `U` (Rust's `as` semantics; see [the guide](crate::guide::kernels)) into a
    /// new tensor of the same shape. Queued; does not wait.
    ///
    /// ```
    /// # fn main() -> Result<(), cuferry::Error> {
    /// # let mut engine = cuferry::CudaEngine::simulated(Default::default());
    /// let x = cuferry::upload_tensor(&mut engine, &[-1.5f32, 300.0, f32::NAN], &[3])?;
    /// let y = engine.cast::<u8>(&x)?; // the source type is the tensor's
    /// assert_eq!(cuferry::download_tensor(&mut engine, &y)?, [0, 255, 0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`add`](Self::add), except that every pair of element types is served.
    pub fn cast<U: Element>(&mut self, a: &DeviceTensor<impl Element>) -> Result<DeviceTensor<U>> {
        let spec = spec(ElementwiseOp::Cast, a.dtype(), U::DTYPE)?;
        a.check_engine(self)?;
        let out = DeviceTensor::<U>::alloc(self, a.shape())?;
        let args = ElementwiseArgs {
            out: out.raw_ptr(),
            a: a.raw_ptr(),
            b: 0,
            scalar: 0,
            len: a.len() as u64,
        };
        // SAFETY: as in `binary`: `a` is borrowed through the call, `out` is fresh and returned.
        unsafe { self.launch_elementwise(spec, args, &[]) }?;
        Ok(out)
    }

    /// Writes `value` into every element of `tensor`, of any element type. Queued; does not wait.
    ///
    /// # Errors
    /// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) for another engine's tensor; [`SetupError::Unavailable`](crate::error::SetupError::Unavailable),
    /// [`LibraryError::Compile`](crate::error::LibraryError::Compile) or [`Error::Driver`] as for [`add`](Self::add).
    pub fn fill<T: Element>(&mut self, tensor: &mut DeviceTensor<T>, value: T) -> Result<()> {
        let spec = spec(ElementwiseOp::Fill, T::DTYPE, T::DTYPE)?;
        tensor.check_engine(self)?;
        let args = ElementwiseArgs {
            out: tensor.raw_ptr(),
            a: 0,
            b: 0,
            scalar: scalar_bits(value),
            len: tensor.len() as u64,
        };
        // SAFETY: `tensor` is a live allocation of this engine, borrowed exclusively for the
        // call; its free, if any, is queued later.
        unsafe { self.launch_elementwise(spec, args, &[]) }
    }

    /// A new tensor of `shape` with every element `value`. Queued; does not wait.
    ///
    /// # Errors
    /// As [`fill`](Self::fill), plus [`UsageError::ShapeOverflow`](crate::error::UsageError::ShapeOverflow) when the shape's element count
    /// overflows `usize` and [`UsageError::SizeOverflow`](crate::error::UsageError::SizeOverflow) when its bytes exceed `isize::MAX`.
    pub fn full<T: Element>(&mut self, shape: &[usize], value: T) -> Result<DeviceTensor<T>> {
        let mut out = DeviceTensor::alloc(self, shape)?;
        self.fill(&mut out, value)?;
        Ok(out)
    }

    /// How many elementwise kernels this engine has compiled and cached.
    pub fn cached_kernels(&self) -> usize {
        self.shared.lock().parts.get_mut::<KernelCache>().len()
    }

    fn unary<T: Element>(
        &mut self,
        spec: ElementwiseSpec,
        a: &DeviceTensor<T>,
        scalar: u64,
    ) -> Result<DeviceTensor<T>> {
        a.check_engine(self)?;
        let out = DeviceTensor::alloc(self, a.shape())?;
        let args = ElementwiseArgs {
            out: out.raw_ptr(),
            a: a.raw_ptr(),
            b: 0,
            scalar,
            len: a.len() as u64,
        };
        // SAFETY: as in `binary`: `a` is borrowed through the call, `out` is fresh and returned.
        unsafe { self.launch_elementwise(spec, args, &[]) }?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn support_matrix() {
        for d in DType::ALL {
            assert!(unsupported(ElementwiseOp::Fill, d).is_none());
            assert!(unsupported(ElementwiseOp::Cast, d).is_none());
        }
        assert!(unsupported(ElementwiseOp::Add, DType::Bool).is_some());
        assert!(unsupported(ElementwiseOp::Div, DType::I32).is_some());
        assert!(unsupported(ElementwiseOp::Div, DType::BF16).is_none());
        assert!(unsupported(ElementwiseOp::Neg, DType::U8).is_some());
        assert!(unsupported(ElementwiseOp::Neg, DType::I8).is_none());
    }

    #[test]
    fn scalar_bits_zero_extend() {
        assert_eq!(scalar_bits(-1i8), 0xff);
        assert_eq!(scalar_bits(1.0f32), u64::from(1.0f32.to_bits()));
        assert_eq!(scalar_bits(true), 1);
    }
}
