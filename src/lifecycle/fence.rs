//! The one proof of completion: [`Fenced<R>`], resources bound to the event recorded after the
//! queued work that may still touch them.
//!
//! Every value that lends memory to queued device work (a pending transfer's buffer and tensor,
//! a staging chunk, a detached record, a read-back) holds it through this module, so the rules
//! are written once:
//!
//! - A `Fenced<R>` is made only by recording an event after the work ([`fence`]). Making it has
//!   exactly three outcomes ([`Fencing`]): fenced (the event is recorded), proven now (the event
//!   could not be recorded but a stream synchronize proved the work complete: `R` comes back), or
//!   untracked (neither worked: `R` is held by an [`Untracked`], whose only way out is to be
//!   retained for the life of the engine, never released).
//! - Readiness ([`Fenced::is_ready`]), waits ([`Fenced::wait`], [`Fenced::try_wait`]), the
//!   device's wake-up ([`Fenced::notify_on_completion`], for futures) and detach-on-drop are
//!   methods of this type. Host waits happen outside the engine's lock, so a
//!   thread waiting on one transfer never blocks the engine's owner.
//! - `R` is held in `ManuallyDrop` everywhere the proof is still owed: a panic that unwinds
//!   through any of these paths leaks `R` (sound) instead of releasing it, and never takes the
//!   engine's lock while it is held.

use crate::core::engine::{Shared, State};
use crate::core::retire::{Held, Record};
use crate::driver::{EventHandle, Lane, Wake, callbacks};
use crate::error::{DriverError, Error, Result, UsageError};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Resources `R` that queued device work may still touch, and the event recorded after that
/// work. The only way to get `R` back is a proof: the event reports completion.
///
/// Dropping it detaches it into the engine's retirement queue, which releases `R` once the event
/// proves completion; after the engine's teardown it waits in place. `mem::forget` leaks `R` and
/// the event, which is sound.
pub struct Fenced<R: Send + 'static> {
    /// `Some` until a transition or drop moves it out.
    inner: Option<Inner<R>>,
}

impl<R: Send + 'static> std::fmt::Debug for Fenced<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = self.inner.as_ref().map(|inner| inner.what);
        f.debug_struct("Fenced")
            .field("what", &what)
            .finish_non_exhaustive()
    }
}

/// The parts of a fence. Dropping it leaks `resources` (`ManuallyDrop`): only a proof releases
/// them, so a panic between the steps of a transition can never free memory the device may use.
struct Inner<R> {
    resources: ManuallyDrop<R>,
    event: EventHandle,
    owner: Arc<Shared>,
    what: &'static str,
    /// What the event's completion proves: its lane, up to this position.
    covers: (Lane, u64),
    /// The bytes of memory the resources hold ([`Held`]), for the retirement queue's figures.
    bytes: u64,
}

/// The outcome of fencing resources after queued work. There is no fourth case.
pub(crate) enum Fencing<R: Send + 'static> {
    /// The event is recorded after the work.
    Fenced(Fenced<R>),
    /// The event could not be recorded, but a stream synchronize proved the work complete:
    /// the resources come back, with what failed.
    Proven(R, Error),
    /// Neither the event nor a stream synchronize worked: the work may still touch the
    /// resources, which can only be retained.
    Untracked(Untracked<R>, Error),
}

/// Records an event after everything queued so far on `lane` (the lane the work was queued on)
/// and binds `resources` to it. `event` is an idle event to reuse (a resubmission's); otherwise one comes from the
/// engine's pool.
///
/// Called with the engine's state locked (the caller has just queued the work). The fallback
/// stream synchronize, on the failure path only, waits with the lock held.
///
/// `resources` arrive in `ManuallyDrop`, put there by the caller before the first enqueue of the
/// work: a panic inside any driver call from that enqueue to the proof leaks them, never
/// releases them (the type makes every route hold them from the start, not from here).
pub(crate) fn fence<R: Send + Held + 'static>(
    st: &mut State,
    owner: &Arc<Shared>,
    lane: Lane,
    resources: ManuallyDrop<R>,
    event: Option<EventHandle>,
    what: &'static str,
) -> Fencing<R> {
    let recorded = match event {
        Some(event) => Ok(event),
        None => st.events.take(&mut *st.driver),
    }
    .and_then(|event| match st.driver.event_record(lane, event) {
        Ok(()) => Ok(event),
        Err(source) => {
            // The event was not recorded, so its last record (if any) is complete: reusable.
            st.events.put(event);
            Err(Error::Driver {
                call: "cuEventRecord",
                source,
            })
        }
    });
    let error = match recorded {
        Ok(event) => {
            let bytes = resources.held_bytes();
            return Fencing::Fenced(Fenced {
                inner: Some(Inner {
                    resources,
                    event,
                    owner: Arc::clone(owner),
                    what,
                    covers: (lane, st.order.position(lane)),
                    bytes,
                }),
            });
        }
        Err(error) => error,
    };
    let upto = st.order.positions();
    match owner.waits.stream_synchronize() {
        Ok(()) => {
            st.order.settled(upto);
            Fencing::Proven(ManuallyDrop::into_inner(resources), error)
        }
        Err(wait) => Fencing::Untracked(
            Untracked {
                resources,
                owner: Arc::clone(owner),
                what,
                failure: wait,
            },
            error,
        ),
    }
}

impl<R: Send + 'static> Fenced<R> {
    fn take(&mut self) -> Inner<R> {
        // Invariant: `inner` is `Some` for every value a caller can reach.
        self.inner.take().expect("a live fence holds its parts")
    }

    fn inner(&self) -> &Inner<R> {
        self.inner.as_ref().expect("a live fence holds its parts")
    }

    /// The engine the fenced work was queued on.
    pub(crate) fn owner(&self) -> &Arc<Shared> {
        &self.inner().owner
    }

    /// The event recorded after the work, for another stream to wait on (never to record again:
    /// it stays this fence's until a proof).
    pub(crate) fn event(&self) -> EventHandle {
        self.inner().event
    }

    /// The resources, shared, while the proof is still owed. Only for parts that the caller may
    /// use on the engine's own stream (where queued work runs after the fenced work) and that a
    /// shared borrow cannot write: a pending transfer's device tensor, never its host buffer.
    pub(crate) fn resources(&self) -> &R {
        &self.inner().resources
    }

    /// Binds `extra`, which holds `extra_bytes` of the engine's memory, to the same proof: it is
    /// released with the resources, never before.
    pub(crate) fn attach<X: Send + 'static>(
        mut self,
        extra: X,
        extra_bytes: u64,
    ) -> Fenced<(R, X)> {
        let inner = self.take();
        let resources = ManuallyDrop::into_inner(inner.resources);
        Fenced {
            inner: Some(Inner {
                resources: ManuallyDrop::new((resources, extra)),
                event: inner.event,
                owner: inner.owner,
                what: inner.what,
                covers: inner.covers,
                bytes: inner.bytes + extra_bytes,
            }),
        }
    }

    /// Whether the work has completed. Never waits and takes no lock.
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when the device reports a failure of the work (or of earlier work).
    pub(crate) fn is_ready(&self) -> Result<bool> {
        in_wake_refused("a readiness check")?;
        let inner = self.inner();
        inner
            .owner
            .waits
            .event_query(inner.event)
            .map_err(|source| Error::DeviceFault {
                what: inner.what,
                source,
            })
    }

    /// Waits at most about `within` for the work, outside the engine's lock: `Ok(true)` once
    /// it has completed, `Ok(false)` when `within` passed first. The resources stay fenced
    /// either way.
    ///
    /// # Errors
    /// As [`is_ready`](Self::is_ready).
    pub(crate) fn wait_within(&self, within: std::time::Duration) -> Result<bool> {
        in_wake_refused("a wait")?;
        let inner = self.inner();
        inner
            .owner
            .waits
            .event_wait_within(inner.event, within)
            .map_err(|source| Error::DeviceFault {
                what: inner.what,
                source,
            })
    }

    /// For a caller that has just found the work not done: asks the event again, without
    /// waiting and without the lock, until it reports completion or a failure, or until the
    /// driver's `spin_before_wake` has passed (with none, it does not ask again). `Ok(false)`:
    /// still not done.
    ///
    /// # Errors
    /// As [`is_ready`](Self::is_ready).
    pub(crate) fn spin_until_ready(&self) -> Result<bool> {
        let budget = self.inner().owner.waits.spin_before_wake();
        if budget.is_zero() {
            return Ok(false);
        }
        let start = std::time::Instant::now();
        loop {
            if self.is_ready()? {
                return Ok(true);
            }
            if start.elapsed() >= budget {
                return Ok(false);
            }
            std::hint::spin_loop();
        }
    }

    /// Asks the device to call `wake` once, on a thread of its choosing, when the work has
    /// completed or the device has failed (see `Driver::notify_after`). Takes the engine's lock
    /// for the registration only; never waits.
    ///
    /// `false` when no wake was registered: the engine has been torn down (its teardown waited
    /// for its streams, so a query answers at once; should that wait have failed, the caller's
    /// wait waits for the event itself), its context could not be made current, or the device
    /// refused the registration. `wake` was then dropped uncalled. The caller falls back
    /// to a query or a wait, which report any failure of the work itself.
    pub(crate) fn notify_on_completion(&self, wake: Wake) -> bool {
        let inner = self.inner();
        let Ok(mut st) = inner.owner.enter() else {
            return false;
        };
        if st.torn_down {
            return false;
        }
        st.driver.notify_after(inner.event, wake).is_ok()
    }

    /// Waits for the work, outside the engine's lock, gives the resources back and returns the
    /// event to the engine's pool.
    ///
    /// # Errors
    /// As [`wait_parts`](Self::wait_parts).
    #[cfg(feature = "cubecl")]
    pub(crate) fn wait(self) -> Result<R> {
        let (resources, _event) = self.wait_parts()?;
        Ok(resources)
    }

    /// Waits for the work, outside the engine's lock, and gives the resources back with the
    /// (now idle) event, for reuse by the caller.
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when the device reports a failure: the resources are then retained
    /// for the engine's lifetime (the device may still touch them), never released.
    pub(crate) fn wait_parts(mut self) -> Result<(R, IdleEvent)> {
        let inner = self.take();
        leak_in_wake(&inner, "a wait")?;
        let waited = inner.owner.waits.event_synchronize(inner.event);
        match settle(inner, waited.map(|()| true))? {
            Settled::Done(resources, event) => Ok((resources, event)),
            Settled::NotYet(_) => unreachable!("a completed wait settles as done"),
        }
    }

    /// Gives the resources back if the work has completed, or the fence if not. Never waits.
    ///
    /// # Errors
    /// As [`wait_parts`](Self::wait_parts).
    pub(crate) fn try_wait(mut self) -> Result<std::result::Result<(R, IdleEvent), Self>> {
        let inner = self.take();
        leak_in_wake(&inner, "a wait")?;
        let done = inner.owner.waits.event_query(inner.event);
        Ok(match settle(inner, done)? {
            Settled::Done(resources, event) => Ok((resources, event)),
            Settled::NotYet(inner) => Err(Fenced { inner: Some(inner) }),
        })
    }
}

/// Refuses `what` inside a wake, where the driver refuses every call (see `driver::callbacks`).
fn in_wake_refused(what: &'static str) -> Result<()> {
    if callbacks::in_wake() {
        return Err(Error::Usage(UsageError::InDeviceCallback { what }));
    }
    Ok(())
}

/// Inside a wake, refuses `what`, which consumes the fence: its resources are leaked (the
/// device may still touch them) and the refusal is also reported at the engine's next boundary.
fn leak_in_wake<R>(inner: &Inner<R>, what: &'static str) -> Result<()> {
    in_wake_refused(what).inspect_err(|_| {
        inner
            .owner
            .report_in_wake(Error::Usage(UsageError::InDeviceCallback {
                what: "a wait, whose resources were leaked,",
            }));
    })
}

/// What a wait or a query found.
enum Settled<R> {
    /// The work completed: the resources and the idle event.
    Done(R, IdleEvent),
    /// Not yet: the proof is still owed.
    NotYet(Inner<R>),
}

/// The end of a wait or query: the resources on completion, the parts back when not yet, and
/// on failure the resources retained and the failure reported.
fn settle<R: Send + 'static>(
    inner: Inner<R>,
    done: std::result::Result<bool, DriverError>,
) -> Result<Settled<R>> {
    match done {
        Ok(true) => Ok(Settled::Done(
            {
                // The lane runs in order: everything queued on it before the record is done too.
                let (lane, upto) = inner.covers;
                inner.owner.proven.prove(lane, upto);
                ManuallyDrop::into_inner(inner.resources)
            },
            IdleEvent {
                event: Some(inner.event),
                owner: inner.owner,
            },
        )),
        Ok(false) => Ok(Settled::NotYet(inner)),
        Err(source) => {
            let what = inner.what;
            retain(inner, source);
            Err(Error::DeviceFault { what, source })
        }
    }
}

/// Keeps a fence whose event reported a failure: its resources are never released.
fn retain<R: Send + 'static>(inner: Inner<R>, failure: DriverError) {
    let record = Record::new(
        inner.event,
        inner.resources,
        inner.what,
        inner.covers,
        inner.bytes,
    );
    if let Some(mut st) = inner.owner.lock_for_drop() {
        let st = &mut *st;
        st.retire.retain_failed(record, failure);
        st.retire.tell(&mut st.ledger);
    }
}

impl<R: Send + 'static> Drop for Fenced<R> {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let owner = Arc::clone(&inner.owner);
        let Some(mut st) = owner.lock_for_drop() else {
            return; // `inner` leaks: sound
        };
        if !st.torn_down {
            let st = &mut *st;
            st.retire.push(Record::new(
                inner.event,
                inner.resources,
                inner.what,
                inner.covers,
                inner.bytes,
            ));
            st.retire.tell(&mut st.ledger);
            return;
        }
        // The engine is gone and nobody drains its queue: prove completion here, outside the
        // lock, or retain.
        drop(st);
        let waited = owner.waits.event_synchronize(inner.event);
        if let Ok(Settled::Done(resources, event)) = settle(inner, waited.map(|()| true)) {
            drop(event);
            drop(resources);
        }
    }
}

/// An event whose last record is complete, owned until it is recorded again
/// ([`into_raw`](Self::into_raw), for [`fence`]) or dropped (back to its engine's pool).
pub struct IdleEvent {
    /// `Some` until `into_raw` takes it.
    event: Option<EventHandle>,
    owner: Arc<Shared>,
}

impl std::fmt::Debug for IdleEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleEvent").finish_non_exhaustive()
    }
}

impl IdleEvent {
    /// The event, for recording again on its own engine.
    pub(crate) fn into_raw(mut self) -> EventHandle {
        self.event
            .take()
            .expect("a live idle event holds its handle")
    }
}

impl Drop for IdleEvent {
    fn drop(&mut self) {
        let Some(event) = self.event.take() else {
            return;
        };
        let Some(mut st) = self.owner.lock_for_drop() else {
            return;
        };
        if !st.torn_down {
            st.events.put(event);
            return;
        }
        // The engine is gone: nobody will reuse or destroy pooled events.
        drop(st);
        if let Some(mut st) = self.owner.enter_for_drop() {
            // SAFETY: the event's last record is complete and nothing uses it again.
            if let Err(source) = unsafe { st.driver.event_destroy(event) } {
                st.defer(Error::Driver {
                    call: "cuEventDestroy",
                    source,
                });
            }
        }
    }
}

/// Resources whose work was queued but could not be fenced or proven complete. No access, no
/// release: [`retain`](Self::retain) (or dropping it) keeps them for the life of the engine and
/// counts them in its retirement statistics.
pub(crate) struct Untracked<R: Send + 'static> {
    /// Owned, never read and never dropped: the device may still touch it.
    #[allow(dead_code)]
    resources: ManuallyDrop<R>,
    owner: Arc<Shared>,
    what: &'static str,
    failure: DriverError,
}

impl<R: Send + 'static> Untracked<R> {
    /// The engine the work was queued on.
    pub(crate) fn owner(&self) -> &Arc<Shared> {
        &self.owner
    }

    /// Keeps the resources for the life of the engine, never released (same as dropping).
    pub(crate) fn retain(self) {
        drop(self);
    }
}

impl<R: Send + 'static> Drop for Untracked<R> {
    fn drop(&mut self) {
        if let Some(mut st) = self.owner.lock_for_drop() {
            let st = &mut *st;
            st.retire.count_untracked(self.what, self.failure);
            st.retire.tell(&mut st.ledger);
        }
        // `self.resources` is `ManuallyDrop`: never dropped, so never released.
    }
}

/// Proves everything queued on `lane` so far complete with a stream synchronize, and gives
/// `resources` back: the proof for work the caller waits for at once, where an event would cost
/// a record and a trip through the event pool for the same answer (the smallest blocking
/// transfers). Releases the lock `st` (the caller has just queued the work) and waits outside it.
///
/// `resources` arrive in `ManuallyDrop`, taken before the work was queued, so a panic anywhere
/// from the enqueue to the proof leaks them.
///
/// # Errors
/// [`Error::DeviceFault`] when the synchronize reports a failure: the resources are then
/// retained for the engine's lifetime (nothing proved the work complete), never released.
pub(crate) fn synchronize_now<R: Send + 'static>(
    st: crate::core::engine::Entered<'_>,
    owner: &Arc<Shared>,
    lane: Lane,
    resources: ManuallyDrop<R>,
    what: &'static str,
) -> Result<R> {
    let upto = st.order.position(lane);
    drop(st);
    match owner.waits.lane_synchronize(lane) {
        Ok(()) => {
            owner.proven.prove(lane, upto);
            Ok(ManuallyDrop::into_inner(resources))
        }
        Err(source) => {
            drop(Untracked {
                resources,
                owner: Arc::clone(owner),
                what,
                failure: source,
            });
            Err(Error::DeviceFault { what, source })
        }
    }
}

/// Proves everything queued on the engine so far complete, with `resources` lent to it: joins
/// the copy lanes into the compute lane, fences the resources there, releases the lock, and waits
/// outside it. For boundaries with another runtime, which can
/// only be ordered by a host wait.
///
/// # Errors
/// The record failure when neither an event nor a stream synchronize could prove completion
/// (`resources` are then retained), or [`Error::DeviceFault`] when the work failed.
#[cfg(feature = "cubecl")]
pub(crate) fn wait_for_queued<R: Send + Held + 'static>(
    mut st: crate::core::engine::Entered<'_>,
    owner: &Arc<Shared>,
    resources: R,
    what: &'static str,
) -> Result<R> {
    // The caller's work on the resources is already queued: held from here, so a failure or a
    // panic below leaks them rather than freeing them under it.
    let resources = ManuallyDrop::new(resources);
    {
        let st = &mut *st;
        st.order.join(&mut *st.driver, Lane::Compute)?;
    }
    let fencing = fence(&mut st, owner, Lane::Compute, resources, None, what);
    drop(st);
    match fencing {
        Fencing::Fenced(fenced) => fenced.wait(),
        Fencing::Proven(resources, _) => Ok(resources),
        Fencing::Untracked(untracked, error) => {
            untracked.retain();
            Err(error)
        }
    }
}
