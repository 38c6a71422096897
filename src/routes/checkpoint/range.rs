//! Byte ranges of a file to and from device tensors: the primitive under the checkpoint load
//! and save, for other file formats to be built on.
//!
//! The blocking routes stage through the engine's pinned slots exactly as a checkpoint load or
//! save does (positioned reads or writes on threads of their own, the DMA overlapped with
//! them). The pending routes move the bytes through a pinned buffer handed over by value: the
//! file side is host work done at the call (a read before the upload goes in flight) or after
//! the proof (a write once the download is [`Returned`]), and the device side is a
//! [`Pending`] like every other operation in flight.

// A refused pending read hands the buffer and the tensor back by value inside its error, as
// every pending route does.
#![allow(clippy::result_large_err)]

use super::header::{self, Entry};
use super::load::{self, Source, Targets};
use super::save::{self, write_exact_at};
use super::{DEFAULT_READERS, DEFAULT_WRITERS, ReadAt, Staging, Tally, WriteAt};
use crate::core::engine::CudaEngine;
use crate::dtype::DType;
use crate::error::{Error, MalformedError, Result, SubmitError, UsageError};
use crate::lifecycle::pending::{Pending, Returned};
use crate::memory::pinned::PinnedHostBuffer;
use crate::memory::tensor::DeviceTensor;
use crate::routes::host::pending::{Download, Upload, upload_pending};
use std::path::Path;

/// The one tensor of a range read.
struct One<'t>(&'t DeviceTensor<u8>);

impl Targets for One<'_> {
    fn target(&self, _: usize) -> &DeviceTensor<u8> {
        self.0
    }

    fn queued(&mut self, _: &mut CudaEngine, _: usize) -> Result<()> {
        Ok(())
    }
}

/// The file range `offset..offset + bytes` of `path`, refused where it passes `u64::MAX`.
fn range(path: &Path, offset: u64, bytes: usize) -> Result<u64> {
    offset.checked_add(bytes as u64).ok_or_else(|| {
        MalformedError::RangeOverflow {
            path: path.to_owned(),
            offset,
            bytes,
        }
        .into()
    })
}

/// Uploads the bytes of `file` at `offset..offset + tensor.len()` into `tensor`, through the
/// engine's pinned staging: a load's crew of [`DEFAULT_READERS`] reader threads takes the parts
/// of each slot's read in turn, and each slot's copy is queued as soon as its read is done. Returns once the copies are complete. `path` names the
/// file in errors.
///
/// # Errors
/// [`MalformedError::ShortRead`] when the file ends inside the range,
/// [`IoError::File`](crate::error::IoError::File) for a failed read, the engine's error when it cannot copy or prove a
/// copy (the tensor's contents are then unspecified); a tensor of another engine is refused
/// before anything is read.
pub fn read_into(
    engine: &mut CudaEngine,
    path: &Path,
    file: &dyn ReadAt,
    offset: u64,
    tensor: &mut DeviceTensor<u8>,
) -> Result<()> {
    tensor.check_engine(engine)?;
    let end = range(path, offset, tensor.len())?;
    let entries = [Entry {
        name: String::new(),
        dtype: DType::U8,
        shape: vec![tensor.len()],
        start: offset,
        end,
        runs: None,
    }];
    let source = Source {
        path,
        file,
        direct: None,
        len: end,
    };
    let mut report = |_| {};
    let mut tally = Tally::new(end - offset, &mut report);
    let mut one = One(tensor);
    load::upload(
        engine,
        source,
        &entries,
        Staging::load(),
        &mut tally,
        &mut one,
    )
}

/// Downloads `tensor` into `file` at `offset..offset + tensor.len()`, through the engine's
/// pinned staging: each chunk written by one of [`DEFAULT_WRITERS`] writer threads once its
/// download is proven, while the next downloads are in flight. Returns once every byte is
/// written (not flushed: [`File::sync_all`](std::fs::File::sync_all) is the caller's). `path`
/// names the file in errors.
///
/// # Errors
/// [`IoError::File`](crate::error::IoError::File) for a failed write (the range's contents are then unspecified); the
/// engine's error when a download or its proof fails; a tensor of another engine is refused
/// before anything is written.
pub fn write_from(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<u8>,
    path: &Path,
    file: &dyn WriteAt,
    offset: u64,
) -> Result<()> {
    tensor.check_engine(engine)?;
    let end = range(path, offset, tensor.len())?;
    let mut report = |_| {};
    let mut tally = Tally::new(end - offset, &mut report);
    save::download(
        engine,
        path,
        file,
        &[(tensor, offset)],
        Staging::save(),
        &mut tally,
    )
}

/// Reads `file` at `offset..offset + buffer.len()` into `buffer` (positioned reads on up to
/// [`DEFAULT_READERS`] threads), then queues its upload into `tensor` and returns the transfer
/// in flight: the [`Pending`] of [`upload_pending`], whose parts come back as
/// `(buffer, tensor)` once it is [`Returned`]. `path` names the file in errors.
///
/// # Errors
/// [`SubmitError::Rejected`] (both back, untouched) when the buffer's length is not the
/// tensor's, the tensor is of another engine or the range passes the largest file offset (a
/// buffer of another engine is refused the same way, after the read); [`SubmitError::Failed`] (both back) when the read
/// fails or the file ends inside the range ([`Error::Io`](crate::Error::Io), [`Error::Malformed`](crate::Error::Malformed)), or the driver refuses the
/// copy; [`SubmitError::Retained`] when the copy was queued but cannot be tracked.
// The full type is the documentation: what goes in flight, and what a refusal hands back.
#[allow(clippy::type_complexity)]
pub fn read_pending(
    engine: &mut CudaEngine,
    path: &Path,
    file: &dyn ReadAt,
    offset: u64,
    mut buffer: PinnedHostBuffer<u8>,
    tensor: DeviceTensor<u8>,
) -> Result<Pending<Upload<u8>>, SubmitError<(PinnedHostBuffer<u8>, DeviceTensor<u8>)>> {
    let refusal = if buffer.len() != tensor.len() {
        Some(Error::Usage(UsageError::LengthMismatch {
            what: "read_pending: the buffer for the tensor",
            expected: tensor.len(),
            found: buffer.len(),
            shape: None,
        }))
    } else {
        tensor
            .check_engine(engine)
            .and_then(|()| range(path, offset, buffer.len()).map(drop))
            .err()
    };
    if let Some(error) = refusal {
        return Err(SubmitError::Rejected {
            input: (buffer, tensor),
            error,
        });
    }
    if let Err(error) = read_parallel(path, file, offset, buffer.as_mut_slice()) {
        return Err(SubmitError::Failed {
            input: (buffer, tensor),
            error,
        });
    }
    upload_pending(engine, buffer, tensor)
}

/// Writes the buffer of a returned [`download_pending`](crate::download_pending) to `file` at
/// `offset..offset + len` (positioned writes on up to [`DEFAULT_WRITERS`] threads): the file
/// side of a pending download into a file, done once the device side is proven. `path` names
/// the file in errors.
///
/// # Errors
/// [`IoError::File`](crate::error::IoError::File) for a failed write.
pub fn write_returned(
    path: &Path,
    file: &dyn WriteAt,
    offset: u64,
    returned: &Pending<Download<u8>, Returned>,
) -> Result<()> {
    let bytes = returned.buffer().as_slice();
    range(path, offset, bytes.len())?;
    write_parallel(path, file, offset, bytes)
}

/// The size of the pieces a host-side read or write of `len` bytes splits into: at most
/// `threads` pieces, none smaller than 4 MiB (but the last).
fn piece(len: usize, threads: usize) -> usize {
    len.div_ceil(threads).max(4 << 20).max(1)
}

/// Reads `file` at `offset` into all of `buffer`, in pieces on threads of their own.
fn read_parallel(
    path: &Path,
    file: &dyn ReadAt,
    offset: u64,
    buffer: &mut [u8],
) -> Result<(), Error> {
    let piece = piece(buffer.len(), DEFAULT_READERS);
    let read = |(k, part): (usize, &mut [u8])| {
        header::read_exact_at(path, file, offset + (k * piece) as u64, part)
    };
    if buffer.len() <= piece {
        return read((0, buffer));
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = buffer
            .chunks_mut(piece)
            .enumerate()
            .map(|job| scope.spawn(move || read(job)))
            .collect();
        first_error(handles)
    })
}

/// Writes all of `bytes` to `file` at `offset`, in pieces on threads of their own.
fn write_parallel(path: &Path, file: &dyn WriteAt, offset: u64, bytes: &[u8]) -> Result<(), Error> {
    let piece = piece(bytes.len(), DEFAULT_WRITERS);
    let write =
        |(k, part): (usize, &[u8])| write_exact_at(path, file, part, offset + (k * piece) as u64);
    if bytes.len() <= piece {
        return write((0, bytes));
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = bytes
            .chunks(piece)
            .enumerate()
            .map(|job| scope.spawn(move || write(job)))
            .collect();
        first_error(handles)
    })
}

/// Joins every thread, rethrowing a panic, and gives the first error.
fn first_error(
    handles: Vec<std::thread::ScopedJoinHandle<'_, Result<(), Error>>>,
) -> Result<(), Error> {
    let mut first = Ok(());
    for handle in handles {
        let result = handle
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        if first.is_ok() {
            first = result;
        }
    }
    first
}
