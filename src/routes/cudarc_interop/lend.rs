//! Lends: an engine's tensor used by another library's stream, with no cudarc type in sight.
//!
//! A [`Lending`] holds the tensor's memory out of the tensor for as long as the other stream may
//! use it. At its start the other stream waits, on the device, for the engine's uses of the
//! tensor that it must follow (its writes, for a shared lend; its reads too, for an exclusive
//! one); at its end the engine's compute lane waits for everything queued on the other stream
//! by then, and only then does the memory go back into the tensor. A lending that never ends
//! (`mem::forget`) leaves the tensor empty and the memory leaked, so the engine never uses the
//! memory under the other stream's work. The cudarc layer ([`super`]) is a thin wrapper over
//! it; the simulator's tests lend to another simulated engine's stream.

use crate::core::engine::{CudaEngine, Shared};
use crate::core::order::Use;
use crate::driver::{DevicePtr, Lane};
use crate::error::Result;
use crate::memory::element::Element;
use crate::memory::tensor::{DeviceTensor, Taken};
use std::sync::Arc;

/// A tensor's memory lent to a stream that is not the engine's (given by its raw handle), out
/// of the tensor until [`end`](Lending::end) (or the drop) puts it back.
pub(crate) struct Lending<'t, T: Element> {
    /// The tensor, empty while the lend lasts.
    tensor: &'t mut DeviceTensor<T>,
    /// Its memory; `None` once the lend has ended.
    taken: Option<Taken>,
    owner: Arc<Shared>,
    /// The other library's stream.
    stream: u64,
    /// Whether the other stream may write the memory (an exclusive lend).
    write: bool,
}

impl<'t, T: Element> Lending<'t, T> {
    /// Lends `tensor` to `stream`: takes its memory out of it (the tensor is left empty), then
    /// makes `stream` wait, on the device, for the engine's uses of it that the lend must
    /// follow: its writes, and with `write` its reads too. Never waits on the host.
    ///
    /// # Errors
    /// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when `tensor` is not
    /// `engine`'s; [`Error::Driver`](crate::error::Error::Driver) when the wait cannot be
    /// queued. The tensor keeps its memory then.
    ///
    /// # Safety
    /// `stream` is a live stream of `engine`'s context (or
    /// [`LEGACY_STREAM`](crate::driver::LEGACY_STREAM)), which stays live until the lend has
    /// ended, and names the same stream on every thread (not
    /// [`PER_THREAD_STREAM`](crate::driver::PER_THREAD_STREAM)).
    pub(crate) unsafe fn begin(
        engine: &mut CudaEngine,
        tensor: &'t mut DeviceTensor<T>,
        stream: u64,
        write: bool,
    ) -> Result<Self> {
        tensor.check_engine(engine)?;
        let mut lending = Lending {
            owner: tensor.owner_arc(),
            tensor,
            taken: None,
            stream,
            write,
        };
        // Out of the tensor before the first enqueue: a panic from here on leaks the memory.
        let taken = lending.tensor.take_memory();
        if taken.ptr() != 0 {
            let uses = [lending.use_of(taken.ptr())];
            let handed = engine.enter().and_then(|mut st| {
                let st = &mut *st;
                // SAFETY: the caller's contract for `stream`.
                unsafe { st.order.hand_over(&mut *st.driver, stream, &uses) }
            });
            if let Err(error) = handed {
                // The other stream was handed nothing it could use: the memory goes back.
                lending.tensor.restore_memory(taken);
                return Err(error);
            }
        }
        lending.taken = Some(taken);
        Ok(lending)
    }

    /// How the other stream uses the memory at `ptr`.
    fn use_of(&self, ptr: DevicePtr) -> Use {
        if self.write {
            Use::Write(ptr)
        } else {
            Use::Read(ptr)
        }
    }

    /// The memory's device address (0 for an empty tensor, or once the lend has ended).
    pub(crate) fn ptr(&self) -> DevicePtr {
        self.taken.as_ref().map_or(0, Taken::ptr)
    }

    /// The element count of the lent tensor.
    pub(crate) fn len(&self) -> usize {
        self.taken.as_ref().map_or(0, Taken::len)
    }

    /// The shape of the lent tensor.
    pub(crate) fn shape(&self) -> &[usize] {
        self.taken.as_ref().map_or(&[0][..], Taken::shape)
    }

    /// Ends the lend: with the engine's context current, runs `settle` (what the other library
    /// does so that its stream's end covers every use of the memory it made, on any of its
    /// streams), makes the engine's compute lane wait for everything queued on the other
    /// stream so far, marks the lend's use of the memory there (later work on any lane follows
    /// it), and puts the memory back into the tensor. Never waits on the host.
    ///
    /// When nothing can be ordered (inside a device callback, or while an engine lock is held
    /// during an unwind) or the wait is refused (the failure is reported at the next boundary),
    /// the memory is leaked and `settle` never runs: the tensor stays empty. Only the first call
    /// does anything.
    pub(crate) fn end(&mut self, settle: impl FnOnce()) {
        let Some(taken) = self.taken.take() else {
            return;
        };
        let Some(mut st) = self.owner.enter_for_drop() else {
            std::mem::forget(settle);
            std::mem::forget(taken);
            return;
        };
        settle();
        if taken.ptr() != 0 {
            let uses = [self.use_of(taken.ptr())];
            let st = &mut *st;
            // SAFETY: `begin`'s contract: the stream is live until the lend has ended, which is
            // now.
            let taken_back = unsafe {
                st.order
                    .take_back(&mut *st.driver, self.stream, Lane::Compute, &uses)
            };
            match taken_back {
                Ok(()) => {
                    if st.torn_down {
                        // The teardown destroyed the order's events before this one was made.
                        st.order.release(&mut *st.driver);
                    }
                }
                Err(error) => {
                    // The other stream's work may still use the memory, and nothing orders the
                    // engine after it: the memory is leaked, never used under it.
                    st.defer(error);
                    std::mem::forget(taken);
                    return;
                }
            }
        }
        drop(st);
        self.tensor.restore_memory(taken);
    }
}

impl<T: Element> Drop for Lending<'_, T> {
    fn drop(&mut self) {
        self.end(|| {});
    }
}
