//! `RegisteredBuffer<T>`: a `Vec<T>` of the caller's, page-locked in place for transfers.
//!
//! # Why it exists
//!
//! The device's copy engines reach full speed, and copies become asynchronous, only with
//! page-locked host memory. A [`PinnedHostBuffer`](crate::PinnedHostBuffer) is such memory, but
//! it is the engine's: data that already lives in a `Vec` has to be copied into it first (the
//! blocking routes make that copy for you, through the staging ring, on host threads).
//! Registering the `Vec`'s own memory with the driver (`cuMemHostRegister`) page-locks it where
//! it is: the DMA then reads and writes the caller's buffer directly, with no staging copy and no
//! second buffer, at the raw pinned copy's speed.
//!
//! # The lifecycle
//!
//! - [`RegisteredBuffer::register`] takes the `Vec` by value and registers its `len` elements.
//!   A refusal hands the `Vec` back untouched in a [`SubmitError`]: [`UsageError::ZeroLength`](crate::error::UsageError::ZeroLength) for an
//!   empty `Vec`, [`Error::Driver`] when the driver will not lock the memory.
//! - While you hold the buffer, [`as_slice`](RegisteredBuffer::as_slice) and
//!   [`as_mut_slice`](RegisteredBuffer::as_mut_slice) read and write it.
//! - [`upload_pending`](crate::upload_pending) and [`download_pending`](crate::download_pending)
//!   take it by value, exactly as they take a pinned buffer: while the transfer is in flight
//!   nothing can reach the memory (it is moved, so touching it does not compile), and it comes
//!   back from [`wait`](crate::Pending::wait), from a returned transfer's
//!   [`into_parts`](crate::Pending::into_parts) and from a refused submission.
//! - [`into_vec`](RegisteredBuffer::into_vec) unregisters the memory and gives the `Vec` back:
//!   the same allocation, with its data. If the driver refuses to unregister it, the memory stays
//!   registered and is retained: never handed back and never freed (leaked for the life of the
//!   process), and the error is returned.
//! - Dropping the buffer unregisters the memory, then frees it. If unregistering fails, the
//!   memory is leaked instead and the failure is reported at the engine's next
//!   [`flush`](crate::CudaEngine::flush) or [`synchronize`](crate::CudaEngine::synchronize).
//! - Dropping an in-flight transfer that owns the buffer detaches it into the engine's
//!   retirement queue: the buffer is unregistered and freed only after the transfer's event
//!   proves the copy complete. A transfer whose completion cannot be proven keeps the buffer for
//!   the life of the engine, registered and never freed.
//! - `mem::forget` of the buffer, or of a transfer that owns it, leaks the registration and the
//!   memory, which is sound: nothing is freed while a copy may use it.
//! - The buffer keeps the engine's shared core alive, as every value the engine hands out does,
//!   so a buffer dropped after its engine is still unregistered on the engine's own context.
//!
//! The memory is registered with flags 0: it is page-locked for the engine's context, which the
//! engine makes current around every copy it queues. The driver locks whole pages, so the pages
//! at either end of a small `Vec` may hold other data of the process; locking them changes none
//! of it. Registering a range whose pages overlap memory already registered may be refused by
//! the driver (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`); the `Vec` then comes back.
//!
//! # The cost of registering
//!
//! Registration is not free: the driver pins every page of the range, which takes about as long
//! as several copies of it (`docs/records/async-registered-handoff.md`). Register a `Vec` once
//! and move it many times: the saving over the blocking routes' staged copy is paid for only
//! after a number of transfers, which the `registered` group of `benches/transfer_paths.rs`
//! measures and prints for several sizes. For a one-off transfer of data in a `Vec`, the blocking
//! routes are faster.
//!
//! # Why an owned buffer and not a borrow
//!
//! A value that held a borrow of the caller's memory (`&mut [T]`, page-locked for a transfer)
//! could be passed to `mem::forget`: the borrow would end for the compiler while the DMA still
//! read or wrote the memory, which the caller could then free or reuse. Safe Rust cannot forbid
//! `mem::forget`, so the only sound borrowed form is a scope whose end proves every transfer it
//! started complete. The owned form is sound without one, because forgetting it leaks the memory
//! rather than freeing it, and it hands the memory to a transfer by value like every other
//! pending route, so it is the form offered.

use super::element::Element;
use super::host::{HostBuffer, sealed::HostMemory};
use super::pressure::Memory;
use crate::core::engine::{CudaEngine, Shared};
use crate::core::retire::Held;
use crate::device::DeviceId;
use crate::error::{Error, Result, SubmitError, UsageError};
use crate::ledger::Owner;
use std::panic::Location;
use std::sync::Arc;

/// The parts of the registered `Vec`.
struct Parts<T> {
    ptr: *mut T,
    len: usize,
    capacity: usize,
}

impl<T> Parts<T> {
    /// The bytes registered: the elements, not the spare capacity.
    fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Rebuilds the `Vec`.
    ///
    /// # Safety
    /// Called once, when the memory is no longer registered and no copy can touch it.
    unsafe fn into_vec(self) -> Vec<T> {
        // SAFETY: the parts are those of a `Vec<T>` taken apart by `register` and rebuilt once
        // (the caller's contract).
        unsafe { Vec::from_raw_parts(self.ptr, self.len, self.capacity) }
    }
}

/// A `Vec<T>` of yours, page-locked in place, so pending transfers move it at the copy engines'
/// full speed with no staging copy.
///
/// Make one with [`register`](Self::register); read and write it with
/// [`as_slice`](Self::as_slice) and [`as_mut_slice`](Self::as_mut_slice) while you hold it; hand
/// it to [`upload_pending`](crate::upload_pending) or [`download_pending`](crate::download_pending)
/// by value, and it comes back from the transfer; take the `Vec` back with
/// [`into_vec`](Self::into_vec). Dropping it unregisters and frees the memory; dropping an
/// in-flight transfer that owns it does so once the copy is proven complete; `mem::forget` leaks
/// it (sound). A refused registration hands the `Vec` back.
///
/// Registering costs about as much as several copies of the same bytes, so register once and
/// transfer many times. The [transfers guide](crate::guide::transfers) says when registering pays
/// off, and why the buffer owns the `Vec` instead of borrowing it.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use cuferry::{download_pending, upload_pending, CudaEngine, RegisteredBuffer};
/// # use cuferry::sim::SimConfig;
/// # let mut engine = CudaEngine::simulated(SimConfig::default());
/// let data: Vec<f32> = (0..1024).map(|i| i as f32 + 0.5).collect();
/// let start = data.as_ptr();
/// let buffer = RegisteredBuffer::register(&mut engine, data)?;
/// let tensor = engine.alloc_tensor::<f32>(&[1024])?;
/// let (mut buffer, tensor) = upload_pending(&mut engine, buffer, tensor)?.wait()?.into_parts();
/// buffer.as_mut_slice().fill(0.0);
/// let (_tensor, buffer) = download_pending(&mut engine, tensor, buffer)?.wait()?.into_parts();
/// let back = buffer.into_vec()?;
/// assert_eq!(back.as_ptr(), start, "the same allocation");
/// assert_eq!(back[3], 3.5);
/// # Ok(()) }
/// ```
pub struct RegisteredBuffer<T: Element> {
    /// `Some` until `into_vec` or `drop` takes it.
    parts: Option<Parts<T>>,
    owner: Arc<Shared>,
}

// SAFETY: the buffer owns its `Vec`'s memory exclusively, as the `Vec` did; `T: Send`.
unsafe impl<T: Element> Send for RegisteredBuffer<T> {}
// SAFETY: shared access only reads through `&self` (`as_slice`), and `T: Sync`; every write
// needs `&mut self`.
unsafe impl<T: Element> Sync for RegisteredBuffer<T> {}

impl<T: Element> std::fmt::Debug for RegisteredBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len())
            .finish()
    }
}

impl<T: Element> RegisteredBuffer<T> {
    /// Page-locks the `len` elements of `data` in place for `engine`'s transfers.
    ///
    /// Only the elements are registered (`len * size_of::<T>()` bytes): spare capacity is not,
    /// and is kept for the `Vec` that [`into_vec`](Self::into_vec) gives back.
    ///
    /// # Errors
    /// The `Vec` comes back untouched: [`SubmitError::Rejected`] with
    /// [`UsageError::ZeroLength`](crate::error::UsageError::ZeroLength) for an empty `Vec`;
    /// [`SubmitError::Failed`] with [`Error::Driver`] when the engine's context cannot be made
    /// current or the driver refuses to lock the memory (`cuMemHostRegister`).
    #[track_caller]
    pub fn register(
        engine: &mut CudaEngine,
        mut data: Vec<T>,
    ) -> Result<Self, SubmitError<Vec<T>>> {
        if data.is_empty() {
            return Err(SubmitError::Rejected {
                input: data,
                error: Error::Usage(UsageError::ZeroLength {
                    what: "a registered host buffer",
                }),
            });
        }
        let bytes = std::mem::size_of_val(data.as_slice());
        let host = data.as_mut_ptr().cast::<u8>();
        let at = Location::caller();
        let registered = engine
            .shared
            .allocate(Memory::PageLocked, |st, under_pressure| {
                if under_pressure {
                    st.free_idle_pinned();
                }
                st.driver
                    .host_register(host, bytes)
                    .map_err(Error::driver("cuMemHostRegister"))?;
                st.ledger.allocated(Owner::Registered, bytes, at);
                Ok(())
            })
            .map(drop);
        if let Err(error) = registered {
            return Err(SubmitError::Failed { input: data, error });
        }
        let mut data = std::mem::ManuallyDrop::new(data);
        Ok(RegisteredBuffer {
            parts: Some(Parts {
                ptr: data.as_mut_ptr(),
                len: data.len(),
                capacity: data.capacity(),
            }),
            owner: Arc::clone(&engine.shared),
        })
    }

    fn parts(&self) -> &Parts<T> {
        // Invariant: `parts` is `Some` until `into_vec` or `drop`, which consume the buffer.
        self.parts
            .as_ref()
            .expect("a live registered buffer holds its memory")
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.parts().len
    }

    /// Always false: a registered buffer holds at least one element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The size in bytes: what is registered.
    pub fn byte_len(&self) -> usize {
        self.len() * T::DTYPE.size_bytes()
    }

    /// The contents.
    pub fn as_slice(&self) -> &[T] {
        let parts = self.parts();
        // SAFETY: the parts are a `Vec<T>`'s, whose first `len` elements are initialised; no copy
        // touches them while the caller holds the buffer (transfers take it by value), and every
        // copy into it wrote valid `T`s (any bit pattern is one for every element type but
        // `bool`, and downloads into `bool` buffers are refused). Shared access follows `&self`.
        unsafe { std::slice::from_raw_parts(parts.ptr, parts.len) }
    }

    /// The contents, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        let parts = self.parts();
        // SAFETY: as in `as_slice`; exclusive access follows `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(parts.ptr, parts.len) }
    }

    /// Unregisters the memory and gives the `Vec` back: the same allocation, with its length and
    /// capacity, holding what the buffer holds now.
    ///
    /// # Errors
    /// [`Error::Driver`] when the engine's context cannot be made current or the driver refuses to
    /// unregister the memory (`cuMemHostUnregister`). The memory is then retained: it stays
    /// registered and is never handed back or freed (leaked for the life of the process).
    pub fn into_vec(mut self) -> Result<Vec<T>> {
        // From here the buffer's drop does nothing: the parts are either rebuilt or leaked.
        let parts = self
            .parts
            .take()
            .expect("a live registered buffer holds its memory");
        let mut st = self.owner.enter()?;
        // SAFETY: the memory was registered by `register` and is unregistered once (the parts were
        // just taken); no copy touches it, since the caller holds the buffer by value.
        unsafe { st.driver.host_unregister(parts.ptr.cast::<u8>()) }
            .map_err(Error::driver("cuMemHostUnregister"))?;
        st.ledger
            .freed(Owner::Registered, parts.bytes(), Location::caller());
        drop(st);
        // SAFETY: no longer registered, touched by no copy, rebuilt once.
        Ok(unsafe { parts.into_vec() })
    }
}

impl<T: Element> HostMemory for RegisteredBuffer<T> {
    const KIND: &'static str = "registered";

    fn host_ptr(&self) -> *mut u8 {
        self.parts().ptr.cast::<u8>()
    }

    fn host_len(&self) -> usize {
        self.len()
    }

    fn host_engine(&self) -> (DeviceId, u64) {
        (self.owner.device, self.owner.engine_id)
    }

    fn page_locked_bytes(&self) -> u64 {
        self.parts.as_ref().map_or(0, |parts| parts.bytes() as u64)
    }
}

impl<T: Element> HostBuffer<T> for RegisteredBuffer<T> {}

/// The registered bytes.
impl<T: Element> Held for RegisteredBuffer<T> {
    fn held_bytes(&self) -> u64 {
        self.page_locked_bytes()
    }
}

impl<T: Element> Drop for RegisteredBuffer<T> {
    fn drop(&mut self) {
        let Some(parts) = self.parts.take() else {
            return;
        };
        // A buffer is dropped by whoever holds it: the caller, a returned transfer, or the
        // retirement queue once the transfer's event proved its copy complete. Paths that cannot
        // prove completion never drop it. When the context cannot be entered, the memory stays
        // registered and is leaked (the failure is recorded for the next boundary).
        let Some(mut st) = self.owner.enter_for_drop() else {
            return;
        };
        // SAFETY: registered by `register`, unregistered once (the parts were just taken), and no
        // copy touches it (see above).
        match unsafe { st.driver.host_unregister(parts.ptr.cast::<u8>()) } {
            Ok(()) => {
                st.ledger
                    .freed(Owner::Registered, parts.bytes(), Location::caller());
                drop(st);
                // SAFETY: no longer registered, touched by no copy, rebuilt once.
                drop(unsafe { parts.into_vec() });
            }
            // The memory stays registered: leaked, never freed.
            Err(source) => st.defer(Error::Driver {
                call: "cuMemHostUnregister",
                source,
            }),
        }
    }
}
