//! `.await` on an operation in flight: [`PendingFuture`].

use super::flight::Flight;
use super::{InFlight, Operation, Pending, Returned};
use crate::error::Result;
use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::task::{Context, Poll};

/// An operation in flight being awaited: what `.await` on a [`Pending`] in state [`InFlight`]
/// polls ([`IntoFuture`]). It resolves to the operation in state [`Returned`], with the rules of
/// [`Pending::wait`]: on a device failure what the work may still touch is retained by its
/// engine for its lifetime and the typed error
/// ([`Error::DeviceFault`](crate::Error::DeviceFault)) comes back.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use cuferry::{upload_pending, CudaEngine, PinnedHostBuffer};
/// # use cuferry::sim::SimConfig;
/// # let mut engine = CudaEngine::simulated(SimConfig::default());
/// # /*
/// let mut engine = CudaEngine::open(0)?;
/// # */
/// let source = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0, 3.0])?;
/// let destination = engine.alloc_tensor::<f32>(&[3])?;
/// let upload = upload_pending(&mut engine, source, destination)?;
/// # let block_on = futures_lite::future::block_on;
/// let returned = block_on(async { upload.await })?; // any executor
/// assert_eq!(returned.buffer().as_slice(), [1.0, 2.0, 3.0]);
/// # Ok(()) }
/// ```
///
/// # How it is woken
///
/// The first poll asks the work's event, without waiting and without the engine's lock; a small
/// copy may be done already. If not, it keeps asking for 20 µs on CUDA (about what a device call
/// back takes to arrive, so work about to finish resolves at the latency of a host wait; none on
/// the simulated device). If still not, it asks the device to call back once the work has
/// completed or the device has failed, and returns `Pending`; the call back wakes the task, and
/// the next poll asks the event again. On CUDA the call back is a stream callback
/// (`cuStreamAddCallback`) on a side stream that waits for the work's event, so it comes right
/// after the work, is not held up by work queued later on the engine's streams, and is made after
/// a device fault too (unlike `cuLaunchHostFunc`, which CUDA does not call once the context has
/// an error). Beyond the first poll's 20 µs, no host thread spends anything on the operation:
/// nothing polls, and no thread is parked in an event wait. The alternative, a watcher thread
/// blocked in `cuEventSynchronize`, keeps a core busy unless the event was made with
/// `CU_EVENT_BLOCKING_SYNC`, and takes a thread per event waited on at once (or serialises every
/// wait behind the oldest). On the simulated device the wake comes when the device runs the
/// event's record (at once unless its clock is held, see
/// [`SimDevice::hold_clock`](crate::sim::SimDevice::hold_clock)). A collective is awaited rank
/// by rank: each rank's event in turn, each woken by its own device.
///
/// Registering the call back takes the engine's lock briefly, once per await (per rank). When it
/// cannot be registered (the engine was dropped, whose teardown waited for its streams, or the
/// driver refused), the poll waits for the event on the polling thread instead: rare, and short.
///
/// # What the waker may do
///
/// The task's [`Waker`](std::task::Waker) is called as the device's callback: on CUDA on the
/// driver's callback thread, where the driver refuses every call, and on the simulated device
/// the same way, once the thread that ran the device's work holds no engine lock. It may only
/// signal (schedule the task, send on a channel, set a flag), as executors' wakers do. An engine
/// call made from it (polling another operation inline, say) is refused with
/// [`UsageError::InDeviceCallback`](crate::error::UsageError::InDeviceCallback); a value of the engine dropped in
/// it is leaked, never freed under the device, and reported at the next
/// [`flush`](crate::CudaEngine::flush) or [`synchronize`](crate::CudaEngine::synchronize).
///
/// # Cancellation
///
/// Dropping the future before it resolves is exactly dropping the operation in flight: it
/// detaches into the carrying engine's retirement queue (each rank's, for a collective), which
/// releases what it owns once the work is proven complete; nothing is freed early. A call back
/// still pending finds nothing to wake and owns nothing else. So it may lose a `select!` race:
/// the operation is not lost, only handed to the engine. `mem::forget` leaks it, which is sound.
///
/// It works with any executor (the crate depends on no runtime), is `Send` and `Unpin`, and must
/// not be polled again once it has resolved (it panics then, as futures may).
#[must_use = "futures do nothing unless you `.await` or poll them"]
pub struct PendingFuture<Op: Operation> {
    inner: <Op::Flight as Flight>::Poller,
}

impl<Op: Operation> fmt::Debug for PendingFuture<Op> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingFuture")
            .field("operation", &Op::NAME)
            .finish()
    }
}

impl<Op: Operation> Future for PendingFuture<Op> {
    type Output = Result<Pending<Op, Returned>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // `Poller: Unpin`, so the future is too: nothing is pinned structurally (the device
        // holds the addresses of what the operation owns, not the future's).
        let this = self.get_mut();
        <Op::Flight as Flight>::poll(&mut this.inner, cx).map(|answer| {
            answer.map(|done| Pending {
                hold: Op::land(done),
            })
        })
    }
}

impl<Op: Operation> IntoFuture for Pending<Op, InFlight> {
    type Output = Result<Pending<Op, Returned>>;
    type IntoFuture = PendingFuture<Op>;

    /// Awaits the work: see [`PendingFuture`].
    fn into_future(self) -> PendingFuture<Op> {
        PendingFuture {
            inner: self.hold.poller(),
        }
    }
}
