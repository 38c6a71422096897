//! Saving a checkpoint: device → pinned staging → file, the writes overlapped with the
//! downloads, under a temporary name until the file is complete.
//!
//! The layout is the format's own serializer's: tensors sorted by descending alignment of their
//! element types, then by name, the header padded with spaces to a multiple of 8 bytes, so a file this writes is
//! byte for byte the file `safetensors::serialize` writes for the same tensors. The bytes move
//! through staging leases, as a load's do: a window of `ring_depth` leases, each downloading a
//! chunk, then, once its copy is proven, written at its place in the file by a positioned write.
//! The file is written under a temporary name of its own beside the final name (made with
//! `create_new`, `O_EXCL`: no file or link already there is followed, truncated or replaced),
//! flushed to the storage, and renamed over the final name only when every byte is there, then
//! the directory is flushed; so a failure never leaves a truncated checkpoint under the final
//! name (the temporary file is removed on every error), and two saves of one path at once each
//! write their own file, one of which ends under the name whole.

use super::{Done, Job, Progress, Staging, Tally, WriteAt, file_threads, header};
use crate::core::engine::CudaEngine;
use crate::dtype::DType;
use crate::error::{Error, IoError, MalformedError, Result, SubmitError};
use crate::lifecycle::lease::{Proven, StagingLease, Unproven, released};
use crate::memory::any_tensor::{AnyTensor, Visit};
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};

use std::sync::{Mutex, mpsc};

/// A device tensor a [`save`](crate::checkpoint::save) writes, borrowed: a
/// [`DeviceTensor<T>`] of any element type, or an [`AnyTensor`] (a checkpoint's tensors are).
///
/// A save takes its tensors as `&[(&str, &dyn SaveTensor)]`, so tensors of different element
/// types go in one list, each borrowed as it is, the way `safetensors::serialize` takes any
/// `View`: `checkpoint::save(&mut engine, &[("w", &w), ("b", &b)], path)` for a `w` of `f32`
/// and a `b` of `bf16` (each `&DeviceTensor<T>` coerces to `&dyn SaveTensor`). Sealed:
/// implemented for the crate's tensors only.
pub trait SaveTensor: sealed::Sealed {
    /// The element type, as the file names it.
    fn dtype(&self) -> DType;
    /// The shape, as the file gives it.
    fn shape(&self) -> &[usize];
}

pub(crate) mod sealed {
    use super::*;

    /// What a save asks of a tensor, beside its element type and shape.
    pub trait Sealed {
        /// The tensor's bytes in all.
        fn bytes_in_all(&self) -> usize;
        /// The bytes a chunk of the tensor is a multiple of: one element's.
        fn unit(&self) -> usize;
        /// Queues the download of `len` bytes from byte `at` of the tensor into `lease`
        /// (`at` and `len` multiples of [`unit`](Self::unit)).
        #[allow(clippy::result_large_err)]
        fn begin_bytes(
            &self,
            lease: StagingLease<Proven>,
            engine: &mut CudaEngine,
            at: usize,
            len: usize,
        ) -> std::result::Result<StagingLease<Unproven>, SubmitError<StagingLease<Proven>>>;
    }
}

impl<T: Element> SaveTensor for DeviceTensor<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }

    fn shape(&self) -> &[usize] {
        DeviceTensor::shape(self)
    }
}

impl<T: Element> sealed::Sealed for DeviceTensor<T> {
    fn bytes_in_all(&self) -> usize {
        self.byte_len()
    }

    fn unit(&self) -> usize {
        T::DTYPE.size_bytes()
    }

    fn begin_bytes(
        &self,
        lease: StagingLease<Proven>,
        engine: &mut CudaEngine,
        at: usize,
        len: usize,
    ) -> std::result::Result<StagingLease<Unproven>, SubmitError<StagingLease<Proven>>> {
        let size = T::DTYPE.size_bytes();
        lease.begin_download(engine, self, at / size, len / size)
    }
}

impl SaveTensor for AnyTensor {
    fn dtype(&self) -> DType {
        AnyTensor::dtype(self)
    }

    fn shape(&self) -> &[usize] {
        AnyTensor::shape(self)
    }
}

impl sealed::Sealed for AnyTensor {
    fn bytes_in_all(&self) -> usize {
        self.len() * self.dtype().size_bytes()
    }

    fn unit(&self) -> usize {
        self.dtype().size_bytes()
    }

    fn begin_bytes(
        &self,
        lease: StagingLease<Proven>,
        engine: &mut CudaEngine,
        at: usize,
        len: usize,
    ) -> std::result::Result<StagingLease<Unproven>, SubmitError<StagingLease<Proven>>> {
        /// The typed tensor's download.
        struct Begin<'a> {
            lease: StagingLease<Proven>,
            engine: &'a mut CudaEngine,
            at: usize,
            len: usize,
        }
        impl Visit for Begin<'_> {
            type Out =
                std::result::Result<StagingLease<Unproven>, SubmitError<StagingLease<Proven>>>;
            fn visit<T: Element>(self, tensor: &DeviceTensor<T>) -> Self::Out {
                sealed::Sealed::begin_bytes(tensor, self.lease, self.engine, self.at, self.len)
            }
        }
        self.visit(Begin {
            lease,
            engine,
            at,
            len,
        })
    }
}

/// The header bytes (padded) and each tensor's place, for `tensors` in the format's order.
fn layout(
    path: &Path,
    tensors: &mut [(String, &dyn SaveTensor)],
) -> Result<(Vec<u8>, Vec<u64>), Error> {
    // The format's order: its dtypes by descending alignment (its enum's order), then names.
    tensors.sort_by(|(ln, l), (rn, r)| {
        header::format_dtype(r.dtype())
            .cmp(&header::format_dtype(l.dtype()))
            .then(ln.cmp(rn))
    });
    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(tensors.len());
    let mut starts = Vec::with_capacity(tensors.len());
    for (name, t) in tensors.iter() {
        let n = t.bytes_in_all();
        infos.push((
            name.clone(),
            safetensors::tensor::TensorInfo {
                dtype: header::format_dtype(t.dtype()),
                shape: t.shape().to_vec(),
                data_offsets: (offset, offset + n),
            },
        ));
        starts.push(offset as u64);
        offset += n;
    }
    let bad = |reason: String| MalformedError::Header {
        path: path.to_owned(),
        tensor: None,
        reason,
    };
    let metadata =
        safetensors::tensor::Metadata::new(None, infos).map_err(|e| bad(e.to_string()))?;
    let mut json = serde_json::to_string(&metadata)
        .map_err(|e| bad(e.to_string()))?
        .into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    let data_start = out.len() as u64;
    Ok((out, starts.into_iter().map(|s| s + data_start).collect()))
}

/// The temporary files made so far by this process, for their names.
static TEMPORARIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The longest part of the final name a temporary name repeats, in bytes (a file name may be
/// 255 bytes; the rest of the temporary name takes at most 70).
const NAME_PART: usize = 128;

/// A name for a temporary file beside `path` that no other save (of this process or another)
/// picks: `.<file name>.<pid>.<n>.<stamp>.cuferry-partial`, `n` counting this process's
/// temporaries and `stamp` the clock's nanoseconds.
fn temporary_name(path: &Path) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let mut end = name.len().min(NAME_PART);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    let n = TEMPORARIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let pid = std::process::id();
    path.with_file_name(format!(
        ".{}.{pid}.{n}.{stamp:08x}.cuferry-partial",
        &name[..end]
    ))
}

/// Creates a temporary file beside `path`, under a name of its own, with `O_EXCL` (a file or a
/// link already under the name is neither followed nor truncated: another name is tried).
fn create_temporary(path: &Path) -> Result<(File, PathBuf), Error> {
    if path.file_name().is_none() {
        return Err(IoError::File {
            path: path.to_owned(),
            operation: "create",
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file"),
        }
        .into());
    }
    let mut tries = 0;
    loop {
        let name = temporary_name(path);
        let made = super::retry(|| {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&name)
        });
        match made {
            Ok(file) => return Ok((file, name)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 16 => tries += 1,
            Err(source) => {
                return Err(IoError::File {
                    path: name,
                    operation: "create",
                    source,
                }
                .into());
            }
        }
    }
}

/// Flushes the directory that holds `path`, so that a rename into it reaches the storage.
fn sync_directory(path: &Path) -> Result<(), Error> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    super::retry(|| File::open(dir))
        .and_then(|d| super::retry(|| d.sync_all()))
        .map_err(|source| {
            IoError::File {
                path: dir.to_owned(),
                operation: "flush the directory",
                source,
            }
            .into()
        })
}

/// Writes `tensors` (names with their tensors, of `engine`) to the safetensors file `path`.
///
/// # Errors
/// [`Error::Io`] when the file cannot be created, written, flushed or renamed (the partial file
/// is then removed, and nothing is left under `path`); [`Error::Malformed`] for a name given twice;
/// the engine's error when a download or its proof fails.
pub(crate) fn save(
    engine: &mut CudaEngine,
    tensors: &[(&str, &dyn SaveTensor)],
    path: &Path,
    staging: Staging,
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    let mut names = std::collections::HashSet::with_capacity(tensors.len());
    for (name, _) in tensors {
        if *name == header::METADATA_KEY {
            return Err(MalformedError::Header {
                path: path.to_owned(),
                tensor: Some((*name).to_owned()),
                reason: format!(
                    "{} is the format's name for its metadata, not a tensor's",
                    header::METADATA_KEY
                ),
            }
            .into());
        }
        if !names.insert(*name) {
            return Err(MalformedError::Header {
                path: path.to_owned(),
                tensor: Some((*name).to_owned()),
                reason: "the name is given twice".into(),
            }
            .into());
        }
    }
    let mut ordered: Vec<(String, &dyn SaveTensor)> =
        tensors.iter().map(|(n, t)| ((*n).to_owned(), *t)).collect();
    let (head, starts) = layout(path, &mut ordered)?;
    let (file, temporary) = create_temporary(path)?;
    let io = |operation: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| {
            Error::from(IoError::File {
                path,
                operation,
                source,
            })
        }
    };
    let total = ordered.iter().map(|(_, t)| t.bytes_in_all() as u64).sum();
    let mut tally = Tally::new(total, progress);
    // A panic of the download (the engine's) or of a writer removes the temporary file too.
    let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        write_all(
            engine, &file, &temporary, &head, &ordered, &starts, staging, &mut tally,
        )
        .and_then(|()| super::retry(|| file.sync_all()).map_err(io("flush", &temporary)))
    }));
    drop(file);
    let renamed = match written {
        Ok(written) => written.and_then(|()| {
            super::retry(|| std::fs::rename(&temporary, path)).map_err(io("rename", &temporary))
        }),
        Err(panic) => {
            let _ = std::fs::remove_file(&temporary);
            std::panic::resume_unwind(panic);
        }
    };
    if renamed.is_err() {
        let _ = std::fs::remove_file(&temporary);
        return renamed;
    }
    // The file is whole under its name; the directory's flush makes the name durable.
    sync_directory(path)
}

/// One chunk of the save: bytes `at..at + len` of item `item`, to file offset `offset`.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    item: usize,
    at: usize,
    len: usize,
    offset: u64,
}

/// Writes the header, then every tensor's bytes at its place.
#[allow(clippy::too_many_arguments)]
fn write_all(
    engine: &mut CudaEngine,
    file: &File,
    path: &Path,
    head: &[u8],
    tensors: &[(String, &dyn SaveTensor)],
    starts: &[u64],
    staging: Staging,
    tally: &mut Tally<'_>,
) -> Result<()> {
    write_exact_at(path, file, head, 0)?;
    let items: Vec<(&dyn SaveTensor, u64)> = tensors
        .iter()
        .zip(starts)
        .map(|((_, t), &start)| (*t, start))
        .collect();
    download(engine, path, file, &items, staging, tally)
}

/// Writes all of `bytes` at `offset` of `file` (`path` in errors).
pub(crate) fn write_exact_at(
    path: &Path,
    file: &dyn WriteAt,
    mut bytes: &[u8],
    mut offset: u64,
) -> Result<(), Error> {
    while !bytes.is_empty() {
        match file.write_at(bytes, offset) {
            Ok(0) => {
                let source = std::io::Error::from(std::io::ErrorKind::WriteZero);
                return Err(IoError::File {
                    path: path.to_owned(),
                    operation: "write",
                    source,
                }
                .into());
            }
            Ok(n) if n > bytes.len() => {
                return Err(header::overstated(path, "write", bytes.len(), n));
            }
            Ok(n) => {
                bytes = &bytes[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(IoError::File {
                    path: path.to_owned(),
                    operation: "write",
                    source,
                }
                .into());
            }
        }
    }
    Ok(())
}

/// Writes each of `items` (a tensor and the file offset of its first byte) to `file` through
/// `staging`: each chunk's download queued into a slot, and once proven written by one of the
/// writer threads, while the next downloads are in flight. Counts each chunk's bytes into
/// `tally` once written. Returns once every byte is written (not flushed).
///
/// # Errors
/// [`Error::Io`] for a failed write; the engine's error when a download or its proof
/// fails. The slots come back once their downloads are proven.
pub(crate) fn download(
    engine: &mut CudaEngine,
    path: &Path,
    file: &dyn WriteAt,
    items: &[(&dyn SaveTensor, u64)],
    staging: Staging,
    tally: &mut Tally<'_>,
) -> Result<()> {
    if items.iter().all(|(t, _)| t.bytes_in_all() == 0) {
        return Ok(());
    }
    let first = engine.route_lease()?;
    let capacity = first.capacity();
    let mut plan = Vec::new();
    for (i, &(t, start)) in items.iter().enumerate() {
        // Whole elements per chunk (a slot holds at least 4096 bytes, so at least one).
        let step = capacity - capacity % t.unit();
        let mut at = 0;
        while at < t.bytes_in_all() {
            let len = step.min(t.bytes_in_all() - at);
            plan.push(Chunk {
                item: i,
                at,
                len,
                offset: start + at as u64,
            });
            at += len;
        }
    }
    let mut slots = (staging.bytes / capacity).max(2);
    let threads = staging.threads.clamp(1, slots).min(plan.len());
    engine.reserve_route_slots(slots.min(plan.len()));
    let (jobs, queue) = mpsc::channel::<Job>();
    let queue = Mutex::new(queue);
    let (report, answers) = mpsc::channel::<Done>();
    let plan = &plan;
    let write = |i: usize, slot: &mut [u8]| {
        let chunk = &plan[i];
        write_exact_at(path, file, &slot[..chunk.len], chunk.offset)
    };
    std::thread::scope(|scope| {
        file_threads(scope, threads, &queue, &report, &write);
        drop(report);
        let mut free = vec![first];
        let mut made = 1;
        let mut writing = 0;
        let mut flying: VecDeque<(StagingLease<Unproven>, usize)> = VecDeque::new();
        let mut next = 0;
        let mut failure: Option<Error> = None;
        let mut panicked = None;
        loop {
            if failure.is_none() {
                // Downloads are queued while a slot can be had without waiting: an idle one,
                // or a new one while the budget allows.
                while next < plan.len() {
                    let lease = match free.pop() {
                        Some(lease) => lease,
                        None if made < slots => match engine.route_lease() {
                            Ok(lease) => {
                                made += 1;
                                lease
                            }
                            // Pinned memory ran out: the save goes on with the slots it has.
                            Err(_) => {
                                slots = made;
                                break;
                            }
                        },
                        None => break,
                    };
                    let chunk = plan[next];
                    let source = items[chunk.item].0;
                    match source.begin_bytes(lease, engine, chunk.at, chunk.len) {
                        Ok(unproven) => flying.push_back((unproven, next)),
                        Err(refused) => {
                            failure = Some(released(refused));
                            break;
                        }
                    }
                    next += 1;
                }
            }
            // The oldest download, once proven, goes to an idle writer.
            if failure.is_none()
                && writing < threads
                && let Some((unproven, i)) = flying.pop_front()
            {
                match unproven.end_chunk() {
                    Ok(lease) => {
                        if jobs.send((i, lease)).is_err() {
                            failure = Some(writers_gone(path));
                        } else {
                            writing += 1;
                        }
                    }
                    Err(error) => failure = Some(error),
                }
                continue;
            }
            if writing == 0 {
                break;
            }
            let Ok(((i, lease), written)) = answers.recv() else {
                failure.get_or_insert(writers_gone(path));
                break;
            };
            writing -= 1;
            free.push(lease);
            match written {
                Ok(Ok(())) => tally.add(plan[i].len as u64),
                Ok(Err(error)) => {
                    failure.get_or_insert(error);
                }
                Err(payload) => {
                    panicked.get_or_insert(payload);
                    failure.get_or_insert(writers_gone(path));
                }
            }
        }
        drop(jobs);
        if let Some(payload) = panicked {
            // The downloads in flight retire (their slots come back once proven); then the
            // writer's panic goes on to the caller.
            drop(flying);
            drop(free);
            std::panic::resume_unwind(payload);
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(()),
        }
    })
}

/// The error of a save whose writer threads ended early: one panicked, and its panic goes on
/// to the caller once the save has let go of its slots.
fn writers_gone(path: &Path) -> Error {
    IoError::File {
        path: path.to_owned(),
        operation: "write",
        source: std::io::Error::other("a writer thread panicked"),
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::super::load::tests::{checkpoint, engine, load_all};
    use super::*;
    use crate::driver::sim::SimOp;
    use crate::error::DriverError;

    /// Staging of four slots and two writers, so the writes run in parallel even on a machine
    /// of few cores.
    fn staging() -> Staging {
        Staging {
            bytes: 4 * 4096,
            threads: 2,
            given: true,
            direct: false,
        }
    }

    /// The checkpoint's tensors, loaded onto `engine`.
    fn loaded(engine: &mut CudaEngine) -> Vec<(String, AnyTensor)> {
        let (bytes, _) = checkpoint();
        load_all(engine, &&bytes[..], bytes.len() as u64).unwrap()
    }

    #[test]
    fn a_saved_file_is_byte_for_byte_the_formats_own_and_nothing_partial_is_left() {
        let (bytes, _) = checkpoint();
        let (mut engine, sim) = engine();
        let tensors = loaded(&mut engine);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let named: Vec<(&str, &dyn SaveTensor)> = tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t as &dyn SaveTensor))
            .collect();
        save(&mut engine, &named, &path, staging(), &mut |_| {}).unwrap();
        let written = std::fs::read(&path).unwrap();
        assert_eq!(
            written, bytes,
            "the format's serializer writes the same bytes"
        );
        let read = safetensors::SafeTensors::deserialize(&written).unwrap();
        assert_eq!(read.len(), 4);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["model.safetensors"], "no partial file left");
        drop(tensors);
        engine.synchronize().unwrap();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }

    #[test]
    fn a_name_given_twice_is_refused_before_any_file_is_made() {
        let (mut engine, _sim) = engine();
        let tensors = loaded(&mut engine);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let twice: [(&str, &dyn SaveTensor); 2] = [("a", &tensors[0].1), ("a", &tensors[1].1)];
        let err = save(&mut engine, &twice, &path, staging(), &mut |_| {}).unwrap_err();
        assert!(err.to_string().contains("'a'"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_fault_at_every_driver_call_of_the_save_leaves_no_file_and_loses_nothing() {
        const OPS: [SimOp; 5] = [
            SimOp::HostAlloc,
            SimOp::CopyDtoH,
            SimOp::EventCreate,
            SimOp::EventRecord,
            SimOp::EventSynchronize,
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let counts: Vec<u64> = {
            let (mut engine, sim) = engine();
            let tensors = loaded(&mut engine);
            let named: Vec<(&str, &dyn SaveTensor)> = tensors
                .iter()
                .map(|(n, t)| (n.as_str(), t as &dyn SaveTensor))
                .collect();
            let before: Vec<u64> = OPS.iter().map(|&op| sim.calls(op)).collect();
            save(&mut engine, &named, &path, staging(), &mut |_| {}).unwrap();
            std::fs::remove_file(&path).unwrap();
            OPS.iter()
                .zip(before)
                .map(|(&op, b)| sim.calls(op) - b)
                .collect()
        };
        let mut runs = 0;
        for (&op, &count) in OPS.iter().zip(&counts) {
            for n in 1..=count {
                let (mut engine, sim) = engine();
                let tensors = loaded(&mut engine);
                let named: Vec<(&str, &dyn SaveTensor)> = tensors
                    .iter()
                    .map(|(n, t)| (n.as_str(), t as &dyn SaveTensor))
                    .collect();
                sim.fail_nth(op, n, DriverError::LAUNCH_FAILED);
                match save(&mut engine, &named, &path, staging(), &mut |_| {}) {
                    Err(e) if !matches!(e, Error::Io(_) | Error::Malformed(_)) => {
                        let left = std::fs::read_dir(dir.path()).unwrap().count();
                        assert_eq!(left, 0, "{op:?} {n}: a file was left");
                    }
                    // A slot after the first that cannot be made: the save goes on with those
                    // it has, and the file is whole.
                    Ok(()) if op == SimOp::HostAlloc => {
                        assert_eq!(std::fs::read(&path).unwrap(), checkpoint().0, "{op:?} {n}");
                        std::fs::remove_file(&path).unwrap();
                    }
                    // A copy proven another way (a stream synchronize, when its event could not
                    // be recorded): the file is whole, and the failure is reported at the next
                    // boundary.
                    Ok(()) => {
                        assert_eq!(std::fs::read(&path).unwrap(), checkpoint().0, "{op:?} {n}");
                        assert!(engine.synchronize().is_err(), "{op:?} {n}: not reported");
                        std::fs::remove_file(&path).unwrap();
                    }
                    other => panic!("{op:?} call {n}: {other:?}"),
                }
                let _ = engine.synchronize();
                sim.clear_faults();
                save(&mut engine, &named, &path, staging(), &mut |_| {})
                    .expect("the engine saves again");
                assert_eq!(std::fs::read(&path).unwrap(), checkpoint().0);
                std::fs::remove_file(&path).unwrap();
                drop(named);
                drop(tensors);
                let retained = engine.retirement_stats().retained;
                drop(engine);
                assert!(sim.violations().is_empty(), "{:?}", sim.violations());
                if retained == 0 {
                    assert_eq!(sim.device_live().0, 0);
                    assert_eq!(sim.pinned_live().0, 0);
                }
                runs += 1;
            }
        }
        assert!(runs >= 8, "{runs} runs");
    }
}
