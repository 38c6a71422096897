//! Checkpoint files in the safetensors format (feature `safetensors`): named device tensors
//! loaded from a file and saved to one, through pinned staging, with the bytes checked before
//! anything reaches the device.
//!
//! The module exists because a checkpoint is the transfer most GPU work waits on, and its input
//! is a file nobody has checked: every way a header can be wrong (a file shorter than it says, a
//! length beyond the file or any sane limit, text that is not UTF-8 or not JSON, an element type
//! the crate has no type for, a shape that does not fit its range, ranges that overlap or leave
//! the data, a name given twice) is a typed [`CheckpointError`] naming the file and the tensor,
//! found before a byte of device memory is allocated. Reads go through [`ReadAt`], positioned
//! reads that several threads may issue at once on one open file, so that a test (or a storage
//! layer of the caller's) can stand in for the file.

mod header;
mod load;
mod save;

pub use load::Tensor;

use crate::core::engine::CudaEngine;
use crate::error::{CheckpointError, Result};
use std::path::Path;

/// Positioned reads: the bytes at an offset, without a cursor, so that one open file serves
/// several readers at once.
pub trait ReadAt: Sync {
    /// Reads up to `buf.len()` bytes at `offset` into `buf`, and returns how many were read;
    /// zero only at the end of the file (or for an empty `buf`).
    ///
    /// # Errors
    /// The operating system's, as [`std::io::Error`].
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize>;
}

impl ReadAt for std::fs::File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self, buf, offset)
    }
}

impl ReadAt for &[u8] {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let start = usize::try_from(offset).map_or(self.len(), |o| o.min(self.len()));
        let n = buf.len().min(self.len() - start);
        buf[..n].copy_from_slice(&self[start..start + n]);
        Ok(n)
    }
}

/// The tensors of a checkpoint, by name, in the order of their bytes in the file.
#[derive(Debug, Default)]
pub struct Checkpoint {
    tensors: Vec<(String, Tensor)>,
}

impl Checkpoint {
    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// Takes the tensor named `name` out of the checkpoint.
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        let at = self.tensors.iter().position(|(n, _)| n == name)?;
        Some(self.tensors.remove(at).1)
    }

    /// The names, in file order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|(n, _)| n.as_str())
    }

    /// The tensors with their names, in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.tensors.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// How many tensors it holds.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

impl IntoIterator for Checkpoint {
    type Item = (String, Tensor);
    type IntoIter = std::vec::IntoIter<(String, Tensor)>;

    fn into_iter(self) -> Self::IntoIter {
        self.tensors.into_iter()
    }
}

/// Loads every tensor of the safetensors file `path` onto `engine`.
///
/// The header is read and checked first; then each tensor is allocated and its bytes travel
/// file → pinned staging → device: positioned reads on threads of their own into the engine's
/// staging slots (at most `ring_depth` of them, of `chunk_bytes` each: the
/// [`StagingConfig`](crate::staging::StagingConfig)), each slot's copy queued as soon as its read
/// is done, and the next slots read meanwhile. Returns once every copy is complete.
///
/// # Errors
/// [`Error::Checkpoint`](crate::Error::Checkpoint) naming the file (and the tensor, where one
/// is at fault) for a file that cannot be opened or read, a bad header (see
/// [`CheckpointError`]), a `bool` tensor holding a byte other than 0 or 1, or a file whose
/// length changed during the load; the engine's error when it cannot allocate, copy or prove a
/// copy. Nothing is kept: the tensors made so far are freed after their copies, and the staging
/// slots return once theirs are proven.
pub fn load(engine: &mut CudaEngine, path: impl AsRef<Path>) -> Result<Checkpoint> {
    load_selected(engine, path, |_| true)
}

/// As [`load`], for the tensors whose names `select` accepts: the others are neither allocated
/// nor read.
///
/// # Errors
/// As [`load`].
pub fn load_selected(
    engine: &mut CudaEngine,
    path: impl AsRef<Path>,
    mut select: impl FnMut(&str) -> bool,
) -> Result<Checkpoint> {
    let path = path.as_ref();
    let io = |operation| {
        move |source| CheckpointError::Io {
            path: path.to_owned(),
            operation,
            source,
        }
    };
    let file = std::fs::File::open(path).map_err(io("open"))?;
    let len = file.metadata().map_err(io("stat"))?.len();
    load_from(engine, path, &file, len, &mut select)
}

/// As [`load_selected`], reading through `file` (`len` bytes long): a storage layer of the
/// caller's, or a file opened another way. `path` names it in errors.
///
/// # Errors
/// As [`load`].
pub fn load_from(
    engine: &mut CudaEngine,
    path: &Path,
    file: &dyn ReadAt,
    len: u64,
    select: &mut dyn FnMut(&str) -> bool,
) -> Result<Checkpoint> {
    Ok(Checkpoint {
        tensors: load::load(engine, path, file, len, select)?,
    })
}

/// Writes `tensors` (names with tensors of `engine`) to the safetensors file `path`, in the
/// format's own layout: the file is byte for byte what `safetensors::serialize` writes for the
/// same tensors.
///
/// The bytes travel device → pinned staging → file through the engine's staging slots, each
/// chunk written at its place once its download is proven, the next downloads in flight
/// meanwhile. The file is written as `<name>.partial` beside `path`, flushed to the storage and
/// renamed only when complete.
///
/// # Errors
/// [`Error::Checkpoint`](crate::Error::Checkpoint) when the file cannot be created, written,
/// flushed or renamed, or for a name given twice; the engine's error when a download or its
/// proof fails. Either way nothing is left under `path` and the partial file is removed.
pub fn save(
    engine: &mut CudaEngine,
    path: impl AsRef<Path>,
    tensors: &[(&str, &Tensor)],
) -> Result<()> {
    save::save(engine, path.as_ref(), tensors)
}
