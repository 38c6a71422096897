//! Pending routes: page-locked buffers handed over by value, transfers whose state is a type.
//!
//! [`upload_pending`] and [`download_pending`] take a host buffer (a [`PinnedHostBuffer`] or a
//! [`RegisteredBuffer`](crate::RegisteredBuffer), anything that is a [`HostBuffer`]) and a
//! [`DeviceTensor`] by value, queue one copy on the engine's upload or download stream, record an
//! event after it, and return a [`Pending`] handle in state [`InFlight`]. In that state nothing
//! can reach the buffer or the tensor: the handle owns them, and offers only
//! [`Pending::is_ready`] (never waits), [`Pending::wait`], [`Pending::try_wait`] and `.await`
//! ([`PendingFuture`]). The [`Returned`] state, reached once the event proves the copy complete,
//! gives both back, and can resubmit the same pair without allocating anything.
//!
//! Awaiting is woken by the device, never by polling: the future asks the event once, and if
//! the copy is not done it registers a call back that the device makes once the copy has
//! completed or the device has failed (on CUDA a stream callback on a side stream waiting for the
//! event), then yields. Nothing on the host spends time on the transfer meanwhile, and the wake
//! comes right after the event. A watcher thread blocked in an event wait would spin unless the
//! event were made for blocking sync, and would need a thread per wait (or serialise the waits);
//! a poll loop would keep a core busy. [`PendingFuture`] has the details.
//!
//! The routes are written once over the sealed [`HostBuffer`] trait, whose type is the last
//! parameter of every type here, defaulting to [`PinnedHostBuffer`]: both kinds of buffer go
//! through the same lifecycle, refusals, detach-on-drop and retention.
//!
//! Every exit keeps the rule "nothing is freed or reused while DMA may touch it":
//! - a refused submission returns the whole package untouched ([`TransferSubmitError`]);
//! - dropping an `InFlight` handle (or its future, before it resolves) detaches it into the
//!   engine's retirement queue, which releases it once its event proves completion;
//! - `mem::forget` on an `InFlight` handle leaks it in place, which is sound (nothing is freed);
//! - a wait that fails retains everything for the engine's lifetime and returns a typed error.

// A refused submission hands the whole package back by value, as `TrySendError<T>` does; the
// error is large by design and travels only on the refusal path.
#![allow(clippy::result_large_err)]

use crate::core::engine::CudaEngine;
use crate::error::{Error, Result, UsageError};
use crate::lifecycle::fence::{fence, Fenced, Fencing, IdleEvent};
use crate::memory::element::Element;
use crate::memory::host::HostBuffer;
use crate::memory::pinned::PinnedHostBuffer;
use crate::memory::tensor::DeviceTensor;
use crate::routes::peer::{InFlightPeer, PeerLanded};
use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;

mod future;

pub use future::PendingFuture;

pub(in crate::routes) mod sealed {
    pub trait Direction {}
    /// What a transfer in this state holds.
    pub trait State {
        type Hold<T: crate::Element, B: crate::memory::host::HostBuffer<T>>: Send + Sync;
        /// What a peer copy in this state holds.
        type PeerHold<T: crate::Element>: Send + Sync;
    }
}

/// The direction of a pending transfer. Sealed: [`Upload`] or [`Download`].
pub trait Direction: sealed::Direction + Send + Sync + 'static {
    /// Whether the copy goes host to device.
    const UPLOAD: bool;
    /// A name for messages.
    const NAME: &'static str;
}

/// The state of a pending transfer. Sealed: [`InFlight`] or [`Returned`].
pub trait TransferState: sealed::State + Send + Sync + 'static {
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
impl sealed::State for InFlight {
    type Hold<T: Element, B: HostBuffer<T>> = Fenced<TransferPackage<T, B>>;
    type PeerHold<T: Element> = Fenced<InFlightPeer<T>>;
}
impl sealed::State for Returned {
    type Hold<T: Element, B: HostBuffer<T>> = Landed<T, B>;
    type PeerHold<T: Element> = PeerLanded<T>;
}

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

/// What a pending transfer owns: the host buffer (a [`PinnedHostBuffer`] unless `B` says
/// otherwise) and the device tensor.
#[derive(Debug)]
pub struct TransferPackage<T: Element, B: HostBuffer<T> = PinnedHostBuffer<T>> {
    /// The host side.
    pub buffer: B,
    /// The device side.
    pub tensor: DeviceTensor<T>,
}

/// A returned transfer's parts, with its idle event kept for resubmission.
pub struct Landed<T: Element, B: HostBuffer<T>> {
    package: TransferPackage<T, B>,
    event: IdleEvent,
}

/// A submission that did not produce an in-flight transfer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferSubmitError<T: Element, B: HostBuffer<T> = PinnedHostBuffer<T>> {
    /// Refused before anything was queued; the package comes back untouched.
    #[error("transfer rejected: {error}")]
    Rejected {
        /// Everything that was submitted.
        package: TransferPackage<T, B>,
        /// Why: [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) for a buffer or tensor of another engine,
        /// [`UsageError::ZeroLength`](crate::error::UsageError::ZeroLength), [`UsageError::LengthMismatch`](crate::error::UsageError::LengthMismatch) between buffer and tensor,
        /// [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) for a `bool` download.
        error: Error,
    },
    /// The driver refused to queue the copy, or the copy was queued and then proven complete
    /// without an event; nothing is in flight and the package comes back.
    #[error("transfer could not be queued: {error}")]
    Failed {
        /// Everything that was submitted.
        package: TransferPackage<T, B>,
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

impl<T: Element, B: HostBuffer<T>> TransferSubmitError<T, B> {
    /// The package, when it came back.
    pub fn into_package(self) -> Option<TransferPackage<T, B>> {
        match self {
            TransferSubmitError::Rejected { package, .. }
            | TransferSubmitError::Failed { package, .. } => Some(package),
            TransferSubmitError::Retained { .. } => None,
        }
    }

    /// The error, dropping the package if it came back.
    pub fn into_error(self) -> Error {
        match self {
            TransferSubmitError::Rejected { error, .. }
            | TransferSubmitError::Failed { error, .. }
            | TransferSubmitError::Retained { error } => error,
        }
    }

    /// The error, whatever became of the package.
    pub fn error(&self) -> &Error {
        match self {
            TransferSubmitError::Rejected { error, .. }
            | TransferSubmitError::Failed { error, .. }
            | TransferSubmitError::Retained { error } => error,
        }
    }
}

/// A transfer between a page-locked host buffer `B` (a [`PinnedHostBuffer`] unless `B` says
/// otherwise, or a [`RegisteredBuffer`](crate::RegisteredBuffer)) and a [`DeviceTensor`], in
/// direction `D` and state `S`.
///
/// In [`InFlight`] it owns both and gives access to neither; [`Returned`] gives both back.
#[must_use = "a pending transfer owns its buffer and tensor: wait for it (in flight) or take them back with `into_parts` (returned)"]
pub struct Pending<
    D: Direction,
    T: Element,
    S: TransferState,
    B: HostBuffer<T> = PinnedHostBuffer<T>,
> {
    hold: <S as sealed::State>::Hold<T, B>,
    _direction: PhantomData<D>,
}

/// A pending host-to-device transfer.
pub type PendingUpload<T, S = InFlight, B = PinnedHostBuffer<T>> = Pending<Upload, T, S, B>;
/// A pending device-to-host transfer.
pub type PendingDownload<T, S = InFlight, B = PinnedHostBuffer<T>> = Pending<Download, T, S, B>;

impl<D: Direction, T: Element, S: TransferState, B: HostBuffer<T>> fmt::Debug
    for Pending<D, T, S, B>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("direction", &D::NAME)
            .field("in_flight", &S::IN_FLIGHT)
            .field("dtype", &T::DTYPE)
            .field("host", &B::KIND)
            .finish()
    }
}

/// What [`Pending::try_wait`] found.
#[derive(Debug)]
#[must_use]
pub enum TryWait<D: Direction, T: Element, B: HostBuffer<T> = PinnedHostBuffer<T>> {
    /// The copy completed.
    Returned(Pending<D, T, Returned, B>),
    /// Not yet: the handle comes back unchanged.
    InFlight(Pending<D, T, InFlight, B>),
}

impl<D: Direction, T: Element, S: TransferState, B: HostBuffer<T>> Pending<D, T, S, B> {
    fn new(hold: <S as sealed::State>::Hold<T, B>) -> Self {
        Pending {
            hold,
            _direction: PhantomData,
        }
    }
}

impl<D: Direction, T: Element, B: HostBuffer<T>> Pending<D, T, InFlight, B> {
    /// Whether the copy has completed. Never waits, and takes no engine lock.
    ///
    /// `Ok(false)` means not yet; a copy can complete before the first poll, so `Ok(true)` at once
    /// is not an error.
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when the device reports a failure of the copy (or of earlier work).
    pub fn is_ready(&mut self) -> Result<bool> {
        self.hold.is_ready()
    }

    /// The device tensor, for device work queued on this engine while the copy is in flight:
    /// the in-flight handoff.
    ///
    /// The copy's use of the tensor is in the engine's order, so every operation of this engine
    /// queued after the copy that uses the tensor runs after it, on whichever of the engine's
    /// three streams it goes (after an event wait on the device where that is not the copy's): a
    /// kernel, a library call, a device copy, a blocking or pending download, a prepared program
    /// given this tensor reads an upload's destination only after the data has landed, with no
    /// host wait in between. For a download, the tensor is its source, and other work may read it
    /// alongside the copy. The borrow is shared, so nothing can write the tensor, free it or move
    /// it while the copy may still touch it, and it ends before [`wait`](Self::wait) (which
    /// consumes the handle) can return the transfer. The host buffer stays unreachable until then.
    ///
    /// Only the engine that queued the copy accepts the tensor: another engine refuses it with
    /// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine), as it refuses any tensor it does not own. A CubeCL import
    /// (`CubeclScope::import`, feature `cubecl`) queues its copy on this engine's compute stream,
    /// ordered after the upload, and waits for it on the host, so it too reads the data after it
    /// has landed.
    ///
    /// ```
    /// # use cuferry::sim::SimConfig;
    /// # use cuferry::{download_pending, upload_pending, CudaEngine, PinnedHostBuffer};
    /// # let mut engine = CudaEngine::simulated(SimConfig::default());
    /// let source = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0, 3.0])?;
    /// let destination = engine.alloc_tensor::<f32>(&[3])?;
    /// let upload = upload_pending(&mut engine, source, destination).map_err(|e| e.into_error())?;
    /// // Ordered after the copy by an event wait on the device: no host wait.
    /// let doubled = engine.add(upload.device_tensor(), upload.device_tensor())?;
    /// let buffer = PinnedHostBuffer::<f32>::new(&mut engine, 3)?;
    /// let download = download_pending(&mut engine, doubled, buffer).map_err(|e| e.into_error())?;
    /// let download = download.wait()?; // the one host wait
    /// assert_eq!(download.buffer().as_slice(), &[2.0, 4.0, 6.0]);
    /// let _upload = upload.wait()?; // already complete: the kernel that read it waited for it
    /// # Ok::<(), cuferry::Error>(())
    /// ```
    pub fn device_tensor(&self) -> &DeviceTensor<T> {
        &self.hold.resources().tensor
    }

    /// Waits for the copy and returns the transfer in state [`Returned`]. The wait holds no
    /// engine lock: the engine's owner keeps working while another thread waits here.
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when the device reports a failure: the buffer and tensor are then
    /// retained by the engine for its lifetime (the device may still touch them), never freed.
    pub fn wait(self) -> Result<Pending<D, T, Returned, B>> {
        let (package, event) = self.hold.wait_parts()?;
        Ok(Pending::new(Landed { package, event }))
    }

    /// Returns the transfer in state [`Returned`] if the copy has completed, or hands the
    /// [`InFlight`] handle back if not. Never waits.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn try_wait(self) -> Result<TryWait<D, T, B>> {
        Ok(match self.hold.try_wait()? {
            Ok((package, event)) => TryWait::Returned(Pending::new(Landed { package, event })),
            Err(fenced) => TryWait::InFlight(Pending::new(fenced)),
        })
    }
}
impl<D: Direction, T: Element, B: HostBuffer<T>> Pending<D, T, Returned, B> {
    /// The host buffer: for a download, the data that arrived.
    pub fn buffer(&self) -> &B {
        &self.hold.package.buffer
    }

    /// The host buffer, mutably: refill it before [`resubmit`](Self::resubmit)ting an upload.
    pub fn buffer_mut(&mut self) -> &mut B {
        &mut self.hold.package.buffer
    }

    /// The device tensor: for an upload, the destination now holding the data.
    pub fn tensor(&self) -> &DeviceTensor<T> {
        &self.hold.package.tensor
    }

    /// Gives back the buffer and the tensor, in that order.
    pub fn into_parts(self) -> (B, DeviceTensor<T>) {
        let TransferPackage { buffer, tensor } = self.hold.package;
        (buffer, tensor)
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
    ) -> Result<Pending<D, T, InFlight, B>, TransferSubmitError<T, B>> {
        let Landed { package, event } = self.hold;
        submit::<D, T, B>(engine, package, Some(event))
    }
}

/// Why a submission of `package` is refused, if it is.
fn refusal<D: Direction, T: Element, B: HostBuffer<T>>(
    engine: &CudaEngine,
    package: &TransferPackage<T, B>,
) -> Option<Error> {
    let (buffer_len, tensor_len) = (package.buffer.host_len(), package.tensor.len());
    let (buffer_device, buffer_engine) = package.buffer.host_engine();
    if let Err(error) = engine
        .shared
        .check(package.tensor.owner())
        .and_then(|()| engine.shared.check_owner(buffer_device, buffer_engine))
    {
        return Some(error);
    }
    if tensor_len == 0 {
        return Some(Error::Usage(UsageError::ZeroLength {
            what: "a pending transfer",
        }));
    }
    if buffer_len != tensor_len {
        return Some(Error::Usage(UsageError::LengthMismatch {
            what: "pending transfer: buffer for the tensor",
            found: buffer_len,
            shape: None,
            expected: tensor_len,
        }));
    }
    if !D::UPLOAD && !T::DTYPE.any_bit_pattern() {
        return Some(Error::Usage(UsageError::UnsupportedElement {
            operation: "download_pending",
            dtype: T::DTYPE,
            reason:
                "raw device bytes need not be 0 or 1, and a host buffer exposes them as they are",
        }));
    }
    None
}

/// Validates and queues one copy. `event` is the transfer's own idle event on resubmission; on a
/// refusal it goes back to the engine that made it.
fn submit<D: Direction, T: Element, B: HostBuffer<T>>(
    engine: &mut CudaEngine,
    package: TransferPackage<T, B>,
    event: Option<IdleEvent>,
) -> Result<Pending<D, T, InFlight, B>, TransferSubmitError<T, B>> {
    if let Some(error) = refusal::<D, T, B>(engine, &package) {
        return Err(TransferSubmitError::Rejected { package, error });
    }
    let owner = &engine.shared;
    let mut st = match owner.enter() {
        Ok(st) => st,
        Err(error) => return Err(TransferSubmitError::Failed { package, error }),
    };
    let bytes = package.tensor.byte_len();
    let host = package.buffer.host_ptr();
    let device = package.tensor.raw_ptr();
    // From the enqueue until the fence holds it, a panic inside a driver call leaks the package:
    // dropped, its buffer would go back to the pool under the queued copy.
    let package = ManuallyDrop::new(package);
    // SAFETY: the buffer and tensor move into the fence below (or come back only once the stream
    // is proven idle), untouched by the host until the event proves the copy complete (the host
    // cannot read the buffer before the handle is `Returned`); both hold exactly `bytes` bytes
    // (the lengths were checked equal), both belong to this engine, and the buffer's memory is
    // page-locked for as long as the buffer lives (`HostBuffer`'s promise), so it stays valid
    // until the fence releases it.
    let lane = match unsafe { st.queue_host_copy(D::UPLOAD, device, device, host, bytes) } {
        Ok(lane) => lane,
        Err(error) => {
            // Nothing was queued: the package comes back untouched.
            let package = ManuallyDrop::into_inner(package);
            return Err(TransferSubmitError::Failed { package, error });
        }
    };
    let event = event.map(IdleEvent::into_raw);
    match fence(&mut st, owner, lane, package, event, D::NAME) {
        Fencing::Fenced(fenced) => Ok(Pending::new(fenced)),
        Fencing::Proven(package, error) => Err(TransferSubmitError::Failed { package, error }),
        Fencing::Untracked(untracked, error) => {
            drop(st);
            untracked.retain();
            Err(TransferSubmitError::Retained { error })
        }
    }
}

/// Queues a copy of `source` into `destination` and returns the transfer in flight.
///
/// `source` is a [`PinnedHostBuffer`] or a [`RegisteredBuffer`](crate::RegisteredBuffer); either
/// way the copy reads it when the device runs the copy, not at the call, and the handle owns it
/// until then.
///
/// The engine is borrowed only for the call: later work on the engine runs after the copy in
/// stream order, so the destination may be used by queued operations once the transfer is
/// [`Returned`]; the handle holds both until then.
///
/// # Errors
/// [`TransferSubmitError::Rejected`] (package untouched) for a length mismatch, a zero length or
/// a buffer or tensor of another engine; [`TransferSubmitError::Failed`] when the driver refuses
/// the copy; [`TransferSubmitError::Retained`] when the copy was queued but cannot be tracked.
pub fn upload_pending<T: Element, B: HostBuffer<T>>(
    engine: &mut CudaEngine,
    source: B,
    destination: DeviceTensor<T>,
) -> Result<PendingUpload<T, InFlight, B>, TransferSubmitError<T, B>> {
    submit::<Upload, T, B>(
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
/// `buffer` is a [`PinnedHostBuffer`] or a [`RegisteredBuffer`](crate::RegisteredBuffer); the
/// copy writes it when the device runs the copy, and the handle owns it until the copy is proven
/// complete.
///
/// # Errors
/// As [`upload_pending`], and [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) (rejected) for `bool`.
pub fn download_pending<T: Element, B: HostBuffer<T>>(
    engine: &mut CudaEngine,
    value: DeviceTensor<T>,
    buffer: B,
) -> Result<PendingDownload<T, InFlight, B>, TransferSubmitError<T, B>> {
    submit::<Download, T, B>(
        engine,
        TransferPackage {
            buffer,
            tensor: value,
        },
        None,
    )
}
