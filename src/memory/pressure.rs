//! Out of memory, answered once for every allocation path: release what is proven free, then
//! retry once.
//!
//! The engine can hold memory the device has finished with: retirement records whose event has
//! completed but that no poll has released yet (a detached transfer, the chunks and destination
//! of a failed pipeline), and, for page-locked memory, the idle blocks of the pinned pool and the
//! idle slots of the staging ring. An allocation that fails for want of memory must not report
//! out-of-memory while such memory would serve it, and no caller should need a `flush` first.
//! So every allocation path (device tensors, pinned buffers, registrations, staging slots, the
//! scalar slot) goes through [`Shared::allocate`], which on out-of-memory releases what the
//! retirement queue has proven complete (a query per record, never a wait), lets the released
//! resources drop outside the engine's lock (device memory frees stream-ordered; pinned blocks
//! and staging slots go back to their pools), and tries once more, under pressure: a path of
//! page-locked memory then reuses what came back first and frees the idle page-locked memory
//! before it allocates ([`State::free_idle_pinned`]).

use super::pool::PinnedPool;
use super::ring::StagingRing;
use crate::core::engine::{Entered, Shared, State};
use crate::error::{DriverError, Error, Result};

/// The memory an allocation asks for: what can make room for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Memory {
    /// Device memory: retired records holding device memory.
    Device,
    /// Page-locked host memory (pinned or registered): retired records holding it, and idle
    /// pinned blocks and staging slots.
    PageLocked,
}

/// Whether `error` says the driver ran out of memory.
pub(crate) fn out_of_memory(error: &Error) -> bool {
    matches!(error, Error::Driver { source, .. } if *source == DriverError::OUT_OF_MEMORY)
}

impl State {
    /// Whether anything the engine holds could make room for an allocation of `memory`:
    /// retired records, resources released under this hold that drop once it ends, or idle
    /// page-locked memory.
    fn could_make_room(&self, memory: Memory) -> bool {
        let idle_pinned = || {
            let pool = self.parts.get::<PinnedPool>();
            let ring = self.parts.get::<StagingRing>();
            pool.is_some_and(|pool| pool.stats().idle_bytes > 0)
                || ring.is_some_and(StagingRing::has_idle)
        };
        self.retire.has_pending()
            || !self.released.is_empty()
            || (memory == Memory::PageLocked && idle_pinned())
    }

    /// Frees the idle page-locked memory the engine keeps for reuse (the pinned pool's idle
    /// blocks, the staging ring's idle slots), for an allocation under pressure. Nothing in it
    /// is named by queued work. Refused frees are recorded for the next boundary.
    pub(crate) fn free_idle_pinned(&mut self) {
        self.parts.get_mut::<PinnedPool>().trim_to(
            &mut *self.driver,
            &mut self.ledger,
            0,
            &mut self.deferred,
        );
        self.parts.get_mut::<StagingRing>().free_idle_into(
            &mut *self.driver,
            &mut self.ledger,
            &mut self.deferred,
        );
    }
}

impl Shared {
    /// Runs the allocation `attempt` with the engine entered and gives back the lock with what
    /// it made, for the caller to go on under the same hold.
    ///
    /// `attempt` is called with `false` first. When it fails for want of memory and something
    /// the engine holds could make room for `memory`, what the retirement queue has proven
    /// complete is released without waiting, the released resources drop once the lock is let
    /// go, and `attempt` runs once more, with `true`: under pressure, where a path of page-locked
    /// memory reuses what came back and otherwise frees idle page-locked memory
    /// ([`State::free_idle_pinned`]) before it allocates.
    ///
    /// # Errors
    /// The attempt's error: the first one's when nothing could make room, or when it is not
    /// out-of-memory; else the retry's. [`Error::Driver`] when the engine's context cannot be
    /// made current.
    pub(crate) fn allocate<R>(
        &self,
        memory: Memory,
        mut attempt: impl FnMut(&mut State, bool) -> Result<R>,
    ) -> Result<(Entered<'_>, R)> {
        {
            let mut st = self.enter()?;
            match attempt(&mut st, false) {
                Ok(made) => return Ok((st, made)),
                Err(error) if out_of_memory(&error) && st.could_make_room(memory) => {
                    st.release_completed(&*self.waits);
                }
                Err(error) => return Err(error),
            }
        } // The released resources drop here, outside the lock: their drops take it.
        let mut st = self.enter()?;
        let made = attempt(&mut st, true)?;
        Ok((st, made))
    }
}
