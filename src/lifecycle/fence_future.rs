//! Awaiting a proof of completion: [`FenceFuture<R>`], a future over a [`Fenced<R>`] that the
//! device wakes.
//!
//! How it waits. The first poll asks the event without waiting and without the engine's lock
//! ([`Fenced::try_wait`]); a small copy is often done already. If not, it keeps asking for
//! about one wake's latency (the driver's `spin_before_wake`: 20 µs on CUDA, none on the
//! simulated device), so a copy about to finish resolves as fast as a host wait. If still not,
//! it stores the task's waker in a slot and asks the device to call back once the work has
//! completed or failed ([`Fenced::notify_on_completion`], the seam's `Driver::notify_after`): on
//! CUDA a callback on a side stream that waits for the event, on the simulated device a wake
//! attached to the event's record. The callback wakes the task, and the next poll asks the
//! event again, which tells completion from failure. In between, no thread of the process spends
//! anything on the transfer.
//!
//! Why the device calls back, rather than something on the host watching:
//! - polling the event from the executor (re-waking the task at once) keeps a core busy for the
//!   whole transfer, and polling on a timer adds the timer's period to the latency;
//! - a watcher thread that blocks in `cuEventSynchronize` keeps a core busy (spinning or
//!   yielding, as the context's scheduling flags say) unless the event was made with
//!   `CU_EVENT_BLOCKING_SYNC` (the engine's pooled events are not: they are made for cheap
//!   records and queries), and it takes a thread per event waited on at once, or one thread per
//!   process that serialises every wait behind the oldest;
//! - the device's callback comes right after the event, costs nothing while the work runs,
//!   and (as a stream callback) is documented to be called after a device fault too, so a
//!   future never hangs on a failed device.
//!
//! What it promises:
//! - Never spins and never hangs: when no wake can be registered (the engine was torn down, or
//!   the device refused), the poll resolves through a blocking wait on the polling thread,
//!   which is rare and short (a teardown waited for the streams; should that wait have failed,
//!   this one reports the failure too).
//! - Wakes come as the device's callback (`driver::callbacks`): the device's side only marks the
//!   slot fired and wakes the stored waker, and never runs with an engine lock held.
//! - Exactly the rules of [`Fenced::wait_parts`]: a failure retains the resources for the
//!   engine's lifetime and returns the typed error.
//! - Dropping it before it resolves drops the [`Fenced`], which detaches into the retirement
//!   queue as any dropped fence does; the wake the device holds owns only the slot, never the
//!   resources, so nothing is freed early. `mem::forget` leaks the fence, which is sound.

use super::fence::{Fenced, IdleEvent};
use crate::error::Result;
use crate::sync::{AtomicBool, Mutex, MutexGuard, Ordering};
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll, Waker};

/// Where the device's wake finds the task: the waker of the latest poll, and whether the device
/// has called back.
struct WakeSlot {
    waker: Mutex<Option<Waker>>,
    fired: AtomicBool,
}

impl WakeSlot {
    fn lock(&self) -> MutexGuard<'_, Option<Waker>> {
        // Nothing can be left half-written under this lock (it only swaps an `Option`).
        self.waker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The device's call: marks the slot fired and wakes the task, outside the slot's lock.
    fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        let waker = self.lock().take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Keeps `waker` for the device's call, unless the one kept already wakes the same task.
    fn store(&self, waker: &Waker) {
        let mut kept = self.lock();
        if !kept.as_ref().is_some_and(|k| k.will_wake(waker)) {
            let old = kept.replace(waker.clone());
            drop(kept);
            drop(old);
        }
    }

    /// Forgets the waker: the task no longer waits here.
    fn clear(&self) {
        let old = self.lock().take();
        drop(old);
    }

    fn fired(&self) -> bool {
        self.fired.load(Ordering::Acquire)
    }
}

/// A future over a [`Fenced<R>`]: resolves to the resources and the idle event once the work
/// has completed, or to the failure (resources retained).
pub struct FenceFuture<R: Send + 'static> {
    /// `Some` until the future resolves.
    fenced: Option<Fenced<R>>,
    /// `Some` once a wake is registered with the device.
    slot: Option<Arc<WakeSlot>>,
}

impl<R: Send + 'static> std::fmt::Debug for FenceFuture<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceFuture")
            .field("registered", &self.slot.is_some())
            .finish_non_exhaustive()
    }
}

impl<R: Send + 'static> FenceFuture<R> {
    pub(crate) fn new(fenced: Fenced<R>) -> Self {
        FenceFuture {
            fenced: Some(fenced),
            slot: None,
        }
    }

    /// Polls: resolves if the event says the work is done or failed, else makes sure the device
    /// will wake the task of `cx`.
    ///
    /// # Panics
    /// When polled again after it resolved, as futures do.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<(R, IdleEvent)>> {
        let fenced = self
            .fenced
            .take()
            .expect("a fence future is not polled after it resolved");
        let fenced = match fenced.try_wait() {
            Ok(Err(fenced)) => fenced,
            Ok(Ok(done)) => return self.resolve(Ok(done)),
            Err(failure) => return self.resolve(Err(failure)),
        };
        let Some(slot) = &self.slot else {
            // Not done at the first poll: keep asking for about one wake's latency (a copy about
            // to finish then resolves as fast as a host wait would), then ask for the wake.
            return match fenced.spin_until_ready() {
                Ok(false) => self.register(fenced, cx),
                // Done, or failed: the event's answer settles it.
                Ok(true) | Err(_) => self.settle_fired(fenced),
            };
        };
        // Store the waker before reading `fired`: a device call that comes after the store
        // finds the new waker; one that came before it is seen in `fired`.
        slot.store(cx.waker());
        if slot.fired() {
            return self.settle_fired(fenced);
        }
        self.fenced = Some(fenced);
        Poll::Pending
    }

    /// The first time the work is not done yet: registers the device's wake, or falls back to a
    /// blocking wait when none can be registered.
    fn register(
        &mut self,
        fenced: Fenced<R>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(R, IdleEvent)>> {
        let slot = Arc::new(WakeSlot {
            waker: Mutex::new(Some(cx.waker().clone())),
            fired: AtomicBool::new(false),
        });
        let device_side = Arc::clone(&slot);
        if !fenced.notify_on_completion(Box::new(move || device_side.fire())) {
            // No wake will come: resolve here, on the polling thread (rare: see the module).
            return self.resolve(fenced.wait_parts());
        }
        let fired = slot.fired();
        self.slot = Some(slot);
        if fired {
            // The work completed between the query and the registration, and the device
            // called back at once.
            return self.settle_fired(fenced);
        }
        self.fenced = Some(fenced);
        Poll::Pending
    }

    /// Once the event has an answer (the device called back, or the first poll's spin saw it
    /// done or failed). Should it still say "not yet" (which a device that keeps its promise
    /// never does), wait for it here rather than wait for a wake that has already come.
    fn settle_fired(&mut self, fenced: Fenced<R>) -> Poll<Result<(R, IdleEvent)>> {
        let answer = match fenced.try_wait() {
            Ok(Err(fenced)) => fenced.wait_parts(),
            Ok(Ok(done)) => Ok(done),
            Err(failure) => Err(failure),
        };
        self.resolve(answer)
    }

    /// Resolves with `answer`, letting go of the slot's waker.
    fn resolve(&mut self, answer: Result<(R, IdleEvent)>) -> Poll<Result<(R, IdleEvent)>> {
        if let Some(slot) = &self.slot {
            slot.clear();
        }
        Poll::Ready(answer)
    }
}

// Nothing is pinned structurally: the device holds the addresses of what the fence owns, not
// the future's.
impl<R: Send + 'static> Unpin for FenceFuture<R> {}

impl<R: Send + 'static> Drop for FenceFuture<R> {
    fn drop(&mut self) {
        // The fence, if still owed, detaches into the retirement queue by its own drop; the
        // device's wake keeps the slot alive and finds no waker in it.
        if let Some(slot) = &self.slot {
            slot.clear();
        }
    }
}

/// The wake slot's protocol under every interleaving loom explores: the device's call (`fire`)
/// against a poll that stores its waker and then reads `fired`. A wake is never lost: either the
/// poll sees the slot fired, or the device finds the stored waker and wakes it.
#[cfg(all(test, cuferry_loom))]
mod loom_models {
    use super::WakeSlot;
    use crate::sync::{AtomicBool, Mutex, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    /// A waker that records that it was woken.
    struct Flag(AtomicBool);

    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::Release);
        }
    }

    fn slot() -> Arc<WakeSlot> {
        Arc::new(WakeSlot {
            waker: Mutex::new(None),
            fired: AtomicBool::new(false),
        })
    }

    #[test]
    fn loom_a_wake_is_never_lost_between_a_poll_and_the_device() {
        loom::model(|| {
            let slot = slot();
            let device = {
                let slot = Arc::clone(&slot);
                loom::thread::spawn(move || slot.fire())
            };
            let flag = Arc::new(Flag(AtomicBool::new(false)));
            let waker = Waker::from(Arc::clone(&flag));
            // What a poll does: store the waker, then read `fired`.
            slot.store(&waker);
            let saw_fired = slot.fired();
            device.join().unwrap();
            assert!(
                saw_fired || flag.0.load(Ordering::Acquire),
                "the device called back, but the task was neither woken nor saw it"
            );
        });
    }

    #[test]
    fn loom_a_later_poll_replaces_the_waker_and_one_of_them_is_woken_or_sees_it() {
        loom::model(|| {
            let slot = slot();
            let first = Arc::new(Flag(AtomicBool::new(false)));
            slot.store(&Waker::from(Arc::clone(&first)));
            let device = {
                let slot = Arc::clone(&slot);
                loom::thread::spawn(move || slot.fire())
            };
            // A second poll, from another task's waker.
            let second = Arc::new(Flag(AtomicBool::new(false)));
            slot.store(&Waker::from(Arc::clone(&second)));
            let saw_fired = slot.fired();
            device.join().unwrap();
            // The latest poll's task must learn of the call: woken, or told by `fired`.
            assert!(saw_fired || second.0.load(Ordering::Acquire));
        });
    }

    #[test]
    fn loom_a_cleared_slot_wakes_nobody() {
        loom::model(|| {
            let slot = slot();
            let flag = Arc::new(Flag(AtomicBool::new(false)));
            slot.store(&Waker::from(Arc::clone(&flag)));
            let device = {
                let slot = Arc::clone(&slot);
                loom::thread::spawn(move || slot.fire())
            };
            slot.clear();
            device.join().unwrap();
            // Woken only if the call came before the clear; either way the slot is empty after.
            assert!(slot.lock().is_none());
        });
    }
}
