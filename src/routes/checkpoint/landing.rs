//! A load of a file of small tensors: its data copied to the device while its header is parsed.
//!
//! A file of thousands of small tensors (norms, biases) spends a good part of its load on its
//! header: 2,000 entries take about half a millisecond to parse and check, as long as the
//! file's 64 MiB take to read from the page cache, and a load that plans first reads nothing
//! until the plan is made. Such a file is landed instead: its data (the bytes after the header)
//! is read and copied, as it lies in the file, into one device allocation (in sixteen chunks
//! through the load's staging and reader crew, as any load of a few slots' worth) while another
//! thread parses the header. Each tensor is then a part of that allocation at its place in the
//! file ([`Arena`]): nothing is copied twice.
//!
//! Whether to land is decided before the header is known, from what its prefix and the file's
//! length say: a load of the whole file (no selection, no slices) of fewer than sixteen slots'
//! worth, whose data could be small tensors only. Every tensor entry of a header takes at least
//! [`LEAST_ENTRY`] bytes, so a header of `n` bytes names at most `n / 50 + 1` tensors, and data
//! longer than that many small tensors holds a large one.
//!
//! Once the header is read and checked, the landed data serves when every tensor is small, none
//! is `bool` (whose bytes the host checks before they reach the device), and each starts at a
//! multiple of its element's size in the data (as the format's own writer lays them out), so
//! that every tensor is aligned to its element. Otherwise the allocation is dropped (freed
//! after its copies) and the file is loaded the usual way, from the header already read: its
//! data is read a second time.

use super::header::{self, Entry, Header};
use super::load::{self, PACK_MAX, Source, Targets};
use super::{Progress, Staging, Tally};
use crate::core::engine::CudaEngine;
use crate::dtype::DType;
use crate::error::{IoError, Result};
use crate::memory::any_tensor::AnyTensor;
use crate::memory::arena::{ALIGN, Arena};
use crate::memory::tensor::DeviceTensor;
use std::sync::atomic::{AtomicBool, Ordering};

/// The fewest bytes a tensor's entry in a header takes:
/// `"":{"dtype":"U8","shape":[],"data_offsets":[0,1]},`.
const LEAST_ENTRY: u64 = 50;

/// How a landing went.
pub(super) enum Landing {
    /// Every tensor was handed over.
    Loaded,
    /// The header, read and checked, names a tensor the landed data cannot serve: the file is
    /// to be loaded the usual way, from this header.
    Declined(Header),
    /// The file is not one to land (or its prefix is bad, which the usual load reports).
    Untried,
}

/// What a landed tensor is handed to: the engine, the tensor's place in file order, its entry
/// and the tensor.
pub(super) type Each<'e> = dyn FnMut(&mut CudaEngine, usize, Entry, AnyTensor) -> Result<()> + 'e;

/// Whether data of `data` bytes after a header of `header` bytes could be small tensors only.
fn could_be_small(header: u64, data: u64) -> bool {
    (header / LEAST_ENTRY + 1).saturating_mul(PACK_MAX as u64) >= data
}

/// Whether the landed data serves every tensor `header` names: see the module's doc.
fn serves(header: &Header) -> bool {
    header.tensors.iter().all(|t| {
        let size = t.dtype.size_bytes() as u64;
        t.dtype != DType::Bool
            && t.end - t.start <= PACK_MAX as u64
            && (t.start - header.data_start).is_multiple_of(size)
    })
}

/// The landed data: one target, filled by the copies of the data's one entry, until the
/// header says the data cannot serve (`stop`).
struct Data<'t> {
    tensor: &'t DeviceTensor<u8>,
    stop: &'t AtomicBool,
    path: &'t std::path::Path,
}

impl Targets for Data<'_> {
    fn target(&self, _: usize) -> &DeviceTensor<u8> {
        self.tensor
    }

    fn queued(&mut self, _: &mut CudaEngine, _: usize) -> Result<()> {
        Ok(())
    }

    fn proceed(&self) -> Result<()> {
        if !self.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        // Never reported: the header's verdict is, once it is known.
        Err(IoError::File {
            path: self.path.to_owned(),
            operation: "land",
            source: std::io::Error::other("the header names a tensor the landed data cannot serve"),
        }
        .into())
    }
}

/// Lands the data of `source` when it is a file to land (see the module's doc), telling
/// `planned` how many tensors the header names and handing each tensor to `each` once every
/// copy is proven complete: those of no bytes first, then the others in file order.
/// `progress` hears of each chunk's copy, out of the data's bytes.
///
/// # Errors
/// The header's error, when it is malformed (before any other); a read's, a copy's or a
/// proof's; a file whose length changed; `each`'s. The landed allocation is freed after its
/// copies and the tensors already handed out are the caller's.
pub(super) fn load(
    engine: &mut CudaEngine,
    source: Source<'_>,
    staging: Staging,
    progress: &mut dyn FnMut(Progress),
    planned: &mut dyn FnMut(usize),
    each: &mut Each<'_>,
) -> Result<Landing> {
    let Some(data_start) = header::data_start(source.path, source.file, source.len) else {
        return Ok(Landing::Untried);
    };
    let data = source.len - data_start;
    let capacity = engine.staging_config().chunk_bytes;
    if data == 0
        || !load::few_slots(capacity, data)
        || !could_be_small(data_start - header::PREFIX, data)
    {
        return Ok(Landing::Untried);
    }
    // Fewer bytes than sixteen slots: a `usize`.
    let bytes = data as usize;
    // The data from byte `ALIGN` of the allocation on, so that no tensor sits at the
    // allocation's own address, where the arena folds the uses of its parts.
    let arena = Arena::new(engine.alloc_tensor::<u8>(&[ALIGN + bytes])?);
    // SAFETY: the whole allocation, held until the load ends so that the arena outlives the
    // making of its parts; never handed out.
    let whole = unsafe { arena.part(0, ALIGN + bytes) };
    // SAFETY: the data's bytes, only the target of the copies, and dropped before any tensor
    // is made of them.
    let landing = unsafe { arena.part(ALIGN, bytes) };
    let entry = Entry {
        name: String::new(),
        dtype: DType::U8,
        shape: vec![bytes],
        start: data_start,
        end: source.len,
        runs: None,
    };
    // Set once the header is known to be bad, or to name a tensor the landed data cannot
    // serve: the landing stops then, rather than read on.
    let stop = AtomicBool::new(false);
    let read = || {
        let header = header::read(source.path, source.file, source.len);
        if !header.as_ref().is_ok_and(serves) {
            stop.store(true, Ordering::Release);
        }
        header
    };
    let (header, landed) = std::thread::scope(|scope| {
        let parse = std::thread::Builder::new()
            .name("cuferry-header".into())
            .spawn_scoped(scope, read);
        let mut tally = Tally::new(data, progress);
        let mut target = Data {
            tensor: &landing,
            stop: &stop,
            path: source.path,
        };
        let landed = load::upload(
            engine,
            source,
            std::slice::from_ref(&entry),
            staging,
            &mut tally,
            &mut target,
        );
        let header = match parse {
            Ok(parse) => parse
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            // No thread to be had: the header is read now.
            Err(_) => read(),
        };
        (header, landed)
    });
    // A malformed header is what the usual load would report, before any read of the data;
    // a header the data cannot serve sends the load the usual way, whatever the landing met
    // (it may have been stopped for it).
    let header = header?;
    if !serves(&header) {
        return Ok(Landing::Declined(header));
    }
    landed?;
    load::unchanged(source)?;
    // Its copies are proven complete (`upload` returns once they are): its uses fold into the
    // allocation's, and the tensors made below start with none.
    drop(landing);
    planned(header.tensors.len());
    // A tensor of no bytes first, as every load hands them over; then the others in file order.
    let empty = |t: &Entry| t.end == t.start;
    let order: Vec<usize> = (header.tensors.iter().enumerate())
        .filter(|(_, t)| empty(t))
        .chain(header.tensors.iter().enumerate().filter(|(_, t)| !empty(t)))
        .map(|(i, _)| i)
        .collect();
    let mut tensors: Vec<Option<Entry>> = header.tensors.into_iter().map(Some).collect();
    for i in order {
        let t = tensors[i].take().expect("each tensor is handed over once");
        let len = (t.end - t.start) as usize;
        let bytes = if len == 0 {
            engine.alloc_tensor::<u8>(&[0])?
        } else {
            // Inside the data: the header's ranges tile it.
            let at = ALIGN + (t.start - data_start) as usize;
            // SAFETY: the header's ranges tile the data without overlap, so no two tensors made
            // here overlap; `whole` spans them all and is never handed out.
            unsafe { arena.part(at, len) }
        };
        // SAFETY: every copy into the data is proven complete, of the file's bytes for this
        // tensor at its place, and it is not `bool` (`serves`): the bytes are valid values of
        // its type. The allocation is 256-byte aligned and the tensor starts at a multiple of
        // its element's size from it (`serves`).
        let tensor = unsafe { AnyTensor::from_bytes(bytes, t.dtype, &t.shape) };
        let tensor = tensor.expect("the header checked that the shape fills the tensor's bytes");
        each(engine, i, t, tensor)?;
    }
    drop(whole);
    Ok(Landing::Loaded)
}
