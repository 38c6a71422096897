//! Blocking routes: ordinary host memory in, ordinary host memory out, at the PCIe limit.
//!
//! Each route returns only when the caller's host memory is no longer touched by the device: an
//! upload has read its source, a download has written its destination. Device-side ordering is
//! the engine's order (an event wait between its streams wherever a tensor is shared): an upload
//! is visible to every later operation on the engine.
//!
//! Three size bands, all through pinned staging (the device only reaches full speed from
//! page-locked memory, and the caller's memory is pageable):
//! - **16 bytes or less:** the engine's pinned scalar slot (`lifecycle::scalar`): one tiny copy,
//!   proven by a stream synchronize (the caller waits at once, so an event would add a record for
//!   the same proof).
//! - **Up to `cutoff_bytes`:** one staged copy through one ring slot.
//! - **Above:** a pipeline over the bounded ring of [`StagingLease`]s: host threads copy chunk
//!   k+1 into its slot while the DMA of chunk k runs; each chunk has its own event, and a slot
//!   is reused only after its event proved the previous chunk complete. A transfer of up to
//!   16 MiB whose chunks all fit in the ring at once is served in one hand-off to the copy
//!   threads instead: an upload leases every slot up front, copies all chunks together (in chunk
//!   order) and queues each chunk as soon as it has landed; a download queues its DMA into as
//!   few slots as hold it, in marked parts of 512 KiB, and copies each part out as soon as its
//!   mark proves it arrived.
//!
//! A failure after the first enqueue retires every unproven lease (with the destination tensor,
//! on uploads) into the retirement queue, so nothing is freed while DMA may still touch it, and
//! the route returns the error.

use crate::core::engine::CudaEngine;
use crate::driver::Lane;
use crate::dtype::DType;
use crate::error::{Error, Result, StagingError, SubmitError, UsageError};
use crate::lifecycle::lease::{KeepAlive, Mark, Proven, StagingLease, Unproven, released};
use crate::lifecycle::scalar::{SCALAR_BYTES, ScalarHost, scalar_transfer};
use crate::memory::element::{Element, as_bytes, byte_len};
use crate::memory::ring::StagingRing;
use crate::memory::stream_copy::copy_streaming;
use crate::memory::tensor::{DeviceTensor, shape_len};
use crate::sync::copy_pool::{self, CopyPool};
use crate::sync::{AtomicBool, AtomicUsize, Ordering, SpinWait};
use std::collections::VecDeque;

/// Bytes one host-copy task handles at least: below this, splitting costs more than it gains.
const MIN_COPY_PART: usize = 256 << 10;

/// A raw pointer that may cross to the copy threads: each task touches a disjoint range.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: tasks spawned from one `par_bytes` call touch disjoint ranges of memory that outlives
// the scope they run in.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut u8 {
        self.0
    }
}

/// The host-copy threads one transfer uses: the process's shared pool, and at most how many
/// parts the transfer splits each host copy into (the engine's `copy_threads`, no more than the
/// pool's threads).
#[derive(Clone, Copy)]
struct Copiers {
    pool: &'static CopyPool,
    parts: usize,
}

/// Hands out the indices `0..len` one at a time to whichever thread asks next: each index to
/// exactly one caller (a read-modify-write sees every earlier one, so no ordering is needed; what
/// an index stands for is published by other means).
struct Claims {
    next: AtomicUsize,
    len: usize,
}

impl Claims {
    fn new(len: usize) -> Self {
        Claims {
            next: AtomicUsize::new(0),
            len,
        }
    }

    /// The next unclaimed index, if any is left.
    fn claim(&self) -> Option<usize> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        (i < self.len).then_some(i)
    }
}

/// Runs `f(offset, len)` over `bytes` split into parts, on the shared copy threads when the range
/// is large enough.
fn par_bytes(copiers: Option<Copiers>, bytes: usize, f: impl Fn(usize, usize) + Sync) {
    let parts = copiers.map_or(1, |c| (bytes / MIN_COPY_PART).min(c.parts));
    let Some(copiers) = copiers.filter(|_| parts >= 2) else {
        f(0, bytes);
        return;
    };
    let part = bytes.div_ceil(parts).next_multiple_of(64);
    let claims = Claims::new(bytes.div_ceil(part));
    let work = || {
        while let Some(i) = claims.claim() {
            let offset = i * part;
            f(offset, part.min(bytes - offset));
        }
    };
    copiers.pool.join(parts - 1, &work, |_| work());
}

/// Copies `bytes` bytes from `src` to `dst` with the engine's copy threads; with `streaming`,
/// into pinned staging memory for the device to read next, with streaming stores (see
/// [`stream_copy`](crate::memory::stream_copy)).
///
/// Streaming is for uploads of up to [`STREAM_MAX_BYTES`] only. A larger upload copies its chunks
/// while earlier chunks' DMA runs, so its chunks leave the caches long before their DMA reads
/// them, and there the ordinary copy is faster (`docs/records/mid-size-transfers.md`).
///
/// # Safety
/// `src..src+bytes` is readable and `dst..dst+bytes` writable for the call, and they do not
/// overlap.
unsafe fn par_copy(
    copiers: Option<Copiers>,
    dst: *mut u8,
    src: *const u8,
    bytes: usize,
    streaming: bool,
) {
    let (d, s) = (SendPtr(dst), SendPtr(src.cast_mut()));
    par_bytes(copiers, bytes, |off, len| {
        let (to, from) = (d.get().wrapping_add(off), s.get().wrapping_add(off));
        // SAFETY: the caller's contract; `off..off+len` lies inside both ranges, and each task's
        // range is disjoint from every other's.
        unsafe {
            if streaming {
                copy_streaming(to, from, len)
            } else {
                std::ptr::copy_nonoverlapping(from, to, len)
            }
        }
    });
}

/// Decodes `bytes` device bytes at `src` into `bool`s at `dst` (`byte != 0`).
///
/// # Safety
/// As [`par_copy`], with `dst` pointing at `bytes` `bool` slots.
unsafe fn par_decode_bool(copiers: Option<Copiers>, dst: *mut u8, src: *const u8, bytes: usize) {
    let (d, s) = (SendPtr(dst), SendPtr(src.cast_mut()));
    par_bytes(copiers, bytes, |off, len| {
        // SAFETY: the caller's contract; `off..off+len` lies inside both ranges, and each task's
        // range is disjoint from every other's.
        unsafe { decode_bool(d.get().add(off), s.get().add(off), len) }
    });
}

/// Decodes `len` device bytes at `src` into `bool`s at `dst` (`byte != 0`), on this thread.
///
/// # Safety
/// `src..src+len` is readable, `dst..dst+len` writable `bool` slots, and they do not overlap.
unsafe fn decode_bool(dst: *mut u8, src: *const u8, len: usize) {
    for i in 0..len {
        // SAFETY: `i` lies inside both ranges; writing 0 or 1 makes a valid `bool`.
        unsafe { *dst.add(i) = u8::from(*src.add(i) != 0) };
    }
}

/// The shared copy threads and this engine's cap on them, when this transfer is large enough to
/// split.
fn pool_for(engine: &mut CudaEngine, bytes: usize) -> Result<Option<Copiers>> {
    if bytes < 2 * MIN_COPY_PART {
        return Ok(None);
    }
    let cap = engine
        .enter()?
        .parts
        .get_mut::<StagingRing>()
        .config()
        .copy_threads;
    let pool = copy_pool::pool()?;
    Ok(Some(Copiers {
        pool,
        parts: cap.min(pool.threads()),
    }))
}

/// The lease for the next chunk: a new one while fewer than `depth` chunks are in flight, else
/// the oldest in flight once proven.
fn next_lease(
    engine: &mut CudaEngine,
    in_flight: &mut VecDeque<StagingLease<Unproven>>,
    depth: usize,
) -> Result<StagingLease<Proven>> {
    if in_flight.len() < depth {
        return engine.route_lease();
    }
    let oldest = in_flight
        .pop_front()
        .ok_or(Error::Staging(StagingError::Exhausted { depth }))?;
    oldest.end_chunk()
}

/// Retires every unproven lease; the last (newest) keeps `resource` alive with it.
fn retire_all<R: KeepAlive>(mut in_flight: VecDeque<StagingLease<Unproven>>, resource: R) {
    let last = in_flight.pop_back();
    for lease in in_flight {
        lease.retire();
    }
    match last {
        Some(lease) => lease.retire_with(resource),
        None => drop(resource),
    }
}

/// An upload's chunk loop that failed: the error, and the leases whose queued copies may still
/// read their slots. The caller retires them, with the destination tensor when it owns it.
struct Stranded {
    error: Error,
    in_flight: VecDeque<StagingLease<Unproven>>,
}

impl Stranded {
    /// A failure with nothing in flight.
    fn alone(error: Error) -> Self {
        Stranded {
            error,
            in_flight: VecDeque::new(),
        }
    }

    /// Retires every lease still in flight, the newest keeping `resource` alive with it, and
    /// yields the error.
    fn retire_with<R: KeepAlive>(self, resource: R) -> Error {
        retire_all(self.in_flight, resource);
        self.error
    }
}

/// Waits for every lease in flight and releases them. A chunk whose wait fails is retained by
/// the engine; the leases after it come back in the [`Stranded`].
fn finish(mut in_flight: VecDeque<StagingLease<Unproven>>) -> Result<(), Stranded> {
    while let Some(lease) = in_flight.pop_front() {
        match lease.end_chunk() {
            Ok(proven) => proven.release(),
            Err(error) => return Err(Stranded { error, in_flight }),
        }
    }
    Ok(())
}

/// The smallest chunk the pipeline splits a transfer into.
const MIN_PIPELINE_CHUNK: usize = 1 << 20;

/// How one transfer is cut up, decided once from the engine's staging settings.
struct Plan {
    /// Elements per chunk.
    per_chunk: usize,
    /// Elements a staging slot holds (at least `per_chunk`).
    per_slot: usize,
    /// Chunks in flight at once.
    depth: usize,
}

/// The plan for a transfer of `bytes` bytes of `T`.
///
/// A transfer that would fill fewer slots than the ring has is split into `ring_depth` smaller
/// chunks (not below 1 MiB), so even a mid-size transfer overlaps its host copies with its DMA;
/// this also keeps the per-byte cost smooth across the chunk size (no cliff one element above
/// it).
fn plan<T: Element>(engine: &CudaEngine, bytes: usize) -> Plan {
    let config = engine.staging_config();
    let chunk = if bytes <= config.cutoff_bytes {
        config.cutoff_bytes
    } else {
        bytes
            .div_ceil(config.ring_depth)
            .max(MIN_PIPELINE_CHUNK.min(config.chunk_bytes))
            .min(config.chunk_bytes)
    };
    Plan {
        per_chunk: (chunk / T::DTYPE.size_bytes()).max(1),
        per_slot: (config.chunk_bytes / T::DTYPE.size_bytes()).max(1),
        depth: config.ring_depth,
    }
}

/// Fresh download buffers at least this large are backed by huge pages and populated ahead.
const POPULATE_MIN: usize = 4 << 20;

/// Prepares a fresh (never touched) destination of `bytes` bytes at `ptr` on the copy threads:
/// asks for transparent huge pages, then populates its pages (`MADV_POPULATE_WRITE`) in parts
/// that helpers claim, so the copy-out does not stop at a page fault per page. Populating never
/// changes contents, so it may race with the copy-out writing the same pages.
struct Populate {
    start: usize,
    end: usize,
    parts: Claims,
}

impl Populate {
    /// The bytes one populate call covers.
    const PART: usize = 16 << 20;
    const PAGE: usize = 4096;

    /// The whole pages of `ptr..ptr + bytes`, asked to be backed by huge pages.
    fn new(ptr: SendPtr, bytes: usize) -> Self {
        let start = (ptr.get() as usize).next_multiple_of(Self::PAGE);
        let end = ((ptr.get() as usize + bytes) & !(Self::PAGE - 1)).max(start);
        #[cfg(target_os = "linux")]
        if end > start {
            // SAFETY: the range lies inside memory the caller owns (a vector's spare capacity);
            // MADV_HUGEPAGE only changes how the kernel backs it. A refusal is harmless.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
        Populate {
            start,
            end,
            parts: Claims::new((end - start).div_ceil(Self::PART)),
        }
    }

    /// How many parts there are to claim.
    fn parts(&self) -> usize {
        self.parts.len
    }

    /// Populates parts until none is left unclaimed.
    fn run(&self) {
        while let Some(i) = self.parts.claim() {
            let at = self.start + i * Self::PART;
            #[cfg(target_os = "linux")]
            {
                let len = Self::PART.min(self.end - at);
                // SAFETY: as in `new`; MADV_POPULATE_WRITE maps the pages writable without
                // changing their contents. Kernels without it refuse with EINVAL, which is
                // harmless.
                unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
            }
            #[cfg(not(target_os = "linux"))]
            let _ = at; // elsewhere the copy-out faults the pages in itself
        }
    }
}

/// Uploads `data` into a new device tensor of the given shape, and returns once `data` has been
/// read.
///
/// # Errors
/// [`UsageError::LengthMismatch`](crate::error::UsageError::LengthMismatch) when `shape` does not describe `data.len()` elements,
/// [`UsageError::ShapeOverflow`](crate::error::UsageError::ShapeOverflow) when its element count overflows `usize`;
/// [`Error::Driver`] or [`Error::DeviceFault`] when the device refuses or fails (everything a
/// queued copy may still touch is then retired, not freed).
#[track_caller]
pub fn upload_tensor<T: Element>(
    engine: &mut CudaEngine,
    data: &[T],
    shape: &[usize],
) -> Result<DeviceTensor<T>> {
    let expected = shape_len(shape)?;
    if expected != data.len() {
        return Err(Error::Usage(UsageError::LengthMismatch {
            what: "upload_tensor: data for the shape",
            expected,
            found: data.len(),
            shape: Some(shape.to_vec()),
        }));
    }
    let mut tensor = DeviceTensor::alloc_on(engine, Lane::Upload, shape)?;
    match upload_staged(engine, data, &mut tensor) {
        Ok(()) => Ok(tensor),
        // The new tensor goes with the newest lease and is released with its proof.
        Err(stranded) => Err(stranded.retire_with(tensor)),
    }
}

/// Uploads `data` into an existing device tensor of this engine, and returns once `data` has
/// been read.
///
/// The counterpart of [`download_tensor_into`]: the same routes as [`upload_tensor`] (the 16-byte
/// scalar slot, one staged copy up to `cutoff_bytes`, the pipelined ring above it), with no
/// device allocation on any path. The tensor's shape is kept; only its length must match. Like
/// every upload, the copy is ordered after the work queued before it that uses the tensor (on
/// another stream, by an event wait on the device), so device work that reads the tensor's old
/// contents and was queued earlier still sees them.
///
/// ```
/// # fn main() -> Result<(), cuferry::Error> {
/// use cuferry::{download_tensor, upload_tensor_into, CudaEngine};
/// # let mut engine = CudaEngine::simulated(Default::default());
/// # /*
/// let mut engine = CudaEngine::open(0)?;
/// # */
/// let mut t = engine.alloc_tensor::<f32>(&[2, 2])?;
/// for step in 0..3 {
///     let frame: Vec<f32> = (0..4).map(|i| (step * 4 + i) as f32).collect();
///     upload_tensor_into(&mut engine, &mut t, &frame)?; // reuses the tensor's memory
///     assert_eq!(download_tensor(&mut engine, &t)?, frame);
/// }
///
/// // A length that does not match is refused before anything is queued.
/// let refused = upload_tensor_into(&mut engine, &mut t, &[1.0f32; 3]);
/// assert!(matches!(refused, Err(cuferry::Error::Usage(cuferry::error::UsageError::LengthMismatch { found: 3, expected: 4, .. }))));
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when the tensor is not this engine's, and [`UsageError::LengthMismatch`](crate::error::UsageError::LengthMismatch)
/// (`found` the data's length, `expected` the tensor's) when the lengths differ: both are refused
/// before anything is queued, and the tensor is untouched. An empty upload into an empty tensor
/// queues nothing and succeeds. [`Error::Driver`] or [`Error::DeviceFault`] when the device
/// refuses or fails: every staging slot a queued copy may still read is then retired, not freed,
/// and the tensor stays the caller's (its eventual free is ordered after the queued copies).
/// After such an error the tensor's contents are unspecified: some chunks may have landed and
/// others not.
pub fn upload_tensor_into<T: Element>(
    engine: &mut CudaEngine,
    tensor: &mut DeviceTensor<T>,
    data: &[T],
) -> Result<()> {
    tensor.check_engine(engine)?;
    if data.len() != tensor.len() {
        return Err(Error::Usage(UsageError::LengthMismatch {
            what: "upload_tensor_into: data for the tensor",
            found: data.len(),
            shape: None,
            expected: tensor.len(),
        }));
    }
    // The caller keeps the tensor: its free is stream-ordered after the queued copies, so the
    // leases are retired on their own.
    upload_staged(engine, data, tensor).map_err(|stranded| stranded.retire_with(()))
}

/// Uploads `data` (as long as `tensor`) through staging: on the copy threads when the transfer
/// is large enough to split its host copies.
fn upload_staged<T: Element>(
    engine: &mut CudaEngine,
    data: &[T],
    tensor: &mut DeviceTensor<T>,
) -> Result<(), Stranded> {
    debug_assert_eq!(data.len(), tensor.len());
    if data.is_empty() {
        return Ok(());
    }
    if std::mem::size_of_val(data) <= SCALAR_BYTES {
        return scalar_transfer(engine, tensor, ScalarHost::Upload(as_bytes(data)))
            .map_err(Stranded::alone);
    }
    let copiers = pool_for(engine, std::mem::size_of_val(data)).map_err(Stranded::alone)?;
    upload_chunks(engine, data, tensor, copiers)
}

/// The chunk loop of [`upload_tensor`] and [`upload_tensor_into`].
fn upload_chunks<T: Element>(
    engine: &mut CudaEngine,
    data: &[T],
    tensor: &mut DeviceTensor<T>,
    copiers: Option<Copiers>,
) -> Result<(), Stranded> {
    let src = as_bytes(data);
    let size = T::DTYPE.size_bytes();
    let plan = plan::<T>(engine, src.len());
    if let Some(copiers) = copiers.filter(|c| fits_at_once(&plan, data.len(), src.len(), *c)) {
        return upload_at_once(engine, data, tensor, copiers, &plan);
    }
    let streaming = src.len() <= STREAM_MAX_BYTES;
    let mut in_flight = VecDeque::new();
    let mut offset = 0;
    while offset < data.len() {
        let n = plan.per_chunk.min(data.len() - offset);
        let mut lease = match next_lease(engine, &mut in_flight, plan.depth) {
            Ok(lease) => lease,
            Err(error) => return Err(Stranded { error, in_flight }),
        };
        let part = &src[offset * size..(offset + n) * size];
        // SAFETY: the lease is proven (its memory is ours) and holds at least `part.len()` bytes
        // (`plan.per_chunk` elements fit a slot); `part` is borrowed for the call.
        unsafe {
            par_copy(
                copiers,
                lease.as_mut_bytes().as_mut_ptr(),
                part.as_ptr(),
                part.len(),
                streaming,
            )
        };
        match lease.begin_upload(engine, tensor, offset, n) {
            Ok(unproven) => in_flight.push_back(unproven),
            Err(refused) => {
                let error = released(refused);
                return Err(Stranded { error, in_flight });
            }
        }
        offset += n;
    }
    finish(in_flight)
}

/// Downloads a tensor into a new `Vec`, and returns once the data has arrived.
///
/// `bool` tensors are decoded byte by byte (`byte != 0`), since device bytes need not be 0 or 1.
///
/// # Errors
/// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when the tensor is not this engine's;
/// [`Error::Driver`] or [`Error::DeviceFault`] when the device refuses or fails.
pub fn download_tensor<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
) -> Result<Vec<T>> {
    tensor.check_engine(engine)?;
    let mut out = Vec::with_capacity(tensor.len());
    download_staged(engine, tensor, &mut out, true)?;
    Ok(out)
}

/// Downloads a tensor into a caller-owned `Vec`, resized to the tensor's length without
/// reallocating when its capacity suffices, and returns it filled.
///
/// # Errors
/// [`UsageError::UnsupportedElement`](crate::error::UsageError::UnsupportedElement) for `bool`, because raw device bytes need not be 0 or 1 (use
/// [`download_tensor`], which decodes them); otherwise as [`download_tensor`]. Every error hands
/// the `Vec` back: untouched in [`SubmitError::Rejected`] when refused before anything was
/// queued, emptied (its capacity kept) in [`SubmitError::Failed`] when the download failed.
pub fn download_tensor_into<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
    mut buffer: Vec<T>,
) -> Result<Vec<T>, SubmitError<Vec<T>>> {
    let refused = if !T::DTYPE.any_bit_pattern() {
        Some(Error::Usage(UsageError::UnsupportedElement {
            operation: "download_tensor_into",
            dtype: T::DTYPE,
            reason: "raw device bytes are not guaranteed to be 0 or 1; download_tensor decodes them",
        }))
    } else {
        tensor.check_engine(engine).err()
    };
    if let Some(error) = refused {
        return Err(SubmitError::Rejected {
            input: buffer,
            error,
        });
    }
    buffer.clear();
    buffer.reserve_exact(tensor.len());
    match download_staged(engine, tensor, &mut buffer, false) {
        Ok(()) => Ok(buffer),
        Err(error) => Err(SubmitError::Failed {
            input: buffer,
            error,
        }),
    }
}

/// Fills `out`'s spare capacity (at least `tensor.len()` elements) through staging and sets its
/// length. The device writes only staging memory, so `out` is never touched by DMA. A `fresh`
/// vector (just allocated) has its pages faulted in while the first chunks' DMA runs.
fn download_staged<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
    out: &mut Vec<T>,
    fresh: bool,
) -> Result<()> {
    debug_assert!(out.is_empty() && out.capacity() >= tensor.len());
    let total = tensor.len();
    let bytes = byte_len::<T>(total, "download")?;
    if bytes == 0 {
        return Ok(());
    }
    if bytes <= SCALAR_BYTES {
        let mut staged = [0u8; SCALAR_BYTES];
        scalar_transfer(engine, tensor, ScalarHost::Download(&mut staged[..bytes]))?;
        let dst = out.as_mut_ptr().cast::<u8>();
        // SAFETY: `out` has capacity for `total` elements (`bytes` bytes) and does not overlap
        // the local `staged`; the bytes have arrived (the transfer returned once complete).
        unsafe {
            if T::DTYPE == DType::Bool {
                decode_bool(dst, staged.as_ptr(), bytes);
            } else {
                std::ptr::copy_nonoverlapping(staged.as_ptr(), dst, bytes);
            }
            // Every element `0..total` was written, each a valid `T` (any bit pattern, or a
            // decoded 0/1 for bool).
            out.set_len(total);
        }
        return Ok(());
    }
    let copiers = pool_for(engine, bytes)?;
    download_chunks(engine, tensor, out, fresh, copiers)
}

/// The body of [`download_staged`], with the copy threads when there are any.
fn download_chunks<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
    out: &mut Vec<T>,
    fresh: bool,
    copiers: Option<Copiers>,
) -> Result<()> {
    let total = tensor.len();
    let bytes = total * T::DTYPE.size_bytes();
    let plan = plan::<T>(engine, bytes);
    let dst = SendPtr(out.as_mut_ptr().cast::<u8>());
    match copiers {
        Some(c) if fits_at_once(&plan, total, bytes, c) => {
            download_at_once::<T>(engine, tensor, dst, fresh, c, &plan)
        }
        // Half the copy threads populate the pages while the other half copy chunks out.
        Some(c) if fresh && bytes >= POPULATE_MIN => {
            let populate = Populate::new(dst, bytes);
            let helpers = populate.parts().min(c.parts / 2);
            c.pool.join(helpers, &|| populate.run(), |_| {
                chunk_loop::<T>(engine, tensor, dst, &plan, copiers)
            })
        }
        _ => chunk_loop::<T>(engine, tensor, dst, &plan, copiers),
    }?;
    // SAFETY: every chunk `0..total` was written by `chunk_loop`, each element a valid `T` (any
    // bit pattern, or a decoded 0/1 for bool).
    unsafe { out.set_len(total) };
    Ok(())
}

/// Downloads `tensor` chunk by chunk through the ring into `dst` (room for `tensor.len()`
/// elements): primes the ring, then copies out each proven slot and reuses it for the next chunk.
fn chunk_loop<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
    dst: SendPtr,
    plan: &Plan,
    copiers: Option<Copiers>,
) -> Result<()> {
    let total = tensor.len();
    let size = T::DTYPE.size_bytes();
    let mut in_flight: VecDeque<(StagingLease<Unproven>, usize, usize)> = VecDeque::new();
    let mut next = 0;
    let fail = |in_flight: VecDeque<(StagingLease<Unproven>, usize, usize)>, error| {
        in_flight
            .into_iter()
            .for_each(|(lease, _, _)| lease.retire());
        Err(error)
    };
    // Prime the ring, then keep it full: each proven slot is copied out and reused for the next
    // chunk.
    let mut spare: Option<StagingLease<Proven>> = None;
    loop {
        while in_flight.len() < plan.depth && next < total {
            let lease = match spare.take() {
                Some(lease) => lease,
                None => match engine.route_lease() {
                    Ok(lease) => lease,
                    Err(error) => return fail(in_flight, error),
                },
            };
            let n = plan.per_chunk.min(total - next);
            match lease.begin_download(engine, tensor, next, n) {
                Ok(unproven) => in_flight.push_back((unproven, next, n)),
                Err(refused) => {
                    let error = released(refused);
                    return fail(in_flight, error);
                }
            }
            next += n;
        }
        let Some((lease, offset, n)) = in_flight.pop_front() else {
            break;
        };
        let proven = match lease.end_chunk() {
            Ok(proven) => proven,
            Err(error) => return fail(in_flight, error),
        };
        let src = proven.as_bytes().as_ptr();
        // SAFETY: the lease is proven, so the chunk's bytes have arrived in its memory; `dst`
        // has capacity for `total` elements and `offset + n <= total`; the ranges are disjoint
        // (pinned staging vs the caller's vector).
        unsafe {
            let at = dst.get().add(offset * size);
            if T::DTYPE == DType::Bool {
                par_decode_bool(copiers, at, src, n * size);
            } else {
                par_copy(copiers, at, src, n * size, false);
            }
        }
        if next < total {
            spare = Some(proven);
        } else {
            proven.release();
        }
    }
    if let Some(lease) = spare {
        lease.release();
    }
    Ok(())
}

/// The largest transfer served by one parallel region (see [`fits_at_once`]): at 4 and 16 MiB one
/// region beat the chunk-by-chunk pipeline, at 64 MiB (16 MiB chunks) the pipeline beat it
/// (`docs/records/mid-size-transfers.md`).
const AT_ONCE_MAX_BYTES: usize = 16 << 20;

/// The largest upload whose host copies use streaming stores (see [`par_copy`]).
const STREAM_MAX_BYTES: usize = AT_ONCE_MAX_BYTES;

/// Whether a transfer of `len` elements (`bytes` bytes) under `plan` takes every chunk's slot at once (no more
/// chunks than the ring is deep, and at most [`AT_ONCE_MAX_BYTES`]), so one parallel region can
/// serve the whole transfer. Needs two copy threads at least: the thread that drives the
/// transfer waits on the others.
fn fits_at_once(plan: &Plan, len: usize, bytes: usize, copiers: Copiers) -> bool {
    copiers.parts >= 2
        && bytes <= AT_ONCE_MAX_BYTES
        && len.div_ceil(plan.per_chunk) <= plan.depth
        && len.div_ceil(plan.per_chunk) >= 2
}

/// The host-copy parts of one chunk of `bytes`: at least `min` bytes each, about one per copy
/// thread. Yields `(offset, len)` within the chunk.
fn copy_parts(bytes: usize, threads: usize, min: usize) -> impl Iterator<Item = (usize, usize)> {
    let part = bytes.div_ceil(threads.max(1)).max(min).next_multiple_of(64);
    (0..bytes)
        .step_by(part)
        .map(move |offset| (offset, part.min(bytes - offset)))
}

/// An upload whose chunks all fit in the ring at once: every slot is leased up front, the host
/// copies of all chunks are claimed in chunk order by the copy threads and the calling thread
/// together, and each chunk's DMA is queued as soon as its last part has landed, so the copies
/// of later chunks overlap the DMA of earlier ones with one hand-off per transfer.
fn upload_at_once<T: Element>(
    engine: &mut CudaEngine,
    data: &[T],
    tensor: &mut DeviceTensor<T>,
    copiers: Copiers,
    plan: &Plan,
) -> Result<(), Stranded> {
    let src = SendPtr(as_bytes(data).as_ptr().cast_mut());
    let size = T::DTYPE.size_bytes();
    let chunk_bytes = plan.per_chunk * size;
    let chunks = data.len().div_ceil(plan.per_chunk);
    let chunk_len = |c: usize| plan.per_chunk.min(data.len() - c * plan.per_chunk);
    let mut leases: VecDeque<StagingLease<Proven>> = VecDeque::with_capacity(chunks);
    for _ in 0..chunks {
        match engine.route_lease() {
            Ok(lease) => leases.push_back(lease),
            Err(error) => {
                leases.into_iter().for_each(StagingLease::release);
                return Err(Stranded::alone(error));
            }
        }
    }
    let targets: Vec<SendPtr> = leases
        .iter_mut()
        .map(|lease| SendPtr(lease.as_mut_bytes().as_mut_ptr()))
        .collect();
    // Every piece of every chunk, in chunk order: (chunk, offset in the chunk, bytes).
    let pieces: Vec<(usize, usize, usize)> = (0..chunks)
        .flat_map(|c| {
            copy_parts(chunk_len(c) * size, copiers.parts, MIN_COPY_PART)
                .map(move |(offset, len)| (c, offset, len))
        })
        .collect();
    let remaining: Vec<AtomicUsize> = (0..chunks)
        .map(|c| AtomicUsize::new(pieces.iter().filter(|p| p.0 == c).count()))
        .collect();
    let claims = Claims::new(pieces.len());
    let copy_piece = |i: usize| {
        let (c, offset, len) = pieces[i];
        // SAFETY: the slot is leased and proven (no DMA touches it until its chunk is queued,
        // after every piece has landed); it holds the chunk (`plan.per_chunk` elements fit a
        // slot); pieces are disjoint ranges of both sides; `data` is borrowed for the call, and
        // the leases are held until `join` has returned.
        unsafe {
            copy_streaming(
                targets[c].get().add(offset),
                src.get().add(c * chunk_bytes + offset),
                len,
            )
        };
        remaining[c].fetch_sub(1, Ordering::Release);
    };
    let work = || {
        while let Some(i) = claims.claim() {
            copy_piece(i);
        }
    };
    let mut in_flight = VecDeque::with_capacity(chunks);
    let mut failure = None;
    copiers.pool.join(copiers.parts - 1, &work, |_| {
        let mut wait = SpinWait::new();
        for (c, done) in remaining.iter().enumerate() {
            // The calling thread copies too, taking the next piece in order, until this chunk
            // has landed.
            while done.load(Ordering::Acquire) != 0 {
                match claims.claim() {
                    Some(i) => copy_piece(i),
                    None => wait.spin(),
                }
            }
            let lease = leases.pop_front().expect("one lease per chunk");
            if failure.is_some() {
                lease.release();
                continue;
            }
            match lease.begin_upload(engine, tensor, c * plan.per_chunk, chunk_len(c)) {
                Ok(unproven) => in_flight.push_back(unproven),
                Err(refused) => {
                    let error = released(refused);
                    failure = Some(error);
                }
            }
        }
    });
    match failure {
        Some(error) => Err(Stranded { error, in_flight }),
        None => finish(in_flight),
    }
}

/// The bytes a download of a mid-size transfer marks as arrived at a time (see
/// [`download_at_once`]). A mark costs an event record, a wait and a hand-off to the copy
/// threads, which the DMA of 512 KiB covers; smaller marks stop the copy threads between marks,
/// larger ones leave more to copy after the last byte has arrived (the part sizes measured against
/// each other: `docs/records/mid-size-transfers.md`).
const MARK_BYTES: usize = 512 << 10;

/// The smallest piece of a marked part one copy thread copies out.
const MIN_MARKED_PIECE: usize = 32 << 10;

/// How many parts of a download the lead has proven arrived, for the helpers that copy them
/// out, and whether it has given up proving more.
///
/// The lead publishes a count, in order, each time one more part (or a chunk's last) is proven
/// ([`publish`](Arrivals::publish), release); a helper that needs part `p` waits until the count
/// passes `p` (acquire: the proof, and so the bytes, are visible to it) and never reads a part
/// the count does not cover. The lead gives up ([`GiveUpOnDrop`]) once it has published all it
/// will, on return and on unwind alike; a helper that sees that, and still sees its part
/// unpublished, stops waiting. Giving up is stored after the last publication, so the count
/// is read again after it is seen.
struct Arrivals {
    arrived: AtomicUsize,
    gave_up: AtomicBool,
}

impl Arrivals {
    fn new() -> Self {
        Arrivals {
            arrived: AtomicUsize::new(0),
            gave_up: AtomicBool::new(false),
        }
    }

    /// The lead: parts `0..count` have arrived (`count` only grows).
    fn publish(&self, count: usize) {
        self.arrived.store(count, Ordering::Release);
    }

    /// A helper: waits until part `p` has arrived (`true`), or until the lead has given up with
    /// it unpublished (`false`).
    fn wait_for(&self, p: usize) -> bool {
        let mut wait = SpinWait::new();
        while self.arrived.load(Ordering::Acquire) <= p {
            if self.gave_up.load(Ordering::Acquire) && self.arrived.load(Ordering::Acquire) <= p {
                return false;
            }
            wait.spin();
        }
        true
    }
}

/// Gives up when dropped: the lead of a download stops its helpers waiting for marks it will no
/// longer prove, on return and on unwind alike.
struct GiveUpOnDrop<'a>(&'a Arrivals);

impl Drop for GiveUpOnDrop<'_> {
    fn drop(&mut self) {
        self.0.gave_up.store(true, Ordering::Release);
    }
}

/// A download whose chunks all fit in the ring at once: every chunk's DMA is queued up front in
/// parts of [`MARK_BYTES`], each part followed by a mark; the calling thread waits for the marks
/// in order and publishes each part as it arrives, and the copy threads (and then the calling
/// thread) copy the published parts out, each part split between them, while later parts are
/// still on the wire. A `fresh` destination has its pages populated by the same threads first.
fn download_at_once<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
    dst: SendPtr,
    fresh: bool,
    copiers: Copiers,
    plan: &Plan,
) -> Result<()> {
    let total = tensor.len();
    let size = T::DTYPE.size_bytes();
    // As few slots as hold the transfer: one mark stream over one slot copies out faster than
    // the same marks spread over several (8 MiB with 512 KiB marks on the H200 host: 238 µs in
    // one slot, 261 µs in four; `docs/records/mid-size-transfers.md`).
    let per_chunk = plan.per_slot;
    let chunks = total.div_ceil(per_chunk);
    let mark = (MARK_BYTES / size).max(1);
    let fail = |queued: VecDeque<(StagingLease<Unproven>, Vec<Mark>)>, error| {
        // Dropping a mark detaches it; each lease is retired until its copies are proven.
        queued
            .into_iter()
            .for_each(|(lease, _marks)| lease.retire());
        Err(error)
    };
    // Queue every chunk, in marked parts, keeping each slot's address for the copy-out.
    let mut queued = VecDeque::with_capacity(chunks);
    let mut slots = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let lease = match engine.route_lease() {
            Ok(lease) => lease,
            Err(error) => return fail(queued, error),
        };
        let slot = SendPtr(lease.as_bytes().as_ptr().cast_mut());
        let offset = c * per_chunk;
        let n = per_chunk.min(total - offset);
        let mut marks = Vec::with_capacity(n.div_ceil(mark));
        match lease.begin_download_marked(engine, tensor, offset, n, mark, &mut marks) {
            Ok(unproven) => {
                slots.push(slot);
                let failed = matches!(marks.last(), Some(Mark::Failed(_)));
                queued.push_back((unproven, marks));
                // Nothing after a failed part was queued; the wait below meets the failure.
                if failed {
                    break;
                }
            }
            Err(refused) => {
                let error = released(refused);
                return fail(queued, error);
            }
        }
    }
    // Every marked part, in order: (chunk, offset in the chunk, bytes); then every part's
    // pieces: (part, offset in the chunk, bytes).
    let parts: Vec<(usize, usize, usize)> = (0..chunks)
        .flat_map(|c| {
            let n = per_chunk.min(total - c * per_chunk);
            (0..n)
                .step_by(mark)
                .map(move |at| (c, at * size, mark.min(n - at) * size))
        })
        .collect();
    let pieces: Vec<(usize, usize, usize)> = parts
        .iter()
        .enumerate()
        .flat_map(|(p, &(_, start, bytes))| {
            copy_parts(bytes, copiers.parts, MIN_MARKED_PIECE)
                .map(move |(offset, len)| (p, start + offset, len))
        })
        .collect();
    let arrivals = Arrivals::new();
    let claims = Claims::new(pieces.len());
    let populate =
        (fresh && total * size >= POPULATE_MIN).then(|| Populate::new(dst, total * size));
    let chunk_bytes = per_chunk * size;
    let work = || {
        if let Some(populate) = &populate {
            populate.run();
        }
        while let Some(i) = claims.claim() {
            let (p, offset, len) = pieces[i];
            if !arrivals.wait_for(p) {
                return;
            }
            let c = parts[p].0;
            // SAFETY: part `p` was published only after its mark (or its chunk's event) proved
            // its bytes arrived in slot `c`, and no later copy writes them; the slot's lease is
            // held by this function's frame (in `queued`, then `landed`) until `join` has
            // returned; `dst` has room for `total` elements and the piece lies in chunk `c`;
            // pieces are disjoint; pinned staging and the caller's vector do not overlap.
            unsafe {
                let at = dst.get().add(c * chunk_bytes + offset);
                let from = slots[c].get().add(offset);
                if T::DTYPE == DType::Bool {
                    decode_bool(at, from, len);
                } else {
                    std::ptr::copy_nonoverlapping(from, at, len);
                }
            }
        }
    };
    // Every lease stays in `queued` until its chunk is proven, then in `landed`, both owned by
    // this frame: they are released (or retired) only after `join` has returned, when no helper
    // reads their slots any more, on unwind as well.
    let mut landed = Vec::with_capacity(queued.len());
    let failure = copiers.pool.join(copiers.parts - 1, &work, |_| {
        let give_up = GiveUpOnDrop(&arrivals);
        let mut next = 0;
        while let Some((_, marks)) = queued.front_mut() {
            for mark in std::mem::take(marks) {
                let proved = match mark {
                    Mark::Recorded(mark) => mark.wait_parts().map(drop),
                    Mark::Failed(error) => Err(error),
                };
                if let Err(error) = proved {
                    return Some(error);
                }
                next += 1;
                arrivals.publish(next);
            }
            let (lease, _) = queued.pop_front().expect("the chunk just waited for");
            match lease.end_chunk() {
                Ok(proven) => landed.push(proven),
                Err(error) => return Some(error),
            }
            next += 1;
            arrivals.publish(next);
        }
        drop(give_up);
        // Copy out alongside the helpers (or alone, without any).
        work();
        None
    });
    landed.into_iter().for_each(StagingLease::release);
    match failure {
        Some(error) => fail(queued, error),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimConfig;
    use crate::memory::ring::StagingConfig;

    #[test]
    fn the_default_cap_is_the_whole_copy_pool() {
        // Nothing in the crate's unit tests sets the pool's size.
        assert_eq!(
            StagingConfig::default().copy_threads,
            copy_pool::copy_threads()
        );
    }

    #[test]
    fn engines_share_one_pool_of_copy_threads() {
        let mut a = CudaEngine::simulated(SimConfig::default());
        let mut b = CudaEngine::simulated(SimConfig::default());
        let mut cap = b.staging_config();
        cap.copy_threads = 1;
        b.set_staging_config(cap).unwrap();
        let n = (4 << 20) / 4 + 3;
        let data: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        for engine in [&mut a, &mut b] {
            let t = upload_tensor(engine, &data, &[n]).unwrap();
            assert_eq!(download_tensor(engine, &t).unwrap(), data);
            let reused = download_tensor_into(engine, &t, Vec::with_capacity(n)).unwrap();
            assert_eq!(reused, data);
        }
        assert_eq!(copy_pool::pools_built(), 1);
        let (ca, cb) = (
            pool_for(&mut a, 4 << 20).unwrap(),
            pool_for(&mut b, 4 << 20).unwrap(),
        );
        let (ca, cb) = (ca.unwrap(), cb.unwrap());
        assert!(std::ptr::eq(ca.pool, cb.pool));
        assert_eq!(ca.pool.threads(), copy_pool::copy_threads());
        // Each engine's cap applies to its own transfers only.
        assert_eq!(ca.parts, copy_pool::copy_threads());
        assert_eq!(cb.parts, 1);
        assert!(a.sim().unwrap().violations().is_empty());
        assert!(b.sim().unwrap().violations().is_empty());
    }
}

/// The blocking routes' own protocols under every interleaving loom can reach (see
/// `crate::sync`): the index hand-out and the publication of a download's parts.
#[cfg(all(test, cuferry_loom))]
mod loom_models {
    use super::*;
    use crate::sync::{Arc, thread};
    use loom::cell::UnsafeCell;

    /// Runs `f` under loom, with at most `preemptions` preemptions in a schedule.
    fn check(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(preemptions);
        builder.check(f);
    }

    /// (f) Three threads claiming from one hand-out get every index exactly once between them.
    #[test]
    fn loom_claims_hand_out_each_index_exactly_once() {
        check(3, || {
            let claims = Arc::new(Claims::new(3));
            let claim_all = |claims: &Claims| {
                let mut mine = Vec::new();
                while let Some(i) = claims.claim() {
                    mine.push(i);
                }
                mine
            };
            let others: Vec<_> = (0..2)
                .map(|_| {
                    let claims = Arc::clone(&claims);
                    thread::Builder::new()
                        .spawn(move || claim_all(&claims))
                        .unwrap()
                })
                .collect();
            let mut all = claim_all(&claims);
            for other in others {
                all.extend(other.join().unwrap());
            }
            all.sort_unstable();
            assert_eq!(all, [0, 1, 2]);
        });
    }

    /// A download's parts as the model sees them: what the lead proved arrived in each (0 until
    /// then), the claims of the copy-out and the publication between them.
    struct Download {
        parts: Vec<UnsafeCell<usize>>,
        claims: Claims,
        arrivals: Arrivals,
    }

    // SAFETY: a part's cell is written by the lead before it is published and read by helpers
    // only after; loom checks both.
    unsafe impl Sync for Download {}

    impl Download {
        const PARTS: usize = 3;

        fn new() -> Self {
            Download {
                parts: (0..Self::PARTS).map(|_| UnsafeCell::new(0)).collect(),
                claims: Claims::new(Self::PARTS),
                arrivals: Arrivals::new(),
            }
        }

        /// The copy-out as `download_at_once`'s work does it: claims a part, waits for it, reads
        /// it; stops when the lead gave up before publishing the part. Returns the parts read.
        fn copy_out(&self) -> usize {
            let mut read = 0;
            while let Some(p) = self.claims.claim() {
                if !self.arrivals.wait_for(p) {
                    break;
                }
                // SAFETY: the model checks it: the lead wrote the part before publishing it and
                // never writes it again.
                let seen = self.parts[p].with(|v| unsafe { *v });
                assert_eq!(seen, p + 1, "part {p} was read before it arrived");
                read += 1;
            }
            read
        }

        /// The lead: proves the first `arrive` parts in order, publishing each, then gives up
        /// (as it does on a failed mark, and after the last) and copies out beside the helpers.
        fn lead(&self, arrive: usize) -> usize {
            let give_up = GiveUpOnDrop(&self.arrivals);
            for p in 0..arrive {
                // SAFETY: no helper reads part `p` before it is published below.
                self.parts[p].with_mut(|v| unsafe { *v = p + 1 });
                self.arrivals.publish(p + 1);
            }
            drop(give_up);
            self.copy_out()
        }
    }

    /// (g) Helpers copying out a download never read a part the lead has not published, and
    /// stop once the lead gives up (a helper that kept waiting would never end the model),
    /// whether the lead proves every part or fails after some; the lead copies out beside them.
    #[test]
    fn loom_a_download_publishes_its_parts_and_its_helpers_stop_when_it_gives_up() {
        for arrive in 0..=Download::PARTS {
            check(2, move || {
                let download = Arc::new(Download::new());
                let helpers: Vec<_> = (0..2)
                    .map(|_| {
                        let download = Arc::clone(&download);
                        thread::Builder::new()
                            .spawn(move || download.copy_out())
                            .unwrap()
                    })
                    .collect();
                let mut read = download.lead(arrive);
                for helper in helpers {
                    read += helper.join().unwrap();
                }
                // Parts are claimed in order, so every part that arrived was claimed by a thread
                // that had not stopped, and read.
                assert_eq!(read, arrive);
                for part in &download.parts {
                    // SAFETY: the helpers are done; loom checks their reads happened before.
                    part.with_mut(|v| unsafe { *v = 0 });
                }
            });
        }
    }
}
