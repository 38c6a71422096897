//! The `StagingLease<Proven/Unproven>` typestate that makes the lifecycle of a pinned staging
//! slot a compile-time rule.
//!
//! The slots are those of the engine's staging ring (`memory::ring`), the pinned chunks behind
//! the blocking routes. A [`StagingLease`] is the exclusive use of one slot, with the event of
//! its last chunk. Its state says whether the slot's memory may be touched:
//! - [`Proven`]: no queued copy names the slot. Its memory is reachable
//!   ([`as_bytes`](StagingLease::as_bytes), [`as_mut_bytes`](StagingLease::as_mut_bytes)), and it
//!   can be [`release`](StagingLease::release)d or used to begin a chunk.
//! - [`Unproven`]: a copy was queued and an event recorded after it (the slot is
//!   [fenced](crate::lifecycle)). Nothing reaches the memory; the ways out are
//!   [`end_chunk`](StagingLease::end_chunk) (wait for the event: `Proven` again) and
//!   [`retire`](StagingLease::retire) (hand the slot, and any device resource, to the retirement
//!   queue, which returns them once the event proves completion). Dropping an `Unproven` lease
//!   retires it.
//!
//! A begin whose copy was queued but can be proven complete neither by an event nor by a stream
//! synchronize returns [`SubmitError::Retained`]: the slot is retained for the engine's lifetime,
//! and no lease comes back to reach it.
//!
//! The ring's slots serve the blocking routes; leases taken with [`CudaEngine::staging_lease`]
//! draw on a budget of their own (`ring_depth` at a time), so leases held or forgotten by a
//! caller never starve the blocking routes.
//!
//! The lease is public so callers can build their own chunked pipelines.

// A failed begin hands the lease back by value inside its error, as `TrySendError<T>` does.
#![allow(clippy::result_large_err)]

use super::fence::{Fenced, Fencing, IdleEvent, fence};
use crate::core::engine::{CudaEngine, Shared};
#[cfg(feature = "safetensors")]
use crate::core::order::Use;
use crate::core::retire::Held;
#[cfg(feature = "safetensors")]
use crate::driver::DevicePtr;
use crate::error::{Error, Result, StagingError, SubmitError, UsageError};
use crate::memory::element::Element;
use crate::memory::pinned::PinnedHostBuffer;
use crate::memory::pressure::Memory;
use crate::memory::ring::{Slot, SlotKind, StagingConfig, StagingRing, StagingStats, free_slot};
use crate::memory::tensor::DeviceTensor;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// A slot out of the ring. Dropping it returns the slot to the ring; it is dropped only where
/// no queued copy names the slot (a proven lease, or a retired record whose event proved
/// completion).
pub struct LeasedSlot {
    slot: Option<Slot>,
    owner: Arc<Shared>,
}

impl std::fmt::Debug for LeasedSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeasedSlot").finish_non_exhaustive()
    }
}

impl LeasedSlot {
    /// Holds `slot`, just taken from `owner`'s ring: dropping the holder returns it there.
    pub(crate) fn new(slot: Slot, owner: &Arc<Shared>) -> Self {
        LeasedSlot {
            slot: Some(slot),
            owner: Arc::clone(owner),
        }
    }

    /// The start of the slot's pinned memory. Whether it may be touched is the holder's
    /// business: a `LeasedSlot` proves nothing about queued copies.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.slot().ptr()
    }

    fn slot(&self) -> &Slot {
        // Invariant: `slot` is `Some` until `drop`.
        self.slot
            .as_ref()
            .expect("a live leased slot holds its slot")
    }
}

/// The slot's bytes: staging memory that goes back to the ring with it.
impl Held for LeasedSlot {
    fn held_bytes(&self) -> u64 {
        self.slot.as_ref().map_or(0, |slot| slot.bytes() as u64)
    }
}

impl Drop for LeasedSlot {
    fn drop(&mut self) {
        let Some(slot) = self.slot.take() else {
            return;
        };
        let Some(mut locked) = self.owner.lock_for_drop() else {
            return; // leaked: sound
        };
        let st = &mut *locked;
        let torn_down = st.torn_down;
        let ring = st.parts.get_mut::<StagingRing>();
        let Some(slot) = ring.put(&mut st.ledger, slot, torn_down) else {
            return;
        };
        drop(locked);
        if let Some(mut st) = self.owner.enter_for_drop() {
            let st = &mut *st;
            if let Err(error) = free_slot(&mut *st.driver, &mut st.ledger, slot, false) {
                st.defer(error);
            }
        }
    }
}

mod sealed {
    /// What a lease in this state holds.
    pub trait LeaseState {
        type Hold: Send + Sync;
    }
}

/// The state of a [`StagingLease`]. Sealed: [`Proven`] or [`Unproven`].
pub trait LeaseState: sealed::LeaseState + Send + Sync + 'static {
    /// A name for messages.
    const NAME: &'static str;
}

/// Lease state: no queued copy names the slot; its memory is reachable.
#[derive(Debug)]
pub enum Proven {}
/// Lease state: a copy was queued and an event recorded after it; the slot's memory is
/// unreachable until [`end_chunk`](StagingLease::end_chunk) proves it complete.
#[derive(Debug)]
pub enum Unproven {}

/// A proven lease's parts: the slot, and the idle event of its last chunk, reused by the next.
pub struct ProvenSlot {
    slot: LeasedSlot,
    event: Option<IdleEvent>,
}

impl std::fmt::Debug for ProvenSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProvenSlot").finish_non_exhaustive()
    }
}

impl sealed::LeaseState for Proven {
    type Hold = ProvenSlot;
}
impl sealed::LeaseState for Unproven {
    type Hold = Fenced<LeasedSlot>;
}
impl LeaseState for Proven {
    const NAME: &'static str = "proven";
}
impl LeaseState for Unproven {
    const NAME: &'static str = "unproven";
}

/// The exclusive use of one pinned staging slot of an engine, in state `S`.
///
/// Get one with [`CudaEngine::staging_lease`]. In state [`Proven`] no queued copy names the
/// slot: its memory is reachable and the lease can be released or begin a chunk. In state
/// [`Unproven`] a copy was queued: nothing reaches the memory, and the ways out are
/// [`end_chunk`](StagingLease::end_chunk) (wait: `Proven` again) and
/// [`retire`](StagingLease::retire) (to the retirement queue; dropping does the same).
#[must_use = "a lease holds a staging slot; release a proven lease, end or retire an unproven one"]
pub struct StagingLease<S: LeaseState> {
    hold: <S as sealed::LeaseState>::Hold,
    _state: PhantomData<S>,
}

impl<S: LeaseState> std::fmt::Debug for StagingLease<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingLease")
            .field("state", &S::NAME)
            .finish()
    }
}

/// What a failed begin hands back: the lease, proven, when nothing is in flight.
type Begun = Result<StagingLease<Unproven>, SubmitError<StagingLease<Proven>>>;

/// The error of a begin that did not go in flight, with the lease it handed back (if any)
/// released to the ring: for a route that gives up at the first failure.
pub(crate) fn released(refused: SubmitError<StagingLease<Proven>>) -> Error {
    match refused {
        SubmitError::Rejected { input, error } | SubmitError::Failed { input, error } => {
            input.release();
            error
        }
        SubmitError::Retained { error } => error,
    }
}

impl<S: LeaseState> StagingLease<S> {
    fn new(hold: <S as sealed::LeaseState>::Hold) -> Self {
        StagingLease {
            hold,
            _state: PhantomData,
        }
    }
}

impl StagingLease<Proven> {
    fn from_slot(slot: Slot, owner: &Arc<Shared>, event: Option<IdleEvent>) -> Self {
        StagingLease::new(ProvenSlot {
            slot: LeasedSlot::new(slot, owner),
            event,
        })
    }

    fn slot(&self) -> &Slot {
        self.hold.slot.slot()
    }

    /// The slot's size in bytes.
    pub fn capacity(&self) -> usize {
        self.slot().bytes()
    }

    /// The slot's memory.
    pub fn as_bytes(&self) -> &[u8] {
        let slot = self.slot();
        // SAFETY: the slot is `bytes` long, exclusively leased, and no queued copy names it
        // (state `Proven`); its bytes are initialised (`new_slot` zeroes fresh memory).
        unsafe { std::slice::from_raw_parts(slot.ptr(), slot.bytes()) }
    }

    /// The slot's memory, mutably.
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        let slot = self.slot();
        // SAFETY: as in `as_bytes`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(slot.ptr(), slot.bytes()) }
    }

    /// Returns the slot to the ring.
    pub fn release(self) {
        drop(self); // the slot's drop returns it
    }

    /// Queues a copy of the slot's first `len` elements' bytes into `destination`, starting at
    /// element `offset`, records an event after it, and yields the lease [`Unproven`].
    ///
    /// # Errors
    /// [`SubmitError::Rejected`] (lease back, proven) for an empty chunk
    /// ([`UsageError::ZeroLength`](crate::error::UsageError::ZeroLength)), one outside the tensor
    /// ([`StagingError::ChunkOutOfRange`](crate::error::StagingError::ChunkOutOfRange)) or larger
    /// than the slot ([`StagingError::ChunkTooLarge`](crate::error::StagingError::ChunkTooLarge)),
    /// or a lease or tensor of another engine
    /// ([`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine));
    /// [`SubmitError::Failed`] (lease back, proven) for a refused enqueue ([`Error::Driver`]), or
    /// a copy proven complete by a stream synchronize after its event could not be recorded;
    /// [`SubmitError::Retained`] when the copy was queued but cannot be tracked: the slot is then
    /// retained for the engine's lifetime, never reused, and stays counted as leased in
    /// [`staging_stats`](CudaEngine::staging_stats) and as retained in
    /// [`retirement_stats`](CudaEngine::retirement_stats).
    pub fn begin_upload<T: Element>(
        self,
        engine: &mut CudaEngine,
        destination: &mut DeviceTensor<T>,
        offset: usize,
        len: usize,
    ) -> Begun {
        self.begin(engine, destination, offset, len, true, None)
    }

    /// Queues a copy of `len` elements of `source`, starting at element `offset`, into the
    /// slot's first bytes, records an event after it, and yields the lease [`Unproven`].
    ///
    /// # Errors
    /// As [`begin_upload`](Self::begin_upload).
    pub fn begin_download<T: Element>(
        self,
        engine: &mut CudaEngine,
        source: &DeviceTensor<T>,
        offset: usize,
        len: usize,
    ) -> Begun {
        self.begin(engine, source, offset, len, false, None)
    }

    /// As [`begin_download`](Self::begin_download), queued as copies of at most `part`
    /// elements each, with a [`Mark`] recorded after every part but the last, so the parts'
    /// bytes can be read as they arrive while the later parts are still on the wire.
    ///
    /// The lease covers every queued part; a mark covers only the bytes of the parts before it.
    /// When a part after the first cannot be queued, or a mark cannot be recorded, the parts
    /// queued so far stay covered by the lease (which comes back `Unproven` as usual) and the
    /// failure is the last entry of `marks`, as [`Mark::Failed`]: nothing after it was queued.
    pub(crate) fn begin_download_marked<T: Element>(
        self,
        engine: &mut CudaEngine,
        source: &DeviceTensor<T>,
        offset: usize,
        len: usize,
        part: usize,
        marks: &mut Vec<Mark>,
    ) -> Begun {
        self.begin(
            engine,
            source,
            offset,
            len,
            false,
            Some((part.max(1), marks)),
        )
    }

    /// Queues a copy of each of `copies` (bytes of the slot into byte tensors, several per
    /// slot), records one event after the last, and yields the lease [`Unproven`]: the
    /// scattered upload of a slot that holds the bytes of several tensors, or a chunk that does
    /// not start at the slot's first byte.
    ///
    /// Every copy is checked before any is queued. When a copy after the first cannot be queued,
    /// those queued so far stay covered by the lease (which comes back `Unproven`) and the
    /// failure is the second value: nothing after it was queued.
    ///
    /// # Errors
    /// As [`begin_upload`](Self::begin_upload), for any of the copies; an empty list is a
    /// [`UsageError::ZeroLength`](crate::error::UsageError::ZeroLength).
    #[cfg(feature = "safetensors")]
    pub(crate) fn begin_scatter(
        self,
        engine: &mut CudaEngine,
        copies: &[Scatter<'_>],
    ) -> (Begun, Option<Error>) {
        let refusal = if copies.is_empty() {
            Some(Error::Usage(UsageError::ZeroLength {
                what: "a scattered staging chunk",
            }))
        } else {
            copies.iter().find_map(|c| self.scatter_refusal(engine, c))
        };
        if let Some(error) = refusal {
            return (Err(SubmitError::Rejected { input: self, error }), None);
        }
        let host = self.slot().ptr();
        let owner = &engine.shared;
        let mut st = match owner.enter() {
            Ok(st) => st,
            Err(error) => return (Err(SubmitError::Failed { input: self, error }), None),
        };
        // From the first enqueue until the fence holds it, a panic inside any driver call below
        // leaks the slot (see `begin`).
        let ProvenSlot { slot, event } = self.hold;
        let slot = ManuallyDrop::new(slot);
        let mut lane = None;
        let mut later = None;
        for copy in copies {
            let device = copy.tensor.raw_ptr() + copy.at as u64;
            // The tensor alone needs no list made (the common case, once per piece).
            let whole = [Use::Write(copy.tensor.raw_ptr())];
            let with_parts: Vec<Use>;
            let uses: &[Use] = if copy.parts.is_empty() {
                &whole
            } else {
                with_parts = (whole.into_iter())
                    .chain(copy.parts.iter().map(|&part| Use::Write(part)))
                    .collect();
                &with_parts
            };
            let from = host.wrapping_add(copy.from);
            // SAFETY: `from + len` lies in the slot and `at + len` in the tensor (checked by
            // `scatter_refusal`); the slot is held in `ManuallyDrop` from here, then fenced below
            // (unreachable until its event proves every copy complete); the tensor's free is
            // ordered after the copy, and so are its parts' (the copy's uses name each).
            let queued = unsafe { st.queue_host_copy_of(true, uses, device, from, copy.len) };
            match queued {
                Ok(queued) => lane = Some(queued),
                Err(error) if lane.is_none() => {
                    drop(st);
                    // Nothing was queued: the lease comes back proven.
                    let slot = ManuallyDrop::into_inner(slot);
                    let lease = StagingLease::new(ProvenSlot { slot, event });
                    let failed = SubmitError::Failed {
                        input: lease,
                        error,
                    };
                    return (Err(failed), None);
                }
                Err(error) => {
                    later = Some(error);
                    break;
                }
            }
        }
        let lane = lane.expect("at least one copy was queued");
        let event = event.map(IdleEvent::into_raw);
        let fencing = fence(&mut st, owner, lane, slot, event, "staging chunk");
        drop(st);
        (begun(fencing), later)
    }

    /// Why `copy` cannot be queued from this slot, if it cannot.
    #[cfg(feature = "safetensors")]
    fn scatter_refusal(&self, engine: &CudaEngine, copy: &Scatter<'_>) -> Option<Error> {
        let end = copy.from.checked_add(copy.len);
        if end.is_none_or(|end| end > self.capacity()) {
            return Some(Error::Staging(StagingError::ChunkTooLarge {
                len: copy.from.saturating_add(copy.len),
                element_bytes: 1,
                capacity: self.capacity(),
            }));
        }
        self.refusal(engine, copy.tensor, copy.at, copy.len)
    }

    /// Why a chunk of `len` elements at `offset` of `tensor` cannot be queued, if it cannot.
    fn refusal<T: Element>(
        &self,
        engine: &CudaEngine,
        tensor: &DeviceTensor<T>,
        offset: usize,
        len: usize,
    ) -> Option<Error> {
        let owners = engine
            .shared
            .check(&self.hold.slot.owner)
            .and_then(|()| engine.shared.check(tensor.owner()));
        if let Err(error) = owners {
            return Some(error);
        }
        if len == 0 {
            return Some(Error::Usage(UsageError::ZeroLength {
                what: "a staging chunk",
            }));
        }
        let size = T::DTYPE.size_bytes();
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > tensor.len()) {
            return Some(Error::Staging(StagingError::ChunkOutOfRange {
                offset,
                len,
                elements: tensor.len(),
            }));
        }
        if len.saturating_mul(size) > self.capacity() {
            return Some(Error::Staging(StagingError::ChunkTooLarge {
                len,
                element_bytes: size,
                capacity: self.capacity(),
            }));
        }
        None
    }

    fn begin<T: Element>(
        self,
        engine: &mut CudaEngine,
        tensor: &DeviceTensor<T>,
        offset: usize,
        len: usize,
        upload: bool,
        mut marks: Option<(usize, &mut Vec<Mark>)>,
    ) -> Begun {
        if let Some(error) = self.refusal(engine, tensor, offset, len) {
            return Err(SubmitError::Rejected { input: self, error });
        }
        let size = T::DTYPE.size_bytes();
        let part = marks.as_ref().map_or(len, |(part, _)| *part);
        let host = self.slot().ptr();
        let owner = &engine.shared;
        let mut st = match owner.enter() {
            Ok(st) => st,
            Err(error) => return Err(SubmitError::Failed { input: self, error }),
        };
        // From the first enqueue until the fence holds it (or a refusal proves nothing was
        // queued), a panic inside any driver call below leaks the slot: returned to the ring, it
        // would be reused while a queued copy still reads or writes it.
        let ProvenSlot { slot, event } = self.hold;
        let slot = ManuallyDrop::new(slot);
        let mut lane = None;
        let mut unproven_mark = None;
        let mut at = 0;
        while at < len {
            let n = part.min(len - at);
            let device = tensor.raw_ptr() + ((offset + at) * size) as u64;
            // SAFETY: the slot holds at least `len * size` bytes and is held in `ManuallyDrop`
            // from here, then fenced below (unreachable until its event proves the copies
            // complete); the device range lies in the tensor, whose free is ordered after this
            // copy.
            let queued = unsafe {
                st.queue_host_copy(
                    upload,
                    tensor.raw_ptr(),
                    device,
                    host.add(at * size),
                    n * size,
                )
            };
            let queued = match queued {
                Ok(queued) => queued,
                Err(error) => match (&mut marks, lane) {
                    // A later part (only a marked chunk has one): the parts before it stand.
                    (Some((_, marks)), Some(_)) => {
                        marks.push(Mark::Failed(error));
                        break;
                    }
                    _ => {
                        drop(st);
                        // Nothing was queued: the lease comes back proven.
                        let slot = ManuallyDrop::into_inner(slot);
                        let lease = StagingLease::new(ProvenSlot { slot, event });
                        return Err(SubmitError::Failed {
                            input: lease,
                            error,
                        });
                    }
                },
            };
            lane = Some(queued);
            at += n;
            let Some((_, marks)) = &mut marks else {
                continue; // one part: the whole chunk
            };
            if at == len {
                break;
            }
            match fence(
                &mut st,
                owner,
                queued,
                ManuallyDrop::new(()),
                None,
                "staging progress mark",
            ) {
                Fencing::Fenced(mark) => marks.push(Mark::Recorded(mark)),
                Fencing::Proven((), error) => {
                    marks.push(Mark::Failed(error));
                    break;
                }
                Fencing::Untracked(untracked, error) => {
                    // Retained once the lock is released (retaining counts it under the lock).
                    unproven_mark = Some(untracked);
                    marks.push(Mark::Failed(error));
                    break;
                }
            }
        }
        let lane = lane.expect("at least one part was queued");
        let event = event.map(IdleEvent::into_raw);
        let fencing = fence(&mut st, owner, lane, slot, event, "staging chunk");
        drop(st);
        if let Some(untracked) = unproven_mark {
            untracked.retain();
        }
        begun(fencing)
    }
}

/// What a begin gives once its copies are queued and the slot's fence is tried: the lease
/// `Unproven`; back `Proven`, where a stream synchronize proved the copies complete; or
/// nothing, the slot retained, where nothing proves them complete (never reused or freed).
fn begun(fencing: Fencing<LeasedSlot>) -> Begun {
    match fencing {
        Fencing::Fenced(fenced) => Ok(StagingLease::new(fenced)),
        Fencing::Proven(slot, error) => Err(SubmitError::Failed {
            input: StagingLease::new(ProvenSlot { slot, event: None }),
            error,
        }),
        Fencing::Untracked(untracked, error) => {
            if let Some(mut st) = untracked.owner().lock_for_drop() {
                st.parts.get_mut::<StagingRing>().count_retired();
            }
            untracked.retain();
            Err(SubmitError::Retained { error })
        }
    }
}

/// One copy of a scattered upload ([`StagingLease::begin_scatter`]): `len` bytes from byte
/// `from` of the slot into byte `at` of `tensor`.
#[cfg(feature = "safetensors")]
pub(crate) struct Scatter<'t> {
    pub(crate) tensor: &'t DeviceTensor<u8>,
    pub(crate) at: usize,
    pub(crate) from: usize,
    pub(crate) len: usize,
    /// The tensors inside `tensor` the copy writes too, when `tensor` is an allocation that
    /// holds several (every one its bytes `at..at + len` reach): their later uses are ordered
    /// after the copy.
    pub(crate) parts: &'t [DevicePtr],
}

/// A point inside a download chunk queued in parts ([`StagingLease::begin_download_marked`]).
pub(crate) enum Mark {
    /// An event recorded after a part's copy: once it completes, the bytes of that part and of
    /// every part before it have arrived in the slot. It proves nothing about later parts, so
    /// the slot stays the lease's.
    Recorded(Fenced<()>),
    /// A part or a mark that could not be queued or recorded: nothing after it was queued.
    Failed(Error),
}

mod keep_alive {
    pub trait Sealed {
        /// The bytes of the engine's memory the value holds, for the retirement queue's
        /// figures.
        fn held(&self) -> u64;
    }
}

/// What a retired lease may keep alive until its proof: the crate's own device and host values,
/// `()`, and pairs of them.
///
/// Sealed, because the retirement queue drops what it releases inside the engine: a value whose
/// drop runs the caller's code (which could panic there), or one that holds an engine (which
/// would then own itself and never be torn down), cannot be handed to it. Both are compile
/// errors:
///
/// ```compile_fail,E0277
/// # use cuferry::sim::SimConfig;
/// # use cuferry::CudaEngine;
/// let mut engine = CudaEngine::simulated(SimConfig::default());
/// let mut tensor = engine.alloc_tensor::<u8>(&[8]).unwrap();
/// let lease = engine.staging_lease().unwrap();
/// let unproven = lease.begin_upload(&mut engine, &mut tensor, 0, 8).unwrap();
/// unproven.retire_with(engine); // error[E0277]: `CudaEngine` is not `KeepAlive`
/// ```
pub trait KeepAlive: keep_alive::Sealed + Send + Sync + 'static {}

impl keep_alive::Sealed for () {
    fn held(&self) -> u64 {
        0
    }
}
impl KeepAlive for () {}
impl<T: Element> keep_alive::Sealed for DeviceTensor<T> {
    fn held(&self) -> u64 {
        self.held_bytes()
    }
}
impl<T: Element> KeepAlive for DeviceTensor<T> {}
impl<T: Element> keep_alive::Sealed for PinnedHostBuffer<T> {
    fn held(&self) -> u64 {
        self.held_bytes()
    }
}
impl<T: Element> KeepAlive for PinnedHostBuffer<T> {}
impl<A: KeepAlive, B: KeepAlive> keep_alive::Sealed for (A, B) {
    fn held(&self) -> u64 {
        self.0.held() + self.1.held()
    }
}
impl<A: KeepAlive, B: KeepAlive> KeepAlive for (A, B) {}

impl StagingLease<Unproven> {
    /// Waits for the chunk's event, holding no engine lock, and yields the lease [`Proven`].
    ///
    /// # Errors
    /// [`Error::DeviceFault`] when the device reports a failure of the chunk (or of earlier
    /// work): the slot is then retained for the engine's lifetime, never reused, and stays
    /// counted as leased (against the caller's lease budget, for a caller's lease).
    pub fn end_chunk(self) -> Result<StagingLease<Proven>> {
        let (slot, event) = self.hold.wait_parts()?;
        Ok(StagingLease::new(ProvenSlot {
            slot,
            event: Some(event),
        }))
    }

    /// Hands the slot to the engine's retirement queue, which returns it to the ring once the
    /// chunk's event proves completion. Dropping the lease does the same.
    pub fn retire(self) {
        self.retire_with(());
    }

    /// As [`retire`](Self::retire), keeping `resource` (for example the device tensor the chunk
    /// was copying into) alive until the same proof.
    pub fn retire_with<R: KeepAlive>(self, resource: R) {
        if let Some(mut st) = self.hold.owner().lock_for_drop() {
            st.parts.get_mut::<StagingRing>().count_retired();
        }
        let bytes = keep_alive::Sealed::held(&resource);
        drop(self.hold.attach(resource, bytes));
    }
}

impl CudaEngine {
    /// Leases one staging slot of the engine, for building a chunked pipeline by hand.
    ///
    /// Callers' leases draw on a budget of their own, `ring_depth` at a time, so they never
    /// starve the blocking routes.
    ///
    /// # Errors
    /// [`StagingError::Exhausted`](crate::error::StagingError::Exhausted) when `ring_depth` leases are out; [`Error::Driver`] when a new
    /// slot cannot be allocated (out of memory: only after the slots of retired work the device
    /// has finished were released, the engine's idle pinned memory freed, and the allocation
    /// tried once more).
    pub fn staging_lease(&mut self) -> Result<StagingLease<Proven>> {
        self.lease(SlotKind::User)
    }

    /// Leases a slot of the blocking routes' pipeline.
    pub(crate) fn route_lease(&mut self) -> Result<StagingLease<Proven>> {
        self.lease(SlotKind::Route)
    }

    /// Keeps up to `slots` of the blocking routes' slots idle once they are released (at least
    /// `ring_depth`), for a route that stages through that many: a checkpoint load or save,
    /// whose next run then finds its slots made. Idle slots are still freed under memory
    /// pressure and when the settings change.
    #[cfg(feature = "safetensors")]
    pub(crate) fn reserve_route_slots(&mut self, slots: usize) {
        self.shared
            .lock()
            .parts
            .get_mut::<StagingRing>()
            .reserve(slots);
    }

    fn lease(&mut self, kind: SlotKind) -> Result<StagingLease<Proven>> {
        let (st, slot) = self.shared.allocate(Memory::PageLocked, |st, pressure| {
            // Under pressure a slot released meanwhile serves first; else idle pinned memory
            // is freed to make room for a new one.
            if pressure && !st.parts.get_mut::<StagingRing>().has_idle() {
                st.free_idle_pinned();
            }
            st.parts
                .get_mut::<StagingRing>()
                .take_slot(&mut *st.driver, &mut st.ledger, kind)
        })?;
        drop(st);
        Ok(StagingLease::from_slot(slot, &self.shared, None))
    }

    /// The engine's staging settings.
    pub fn staging_config(&self) -> StagingConfig {
        self.shared.lock().parts.get_mut::<StagingRing>().config()
    }

    /// Changes the staging settings. Idle slots of the old size are freed. `copy_threads` only
    /// caps this engine's share of the process's shared copy threads (see
    /// [`StagingConfig::copy_threads`]); the threads themselves are not rebuilt.
    ///
    /// # Errors
    /// [`UsageError::InvalidSetting`](crate::error::UsageError::InvalidSetting) for a value out of range (the settings are then unchanged);
    /// [`Error::Driver`] when the driver refuses to free an idle slot (the settings change).
    pub fn set_staging_config(&mut self, config: StagingConfig) -> Result<()> {
        config.validate()?;
        let mut st = self.enter()?;
        let st = &mut *st;
        st.parts
            .get_mut::<StagingRing>()
            .reconfigure(&mut *st.driver, &mut st.ledger, config)
    }

    /// The staging ring's counters.
    pub fn staging_stats(&self) -> StagingStats {
        self.shared.lock().parts.get_mut::<StagingRing>().stats()
    }
}
