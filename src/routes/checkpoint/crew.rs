//! The reader crew of a load: threads started once per load that take the parts of the staging
//! slots' reads in the order the slots were handed out.
//!
//! A slot's read is cut into parts (a range of the slot each: one positioned read, or the runs
//! or pieces that fall in it), and every part goes into one queue. The crew's threads take
//! parts from its front, so the whole crew reads the first slot before it moves on to the next:
//! the first slot's copy is queued while the later slots are still being read, where slots read
//! side by side would all end at once and every copy wait for the last of them. No thread is
//! started per slot: the crew is first the process's copy threads that are idle
//! ([`copy_pool`](crate::sync::copy_pool), threads that are already running), and only the rest
//! is started for the load (the calling thread starts one, and each thread started the next two
//! before it reads).
//!
//! Each part's answer goes back to the calling thread, which queues a slot's copies once the
//! last part of its read is in. The slots themselves stay with the calling thread's pipeline
//! (`load::pipeline`), which holds each from before the hand-out of its first part to the answer
//! of its last, in a table that outlives every thread of the crew, so that not even a panic lets
//! a slot go while a part of it may still be read into.

use super::ReadAt;
use super::header::{self, Entry};
use super::load::{BLOCK, Chunk, Piece, Source};
use crate::dtype::DType;
use crate::error::{Error, IoError, MalformedError};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Mutex, PoisonError};
use std::thread::Scope;

/// The least a part of a slot's read is cut to (four blocks): smaller parts cost more in
/// system calls and answers than they gain in threads.
const MIN_PART: usize = 16 << 10;

/// What a part of a chunk's read reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum What {
    /// File bytes from `offset` on, of which the part needs the first `need` (a direct read
    /// asks for whole blocks, and may end early at the end of the file).
    Span { offset: u64, need: usize },
    /// Bytes `at..` of a slice of columns (offsets into the slice, as the chunk's), read run
    /// by run.
    Runs { at: u64 },
    /// The chunk's pieces `first..first + count`, each into its place.
    Pieces { first: usize, count: usize },
}

/// The parts of `chunk`'s read into a slot of `capacity` bytes (`direct`: through the file
/// opened for direct reads): at most `most`, fewer where parts would be smaller than
/// [`MIN_PART`]. Each is what it reads and the range of the slot it fills; the ranges are
/// disjoint and in slot order.
pub(super) fn cut(
    chunk: &Chunk,
    capacity: usize,
    direct: bool,
    most: usize,
) -> Vec<(What, Range<usize>)> {
    let split = |bytes: usize| (bytes / MIN_PART).clamp(1, most.max(1));
    match (chunk.runs, chunk.group) {
        (Some((origin, runs)), _) => {
            let len = (chunk.end - chunk.start) as usize;
            // Parts of a whole number of runs, so that a part splits no more runs than it must.
            let part = len
                .div_ceil(split(len))
                .next_multiple_of(runs.len as usize)
                .max(1);
            (0..len)
                .step_by(part)
                .map(|lo| {
                    let at = chunk.start - origin + lo as u64;
                    (What::Runs { at }, lo..(lo + part).min(len))
                })
                .collect()
        }
        (None, Some(_)) => {
            let bytes = chunk.pieces.last().map_or(0, |p| p.from + p.len);
            let per = chunk.pieces.len().div_ceil(split(bytes)).max(1);
            // The pieces come in slot order, so the slot splits between the parts.
            let mut taken = 0;
            (chunk.pieces.chunks(per).enumerate())
                .map(|(k, pieces)| {
                    let end = pieces.last().map_or(taken, |p| p.from + p.len);
                    let what = What::Pieces {
                        first: k * per,
                        count: pieces.len(),
                    };
                    let range = taken..end;
                    taken = end;
                    (what, range)
                })
                .collect()
        }
        (None, None) => {
            // The slot's bytes `..want` hold the file's from `base`; a direct read covers whole
            // blocks.
            let base = chunk.start - chunk.skew as u64;
            let want = chunk.skew + (chunk.end - chunk.start) as usize;
            let span = if direct {
                want.next_multiple_of(BLOCK as usize).min(capacity)
            } else {
                want
            };
            let part = span
                .div_ceil(split(span))
                .next_multiple_of(BLOCK as usize)
                .max(1);
            (0..span)
                .step_by(part)
                .map(|lo| {
                    let hi = (lo + part).min(span);
                    let need = want.saturating_sub(lo).min(hi - lo);
                    let offset = base + lo as u64;
                    (What::Span { offset, need }, lo..hi)
                })
                .collect()
        }
    }
}

/// A part of a slot's read as the crew takes it: `what` chunk `chunk` reads into the `len`
/// bytes of its slot at `ptr`, byte `at` of the slot.
pub(super) struct Part {
    pub(super) chunk: usize,
    pub(super) what: What,
    pub(super) at: usize,
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: a part's pointer is into a staging slot's pinned memory, which is not freed while it
// is leased. The pipeline holds the slot's lease, in a table declared before the crew starts,
// from before the part is handed out until its answer comes back, or, should the load end
// early (an error, a panic), until every thread of the crew has returned (the scope of the
// threads started for the load, and the copy pool's `join` for its threads, both wait for them
// before the table is dropped); it touches no byte of the part meanwhile, and the parts of a
// slot are disjoint. So the one thread that takes the part is the only one to reach those
// bytes, wherever it runs.
unsafe impl Send for Part {}

/// A part's answer to the calling thread: its chunk, and how its read went (a panic of the
/// caller's reader caught, so that the load lets go of its slots before it rethrows it).
pub(super) type Answer = (usize, std::thread::Result<Result<(), Error>>);

/// What the crew's threads share: the queue of parts, how many have been taken from it, whether
/// the load has stopped (parts still queued are then answered unread), what they read, and where
/// they answer.
pub(super) struct Crew<'a> {
    queue: Mutex<Receiver<Part>>,
    taken: AtomicUsize,
    stopped: AtomicBool,
    report: Sender<Answer>,
    source: Source<'a>,
    tensors: &'a [Entry],
    chunks: &'a [Chunk],
}

impl<'a> Crew<'a> {
    /// A crew that reads `chunks` of `tensors` from `source`, taking its parts from `queue` and
    /// answering each on `report`.
    pub(super) fn new(
        queue: Receiver<Part>,
        report: Sender<Answer>,
        source: Source<'a>,
        tensors: &'a [Entry],
        chunks: &'a [Chunk],
    ) -> Self {
        Crew {
            queue: Mutex::new(queue),
            taken: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
            report,
            source,
            tensors,
            chunks,
        }
    }

    /// How many parts the crew has taken from its queue so far.
    pub(super) fn taken(&self) -> usize {
        self.taken.load(Ordering::Relaxed)
    }

    /// Tells the crew that the load stopped: the parts still queued are answered unread.
    pub(super) fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
    }

    /// A guard that tells the crew that the load stopped when it is dropped, on return or
    /// unwind.
    pub(super) fn stopper(&self) -> Stopper<'_, 'a> {
        Stopper(self)
    }

    /// Starts the members `have..size` of a crew of `size` in `scope`, the first `have` being
    /// threads that run [`work`](Self::work) already (the process's copy threads): this thread
    /// starts one, and each thread started the next two before it reads. A thread that cannot
    /// be started leaves the crew smaller.
    ///
    /// # Errors
    /// [`IoError::File`] when the crew would have no thread at all: none running, and not even
    /// the first could be started.
    pub(super) fn start<'scope>(
        &'scope self,
        scope: &'scope Scope<'scope, '_>,
        have: usize,
        size: usize,
    ) -> Result<(), Error> {
        let more = size.saturating_sub(have);
        match self.spawn(scope, 0, more) {
            Err(source) if have == 0 => Err(IoError::File {
                path: self.source.path.to_owned(),
                operation: "start a reader thread",
                source,
            }
            .into()),
            _ => Ok(()),
        }
    }

    /// Starts member `me` of the `more` this load starts, if there is one.
    fn spawn<'scope>(
        &'scope self,
        scope: &'scope Scope<'scope, '_>,
        me: usize,
        more: usize,
    ) -> std::io::Result<()> {
        if me >= more {
            return Ok(());
        }
        std::thread::Builder::new()
            .name("cuferry-reader".into())
            .spawn_scoped(scope, move || {
                // A member that cannot be started leaves the crew smaller.
                let _ = self.spawn(scope, 2 * me + 1, more);
                let _ = self.spawn(scope, 2 * me + 2, more);
                self.work();
            })
            .map(drop)
    }

    /// A member's work: read parts until the queue closes.
    pub(super) fn work(&self) {
        let mut own: Own<'_> = None;
        loop {
            // The lock is held only to take a part, never across a read.
            let part = self
                .queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .recv();
            let Ok(part) = part else { break };
            self.taken.fetch_add(1, Ordering::Relaxed);
            let done = if self.stopped.load(Ordering::Relaxed) {
                Ok(Ok(()))
            } else {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    // SAFETY: the part's `len` bytes at `ptr` are this thread's alone until its
                    // answer is sent (see `Part`'s `Send`), and lie within one leased slot.
                    let buf = unsafe { std::slice::from_raw_parts_mut(part.ptr, part.len) };
                    self.read(&part, buf, &mut own)
                }))
            };
            if self.report.send((part.chunk, done)).is_err() {
                break;
            }
        }
    }

    /// Reads `part` into `buf`, its bytes of the slot, and checks the bytes of its `bool`
    /// pieces.
    fn read(&self, part: &Part, buf: &mut [u8], own: &mut Own<'a>) -> Result<(), Error> {
        let source = self.source;
        let chunk = &self.chunks[part.chunk];
        match part.what {
            What::Span { offset, need } => read_part(source, offset, buf, need)?,
            What::Runs { at } => {
                let (origin, runs) = chunk.runs.expect("a part of runs is of a chunk of runs");
                let file = own_reader(own, source.file);
                let mut at = at;
                let mut done = 0;
                while done < buf.len() {
                    let n = ((runs.len - at % runs.len) as usize).min(buf.len() - done);
                    let offset = runs.file_offset(origin, at);
                    header::read_exact_at(source.path, file, offset, &mut buf[done..done + n])?;
                    done += n;
                    at += n as u64;
                }
            }
            What::Pieces { first, count } => {
                let pieces = &chunk.pieces[first..first + count];
                let tensors = self.tensors;
                let at = |p: &Piece| tensors[p.tensor].start + p.at as u64;
                let file = own_reader(own, source.file);
                // Each piece's place in `buf`, cut off in turn (the pieces come in slot order).
                let mut rest = &mut *buf;
                let mut cut = part.at;
                let mut places = pieces.iter().map(|p| {
                    let (_gap, after) = std::mem::take(&mut rest).split_at_mut(p.from - cut);
                    let (place, after) = after.split_at_mut(p.len);
                    rest = after;
                    cut = p.from + p.len;
                    std::io::IoSliceMut::new(place)
                });
                // Pieces that follow each other in the file are read with one vectored read.
                for run in pieces.chunk_by(|a, b| at(a) + a.len as u64 == at(b)) {
                    let mut bufs: Vec<_> = places.by_ref().take(run.len()).collect();
                    header::read_exact_vectored_at(source.path, file, at(&run[0]), &mut bufs)?;
                }
            }
        }
        check_bools(source, self.tensors, chunk, part.at, buf)
    }
}

/// Tells its crew that the load stopped when dropped ([`Crew::stopper`]).
pub(super) struct Stopper<'c, 'a>(&'c Crew<'a>);

impl Drop for Stopper<'_, '_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// A crew member's own reader of the file: not yet asked for, or what [`ReadAt::reopen`] gave.
type Own<'a> = Option<Option<Box<dyn ReadAt + 'a>>>;

/// A crew member's reader: its own of the file, asked for at its first part that reads many
/// small runs or pieces (threads that read many small runs of one open file at once contend on
/// it, [`ReadAt::reopen`]), where the file can give one; else `file`.
fn own_reader<'s, 'a>(own: &'s mut Own<'a>, file: &'a dyn ReadAt) -> &'s dyn ReadAt {
    own.get_or_insert_with(|| file.reopen())
        .as_deref()
        .unwrap_or(file)
}

/// Refuses a part whose `bool` bytes (of `chunk`'s pieces that fall in `buf`, the slot's bytes
/// from `at` on) hold a byte other than 0 or 1.
fn check_bools(
    source: Source<'_>,
    tensors: &[Entry],
    chunk: &Chunk,
    at: usize,
    buf: &[u8],
) -> Result<(), Error> {
    for piece in &chunk.pieces {
        let t = &tensors[piece.tensor];
        if t.dtype != DType::Bool {
            continue;
        }
        let lo = piece.from.max(at);
        let hi = (piece.from + piece.len).min(at + buf.len());
        if lo < hi && buf[lo - at..hi - at].iter().any(|&b| b > 1) {
            return Err(MalformedError::Header {
                path: source.path.to_owned(),
                tensor: Some(t.name.clone()),
                reason: "a bool element is neither 0 nor 1".into(),
            }
            .into());
        }
    }
    Ok(())
}

/// Reads the file from `offset` into `buf`, which needs its first `need` bytes (a direct read
/// asks for all of `buf`, whole blocks, and may end early at the end of the file). A direct read
/// that the file system or the buffer's memory refuses (`EINVAL`) is finished through the page
/// cache.
fn read_part(source: Source<'_>, offset: u64, buf: &mut [u8], need: usize) -> Result<(), Error> {
    let Some(direct) = source.direct else {
        return header::read_exact_at(source.path, source.file, offset, &mut buf[..need]);
    };
    let mut got = 0;
    while got < need {
        match std::os::unix::fs::FileExt::read_at(direct, &mut buf[got..], offset + got as u64) {
            Ok(0) => {
                return Err(MalformedError::ShortRead {
                    path: source.path.to_owned(),
                    offset: offset + got as u64,
                    missing: need - got,
                }
                .into());
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                let rest = &mut buf[got..need];
                return header::read_exact_at(source.path, source.file, offset + got as u64, rest);
            }
            Err(error) => {
                return Err(IoError::File {
                    path: source.path.to_owned(),
                    operation: "read",
                    source: error,
                }
                .into());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::checkpoint::load::tests::layout;
    use crate::routes::checkpoint::load::{chunks, groups};

    proptest::proptest! {
        /// The parts of any chunk are at most `most`, disjoint and in slot order, and between
        /// them read every byte the chunk's read needs once: a span from its first block on, a
        /// slice's runs each byte once, a packed chunk each piece whole in one part.
        #[test]
        fn parts_split_every_chunk_once_within_its_slot(
            sizes in proptest::collection::vec((0u64..3, 1u64..40_000, 0u64..4), 1..10),
            capacity in (64usize << 10)..(200 << 10),
            direct: bool,
            pack: bool,
            most in 1usize..40,
        ) {
            // Tensors in file order, with gaps, some of them slices of columns.
            let tensors = layout(sizes.iter().copied());
            let groups = if pack { groups(&tensors, capacity) } else { Vec::new() };
            for chunk in chunks(&tensors, capacity, direct, &groups) {
                let direct = direct && chunk.runs.is_none();
                let parts = cut(&chunk, capacity, direct, most);
                proptest::prop_assert!(!parts.is_empty() && parts.len() <= most);
                let mut end = 0;
                for (_, range) in &parts {
                    proptest::prop_assert!(range.start == end && range.start < range.end);
                    end = range.end;
                }
                proptest::prop_assert!(end <= capacity);
                match (chunk.runs, chunk.group) {
                    (Some((origin, runs)), _) => {
                        proptest::prop_assert_eq!(end as u64, chunk.end - chunk.start);
                        for (what, range) in &parts {
                            let at = chunk.start - origin + range.start as u64;
                            proptest::prop_assert_eq!(*what, What::Runs { at });
                            // A part splits no run but the chunk's own ends.
                            proptest::prop_assert!((range.start as u64).is_multiple_of(runs.len));
                        }
                    }
                    (None, Some(_)) => {
                        let mut next = 0;
                        for (what, range) in &parts {
                            let What::Pieces { first, count } = *what else {
                                proptest::prop_assert!(false, "{what:?}");
                                unreachable!()
                            };
                            proptest::prop_assert_eq!(first, next);
                            for p in &chunk.pieces[first..first + count] {
                                proptest::prop_assert!(range.start <= p.from && p.from + p.len <= range.end);
                            }
                            next = first + count;
                        }
                        proptest::prop_assert_eq!(next, chunk.pieces.len());
                    }
                    (None, None) => {
                        let base = chunk.start - chunk.skew as u64;
                        let want = chunk.skew + (chunk.end - chunk.start) as usize;
                        let mut needed = 0;
                        for (what, range) in &parts {
                            let What::Span { offset, need } = *what else {
                                proptest::prop_assert!(false, "{what:?}");
                                unreachable!()
                            };
                            proptest::prop_assert_eq!(offset, base + range.start as u64);
                            proptest::prop_assert!(need <= range.len());
                            if direct {
                                proptest::prop_assert_eq!(offset % BLOCK, 0);
                                proptest::prop_assert_eq!(range.start % BLOCK as usize, 0);
                            }
                            needed += need;
                        }
                        proptest::prop_assert_eq!(needed, want);
                        proptest::prop_assert!(end >= want);
                    }
                }
            }
        }
    }
}
