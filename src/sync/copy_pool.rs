//! The host-copy threads: one pool per process, shared by every engine.
//!
//! The blocking routes split the host half of a staged transfer (copying into and out of pinned
//! chunks) across a pool of threads. There is one such pool in the process, built on first use
//! and never torn down, so a program with several engines does not start a pool per engine and
//! oversubscribe the host.
//!
//! Its size is fixed when it is built, in this order of precedence:
//!
//! 1. the value given to [`set_copy_threads`] before the pool was first used;
//! 2. the environment variable `CUFERRY_COPY_THREADS` (a whole number from 1 to 256; any other
//!    value is ignored), read once, on the first call into this module;
//! 3. the machine's rule ([`size_for_cores`]): all but a quarter of the cores the process may run
//!    on (leaving at least 2 to the application), at least 1 and at most 12.
//!
//! Each engine's [`StagingConfig::copy_threads`](crate::staging::StagingConfig::copy_threads) then caps how
//! many of these threads one of its transfers splits across.
//!
//! The threads are cheap to hand work to, because a mid-size transfer hands them work many times
//! in a few hundred microseconds (every chunk of a download is copied out by all of them): a
//! thread that finishes a task stays hot for [`HOT`], watching its slot, and only then parks. A
//! transfer claims idle threads, writes its task into their slots and runs its own part (the
//! lead) on the calling thread; it returns once every claimed thread has finished. (Hot threads
//! against threads that sleep between tasks: `docs/records/mid-size-transfers.md`.)
//!
//! The hand-off is lock-free code written by hand, so besides the threaded tests, loom models
//! (`loom_models` below; see [`crate::sync`] for how they are built and run) check it under every
//! interleaving: a join hands its task over and returns only after every helper is done with the
//! borrowed work, a parking thread never misses its wake-up, a panicking task is raised after
//! every helper finished and frees its slot, a lead that unwinds still waits, and two joins never
//! claim one thread twice. Four choices in it are deliberate:
//!
//! - **The park hand-shake uses fences.** A thread going cold stores `parked` then loads its
//!   slot; a claimer stores `READY` then loads `parked`; a sequentially consistent fence between
//!   each store and load guarantees that one of the two sees the other's store. (SeqCst loads
//!   and stores would do as well under the C++ model, but loom models them only as
//!   acquire/release, and reports a lost wake-up in that form that cannot happen; it models SeqCst
//!   fences exactly.)
//! - **The waits pace themselves.** One spin-loop hint per look, and past [`SPIN`] a yield every
//!   64 looks, rather than crossbeam's `Backoff`, whose spins double up to 64 hints between looks:
//!   joins took longer with it (`docs/records/mid-size-transfers.md`, run I).
//! - **Parking is `std`'s `park`/`unpark`,** not crossbeam's `Parker`: loom can run that one only
//!   with every crossbeam crate in the build switched by `--cfg crossbeam_loom` (crossbeam-epoch,
//!   through the benches' rayon, then needs its own loom feature), and its `unpark` of a parked
//!   thread takes a mutex and signals a condition variable where `std`'s (a futex on Linux) swaps
//!   one atomic and wakes. The `parked` flag already spares hot threads any unpark.
//! - **Each slot has cache lines of its own** (crossbeam's `CachePadded`): unpadded, a slot
//!   shares a line with its neighbours', so each claim takes a line another thread is watching,
//!   and joins with several helpers took longer (`docs/records/mid-size-transfers.md`, run I).
//!
//! Process state with no knowledge of any engine or of memory: it depends only on the errors and
//! the primitives beside it in [`crate::sync`].

use crate::error::{Error, Result, UsageError};
use crate::sync::thread::{self, Thread};
use crate::sync::{Arc, AtomicBool, AtomicU8, AtomicUsize, Ordering, arc_slice, fence};
use crate::sync::{SpinWait, UnsafeCell};
use crossbeam_utils::CachePadded;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable that sets the pool's size when the process does not.
pub(crate) const ENV: &str = "CUFERRY_COPY_THREADS";

/// The most copy threads the pool (or a transfer) may have.
pub(crate) const MAX_THREADS: usize = 256;

/// The most threads the machine's rule picks: more gained little on the reference host and take
/// cores from the application (`docs/records/blocking-staging.md`).
const RULE_MAX: usize = 12;

/// How long a copy thread keeps watching for its next task after finishing one, before it
/// parks: long enough to span the gaps inside a transfer and between back-to-back transfers, short
/// enough that an idle process does not keep cores busy. Waking a parked thread costs far more
/// than handing work to a hot one (`docs/records/mid-size-transfers.md`).
#[cfg_attr(cuferry_loom, allow(dead_code))]
pub(crate) const HOT: Duration = Duration::from_micros(300);

/// Within [`HOT`], how long a thread spins before it starts yielding its core between looks.
const SPIN: Duration = Duration::from_micros(50);

/// The shared pool, once built.
static POOL: OnceLock<CopyPool> = OnceLock::new();

/// The size asked for by [`set_copy_threads`]; held while the pool is built, so a request
/// cannot slip in between reading it and building.
static REQUESTED: Mutex<Option<usize>> = Mutex::new(None);

/// The size used when the process asks for none: the environment's, else the machine's.
static AUTOMATIC: OnceLock<usize> = OnceLock::new();

/// Pools built in this process (at most one; counted so tests can tell). A `std` atomic in every
/// build: bookkeeping outside the hand-off (and loom's atomics cannot be built in a `static`).
static BUILT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The pool size the machine's rule gives for `cores` cores: all but a quarter of them, leaving
/// the application at least 2, and between 1 and 12 threads.
///
/// On the 16-core reference host this is 12, the setting chosen by measurement there.
pub(crate) fn size_for_cores(cores: usize) -> usize {
    let reserve = (cores / 4).max(2);
    cores.saturating_sub(reserve).clamp(1, RULE_MAX)
}

/// The machine's cores, as far as this process may use them (affinity and cgroup quotas
/// included); 1 when unknown.
fn machine_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The size from the environment variable's value, when it is a whole number from 1 to 256.
fn parse_env(value: &str) -> Option<usize> {
    value
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|n| (1..=MAX_THREADS).contains(n))
}

fn automatic() -> usize {
    *AUTOMATIC.get_or_init(|| {
        std::env::var(ENV)
            .ok()
            .and_then(|v| parse_env(&v))
            .unwrap_or_else(|| size_for_cores(machine_cores()))
    })
}

fn requested() -> MutexGuard<'static, Option<usize>> {
    // The guarded value is a plain number, valid whatever a panicking holder left behind.
    REQUESTED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets the number of host-copy threads the process's shared pool will have.
///
/// The blocking routes ([`upload_tensor`](crate::upload_tensor),
/// [`download_tensor`](crate::download_tensor), [`download_tensor_into`](crate::download_tensor_into))
/// split the host half of a large transfer across one pool of threads shared by every engine in
/// the process. The pool is built on first use (the first blocking transfer of 512 KiB or more)
/// and keeps its size for the life of the process, so this must be called before that; it
/// overrides `CUFERRY_COPY_THREADS` and the machine's rule (see
/// [the staging settings](crate::guide::transfers#staging-settings)). It may be called more than
/// once before the pool is built: the last value counts.
///
/// # Errors
/// [`UsageError::InvalidSetting`](crate::error::UsageError::InvalidSetting) when `threads` is not between 1 and 256, or when the pool was
/// already built (its size is then unchanged and [`copy_threads`] says what it is).
///
/// ```
/// # fn main() -> Result<(), cuferry::Error> {
/// // At the start of `main`, before any transfer:
/// cuferry::staging::set_copy_threads(4)?;
/// assert_eq!(cuferry::staging::copy_threads(), 4);
/// # Ok(()) }
/// ```
pub fn set_copy_threads(threads: usize) -> Result<()> {
    if !(1..=MAX_THREADS).contains(&threads) {
        return Err(Error::Usage(UsageError::InvalidSetting {
            setting: "copy_threads",
            value: threads,
            reason: "must be between 1 and 256",
        }));
    }
    let mut requested = requested();
    if POOL.get().is_some() {
        return Err(Error::Usage(UsageError::InvalidSetting {
            setting: "copy_threads",
            value: threads,
            reason: "the shared copy threads are already running; set their number before the \
                     first transfer that uses them",
        }));
    }
    *requested = Some(threads);
    Ok(())
}

/// The number of host-copy threads in the process's shared pool: its size once built, else the
/// size it will be built with (the value given to [`set_copy_threads`], else
/// `CUFERRY_COPY_THREADS`, else the machine's rule).
///
/// This is also the default of [`StagingConfig::copy_threads`](crate::staging::StagingConfig::copy_threads).
pub fn copy_threads() -> usize {
    if let Some(pool) = POOL.get() {
        return pool.threads();
    }
    let requested = requested();
    match POOL.get() {
        Some(pool) => pool.threads(),
        None => requested.unwrap_or_else(automatic),
    }
}

/// The shared pool, built on first use.
///
/// # Errors
/// [`UsageError::InvalidSetting`](crate::error::UsageError::InvalidSetting) when the threads could not be started (the next call tries again).
pub(crate) fn pool() -> Result<&'static CopyPool> {
    if let Some(pool) = POOL.get() {
        return Ok(pool);
    }
    let requested = requested();
    if let Some(pool) = POOL.get() {
        return Ok(pool);
    }
    let threads = requested.unwrap_or_else(automatic);
    let pool = CopyPool::start(threads).map_err(|_| {
        Error::Usage(UsageError::InvalidSetting {
            setting: "copy_threads",
            value: threads,
            reason: "the host-copy threads could not be started",
        })
    })?;
    BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Only this thread can be here (it holds `REQUESTED`), so the pool just built is the one set.
    let pool = POOL.get_or_init(|| pool);
    drop(requested);
    Ok(pool)
}

/// A worker's slot: free, taken by a transfer that is writing its task, or holding a task to run.
const IDLE: u8 = 0;
const CLAIMED: u8 = 1;
const READY: u8 = 2;

/// Under loom, how many looks a free thread takes at its slot before it parks: time does not
/// pass in a model, so [`HOT`] and [`SPIN`] become a count, small enough to keep the models
/// short and large enough that both a hot hand-off and a parked one are explored.
#[cfg(cuferry_loom)]
const LOOKS_BEFORE_PARKING: u32 = 0;

/// The copy threads: one slot each, through which a transfer hands a thread its task.
pub(crate) struct CopyPool {
    /// Each slot on cache lines of its own: a claimer writing one slot does not take the line
    /// another thread is watching.
    workers: Arc<[CachePadded<Worker>]>,
    /// The threads, joined by `CopyPool::shutdown` (the process's pool is never shut down).
    #[cfg(all(test, cuferry_loom))]
    handles: Vec<thread::JoinHandle<()>>,
}

/// One copy thread's slot.
struct Worker {
    /// [`IDLE`], [`CLAIMED`] or [`READY`].
    state: AtomicU8,
    /// Whether the thread is parked (or about to park) and must be unparked to see a task.
    parked: AtomicBool,
    /// The task, written by the claimer between `CLAIMED` and `READY` and taken by the thread
    /// once it sees `READY`; nobody else touches it. A `READY` slot with no task tells the thread
    /// to end (only `CopyPool::shutdown` hands that over).
    task: UnsafeCell<Option<Task>>,
    /// The thread, to unpark it; set before the pool is published.
    thread: OnceLock<Thread>,
}

// SAFETY: `task` is the only field that is not `Sync`. Its accesses are ordered by `state`: only
// the transfer that moved `state` from `IDLE` to `CLAIMED` writes it, before storing `READY`
// (release); only the worker reads it, after loading `READY` (acquire), and it sets `IDLE` again
// (release, read by the next claimer's acquire) only after taking the task out. So no two
// threads ever touch it at once.
unsafe impl Sync for Worker {}

/// A task handed to a worker: the work to call and the latch to count down after it.
struct Task {
    work: *const (dyn Fn() + Sync + 'static),
    latch: *const Latch,
}

// SAFETY: the pointers are only dereferenced by the worker while the transfer that made them is
// blocked in `join`, which keeps both alive until the latch reaches zero; the work is `Sync`.
unsafe impl Send for Task {}

/// What a transfer waits on: its claimed workers still running, and whether one panicked.
struct Latch {
    pending: AtomicUsize,
    panicked: AtomicBool,
}

/// Where a free copy thread is in its watch over its slot: one spin-loop hint per look for
/// [`SPIN`], then a yield every 64 looks until [`HOT`] has passed, when it parks (the clock is
/// read every 64 looks). Under loom, time does not pass: the thread parks after
/// `LOOKS_BEFORE_PARKING` looks.
struct Idle {
    wait: SpinWait,
    #[cfg(not(cuferry_loom))]
    since: Instant,
    looks: u32,
}

impl Idle {
    fn new() -> Self {
        Idle {
            wait: SpinWait::new(),
            #[cfg(not(cuferry_loom))]
            since: Instant::now(),
            looks: 0,
        }
    }

    /// Pauses before the next look and returns `true`, or returns `false` once the thread has
    /// been idle for [`HOT`]: it should park.
    fn pause(&mut self) -> bool {
        #[cfg(not(cuferry_loom))]
        {
            self.looks = self.looks.wrapping_add(1);
            if self.looks.is_multiple_of(64) {
                let idle = self.since.elapsed();
                if idle >= HOT {
                    return false;
                }
                if idle >= SPIN {
                    self.wait.yield_now();
                    return true;
                }
            }
            self.wait.spin();
            true
        }
        #[cfg(cuferry_loom)]
        {
            // Always true while the constant is 0; raising it explores more hot looks.
            #[allow(clippy::absurd_extreme_comparisons)]
            if self.looks >= LOOKS_BEFORE_PARKING {
                return false;
            }
            self.looks += 1;
            self.wait.spin();
            true
        }
    }
}

/// Waits, when dropped (on return or unwind alike), until every worker counted in the latch has
/// finished its task: the task borrows the transfer's stack, which must outlive it. It spins for
/// [`SPIN`], then yields between looks.
struct WaitForWorkers<'a>(&'a Latch);

impl Drop for WaitForWorkers<'_> {
    fn drop(&mut self) {
        let start = Instant::now();
        let mut wait = SpinWait::new();
        while self.0.pending.load(Ordering::Acquire) != 0 {
            if start.elapsed() < SPIN {
                wait.spin();
            } else {
                wait.yield_now();
            }
        }
    }
}

impl CopyPool {
    /// Starts `threads` copy threads.
    fn start(threads: usize) -> std::io::Result<CopyPool> {
        let workers: Arc<[CachePadded<Worker>]> = arc_slice((0..threads).map(|_| {
            CachePadded::new(Worker {
                state: AtomicU8::new(IDLE),
                parked: AtomicBool::new(false),
                task: UnsafeCell::new(None),
                thread: OnceLock::new(),
            })
        }));
        #[cfg(all(test, cuferry_loom))]
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let all = Arc::clone(&workers);
            let handle = thread::Builder::new()
                .name(format!("cuferry-copy-{i}"))
                .spawn(move || run_worker(&all[i]))?;
            let _ = workers[i].thread.set(handle.thread().clone());
            #[cfg(all(test, cuferry_loom))]
            handles.push(handle);
        }
        Ok(CopyPool {
            workers,
            #[cfg(all(test, cuferry_loom))]
            handles,
        })
    }

    /// The pool's number of threads.
    pub(crate) fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Moves `worker`'s slot from `IDLE` to `CLAIMED`, if it is free.
    fn claim(worker: &Worker) -> bool {
        worker
            .state
            .compare_exchange(IDLE, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// Hands `task` to a worker whose slot this thread claimed, and wakes it if it parked.
    fn hand_over(worker: &Worker, task: Option<Task>) {
        // SAFETY: this thread moved the slot from IDLE to CLAIMED, so it alone may write the
        // task until it stores READY (see `Worker`).
        worker.task.with_mut(|slot| unsafe { *slot = task });
        worker.state.store(READY, Ordering::Release);
        // Pairs with the fence between the worker's `parked` store and its `state` load: either
        // the worker's fence comes first, and this sees it parked (and unparks it), or this one
        // does, and the worker sees READY before parking.
        fence(Ordering::SeqCst);
        if worker.parked.load(Ordering::Relaxed)
            && let Some(thread) = worker.thread.get()
        {
            thread.unpark();
        }
    }

    /// Runs `work` on up to `helpers` idle copy threads while the calling thread runs `lead`
    /// (given how many helpers it got, possibly none), and returns `lead`'s result once every
    /// helper has returned from `work`.
    ///
    /// `work` must return on its own once `lead` has returned or unwound (a helper waiting for
    /// something only the lead provides must also watch for the lead giving up), or this waits
    /// forever. A panic in `work` is raised again here, after every helper has finished.
    pub(crate) fn join<R>(
        &self,
        helpers: usize,
        work: &(dyn Fn() + Sync),
        lead: impl FnOnce(usize) -> R,
    ) -> R {
        let latch = Latch {
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        };
        // Created before the first hand-off, so whatever happens below, this frame (which the
        // tasks borrow) is not left until the helpers are done.
        let wait = WaitForWorkers(&latch);
        // SAFETY: only the lifetime is erased. The pointer is dereferenced by helpers counted in
        // the latch, and `wait` keeps this frame, and so `work`'s borrow, alive until they are
        // done.
        let work: *const (dyn Fn() + Sync + 'static) = unsafe { std::mem::transmute(work) };
        let mut claimed = 0;
        for worker in self.workers.iter() {
            if claimed == helpers {
                break;
            }
            if !Self::claim(worker) {
                continue;
            }
            latch.pending.fetch_add(1, Ordering::Relaxed);
            Self::hand_over(
                worker,
                Some(Task {
                    work,
                    latch: &latch,
                }),
            );
            claimed += 1;
        }
        let out = lead(claimed);
        drop(wait);
        if latch.panicked.load(Ordering::Relaxed) {
            panic!("a host-copy task panicked");
        }
        out
    }

    /// Ends every thread once it is free, and returns when they have ended. A model must end;
    /// the process's pool never does.
    #[cfg(all(test, cuferry_loom))]
    pub(crate) fn shutdown(self) {
        for worker in self.workers.iter() {
            let mut wait = SpinWait::new();
            while !Self::claim(worker) {
                wait.yield_now();
            }
            Self::hand_over(worker, None);
        }
        for handle in self.handles {
            handle
                .join()
                .expect("a copy thread catches its tasks' panics");
        }
    }
}

/// A copy thread: waits for a task in its slot, runs it, and waits again.
fn run_worker(me: &Worker) {
    loop {
        wait_for_task(me);
        // SAFETY: READY was loaded with acquire ordering, so the claimer's write of the task is
        // visible, and the claimer touches the slot no more (see `Worker`).
        let Some(Task { work, latch }) = me.task.with_mut(|slot| unsafe { (*slot).take() }) else {
            // The pool is shut down (see `CopyPool::shutdown`).
            return;
        };
        // SAFETY: the transfer that handed over the task waits in `join` until the latch
        // reaches zero, so `work` and `latch` are alive until the count down below.
        let ran = catch_unwind(AssertUnwindSafe(|| unsafe { (*work)() }));
        // SAFETY: as above: the count down is the last use of the latch.
        let latch = unsafe { &*latch };
        if ran.is_err() {
            latch.panicked.store(true, Ordering::Relaxed);
        }
        me.state.store(IDLE, Ordering::Release);
        latch.pending.fetch_sub(1, Ordering::Release);
    }
}

/// Returns once the slot holds a task: spinning for [`SPIN`], then yielding between looks until
/// [`HOT`] has passed, then parked until a claimer unparks the thread.
fn wait_for_task(me: &Worker) {
    let mut idle = Idle::new();
    loop {
        if me.state.load(Ordering::Acquire) == READY {
            return;
        }
        if idle.pause() {
            continue;
        }
        me.parked.store(true, Ordering::Relaxed);
        // Pairs with the fence in `CopyPool::hand_over`: either this fence comes first and the
        // claimer sees `parked` (and unparks), or the claimer's does and this sees READY.
        fence(Ordering::SeqCst);
        if me.state.load(Ordering::Relaxed) != READY {
            thread::park();
        }
        // A claimer that still sees `parked` unparks in vain: the next `park` returns at once.
        me.parked.store(false, Ordering::Relaxed);
        idle = Idle::new();
    }
}

/// How many pools this process has built (0 or 1).
#[cfg(test)]
pub(crate) fn pools_built() -> usize {
    BUILT.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_leaves_a_quarter_of_the_cores_and_at_least_two() {
        let table = [
            (1, 1),
            (2, 1),
            (3, 1),
            (4, 2),
            (6, 4),
            (8, 6),
            (12, 9),
            (16, 12),
            (24, 12),
            (128, 12),
        ];
        for (cores, threads) in table {
            assert_eq!(size_for_cores(cores), threads, "{cores} cores");
        }
    }

    #[test]
    fn the_default_size_follows_the_rule_on_this_machine() {
        // Nothing in the crate's unit tests sets the size; the environment may.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let expected = std::env::var(ENV)
            .ok()
            .and_then(|v| parse_env(&v))
            .unwrap_or(size_for_cores(cores));
        assert_eq!(copy_threads(), expected);
        let pool = pool().unwrap();
        assert_eq!(pool.threads(), expected);
        assert_eq!(copy_threads(), expected);
    }

    #[test]
    fn join_runs_the_work_on_claimed_threads_and_waits_for_them() {
        let pool = CopyPool::start(3).unwrap();
        for round in 0..50 {
            let done = AtomicUsize::new(0);
            let names = Mutex::new(Vec::new());
            let work = || {
                std::thread::sleep(Duration::from_micros(round % 7 * 100));
                let name = std::thread::current().name().map(str::to_owned);
                names.lock().unwrap().push(name);
                done.fetch_add(1, Ordering::Relaxed);
            };
            let helpers = pool.join(3, &work, |helpers| helpers);
            assert_eq!(
                helpers, 3,
                "round {round}: every thread is idle between joins"
            );
            // Every helper finished before `join` returned.
            assert_eq!(done.load(Ordering::Relaxed), 3);
            let names = names.into_inner().unwrap();
            assert!(
                names
                    .iter()
                    .all(|n| n.as_deref().is_some_and(|n| n.starts_with("cuferry-copy-")))
            );
            // Rounds far apart find the threads parked, and still wake them.
            if round % 10 == 9 {
                std::thread::sleep(HOT * 3);
            }
        }
    }

    #[test]
    fn concurrent_joins_share_the_threads_and_never_claim_one_twice() {
        let pool = CopyPool::start(4).unwrap();
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let ran = AtomicUsize::new(0);
                        let work = || {
                            ran.fetch_add(1, Ordering::Relaxed);
                        };
                        let helpers = pool.join(4, &work, |helpers| {
                            work();
                            helpers
                        });
                        assert!(helpers <= 4);
                        assert_eq!(ran.load(Ordering::Relaxed), helpers + 1);
                        total.fetch_add(helpers + 1, Ordering::Relaxed);
                    }
                });
            }
        });
        assert!(total.load(Ordering::Relaxed) >= 800);
    }

    #[test]
    fn a_panicking_task_is_raised_in_the_caller_after_every_helper_finished() {
        let pool = CopyPool::start(2).unwrap();
        let finished = AtomicUsize::new(0);
        let which = AtomicUsize::new(0);
        let work = || {
            if which.fetch_add(1, Ordering::Relaxed) == 0 {
                panic!("a task fails");
            }
            std::thread::sleep(Duration::from_millis(5));
            finished.fetch_add(1, Ordering::Relaxed);
        };
        let raised = catch_unwind(AssertUnwindSafe(|| pool.join(2, &work, |_| ())));
        assert!(raised.is_err());
        assert_eq!(finished.load(Ordering::Relaxed), 1);
        // The threads survive a panicking task.
        let ran = AtomicUsize::new(0);
        let work = || {
            ran.fetch_add(1, Ordering::Relaxed);
        };
        assert_eq!(pool.join(2, &work, |helpers| helpers), 2);
        assert_eq!(ran.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_panicking_lead_still_waits_for_the_helpers() {
        let pool = CopyPool::start(2).unwrap();
        let stop = AtomicBool::new(false);
        let finished = AtomicUsize::new(0);
        let work = || {
            while !stop.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            finished.fetch_add(1, Ordering::Relaxed);
        };
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let raised = catch_unwind(AssertUnwindSafe(|| {
            pool.join(2, &work, |_| {
                let _stop = Stop(&stop);
                panic!("the lead fails");
            })
        }));
        assert!(raised.is_err());
        assert_eq!(finished.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn the_environment_value_must_be_a_whole_number_from_1_to_256() {
        assert_eq!(parse_env("6"), Some(6));
        assert_eq!(parse_env(" 256 "), Some(256));
        for bad in ["", "0", "257", "-1", "four", "2.5"] {
            assert_eq!(parse_env(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn out_of_range_requests_are_refused() {
        for bad in [0, MAX_THREADS + 1] {
            assert!(matches!(
                set_copy_threads(bad),
                Err(Error::Usage(UsageError::InvalidSetting {
                    setting: "copy_threads",
                    ..
                }))
            ));
        }
    }
}

/// The copy threads' protocols under every interleaving loom can reach (see `crate::sync`).
#[cfg(all(test, cuferry_loom))]
mod loom_models {
    use super::*;

    /// Runs `f` under loom with a pool of `threads` copy threads, its preemptions bounded: 3
    /// with one copy thread, 2 with two (every order of their hand-offs needs no more; with 3 a
    /// model of two threads takes about 15 s instead of 1).
    fn check(threads: usize, f: impl Fn(CopyPool) + Sync + Send + 'static) {
        quiet_panics();
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(if threads == 1 { 3 } else { 2 });
        builder.check(move || f(CopyPool::start(threads).unwrap()));
    }

    /// The panics the models raise on purpose are not printed (once per explored schedule);
    /// every other panic, loom's reports included, is.
    fn quiet_panics() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let report = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                let payload = info.payload();
                let message = payload
                    .downcast_ref::<&str>()
                    .copied()
                    .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
                if !matches!(
                    message,
                    Some("a task fails" | "the lead fails" | "a host-copy task panicked")
                ) {
                    report(info);
                }
            }));
        });
    }

    /// Work that marks one of `marks` per call (each call claims the next): a helper's write
    /// that `join`'s return does not follow is a race loom reports when the lead reads it.
    struct Marks {
        next: AtomicUsize,
        marks: Vec<UnsafeCell<usize>>,
    }

    // SAFETY: each cell is written by the one call that claimed its index, and read only after
    // the helpers are done; loom checks both.
    unsafe impl Sync for Marks {}

    impl Marks {
        fn new(n: usize) -> Self {
            Marks {
                next: AtomicUsize::new(0),
                marks: (0..n).map(|_| UnsafeCell::new(0)).collect(),
            }
        }

        /// Marks the next cell; returns its index.
        fn mark(&self) -> usize {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            // SAFETY: each index is taken by one call only; the lead reads the cells after
            // `join` returned, which loom checks follows every write.
            self.marks[i].with_mut(|m| unsafe { *m += 1 });
            i
        }

        /// How many cells were marked, once each (as the lead, after `join`: written through
        /// `with_mut`, so loom checks every helper's write happened before).
        fn marked(&self) -> usize {
            let taken = self.next.load(Ordering::Relaxed).min(self.marks.len());
            for cell in &self.marks[..taken] {
                // SAFETY: the helpers are done (that is what the model checks).
                cell.with_mut(|m| assert_eq!(unsafe { *m }, 1));
            }
            taken
        }
    }

    fn every_slot_is_idle(pool: &CopyPool) -> bool {
        pool.workers
            .iter()
            .all(|w| w.state.load(Ordering::Relaxed) == IDLE)
    }

    /// (a) The task reaches every claimed thread, and `join` returns only after each has
    /// finished with the work it borrowed.
    #[test]
    fn loom_join_hands_over_and_returns_after_every_helper() {
        for helpers in [1, 2] {
            check(helpers, move |pool| {
                let marks = Marks::new(helpers);
                let work = || {
                    marks.mark();
                };
                let claimed = pool.join(helpers, &work, |claimed| claimed);
                assert_eq!(claimed, helpers, "every thread is idle");
                assert_eq!(marks.marked(), helpers);
                assert!(every_slot_is_idle(&pool));
                pool.shutdown();
            });
        }
    }

    /// (b) A thread that goes cold after a task and parks still sees the next hand-off: the
    /// claimer unparks it or it sees the task before parking. A lost wake-up leaves the second
    /// hand-off (or the shutdown's) waiting forever, which loom reports as a deadlock.
    #[test]
    fn loom_a_parking_thread_never_misses_its_wake_up() {
        check(1, |pool| {
            for _ in 0..2 {
                let marks = Marks::new(1);
                let work = || {
                    marks.mark();
                };
                assert_eq!(pool.join(1, &work, |claimed| claimed), 1);
                assert_eq!(marks.marked(), 1);
            }
            pool.shutdown();
        });
    }

    /// (c) A panic in a helper's task is raised in the caller, after every helper finished, and
    /// leaves every slot free for the next transfer.
    #[test]
    fn loom_a_panicking_task_is_raised_after_every_helper_and_frees_its_slot() {
        check(2, |pool| {
            let marks = Marks::new(2);
            let work = || {
                if marks.mark() == 0 {
                    panic!("a task fails");
                }
            };
            let raised = catch_unwind(AssertUnwindSafe(|| pool.join(2, &work, |_| ())));
            let message = raised.expect_err("the task's panic is raised in the caller");
            assert_eq!(
                message.downcast_ref::<&str>(),
                Some(&"a host-copy task panicked")
            );
            assert_eq!(marks.marked(), 2, "the other helper finished first");
            assert!(every_slot_is_idle(&pool));
            pool.shutdown();
        });
    }

    /// (d) A lead that unwinds still waits, in `join`, for every helper to finish with the
    /// work it borrowed: helpers that only work, and a helper that waits for the lead to let it
    /// go (as a download's helpers wait for its marks), let go by the lead's guard on unwind.
    #[test]
    fn loom_a_lead_that_unwinds_waits_for_its_helpers() {
        check(2, |pool| {
            let marks = Marks::new(2);
            let work = || {
                marks.mark();
            };
            let raised = catch_unwind(AssertUnwindSafe(|| {
                pool.join(2, &work, |_| panic!("the lead fails"))
            }));
            assert!(raised.is_err());
            assert_eq!(marks.marked(), 2);
            assert!(every_slot_is_idle(&pool));
            pool.shutdown();
        });
        check(2, |pool| {
            let marks = Marks::new(2);
            let stop = AtomicBool::new(false);
            let work = || {
                let mut wait = SpinWait::new();
                while !stop.load(Ordering::Acquire) {
                    wait.spin();
                }
                marks.mark();
            };
            struct Release<'a>(&'a AtomicBool);
            impl Drop for Release<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Release);
                }
            }
            let raised = catch_unwind(AssertUnwindSafe(|| {
                pool.join(2, &work, |_| {
                    let _release = Release(&stop);
                    panic!("the lead fails");
                })
            }));
            assert!(raised.is_err());
            assert_eq!(marks.marked(), 2);
            assert!(every_slot_is_idle(&pool));
            pool.shutdown();
        });
    }

    /// (e) Two transfers joining at once never claim one thread twice: each gets back exactly
    /// the helpers it handed its task to, and each of those runs its task once. One copy thread,
    /// which both want: the race that matters, a second claim of a busy slot, is the one every
    /// schedule offers (with two threads the model runs for many minutes).
    #[test]
    fn loom_concurrent_joins_never_claim_one_thread_twice() {
        const THREADS: usize = 1;
        check(THREADS, |pool| {
            let pool = Arc::new(pool);
            let join_once = |pool: &CopyPool| {
                let marks = Marks::new(THREADS);
                let work = || {
                    marks.mark();
                };
                let claimed = pool.join(THREADS, &work, |claimed| claimed);
                assert_eq!(marks.marked(), claimed);
            };
            let other = {
                let pool = Arc::clone(&pool);
                thread::Builder::new()
                    .spawn(move || join_once(&pool))
                    .unwrap()
            };
            join_once(&pool);
            other.join().unwrap();
            let pool = Arc::try_unwrap(pool).unwrap_or_else(|_| panic!("the other lead is done"));
            assert!(every_slot_is_idle(&pool));
            pool.shutdown();
        });
    }
}
