//! Raw scopes: the engine's context, compute stream and device pointers, for code that calls CUDA
//! itself (a hand-written kernel, a vendor library the crate does not wrap).
//!
//! A raw scope makes the engine's context current on the calling thread for the duration of a
//! closure and restores the previous one afterwards: on return, on `Err`, and on unwind. The
//! handles it gives out carry the scope's lifetime, so none can be kept past it, and are neither
//! `Send` nor `Sync`, because the context is current only on this thread. Entering a scope is not
//! a host barrier: work queued inside it runs on the engine's compute stream after everything
//! the engine queued before the scope (the scope begins with an event join of the copy streams),
//! and later copies of the tensors it lent run after it.
//!
//! The scope's lifetime is a brand, invariant in every type that carries it, so a tensor lent to
//! the scope stays borrowed until the closure returns; [`RawScope`] explains why it takes a
//! second lifetime. The raw values are cudarc driver types, named through the crate's re-export
//! `cuferry::raw::cudarc`, the cudarc release these scopes speak.

use crate::core::context::ContextScope;
use crate::core::engine::{CudaEngine, Shared};
use crate::core::order::Use;
use crate::driver::Lane;
use crate::error::{Error, Result};
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use std::marker::PhantomData;
use std::sync::Mutex;

/// Marks a handle as tied to the scope `'s` and to the calling thread: invariant in `'s` (the
/// `fn(&'s ()) -> &'s ()`, so the brand can be neither shortened nor lengthened) and neither
/// `Send` nor `Sync` (the `*mut ()`).
type ScopeMarker<'s> = PhantomData<(fn(&'s ()) -> &'s (), *mut ())>;

/// Marks the environment lifetime of a raw scope, invariant like the brand.
type EnvMarker<'env> = PhantomData<fn(&'env ()) -> &'env ()>;

/// The engine's context, valid inside one raw scope.
#[derive(Clone, Copy, Debug)]
pub struct RawContext<'s> {
    raw: u64,
    _scope: ScopeMarker<'s>,
}

impl RawContext<'_> {
    /// The `CUcontext` (for a simulated engine, an opaque non-null token), typed through the
    /// crate's cudarc re-export: `cuferry::raw::cudarc::driver::sys::CUcontext`.
    pub fn as_raw(&self) -> crate::raw::cudarc::driver::sys::CUcontext {
        self.raw as crate::raw::cudarc::driver::sys::CUcontext
    }
}

/// The engine's compute stream, valid inside one raw scope.
///
/// Work queued on it runs after everything the engine queued before the scope, and later work
/// of the engine that shares a tensor lent to the scope runs after it.
#[derive(Clone, Copy, Debug)]
pub struct RawStream<'s> {
    raw: u64,
    _scope: ScopeMarker<'s>,
}

impl RawStream<'_> {
    /// The `CUstream`, typed through the crate's cudarc re-export:
    /// `cuferry::raw::cudarc::driver::sys::CUstream`.
    pub fn as_raw(&self) -> crate::raw::cudarc::driver::sys::CUstream {
        self.raw as crate::raw::cudarc::driver::sys::CUstream
    }
}

/// A tensor's device address, valid inside one raw scope. The tensor stays borrowed until the
/// scope ends, however soon the pointer itself is last used.
#[derive(Clone, Copy, Debug)]
pub struct RawDevicePtr<'s> {
    raw: u64,
    bytes: usize,
    _scope: ScopeMarker<'s>,
}

impl RawDevicePtr<'_> {
    /// The `CUdeviceptr` (a `u64`), typed through the crate's cudarc re-export:
    /// `cuferry::raw::cudarc::driver::sys::CUdeviceptr`.
    pub fn as_raw(&self) -> crate::raw::cudarc::driver::sys::CUdeviceptr {
        self.raw
    }

    /// The length of the allocation behind it, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// What a raw scope's closure receives. See [`CudaEngine::with_raw`].
///
/// # The brand
///
/// The scope's lifetime `'s` is a brand: the closure must work for every `'s`
/// (`for<'s> FnOnce(&'s RawScope<'s, 'env>)`), and every type that carries it is *invariant* in
/// it, so the compiler can neither shorten nor lengthen it. A tensor handed to
/// [`device_ptr`](Self::device_ptr) or [`device_ptr_mut`](Self::device_ptr_mut) is therefore
/// borrowed for the whole scope, not only while the returned [`RawDevicePtr`] is used: raw work
/// queued inside the scope may still read or write its memory after the last use of the pointer,
/// so the tensor cannot be dropped, moved or borrowed mutably again until the closure has
/// returned. Only tensors from outside the closure (which outlive the scope) can be lent at all.
///
/// The second lifetime, `'env`, is the closure's environment, as in [`std::thread::scope`]: the
/// argument type `&'s RawScope<'s, 'env>` implies `'env: 's`, which is what lets the closure lend
/// tensors it borrowed from its caller for `'s`. Without it, an invariant `'s` that the closure
/// must accept for every lifetime would demand borrows for `'static`. Both are invariant. The
/// closure never names either: `|raw| ...` is the whole signature.
pub struct RawScope<'s, 'env: 's> {
    shared: &'s Shared,
    context: u64,
    stream: u64,
    /// The tensors lent so far, and how: recorded as the scope's uses when it ends.
    lent: &'s Mutex<Vec<Use>>,
    _scope: ScopeMarker<'s>,
    _env: EnvMarker<'env>,
}

impl<'s, 'env> RawScope<'s, 'env> {
    /// The engine's context, current on this thread for the whole scope.
    pub fn context(&self) -> RawContext<'s> {
        RawContext {
            raw: self.context,
            _scope: PhantomData,
        }
    }

    /// The engine's compute stream. Everything the engine queued before the scope, on any of
    /// its streams, runs before work queued here: the scope begins with the compute stream
    /// waiting for the engine's copy streams (one event wait each, only for a copy stream with
    /// work the compute stream has not waited for yet). After the scope, the engine orders work
    /// on its other streams after the work queued here wherever it shares a tensor lent to the
    /// scope: a copy that overwrites a tensor lent by [`device_ptr`](Self::device_ptr), and any
    /// copy of a tensor lent by [`device_ptr_mut`](Self::device_ptr_mut).
    pub fn stream(&self) -> RawStream<'s> {
        RawStream {
            raw: self.stream,
            _scope: PhantomData,
        }
    }

    /// The device address of a tensor, for reading. The tensor stays borrowed until the scope
    /// ends, so it cannot be dropped, moved or written meanwhile.
    ///
    /// # Errors
    /// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when the tensor is not this engine's.
    pub fn device_ptr<T: Element>(&self, tensor: &'s DeviceTensor<T>) -> Result<RawDevicePtr<'s>> {
        self.lend(tensor, Use::Read(tensor.raw_ptr()))
    }

    fn lend<T: Element>(&self, tensor: &DeviceTensor<T>, usage: Use) -> Result<RawDevicePtr<'s>> {
        self.shared
            .check_owner(tensor.device(), tensor.engine_id())?;
        if !tensor.is_empty() {
            self.lent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(usage);
        }
        Ok(RawDevicePtr {
            raw: tensor.raw_ptr(),
            bytes: tensor.byte_len(),
            _scope: PhantomData,
        })
    }

    /// The device address of a tensor, for writing. The tensor stays borrowed mutably until the
    /// scope ends, so nothing else can read, write, drop or move it meanwhile (not even another
    /// `device_ptr` of the same tensor in this scope).
    ///
    /// # Errors
    /// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when the tensor is not this engine's.
    pub fn device_ptr_mut<T: Element>(
        &self,
        tensor: &'s mut DeviceTensor<T>,
    ) -> Result<RawDevicePtr<'s>> {
        let usage = Use::Write(tensor.raw_ptr());
        self.lend(tensor, usage)
    }
}

/// Records, when a raw scope ends (on return, `Err` or unwind), the tensors it lent as used on
/// the compute stream by the work it queued, so later work on the copy streams that shares one
/// waits for it.
struct AfterRawWork<'a> {
    shared: &'a Shared,
    lent: Mutex<Vec<Use>>,
}

impl Drop for AfterRawWork<'_> {
    fn drop(&mut self) {
        let lent = std::mem::take(self.lent.get_mut().unwrap_or_else(|e| e.into_inner()));
        if lent.is_empty() {
            return;
        }
        if let Some(mut st) = self.shared.lock_for_drop() {
            st.order.mark(Lane::Compute, &lent);
        }
    }
}

impl std::fmt::Debug for RawScope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawScope")
            .field("device", &self.shared.device)
            .field("context", &self.context)
            .field("stream", &self.stream)
            .finish()
    }
}

impl CudaEngine {
    /// Runs `f` with the engine's raw context, compute stream and tensor pointers.
    ///
    /// Saves the calling thread's current context, makes the engine's current, and restores the
    /// previous one when `f` returns, returns `Err`, or unwinds. Not a host barrier.
    ///
    /// The engine stays borrowed for the whole call, so the closure cannot use it; tensors lent
    /// with [`RawScope::device_ptr`] or [`RawScope::device_ptr_mut`] stay borrowed until the
    /// closure returns ([the brand](RawScope#the-brand)).
    ///
    /// ```
    /// # fn main() -> Result<(), cuferry::Error> {
    /// # let mut engine = cuferry::CudaEngine::simulated(Default::default());
    /// let tensor = cuferry::upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3])?;
    /// let bytes = engine.with_raw(|raw| {
    ///     let ptr = raw.device_ptr(&tensor)?;
    ///     // ... queue work on raw.stream().as_raw() with raw CUDA calls ...
    ///     Ok::<_, cuferry::Error>(ptr.bytes())
    /// })?;
    /// assert_eq!(bytes, 12);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// Whatever `f` returns, or [`Error::Driver`] (converted into `E`) when the context cannot
    /// be made current.
    pub fn with_raw<'env, R, E>(
        &mut self,
        f: impl for<'s> FnOnce(&'s RawScope<'s, 'env>) -> Result<R, E>,
    ) -> Result<R, E>
    where
        E: From<Error>,
    {
        let _restore =
            ContextScope::enter(&self.shared, "cuCtxSetCurrent (restore after raw scope)")?;
        let shared: &Shared = &self.shared;
        let (context, stream) = {
            let mut st = shared.lock();
            let st = &mut *st;
            // Everything queued on the copy streams so far runs before the scope's work.
            st.order.join(&mut *st.driver, Lane::Compute)?;
            (st.driver.context().0, st.driver.stream_handle())
        };
        let after = AfterRawWork {
            shared,
            lent: Mutex::new(Vec::new()),
        };
        let scope = RawScope {
            shared,
            context,
            stream,
            lent: &after.lent,
            _scope: PhantomData,
            _env: PhantomData,
        };
        f(&scope)
    }
}
