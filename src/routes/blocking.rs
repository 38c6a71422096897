//! Blocking routes: ordinary host memory in, ordinary host memory out, at the PCIe limit.
//!
//! Each route returns only when the caller's host memory is no longer touched by the device: an
//! upload has read its source, a download has written its destination. Device-side ordering is
//! the stream's: an upload is visible to every later operation on the engine.
//!
//! Three size bands, all through pinned staging (the device only reaches full speed from
//! page-locked memory, and the caller's memory is pageable):
//! - **16 bytes or less:** the engine's pinned scalar slot: one tiny copy and one event wait.
//! - **Up to `cutoff_bytes`:** one staged copy through one ring slot.
//! - **Above:** a pipeline over the bounded ring of [`StagingLease`]s: host threads copy chunk
//!   k+1 into its slot while the DMA of chunk k runs; each chunk has its own event, and a slot
//!   is reused only after its event proved the previous chunk complete.
//!
//! A failure after the first enqueue retires every unproven lease (with the destination tensor,
//! on uploads) into the retirement queue, so nothing is freed while DMA may still touch it, and
//! the route returns the error.

use crate::core::engine::CudaEngine;
use crate::dtype::DType;
use crate::error::{Error, Refused, Result};
use crate::lifecycle::lease::{BeginError, KeepAlive, Proven, StagingLease, Unproven};
use crate::memory::copy_pool;
use crate::memory::element::{as_bytes, byte_len, Element};
use crate::memory::tensor::{shape_len, DeviceTensor};
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
    pool: &'static rayon::ThreadPool,
    parts: usize,
}

/// Runs `f(offset, len)` over `bytes` split into parts, on the shared copy threads when the range
/// is large enough.
fn par_bytes(copiers: Option<Copiers>, bytes: usize, f: impl Fn(usize, usize) + Sync) {
    let parts = match copiers {
        Some(copiers) if bytes >= 2 * MIN_COPY_PART => (bytes / MIN_COPY_PART).min(copiers.parts),
        _ => 1,
    };
    if parts <= 1 {
        f(0, bytes);
        return;
    }
    let part = bytes.div_ceil(parts).next_multiple_of(64);
    let f = &f;
    if let Some(copiers) = copiers {
        copiers.pool.scope(|scope| {
            let mut offset = 0;
            while offset < bytes {
                let len = part.min(bytes - offset);
                scope.spawn(move |_| f(offset, len));
                offset += len;
            }
        });
    }
}

/// Copies `bytes` bytes from `src` to `dst` with the engine's copy threads.
///
/// # Safety
/// `src..src+bytes` is readable and `dst..dst+bytes` writable for the call, and they do not
/// overlap.
unsafe fn par_copy(copiers: Option<Copiers>, dst: *mut u8, src: *const u8, bytes: usize) {
    let (d, s) = (SendPtr(dst), SendPtr(src.cast_mut()));
    par_bytes(copiers, bytes, |off, len| {
        // SAFETY: the caller's contract; `off..off+len` lies inside both ranges, and each task's
        // range is disjoint from every other's.
        unsafe { std::ptr::copy_nonoverlapping(s.get().add(off), d.get().add(off), len) }
    });
}

/// Decodes `bytes` device bytes at `src` into `bool`s at `dst` (`byte != 0`).
///
/// # Safety
/// As [`par_copy`], with `dst` pointing at `bytes` `bool` slots.
unsafe fn par_decode_bool(copiers: Option<Copiers>, dst: *mut u8, src: *const u8, bytes: usize) {
    let (d, s) = (SendPtr(dst), SendPtr(src.cast_mut()));
    par_bytes(copiers, bytes, |off, len| {
        for i in off..off + len {
            // SAFETY: `i` lies inside both ranges; writing 0 or 1 makes a valid `bool`.
            unsafe { *d.get().add(i) = u8::from(*s.get().add(i) != 0) };
        }
    });
}

/// The shared copy threads and this engine's cap on them, when this transfer is large enough to
/// split.
fn pool_for(engine: &mut CudaEngine, bytes: usize) -> Result<Option<Copiers>> {
    if bytes < 2 * MIN_COPY_PART {
        return Ok(None);
    }
    let cap = engine.enter()?.staging.config().copy_threads;
    let pool = copy_pool::pool()?;
    Ok(Some(Copiers {
        pool,
        parts: cap.min(pool.current_num_threads()),
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
        .ok_or(Error::StagingExhausted { depth })?;
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

/// Waits for every lease in flight and releases them; on failure retires the rest with
/// `resource`. A chunk whose wait fails is retained by the engine.
fn finish<R: KeepAlive>(mut in_flight: VecDeque<StagingLease<Unproven>>, resource: R) -> Result<R> {
    while let Some(lease) = in_flight.pop_front() {
        match lease.end_chunk() {
            Ok(proven) => proven.release(),
            Err(error) => {
                retire_all(in_flight, resource);
                return Err(error);
            }
        }
    }
    Ok(resource)
}

/// The smallest chunk the pipeline splits a transfer into.
const MIN_PIPELINE_CHUNK: usize = 1 << 20;

/// How one transfer is cut up, decided once from the engine's staging settings.
struct Plan {
    /// Elements per chunk.
    per_chunk: usize,
    /// Chunks in flight at once.
    depth: usize,
    /// Whether the transfer goes through the 16-byte scalar slot.
    scalar: bool,
}

/// The plan for a transfer of `bytes` bytes of `T`.
///
/// A transfer that would fill fewer slots than the ring has is split into `ring_depth` smaller
/// chunks (not below 1 MiB), so even a mid-size transfer overlaps its host copies with its DMA;
/// this also keeps the per-byte cost smooth across the chunk size (no cliff one element above
/// it).
fn plan<T: Element>(engine: &CudaEngine, bytes: usize) -> Plan {
    let config = engine.staging_config();
    let scalar = bytes <= 16;
    let chunk = if scalar {
        16
    } else if bytes <= config.cutoff_bytes {
        config.cutoff_bytes
    } else {
        bytes
            .div_ceil(config.ring_depth)
            .max(MIN_PIPELINE_CHUNK.min(config.chunk_bytes))
            .min(config.chunk_bytes)
    };
    Plan {
        per_chunk: (chunk / T::DTYPE.size_bytes()).max(1),
        depth: if scalar { 1 } else { config.ring_depth },
        scalar,
    }
}

/// Fresh download buffers at least this large are backed by huge pages and populated ahead.
const POPULATE_MIN: usize = 4 << 20;

/// Prepares a fresh (never touched) destination of `bytes` bytes at `ptr`: asks for transparent
/// huge pages, then populates its pages on the copy threads (`MADV_POPULATE_WRITE`) while the
/// pipeline runs, so the copy-out does not stop at a page fault per page. Populating never
/// changes contents, so it may race with the copy-out writing the same pages.
#[cfg(target_os = "linux")]
fn populate(scope: &rayon::Scope<'_>, ptr: SendPtr, bytes: usize) {
    const PAGE: usize = 4096;
    const PART: usize = 16 << 20;
    let start = (ptr.get() as usize).next_multiple_of(PAGE);
    let end = (ptr.get() as usize + bytes) & !(PAGE - 1);
    if end <= start {
        return;
    }
    // SAFETY: the range lies inside memory the caller owns (a vector's spare capacity);
    // MADV_HUGEPAGE only changes how the kernel backs it. A refusal is harmless.
    unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    let mut at = start;
    while at < end {
        let len = PART.min(end - at);
        scope.spawn(move |_| {
            // SAFETY: as above; MADV_POPULATE_WRITE maps the pages writable without changing
            // their contents. Kernels without it refuse with EINVAL, which is harmless.
            unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
        });
        at += len;
    }
}

/// Elsewhere the copy-out faults the pages in itself.
#[cfg(not(target_os = "linux"))]
fn populate(_scope: &rayon::Scope<'_>, _ptr: SendPtr, _bytes: usize) {}

/// The lease for an upload's next chunk under `plan`.
fn lease_for(
    engine: &mut CudaEngine,
    plan: &Plan,
    in_flight: &mut VecDeque<StagingLease<Unproven>>,
) -> Result<StagingLease<Proven>> {
    if plan.scalar {
        engine.scalar_lease()
    } else {
        next_lease(engine, in_flight, plan.depth)
    }
}

/// Uploads `data` into a new device tensor of the given shape, and returns once `data` has been
/// read.
///
/// # Errors
/// [`Error::ShapeMismatch`] when `shape` does not describe `data.len()` elements;
/// [`Error::Driver`] or [`Error::DeviceFault`] when the device refuses or fails (everything a
/// queued copy may still touch is then retired, not freed).
pub fn upload_tensor<T: Element>(
    engine: &mut CudaEngine,
    data: &[T],
    shape: &[usize],
) -> Result<DeviceTensor<T>> {
    let expected = shape_len(shape)?;
    if expected != data.len() {
        return Err(Error::ShapeMismatch {
            shape: shape.to_vec(),
            expected,
            actual: data.len(),
        });
    }
    let tensor = DeviceTensor::alloc(engine, shape)?;
    if data.is_empty() {
        return Ok(tensor);
    }
    match pool_for(engine, std::mem::size_of_val(data))? {
        // The loop runs on one of the copy threads, so splitting each chunk's host copy is a
        // local spawn onto warm workers rather than an injection from outside the pool.
        Some(copiers) => copiers
            .pool
            .install(|| upload_chunks(engine, data, tensor, Some(copiers))),
        None => upload_chunks(engine, data, tensor, None),
    }
}

/// The chunk loop of [`upload_tensor`].
fn upload_chunks<T: Element>(
    engine: &mut CudaEngine,
    data: &[T],
    mut tensor: DeviceTensor<T>,
    copiers: Option<Copiers>,
) -> Result<DeviceTensor<T>> {
    let src = as_bytes(data);
    let size = T::DTYPE.size_bytes();
    let plan = plan::<T>(engine, src.len());
    let mut in_flight = VecDeque::new();
    let mut offset = 0;
    while offset < data.len() {
        let n = plan.per_chunk.min(data.len() - offset);
        let mut lease = match lease_for(engine, &plan, &mut in_flight) {
            Ok(lease) => lease,
            Err(error) => {
                retire_all(in_flight, tensor);
                return Err(error);
            }
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
            )
        };
        match lease.begin_upload(engine, &mut tensor, offset, n) {
            Ok(unproven) => in_flight.push_back(unproven),
            Err(BeginError::NotQueued { lease, error }) => {
                lease.release();
                retire_all(in_flight, tensor);
                return Err(error);
            }
            Err(BeginError::Untracked { lease, error }) => {
                lease.retire();
                retire_all(in_flight, tensor);
                return Err(error);
            }
        }
        offset += n;
    }
    finish(in_flight, tensor)
}

/// Downloads a tensor into a new `Vec`, and returns once the data has arrived.
///
/// `bool` tensors are decoded byte by byte (`byte != 0`), since device bytes need not be 0 or 1.
///
/// # Errors
/// [`Error::WrongEngine`] when the tensor is not this engine's;
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
/// [`Error::UnsupportedElement`] for `bool`, because raw device bytes need not be 0 or 1 (use
/// [`download_tensor`], which decodes them); otherwise as [`download_tensor`]. Every error hands
/// the `Vec` back in the [`Refused`]: untouched when refused before anything was queued, emptied
/// (its capacity kept) when the download failed.
pub fn download_tensor_into<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
    mut buffer: Vec<T>,
) -> Result<Vec<T>, Refused<Vec<T>>> {
    let refused = if !T::DTYPE.any_bit_pattern() {
        Some(Error::UnsupportedElement {
            operation: "download_tensor_into",
            dtype: T::DTYPE,
            reason:
                "raw device bytes are not guaranteed to be 0 or 1; download_tensor decodes them",
        })
    } else {
        tensor.check_engine(engine).err()
    };
    if let Some(error) = refused {
        return Err(Refused {
            error,
            input: buffer,
        });
    }
    buffer.clear();
    buffer.reserve_exact(tensor.len());
    match download_staged(engine, tensor, &mut buffer, false) {
        Ok(()) => Ok(buffer),
        Err(error) => Err(Refused {
            error,
            input: buffer,
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
    match pool_for(engine, bytes)? {
        // As in `upload_tensor`: the loop runs on a copy thread.
        Some(copiers) => copiers
            .pool
            .install(|| download_chunks(engine, tensor, out, fresh, Some(copiers))),
        None => download_chunks(engine, tensor, out, fresh, None),
    }
}

/// The body of [`download_staged`], on the copy threads when there are any.
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
        Some(c) if fresh && bytes >= POPULATE_MIN => c.pool.scope(|scope| {
            populate(scope, dst, bytes);
            chunk_loop::<T>(engine, tensor, dst, &plan, copiers)
        }),
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
                None if plan.scalar => engine.scalar_lease()?,
                None => match engine.route_lease() {
                    Ok(lease) => lease,
                    Err(error) => return fail(in_flight, error),
                },
            };
            let n = plan.per_chunk.min(total - next);
            match lease.begin_download(engine, tensor, next, n) {
                Ok(unproven) => in_flight.push_back((unproven, next, n)),
                Err(BeginError::NotQueued { lease, error }) => {
                    lease.release();
                    return fail(in_flight, error);
                }
                Err(BeginError::Untracked { lease, error }) => {
                    lease.retire();
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
                par_copy(copiers, at, src, n * size);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimConfig;

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
        assert_eq!(ca.pool.current_num_threads(), copy_pool::copy_threads());
        // Each engine's cap applies to its own transfers only.
        assert_eq!(ca.parts, copy_pool::copy_threads());
        assert_eq!(cb.parts, 1);
        let names = ca
            .pool
            .broadcast(|_| std::thread::current().name().map(str::to_owned));
        assert!(names.iter().all(|name| name
            .as_deref()
            .is_some_and(|n| n.starts_with("cuferry-copy-"))));
        assert!(a.sim().unwrap().violations().is_empty());
        assert!(b.sim().unwrap().violations().is_empty());
    }
}
