//! Wakes at a time of the caller's choosing, from one thread for the whole process: what an
//! awaited collective of ranks in other processes uses to look again at its communicator's
//! health and deadline, since no device wake comes for a peer that died.
//!
//! The thread starts at the first request and sleeps until the earliest one is due; a request
//! is a waker and an instant, and costs nothing but its place in the list. Wakes may come late
//! (the thread's scheduling) but never early, and a woken task that is not done simply asks
//! again.

use std::sync::{Condvar, Mutex, OnceLock, PoisonError};
use std::task::Waker;
use std::time::Instant;

/// The requests, and the condition the thread sleeps on.
struct Timer {
    due: Mutex<Vec<(Instant, Waker)>>,
    changed: Condvar,
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<&'static Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        let timer: &'static Timer = Box::leak(Box::new(Timer {
            due: Mutex::new(Vec::new()),
            changed: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("cuferry-timer".into())
            .spawn(move || timer.run())
            .expect("the timer thread starts");
        timer
    })
}

impl Timer {
    fn run(&self) {
        let mut due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let now = Instant::now();
            let (ready, later): (Vec<_>, Vec<_>) = due.drain(..).partition(|(at, _)| *at <= now);
            *due = later;
            if !ready.is_empty() {
                // Woken outside the lock: a waker may run its task's poll inline.
                drop(due);
                for (_, waker) in ready {
                    waker.wake();
                }
                due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            due = match due.iter().map(|(at, _)| *at).min() {
                None => self
                    .changed
                    .wait(due)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(at) => {
                    self.changed
                        .wait_timeout(due, at.saturating_duration_since(now))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }
}

/// Wakes `waker` at `at` (at once if it has passed), from the timer's thread.
pub(crate) fn wake_at(at: Instant, waker: Waker) {
    let timer = timer();
    timer
        .due
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((at, waker));
    timer.changed.notify_one();
}
