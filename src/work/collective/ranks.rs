//! A collective in flight, rank by rank: its parts, their proof and their `.await`.

use super::{Comms, Kind};
use crate::error::Result;
use crate::lifecycle::fence::{Fenced, IdleEvent};
use crate::lifecycle::wake::FenceFuture;
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use crate::routes::pending::flight::Flight;
use std::sync::Arc;
use std::task::{Context, Poll};

/// A rank's part of a collective in flight: its tensor fenced on its engine, or proven complete
/// already (where the event could not be recorded but a synchronize proved the work done).
pub(super) enum Part<T: Element> {
    Fenced(Fenced<(DeviceTensor<T>, Arc<Comms>)>),
    Done(DeviceTensor<T>),
}

/// What a collective in flight holds: every rank's part, in rank order, and what a resubmission
/// needs.
pub struct Ranks<T: Element> {
    pub(super) parts: Vec<Part<T>>,
    pub(super) comms: Arc<Comms>,
    pub(super) kind: Kind,
}

impl<T: Element> std::fmt::Debug for Ranks<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ranks")
            .field("dtype", &T::DTYPE)
            .finish_non_exhaustive()
    }
}

/// A returned collective: every rank's tensor, in rank order, with each rank's idle event (where
/// it had one) kept for resubmission.
pub struct RanksLanded<T: Element> {
    pub(super) tensors: Vec<DeviceTensor<T>>,
    pub(super) events: Vec<Option<IdleEvent>>,
    pub(super) comms: Arc<Comms>,
    pub(super) kind: Kind,
}

impl<T: Element> std::fmt::Debug for RanksLanded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RanksLanded")
            .field("dtype", &T::DTYPE)
            .finish_non_exhaustive()
    }
}

impl<T: Element> Ranks<T> {
    fn landed(comms: Arc<Comms>, kind: Kind, ranks: usize) -> RanksLanded<T> {
        RanksLanded {
            tensors: Vec::with_capacity(ranks),
            events: Vec::with_capacity(ranks),
            comms,
            kind,
        }
    }
}

impl<T: Element> RanksLanded<T> {
    fn push(&mut self, tensor: DeviceTensor<T>, event: Option<IdleEvent>) {
        self.tensors.push(tensor);
        self.events.push(event);
    }
}

impl<T: Element> Flight for Ranks<T> {
    type Done = RanksLanded<T>;
    type Poller = RanksFuture<T>;

    fn is_ready(&self) -> Result<bool> {
        for part in &self.parts {
            if let Part::Fenced(fenced) = part
                && !fenced.is_ready()?
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn wait(self) -> Result<RanksLanded<T>> {
        let mut landed = Ranks::landed(self.comms, self.kind, self.parts.len());
        for part in self.parts {
            match part {
                Part::Done(tensor) => landed.push(tensor, None),
                // On a failure the parts not waited for detach as they drop.
                Part::Fenced(fenced) => {
                    let ((tensor, _comms), event) = fenced.wait_parts()?;
                    landed.push(tensor, Some(event));
                }
            }
        }
        Ok(landed)
    }

    fn try_wait(self) -> Result<std::result::Result<RanksLanded<T>, Self>> {
        for part in &self.parts {
            if let Part::Fenced(fenced) = part {
                match fenced.is_ready() {
                    Ok(true) => {}
                    Ok(false) => return Ok(Err(self)),
                    // The wait below settles the failure: the failing rank's tensor is retained.
                    Err(_) => break,
                }
            }
        }
        // Every part is done (or one failed): the waits return at once.
        self.wait().map(Ok)
    }

    fn poller(self) -> RanksFuture<T> {
        let landed = Ranks::landed(self.comms, self.kind, self.parts.len());
        RanksFuture {
            landed: Some(landed),
            current: None,
            rest: self.parts.into_iter(),
        }
    }

    fn poll(poller: &mut RanksFuture<T>, cx: &mut Context<'_>) -> Poll<Result<RanksLanded<T>>> {
        poller.poll(cx)
    }
}

/// A collective being awaited: each rank's part in turn, each woken by its own device.
pub struct RanksFuture<T: Element> {
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
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<RanksLanded<T>>> {
        let landed = self
            .landed
            .as_mut()
            .expect("a collective's future is not polled after it resolved");
        loop {
            if let Some(current) = &mut self.current {
                match current.poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(((tensor, _comms), event))) => landed.push(tensor, Some(event)),
                    Poll::Ready(Err(error)) => {
                        // The parts not awaited detach as the future drops.
                        self.landed = None;
                        return Poll::Ready(Err(error));
                    }
                }
                self.current = None;
            }
            match self.rest.next() {
                Some(Part::Done(tensor)) => landed.push(tensor, None),
                Some(Part::Fenced(fenced)) => self.current = Some(FenceFuture::new(fenced)),
                None => {
                    let landed = self.landed.take().expect("checked above");
                    return Poll::Ready(Ok(landed));
                }
            }
        }
    }
}
