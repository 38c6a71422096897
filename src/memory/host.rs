//! `HostBuffer<T>`: the host side a pending transfer can own.
//!
//! A pending transfer queues a copy whose host side the device's copy engines read or write
//! directly, while the transfer holds it, so the host side must be page-locked memory that one
//! value owns and hands over by value: a [`PinnedHostBuffer`](super::pinned::PinnedHostBuffer)
//! (the engine's own page-locked memory) or a
//! [`RegisteredBuffer`](super::registered::RegisteredBuffer) (the caller's `Vec`, page-locked in
//! place). The trait names what the routes need of either (where the memory starts, how many
//! elements it holds, which engine it belongs to) and nothing else, so the routes are written
//! once for both.
//!
//! It is sealed: a type outside the crate could not promise that its memory stays valid, and
//! untouched by the host, for as long as a transfer that owns it may run.

use crate::memory::element::Element;
use std::fmt;

pub(crate) mod sealed {
    use crate::device::DeviceId;

    /// What the transfer routes read off a host buffer. Implemented inside the crate only.
    pub trait HostMemory {
        /// A short name of the kind of memory, for messages.
        const KIND: &'static str;
        /// The start of the memory the copies read or write.
        fn host_ptr(&self) -> *mut u8;
        /// The number of elements.
        fn host_len(&self) -> usize;
        /// The engine the memory belongs to: its device and its id.
        fn host_engine(&self) -> (DeviceId, u64);
        /// The bytes of page-locked memory the value holds (what the engine's ledger counts
        /// for it).
        fn page_locked_bytes(&self) -> u64;
    }
}

/// Host memory of `T` elements that a pending transfer can own: page-locked, owned by this one
/// value, and handed to [`upload_pending`](crate::upload_pending) and
/// [`download_pending`](crate::download_pending) by value.
///
/// Sealed. Implemented by [`PinnedHostBuffer<T>`](crate::PinnedHostBuffer) (page-locked memory
/// from the engine's pool) and [`RegisteredBuffer<T>`](crate::RegisteredBuffer) (a `Vec<T>` of
/// yours, page-locked in place). Every pending route and every state of a
/// [`Pending`](crate::Pending) transfer works the same way for both.
pub trait HostBuffer<T: Element>: sealed::HostMemory + fmt::Debug + Send + Sync + 'static {}
