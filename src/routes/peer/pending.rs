//! The pending peer route: a device-to-device copy between two engines, an operation in flight.
//!
//! [`copy_pending`] takes a tensor of one engine and a tensor of another by value, queues the
//! copy on the destination engine's compute stream (after the source engine's work on the
//! source, on the device, unless that engine has proven it complete), records an event after it
//! and returns a [`Pending<PeerCopy<T>>`](Pending) in state [`InFlight`]. In that state it owns
//! both tensors and lends them only shared, for device work that reads them
//! ([`destination`](Pending::destination) on the destination engine, whose stream runs it after
//! the copy; [`source`](Pending::source) on the source engine, beside the copy), and nothing can
//! write or free either. [`wait`](Pending::wait) (or `.await`) proves the copy complete and
//! returns both in state [`Returned`].
//!
//! The exits are those of every operation in flight ([`crate::pending`]): a refused submission
//! hands both tensors back ([`SubmitError`]); dropping it in flight detaches it into the
//! retirement queue of the destination engine (whose stream carries the copy), which releases
//! both tensors once the event proves the copy complete; `mem::forget` leaks them; a wait that
//! fails retains them for that engine's lifetime.

// A refused submission hands both tensors back by value (see `lifecycle::pending`).
#![allow(clippy::result_large_err)]

use crate::core::engine::CudaEngine;
use crate::core::order::Use;
use crate::driver::Lane;
use crate::error::{Error, SetupError, SubmitError, UsageError};
use crate::lifecycle::fence::{Fenced, Fencing, IdleEvent, fence};
use crate::lifecycle::pending::{InFlight, Operation, Pending, Returned, sealed};
use crate::lifecycle::signal::Signal;
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;

/// What a peer copy owns: the tensor it reads, of the source engine, and the tensor it writes,
/// of the destination engine.
pub(crate) struct PeerPackage<T: Element> {
    source: DeviceTensor<T>,
    destination: DeviceTensor<T>,
}

/// What an in-flight peer copy holds: both tensors, and the signal of the source engine its copy
/// waited for on the device, if any (its completion is proven with the copy's).
pub struct InFlightPeer<T: Element> {
    package: PeerPackage<T>,
    waited_for: Option<Signal>,
}

/// Both tensors' bytes (each counted under its own engine's owners too).
impl<T: Element> crate::core::retire::Held for InFlightPeer<T> {
    fn held_bytes(&self) -> u64 {
        self.package.source.held_bytes() + self.package.destination.held_bytes()
    }
}

impl<T: Element> std::fmt::Debug for InFlightPeer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlightPeer")
            .field("dtype", &T::DTYPE)
            .finish_non_exhaustive()
    }
}

impl<T: Element> InFlightPeer<T> {
    /// The tensors, once the copy is proven complete: the signal it waited for is complete too,
    /// which the source engine records (its next copy of the source then needs no wait).
    fn landed(self) -> PeerPackage<T> {
        if let Some(signal) = &self.waited_for {
            signal.proven_complete();
        }
        self.package
    }
}

/// A returned peer copy's tensors, with its idle event kept for resubmission.
pub struct PeerLanded<T: Element> {
    package: PeerPackage<T>,
    event: IdleEvent,
}

impl<T: Element> std::fmt::Debug for PeerLanded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerLanded")
            .field("dtype", &T::DTYPE)
            .finish_non_exhaustive()
    }
}

/// The operation of [`copy_pending`]: a copy of one engine's tensor into another engine's,
/// device to device. Its [parts](Operation::Parts) are `(source, destination)`.
pub struct PeerCopy<T: Element>(PhantomData<fn() -> T>);

impl<T: Element> std::fmt::Debug for PeerCopy<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PeerCopy").field(&T::DTYPE).finish()
    }
}

impl<T: Element> sealed::Sealed for PeerCopy<T> {}

impl<T: Element> Operation for PeerCopy<T> {
    type Parts = (DeviceTensor<T>, DeviceTensor<T>);
    type Flight = Fenced<InFlightPeer<T>>;
    type Landed = PeerLanded<T>;
    const NAME: &'static str = "peer copy";

    fn land((held, event): (InFlightPeer<T>, IdleEvent)) -> PeerLanded<T> {
        PeerLanded {
            package: held.landed(),
            event,
        }
    }

    fn into_parts(landed: PeerLanded<T>) -> (DeviceTensor<T>, DeviceTensor<T>) {
        back(landed.package)
    }
}

fn back<T: Element>(package: PeerPackage<T>) -> (DeviceTensor<T>, DeviceTensor<T>) {
    (package.source, package.destination)
}

impl<T: Element> Pending<PeerCopy<T>, InFlight> {
    /// The destination tensor, for device work queued on the destination engine while the copy
    /// is in flight: the in-flight handoff.
    ///
    /// The copy runs on the destination engine's compute stream, and its write of the tensor is
    /// in that engine's order, so every operation queued there afterwards that uses the tensor (a
    /// kernel, a library call, a download on its own stream after an event wait, a further peer
    /// copy out of it) reads the data after it has landed, with no host wait. The borrow is
    /// shared: nothing can write the tensor or free it while the copy may still touch it, and
    /// the borrow ends before [`wait`](Pending::wait) can return it. Any other engine refuses the
    /// tensor ([`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine)).
    pub fn destination(&self) -> &DeviceTensor<T> {
        &self.hold.resources().package.destination
    }

    /// The source tensor, for device work on the source engine that reads it beside the copy
    /// (the borrow is shared: nothing can write or free it while the copy may still read it).
    pub fn source(&self) -> &DeviceTensor<T> {
        &self.hold.resources().package.source
    }
}

impl<T: Element> Pending<PeerCopy<T>, Returned> {
    /// The source tensor.
    pub fn source(&self) -> &DeviceTensor<T> {
        &self.hold.package.source
    }

    /// The destination tensor, now holding the source's values.
    pub fn destination(&self) -> &DeviceTensor<T> {
        &self.hold.package.destination
    }

    /// Queues the same copy again, between the same tensors, reusing the copy's event: for a
    /// loop that refreshes the destination from a source the source engine keeps rewriting
    /// (write it between [`into_parts`](Pending::into_parts) and a new submission instead when
    /// the source must change hands).
    ///
    /// # Errors
    /// As [`copy_pending`].
    pub fn resubmit(
        self,
        src_engine: &mut CudaEngine,
        dst_engine: &mut CudaEngine,
    ) -> Submitted<T> {
        let PeerLanded { package, event } = self.hold;
        submit(src_engine, package, dst_engine, Some(event))
    }
}

type Submitted<T> = Result<Pending<PeerCopy<T>>, SubmitError<(DeviceTensor<T>, DeviceTensor<T>)>>;

/// Why a submission of `package` from `src_engine` to `dst_engine` is refused, if it is.
fn refusal<T: Element>(
    src_engine: &mut CudaEngine,
    package: &PeerPackage<T>,
    dst_engine: &mut CudaEngine,
) -> Option<Error> {
    let (source, destination) = (&package.source, &package.destination);
    if let Err(error) = source
        .check_engine(src_engine)
        .and_then(|()| destination.check_engine(dst_engine))
    {
        return Some(error);
    }
    if source.is_empty() {
        return Some(Error::Usage(UsageError::ZeroLength {
            what: "a pending peer copy",
        }));
    }
    if source.len() != destination.len() {
        return Some(Error::Usage(UsageError::LengthMismatch {
            what: "peer::copy_pending: source for the destination",
            found: source.len(),
            shape: None,
            expected: destination.len(),
        }));
    }
    None
}

/// Validates and queues one peer copy on `dst_engine`'s compute stream. `event` is the copy's
/// own idle event on resubmission.
fn submit<T: Element>(
    src_engine: &mut CudaEngine,
    package: PeerPackage<T>,
    dst_engine: &mut CudaEngine,
    event: Option<IdleEvent>,
) -> Submitted<T> {
    if let Some(error) = refusal(src_engine, &package, dst_engine) {
        let input = back(package);
        return Err(SubmitError::Rejected { input, error });
    }
    match super::access(dst_engine, src_engine) {
        Ok(true) => {}
        Ok(false) => {
            return Err(SubmitError::Rejected {
                input: back(package),
                error: super::no_link(src_engine, dst_engine),
            });
        }
        Err(error @ Error::Setup(SetupError::Unreachable { .. })) => {
            return Err(SubmitError::Rejected {
                input: back(package),
                error,
            });
        }
        Err(error) => {
            return Err(SubmitError::Failed {
                input: back(package),
                error,
            });
        }
    }
    // The copy reads the source only once the source engine's work that writes it is done.
    let source = Use::Read(package.source.raw_ptr());
    let (src_ctx, waited_for) = match super::other_side(dst_engine, src_engine, source) {
        Ok(side) => side,
        Err(error) => {
            return Err(SubmitError::Failed {
                input: back(package),
                error,
            });
        }
    };
    let owner = &dst_engine.shared;
    let mut st = match owner.enter() {
        Ok(st) => st,
        Err(error) => {
            return Err(SubmitError::Failed {
                input: back(package),
                error,
            });
        }
    };
    let (dst, src) = (package.destination.raw_ptr(), package.source.raw_ptr());
    let dst_ctx = st.driver.context();
    // Recorded before the copy is queued: the destination engine's later uses of the tensor, on
    // any of its streams, and its free wait for the copy.
    if let Err(error) = st.order_uses(Lane::Compute, &[Use::Write(dst)]) {
        return Err(SubmitError::Failed {
            input: back(package),
            error,
        });
    }
    // From the copy's enqueue until the fence holds them, a panic (inside a driver call) leaks
    // both tensors: the source's engine knows nothing of the copy, so dropping it could free it
    // under the copy.
    let package = ManuallyDrop::new(package);
    // SAFETY: both tensors move into the fence below (or come back only once the stream is
    // proven idle), so neither is written or freed until the event proves the copy complete;
    // both hold exactly `byte_len` bytes (the lengths were checked equal); the source's writes
    // queued on its engine run first (`other_side`), and the destination's uses on its own
    // engine are ordered by the use recorded above.
    let queued = unsafe {
        st.driver.copy_peer(
            Lane::Compute,
            dst,
            dst_ctx,
            src,
            src_ctx,
            package.source.byte_len(),
        )
    };
    if let Err(source) = queued {
        let (src_id, from, to) = (
            src_engine.shared.engine_id,
            src_engine.device(),
            st.driver.device(),
        );
        let error = super::refused_copy(&mut st, src_id, from, to, source);
        // Nothing was queued: both tensors come back.
        let package = ManuallyDrop::into_inner(package);
        return Err(match error {
            // The link went away after the pair's first copy: refused as for a pair never
            // linked (the copy was not queued, and a wait for the source engine queued before it
            // only orders this engine's stream).
            error @ Error::Setup(SetupError::Unreachable { .. }) => SubmitError::Rejected {
                input: back(package),
                error,
            },
            error => SubmitError::Failed {
                input: back(package),
                error,
            },
        });
    }
    let event = event.map(IdleEvent::into_raw);
    // Moved from one holder to the other with no call in between: held throughout.
    let held = ManuallyDrop::new(InFlightPeer {
        package: ManuallyDrop::into_inner(package),
        waited_for,
    });
    let fencing = fence(&mut st, owner, Lane::Compute, held, event, "peer copy");
    // Released before anything the fencing hands back is dropped (a signal's drop takes its
    // engine's lock).
    drop(st);
    match fencing {
        Fencing::Fenced(hold) => Ok(Pending::in_flight(hold)),
        Fencing::Proven(held, error) => Err(SubmitError::Failed {
            input: back(held.landed()),
            error,
        }),
        Fencing::Untracked(untracked, error) => {
            untracked.retain();
            Err(SubmitError::Retained { error })
        }
    }
}

/// Queues a copy of `source`, a tensor of `src_engine`, into `destination`, a tensor of
/// `dst_engine` of the same length, and returns the copy in flight: it owns both tensors until
/// [`wait`](Pending::wait) proves the copy complete.
///
/// The copy runs on `dst_engine`'s compute stream (over the peer link, when the devices differ)
/// after the work queued on `src_engine` that writes `source` (a wait on the device, for
/// everything queued there so far, skipped when `src_engine` has proven that work complete), so
/// later work on `dst_engine` that reads [`destination`](Pending::destination) runs after it with
/// no host wait. Neither engine stays borrowed.
///
/// ```
/// # fn main() -> Result<(), cuferry::Error> {
/// use cuferry::sim::{SimConfig, SimDevice};
/// use cuferry::{download_tensor, peer, upload_tensor, CudaEngine};
/// # /*
/// let (mut gpu0, mut gpu1) = (CudaEngine::open(0)?, CudaEngine::open(1)?);
/// # */
/// # let machine = SimDevice::new(SimConfig { devices: 2, ..SimConfig::default() });
/// # let mut gpu0 = CudaEngine::simulated_on_device(&machine, 0)?;
/// # let mut gpu1 = CudaEngine::simulated_on_device(&machine, 1)?;
/// let x = upload_tensor(&mut gpu0, &[1.0f32, 2.0, 3.0], &[3])?;
/// let landing = gpu1.alloc_tensor::<f32>(&[3])?;
/// let copy = peer::copy_pending(&mut gpu0, x, &mut gpu1, landing)?;
/// // Queued on GPU 1 after the copy: no host wait in between.
/// let doubled = gpu1.scale(copy.destination(), 2.0)?;
/// assert_eq!(download_tensor(&mut gpu1, &doubled)?, [2.0, 4.0, 6.0]);
/// let (x, landing) = copy.wait()?.into_parts(); // complete already: stream order
/// # drop((x, landing));
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`SubmitError::Rejected`] (both tensors untouched) for a tensor of another engine than the
/// one named beside it, a zero length, a length mismatch, or devices that cannot reach each other
/// ([`SetupError::Unreachable`](crate::error::SetupError::Unreachable);
/// [`copy_staged`](super::copy_staged) copies through host memory);
/// [`SubmitError::Failed`] (both back) when the driver refuses a step before the copy is in
/// flight; [`SubmitError::Retained`] when the copy was queued but cannot be tracked.
pub fn copy_pending<T: Element>(
    src_engine: &mut CudaEngine,
    source: DeviceTensor<T>,
    dst_engine: &mut CudaEngine,
    destination: DeviceTensor<T>,
) -> Submitted<T> {
    let package = PeerPackage {
        source,
        destination,
    };
    submit(src_engine, package, dst_engine, None)
}
