//! The memory level: what device and pinned host memory the engine hands out, and the state it
//! keeps to hand it out cheaply.
//!
//! - [`element`]: the sealed `Element` trait, the element types a tensor can hold.
//! - [`tensor`]: `DeviceTensor<T>`, a shaped, stream-ordered device allocation.
//! - [`any_tensor`]: `AnyTensor`, a `DeviceTensor<T>` whose element type is known at run time (a
//!   checkpoint's tensor, a prepared program's new output).
//! - [`pinned`]: `PinnedHostBuffer<T>`, page-locked host memory handed to transfers by value.
//! - [`registered`]: `RegisteredBuffer<T>`, the caller's `Vec<T>` page-locked in place, handed
//!   to transfers by value the same way.
//! - [`host`]: `HostBuffer<T>`, the sealed trait of what a pending transfer's host side is.
//! - [`pool`]: the pinned pool the buffers come from (an engine part).
//! - [`ring`]: the staging ring's chunks, settings and counters (an engine part).
//! - [`pressure`]: the one answer of every allocation path to out-of-memory: release what the
//!   retirement queue has proven complete, then retry once.
//! - [`usage`]: what the engine holds, by owner, asked of the engine (the figures are the
//!   ledger's, `crate::ledger`, which every allocation and free here tells).
//! - [`stream_copy`]: the copy into pinned staging memory, written around the CPU's caches so
//!   the DMA that reads it next does not have to pull it out of them.
//!
//! The level exists so that owning memory (allocating it on the engine's streams, returning it to
//! a pool, freeing it stream-ordered) is written once, apart from the proofs of when the device
//! is done with it, which are the lifecycle level's. It depends on the seam, the core and the
//! errors. `pool` and `ring` are engine parts ([`core::parts`](crate::core::parts)): the engine
//! holds them behind its lock without naming them, and they know nothing of the engine but the
//! part trait. The host-copy threads the blocking routes split their host copies
//! across are process state and know nothing of memory: they live in `sync::copy_pool`.

pub(crate) mod any_tensor;
#[cfg(feature = "safetensors")]
pub(crate) mod arena;
pub(crate) mod element;
pub(crate) mod host;
pub(crate) mod pinned;
pub(crate) mod pool;
pub(crate) mod pressure;
pub(crate) mod registered;
pub(crate) mod ring;
pub(crate) mod stream_copy;
pub(crate) mod tensor;
pub(crate) mod usage;
