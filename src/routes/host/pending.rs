//! The host operations in flight: [`Upload`] and [`Download`], between a page-locked host buffer
//! and a device tensor, handed over by value.
//!
//! [`upload_pending`] and [`download_pending`] take a host buffer (a [`PinnedHostBuffer`] or a
//! [`RegisteredBuffer`](crate::RegisteredBuffer), anything that is a [`HostBuffer`]) and a
//! [`DeviceTensor`] by value, queue one copy on the engine's upload or download stream, record an
//! event after it, and return a [`Pending`] in state [`InFlight`]. In that state nothing can
//! reach the buffer; the tensor is lent shared ([`Pending::tensor`]) to work on the same engine,
//! which runs after the copy. The [`Returned`] state gives both back, and can resubmit the same
//! pair without allocating anything.
//!
//! Both kinds of buffer go through the same lifecycle, refusals, detach-on-drop and retention:
//! the routes are written once over the sealed [`HostBuffer`] trait, whose type is the last
//! parameter of [`Upload`] and [`Download`], defaulting to [`PinnedHostBuffer`].

// A refused submission hands the whole package back by value, as `TrySendError<T>` does; the
// error is large by design and travels only on the refusal path.
#![allow(clippy::result_large_err)]

use crate::core::engine::CudaEngine;
use crate::error::{Error, SubmitError, UsageError};
use crate::lifecycle::fence::{Fenced, Fencing, IdleEvent, fence};
use crate::lifecycle::pending::{InFlight, Operation, Pending, Returned, sealed};
use crate::memory::element::Element;
use crate::memory::host::HostBuffer;
use crate::memory::pinned::PinnedHostBuffer;
use crate::memory::tensor::DeviceTensor;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;

/// The operation of [`upload_pending`]: a copy from a page-locked host buffer `B` (a
/// [`PinnedHostBuffer`] unless `B` says otherwise) into a [`DeviceTensor`]. Its
/// [parts](Operation::Parts) are `(B, DeviceTensor<T>)`: source first, in the order
/// [`upload_pending`] takes them.
pub struct Upload<T: Element, B: HostBuffer<T> = PinnedHostBuffer<T>>(PhantomData<fn() -> (T, B)>);

impl<T: Element, B: HostBuffer<T>> std::fmt::Debug for Upload<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Upload")
            .field(&T::DTYPE)
            .field(&B::KIND)
            .finish()
    }
}

/// The operation of [`download_pending`]: a copy from a [`DeviceTensor`] into a page-locked host
/// buffer `B` (a [`PinnedHostBuffer`] unless `B` says otherwise). Its
/// [parts](Operation::Parts) are `(DeviceTensor<T>, B)`: source first, in the order
/// [`download_pending`] takes them.
pub struct Download<T: Element, B: HostBuffer<T> = PinnedHostBuffer<T>>(
    PhantomData<fn() -> (T, B)>,
);

impl<T: Element, B: HostBuffer<T>> std::fmt::Debug for Download<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Download")
            .field(&T::DTYPE)
            .field(&B::KIND)
            .finish()
    }
}

/// What a host transfer owns: the host buffer and the device tensor.
pub struct TransferPackage<T: Element, B: HostBuffer<T>> {
    pub(crate) buffer: B,
    pub(crate) tensor: DeviceTensor<T>,
}

/// The tensor's bytes and the host buffer's page-locked bytes.
impl<T: Element, B: HostBuffer<T>> crate::core::retire::Held for TransferPackage<T, B> {
    fn held_bytes(&self) -> u64 {
        self.tensor.held_bytes() + self.buffer.page_locked_bytes()
    }
}

impl<T: Element, B: HostBuffer<T>> std::fmt::Debug for TransferPackage<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferPackage")
            .field("dtype", &T::DTYPE)
            .field("host", &B::KIND)
            .finish_non_exhaustive()
    }
}

/// A returned transfer's parts, with its idle event kept for resubmission.
pub struct Landed<T: Element, B: HostBuffer<T>> {
    package: TransferPackage<T, B>,
    event: IdleEvent,
}

impl<T: Element, B: HostBuffer<T>> std::fmt::Debug for Landed<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Landed")
            .field("dtype", &T::DTYPE)
            .field("host", &B::KIND)
            .finish_non_exhaustive()
    }
}

/// The direction of a host transfer: what the shared code asks of [`Upload`] and [`Download`].
trait Direction<T: Element, B: HostBuffer<T>>:
    Operation<Flight = Fenced<TransferPackage<T, B>>, Landed = Landed<T, B>>
{
    /// Whether the copy goes host to device.
    const UPLOAD: bool;
    /// The route and its direction, as refusals name them.
    const ROUTE: &'static str;
    /// What the route was given, in the order it took it: source first.
    fn parts(package: TransferPackage<T, B>) -> Self::Parts;
    /// How a refusal names the buffer's count for the tensor's.
    const BUFFER: &'static str;
    /// How a refusal names the tensor.
    const TENSOR: &'static str;
    /// How a refusal names the buffer.
    const HOST: &'static str;
}

macro_rules! transfer_operation {
    ($op:ident, $upload:expr_2021, $name:expr_2021, $route:literal, |$p:ident| $parts:expr, ($($ty:ty),*)) => {
        impl<T: Element, B: HostBuffer<T>> sealed::Sealed for $op<T, B> {}

        impl<T: Element, B: HostBuffer<T>> Operation for $op<T, B> {
            type Parts = ($($ty),*);
            type Flight = Fenced<TransferPackage<T, B>>;
            type Landed = Landed<T, B>;
            const NAME: &'static str = $name;

            fn land((package, event): (TransferPackage<T, B>, IdleEvent)) -> Landed<T, B> {
                Landed { package, event }
            }

            fn into_parts(landed: Landed<T, B>) -> ($($ty),*) {
                <Self as Direction<T, B>>::parts(landed.package)
            }
        }

        impl<T: Element, B: HostBuffer<T>> Direction<T, B> for $op<T, B> {
            const UPLOAD: bool = $upload;
            const ROUTE: &'static str = $route;
            const BUFFER: &'static str = concat!($route, ": buffer for the tensor");
            const TENSOR: &'static str = concat!($route, ": the tensor");
            const HOST: &'static str = concat!($route, ": the buffer");

            fn parts($p: TransferPackage<T, B>) -> ($($ty),*) {
                $parts
            }
        }

        impl<T: Element, B: HostBuffer<T>> Pending<$op<T, B>, InFlight> {
            /// The device tensor, for device work queued on this engine while the copy is in
            /// flight: the in-flight handoff.
            ///
            /// The copy's use of the tensor is in the engine's order, so every operation of this
            /// engine queued after the copy that uses the tensor runs after it, on whichever of
            /// the engine's three streams it goes (after an event wait on the device where that
            /// is not the copy's): a kernel, a library call, a device copy, a blocking or pending
            /// download, a prepared program given this tensor reads an upload's destination only
            /// after the data has landed, with no host wait in between. For a download, the
            /// tensor is its source, and other work may read it alongside the copy. The borrow is
            /// shared, so nothing can write the tensor, free it or move it while the copy may
            /// still touch it, and it ends before [`wait`](Pending::wait) (which consumes the
            /// value) can return the transfer. The host buffer stays unreachable until then.
            ///
            /// Only the engine that queued the copy accepts the tensor: another engine refuses it
            /// with [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine), as it refuses any tensor it does not own. A CubeCL
            /// import (`cubecl::Scope::import`, feature `cubecl`) queues its copy on this
            /// engine's compute stream, ordered after the upload, and waits for it on the host,
            /// so it too reads the data after it has landed.
            ///
            /// ```
            /// # use cuferry::sim::SimConfig;
            /// # use cuferry::{download_pending, upload_pending, CudaEngine, PinnedHostBuffer};
            /// # let mut engine = CudaEngine::simulated(SimConfig::default());
            /// let source = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0, 3.0])?;
            /// let destination = engine.alloc_tensor::<f32>(&[3])?;
            /// let upload = upload_pending(&mut engine, source, destination)?;
            /// // Ordered after the copy by an event wait on the device: no host wait.
            /// let doubled = engine.add(upload.tensor(), upload.tensor())?;
            /// let buffer = PinnedHostBuffer::<f32>::new(&mut engine, 3)?;
            /// let download = download_pending(&mut engine, doubled, buffer)?;
            /// let download = download.wait()?; // the one host wait
            /// assert_eq!(download.buffer().as_slice(), &[2.0, 4.0, 6.0]);
            /// let _upload = upload.wait()?; // already complete: the kernel that read it waited
            /// # Ok::<(), cuferry::Error>(())
            /// ```
            pub fn tensor(&self) -> &DeviceTensor<T> {
                &self.hold.resources().tensor
            }
        }

        impl<T: Element, B: HostBuffer<T>> Pending<$op<T, B>, Returned> {
            /// The host buffer: for a download, the data that arrived.
            pub fn buffer(&self) -> &B {
                &self.hold.package.buffer
            }

            /// The host buffer, mutably: refill it before [`resubmit`](Self::resubmit)ting an
            /// upload.
            pub fn buffer_mut(&mut self) -> &mut B {
                &mut self.hold.package.buffer
            }

            /// The device tensor: for an upload, the destination now holding the data.
            pub fn tensor(&self) -> &DeviceTensor<T> {
                &self.hold.package.tensor
            }

            /// Queues the same copy again, between the same buffer and tensor, reusing the
            /// transfer's event: nothing is allocated. For streaming loops: refill the buffer
            /// through [`buffer_mut`](Self::buffer_mut) and resubmit an upload, or resubmit a
            /// download to read the tensor again.
            ///
            /// # Errors
            /// As [`upload_pending`] and [`download_pending`].
            pub fn resubmit(
                self,
                engine: &mut CudaEngine,
            ) -> Result<Pending<$op<T, B>, InFlight>, SubmitError<($($ty),*)>> {
                let Landed { package, event } = self.hold;
                submit::<$op<T, B>, T, B>(engine, package, Some(event))
            }
        }
    };
}

transfer_operation!(
    Upload,
    true,
    "pending upload",
    "upload_pending (host to device)",
    |p| (p.buffer, p.tensor),
    (B, DeviceTensor<T>)
);
transfer_operation!(
    Download,
    false,
    "pending download",
    "download_pending (device to host)",
    |p| (p.tensor, p.buffer),
    (DeviceTensor<T>, B)
);

/// Why a submission of `package` is refused, if it is.
fn refusal<D: Direction<T, B>, T: Element, B: HostBuffer<T>>(
    engine: &CudaEngine,
    package: &TransferPackage<T, B>,
) -> Option<Error> {
    let (buffer_len, tensor_len) = (package.buffer.host_len(), package.tensor.len());
    let (buffer_device, buffer_engine) = package.buffer.host_engine();
    // Which value is another engine's, named with the route.
    let naming = |value: &'static str| {
        move |mut error: Error| {
            if let Error::Usage(UsageError::WrongEngine { what, .. }) = &mut error {
                *what = value;
            }
            error
        }
    };
    if let Err(error) = engine
        .shared
        .check(package.tensor.owner())
        .map_err(naming(D::TENSOR))
        .and_then(|()| {
            engine
                .shared
                .check_owner(buffer_device, buffer_engine)
                .map_err(naming(D::HOST))
        })
    {
        return Some(error);
    }
    if tensor_len == 0 {
        return Some(Error::Usage(UsageError::ZeroLength { what: D::TENSOR }));
    }
    if buffer_len != tensor_len {
        return Some(Error::Usage(UsageError::LengthMismatch {
            what: D::BUFFER,
            found: buffer_len,
            shape: Some(package.tensor.shape().to_vec()),
            expected: tensor_len,
        }));
    }
    if !D::UPLOAD && !T::DTYPE.any_bit_pattern() {
        return Some(Error::Usage(UsageError::UnsupportedElement {
            operation: D::ROUTE,
            dtype: T::DTYPE,
            reason: "raw device bytes need not be 0 or 1, and a host buffer exposes them as they are",
        }));
    }
    None
}

type Submitted<D> = Result<Pending<D, InFlight>, SubmitError<<D as Operation>::Parts>>;

/// Validates and queues one copy. `event` is the transfer's own idle event on resubmission; on a
/// refusal it goes back to the engine that made it.
fn submit<D: Direction<T, B>, T: Element, B: HostBuffer<T>>(
    engine: &mut CudaEngine,
    package: TransferPackage<T, B>,
    event: Option<IdleEvent>,
) -> Submitted<D> {
    let back = D::parts;
    if let Some(error) = refusal::<D, T, B>(engine, &package) {
        let input = back(package);
        return Err(SubmitError::Rejected { input, error });
    }
    let owner = &engine.shared;
    let mut st = match owner.enter() {
        Ok(st) => st,
        Err(error) => {
            let input = back(package);
            return Err(SubmitError::Failed { input, error });
        }
    };
    let bytes = package.tensor.byte_len();
    let host = package.buffer.host_ptr();
    let device = package.tensor.raw_ptr();
    // From the enqueue until the fence holds it, a panic inside a driver call leaks the package:
    // dropped, its buffer would go back to the pool under the queued copy.
    let package = ManuallyDrop::new(package);
    // SAFETY: the buffer and tensor move into the fence below (or come back only once the stream
    // is proven idle), untouched by the host until the event proves the copy complete (the host
    // cannot read the buffer before the operation is `Returned`); both hold exactly `bytes`
    // bytes (the lengths were checked equal), both belong to this engine, and the buffer's memory
    // is page-locked for as long as the buffer lives (`HostBuffer`'s promise), so it stays valid
    // until the fence releases it.
    let lane = match unsafe { st.queue_host_copy(D::UPLOAD, device, device, host, bytes) } {
        Ok(lane) => lane,
        Err(error) => {
            // Nothing was queued: the package comes back untouched.
            let input = back(ManuallyDrop::into_inner(package));
            return Err(SubmitError::Failed { input, error });
        }
    };
    let event = event.map(IdleEvent::into_raw);
    match fence(&mut st, owner, lane, package, event, D::NAME) {
        Fencing::Fenced(fenced) => Ok(Pending::in_flight(fenced)),
        Fencing::Proven(package, error) => Err(SubmitError::Failed {
            input: back(package),
            error,
        }),
        Fencing::Untracked(untracked, error) => {
            drop(st);
            untracked.retain();
            Err(SubmitError::Retained { error })
        }
    }
}

/// Queues a copy of `source` into `destination` and returns the transfer in flight.
///
/// `source` is a [`PinnedHostBuffer`] or a [`RegisteredBuffer`](crate::RegisteredBuffer); either
/// way the copy reads it when the device runs the copy, not at the call, and the operation owns
/// it until then.
///
/// The engine is borrowed only for the call: later work on the engine that uses the destination
/// ([`Pending::tensor`]) runs after the copy, ordered on the device; the operation holds both
/// until it is [`Returned`].
///
/// # Errors
/// [`SubmitError::Rejected`] (both back, untouched, as `(buffer, tensor)`) for a length mismatch
/// (naming the route, its direction and the tensor's shape), a zero length or a buffer or tensor
/// of another engine (naming which); [`SubmitError::Failed`] (both back) when the driver
/// refuses the copy; [`SubmitError::Retained`] when the copy was queued but cannot be tracked.
// The full type is the documentation: what goes in flight, and what a refusal hands back.
#[allow(clippy::type_complexity)]
pub fn upload_pending<T: Element, B: HostBuffer<T>>(
    engine: &mut CudaEngine,
    source: B,
    destination: DeviceTensor<T>,
) -> Result<Pending<Upload<T, B>>, SubmitError<(B, DeviceTensor<T>)>> {
    let package = TransferPackage {
        buffer: source,
        tensor: destination,
    };
    submit::<Upload<T, B>, T, B>(engine, package, None)
}

/// Queues a copy of `source` into `destination` and returns the transfer in flight.
///
/// `destination` is a [`PinnedHostBuffer`] or a [`RegisteredBuffer`](crate::RegisteredBuffer);
/// the copy writes it when the device runs the copy, and the operation owns it until the copy
/// is proven complete. Its [parts](Operation::Parts), and a refusal's input, come back in the
/// order the call takes them, source first: `(tensor, buffer)`.
///
/// # Errors
/// As [`upload_pending`], and
/// [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) (rejected)
/// for `bool`.
// The full type is the documentation: what goes in flight, and what a refusal hands back.
#[allow(clippy::type_complexity)]
pub fn download_pending<T: Element, B: HostBuffer<T>>(
    engine: &mut CudaEngine,
    source: DeviceTensor<T>,
    destination: B,
) -> Result<Pending<Download<T, B>>, SubmitError<(DeviceTensor<T>, B)>> {
    let package = TransferPackage {
        buffer: destination,
        tensor: source,
    };
    submit::<Download<T, B>, T, B>(engine, package, None)
}
