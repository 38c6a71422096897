//! Operations in flight: one type, [`Pending<Op, S>`](crate::Pending), for everything the device
//! finishes later, whose state is a type.
//!
//! An operation takes what it works on by value (a host transfer its buffer and tensor, a peer
//! copy both tensors, a collective every rank's tensor), queues its work, records an event after
//! it, and returns a [`Pending`] in state [`InFlight`]. In that state nothing can reach what it
//! owns, except the device side it lends shared to the engine that carries the work (whose later
//! work is ordered after it on the device). The verbs are the same for every operation:
//!
//! - [`is_ready`](Pending::is_ready) asks, never waits, and takes no engine lock;
//! - [`wait`](Pending::wait) waits outside every engine lock and returns it in state
//!   [`Returned`];
//! - [`try_wait`](Pending::try_wait) returns it in state [`Returned`] if it is done, or hands the
//!   [`InFlight`] value back ([`TryWait`]);
//! - [`wait_for`](Pending::wait_for) waits at most a `Duration` (`Duration::MAX`: no bound) and
//!   answers as [`try_wait`](Pending::try_wait) does;
//! - `.await` on any executor ([`PendingFuture`]), woken by the device, never by polling;
//! - dropping it in flight detaches it into the carrying engine's retirement queue, which
//!   releases what it owns once the event proves the work complete; `mem::forget` leaks it,
//!   which is sound;
//! - once [`Returned`], [`into_parts`](Pending::into_parts) gives everything back, and where the
//!   operation allows, `resubmit` queues the same work again with the same event, allocating
//!   nothing.
//!
//! The operations are the types `Op` names ([`Operation`], sealed): [`Upload`](crate::pending::Upload) and [`Download`](crate::pending::Download)
//! (the host routes [`upload_pending`](crate::upload_pending) and
//! [`download_pending`](crate::download_pending)), [`PeerCopy`](crate::peer::PeerCopy)
//! ([`peer::copy_pending`](crate::peer::copy_pending)) and
//! [`Collective`](crate::collective::Collective)
//! ([`CollectiveGroup::submit`](crate::collective::CollectiveGroup::submit)), and on Linux what
//! sharing between processes hands back later: `share::Loan` (`Importer::lend`),
//! `share::Reclaim` (`Exported::reclaim`) and `share::Departure` (`Importer::departure`), whose
//! completion the importers prove (a release counted by the connection's reader) rather than an
//! event, and which own no device work to detach on drop. A submission that does not go in
//! flight is a [`SubmitError`](crate::SubmitError), which hands back what it can.
//!
//! The module exists so that the lifecycle is written once: each operation says only what it
//! owns and how its completion is proven (one fence, or one per rank); the typestate, the waits,
//! the future and the detach are generic, monomorphised, and add no lock, allocation or dynamic
//! call to the operation's own path.

use crate::error::Result;
use crate::lifecycle::fence::{Fenced, IdleEvent};
use crate::lifecycle::fence_future::FenceFuture;
use crate::sync::deadline::Deadline;
use std::fmt;
use std::task::{Context, Poll};
use std::time::Duration;

mod future;

pub use future::PendingFuture;

pub(crate) mod sealed {
    /// Only the crate's operations and states.
    pub trait Sealed {}
}

pub(crate) mod flight {
    use crate::error::Result;
    use crate::sync::deadline::Deadline;
    use std::task::{Context, Poll};

    /// How an operation's completion is proven: one fence, or one per rank.
    pub trait Flight: Send + Sync + Sized + 'static {
        /// What a proof gives back.
        type Done;
        /// The state of an `.await`.
        type Poller: Send + Unpin;
        /// Whether the work has completed. Never waits.
        fn is_ready(&self) -> Result<bool>;
        /// Waits for the work, outside every engine lock.
        fn wait(self) -> Result<Self::Done>;
        /// The proof if the work has completed, or `self` back. Never waits.
        fn try_wait(self) -> Result<std::result::Result<Self::Done, Self>>;
        /// Waits for the work until `deadline` (never [`Deadline::never`]: that is
        /// [`wait`](Self::wait)), outside every engine lock: the proof, or `self` back once
        /// the deadline has passed.
        fn wait_until(self, deadline: Deadline) -> Result<std::result::Result<Self::Done, Self>>;
        /// Starts an `.await`.
        fn poller(self) -> Self::Poller;
        /// Polls an `.await`; not called again once it has resolved.
        fn poll(poller: &mut Self::Poller, cx: &mut Context<'_>) -> Poll<Result<Self::Done>>;
    }
}

use flight::Flight;

impl<R: Send + Sync + 'static> Flight for Fenced<R> {
    type Done = (R, IdleEvent);
    type Poller = FenceFuture<R>;

    fn is_ready(&self) -> Result<bool> {
        Fenced::is_ready(self)
    }

    fn wait(self) -> Result<(R, IdleEvent)> {
        self.wait_parts()
    }

    fn try_wait(self) -> Result<std::result::Result<(R, IdleEvent), Self>> {
        Fenced::try_wait(self)
    }

    fn wait_until(self, deadline: Deadline) -> Result<std::result::Result<(R, IdleEvent), Self>> {
        // One bounded event wait: its `Ok(true)` makes the query below answer done.
        let left = deadline.remaining().unwrap_or(Duration::MAX);
        if !left.is_zero() && !self.wait_within(left)? {
            return Ok(Err(self));
        }
        Fenced::try_wait(self)
    }

    fn poller(self) -> FenceFuture<R> {
        FenceFuture::new(self)
    }

    fn poll(poller: &mut FenceFuture<R>, cx: &mut Context<'_>) -> Poll<Result<(R, IdleEvent)>> {
        poller.poll(cx)
    }
}

/// An operation the device finishes later: what a [`Pending`] owns and how it is proven
/// complete. Sealed: [`Upload`](crate::pending::Upload), [`Download`](crate::pending::Download), [`PeerCopy`](crate::peer::PeerCopy),
/// [`Collective`](crate::collective::Collective), and (Linux) `share::Loan`, `share::Reclaim`
/// and `share::Departure`.
pub trait Operation: sealed::Sealed + Sized + 'static {
    /// What the operation owns and gives back: by [`Pending::into_parts`] once returned, and by
    /// a refused submission ([`SubmitError`](crate::SubmitError)).
    type Parts;
    #[doc(hidden)]
    type Flight: Flight;
    #[doc(hidden)]
    type Landed: Send + Sync;
    #[doc(hidden)]
    const NAME: &'static str;
    #[doc(hidden)]
    fn land(done: <Self::Flight as Flight>::Done) -> Self::Landed;
    #[doc(hidden)]
    fn into_parts(landed: Self::Landed) -> Self::Parts;
}

/// The state of a [`Pending`] operation. Sealed: [`InFlight`] or [`Returned`].
pub trait State: sealed::Sealed + 'static {
    #[doc(hidden)]
    type Hold<Op: Operation>: Send + Sync;
    #[doc(hidden)]
    const IN_FLIGHT: bool;
}

/// State: the device may still be working; nothing is reachable but the device side, lent
/// shared to the engine that carries the work.
#[derive(Debug)]
pub enum InFlight {}

/// State: the work is proven complete; everything the operation owns is reachable.
#[derive(Debug)]
pub enum Returned {}

impl sealed::Sealed for InFlight {}
impl sealed::Sealed for Returned {}

impl State for InFlight {
    type Hold<Op: Operation> = Op::Flight;
    const IN_FLIGHT: bool = true;
}

impl State for Returned {
    type Hold<Op: Operation> = Op::Landed;
    const IN_FLIGHT: bool = false;
}

/// An operation `Op` the device finishes later, in state `S`: [`InFlight`] until a proof makes
/// it [`Returned`]. See [the module](crate::pending) for the verbs every operation has.
///
/// ```
/// # use cuferry::sim::SimConfig;
/// use cuferry::pending::{InFlight, Upload};
/// use cuferry::{upload_pending, CudaEngine, Pending, PinnedHostBuffer};
/// # let mut engine = CudaEngine::simulated(SimConfig::default());
/// let source = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0, 3.0])?;
/// let destination = engine.alloc_tensor::<f32>(&[3])?;
/// let upload: Pending<Upload<f32>, InFlight> = upload_pending(&mut engine, source, destination)?;
/// let (buffer, tensor) = upload.wait()?.into_parts();
/// # drop((buffer, tensor));
/// # Ok::<(), cuferry::Error>(())
/// ```
#[must_use = "an operation in flight owns what it works on: wait for it (in flight) or take it back with `into_parts` (returned)"]
pub struct Pending<Op: Operation, S: State = InFlight> {
    pub(crate) hold: S::Hold<Op>,
}

impl<Op: Operation, S: State> fmt::Debug for Pending<Op, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("operation", &Op::NAME)
            .field("in_flight", &S::IN_FLIGHT)
            .finish()
    }
}

/// What [`Pending::try_wait`] found.
#[must_use]
pub enum TryWait<Op: Operation> {
    /// The work completed.
    Returned(Pending<Op, Returned>),
    /// Not yet: the operation comes back unchanged.
    InFlight(Pending<Op, InFlight>),
}

impl<Op: Operation> fmt::Debug for TryWait<Op> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TryWait::Returned(p) => f.debug_tuple("Returned").field(p).finish(),
            TryWait::InFlight(p) => f.debug_tuple("InFlight").field(p).finish(),
        }
    }
}

impl<Op: Operation> Pending<Op, InFlight> {
    pub(crate) fn in_flight(hold: Op::Flight) -> Self {
        Pending { hold }
    }

    /// Whether the work has completed. Never waits, and takes no engine lock.
    ///
    /// `Ok(false)` means not yet; work can complete before the first poll, so `Ok(true)` at once
    /// is not an error.
    ///
    /// # Errors
    /// [`Error::DeviceFault`](crate::Error::DeviceFault) when the device reports a failure of the
    /// work (or of earlier work on the stream that carries it).
    pub fn is_ready(&mut self) -> Result<bool> {
        self.hold.is_ready()
    }

    /// Waits for the work and returns the operation in state [`Returned`]. The wait holds no
    /// engine lock: the engines' owners keep working while another thread waits here.
    ///
    /// # Errors
    /// [`Error::DeviceFault`](crate::Error::DeviceFault) when the device reports a failure: what
    /// the failed work may still touch is then retained by its engine for the engine's lifetime,
    /// never freed.
    pub fn wait(self) -> Result<Pending<Op, Returned>> {
        let done = self.hold.wait()?;
        Ok(Pending {
            hold: Op::land(done),
        })
    }

    /// Returns the operation in state [`Returned`] if the work has completed, or hands the
    /// [`InFlight`] value back if not. Never waits.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn try_wait(self) -> Result<TryWait<Op>> {
        Ok(match self.hold.try_wait()? {
            Ok(done) => TryWait::Returned(Pending {
                hold: Op::land(done),
            }),
            Err(hold) => TryWait::InFlight(Pending { hold }),
        })
    }

    /// Waits at most about `within` for the work: the operation in state [`Returned`] if it
    /// completes in time, else the [`InFlight`] value back ([`TryWait`], as
    /// [`try_wait`](Self::try_wait)). The wait holds no engine lock. `Duration::ZERO` is
    /// [`try_wait`](Self::try_wait); a `within` too large for an instant (`Duration::MAX`
    /// among them) is no bound, [`wait`](Self::wait).
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_for(self, within: Duration) -> Result<TryWait<Op>> {
        let deadline = Deadline::after(within);
        if deadline == Deadline::never() {
            return self.wait().map(TryWait::Returned);
        }
        Ok(match self.hold.wait_until(deadline)? {
            Ok(done) => TryWait::Returned(Pending {
                hold: Op::land(done),
            }),
            Err(hold) => TryWait::InFlight(Pending { hold }),
        })
    }
}

impl<Op: Operation> Pending<Op, Returned> {
    /// Gives back everything the operation owned ([`Operation::Parts`]).
    pub fn into_parts(self) -> Op::Parts {
        Op::into_parts(self.hold)
    }
}
