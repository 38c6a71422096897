//! Adoptions: memory another library allocated, taken in as a tensor of the engine without a
//! copy, with no cudarc type in sight.
//!
//! The value that owns the memory (a cudarc `CudaSlice`, or in the simulator's tests another
//! engine's tensor) becomes the tensor's [`Home`]: the engine's compute lane first waits for
//! everything queued on the owner's stream, and when the tensor is dropped the owner's stream
//! waits for every use the engine queued, after which the owner is dropped and frees the memory
//! on its stream, in order. When that wait cannot be queued the owner is leaked, never dropped
//! under the engine's work. The cudarc layer ([`super`]) is a thin wrapper over it.

use crate::core::context::ContextScope;
use crate::core::engine::{CudaEngine, Shared};
use crate::core::order::Use;
use crate::driver::{DevicePtr, Lane};
use crate::error::{Error, SubmitError, UsageError};
use crate::memory::element::Element;
use crate::memory::tensor::{DeviceTensor, Home, shape_len};
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

/// Takes the memory `keep` owns, `len` elements of `T` at `ptr`, as a tensor of `engine` of
/// `shape`: the engine's compute lane waits, on the device, for everything queued on `stream`
/// so far, and the tensor's drop orders `stream` after the engine's uses before it drops `keep`
/// (see the [module docs](self)). `what` names the call in errors. A zero-element `shape` drops
/// `keep` at once and gives an empty tensor.
///
/// # Errors
/// In [`SubmitError::Rejected`], `keep` handed back:
/// [`UsageError::LengthMismatch`] when `shape` does not hold `len` elements,
/// [`UsageError::ShapeOverflow`] when its element count overflows. In
/// [`SubmitError::Failed`], `keep` handed back: [`Error::Driver`] when the wait cannot be
/// queued.
///
/// # Safety
/// `keep` owns device memory of `engine`'s device at `ptr` that holds `len` valid `T`s once the
/// work queued on `stream` so far has run, and frees it when dropped, stream-ordered on
/// `stream` (after everything queued on it by then), never before; nothing else uses or frees
/// it meanwhile. `stream` is a stream of `engine`'s context (or
/// [`LEGACY_STREAM`](crate::driver::LEGACY_STREAM)) that stays live while `keep` does, and names
/// the same stream on every thread (not [`PER_THREAD_STREAM`](crate::driver::PER_THREAD_STREAM)).
// The refusal hands `keep` back by value, as every give-back error does.
#[allow(clippy::result_large_err)]
pub(crate) unsafe fn adopt<T: Element, O: Send + 'static>(
    engine: &mut CudaEngine,
    keep: O,
    ptr: DevicePtr,
    len: usize,
    shape: &[usize],
    stream: u64,
    what: &'static str,
) -> Result<DeviceTensor<T>, SubmitError<O>> {
    let expected = match shape_len(shape) {
        Ok(expected) => expected,
        Err(error) => return Err(SubmitError::Rejected { input: keep, error }),
    };
    if expected != len {
        return Err(SubmitError::Rejected {
            input: keep,
            error: Error::Usage(UsageError::LengthMismatch {
                what,
                expected,
                found: len,
                shape: Some(shape.to_vec()),
            }),
        });
    }
    if len == 0 {
        // Nothing to view: the owner's memory goes back now.
        release(&engine.shared, keep);
        return match DeviceTensor::alloc(engine, shape) {
            Ok(empty) => Ok(empty),
            Err(error) => unreachable!("a zero-element tensor allocates nothing: {error}"),
        };
    }
    // Held out of reach of an unwind from the first enqueue on: a driver panic leaks it.
    let keep = ManuallyDrop::new(keep);
    let joined = engine.enter().and_then(|mut st| {
        let st = &mut *st;
        // SAFETY: the caller's contract for `stream`.
        unsafe {
            st.order
                .take_back(&mut *st.driver, stream, Lane::Compute, &[Use::Write(ptr)])
        }
    });
    let keep = ManuallyDrop::into_inner(keep);
    if let Err(error) = joined {
        return Err(SubmitError::Failed { input: keep, error });
    }
    let home: Arc<dyn Home> = Arc::new(Adopted {
        keep: Mutex::new(Some(keep)),
        stream,
    });
    // SAFETY: the caller's contract: `ptr` is device memory of the engine's device holding
    // `len` valid `T`s once the work on `stream` so far has run, which the compute lane now
    // waits for (and the other lanes, through the mark, when they use it); `home` holds its
    // owner and releases it.
    Ok(unsafe { DeviceTensor::homed(ptr, shape, len, &engine.shared, home) })
}

/// Drops `keep` (which frees its memory, stream-ordered) with the engine's context current, and
/// the caller's restored after: cudarc makes its own context current for its calls and leaves
/// it so.
fn release<O>(owner: &Arc<Shared>, keep: O) {
    let scope = ContextScope::enter(owner, "cuCtxSetCurrent (restore after a cudarc release)");
    drop(keep);
    drop(scope);
}

/// The home of an adopted tensor: its memory's owner, dropped once the owner's stream follows
/// the engine's uses. Dropped without [`drop_memory`](Home::drop_memory) (a tensor that gave
/// its memory up), it leaks the owner: only a proven order releases it.
struct Adopted<O: Send + 'static> {
    keep: Mutex<Option<O>>,
    /// The owner's stream.
    stream: u64,
}

impl<O: Send + 'static> Home for Adopted<O> {
    fn drop_memory(&self, owner: &Arc<Shared>, ptr: DevicePtr) {
        let keep = self.keep.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(keep) = keep else {
            return;
        };
        // Held out of reach of an unwind until the order is made: a driver panic leaks it.
        let keep = ManuallyDrop::new(keep);
        let Some(mut entered) = owner.enter_for_drop() else {
            return; // leaked
        };
        let st = &mut *entered;
        // SAFETY: `adopt`'s contract: the stream is live while the owner is, which it still is.
        let handed = unsafe {
            st.order
                .hand_over(&mut *st.driver, self.stream, &[Use::Write(ptr)])
        };
        match handed {
            Ok(()) => {
                if st.torn_down {
                    // The teardown destroyed the order's events before these were made.
                    st.order.release(&mut *st.driver);
                }
                // The memory leaves the engine: its address may come back as another value.
                st.order.forget(ptr);
            }
            Err(error) => {
                // The engine's work may still use the memory, and nothing orders the owner's
                // free after it: the owner is leaked.
                st.defer(error);
                return;
            }
        }
        drop(entered);
        release(owner, ManuallyDrop::into_inner(keep));
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl<O: Send + 'static> Drop for Adopted<O> {
    fn drop(&mut self) {
        if let Some(keep) = self
            .keep
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            std::mem::forget(keep);
        }
    }
}
