//! Where the device's wakes run: never under an engine's lock, and always marked as the
//! device's callback.
//!
//! A wake ([`Driver::notify_after`](crate::driver::Driver::notify_after)) is how an awaited
//! transfer learns that its work is done. On CUDA it runs on the driver's callback thread, where
//! the driver refuses every call (`CUDA_ERROR_NOT_PERMITTED`); on the simulated device it runs on
//! whichever thread advanced the device's clock, which may be a thread in the middle of an engine
//! call. Both drivers hand their wakes to [`call`], which keeps the two promises the engine
//! builds on:
//!
//! - **No engine lock is held while a wake runs.** This module counts the engine locks each
//!   thread holds (the engine reports every lock and unlock here); a wake due while the count is
//!   not zero waits on this thread until the last of them is released, and runs then. So a
//!   waker that takes a lock of its own, or drops a value whose drop takes the engine's, never
//!   deadlocks against the thread that ran the device's work.
//! - **A wake runs as the device's callback** ([`in_wake`]), on both drivers alike: the engine
//!   refuses every call made from one with a typed error, and a value dropped in one is reported
//!   at the engine's next boundary, instead of the call failing on CUDA alone (or a free being
//!   refused there and the memory leaking unseen).
//!
//! Process-wide state with no knowledge of any engine: it depends only on the seam's `Wake`.

use super::Wake;
use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    /// How many engine locks this thread holds.
    static ENGINE_LOCKS: Cell<usize> = const { Cell::new(0) };
    /// Wakes that came due while this thread held an engine lock, to run once it holds none.
    static DEFERRED: RefCell<Vec<Wake>> = const { RefCell::new(Vec::new()) };
    /// Whether `DEFERRED` may hold wakes: the check every lock release makes, without the
    /// borrow of the list.
    static HAS_DEFERRED: Cell<bool> = const { Cell::new(false) };
    /// Whether this thread is running a wake.
    static IN_WAKE: Cell<bool> = const { Cell::new(false) };
}

/// Counts an engine lock taken by this thread.
pub(crate) fn engine_lock_taken() {
    ENGINE_LOCKS.with(|held| held.set(held.get() + 1));
}

/// Counts an engine lock released by this thread. The caller runs [`run_deferred`] once it has
/// dropped what it released with the lock.
pub(crate) fn engine_lock_released() {
    ENGINE_LOCKS.with(|held| held.set(held.get().saturating_sub(1)));
}

/// How many engine locks this thread holds.
pub(crate) fn engine_locks_held() -> usize {
    ENGINE_LOCKS.with(Cell::get)
}

/// Whether this thread is running a wake (the device's callback).
pub(crate) fn in_wake() -> bool {
    IN_WAKE.with(Cell::get)
}

/// Runs `wakes` now when this thread holds no engine lock, else once it holds none.
///
/// While a panic unwinds, nothing runs: the wakes wait for this thread's next release of an
/// engine lock (running a caller's code during an unwind could abort the process).
pub(crate) fn call(wakes: Vec<Wake>) {
    if wakes.is_empty() {
        return;
    }
    if engine_locks_held() > 0 || std::thread::panicking() {
        DEFERRED.with(|deferred| deferred.borrow_mut().extend(wakes));
        HAS_DEFERRED.with(|has| has.set(true));
        return;
    }
    run(wakes);
}

/// Runs the wakes deferred on this thread, once it holds no engine lock (and no panic unwinds).
pub(crate) fn run_deferred() {
    if !HAS_DEFERRED.with(Cell::get) || engine_locks_held() > 0 || std::thread::panicking() {
        return;
    }
    // Wakes may come due while these run (a wake that registers another): loop until none is
    // left.
    loop {
        let wakes = DEFERRED.with(|deferred| std::mem::take(&mut *deferred.borrow_mut()));
        HAS_DEFERRED.with(|has| has.set(false));
        if wakes.is_empty() {
            return;
        }
        run(wakes);
    }
}

/// Runs each wake marked as the device's callback; one that panics does not keep the others from
/// running.
fn run(wakes: Vec<Wake>) {
    for wake in wakes {
        let outer = IN_WAKE.with(|w| w.replace(true));
        let ran = catch_unwind(AssertUnwindSafe(wake));
        IN_WAKE.with(|w| w.set(outer));
        if let Err(payload) = ran {
            // Dropping a panic's payload may itself panic: leak it instead.
            std::mem::forget(payload);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn counting(count: &Arc<AtomicUsize>, saw_wake: bool) -> Wake {
        let count = Arc::clone(count);
        Box::new(move || {
            assert_eq!(in_wake(), saw_wake);
            assert_eq!(
                engine_locks_held(),
                0,
                "a wake runs with no engine lock held"
            );
            count.fetch_add(1, Ordering::Relaxed);
        })
    }

    #[test]
    fn a_wake_due_under_an_engine_lock_runs_once_the_last_is_released() {
        let count = Arc::new(AtomicUsize::new(0));
        engine_lock_taken();
        engine_lock_taken();
        call(vec![counting(&count, true)]);
        engine_lock_released();
        run_deferred();
        assert_eq!(count.load(Ordering::Relaxed), 0, "one lock still held");
        engine_lock_released();
        run_deferred();
        assert_eq!(count.load(Ordering::Relaxed), 1);
        run_deferred();
        assert_eq!(count.load(Ordering::Relaxed), 1, "called once");
        assert!(!in_wake());
    }

    #[test]
    fn a_panicking_wake_does_not_keep_the_others_from_running() {
        let count = Arc::new(AtomicUsize::new(0));
        call(vec![
            Box::new(|| panic!("a wake fails")),
            counting(&count, true),
        ]);
        assert_eq!(count.load(Ordering::Relaxed), 1);
        assert!(!in_wake());
    }
}
