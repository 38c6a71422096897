//! DLPack capsules as Python objects: the crate's [`Capsule`] wrapped in a `PyCapsule` for a
//! consumer, and a producer's `PyCapsule` taken as a [`Capsule`].
//!
//! The protocol (the Python array API's `__dlpack__`): a producer returns a `PyCapsule` named
//! `"dltensor_versioned"` (DLPack 1.x, `DLManagedTensorVersioned`) or `"dltensor"` (legacy,
//! `DLManagedTensor`). A consumer that takes the tensor renames the capsule
//! `"used_dltensor_versioned"` / `"used_dltensor"` and becomes the one that calls the managed
//! tensor's deleter. The capsule's own destructor calls the deleter only while the capsule still
//! has its original name, that is, when no consumer took it.

use cuferry::dlpack::ffi::{DLManagedTensor, DLManagedTensorVersioned};
use cuferry::dlpack::{Capsule, RawCapsule};
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;
use std::ffi::{CStr, c_void};

/// A DLPack 1.x capsule's name.
const VERSIONED: &CStr = c"dltensor_versioned";
/// A legacy capsule's name.
const LEGACY: &CStr = c"dltensor";
/// A DLPack 1.x capsule's name once a consumer took it.
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";
/// A legacy capsule's name once a consumer took it.
const USED_LEGACY: &CStr = c"used_dltensor";

/// Wraps `capsule` in a `PyCapsule` named for its ABI, whose destructor calls the managed
/// tensor's deleter unless a consumer took it.
pub(crate) fn to_python(py: Python<'_>, capsule: Capsule) -> PyResult<Bound<'_, PyAny>> {
    let (pointer, name, destructor): (*mut c_void, &CStr, ffi::PyCapsule_Destructor) =
        match capsule.into_raw() {
            RawCapsule::Versioned(m) => (m.cast(), VERSIONED, drop_versioned),
            RawCapsule::Legacy(m) => (m.cast(), LEGACY, drop_legacy),
        };
    // SAFETY: attached (`py`); `pointer` is a live managed tensor we own (from `into_raw`),
    // `name` a static string that outlives the capsule, and `destructor` matches the name's ABI.
    let made = unsafe { ffi::PyCapsule_New(pointer, name.as_ptr(), Some(destructor)) };
    if made.is_null() {
        // The capsule was not made, so the tensor is still ours to release.
        // SAFETY: `pointer` came from `into_raw` above, of the ABI `name` says, and nothing else
        // owns it; taking it back runs its deleter once, on drop.
        let back = unsafe {
            if name == VERSIONED {
                Capsule::from_versioned(pointer.cast())
            } else {
                Capsule::from_legacy(pointer.cast())
            }
        };
        drop(back);
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `made` is a new, non-null reference, which the `Bound` now owns.
    Ok(unsafe { Bound::from_owned_ptr(py, made) })
}

/// The destructor of a DLPack 1.x capsule made by [`to_python`].
///
/// # Safety
/// Python calls it, attached, with the capsule being destroyed.
unsafe extern "C" fn drop_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule (the caller's contract); `PyCapsule_IsValid` sets no
    // exception, and `PyCapsule_GetPointer` none either once the name is known to match.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            // Not taken by a consumer: the tensor is still the capsule's, released here, once.
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// The destructor of a legacy capsule made by [`to_python`].
///
/// # Safety
/// As [`drop_versioned`].
unsafe extern "C" fn drop_legacy(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `drop_versioned`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let managed =
                ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// Takes the managed tensor of a producer's capsule (what its `__dlpack__` returned): renames
/// the capsule "used", so its destructor no longer releases the tensor, and returns it as a
/// [`Capsule`], whose drop does.
///
/// # Errors
/// `TypeError` for an object that is not a capsule; `BufferError` for a capsule of another
/// name (not DLPack, or taken already); `cuferry.Error` (kind `"malformed"`) for a DLPack 1.x
/// capsule of another major version (its deleter has then run).
pub(crate) fn from_python(py: Python<'_>, object: &Bound<'_, PyAny>) -> PyResult<Capsule> {
    let Ok(capsule) = object.cast::<PyCapsule>() else {
        return Err(PyTypeError::new_err(format!(
            "__dlpack__ returned a {}, not a DLPack capsule",
            object.get_type().name()?
        )));
    };
    let raw = capsule.as_ptr();
    for (name, used, versioned) in [
        (VERSIONED, USED_VERSIONED, true),
        (LEGACY, USED_LEGACY, false),
    ] {
        // SAFETY: attached; `raw` is a live capsule (we hold a reference); `PyCapsule_IsValid`
        // sets no exception.
        if unsafe { ffi::PyCapsule_IsValid(raw, name.as_ptr()) } != 1 {
            continue;
        }
        // SAFETY: as above; the name matches, so no exception is set and the pointer is the
        // capsule's non-null managed tensor.
        let managed = unsafe { ffi::PyCapsule_GetPointer(raw, name.as_ptr()) };
        // Renamed first: once it is "used", its destructor leaves the tensor to us. Were the
        // renaming to fail, the producer would still own it, and we take nothing.
        // SAFETY: as above; `used` is a static string that outlives the capsule.
        if unsafe { ffi::PyCapsule_SetName(raw, used.as_ptr()) } != 0 {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: the producer's live managed tensor of the ABI the name says, which nothing
        // else owns now that the capsule is "used"; DLPack lets its deleter run on any thread.
        let taken = unsafe {
            if versioned {
                Capsule::from_versioned(managed.cast())
            } else {
                Capsule::from_legacy(managed.cast())
            }
        };
        return taken.map_err(|e| crate::errors::Failure::Crate(e).into_py(py));
    }
    // SAFETY: attached; `raw` is a live capsule; the name is null or a string the capsule keeps
    // while it lives, copied out at once.
    let name = unsafe {
        let name = ffi::PyCapsule_GetName(raw);
        if name.is_null() {
            ffi::PyErr_Clear();
            String::from("(no name)")
        } else {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        }
    };
    Err(PyBufferError::new_err(format!(
        "a capsule named {name:?} is not a DLPack tensor that can be taken (\"dltensor\" or \
         \"dltensor_versioned\"): a consumer took it already, or it is not DLPack"
    )))
}
