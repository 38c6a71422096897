//! One engine per device ordinal per process, opened on first use and kept until the process
//! ends.
//!
//! PyTorch users think in devices, not engines: `cuferry.load(path, device=1)` should not open
//! a context and streams on every call, and the tensors it returns must be freed through the
//! engine that made them. So the module keeps a registry, `ordinal -> Arc<Mutex<CudaEngine>>`;
//! each [`Tensor`](crate::tensor::Tensor) holds the `Arc` of its engine, so a tensor never asks
//! the registry again and outlives nothing it needs.
//!
//! Every wait for an engine's mutex happens detached from the interpreter (the callers run it
//! inside `Python::detach`), and a thread that holds an engine re-attaches only to run a load's
//! `select` and `progress` callbacks. A callback that called back into cuferry would wait for an
//! engine its own thread holds (or, across two threads and two devices, for each other's), so
//! [`lock`] refuses any engine to a thread that already holds one: the callback's call raises
//! `cuferry.UsageError` instead of hanging.

use crate::errors::Failure;
use cuferry::CudaEngine;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

/// An engine shared by the tensors it made and the calls that use it.
pub(crate) type Shared = Arc<Mutex<CudaEngine>>;

/// The engines of the real devices, by ordinal.
static ENGINES: LazyLock<Mutex<HashMap<usize, Shared>>> = LazyLock::new(Default::default);

/// Whether [`_use_simulator`] was called: later calls use simulated devices.
#[cfg(feature = "sim")]
static SIMULATE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The engines of the simulated devices, by ordinal.
#[cfg(feature = "sim")]
static SIMULATED: LazyLock<Mutex<HashMap<usize, Shared>>> = LazyLock::new(Default::default);

thread_local! {
    /// How many engines this thread holds now.
    static HOLDING: Cell<usize> = const { Cell::new(0) };
}

/// The engine of device `ordinal`, opened if this is its first use. Run detached: opening a
/// device takes a while, and the registry's lock may be held by another thread opening one.
///
/// # Errors
/// The crate's, from `CudaEngine::open`, with the ordinal named.
pub(crate) fn engine(ordinal: usize) -> Result<Shared, Failure> {
    #[cfg(feature = "sim")]
    if SIMULATE.load(std::sync::atomic::Ordering::Acquire) {
        let mut map = SIMULATED.lock().unwrap_or_else(PoisonError::into_inner);
        let engine = map.entry(ordinal).or_insert_with(|| {
            let config = cuferry::sim::SimConfig {
                ordinal,
                ..Default::default()
            };
            Arc::new(Mutex::new(CudaEngine::simulated(config)))
        });
        return Ok(Arc::clone(engine));
    }
    let mut map = ENGINES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(engine) = map.get(&ordinal) {
        return Ok(Arc::clone(engine));
    }
    let engine = CudaEngine::open(ordinal).map_err(|error| Failure::Open { ordinal, error })?;
    let engine = Arc::new(Mutex::new(engine));
    map.insert(ordinal, Arc::clone(&engine));
    Ok(engine)
}

/// An engine held by this thread; counted in [`HOLDING`] while it lives.
pub(crate) struct Held<'a> {
    guard: MutexGuard<'a, CudaEngine>,
}

impl std::ops::Deref for Held<'_> {
    type Target = CudaEngine;
    fn deref(&self) -> &CudaEngine {
        &self.guard
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut CudaEngine {
        &mut self.guard
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        HOLDING.with(|h| h.set(h.get() - 1));
    }
}

/// Locks `engine` for this thread. Run detached.
///
/// A poisoned mutex is taken as it is: the crate's operations leave an engine usable after a
/// panic (what a panic interrupted is leaked, never released), and the panic itself was raised
/// to Python as `pyo3_runtime.PanicException` when it happened.
///
/// # Errors
/// [`Failure::Reentered`] when this thread already holds an engine: a load's callback called
/// back into cuferry.
pub(crate) fn lock(engine: &Shared) -> Result<Held<'_>, Failure> {
    if HOLDING.with(Cell::get) > 0 {
        return Err(Failure::Reentered);
    }
    let guard = engine.lock().unwrap_or_else(PoisonError::into_inner);
    HOLDING.with(|h| h.set(h.get() + 1));
    Ok(Held { guard })
}

/// Makes later calls use simulated devices (one per ordinal, made on first use) instead of
/// CUDA's; engines opened before stay as they are. Only in a build with the cargo feature `sim`,
/// for tests without a GPU.
#[cfg(feature = "sim")]
#[pyo3::pyfunction]
pub(crate) fn _use_simulator() {
    SIMULATE.store(true, std::sync::atomic::Ordering::Release);
}
