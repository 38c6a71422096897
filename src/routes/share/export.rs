//! The exporting side: a listener that importer processes connect to, one [`Importer`] per
//! connection, and the two states an exported tensor is in: [`Exported`] (shared read-only with
//! any number of importers) and lent (handed over exclusively to one, a
//! [`Pending<Loan<T>>`](super::Loan) until it comes back).
//!
//! Every exported tensor has an [`Export`] entry, its home: the tensor keeps it after it comes
//! back, so the same allocation offered again is the same export, which an importer that still
//! maps it uses without mapping it again. The entry counts, connection by connection, the
//! imports in use and the importers that map the memory. A connection's reader thread takes the
//! importer's messages as they come: a release ends one import in use, and an unmapping ends
//! the mapping; each makes the exporting engine's compute stream wait for the importer's event
//! (recorded after its last use, or its unmapping) and records a write of the memory there, so
//! the exporter's next use on any stream follows. A connection that ends while its importer holds
//! anything (it closed it, or its process died) keeps what it holds until the driver says the
//! process has ended: only then is no work of it left to touch the memory.
//!
//! The memory is written again only once no import of it is in use (a reclaim, a hand-back), and
//! freed only once no importer maps it: a tensor dropped while importers map it asks each to
//! unmap it, and its entry frees it after the last has.

use super::pending::{Back, Departure, Leaving, Loan, Reclaim, Wakers};
use super::wire::{self, Access, Message, Offer};
use crate::core::engine::{Charge, CudaEngine, Shared};
use crate::core::order::Use;
use crate::driver::share::{Name, Origin};
use crate::driver::{DevicePtr, EventHandle, Lane};
use crate::error::{Error, IoError, MalformedError, PeerError, Result, SubmitError, UsageError};
use crate::ledger::Owner;
use crate::lifecycle::pending::Pending;
use crate::memory::element::Element;
use crate::memory::tensor::{DeviceTensor, Home};
use crate::sync::deadline::Deadline;
use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::Location;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

/// How often a connection whose importer may have gone asks whether its process has ended.
const PROCESS_POLL: Duration = Duration::from_millis(10);
/// How long a connection's reader waits for a message before it asks whether the importer's
/// process has ended (a killed process's socket may be held open by another).
const IDLE_POLL: Duration = Duration::from_millis(100);
/// How long a wait for a release or an offer asks again before it sleeps.
pub(super) const SPIN: Duration = Duration::from_micros(100);
/// How long an accepted connection may take to greet, whole, unless the listener says
/// otherwise ([`ShareListener::with_timeout`]).
const GREETING_TIMEOUT: Duration = Duration::from_secs(10);

/// Checks that the kernel's word for a peer's user, `uid`, is this process's effective user or
/// one of `allowed`.
///
/// # Errors
/// [`PeerError::OtherUser`] otherwise.
pub(super) fn check_user(uid: u32, allowed: &[u32]) -> Result<(), Error> {
    let own = wire::own_uid();
    if uid == own || allowed.contains(&uid) {
        return Ok(());
    }
    let mut users = vec![own];
    users.extend(allowed.iter().copied().filter(|&u| u != own));
    Err(PeerError::OtherUser {
        uid,
        allowed: users,
    }
    .into())
}

/// Numbers for exports and connections, unique in the process.
static NEXT: AtomicU64 = AtomicU64::new(1);

/// Locks `m`; every critical section here leaves its data whole, so a poisoned lock is usable.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The code of an element type on the wire: its index in [`DType::ALL`](crate::DType::ALL).
pub(super) fn dtype_code(dtype: crate::DType) -> u8 {
    crate::DType::ALL
        .iter()
        .position(|&d| d == dtype)
        .expect("every element type is in DType::ALL") as u8
}

/// One exported allocation: its imports in use and its mappings, connection by connection.
pub(super) struct Export {
    id: u64,
    ptr: DevicePtr,
    /// The allocation's bytes, counted under [`Owner::Exported`] from the export on.
    bytes: usize,
    engine: Arc<Shared>,
    /// The allocation's export data.
    pointer: Name,
    pub(super) inner: Mutex<Imports>,
    changed: Condvar,
}

#[derive(Default)]
pub(super) struct Imports {
    /// Imports in use, by connection.
    held: HashMap<u64, usize>,
    /// The connections whose importers map the memory.
    mapped: HashMap<u64, Weak<Conn>>,
    /// Set once the exporter's tensor is gone: the entry frees the memory once it is unmapped
    /// everywhere.
    abandoned: bool,
    /// Set when an importer's last use could not be ordered before the exporter's next: the
    /// memory is never written or freed again.
    unprovable: Option<Error>,
    /// The `.await`s of a loan or a reclaim of it, woken at each change.
    pub(super) wakers: Wakers,
}

impl Imports {
    fn in_use(&self) -> usize {
        self.held.values().sum()
    }

    /// Whether a wait for the imports to end answers at once: none is in use, or an
    /// importer's use could not be ordered (the wait reports it).
    pub(super) fn settled(&self) -> bool {
        self.in_use() == 0 || self.unprovable.is_some()
    }
}

/// The home of an exported tensor: its [`Export`] entry.
struct ExportHome(Arc<Export>);

impl Home for ExportHome {
    fn drop_memory(&self, _owner: &Arc<Shared>, ptr: DevicePtr) {
        let export = &self.0;
        debug_assert_eq!(ptr, export.ptr);
        let mapped: Vec<Arc<Conn>> = {
            let mut inner = lock(&export.inner);
            inner.abandoned = true;
            inner.mapped.values().filter_map(Weak::upgrade).collect()
        };
        // Every importer that maps it is asked to unmap it; the last unmapping frees it. A
        // request that cannot be sent leaves the memory with the importer until it closes.
        for conn in &mapped {
            let _ = conn.send(&Message::Unmap { id: export.id }, None);
        }
        export.settle();
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Export {
    /// The export entry of `tensor`: its own when it was exported before, else a new one, made
    /// its home.
    fn of<T: Element>(engine: &mut CudaEngine, tensor: &mut DeviceTensor<T>) -> Result<Arc<Self>> {
        tensor.check_engine(engine)?;
        if tensor.is_empty() {
            return Err(Error::Usage(UsageError::ZeroLength {
                what: "a shared tensor",
            }));
        }
        if let Some(home) = tensor.home() {
            return match home.as_any().downcast_ref::<ExportHome>() {
                Some(ExportHome(export)) => Ok(Arc::clone(export)),
                None => Err(Error::Usage(UsageError::Reexport)),
            };
        }
        let (ptr, bytes) = (tensor.raw_ptr(), tensor.byte_len());
        let pointer = {
            let mut st = engine.enter()?;
            // A pool's pointers can be exported only once the pool itself has been.
            st.driver
                .pool_descriptor()
                .map_err(Error::driver("cuMemPoolExportToShareableHandle"))?;
            let pointer = st
                .driver
                .export_pointer(ptr)
                .map_err(Error::driver("cuMemPoolExportPointer"))?;
            // The tensor's memory is the export's from here (its home below frees it).
            st.ledger
                .moved(Owner::Tensors, Owner::Exported, bytes, Location::caller());
            pointer
        };
        let export = Arc::new(Export {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            ptr,
            bytes,
            engine: Arc::clone(&engine.shared),
            pointer,
            inner: Mutex::new(Imports::default()),
            changed: Condvar::new(),
        });
        tensor.set_home(Arc::new(ExportHome(Arc::clone(&export))));
        Ok(export)
    }

    /// Frees the memory once the exporter's tensor is gone and no importer maps it (or leaks
    /// it when an importer's use could not be ordered).
    fn settle(&self) {
        let (free, woken) = {
            let mut inner = lock(&self.inner);
            let free = inner.abandoned
                && inner.mapped.is_empty()
                && inner.in_use() == 0
                && inner.unprovable.is_none();
            // Freed once: the flag is the memory's.
            inner.abandoned &= !free;
            (free, inner.wakers.take())
        };
        self.changed.notify_all();
        // No lock of the export's or of any engine is held here.
        woken.wake();
        if !free {
            return;
        }
        // Leaked (never freed) when the context cannot be entered.
        if let Some(mut st) = self.engine.enter_for_drop() {
            let charge = Charge::new(Owner::Exported, self.bytes);
            // SAFETY: the exporter's own allocation, whose tensor is gone: no operation queued
            // later names it; every importer's last use and unmapping is ordered before this
            // free by the waits `order_after` queued on the compute stream.
            unsafe { st.free_device(&*self.engine.waits, self.ptr, charge) };
        }
    }

    /// Orders the exporting engine's next use of the memory after an importer's last one: its
    /// compute stream waits for `done` (the importer's event, recorded after its last use or
    /// its unmapping), and a write recorded there orders the other streams after that wait.
    /// When the device refuses the wait, the host waits for the event instead; when that fails
    /// too, the memory is never written or freed again.
    fn order_after(&self, done: EventHandle) {
        let refused = match self.engine.enter() {
            Ok(mut st) => {
                let st = &mut *st;
                match st.driver.stream_wait(Lane::Compute, done) {
                    Ok(()) => {
                        st.order.mark(Lane::Compute, &[Use::Write(self.ptr)]);
                        false
                    }
                    Err(source) => {
                        st.defer(Error::Driver {
                            call: "cuStreamWaitEvent",
                            source,
                        });
                        true
                    }
                }
            }
            Err(error) => {
                lock(&self.inner).unprovable = Some(error);
                return;
            }
        };
        if refused && let Err(source) = self.engine.waits.event_synchronize(done) {
            lock(&self.inner).unprovable = Some(Error::DeviceFault {
                what: "an importer's last use of a shared tensor",
                source,
            });
        }
    }

    /// The imports in use now.
    pub(super) fn imports(&self) -> usize {
        lock(&self.inner).in_use()
    }

    /// Waits until no import is in use, until `deadline`: `Ok(true)` then, `Ok(false)` once the
    /// deadline has passed with imports still in use; the failure that left an importer's use
    /// unordered, reported once.
    pub(super) fn wait_released(&self, deadline: Deadline) -> Result<bool> {
        // A release that comes within a few tens of microseconds (a hand-back queued at once)
        // is met without a sleep and a wake.
        let spin = Deadline::after(SPIN).min(deadline);
        while !lock(&self.inner).settled() && !spin.expired() {
            std::thread::yield_now();
        }
        let mut inner = lock(&self.inner);
        loop {
            if let Some(error) = inner.unprovable.take() {
                return Err(error);
            }
            if inner.in_use() == 0 {
                return Ok(true);
            }
            // An hour at a time when there is no deadline: a condition variable's wait is
            // finite.
            let Some(left) = deadline.slice(Duration::from_secs(3600)) else {
                return Ok(false);
            };
            inner = self
                .changed
                .wait_timeout(inner, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// What a connection's reader knows of its importer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    /// Reading its messages.
    Open,
    /// Its socket ended (or it broke the protocol) while it may hold imports or mappings: they
    /// are held until its process ends.
    Closed,
    /// Its socket ended and it holds nothing: it released and unmapped everything, or its
    /// process ended.
    Done,
}

/// One importer's connection, shared by its [`Importer`] handle, its reader thread and the
/// importer's [departures](Importer::departure).
pub(super) struct Conn {
    id: u64,
    origin: Origin,
    engine: Arc<Shared>,
    writer: Mutex<UnixStream>,
    /// The exporter's event, recorded before each offer; its handle goes with every offer.
    ready: EventHandle,
    ready_name: Name,
    /// The importer's event, opened here.
    done: EventHandle,
    /// Whether an offer with the pool's descriptor has reached the socket: later offers go
    /// without it.
    pool_sent: std::sync::atomic::AtomicBool,
    /// The exports this connection's importer uses or maps, by export id.
    exports: Mutex<HashMap<u64, Arc<Export>>>,
    link: Mutex<Link>,
    /// Signalled when `link` changes.
    changed: Condvar,
    /// The `.await`s of the importer's departure, woken when `link` changes.
    wakers: Mutex<Wakers>,
}

/// What an importer's message ends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ends {
    /// One import in use, released after its last use.
    Use,
    /// One import, refused before it was used; the mapping stays when `true`.
    Refusal { mapped: bool },
    /// The mapping, after the importer unmapped it.
    Mapping,
}

impl Conn {
    /// Applies a release, a refusal or an unmapping of export `id`; `false` when it names
    /// nothing this connection holds (the importer broke the protocol).
    fn end(self: &Arc<Self>, id: u64, ends: Ends) -> bool {
        let Some(export) = lock(&self.exports).get(&id).cloned() else {
            return false;
        };
        if matches!(ends, Ends::Use | Ends::Mapping) {
            export.order_after(self.done);
        }
        {
            // Under the connection's lock, so an offer made meanwhile is counted in both.
            let mut exports = lock(&self.exports);
            let mut inner = lock(&export.inner);
            match ends {
                Ends::Use | Ends::Refusal { .. } => {
                    let Some(n) = inner.held.get_mut(&self.id) else {
                        return false;
                    };
                    *n -= 1;
                    if *n == 0 {
                        inner.held.remove(&self.id);
                    }
                    if ends == (Ends::Refusal { mapped: false }) {
                        inner.mapped.remove(&self.id);
                    }
                }
                Ends::Mapping => {
                    if inner.held.contains_key(&self.id) {
                        return false;
                    }
                    inner.mapped.remove(&self.id);
                }
            }
            if !inner.held.contains_key(&self.id) && !inner.mapped.contains_key(&self.id) {
                exports.remove(&id);
            }
        }
        export.settle();
        true
    }

    /// The reader: the importer's messages until its socket ends, then the wait for its
    /// process to end, when it still holds anything.
    fn read(self: Arc<Self>, mut reader: UnixStream) {
        let pid = self.origin.pid;
        loop {
            // A process that dies closes its socket; one whose socket another process holds
            // open does not, so an idle socket is also a cue to ask the driver.
            if !readable(&reader, IDLE_POLL) {
                if self.ended() {
                    break;
                }
                continue;
            }
            match wire::recv(&mut reader) {
                Ok((Message::Release { id }, _)) if self.end(id, Ends::Use) => {}
                Ok((Message::Unmapped { id }, _)) if self.end(id, Ends::Mapping) => {}
                Ok((Message::Goodbye, _)) => {
                    self.forget_all();
                    break;
                }
                Ok((Message::Refuse { id, mapped, reason }, _))
                    if self.end(id, Ends::Refusal { mapped }) =>
                {
                    self.engine
                        .lock()
                        .defer(Error::Peer(PeerError::OfferRefused { pid, reason }));
                }
                // A message an importer never sends, one that names nothing it holds, garbage,
                // or the end: the connection is over, and what it holds is held until its
                // process ends.
                _ => break,
            }
        }
        // Every message is taken and every wait queued: the importer may destroy its event.
        let _ = lock(&self.writer).shutdown(std::net::Shutdown::Write);
        self.set_link(Link::Closed);
        while !lock(&self.exports).is_empty() && !self.ended() {
            std::thread::sleep(PROCESS_POLL);
        }
        // Its process has ended (its work with it), or it holds nothing.
        self.forget_all();
        self.set_link(Link::Done);
    }

    /// Ends everything the importer held: it said goodbye (after its last release and
    /// unmapping), or its process has ended.
    fn forget_all(&self) {
        let exports: Vec<_> = lock(&self.exports).drain().map(|(_, e)| e).collect();
        for export in exports {
            {
                let mut inner = lock(&export.inner);
                inner.held.remove(&self.id);
                inner.mapped.remove(&self.id);
            }
            export.settle();
        }
    }

    /// Whether the importer's process has ended, as the driver judges it.
    fn ended(&self) -> bool {
        self.engine.lock().driver.process_ended(&self.origin)
    }

    fn set_link(&self, link: Link) {
        *lock(&self.link) = link;
        self.changed.notify_all();
        // Taken after the change: an await that registered before it is woken, and one that
        // registers after it sees it. No lock is held while they are woken.
        let woken = lock(&self.wakers).take();
        woken.wake();
    }

    /// Whether the connection is over and the importer holds nothing of this exporter's.
    pub(super) fn departed(&self) -> bool {
        *lock(&self.link) == Link::Done
    }

    /// Waits until [`departed`](Self::departed), until `deadline`; returns whether it is.
    pub(super) fn wait_departed(&self, deadline: Deadline) -> bool {
        let mut link = lock(&self.link);
        while *link != Link::Done {
            // An hour at a time when there is no deadline: a condition variable's wait is
            // finite.
            let Some(left) = deadline.slice(Duration::from_secs(3600)) else {
                return false;
            };
            link = self
                .changed
                .wait_timeout(link, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// The wakers of the importer's departure's `.await`s.
    pub(super) fn wakers(&self) -> &Mutex<Wakers> {
        &self.wakers
    }

    fn send(&self, message: &Message, fd: Option<BorrowedFd<'_>>) -> Result<()> {
        wire::send(&mut lock(&self.writer), message, fd)
    }
}

/// Whether `stream` has something to read (a message, or its end) within `within`.
fn readable(stream: &UnixStream, within: Duration) -> bool {
    use std::os::fd::AsRawFd;
    let mut poll = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = libc::c_int::try_from(within.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid `pollfd`, for the duration of the call.
    let ready = unsafe { libc::poll(&mut poll, 1, millis) };
    // An interruption is retried at the next round; any other error reads as the end.
    ready > 0
        || (ready < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted)
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The last holder is the reader, which has seen the importer go, or the handle (or a
        // departure) of a connection whose reader never started, or a departure that outlived
        // both (the reader ended): no offer is still to be made, and the waits queued on `done`
        // captured their record when queued.
        if let Some(mut st) = self.engine.enter_for_drop() {
            // SAFETY: `done` was opened on this engine and is closed once, here.
            let _ = unsafe { st.driver.ipc_event_close(self.done) };
            // SAFETY: `ready` is this connection's own event, destroyed once; an importer's
            // waits on it captured their record when queued.
            let _ = unsafe { st.driver.event_destroy(self.ready) };
        }
    }
}

/// The socket importer processes connect to, on the exporting side.
///
/// Binding makes a Unix socket at `path` (removed again when the listener is dropped), of mode
/// `0600` whatever the umask: only this user (and root) can connect. Each
/// [`accept`](Self::accept) takes one importer's connection, and believes nothing its greeting
/// says that the kernel does not confirm: the connecting process's pid and user come from the
/// socket (`SO_PEERCRED`), its start time from `/proc`, and a greeting that names another is
/// refused, as is a peer of another user unless [allowed](Self::allow_uid). Callers with a
/// channel of their own (a socket pair made before a fork, say) skip the listener:
/// [`Importer::from_stream`].
#[derive(Debug)]
pub struct ShareListener {
    listener: UnixListener,
    path: PathBuf,
    /// Users besides this process's that may connect.
    allowed: Vec<u32>,
    /// How long an accepted connection has to greet, whole.
    greeting: Duration,
}

impl ShareListener {
    /// Binds a Unix socket at `path`, of mode `0600` (the socket's own mode is set before it
    /// is bound, and again after, so no umask widens or narrows it).
    ///
    /// # Errors
    /// [`IoError::Socket`] when the socket cannot be made (the path exists, say).
    pub fn bind(path: impl AsRef<Path>) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let path = path.as_ref().to_path_buf();
        let io = |operation| move |source| Error::Io(IoError::Socket { operation, source });
        let listener = bind_private(&path).map_err(io("bind"))?;
        // The socket exists from here: dropped on the error path below, it would leave the
        // path behind, so the listener takes it at once.
        let listener = ShareListener {
            listener,
            path,
            allowed: Vec::new(),
            greeting: GREETING_TIMEOUT,
        };
        std::fs::set_permissions(&listener.path, std::fs::Permissions::from_mode(0o600))
            .map_err(io("chmod"))?;
        Ok(listener)
    }

    /// Lets importers of user `uid` connect besides this process's own user (the only one by
    /// default): the kernel's word for the connecting process's user (`SO_PEERCRED`) must be
    /// one of them. The socket stays of mode `0600`: a caller that lets another user in also
    /// gives it a way to reach the path (the socket's group and mode, say), at its own choice.
    #[must_use]
    pub fn allow_uid(mut self, uid: u32) -> Self {
        self.allowed.push(uid);
        self
    }

    /// How long an accepted connection has to greet, from the accept to the greeting's last
    /// byte, however it trickles in: one deadline for the whole greeting (ten seconds by
    /// default; `Duration::MAX` waits for ever).
    #[must_use]
    pub fn with_timeout(mut self, within: Duration) -> Self {
        self.greeting = within;
        self
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for the next importer to connect and greet, for `engine` to share with; the
    /// greeting must come whole within the [timeout](Self::with_timeout) of the
    /// connection's accept.
    ///
    /// # Errors
    /// As [`Importer::from_stream`], with [`PeerError::TimedOut`] past the greeting limit;
    /// [`IoError::Socket`] when the accept fails. A refused connection is closed; the listener
    /// takes the next.
    pub fn accept(&self, engine: &mut CudaEngine) -> Result<Importer> {
        let (stream, _) = self.listener.accept().map_err(|source| {
            Error::Io(IoError::Socket {
                operation: "accept",
                source,
            })
        })?;
        let deadline = Deadline::after(self.greeting);
        let peer = wire::peer(&stream)?;
        Importer::greeted(
            engine,
            stream,
            Some(peer),
            &self.allowed,
            deadline,
            self.greeting,
        )
    }
}

/// A listening Unix socket at `path` whose mode is `0600` from its making: the socket's own
/// mode is set before the bind, which gives it that mode less the umask.
fn bind_private(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: an all-zero `sockaddr_un` is a valid empty address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "a socket path of {} bytes (at most {}, without NUL)",
                bytes.len(),
                addr.sun_path.len() - 1
            ),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (to, &from) in addr.sun_path.iter_mut().zip(bytes) {
        *to = from as libc::c_char;
    }
    let last = |ok: libc::c_int| {
        if ok < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(ok)
        }
    };
    let flags = libc::SOCK_STREAM | libc::SOCK_CLOEXEC;
    // SAFETY: plain socket creation; the descriptor is owned at once.
    let fd = last(unsafe { libc::socket(libc::AF_UNIX, flags, 0) })?;
    // SAFETY: `fd` was just made, for this function alone.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `fd` is open; `addr` is a valid address of the length given.
    unsafe {
        last(libc::fchmod(fd.as_raw_fd(), 0o600))?;
        last(libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        ))?;
    }
    // SAFETY: `fd` is a bound socket.
    if let Err(error) = last(unsafe { libc::listen(fd.as_raw_fd(), 128) }) {
        let _ = std::fs::remove_file(path);
        return Err(error);
    }
    Ok(UnixListener::from(fd))
}

impl Drop for ShareListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One importer process, as its exporter sees it: what [`offer`](Self::offer) and
/// [`lend`](Self::lend) send tensors to.
///
/// Dropping the handle offers nothing more; the connection lives on while the importer uses or
/// maps anything of this exporter's, and ends once it holds nothing or its process has ended.
pub struct Importer {
    conn: Arc<Conn>,
}

impl std::fmt::Debug for Importer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Importer")
            .field("pid", &self.conn.origin.pid)
            .field("link", &*lock(&self.conn.link))
            .finish()
    }
}

impl Importer {
    /// Takes an importer's connection on `stream`, a channel the caller brought: reads its
    /// greeting (whole within ten seconds), checks that it names the process and the user the
    /// kernel reports at the other end (`SO_PEERCRED`, and the start time in `/proc`), that the
    /// user is this process's, and that it is a live process of this host, and opens its event
    /// on `engine`, which every tensor offered to it must belong to.
    ///
    /// What is trusted: the kernel's word for the socket's other end. A channel this process
    /// made itself (a socket pair, made before a fork) names this process at both ends, so the
    /// kernel cannot say who holds the other: the caller vouches for it (it chose who got that
    /// end), and only the greeting's own checks (host, boot, a live process) apply.
    ///
    /// # Errors
    /// [`PeerError::OtherUser`] for a peer of another user; [`MalformedError::PeerIdentity`] for a
    /// greeting whose pid, start time or user is not the kernel's; [`PeerError::TimedOut`]
    /// when it does not come whole in time; [`MalformedError::Sharing`], [`PeerError::Closed`]
    /// or [`IoError::Socket`] when it is not the protocol or the socket fails (or is not a
    /// connected Unix socket); [`SetupError::OtherHost`](crate::error::SetupError::OtherHost), [`SetupError::OtherBoot`](crate::error::SetupError::OtherBoot) or
    /// [`PeerError::ProcessGone`] for a greeting of another host, boot or an exited process;
    /// [`Error::Driver`] when the events cannot be made or opened.
    pub fn from_stream(engine: &mut CudaEngine, stream: UnixStream) -> Result<Importer> {
        let deadline = Deadline::after(GREETING_TIMEOUT);
        let peer = wire::peer(&stream)?;
        let peer = (peer.pid != std::process::id()).then_some(peer);
        Importer::greeted(engine, stream, peer, &[], deadline, GREETING_TIMEOUT)
    }

    /// Takes the connection on `stream`, whose other end the kernel says is `peer` (`None`:
    /// this process, vouched for), of this user or one of `allowed`, greeting by `deadline`
    /// (`limit` from the accept).
    fn greeted(
        engine: &mut CudaEngine,
        mut stream: UnixStream,
        peer: Option<wire::Peer>,
        allowed: &[u32],
        deadline: Deadline,
        limit: Duration,
    ) -> Result<Importer> {
        let io = |operation| move |source| Error::Io(IoError::Socket { operation, source });
        // A user not allowed is refused before a byte of its is read.
        if let Some(peer) = peer {
            check_user(peer.uid, allowed)?;
        }
        let hello = match wire::recv_by(&mut stream, deadline) {
            Ok((Message::Hello(hello), _)) => hello,
            Ok(_) => {
                return Err(Error::Malformed(MalformedError::Sharing {
                    reason: "a connection that did not open with a greeting".into(),
                }));
            }
            Err(Error::Io(IoError::Socket { source, .. }))
                if source.kind() == std::io::ErrorKind::TimedOut =>
            {
                return Err(Error::Peer(PeerError::TimedOut {
                    what: "a greeting",
                    within: limit,
                }));
            }
            Err(error) => return Err(error),
        };
        if let Some(peer) = peer
            && hello.uid != peer.uid
        {
            return Err(Error::Malformed(MalformedError::PeerIdentity {
                what: "user id",
                claimed: hello.uid.into(),
                kernel: peer.uid.into(),
            }));
        }
        stream.set_read_timeout(None).map_err(io("setsockopt"))?;
        // An importer that stops reading holds no send here for long: a write that finds no
        // room for its limit fails (the message is not sent, as when the socket breaks).
        stream
            .set_write_timeout(Some(wire::MESSAGE_LIMIT))
            .map_err(io("setsockopt"))?;
        let reader = stream.try_clone().map_err(io("dup"))?;
        let shared = Arc::clone(&engine.shared);
        let (ready, ready_name, done) = {
            let mut st = engine.enter()?;
            // The greeting names the process the kernel reports, before anything else of it
            // is believed.
            if let Some(peer) = peer {
                st.driver.check_peer(&hello.origin, peer.pid)?;
            }
            let here = st.driver.process()?;
            let ended = st.driver.process_ended(&hello.origin);
            hello.origin.check(&here, ended)?;
            let (ready, ready_name) = st
                .driver
                .ipc_event_create()
                .map_err(Error::driver("cuIpcGetEventHandle"))?;
            match st.driver.ipc_event_open(&hello.event) {
                Ok(done) => (ready, ready_name, done),
                Err(source) => {
                    // SAFETY: made just above, never recorded or named elsewhere.
                    let _ = unsafe { st.driver.event_destroy(ready) };
                    return Err(Error::Driver {
                        call: "cuIpcOpenEventHandle",
                        source,
                    });
                }
            }
        };
        let conn = Arc::new(Conn {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            origin: hello.origin,
            engine: shared,
            writer: Mutex::new(stream),
            ready,
            ready_name,
            done,
            pool_sent: std::sync::atomic::AtomicBool::new(false),
            exports: Mutex::new(HashMap::new()),
            link: Mutex::new(Link::Open),
            changed: Condvar::new(),
            wakers: Mutex::new(Wakers::default()),
        });
        let reading = Arc::clone(&conn);
        std::thread::Builder::new()
            .name("cuferry-share".into())
            .spawn(move || reading.read(reader))
            .map_err(io("spawn"))?;
        Ok(Importer { conn })
    }

    /// The importer's process id.
    pub fn pid(&self) -> u32 {
        self.conn.origin.pid
    }

    /// The importer's leaving, an operation in flight ([`Departure`]) complete once the
    /// connection is over and the importer holds nothing of this exporter's: it released and
    /// unmapped everything and closed its end, or its process ended (and the driver tore its
    /// context down). Waited on with the verbs of every operation in flight
    /// ([`crate::pending`]): [`is_ready`](Pending::is_ready), [`wait`](Pending::wait),
    /// [`try_wait`](Pending::try_wait), [`wait_for`](Pending::wait_for) (`Duration::MAX`: no
    /// bound) and `.await`, woken by the connection's reader. Each call makes a new one, of the
    /// same connection; dropping one changes nothing.
    pub fn departure(&self) -> Pending<Departure> {
        Pending::in_flight(Leaving::new(Arc::clone(&self.conn)))
    }

    /// Offers `tensor` to the importer, read-only: the importer's reads run after every write
    /// queued on the exporting engine before this call (its streams wait for an event of this
    /// engine's, on the device). The tensor stays readable here; it is written again only once
    /// reclaimed ([`Exported::reclaim`]), after every importer released it.
    ///
    /// # Errors
    /// [`UsageError::WrongEngine`] when `tensor` or this importer is not `engine`'s;
    /// [`Error::Driver`] when the event cannot be recorded or the pool exported;
    /// [`IoError::Socket`] when the socket refuses. Nothing is counted as imported then.
    pub fn offer<T: Element>(&self, engine: &mut CudaEngine, tensor: &Exported<T>) -> Result<()> {
        self.send_offer(engine, &tensor.tensor, &tensor.export, Access::Read)
    }

    /// Hands `tensor` over to the importer, exclusively: the importer reads and writes it
    /// after every use queued on this engine before this call, and until it hands it back this
    /// engine has no access: the loan is an operation in flight ([`Loan`]), returned (its
    /// parts the tensor, ordered after the importer's writes) once the importer has handed it
    /// back, waited on with the verbs of every operation in flight ([`crate::pending`]). A
    /// tensor whose importer's process died comes back with whatever it wrote. A tensor lent
    /// before (and come back) is the same export: an importer that still maps it does not map
    /// it again.
    ///
    /// # Errors
    /// [`UsageError::ZeroLength`] for an empty tensor, [`UsageError::Reexport`] for a tensor
    /// whose memory is not an allocation of its own (imported from another process, adopted,
    /// or part of a larger one), and as [`export_tensor`](CudaEngine::export_tensor): the
    /// tensor comes back in [`SubmitError::Rejected`] (nothing was sent); as
    /// [`offer`](Self::offer) when sending fails: the tensor comes back in
    /// [`SubmitError::Failed`].
    // The refusal hands the tensor back by value, as `TrySendError<T>` does.
    #[allow(clippy::result_large_err)]
    pub fn lend<T: Element>(
        &self,
        engine: &mut CudaEngine,
        mut tensor: DeviceTensor<T>,
    ) -> Result<Pending<Loan<T>>, SubmitError<DeviceTensor<T>>> {
        let export = match Export::of(engine, &mut tensor) {
            Ok(export) => export,
            Err(error) => {
                return Err(SubmitError::Rejected {
                    input: tensor,
                    error,
                });
            }
        };
        match self.send_offer(engine, &tensor, &export, Access::Exclusive) {
            Ok(()) => Ok(Pending::in_flight(Back::new(tensor, export))),
            Err(error) => Err(SubmitError::Failed {
                input: tensor,
                error,
            }),
        }
    }

    fn send_offer<T: Element>(
        &self,
        engine: &mut CudaEngine,
        tensor: &DeviceTensor<T>,
        export: &Arc<Export>,
        access: Access,
    ) -> Result<()> {
        tensor.check_engine(engine)?;
        engine
            .shared
            .check_owner(self.conn.engine.device, self.conn.engine.engine_id)?;
        let conn = &self.conn;
        if *lock(&conn.link) != Link::Open {
            return Err(Error::Peer(PeerError::Closed));
        }
        // Counted before the offer leaves, so its release can never come before its count.
        let mapped_before = {
            let mut exports = lock(&conn.exports);
            exports.insert(export.id, Arc::clone(export));
            let mut inner = lock(&export.inner);
            *inner.held.entry(conn.id).or_default() += 1;
            inner.mapped.insert(conn.id, Arc::downgrade(conn)).is_some()
        };
        let sent = (|| {
            let (fd, origin, device) = {
                let mut st = engine.enter()?;
                let st = &mut *st;
                // The compute stream joins the copy streams, so the event covers every use
                // queued so far on all three.
                st.order.join(&mut *st.driver, Lane::Compute)?;
                st.driver
                    .event_record(Lane::Compute, conn.ready)
                    .map_err(Error::driver("cuEventRecord"))?;
                let fd = st
                    .driver
                    .pool_descriptor()
                    .map_err(Error::driver("cuMemPoolExportToShareableHandle"))?;
                (fd, st.driver.process()?, st.driver.uuid())
            };
            let offer = Offer {
                id: export.id,
                origin,
                device,
                dtype: dtype_code(T::DTYPE),
                access,
                shape: tensor.shape().iter().map(|&d| d as u64).collect(),
                bytes: tensor.byte_len() as u64,
                pointer: export.pointer,
                event: conn.ready_name,
            };
            // SAFETY: the driver keeps the descriptor open for as long as it lives, which is
            // longer than this call (its engine is borrowed).
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let first = !conn.pool_sent.load(Ordering::Acquire);
            conn.send(&Message::Offer(Box::new(offer)), first.then_some(fd))?;
            conn.pool_sent.store(true, Ordering::Release);
            Ok(())
        })();
        if sent.is_err() {
            // The importer never had it (a message cut short maps nothing there).
            let mut exports = lock(&conn.exports);
            let mut inner = lock(&export.inner);
            if let Some(n) = inner.held.get_mut(&conn.id) {
                *n -= 1;
                if *n == 0 {
                    inner.held.remove(&conn.id);
                }
            }
            if !mapped_before {
                inner.mapped.remove(&conn.id);
            }
            if !inner.held.contains_key(&conn.id) && !inner.mapped.contains_key(&conn.id) {
                exports.remove(&export.id);
            }
            drop((inner, exports));
            export.settle();
        }
        sent
    }
}

/// A tensor shared read-only with importer processes ([`CudaEngine::export_tensor`]).
///
/// The exporting engine still reads it (it dereferences to the tensor), never writes it: a
/// write needs the tensor back, [`reclaim`](Self::reclaim)ed once every importer has released
/// its import, and ordered after their reads. Dropping it frees nothing under an importer: the
/// memory is kept until no importer maps it (or its process has ended), then freed
/// stream-ordered.
pub struct Exported<T: Element> {
    tensor: DeviceTensor<T>,
    export: Arc<Export>,
}

impl<T: Element> std::fmt::Debug for Exported<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exported")
            .field("tensor", &self.tensor)
            .field("imports", &self.imports())
            .finish()
    }
}

impl<T: Element> std::ops::Deref for Exported<T> {
    type Target = DeviceTensor<T>;
    fn deref(&self) -> &DeviceTensor<T> {
        &self.tensor
    }
}

impl<T: Element> Exported<T> {
    /// The imports in use now.
    pub fn imports(&self) -> usize {
        self.export.imports()
    }

    /// Takes the tensor back for writing: an operation in flight ([`Reclaim`]), returned (its
    /// parts the tensor) once every importer has released it, waited on with the verbs of
    /// every operation in flight ([`crate::pending`]): [`is_ready`](Pending::is_ready),
    /// [`wait`](Pending::wait), [`try_wait`](Pending::try_wait),
    /// [`wait_for`](Pending::wait_for) (`Duration::MAX`: no bound; a bound that passes hands
    /// the reclaim back, still in flight) and `.await`, woken by the connection's reader when
    /// the last release comes. Every use on the exporting engine of the tensor returned runs
    /// after the importers' last uses (on the device). In flight the tensor stays readable
    /// here ([`tensor`](Pending::tensor)) and is offered to no one new. Importers may still map
    /// it: it is freed, once dropped, only after they have unmapped it.
    ///
    /// The wait fails when an importer's last use could not be ordered before this engine's:
    /// the memory is then kept for the engine's lifetime, and the typed error comes back.
    pub fn reclaim(self) -> Pending<Reclaim<T>> {
        Pending::in_flight(Back::new(self.tensor, self.export))
    }
}

impl CudaEngine {
    /// Makes `tensor` shareable read-only with importer processes ([`Importer::offer`]).
    ///
    /// # Errors
    /// [`UsageError::WrongEngine`] when it is not this engine's, [`UsageError::ZeroLength`]
    /// when it has no elements, [`UsageError::Reexport`] when its memory is not an allocation of
    /// its own (another process's, imported here; adopted; part of a larger allocation), [`Error::Driver`] when the device cannot export it (a pool that is not
    /// exportable): the tensor comes back in [`SubmitError::Rejected`].
    #[allow(clippy::result_large_err)]
    pub fn export_tensor<T: Element>(
        &mut self,
        mut tensor: DeviceTensor<T>,
    ) -> Result<Exported<T>, SubmitError<DeviceTensor<T>>> {
        match Export::of(self, &mut tensor) {
            Ok(export) => Ok(Exported { tensor, export }),
            Err(error) => Err(SubmitError::Rejected {
                input: tensor,
                error,
            }),
        }
    }
}
