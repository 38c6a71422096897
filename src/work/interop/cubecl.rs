//! CubeCL interop (feature `cubecl`): run CubeCL kernels on data that came from the engine.
//!
//! [`CudaEngine::with_cubecl`] opens a scope with the engine's context current and a CubeCL
//! compute client for the engine's device. CubeCL (0.10, CUDA runtime) shares the device's
//! primary context with the engine, so device memory is common, but it queues its work on streams
//! of its own that the engine cannot see. The boundary between the two is therefore explicit:
//!
//! - [`Scope::import`] copies a tensor into a fresh CubeCL buffer. It first waits for
//!   CubeCL's stream (so the buffer is allocated and no earlier CubeCL work still uses its
//!   memory), then queues the copy on the engine's compute stream and waits for it, so the copy
//!   has seen every earlier engine operation and CubeCL sees the copy.
//! - [`Scope::export`] copies a CubeCL buffer into a new [`DeviceTensor`]. It first waits
//!   for CubeCL's stream (so the kernels that wrote the buffer have finished), then queues the
//!   copy on the engine's compute stream and waits for it, so CubeCL may reuse the buffer at
//!   once; later engine operations on the tensor are ordered after the copy by the engine's order.
//!
//! # What the boundary costs
//!
//! Each import and each export is one device-to-device copy of the data plus two host waits: one
//! CubeCL `sync` (which also drains whatever else CubeCL queued on this thread's stream) and one
//! event wait on the engine's compute stream (which, joined to the copy streams first, drains
//! everything the engine queued before). Entering the scope itself is not a host barrier. What a
//! crossing costs against the engine's own copy and wait is in
//! `docs/records/cubecl-boundary.md`: keep data on one side for a whole stage and cross once.
//! A cross-stream event wait would avoid the host waits, but CubeCL 0.10 does not expose its
//! streams, so a host wait is the only ordering it offers.

use crate::core::engine::CudaEngine;
use crate::core::order::Use;
use crate::driver::Lane;
use crate::error::{Error, LibraryError, Result, SetupError, UsageError};
use crate::lifecycle::fence::wait_for_queued;
use crate::memory::element::{Element, byte_len};
use crate::memory::tensor::{DeviceTensor, shape_len};
use cubecl::Runtime;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::Handle;
use std::sync::Arc;

/// CubeCL's memory, not the engine's: none counted.
impl crate::core::retire::Held for Handle {}

/// The CubeCL runtime this interop targets, re-exported so kernels use the same version.
pub use cubecl as runtime;

/// What [`CudaEngine::with_cubecl`]'s closure receives: a CubeCL client for the engine's device,
/// and the engine itself for eager operations inside the scope.
pub struct Scope<'e> {
    engine: &'e mut CudaEngine,
    client: ComputeClient<CudaRuntime>,
}

impl std::fmt::Debug for Scope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("device", &self.engine.device())
            .finish()
    }
}

fn cubecl_error(what: &'static str) -> impl FnOnce(cubecl::server::ServerError) -> Error {
    move |e| {
        Error::Library(LibraryError::Interop {
            runtime: "CubeCL",
            what,
            detail: format!("{e:?}"),
        })
    }
}

impl<'e> Scope<'e> {
    /// The CubeCL client for the engine's device (CubeCL's `CudaRuntime`).
    pub fn client(&self) -> &ComputeClient<CudaRuntime> {
        &self.client
    }

    /// The engine, for eager operations inside the scope. They queue on the engine's streams, not
    /// CubeCL's: only [`import`](Self::import) and [`export`](Self::export) order the two.
    pub fn engine(&mut self) -> &mut CudaEngine {
        self.engine
    }

    /// Waits until CubeCL's stream for this thread has drained.
    fn sync_cubecl(&self, what: &'static str) -> Result<()> {
        cubecl::future::block_on(self.client.sync()).map_err(cubecl_error(what))
    }

    /// The device address of a CubeCL buffer.
    fn address(&self, handle: &Handle, what: &'static str) -> Result<u64> {
        let resource = self
            .client
            .get_resource(handle.clone())
            .map_err(cubecl_error(what))?;
        Ok(resource.resource().ptr)
    }

    /// Copies `tensor` into a new CubeCL buffer and returns its handle, after every engine
    /// operation queued before (see the [module docs](self) for the cost).
    ///
    /// # Errors
    /// [`UsageError::ZeroLength`](crate::error::UsageError::ZeroLength) for an empty tensor; [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine)
    /// for another engine's tensor; [`LibraryError::Interop`](crate::error::LibraryError::Interop) when CubeCL fails;
    /// [`Error::Driver`]/[`Error::DeviceFault`] when the copy fails.
    pub fn import<T: Element>(&mut self, tensor: &DeviceTensor<T>) -> Result<Handle> {
        tensor.check_engine(self.engine)?;
        let bytes = tensor.byte_len();
        if bytes == 0 {
            return Err(Error::Usage(UsageError::ZeroLength {
                what: "CubeCL import",
            }));
        }
        let handle = self.client.empty(bytes);
        let dst = self.address(&handle, "CubeCL buffer address")?;
        self.sync_cubecl("CubeCL sync before import")?;
        let owner = Arc::clone(&self.engine.shared);
        let mut st = owner.enter()?;
        st.order_uses(Lane::Compute, &[Use::Read(tensor.raw_ptr())])?;
        // SAFETY: `dst` is a live CubeCL allocation of at least `bytes` bytes (the handle is
        // held, and CubeCL's stream is idle, so nothing else uses it); the tensor is a live
        // allocation of this engine of `bytes` bytes, borrowed for the call; the wait below
        // proves the copy complete before either is released or reused.
        unsafe { st.driver.copy_dtod(dst, tensor.raw_ptr(), bytes) }
            .map_err(Error::driver("cuMemcpyDtoDAsync"))?;
        wait_for_queued(st, &owner, handle, "copy into a CubeCL buffer")
    }

    /// Copies a CubeCL buffer into a new tensor of `shape`, after every CubeCL operation queued
    /// before (see the [module docs](self) for the cost). Later engine operations on the tensor
    /// follow in stream order.
    ///
    /// # Errors
    /// [`UsageError::BufferTooSmall`](crate::error::UsageError::BufferTooSmall) when the buffer is
    /// smaller than `shape` needs;
    /// [`LibraryError::Interop`](crate::error::LibraryError::Interop) when CubeCL fails; [`Error::Driver`]/[`Error::DeviceFault`] when the
    /// copy fails.
    pub fn export<T: Element>(
        &mut self,
        handle: &Handle,
        shape: &[usize],
    ) -> Result<DeviceTensor<T>> {
        let len = shape_len(shape)?;
        let bytes = byte_len::<T>(len, "CubeCL export")?;
        let available = handle.size_in_used();
        if (bytes as u64) > available {
            return Err(Error::Usage(UsageError::BufferTooSmall {
                operation: "CubeCL export",
                shape: shape.to_vec(),
                dtype: T::DTYPE,
                needed: bytes as u64,
                available,
            }));
        }
        let out = DeviceTensor::<T>::alloc(self.engine, shape)?;
        if bytes == 0 {
            return Ok(out);
        }
        let src = self.address(handle, "CubeCL buffer address")?;
        self.sync_cubecl("CubeCL sync before export")?;
        let owner = Arc::clone(&self.engine.shared);
        let mut st = owner.enter()?;
        st.order_uses(Lane::Compute, &[Use::Write(out.raw_ptr())])?;
        // SAFETY: `src` is a live CubeCL allocation of at least `bytes` bytes whose writers have
        // finished (CubeCL's stream is idle) and which stays alive while `handle` is borrowed;
        // `out` is a fresh allocation of `bytes` bytes; the wait below proves the copy complete
        // before CubeCL may reuse the buffer.
        unsafe { st.driver.copy_dtod(out.raw_ptr(), src, bytes) }
            .map_err(Error::driver("cuMemcpyDtoDAsync"))?;
        wait_for_queued(st, &owner, (), "copy out of a CubeCL buffer")?;
        Ok(out)
    }
}

impl CudaEngine {
    /// Runs `f` with a CubeCL client for this engine's device (feature `cubecl`).
    ///
    /// Saves the calling thread's current context, makes the engine's current, and restores the
    /// previous one when `f` returns, returns `Err`, or unwinds. Entering is not a host barrier;
    /// data crosses between the engine and CubeCL only through [`Scope::import`] and
    /// [`Scope::export`], which order the two streams with host waits (see the
    /// [module docs](crate::cubecl) for what that costs).
    ///
    /// # Errors
    /// Whatever `f` returns; [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) (converted into `E`) on the simulated
    /// device, which CubeCL cannot drive; [`Error::Driver`] when the context cannot be made
    /// current.
    pub fn with_cubecl<R, E>(
        &mut self,
        f: impl FnOnce(&mut Scope<'_>) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E>
    where
        E: From<Error>,
    {
        if !self.shared.lock().driver.hosts_cuda_runtimes() {
            return Err(Error::Setup(SetupError::Unavailable {
                library: "CubeCL",
                detail: "simulated device: CubeCL's CUDA runtime needs a CUDA device".into(),
            })
            .into());
        }
        let _restore = crate::core::context::ContextScope::enter(
            &self.shared,
            "cuCtxSetCurrent (restore after CubeCL scope)",
        )?;
        let client = CudaRuntime::client(&CudaDevice::new(self.device().ordinal()));
        let mut scope = Scope {
            engine: self,
            client,
        };
        f(&mut scope)
    }
}
