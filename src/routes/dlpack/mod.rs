//! DLPack, both ways (feature `dlpack`): a device tensor handed to another library (PyTorch,
//! JAX, CuPy, cudarc-based crates) without a copy, and theirs taken in, with readiness carried
//! across the boundary by stream-ordered waits.
//!
//! The module exists because the bugs at this boundary are ordering bugs: a consumer that reads
//! a tensor before the producer's stream wrote it, memory freed while the consumer's stream
//! still reads it, an offset ignored, a stream named by the wrong number. Every exchange here is
//! ordered on the device, never by a host wait unless no stream is named:
//!
//! - [`export`] (by value), [`export_shared`] (read-only, through an `Arc` the capsule keeps)
//!   and [`export_any`] make a [`Capsule`] whose consumer stream waits for every write the
//!   engine queued on the tensor. When the consumer calls the deleter, on any thread, at any
//!   time, after the engine is gone too, the engine's compute stream waits for everything the
//!   consumer queued on its stream so far, and only then is the memory freed (stream-ordered).
//! - [`import`], [`import_read_only`] and [`import_any`] take a producer's capsule as a tensor of
//!   the engine: its device, element type, shape, strides, offset and extent checked (the
//!   extent against the allocation the driver reports), the producer's stream joined by an event
//!   ([`Ready`]), non-compact strides refused or copied ([`Strides`]). The producer's deleter is
//!   called exactly once: when the capsule is refused (through the [`Capsule`] handed back), or
//!   after the engine's last use of the tensor is proven complete.
//!
//! The [guide's chapter on interop](crate::guide::interop) says what each side may do when.

mod capsule;
mod export;
pub mod ffi;
mod import;

pub use capsule::{Capsule, RawCapsule};
pub use export::{export, export_any, export_shared};
pub use import::{ReadOnly, import, import_any, import_read_only};

use crate::core::engine::CudaEngine;
use crate::dtype::DType;

/// A CUDA stream of another library, by the handle the DLPack protocol passes
/// (`__dlpack__(stream=...)`): the legacy default stream, the calling thread's default stream,
/// or a raw `CUstream` of the engine's context.
///
/// A stream named in an export must stay live until the capsule's deleter has run (the deleter
/// orders the free after the work queued on it); one named in an import, until the import
/// returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream(u64);

impl Stream {
    /// The legacy default stream (`CU_STREAM_LEGACY`, the protocol's `1`): what a consumer means
    /// by `stream=None`.
    pub const LEGACY: Stream = Stream(crate::driver::LEGACY_STREAM);
    /// The calling thread's default stream (`CU_STREAM_PER_THREAD`, the protocol's `2`).
    pub const PER_THREAD: Stream = Stream(crate::driver::PER_THREAD_STREAM);

    /// The stream with raw handle `handle` (a `CUstream`'s value; `1` and `2` name
    /// [`LEGACY`](Self::LEGACY) and [`PER_THREAD`](Self::PER_THREAD)).
    ///
    /// # Safety
    /// `handle` is `1`, `2`, or a live stream of the context of the engine it is used with,
    /// which stays live for as long as the [type's docs](Stream) say. A dangling handle is
    /// undefined behaviour in the CUDA driver, which cannot check it.
    pub unsafe fn from_raw(handle: u64) -> Stream {
        Stream(handle)
    }

    /// The raw handle.
    pub fn as_raw(self) -> u64 {
        self.0
    }
}

/// The ABI a capsule is made in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Version {
    /// `DLManagedTensorVersioned`, DLPack 1.x: carries its version and the read-only flag.
    /// What a consumer that passes `max_version >= (1, 0)` asks for.
    V1,
    /// `DLManagedTensor`, for consumers older than DLPack 1.0: no version, no flags, so a
    /// read-only tensor cannot be exported this way.
    Legacy,
}

/// How an imported tensor's contents are known to be ready for the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ready {
    /// The producer has ordered its writes before the engine's compute stream: it was asked
    /// for the capsule with [`engine_stream`] as the consumer's stream (what `__dlpack__`
    /// does with its `stream` argument).
    OnEngineStream,
    /// The producer's writes are queued on this stream: the engine waits for an event recorded
    /// on it now, on the device.
    After(Stream),
    /// Nothing that writes the tensor is queued anywhere (the producer waited on the host).
    Complete,
}

/// What an import does with strides that are not compact row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strides {
    /// Refuses the capsule ([`UsageError::NotCompact`](crate::error::UsageError::NotCompact)),
    /// handing it back.
    Refuse,
    /// Copies the strided view into a new compact tensor on the engine's compute stream; the
    /// capsule is released once the copy is proven complete.
    Copy,
}

/// The handle to pass a producer as the consumer's stream (`__dlpack__(stream=...)`) so that it
/// orders its writes before the engine's work: the engine's compute stream, on which
/// [`Ready::OnEngineStream`] imports are ordered.
pub fn engine_stream(engine: &CudaEngine) -> u64 {
    engine.shared.lock().driver.stream_handle()
}

/// The DLPack element type of `dtype`.
pub(crate) const fn dl_dtype(dtype: DType) -> ffi::DLDataType {
    let (code, bits) = match dtype {
        DType::F32 => (ffi::DL_FLOAT, 32),
        DType::F64 => (ffi::DL_FLOAT, 64),
        DType::F16 => (ffi::DL_FLOAT, 16),
        DType::BF16 => (ffi::DL_BFLOAT, 16),
        DType::I8 => (ffi::DL_INT, 8),
        DType::I16 => (ffi::DL_INT, 16),
        DType::I32 => (ffi::DL_INT, 32),
        DType::I64 => (ffi::DL_INT, 64),
        DType::U8 => (ffi::DL_UINT, 8),
        DType::U16 => (ffi::DL_UINT, 16),
        DType::U32 => (ffi::DL_UINT, 32),
        DType::U64 => (ffi::DL_UINT, 64),
        DType::Bool => (ffi::DL_BOOL, 8),
    };
    ffi::DLDataType {
        code,
        bits,
        lanes: 1,
    }
}

/// The element type a DLPack element type names, if the crate has it.
pub(crate) fn dtype_of(dl: ffi::DLDataType) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| dl_dtype(d) == dl)
}

#[cfg(test)]
mod tests;
