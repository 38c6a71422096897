//! `cuferry.Tensor`: a device tensor of one of the module's engines, whose element type is
//! known at run time, handed to other libraries through DLPack by value.
//!
//! A `Tensor` holds its crate tensor until it is exported: `__dlpack__` moves it into the
//! capsule (the consumer then owns the memory, and frees it through the crate's deleter,
//! ordered after its own stream's work), so a second `__dlpack__` raises `BufferError`. Its
//! shape, element type and device stay readable after the export.

use crate::capsule;
use crate::engines::{self, Shared};
use crate::errors::Failure;
use cuferry::dlpack::{self, Stream, Version};
use cuferry::{AnyTensor, CudaEngine, DType, SubmitError, bf16, f16};
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use std::sync::{Arc, Mutex, PoisonError};

/// DLPack's device type of a CUDA device (`kDLCUDA`).
pub(crate) const DL_CUDA: i64 = 2;

/// A CUDA tensor of cuferry's (the tensors `cuferry.load` returns when torch is absent, and
/// what `cuferry.from_dlpack` makes): `shape` (a tuple), `dtype` (a string such as `"bf16"`),
/// `device` (the CUDA ordinal), `to_bytes()`, and the DLPack protocol (`__dlpack__`,
/// `__dlpack_device__`), which exports it by value: once.
#[pyclass(module = "cuferry", name = "Tensor", frozen)]
pub(crate) struct Tensor {
    /// The device ordinal of its engine.
    ordinal: usize,
    /// The engine that made it, which frees it.
    engine: Shared,
    /// Its element type, kept after the export.
    dtype: DType,
    /// Its shape, kept after the export.
    shape: Vec<usize>,
    /// The tensor, until exported. An `Arc` so that a save or a download can borrow it
    /// detached, without holding this lock; an export takes it only when no one borrows it.
    inner: Mutex<Option<Arc<AnyTensor>>>,
}

impl Tensor {
    /// A `Tensor` of `engine`'s device `ordinal`.
    pub(crate) fn new(ordinal: usize, engine: Shared, tensor: AnyTensor) -> Tensor {
        Tensor {
            ordinal,
            engine,
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            inner: Mutex::new(Some(Arc::new(tensor))),
        }
    }

    /// The device ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Its engine.
    pub(crate) fn engine(&self) -> &Shared {
        &self.engine
    }

    /// The tensor, borrowed (shared) for a save or a download.
    ///
    /// # Errors
    /// `BufferError` once it was exported.
    pub(crate) fn borrow(&self) -> PyResult<Arc<AnyTensor>> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.as_ref().map(Arc::clone).ok_or_else(|| {
            PyBufferError::new_err("this cuferry.Tensor was exported through DLPack already")
        })
    }

    /// Takes the tensor out for an export.
    fn take(&self) -> PyResult<AnyTensor> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(shared) = inner.take() else {
            return Err(PyBufferError::new_err(
                "this cuferry.Tensor was exported through DLPack already: a Tensor is exported \
                 by value, once",
            ));
        };
        match Arc::try_unwrap(shared) {
            Ok(tensor) => Ok(tensor),
            Err(shared) => {
                *inner = Some(shared);
                Err(PyBufferError::new_err(
                    "this cuferry.Tensor is in use by a save or a download on another thread",
                ))
            }
        }
    }

    /// Puts back a tensor whose export was refused.
    fn put_back(&self, tensor: AnyTensor) {
        *self.inner.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(tensor));
    }
}

/// The consumer's stream, from `__dlpack__`'s `stream` argument: `None` is the legacy default
/// stream (`1`), `-1` asks for no synchronization, `1` and `2` are CUDA's legacy and per-thread
/// default streams, any other positive integer a raw `CUstream` of the consumer's. Returns the
/// raw handle, or `None` for no synchronization.
fn consumer_stream(stream: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(stream) = stream.filter(|s| !s.is_none()) else {
        return Ok(Some(Stream::LEGACY.as_raw()));
    };
    if stream.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(
            "stream must be None or an int (a CUDA stream handle, 1, 2 or -1), not a bool",
        ));
    }
    let handle: i128 = stream.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "stream must be None or an int (a CUDA stream handle, 1, 2 or -1), not {}",
            stream
                .get_type()
                .name()
                .map_or_else(|_| "another type".into(), |n| n.to_string())
        ))
    })?;
    match handle {
        -1 => Ok(None),
        0 => Err(PyValueError::new_err(
            "stream=0 is ambiguous for CUDA and refused by the DLPack protocol: pass 1 for the \
             legacy default stream, 2 for the per-thread default stream, or -1 for no \
             synchronization",
        )),
        h if h < 0 || h > i128::from(u64::MAX) => Err(PyValueError::new_err(format!(
            "stream={h} is not a CUDA stream handle (a positive pointer-sized integer, 1, 2 or -1)"
        ))),
        h => Ok(Some(h as u64)),
    }
}

/// The ABI asked for by `__dlpack__`'s `max_version`: DLPack 1.x for `(1, _)` or later, the
/// legacy one for `None` or `(0, _)`.
fn version(max_version: Option<&Bound<'_, PyAny>>) -> PyResult<Version> {
    let Some(max) = max_version.filter(|m| !m.is_none()) else {
        return Ok(Version::Legacy);
    };
    let (major, _minor): (i64, i64) = max.extract().map_err(|_| {
        PyTypeError::new_err("max_version must be None or a tuple (major, minor) of ints")
    })?;
    Ok(if major >= 1 {
        Version::V1
    } else {
        Version::Legacy
    })
}

/// A tensor's bytes, little-endian (the host's and the file's order), downloaded by its
/// element type. `None` for an element type this module does not know (a newer crate's).
fn download_bytes(engine: &mut CudaEngine, tensor: &AnyTensor) -> Option<cuferry::Result<Vec<u8>>> {
    macro_rules! by_type {
        ($($dtype:ident => $t:ty, $bytes:expr;)*) => {
            match tensor.dtype() {
                $(DType::$dtype => {
                    let typed = tensor.as_typed::<$t>().expect("the dtype names the type");
                    Some(cuferry::download_tensor(engine, typed).map(|values| {
                        values.into_iter().flat_map($bytes).collect()
                    }))
                })*
                _ => None,
            }
        };
    }
    by_type! {
        F32 => f32, f32::to_le_bytes;
        F64 => f64, f64::to_le_bytes;
        F16 => f16, f16::to_le_bytes;
        BF16 => bf16, bf16::to_le_bytes;
        I8 => i8, i8::to_le_bytes;
        I16 => i16, i16::to_le_bytes;
        I32 => i32, i32::to_le_bytes;
        I64 => i64, i64::to_le_bytes;
        U8 => u8, u8::to_le_bytes;
        U16 => u16, u16::to_le_bytes;
        U32 => u32, u32::to_le_bytes;
        U64 => u64, u64::to_le_bytes;
        Bool => bool, |b: bool| [u8::from(b)];
    }
}

#[pymethods]
impl Tensor {
    /// The shape, a tuple of ints.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// The element type: `"f32"`, `"f64"`, `"f16"`, `"bf16"`, `"i8"`, `"i16"`, `"i32"`,
    /// `"i64"`, `"u8"`, `"u16"`, `"u32"`, `"u64"` or `"bool"`.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The CUDA device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.ordinal
    }

    /// The number of elements.
    #[getter]
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    /// Whether it was exported through DLPack (and so holds nothing any more).
    #[getter]
    fn exported(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// The tensor's bytes, copied to the host: the elements in row-major order, little-endian,
    /// as a safetensors file holds them (`bool` one byte each, 0 or 1).
    ///
    /// Raises `BufferError` once the tensor was exported, `cuferry.Error` when the download
    /// fails.
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let tensor = self.borrow()?;
        let engine = Arc::clone(&self.engine);
        let dtype = self.dtype;
        let bytes = py.detach(move || -> Result<Vec<u8>, Failure> {
            let mut engine = engines::lock(&engine)?;
            match download_bytes(&mut engine, &tensor) {
                Some(bytes) => Ok(bytes?),
                None => Err(Failure::Buffer(format!(
                    "to_bytes does not know the element type {}",
                    dtype.name()
                ))),
            }
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// `(2, ordinal)`: DLPack's device type of a CUDA device, and the ordinal.
    fn __dlpack_device__(&self) -> (i64, usize) {
        (DL_CUDA, self.ordinal)
    }

    /// Exports the tensor as a DLPack capsule, by value: the consumer owns it from now on, and a
    /// second call raises `BufferError`.
    ///
    /// - `stream`: the consumer's stream, which waits on the device for every write the engine
    ///   queued on the tensor. `None` means the legacy default stream (as `1`), `2` the
    ///   per-thread default stream, `-1` no synchronization (the export waits on the host), any
    ///   other positive int a raw `CUstream` of the consumer's on this device, which must stay
    ///   alive until the consumer has released the tensor (the protocol's contract; `0` is
    ///   refused as ambiguous).
    /// - `max_version`: `(1, 0)` or later makes a `"dltensor_versioned"` capsule (DLPack 1.x);
    ///   `None` a legacy `"dltensor"` one.
    /// - `dl_device`: `None` or this tensor's own `(2, ordinal)`; another raises `BufferError`.
    /// - `copy`: `None` or `False`; `True` raises `BufferError` (the export never copies).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    // A refused export hands the tensor back by value, as the crate's give-back errors do.
    #[allow(clippy::result_large_err)]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let consumer = consumer_stream(stream)?;
        let version = version(max_version)?;
        if let Some(device) = dl_device.filter(|d| !d.is_none()) {
            let (kind, id): (i64, i64) = device.extract().map_err(|_| {
                PyTypeError::new_err("dl_device must be None or a tuple (device_type, device_id)")
            })?;
            if (kind, id) != (DL_CUDA, self.ordinal as i64) {
                return Err(PyBufferError::new_err(format!(
                    "cannot export to DLPack device ({kind}, {id}): this tensor is on CUDA \
                     device {} ({DL_CUDA}, {}), and the export does not copy",
                    self.ordinal, self.ordinal
                )));
            }
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "copy=True: a cuferry.Tensor is exported by value, without a copy; pass \
                 copy=None or copy=False",
            ));
        }
        let tensor = self.take()?;
        let engine = Arc::clone(&self.engine);
        let exported = py.detach(move || {
            let mut engine = match engines::lock(&engine) {
                Ok(engine) => engine,
                Err(failure) => return Err((Some(tensor), failure)),
            };
            // SAFETY: the consumer named this stream in `__dlpack__(stream=...)`: `1`, `2` or a
            // stream of this device's context that it will use the tensor on. The module trusts
            // it to stay live until the consumer calls the capsule's deleter, which the
            // deleter's free waits for (torch's streams are pooled and never destroyed; the
            // interop guide states this trust): the promise `Stream::from_raw` asks for.
            let consumer = consumer.map(|h| unsafe { Stream::from_raw(h) });
            dlpack::export_any(&mut engine, tensor, consumer, version).map_err(|refused| {
                match refused {
                    SubmitError::Rejected { input, error }
                    | SubmitError::Failed { input, error } => (Some(input), Failure::Crate(error)),
                    SubmitError::Retained { error } => (None, Failure::Crate(error)),
                }
            })
        });
        match exported {
            Ok(capsule) => capsule::to_python(py, capsule),
            Err((back, failure)) => {
                if let Some(tensor) = back {
                    self.put_back(tensor);
                }
                Err(failure.into_py(py))
            }
        }
    }

    /// `cuferry.Tensor(shape=(2, 3), dtype='f32', device=0)`, with `, exported` once exported.
    fn __repr__(&self) -> String {
        let shape: Vec<String> = self.shape.iter().map(ToString::to_string).collect();
        let shape = match shape.len() {
            1 => format!("({},)", shape[0]),
            _ => format!("({})", shape.join(", ")),
        };
        format!(
            "cuferry.Tensor(shape={shape}, dtype='{}', device={}{})",
            self.dtype.name(),
            self.ordinal,
            if self.exported() { ", exported" } else { "" }
        )
    }
}
