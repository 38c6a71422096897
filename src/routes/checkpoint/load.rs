//! Loading a checkpoint: file → pinned staging → device, with the reads split across threads
//! and the copies overlapped with them.
//!
//! The route is a composition of staging leases ([`StagingLease`]): each chunk of a tensor is
//! read (a positioned read, on a thread of its own) into a leased pinned slot, then queued as a
//! copy into the tensor, after which the lease is [`Unproven`] until its event proves the copy
//! done; only then is the slot read into again. A window of `ring_depth` leases (the engine's
//! [`StagingConfig`](crate::staging::StagingConfig)) bounds the pinned memory the load holds,
//! and half of it is read into while the other half is on the wire. Every failure (a read, a
//! copy, a proof) stops the load: the leases in flight retire into the engine (their slots come
//! back once their copies are proven, never before), the tensors made so far are dropped, which
//! frees them after their copies, and the error names the file (and the tensor, for bad data).

use super::header::{self, Entry, Header};
use super::{ReadAt, Tally};
use crate::core::engine::CudaEngine;
use crate::dtype::DType;
use crate::error::{CheckpointError, Error, Result, StagingError};
use crate::lifecycle::lease::{Proven, StagingLease, Unproven, released};
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use std::collections::VecDeque;
use std::path::Path;

/// A device tensor whose element type is known at run time, as a checkpoint holds it: its
/// bytes on the device, their element type and the tensor's shape.
///
/// [`into_typed`](Self::into_typed) gives the `DeviceTensor<T>` of its element type (checked);
/// `Tensor::from` makes one of any `DeviceTensor<T>`, for [`save`](crate::checkpoint::save).
#[derive(Debug)]
pub struct Tensor {
    bytes: DeviceTensor<u8>,
    dtype: DType,
    shape: Vec<usize>,
}

impl Tensor {
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The tensor's bytes, as the file held them.
    pub fn bytes(&self) -> &DeviceTensor<u8> {
        &self.bytes
    }

    /// The tensor as a `DeviceTensor<T>`, when `T` is its element type; the tensor back
    /// otherwise, unchanged.
    ///
    /// # Errors
    /// The tensor itself, when `T` is not its element type.
    pub fn into_typed<T: Element>(self) -> std::result::Result<DeviceTensor<T>, Tensor> {
        if T::DTYPE != self.dtype {
            return Err(self);
        }
        let Tensor { bytes, shape, .. } = self;
        // SAFETY: the bytes are a tensor of `T` (checked above) as the file held it, and the
        // load refused a `bool` tensor holding a byte other than 0 or 1 before copying it.
        let typed = unsafe { bytes.reinterpret::<T>(&shape) };
        Ok(typed.expect("the shape fills the bytes (checked by the header, or by `from`)"))
    }
}

impl<T: Element> From<DeviceTensor<T>> for Tensor {
    fn from(tensor: DeviceTensor<T>) -> Tensor {
        let shape = tensor.shape().to_vec();
        Tensor {
            bytes: tensor.into_bytes(),
            dtype: T::DTYPE,
            shape,
        }
    }
}

/// One chunk of the load: bytes `start..end` of the file into tensor `tensor` at byte `at`.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    tensor: usize,
    at: usize,
    start: u64,
    end: u64,
}

/// The chunks of `tensors`, each at most `capacity` bytes, in file order.
fn chunks(tensors: &[Entry], capacity: usize) -> Vec<Chunk> {
    let mut out = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let mut start = t.start;
        while start < t.end {
            let end = t.end.min(start + capacity as u64);
            out.push(Chunk {
                tensor: i,
                at: (start - t.start) as usize,
                start,
                end,
            });
            start = end;
        }
    }
    out
}

/// The tensors of the safetensors file `path` (read through `file`, `len` bytes long) that
/// `wanted` selects, in file order: its header, read and checked.
pub(crate) fn plan(
    path: &Path,
    file: &dyn ReadAt,
    len: u64,
    wanted: &mut dyn FnMut(&str) -> bool,
) -> Result<Vec<Entry>> {
    let Header { tensors, .. } = header::read(path, file, len)?;
    Ok(tensors.into_iter().filter(|t| wanted(&t.name)).collect())
}

/// The bytes a plan moves.
pub(crate) fn plan_bytes(tensors: &[Entry]) -> u64 {
    tensors.iter().map(|t| t.end - t.start).sum()
}

/// Loads the planned `tensors` of the file `path` (read through `file`, `len` bytes long) onto
/// `engine`, in file order, counting each chunk's bytes into `tally` once its copy is queued.
/// Returns once every copy is proven complete.
///
/// # Errors
/// [`Error::Checkpoint`] for a bad header, a failed or short read, a `bool` tensor holding a
/// byte other than 0 or 1, or a file whose length changed; the engine's error when it cannot
/// allocate, copy or prove a copy.
pub(crate) fn load(
    engine: &mut CudaEngine,
    path: &Path,
    file: &dyn ReadAt,
    len: u64,
    tensors: Vec<Entry>,
    tally: &mut Tally<'_>,
) -> Result<Vec<(String, Tensor)>> {
    let mut out: Vec<DeviceTensor<u8>> = Vec::with_capacity(tensors.len());
    for t in &tensors {
        out.push(engine.alloc_tensor::<u8>(&[(t.end - t.start) as usize])?);
    }
    let mut depth = engine.staging_config().ring_depth.max(2);
    let mut free: Vec<StagingLease<Proven>> = Vec::with_capacity(depth);
    free.push(engine.staging_lease()?);
    let capacity = free[0].capacity();
    let plan = chunks(&tensors, capacity);
    let group = (depth / 2).max(1);
    let mut flying: VecDeque<StagingLease<Unproven>> = VecDeque::with_capacity(depth);
    let mut next = 0;
    while next < plan.len() {
        // A proven slot per chunk: a new lease while the window has room, else the oldest
        // copy's, once proven.
        let want = group.min(depth).max(1).min(plan.len() - next);
        let mut leases = Vec::with_capacity(want);
        while leases.len() < want {
            if let Some(lease) = free.pop() {
                leases.push(lease);
                continue;
            }
            if flying.len() + leases.len() < depth {
                match engine.staging_lease() {
                    Ok(lease) => {
                        leases.push(lease);
                        continue;
                    }
                    // Slots the engine retained after earlier failures count against the
                    // budget: the window shrinks to what there is, if there is any.
                    Err(Error::Staging(StagingError::Exhausted { .. }))
                        if !flying.is_empty() || !leases.is_empty() =>
                    {
                        depth = flying.len() + leases.len();
                    }
                    Err(error) => return Err(error),
                }
            }
            match flying.pop_front() {
                Some(oldest) => leases.push(oldest.end_chunk()?),
                // The batch is as wide as the window: load it in the leases it has.
                None => break,
            }
        }
        let batch = &plan[next..next + leases.len()];
        next += batch.len();
        read_batch(path, file, &tensors, batch, &mut leases)?;
        for (lease, chunk) in leases.into_iter().zip(batch) {
            let tensor = &mut out[chunk.tensor];
            let bytes = (chunk.end - chunk.start) as usize;
            match lease.begin_upload(engine, tensor, chunk.at, bytes) {
                Ok(unproven) => {
                    flying.push_back(unproven);
                    tally.add(bytes as u64);
                }
                Err(refused) => return Err(released(refused)),
            }
        }
    }
    // The last copies are proven before the load returns, so their slots go back to the
    // engine's lease budget at once (a retired lease would hold its place there until the
    // engine next polls).
    for lease in flying {
        lease.end_chunk()?.release();
    }
    drop(free);
    let current = file_len(path, file, len)?;
    if current != len {
        return Err(CheckpointError::LengthChanged {
            path: path.to_owned(),
            before: len,
            after: current,
        }
        .into());
    }
    Ok(tensors
        .into_iter()
        .zip(out)
        .map(|(t, bytes)| {
            let tensor = Tensor {
                bytes,
                dtype: t.dtype,
                shape: t.shape,
            };
            (t.name, tensor)
        })
        .collect())
}

/// The file's length now, as the reader sees it: a read of one byte at `len - 1` and one at
/// `len` tell a file that shrank or grew from one that did not.
fn file_len(path: &Path, file: &dyn ReadAt, len: u64) -> Result<u64, CheckpointError> {
    let mut probe = [0u8; 1];
    let io = |source| CheckpointError::Io {
        path: path.to_owned(),
        operation: "read",
        source,
    };
    if len > 0 && file.read_at(&mut probe, len - 1).map_err(io)? == 0 {
        return Ok(len - 1);
    }
    Ok(len + file.read_at(&mut probe, len).map_err(io)? as u64)
}

/// Reads every chunk of `batch` into its lease's slot, one thread per chunk, and checks the
/// bytes of `bool` tensors.
fn read_batch(
    path: &Path,
    file: &dyn ReadAt,
    tensors: &[Entry],
    batch: &[Chunk],
    leases: &mut [StagingLease<Proven>],
) -> Result<(), CheckpointError> {
    let read = |chunk: &Chunk, slot: &mut [u8]| -> Result<(), CheckpointError> {
        let bytes = (chunk.end - chunk.start) as usize;
        header::read_exact_at(path, file, chunk.start, &mut slot[..bytes])?;
        let t = &tensors[chunk.tensor];
        if t.dtype == DType::Bool && slot[..bytes].iter().any(|&b| b > 1) {
            return Err(CheckpointError::Header {
                path: path.to_owned(),
                tensor: Some(t.name.clone()),
                reason: "a bool element is neither 0 nor 1".into(),
            });
        }
        Ok(())
    };
    if batch.len() == 1 {
        return read(&batch[0], leases[0].as_mut_bytes());
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = batch
            .iter()
            .zip(leases.iter_mut())
            .map(|(chunk, lease)| {
                let slot = lease.as_mut_bytes();
                scope.spawn(move || read(chunk, slot))
            })
            .collect();
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
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::driver::sim::{SimConfig, SimDevice, SimOp};
    use crate::error::DriverError;
    use crate::memory::ring::StagingConfig;
    use crate::routes::download_tensor;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A tensor as the tests expect it back: name, element type, shape, bytes.
    pub(in crate::routes::checkpoint) type Expected = (String, DType, Vec<usize>, Vec<u8>);

    /// A checkpoint written by the format's own serializer: four tensors of four element types,
    /// with distinct bytes, large enough to take several chunks of a small slot.
    pub(in crate::routes::checkpoint) fn checkpoint() -> (Vec<u8>, Vec<Expected>) {
        use safetensors::Dtype as F;
        let tensors: Vec<(F, Expected)> = vec![
            (
                F::F32,
                (
                    "w".into(),
                    DType::F32,
                    vec![64, 40],
                    (0..64 * 40 * 4).map(|i| (i * 7 % 251) as u8).collect(),
                ),
            ),
            (
                F::BF16,
                (
                    "b".into(),
                    DType::BF16,
                    vec![33],
                    (0..66).map(|i| (i * 3 % 256) as u8).collect(),
                ),
            ),
            (
                F::BOOL,
                (
                    "mask".into(),
                    DType::Bool,
                    vec![5, 3],
                    (0..15).map(|i| (i % 2) as u8).collect(),
                ),
            ),
            (
                F::I64,
                (
                    "step".into(),
                    DType::I64,
                    vec![],
                    42i64.to_le_bytes().to_vec(),
                ),
            ),
        ];
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(f, (n, _, s, d))| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*f, s.clone(), d).unwrap(),
                )
            })
            .collect();
        let bytes = safetensors::serialize(views, None::<HashMap<String, String>>).unwrap();
        let expect = tensors.into_iter().map(|(_, expected)| expected).collect();
        (bytes, expect)
    }

    /// An engine whose staging slots are small (so every tensor takes several chunks and every
    /// batch several threads).
    pub(in crate::routes::checkpoint) fn engine() -> (CudaEngine, SimDevice) {
        let mut engine = CudaEngine::simulated(SimConfig::default());
        let config = StagingConfig {
            chunk_bytes: 4096,
            cutoff_bytes: 1024,
            ring_depth: 4,
            ..StagingConfig::default()
        };
        engine.set_staging_config(config).unwrap();
        let sim = engine.sim().unwrap();
        (engine, sim)
    }

    pub(in crate::routes::checkpoint) fn load_all(
        engine: &mut CudaEngine,
        file: &dyn ReadAt,
        len: u64,
    ) -> Result<Vec<(String, Tensor)>> {
        let path = Path::new("model.safetensors");
        let tensors = plan(path, file, len, &mut |_| true)?;
        load(engine, path, file, len, tensors, &mut Tally::silent())
    }

    #[test]
    fn a_file_the_format_wrote_loads_bit_for_bit_in_chunks() {
        let (bytes, expect) = checkpoint();
        let (mut engine, sim) = engine();
        let loaded = load_all(&mut engine, &&bytes[..], bytes.len() as u64).unwrap();
        assert_eq!(loaded.len(), expect.len());
        for (name, dtype, shape, data) in &expect {
            let (_, t) = loaded.iter().find(|(n, _)| n == name).expect("loaded");
            assert_eq!((t.dtype(), t.shape()), (*dtype, shape.as_slice()), "{name}");
            assert_eq!(
                &download_tensor(&mut engine, t.bytes()).unwrap(),
                data,
                "{name}"
            );
        }
        // The typed view, checked: the right type converts, another comes back.
        let (_, w) = loaded.into_iter().find(|(n, _)| n == "w").unwrap();
        let w = w.into_typed::<f64>().expect_err("f32, not f64");
        let w = w.into_typed::<f32>().unwrap();
        assert_eq!(w.shape(), [64, 40]);
        let host = download_tensor(&mut engine, &w).unwrap();
        assert_eq!(host[1].to_le_bytes(), [28, 35, 42, 49]);
        drop(w);
        engine.synchronize().unwrap();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }

    #[test]
    fn only_the_selected_tensors_are_read_and_allocated() {
        let (bytes, _) = checkpoint();
        let (mut engine, sim) = engine();
        let reads = AtomicUsize::new(0);
        struct Counting<'a>(&'a [u8], &'a AtomicUsize);
        impl ReadAt for Counting<'_> {
            fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
                self.1.fetch_add(buf.len(), Ordering::Relaxed);
                self.0.read_at(buf, offset)
            }
        }
        let before = sim.device_live().0;
        let file = Counting(&bytes, &reads);
        let len = bytes.len() as u64;
        let path = Path::new("m");
        let tensors = plan(path, &file, len, &mut |n| n == "step").unwrap();
        let loaded = load(&mut engine, path, &file, len, tensors, &mut Tally::silent()).unwrap();
        assert_eq!(loaded.len(), 1);
        assert_eq!(
            download_tensor(&mut engine, loaded[0].1.bytes()).unwrap(),
            42i64.to_le_bytes()
        );
        assert_eq!(sim.device_live().0 - before, 1, "one tensor allocated");
        assert!(
            reads.load(Ordering::Relaxed) < 1000,
            "the other tensors' bytes were not read"
        );
    }

    /// A reader that fails, or comes back short, at its `n`-th read.
    struct Faulty<'a> {
        bytes: &'a [u8],
        fail_at: usize,
        short: bool,
        reads: AtomicUsize,
    }

    impl ReadAt for Faulty<'_> {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            if self.reads.fetch_add(1, Ordering::SeqCst) + 1 == self.fail_at {
                if self.short {
                    return Ok(0);
                }
                return Err(std::io::Error::other("injected"));
            }
            self.bytes.read_at(buf, offset)
        }
    }

    /// After a failed load: nothing freed under a copy, nothing left once the engine is gone,
    /// and the engine loads the file right.
    fn recovers(mut engine: CudaEngine, sim: &SimDevice, bytes: &[u8]) {
        let _ = engine.synchronize();
        sim.clear_faults();
        let again =
            load_all(&mut engine, &bytes, bytes.len() as u64).expect("the engine loads again");
        assert_eq!(again.len(), 4);
        drop(again);
        let retained = engine.retirement_stats().retained;
        drop(engine);
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        if retained == 0 {
            assert_eq!(sim.device_live().0, 0, "device memory left");
            assert_eq!(sim.pinned_live().0, 0, "pinned memory left");
        }
    }

    #[test]
    fn a_read_that_fails_or_comes_back_short_at_any_step_is_reported_and_loses_nothing() {
        let (bytes, _) = checkpoint();
        let reads = {
            let file = Faulty {
                bytes: &bytes,
                fail_at: 0,
                short: false,
                reads: AtomicUsize::new(0),
            };
            let (mut engine, _sim) = engine();
            load_all(&mut engine, &file, bytes.len() as u64).unwrap();
            file.reads.load(Ordering::SeqCst)
        };
        assert!(reads >= 8, "{reads} reads");
        for fail_at in 1..=reads {
            for short in [false, true] {
                let (mut engine, sim) = engine();
                let file = Faulty {
                    bytes: &bytes,
                    fail_at,
                    short,
                    reads: AtomicUsize::new(0),
                };
                match load_all(&mut engine, &file, bytes.len() as u64) {
                    // The last read asks past the end, where reading nothing is the truth.
                    Ok(_) if short && fail_at == reads => {}
                    Err(Error::Checkpoint(CheckpointError::Io { .. }))
                    | Err(Error::Checkpoint(CheckpointError::ShortRead { .. }))
                    | Err(Error::Checkpoint(CheckpointError::LengthChanged { .. })) => {}
                    other => panic!("read {fail_at} (short: {short}): {other:?}"),
                }
                recovers(engine, &sim, &bytes);
            }
        }
    }

    #[test]
    fn a_fault_at_every_driver_call_of_the_load_is_reported_and_loses_nothing() {
        let (bytes, _) = checkpoint();
        const OPS: [SimOp; 6] = [
            SimOp::Alloc,
            SimOp::HostAlloc,
            SimOp::CopyHtoD,
            SimOp::EventCreate,
            SimOp::EventRecord,
            SimOp::EventSynchronize,
        ];
        let counts: Vec<u64> = {
            let (mut engine, sim) = engine();
            let before: Vec<u64> = OPS.iter().map(|&op| sim.calls(op)).collect();
            load_all(&mut engine, &&bytes[..], bytes.len() as u64).unwrap();
            OPS.iter()
                .zip(before)
                .map(|(&op, b)| sim.calls(op) - b)
                .collect()
        };
        let mut runs = 0;
        for (&op, &count) in OPS.iter().zip(&counts) {
            for n in 1..=count {
                let (mut engine, sim) = engine();
                sim.fail_nth(op, n, DriverError::LAUNCH_FAILED);
                match load_all(&mut engine, &&bytes[..], bytes.len() as u64) {
                    Err(e) if !matches!(e, Error::Checkpoint(_)) => {}
                    other => panic!("{op:?} call {n}: {other:?}"),
                }
                recovers(engine, &sim, &bytes);
                runs += 1;
            }
        }
        assert!(runs > 20, "{runs} runs");
    }

    #[test]
    fn a_bool_byte_other_than_zero_or_one_is_refused_naming_the_tensor() {
        let (mut bytes, _) = checkpoint();
        // The mask's bytes follow w's and b's; flip one to 2.
        let header = header::read(Path::new("m"), &&bytes[..], bytes.len() as u64).unwrap();
        let mask = header.tensors.iter().find(|t| t.name == "mask").unwrap();
        bytes[mask.start as usize + 3] = 2;
        let (mut engine, sim) = engine();
        let err = load_all(&mut engine, &&bytes[..], bytes.len() as u64).unwrap_err();
        assert!(err.to_string().contains("'mask'"), "{err}");
        recovers(engine, &sim, &checkpoint().0);
    }
}
