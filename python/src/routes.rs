//! The module's functions: `load`, `save` and `from_dlpack`, each a composition of the crate's
//! routes run detached from the interpreter.
//!
//! The Python half (`cuferry/__init__.py`) normalises the arguments (a path-like, a device given
//! as `"cuda:1"` or a `torch.device`, a `select` iterable, `progress=True`) before calling these.

use crate::capsule;
use crate::engines::{self, Shared};
use crate::errors::Failure;
use crate::tensor::{DL_CUDA, Tensor};
use cuferry::checkpoint::{self, LoadOptions, Progress, SaveTensor};
use cuferry::dlpack::{self, Ready, Strides};
use cuferry::{AnyTensor, SubmitError};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::cell::RefCell;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

/// Which tensors a load reads.
enum Select {
    /// Every one.
    All,
    /// Those named.
    Names(HashSet<String>),
    /// Those for which a Python callable, given the name, returns something true.
    Call(Py<PyAny>),
}

/// Loads the safetensors checkpoint `path` (one file, or a sharded set through its
/// `*.safetensors.index.json`) onto CUDA device `device`, and returns a dict of
/// `cuferry.Tensor` by name, in file order (the shards' in the order the index first names
/// them).
///
/// `select`: `None` (every tensor), a set or frozenset of names, or a callable `name -> bool`;
/// the others are neither allocated nor read. `progress`: `None`, or a callable
/// `(bytes_done, bytes_total)`, called after each chunk's copy is queued. The callables run on
/// the calling thread while the load holds the device's engine, so they must not call cuferry
/// (that raises `cuferry.UsageError` in them). An exception raised in one (a
/// `KeyboardInterrupt` included) stops further calls and is raised once the load has finished,
/// its tensors dropped.
///
/// Returns once every copy is complete. Raises `cuferry.Error` naming the file (and the tensor)
/// for a file that cannot be read or a bad one, and for a device that cannot be opened.
#[pyfunction]
#[pyo3(signature = (path, device=0, select=None, progress=None))]
pub(crate) fn load<'py>(
    py: Python<'py>,
    path: PathBuf,
    device: usize,
    select: Option<Bound<'py, PyAny>>,
    progress: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let select = match select {
        None => Select::All,
        Some(s) if s.is_none() => Select::All,
        Some(s) if s.is_callable() => Select::Call(s.unbind()),
        Some(s) => Select::Names(s.extract().map_err(|_| {
            PyTypeError::new_err(
                "select must be None, a set of tensor names (str) or a callable name -> bool",
            )
        })?),
    };
    let progress = match progress {
        Some(p) if p.is_none() => None,
        Some(p) if !p.is_callable() => {
            return Err(PyTypeError::new_err(
                "progress must be None or a callable (bytes_done, bytes_total)",
            ));
        }
        p => p.map(Bound::unbind),
    };
    let (engine, loaded) = py.detach(move || -> Result<_, Failure> {
        let engine = engines::engine(device)?;
        let loaded = {
            let mut held = engines::lock(&engine)?;
            // The first exception a callback raised; none is called after it.
            let raised: RefCell<Option<PyErr>> = RefCell::new(None);
            let keep = |name: &str| -> bool {
                match &select {
                    Select::All => true,
                    Select::Names(names) => names.contains(name),
                    Select::Call(f) => {
                        if raised.borrow().is_some() {
                            return false;
                        }
                        Python::attach(|py| {
                            match f.bind(py).call1((name,)).and_then(|r| r.is_truthy()) {
                                Ok(keep) => keep,
                                Err(e) => {
                                    *raised.borrow_mut() = Some(e);
                                    false
                                }
                            }
                        })
                    }
                }
            };
            // Attached once a chunk: for the caller's callback, and for Ctrl-C, whose handler
            // runs only while attached.
            let report = |p: Progress| {
                if raised.borrow().is_some() {
                    return;
                }
                Python::attach(|py| {
                    let called = py.check_signals().and_then(|()| match &progress {
                        Some(f) => f.bind(py).call1((p.done, p.total)).map(drop),
                        None => Ok(()),
                    });
                    if let Err(e) = called {
                        *raised.borrow_mut() = Some(e);
                    }
                });
            };
            let options = LoadOptions::new().select(keep).progress(report);
            let loaded = checkpoint::load_with(&mut held, &path, options);
            // A callback's exception comes first: it is the caller's, and may be why the load
            // went wrong (a Ctrl-C, say). The tensors loaded are then dropped.
            if let Some(e) = raised.into_inner() {
                drop(loaded);
                return Err(Failure::Py(e));
            }
            loaded?
        };
        Ok((engine, loaded))
    })?;
    let tensors = PyDict::new(py);
    for (name, tensor) in loaded {
        let tensor = Tensor::new(device, Arc::clone(&engine), tensor);
        tensors.set_item(name, Bound::new(py, tensor)?)?;
    }
    Ok(tensors)
}

/// The CUDA ordinal a DLPack producer says its tensor is on (`__dlpack_device__()`), for the
/// tensor `what` in errors.
///
/// # Errors
/// `TypeError` for an object that is not a DLPack producer; `ValueError` for one that is not
/// on a CUDA device.
fn producer_device(object: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    let type_name = || {
        object
            .get_type()
            .name()
            .map_or_else(|_| String::from("object"), |n| n.to_string())
    };
    let (Ok(device), true) = (
        object.getattr("__dlpack_device__"),
        object.hasattr("__dlpack__")?,
    ) else {
        return Err(PyTypeError::new_err(format!(
            "{what}: a {} is not a DLPack producer (it has no __dlpack__ and \
             __dlpack_device__): pass a CUDA tensor (torch's, cuferry's, or any other \
             library's)",
            type_name()
        )));
    };
    let (kind, id): (i64, i64) = device.call0()?.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: the {}'s __dlpack_device__() did not return a tuple (device_type, device_id)",
            type_name()
        ))
    })?;
    let label = match kind {
        1 => " (the CPU)",
        3 => " (CUDA host memory)",
        13 => " (CUDA managed memory)",
        _ => "",
    };
    match (kind, usize::try_from(id)) {
        (DL_CUDA, Ok(ordinal)) => Ok(ordinal),
        _ => Err(PyValueError::new_err(format!(
            "{what} is on DLPack device ({kind}, {id}){label}, not a CUDA device ({DL_CUDA}, n): \
             cuferry takes CUDA tensors only (move it with .cuda() or .to(\"cuda\") first)"
        ))),
    }
}

/// Asks `producer` for its capsule, with `stream` as the consumer's stream so that it orders
/// its writes before the engine's (`__dlpack__(stream=stream, max_version=(1, 0))`, again
/// without `max_version` where the producer refuses it with a `TypeError`), and takes it.
fn capsule_of(
    py: Python<'_>,
    producer: &Bound<'_, PyAny>,
    stream: u64,
) -> PyResult<dlpack::Capsule> {
    let method = producer.getattr("__dlpack__")?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("stream", stream)?;
    kwargs.set_item("max_version", (1, 0))?;
    let made = match method.call((), Some(&kwargs)) {
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            // A producer older than DLPack 1.0 has no `max_version`.
            kwargs.del_item("max_version")?;
            method.call((), Some(&kwargs))?
        }
        made => made?,
    };
    capsule::from_python(py, &made)
}

/// The engine of device `ordinal` and its stream, for a producer's `__dlpack__(stream=...)`.
fn engine_and_stream(py: Python<'_>, ordinal: usize) -> PyResult<(Shared, u64)> {
    Ok(py.detach(move || -> Result<_, Failure> {
        let engine = engines::engine(ordinal)?;
        let stream = dlpack::engine_stream(&*engines::lock(&engine)?);
        Ok((engine, stream))
    })?)
}

/// Takes any DLPack producer's CUDA tensor (torch's, cuferry's own, CuPy's, JAX's) as a
/// `cuferry.Tensor` of device `device` (by default the producer's device; another one is
/// refused with `ValueError`, since the import does not copy between devices).
///
/// The producer is asked for its capsule with the engine's stream as the consumer's, so it
/// orders its writes before the engine's work on the device, with no host wait. A compact
/// (row-major) tensor comes in as a view of the producer's memory, which the producer keeps
/// until the `Tensor` is gone; a strided one as a compact copy, made on the device.
#[pyfunction]
#[pyo3(signature = (obj, device=None))]
pub(crate) fn from_dlpack(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: Option<usize>,
) -> PyResult<Tensor> {
    let on = producer_device(obj, "the tensor")?;
    let ordinal = device.unwrap_or(on);
    if ordinal != on {
        return Err(PyValueError::new_err(format!(
            "the tensor is on CUDA device {on}, not on device {ordinal}: from_dlpack takes a \
             tensor on its own device (move it with .to(\"cuda:{ordinal}\") first)"
        )));
    }
    let (engine, stream) = engine_and_stream(py, ordinal)?;
    let capsule = capsule_of(py, obj, stream)?;
    let shared = Arc::clone(&engine);
    let tensor = py.detach(move || -> Result<AnyTensor, Failure> {
        let mut engine = engines::lock(&shared)?;
        dlpack::import_any(&mut engine, capsule, Ready::OnEngineStream, Strides::Copy)
            .map_err(|refused| Failure::Crate(refused.into_error()))
    })?;
    Ok(Tensor::new(ordinal, engine, tensor))
}

/// A tensor to save: one of ours, borrowed, or another library's, taken through DLPack.
enum Source {
    /// A `cuferry.Tensor`'s tensor.
    Ours(Arc<AnyTensor>),
    /// A producer's capsule, taken.
    Theirs(dlpack::Capsule),
}

/// Saves the CUDA tensors `tensors` (`(name, tensor)` pairs, all on one device) to the
/// safetensors file `path`, through the crate's writer: written under a temporary name, renamed
/// over `path` once complete.
///
/// Each tensor is a `cuferry.Tensor` (borrowed, still usable after) or any DLPack producer's
/// (torch's included), taken without a copy: asked for its capsule with the engine's stream as
/// the consumer's, so the producer orders its writes before the save reads; a strided one is
/// saved as its row-major contents (a compact copy made on the device). No tensors at all write
/// an empty checkpoint through device 0's engine.
///
/// Raises `TypeError` for a tensor that is not a DLPack producer, `ValueError` for one not on a
/// CUDA device or for tensors on several devices, and `cuferry.Error` for what the crate
/// refuses (a name given twice, `__metadata__` as a name, a file that cannot be written).
#[pyfunction]
pub(crate) fn save<'py>(
    py: Python<'py>,
    path: PathBuf,
    tensors: Vec<(String, Bound<'py, PyAny>)>,
) -> PyResult<()> {
    // Every tensor's device, checked before anything is asked of a producer.
    let mut ordinal: Option<(usize, &str)> = None;
    for (name, tensor) in &tensors {
        let on = match tensor.cast::<Tensor>() {
            Ok(ours) => ours.get().ordinal(),
            Err(_) => producer_device(tensor, &format!("tensor '{name}'"))?,
        };
        match ordinal {
            None => ordinal = Some((on, name)),
            Some((first, first_name)) if first != on => {
                return Err(PyValueError::new_err(format!(
                    "tensor '{name}' is on CUDA device {on}, tensor '{first_name}' on device \
                     {first}: one save writes the tensors of one device"
                )));
            }
            Some(_) => {}
        }
    }
    let ordinal = ordinal.map_or(0, |(on, _)| on);
    let (engine, stream) = engine_and_stream(py, ordinal)?;
    let mut sources = Vec::with_capacity(tensors.len());
    for (name, tensor) in &tensors {
        let source = match tensor.cast::<Tensor>() {
            Ok(ours) => {
                let ours = ours.get();
                if !Arc::ptr_eq(ours.engine(), &engine) {
                    return Err(PyValueError::new_err(format!(
                        "tensor '{name}' belongs to another engine of device {ordinal} than \
                         the one this process now uses for it (made before \
                         cuferry._native._use_simulator() was called?)"
                    )));
                }
                Source::Ours(ours.borrow()?)
            }
            Err(_) => Source::Theirs(capsule_of(py, tensor, stream)?),
        };
        sources.push((name.clone(), source));
    }
    py.detach(move || -> Result<(), Failure> {
        let mut held = engines::lock(&engine)?;
        // The producers' tensors, taken in, in order; their capsules' deleters run when these
        // drop, after the save has read them.
        let mut taken: Vec<(String, Arc<AnyTensor>)> = Vec::with_capacity(sources.len());
        let mut sources = sources.into_iter();
        for (name, source) in sources.by_ref() {
            let tensor = match source {
                Source::Ours(tensor) => tensor,
                Source::Theirs(capsule) => {
                    match dlpack::import_any(
                        &mut held,
                        capsule,
                        Ready::OnEngineStream,
                        Strides::Copy,
                    ) {
                        Ok(tensor) => Arc::new(tensor),
                        Err(refused) => {
                            let error = match refused {
                                SubmitError::Rejected { error, .. }
                                | SubmitError::Failed { error, .. }
                                | SubmitError::Retained { error } => error,
                            };
                            return Err(Failure::About {
                                about: format!("tensor '{name}'"),
                                error,
                            });
                        }
                    }
                }
            };
            taken.push((name, tensor));
        }
        let named: Vec<(&str, &dyn SaveTensor)> = taken
            .iter()
            .map(|(name, tensor)| (name.as_str(), &**tensor as &dyn SaveTensor))
            .collect();
        checkpoint::save(&mut held, &named, &path)?;
        Ok(())
    })?;
    Ok(())
}
