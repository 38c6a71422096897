//! Several tensors in one device allocation, each freed on its own terms.
//!
//! A checkpoint of thousands of small tensors (norms, biases) spends its time in one
//! allocation and one copy per tensor, not in moving bytes. An [`Arena`] is one allocation
//! that holds many such tensors, each 256-byte aligned inside it, so that one copy fills them
//! all. Each part is a [`DeviceTensor`] of its own whose drop goes to the arena (its
//! [`Home`]): the part's uses are folded into the allocation's
//! ([`Order::fold`](crate::core::order::Order::fold)), and once the last part is gone the
//! allocation is freed, ordered after every use of every part. A part leaked, or dropped where
//! its engine cannot be entered, leaks the whole allocation: it is never freed without that
//! order.

use crate::core::engine::Shared;
use crate::driver::DevicePtr;
use crate::memory::tensor::{DeviceTensor, Home};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The alignment of every part (the driver's own for an allocation).
pub(crate) const ALIGN: usize = 256;

/// One device allocation shared by the tensors made of it ([`part`](Self::part)).
pub(crate) struct Arena {
    /// The allocation, until the last part is dropped.
    block: Mutex<Option<DeviceTensor<u8>>>,
    /// Its address: where the parts' uses are folded.
    base: DevicePtr,
    /// The parts not yet dropped.
    live: AtomicUsize,
}

impl Arena {
    /// An arena over `block`, with no part yet.
    pub(crate) fn new(block: DeviceTensor<u8>) -> Arc<Arena> {
        Arc::new(Arena {
            base: block.raw_ptr(),
            block: Mutex::new(Some(block)),
            live: AtomicUsize::new(0),
        })
    }

    /// The arena's `len` bytes at `offset`, as a tensor of their own. The caller holds a part
    /// for as long as it makes more (the arena is freed when its parts drop to none).
    ///
    /// # Safety
    /// No two parts that safe code can reach overlap: each is a tensor of its own, written
    /// through `&mut` alone. A part that spans others (the whole allocation, say) stays the
    /// caller's, used only to fill them before they are handed out.
    ///
    /// # Panics
    /// When `offset..offset + len` is not inside the allocation.
    pub(crate) unsafe fn part(self: &Arc<Self>, offset: usize, len: usize) -> DeviceTensor<u8> {
        let block = self.block.lock().unwrap_or_else(|e| e.into_inner());
        let block = block
            .as_ref()
            .expect("a part is made while another is held");
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= block.len()),
            "a part inside the allocation"
        );
        let owner = block.owner_arc();
        self.live.fetch_add(1, Ordering::AcqRel);
        let home: Arc<dyn Home> = Arc::clone(self) as Arc<dyn Home>;
        // SAFETY: the bytes lie inside `block`, memory of `owner`'s driver that the arena keeps
        // until this part's drop has come to `drop_memory`; bytes of `u8` are valid whatever
        // they hold.
        unsafe { DeviceTensor::homed(self.base + offset as u64, &[len], len, &owner, home) }
    }
}

impl Home for Arena {
    fn drop_memory(&self, owner: &Arc<Shared>, ptr: DevicePtr) {
        let Some(mut entered) = owner.enter_for_drop() else {
            return; // leaked: the part's uses cannot be ordered before the allocation's free
        };
        entered.order.fold(ptr, self.base);
        let last = self.live.fetch_sub(1, Ordering::AcqRel) == 1;
        drop(entered);
        if last {
            // Its own drop frees it, ordered after every use folded into it.
            let block = self.block.lock().unwrap_or_else(|e| e.into_inner()).take();
            drop(block);
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // Parts that never came to `drop_memory` (leaked, or dropped where their engine could
        // not be entered): nothing orders the free after their uses, so the memory is leaked.
        if let Some(block) = self
            .block
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            std::mem::forget(block);
        }
    }
}
