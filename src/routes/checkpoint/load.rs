//! Loading a checkpoint: file → pinned staging → device, with the reads split across threads
//! and the copies overlapped with them.
//!
//! The route is a composition of staging leases ([`StagingLease`]): each chunk of a tensor is
//! read into a leased pinned slot (in parts, by the load's crew of reader threads: see
//! [`crew`](super::crew)), then queued as a copy into the tensor, after which the lease is
//! [`Unproven`] until its event proves the copy done; only then is the slot read into again.
//! The load's staging setting bounds the pinned memory it holds, in slots of the engine's
//! [`StagingConfig`](crate::staging::StagingConfig) chunk size. Every failure (a read, a copy, a
//! proof) stops the load: the leases in flight retire into the engine (their slots come back
//! once their copies are proven, never before), the tensors made so far are dropped, which
//! frees them after their copies, and the error names the file (and the tensor, for bad data).

use super::Staging;
use super::crew::{self, Answer, Crew, Part};
use super::header::{self, Entry, Header};
use super::slice::Runs;
use super::{ReadAt, Tally};
use crate::core::engine::CudaEngine;
use crate::driver::DevicePtr;
use crate::error::{Error, IoError, MalformedError, Result};
use crate::lifecycle::lease::{Proven, Scatter, StagingLease, Unproven, released};
use crate::memory::any_tensor::AnyTensor;
use crate::memory::arena::{ALIGN as ARENA_ALIGN, Arena};
use crate::memory::tensor::DeviceTensor;
use crate::sync::copy_pool;
use std::collections::VecDeque;
use std::path::Path;
use std::sync::mpsc;

/// Where a piece of a chunk goes: `len` bytes at byte `from` of the slot into tensor
/// `tensor` at byte `at`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Piece {
    pub(super) tensor: usize,
    pub(super) at: usize,
    pub(super) from: usize,
    pub(super) len: usize,
}

/// One read of the load: file bytes `start..end` into one staging slot at byte `skew` (a
/// direct read starts on the block boundary `skew` bytes before `start`), then copied to its
/// pieces, one or more tensors.
///
/// A chunk of a slice of columns holds part of one tensor only, read as runs: `start..end` are
/// then offsets into the slice's bytes from `origin` (the slice's first byte in the file), and
/// byte `b` of them lies at `runs.file_offset(origin, b - origin)`.
#[derive(Clone, Debug)]
pub(super) struct Chunk {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) skew: usize,
    pub(super) pieces: Vec<Piece>,
    pub(super) runs: Option<(u64, Runs)>,
    /// For a chunk of small tensors packed into one allocation: the group (of the targets'
    /// [`groups`](Targets::groups)) it fills. Its pieces are read one by one into their places
    /// in the slot, which are their places in the allocation.
    pub(super) group: Option<usize>,
}

impl Chunk {
    /// The bytes the chunk moves.
    fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len as u64).sum()
    }
}

/// Small tensors that follow each other in a load's plan, packed into one device allocation
/// (an [`Arena`]) and one staging slot alike: entries `first..first + offsets.len()`, each at
/// its offset (256-byte aligned, the first at 256, so that no part sits at the allocation's own
/// address), `bytes` in all.
#[derive(Clone, Debug)]
pub(crate) struct Group {
    first: usize,
    offsets: Vec<usize>,
    bytes: usize,
}

/// The largest tensor a load packs with others into one allocation.
pub(super) const PACK_MAX: usize = 256 << 10;

/// The groups of small tensors among `entries` that a load through slots of `capacity` bytes
/// packs: runs of at least two tensors of at most [`PACK_MAX`] bytes (and an eighth of a slot),
/// as many as one slot holds.
pub(crate) fn groups(entries: &[Entry], capacity: usize) -> Vec<Group> {
    // As `chunks` leaves room for direct reads, whether or not they are asked for.
    let room = capacity.saturating_sub(2 * BLOCK as usize);
    let small = PACK_MAX.min(room / 8);
    let mut out: Vec<Group> = Vec::new();
    let mut open: Option<Group> = None;
    let close = |group: Option<Group>, out: &mut Vec<Group>| {
        if let Some(group) = group.filter(|g| g.offsets.len() >= 2) {
            out.push(group);
        }
    };
    for (i, t) in entries.iter().enumerate() {
        let size = (t.end - t.start) as usize;
        if t.runs.is_some() || size == 0 || size > small {
            close(open.take(), &mut out);
            continue;
        }
        let at = open
            .as_ref()
            .map_or(ARENA_ALIGN, |g| g.bytes.next_multiple_of(ARENA_ALIGN));
        match open.as_mut() {
            Some(g) if at + size <= room => {
                g.offsets.push(at);
                g.bytes = at + size;
            }
            _ => {
                close(open.take(), &mut out);
                open = Some(Group {
                    first: i,
                    offsets: vec![ARENA_ALIGN],
                    bytes: ARENA_ALIGN + size,
                });
            }
        }
    }
    close(open, &mut out);
    out
}

/// How many chunks at least a load that fits in fewer slots is cut into.
const SPREAD: u64 = 16;

/// The smallest chunk a load is cut to for [`SPREAD`].
const MIN_CHUNK: u64 = 1 << 20;

/// Whether a load of `bytes` in all, through slots of `capacity` bytes, is of fewer than
/// [`SPREAD`] slots' worth: one that is cut into smaller chunks ([`chunk_bytes`]) and runs fewer
/// readers by default ([`Staging::readers`]).
pub(crate) fn few_slots(capacity: usize, bytes: u64) -> bool {
    bytes < capacity as u64 * SPREAD
}

/// The most bytes one chunk of a load of `bytes` in all holds, through slots of `capacity`
/// bytes: a slot, but for a load of [`few_slots`], a [`SPREAD`]th of it (at least
/// [`MIN_CHUNK`]). The copies to the device wait for the first chunk's read, and a file of a
/// few slots would otherwise be read almost whole before its first copy starts.
pub(crate) fn chunk_bytes(capacity: usize, bytes: u64) -> usize {
    if !few_slots(capacity, bytes) {
        return capacity;
    }
    // Less than `capacity`, so it fits a `usize`.
    (bytes / SPREAD).max(MIN_CHUNK).min(capacity as u64) as usize
}

/// The block size direct reads align their offsets, lengths and buffers to.
pub(super) const BLOCK: u64 = 4096;

/// The smallest slot that direct reads use (a chunk gives up two blocks to alignment).
const DIRECT_MIN_SLOT: usize = 64 << 10;

/// The chunks that read `tensors` into slots of `capacity` bytes, in file order: tensors that
/// follow each other in the file share a chunk, a large one spans several.
pub(super) fn chunks(
    tensors: &[Entry],
    capacity: usize,
    direct: bool,
    groups: &[Group],
) -> Vec<Chunk> {
    // A direct read may start up to a block before its first byte and end up to a block after
    // its last.
    let room = if direct {
        capacity - 2 * BLOCK as usize
    } else {
        capacity
    } as u64;
    let mut out: Vec<Chunk> = Vec::new();
    let mut packed = groups.iter().enumerate().peekable();
    let mut skip = 0..0;
    for (i, t) in tensors.iter().enumerate() {
        if skip.contains(&i) {
            continue;
        }
        if let Some((g, group)) = packed.next_if(|(_, group)| group.first == i) {
            let pieces = group.offsets.iter().enumerate().map(|(k, &from)| {
                let t = &tensors[i + k];
                Piece {
                    tensor: i + k,
                    at: 0,
                    from,
                    len: (t.end - t.start) as usize,
                }
            });
            out.push(Chunk {
                start: t.start,
                end: t.start,
                skew: 0,
                pieces: pieces.collect(),
                runs: None,
                group: Some(g),
            });
            skip = i..i + group.offsets.len();
            continue;
        }
        let mut start = t.start;
        let runs = t.runs.map(|r| (t.start, r));
        while start < t.end {
            // A slice of columns shares no chunk: its reads are its own runs.
            let fits = runs.is_none()
                && out.last().is_some_and(|c| {
                    c.runs.is_none()
                        && c.group.is_none()
                        && c.end == start
                        && c.end - c.start < room
                });
            if !fits {
                let skew = if direct && runs.is_none() {
                    (start % BLOCK) as usize
                } else {
                    0
                };
                out.push(Chunk {
                    start,
                    end: start,
                    skew,
                    pieces: Vec::new(),
                    runs,
                    group: None,
                });
            }
            let c = out.last_mut().expect("a chunk was just pushed");
            let n = (room - (c.end - c.start)).min(t.end - start);
            c.pieces.push(Piece {
                tensor: i,
                at: (start - t.start) as usize,
                from: c.skew + (c.end - c.start) as usize,
                len: n as usize,
            });
            c.end += n;
            start += n;
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

/// Where a load reads: the file `path` through `file`, and through `direct` (the same file
/// opened for `O_DIRECT`) where direct reads were asked for.
#[derive(Clone, Copy)]
pub(crate) struct Source<'f> {
    pub(crate) path: &'f Path,
    pub(crate) file: &'f dyn ReadAt,
    pub(crate) direct: Option<&'f std::fs::File>,
    /// The file's length when its header was read.
    pub(crate) len: u64,
}

/// The device tensors a pipeline copies into, one per planned entry: who holds them, and what
/// happens to one once every copy into it is queued.
pub(crate) trait Targets {
    /// The tensor of entry `i`, while copies into it are still to be queued. Not asked of an
    /// entry packed into a group's allocation ([`groups`](Self::groups)): its copy is the
    /// group's.
    fn target(&self, i: usize) -> &DeviceTensor<u8>;

    /// The byte of [`target`](Self::target)'s tensor where entry `i`'s bytes begin.
    fn at(&self, _i: usize) -> usize {
        0
    }

    /// The groups of small entries packed into one allocation each: none unless the targets
    /// made them ([`groups`]).
    fn groups(&self) -> &[Group] {
        &[]
    }

    /// The allocation group `g` is packed into, as one tensor (of which each entry's tensor is
    /// a part).
    fn block(&self, g: usize) -> &DeviceTensor<u8> {
        unreachable!("no group {g}: these targets pack none")
    }

    /// Every copy into entry `i`'s tensor is queued: later work on the engine that uses it is
    /// ordered after them.
    ///
    /// # Errors
    /// Whatever stops the pipeline (a caller's error).
    fn queued(&mut self, engine: &mut CudaEngine, i: usize) -> Result<()>;

    /// Whether the pipeline is to go on: asked before each slot is handed out to the readers
    /// and after each batch of their answers.
    ///
    /// # Errors
    /// Why the load is to stop: the pipeline stops as on a failure (the reads not yet begun
    /// are not made) and returns it.
    fn proceed(&self) -> Result<()> {
        Ok(())
    }
}

/// What a loaded tensor is handed to: its index in the plan, and the tensor, as soon as every
/// copy into it is queued (later work on the engine is ordered after those copies).
pub(crate) type Each<'e> = dyn FnMut(&mut CudaEngine, usize, AnyTensor) -> Result<()> + 'e;

/// A load's targets: tensors it allocated, each handed to `each` once its copies are queued.
struct Loaded<'a, 'e> {
    entries: &'a [Entry],
    tensors: Vec<Target>,
    each: &'a mut Each<'e>,
    groups: Vec<Group>,
    /// Each group's allocation, whole: a part of its arena held until the load ends, so the
    /// arena outlives the making of its other parts.
    blocks: Vec<DeviceTensor<u8>>,
    /// Each group's arena, of which a packed entry's tensor is made when it is handed out.
    arenas: Vec<std::sync::Arc<Arena>>,
}

/// What a load holds for one entry until it hands the entry's tensor out.
enum Target {
    /// A tensor of its own.
    Own(DeviceTensor<u8>),
    /// `len` bytes at `at` of group `group`'s allocation: the part is made only when it is
    /// handed out (a part costs a lock of the engine's, and most of a load of many small
    /// tensors would otherwise go to making them before the first byte is read).
    Packed { group: usize, at: usize, len: usize },
    /// Handed out.
    Gone,
}

impl Drop for Loaded<'_, '_> {
    fn drop(&mut self) {
        // A packed entry not handed out (the load stopped): a copy into it may have recorded
        // its use under the part's address, which a part's drop folds into the allocation's.
        // Made and dropped here, as if it had been made at the start and dropped now.
        for target in &mut self.tensors {
            if let Target::Packed { group, at, len } = std::mem::replace(target, Target::Gone) {
                // SAFETY: as in `queued`: the part lies inside the group's allocation, apart
                // from every other part.
                drop(unsafe { self.arenas[group].part(at, len) });
            }
        }
    }
}

impl Targets for Loaded<'_, '_> {
    fn groups(&self) -> &[Group] {
        &self.groups
    }

    fn block(&self, g: usize) -> &DeviceTensor<u8> {
        &self.blocks[g]
    }

    fn target(&self, i: usize) -> &DeviceTensor<u8> {
        match &self.tensors[i] {
            Target::Own(tensor) => tensor,
            _ => unreachable!("a tensor of its own, not yet handed out"),
        }
    }

    fn queued(&mut self, engine: &mut CudaEngine, i: usize) -> Result<()> {
        let bytes = match std::mem::replace(&mut self.tensors[i], Target::Gone) {
            Target::Own(tensor) => tensor,
            // SAFETY: `groups` lays the group's tensors out one after another, each at its own
            // aligned offset inside the allocation: no two parts overlap. The group's whole
            // allocation (`blocks`) is only the target of its copy, never handed out.
            Target::Packed { group, at, len } => unsafe { self.arenas[group].part(at, len) },
            Target::Gone => unreachable!("each tensor is handed out once"),
        };
        let entry = &self.entries[i];
        // SAFETY: every copy into the bytes is queued, of the file's bytes for this tensor, and
        // the reader refused a `bool` tensor holding a byte other than 0 or 1 before its copy
        // was queued: once those copies complete the bytes are valid values of its type. Later
        // work on the engine is ordered after them.
        let tensor = unsafe { AnyTensor::from_bytes(bytes, entry.dtype, &entry.shape) };
        let tensor = tensor.expect("the header checked that the shape fills the tensor's bytes");
        (self.each)(engine, i, tensor)
    }
}

/// Loads the planned `tensors` of `source` onto `engine` through `staging`, handing each to
/// `each` as soon as its copies are queued, and counting each chunk's bytes into `tally` once
/// its copies are queued. Returns once every copy is proven complete.
///
/// # Errors
/// [`Error::Io`] for a failed read; [`Error::Malformed`] for a short read, a `bool` tensor holding a byte other than
/// 0 or 1, or a file whose length changed; the engine's error when it cannot allocate, copy or
/// prove a copy; `each`'s error. The tensors not yet handed out are dropped (freed after their
/// copies); the slots come back once their copies are proven.
pub(crate) fn load(
    engine: &mut CudaEngine,
    source: Source<'_>,
    tensors: &[Entry],
    staging: Staging,
    tally: &mut Tally<'_>,
    each: &mut Each<'_>,
) -> Result<()> {
    let capacity = engine.staging_config().chunk_bytes;
    let groups = groups(tensors, chunk_bytes(capacity, plan_bytes(tensors)));
    let mut loaded = Loaded {
        entries: tensors,
        tensors: Vec::with_capacity(tensors.len()),
        each,
        blocks: Vec::with_capacity(groups.len()),
        arenas: Vec::with_capacity(groups.len()),
        groups,
    };
    let mut packed = loaded.groups.iter().enumerate().peekable();
    let mut i = 0;
    while i < tensors.len() {
        if let Some((g, group)) = packed.next_if(|(_, g)| g.first == i) {
            // One allocation for the group: each tensor a part of it, made when handed out.
            let arena = Arena::new(engine.alloc_tensor::<u8>(&[group.bytes])?);
            // SAFETY: the whole allocation stays the load's, the target of the group's one
            // copy, never handed out.
            loaded.blocks.push(unsafe { arena.part(0, group.bytes) });
            loaded.arenas.push(arena);
            for (k, &at) in group.offsets.iter().enumerate() {
                let len = (tensors[i + k].end - tensors[i + k].start) as usize;
                (loaded.tensors).push(Target::Packed { group: g, at, len });
            }
            i += group.offsets.len();
            continue;
        }
        let t = &tensors[i];
        let bytes = engine.alloc_tensor::<u8>(&[(t.end - t.start) as usize])?;
        loaded.tensors.push(Target::Own(bytes));
        i += 1;
    }
    upload(engine, source, tensors, staging, tally, &mut loaded)?;
    unchanged(source)
}

/// Refuses a file whose length changed since its header was read.
pub(super) fn unchanged(source: Source<'_>) -> Result<()> {
    let current = file_len(source.path, source.file, source.len)?;
    if current != source.len {
        return Err(MalformedError::LengthChanged {
            path: source.path.to_owned(),
            before: source.len,
            after: current,
        }
        .into());
    }
    Ok(())
}

/// The planned `tensors` of `source`, loaded as their bytes (a `u8` tensor each, in plan
/// order), for a route that hands them on before they are typed. Returns once every copy is
/// proven complete.
///
/// # Errors
/// As [`load`].
pub(crate) fn load_bytes(
    engine: &mut CudaEngine,
    source: Source<'_>,
    tensors: &[Entry],
    staging: Staging,
    tally: &mut Tally<'_>,
) -> Result<Vec<DeviceTensor<u8>>> {
    /// Tensors kept as they are once their copies are queued.
    struct Kept(Vec<DeviceTensor<u8>>);
    impl Targets for Kept {
        fn target(&self, i: usize) -> &DeviceTensor<u8> {
            &self.0[i]
        }
        fn queued(&mut self, _: &mut CudaEngine, _: usize) -> Result<()> {
            Ok(())
        }
    }
    let mut kept = Kept(Vec::with_capacity(tensors.len()));
    for t in tensors {
        kept.0
            .push(engine.alloc_tensor::<u8>(&[(t.end - t.start) as usize])?);
    }
    upload(engine, source, tensors, staging, tally, &mut kept)?;
    unchanged(source)?;
    Ok(kept.0)
}

/// Copies the file bytes each of `entries` names into its tensor of `targets` through
/// `staging`, telling `targets` of each tensor once its copies are queued (a tensor of no bytes
/// first), and counting each chunk's bytes into `tally`. Returns once every copy is proven.
///
/// # Errors
/// As [`load`], but for the file's length, which is the caller's to check.
pub(crate) fn upload(
    engine: &mut CudaEngine,
    source: Source<'_>,
    entries: &[Entry],
    staging: Staging,
    tally: &mut Tally<'_>,
    targets: &mut dyn Targets,
) -> Result<()> {
    let mut remaining = vec![0usize; entries.len()];
    let mut run = Run {
        engine,
        entries,
        targets,
        remaining: &mut remaining,
        tally,
    };
    if !entries.iter().any(|t| t.end > t.start) {
        return (0..entries.len()).try_for_each(|i| run.targets.queued(run.engine, i));
    }
    let first = run.engine.route_lease()?;
    let direct = source.direct.is_some() && first.capacity() >= DIRECT_MIN_SLOT;
    let bytes = plan_bytes(entries);
    let room = chunk_bytes(first.capacity(), bytes);
    let chunks = chunks(entries, room, direct, run.targets.groups());
    let readers = staging.readers(few_slots(first.capacity(), bytes));
    for piece in chunks.iter().flat_map(|c| &c.pieces) {
        run.remaining[piece.tensor] += 1;
    }
    let source = Source {
        direct: source.direct.filter(|_| direct),
        ..source
    };
    for i in 0..entries.len() {
        if run.remaining[i] == 0 {
            run.targets.queued(run.engine, i)?;
        }
    }
    pipeline(&mut run, source, &chunks, staging.bytes, readers, first)
}

/// The state a pipeline works on, on the calling thread.
struct Run<'a, 'e> {
    engine: &'a mut CudaEngine,
    entries: &'a [Entry],
    targets: &'a mut dyn Targets,
    /// The pieces of each tensor not yet queued.
    remaining: &'a mut [usize],
    tally: &'a mut Tally<'e>,
}

impl Run<'_, '_> {
    /// Queues the copies of `chunk`, read into `lease`, and counts its bytes; the targets are
    /// told of its tensors by [`hand_over`](Self::hand_over).
    fn land(
        &mut self,
        chunk: &Chunk,
        lease: StagingLease<Proven>,
        flying: &mut VecDeque<StagingLease<Unproven>>,
    ) -> Result<()> {
        let targets = &*self.targets;
        let parts: Vec<DevicePtr>;
        let copies: Vec<Scatter<'_>> = match chunk.group {
            // One copy fills the group's allocation, every tensor in it at once.
            Some(g) => {
                // Each piece's place in the slot is its tensor's in the allocation.
                let block = targets.block(g);
                parts = (chunk.pieces.iter())
                    .map(|p| block.raw_ptr() + p.from as u64)
                    .collect();
                let end = targets.groups()[g].bytes;
                vec![Scatter {
                    tensor: block,
                    at: ARENA_ALIGN,
                    from: ARENA_ALIGN,
                    len: end - ARENA_ALIGN,
                    parts: &parts,
                }]
            }
            None => (chunk.pieces.iter())
                .map(|p| Scatter {
                    tensor: targets.target(p.tensor),
                    at: targets.at(p.tensor) + p.at,
                    from: p.from,
                    len: p.len,
                    parts: &[],
                })
                .collect(),
        };
        let (begun, later) = lease.begin_scatter(self.engine, &copies);
        drop(copies);
        flying.push_back(begun.map_err(released)?);
        if let Some(error) = later {
            return Err(error);
        }
        self.tally.add(chunk.bytes());
        Ok(())
    }

    /// Tells the targets of each tensor whose last piece `chunk` (landed) holds.
    fn hand_over(&mut self, chunk: &Chunk) -> Result<()> {
        for piece in &chunk.pieces {
            self.remaining[piece.tensor] -= 1;
            if self.remaining[piece.tensor] == 0 {
                self.targets.queued(self.engine, piece.tensor)?;
            }
        }
        Ok(())
    }
}

/// Reads `chunks` into at most `staging_bytes` of staging slots (`first` one of them) through a
/// crew of up to `readers` reader threads that take the parts of each slot's read in the order
/// the slots were handed out ([`crew`](super::crew)); each slot's copies are queued as soon as
/// the last part of its read is in, and the slot read into again once they are proven.
fn pipeline(
    run: &mut Run<'_, '_>,
    source: Source<'_>,
    chunks: &[Chunk],
    staging_bytes: usize,
    readers: usize,
    first: StagingLease<Proven>,
) -> Result<()> {
    let capacity = first.capacity();
    let mut slots = (staging_bytes / capacity).max(2);
    let most = readers.max(1);
    let direct = source.direct.is_some();
    // No more threads than the file has parts to read.
    let mut parts = 0;
    for chunk in chunks {
        parts += crew::cut(chunk, capacity, direct, most).len();
        if parts >= most {
            break;
        }
    }
    let size = most.min(parts);
    run.engine.reserve_route_slots(slots.min(chunks.len()));
    let (jobs, queue) = mpsc::channel::<Part>();
    let (report, answers) = mpsc::channel::<Answer>();
    let crew = Crew::new(queue, report, source, run.entries, chunks);
    // The slots being read into, by chunk, with the parts of each still out. Each is held here,
    // outside the crew's threads' scopes, from its first part's hand-out until its last part's
    // answer: a panic on this thread drops them only after every reader has returned.
    let mut reading: Vec<Option<StagingLease<Proven>>> = Vec::new();
    reading.resize_with(chunks.len(), || None);
    let mut left = vec![0usize; chunks.len()];
    // The crew: the process's copy threads that are idle, and threads of the load's own for
    // the rest. The copy threads return once the queue closes, which this thread's part of the
    // work (`lead`) does as it returns or unwinds.
    let lead = |have: usize| {
        std::thread::scope(|scope| {
            let jobs = jobs;
            // However this ends, the parts still queued are then answered unread.
            let _stop = crew.stopper();
            crew.start(scope, have, size)?;
            let crew = &crew;
            let mut free = vec![first];
            let mut made = 1;
            // Chunks handed to the crew and not yet answered in full, and parts handed out.
            let mut in_read = 0;
            let mut sent = 0;
            // Sized by what the file needs, never by the setting alone.
            let mut flying: VecDeque<StagingLease<Unproven>> =
                VecDeque::with_capacity(slots.min(chunks.len()));
            let mut next = 0;
            let mut failure: Option<Error> = None;
            let mut panicked = None;
            // Chunks whose copies are queued and whose tensors are still to be handed over: the
            // copies of every read already done are queued first, and the next reads handed out,
            // before the calling thread spends time on the tensors.
            let mut landed: Vec<usize> = Vec::new();
            loop {
                if failure.is_none()
                    && let Err(error) = run.targets.proceed()
                {
                    failure = Some(error);
                }
                // Slots are handed out while one can be had: an idle one, a new one while the
                // budget allows, or, once the crew would run out of parts, the oldest in flight
                // once proven.
                while failure.is_none() && next < chunks.len() {
                    let lease = if let Some(lease) = free.pop() {
                        lease
                    } else if made < slots {
                        match run.engine.route_lease() {
                            Ok(lease) => {
                                made += 1;
                                lease
                            }
                            // Pinned memory ran out: the load goes on with the slots it has.
                            Err(_) if in_read + flying.len() > 0 => {
                                slots = made;
                                continue;
                            }
                            Err(error) => {
                                failure = Some(error);
                                break;
                            }
                        }
                    } else if sent - crew.taken() < size
                        && let Some(oldest) = flying.pop_front()
                    {
                        match oldest.end_chunk() {
                            Ok(lease) => lease,
                            Err(error) => {
                                failure = Some(error);
                                break;
                            }
                        }
                    } else {
                        break; // the crew has parts enough, or every slot is being read into
                    };
                    let mut lease = lease;
                    let bytes = lease.as_mut_bytes();
                    let parts: Vec<Part> = crew::cut(&chunks[next], capacity, direct, most)
                        .into_iter()
                        .map(|(what, range)| Part {
                            chunk: next,
                            what,
                            at: range.start,
                            len: range.len(),
                            ptr: bytes[range].as_mut_ptr(),
                        })
                        .collect();
                    // The slot is held here before any part of it is handed out.
                    reading[next] = Some(lease);
                    for part in parts {
                        // The queue's receiver is the crew's, which outlives the scope.
                        jobs.send(part).expect("the crew's queue outlives the load");
                        left[next] += 1;
                        sent += 1;
                    }
                    next += 1;
                    in_read += 1;
                }
                for i in landed.drain(..) {
                    if failure.is_none()
                        && let Err(error) = run.hand_over(&chunks[i])
                    {
                        failure = Some(error);
                    }
                }
                if failure.is_some() {
                    crew.stop();
                }
                if in_read == 0 {
                    break;
                }
                let Ok(first) = answers.recv() else {
                    // The crew holds a sender of its own, so the channel stays open while a
                    // reader can answer; a closed one stops the load rather than waiting.
                    failure.get_or_insert(readers_gone(source.path));
                    break;
                };
                // This answer and every other already in.
                let mut answer = Some(first);
                while let Some((i, read)) = answer.take() {
                    match read {
                        Err(payload) => {
                            panicked.get_or_insert(payload);
                            failure.get_or_insert(readers_gone(source.path));
                        }
                        Ok(Err(error)) => {
                            failure.get_or_insert(error);
                        }
                        Ok(Ok(())) => {}
                    }
                    left[i] -= 1;
                    if left[i] == 0 {
                        in_read -= 1;
                        let lease = reading[i].take().expect("a chunk in read holds its slot");
                        if failure.is_some() {
                            drop(lease); // draining: the slot goes back to the ring
                        } else {
                            match run.land(&chunks[i], lease, &mut flying) {
                                Ok(()) => landed.push(i),
                                Err(error) => failure = Some(error),
                            }
                        }
                    }
                    answer = answers.try_recv().ok();
                }
            }
            drop(jobs);
            if let Some(payload) = panicked {
                // The copies in flight retire (their slots come back once proven); then the
                // reader's panic goes on to the caller.
                drop(flying);
                drop(free);
                std::panic::resume_unwind(payload);
            }
            if let Some(error) = failure {
                return Err(error);
            }
            // The last copies are proven before the load returns, so their slots go back to the
            // ring at once (a retired lease would hold its place until the engine next polls).
            for lease in flying {
                lease.end_chunk()?.release();
            }
            Ok(())
        })
    };
    match copy_pool::pool() {
        Ok(pool) => pool.join(size, &|| crew.work(), lead),
        // No copy threads to be had: the load starts all of its own.
        Err(_) => lead(0),
    }
}

/// The error of a load whose reader threads ended early: one panicked, and its panic goes on
/// to the caller once the load has let go of its slots.
fn readers_gone(path: &Path) -> Error {
    IoError::File {
        path: path.to_owned(),
        operation: "read",
        source: std::io::Error::other("a reader thread panicked"),
    }
    .into()
}

/// The file's length now, as the reader sees it: a read of one byte at `len - 1` and one at
/// `len` tell a file that shrank or grew from one that did not. Each read is retried while it
/// is `Interrupted`.
fn file_len(path: &Path, file: &dyn ReadAt, len: u64) -> Result<u64, Error> {
    let mut probe = [0u8; 1];
    let io = |source| IoError::File {
        path: path.to_owned(),
        operation: "read",
        source,
    };
    let mut read = |at| {
        let n = super::retry(|| file.read_at(&mut probe, at)).map_err(io)?;
        if n > probe.len() {
            return Err(header::overstated(path, "read", probe.len(), n));
        }
        Ok(n)
    };
    if len > 0 && read(len - 1)? == 0 {
        return Ok(len - 1);
    }
    Ok(len + read(len)? as u64)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::driver::sim::{SimConfig, SimDevice, SimOp};
    use crate::dtype::DType;
    use crate::error::DriverError;
    use crate::memory::element::Element;
    use crate::memory::ring::StagingConfig;
    use crate::routes::checkpoint::slice::Runs;
    use crate::routes::checkpoint::{DEFAULT_READERS, SMALL_LOAD_READERS};
    use crate::routes::download_tensor;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// `tensor`'s bytes, as the file held them, downloaded.
    pub(in crate::routes::checkpoint) fn any_bytes(
        engine: &mut CudaEngine,
        tensor: &AnyTensor,
    ) -> Vec<u8> {
        struct Bytes<'a>(&'a mut CudaEngine);
        impl crate::memory::any_tensor::Visit for Bytes<'_> {
            type Out = Vec<u8>;
            fn visit<T: Element>(self, tensor: &DeviceTensor<T>) -> Vec<u8> {
                let data = download_tensor(self.0, tensor).unwrap();
                crate::memory::element::as_bytes(&data).to_vec()
            }
        }
        tensor.visit(Bytes(engine))
    }

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
        engine_with(4096)
    }

    /// An engine whose staging slots are `chunk` bytes.
    fn engine_with(chunk: usize) -> (CudaEngine, SimDevice) {
        let mut engine = CudaEngine::simulated(SimConfig::default());
        let config = StagingConfig {
            chunk_bytes: chunk,
            cutoff_bytes: 1024,
            ring_depth: 4,
            ..StagingConfig::default()
        };
        engine.set_staging_config(config).unwrap();
        let sim = engine.sim().unwrap();
        (engine, sim)
    }

    /// Staging of `bytes` and `threads` readers, both as a load's settings would give them.
    pub(in crate::routes::checkpoint) fn given(bytes: usize, threads: usize) -> Staging {
        Staging {
            bytes,
            threads,
            given: true,
            direct: false,
        }
    }

    /// Staging of four slots (of the test engine's 4 KiB) and three readers, so the reads run in
    /// parallel even on a machine of few cores.
    pub(in crate::routes::checkpoint) fn staging() -> Staging {
        given(4 * 4096, 3)
    }

    pub(in crate::routes::checkpoint) fn load_all(
        engine: &mut CudaEngine,
        file: &dyn ReadAt,
        len: u64,
    ) -> Result<Vec<(String, AnyTensor)>> {
        load_all_with(engine, file, len, staging())
    }

    /// As `load_all`, through `staging`.
    fn load_all_with(
        engine: &mut CudaEngine,
        file: &dyn ReadAt,
        len: u64,
        staging: Staging,
    ) -> Result<Vec<(String, AnyTensor)>> {
        let path = Path::new("model.safetensors");
        let tensors = plan(path, file, len, &mut |_| true)?;
        load_planned(engine, path, file, len, &tensors, staging)
    }

    /// Loads the planned `tensors` through `staging`, in the order they are handed out.
    fn load_planned(
        engine: &mut CudaEngine,
        path: &Path,
        file: &dyn ReadAt,
        len: u64,
        tensors: &[Entry],
        staging: Staging,
    ) -> Result<Vec<(String, AnyTensor)>> {
        let source = Source {
            path,
            file,
            direct: None,
            len,
        };
        let mut out = Vec::new();
        let mut each = |_: &mut CudaEngine, i: usize, t| {
            out.push((tensors[i].name.clone(), t));
            Ok(())
        };
        load(
            engine,
            source,
            tensors,
            staging,
            &mut Tally::silent(),
            &mut each,
        )?;
        Ok(out)
    }

    /// `u8` tensors in file order from byte 4,321 on, each after a gap of `gap` thousand bytes
    /// and `len` bytes long, or, where `cols` is not 0, a slice of columns: runs of `cols * 64`
    /// bytes every `3 * cols * 64`, `len` rounded up to whole runs.
    pub(in crate::routes::checkpoint) fn layout(
        sizes: impl Iterator<Item = (u64, u64, u64)>,
    ) -> Vec<Entry> {
        let mut at = 4_321u64;
        sizes
            .enumerate()
            .map(|(i, (gap, len, cols))| {
                at += gap * 1000;
                let runs = (cols > 0).then(|| Runs {
                    stride: 3 * cols * 64,
                    len: cols * 64,
                });
                let len = runs.map_or(len, |r| len.next_multiple_of(r.len));
                let span = runs.map_or(len, |r| len / r.len * r.stride);
                let t = Entry {
                    name: format!("t{i}"),
                    dtype: DType::U8,
                    shape: vec![len as usize],
                    start: at,
                    end: at + len,
                    runs,
                };
                at += span;
                t
            })
            .collect()
    }

    /// Drops `engine`, and checks that nothing was freed under a copy and no device memory is
    /// left.
    fn ends_clean(engine: CudaEngine, sim: &SimDevice) {
        drop(engine);
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        assert_eq!(sim.device_live().0, 0, "device memory left");
    }

    proptest::proptest! {
        /// The chunks of any layout read every selected byte once, into its tensor at its place,
        /// within the slot, and a direct chunk's read starts on a block boundary.
        #[test]
        fn chunks_cover_every_byte_once_within_the_slot(
            sizes in proptest::collection::vec((0u64..3, 0u64..20_000), 1..12),
            capacity in (64usize << 10)..(200 << 10),
            direct: bool,
            pack: bool,
        ) {
            // Tensors in file order, some with gaps between them (not selected ones).
            let tensors = layout(sizes.iter().map(|&(gap, len)| (gap, len, 0)));
            let mut seen: Vec<Vec<bool>> =
                tensors.iter().map(|t| vec![false; (t.end - t.start) as usize]).collect();
            let groups = if pack { groups(&tensors, capacity) } else { Vec::new() };
            for c in chunks(&tensors, capacity, direct, &groups) {
                if c.group.is_some() {
                    // Packed: at least two tensors, whole, each 256-byte aligned from byte 256
                    // on, one after another within the slot's room.
                    proptest::prop_assert!(c.pieces.len() >= 2);
                    let mut end = ARENA_ALIGN;
                    for p in &c.pieces {
                        let t = &tensors[p.tensor];
                        proptest::prop_assert_eq!((p.at, p.len), (0, (t.end - t.start) as usize));
                        proptest::prop_assert!(p.from >= end && p.from % ARENA_ALIGN == 0);
                        end = p.from + p.len;
                        for b in &mut seen[p.tensor] {
                            proptest::prop_assert!(!*b, "a byte read twice");
                            *b = true;
                        }
                    }
                    proptest::prop_assert!(end <= capacity - 2 * BLOCK as usize);
                    continue;
                }
                proptest::prop_assert!(c.start < c.end);
                if direct {
                    proptest::prop_assert_eq!((c.start - c.skew as u64) % BLOCK, 0);
                    let read = (c.skew + (c.end - c.start) as usize).next_multiple_of(BLOCK as usize);
                    proptest::prop_assert!(read <= capacity);
                } else {
                    proptest::prop_assert_eq!(c.skew, 0);
                    proptest::prop_assert!((c.end - c.start) as usize <= capacity);
                }
                let mut file = c.start;
                for p in &c.pieces {
                    let t = &tensors[p.tensor];
                    // Pieces follow each other in the file and in the slot.
                    proptest::prop_assert_eq!(t.start + p.at as u64, file);
                    proptest::prop_assert_eq!(p.from, c.skew + (file - c.start) as usize);
                    for b in &mut seen[p.tensor][p.at..p.at + p.len] {
                        proptest::prop_assert!(!*b, "a byte read twice");
                        *b = true;
                    }
                    file += p.len as u64;
                }
                proptest::prop_assert_eq!(file, c.end);
            }
            proptest::prop_assert!(seen.iter().flatten().all(|&b| b), "a byte never read");
        }
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
            assert_eq!(&any_bytes(&mut engine, t), data, "{name}");
        }
        // The typed view, checked: the right type converts, another comes back.
        let (_, w) = loaded.into_iter().find(|(n, _)| n == "w").unwrap();
        let w = w.into_typed::<f64>().expect_err("f32, not f64");
        let w = w.into_input().expect("the tensor comes back");
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
        let loaded = load_planned(&mut engine, path, &file, len, &tensors, staging()).unwrap();
        assert_eq!(loaded.len(), 1);
        assert_eq!(any_bytes(&mut engine, &loaded[0].1), 42i64.to_le_bytes());
        assert_eq!(sim.device_live().0 - before, 1, "one tensor allocated");
        assert!(
            reads.load(Ordering::Relaxed) < 1000,
            "the other tensors' bytes were not read"
        );
    }

    /// How a [`Faulty`] reader's read goes wrong.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Fault {
        /// An error.
        Fails,
        /// Nothing read, as at the end of the file.
        Short,
        /// One byte more than asked said to be read, and nothing written.
        Overlong,
    }

    /// A reader whose `n`-th read goes wrong, as `fault` says.
    struct Faulty<'a> {
        bytes: &'a [u8],
        fail_at: usize,
        fault: Fault,
        reads: AtomicUsize,
    }

    impl ReadAt for Faulty<'_> {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            if self.reads.fetch_add(1, Ordering::SeqCst) + 1 == self.fail_at {
                return match self.fault {
                    Fault::Fails => Err(std::io::Error::other("injected")),
                    Fault::Short => Ok(0),
                    Fault::Overlong => Ok(buf.len() + 1),
                };
            }
            self.bytes.read_at(buf, offset)
        }

        /// The threads' own readers count and fail with this one's reads.
        fn reopen(&self) -> Option<Box<dyn ReadAt + '_>> {
            Some(Box::new(Through(self)))
        }
    }

    /// A reader a test reader hands out as a thread's own: its reads are the test reader's.
    struct Through<'r, R: ReadAt>(&'r R);

    impl<R: ReadAt> ReadAt for Through<'_, R> {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            self.0.read_at(buf, offset)
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
        // Small slots, three readers; then one 64 KiB slot whose read is split in three.
        let split = given(4 << 16, 8);
        for (chunk, staging) in [(4096, staging()), (64 << 10, split)] {
            let reads = {
                let file = Faulty {
                    bytes: &bytes,
                    fail_at: 0,
                    fault: Fault::Fails,
                    reads: AtomicUsize::new(0),
                };
                let (mut engine, _sim) = engine_with(chunk);
                load_all_with(&mut engine, &file, bytes.len() as u64, staging).unwrap();
                file.reads.load(Ordering::SeqCst)
            };
            assert!(reads >= 6, "{reads} reads");
            for fail_at in 1..=reads {
                for fault in [Fault::Fails, Fault::Short, Fault::Overlong] {
                    let (mut engine, sim) = engine_with(chunk);
                    let file = Faulty {
                        bytes: &bytes,
                        fail_at,
                        fault,
                        reads: AtomicUsize::new(0),
                    };
                    match load_all_with(&mut engine, &file, bytes.len() as u64, staging) {
                        // The last read asks past the end, where reading nothing is the truth.
                        Ok(_) if fault == Fault::Short && fail_at == reads => {}
                        // A read that says it read more than it was asked for is the reader's
                        // error, at any step.
                        Err(Error::Io(IoError::File { .. })) if fault == Fault::Overlong => {}
                        Err(Error::Io(IoError::File { .. }))
                        | Err(Error::Malformed(MalformedError::ShortRead { .. }))
                        | Err(Error::Malformed(MalformedError::LengthChanged { .. }))
                            if fault != Fault::Overlong => {}
                        other => panic!("{chunk}: read {fail_at} ({fault:?}): {other:?}"),
                    }
                    recovers(engine, &sim, &bytes);
                }
            }
        }
    }

    /// A reader that panics at its `n`-th read.
    struct Panicking<'a> {
        bytes: &'a [u8],
        panic_at: usize,
        reads: AtomicUsize,
    }

    impl ReadAt for Panicking<'_> {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            if self.reads.fetch_add(1, Ordering::SeqCst) + 1 == self.panic_at {
                panic!("injected reader panic");
            }
            self.bytes.read_at(buf, offset)
        }

        /// Asking for a thread's own reader is a step that may panic too; the reader handed
        /// out panics with this one's reads.
        fn reopen(&self) -> Option<Box<dyn ReadAt + '_>> {
            if self.reads.fetch_add(1, Ordering::SeqCst) + 1 == self.panic_at {
                panic!("injected panic asking for a reader");
            }
            Some(Box::new(Through(self)))
        }
    }

    /// A file of one `u8` tensor of `len` bytes, each byte distinct from its neighbours.
    fn one_tensor(len: usize) -> Vec<u8> {
        let data: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![len], &data).unwrap();
        safetensors::serialize([("t", view)], None::<HashMap<String, String>>).unwrap()
    }

    /// A reader whose threads' first reads at offsets in `gate` each wait until `crew` threads
    /// wait at once, or give up after a while and say so (`missed`).
    struct Gate<'a> {
        bytes: &'a [u8],
        gate: std::ops::Range<u64>,
        crew: usize,
        seen: std::sync::Mutex<std::collections::HashSet<std::thread::ThreadId>>,
        arrived: std::sync::Condvar,
        missed: std::sync::atomic::AtomicBool,
    }

    impl<'a> Gate<'a> {
        fn new(bytes: &'a [u8], gate: std::ops::Range<u64>, crew: usize) -> Self {
            Gate {
                bytes,
                gate,
                crew,
                seen: Default::default(),
                arrived: Default::default(),
                missed: Default::default(),
            }
        }

        /// How many threads came to the gate.
        fn arrivals(&self) -> usize {
            self.seen.lock().unwrap().len()
        }
    }

    impl ReadAt for Gate<'_> {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            let mut seen = self.seen.lock().unwrap();
            if self.gate.contains(&offset) && seen.insert(std::thread::current().id()) {
                self.arrived.notify_all();
                let wait = std::time::Duration::from_secs(10);
                let (seen, timeout) = (self.arrived)
                    .wait_timeout_while(seen, wait, |seen| seen.len() < self.crew)
                    .unwrap();
                drop(seen);
                if timeout.timed_out() {
                    self.missed.store(true, Ordering::SeqCst);
                }
            } else {
                drop(seen);
            }
            self.bytes.read_at(buf, offset)
        }
    }

    #[test]
    fn every_reader_of_the_crew_takes_a_part_of_the_first_slot() {
        // 64 KiB slots, four of them, four readers: the first slot's read is cut into four
        // parts, and each reader takes one, so the four reads of it wait for each other at the
        // gate. Slots read side by side, each by one thread, would leave one read at the gate.
        let bytes = one_tensor(256 << 10);
        let path = Path::new("model.safetensors");
        let len = bytes.len() as u64;
        let tensors = plan(path, &&bytes[..], len, &mut |_| true).unwrap();
        let first = tensors[0].start;
        let file = Gate::new(&bytes, first..first + (64 << 10), 4);
        let (mut engine, sim) = engine_with(64 << 10);
        let staging = given(4 << 16, 4);
        let loaded = load_planned(&mut engine, path, &file, len, &tensors, staging).unwrap();
        assert!(
            !file.missed.load(Ordering::SeqCst),
            "the first slot's read was not shared by the crew"
        );
        assert_eq!(file.arrivals(), 4);
        assert_eq!(
            any_bytes(&mut engine, &loaded[0].1),
            bytes[first as usize..]
        );
        drop(loaded);
        ends_clean(engine, &sim);
    }

    #[test]
    fn a_load_of_a_few_slots_is_cut_into_sixteen_chunks_so_its_copies_start_early() {
        // One 16 MiB tensor through 16 MiB slots: sixteen chunks of 1 MiB, each copied once
        // read, where one slot's worth would be read whole before its one copy.
        let bytes = one_tensor(16 << 20);
        let (mut engine, sim) = engine_with(16 << 20);
        let staging = given(4 << 24, 4);
        let copies = sim.calls(SimOp::CopyHtoD);
        let loaded = load_all_with(&mut engine, &&bytes[..], bytes.len() as u64, staging).unwrap();
        assert_eq!(sim.calls(SimOp::CopyHtoD) - copies, 16);
        assert_eq!(
            any_bytes(&mut engine, &loaded[0].1),
            bytes[bytes.len() - (16 << 20)..]
        );
        // A load of many slots' worth keeps whole slots.
        assert_eq!(chunk_bytes(16 << 20, 8 << 30), 16 << 20);
        assert_eq!(chunk_bytes(16 << 20, 64 << 20), 4 << 20);
        assert_eq!(chunk_bytes(4096, 64 << 20), 4096);
        drop(loaded);
        ends_clean(engine, &sim);
    }

    #[test]
    fn a_load_runs_its_default_readers_fewer_for_a_few_slots_and_a_given_count_as_given() {
        // The first 512 columns of a u8 tensor of 1024 columns, a run of 512 bytes per row,
        // through 64 KiB slots, eight at once. Each reader's first read waits until as many
        // readers wait as the load should run, and no more ever read: `DEFAULT_READERS` for
        // 2048 rows (sixteen slots' worth), `SMALL_LOAD_READERS` for 1024, and a count given by
        // the setting as given.
        for (rows, given, crew) in [
            (2048, None, DEFAULT_READERS),
            (1024, None, SMALL_LOAD_READERS),
            (2048, Some(4), 4),
        ] {
            let data: Vec<u8> = (0..rows * 1024).map(|i| (i * 7 % 253) as u8).collect();
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::U8,
                vec![rows, 1024],
                &data,
            )
            .unwrap();
            let bytes =
                safetensors::serialize([("w", view)], None::<HashMap<String, String>>).unwrap();
            let path = Path::new("model.safetensors");
            let len = bytes.len() as u64;
            let planned = plan(path, &&bytes[..], len, &mut |_| true).unwrap();
            let mut columns =
                |_: &str, _: &[usize]| Ok(crate::routes::checkpoint::Slice::Columns(0..512));
            let tensors = crate::routes::checkpoint::slice::apply(planned, &mut columns).unwrap();
            // The data: past the prefix and the header, short of the length's probe.
            let file = Gate::new(&bytes, 8 + 64..len - 1, crew);
            let (mut engine, sim) = engine_with(64 << 10);
            let staging = Staging {
                bytes: 8 << 16,
                threads: given.unwrap_or(DEFAULT_READERS),
                given: given.is_some(),
                direct: false,
            };
            let loaded = load_planned(&mut engine, path, &file, len, &tensors, staging).unwrap();
            let what = format!("{rows} rows, readers {given:?}");
            assert!(
                !file.missed.load(Ordering::SeqCst),
                "{what}: fewer than {crew}"
            );
            assert_eq!(file.arrivals(), crew, "{what}");
            let back = any_bytes(&mut engine, &loaded[0].1);
            let want: Vec<u8> = data
                .chunks(1024)
                .flat_map(|row| row[..512].to_vec())
                .collect();
            assert!(back == want, "{what}");
            drop(loaded);
            ends_clean(engine, &sim);
        }
    }

    #[test]
    fn a_load_starts_its_readers_once_not_per_slot() {
        // Sixteen 64 KiB slots' reads through four slots by eight readers: the threads that read
        // are the crew's eight, whatever the number of slots' reads.
        let bytes = one_tensor(1 << 20);
        let threads = std::sync::Mutex::new(std::collections::HashSet::new());
        struct Counting<'a>(
            &'a [u8],
            &'a std::sync::Mutex<std::collections::HashSet<std::thread::ThreadId>>,
        );
        impl ReadAt for Counting<'_> {
            fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
                self.1.lock().unwrap().insert(std::thread::current().id());
                self.0.read_at(buf, offset)
            }
        }
        let (mut engine, sim) = engine_with(64 << 10);
        let staging = given(4 << 16, 8);
        let file = Counting(&bytes, &threads);
        let loaded = load_all_with(&mut engine, &file, bytes.len() as u64, staging).unwrap();
        // The crew's eight, and the calling thread's reads of the header and the length.
        let readers = threads.lock().unwrap().len();
        assert!(readers <= 8 + 1, "{readers} threads read");
        assert_eq!(
            any_bytes(&mut engine, &loaded[0].1),
            bytes[bytes.len() - (1 << 20)..]
        );
        drop(loaded);
        ends_clean(engine, &sim);
    }

    #[test]
    fn a_load_stopped_before_packed_tensors_are_handed_out_leaves_no_trace_of_them() {
        // 64 KiB slots: the small tensors are packed into one allocation, copied at once, and
        // handed out one by one; the caller refuses the `stop`-th.
        let (bytes, _) = checkpoint();
        let path = Path::new("model.safetensors");
        let file: &dyn ReadAt = &&bytes[..];
        let len = bytes.len() as u64;
        let tensors = plan(path, file, len, &mut |_| true).unwrap();
        let source = Source {
            path,
            file,
            direct: None,
            len,
        };
        for stop in 1..=tensors.len() {
            let (mut engine, sim) = engine_with(64 << 10);
            let values = |engine: &mut CudaEngine| engine.shared.enter().unwrap().order.values();
            let before = values(&mut engine);
            let mut handed = 0;
            let mut each = |_: &mut CudaEngine, _: usize, _: AnyTensor| {
                handed += 1;
                if handed == stop {
                    return Err(Error::Usage(crate::error::UsageError::ZeroLength {
                        what: "the caller's refusal",
                    }));
                }
                Ok(())
            };
            let staging = given(4 << 16, 3);
            let stopped = load(
                &mut engine,
                source,
                &tensors,
                staging,
                &mut Tally::silent(),
                &mut each,
            );
            assert!(
                matches!(stopped, Err(Error::Usage(_))),
                "{stop}: {stopped:?}"
            );
            engine.synchronize().unwrap();
            // Every part's use was folded into its allocation, which was freed after them: the
            // order tracks no value the load made.
            assert_eq!(values(&mut engine), before, "{stop}");
            recovers(engine, &sim, &bytes);
        }
    }

    #[test]
    fn a_reader_that_panics_at_any_read_frees_nothing_under_a_copy() {
        let (bytes, _) = checkpoint();
        // Every read panics in turn (the header's, the chunks' on the readers, the length
        // probes'), until one past the last, which loads: with small slots, and with 64 KiB
        // ones, where the small tensors are packed and read by threads that each ask for a
        // reader of their own (a step that panics in turn too).
        for chunk in [4096, 64 << 10] {
            for panic_at in 1.. {
                let (mut engine, sim) = engine_with(chunk);
                let file = Panicking {
                    bytes: &bytes,
                    panic_at,
                    reads: AtomicUsize::new(0),
                };
                let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    load_all(&mut engine, &file, bytes.len() as u64)
                }));
                if let Ok(loaded) = loaded {
                    assert!(
                        panic_at > 6,
                        "{chunk}: read {panic_at}: the panic did not reach the caller"
                    );
                    assert_eq!(loaded.unwrap().len(), 4);
                    recovers(engine, &sim, &bytes);
                    break;
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
                    Err(e) if !matches!(e, Error::Io(_) | Error::Malformed(_)) => {}
                    // A slot after the first cannot be made: the load goes on with those it has.
                    Ok(loaded) if op == SimOp::HostAlloc && n > 1 => {
                        for (name, _, _, data) in &checkpoint().1 {
                            let (_, t) = loaded.iter().find(|(m, _)| m == name).unwrap();
                            let back = any_bytes(&mut engine, t);
                            assert_eq!(&back, data, "{op:?} call {n}: {name}");
                        }
                    }
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
