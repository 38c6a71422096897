//! A collective in flight, tensor by tensor: its parts, their proof and their `.await`, and,
//! for ranks in other processes, the watch on the communicator's health and deadline that
//! every wait keeps.
//!
//! A collective of [joined](super::Communicator::join) ranks can wait for ever: a peer that
//! died, hangs or never queues its part leaves this rank's part spinning on the device, and its
//! event never completes. So every wait on one ([`is_ready`](Flight::is_ready),
//! [`wait`](Flight::wait), [`try_wait`](Flight::try_wait), `.await`) also asks the
//! communicator's asynchronous state (`ncclCommGetAsyncError`) and the collective's deadline,
//! at least every [`WATCH_PERIOD`]. A failure or a deadline passed aborts the communicator
//! (`ncclCommAbort`), which ends the part on the device, and the wait returns
//! [`PeerError`](crate::error::PeerError); the collective's tensors then detach into their engines' retirement
//! queues, released once each engine's event proves the ended part complete, as for any
//! operation dropped in flight. A collective whose events complete after its communicator was
//! aborted reports [`PeerError::Aborted`] too: its results are void.

use super::{Comms, Plan};
use crate::error::{Error, PeerError, Result};
use crate::lifecycle::fence::{Fenced, IdleEvent};
use crate::lifecycle::fence_future::FenceFuture;
use crate::lifecycle::pending::flight::Flight;
use crate::lifecycle::timer;
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use crate::sync::deadline::Deadline;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// How often a wait on a collective of joined ranks asks the communicator's health while its
/// part is not done.
const WATCH_PERIOD: Duration = Duration::from_millis(10);

/// A tensor of a collective in flight: fenced on its engine, or proven complete already (where
/// the event could not be recorded but a synchronize proved the work done).
pub(super) enum Part<T: Element> {
    Fenced(Fenced<(DeviceTensor<T>, Arc<Comms>)>),
    Done(DeviceTensor<T>),
}

/// What a collective in flight holds: every tensor's part, in the order given, and what a
/// resubmission and the watch need.
pub struct Ranks<T: Element> {
    pub(super) parts: Vec<Part<T>>,
    pub(super) comms: Arc<Comms>,
    pub(super) plan: Arc<Plan>,
    pub(super) timeout: Duration,
    /// When a wait on a watched communicator gives up (none for a timeout of
    /// `Duration::MAX`).
    pub(super) deadline: Deadline,
}

impl<T: Element> std::fmt::Debug for Ranks<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ranks")
            .field("dtype", &T::DTYPE)
            .finish_non_exhaustive()
    }
}

/// A returned collective: every tensor, in the order given, with its idle event (where it had
/// one) kept for resubmission.
pub struct RanksLanded<T: Element> {
    pub(super) tensors: Vec<DeviceTensor<T>>,
    pub(super) events: Vec<Option<IdleEvent>>,
    pub(super) comms: Arc<Comms>,
    pub(super) plan: Arc<Plan>,
    pub(super) timeout: Duration,
}

impl<T: Element> std::fmt::Debug for RanksLanded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RanksLanded")
            .field("dtype", &T::DTYPE)
            .finish_non_exhaustive()
    }
}

impl<T: Element> RanksLanded<T> {
    fn push(&mut self, tensor: DeviceTensor<T>, event: Option<IdleEvent>) {
        self.tensors.push(tensor);
        self.events.push(event);
    }
}

/// The watch of a collective: its communicator and deadline.
#[derive(Clone)]
struct Watch {
    comms: Arc<Comms>,
    timeout: Duration,
    deadline: Deadline,
}

impl Watch {
    /// Whether the communicator's waits are watched at all (ranks in other processes).
    fn active(&self) -> bool {
        self.comms.seam.watched()
    }

    /// `Err` (after aborting the communicator) when it failed or was aborted: for work found
    /// complete, whose results an abort voids.
    fn health(&self) -> Result<()> {
        if !self.active() {
            return Ok(());
        }
        let (rank, world) = (self.comms.first_rank, self.comms.world);
        if let Err(error) = self.comms.seam.health() {
            self.comms.seam.abort();
            return Err(match error {
                Error::Peer(peer) => Error::Peer(peer),
                other => PeerError::CommunicatorFailed {
                    rank,
                    world,
                    reason: other.to_string(),
                }
                .into(),
            });
        }
        Ok(())
    }

    /// As [`health`](Self::health), and `Err` (after aborting the communicator) when the
    /// deadline passed: for work found not complete.
    fn check(&self) -> Result<()> {
        self.health()?;
        if self.active() && self.deadline.expired() {
            let (rank, world) = (self.comms.first_rank, self.comms.world);
            self.comms.seam.abort();
            return Err(PeerError::CollectiveTimedOut {
                rank,
                world,
                timeout: self.timeout,
            }
            .into());
        }
        Ok(())
    }

    /// How long a wait may block before it checks again: at most [`WATCH_PERIOD`], zero once
    /// the deadline has passed.
    fn slice(&self) -> Duration {
        self.deadline.slice(WATCH_PERIOD).unwrap_or(Duration::ZERO)
    }

    /// Blocks until `fenced`'s work completes (`Ok`), or its wait reports a failure or the
    /// watch fails (`Err`: the caller drops the parts, which detach into their engines'
    /// queues, released only once proven complete).
    fn wait_for<R: Send + 'static>(&self, fenced: &Fenced<R>) -> Result<()> {
        loop {
            if fenced.wait_within(self.slice())? {
                return Ok(());
            }
            self.check()?;
        }
    }
}

impl<T: Element> Ranks<T> {
    fn watch(&self) -> Watch {
        Watch {
            comms: Arc::clone(&self.comms),
            timeout: self.timeout,
            deadline: self.deadline,
        }
    }

    fn landed(&self) -> RanksLanded<T> {
        RanksLanded {
            tensors: Vec::with_capacity(self.parts.len()),
            events: Vec::with_capacity(self.parts.len()),
            comms: Arc::clone(&self.comms),
            plan: Arc::clone(&self.plan),
            timeout: self.timeout,
        }
    }

    /// Waits for every part, each proven complete by its event; `Err` (the parts not yet
    /// taken detach as they drop; a failing part's tensor is retained) on the first failure.
    fn take_all(self) -> Result<RanksLanded<T>> {
        let mut landed = self.landed();
        for part in self.parts {
            match part {
                Part::Done(tensor) => landed.push(tensor, None),
                Part::Fenced(fenced) => {
                    let ((tensor, _comms), event) = fenced.wait_parts()?;
                    landed.push(tensor, Some(event));
                }
            }
        }
        Ok(landed)
    }
}

impl<T: Element> Flight for Ranks<T> {
    type Done = RanksLanded<T>;
    type Poller = RanksFuture<T>;

    fn is_ready(&self) -> Result<bool> {
        let watch = self.watch();
        for part in &self.parts {
            if let Part::Fenced(fenced) = part
                && !fenced.is_ready()?
            {
                watch.check()?;
                return Ok(false);
            }
        }
        watch.health()?;
        Ok(true)
    }

    fn wait(self) -> Result<RanksLanded<T>> {
        let watch = self.watch();
        if watch.active() {
            for part in &self.parts {
                if let Part::Fenced(fenced) = part {
                    watch.wait_for(fenced)?;
                }
            }
            // Complete: unless the communicator was aborted meanwhile, which voids the results.
            watch.health()?;
        }
        self.take_all()
    }

    fn try_wait(self) -> Result<std::result::Result<RanksLanded<T>, Self>> {
        let watch = self.watch();
        for part in &self.parts {
            if let Part::Fenced(fenced) = part {
                match fenced.is_ready() {
                    Ok(true) => {}
                    Ok(false) => {
                        watch.check()?;
                        return Ok(Err(self));
                    }
                    // The wait below settles the failure: the failing tensor is retained.
                    Err(_) => break,
                }
            }
        }
        // Every part is done (or one failed): the waits return at once.
        watch.health()?;
        self.take_all().map(Ok)
    }

    fn wait_until(self, deadline: Deadline) -> Result<std::result::Result<RanksLanded<T>, Self>> {
        let watch = self.watch();
        for part in &self.parts {
            if let Part::Fenced(fenced) = part {
                loop {
                    // Until the caller's deadline, looking at the watch every period.
                    let mut slice = deadline.remaining().unwrap_or(Duration::MAX);
                    if watch.active() {
                        slice = slice.min(watch.slice());
                    }
                    if fenced.wait_within(slice)? {
                        break;
                    }
                    watch.check()?;
                    if deadline.expired() {
                        return Ok(Err(self));
                    }
                }
            }
        }
        // Every part is done: the waits return at once.
        watch.health()?;
        self.take_all().map(Ok)
    }

    fn poller(self) -> RanksFuture<T> {
        let landed = self.landed();
        RanksFuture {
            watch: self.watch(),
            landed: Some(landed),
            current: None,
            rest: self.parts.into_iter(),
        }
    }

    fn poll(poller: &mut RanksFuture<T>, cx: &mut Context<'_>) -> Poll<Result<RanksLanded<T>>> {
        poller.poll(cx)
    }
}

/// A collective being awaited: each part in turn, each woken by its own device (and, for
/// joined ranks, by the timer too, to watch the communicator).
pub struct RanksFuture<T: Element> {
    watch: Watch,
    /// `None` once resolved.
    landed: Option<RanksLanded<T>>,
    current: Option<FenceFuture<(DeviceTensor<T>, Arc<Comms>)>>,
    rest: std::vec::IntoIter<Part<T>>,
}

impl<T: Element> std::fmt::Debug for RanksFuture<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RanksFuture")
            .field("dtype", &T::DTYPE)
            .finish_non_exhaustive()
    }
}

// Nothing is pinned structurally: the device holds the tensors' addresses, not the future's.
impl<T: Element> Unpin for RanksFuture<T> {}

impl<T: Element> RanksFuture<T> {
    /// Resolves to `error`: the parts not awaited detach as the future drops.
    fn fail(&mut self, error: Error) -> Poll<Result<RanksLanded<T>>> {
        self.landed = None;
        self.current = None;
        Poll::Ready(Err(error))
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<RanksLanded<T>>> {
        assert!(
            self.landed.is_some(),
            "a collective's future is not polled after it resolved"
        );
        loop {
            if let Some(current) = &mut self.current {
                match current.poll(cx) {
                    Poll::Pending => {
                        if let Err(error) = self.watch.check() {
                            return self.fail(error);
                        }
                        if self.watch.active() {
                            // No device wake comes for a peer that died: look again soon.
                            // At most `WATCH_PERIOD` from now: the sum is checked all the same.
                            let at = Deadline::after(self.watch.slice())
                                .instant()
                                .unwrap_or_else(Instant::now);
                            timer::wake_at(at, cx.waker().clone());
                        }
                        return Poll::Pending;
                    }
                    Poll::Ready(Ok(((tensor, _comms), event))) => {
                        let landed = self.landed.as_mut().expect("checked above");
                        landed.push(tensor, Some(event));
                    }
                    Poll::Ready(Err(error)) => return self.fail(error),
                }
                self.current = None;
            }
            match self.rest.next() {
                Some(Part::Done(tensor)) => {
                    let landed = self.landed.as_mut().expect("checked above");
                    landed.push(tensor, None);
                }
                Some(Part::Fenced(fenced)) => self.current = Some(FenceFuture::new(fenced)),
                None => {
                    // Complete: unless the communicator was aborted meanwhile.
                    if let Err(error) = self.watch.health() {
                        return self.fail(error);
                    }
                    let landed = self.landed.take().expect("checked above");
                    return Poll::Ready(Ok(landed));
                }
            }
        }
    }
}
