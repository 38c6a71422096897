//! Pending routes: pinned buffers handed over by value, transfers whose state is a type.
//!
//! [`upload_pending`] and [`download_pending`] take a [`PinnedHostBuffer`] and a
//! [`DeviceTensor`] by value, queue one copy on the engine's stream, record an event after it,
//! and return a [`Pending`] handle in state [`InFlight`]. In that state nothing can reach the
//! buffer or the tensor: the handle owns them, and offers only [`Pending::is_ready`] (never
//! waits), [`Pending::wait`] and [`Pending::try_wait`]. The [`Returned`] state, reached once the
//! event proves the copy complete, gives both back, and can resubmit the same pair without
//! allocating anything.
//!
//! Every exit keeps the rule "nothing is freed or reused while DMA may touch it":
//! - a refused submission returns the whole package untouched ([`TransferSubmitError`]);
//! - dropping an `InFlight` handle detaches it into the engine's retirement queue, which releases
//!   it once its event proves completion;
//! - `mem::forget` on an `InFlight` handle leaks it in place, which is sound (nothing is freed);
//! - a wait that fails retains everything for the engine's lifetime and returns a typed error.

// A refused submission hands the whole package back by value, as `TrySendError<T>` does; the
// error is large by design and travels only on the refusal path.
#![allow(clippy::result_large_err)]

use crate::driver::EventHandle;
use crate::element::{DType, Element};
use crate::engine::{CudaEngine, Shared};
use crate::error::{DeviceId, Error, Result};
use crate::pinned::PinnedHostBuffer;
use crate::retire::Record;
use crate::tensor::DeviceTensor;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

mod sealed {
    pub trait Direction {}
    pub trait State {}
}

/// The direction of a pending transfer. Sealed: [`Upload`] or [`Download`].
pub trait Direction: sealed::Direction + Send + 'static {
    /// Whether the copy goes host to device.
    const UPLOAD: bool;
    /// A name for messages.
    const NAME: &'static str;
}

/// The state of a pending transfer. Sealed: [`InFlight`] or [`Returned`].
pub trait TransferState: sealed::State + Send + 'static {
    /// Whether the copy may still be running.
    const IN_FLIGHT: bool;
}

/// Direction marker: host to device.
#[derive(Debug)]
pub enum Upload {}
/// Direction marker: device to host.
#[derive(Debug)]
pub enum Download {}
/// State marker: the copy may still be running; nothing is reachable.
#[derive(Debug)]
pub enum InFlight {}
/// State marker: the copy has completed; buffer and tensor are reachable.
#[derive(Debug)]
pub enum Returned {}

impl sealed::Direction for Upload {}
impl sealed::Direction for Download {}
impl sealed::State for InFlight {}
impl sealed::State for Returned {}

impl Direction for Upload {
    const UPLOAD: bool = true;
    const NAME: &'static str = "pending upload";
}
impl Direction for Download {
    const UPLOAD: bool = false;
    const NAME: &'static str = "pending download";
}
impl TransferState for InFlight {
    const IN_FLIGHT: bool = true;
}
impl TransferState for Returned {
    const IN_FLIGHT: bool = false;
}

/// What a pending transfer owns: the pinned buffer and the device tensor.
#[derive(Debug)]
pub struct TransferPackage<T: Element> {
    /// The pinned host side.
    pub buffer: PinnedHostBuffer<T>,
    /// The device side.
    pub tensor: DeviceTensor<T>,
}

/// Why a submission was refused. Nothing was queued.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectReason {
    /// The buffer and the tensor hold different numbers of elements.
    LengthMismatch {
        /// Elements in the buffer.
        buffer: usize,
        /// Elements in the tensor.
        tensor: usize,
    },
    /// The tensor holds no elements.
    ZeroLength,
    /// The tensor lives on another device.
    WrongDevice {
        /// The engine's device.
        expected: DeviceId,
        /// The tensor's device.
        found: DeviceId,
    },
    /// The tensor belongs to another engine (another stream).
    WrongEngine {
        /// The engine the submission was made on.
        expected: u64,
        /// The tensor's engine.
        found: u64,
    },
    /// The element type cannot travel this way: raw device bytes downloaded into a `bool`
    /// buffer need not be 0 or 1.
    UnsupportedElement {
        /// The element type.
        dtype: DType,
    },
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::LengthMismatch { buffer, tensor } => write!(
                f,
                "the buffer holds {buffer} element(s) but the tensor holds {tensor}"
            ),
            RejectReason::ZeroLength => f.write_str("the tensor holds no elements"),
            RejectReason::WrongDevice { expected, found } => {
                write!(f, "the tensor lives on {found}, but this engine drives {expected}")
            }
            RejectReason::WrongEngine { expected, found } => write!(
                f,
                "the tensor belongs to engine #{found}, not to engine #{expected}"
            ),
            RejectReason::UnsupportedElement { dtype } => write!(
                f,
                "{dtype} cannot be downloaded into pinned memory: raw device bytes need not be 0 or 1"
            ),
        }
    }
}

/// A submission that did not produce an in-flight transfer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferSubmitError<T: Element> {
    /// Refused before anything was queued; the package comes back untouched.
    #[error("transfer rejected: {reason}")]
    Rejected {
        /// Everything that was submitted.
        package: TransferPackage<T>,
        /// Why.
        reason: RejectReason,
    },
    /// The driver refused to queue the copy; nothing is in flight and the package comes back.
    #[error("transfer could not be queued: {error}")]
    Failed {
        /// Everything that was submitted.
        package: TransferPackage<T>,
        /// The driver failure.
        error: Error,
    },
    /// The copy was queued but its completion could not be tracked or proven. The device may
    /// still touch the package, so the engine retains it for its lifetime instead of returning it.
    #[error(
        "transfer queued but its completion cannot be proven; its memory is retained: {error}"
    )]
    Retained {
        /// The driver failure.
        error: Error,
    },
}

impl<T: Element> TransferSubmitError<T> {
    /// The package, when it came back.
    pub fn into_package(self) -> Option<TransferPackage<T>> {
        match self {
            TransferSubmitError::Rejected { package, .. }
            | TransferSubmitError::Failed { package, .. } => Some(package),
            TransferSubmitError::Retained { .. } => None,
        }
    }
}

struct Inner<T: Element> {
    buffer: PinnedHostBuffer<T>,
    tensor: DeviceTensor<T>,
    event: EventHandle,
}

impl<T: Element> Inner<T> {
    fn owner(&self) -> Arc<Shared> {
        Arc::clone(self.tensor.owner())
    }

    fn into_record(self, what: &'static str) -> Record {
        Record {
            event: self.event,
            resources: Box::new((self.buffer, self.tensor)),
            what,
        }
    }
}

/// A pinned transfer between a [`PinnedHostBuffer`] and a [`DeviceTensor`], in direction `D`
/// and state `S`.
///
/// In [`InFlight`] it owns both and gives access to neither; [`Returned`] gives both back.
#[must_use = "a pending transfer owns its buffer and tensor: wait for it (in flight) or take them back with `into_parts` (returned)"]
pub struct Pending<D: Direction, T: Element, S: TransferState> {
    /// `Some` until a transition or drop moves it out.
    inner: Option<Inner<T>>,
    _marker: PhantomData<(D, S)>,
}

/// A pending host-to-device transfer.
pub type PendingUpload<T, S = InFlight> = Pending<Upload, T, S>;
/// A pending device-to-host transfer.
pub type PendingDownload<T, S = InFlight> = Pending<Download, T, S>;

impl<D: Direction, T: Element, S: TransferState> fmt::Debug for Pending<D, T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("direction", &D::NAME)
            .field("in_flight", &S::IN_FLIGHT)
            .field("dtype", &T::DTYPE)
            .finish()
    }
}

/// What [`Pending::try_wait`] found.
#[derive(Debug)]
#[must_use]
pub enum TryWait<D: Direction, T: Element> {
    /// The copy completed.
    Returned(Pending<D, T, Returned>),
    /// Not yet: the handle comes back unchanged.
    InFlight(Pending<D, T, InFlight>),
}

impl<D: Direction, T: Element, S: TransferState> Pending<D, T, S> {
    fn new(inner: Inner<T>) -> Self {
        Pending {
            inner: Some(inner),
            _marker: PhantomData,
        }
    }

    fn take(mut self) -> Inner<T> {
        // Invariant: `inner` is `Some` for every value reachable by the caller.
        self.inner
            .take()
            .expect("a live pending transfer holds its parts")
    }

    fn inner(&self) -> &Inner<T> {
        self.inner
            .as_ref()
            .expect("a live pending transfer holds its parts")
    }
}

/// Asks a transfer's event whether the copy completed, waiting for it when `block`. On a device
/// failure everything the copy may touch is retained for the engine's lifetime and the error
/// returned; when the context cannot be entered the transfer is detached instead.
fn settle<D: Direction, T: Element>(inner: Inner<T>, block: bool) -> Result<(Inner<T>, bool)> {
    let owner = inner.owner();
    let mut st = match owner.enter() {
        Ok(st) => st,
        Err(e) => {
            owner.lock_raw().retire.push(inner.into_record(D::NAME));
            return Err(e);
        }
    };
    let done = if block {
        st.driver.event_synchronize(inner.event).map(|()| true)
    } else {
        st.driver.event_query(inner.event)
    };
    match done {
        Ok(done) => Ok((inner, done)),
        Err(source) => {
            st.retire.retain_failed(inner.into_record(D::NAME), source);
            Err(fault(D::NAME)(source))
        }
    }
}

fn fault(what: &'static str) -> impl FnOnce(crate::DriverError) -> Error {
    move |source| Error::DeviceFault { what, source }
}

impl<D: Direction, T: Element> Pending<D, T, InFlight> {
    /// Whether the copy has completed. Never waits.
    ///
    /// `Ok(false)` means not yet; a copy can complete before the first poll, so `Ok(true)` at once
    /// is not an error.
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when the device reports a failure of the copy (or of earlier work).
    pub fn is_ready(&mut self) -> Result<bool> {
        let inner = self.inner();
        let owner = inner.owner();
        let mut st = owner.enter()?;
        st.driver.event_query(inner.event).map_err(fault(D::NAME))
    }

    /// Waits for the copy and returns the transfer in state [`Returned`].
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when the device reports a failure: the buffer and tensor are then
    /// retained by the engine for its lifetime (the device may still touch them), never freed.
    pub fn wait(self) -> Result<Pending<D, T, Returned>> {
        let (inner, _) = settle::<D, T>(self.take(), true)?;
        Ok(Pending::new(inner))
    }

    /// Returns the transfer in state [`Returned`] if the copy has completed, or hands the
    /// [`InFlight`] handle back if not. Never waits.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn try_wait(self) -> Result<TryWait<D, T>> {
        let (inner, done) = settle::<D, T>(self.take(), false)?;
        Ok(if done {
            TryWait::Returned(Pending::new(inner))
        } else {
            TryWait::InFlight(Pending::new(inner))
        })
    }
}

impl<D: Direction, T: Element> Pending<D, T, Returned> {
    /// The pinned buffer: for a download, the data that arrived.
    pub fn buffer(&self) -> &PinnedHostBuffer<T> {
        &self.inner().buffer
    }

    /// The pinned buffer, mutably: refill it before [`resubmit`](Self::resubmit)ting an upload.
    pub fn buffer_mut(&mut self) -> &mut PinnedHostBuffer<T> {
        &mut self
            .inner
            .as_mut()
            .expect("a live pending transfer holds its parts")
            .buffer
    }

    /// The device tensor: for an upload, the destination now holding the data.
    pub fn tensor(&self) -> &DeviceTensor<T> {
        &self.inner().tensor
    }

    /// Gives back the buffer and the tensor, in that order.
    pub fn into_parts(self) -> (PinnedHostBuffer<T>, DeviceTensor<T>) {
        let inner = self.take();
        release_event(&inner.owner(), inner.event);
        (inner.buffer, inner.tensor)
    }

    /// Queues the same copy again, between the same buffer and tensor, reusing the transfer's
    /// event: nothing is allocated. For streaming loops: refill the buffer through
    /// [`buffer_mut`](Self::buffer_mut) and resubmit an upload, or resubmit a download to read the
    /// tensor again.
    ///
    /// # Errors
    /// As [`upload_pending`] and [`download_pending`].
    pub fn resubmit(
        self,
        engine: &mut CudaEngine,
    ) -> Result<Pending<D, T, InFlight>, TransferSubmitError<T>> {
        let inner = self.take();
        let package = TransferPackage {
            buffer: inner.buffer,
            tensor: inner.tensor,
        };
        submit::<D, T>(engine, package, Some(inner.event))
    }
}

/// Returns a completed event to its engine's pool (destroys it after teardown).
fn release_event(owner: &Shared, event: EventHandle) {
    if let Some(mut st) = owner.enter_for_drop() {
        let st = &mut *st;
        if st.torn_down {
            // SAFETY: the event's last record is complete and nothing uses it again.
            let _ = unsafe { st.driver.event_destroy(event) };
        } else {
            st.events.put(event);
        }
    }
}

impl<D: Direction, T: Element, S: TransferState> Drop for Pending<D, T, S> {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let owner = inner.owner();
        if !S::IN_FLIGHT {
            release_event(&owner, inner.event);
            return; // buffer and tensor drop here, after the lock is released
        }
        let Some(mut st) = owner.enter_for_drop() else {
            std::mem::forget(inner);
            return;
        };
        if !st.torn_down {
            st.retire.push(inner.into_record(D::NAME));
            return;
        }
        // The engine is gone and nobody drains its queue: resolve here, or leak.
        if st.driver.event_synchronize(inner.event).is_ok() {
            // SAFETY: the event's record is complete and nothing uses it again.
            let _ = unsafe { st.driver.event_destroy(inner.event) };
            drop(st);
            drop(inner);
        } else {
            std::mem::forget(inner);
        }
    }
}

/// Validates and queues one copy. `event` is the transfer's own event on resubmission.
fn submit<D: Direction, T: Element>(
    engine: &mut CudaEngine,
    package: TransferPackage<T>,
    event: Option<EventHandle>,
) -> Result<Pending<D, T, InFlight>, TransferSubmitError<T>> {
    let reject = |package, reason| Err(TransferSubmitError::Rejected { package, reason });
    let (buffer_len, tensor_len) = (package.buffer.len(), package.tensor.len());
    let found_device = package.tensor.device();
    let found_engine = package.tensor.engine_id();
    let owner_check = engine.shared.check_owner(found_device, found_engine);
    // A resubmitted transfer's event belongs to the engine that made it (the tensor's owner),
    // which is not `engine` when the submission is refused for a wrong device or engine.
    let returned_event = |package: &TransferPackage<T>| {
        if let Some(event) = event {
            release_event(package.tensor.owner(), event);
        }
    };
    let reason = match owner_check {
        Err(Error::WrongDevice { expected, found }) => {
            Some(RejectReason::WrongDevice { expected, found })
        }
        Err(Error::WrongEngine { expected, found }) => {
            Some(RejectReason::WrongEngine { expected, found })
        }
        _ if tensor_len == 0 => Some(RejectReason::ZeroLength),
        _ if buffer_len != tensor_len => Some(RejectReason::LengthMismatch {
            buffer: buffer_len,
            tensor: tensor_len,
        }),
        _ if !D::UPLOAD && !T::DTYPE.any_bit_pattern() => {
            Some(RejectReason::UnsupportedElement { dtype: T::DTYPE })
        }
        _ => None,
    };
    if let Some(reason) = reason {
        returned_event(&package);
        return reject(package, reason);
    }
    let bytes = package.tensor.byte_len();
    let mut st = match engine.shared.enter() {
        Ok(st) => st,
        Err(error) => {
            returned_event(&package);
            return Err(TransferSubmitError::Failed { package, error });
        }
    };
    let st = &mut *st;
    let event = match event.map_or_else(|| st.events.take(&mut *st.driver), Ok) {
        Ok(event) => event,
        Err(error) => return Err(TransferSubmitError::Failed { package, error }),
    };
    let host = package.buffer.raw_ptr();
    let device = package.tensor.raw_ptr();
    let queued = if D::UPLOAD {
        // SAFETY: the buffer and tensor move into the returned handle (or the retirement queue)
        // and stay there, untouched by the host, until the event recorded below proves the copy
        // complete; both hold exactly `bytes` bytes.
        unsafe { st.driver.copy_htod(device, host, bytes) }
            .map_err(Error::driver("cuMemcpyHtoDAsync"))
    } else {
        // SAFETY: as above; the host cannot read the buffer until the handle is `Returned`.
        unsafe { st.driver.copy_dtoh(host, device, bytes) }
            .map_err(Error::driver("cuMemcpyDtoHAsync"))
    };
    if let Err(error) = queued {
        st.events.put(event);
        return Err(TransferSubmitError::Failed { package, error });
    }
    let inner = Inner {
        buffer: package.buffer,
        tensor: package.tensor,
        event,
    };
    if let Err(source) = st.driver.event_record(event) {
        let error = Error::Driver {
            call: "cuEventRecord",
            source,
        };
        // The copy is queued but untracked: prove it complete the hard way, or retain it.
        return match st.driver.stream_synchronize() {
            Ok(()) => {
                st.events.put(event);
                Err(TransferSubmitError::Failed {
                    package: TransferPackage {
                        buffer: inner.buffer,
                        tensor: inner.tensor,
                    },
                    error,
                })
            }
            Err(wait) => {
                st.retire.retain_failed(inner.into_record(D::NAME), wait);
                Err(TransferSubmitError::Retained { error })
            }
        };
    }
    Ok(Pending::new(inner))
}

/// Queues a copy of `source` into `destination` and returns the transfer in flight.
///
/// The engine is borrowed only for the call: later work on the engine runs after the copy in
/// stream order, so the destination may be used by queued operations once the transfer is
/// [`Returned`]; the handle holds both until then.
///
/// # Errors
/// [`TransferSubmitError::Rejected`] (package untouched) for a length mismatch, a zero length or
/// a tensor of another device or engine; [`TransferSubmitError::Failed`] when the driver refuses
/// the copy; [`TransferSubmitError::Retained`] when the copy was queued but cannot be tracked.
pub fn upload_pending<T: Element>(
    engine: &mut CudaEngine,
    source: PinnedHostBuffer<T>,
    destination: DeviceTensor<T>,
) -> Result<PendingUpload<T>, TransferSubmitError<T>> {
    submit::<Upload, T>(
        engine,
        TransferPackage {
            buffer: source,
            tensor: destination,
        },
        None,
    )
}

/// Queues a copy of `value` into `buffer` and returns the transfer in flight.
///
/// # Errors
/// As [`upload_pending`], and [`RejectReason::UnsupportedElement`] for `bool`.
pub fn download_pending<T: Element>(
    engine: &mut CudaEngine,
    value: DeviceTensor<T>,
    buffer: PinnedHostBuffer<T>,
) -> Result<PendingDownload<T>, TransferSubmitError<T>> {
    submit::<Download, T>(
        engine,
        TransferPackage {
            buffer,
            tensor: value,
        },
        None,
    )
}
