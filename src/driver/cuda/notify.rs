//! Wakes called by the device: [`Driver::notify_after`](crate::driver::Driver::notify_after)
//! over CUDA.
//!
//! A registration queues two things on a side stream of the driver's own: `cuStreamWaitEvent`
//! on the event, then `cuStreamAddCallback`. The driver runs the callback on a thread of its own
//! once the wait is satisfied, so the host spends nothing while the work runs, and the wake comes
//! right after the event: the side stream holds nothing but waits and callbacks, so work queued
//! on the engine's stream after the event does not delay it (a callback queued on the engine's
//! stream itself would also block the work queued after it until the callback returned).
//!
//! `cuStreamAddCallback`, not `cuLaunchHostFunc`: the CUDA driver API documents that a stream
//! callback is executed exactly once per call and, after a device error, is still called (with
//! the error as its status), whereas `cuLaunchHostFunc`'s host function "will not be called in
//! the event of an error in the CUDA context". A wake that never comes after a device fault
//! would leave a future pending forever, so only the stream callback fits. The status itself is
//! ignored: whoever is woken asks the event, which reports the failure.
//!
//! A wake only signals (see the seam and `driver::callbacks`). Should it still call the engine or
//! drop one of its values (an executor that drops a task's future when woken after its own
//! shutdown), it runs on the driver's callback thread, where CUDA refuses every call
//! (`CUDA_ERROR_NOT_PERMITTED`): the engine refuses such calls itself with
//! `UsageError::InDeviceCallback`, and a value dropped there is leaked (never freed under the device)
//! and reported at the engine's next boundary.
//!
//! Side streams are made on first use and reused: a registration takes a side stream with no
//! callback pending, or makes a new one, up to [`SIDE_STREAMS`]. Beyond that many wakes pending
//! at once, registrations share the side streams in turn, and a wake may then also wait for an
//! earlier registration's event on the same side stream.

use crate::driver::{EventHandle, Wake};
use crate::error::DriverError;
use cudarc::driver::{result, sys};
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// At most this many side streams per driver.
pub(super) const SIDE_STREAMS: usize = 8;

/// One side stream and the number of its callbacks that have not run yet.
struct Side {
    stream: sys::CUstream,
    pending: Arc<AtomicUsize>,
}

/// The side streams of one driver, made on first use.
#[derive(Default)]
pub(super) struct SideStreams {
    sides: Vec<Side>,
    /// The side stream the next registration shares when every one has a callback pending.
    next: usize,
}

/// What a callback owns: the wake, and its side stream's count of pending callbacks.
struct Callback {
    wake: Wake,
    pending: Arc<AtomicUsize>,
}

/// The stream callback: calls the wake once and counts the callback done. Never unwinds into
/// the driver and never calls CUDA.
unsafe extern "C" fn call_back(_stream: sys::CUstream, _status: sys::CUresult, data: *mut c_void) {
    // SAFETY: `data` is the `Box<Callback>` that `notify_after` leaked for exactly this callback,
    // and CUDA calls a stream callback exactly once, so the box is taken back exactly once.
    let callback = unsafe { Box::from_raw(data.cast::<Callback>()) };
    let Callback { wake, pending } = *callback;
    // The driver's callback thread holds no engine lock: the wake runs now, marked as the
    // device's callback, and a panic inside it never unwinds into the driver.
    crate::driver::callbacks::call(vec![wake]);
    pending.fetch_sub(1, Ordering::AcqRel);
}

impl SideStreams {
    /// A side stream for one more registration: one with no callback pending, else a new one,
    /// else the next in turn.
    fn pick(&mut self) -> Result<&Side, DriverError> {
        let idle = self
            .sides
            .iter()
            .position(|side| side.pending.load(Ordering::Acquire) == 0);
        let index = match idle {
            Some(index) => index,
            None if self.sides.len() < SIDE_STREAMS => {
                let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                    .map_err(|e| DriverError::from_raw(e.0))?;
                self.sides.push(Side {
                    stream,
                    pending: Arc::new(AtomicUsize::new(0)),
                });
                self.sides.len() - 1
            }
            None => {
                self.next = (self.next + 1) % self.sides.len();
                self.next
            }
        };
        Ok(&self.sides[index])
    }

    /// Queues a wait for `event`'s last record and then a callback that calls `wake`, on a side
    /// stream. The driver's context must be current.
    pub(super) fn notify_after(
        &mut self,
        event: EventHandle,
        wake: Wake,
    ) -> Result<(), DriverError> {
        let side = self.pick()?;
        // SAFETY: the side stream and the event belong to this driver's context, which the
        // engine made current for the call; the event is live while its fence holds it, and the
        // wait captures its last record now, so recording or destroying the event afterwards
        // does not affect it (as cuStreamWaitEvent documents).
        DriverError::check(unsafe {
            sys::cuStreamWaitEvent(
                side.stream,
                event.0 as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT as u32,
            )
        })?;
        side.pending.fetch_add(1, Ordering::AcqRel);
        let data = Box::into_raw(Box::new(Callback {
            wake,
            pending: Arc::clone(&side.pending),
        }));
        // SAFETY: the stream is live (destroyed only when the driver is dropped); `call_back`
        // matches `CUstreamCallback` and takes `data` back exactly once when CUDA calls it;
        // the flags must be zero.
        let queued = DriverError::check(unsafe {
            sys::cuStreamAddCallback(side.stream, Some(call_back), data.cast::<c_void>(), 0)
        });
        if let Err(error) = queued {
            // SAFETY: the callback was not queued, so nothing else will take `data` back.
            let callback = unsafe { Box::from_raw(data) };
            callback.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(error);
        }
        Ok(())
    }

    /// Waits for every pending callback, then destroys the side streams. For the driver's drop,
    /// with its context current, once the engine's stream is idle (its teardown waited for it),
    /// so the waits are satisfied and the callbacks run at once. Errors are ignored.
    pub(super) fn release(&mut self) {
        for side in self.sides.drain(..) {
            // SAFETY: the stream was made by `pick` and is destroyed once, here; its callbacks
            // own everything they touch, so a failed synchronize (a device fault, after which
            // the driver still calls them) leaves nothing dangling.
            unsafe {
                sys::cuStreamSynchronize(side.stream);
                sys::cuStreamDestroy_v2(side.stream);
            }
        }
    }
}
