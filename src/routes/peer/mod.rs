//! Peer routes: a tensor of one engine copied to another engine, device to device.
//!
//! Engines never share values, so moving data between them is a route of its own. [`copy`]
//! copies a tensor of one engine into a new tensor of another over the devices' peer link (or
//! within one device, for two engines on it), with no host memory in between, and
//! [`copy_into`] into a tensor the other engine already has; where the devices
//! have no peer link it is refused, and [`copy_staged`] is the copy through host memory,
//! taken only when asked for by name.
//!
//! A copy runs on one engine's compute stream, the carrier's: the source engine's for the blocking
//! routes (a copy pushed over the link completes sooner than one pulled; see
//! `docs/records/peer-routes.md`), where a new destination is allocated from the destination
//! engine's memory pool on that same stream (`cuMemAllocFromPoolAsync` takes a pool of another
//! device), so neither engine waits for the other's allocation; the destination engine's for the
//! pending route, whose destination that engine's next work may read. The carrier's own side is ordered by its lane order;
//! the other engine's side only needs a wait when work queued there on that tensor is not yet
//! proven complete (the engine's own bookkeeping answers, with no driver call): then the
//! carrier's stream waits for a [`Signal`](crate::engine::Signal) of the other engine, on the device.
//! The blocking routes return once a synchronize of the carrier's stream proves the copy
//! complete.

use crate::core::engine::{CudaEngine, State};
use crate::core::order::Use;
use crate::device::DeviceId;
use crate::driver::{ContextHandle, DevicePtr, Lane};
use crate::error::{DriverError, Error, Result, SetupError, UsageError};
use crate::ledger::Owner;
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use crate::routes::host::blocking::{download_tensor, upload_tensor};
use std::mem::ManuallyDrop;
use std::panic::Location;
use std::sync::Mutex;

mod pending;

pub use pending::{PeerCopy, copy_pending};

/// The ordered pairs of devices (reaching, reached) whose peer access this process has enabled.
static ENABLED: Mutex<Vec<(DeviceId, DeviceId)>> = Mutex::new(Vec::new());

/// Whether `engine`'s device reaches `other`'s device memory directly: the same device,
/// or a device it has a peer link to (NVLink or PCIe peer-to-peer). Where it does, the access
/// is enabled: `engine`'s device's context to the other's (`cuCtxEnablePeerAccess`, once per pair
/// of devices in the process), and the other engine's memory pool to this device
/// (`cuMemPoolSetAccess`, once per engine). The answer is remembered for the pair of
/// engines, so later copies do not ask; a copy the driver refuses forgets it, and the next
/// one asks again.
///
/// # Errors
/// [`SetupError::Unreachable`](crate::error::SetupError::Unreachable) when the two engines'
/// devices cannot reach each other at all
/// (separate simulated devices, or a real and a simulated one); [`Error::Driver`] when the
/// driver refuses the question or the enabling.
pub fn access(engine: &mut CudaEngine, other: &CudaEngine) -> Result<bool> {
    let (me, peer) = (engine.device(), other.device());
    crate::driver::reachable(peer, me).map_err(|reason| {
        Error::Setup(SetupError::Unreachable {
            from: peer,
            to: me,
            reason,
        })
    })?;
    // Asked (and enabled) once per pair of engines: a copy's hot path only looks it up.
    if me == peer || engine.shared.lock().peers.contains(&other.shared.engine_id) {
        return Ok(true);
    }
    let peer_ctx = other.shared.lock().driver.context();
    {
        let mut enabled = ENABLED.lock().unwrap_or_else(|e| e.into_inner());
        let mut st = engine.enter()?;
        let reachable = st
            .driver
            .can_access_peer(peer)
            .map_err(Error::driver("cuDeviceCanAccessPeer"))?;
        if !reachable {
            return Ok(false);
        }
        if !enabled.contains(&(me, peer)) {
            st.driver
                .enable_peer_access(peer_ctx)
                .map_err(Error::driver("cuCtxEnablePeerAccess"))?;
            enabled.push((me, peer));
        }
    }
    // The other engine's memory comes from its own pool, which must name this device too.
    other
        .shared
        .enter()?
        .driver
        .grant_peer_access(me)
        .map_err(Error::driver("cuMemPoolSetAccess"))?;
    engine.shared.lock().peers.push(other.shared.engine_id);
    Ok(true)
}

/// Copies `src`, a tensor of `src_engine`, into a new tensor of the same shape on `dst_engine`,
/// device to device, and returns it once the copy has completed.
///
/// Everything queued on `src_engine` before the call that writes `src` is copied; later work
/// on either engine sees the copy done. The copy runs on `src_engine`'s compute stream (over the
/// peer link, when the devices differ).
///
/// ```
/// # fn main() -> Result<(), cuferry::Error> {
/// use cuferry::sim::{SimConfig, SimDevice};
/// use cuferry::{download_tensor, peer, upload_tensor, CudaEngine};
/// # /*
/// let (mut gpu0, mut gpu1) = (CudaEngine::open(0)?, CudaEngine::open(1)?);
/// # */
/// # let machine = SimDevice::new(SimConfig { devices: 2, ..SimConfig::default() });
/// # let mut gpu0 = CudaEngine::simulated_on_device(&machine, 0)?;
/// # let mut gpu1 = CudaEngine::simulated_on_device(&machine, 1)?;
/// let x = upload_tensor(&mut gpu0, &[1.0f32, 2.0, 3.0], &[3])?;
/// let y = gpu0.scale(&x, 10.0)?;
/// let there = peer::copy(&mut gpu0, &y, &mut gpu1)?; // GPU 0 to GPU 1, no host memory
/// assert_eq!(download_tensor(&mut gpu1, &there)?, [10.0, 20.0, 30.0]);
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when `src` is not
/// `src_engine`'s; [`SetupError::Unreachable`](crate::error::SetupError::Unreachable) when the
/// devices have no peer link ([`copy_staged`] copies through host memory) or cannot reach
/// each other at all; [`Error::Driver`] or [`Error::DeviceFault`] when the device refuses or
/// fails. After a failure that leaves the copy unproven, the new tensor's free is ordered after
/// the copy on the device, or, when that cannot be arranged either, its memory is leaked: never
/// freed under the copy.
#[track_caller]
pub fn copy<T: Element>(
    src_engine: &mut CudaEngine,
    src: &DeviceTensor<T>,
    dst_engine: &mut CudaEngine,
) -> Result<DeviceTensor<T>> {
    src.check_engine(src_engine)?;
    if !access(src_engine, dst_engine)? {
        return Err(no_link(dst_engine, src_engine));
    }
    let bytes = src.byte_len();
    if bytes == 0 {
        return DeviceTensor::alloc_on(dst_engine, Lane::Compute, src.shape());
    }
    // Allocated from the destination engine's pool on the stream that carries the copy, so
    // neither waits for the other engine.
    let pool = dst_engine.shared.lock().driver.pool();
    let ptr = src_engine
        .enter()?
        .driver
        .alloc_from(Lane::Compute, pool, bytes)
        .map_err(Error::driver("cuMemAllocFromPoolAsync"))?;
    // The destination engine's memory, which its tensor frees: counted there.
    dst_engine
        .shared
        .lock()
        .ledger
        .allocated(Owner::Tensors, bytes, Location::caller());
    // SAFETY: `ptr` is a fresh allocation of `bytes` bytes (`src.len()` elements of `T`) from
    // the destination engine's pool, which its driver frees; nothing else owns it. Held in
    // `ManuallyDrop` until the allocation and the copy are proven complete, so no path (a panic
    // included) frees it under them.
    let dst = ManuallyDrop::new(unsafe {
        DeviceTensor::<T>::from_raw(ptr, src.shape(), src.len(), &dst_engine.shared, None)
    });
    // SAFETY: `src` is borrowed for the call and its free is ordered after the copy on its
    // engine's lanes (the read recorded); `dst` is not freed before the copy is proven complete
    // (or ever, when it cannot be); both hold `bytes` bytes.
    let copied = unsafe {
        copy_and_prove(
            src_engine,
            dst_engine,
            Use::Read(src.raw_ptr()),
            Use::Write(ptr),
            ptr,
            src.raw_ptr(),
            bytes,
        )
    };
    let (error, freeable) = match copied {
        Ok(()) => return Ok(ManuallyDrop::into_inner(dst)),
        // The allocation is still ordered on the source engine's stream: the destination engine
        // frees it only once that stream is proven past it.
        Err(Copied::NotQueued(error)) => {
            let past = src_engine.shared.waits.lane_synchronize(Lane::Compute);
            (error, past.is_ok())
        }
        // The destination's free must follow the copy: its engine's streams wait for it on the
        // device.
        Err(Copied::Unproven(error)) => {
            let ordered = src_engine
                .signal()
                .and_then(|done| dst_engine.wait_signal(&done));
            (error, ordered.is_ok())
        }
    };
    // Otherwise left in `ManuallyDrop`: its memory is leaked, never freed under the copy.
    if freeable {
        drop(ManuallyDrop::into_inner(dst));
    }
    Err(error)
}

/// The refusal of a copy from `from`'s device to `to`'s, which have no peer link.
fn no_link(from: &CudaEngine, to: &CudaEngine) -> Error {
    Error::Setup(SetupError::Unreachable {
        from: from.device(),
        to: to.device(),
        reason: NO_LINK,
    })
}

const NO_LINK: &str = "the devices have no peer link; peer::copy_staged copies through host memory";

/// What a copy the driver refused (`source`) on the stream of `st`'s engine (on device `to`)
/// reports, `other` the engine on the far side (on device `from`).
///
/// Peer access is remembered per pair of engines after the first copy, so a later copy reaches
/// the driver without asking: when the link has gone since (a simulated machine's
/// [`set_peer_link`](crate::sim::SimDevice::set_peer_link)), the refusal is the driver's. The
/// pair is forgotten here, so the next copy asks again, and the driver is asked now: where the
/// devices no longer reach each other the refusal is [`SetupError::Unreachable`](crate::error::SetupError::Unreachable), as it is for a pair
/// never linked; otherwise it is the driver's own.
fn refused_copy(
    st: &mut State,
    other: u64,
    from: DeviceId,
    to: DeviceId,
    source: DriverError,
) -> Error {
    st.peers.retain(|&id| id != other);
    if from != to && st.driver.can_access_peer(from) == Ok(false) {
        return Error::Setup(SetupError::Unreachable {
            from,
            to,
            reason: NO_LINK,
        });
    }
    Error::driver("cuMemcpyPeerAsync")(source)
}

/// The other side of a copy: `other`'s context, and the [`Signal`](crate::engine::Signal) of `other`'s
/// work that `carrier`'s compute stream now waits for on the device, if the copy's use of
/// `other`'s side (`theirs`) must follow work there that `other`'s bookkeeping has not proven
/// complete (its completion proves `other`'s lanes once the copy is proven). One lock of `other`
/// when nothing needs waiting for.
fn other_side(
    carrier: &mut CudaEngine,
    other: &mut CudaEngine,
    theirs: Use,
) -> Result<(ContextHandle, Option<crate::engine::Signal>)> {
    let (ctx, settled) = {
        let st = other.shared.lock();
        (st.driver.context(), st.order.settled_for(&[theirs]))
    };
    if settled {
        return Ok((ctx, None));
    }
    let done = other.signal()?;
    carrier.wait_signal_on(&done, &[Lane::Compute])?;
    Ok((ctx, Some(done)))
}

/// Why [`copy_and_prove`] failed.
enum Copied {
    /// Nothing was queued.
    NotQueued(Error),
    /// The copy was queued but could not be proven complete.
    Unproven(Error),
}

/// Queues a copy of `bytes` from `src` to `dst` on `carrier`'s compute stream (after the work
/// queued on `other` that `theirs`, the copy's use of `other`'s side, must follow; `carrier`'s
/// use of its own side, `mine`, recorded first) and proves it complete with a synchronize of
/// that stream.
///
/// # Safety
/// `dst` and `src` hold `bytes` bytes, one on each engine's device (`mine` names `carrier`'s),
/// and stay allocated until the copy is proven complete or, unproven, until the caller has
/// ordered their frees after it.
unsafe fn copy_and_prove(
    carrier: &mut CudaEngine,
    other: &mut CudaEngine,
    mine: Use,
    theirs: Use,
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
) -> std::result::Result<(), Copied> {
    let (other_ctx, signal) = other_side(carrier, other, theirs).map_err(Copied::NotQueued)?;
    let (other_id, other_device) = (other.shared.engine_id, other.device());
    {
        let mut st = carrier.enter().map_err(Copied::NotQueued)?;
        let my_ctx = st.driver.context();
        let (dst_ctx, src_ctx) = match mine {
            Use::Write(_) => (my_ctx, other_ctx),
            _ => (other_ctx, my_ctx),
        };
        // Recorded before the copy is queued, so `carrier`'s later uses and free of its side wait
        // for it (a use recorded for a refused copy only orders more than needed).
        st.order_uses(Lane::Compute, &[mine])
            .map_err(Copied::NotQueued)?;
        // SAFETY: the caller's contract; `carrier`'s side is ordered by the use above, `other`'s
        // by the wait above (or needs none).
        unsafe {
            st.driver
                .copy_peer(Lane::Compute, dst, dst_ctx, src, src_ctx, bytes)
        }
        .map_err(|e| {
            let to = st.driver.device();
            Copied::NotQueued(refused_copy(&mut st, other_id, other_device, to, e))
        })?;
    }
    // The proof: a synchronize of the copy's stream (the caller waits at once, so an event would
    // add a record for the same answer).
    let upto = carrier.shared.lock().order.position(Lane::Compute);
    match carrier.shared.waits.lane_synchronize(Lane::Compute) {
        Ok(()) => {
            carrier.shared.proven.prove(Lane::Compute, upto);
            // The stream waited for the signal before the copy: what it covers is complete too,
            // so the next copy between these engines needs no wait.
            if let Some(signal) = &signal {
                signal.proven_complete();
            }
            Ok(())
        }
        Err(source) => Err(Copied::Unproven(Error::DeviceFault {
            what: "peer copy",
            source,
        })),
    }
}

/// Copies `src`, a tensor of `src_engine`, into `dst`, an existing tensor of `dst_engine` of the
/// same length, device to device, and returns once the copy has completed: [`copy`] with
/// no allocation.
///
/// The copy runs on `src_engine`'s compute stream, pushed over the link, after everything queued
/// there that writes `src` and, unless `dst_engine` has proven it complete, after everything
/// queued on `dst_engine` (a wait on the device).
///
/// ```
/// # fn main() -> Result<(), cuferry::Error> {
/// use cuferry::sim::{SimConfig, SimDevice};
/// use cuferry::{download_tensor, peer, upload_tensor, CudaEngine};
/// # /*
/// let (mut gpu0, mut gpu1) = (CudaEngine::open(0)?, CudaEngine::open(1)?);
/// # */
/// # let machine = SimDevice::new(SimConfig { devices: 2, ..SimConfig::default() });
/// # let mut gpu0 = CudaEngine::simulated_on_device(&machine, 0)?;
/// # let mut gpu1 = CudaEngine::simulated_on_device(&machine, 1)?;
/// let mut landing = gpu1.alloc_tensor::<f32>(&[3])?; // reused for every step
/// for step in 0..3 {
///     let x = upload_tensor(&mut gpu0, &[step as f32; 3], &[3])?;
///     peer::copy_into(&mut gpu0, &x, &mut gpu1, &mut landing)?;
///     assert_eq!(download_tensor(&mut gpu1, &landing)?, [step as f32; 3]);
/// }
/// # Ok(()) }
/// ```
///
/// # Errors
/// As [`copy`], and [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when `dst`
/// is not `dst_engine`'s, [`UsageError::LengthMismatch`](crate::error::UsageError::LengthMismatch)
/// (`found` the source's length, `expected` the destination's) when the
/// lengths differ: both refused before anything is queued. After a failure, `dst`'s contents
/// are unspecified. When the copy could not be proven complete, `dst_engine`'s streams are made
/// to wait for it on the device; when even that cannot be arranged (or a panic unwinds through
/// the call), `dst`'s memory is leaked (never freed under the copy)
/// and `dst` is left an empty tensor of `dst_engine`.
pub fn copy_into<T: Element>(
    src_engine: &mut CudaEngine,
    src: &DeviceTensor<T>,
    dst_engine: &mut CudaEngine,
    dst: &mut DeviceTensor<T>,
) -> Result<()> {
    src.check_engine(src_engine)?;
    dst.check_engine(dst_engine)?;
    if src.len() != dst.len() {
        return Err(Error::Usage(UsageError::LengthMismatch {
            what: "peer::copy_into: source for the destination",
            found: src.len(),
            shape: None,
            expected: dst.len(),
        }));
    }
    if !access(src_engine, dst_engine)? {
        return Err(no_link(dst_engine, src_engine));
    }
    let bytes = src.byte_len();
    if bytes == 0 {
        return Ok(());
    }
    let (dst_ptr, src_ptr) = (dst.raw_ptr(), src.raw_ptr());
    let landing = Landing(Some(dst));
    // SAFETY: `src` is borrowed for the call and its free is ordered after the copy on its
    // engine's lanes (the read recorded); `dst`'s memory is held by `landing`, which leaks it
    // unless the copy is proven complete or `dst`'s engine is ordered behind it; both hold
    // `bytes` bytes.
    let copied = unsafe {
        copy_and_prove(
            src_engine,
            dst_engine,
            Use::Read(src_ptr),
            Use::Write(dst_ptr),
            dst_ptr,
            src_ptr,
            bytes,
        )
    };
    let (error, ordered) = match copied {
        Ok(()) => {
            landing.disarm();
            return Ok(());
        }
        Err(Copied::NotQueued(error)) => (error, true),
        // `dst`'s engine must not write or free `dst` before the copy has landed: its streams
        // wait for the copy on the device.
        Err(Copied::Unproven(error)) => {
            let ordered = src_engine
                .signal()
                .and_then(|done| dst_engine.wait_signal(&done));
            (error, ordered.is_ok())
        }
    };
    if ordered {
        landing.disarm();
    }
    Err(error)
}

/// A destination that another engine's stream may still write. Unless disarmed (the copy
/// proven complete, never queued, or its engine ordered behind it), it gives up its memory when
/// the guard goes, a panic's unwinding included: the tensor is left empty and the memory leaked,
/// never freed under the copy.
struct Landing<'a, T: Element>(Option<&'a mut DeviceTensor<T>>);

impl<T: Element> Landing<'_, T> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl<T: Element> Drop for Landing<'_, T> {
    fn drop(&mut self) {
        if let Some(dst) = self.0.take() {
            dst.leak_memory();
        }
    }
}

/// Copies `src`, a tensor of `src_engine`, into a new tensor of the same shape on `dst_engine`
/// through host memory: a [`download_tensor`] then an [`upload_tensor`]. For devices without a
/// peer link, where [`copy`] is refused; it takes about twice as long as either transfer.
///
/// # Errors
/// As [`download_tensor`] and [`upload_tensor`].
pub fn copy_staged<T: Element>(
    src_engine: &mut CudaEngine,
    src: &DeviceTensor<T>,
    dst_engine: &mut CudaEngine,
) -> Result<DeviceTensor<T>> {
    let host = download_tensor(src_engine, src)?;
    upload_tensor(dst_engine, &host, src.shape())
}
