//! cudarc interop, both ways: an engine's tensor lent to cudarc code as a `CudaView` or a
//! `CudaViewMut` on a cudarc stream, and a cudarc `CudaSlice` taken in as a tensor of the
//! engine, without a copy, with readiness carried across by stream-ordered waits.
//!
//! The module exists because cudarc code and the engine share the device's primary context (the
//! one [`CudaContext::new`](cudarc::driver::CudaContext::new) retains, and the engine's), so
//! their memory is common, but each queues work on streams the other cannot see. The bugs at
//! that boundary are ordering bugs: a cudarc kernel that reads a tensor before the engine's
//! upload has written it, an engine kernel that overwrites it while the cudarc kernel still
//! reads it, memory freed under the other side's queued work. Every crossing here is ordered on
//! the device, by events, never by a host wait:
//!
//! - [`lend`] and [`lend_mut`] lend a tensor to a cudarc
//!   stream for as long as the [`Lent`] or [`LentMut`] they return lives: a `CudaView` (or a
//!   `CudaViewMut`) of the tensor for cudarc's kernels and copies. The stream first waits for
//!   the engine's writes of the tensor (for a mutable lend, its reads too); when the lend is
//!   dropped, the engine's compute stream waits for everything cudarc queued on the stream by
//!   then, and on any other stream the view was used on (cudarc's event tracking orders those
//!   before the lend's stream), before the engine uses the tensor again. The lend borrows the
//!   tensor and the stream, so a view that outlives the lend, or an engine operation on the
//!   tensor while it is lent, does not compile.
//! - [`adopt`] takes a `CudaSlice` in as a [`DeviceTensor`] viewing the same
//!   memory, with no copy: the engine's compute stream first waits for everything queued on the
//!   slice's stream (its other streams' uses ordered before it, as above). The tensor keeps the
//!   slice; when the tensor is dropped, the slice's stream waits for every use the engine
//!   queued, and the slice is then dropped, which frees the memory on its stream after that
//!   wait. A tensor dropped after its engine still does all of this.
//!
//! ```no_run
//! use cuferry::raw::cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
//! use cuferry::raw::cudarc::nvrtc::compile_ptx;
//! use cuferry::{CudaEngine, cudarc_interop, download_tensor, upload_tensor};
//!
//! const TWICE: &str = r#"
//! extern "C" __global__ void twice(float* x, unsigned int n) {
//!     unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
//!     if (i < n) x[i] *= 2.0f;
//! }"#;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut engine = CudaEngine::open(0)?;
//! let ctx = CudaContext::new(0)?; // device 0's primary context: the engine's too
//! let stream = ctx.new_stream()?;
//! let twice = ctx.load_module(compile_ptx(TWICE)?)?.load_function("twice")?;
//!
//! let mut x = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3])?;
//! {
//!     // The stream waits, on the device, for the upload.
//!     let mut lent = cudarc_interop::lend_mut(&mut engine, &mut x, &stream)?;
//!     let n = lent.view().len() as u32;
//!     let mut view = lent.view_mut();
//!     let mut launch = stream.launch_builder(&twice);
//!     launch.arg(&mut view).arg(&n);
//!     // SAFETY: `twice` takes (float*, unsigned int) and touches the view's n floats only.
//!     unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
//! } // the lend ends: the engine's compute stream waits, on the device, for the kernel
//! assert_eq!(download_tensor(&mut engine, &x)?, [2.0, 4.0, 6.0]);
//!
//! // And the other way: cudarc's memory as an engine tensor, no copy.
//! let slice = stream.clone_htod(&[1.0f32, 2.0, 3.0, 4.0])?;
//! let y = cudarc_interop::adopt(&mut engine, slice, &[2, 2]).map_err(|e| e.into_error())?;
//! let z = engine.add(&y, &y)?;
//! assert_eq!(download_tensor(&mut engine, &z)?, [2.0, 4.0, 6.0, 8.0]);
//! # Ok(()) }
//! ```
//!
//! # Forget-safety
//!
//! A lend takes the tensor's memory out of the tensor while it lasts: the tensor is an empty
//! tensor (no elements, shape `[0]`) until the lend's drop has ordered the engine after cudarc's
//! work and put the memory back. A lend that is forgotten (`mem::forget`) therefore leaves the
//! tensor empty and the memory leaked, never used by the engine under cudarc's queued work. For
//! that reason both lends borrow the tensor `&mut`, the shared one too, which still hands out
//! only a `CudaView`. The `CudaSlice` behind a lend's view (cudarc makes views only of slices)
//! is made over the engine's memory and never dropped, which would free it: it is leaked when
//! the lend ends. A forgotten adopted tensor leaks its slice the same way.
//!
//! # Streams
//!
//! A lend's stream, and an adopted slice's, must be of the engine's context (a stream of
//! `CudaContext::new(ordinal)` for the engine's ordinal; another device's, or a context of its
//! own, is refused with
//! [`UsageError::ForeignContext`](crate::error::UsageError::ForeignContext)). The legacy
//! default stream (`default_stream()`) serves; the per-thread default stream
//! (`per_thread_stream()`) is refused
//! ([`UsageError::PerThreadStream`](crate::error::UsageError::PerThreadStream)): its handle names
//! another stream on every thread, so a wait queued where a lend began would not be matched
//! where it ends, on another thread. A view used on other streams than the lend's is covered by
//! cudarc's event tracking, its default for a context with streams of its own
//! (`new_stream()`); code that turns tracking off (`disable_event_tracking`, an unsafe call)
//! orders such uses before the lend's stream itself, as that call's contract asks.
//!
//! # What a crossing costs
//!
//! No host wait, no copy. A lend queues one event wait on the cudarc stream (after an event
//! record on the engine's compute stream, and cross-stream waits on the engine's side when the
//! tensor's last uses were uploads or downloads), and its end one event record on the cudarc
//! stream and one wait on the engine's compute stream. cudarc offers no view without a slice:
//! the slice behind the view makes two events when cudarc tracks events, and its leak at the
//! end destroys them (nothing accumulates), so a lend costs four more driver calls and two
//! stream waits that do nothing unless the view was used on another stream. An adoption queues
//! one event record on the slice's stream and one wait on the engine's, and the tensor's drop
//! one record on the engine's and one wait on the slice's, before cudarc's own free.

mod adopt;
mod lend;
#[cfg(test)]
mod tests;

use crate::core::context::ContextScope;
use crate::core::engine::CudaEngine;
use crate::device::DeviceKind;
use crate::driver::{LEGACY_STREAM, PER_THREAD_STREAM};
use crate::error::{Error, Result, SetupError, SubmitError, UsageError};
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtrMut, DeviceRepr,
};
use lend::Lending;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// A tensor lent read-only to cudarc code on one stream ([`lend`]): its
/// [`view`](Self::view) is a `CudaView` of the tensor for cudarc's kernels and copies, valid
/// while the lend lives. Dropping it makes the engine's compute stream wait for everything
/// cudarc queued with the view, on the device; the tensor is the engine's again from then on.
///
/// The lend borrows the tensor, so the engine cannot use it meanwhile:
///
/// ```compile_fail
/// # use cuferry::raw::cudarc::driver::CudaStream;
/// # use std::sync::Arc;
/// fn use_while_lent(engine: &mut cuferry::CudaEngine, stream: &Arc<CudaStream>) {
///     let mut x = engine.full::<f32>(&[4], 1.0).unwrap();
///     let lent = cuferry::cudarc_interop::lend(engine, &mut x, stream).unwrap();
///     let y = engine.add(&x, &x); // the tensor is lent
///     drop((lent, y));
/// }
/// ```
#[must_use = "dropping the lend at once ends it"]
pub struct Lent<'t, T: Element + DeviceRepr> {
    loan: Loan<'t, T>,
}

/// A tensor lent to cudarc code on one stream, which may write it
/// ([`lend_mut`]): [`view_mut`](Self::view_mut) is a `CudaViewMut` of the
/// tensor, [`view`](Self::view) a `CudaView`, valid while the lend lives. Dropping it makes the
/// engine's compute stream wait for everything cudarc queued with the views, on the device; the
/// tensor is the engine's again from then on, with what cudarc wrote.
#[must_use = "dropping the lend at once ends it"]
pub struct LentMut<'t, T: Element + DeviceRepr> {
    loan: Loan<'t, T>,
}

impl<'t, T: Element + DeviceRepr> Lent<'t, T> {
    /// The tensor as a cudarc view, for reading on the lend's stream (or on another stream of
    /// the context, through cudarc's event tracking).
    pub fn view(&self) -> CudaView<'_, T> {
        self.loan.slice.as_view()
    }

    /// The stream the tensor is lent to.
    pub fn stream(&self) -> &'t Arc<CudaStream> {
        self.loan.stream
    }

    /// The lent tensor's shape.
    pub fn shape(&self) -> &[usize] {
        self.loan.lending.shape()
    }
}

impl<'t, T: Element + DeviceRepr> LentMut<'t, T> {
    /// The tensor as a cudarc view, for reading.
    pub fn view(&self) -> CudaView<'_, T> {
        self.loan.slice.as_view()
    }

    /// The tensor as a mutable cudarc view, for reading and writing on the lend's stream (or on
    /// another stream of the context, through cudarc's event tracking).
    pub fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.loan.slice.as_view_mut()
    }

    /// The stream the tensor is lent to.
    pub fn stream(&self) -> &'t Arc<CudaStream> {
        self.loan.stream
    }

    /// The lent tensor's shape.
    pub fn shape(&self) -> &[usize] {
        self.loan.lending.shape()
    }
}

impl<T: Element + DeviceRepr> std::fmt::Debug for Lent<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.loan.describe(f, "Lent")
    }
}

impl<T: Element + DeviceRepr> std::fmt::Debug for LentMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.loan.describe(f, "LentMut")
    }
}

/// What both lends hold: the lending (the memory out of its tensor), the cudarc slice over the
/// memory that the views borrow, and the stream.
struct Loan<'t, T: Element + DeviceRepr> {
    /// Over the engine's memory: never dropped (that would free it), leaked when the lend ends.
    slice: ManuallyDrop<CudaSlice<T>>,
    lending: Lending<'t, T>,
    stream: &'t Arc<CudaStream>,
}

impl<'t, T: Element + DeviceRepr> Loan<'t, T> {
    /// Lends `tensor` to `stream` (see [`lend`]).
    fn new(
        engine: &mut CudaEngine,
        tensor: &'t mut DeviceTensor<T>,
        stream: &'t Arc<CudaStream>,
        write: bool,
    ) -> Result<Self> {
        let raw = check_stream(engine, stream, "the stream of a cudarc lend")?;
        // SAFETY: `raw` is the legacy default stream or a stream of the engine's context
        // (checked above) that names the same stream on every thread; the stream is borrowed
        // for the lend's life, and the slice below holds it too until the lend has ended.
        let lending = unsafe { Lending::begin(engine, tensor, raw, write) }?;
        // cudarc makes its own context current for its calls and leaves it so: the engine's
        // (the same context) is made current first, and the caller's restored after.
        let _scope = ContextScope::enter(
            &engine.shared,
            "cuCtxSetCurrent (restore after a cudarc lend)",
        )?;
        let mut slice =
            // SAFETY: the lending holds the memory at `ptr` out of its tensor, `len` elements of
            // `T` of the engine's allocation, valid (the tensor's elements) once the work the stream
            // now waits for has run, until the lend ends; the slice is never dropped (it would free
            // the engine's memory), only leaked when the lend ends.
            ManuallyDrop::new(unsafe { stream.upgrade_device_ptr(lending.ptr(), lending.len()) });
        // With cudarc's event tracking on, the slice's write event is recorded on the stream
        // now, after its wait for the engine: a use of the view on another stream waits for it.
        drop(slice.device_ptr_mut(stream));
        Ok(Loan {
            slice,
            lending,
            stream,
        })
    }

    fn describe(&self, f: &mut std::fmt::Formatter<'_>, name: &str) -> std::fmt::Result {
        f.debug_struct(name)
            .field("dtype", &T::DTYPE)
            .field("shape", &self.lending.shape())
            .field("stream", &self.stream.cu_stream())
            .finish()
    }
}

impl<T: Element + DeviceRepr> Drop for Loan<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the field is read once, here, as the loan is dropped; it is `ManuallyDrop`, so
        // the copy left behind is never dropped.
        let slice: ManuallyDrop<CudaSlice<T>> = unsafe { std::ptr::read(&self.slice) };
        self.lending.end(move || {
            // The stream waits for the slice's read and write events (the view's uses on other
            // streams), then the events are destroyed; the memory is the engine's again.
            let _ = ManuallyDrop::into_inner(slice).leak();
        });
    }
}

/// The raw handle the driver seam takes for a cudarc stream of the engine's context: the null
/// handle (cudarc's `default_stream()`) is the legacy default stream.
///
/// # Errors
/// [`SetupError::Unavailable`] on a simulated engine; [`UsageError::ForeignContext`] for a stream
/// of another context; [`UsageError::PerThreadStream`] for the per-thread default stream.
fn check_stream(engine: &CudaEngine, stream: &CudaStream, what: &'static str) -> Result<u64> {
    check_context(engine, stream.context(), what)?;
    match stream.cu_stream() as u64 {
        0 => Ok(LEGACY_STREAM),
        PER_THREAD_STREAM => Err(Error::Usage(UsageError::PerThreadStream { what })),
        raw => Ok(raw),
    }
}

/// Checks that `ctx` is the engine's context (the device's primary context).
fn check_context(engine: &CudaEngine, ctx: &CudaContext, what: &'static str) -> Result<()> {
    let device = engine.device();
    if device.kind() == DeviceKind::Simulated {
        return Err(Error::Setup(SetupError::Unavailable {
            library: "cudarc",
            detail: "simulated device: cudarc's streams and slices live in a CUDA context".into(),
        }));
    }
    let expected = engine.shared.lock().driver.context().0;
    let found = ctx.cu_ctx() as u64;
    if found != expected {
        return Err(Error::Usage(UsageError::ForeignContext {
            what,
            expected,
            found,
            engine: device,
        }));
    }
    Ok(())
}

/// Lends `tensor` read-only to cudarc code on `stream`, for as long as the returned
/// [`Lent`] lives: its [`view`](Lent::view) is a `CudaView` of the tensor (see the
/// [module docs](crate::cudarc_interop)).
///
/// `stream` waits, on the device, for every write the engine queued on the tensor. Dropping
/// the lend makes the engine's compute stream wait for everything queued on `stream` by then
/// (and the view's uses on other streams, through cudarc's event tracking), on the device.
/// The tensor is borrowed `&mut`, and is empty while lent, so a forgotten lend leaks its
/// memory instead of letting the engine use it under cudarc's work.
///
/// # Errors
/// [`UsageError::WrongEngine`] when `tensor` is not the engine's;
/// [`UsageError::ForeignContext`] when `stream` is not of the engine's context (the
/// device's primary context); [`UsageError::PerThreadStream`] for the per-thread default
/// stream; [`SetupError::Unavailable`] on a simulated engine; [`Error::Driver`] when the wait
/// cannot be queued. The tensor is untouched then.
pub fn lend<'t, T: Element + DeviceRepr>(
    engine: &mut CudaEngine,
    tensor: &'t mut DeviceTensor<T>,
    stream: &'t Arc<CudaStream>,
) -> Result<Lent<'t, T>> {
    Loan::new(engine, tensor, stream, false).map(|loan| Lent { loan })
}

/// Lends `tensor` to cudarc code on `stream`, which may write it, for as long as the
/// returned [`LentMut`] lives: its [`view_mut`](LentMut::view_mut) is a `CudaViewMut` of the
/// tensor.
///
/// As [`lend`], except that `stream` also waits for every read
/// the engine queued on the tensor, and the engine's later reads of it (on any of its
/// streams) see what cudarc wrote.
///
/// # Errors
/// As [`lend`].
pub fn lend_mut<'t, T: Element + DeviceRepr>(
    engine: &mut CudaEngine,
    tensor: &'t mut DeviceTensor<T>,
    stream: &'t Arc<CudaStream>,
) -> Result<LentMut<'t, T>> {
    Loan::new(engine, tensor, stream, true).map(|loan| LentMut { loan })
}

/// Takes cudarc's `slice` in as a tensor of the engine of `shape`, viewing the same memory
/// with no copy (see the [module docs](crate::cudarc_interop)).
///
/// The engine's compute stream waits, on the device, for everything queued on the slice's
/// stream so far (and the slice's uses on other streams, through cudarc's event tracking).
/// The tensor keeps the slice: when the tensor is dropped, the slice's stream waits for every
/// use the engine queued, and the slice is then dropped, freeing the memory on its stream
/// after that wait. When that wait cannot be queued, the slice is leaked. A zero-element
/// `shape` drops the slice at once.
///
/// # Errors
/// In [`SubmitError::Rejected`], the slice handed back: [`UsageError::LengthMismatch`]
/// when `shape` does not hold the slice's element count, [`UsageError::ShapeOverflow`] when
/// its element count overflows, [`UsageError::ForeignContext`] for a slice of another
/// context than the engine's, [`UsageError::PerThreadStream`] for a slice of the
/// per-thread default stream, [`SetupError::Unavailable`] on a simulated engine. In
/// [`SubmitError::Failed`], the slice handed back: [`Error::Driver`] when the wait cannot be
/// queued.
// The refusal hands the slice back by value, as every give-back error does.
#[allow(clippy::result_large_err)]
pub fn adopt<T: Element + DeviceRepr>(
    engine: &mut CudaEngine,
    mut slice: CudaSlice<T>,
    shape: &[usize],
) -> Result<DeviceTensor<T>, SubmitError<CudaSlice<T>>> {
    let stream = Arc::clone(slice.stream());
    let raw = match check_stream(engine, &stream, "the adopted cudarc slice") {
        Ok(raw) => raw,
        Err(error) => {
            return Err(SubmitError::Rejected {
                input: slice,
                error,
            });
        }
    };
    let len = slice.len();
    let ptr = {
        // cudarc makes its own context current and leaves it so (see `Loan::new`).
        let _scope = ContextScope::enter(
            &engine.shared,
            "cuCtxSetCurrent (restore after a cudarc adoption)",
        );
        // With cudarc's event tracking on, the slice's stream waits for the slice's uses on
        // other streams (its read and write events): its end covers them all.
        let (ptr, record) = slice.device_ptr_mut(&stream);
        drop(record);
        ptr
    };
    // SAFETY: the slice owns `len` valid `T`s of device memory of the engine's context at
    // `ptr` (a `CudaSlice` is initialised memory; its stream's work, which the adoption
    // waits for, includes every use on other streams, ordered before it just above), and
    // frees it when dropped, on its stream after everything queued there by then; its
    // stream is the legacy default stream or a stream of the engine's context that names the
    // same stream on every thread (checked above), which the slice keeps alive.
    unsafe {
        adopt::adopt(
            engine,
            slice,
            ptr,
            len,
            shape,
            raw,
            "cudarc_interop::adopt: the slice's elements for the shape",
        )
    }
}
