//! Imports: another library's DLPack capsule as a tensor of the engine.
//!
//! Everything the capsule says is checked before the engine uses a byte: its device, element
//! type, rank, shape, strides and offset, and its extent against the allocation the driver
//! reports for its address. The tensor is a view of the producer's memory, tied to the capsule:
//! when it is dropped, the capsule waits in the engine's retirement queue for an event recorded
//! after the engine's last use, and its deleter runs once that event reports completion.

use super::capsule::capsule_error;
use super::{Capsule, Ready, Strides, dtype_of, ffi};
use crate::core::engine::{CudaEngine, Shared, State};
use crate::core::order::Use;
use crate::core::parts::{Part, Teardown};
use crate::driver::{DevicePtr, Driver, Lane};
use crate::dtype::DType;
use crate::error::{Error, Result, SubmitError, UsageError};
use crate::lifecycle::fence::{Fencing, fence};
use crate::memory::any_tensor::AnyTensor;
use crate::memory::element::Element;
use crate::memory::tensor::{DeviceTensor, Home};
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

/// The most dimensions a capsule may declare: checked before its shape is read.
const MAX_NDIM: i32 = 64;

/// A tensor another library lent read-only: the engine reads it (it dereferences to a
/// [`DeviceTensor`]) and cannot write it. Dropping it releases the capsule once the engine's
/// reads are proven complete.
///
/// ```compile_fail
/// fn write(engine: &mut cuferry::CudaEngine, weights: &mut cuferry::dlpack::ReadOnly<f32>) {
///     engine.fill(&mut *weights, 0.0).unwrap(); // a read-only import cannot be written
/// }
/// ```
pub struct ReadOnly<T: Element> {
    tensor: DeviceTensor<T>,
}

impl<T: Element> std::fmt::Debug for ReadOnly<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReadOnly").field(&self.tensor).finish()
    }
}

impl<T: Element> std::ops::Deref for ReadOnly<T> {
    type Target = DeviceTensor<T>;
    fn deref(&self) -> &DeviceTensor<T> {
        &self.tensor
    }
}

/// Imports a capsule as a writable tensor of `T` on `engine`: a view of the producer's memory
/// when its strides are compact, else (with [`Strides::Copy`]) a compact copy made on the
/// engine's compute stream. `bool` tensors are always copied, through a cast that makes every
/// byte 0 or 1 (a byte the producer left at another value would not be a `bool`).
///
/// # Errors
/// With the capsule handed back in [`SubmitError::Rejected`] (drop it to call the producer's
/// deleter): [`MalformedError::Capsule`](crate::error::MalformedError::Capsule) for a field
/// that cannot be so (a rank above 64, a negative or overflowing shape, an element type the crate
/// has no type for, vector lanes, a null data pointer, an offset that misaligns the data, a view
/// that leaves the allocation the driver reports); [`UsageError::ForeignDevice`] for memory of
/// another device, or not a device's; [`UsageError::ElementTypeMismatch`] when the capsule holds
/// another type than `T`; [`UsageError::NotCompact`] for strides that are not compact row-major
/// with [`Strides::Refuse`]; [`UsageError::ReadOnly`] for a capsule flagged read-only (use
/// [`import_read_only`]); [`UsageError::Overlaps`] when a live import of this engine views the
/// same bytes; [`Error::Driver`] when the join of the producer's stream cannot be queued.
#[allow(clippy::result_large_err)]
pub fn import<T: Element>(
    engine: &mut CudaEngine,
    capsule: Capsule,
    ready: Ready,
    strides: Strides,
) -> Result<DeviceTensor<T>, SubmitError<Capsule>> {
    let capsule = of_type::<T>(capsule, "dlpack::import")?;
    let tensor = import_any(engine, capsule, ready, strides)?;
    Ok(tensor
        .try_typed()
        .unwrap_or_else(|_| unreachable!("the element type was checked above")))
}

/// Imports a capsule read-only: as [`import`], for capsules flagged read-only too, and
/// overlapping other read-only imports of the same memory.
///
/// # Errors
/// As [`import`], but for [`UsageError::ReadOnly`].
#[allow(clippy::result_large_err)]
pub fn import_read_only<T: Element>(
    engine: &mut CudaEngine,
    capsule: Capsule,
    ready: Ready,
    strides: Strides,
) -> Result<ReadOnly<T>, SubmitError<Capsule>> {
    let capsule = of_type::<T>(capsule, "dlpack::import_read_only")?;
    let tensor = import_with(engine, capsule, ready, strides, false)?;
    Ok(ReadOnly {
        tensor: tensor
            .try_typed()
            .unwrap_or_else(|_| unreachable!("the element type was checked above")),
    })
}

/// [`import`] for an element type known at run time: the capsule's.
///
/// # Errors
/// As [`import`], but for [`UsageError::ElementTypeMismatch`].
#[allow(clippy::result_large_err)]
pub fn import_any(
    engine: &mut CudaEngine,
    capsule: Capsule,
    ready: Ready,
    strides: Strides,
) -> Result<AnyTensor, SubmitError<Capsule>> {
    import_with(engine, capsule, ready, strides, true)
}

/// The capsule, when it holds `T`s or an element type the crate has not (which the import
/// refuses with the field's error); refused with `UsageError::ElementTypeMismatch` otherwise.
#[allow(clippy::result_large_err)]
fn of_type<T: Element>(
    capsule: Capsule,
    operation: &'static str,
) -> Result<Capsule, SubmitError<Capsule>> {
    match capsule_dtype(&capsule) {
        Some(dtype) if dtype != T::DTYPE => {
            let shape = capsule_shape(&capsule);
            Err(SubmitError::Rejected {
                input: capsule,
                error: Error::Usage(UsageError::ElementTypeMismatch {
                    operation,
                    asked: T::DTYPE,
                    holds: dtype,
                    shape,
                }),
            })
        }
        _ => Ok(capsule),
    }
}

/// The capsule's element type, when the crate has it.
fn capsule_dtype(capsule: &Capsule) -> Option<DType> {
    dtype_of(capsule.tensor().dtype)
}

/// The capsule's shape as far as it can be read safely (empty when it cannot), for an error.
fn capsule_shape(capsule: &Capsule) -> Vec<usize> {
    describe_shape(capsule.tensor()).unwrap_or_default()
}

/// The shape a tensor declares, checked: a rank of 0 to [`MAX_NDIM`], a shape array when the
/// rank is not 0, no negative extent, an element count that fits `usize`.
fn describe_shape(t: &ffi::DLTensor) -> Result<Vec<usize>> {
    if !(0..=MAX_NDIM).contains(&t.ndim) {
        return Err(capsule_error(
            "dl_tensor.ndim",
            format!("{} dimensions, outside 0..={MAX_NDIM}", t.ndim),
        ));
    }
    let ndim = t.ndim as usize;
    if ndim == 0 {
        return Ok(Vec::new());
    }
    if t.shape.is_null() {
        return Err(capsule_error(
            "dl_tensor.shape",
            format!("null, for {ndim} dimensions"),
        ));
    }
    // SAFETY: a live capsule's non-null shape holds `ndim` extents (DLPack's layout; `Capsule`'s
    // constructors' contract); `ndim` was bounded above.
    let extents = unsafe { std::slice::from_raw_parts(t.shape, ndim) };
    let shape = extents
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<Vec<usize>, _>>()
        .map_err(|_| {
            capsule_error(
                "dl_tensor.shape",
                format!("{extents:?} has a negative extent"),
            )
        })?;
    if !shape.contains(&0)
        && shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .is_none()
    {
        return Err(capsule_error(
            "dl_tensor.shape",
            format!("{extents:?} holds more elements than fit in memory"),
        ));
    }
    Ok(shape)
}

/// What a checked capsule describes.
struct View {
    dtype: DType,
    shape: Vec<usize>,
    len: usize,
    /// The first element's address.
    ptr: DevicePtr,
    /// Strides in elements, when not compact row-major.
    strides: Option<Vec<i64>>,
    /// The bytes the view reaches: `start..end`.
    start: u64,
    end: u64,
}

/// Checks everything `capsule` says against the engine's device and the driver's record of the
/// allocation, before a byte of it is used.
fn describe(st: &State, engine_ordinal: usize, capsule: &Capsule) -> Result<View> {
    let t = capsule.tensor();
    let shape = describe_shape(t)?;
    let dtype = dtype_of(t.dtype).ok_or_else(|| {
        capsule_error(
            "dl_tensor.dtype",
            format!(
                "type code {}, {} bits, {} lane(s): no element type of this crate",
                t.dtype.code, t.dtype.bits, t.dtype.lanes
            ),
        )
    })?;
    let engine = st.driver.device();
    if t.device.device_type != ffi::DL_CUDA
        || usize::try_from(t.device.device_id) != Ok(engine_ordinal)
    {
        return Err(Error::Usage(UsageError::ForeignDevice {
            device_type: t.device.device_type,
            device_id: t.device.device_id,
            engine,
        }));
    }
    let len: usize = shape.iter().product();
    let size = dtype.size_bytes() as u64;
    let ptr = (t.data as u64).checked_add(t.byte_offset).ok_or_else(|| {
        capsule_error(
            "dl_tensor.byte_offset",
            format!("{} past the data pointer overflows", t.byte_offset),
        )
    })?;
    let ndim = shape.len();
    let strides = if t.strides.is_null() || ndim == 0 {
        None
    } else {
        // SAFETY: as for the shape: a live capsule's non-null strides hold `ndim` values.
        let given = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        (!is_compact(&shape, given)).then(|| given.to_vec())
    };
    if len == 0 {
        return Ok(View {
            dtype,
            shape,
            len,
            ptr: 0,
            strides: None,
            start: 0,
            end: 0,
        });
    }
    if t.data.is_null() {
        return Err(capsule_error(
            "dl_tensor.data",
            format!("null, for {len} element(s)"),
        ));
    }
    if ptr % size != 0 {
        return Err(capsule_error(
            "dl_tensor.byte_offset",
            format!(
                "the data begins at {ptr:#x}, not aligned to its {size}-byte {} elements",
                dtype.name()
            ),
        ));
    }
    // The lowest and highest element the view reaches, in elements from `ptr`.
    let (mut lo, mut hi) = (0i128, 0i128);
    for (d, &extent) in shape.iter().enumerate() {
        let stride = strides.as_ref().map_or_else(
            || shape[d + 1..].iter().map(|&e| e as i128).product(),
            |s| i128::from(s[d]),
        );
        let reach = (extent as i128 - 1) * stride;
        if reach < 0 {
            lo += reach;
        } else {
            hi += reach;
        }
    }
    let start = i128::from(ptr) + lo * i128::from(size);
    let end = i128::from(ptr) + (hi + 1) * i128::from(size);
    let allocation = st.driver.allocation_of(ptr).map_err(|source| {
        capsule_error(
            "dl_tensor.data",
            format!("{ptr:#x} lies in no device allocation the driver knows ({source})"),
        )
    })?;
    if allocation.ordinal != engine_ordinal {
        return Err(Error::Usage(UsageError::ForeignDevice {
            device_type: t.device.device_type,
            device_id: allocation.ordinal as i32,
            engine,
        }));
    }
    let base = i128::from(allocation.base);
    if start < base || end > base + i128::from(allocation.bytes) {
        return Err(capsule_error(
            "dl_tensor",
            format!(
                "the view reaches bytes {start:#x}..{end:#x}, outside its allocation {base:#x}..{:#x}",
                base + i128::from(allocation.bytes)
            ),
        ));
    }
    Ok(View {
        dtype,
        shape,
        len,
        ptr,
        strides,
        // Inside the allocation, so inside `u64`.
        start: start as u64,
        end: end as u64,
    })
}

/// Whether `strides` describe compact row-major data of `shape` (extents of 1 take any stride,
/// as producers give them).
fn is_compact(shape: &[usize], strides: &[i64]) -> bool {
    let mut step = 1i128;
    for (&extent, &stride) in shape.iter().zip(strides).rev() {
        if extent != 1 && i128::from(stride) != step {
            return false;
        }
        step *= extent as i128;
    }
    true
}

/// The live imports of an engine, by the bytes they view: a writable import may not share
/// bytes with another import.
#[derive(Default)]
pub(crate) struct Imports {
    /// `(id, start, end, writable)` of each live view.
    live: Vec<(u64, u64, u64, bool)>,
    /// The id of the next view admitted.
    next: u64,
}

impl Part for Imports {
    const TEARDOWN: Teardown = Teardown::BeforeEvents(2);
    fn teardown(&mut self, _: &mut dyn Driver, _: &mut crate::ledger::Ledger) {}
}

impl Imports {
    /// Admits a view of `start..end`, unless it shares bytes with a live view and either is
    /// writable; returns its id.
    fn admit(&mut self, start: u64, end: u64, writable: bool) -> Result<u64> {
        let clash = self
            .live
            .iter()
            .any(|&(_, s, e, w)| s < end && start < e && (w || writable));
        if clash {
            return Err(Error::Usage(UsageError::Overlaps { start, end }));
        }
        self.next += 1;
        self.live.push((self.next, start, end, writable));
        Ok(self.next)
    }

    /// Forgets view `id` (nothing when it is already forgotten).
    fn remove(&mut self, id: u64) {
        if let Some(at) = self.live.iter().position(|&(i, ..)| i == id) {
            self.live.swap_remove(at);
        }
    }
}

/// Forgets the view behind `tensor`, if it is an import of this crate's, because it is being
/// exported by value: no value of the engine reaches it any more (the capsule holds it until
/// the consumer's deleter), so its bytes may be imported again, as the new value they are.
pub(crate) fn exported(st: &mut State, home: Option<&Arc<dyn Home>>) {
    let Some(import) = home.and_then(|h| h.as_any().downcast_ref::<ImportHome>()) else {
        return;
    };
    let id = import
        .release
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(|r| r.entry);
    if let Some(id) = id {
        st.parts.get_mut::<Imports>().remove(id);
    }
}

#[allow(clippy::result_large_err)]
fn import_with(
    engine: &mut CudaEngine,
    capsule: Capsule,
    ready: Ready,
    strides: Strides,
    writable: bool,
) -> Result<AnyTensor, SubmitError<Capsule>> {
    if writable && capsule.is_read_only() {
        return Err(SubmitError::Rejected {
            input: capsule,
            error: Error::Usage(UsageError::ReadOnly {
                what: "a DLPack tensor flagged read-only, imported writable (use import_read_only)",
            }),
        });
    }
    let ordinal = engine.device().ordinal;
    // Checked, admitted and the producer's stream joined under one lock hold; an empty view
    // (`None`) is neither admitted nor joined.
    let checked = (|| {
        let mut st = engine.enter()?;
        let view = describe(&st, ordinal, &capsule)?;
        if view.len == 0 {
            return Ok((view, None));
        }
        if let (Some(given), Strides::Refuse) = (&view.strides, strides) {
            return Err(Error::Usage(UsageError::NotCompact {
                shape: view.shape.clone(),
                strides: given.clone(),
            }));
        }
        let copy = view.strides.is_some() || view.dtype == DType::Bool;
        let entry = st
            .parts
            .get_mut::<Imports>()
            .admit(view.start, view.end, writable && !copy)?;
        if let Err(error) = join(&mut st, view.ptr, ready) {
            st.parts.get_mut::<Imports>().remove(entry);
            return Err(error);
        }
        Ok((view, Some(entry)))
    })();
    let (view, entry) = match checked {
        Ok(checked) => checked,
        Err(error) => {
            return Err(SubmitError::Rejected {
                input: capsule,
                error,
            });
        }
    };
    let Some(entry) = entry else {
        drop(capsule); // nothing to view: the producer's memory goes back now
        let bytes = match DeviceTensor::<u8>::alloc(engine, &[0]) {
            Ok(bytes) => bytes,
            Err(error) => unreachable!("a zero-element tensor allocates nothing: {error}"),
        };
        return Ok(
            // SAFETY: zero bytes hold zero elements of any type.
            unsafe { AnyTensor::from_bytes(bytes, view.dtype, &view.shape) }
                .expect("zero elements fill zero bytes"),
        );
    };
    let copy = view.strides.is_some() || view.dtype == DType::Bool;
    let owner = Arc::clone(&engine.shared);
    // From here the capsule is held until its release is proven: dropped only by `Release`.
    let release = Release {
        capsule: Some(capsule),
        owner: Arc::clone(&owner),
        entry,
    };
    if copy {
        return copied(engine, release, &view);
    }
    let bytes = view.len * view.dtype.size_bytes();
    let home: Arc<dyn Home> = Arc::new(ImportHome {
        release: Mutex::new(Some(release)),
    });
    let bytes_tensor =
        // SAFETY: `ptr` is device memory of the engine's device (the driver says so) holding the
        // view's `bytes` (checked against its allocation), valid values of `dtype` once the
        // producer's writes, which the engine's streams now wait for, have run (the producer's
        // claim, for a non-`bool` type any bit pattern is); `home` releases it.
        unsafe { DeviceTensor::<u8>::homed(view.ptr, &[bytes], bytes, &owner, home) };
    Ok(
        // SAFETY: as above; the bytes are exactly `len` elements of `dtype`.
        unsafe { AnyTensor::from_bytes(bytes_tensor, view.dtype, &view.shape) }
            .expect("the view's bytes are its elements"),
    )
}

/// Orders the engine's lanes after the producer's writes of `ptr`, as `ready` says.
fn join(st: &mut State, ptr: DevicePtr, ready: Ready) -> Result<()> {
    let uses = [Use::Write(ptr)];
    match ready {
        // The producer made the compute stream wait; the other lanes follow it from here.
        Ready::OnEngineStream => {
            st.order.mark(Lane::Compute, &uses);
            Ok(())
        }
        Ready::After(stream) => {
            let st = &mut *st;
            // SAFETY: `Stream`'s contract: live until this import returns.
            unsafe {
                st.order
                    .take_back(&mut *st.driver, stream.as_raw(), Lane::Compute, &uses)
            }
        }
        Ready::Complete => Ok(()),
    }
}

/// A strided or `bool` import: a compact copy on the compute stream, after which the capsule
/// is released.
#[allow(clippy::result_large_err)]
fn copied(
    engine: &mut CudaEngine,
    release: Release,
    view: &View,
) -> Result<AnyTensor, SubmitError<Capsule>> {
    let (dtype, gathered) = if view.dtype == DType::Bool {
        (DType::U8, DType::Bool)
    } else {
        (view.dtype, view.dtype)
    };
    let compact: Vec<i64> = {
        let mut step = 1i64;
        let mut s = vec![0i64; view.shape.len()];
        for (stride, &extent) in s.iter_mut().zip(&view.shape).rev() {
            *stride = step;
            step = step.saturating_mul(extent as i64);
        }
        s
    };
    let strides = view.strides.as_deref().unwrap_or(&compact);
    // SAFETY: every element the view reaches lies in the producer's allocation (checked in
    // `describe`), which `release` keeps until the copy is proven complete (fenced below).
    let copy = unsafe { engine.gather_strided(view.ptr, view.ptr, dtype, &view.shape, strides, 0) };
    let out = match copy {
        Ok(out) => out,
        // Refused: nothing reads the capsule's memory, which goes back to the caller.
        Err(error) => {
            return Err(SubmitError::Rejected {
                input: release.into_capsule(),
                error,
            });
        }
    };
    let owner = Arc::clone(&engine.shared);
    retire(&owner, view.ptr, release);
    if gathered != DType::Bool {
        return Ok(out);
    }
    let bytes = out
        .try_typed::<u8>()
        .unwrap_or_else(|_| unreachable!("gathered as u8"));
    // The capsule is already on its way back to its producer: nothing to hand back.
    engine
        .cast::<bool>(&bytes)
        .map(AnyTensor::from)
        .map_err(|error| SubmitError::Retained { error })
}

/// The producer's memory, not the engine's: none counted.
impl crate::core::retire::Held for Release {}

/// What holds an import's capsule until its release is proven: dropping it forgets the
/// import's bytes and calls the producer's deleter.
struct Release {
    capsule: Option<Capsule>,
    owner: Arc<Shared>,
    /// Its id among the engine's live imports.
    entry: u64,
}

impl Release {
    /// The capsule, back from a refused import: its bytes are no longer a live import.
    fn into_capsule(mut self) -> Capsule {
        self.capsule
            .take()
            .expect("a live release holds its capsule")
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        if let Some(mut st) = self.owner.lock_for_drop() {
            st.parts.get_mut::<Imports>().remove(self.entry);
        }
        drop(self.capsule.take());
    }
}

/// Where an imported view's memory goes when its tensor is dropped: back to the producer, once
/// the engine's uses are proven complete.
struct ImportHome {
    release: Mutex<Option<Release>>,
}

impl Home for ImportHome {
    fn drop_memory(&self, owner: &Arc<Shared>, ptr: DevicePtr) {
        let release = self
            .release
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(release) = release {
            retire(owner, ptr, release);
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Hands `release` to the engine's retirement queue behind an event recorded after every use of
/// `ptr` queued so far (on the compute stream, which waits for the others' first); when that
/// cannot be done, a host wait for every lane proves them, and when that fails too, the
/// capsule is leaked: never released under work that may still use it.
fn retire(owner: &Arc<Shared>, ptr: DevicePtr, release: Release) {
    let Some(mut st) = owner.enter_for_drop() else {
        std::mem::forget(release);
        return;
    };
    if let Err(refused) = st.order_uses(Lane::Compute, &[Use::Write(ptr)]) {
        st.defer(refused);
        let upto = st.order.positions();
        match owner.waits.stream_synchronize() {
            Ok(()) => {
                st.order.settled(upto);
                drop(st);
                drop(release);
            }
            Err(source) => {
                st.defer(Error::DeviceFault {
                    what: "the engine's work on a DLPack import",
                    source,
                });
                std::mem::forget(release);
            }
        }
        return;
    }
    match fence(
        &mut st,
        owner,
        Lane::Compute,
        ManuallyDrop::new(release),
        None,
        "a DLPack import",
    ) {
        Fencing::Fenced(fenced) => {
            drop(st);
            drop(fenced); // detaches into the retirement queue
        }
        Fencing::Proven(release, error) => {
            st.defer(error);
            drop(st);
            drop(release);
        }
        Fencing::Untracked(untracked, error) => {
            st.defer(error);
            drop(st);
            drop(untracked); // retained for the engine's life
        }
    }
}
