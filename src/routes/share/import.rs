//! The importing side: a [`ShareLink`] to one exporter process, the read-only imports it
//! yields ([`ReadOnly`]) and the exclusive ones (plain [`DeviceTensor`]s, whose drop hands them
//! back).
//!
//! An imported tensor is a `DeviceTensor` of the importing engine whose memory is the
//! exporter's. It carries its import as its home, so wherever it goes, dropping it releases the
//! import: an event recorded after its last use (on every stream) and a release sent, never a
//! free of the exporter's memory. The link keeps the mapping for the next offer of the same
//! tensor (mapping costs far more than an offer), until the exporter asks for it back (it wants
//! to free the memory) or the link goes: then the memory is unmapped stream-ordered, an event
//! recorded after it, and the exporter told. A release that cannot be proven ordered is never
//! sent: its exporter then keeps the memory until this process exits.

use super::export::{SPIN, dtype_code, lock};
use super::wire::{self, Access, Hello, Message, Offer};
use crate::core::engine::{Charge, CudaEngine, Entered, Shared, State};
use crate::core::order::Use;
use crate::driver::share::{Name, Origin};
use crate::driver::{DevicePtr, EventHandle, Lane};
use crate::error::{Error, IoError, MalformedError, PeerError, Result, SetupError, UsageError};
use crate::ledger::Owner;
use crate::memory::element::Element;
use crate::memory::tensor::{DeviceTensor, Home, shape_len};
use crate::sync::deadline::Deadline;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::panic::Location;
use std::path::Path;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// How long a link that goes waits for its exporter to take its last messages.
const LINGER: Duration = Duration::from_secs(10);

/// The most offers a link holds that [`ShareLink::import_read`] and
/// [`ShareLink::import_exclusive`] have not taken yet (the one being taken included). An
/// exporter that sends more is treated as hostile: the link stops reading it and every later
/// import fails with [`MalformedError::OverLimit`].
pub(super) const MAX_WAITING_OFFERS: usize = 4096;

/// The most pool descriptors a link holds at once: the one its exporter sends with its first
/// offer. A second that comes while the link holds one (queued, or kept after a refusal until
/// the pool is imported) closes the link as [`MAX_WAITING_OFFERS`] does; one that comes after
/// the pool's import is closed at once.
const MAX_DESCRIPTORS: usize = 1;

/// The error of a link whose exporter passed a bound.
fn over(what: &'static str, limit: usize) -> Error {
    MalformedError::OverLimit { what, limit }.into()
}

/// A pool descriptor the link holds, counted (in [`Mappings::descriptors`]) while it lives.
struct HeldFd {
    fd: OwnedFd,
    link: Weak<LinkShared>,
}

impl Drop for HeldFd {
    fn drop(&mut self) {
        // Never dropped under the mappings' lock.
        if let Some(link) = self.link.upgrade() {
            let mut mapped = lock(&link.mapped);
            mapped.descriptors = mapped.descriptors.saturating_sub(1);
        }
    }
}

/// An exporter's mapped allocation.
struct Mapping {
    ptr: DevicePtr,
    /// Where `ptr` lies in the exporter's allocation, and the allocation's size, as the driver
    /// measured the mapping: every offer of it must fit.
    offset: u64,
    allocation: u64,
    /// Its export data, which every later offer of it must repeat.
    pointer: Name,
    /// Imports of it alive.
    in_use: usize,
    /// Whether the exporter asked for it back: unmapped once no import is in use.
    unmap: bool,
}

#[derive(Default)]
struct Mappings {
    by_id: HashMap<u64, Mapping>,
    /// Unmap requests for tensors whose offer has not been taken yet: only ids in `queued`
    /// (so at most [`MAX_WAITING_OFFERS`]); a request for anything else holds nothing.
    asked: HashSet<u64>,
    /// Offers the reader has passed on and the link has not finished taking, by tensor.
    queued: HashMap<u64, usize>,
    /// All of them (at most [`MAX_WAITING_OFFERS`]).
    waiting: usize,
    /// Pool descriptors the link holds (queued with an offer, or kept for the pool's import):
    /// at most [`MAX_DESCRIPTORS`].
    descriptors: usize,
    /// Set once the exporter's pool is imported: a descriptor after it is closed at once.
    pool: bool,
    /// The bound the exporter passed, once it has: the link reads it no more.
    hostile: Option<(&'static str, usize)>,
    /// Set once a release or an unmapping could not be proven ordered (the exporter was not
    /// told): the link never says it holds nothing, so the exporter keeps its memory until
    /// this process ends.
    stuck: bool,
    /// Mappings made (or being made) and neither recorded in `by_id` nor released yet: one
    /// that a driver panic left counted is leaked, so the link never says it holds nothing.
    unrecorded: usize,
}

/// The link's end of the socket for writing. A message that did not leave whole (the
/// exporter stopped reading for [`wire::MESSAGE_LIMIT`], the write timeout the link sets) cuts
/// it: the socket's writing side is shut, so no later message runs on from a partial one's
/// bytes, and nothing is written after. The exporter reads a message cut short, and keeps what
/// this link holds until this process ends.
struct Writer {
    stream: UnixStream,
    cut: bool,
}

/// What the link, its reader and every import of it share: the socket, this side's event and
/// the mappings.
struct LinkShared {
    engine: Arc<Shared>,
    writer: Mutex<Writer>,
    /// Set by the reader once the exporter's end is closed: the exporter has taken every
    /// message, and queued every wait for `done` it will queue.
    closed: Arc<(Mutex<bool>, std::sync::Condvar)>,
    /// This importer's event, recorded after each release and unmapping.
    done: EventHandle,
    mapped: Mutex<Mappings>,
}

/// Records `done` on `lane` after the work queued there, or, when the device refuses, waits on
/// the host for every lane instead; `false` when neither proves the work ordered (and the
/// exporter must not be told).
fn record_done(st: &mut State, engine: &Shared, lane: Lane, done: EventHandle) -> bool {
    let Err(source) = st.driver.event_record(lane, done) else {
        return true;
    };
    st.defer(Error::Driver {
        call: "cuEventRecord",
        source,
    });
    host_proves(st, engine)
}

/// Waits on the host for every lane of `engine`, where the device would not order the work:
/// `false` when the wait fails too (and the exporter must not be told).
fn host_proves(st: &mut State, engine: &Shared) -> bool {
    match engine.waits.stream_synchronize() {
        Ok(()) => true,
        Err(source) => {
            st.defer(Error::DeviceFault {
                what: "the last use of an imported tensor",
                source,
            });
            false
        }
    }
}

/// Unmaps `ptr` after every use of it on `st`'s streams and records `done` after that; `false`
/// when it stays mapped or the order cannot be proven (the exporter must not be told).
/// `bytes`: what the ledger counts for the mapping, `None` for one it never counted (refused).
fn unmap(
    st: &mut State,
    engine: &Shared,
    ptr: DevicePtr,
    bytes: Option<u64>,
    done: EventHandle,
) -> bool {
    let charge = bytes.map(|bytes| Charge::new(Owner::Imported, bytes as usize));
    // SAFETY: `ptr` is an import of this driver whose imports are all gone (the caller checked
    // under the mappings' lock), released once (its mapping is removed with it);
    // `free_ordered` orders every use before the release.
    let lane = unsafe {
        st.free_ordered(
            &*engine.waits,
            ptr,
            charge,
            "cuMemFreeAsync",
            |driver, lane| driver.release_import(lane, ptr),
        )
    };
    lane.is_some_and(|lane| record_done(st, engine, lane, done))
}

impl LinkShared {
    /// Counts an offer of tensor `id` that the reader passes on, with the descriptor that came
    /// with it (closed at once after the pool's import); the bound it passes, if any.
    fn admit(&self, id: u64, fd: Option<OwnedFd>) -> Result<Option<OwnedFd>, Error> {
        let mut mapped = lock(&self.mapped);
        if mapped.waiting >= MAX_WAITING_OFFERS {
            return Err(over("offers waiting to be taken", MAX_WAITING_OFFERS));
        }
        let fd = match fd {
            Some(_) if mapped.pool => None,
            Some(_) if mapped.descriptors >= MAX_DESCRIPTORS => {
                return Err(over("pool descriptors held", MAX_DESCRIPTORS));
            }
            Some(fd) => {
                mapped.descriptors += 1;
                Some(fd)
            }
            None => None,
        };
        mapped.waiting += 1;
        *mapped.queued.entry(id).or_default() += 1;
        Ok(fd)
    }

    /// An offer of tensor `id` is taken (imported or refused): an unmap request for it that
    /// its import did not take is forgotten with the last one.
    fn taken(&self, id: u64) {
        let mut mapped = lock(&self.mapped);
        mapped.waiting = mapped.waiting.saturating_sub(1);
        if let Some(n) = mapped.queued.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                mapped.queued.remove(&id);
                if !mapped.by_id.contains_key(&id) {
                    mapped.asked.remove(&id);
                }
            }
        }
    }

    /// Sends `message` to the exporter, waiting at most [`wire::MESSAGE_LIMIT`] for it to
    /// make room. Nothing is sent once the writer is cut ([`Writer`]): what the exporter was
    /// not told it keeps until this process ends.
    ///
    /// # Errors
    /// [`PeerError::TimedOut`] when the exporter does not take the message within the limit
    /// (the writer is cut); [`IoError::Socket`] when the socket refuses it otherwise (cut too).
    fn send(&self, message: &Message) -> Result<()> {
        let mut writer = lock(&self.writer);
        if writer.cut {
            return Ok(());
        }
        let error = match wire::send(&mut writer.stream, message, None) {
            Ok(()) => return Ok(()),
            // The exporter has gone: it holds nothing to release any more.
            Err(Error::Io(IoError::Socket { source, .. }))
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                return Ok(());
            }
            // The socket's write timeout (`EAGAIN` once `SO_SNDTIMEO` passes).
            Err(Error::Io(IoError::Socket { source, .. }))
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                PeerError::TimedOut {
                    what: "a message to the exporter (it stopped reading)",
                    within: wire::MESSAGE_LIMIT,
                }
                .into()
            }
            Err(error) => error,
        };
        // Part of the message may have left: nothing may follow it.
        writer.cut = true;
        let _ = writer.stream.shutdown(std::net::Shutdown::Write);
        Err(error)
    }

    /// The exporter asks for tensor `id` back: unmapped now when no import of it is in use,
    /// else when the last one is released.
    fn unmap_asked(&self, id: u64) {
        let Ok(mut st) = self.engine.enter() else {
            // Left mapped; the link's drop unmaps it.
            return;
        };
        let mut mapped = lock(&self.mapped);
        let queued = mapped.queued.contains_key(&id);
        let told = match mapped.by_id.get_mut(&id) {
            Some(m) if m.in_use > 0 => {
                m.unmap = true;
                false
            }
            Some(m) => {
                let (ptr, bytes) = (m.ptr, m.allocation);
                mapped.by_id.remove(&id);
                let told = unmap(&mut st, &self.engine, ptr, Some(bytes), self.done);
                mapped.stuck |= !told;
                told
            }
            // An offer not taken yet: unmapped once it is mapped and released.
            None if queued => {
                mapped.asked.insert(id);
                false
            }
            // Nothing this link maps or will map (refused, or never offered): nothing to do,
            // and nothing held.
            None => false,
        };
        drop((mapped, st));
        if told && let Err(error) = self.send(&Message::Unmapped { id }) {
            self.engine.lock().defer(error);
        }
    }
}

impl Drop for LinkShared {
    fn drop(&mut self) {
        // No import is alive (each holds the link): every mapping is unmapped and the exporter
        // told, then this side's event waited for (so the exporter's waits on it see it
        // complete) and destroyed.
        let Some(mut st) = self.engine.enter_for_drop() else {
            return;
        };
        let (mappings, stuck) = {
            let mut mapped = lock(&self.mapped);
            (
                std::mem::take(&mut mapped.by_id),
                mapped.stuck || mapped.unrecorded > 0,
            )
        };
        let mut all_told = !stuck;
        let mut told = Vec::new();
        for (id, m) in mappings {
            if unmap(&mut st, &self.engine, m.ptr, Some(m.allocation), self.done) {
                told.push(id);
            } else {
                all_told = false;
            }
        }
        drop(st);
        for id in told {
            let _ = self.send(&Message::Unmapped { id });
        }
        // A goodbye says this process holds nothing: never sent while it may.
        if all_told {
            let _ = self.send(&Message::Goodbye);
        }
        // The exporter waits on the device for `done` as it takes each message: the event is
        // destroyed only once it has closed its end (it has taken them all), or its process
        // has gone; an exporter that does not answer in time leaves the event alive.
        let _ = lock(&self.writer)
            .stream
            .shutdown(std::net::Shutdown::Write);
        let (closed, changed) = &*self.closed;
        let (closed, _) = changed
            .wait_timeout_while(lock(closed), LINGER, |closed| !*closed)
            .unwrap_or_else(|e| e.into_inner());
        if *closed
            && self.engine.waits.event_synchronize(self.done).is_ok()
            && let Some(mut st) = self.engine.enter_for_drop()
        {
            // SAFETY: the link's own event, destroyed once, after its last record completed and
            // after the exporter queued its last wait for it.
            let _ = unsafe { st.driver.event_destroy(self.done) };
        }
        drop(closed);
        let _ = lock(&self.writer).stream.shutdown(std::net::Shutdown::Both);
    }
}

/// One import's home: what a dropped imported tensor does instead of a free.
struct Import {
    link: Arc<LinkShared>,
    id: u64,
}

impl Home for Import {
    fn drop_memory(&self, owner: &Arc<Shared>, ptr: DevicePtr) {
        let link = &self.link;
        // Left in use (and the exporter never told) when the context cannot be entered: the
        // exporter keeps its memory until this process exits.
        let Some(mut st) = owner.enter_for_drop() else {
            return;
        };
        let mut mapped = lock(&link.mapped);
        let Some(m) = mapped.by_id.get_mut(&self.id) else {
            return;
        };
        m.in_use -= 1;
        let unmapping = m.in_use == 0 && m.unmap;
        let bytes = m.allocation;
        let told = if unmapping {
            mapped.by_id.remove(&self.id);
            unmap(&mut st, owner, ptr, Some(bytes), link.done)
        } else {
            // The compute stream follows every use on the others, and the event covers it.
            match st.order_uses(Lane::Compute, &[Use::Write(ptr)]) {
                Ok(()) => record_done(&mut st, owner, Lane::Compute, link.done),
                Err(refused) => {
                    st.defer(refused);
                    host_proves(&mut st, owner)
                }
            }
        };
        mapped.stuck |= !told;
        drop((mapped, st));
        if !told {
            return;
        }
        let id = self.id;
        let mut sent = link.send(&Message::Release { id });
        if unmapping && sent.is_ok() {
            sent = link.send(&Message::Unmapped { id });
        }
        if let Err(error) = sent {
            owner.lock().defer(error);
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A tensor another process shares read-only: this engine reads it (it dereferences to a
/// [`DeviceTensor`]) and cannot write it. Dropping it releases the import.
///
/// ```compile_fail
/// fn write(engine: &mut cuferry::CudaEngine, weights: &mut cuferry::share::ReadOnly<f32>) {
///     engine.fill(&mut *weights, 0.0).unwrap(); // a read-only import cannot be written
/// }
/// ```
pub struct ReadOnly<T: Element> {
    tensor: DeviceTensor<T>,
}

impl<T: Element> std::fmt::Debug for ReadOnly<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReadOnly").field(&self.tensor).finish()
    }
}

impl<T: Element> std::ops::Deref for ReadOnly<T> {
    type Target = DeviceTensor<T>;
    fn deref(&self) -> &DeviceTensor<T> {
        &self.tensor
    }
}

/// An offer as the reader hands it over, or why none comes.
type Incoming = std::result::Result<(Box<Offer>, Option<HeldFd>), Error>;

/// The importing side's connection to one exporter process.
///
/// Offers arrive in the order the exporter made them; [`import_read`](Self::import_read) and
/// [`import_exclusive`](Self::import_exclusive) take the next one. A thread of the link's own
/// reads the socket, so an exporter's request to unmap memory it wants to free is answered at
/// once. The link may be dropped while imports of it live: they keep what they need to release
/// themselves, and the last one unmaps what the link mapped.
///
/// What an exporter can make the link hold is bounded: at most 4096 offers waiting to be taken
/// (the one being taken included) and one pool descriptor (a descriptor that comes after the
/// pool's import is closed at once); an unmap request holds something only for an offer still
/// waiting. An exporter past a bound is hostile: the link stops reading it, closes the socket,
/// and every later import fails with [`MalformedError::OverLimit`], naming the bound.
///
/// What the link writes to its exporter (releases, unmappings, refusals) waits at most 10 s
/// for the exporter to make room (the socket's write timeout, as on the exporter's side). An
/// exporter that stops reading longer is cut off: the send fails with
/// [`PeerError::TimedOut`] (reported at the engine's next boundary where a drop sent it),
/// the link writes nothing more, and the exporter keeps what it was not told of until this
/// process ends.
pub struct ShareLink {
    link: Arc<LinkShared>,
    offers: Receiver<Incoming>,
    /// How long an import waits for an offer (`Duration::MAX`: for ever).
    timeout: Duration,
    /// The exporter's process and device, from its first offer, and its pool, imported then.
    exporter: Option<(Origin, [u8; 16], u64)>,
    /// Who the kernel says is at the socket's other end, which the first offer's origin must
    /// name; `None` for a channel this process made itself (the caller vouches for it).
    peer: Option<wire::Peer>,
    /// The users besides this process's that may export to it ([`allow_uid`](Self::allow_uid)).
    allowed: Vec<u32>,
    /// The exporter's event, opened, and its handle.
    ready: Option<(EventHandle, Name)>,
    /// The pool's descriptor, kept from an offer refused before the pool was imported, for the
    /// next offer's import (the exporter sends it once).
    pending: Option<HeldFd>,
}

impl std::fmt::Debug for ShareLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShareLink")
            .field("exporter_pid", &self.exporter_pid())
            .finish()
    }
}

/// The link's reader: offers to the link, unmap requests answered, until the socket ends.
fn read(
    reader: UnixStream,
    link: Weak<LinkShared>,
    offers: Sender<Incoming>,
    closed: Arc<(Mutex<bool>, std::sync::Condvar)>,
) {
    read_until_end(reader, link, offers);
    let (closed, changed) = &*closed;
    *lock(closed) = true;
    changed.notify_all();
}

fn read_until_end(mut reader: UnixStream, link: Weak<LinkShared>, offers: Sender<Incoming>) {
    loop {
        let next = match wire::recv(&mut reader) {
            Ok((Message::Offer(offer), fd)) => {
                let Some(shared) = link.upgrade() else {
                    // The link and its imports are gone: no one takes it.
                    continue;
                };
                match shared.admit(offer.id, fd) {
                    Ok(fd) => Ok((
                        offer,
                        fd.map(|fd| HeldFd {
                            fd,
                            link: Weak::clone(&link),
                        }),
                    )),
                    Err(bound) => {
                        // A hostile exporter: read no more of it, close the socket, and fail
                        // every later import.
                        if let Error::Malformed(MalformedError::OverLimit { what, limit }) = bound {
                            lock(&shared.mapped).hostile = Some((what, limit));
                        }
                        let _ = reader.shutdown(std::net::Shutdown::Both);
                        let _ = offers.send(Err(bound));
                        return;
                    }
                }
            }
            Ok((Message::Unmap { id }, _)) => {
                // When the link is gone, its drop unmaps everything (and waits for the end).
                if let Some(link) = link.upgrade() {
                    link.unmap_asked(id);
                }
                continue;
            }
            Ok(_) => Err(MalformedError::Sharing {
                reason: "a message an exporter does not send".into(),
            }
            .into()),
            Err(error) => Err(error),
        };
        let end = next.is_err();
        if let Err(unsent) = offers.send(next)
            && let Ok((offer, fd)) = unsent.0
            && let Some(link) = link.upgrade()
        {
            drop(fd);
            link.taken(offer.id);
            // The link is gone while imports of it live: no one takes the offer.
            let mapped = lock(&link.mapped).by_id.contains_key(&offer.id);
            let refusal = Message::Refuse {
                id: offer.id,
                mapped,
                reason: "the link was dropped".into(),
            };
            let _ = link.send(&refusal);
        }
        if end {
            return;
        }
    }
}

impl ShareLink {
    /// Connects to the exporter listening at `path` ([`ShareListener`](super::ShareListener)),
    /// for `engine` to import into.
    ///
    /// # Errors
    /// [`IoError::Socket`] when the socket cannot be reached; as
    /// [`from_stream`](Self::from_stream).
    pub fn connect(engine: &mut CudaEngine, path: impl AsRef<Path>) -> Result<Self> {
        Self::connect_greeting(engine, path.as_ref(), |_| {})
    }

    /// Connects to the exporter at `path` and greets it, the greeting first passed to `forge`
    /// (which changes nothing but in a test's liar).
    fn connect_greeting(
        engine: &mut CudaEngine,
        path: &Path,
        forge: impl FnOnce(&mut Hello),
    ) -> Result<Self> {
        let stream = UnixStream::connect(path).map_err(|source| {
            Error::Io(IoError::Socket {
                operation: "connect",
                source,
            })
        })?;
        let peer = wire::peer(&stream)?;
        Self::greet(engine, stream, Some(peer), forge)
    }

    /// A test's liar: [`connect`](Self::connect), with a greeting whose pid, start time or
    /// user id is `forge`'s instead of this process's. Only the `sim` feature has it.
    #[cfg(feature = "sim")]
    #[doc(hidden)]
    pub fn connect_claiming(
        engine: &mut CudaEngine,
        path: impl AsRef<Path>,
        pid: Option<u32>,
        start: Option<u64>,
        uid: Option<u32>,
    ) -> Result<Self> {
        Self::connect_greeting(engine, path.as_ref(), |hello| {
            hello.origin.pid = pid.unwrap_or(hello.origin.pid);
            hello.origin.start = start.unwrap_or(hello.origin.start);
            hello.uid = uid.unwrap_or(hello.uid);
        })
    }

    /// Lets an exporter of user `uid` share with this link, besides this process's own user
    /// (the default, and the only one otherwise): checked, with the exporter's process, against
    /// the kernel's word (`SO_PEERCRED`) when its first offer comes.
    pub fn allow_uid(&mut self, uid: u32) {
        self.allowed.push(uid);
    }

    /// Greets the exporter on `stream`, a channel the caller brought: says who this process is,
    /// its device, and the event it records after each release.
    ///
    /// What is trusted: the kernel names the process at the other end of a Unix socket
    /// (`SO_PEERCRED`), and the exporter's first offer must name that process and a user this
    /// link allows, as for [`connect`](Self::connect). A channel this process made itself (a
    /// socket pair, made before a fork) names this process at both ends, so the kernel cannot
    /// say who holds the other: the caller vouches for it (it chose who got that end), and only
    /// the offers' own checks (host, boot, a live process) apply.
    ///
    /// The link sets the socket's write timeout (10 s; see [`ShareLink`]).
    ///
    /// # Errors
    /// [`SetupError::Identity`] when this process cannot be named; [`Error::Driver`] when the
    /// event cannot be made; [`IoError::Socket`] when the socket refuses, or is not a connected
    /// Unix socket the kernel names a peer for.
    pub fn from_stream(engine: &mut CudaEngine, stream: UnixStream) -> Result<Self> {
        let peer = wire::peer(&stream)?;
        let peer = (peer.pid != std::process::id()).then_some(peer);
        Self::greet(engine, stream, peer, |_| {})
    }

    /// Greets the exporter on `stream`, whose other end the kernel says is `peer`, with the
    /// greeting `forge` leaves.
    fn greet(
        engine: &mut CudaEngine,
        stream: UnixStream,
        peer: Option<wire::Peer>,
        forge: impl FnOnce(&mut Hello),
    ) -> Result<Self> {
        let io = |operation| move |source| Error::Io(IoError::Socket { operation, source });
        // An exporter that stops reading holds no send of this link for long: a write that
        // finds no room within the limit fails, and cuts the link's writing (see `Writer`).
        stream
            .set_write_timeout(Some(wire::MESSAGE_LIMIT))
            .map_err(io("setsockopt"))?;
        let reader = stream.try_clone().map_err(io("dup"))?;
        let (done, hello) = {
            let mut st = engine.enter()?;
            let origin = st.driver.process()?;
            let device = st.driver.uuid();
            let (done, event) = st
                .driver
                .ipc_event_create()
                .map_err(Error::driver("cuIpcGetEventHandle"))?;
            (
                done,
                Hello {
                    origin,
                    uid: wire::own_uid(),
                    device,
                    event,
                },
            )
        };
        let mut hello = hello;
        forge(&mut hello);
        // From here the link owns the event (its drop destroys it).
        let closed = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let link = Arc::new(LinkShared {
            engine: Arc::clone(&engine.shared),
            writer: Mutex::new(Writer { stream, cut: false }),
            closed: Arc::clone(&closed),
            done,
            mapped: Mutex::new(Mappings::default()),
        });
        wire::send(
            &mut lock(&link.writer).stream,
            &Message::Hello(Box::new(hello)),
            None,
        )?;
        let (tx, offers) = channel();
        let weak = Arc::downgrade(&link);
        std::thread::Builder::new()
            .name("cuferry-share-link".into())
            .spawn(move || read(reader, weak, tx, closed))
            .map_err(io("spawn"))?;
        Ok(ShareLink {
            link,
            offers,
            timeout: Duration::MAX,
            exporter: None,
            peer,
            allowed: Vec::new(),
            ready: None,
            pending: None,
        })
    }

    /// The exporter's process id, once its first offer has come.
    pub fn exporter_pid(&self) -> Option<u32> {
        self.exporter.map(|(origin, _, _)| origin.pid)
    }

    /// How long [`import_read`](Self::import_read) and
    /// [`import_exclusive`](Self::import_exclusive) wait for an offer: one deadline for each
    /// wait, from its start (`Duration::MAX`, the default: for ever).
    #[must_use]
    pub fn with_timeout(mut self, within: Duration) -> Self {
        self.timeout = within;
        self
    }

    /// Takes the next offer, a read-only share, into `engine`: its reads on every stream run
    /// after the exporter's writes queued before the offer (the streams wait for the exporter's
    /// event on the device; the host does not wait).
    ///
    /// # Errors
    /// Each refusal is told to the exporter and maps nothing:
    /// [`UsageError::OfferAccess`] for an exclusive hand-off; [`UsageError::OfferElementType`] for another
    /// element type; [`MalformedError::Sharing`] for an offer whose shape and size disagree, whose
    /// shape is empty or overflows this host's sizes, that names a mapped tensor by other export
    /// data, or of another exporter than the link's first (or without the pool's descriptor,
    /// when no offer brought it yet); [`MalformedError::PastAllocation`] for an offer whose size
    /// does not fit the allocation it maps, as the driver measures the mapping (the size never
    /// comes from the offer: a new mapping is released again, stream-ordered, and the exporter
    /// told); [`PeerError::OtherUser`] or [`MalformedError::PeerIdentity`] for a first offer
    /// whose exporter is of a user not allowed ([`allow_uid`](Self::allow_uid)) or is not the
    /// process the kernel reports at the socket's other end; [`SetupError::OtherHost`],
    /// [`SetupError::OtherBoot`], [`PeerError::ProcessGone`] for a handle of another host, boot
    /// or an exited process; [`SetupError::UnreachableDevice`] for a device this engine cannot reach;
    /// [`Error::Driver`] when the driver refuses the pool, the pointer or the event (a forged
    /// handle), or cannot measure the mapping (`cuMemGetAddressRange`: the mapping is never
    /// used, and is released as for [`MalformedError::PastAllocation`]). A refusal leaves the
    /// link as it was: the next offer is taken as if the refused one had not come (the pool's
    /// descriptor, which comes once, is kept until the pool is imported). When no offer comes:
    /// [`IoError::Socket`] (of kind `TimedOut` past the [timeout](Self::with_timeout)),
    /// [`PeerError::Closed`] or [`MalformedError::Sharing`] (a message that is not the protocol
    /// ends the link); [`MalformedError::OverLimit`] once the exporter has passed a bound (see
    /// [`ShareLink`]), for this import and every later one.
    pub fn import_read<T: Element>(&mut self, engine: &mut CudaEngine) -> Result<ReadOnly<T>> {
        let tensor = self.import(engine, Access::Read)?;
        Ok(ReadOnly { tensor })
    }

    /// Takes the next offer, an exclusive hand-off, into `engine`, as a tensor of its own to
    /// read and write: its uses run after the exporter's queued before the hand-off. Dropping
    /// the tensor hands it back, after its writes.
    ///
    /// # Errors
    /// As [`import_read`](Self::import_read), with [`UsageError::OfferAccess`] for a read-only share.
    pub fn import_exclusive<T: Element>(
        &mut self,
        engine: &mut CudaEngine,
    ) -> Result<DeviceTensor<T>> {
        self.import(engine, Access::Exclusive)
    }

    fn next_offer(&self) -> Result<(Box<Offer>, Option<HeldFd>)> {
        let hostile = lock(&self.link.mapped).hostile;
        if let Some((what, limit)) = hostile {
            // Offers still queued are never taken: their descriptors close as they drop.
            while self.offers.try_recv().is_ok() {}
            return Err(over(what, limit));
        }
        // One deadline for the whole wait, the spin included.
        let deadline = Deadline::after(self.timeout);
        // An offer that comes within a few tens of microseconds is met without a sleep.
        let spin = Deadline::after(SPIN).min(deadline);
        while !spin.expired() {
            match self.offers.try_recv() {
                Ok(incoming) => return incoming,
                Err(std::sync::mpsc::TryRecvError::Empty) => std::thread::yield_now(),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    return Err(Error::Peer(PeerError::Closed));
                }
            }
        }
        let next = match deadline.remaining() {
            None => self.offers.recv().map_err(|_| PeerError::Closed.into()),
            Some(within) => self.offers.recv_timeout(within).map_err(|e| match e {
                RecvTimeoutError::Timeout => IoError::Socket {
                    operation: "read",
                    source: std::io::ErrorKind::TimedOut.into(),
                }
                .into(),
                RecvTimeoutError::Disconnected => PeerError::Closed.into(),
            }),
        };
        next.and_then(|incoming| incoming)
    }

    fn import<T: Element>(
        &mut self,
        engine: &mut CudaEngine,
        access: Access,
    ) -> Result<DeviceTensor<T>> {
        let (offer, fd) = self.next_offer()?;
        let checked = self.check::<T>(engine, access, &offer, fd);
        let mapped = checked
            .map_err(|error| (error, false))
            .and_then(|(pool, ready)| self.map::<T>(engine, &offer, pool, ready));
        self.link.taken(offer.id);
        mapped.map_err(|(error, told)| {
            if told {
                // Mapped and released again: the release told the exporter.
                return error;
            }
            // Nothing of the offer is in use: the exporter counts it as ended.
            let refusal = Message::Refuse {
                id: offer.id,
                mapped: lock(&self.link.mapped).by_id.contains_key(&offer.id),
                reason: error.to_string(),
            };
            let _ = self.link.send(&refusal);
            error
        })
    }

    /// Checks `offer` against what was asked for, and imports the exporter's pool and opens
    /// its event when they are new: returns the pool and the event, for [`map`](Self::map).
    fn check<T: Element>(
        &mut self,
        engine: &mut CudaEngine,
        access: Access,
        offer: &Offer,
        fd: Option<HeldFd>,
    ) -> Result<(u64, EventHandle)> {
        // Kept until the pool is imported, whatever this offer's fate: the exporter sends it
        // once, with its first offer. One that comes after the import is closed.
        if let Some(fd) = fd
            && self.exporter.is_none()
        {
            self.pending = Some(fd);
        }
        let name = |a| match a {
            Access::Read => "read-only",
            Access::Exclusive => "exclusive",
        };
        if offer.access != access {
            return Err(Error::Usage(UsageError::OfferAccess {
                expected: name(access),
                offered: name(offer.access),
            }));
        }
        if offer.dtype != dtype_code(T::DTYPE) {
            return Err(Error::Usage(UsageError::OfferElementType {
                expected: T::DTYPE,
                offered: crate::DType::ALL.get(usize::from(offer.dtype)).copied(),
            }));
        }
        let garbage = |reason: String| Error::Malformed(MalformedError::Sharing { reason });
        let (shape, len) = shape_of(offer)?;
        if len == 0 || len.checked_mul(T::DTYPE.size_bytes()) != usize::try_from(offer.bytes).ok() {
            return Err(garbage(format!(
                "an offer of shape {shape:?} in {} bytes",
                offer.bytes
            )));
        }
        let mut st = engine.enter()?;
        let pool = match self.exporter {
            // The link's exporter, checked with its first offer; a later one can come only
            // while it lives (its end of the socket closes with it).
            Some((origin, device, pool)) if origin == offer.origin && device == offer.device => {
                pool
            }
            Some(_) => {
                return Err(garbage(
                    "an offer of another exporter than the link's first".into(),
                ));
            }
            None => {
                // The exporter is who the kernel says is at the socket's other end.
                if let Some(peer) = self.peer {
                    super::export::check_user(peer.uid, &self.allowed)?;
                    st.driver.check_peer(&offer.origin, peer.pid)?;
                }
                let here = st.driver.process()?;
                let ended = st.driver.process_ended(&offer.origin);
                offer.origin.check(&here, ended)?;
                if !st
                    .driver
                    .reaches(&offer.device)
                    .map_err(Error::driver("cuDeviceCanAccessPeer"))?
                {
                    return Err(Error::Setup(SetupError::UnreachableDevice {
                        uuid: offer.device,
                    }));
                }
                let Some(fd) = &self.pending else {
                    return Err(garbage(
                        "a link's first offer without the pool's descriptor".into(),
                    ));
                };
                let imported = st.driver.import_pool(fd.fd.as_raw_fd(), &offer.device);
                // Imported or refused (a descriptor that names no pool), it has done its part;
                // a later offer may bring another while none is imported.
                let fd = self.pending.take();
                let pool = imported.map_err(Error::driver("cuMemPoolImportFromShareableHandle"));
                if pool.is_ok() {
                    lock(&self.link.mapped).pool = true;
                }
                drop(fd);
                let pool = pool?;
                self.exporter = Some((offer.origin, offer.device, pool));
                pool
            }
        };
        let ready = match self.ready {
            Some((event, name)) if name == offer.event => event,
            _ => {
                let event = st
                    .driver
                    .ipc_event_open(&offer.event)
                    .map_err(Error::driver("cuIpcOpenEventHandle"))?;
                if let Some((old, _)) = self.ready.replace((event, offer.event)) {
                    // SAFETY: opened by this link, closed once; its waits captured their record.
                    let _ = unsafe { st.driver.ipc_event_close(old) };
                }
                event
            }
        };
        Ok((pool, ready))
    }

    /// Refuses the offer of tensor `id`, just mapped at `ptr`, for `error`: the mapping is
    /// released stream-ordered (never used), then the exporter is told, with the engine left
    /// (a send may wait for the exporter): the refusal says it is mapped, and an unmapping
    /// follows once the release is proven ordered (else the link never says it holds
    /// nothing, and the exporter keeps the memory until this process ends).
    fn refuse_mapped(
        &self,
        mut st: Entered<'_>,
        engine: &Shared,
        id: u64,
        ptr: DevicePtr,
        error: &Error,
    ) {
        let told = unmap(&mut st, engine, ptr, None, self.link.done);
        {
            let mut mapped = lock(&self.link.mapped);
            mapped.stuck |= !told;
            // Released (or its release queued), or left stuck: no longer unrecorded.
            mapped.unrecorded -= 1;
        }
        drop(st);
        let refusal = Message::Refuse {
            id,
            mapped: true,
            reason: error.to_string(),
        };
        if self.link.send(&refusal).is_ok() && told {
            let _ = self.link.send(&Message::Unmapped { id });
        }
    }

    /// Maps a checked offer (or takes its mapping, when the link still has it) and orders
    /// every stream of `engine` after the exporter's writes. A failure says whether the import
    /// was made and released again (its release told the exporter).
    fn map<T: Element>(
        &mut self,
        engine: &mut CudaEngine,
        offer: &Offer,
        pool: u64,
        ready: EventHandle,
    ) -> Result<DeviceTensor<T>, (Error, bool)> {
        let untold = |error| (error, false);
        let (shape, len) = shape_of(offer).map_err(untold)?;
        let shared = Arc::clone(&engine.shared);
        let mut st = shared.enter().map_err(untold)?;
        let mut mapped = lock(&self.link.mapped);
        let ptr = match mapped.by_id.get_mut(&offer.id) {
            Some(m) if m.pointer == offer.pointer => {
                // The mapping kept from an earlier offer: this one must fit it too (a relay may
                // have rewritten it).
                fits(offer.bytes, m.offset, m.allocation).map_err(untold)?;
                m.in_use += 1;
                m.ptr
            }
            Some(_) => {
                return Err(untold(Error::Malformed(MalformedError::Sharing {
                    reason: "an offer that names a mapped tensor by other export data".into(),
                })));
            }
            None => {
                // A driver panic from here until the mapping is recorded or released leaks
                // it, counted: the link then never says it holds nothing.
                mapped.unrecorded += 1;
                // SAFETY: the exporter keeps the allocation until this link's unmapping of it
                // reaches it, and the mapping made here is unmapped exactly once (its entry
                // goes with it).
                let imported = unsafe { st.driver.import_pointer(pool, &offer.pointer) };
                let ptr = imported.map_err(|source| {
                    mapped.unrecorded -= 1;
                    untold(Error::Driver {
                        call: "cuMemPoolImportPointer",
                        source,
                    })
                })?;
                // The true size, from the driver: the offer's own word is never trusted for it.
                let measured = st
                    .driver
                    .address_range(ptr)
                    .map_err(Error::driver("cuMemGetAddressRange"))
                    .and_then(|(base, size)| {
                        let offset = ptr.checked_sub(base).unwrap_or(u64::MAX);
                        let size = size as u64;
                        fits(offer.bytes, offset, size).map(|()| (offset, size))
                    });
                let (offset, allocation) = match measured {
                    Ok(measured) => measured,
                    Err(error) => {
                        drop(mapped);
                        self.refuse_mapped(st, &shared, offer.id, ptr, &error);
                        return Err((error, true));
                    }
                };
                let unmap = mapped.asked.remove(&offer.id);
                mapped.unrecorded -= 1;
                // Counted as the allocation the driver measured: what the mapping holds.
                st.ledger
                    .allocated(Owner::Imported, allocation as usize, Location::caller());
                mapped.by_id.insert(
                    offer.id,
                    Mapping {
                        ptr,
                        offset,
                        allocation,
                        pointer: offer.pointer,
                        in_use: 1,
                        unmap,
                    },
                );
                ptr
            }
        };
        drop(mapped);
        let import = Arc::new(Import {
            link: Arc::clone(&self.link),
            id: offer.id,
        });
        // The tensor holds the import from here: dropped on any path below, it releases it.
        // SAFETY: `ptr` maps `len` elements of `T`: the offer's bytes are `len` elements of `T`
        // (checked in `check`) and fit the allocation from `ptr` on, as the driver measured it
        // (checked above, for a new mapping and a kept one alike);
        // the exporter wrote them before its event, which every stream waits for below before
        // any use of the tensor.
        let tensor = unsafe { DeviceTensor::homed(ptr, &shape, len, &shared, import) };
        let refused = Lane::ALL
            .into_iter()
            .find_map(|lane| st.driver.stream_wait(lane, ready).err());
        if let Some(source) = refused {
            // The device would not wait: the host does, so the order still holds.
            let waited = shared.waits.event_synchronize(ready);
            st.defer(Error::Driver {
                call: "cuStreamWaitEvent",
                source,
            });
            if let Err(source) = waited {
                drop(st);
                drop(tensor);
                let error = Error::DeviceFault {
                    what: "an exporter's writes before an offer",
                    source,
                };
                return Err((error, true));
            }
        }
        drop(st);
        Ok(tensor)
    }
}

/// An offer's shape, in this host's sizes, and its element count: an offer whose dimensions or
/// count do not fit this host's sizes is [`MalformedError::Sharing`].
fn shape_of(offer: &Offer) -> Result<(Vec<usize>, usize)> {
    let overflows = || {
        Error::Malformed(MalformedError::Sharing {
            reason: format!(
                "an offer whose shape {:?} overflows this host's sizes",
                offer.shape
            ),
        })
    };
    let shape: Vec<usize> = offer
        .shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| overflows())?;
    let len = shape_len(&shape).map_err(|_| overflows())?;
    Ok((shape, len))
}

/// Checks that `bytes` at `offset` fit an allocation of `allocation` bytes.
fn fits(bytes: u64, offset: u64, allocation: u64) -> Result<()> {
    if offset
        .checked_add(bytes)
        .is_some_and(|end| end <= allocation)
    {
        Ok(())
    } else {
        Err(Error::Malformed(MalformedError::PastAllocation {
            offered: bytes,
            offset,
            allocation,
        }))
    }
}

#[cfg(test)]
impl ShareLink {
    /// Whether the link's reader has stopped reading its exporter.
    pub(super) fn reader_ended(&self) -> bool {
        *lock(&self.link.closed.0)
    }

    /// The unmap requests the link holds for offers it has not mapped.
    pub(super) fn unmaps_held(&self) -> usize {
        lock(&self.link.mapped).asked.len()
    }

    /// The write timeout of the link's socket.
    pub(super) fn write_limit(&self) -> Option<Duration> {
        lock(&self.link.writer)
            .stream
            .write_timeout()
            .ok()
            .flatten()
    }

    /// Shortens the write timeout of the link's socket, for a test that cannot wait the limit.
    pub(super) fn set_write_limit(&self, limit: Duration) {
        lock(&self.link.writer)
            .stream
            .set_write_timeout(Some(limit))
            .unwrap();
    }

    /// Sends `message` as the link sends its own.
    pub(super) fn send_as_link(&self, message: &Message) -> crate::Result<()> {
        self.link.send(message)
    }
}

impl Drop for ShareLink {
    fn drop(&mut self) {
        if let Some((event, _)) = self.ready.take()
            && let Some(mut st) = self.link.engine.enter_for_drop()
        {
            // SAFETY: opened by this link, closed once; its waits captured their record.
            let _ = unsafe { st.driver.ipc_event_close(event) };
        }
    }
}
