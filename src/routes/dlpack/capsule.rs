//! [`Capsule`]: an owned DLPack managed tensor of either ABI, whose deleter runs exactly once.

use super::ffi::{DLManagedTensor, DLManagedTensorVersioned, DLTensor};
use crate::error::{Error, MalformedError, Result};
use std::ptr::NonNull;

/// An owned DLPack tensor: a `DLManagedTensorVersioned` (DLPack 1.x) or a legacy
/// `DLManagedTensor`, whose producer's deleter runs exactly once, when the capsule is dropped.
///
/// A capsule comes from a producer ([`from_versioned`](Self::from_versioned),
/// [`from_legacy`](Self::from_legacy)) or from this crate's exports, and goes to a consumer
/// ([`into_raw`](Self::into_raw), or this crate's imports). An import that refuses it hands it
/// back, so its deleter still runs once, when the caller drops it.
pub struct Capsule {
    raw: Raw,
}

#[derive(Clone, Copy)]
enum Raw {
    Versioned(NonNull<DLManagedTensorVersioned>),
    Legacy(NonNull<DLManagedTensor>),
}

/// A capsule's raw managed tensor, for a consumer that calls its deleter itself.
#[derive(Debug)]
pub enum RawCapsule {
    /// A DLPack 1.x managed tensor.
    Versioned(*mut DLManagedTensorVersioned),
    /// A legacy managed tensor.
    Legacy(*mut DLManagedTensor),
}

// SAFETY: a capsule is the sole owner of its managed tensor (the constructors' contract), and
// DLPack lets the deleter be called from any thread (the constructors' contract, which this
// crate's own exports keep).
unsafe impl Send for Capsule {}

impl std::fmt::Debug for Capsule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capsule")
            .field("versioned", &self.is_versioned())
            .field("read_only", &self.is_read_only())
            .finish_non_exhaustive()
    }
}

pub(super) fn capsule_error(field: &'static str, reason: impl Into<String>) -> Error {
    Error::Malformed(MalformedError::Capsule {
        field,
        reason: reason.into(),
    })
}

impl Capsule {
    /// Takes ownership of a DLPack 1.x managed tensor.
    ///
    /// # Errors
    /// [`MalformedError::Capsule`] when `managed` is null, or its major version is not 1 (its
    /// deleter, the one field every major version keeps in place, has then been called).
    ///
    /// # Safety
    /// `managed` is null or a live managed tensor that nothing else owns: its fields describe
    /// memory as DLPack says, and its deleter may be called once, from any thread, and frees it.
    pub unsafe fn from_versioned(managed: *mut DLManagedTensorVersioned) -> Result<Capsule> {
        let managed = NonNull::new(managed)
            .ok_or_else(|| capsule_error("managed tensor", "the pointer is null"))?;
        // SAFETY: the caller's contract: a live managed tensor; `version` is its first field in
        // every major version.
        let version = unsafe { (*managed.as_ptr()).version };
        let capsule = Capsule {
            raw: Raw::Versioned(managed),
        };
        if version.major != super::ffi::DLPACK_MAJOR_VERSION {
            drop(capsule); // the deleter, where every major version keeps it
            return Err(capsule_error(
                "version",
                format!(
                    "DLPack {}.{}, whose layout this crate does not know (it speaks 1.x)",
                    version.major, version.minor
                ),
            ));
        }
        Ok(capsule)
    }

    /// Takes ownership of a legacy (pre-1.0) managed tensor.
    ///
    /// # Errors
    /// [`MalformedError::Capsule`] when `managed` is null.
    ///
    /// # Safety
    /// As [`from_versioned`](Self::from_versioned).
    pub unsafe fn from_legacy(managed: *mut DLManagedTensor) -> Result<Capsule> {
        let managed = NonNull::new(managed)
            .ok_or_else(|| capsule_error("managed tensor", "the pointer is null"))?;
        Ok(Capsule {
            raw: Raw::Legacy(managed),
        })
    }

    /// Gives up ownership: the caller calls the deleter, once.
    pub fn into_raw(self) -> RawCapsule {
        let raw = self.raw;
        std::mem::forget(self);
        match raw {
            Raw::Versioned(m) => RawCapsule::Versioned(m.as_ptr()),
            Raw::Legacy(m) => RawCapsule::Legacy(m.as_ptr()),
        }
    }

    /// Whether it is a DLPack 1.x managed tensor.
    pub fn is_versioned(&self) -> bool {
        matches!(self.raw, Raw::Versioned(_))
    }

    /// Whether the producer flagged the tensor read-only (DLPack 1.x only).
    pub fn is_read_only(&self) -> bool {
        self.flags() & super::ffi::DLPACK_FLAG_BITMASK_READ_ONLY != 0
    }

    /// The flags (0 for a legacy tensor).
    pub(crate) fn flags(&self) -> u64 {
        match self.raw {
            // SAFETY: the managed tensor is live while the capsule owns it.
            Raw::Versioned(m) => unsafe { (*m.as_ptr()).flags },
            Raw::Legacy(_) => 0,
        }
    }

    /// The DLPack version it declares (`None` for a legacy tensor).
    pub fn version(&self) -> Option<(u32, u32)> {
        match self.raw {
            Raw::Versioned(m) => {
                // SAFETY: as in `flags`.
                let v = unsafe { (*m.as_ptr()).version };
                Some((v.major, v.minor))
            }
            Raw::Legacy(_) => None,
        }
    }

    /// The tensor it describes.
    pub(crate) fn tensor(&self) -> &DLTensor {
        match self.raw {
            // SAFETY: the managed tensor is live, and not written, while the capsule owns it.
            Raw::Versioned(m) => unsafe { &(*m.as_ptr()).dl_tensor },
            // SAFETY: as above.
            Raw::Legacy(m) => unsafe { &(*m.as_ptr()).dl_tensor },
        }
    }
}

impl Drop for Capsule {
    fn drop(&mut self) {
        match self.raw {
            Raw::Versioned(m) => {
                // SAFETY: the capsule owns the managed tensor; its deleter is called once, here.
                if let Some(deleter) = unsafe { (*m.as_ptr()).deleter } {
                    // SAFETY: the producer's deleter, with its own managed tensor, once.
                    unsafe { deleter(m.as_ptr()) };
                }
            }
            Raw::Legacy(m) => {
                // SAFETY: as above.
                if let Some(deleter) = unsafe { (*m.as_ptr()).deleter } {
                    // SAFETY: as above.
                    unsafe { deleter(m.as_ptr()) };
                }
            }
        }
    }
}
