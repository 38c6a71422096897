//! Ordering one engine's work after another's on the device, with no host wait: [`Signal`].
//!
//! Engines never share values, so nothing orders the streams of two engines by itself. A
//! [`Signal`] is the crate's one proof of completion (a fence, recorded after everything queued on
//! an engine so far) handed to another engine: [`CudaEngine::wait_signal`] makes every stream of
//! the waiting engine wait for it on the device (`cuStreamWaitEvent`), so work queued there
//! afterwards runs after the signalled work, while the host moves on. The same signal is a host
//! proof too ([`Signal::is_ready`], [`Signal::wait`]).
//!
//! Real devices wait for each other's events across contexts and devices. A simulated engine
//! waits only for engines of the same simulated machine, on any of its devices (separate
//! machines share no clock): anything else is refused with [`SetupError::Unreachable`](crate::error::SetupError::Unreachable).

use super::fence::{Fenced, Fencing, fence};
use crate::core::engine::CudaEngine;
use crate::device::DeviceId;
use crate::driver::Lane;
use crate::error::{Error, Result, SetupError};
use std::mem::ManuallyDrop;

/// A point in one engine's work that other engines' streams can wait for on the device.
///
/// Made by [`CudaEngine::signal`] after everything queued on that engine so far, on all of its
/// streams. Hand it (by reference) to [`CudaEngine::wait_signal`] of any engine whose later work
/// must follow; wait for it on the host with [`wait`](Self::wait), or ask with
/// [`is_ready`](Self::is_ready). A signal is `Send + Sync`: it may cross to the thread that
/// holds the other engine. Dropping it is free (its event returns to its engine once complete),
/// and so is forgetting it (the event leaks).
///
/// ```
/// # fn main() -> Result<(), cuferry::Error> {
/// use cuferry::sim::{SimConfig, SimDevice};
/// use cuferry::{download_tensor, upload_tensor, CudaEngine};
/// # /*
/// let (mut a, mut b) = (CudaEngine::open(0)?, CudaEngine::open(1)?);
/// # */
/// # let sim = SimDevice::new(SimConfig::default());
/// # let (mut a, mut b) = (CudaEngine::simulated_on(&sim), CudaEngine::simulated_on(&sim));
/// let x = upload_tensor(&mut a, &[1.0f32, 2.0, 3.0], &[3])?;
/// let doubled = a.scale(&x, 2.0)?;
/// let done = a.signal()?; // after the upload and the kernel
///
/// b.wait_signal(&done)?; // b's streams wait for them on the device; the host goes on
/// let y = upload_tensor(&mut b, &[4.0f32], &[1])?; // runs after a's kernel
///
/// done.wait()?; // the host can wait for the same point
/// assert_eq!(download_tensor(&mut a, &doubled)?, [2.0, 4.0, 6.0]);
/// assert_eq!(download_tensor(&mut b, &y)?, [4.0]);
/// # Ok(()) }
/// ```
#[must_use = "a signal orders nothing until an engine waits for it"]
pub struct Signal {
    /// The fence after the signalled work; `None` when that work was already proven complete
    /// when the signal was made (there is nothing to wait for).
    fence: Option<Fenced<()>>,
    /// The signalling engine's device.
    device: DeviceId,
    /// Each of the signalling engine's lanes' position when the signal was made: what the
    /// signal's completion proves complete.
    covers: [u64; 3],
}

impl std::fmt::Debug for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signal")
            .field("device", &self.device)
            .field("proven_at_creation", &self.fence.is_none())
            .finish()
    }
}

impl Signal {
    /// The device of the engine that made the signal.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Whether the signalled work has completed. Never waits and takes no engine lock.
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when the device reports a failure of the signalled work (or of
    /// earlier work on its engine).
    pub fn is_ready(&self) -> Result<bool> {
        match &self.fence {
            Some(fence) => fence.is_ready(),
            None => Ok(true),
        }
    }

    /// Records, on the signalling engine, that everything the signal covers has completed: for
    /// a caller that has just proven that, through work on another engine that waited for the
    /// signal on the device.
    pub(crate) fn proven_complete(&self) {
        if let Some(fence) = &self.fence {
            for (lane, upto) in Lane::ALL.into_iter().zip(self.covers) {
                fence.owner().proven.prove(lane, upto);
            }
        }
    }

    /// Waits on the host until the signalled work has completed.
    ///
    /// # Errors
    /// As [`is_ready`](Self::is_ready).
    pub fn wait(self) -> Result<()> {
        match self.fence {
            Some(fence) => fence.wait_parts().map(drop),
            None => Ok(()),
        }
    }
}

impl CudaEngine {
    /// A [`Signal`] after everything queued on this engine so far, on all three of its streams.
    ///
    /// The engine's compute stream first waits (on the device) for its copy streams, then an
    /// event is recorded on it: later copies and kernels on this engine are not delayed by it,
    /// beyond that one join.
    ///
    /// # Errors
    /// [`Error::Driver`] when a wait or the event record is refused and nothing could prove the
    /// work complete instead. When the record is refused but a stream synchronize proves the work
    /// complete, the signal is returned (already complete) and the refusal is reported at the
    /// next [`flush`](Self::flush) or [`synchronize`](Self::synchronize).
    pub fn signal(&mut self) -> Result<Signal> {
        let device = self.shared.device;
        let mut st = self.shared.enter()?;
        {
            let st = &mut *st;
            st.order.join(&mut *st.driver, Lane::Compute)?;
        }
        // The compute lane has joined the copy lanes: its event proves each lane up to here.
        let covers = st.order.positions();
        let nothing = ManuallyDrop::new(());
        match fence(
            &mut st,
            &self.shared,
            Lane::Compute,
            nothing,
            None,
            "signal",
        ) {
            Fencing::Fenced(fence) => Ok(Signal {
                fence: Some(fence),
                device,
                covers,
            }),
            Fencing::Proven((), error) => {
                st.defer(error);
                Ok(Signal {
                    fence: None,
                    device,
                    covers,
                })
            }
            Fencing::Untracked(untracked, error) => {
                drop(st);
                untracked.retain();
                Err(error)
            }
        }
    }

    /// Makes every later operation of this engine wait, on the device, for the work `signal`
    /// covers (queued on its own engine, this one or another, before the signal was made). The
    /// host does not wait.
    ///
    /// A signal whose work is proven complete queues nothing: its event reports completion, or
    /// its engine has been dropped and that teardown's wait for its streams succeeded. A teardown
    /// whose wait failed proves nothing: the wait is queued on the device as for a live engine.
    /// When the device refuses a wait, the host waits for the signal instead, so the order holds
    /// either way, and the refusal is reported at the next [`flush`](Self::flush) or
    /// [`synchronize`](Self::synchronize).
    ///
    /// # Errors
    /// [`SetupError::Unreachable`](crate::error::SetupError::Unreachable) when this engine's device cannot wait for the signal's (separate
    /// simulated devices, or a real and a simulated one); nothing is queued.
    /// [`Error::DeviceFault`] when the signalled work failed.
    pub fn wait_signal(&mut self, signal: &Signal) -> Result<()> {
        self.wait_signal_on(signal, &Lane::ALL)
    }

    /// As [`wait_signal`](Self::wait_signal), for the given lanes of this engine only.
    pub(crate) fn wait_signal_on(&mut self, signal: &Signal, lanes: &[Lane]) -> Result<()> {
        let Some(fence) = &signal.fence else {
            return Ok(());
        };
        let to = self.shared.device;
        if let Err(reason) = crate::driver::reachable(signal.device, to) {
            return Err(Error::Setup(SetupError::Unreachable {
                from: signal.device,
                to,
                reason,
            }));
        }
        // Only a proof lets the wait be skipped: the event's own answer, or the signalling
        // engine's teardown wait, which covers everything queued there, when it succeeded. A
        // teardown whose wait failed proves nothing, so the wait is queued on the device as for
        // a live engine (the event lives as long as the signal).
        if fence.is_ready()? || fence.owner().lock().settled {
            return Ok(());
        }
        let event = fence.event();
        let mut st = self.shared.enter()?;
        let refused = lanes
            .iter()
            .find_map(|&lane| st.driver.stream_wait(lane, event).err());
        let Some(source) = refused else {
            return Ok(());
        };
        drop(st);
        // The device would not wait: the host does, so the order still holds.
        fence
            .owner()
            .waits
            .event_synchronize(event)
            .map_err(|source| Error::DeviceFault {
                what: "signal",
                source,
            })?;
        self.shared.lock().defer(Error::Driver {
            call: "cuStreamWaitEvent",
            source,
        });
        Ok(())
    }
}
