//! The smallest band of the blocking routes: a transfer of at most 16 bytes, moved through the
//! engine's pinned scalar slot and proven by a stream synchronize.
//!
//! The module exists because this band shares nothing with the staged bands of
//! [`blocking`](super::blocking) but the caller: no lease, no ring slot, no event, no copy
//! threads. The slot is the staging ring's (`memory::ring`), held as a
//! [`LeasedSlot`] so that dropping it returns it; the proof is the lifecycle level's
//! [`synchronize_now`]. The route is only their composition.

use crate::core::engine::CudaEngine;
use crate::error::{Error, Result, UsageError};
use crate::lifecycle::fence::synchronize_now;
use crate::lifecycle::lease::LeasedSlot;
use crate::memory::element::Element;
use crate::memory::pressure::Memory;
use crate::memory::ring::StagingRing;
use crate::memory::tensor::DeviceTensor;
use std::mem::ManuallyDrop;

/// The most bytes the scalar slot holds, and so the most a scalar transfer moves.
pub(crate) const SCALAR_BYTES: usize = 16;

/// The host side of a [`scalar_transfer`], which also gives its direction.
pub(crate) enum ScalarHost<'a> {
    /// Host to device, from these bytes.
    Upload(&'a [u8]),
    /// Device to host, into these bytes.
    Download(&'a mut [u8]),
}

impl ScalarHost<'_> {
    fn is_upload(&self) -> bool {
        matches!(self, ScalarHost::Upload(_))
    }
}

/// Moves at most 16 bytes between host memory and the start of `tensor` through the engine's
/// scalar slot, and returns once the copy has completed: the whole of a blocking transfer
/// that small.
///
/// One lock section takes the slot, fills it (upload) and queues the copy; a stream
/// synchronize outside the lock proves it complete (for a transfer the caller waits for at
/// once, the same proof as an event, without the record and the event pool); a second lock
/// section returns the slot. The slot is never a lease the caller sees: from the enqueue to
/// the proof it is held in `ManuallyDrop`, so a panic leaks it, and a failed proof retains it.
///
/// # Errors
/// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) for another engine's
/// tensor; [`UsageError::ScalarBytes`](crate::error::UsageError::ScalarBytes) when the host side
/// is empty, longer than 16 bytes or than the tensor; [`Error::Driver`] when the slot or the copy
/// is refused (nothing queued); [`Error::DeviceFault`] when the synchronize fails (the slot is
/// retained).
pub(crate) fn scalar_transfer<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
    host: ScalarHost<'_>,
) -> Result<()> {
    engine.shared.check(tensor.owner())?;
    let bytes = match &host {
        ScalarHost::Upload(src) => src.len(),
        ScalarHost::Download(dst) => dst.len(),
    };
    if bytes == 0 || bytes > SCALAR_BYTES || bytes > tensor.byte_len() {
        return Err(Error::Usage(UsageError::ScalarBytes {
            operation: "scalar transfer",
            bytes,
            tensor_bytes: tensor.byte_len(),
            slot_bytes: SCALAR_BYTES,
        }));
    }
    let owner = &engine.shared;
    let (mut st, slot) = owner.allocate(Memory::PageLocked, |st, pressure| {
        if pressure && !st.parts.get_mut::<StagingRing>().stats().scalar_slot {
            st.free_idle_pinned();
        }
        st.parts
            .get_mut::<StagingRing>()
            .take_scalar(&mut *st.driver, &mut st.ledger)
    })?;
    let slot = LeasedSlot::new(slot, owner);
    let ptr = slot.ptr();
    if let ScalarHost::Upload(src) = &host {
        // SAFETY: the slot holds 16 bytes, is ours alone (just taken from the ring) and no
        // queued copy names it; `src` is at most 16 bytes and does not overlap pinned
        // staging memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), ptr, bytes) };
    }
    // From the enqueue until the proof, a panic leaks the slot.
    let slot = ManuallyDrop::new(slot);
    let device = tensor.raw_ptr();
    // SAFETY: the slot holds at least `bytes` bytes and is not returned to the ring before
    // the synchronize below proves the copy complete (or ever, if it fails); the device range
    // is the tensor's first `bytes` bytes, and the tensor is borrowed for the call.
    let queued = unsafe { st.queue_host_copy(host.is_upload(), device, device, ptr, bytes) };
    let lane = match queued {
        Ok(lane) => lane,
        Err(error) => {
            drop(st);
            // Nothing was queued: the slot goes back to the ring.
            drop(ManuallyDrop::into_inner(slot));
            return Err(error);
        }
    };
    let what = "blocking transfer of 16 bytes or fewer";
    let slot = synchronize_now(st, owner, lane, slot, what)?;
    if let ScalarHost::Download(dst) = host {
        // SAFETY: the synchronize proved the copy into the slot complete; `dst` is at most
        // 16 bytes and lies outside pinned staging memory.
        unsafe { std::ptr::copy_nonoverlapping(ptr, dst.as_mut_ptr(), bytes) };
    }
    drop(slot); // back to the ring
    Ok(())
}
