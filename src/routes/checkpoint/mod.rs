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
mod index;
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

/// How far a load or a save has come: bytes done of bytes in all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// The bytes moved so far: for a load, those whose copy to the device is queued; for a
    /// save, those written to the file.
    pub done: u64,
    /// The bytes the load or save moves in all.
    pub total: u64,
}

/// Counts the bytes moved and reports each step.
pub(crate) struct Tally<'a> {
    done: u64,
    total: u64,
    report: &'a mut dyn FnMut(Progress),
}

impl<'a> Tally<'a> {
    pub(crate) fn new(total: u64, report: &'a mut dyn FnMut(Progress)) -> Self {
        Tally {
            done: 0,
            total,
            report,
        }
    }

    /// A tally that reports to no one.
    #[cfg(test)]
    pub(crate) fn silent() -> Tally<'static> {
        Tally {
            done: 0,
            total: 0,
            report: Box::leak(Box::new(|_| {})),
        }
    }

    pub(crate) fn add(&mut self, bytes: u64) {
        self.done += bytes;
        (self.report)(Progress {
            done: self.done,
            total: self.total,
        });
    }
}

/// What a load reads, and whom it tells how far it has come.
pub struct LoadOptions<'a> {
    select: Box<dyn FnMut(&str) -> bool + 'a>,
    progress: Box<dyn FnMut(Progress) + 'a>,
}

impl std::fmt::Debug for LoadOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions").finish_non_exhaustive()
    }
}

impl Default for LoadOptions<'_> {
    fn default() -> Self {
        LoadOptions {
            select: Box::new(|_| true),
            progress: Box::new(|_| {}),
        }
    }
}

impl<'a> LoadOptions<'a> {
    /// Every tensor, reporting to no one.
    pub fn new() -> Self {
        Self::default()
    }

    /// Loads only the tensors whose names `select` accepts: the others are neither allocated
    /// nor read.
    pub fn select(mut self, select: impl FnMut(&str) -> bool + 'a) -> Self {
        self.select = Box::new(select);
        self
    }

    /// Calls `progress` after each chunk's copy is queued, with the bytes done of the bytes
    /// selected.
    pub fn progress(mut self, progress: impl FnMut(Progress) + 'a) -> Self {
        self.progress = Box::new(progress);
        self
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

/// Loads every tensor of the safetensors checkpoint `path` onto `engine`: one file, or, for a
/// path ending in `.index.json`, the sharded set that index names.
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
/// [`CheckpointError`]), a `bool` tensor holding a byte other than 0 or 1, a file whose length
/// changed during the load, or an index that names a shard that is missing or lacks a tensor;
/// the engine's error when it cannot allocate, copy or prove a copy. Nothing is kept: the
/// tensors made so far are freed after their copies, and the staging slots return once theirs
/// are proven.
pub fn load(engine: &mut CudaEngine, path: impl AsRef<Path>) -> Result<Checkpoint> {
    load_with(engine, path, LoadOptions::default())
}

/// As [`load`], with a selection of the tensors and a progress report.
///
/// # Errors
/// As [`load`].
pub fn load_with(
    engine: &mut CudaEngine,
    path: impl AsRef<Path>,
    mut options: LoadOptions<'_>,
) -> Result<Checkpoint> {
    let path = path.as_ref();
    if path.to_string_lossy().ends_with(".index.json") {
        return index::load(engine, path, &mut options);
    }
    let file = open(path)?;
    let len = file_len(path, &file)?;
    load_from(engine, path, &file, len, options)
}

/// Opens `path` for reading.
fn open(path: &Path) -> Result<std::fs::File> {
    std::fs::File::open(path).map_err(|source| {
        CheckpointError::Io {
            path: path.to_owned(),
            operation: "open",
            source,
        }
        .into()
    })
}

/// The length of the open file `path`.
fn file_len(path: &Path, file: &std::fs::File) -> Result<u64> {
    Ok(file
        .metadata()
        .map_err(|source| CheckpointError::Io {
            path: path.to_owned(),
            operation: "stat",
            source,
        })?
        .len())
}

/// As [`load_with`], for one file read through `file` (`len` bytes long): a storage layer of
/// the caller's, or a file opened another way. `path` names it in errors.
///
/// # Errors
/// As [`load`].
pub fn load_from(
    engine: &mut CudaEngine,
    path: &Path,
    file: &dyn ReadAt,
    len: u64,
    mut options: LoadOptions<'_>,
) -> Result<Checkpoint> {
    let tensors = load::plan(path, file, len, &mut *options.select)?;
    let mut tally = Tally::new(load::plan_bytes(&tensors), &mut *options.progress);
    Ok(Checkpoint {
        tensors: load::load(engine, path, file, len, tensors, &mut tally)?,
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
    save_with(engine, path, tensors, SaveOptions::default())
}

/// Whom a save tells how far it has come.
pub struct SaveOptions<'a> {
    progress: Box<dyn FnMut(Progress) + 'a>,
}

impl std::fmt::Debug for SaveOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions").finish_non_exhaustive()
    }
}

impl Default for SaveOptions<'_> {
    fn default() -> Self {
        SaveOptions {
            progress: Box::new(|_| {}),
        }
    }
}

impl<'a> SaveOptions<'a> {
    /// Reporting to no one.
    pub fn new() -> Self {
        Self::default()
    }

    /// Calls `progress` after each chunk is written, with the bytes written of the bytes to
    /// write.
    pub fn progress(mut self, progress: impl FnMut(Progress) + 'a) -> Self {
        self.progress = Box::new(progress);
        self
    }
}

/// As [`save`], with a progress report.
///
/// # Errors
/// As [`save`].
pub fn save_with(
    engine: &mut CudaEngine,
    path: impl AsRef<Path>,
    tensors: &[(&str, &Tensor)],
    mut options: SaveOptions<'_>,
) -> Result<()> {
    save::save(engine, path.as_ref(), tensors, &mut *options.progress)
}
