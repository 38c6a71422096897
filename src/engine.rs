//! `CudaEngine`: one device, one context, one stream, held by the caller.
//!
//! The engine is the unit of ownership. It holds the driver (behind the device seam), the
//! stream every operation is queued on, and the per-engine caches and pools. Operations borrow it
//! `&mut`, so a chain of dependent operations is a chain of calls with no entry protocol and no
//! implicit host barrier: [`CudaEngine::flush`] is a submission boundary that reports failures
//! without waiting, and [`CudaEngine::synchronize`] is the one explicit host barrier.
//!
//! Values the engine hands out (tensors, pinned buffers, pending transfers) keep the engine's
//! shared core alive through an `Arc`, so a value dropped after the engine still frees its memory
//! on the right device, stream-ordered, and never early.

use crate::driver::{ContextHandle, Driver};
use crate::error::{DeviceId, Error, Result};
use crate::pinned::{PinnedPool, PinnedPoolStats};
use crate::retire::{EventPool, RetireQueue, RetirementStats};
use crate::transfer::staging::StagingRing;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// The state shared between an engine and the values it handed out.
pub(crate) struct Shared {
    /// Unique per engine, so values are never used on another engine's stream.
    pub(crate) engine_id: u64,
    pub(crate) device: DeviceId,
    state: Mutex<State>,
}

/// What the mutex guards: the driver and everything that must change together with it.
pub(crate) struct State {
    pub(crate) driver: Box<dyn Driver>,
    /// Failures recorded where they could not be reported (drops), for the next boundary.
    pub(crate) deferred: Vec<Error>,
    /// Set once the engine has been dropped.
    pub(crate) torn_down: bool,
    /// Idle pinned host blocks for reuse.
    pub(crate) pinned: PinnedPool,
    /// Idle events for reuse.
    pub(crate) events: EventPool,
    /// Resources waiting for their event before release.
    pub(crate) retire: RetireQueue,
    /// The pinned staging ring of the blocking routes.
    pub(crate) staging: StagingRing,
    /// Compiled elementwise kernels, by operation and element type(s).
    pub(crate) kernels: crate::kernels::KernelCache,
    /// cuBLAS/cuSOLVER/cuTENSOR handles, made on first use and bound to the stream.
    pub(crate) vendor: crate::vendor::VendorHandles,
}

impl State {
    /// Records a failure for the next `flush` or `synchronize`.
    pub(crate) fn defer(&mut self, error: Error) {
        self.deferred.push(error);
    }

    /// Waits until everything queued so far has completed, through a pooled event (a cheaper
    /// wait than a stream synchronize, and the same proof). If the event cannot be recorded it
    /// falls back to a stream synchronize, so on `Ok` the queued work has completed either way.
    #[cfg(feature = "cubecl")]
    pub(crate) fn wait_stream(&mut self, what: &'static str) -> Result<()> {
        let fault = |source| Error::DeviceFault { what, source };
        let event = self.events.take(&mut *self.driver)?;
        let waited = match self.driver.event_record(event) {
            Ok(()) => self.driver.event_synchronize(event).map_err(fault),
            Err(_) => self.driver.stream_synchronize().map_err(fault),
        };
        if waited.is_ok() {
            self.events.put(event);
        }
        // A failed event is not reused (its state is unknown); it is leaked.
        waited
    }

    fn take_deferred(&mut self) -> Result<()> {
        let mut errors = std::mem::take(&mut self.deferred);
        if errors.is_empty() {
            return Ok(());
        }
        let count = errors.len();
        Err(Error::Deferred {
            count,
            first: Box::new(errors.swap_remove(0)),
        })
    }
}

/// The engine's state, locked, with the engine's context current on this thread. Dropping it
/// restores whatever context was current before.
pub(crate) struct Entered<'a> {
    guard: MutexGuard<'a, State>,
    previous: Option<ContextHandle>,
}

impl Deref for Entered<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl DerefMut for Entered<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            if let Err(source) = self.guard.driver.set_current_context(previous) {
                self.guard.defer(Error::Driver {
                    call: "cuCtxSetCurrent (restore)",
                    source,
                });
            }
        }
    }
}

impl Shared {
    pub(crate) fn lock_raw(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held leaves no half-made driver state behind (every driver
        // call is atomic), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks the state and makes the engine's context current for the duration.
    pub(crate) fn enter(&self) -> Result<Entered<'_>> {
        let guard = self.lock_raw();
        let ctx = guard.driver.context();
        let current = guard
            .driver
            .current_context()
            .map_err(Error::driver("cuCtxGetCurrent"))?;
        let previous = if current == ctx {
            None
        } else {
            guard
                .driver
                .set_current_context(ctx)
                .map_err(Error::driver("cuCtxSetCurrent"))?;
            Some(current)
        };
        Ok(Entered { guard, previous })
    }

    /// Like [`Shared::enter`], for drop paths: on failure the caller leaks what it would have
    /// released, and the failure is recorded for the next boundary.
    pub(crate) fn enter_for_drop(&self) -> Option<Entered<'_>> {
        match self.enter() {
            Ok(entered) => Some(entered),
            Err(e) => {
                self.lock_raw().defer(e);
                None
            }
        }
    }

    /// Checks that a value made by engine `engine_id` on `device` may be used on this engine.
    pub(crate) fn check_owner(&self, device: DeviceId, engine_id: u64) -> Result<()> {
        if device != self.device {
            return Err(Error::WrongDevice {
                expected: self.device,
                found: device,
            });
        }
        if engine_id != self.engine_id {
            return Err(Error::WrongEngine {
                expected: self.engine_id,
                found: engine_id,
            });
        }
        Ok(())
    }
}

/// A CUDA device, its primary context and one stream, held by the caller.
///
/// Open one per device and per independent stream of work, keep it, and pass it `&mut` to every
/// operation. Nothing waits for the device unless you ask: operations queue on the engine's
/// stream in call order; [`flush`](Self::flush) reports failures at a boundary you choose without
/// waiting; [`synchronize`](Self::synchronize) is the host barrier.
///
/// Dropping the engine waits for its stream, releases what it retained, and never panics or
/// reports. If that final wait fails, everything the device may still touch is leaked rather
/// than freed.
pub struct CudaEngine {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine")
            .field("device", &self.shared.device)
            .field("engine", &self.shared.engine_id)
            .finish()
    }
}

impl CudaEngine {
    /// Opens CUDA device `ordinal`: retains its primary context and creates the engine's stream.
    ///
    /// # Errors
    /// [`Error::NoDriver`] when the machine has no CUDA driver library, [`Error::NoSuchDevice`]
    /// when the ordinal does not exist, [`Error::Driver`] when the driver refuses.
    pub fn open(ordinal: usize) -> Result<Self> {
        let driver = crate::driver::cuda::CudaDriver::open(ordinal)?;
        Ok(Self::from_driver(Box::new(driver)))
    }

    /// Opens an engine on a fresh simulated device (feature `sim`).
    #[cfg(any(test, feature = "sim"))]
    pub fn simulated(config: crate::sim::SimConfig) -> Self {
        Self::simulated_on(&crate::sim::SimDevice::new(config))
    }

    /// Opens another engine on an existing simulated device (feature `sim`), as
    /// [`open`](Self::open) twice with one ordinal opens two engines on one GPU.
    #[cfg(any(test, feature = "sim"))]
    pub fn simulated_on(device: &crate::sim::SimDevice) -> Self {
        let driver = crate::driver::sim::SimDriver::new(device.clone());
        Self::from_driver(Box::new(driver))
    }

    fn from_driver(driver: Box<dyn Driver>) -> Self {
        let device = driver.device();
        CudaEngine {
            shared: Arc::new(Shared {
                engine_id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
                device,
                state: Mutex::new(State {
                    driver,
                    deferred: Vec::new(),
                    torn_down: false,
                    pinned: PinnedPool::default(),
                    events: EventPool::default(),
                    retire: RetireQueue::default(),
                    staging: StagingRing::default(),
                    kernels: Default::default(),
                    vendor: Default::default(),
                }),
            }),
        }
    }

    /// The number of CUDA devices on this machine.
    ///
    /// # Errors
    /// [`Error::NoDriver`] when the machine has no CUDA driver library.
    pub fn device_count() -> Result<usize> {
        crate::driver::cuda::device_count()
    }

    /// The device this engine drives.
    pub fn device(&self) -> DeviceId {
        self.shared.device
    }

    /// The device's name, as the driver reports it.
    pub fn device_name(&self) -> String {
        self.shared.lock_raw().driver.name().to_owned()
    }

    /// A number unique to this engine among the engines of this process.
    pub fn id(&self) -> u64 {
        self.shared.engine_id
    }

    /// The simulated device behind this engine, if it is one (feature `sim`): advance its clock,
    /// inject faults and read its accounting through it.
    #[cfg(any(test, feature = "sim"))]
    pub fn sim(&self) -> Option<crate::sim::SimDevice> {
        self.shared.lock_raw().driver.as_sim()
    }

    pub(crate) fn enter(&mut self) -> Result<Entered<'_>> {
        self.shared.enter()
    }

    /// A submission boundary: reports failures queued since the last boundary without waiting
    /// for the device.
    ///
    /// It reports failures recorded while values were dropped, and asks the stream (without
    /// waiting) whether earlier work failed asynchronously.
    ///
    /// # Errors
    /// [`Error::Deferred`] for recorded failures, [`Error::DeviceFault`] when the device reports a
    /// failure of queued work.
    pub fn flush(&mut self) -> Result<()> {
        let mut st = self.enter()?;
        st.take_deferred()?;
        st.driver
            .stream_query()
            .map_err(|source| Error::DeviceFault {
                what: "work queued on the engine's stream",
                source,
            })?;
        Ok(())
    }

    /// The host barrier: waits until everything queued on the engine's stream has completed,
    /// then reports any failure.
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when queued work failed, [`Error::Deferred`] for failures recorded
    /// while values were dropped.
    ///
    /// After the wait it releases every retired record whose event proved completion.
    pub fn synchronize(&mut self) -> Result<()> {
        let mut guard = self.enter()?;
        let st = &mut *guard;
        st.driver
            .stream_synchronize()
            .map_err(|source| Error::DeviceFault {
                what: "work queued on the engine's stream",
                source,
            })?;
        let released = st.retire.drain_all(&mut *st.driver, &mut st.events);
        let deferred = st.take_deferred();
        drop(guard);
        drop(released);
        deferred
    }

    /// The pinned pool's idle-byte budget: idle pinned memory beyond it is freed.
    pub fn pinned_pool_budget(&self) -> usize {
        self.shared.lock_raw().pinned.stats().budget_bytes
    }

    /// Sets the pinned pool's idle-byte budget and trims the pool to it at once.
    ///
    /// # Errors
    /// [`Error::Driver`] when the engine's context cannot be made current.
    pub fn set_pinned_pool_budget(&mut self, bytes: usize) -> Result<()> {
        let mut st = self.enter()?;
        let st = &mut *st;
        st.pinned.set_budget(&mut *st.driver, bytes);
        Ok(())
    }

    /// The pinned pool's counters.
    pub fn pinned_pool_stats(&self) -> PinnedPoolStats {
        self.shared.lock_raw().pinned.stats()
    }

    /// The retirement queue's counters.
    pub fn retirement_stats(&self) -> RetirementStats {
        self.shared.lock_raw().retire.stats()
    }

    /// How many events the engine has created (events are pooled and reused).
    pub fn events_created(&self) -> u64 {
        self.shared.lock_raw().events.created()
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        let Some(mut guard) = self.shared.enter_for_drop() else {
            return;
        };
        // Never panics, never reports. A failed wait means the device may still touch memory
        // that queued work names, so every retired record is forgotten (leaked), never freed.
        let st = &mut *guard;
        st.torn_down = true;
        if st.driver.stream_synchronize().is_err() {
            st.retire.forget_all();
            return;
        }
        let released = st.retire.drain_all(&mut *st.driver, &mut st.events);
        // Records whose event failed stay unreleased for good.
        st.retire.forget_failed();
        st.pinned.trim_to(&mut *st.driver, 0);
        st.staging.free_idle(&mut *st.driver);
        st.events.destroy_all(&mut *st.driver);
        // The stream is idle: no kernel or vendor call queued on it is pending.
        st.vendor.release();
        st.kernels.release(st.driver.as_mut());
        drop(guard);
        // Released resources drop after the lock is gone (their drops take it); buffers among
        // them are freed at once since the engine is torn down.
        drop(released);
    }
}
