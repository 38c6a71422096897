//! Exports: a device tensor as a DLPack capsule for another library.
//!
//! The capsule owns what keeps the memory alive (the tensor, or an `Arc` of it for a read-only
//! export) in one heap block with the managed tensor and its shape and strides. The consumer's
//! stream waits on the device for the engine's writes when the capsule is made; when the
//! consumer calls the deleter, the engine's compute stream waits on the device for what the
//! consumer queued on its stream, and the memory is freed after that, stream-ordered.

use super::ffi::{self, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLTensor};
use super::{Capsule, Stream, Version, dl_dtype};
use crate::core::engine::{CudaEngine, Shared};
use crate::core::order::Use;
use crate::driver::{DevicePtr, Lane};
use crate::dtype::DType;
use crate::error::{Error, Result, SubmitError, UsageError};
use crate::memory::any_tensor::AnyTensor;
use crate::memory::element::Element;
use crate::memory::tensor::{DeviceTensor, Home};
use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

/// Exports `tensor` by value: the consumer may read and write it, and the engine cannot use it
/// again (it is moved into the capsule).
///
/// `consumer` is the stream the consumer will use it on (`__dlpack__`'s `stream`): it waits, on
/// the device, for every write the engine queued on the tensor, and when the deleter runs, the
/// free waits for everything queued on it by then. `None` (the protocol's `-1`) asks for no
/// stream: the export then waits on the host for the engine's work on the tensor, and the
/// deleter waits on the host for every stream of the context before the free.
///
/// ```
/// # use cuferry::sim::SimConfig;
/// # use cuferry::{CudaEngine, upload_tensor};
/// use cuferry::dlpack::{self, Ready, Stream, Strides, Version};
/// # let mut engine = CudaEngine::simulated(SimConfig::default());
/// let x = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3])?;
/// let stream = dlpack::engine_stream(&engine);
/// // SAFETY: the engine's own stream, live as long as the engine.
/// let capsule = dlpack::export(&mut engine, x, Some(unsafe { Stream::from_raw(stream) }), Version::V1)?;
/// // ... handed to another library, or taken back in:
/// let y = dlpack::import::<f32>(&mut engine, capsule, Ready::OnEngineStream, Strides::Refuse)?;
/// assert_eq!(cuferry::download_tensor(&mut engine, &y)?, [1.0, 2.0, 3.0]);
/// # Ok::<(), cuferry::Error>(())
/// ```
///
/// # Errors
/// [`UsageError::WrongEngine`] when `tensor` is not this engine's; [`Error::Driver`] when a
/// wait cannot be queued; the tensor comes back in [`SubmitError::Rejected`].
///
/// # Safety of `consumer`
/// A [`Stream`] is made unsafely, with the promise that it stays live until the deleter has
/// run; this function relies on it.
// The refusal hands the tensor back by value, as every give-back error does.
#[allow(clippy::result_large_err)]
pub fn export<T: Element>(
    engine: &mut CudaEngine,
    tensor: DeviceTensor<T>,
    consumer: Option<Stream>,
    version: Version,
) -> Result<Capsule, SubmitError<DeviceTensor<T>>> {
    let described = Described::of(&tensor);
    let checked = tensor
        .check_engine(engine)
        .and_then(|()| hand_over(engine, described.ptr, consumer, false))
        .map(|()| forget_import(engine, tensor.home()));
    described.finish(checked, tensor, consumer, version, false)
}

/// Exports `tensor` read-only, through the `Arc` the capsule keeps: neither the engine (which
/// holds it shared) nor the consumer (to which it is flagged read-only) may write it. Only in
/// DLPack 1.x ([`Version::V1`]), the first that can say so.
///
/// # Errors
/// As [`export`], and [`UsageError::ReadOnly`] for [`Version::Legacy`].
#[allow(clippy::result_large_err)]
pub fn export_shared<T: Element>(
    engine: &mut CudaEngine,
    tensor: Arc<DeviceTensor<T>>,
    consumer: Option<Stream>,
    version: Version,
) -> Result<Capsule, SubmitError<Arc<DeviceTensor<T>>>> {
    let described = Described::of(&*tensor);
    let checked = if version == Version::Legacy {
        Err(Error::Usage(UsageError::ReadOnly {
            what: "a read-only export in the legacy DLPack ABI, which cannot flag it read-only",
        }))
    } else {
        tensor
            .check_engine(engine)
            .and_then(|()| hand_over(engine, described.ptr, consumer, true))
    };
    described.finish(checked, tensor, consumer, version, true)
}

/// [`export`] for a tensor whose element type is known at run time.
///
/// # Errors
/// As [`export`].
#[allow(clippy::result_large_err)]
pub fn export_any(
    engine: &mut CudaEngine,
    tensor: AnyTensor,
    consumer: Option<Stream>,
    version: Version,
) -> Result<Capsule, SubmitError<AnyTensor>> {
    struct Of;
    impl crate::memory::any_tensor::Visit for Of {
        type Out = (Described, Option<Arc<dyn Home>>, Arc<Shared>);
        fn visit<T: Element>(self, tensor: &DeviceTensor<T>) -> Self::Out {
            (
                Described::of(tensor),
                tensor.home().cloned(),
                tensor.owner_arc(),
            )
        }
    }
    let (described, home, owner) = tensor.visit(Of);
    let checked = engine
        .shared
        .check(&owner)
        .and_then(|()| hand_over(engine, described.ptr, consumer, false))
        .map(|()| forget_import(engine, home.as_ref()));
    described.finish(checked, tensor, consumer, version, false)
}

/// A tensor exported by value that is itself an import leaves the engine's live imports: see
/// [`exported`](super::import::exported).
fn forget_import(engine: &CudaEngine, home: Option<&Arc<dyn Home>>) {
    if home.is_some() {
        super::import::exported(&mut engine.shared.lock(), home);
    }
}

/// Orders the consumer's stream after the engine's work on `ptr` (a read for a read-only
/// export, else a write), or, with no stream, waits on the host for it.
fn hand_over(
    engine: &mut CudaEngine,
    ptr: DevicePtr,
    consumer: Option<Stream>,
    read_only: bool,
) -> Result<()> {
    if ptr == 0 {
        return Ok(()); // no memory: nothing to order
    }
    let uses = [if read_only {
        Use::Read(ptr)
    } else {
        Use::Write(ptr)
    }];
    let mut st = engine.enter()?;
    match consumer {
        Some(stream) => {
            let st = &mut *st;
            // SAFETY: `Stream`'s contract: `stream` is live (it was made unsafely with that
            // promise).
            unsafe { st.order.hand_over(&mut *st.driver, stream.0, &uses) }
        }
        None => {
            st.order_uses(Lane::Compute, &uses)?;
            let upto = st.order.positions();
            drop(st);
            engine
                .shared
                .waits
                .lane_synchronize(Lane::Compute)
                .map_err(|source| Error::DeviceFault {
                    what: "the engine's work on a tensor exported with no consumer stream",
                    source,
                })?;
            engine
                .shared
                .proven
                .prove(Lane::Compute, upto[Lane::Compute.index()]);
            Ok(())
        }
    }
}

/// What a capsule says of a tensor.
struct Described {
    ptr: DevicePtr,
    shape: Box<[i64]>,
    dtype: DType,
    ordinal: usize,
    owner: Arc<Shared>,
}

impl Described {
    fn of<T: Element>(tensor: &DeviceTensor<T>) -> Described {
        Described {
            ptr: tensor.raw_ptr(),
            // A tensor's extents fit in `isize` (its bytes do), so in `i64`.
            shape: tensor.shape().iter().map(|&d| d as i64).collect(),
            dtype: T::DTYPE,
            ordinal: tensor.device().ordinal,
            owner: tensor.owner_arc(),
        }
    }

    /// The capsule of `value` once `checked` let the export go through; `value` back in the
    /// refusal otherwise.
    #[allow(clippy::result_large_err)]
    fn finish<V: Send + 'static>(
        self,
        checked: Result<()>,
        value: V,
        consumer: Option<Stream>,
        version: Version,
        read_only: bool,
    ) -> Result<Capsule, SubmitError<V>> {
        match checked {
            Ok(()) => Ok(self.into_capsule(Box::new(value), consumer, version, read_only)),
            Err(error) => Err(SubmitError::Rejected {
                input: value,
                error,
            }),
        }
    }

    /// The capsule that keeps `value` (what holds the memory) until its deleter runs.
    fn into_capsule(
        self,
        value: Box<dyn Any + Send>,
        consumer: Option<Stream>,
        version: Version,
        read_only: bool,
    ) -> Capsule {
        // Compact row-major strides, in elements.
        let mut strides = vec![0i64; self.shape.len()].into_boxed_slice();
        let mut step = 1i64;
        for (stride, &extent) in strides.iter_mut().zip(self.shape.iter()).rev() {
            *stride = step;
            step = step.saturating_mul(extent.max(1));
        }
        let keep = Keep {
            value: Some(value),
            ptr: self.ptr,
            owner: self.owner,
            consumer,
        };
        let tensor = DLTensor {
            data: self.ptr as *mut c_void,
            device: DLDevice {
                device_type: ffi::DL_CUDA,
                device_id: self.ordinal as i32,
            },
            ndim: self.shape.len() as i32,
            dtype: dl_dtype(self.dtype),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        let keep = (self.shape, strides, keep);
        match version {
            Version::V1 => {
                let managed = DLManagedTensorVersioned {
                    version: ffi::DLPackVersion {
                        major: ffi::DLPACK_MAJOR_VERSION,
                        minor: ffi::DLPACK_MINOR_VERSION,
                    },
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_versioned),
                    flags: if read_only {
                        ffi::DLPACK_FLAG_BITMASK_READ_ONLY
                    } else {
                        0
                    },
                    dl_tensor: tensor,
                };
                let managed = Held::leak(managed, keep, |m| (&mut m.dl_tensor, &mut m.manager_ctx));
                // SAFETY: a live managed tensor made just above, owned by nothing else, whose
                // deleter (`delete_versioned`) may run on any thread.
                unsafe { Capsule::from_versioned(managed) }
                    .expect("a capsule made here is not null and speaks DLPack 1")
            }
            Version::Legacy => {
                let managed = DLManagedTensor {
                    dl_tensor: tensor,
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_legacy),
                };
                let managed = Held::leak(managed, keep, |m| (&mut m.dl_tensor, &mut m.manager_ctx));
                // SAFETY: as above, with `delete_legacy`.
                unsafe { Capsule::from_legacy(managed) }.expect("a capsule made here is not null")
            }
        }
    }
}

/// One heap block per capsule: the managed tensor the consumer sees, the arrays it points to,
/// and what keeps the memory.
struct Held<M> {
    managed: M,
    shape: Box<[i64]>,
    strides: Box<[i64]>,
    /// Dropped with the block: the release of the memory, after the consumer's work.
    _keep: Keep,
}

impl<M> Held<M> {
    /// Leaks a block holding `managed`, the shape, strides and keeper of `parts`, and returns
    /// the managed tensor, pointing at the block's shape and strides and with the block as its
    /// `manager_ctx` (which its deleter frees). `fields` names the managed tensor's tensor and
    /// context.
    fn leak(
        managed: M,
        (shape, strides, keep): (Box<[i64]>, Box<[i64]>, Keep),
        fields: fn(&mut M) -> (&mut DLTensor, &mut *mut c_void),
    ) -> *mut M {
        let held = Box::into_raw(Box::new(Held {
            managed,
            shape,
            strides,
            _keep: keep,
        }));
        // SAFETY: `held` is the block just leaked, live until its deleter frees it; its shape
        // and strides are boxed slices that live as long as it.
        unsafe {
            let (tensor, ctx) = fields(&mut (*held).managed);
            tensor.shape = (*held).shape.as_mut_ptr();
            tensor.strides = (*held).strides.as_mut_ptr();
            *ctx = held.cast();
            &raw mut (*held).managed
        }
    }
}

/// The value that holds the exported memory, and what its release must follow.
struct Keep {
    /// The tensor (or `Arc` of it), taken by the drop.
    value: Option<Box<dyn Any + Send>>,
    ptr: DevicePtr,
    owner: Arc<Shared>,
    consumer: Option<Stream>,
}

impl Drop for Keep {
    fn drop(&mut self) {
        let Some(value) = self.value.take() else {
            return;
        };
        if self.ptr != 0 && !self.take_back() {
            // The consumer's work could not be ordered before the free: the memory is leaked,
            // never freed under it.
            std::mem::forget(value);
            return;
        }
        drop(value);
    }
}

impl Keep {
    /// Orders the engine's compute stream (where the free goes) after the consumer's work:
    /// on the device when it named a stream (other than the per-thread default stream), else
    /// by a host wait for the whole context.
    /// `false` when neither could be done (the failure is recorded for the next boundary).
    fn take_back(&self) -> bool {
        // The per-thread default stream names another stream on every thread, and the deleter
        // may run on any: only a wait for the whole context covers the consumer's work then.
        let named = self.consumer.filter(|&s| s != Stream::PER_THREAD);
        let Some(stream) = named else {
            return match self.owner.waits.context_synchronize() {
                Ok(()) => true,
                Err(source) => {
                    if let Some(mut st) = self.owner.lock_for_drop() {
                        st.defer(Error::DeviceFault {
                            what: "the consumer's work on an exported DLPack tensor",
                            source,
                        });
                    }
                    false
                }
            };
        };
        let Some(mut st) = self.owner.enter_for_drop() else {
            return false;
        };
        let st = &mut *st;
        // SAFETY: `Stream`'s contract: the consumer's stream is live until the deleter ran,
        // which is now.
        let taken = unsafe {
            st.order.take_back(
                &mut *st.driver,
                stream.0,
                Lane::Compute,
                &[Use::Write(self.ptr)],
            )
        };
        match taken {
            Ok(()) => {
                if st.torn_down {
                    // The teardown destroyed the order's events before this one was made.
                    st.order.release(&mut *st.driver);
                }
                true
            }
            Err(error) => {
                st.defer(error);
                false
            }
        }
    }
}

/// The deleter of the versioned capsules this crate makes.
///
/// # Safety
/// `managed` is null or a managed tensor made by [`Described::into_capsule`], deleted once.
unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    if managed.is_null() {
        return;
    }
    // SAFETY: the caller's contract: `manager_ctx` is the block `into_capsule` leaked, whose
    // first field is `managed`; it is freed once, here.
    let held = unsafe {
        Box::from_raw(
            (*managed)
                .manager_ctx
                .cast::<Held<DLManagedTensorVersioned>>(),
        )
    };
    release(held);
}

/// The deleter of the legacy capsules this crate makes.
///
/// # Safety
/// As [`delete_versioned`].
unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: as in `delete_versioned`.
    let held = unsafe { Box::from_raw((*managed).manager_ctx.cast::<Held<DLManagedTensor>>()) };
    release(held);
}

/// Drops a capsule's block on the consumer's thread; a panic there leaks what was left, since
/// it must not cross the C boundary.
fn release<M>(held: Box<Held<M>>) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(held)));
}
