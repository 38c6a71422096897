//! A lock guard that releases its lock before the work its holder left behind runs.
//!
//! The engine and the simulated device both keep state behind one mutex whose holders leave
//! work that must not run under it: the engine's resources released meanwhile (whose drops take
//! the lock again), the device's wakes (which may take other locks, or register another wake).
//! [`UnlockFirst`] is that guard, written once: as it drops, the state hands out what it left
//! ([`Unlocking::on_unlock`], with the lock still held), the lock is released, and only then
//! does that work run ([`Unlocking::after_unlock`]).
//!
//! The module exists so the order (take, release, then run) is one piece of code for both
//! states, which differ only in what they leave behind. It knows nothing of either.

use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

/// State locked by an [`UnlockFirst`]: what its holder leaves to run once the lock is released.
pub(crate) trait Unlocking {
    /// The work left behind.
    type Then;
    /// Takes the work left behind, the lock still held, as the guard drops; `unwinding` says a
    /// panic is unwinding through the guard.
    fn on_unlock(&mut self, unwinding: bool) -> Self::Then;
    /// Runs what [`on_unlock`](Self::on_unlock) took, the lock released.
    fn after_unlock(then: Self::Then);
}

/// A guard of a `Mutex<S>` whose drop releases the lock first, then runs what the state left
/// behind (see the module doc).
pub(crate) struct UnlockFirst<'a, S: Unlocking> {
    /// `Some` except while [`relock`](Self::relock) has the guard, and during the drop.
    guard: Option<MutexGuard<'a, S>>,
}

impl<'a, S: Unlocking> UnlockFirst<'a, S> {
    /// Takes the lock, even one poisoned by a panic: both states are left whole by every
    /// section (each driver call is atomic, and an unproven resource is leaked, not released,
    /// on unwind), so a poisoned lock is still usable.
    pub(crate) fn lock(mutex: &'a Mutex<S>) -> Self {
        let guard = mutex.lock().unwrap_or_else(|e| e.into_inner());
        UnlockFirst { guard: Some(guard) }
    }

    /// Hands the bare guard to `wait` (a condition variable's wait, which releases and takes
    /// the lock again) and keeps what it returns. Nothing left behind runs meanwhile. (The
    /// simulated device waits on its lock this way; the engine never does.)
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn relock(
        mut self,
        wait: impl FnOnce(MutexGuard<'a, S>) -> MutexGuard<'a, S>,
    ) -> Self {
        let guard = self.guard.take().expect("a live lock holds its guard");
        self.guard = Some(wait(guard));
        self
    }
}

impl<S: Unlocking> Deref for UnlockFirst<'_, S> {
    type Target = S;
    fn deref(&self) -> &S {
        self.guard.as_ref().expect("a live lock holds its guard")
    }
}

impl<S: Unlocking> DerefMut for UnlockFirst<'_, S> {
    fn deref_mut(&mut self) -> &mut S {
        self.guard.as_mut().expect("a live lock holds its guard")
    }
}

impl<S: Unlocking> Drop for UnlockFirst<'_, S> {
    fn drop(&mut self) {
        let Some(mut guard) = self.guard.take() else {
            return;
        };
        let then = guard.on_unlock(std::thread::panicking());
        drop(guard);
        S::after_unlock(then);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    static LOCKED_WHEN_RUN: AtomicBool = AtomicBool::new(true);
    static STATE: Mutex<Left> = Mutex::new(Left(Vec::new()));

    struct Left(Vec<u32>);

    impl Unlocking for Left {
        type Then = Vec<u32>;
        fn on_unlock(&mut self, _unwinding: bool) -> Vec<u32> {
            std::mem::take(&mut self.0)
        }
        fn after_unlock(then: Vec<u32>) {
            assert_eq!(then, [1, 2]);
            LOCKED_WHEN_RUN.store(STATE.try_lock().is_err(), Ordering::SeqCst);
        }
    }

    #[test]
    fn what_was_left_runs_once_the_lock_is_released() {
        let mut locked = UnlockFirst::lock(&STATE);
        locked.0.push(1);
        let mut locked = locked.relock(|guard| guard);
        locked.0.push(2);
        drop(locked);
        assert!(
            !LOCKED_WHEN_RUN.load(Ordering::SeqCst),
            "ran under the lock"
        );
        assert!(STATE.lock().unwrap().0.is_empty());
    }
}
