//! How failures reach Python.
//!
//! - The crate's errors raise `cuferry.Error` (a `RuntimeError`) with the crate's message, which
//!   names the file and the tensor (`model.safetensors: bad header at tensor 'w': ...`), and a
//!   `kind` attribute naming the crate's variant (`"io"`, `"malformed"`, `"setup"`, `"usage"`,
//!   `"driver"`, `"device_fault"`, ...), so a caller can tell a bad file from a missing device
//!   without parsing the message. The crate's usage errors (what the caller passed, for example
//!   a tensor of another engine) raise `cuferry.UsageError`, a subclass of both `cuferry.Error`
//!   and `ValueError`.
//! - A device that cannot be opened is `cuferry.Error` of kind `"setup"` (or `"driver"`) whose
//!   message begins `cannot open CUDA device N: ` and goes on with the crate's reason (`no CUDA
//!   driver on this machine: ...`).
//! - What the Python caller passed wrong before anything reached the crate raises Python's own
//!   classes: `TypeError` for an argument of the wrong type, `ValueError` for a value out of
//!   range, `BufferError` for the DLPack protocol's refusals (a tensor exported already, a device
//!   or a copy the export cannot give).
//! - A load's callback that calls cuferry again raises `cuferry.UsageError` in the callback
//!   (the engine is held by the load that called it).

use pyo3::exceptions::{PyBufferError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

pyo3::create_exception!(
    cuferry,
    Error,
    PyRuntimeError,
    "A failure reported by the cuferry engine: its message is the crate's (naming the file and \
     the tensor where one is at fault), its `kind` attribute the crate's variant (\"io\", \
     \"malformed\", \"setup\", \"usage\", \"driver\", \"device_fault\", ...)."
);

/// `cuferry.UsageError`, made once per process.
static USAGE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `cuferry.UsageError`: `class UsageError(cuferry.Error, ValueError)`, for the crate's usage
/// errors. Made with `type()`, since a class of two bases cannot be declared through PyO3.
pub(crate) fn usage_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    USAGE_ERROR
        .get_or_try_init(py, || {
            let bases = PyTuple::new(py, [py.get_type::<Error>(), py.get_type::<PyValueError>()])?;
            let namespace = PyDict::new(py);
            namespace.set_item("__module__", "cuferry")?;
            namespace.set_item(
                "__doc__",
                "A call the cuferry engine refused because of what was passed (a tensor of \
                 another engine, a setting out of range): both a cuferry.Error and a ValueError.",
            )?;
            let made = py
                .get_type::<PyType>()
                .call1(("UsageError", bases, namespace))?;
            Ok(made.cast_into::<PyType>()?.unbind())
        })
        .map(|ty| ty.bind(py))
}

/// The `kind` of a crate error: its variant's name.
fn kind(error: &cuferry::Error) -> &'static str {
    use cuferry::Error as E;
    match error {
        E::Driver { .. } => "driver",
        E::OutOfMemory(_) => "out_of_memory",
        E::DeviceFault { .. } => "device_fault",
        E::Deferred { .. } => "deferred",
        E::Usage(_) => "usage",
        E::Setup(_) => "setup",
        E::Library(_) => "library",
        E::Program(_) => "program",
        E::Staging(_) => "staging",
        E::Io(_) => "io",
        E::Malformed(_) => "malformed",
        E::Peer(_) => "peer",
        _ => "other",
    }
}

/// A failure on its way to Python: made detached (it is `Send`), raised once attached.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The crate's error.
    Crate(cuferry::Error),
    /// The crate's error, with what it was about put first (`tensor 'w': `).
    About {
        /// What the error is about.
        about: String,
        /// The error.
        error: cuferry::Error,
    },
    /// A device that could not be opened.
    Open {
        /// Its ordinal.
        ordinal: usize,
        /// Why not.
        error: cuferry::Error,
    },
    /// A Python exception: a callback's, or one made attached.
    Py(PyErr),
    /// A thread that holds an engine asked for one: a load's callback called cuferry.
    Reentered,
    /// The DLPack protocol's refusal (`BufferError`).
    Buffer(String),
}

impl From<cuferry::Error> for Failure {
    fn from(error: cuferry::Error) -> Self {
        Failure::Crate(error)
    }
}

impl From<PyErr> for Failure {
    fn from(error: PyErr) -> Self {
        Failure::Py(error)
    }
}

impl From<Failure> for PyErr {
    fn from(failure: Failure) -> PyErr {
        Python::attach(|py| failure.into_py(py))
    }
}

impl Failure {
    /// The Python exception.
    pub(crate) fn into_py(self, py: Python<'_>) -> PyErr {
        match self {
            Failure::Crate(error) => crate_error(py, error.to_string(), &error),
            Failure::About { about, error } => crate_error(py, format!("{about}: {error}"), &error),
            Failure::Open { ordinal, error } => crate_error(
                py,
                format!("cannot open CUDA device {ordinal}: {error}"),
                &error,
            ),
            Failure::Py(error) => error,
            Failure::Reentered => usage(
                py,
                "cuferry was called from a select or progress callback of a load in progress, \
                 which holds the engine: callbacks must not call cuferry",
            ),
            Failure::Buffer(message) => PyBufferError::new_err(message),
        }
    }
}

/// `cuferry.Error` (or `cuferry.UsageError` for the crate's usage errors) with `message` and
/// the `kind` of `error`.
fn crate_error(py: Python<'_>, message: String, error: &cuferry::Error) -> PyErr {
    let kind = kind(error);
    let raised = if kind == "usage" {
        match usage_error_type(py) {
            Ok(ty) => PyErr::from_type(ty.clone(), message),
            Err(e) => return e,
        }
    } else {
        Error::new_err(message)
    };
    if let Err(e) = raised.value(py).setattr("kind", kind) {
        return e;
    }
    raised
}

/// `cuferry.UsageError` with `message`, of kind `"usage"`.
pub(crate) fn usage(py: Python<'_>, message: &str) -> PyErr {
    let raised = match usage_error_type(py) {
        Ok(ty) => PyErr::from_type(ty.clone(), message.to_owned()),
        Err(e) => return e,
    };
    if let Err(e) = raised.value(py).setattr("kind", "usage") {
        return e;
    }
    raised
}
