//! Checkpoint files in the safetensors format (feature `safetensors`): named device tensors
//! loaded from a file and saved to one, through pinned staging, with the bytes checked before
//! anything reaches the device.
//!
//! The module exists because a checkpoint is the transfer most GPU work waits on, and its input
//! is a file nobody has checked: every way a header can be wrong (a file shorter than it says, a
//! length beyond the file or any sane limit, text that is not UTF-8 or not JSON, an element type
//! the crate has no type for, a shape that does not fit its range, ranges that overlap or leave
//! the data, a name given twice) is a typed [`MalformedError`](crate::error::MalformedError) naming the file and the tensor,
//! found before any tensor is allocated on its word (a file of small tensors lands its data
//! while the header is checked, in memory sized by the file's length, freed again when the
//! header is bad). Reads go through [`ReadAt`], positioned
//! reads that several threads may issue at once on one open file, so that a test (or a storage
//! layer of the caller's) can stand in for the file.

mod crew;
mod header;
mod index;
mod landing;
mod load;
mod range;
mod save;
mod shared;
mod slice;

pub use range::{read_into, read_pending, write_from, write_returned};
pub use save::SaveTensor;
pub use shared::load_shared;
pub use slice::{Slice, TensorParallel};

use crate::core::engine::CudaEngine;
use crate::dtype::DType;
use crate::error::{Error, IoError, Result, UsageError};
use crate::memory::any_tensor::AnyTensor;
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use std::hash::BuildHasher;
use std::path::Path;
use std::sync::Arc;

/// Positioned reads: the bytes at an offset, without a cursor, so that one open file serves
/// several readers at once.
pub trait ReadAt: Sync {
    /// Reads up to `buf.len()` bytes at `offset` into `buf`, and returns how many were read;
    /// zero only at the end of the file (or for an empty `buf`).
    ///
    /// # Errors
    /// The operating system's, as [`std::io::Error`].
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize>;

    /// Reads the bytes at `offset` on into `bufs` in turn (the first buffer filled, then the
    /// next), and returns how many were read; zero only at the end of the file (or when every
    /// buffer is empty). Like [`read_at`](Self::read_at), it may read fewer than asked.
    ///
    /// A load reads runs of small tensors that follow each other in the file, each into a
    /// place of its own in a staging slot, with one such read. The default reads into the first
    /// buffer that is not empty, through `read_at`; a [`File`](std::fs::File) reads into all
    /// of them with one `preadv`.
    ///
    /// # Errors
    /// The operating system's, as [`std::io::Error`].
    fn read_vectored_at(
        &self,
        bufs: &mut [std::io::IoSliceMut<'_>],
        offset: u64,
    ) -> std::io::Result<usize> {
        let Some(buf) = bufs.iter_mut().find(|buf| !buf.is_empty()) else {
            return Ok(0);
        };
        let n = self.read_at(buf, offset)?;
        if n > buf.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a read of {} bytes said it read {n}", buf.len()),
            ));
        }
        Ok(n)
    }

    /// Another reader of the same bytes that shares no state with this one, for a thread of
    /// its own; `None` (the default) where there is none, and every thread reads through
    /// `self`.
    ///
    /// A load asks for one per thread where it reads many small runs (a slice of columns,
    /// packed small tensors). Threads that read one open file at once contend on its open file
    /// description, which the kernel takes a reference on for every read; a
    /// [`File`](std::fs::File) answers with the same file opened again, a description of its
    /// own (the checkpoint record measures the difference).
    fn reopen(&self) -> Option<Box<dyn ReadAt + '_>> {
        None
    }
}

impl ReadAt for std::fs::File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self, buf, offset)
    }

    /// One `preadv` into at most `IOV_MAX` of the buffers (the rest wait for the next call).
    fn read_vectored_at(
        &self,
        bufs: &mut [std::io::IoSliceMut<'_>],
        offset: u64,
    ) -> std::io::Result<usize> {
        use std::os::unix::io::AsRawFd;
        let offset = libc::off_t::try_from(offset).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "an offset past the largest a file can have",
            )
        })?;
        let count = bufs.len().min(IOV_MAX);
        // SAFETY: `IoSliceMut` is ABI-compatible with `iovec` on Unix (std's documented
        // guarantee), and each of the first `count` describes memory the caller lends mutably
        // for the call; the kernel writes at most their lengths into them. The descriptor is
        // this file's, open while `self` is borrowed.
        let read = unsafe {
            libc::preadv(
                self.as_raw_fd(),
                bufs.as_ptr().cast::<libc::iovec>(),
                count as libc::c_int,
                offset,
            )
        };
        // A negative count is the call's failure, in `errno`.
        usize::try_from(read).map_err(|_| std::io::Error::last_os_error())
    }

    /// The same file opened again through `/proc/self/fd`, which names the open file and not
    /// its path (a file renamed over the path since is not the one read), and only if it is a
    /// regular file (opening a pipe would wait for a writer) and the new descriptor's device
    /// and inode are this one's.
    fn reopen(&self) -> Option<Box<dyn ReadAt + '_>> {
        use std::os::unix::fs::MetadataExt;
        use std::os::unix::io::AsRawFd;
        let this = self.metadata().ok().filter(std::fs::Metadata::is_file)?;
        let again = std::fs::File::open(format!("/proc/self/fd/{}", self.as_raw_fd())).ok()?;
        let that = again.metadata().ok()?;
        (this.dev() == that.dev() && this.ino() == that.ino())
            .then(|| Box::new(again) as Box<dyn ReadAt>)
    }
}

/// The most buffers one `preadv` takes: Linux's `UIO_MAXIOV`, else the least POSIX allows.
#[cfg(target_os = "linux")]
const IOV_MAX: usize = libc::UIO_MAXIOV as usize;
#[cfg(not(target_os = "linux"))]
const IOV_MAX: usize = 16;

impl ReadAt for &[u8] {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let start = usize::try_from(offset).map_or(self.len(), |o| o.min(self.len()));
        let n = buf.len().min(self.len() - start);
        buf[..n].copy_from_slice(&self[start..start + n]);
        Ok(n)
    }
}

/// Positioned writes: bytes at an offset, without a cursor, so that several writers may write
/// one open file at once.
pub trait WriteAt: Sync {
    /// Writes up to `buf.len()` bytes of `buf` at `offset`, and returns how many were written.
    ///
    /// # Errors
    /// The operating system's, as [`std::io::Error`].
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<usize>;
}

impl WriteAt for std::fs::File {
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<usize> {
        std::os::unix::fs::FileExt::write_at(self, buf, offset)
    }
}

/// A job for a file thread: a chunk's index and the staging slot it reads into or writes from.
pub(crate) type Job = (
    usize,
    crate::lifecycle::lease::StagingLease<crate::lifecycle::lease::Proven>,
);

/// A file thread's answer: the job back, and how its read or write went (a panic of the
/// caller's reader or writer caught, so the route lets go of its slots before it rethrows it).
pub(crate) type Done = (Job, std::thread::Result<std::result::Result<(), Error>>);

/// Starts `threads` threads in `scope` that take jobs from `queue` until it closes, and answer
/// each on `report` with `work`'s result, until no one listens.
pub(crate) fn file_threads<'scope, W>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    threads: usize,
    queue: &'scope std::sync::Mutex<std::sync::mpsc::Receiver<Job>>,
    report: &std::sync::mpsc::Sender<Done>,
    work: &'scope W,
) where
    W: Fn(usize, &mut [u8]) -> std::result::Result<(), Error> + Sync,
{
    for _ in 0..threads {
        let report = report.clone();
        scope.spawn(move || {
            loop {
                // The lock is held only to take a job, never across a read or a write.
                let job = queue.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok((i, mut lease)) = job else { break };
                let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    work(i, lease.as_mut_bytes())
                }));
                if report.send(((i, lease), done)).is_err() {
                    break;
                }
            }
        });
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

/// The pinned staging a load or a save stages its bytes through, unless its options say
/// otherwise: 64 MiB (four slots of the engine's default 16 MiB chunk). More staging is
/// slower, not faster: the reads land in memory the processor's caches no longer hold when the
/// copy engines read it, and with the reader crew taking each slot's parts in turn, four slots
/// keep the copies busy (`docs/records/checkpoints.md` has the sweeps behind the figure).
pub const DEFAULT_STAGING_BYTES: usize = 64 << 20;

/// The reader threads a load runs, unless its options say otherwise: each slot's read is cut
/// into parts that the readers take in turn. A load of fewer than sixteen slots' worth runs
/// [`SMALL_LOAD_READERS`] instead (`docs/records/checkpoints.md` has the sweeps behind both).
pub const DEFAULT_READERS: usize = 16;

/// The reader threads a load of fewer than sixteen slots' worth runs, unless its options say
/// otherwise: its reads are few and short, and threads past eight cost it more to set going
/// than they read.
pub const SMALL_LOAD_READERS: usize = 8;

/// The writer threads a save runs, unless its options say otherwise.
pub const DEFAULT_WRITERS: usize = 16;

/// The most pinned staging a load or a save may be set to hold: 1 TiB (more than any host
/// can pin), so that no setting sizes a table past what memory can hold.
pub(crate) const MAX_STAGING_BYTES: usize = 1 << 40;

/// The most reader or writer threads a load or a save may be set to run.
pub(crate) const MAX_THREADS: usize = 256;

/// Runs `op` again for as long as the operating system answers `Interrupted` (a signal came
/// during the call): every open, stat, read, write, flush and rename of the checkpoint code
/// goes through it or through a loop of its own that does the same.
pub(crate) fn retry<T>(mut op: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    loop {
        match op() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            done => return done,
        }
    }
}

/// How a load or a save stages its bytes: at most `bytes` of pinned slots (the engine's
/// chunk size each, at least two), `threads` file threads (`given` by a setting, or the default,
/// which a load of a few slots' worth lowers to [`SMALL_LOAD_READERS`]), and for a load, direct
/// reads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Staging {
    pub(crate) bytes: usize,
    pub(crate) threads: usize,
    pub(crate) given: bool,
    pub(crate) direct: bool,
}

impl Staging {
    /// A load's defaults.
    pub(crate) fn load() -> Self {
        Staging {
            bytes: DEFAULT_STAGING_BYTES,
            threads: DEFAULT_READERS,
            given: false,
            direct: false,
        }
    }

    /// The reader threads a load runs: as given, or by default [`DEFAULT_READERS`], and
    /// [`SMALL_LOAD_READERS`] for a load of a few slots' worth (`few_slots`).
    pub(crate) fn readers(self, few_slots: bool) -> usize {
        if few_slots && !self.given {
            SMALL_LOAD_READERS
        } else {
            self.threads
        }
    }

    /// A save's defaults.
    pub(crate) fn save() -> Self {
        Staging {
            threads: DEFAULT_WRITERS,
            ..Staging::load()
        }
    }
}

impl Staging {
    /// Checks the settings' ranges.
    fn validate(self, threads: &'static str) -> Result<Self> {
        let bad = |setting, value, reason| {
            Err(UsageError::InvalidSetting {
                setting,
                value,
                reason,
            }
            .into())
        };
        if self.bytes == 0 || self.bytes > MAX_STAGING_BYTES {
            return bad(
                "staging_bytes",
                self.bytes,
                "must be between 1 and 1 TiB (1 << 40)",
            );
        }
        if self.threads == 0 || self.threads > MAX_THREADS {
            return bad(threads, self.threads, "must be between 1 and 256");
        }
        Ok(self)
    }
}

/// What a load asks of each tensor's element type: given its name and the file's type, the type
/// to load it as.
type Convert<'a> = dyn FnMut(&str, DType) -> DType + 'a;

/// What a load reads, how it stages the bytes, which element types it loads them as, and whom it
/// tells how far it has come.
pub struct LoadOptions<'a> {
    select: Box<dyn FnMut(&str) -> bool + 'a>,
    /// Whether `select` was given.
    selected: bool,
    slices: Box<slice::Slicer<'a>>,
    /// Whether `slices` was given.
    sliced: bool,
    progress: Box<dyn FnMut(Progress) + 'a>,
    convert: Box<Convert<'a>>,
    staging: Staging,
}

impl std::fmt::Debug for LoadOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("staging_bytes", &self.staging.bytes)
            .field("readers", &self.staging.threads)
            .field("direct_io", &self.staging.direct)
            .finish_non_exhaustive()
    }
}

impl Default for LoadOptions<'_> {
    fn default() -> Self {
        LoadOptions {
            select: Box::new(|_| true),
            selected: false,
            slices: Box::new(|_, _| Ok(Slice::Whole)),
            sliced: false,
            progress: Box::new(|_| {}),
            convert: Box::new(|_, dtype| dtype),
            staging: Staging::load(),
        }
    }
}

impl<'a> LoadOptions<'a> {
    /// Every tensor, reporting to no one, through the default staging.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the load takes every tensor whole: no selection, no slices.
    fn whole(&self) -> bool {
        !self.selected && !self.sliced
    }

    /// Loads only the tensors whose names `select` accepts: the others are neither allocated
    /// nor read.
    pub fn select(mut self, select: impl FnMut(&str) -> bool + 'a) -> Self {
        self.select = Box::new(select);
        self.selected = true;
        self
    }

    /// Takes of each selected tensor the part `slices` names for it, given its name and its
    /// shape in the file ([`Slice`]): whole, a range of rows, a range of columns, or nothing.
    /// Only the slice's bytes are read: a range of rows is one range of the file, a range of
    /// columns one positioned read per row (through the page cache, even with
    /// [`direct_io`](Self::direct_io)), and the pinned staging stays within
    /// [`staging_bytes`](Self::staging_bytes). The tensor handed out is the compact slice, of
    /// the file's element type (or [`convert`](Self::convert)'s). For the usual
    /// tensor-parallel split, see [`tensor_parallel`](Self::tensor_parallel).
    ///
    /// A load whose `slices` returns an error stops with it, before anything is allocated; a
    /// range past its dimension is [`UsageError::SliceOutOfRange`].
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use cuferry::sim::SimConfig;
    /// # use cuferry::{checkpoint, download_tensor, upload_tensor, CudaEngine};
    /// # let mut engine = CudaEngine::simulated(SimConfig::default());
    /// # let dir = tempfile::tempdir()?;
    /// # let path = dir.path().join("model.safetensors");
    /// # let w = upload_tensor(&mut engine, &[0f32, 1., 2., 3., 4., 5.], &[2, 3])?;
    /// # checkpoint::save(&mut engine, &[("w", &w)], &path)?;
    /// use checkpoint::{LoadOptions, Slice};
    /// // The last two columns of `w`, a [2, 3] tensor.
    /// let options = LoadOptions::new().slices(|_, _| Ok(Slice::Columns(1..3)));
    /// let mut loaded = checkpoint::load_with(&mut engine, &path, options)?;
    /// let w = loaded.take::<f32>("w")?;
    /// assert_eq!(w.shape(), [2, 2]);
    /// assert_eq!(download_tensor(&mut engine, &w)?, [1., 2., 4., 5.]);
    /// # Ok(()) }
    /// ```
    pub fn slices(mut self, slices: impl FnMut(&str, &[usize]) -> Result<Slice> + 'a) -> Self {
        self.slices = Box::new(slices);
        self.sliced = true;
        self
    }

    /// Takes this rank's share of each tensor as `plan` splits it ([`TensorParallel`]): the
    /// tensors its rules match by rows or by columns, the others whole.
    ///
    /// # Errors
    /// The load stops with [`UsageError::UnevenSplit`] for a split the world does not divide,
    /// unless the plan allows uneven ones.
    pub fn tensor_parallel(self, plan: TensorParallel) -> Self {
        self.slices(move |name, shape| plan.slice(name, shape))
    }

    /// Calls `progress` after each chunk's copy is queued, with the bytes done of the bytes
    /// selected. A landing that the header stops (see [`load`]) has counted from zero to
    /// where it stopped, and the load counts again from zero.
    pub fn progress(mut self, progress: impl FnMut(Progress) + 'a) -> Self {
        self.progress = Box::new(progress);
        self
    }

    /// Loads each tensor as the element type `convert` names for it (given its name and the
    /// file's element type): the file's bytes go to the device as they are, and a cast kernel
    /// queued on the engine's compute stream after the tensor's last copy converts them there,
    /// never on the host. The tensor of the file's type serves as the scratch buffer: it is
    /// freed, stream-ordered, once the cast has read it, so a converted tensor briefly holds
    /// both sizes of device memory. The tensor handed out carries the new type.
    ///
    /// Every pair of element types converts as [`CudaEngine::cast`] does (Rust's `as`; floats
    /// narrowed to `f16` or `bf16` round to nearest even, through `f32`).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use cuferry::sim::SimConfig;
    /// # use cuferry::{bf16, checkpoint, download_tensor, upload_tensor, CudaEngine, DType};
    /// # let mut engine = CudaEngine::simulated(SimConfig::default());
    /// # let dir = tempfile::tempdir()?;
    /// # let path = dir.path().join("model.safetensors");
    /// # let w = upload_tensor(&mut engine, &[0.5f32, 1.5, 2.5, 3.5], &[2, 2])?;
    /// # checkpoint::save(&mut engine, &[("w", &w)], &path)?;
    /// use checkpoint::LoadOptions;
    /// // The f32 weights of the file, as bf16 on the device.
    /// let options = LoadOptions::new().convert(|_, dtype| match dtype {
    ///     DType::F32 => DType::BF16,
    ///     other => other,
    /// });
    /// let mut loaded = checkpoint::load_with(&mut engine, &path, options)?;
    /// let w = loaded.take::<bf16>("w")?;
    /// assert_eq!(download_tensor(&mut engine, &w)?, [0.5, 1.5, 2.5, 3.5].map(bf16::from_f32));
    /// # Ok(()) }
    /// ```
    pub fn convert(mut self, convert: impl FnMut(&str, DType) -> DType + 'a) -> Self {
        self.convert = Box::new(convert);
        self
    }

    /// The most pinned staging memory the load holds: slots of the engine's
    /// [`chunk_bytes`](crate::staging::StagingConfig::chunk_bytes), as many as fit (two at
    /// least). Default [`DEFAULT_STAGING_BYTES`]. The slots are the engine's, kept once made, so
    /// a second load does not pay for them again. 1 byte to 1 TiB (`1 << 40`); zero or more is
    /// refused when the load starts.
    pub fn staging_bytes(mut self, bytes: usize) -> Self {
        self.staging.bytes = bytes;
        self
    }

    /// How many reader threads the load runs, each with one positioned read in flight: a crew
    /// started once for the load, which takes the parts of each staging slot's read (down to
    /// 16 KiB, at most one per reader) in the order the slots were handed out, so that the
    /// first slot is read, and its copy queued, before the next. No more threads are started
    /// than the file has parts. Default [`DEFAULT_READERS`], or [`SMALL_LOAD_READERS`] for a
    /// load of fewer than sixteen of the engine's slots' worth; 1 to 256, others refused when
    /// the load starts.
    pub fn readers(mut self, readers: usize) -> Self {
        self.staging.threads = readers;
        self.staging.given = true;
        self
    }

    /// Reads the file with `O_DIRECT`, bypassing the page cache: whole 4 KiB blocks straight
    /// into the pinned slots, for a file that is not in the cache and need not be kept there
    /// (a cold load). Where the file system refuses direct reads, or the file is not opened by
    /// the load (`load_from`), the reads go through the page cache. Default off.
    pub fn direct_io(mut self, direct: bool) -> Self {
        self.staging.direct = direct;
        self
    }
}

/// The tensors of a checkpoint, by name, in the order of their bytes in the file (the shards'
/// in the order the index first names them).
///
/// A name is looked up through a hash of the names, not a scan: [`get`](Self::get),
/// [`remove`](Self::remove) and [`take`](Self::take) cost the same in a checkpoint of any size.
#[derive(Debug, Default)]
pub struct Checkpoint {
    /// In file order; a tensor taken out leaves its place empty.
    tensors: Vec<Option<Held>>,
    /// The places in `tensors` of the tensors held, by a hash of their names (the names are
    /// `tensors`' own, not copies).
    by_name: hashbrown::HashTable<usize>,
    /// The names' hasher: keyed at random, so that no file can choose names that collide.
    hasher: std::hash::RandomState,
}

/// A tensor a checkpoint holds: its name, the tensor, and the file it came from (for errors).
#[derive(Debug)]
struct Held {
    name: String,
    tensor: AnyTensor,
    file: Arc<Path>,
}

impl Checkpoint {
    /// The place of the tensor named `name`, while the checkpoint holds it.
    fn place(&self, name: &str) -> Option<usize> {
        let hash = self.hasher.hash_one(name);
        let tensors = &self.tensors;
        let &at = self.by_name.find(hash, |&at| named(tensors, at, name))?;
        Some(at)
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&AnyTensor> {
        let at = self.place(name)?;
        self.tensors[at].as_ref().map(|h| &h.tensor)
    }

    /// Takes the tensor named `name` out of the checkpoint.
    pub fn remove(&mut self, name: &str) -> Option<AnyTensor> {
        let hash = self.hasher.hash_one(name);
        let tensors = &self.tensors;
        let (at, _) = (self.by_name)
            .find_entry(hash, |&at| named(tensors, at, name))
            .ok()?
            .remove();
        self.tensors[at].take().map(|h| h.tensor)
    }

    /// Takes the tensor named `name` out of the checkpoint as a `DeviceTensor<T>`, when `T` is
    /// its element type.
    ///
    /// # Errors
    /// [`UsageError::NoTensor`] when the checkpoint holds no tensor of that name;
    /// [`UsageError::StoredElementType`], naming the file, the tensor and both element types,
    /// when it holds another type. Either way the checkpoint is unchanged.
    pub fn take<T: Element>(&mut self, name: &str) -> Result<DeviceTensor<T>> {
        let Some(at) = self.place(name) else {
            return Err(UsageError::NoTensor {
                tensor: name.to_owned(),
            }
            .into());
        };
        let held = self.tensors[at].as_ref().expect("placed");
        let holds = held.tensor.dtype();
        if holds != T::DTYPE {
            return Err(UsageError::StoredElementType {
                path: held.file.to_path_buf(),
                tensor: name.to_owned(),
                asked: T::DTYPE,
                holds,
            }
            .into());
        }
        let tensor = self.remove(name).expect("placed");
        Ok(tensor
            .into_typed::<T>()
            .expect("the element type was checked"))
    }

    /// The names, in file order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.iter().map(|(n, _)| n)
    }

    /// The tensors with their names, in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &AnyTensor)> {
        self.tensors
            .iter()
            .flatten()
            .map(|h| (h.name.as_str(), &h.tensor))
    }

    /// The tensors with their names, in file order, as [`save`] takes them: a checkpoint
    /// saved again is `checkpoint::save(&mut engine, &loaded.named(), path)`.
    pub fn named(&self) -> Vec<(&str, &dyn SaveTensor)> {
        self.iter()
            .map(|(n, t)| (n, t as &dyn SaveTensor))
            .collect()
    }

    /// How many tensors it holds.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

impl IntoIterator for Checkpoint {
    type Item = (String, AnyTensor);
    type IntoIter = std::vec::IntoIter<(String, AnyTensor)>;

    fn into_iter(self) -> Self::IntoIter {
        let held: Vec<_> = self
            .tensors
            .into_iter()
            .flatten()
            .map(|h| (h.name, h.tensor))
            .collect();
        held.into_iter()
    }
}

/// Loads every tensor of the safetensors checkpoint `path` onto `engine`: one file, or, for a
/// path ending in `.index.json`, the sharded set that index names.
///
/// The header is read and checked first; then each tensor is allocated and its bytes travel
/// file → pinned staging → device: [`DEFAULT_READERS`] reader threads take the parts of each
/// staging slot's read in turn (slots of the engine's chunk size, [`DEFAULT_STAGING_BYTES`] of
/// them in all), each slot's copies queued as soon as its read is done and the slot read into
/// again once they are proven.
/// Tensors that follow each other in the file share a slot. Returns once every copy is
/// complete.
///
/// A file of small tensors (each at most 256 KiB, as norms and biases are) of fewer than
/// sixteen slots' worth, loaded whole, is landed instead: its data is read and copied to one
/// device allocation, as it lies in the file, while another thread checks the header, and each
/// tensor is then the part of that allocation at its place in the file (aligned to its
/// element). A header that names a large tensor, a `bool` one or one out of its element's
/// alignment stops the landing, and the file is loaded as above, its data read again.
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) naming the file for a file that cannot be opened or read;
/// [`Error::Malformed`](crate::Error::Malformed) naming the file (and the tensor, where one is at
/// fault) for a bad header (see [`MalformedError`](crate::error::MalformedError)), a `bool` tensor holding a byte other than 0 or 1, a file whose length
/// changed during the load, or an index that names a shard that is missing or lacks a tensor;
/// the engine's error when it cannot allocate, copy or prove a copy. Nothing is kept: the
/// tensors made so far are freed after their copies, and the staging slots return once theirs
/// are proven.
pub fn load(engine: &mut CudaEngine, path: impl AsRef<Path>) -> Result<Checkpoint> {
    load_with(engine, path, LoadOptions::default())
}

/// As [`load`], with a selection of the tensors, a progress report and the staging settings.
///
/// # Errors
/// As [`load`], and [`UsageError::InvalidSetting`] for a staging setting out of range.
pub fn load_with(
    engine: &mut CudaEngine,
    path: impl AsRef<Path>,
    options: LoadOptions<'_>,
) -> Result<Checkpoint> {
    Filling::filled_by(|planned, each| load_indexed(engine, path.as_ref(), options, planned, each))
}

/// As [`load_with`], handing each tensor to `each` as soon as every copy into it is queued,
/// while later tensors are still being read: the in-flight handoff.
///
/// `each` runs on the calling thread with the engine, so it can queue work on the tensor at
/// once; that work is ordered after the tensor's copies on the device (the engine's one
/// order), so a model's first layers can run while the rest of the file is still loading. The
/// tensors come in the order their last bytes are read, which with several readers need not be
/// file order. A tensor of no bytes comes first. A landed file's tensors (see [`load`]) come
/// together once every copy of its data is queued, in file order.
///
/// # Errors
/// As [`load_with`], and `each`'s error, which stops the load. The tensors already handed out
/// are the caller's; the others are freed after their copies.
pub fn load_each(
    engine: &mut CudaEngine,
    path: impl AsRef<Path>,
    options: LoadOptions<'_>,
    mut each: impl FnMut(&mut CudaEngine, String, AnyTensor) -> Result<()>,
) -> Result<()> {
    load_indexed(
        engine,
        path.as_ref(),
        options,
        &mut |_| {},
        &mut |engine, _, _, name, tensor| each(engine, name, tensor),
    )
}

/// What a load hands each tensor to: the engine, the tensor's place in the checkpoint's file
/// order, its file, its name and the tensor.
type Handoff<'e> =
    dyn FnMut(&mut CudaEngine, usize, &Arc<Path>, String, AnyTensor) -> Result<()> + 'e;

/// Whether the tensor at place `at` of `tensors` is held and named `name`.
fn named(tensors: &[Option<Held>], at: usize, name: &str) -> bool {
    tensors[at].as_ref().is_some_and(|h| h.name == name)
}

/// A checkpoint being filled by a load: each tensor put straight into its place in file order
/// as it is handed out, the names' table made once the load is done.
struct Filling {
    tensors: Vec<Option<Held>>,
}

impl Filling {
    /// Room for `places` tensors.
    fn new(places: usize) -> Filling {
        Filling {
            tensors: std::iter::repeat_with(|| None).take(places).collect(),
        }
    }

    /// The checkpoint `load` fills: it tells how many tensors it plans (the room made), then
    /// hands each out with its place.
    fn filled_by(
        load: impl FnOnce(&mut dyn FnMut(usize), &mut Handoff<'_>) -> Result<()>,
    ) -> Result<Checkpoint> {
        let filling = std::cell::RefCell::new(Filling::new(0));
        load(
            &mut |planned| *filling.borrow_mut() = Filling::new(planned),
            &mut |_, place, file, name, tensor| {
                filling.borrow_mut().put(place, file, name, tensor);
                Ok(())
            },
        )?;
        Ok(filling.into_inner().done())
    }

    /// Puts `tensor`, named `name`, from `file`, at `place`.
    ///
    /// # Panics
    /// When `place` lies outside the room made, or was given before: a load's places are
    /// `0..n`, each given once.
    fn put(&mut self, place: usize, file: &Arc<Path>, name: String, tensor: AnyTensor) {
        let at = &mut self.tensors[place];
        assert!(at.is_none(), "place {place} is given twice");
        *at = Some(Held {
            name,
            tensor,
            file: Arc::clone(file),
        });
    }

    /// The checkpoint, its names' table made.
    fn done(self) -> Checkpoint {
        let hasher = std::hash::RandomState::new();
        let tensors = self.tensors;
        let mut by_name = hashbrown::HashTable::with_capacity(tensors.len());
        for (at, held) in tensors.iter().enumerate() {
            let Some(held) = held else { continue };
            let hash = hasher.hash_one(held.name.as_str());
            // A load hands out each name once (a file or an index naming one twice is
            // refused); were one to come twice, the first would be the one found.
            if let hashbrown::hash_table::Entry::Vacant(vacant) = by_name.entry(
                hash,
                |&other| named(&tensors, other, &held.name),
                |&other| hasher.hash_one(tensors[other].as_ref().map_or("", |h| h.name.as_str())),
            ) {
                vacant.insert(at);
            }
        }
        Checkpoint {
            tensors,
            by_name,
            hasher,
        }
    }
}

/// Loads `path` (one file, or the shards of an index) through `options`, telling `planned`
/// how many tensors the plan holds before the first is handed out, and handing each tensor to
/// `each`.
fn load_indexed(
    engine: &mut CudaEngine,
    path: &Path,
    mut options: LoadOptions<'_>,
    planned: &mut dyn FnMut(usize),
    each: &mut Handoff<'_>,
) -> Result<()> {
    let staging = options.staging.validate("readers")?;
    if !is_index(path) {
        let shard = Shard::open(path, staging.direct)?;
        return load_file(engine, shard.source(), options, staging, planned, each);
    }
    let shards = plan_shards(path, &mut options, staging)?;
    planned(shards.iter().map(|s| s.tensors.len()).sum());
    let total = shards.iter().map(|s| load::plan_bytes(&s.tensors)).sum();
    let mut tally = Tally::new(total, &mut *options.progress);
    let convert = &mut *options.convert;
    let each = &mut |engine: &mut CudaEngine, i, file: &Arc<Path>, name: String, tensor| {
        let tensor = converted(engine, &mut *convert, &name, tensor)?;
        each(engine, i, file, name, tensor)
    };
    let mut base = 0;
    for shard in &shards {
        load_shard(
            engine,
            shard.source(),
            &shard.tensors,
            base,
            staging,
            &mut tally,
            each,
        )?;
        base += shard.tensors.len();
    }
    Ok(())
}

/// Whether `path` names the index of a sharded checkpoint.
fn is_index(path: &Path) -> bool {
    path.to_string_lossy().ends_with(".index.json")
}

/// Loads the one file `source` through `options`: landed when it is a file of small tensors
/// loaded whole ([`landing`]), else planned from its header and read tensor by tensor. Tells
/// `planned` how many tensors the plan holds before the first is handed out, and hands each
/// tensor to `each`.
fn load_file(
    engine: &mut CudaEngine,
    source: load::Source<'_>,
    options: LoadOptions<'_>,
    staging: Staging,
    planned: &mut dyn FnMut(usize),
    each: &mut Handoff<'_>,
) -> Result<()> {
    let whole = options.whole();
    let LoadOptions {
        mut select,
        mut slices,
        mut progress,
        mut convert,
        ..
    } = options;
    let file: Arc<Path> = source.path.into();
    let mut each = |engine: &mut CudaEngine, i, name: String, tensor| {
        let tensor = converted(engine, &mut *convert, &name, tensor)?;
        each(engine, i, &file, name, tensor)
    };
    let mut header = None;
    if whole {
        let landed = landing::load(
            engine,
            source,
            staging,
            &mut *progress,
            &mut *planned,
            &mut |engine, i, entry, tensor| each(engine, i, entry.name, tensor),
        )?;
        match landed {
            landing::Landing::Loaded => return Ok(()),
            landing::Landing::Declined(read) => header = Some(read),
            landing::Landing::Untried => {}
        }
    }
    let header = match header {
        Some(header) => header,
        None => header::read(source.path, source.file, source.len)?,
    };
    let tensors = header.tensors.into_iter().filter(|t| select(&t.name));
    let tensors = slice::apply(tensors.collect(), &mut *slices)?;
    planned(tensors.len());
    let mut tally = Tally::new(load::plan_bytes(&tensors), &mut *progress);
    load::load(
        engine,
        source,
        &tensors,
        staging,
        &mut tally,
        &mut |engine, i, tensor| each(engine, i, tensors[i].name.clone(), tensor),
    )
}

/// The files of a load of `path` (one file, or the shards of an index), each with its planned
/// tensors: those `options` selects, cut to the slices it names.
fn plan_shards(path: &Path, options: &mut LoadOptions<'_>, staging: Staging) -> Result<Vec<Shard>> {
    let mut shards = if is_index(path) {
        index::plan(path, &mut *options.select, staging.direct)?
    } else {
        let mut shard = Shard::open(path, staging.direct)?;
        shard.tensors = load::plan(path, &shard.file, shard.len, &mut *options.select)?;
        vec![shard]
    };
    for shard in &mut shards {
        let planned = std::mem::take(&mut shard.tensors);
        shard.tensors = slice::apply(planned, &mut *options.slices)?;
    }
    Ok(shards)
}

/// `tensor` as the element type `convert` names for it: itself when that is its own type, else
/// a new tensor that a cast kernel, queued on the compute stream after the tensor's copies,
/// fills; `tensor` is dropped (freed, stream-ordered, after the cast).
fn converted(
    engine: &mut CudaEngine,
    convert: &mut dyn FnMut(&str, DType) -> DType,
    name: &str,
    tensor: AnyTensor,
) -> Result<AnyTensor> {
    let to = convert(name, tensor.dtype());
    if to == tensor.dtype() {
        return Ok(tensor);
    }
    /// Casts the visited tensor to the element type `to`.
    struct CastTo<'e> {
        engine: &'e mut CudaEngine,
        to: DType,
    }
    impl crate::memory::any_tensor::Visit for CastTo<'_> {
        type Out = Result<AnyTensor>;
        fn visit<T: Element>(self, tensor: &DeviceTensor<T>) -> Result<AnyTensor> {
            let e = self.engine;
            match self.to {
                DType::F32 => e.cast::<f32>(tensor).map(AnyTensor::from),
                DType::F64 => e.cast::<f64>(tensor).map(AnyTensor::from),
                DType::F16 => e.cast::<half::f16>(tensor).map(AnyTensor::from),
                DType::BF16 => e.cast::<half::bf16>(tensor).map(AnyTensor::from),
                DType::I8 => e.cast::<i8>(tensor).map(AnyTensor::from),
                DType::I16 => e.cast::<i16>(tensor).map(AnyTensor::from),
                DType::I32 => e.cast::<i32>(tensor).map(AnyTensor::from),
                DType::I64 => e.cast::<i64>(tensor).map(AnyTensor::from),
                DType::U8 => e.cast::<u8>(tensor).map(AnyTensor::from),
                DType::U16 => e.cast::<u16>(tensor).map(AnyTensor::from),
                DType::U32 => e.cast::<u32>(tensor).map(AnyTensor::from),
                DType::U64 => e.cast::<u64>(tensor).map(AnyTensor::from),
                DType::Bool => e.cast::<bool>(tensor).map(AnyTensor::from),
            }
        }
    }
    tensor.visit(CastTo { engine, to })
}

/// One file of a load: its planned tensors, and the file opened for them.
pub(crate) struct Shard {
    pub(crate) path: std::path::PathBuf,
    pub(crate) file: std::fs::File,
    /// The file opened for direct reads, where they were asked for and the system allows them.
    pub(crate) direct: Option<std::fs::File>,
    pub(crate) len: u64,
    pub(crate) tensors: Vec<header::Entry>,
}

impl Shard {
    /// The file `path`, opened (and opened again for direct reads where `direct` asks for
    /// them and the system allows it), with no tensor planned yet.
    fn open(path: &Path, direct: bool) -> Result<Shard> {
        let file = open(path)?;
        let len = file_len(path, &file)?;
        Ok(Shard {
            path: path.to_owned(),
            direct: direct.then(|| open_direct(path)).flatten(),
            file,
            len,
            tensors: Vec::new(),
        })
    }

    /// Where a load of the shard reads.
    pub(crate) fn source(&self) -> load::Source<'_> {
        load::Source {
            path: &self.path,
            file: &self.file,
            direct: self.direct.as_ref(),
            len: self.len,
        }
    }
}

/// Loads the planned `tensors` of one file, handing each to `each` with its place (`base` on).
fn load_shard(
    engine: &mut CudaEngine,
    source: load::Source<'_>,
    tensors: &[header::Entry],
    base: usize,
    staging: Staging,
    tally: &mut Tally<'_>,
    each: &mut Handoff<'_>,
) -> Result<()> {
    let file: Arc<Path> = source.path.into();
    load::load(
        engine,
        source,
        tensors,
        staging,
        tally,
        &mut |engine, i, tensor| each(engine, base + i, &file, tensors[i].name.clone(), tensor),
    )
}

/// Opens `path` for reading with `O_DIRECT`, where the system has it and the file system
/// allows it.
pub(crate) fn open_direct(path: &Path) -> Option<std::fs::File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        retry(|| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT | libc::O_NONBLOCK)
                .open(path)
        })
        .ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        None
    }
}

/// Opens `path` for reading, without waiting: a FIFO or a device planted under the name
/// cannot hold the open (or a read) for ever (`O_NONBLOCK`, which changes nothing for a
/// regular file).
fn open(path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    retry(|| {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
    })
    .map_err(|source| {
        IoError::File {
            path: path.to_owned(),
            operation: "open",
            source,
        }
        .into()
    })
}

/// The length of the open file `path`.
fn file_len(path: &Path, file: &std::fs::File) -> Result<u64> {
    Ok(retry(|| file.metadata())
        .map_err(|source| IoError::File {
            path: path.to_owned(),
            operation: "stat",
            source,
        })?
        .len())
}

/// As [`load_with`], for one file read through `file` (`len` bytes long): a storage layer of
/// the caller's, or a file opened another way. `path` names it in errors. Direct reads do not
/// apply: the reads are `file`'s.
///
/// # Errors
/// As [`load_with`].
pub fn load_from(
    engine: &mut CudaEngine,
    path: &Path,
    file: &dyn ReadAt,
    len: u64,
    options: LoadOptions<'_>,
) -> Result<Checkpoint> {
    let staging = options.staging.validate("readers")?;
    let source = load::Source {
        path,
        file,
        direct: None,
        len,
    };
    Filling::filled_by(|planned, each| load_file(engine, source, options, staging, planned, each))
}

/// Writes `tensors` (names with tensors of `engine`, borrowed) to the safetensors file `path`,
/// in the format's own layout: the file is byte for byte what `safetensors::serialize` writes
/// for the same tensors. Source first, as every route: the tensors, then the file.
///
/// Each tensor is a [`SaveTensor`]: a `DeviceTensor<T>` of any element type, or a checkpoint's
/// [`AnyTensor`](crate::AnyTensor), so one list mixes them, each borrowed as it is:
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # use cuferry::sim::SimConfig;
/// # use cuferry::{bf16, checkpoint, upload_tensor, CudaEngine};
/// # let mut engine = CudaEngine::simulated(SimConfig::default());
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("model.safetensors");
/// let w = upload_tensor(&mut engine, &[0.5f32, 1.5, 2.5, 3.5], &[2, 2])?;
/// let b = upload_tensor(&mut engine, &[bf16::from_f32(1.0), bf16::from_f32(2.0)], &[2])?;
/// checkpoint::save(&mut engine, &[("w", &w), ("b", &b)], &path)?;
/// // Still the caller's:
/// let mut loaded = checkpoint::load(&mut engine, &path)?;
/// assert_eq!(loaded.take::<f32>("w")?.shape(), w.shape());
/// # Ok(()) }
/// ```
///
/// The bytes travel device → pinned staging → file: each chunk's download queued into a
/// staging slot of the engine's chunk size ([`DEFAULT_STAGING_BYTES`] of them in all), and
/// once proven written at its place by one of [`DEFAULT_WRITERS`] writer threads while the
/// next downloads are in flight. The file is written under a temporary name of its own beside
/// `path` (`.<name>.<pid>.<n>.<stamp>.cuferry-partial`, made with `O_EXCL`, so no file or link
/// already there is written through or replaced), flushed to the storage, renamed over `path`
/// only when complete, and the directory flushed. Two saves of one path at once each write
/// their own temporary file: `path` ends as the whole file of one of them.
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) when the file cannot be created, written, flushed or
/// renamed; [`Error::Malformed`](crate::Error::Malformed) for a name given twice, or for a tensor named `__metadata__` (the
/// format's name for its free-form metadata, which a load would refuse as a tensor); the
/// engine's error when a download or its proof fails. Either way nothing is left under `path`
/// (but where the directory cannot be flushed after the rename: the whole file is then under
/// `path`, its name perhaps not yet on the storage) and the temporary file is removed.
pub fn save(
    engine: &mut CudaEngine,
    tensors: &[(&str, &dyn SaveTensor)],
    path: impl AsRef<Path>,
) -> Result<()> {
    save_with(engine, tensors, path, SaveOptions::default())
}

/// Whom a save tells how far it has come, and how it stages the bytes.
pub struct SaveOptions<'a> {
    progress: Box<dyn FnMut(Progress) + 'a>,
    staging: Staging,
}

impl std::fmt::Debug for SaveOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions")
            .field("staging_bytes", &self.staging.bytes)
            .field("writers", &self.staging.threads)
            .finish_non_exhaustive()
    }
}

impl Default for SaveOptions<'_> {
    fn default() -> Self {
        SaveOptions {
            progress: Box::new(|_| {}),
            staging: Staging::save(),
        }
    }
}

impl<'a> SaveOptions<'a> {
    /// Reporting to no one, through the default staging.
    pub fn new() -> Self {
        Self::default()
    }

    /// Calls `progress` after each chunk is written, with the bytes written of the bytes to
    /// write.
    pub fn progress(mut self, progress: impl FnMut(Progress) + 'a) -> Self {
        self.progress = Box::new(progress);
        self
    }

    /// The most pinned staging memory the save holds, as
    /// [`LoadOptions::staging_bytes`] (1 byte to 1 TiB, others refused when the save starts).
    pub fn staging_bytes(mut self, bytes: usize) -> Self {
        self.staging.bytes = bytes;
        self
    }

    /// How many positioned writes the save keeps in flight, each on a thread of its own (at
    /// most one per staging slot). Default [`DEFAULT_WRITERS`]; 1 to 256, others refused when
    /// the save starts.
    pub fn writers(mut self, writers: usize) -> Self {
        self.staging.threads = writers;
        self
    }
}

/// As [`save`], with a progress report and the staging settings.
///
/// # Errors
/// As [`save`], and [`UsageError::InvalidSetting`] for a staging setting out of range.
pub fn save_with(
    engine: &mut CudaEngine,
    tensors: &[(&str, &dyn SaveTensor)],
    path: impl AsRef<Path>,
    mut options: SaveOptions<'_>,
) -> Result<()> {
    let staging = options.staging.validate("writers")?;
    save::save(
        engine,
        tensors,
        path.as_ref(),
        staging,
        &mut *options.progress,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{IoError, MalformedError};

    #[test]
    fn retry_runs_an_interrupted_call_again_and_passes_every_other_answer_on() {
        let mut calls = 0;
        let got = retry(|| {
            calls += 1;
            if calls < 4 {
                Err(std::io::ErrorKind::Interrupted.into())
            } else {
                Ok(calls)
            }
        });
        assert_eq!(got.unwrap(), 4);
        let mut calls = 0;
        let got: std::io::Result<()> = retry(|| {
            calls += 1;
            Err(std::io::ErrorKind::WouldBlock.into())
        });
        assert_eq!(got.unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
        assert_eq!(calls, 1, "another error is not retried");
    }

    #[test]
    fn a_filled_checkpoint_finds_each_name_at_its_place_and_forgets_those_taken_out() {
        let (mut engine, _sim) = load::tests::engine();
        let file: Arc<Path> = Path::new("m.safetensors").into();
        let names = ["b", "a", "c", "a", "d"];
        let mut filling = Filling::new(names.len());
        // Handed out in another order than the file's, as a load's readers may.
        for at in [3, 0, 4, 2, 1] {
            let tensor = engine.alloc_tensor::<u8>(&[at + 1]).unwrap();
            filling.put(at, &file, names[at].into(), tensor.into());
        }
        let mut loaded = filling.done();
        // A name given twice is found at its first place; both stay in file order.
        assert_eq!(loaded.len(), 4);
        assert_eq!(loaded.names().collect::<Vec<_>>(), names);
        let len = |c: &Checkpoint, n| c.get(n).map(|t| t.shape().to_vec());
        assert_eq!(len(&loaded, "b"), Some(vec![1]));
        assert_eq!(len(&loaded, "a"), Some(vec![2]));
        assert_eq!(len(&loaded, "d"), Some(vec![5]));
        assert_eq!(len(&loaded, "e"), None);
        let c = loaded.take::<u8>("c").unwrap();
        assert_eq!(c.shape(), &[3]);
        assert!(loaded.get("c").is_none());
        assert!(loaded.remove("c").is_none());
        assert_eq!(loaded.len(), 3);
        assert_eq!(loaded.remove("a").unwrap().shape(), &[2]);
        assert_eq!(len(&loaded, "b"), Some(vec![1]));
        assert_eq!(len(&loaded, "d"), Some(vec![5]));
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded.names().collect::<Vec<_>>(), ["b", "a", "d"]);
    }

    #[test]
    fn a_fifo_planted_as_a_checkpoint_does_not_hold_the_open() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("m.safetensors");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success(), "mkfifo");
        let (mut engine, _sim) = load::tests::engine();
        let err = load(&mut engine, &fifo).unwrap_err();
        assert!(
            matches!(err, crate::Error::Io(_) | crate::Error::Malformed(_)),
            "{err}"
        );
        let index = dir.path().join("m.safetensors.index.json");
        std::fs::rename(&fifo, &index).unwrap();
        let err = load(&mut engine, &index).unwrap_err();
        assert!(
            matches!(err, crate::Error::Io(_) | crate::Error::Malformed(_)),
            "{err}"
        );
    }

    #[test]
    fn a_file_reopened_for_a_thread_reads_the_open_file_not_what_its_path_names_now() {
        use std::os::unix::io::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, b"the file that was opened").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // Another file renamed over the path after the open.
        let other = dir.path().join("other");
        std::fs::write(&other, b"a file planted afterwards").unwrap();
        std::fs::rename(&other, &path).unwrap();
        let own = file.reopen().expect("a regular file opens again");
        let mut buf = [0u8; 24];
        header::read_exact_at(&path, &*own, 0, &mut buf).unwrap();
        assert_eq!(&buf, b"the file that was opened");
        // A pipe is no regular file: opening it again could wait for a writer.
        let (pipe, _writer) = std::io::pipe().unwrap();
        let pipe = std::fs::File::from(std::os::fd::OwnedFd::from(pipe));
        assert!(pipe.as_raw_fd() >= 0);
        assert!(pipe.reopen().is_none());
        // A reader of bytes in memory has no other reader to give.
        assert!((&buf[..]).reopen().is_none());
    }

    /// `bufs` over `places`, lent mutably for a read.
    fn slices(places: &mut [Vec<u8>]) -> Vec<std::io::IoSliceMut<'_>> {
        places
            .iter_mut()
            .map(|p| std::io::IoSliceMut::new(p))
            .collect()
    }

    #[test]
    fn a_file_reads_runs_into_many_places_with_one_call_and_all_of_them_in_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..4000u32).map(|i| (i * 7 + i / 256) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // Places of 0, 1, 2, ... bytes: one call fills them in turn.
        let mut places: Vec<Vec<u8>> = (0..40).map(|n| vec![0; n]).collect();
        let mut bufs = slices(&mut places);
        let n = file.read_vectored_at(&mut bufs, 100).unwrap();
        assert_eq!(n, (0..40).sum::<usize>());
        let got: Vec<u8> = places.concat();
        assert_eq!(got, bytes[100..100 + n]);
        // More places than one `preadv` takes: the exact read goes on until all are full.
        let mut places: Vec<Vec<u8>> = (0..IOV_MAX + 500).map(|_| vec![0; 2]).collect();
        let mut bufs = slices(&mut places);
        let first = file.read_vectored_at(&mut bufs, 0).unwrap();
        assert_eq!(first, 2 * IOV_MAX, "one call reads into IOV_MAX places");
        header::read_exact_vectored_at(&path, &file, 0, &mut bufs).unwrap();
        assert_eq!(places.concat(), bytes[..2 * (IOV_MAX + 500)]);
        // Past the end: short, and said to be, with the bytes it lacked.
        let mut places = vec![vec![0; 30], vec![0; 30]];
        let mut bufs = slices(&mut places);
        let short = header::read_exact_vectored_at(&path, &file, 3960, &mut bufs);
        assert!(
            matches!(
                short,
                Err(Error::Malformed(MalformedError::ShortRead {
                    offset: 4000,
                    missing: 20,
                    ..
                }))
            ),
            "{short:?}"
        );
        // An offset no file can have is refused, not wrapped.
        let mut places = vec![vec![0; 1]];
        let err = file
            .read_vectored_at(&mut slices(&mut places), u64::MAX)
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    }

    /// A reader of `bytes` that gives at most `most` bytes a call and is interrupted every
    /// third call.
    struct Trickle<'a> {
        bytes: &'a [u8],
        most: usize,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl ReadAt for Trickle<'_> {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            let call = self
                .calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if call % 3 == 2 {
                return Err(std::io::ErrorKind::Interrupted.into());
            }
            let take = buf.len().min(self.most);
            self.bytes.read_at(&mut buf[..take], offset)
        }
    }

    /// A reader that says it read one byte more than it was asked for, and wrote nothing;
    /// with `vectored`, its vectored reads say so too (else they are the default's).
    struct Liar {
        vectored: bool,
    }

    impl ReadAt for Liar {
        fn read_at(&self, buf: &mut [u8], _: u64) -> std::io::Result<usize> {
            Ok(buf.len() + 1)
        }

        fn read_vectored_at(
            &self,
            bufs: &mut [std::io::IoSliceMut<'_>],
            _: u64,
        ) -> std::io::Result<usize> {
            if !self.vectored {
                let Some(buf) = bufs.iter_mut().find(|b| !b.is_empty()) else {
                    return Ok(0);
                };
                return Ok(buf.len() + 1);
            }
            Ok(bufs.iter().map(|b| b.len()).sum::<usize>() + 1)
        }
    }

    #[test]
    fn exact_reads_go_on_through_short_and_interrupted_reads_and_refuse_a_reader_that_says_too_much()
     {
        let path = Path::new("trickle");
        let bytes: Vec<u8> = (0..=255).collect();
        for most in [1, 3, 7, 64] {
            let reader = Trickle {
                bytes: &bytes,
                most,
                calls: Default::default(),
            };
            let mut places: Vec<Vec<u8>> = [5, 0, 9, 1, 0, 30].map(|n| vec![0; n]).into();
            header::read_exact_vectored_at(path, &reader, 10, &mut slices(&mut places)).unwrap();
            assert_eq!(places.concat(), bytes[10..55], "at most {most} a call");
            let mut one = vec![0; 45];
            header::read_exact_at(path, &reader, 10, &mut one).unwrap();
            assert_eq!(one, bytes[10..55]);
        }
        // A reader that says it read more than it was asked for is an error, not a panic and
        // not bytes taken as read: through `read_at`, the default vectored read and a vectored
        // read of its own.
        let mut one = vec![0; 8];
        let said = header::read_exact_at(path, &Liar { vectored: false }, 0, &mut one);
        assert!(
            matches!(said, Err(Error::Io(IoError::File { .. }))),
            "{said:?}"
        );
        for vectored in [false, true] {
            let mut places = vec![vec![0; 8], vec![0; 8]];
            let liar = Liar { vectored };
            let said = header::read_exact_vectored_at(path, &liar, 0, &mut slices(&mut places));
            assert!(
                matches!(said, Err(Error::Io(IoError::File { .. }))),
                "{said:?}"
            );
        }
        // The default, through a reader whose `read_at` says too much, says so itself.
        struct OnlyReadAt(Liar);
        impl ReadAt for OnlyReadAt {
            fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
                self.0.read_at(buf, offset)
            }
        }
        let mut places = vec![vec![0; 8], vec![0; 8]];
        let err = OnlyReadAt(Liar { vectored: false })
            .read_vectored_at(&mut slices(&mut places), 0)
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_writer_that_says_it_wrote_more_than_it_was_given_is_an_error_not_a_panic() {
        struct Boaster;
        impl WriteAt for Boaster {
            fn write_at(&self, buf: &[u8], _: u64) -> std::io::Result<usize> {
                Ok(buf.len() + 1)
            }
        }
        let said = save::write_exact_at(Path::new("boast"), &Boaster, &[1, 2, 3], 0);
        assert!(
            matches!(
                said,
                Err(Error::Io(IoError::File {
                    operation: "write",
                    ..
                }))
            ),
            "{said:?}"
        );
    }
}
