//! A load of a file of small tensors: its data copied to the device while its header is parsed.
//!
//! A file of thousands of small tensors (norms, biases) spends a good part of its load on its
//! header: 2,000 entries take half a millisecond to a millisecond to parse and check, as long
//! as the file's 64 MiB take to read from the page cache, and a load that plans first reads
//! nothing until the plan is made. Such a file is landed instead: its data (the bytes after the
//! header) is read and copied, as it lies in the file, into one device allocation (in sixteen
//! chunks through the load's staging and reader crew, as any load of a few slots' worth) while
//! another thread parses the header and then makes the tensors. Each tensor is a part of that
//! allocation at its place in the file ([`Arena`]): nothing is copied twice. The thread sends
//! the tensors on in batches as it makes them; once every copy is queued, the calling thread
//! records and hands out each batch while the next is made.
//!
//! Whether to land is decided before the header is known, from what its prefix and the file's
//! length say: a load of the whole file (no selection, no slices) of fewer than sixteen slots'
//! worth, whose data could be small tensors only. Every tensor entry of a header takes at least
//! fifty bytes (`header::SHORTEST_ENTRY`), so a header of `n` bytes names at most `n / 50 + 1`
//! tensors, and data longer than that many small tensors holds a large one.
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
use crate::core::order::Use;
use crate::driver::{DevicePtr, Lane};
use crate::dtype::DType;
use crate::error::{IoError, Result};
use crate::memory::any_tensor::AnyTensor;
use crate::memory::arena::{ALIGN, Arena};
use crate::memory::tensor::DeviceTensor;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};

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
    (header / header::SHORTEST_ENTRY as u64 + 1).saturating_mul(PACK_MAX as u64) >= data
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

/// What the header's thread found: a header the landed data serves, its tensors to be made
/// and handed out, or one it does not serve.
enum Parsed {
    Serves(Ready),
    Declines(Header),
}

/// How many tensors the header's thread makes before it sends them on: the calling thread
/// hands one batch out while the next is made.
const BATCH: usize = 256;

/// The tensors of a header the landed data serves, to be handed out once every copy is
/// queued.
struct Ready {
    /// How many tensors the header names.
    count: usize,
    /// The tensors of no bytes, which get allocations of their own, with their places.
    empty: Vec<(usize, Entry)>,
    /// How many others there are.
    full: usize,
    /// The others, in file order, in batches as the header's thread makes them.
    batches: Receiver<Batch>,
}

/// Tensors made on the header's thread, not yet reachable by any caller: each the part of the
/// allocation at its place in the data, with its place in the file and its entry, and the uses
/// to record for them (each written by the copies).
struct Batch {
    written: Vec<Use>,
    tensors: Vec<(usize, Entry, AnyTensor)>,
}

/// Where the landed data lies: the arena, its address, and where the data starts in the file
/// (it starts at byte [`ALIGN`] of the arena).
#[derive(Clone, Copy)]
struct Place<'a> {
    arena: &'a Arc<Arena>,
    base: DevicePtr,
    data_start: u64,
}

impl Place<'_> {
    /// The tensors of `entries`, which the data serves (`serves`), each the part of the arena
    /// at its place.
    fn make(self, entries: Vec<(usize, Entry)>) -> Batch {
        let written = (entries.iter())
            .map(|(_, t)| Use::Write(self.base + ALIGN as u64 + (t.start - self.data_start)))
            .collect();
        let tensors = (entries.into_iter())
            .map(|(i, t)| {
                let at = ALIGN + (t.start - self.data_start) as usize;
                // SAFETY: the header's ranges tile the data without overlap, so no two tensors
                // made here overlap; the whole allocation, which spans them all, is the
                // landing's own and never handed out.
                let bytes = unsafe { self.arena.part(at, (t.end - t.start) as usize) };
                // SAFETY: the tensor is handed out only once every copy of the file's bytes
                // into the data is queued and it is recorded as written by them
                // (`Data::hand_out`), so work on it is ordered after them; until then nothing
                // reaches it. It is not `bool` (`serves`), so any bytes are valid values of its
                // type. The allocation is 256-byte aligned, and the tensor starts at a multiple
                // of its element's size from it (`serves`).
                let tensor = unsafe { AnyTensor::from_bytes(bytes, t.dtype, &t.shape) };
                let tensor =
                    tensor.expect("the header checked that the shape fills the tensor's bytes");
                (i, t, tensor)
            })
            .collect();
        Batch { written, tensors }
    }
}

/// Reads and checks the header of `source`, tells `told` what it says, and when the landed
/// data at `place` serves it, makes its tensors in batches, in file order, sending each on as
/// it is made; stops once the batches are no longer taken (the landing stopped). A header that
/// is bad or does not serve sets `stop`.
fn parse_and_make(
    source: &Source<'_>,
    place: Place<'_>,
    stop: &AtomicBool,
    told: Sender<Result<Parsed>>,
) {
    let header = match header::read(source.path, source.file, source.len) {
        Ok(header) if serves(&header) => header,
        parsed => {
            stop.store(true, Ordering::Release);
            let _ = told.send(parsed.map(Parsed::Declines));
            return;
        }
    };
    let count = header.tensors.len();
    let (empty, full): (Vec<_>, Vec<_>) =
        (header.tensors.into_iter().enumerate()).partition(|(_, t)| t.end == t.start);
    let (send, batches) = std::sync::mpsc::channel();
    let ready = Ready {
        count,
        empty,
        full: full.len(),
        batches,
    };
    if told.send(Ok(Parsed::Serves(ready))).is_err() {
        return;
    }
    let mut full = full.into_iter();
    loop {
        let entries: Vec<_> = full.by_ref().take(BATCH).collect();
        // A batch not taken is dropped here, its tensors folded into the allocation.
        if entries.is_empty() || send.send(place.make(entries)).is_err() {
            return;
        }
    }
}

/// What the header says, from the thread that parses it and makes its tensors (or, where no
/// thread could be had, from a parse on the calling thread); kept once known.
struct Parse<'a, 'scope> {
    thread: Option<std::thread::ScopedJoinHandle<'scope, ()>>,
    /// The thread's first word.
    told: Receiver<Result<Parsed>>,
    /// The header read, checked and its tensors made on the calling thread.
    inline: &'a (dyn Fn() -> Result<Parsed> + Sync),
    parsed: Option<Result<Parsed>>,
}

impl Parse<'_, '_> {
    /// What the header says: waits for the thread's word the first time.
    fn parsed(&mut self) -> &Result<Parsed> {
        if self.parsed.is_none() {
            let parsed = match self.thread {
                Some(_) => match self.told.recv() {
                    Ok(parsed) => parsed,
                    Err(_) => self.rethrow("the header's thread tells what the header says"),
                },
                None => (self.inline)(),
            };
            self.parsed = Some(parsed);
        }
        self.parsed.as_ref().expect("known from here on")
    }

    /// Once the header's thread has ended with less said than it promised: its panic, passed
    /// on to the calling thread.
    fn rethrow(&mut self, promise: &str) -> ! {
        match self.thread.take().map(|thread| thread.join()) {
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            _ => panic!("{promise}"),
        }
    }
}

/// A landing's one target: the whole allocation, the data from byte [`ALIGN`] on, filled by the
/// copies of the data's one entry. Once they are all queued, the tensors are handed out, each
/// the part of the allocation at its place, while the copies still run; a header the data
/// cannot serve stops the landing instead (`stop`).
struct Data<'a, 'scope, 'e> {
    whole: &'a DeviceTensor<u8>,
    parse: Parse<'a, 'scope>,
    stop: &'a AtomicBool,
    path: &'a std::path::Path,
    planned: &'a mut dyn FnMut(usize),
    each: &'a mut Each<'e>,
    /// Set once a tensor has been handed out.
    handed: bool,
}

impl Targets for Data<'_, '_, '_> {
    fn target(&self, _: usize) -> &DeviceTensor<u8> {
        self.whole
    }

    fn at(&self, _: usize) -> usize {
        ALIGN
    }

    fn queued(&mut self, engine: &mut CudaEngine, _: usize) -> Result<()> {
        // A header the data cannot serve, or a bad one, is told once the landing returns.
        if !matches!(self.parse.parsed(), Ok(Parsed::Serves(_))) {
            return Ok(());
        }
        match self.parse.parsed.take() {
            Some(Ok(Parsed::Serves(ready))) => self.hand_out(engine, ready),
            _ => Ok(()),
        }
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

impl Data<'_, '_, '_> {
    /// Hands out every tensor of `ready`, once every copy into the data is queued: those of no
    /// bytes first, then the others in file order. Each is recorded first as written by the
    /// copies queued so far on the upload lane, so that later work on it waits for them.
    fn hand_out(&mut self, engine: &mut CudaEngine, ready: Ready) -> Result<()> {
        (self.planned)(ready.count);
        let mut handed = Ok(());
        for (i, t) in ready.empty {
            let tensor = engine.alloc_tensor::<u8>(&[0]).map(|bytes| {
                // SAFETY: a tensor of no bytes: nothing to order or validate.
                let tensor = unsafe { AnyTensor::from_bytes(bytes, t.dtype, &t.shape) };
                tensor.expect("the header checked that the shape holds no element")
            });
            handed = handed.and(tensor).and_then(|tensor| {
                self.handed = true;
                (self.each)(engine, i, t, tensor)
            });
        }
        let mut made = 0;
        while handed.is_ok()
            && made < ready.full
            && let Ok(batch) = ready.batches.recv()
        {
            made += batch.tensors.len();
            handed = engine
                .enter()
                .map(|mut st| st.order.mark_queued(Lane::Upload, &batch.written));
            for (i, t, tensor) in batch.tensors {
                if handed.is_err() {
                    // The load stopped: the tensor is dropped at once, which folds the use
                    // recorded for it above into the allocation's, so that the allocation's
                    // free waits for the copies and the order keeps nothing of it.
                    continue;
                }
                self.handed = true;
                handed = (self.each)(engine, i, t, tensor);
            }
        }
        if handed.is_ok() && made < ready.full {
            self.parse
                .rethrow("the header's thread makes every tensor it tells of");
        }
        // Batches not yet made are not: the thread stops once `ready.batches` is dropped.
        handed
    }
}

/// Lands the data of `source` when it is a file to land (see the module's doc), telling
/// `planned` how many tensors the header names and handing each tensor to `each` once every
/// copy into the data is queued: those of no bytes first, then the others in file order.
/// Returns once every copy is proven complete. `progress` hears of each chunk's copy, out of
/// the data's bytes.
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
    // allocation's own address, where the copies' uses are recorded and the arena folds those
    // of its parts.
    let arena = Arena::new(engine.alloc_tensor::<u8>(&[ALIGN + bytes])?);
    // SAFETY: the whole allocation: the copies' target, held until the load ends so that the
    // arena outlives the making of its parts; never handed out.
    let whole = unsafe { arena.part(0, ALIGN + bytes) };
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
    let place = Place {
        arena: &arena,
        base: whole.raw_ptr(),
        data_start,
    };
    let inline = || {
        let (told, word) = std::sync::mpsc::channel();
        parse_and_make(&source, place, &stop, told);
        word.recv()
            .expect("the header is told before anything is made")
    };
    let (told, word) = std::sync::mpsc::channel();
    let (parsed, landed, handed) = std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .name("cuferry-header".into())
            .spawn_scoped(scope, || parse_and_make(&source, place, &stop, told))
            // No thread to be had: the header is read once the copies are queued.
            .ok();
        let mut tally = Tally::new(data, progress);
        let mut target = Data {
            whole: &whole,
            parse: Parse {
                thread,
                told: word,
                inline: &inline,
                parsed: None,
            },
            stop: &stop,
            path: source.path,
            planned,
            each,
            handed: false,
        };
        let landed = load::upload(
            engine,
            source,
            std::slice::from_ref(&entry),
            staging,
            &mut tally,
            &mut target,
        );
        // Known already, unless the tensors were handed out (which took it).
        let parsed = if target.handed {
            None
        } else {
            target.parse.parsed();
            target.parse.parsed.take()
        };
        (parsed, landed, target.handed)
    });
    if handed {
        landed?;
        load::unchanged(source)?;
        return Ok(Landing::Loaded);
    }
    // Nothing was handed out. A malformed header is what the usual load would report, before
    // any read of the data; a header the data cannot serve sends the load the usual way,
    // whatever the landing met (it may have been stopped for it).
    match parsed.expect("known once the landing ends")? {
        Parsed::Declines(header) => Ok(Landing::Declined(header)),
        Parsed::Serves(ready) => {
            // Its tensors were not handed out: dropped, each folded into the allocation,
            // which is freed after the copies.
            drop(ready);
            // A landing whose copies are all queued hands its tensors out, so the landing
            // failed.
            landed?;
            // Not reached; were it, the file is loaded the usual way.
            Ok(Landing::Untried)
        }
    }
}
