//! Checkpoint files in the safetensors format (feature `safetensors`): what a file holds, read
//! and checked before anything reaches the device.
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

use std::path::PathBuf;

/// Positioned reads: the bytes at an offset, without a cursor, so that one open file serves
/// several readers at once.
pub(crate) trait ReadAt: Sync {
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

/// What is wrong with a checkpoint file, named by its path (and its tensor, where one is at
/// fault).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum CheckpointError {
    /// The operating system refused an operation on the file.
    #[error("{path}: {operation} failed: {source}", path = path.display())]
    Io {
        path: PathBuf,
        operation: &'static str,
        source: std::io::Error,
    },
    /// A read came back short of what the file's length promised (the file shrank, or the
    /// storage under it failed quietly).
    #[error("{path}: a read at byte {offset} came back {missing} byte(s) short", path = path.display())]
    ShortRead {
        path: PathBuf,
        offset: u64,
        missing: usize,
    },
    /// The file is shorter than its header says it must be.
    #[error("{path}: {len} bytes long, shorter than the {needed} its header needs", path = path.display())]
    Truncated {
        path: PathBuf,
        needed: u64,
        len: u64,
    },
    /// The header's length is beyond the format's limit.
    #[error(
        "{path}: a header of {length} bytes, above the limit of {limit} (the file is {file_len} bytes)",
        path = path.display()
    )]
    HeaderLength {
        path: PathBuf,
        length: u64,
        limit: u64,
        file_len: u64,
    },
    /// The header is not what the format describes: not UTF-8, not JSON, a tensor entry that is
    /// not one, ranges that do not tile the data, a name given twice.
    #[error(
        "{path}: bad header{}: {reason}",
        tensor.as_ref().map(|t| format!(" at tensor '{t}'")).unwrap_or_default(),
        path = path.display()
    )]
    Header {
        path: PathBuf,
        tensor: Option<String>,
        reason: String,
    },
    /// A tensor's element type is one the crate has no type for (the 8-bit and sub-byte floats,
    /// the complex types), or one the format does not know.
    #[error("{path}: tensor '{tensor}' has element type {dtype}, which cuferry does not hold", path = path.display())]
    Dtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// The file's length changed while it was being read.
    #[error("{path}: {before} bytes long when the load began, {after} when it ended", path = path.display())]
    LengthChanged {
        path: PathBuf,
        before: u64,
        after: u64,
    },
    /// The data after the header is not as long as the header's ranges say.
    #[error(
        "{path}: the header describes {header_says} bytes of data, the file holds {file_holds}",
        path = path.display()
    )]
    DataLength {
        path: PathBuf,
        header_says: u64,
        file_holds: u64,
    },
}
