//! The crate's host concurrency, below every level: the synchronization primitives of its
//! hand-written concurrency, from `std` in every ordinary build and from
//! [`loom`](https://docs.rs/loom) when built with `--cfg cuferry_loom`, and the process's
//! host-copy threads built on them ([`copy_pool`]), the one [`deadline`] that bounds a whole
//! exchange with a peer, and the lock guard that releases its lock before what its holder left
//! behind runs ([`unlock_first`]).
//!
//! The module exists so that what runs on host threads, and knows nothing of the device, the
//! engine or memory, sits apart from the levels that use it. It depends only on the errors.
//!
//! The copy threads' hand-off ([`copy_pool`]) and the blocking routes' index hand-out and
//! part publication (`routes::host::blocking`) are lock-free protocols written by hand. Their tests
//! with real threads only sample the schedules the machine happens to produce; loom runs a model
//! under every interleaving (and every value a weak memory order lets a load see) and fails on a
//! data race, a lost wake-up or a deadlock. For that, the protocols use these names instead of
//! `std`'s, and a loom build swaps them for loom's instrumented versions; nothing else changes.
//!
//! The cfg is `cuferry_loom`, not the usual `loom`: dependencies of the crate's tests (tokio
//! among them) change their own code under `cfg(loom)` and would not build with it set.
//! The models run with
//! `RUSTFLAGS="--cfg cuferry_loom" CARGO_TARGET_DIR=target/loom cargo test --release --lib loom`
//! (`scripts/test.sh` runs them).
//!
//! Two names differ from `std`'s in shape: [`UnsafeCell`] is reached through `with_mut`, as
//! loom's is (loom checks every access against the happens-before order), and a wait that spins
//! pauses through a [`SpinWait`] (in an ordinary build exactly `spin_loop` and `yield_now`;
//! under loom, yields to the model's scheduler that keep a model with two waiting threads
//! finite).

pub(crate) mod copy_pool;
pub(crate) mod deadline;
pub(crate) mod unlock_first;

#[cfg(not(cuferry_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering, fence};
#[cfg(not(cuferry_loom))]
#[allow(unused_imports)] // `Arc` is for the models; a protocol's lock must come from here.
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

#[cfg(cuferry_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering, fence};
#[cfg(cuferry_loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

/// Threads: spawning, parking and unparking, yielding.
pub(crate) mod thread {
    #[cfg(not(cuferry_loom))]
    #[allow(unused_imports)] // `JoinHandle` is kept only by a loom build's pool.
    pub(crate) use std::thread::{Builder, JoinHandle, Thread, park, yield_now};

    #[cfg(cuferry_loom)]
    #[allow(unused_imports)]
    pub(crate) use loom::thread::{Builder, JoinHandle, Thread, park, yield_now};
}

/// Hints to the processor (under loom, to the model's scheduler).
pub(crate) mod hint {
    #[cfg(not(cuferry_loom))]
    pub(crate) use std::hint::spin_loop;

    #[cfg(cuferry_loom)]
    pub(crate) use loom::hint::spin_loop;
}

/// An `Arc<[T]>` of `items` (loom's `Arc` is built from std's for unsized values).
pub(crate) fn arc_slice<T>(items: impl IntoIterator<Item = T>) -> Arc<[T]> {
    let all: std::sync::Arc<[T]> = items.into_iter().collect();
    #[cfg(cuferry_loom)]
    let all = Arc::from_std(all);
    all
}

/// A cell whose contents are reached through a raw pointer handed to a closure, as loom's
/// `UnsafeCell` is: loom checks each access, `std`'s needs no check.
#[cfg(not(cuferry_loom))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(cuferry_loom))]
impl<T> UnsafeCell<T> {
    /// A cell holding `value`.
    pub(crate) const fn new(value: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(value))
    }

    /// Calls `f` with a pointer to the contents; the caller's protocol decides when it may
    /// write through it.
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(cuferry_loom)]
pub(crate) use loom::cell::UnsafeCell;

/// The pause between two looks of a wait that spins: a processor hint while spinning, the core
/// given up while yielding. In an ordinary build exactly `std::hint::spin_loop` and
/// `std::thread::yield_now`.
#[cfg(not(cuferry_loom))]
#[derive(Debug, Default)]
pub(crate) struct SpinWait;

#[cfg(not(cuferry_loom))]
impl SpinWait {
    /// A new wait.
    pub(crate) fn new() -> Self {
        SpinWait
    }

    /// A pause that spins.
    #[inline]
    pub(crate) fn spin(&mut self) {
        hint::spin_loop();
    }

    /// A pause that yields the core.
    #[inline]
    pub(crate) fn yield_now(&mut self) {
        thread::yield_now();
    }
}

/// Under loom, every pause yields to the model's scheduler (loom explores a spin loop only if it
/// is told the thread waits for another one).
///
/// After [`SpinWait::FAIR_LOOKS`] pauses of one wait, the model stops exploring other schedules
/// for the rest of the execution (`loom::skip_branch`) and finishes it on loom's default one,
/// which runs the threads that yielded least first. Without that, a model in which two threads
/// wait at once never ends: loom cannot tell two threads yielding to each other from progress,
/// and explores their ping-pong forever. Nothing is lost by it: a wait only loads, so every
/// schedule past that point is also reached by one in which the waiting thread looked fewer
/// times; and a wait that can never end (a lost wake-up) still never ends on the default
/// schedule, which loom reports.
#[cfg(cuferry_loom)]
#[derive(Debug, Default)]
pub(crate) struct SpinWait {
    looks: u32,
}

#[cfg(cuferry_loom)]
impl SpinWait {
    /// Pauses of one wait after which the model stops exploring other schedules.
    const FAIR_LOOKS: u32 = 3;

    /// A new wait.
    pub(crate) fn new() -> Self {
        SpinWait::default()
    }

    /// A pause that would spin.
    pub(crate) fn spin(&mut self) {
        self.looks += 1;
        if self.looks == Self::FAIR_LOOKS {
            loom::skip_branch();
        }
        // Loom's spin-loop hint is its yield.
        hint::spin_loop();
    }

    /// A pause that would yield the core.
    pub(crate) fn yield_now(&mut self) {
        self.spin();
    }
}
