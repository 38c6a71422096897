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
//! Each engine's [`StagingConfig::copy_threads`](crate::StagingConfig::copy_threads) then caps how
//! many of these threads one of its transfers splits across.
//!
//! Process state with no knowledge of any engine: it depends only on the errors.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The environment variable that sets the pool's size when the process does not.
pub(crate) const ENV: &str = "CUFERRY_COPY_THREADS";

/// The most copy threads the pool (or a transfer) may have.
pub(crate) const MAX_THREADS: usize = 256;

/// The most threads the machine's rule picks: on the H200 reference host 16 threads gained at
/// most about 16% over 12 on 256 MiB transfers and were slower on 8 MiB ones, where every
/// chunk's fork-join wakes them all (`docs/records/blocking-staging.md`).
const RULE_MAX: usize = 12;

/// The shared pool, once built.
static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();

/// The size asked for by [`set_copy_threads`]; held while the pool is built, so a request
/// cannot slip in between reading it and building.
static REQUESTED: Mutex<Option<usize>> = Mutex::new(None);

/// The size used when the process asks for none: the environment's, else the machine's.
static AUTOMATIC: OnceLock<usize> = OnceLock::new();

/// Pools built in this process (at most one; counted so tests can tell).
static BUILT: AtomicUsize = AtomicUsize::new(0);

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
/// [`Error::InvalidSetting`] when `threads` is not between 1 and 256, or when the pool was
/// already built (its size is then unchanged and [`copy_threads`] says what it is).
///
/// ```
/// # fn main() -> Result<(), cuferry::Error> {
/// // At the start of `main`, before any transfer:
/// cuferry::set_copy_threads(4)?;
/// assert_eq!(cuferry::copy_threads(), 4);
/// # Ok(()) }
/// ```
pub fn set_copy_threads(threads: usize) -> Result<()> {
    if !(1..=MAX_THREADS).contains(&threads) {
        return Err(Error::InvalidSetting {
            setting: "copy_threads",
            value: threads,
            reason: "must be between 1 and 256",
        });
    }
    let mut requested = requested();
    if POOL.get().is_some() {
        return Err(Error::InvalidSetting {
            setting: "copy_threads",
            value: threads,
            reason: "the shared copy threads are already running; set their number before the \
                     first transfer that uses them",
        });
    }
    *requested = Some(threads);
    Ok(())
}

/// The number of host-copy threads in the process's shared pool: its size once built, else the
/// size it will be built with (the value given to [`set_copy_threads`], else
/// `CUFERRY_COPY_THREADS`, else the machine's rule).
///
/// This is also the default of [`StagingConfig::copy_threads`](crate::StagingConfig::copy_threads).
pub fn copy_threads() -> usize {
    if let Some(pool) = POOL.get() {
        return pool.current_num_threads();
    }
    let requested = requested();
    match POOL.get() {
        Some(pool) => pool.current_num_threads(),
        None => requested.unwrap_or_else(automatic),
    }
}

/// The shared pool, built on first use.
///
/// # Errors
/// [`Error::InvalidSetting`] when the threads could not be started (the next call tries again).
pub(crate) fn pool() -> Result<&'static rayon::ThreadPool> {
    if let Some(pool) = POOL.get() {
        return Ok(pool);
    }
    let requested = requested();
    if let Some(pool) = POOL.get() {
        return Ok(pool);
    }
    let threads = requested.unwrap_or_else(automatic);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("cuferry-copy-{i}"))
        .build()
        .map_err(|_| Error::InvalidSetting {
            setting: "copy_threads",
            value: threads,
            reason: "the host-copy threads could not be started",
        })?;
    BUILT.fetch_add(1, Ordering::Relaxed);
    // Only this thread can be here (it holds `REQUESTED`), so the pool just built is the one set.
    let pool = POOL.get_or_init(|| pool);
    drop(requested);
    Ok(pool)
}

/// How many pools this process has built (0 or 1).
#[cfg(test)]
pub(crate) fn pools_built() -> usize {
    BUILT.load(Ordering::Relaxed)
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
        assert_eq!(crate::StagingConfig::default().copy_threads, expected);
        let pool = pool().unwrap();
        assert_eq!(pool.current_num_threads(), expected);
        assert_eq!(copy_threads(), expected);
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
                Err(Error::InvalidSetting {
                    setting: "copy_threads",
                    ..
                })
            ));
        }
    }
}
