//! The collective half of the seam on CUDA devices: NCCL, loaded at run time, and the
//! communicators made with it.
//!
//! The library is opened on first use, by its versioned name (`libnccl.so.2`, what NCCL's
//! packages install) and then its development name (`libnccl.so`); `CUFERRY_NCCL` names a file
//! to try first. A machine without it gets a typed [`SetupError::Unavailable`](crate::error::SetupError::Unavailable), never a panic.
//! cudarc's `nccl` module is not used for this: it looks only for unversioned names and names
//! with the CUDA major version, so it misses `libnccl.so.2` where no development symlink is
//! installed, and it panics where it finds nothing.

use super::CudaDriver;
use crate::device::DeviceId;
use crate::driver::collective::{
    CollectiveKind, Collectives, Communicators, Group, Part, Reduction, UNIQUE_ID_BYTES,
};
use crate::dtype::DType;
use crate::error::{Error, LibraryError, PeerError, Result, SetupError, UsageError};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{OnceLock, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

/// `ncclComm_t`: an opaque communicator.
type Comm = *mut c_void;

/// What a non-blocking join needs: `ncclCommInitRankConfig`, `ncclCommGetAsyncError` and
/// `ncclCommAbort`.
struct NonBlocking {
    init_rank_config:
        unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> Status,
    get_async_error: unsafe extern "C" fn(Comm, *mut Status) -> Status,
    abort: unsafe extern "C" fn(Comm) -> Status,
}

/// The leading fields of `ncclConfig_t`, as NCCL 2.14 declared it: NCCL reads only `size`
/// bytes of a configuration and, for one stamped with an older version, takes its defaults for
/// every field added since, so this prefix sets `blocking` and leaves the rest to NCCL.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
}

/// `NCCL_API_MAGIC`, which marks an initialised configuration.
const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// NCCL 2.14.0's version code: the layout `Config` follows.
const CONFIG_VERSION: u32 = 21400;

/// `ncclInProgress`: a non-blocking call still under way.
const IN_PROGRESS: Status = 7;

/// `ncclUniqueId`, which `ncclCommInitRank` takes by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [u8; UNIQUE_ID_BYTES],
}
/// `ncclResult_t`.
type Status = c_int;
/// `cudaStream_t` (the driver's `CUstream`).
type Stream = *mut c_void;

/// The entry points, typed as `nccl.h` declares them (stable across NCCL 2).
struct Nccl {
    /// Keeps the library loaded for as long as the entry points are reachable (the process).
    _library: libloading::Library,
    /// NCCL's version, as `ncclGetVersion` reports it (`major * 10000 + minor * 100 + patch`).
    version: c_int,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Status,
    get_unique_id: unsafe extern "C" fn(*mut [u8; UNIQUE_ID_BYTES]) -> Status,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Status,
    /// The non-blocking join and what it needs (NCCL 2.14 on); `None` on an older NCCL.
    nonblocking: Option<NonBlocking>,
    comm_destroy: unsafe extern "C" fn(Comm) -> Status,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> Status,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> Status,
    reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> Status,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> Status,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> Status,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, Stream) -> Status,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> Status,
    group_start: unsafe extern "C" fn() -> Status,
    group_end: unsafe extern "C" fn() -> Status,
}

/// Runs `f`, then makes current again the context that was current on the calling thread before
/// it: NCCL makes each of its devices' primary context current as it goes (the engines' promise
/// is that the caller's context is theirs to keep).
fn keeping_context<R>(f: impl FnOnce() -> R) -> R {
    use cudarc::driver::sys;
    let mut before = std::ptr::null_mut();
    // SAFETY: an out pointer valid for one write.
    let saved = unsafe { sys::cuCtxGetCurrent(&mut before) } == sys::CUresult::CUDA_SUCCESS;
    let result = f();
    if saved {
        // SAFETY: `before` was current on this thread before `f` (or is null, which unbinds).
        unsafe { sys::cuCtxSetCurrent(before) };
    }
    result
}

/// The file names tried, in order.
fn candidates() -> Vec<String> {
    let mut names: Vec<String> = std::env::var("CUFERRY_NCCL").into_iter().collect();
    names.extend(["libnccl.so.2".to_owned(), "libnccl.so".to_owned()]);
    names
}

/// NCCL, loaded once per process.
///
/// # Errors
/// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when no candidate loads or one lacks an entry point.
fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(load).as_ref().map_err(|detail| {
        Error::Setup(SetupError::Unavailable {
            library: "NCCL",
            detail: detail.clone(),
        })
    })
}

fn load() -> std::result::Result<Nccl, String> {
    let names = candidates();
    let Some(library) = names.iter().find_map(|name| {
        // SAFETY: loading NCCL runs its initialisers, which only set up the library's own state.
        unsafe { libloading::Library::new(name) }.ok()
    }) else {
        return Err(format!("none of {names:?} could be loaded"));
    };
    /// Looks up `name` as a function of type `F`.
    ///
    /// # Safety
    /// `F` is the function's type as `nccl.h` declares it.
    unsafe fn get<F: Copy>(library: &libloading::Library, name: &str) -> Result<F, String> {
        // SAFETY: the caller's contract.
        unsafe { library.get::<F>(name.as_bytes()) }
            .map(|symbol| *symbol)
            .map_err(|e| format!("NCCL has no {name}: {e}"))
    }
    // SAFETY: each type below is the entry point's declaration in `nccl.h` (NCCL 2).
    unsafe {
        let get_version: unsafe extern "C" fn(*mut c_int) -> Status =
            get(&library, "ncclGetVersion")?;
        let mut version = 0;
        if get_version(&mut version) != 0 {
            return Err("ncclGetVersion failed".into());
        }
        Ok(Nccl {
            version,
            get_error_string: get(&library, "ncclGetErrorString")?,
            comm_init_all: get(&library, "ncclCommInitAll")?,
            get_unique_id: get(&library, "ncclGetUniqueId")?,
            comm_init_rank: get(&library, "ncclCommInitRank")?,
            nonblocking: (|| {
                Ok::<_, String>(NonBlocking {
                    init_rank_config: get(&library, "ncclCommInitRankConfig")?,
                    get_async_error: get(&library, "ncclCommGetAsyncError")?,
                    abort: get(&library, "ncclCommAbort")?,
                })
            })()
            .ok(),
            comm_destroy: get(&library, "ncclCommDestroy")?,
            all_reduce: get(&library, "ncclAllReduce")?,
            broadcast: get(&library, "ncclBroadcast")?,
            reduce: get(&library, "ncclReduce")?,
            all_gather: get(&library, "ncclAllGather")?,
            reduce_scatter: get(&library, "ncclReduceScatter")?,
            send: get(&library, "ncclSend")?,
            recv: get(&library, "ncclRecv")?,
            group_start: get(&library, "ncclGroupStart")?,
            group_end: get(&library, "ncclGroupEnd")?,
            _library: library,
        })
    }
}

impl Nccl {
    /// `status` as a result of `call`.
    fn check(&self, call: &'static str, status: Status) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: `ncclGetErrorString` returns a static string for any status.
        let name = unsafe { CStr::from_ptr((self.get_error_string)(status)) }
            .to_string_lossy()
            .into_owned();
        Err(Error::Library(LibraryError::Vendor {
            library: "NCCL",
            call,
            status: i64::from(status),
            name,
        }))
    }

    /// One communicator per device of `devices`, ranks in that order (`ncclCommInitAll`).
    fn comm_init_all(&self, devices: &[c_int]) -> Result<Vec<Comm>> {
        let n = c_int::try_from(devices.len()).map_err(|_| UsageError::ExceedsLimit {
            operation: "Communicator::new",
            what: "ranks",
            value: devices.len(),
            limit: c_int::MAX as usize,
        })?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for `n` communicators and `devices` holds `n` ordinals.
        let status = unsafe { (self.comm_init_all)(comms.as_mut_ptr(), n, devices.as_ptr()) };
        self.check("ncclCommInitAll", status)?;
        Ok(comms)
    }

    /// Destroys `comm`.
    ///
    /// # Safety
    /// `comm` came from [`comm_init_all`](Self::comm_init_all), is destroyed once, and no
    /// operation on it is still running.
    unsafe fn comm_destroy(&self, comm: Comm) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("ncclCommDestroy", unsafe { (self.comm_destroy)(comm) })
    }

    /// Opens a group: the calls up to [`group_end`](Self::group_end) are launched together.
    fn group_start(&self) -> Result<()> {
        // SAFETY: no arguments; groups nest.
        self.check("ncclGroupStart", unsafe { (self.group_start)() })
    }

    /// Queues one call of a rank's part on `stream`, on `comm`.
    ///
    /// # Safety
    /// `part`'s buffers hold what its kind's extents say on `comm`'s device and stay allocated,
    /// and untouched by other work, until the call has completed on `stream`, a stream of that
    /// device's primary context; its root or peer is a rank of `comm`'s world.
    unsafe fn enqueue(&self, part: &Part, comm: Comm) -> Result<()> {
        let dtype = data_type(part.dtype)?;
        let stream = part.stream as Stream;
        let (send, recv) = (part.send as *const c_void, part.recv as *mut c_void);
        let count = part.count;
        let rank = |r: usize| {
            c_int::try_from(r).map_err(|_| {
                Error::Usage(UsageError::ExceedsLimit {
                    operation: "collective",
                    what: "rank",
                    value: r,
                    limit: c_int::MAX as usize,
                })
            })
        };
        // SAFETY: (every arm) the caller's contract; each call's arguments are those `nccl.h`
        // declares, send and receive buffers possibly the same (in place, which NCCL allows).
        let status = unsafe {
            match part.kind {
                CollectiveKind::AllReduce(op) => {
                    (self.all_reduce)(send, recv, count, dtype, red_op(op), comm, stream)
                }
                CollectiveKind::Broadcast { root } => {
                    (self.broadcast)(send, recv, count, dtype, rank(root)?, comm, stream)
                }
                CollectiveKind::Reduce { op, root } => (self.reduce)(
                    send,
                    recv,
                    count,
                    dtype,
                    red_op(op),
                    rank(root)?,
                    comm,
                    stream,
                ),
                CollectiveKind::AllGather => {
                    (self.all_gather)(send, recv, count, dtype, comm, stream)
                }
                CollectiveKind::ReduceScatter(op) => {
                    (self.reduce_scatter)(send, recv, count, dtype, red_op(op), comm, stream)
                }
                CollectiveKind::Send { peer } => {
                    (self.send)(send, count, dtype, rank(peer)?, comm, stream)
                }
                CollectiveKind::Recv { peer } => {
                    (self.recv)(recv, count, dtype, rank(peer)?, comm, stream)
                }
            }
        };
        // A non-blocking communicator may answer that the call is under way.
        if status == IN_PROGRESS {
            return Ok(());
        }
        self.check(part.kind.call(), status)
    }
}

/// The version of the NCCL library loaded, as `(major, minor, patch)`.
pub(crate) fn nccl_version() -> Result<(u32, u32, u32)> {
    let v = u32::try_from(nccl()?.version).unwrap_or(0);
    Ok((v / 10000, v / 100 % 100, v % 100))
}

/// `ncclDataType_t` for an element type NCCL reduces and broadcasts.
fn data_type(dtype: DType) -> Result<c_int> {
    Ok(match dtype {
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::I64 => 4,
        DType::U64 => 5,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
        other => {
            return Err(Error::Usage(UsageError::UnsupportedElement {
                operation: "collective",
                dtype: other,
                reason: "NCCL reduces and broadcasts 8-, 32- and 64-bit integers and floats",
            }));
        }
    })
}

/// `ncclRedOp_t`.
fn red_op(reduction: Reduction) -> c_int {
    match reduction {
        Reduction::Sum => 0,
        Reduction::Prod => 1,
        Reduction::Max => 2,
        Reduction::Min => 3,
        Reduction::Avg => 4,
    }
}

/// NCCL communicators, one per rank, destroyed on drop (or freed by their abort).
struct NcclComms {
    nccl: &'static Nccl,
    /// The communicators, in rank order; empty once aborted (`ncclCommAbort` frees them). A
    /// group holds the read lock from its start to its end; the abort takes the write lock.
    comms: RwLock<Vec<Comm>>,
    /// Whether the communicators were made non-blocking: NCCL's calls on them may then return
    /// `ncclInProgress`, and the group's end waits for the enqueue to finish.
    nonblocking: bool,
    /// Whether the world has ranks in other processes (made by a join).
    joined: bool,
    /// The world's rank of the first communicator, and the world's size.
    rank: usize,
    world: usize,
}

// SAFETY: NCCL communicators may be used from any thread as long as calls on one are not made
// concurrently, except `ncclCommGetAsyncError` and `ncclCommAbort`, which NCCL allows from a
// watching thread. The engines serialise every group over them (each call borrows every member
// engine exclusively, and a group holds the read lock); the abort takes the write lock, so it
// waits for a group in progress and frees the communicators once; the destroy runs once, from
// the last owner.
unsafe impl Send for NcclComms {}
// SAFETY: as above.
unsafe impl Sync for NcclComms {}

impl Drop for NcclComms {
    fn drop(&mut self) {
        let comms = std::mem::take(self.comms.get_mut().unwrap_or_else(PoisonError::into_inner));
        // Any thread may drop the last reference: NCCL makes each communicator's device current
        // to destroy it, and the thread's own context is put back.
        keeping_context(|| {
            for comm in comms {
                // SAFETY: made by `ncclCommInitAll` or a join, destroyed once (an aborted one
                // is no longer in the list); the owner keeps this value alive until every
                // collective queued on it has completed.
                let _ = unsafe { self.nccl.comm_destroy(comm) };
            }
        });
    }
}

impl NcclComms {
    fn read(&self) -> RwLockReadGuard<'_, Vec<Comm>> {
        self.comms.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn aborted(&self) -> Error {
        PeerError::Aborted {
            rank: self.rank,
            world: self.world,
        }
        .into()
    }

    /// Ends the group. On non-blocking communicators the end may return `ncclInProgress` while
    /// NCCL is still queuing the parts (connecting to a peer, for a first send): it waits until
    /// each communicator's state has settled, so that what is recorded on the streams after the
    /// end follows the parts, or until `timeout` has passed, when it reports
    /// [`PeerError::CollectiveTimedOut`] (the caller aborts).
    fn group_end(&self, comms: &[Comm], timeout: Duration) -> Result<()> {
        let nccl = self.nccl;
        // SAFETY: no arguments; called once per `group_start` (`NcclGroup` closes once).
        let status = unsafe { (nccl.group_end)() };
        if status != IN_PROGRESS || !self.nonblocking {
            return nccl.check("ncclGroupEnd", status);
        }
        let nb = nccl
            .nonblocking
            .as_ref()
            .expect("non-blocking communicators have the calls");
        let start = Instant::now();
        for &comm in comms {
            loop {
                let mut state: Status = 0;
                // SAFETY: `comm` is live (the caller holds the read lock); `state` is an out
                // pointer.
                let asked = unsafe { (nb.get_async_error)(comm, &mut state) };
                nccl.check("ncclCommGetAsyncError", asked)?;
                if state != IN_PROGRESS {
                    nccl.check("ncclGroupEnd", state)?;
                    break;
                }
                if start.elapsed() >= timeout {
                    return Err(PeerError::CollectiveTimedOut {
                        rank: self.rank,
                        world: self.world,
                        timeout,
                    }
                    .into());
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }
}

impl Communicators for NcclComms {
    fn group(&self, timeout: Duration) -> Result<Box<dyn Group + '_>> {
        let comms = self.read();
        if comms.is_empty() {
            return Err(self.aborted());
        }
        self.nccl.group_start()?;
        Ok(Box::new(NcclGroup {
            owner: self,
            comms: Some(comms),
            timeout,
        }))
    }

    fn watched(&self) -> bool {
        self.joined
    }

    fn health(&self) -> Result<()> {
        let comms = self.read();
        if comms.is_empty() {
            return Err(self.aborted());
        }
        let Some(nb) = self.nccl.nonblocking.as_ref() else {
            return Ok(()); // an NCCL before 2.14 has no asynchronous state to ask
        };
        for &comm in comms.iter() {
            let mut state: Status = 0;
            // SAFETY: `comm` is live (the read lock is held); `state` is an out pointer; NCCL
            // allows this call beside the communicator's other calls.
            let asked = unsafe { (nb.get_async_error)(comm, &mut state) };
            self.nccl.check("ncclCommGetAsyncError", asked)?;
            if state != IN_PROGRESS {
                self.nccl.check("ncclCommGetAsyncError", state)?;
            }
        }
        Ok(())
    }

    fn abort(&self) {
        let mut comms = self.comms.write().unwrap_or_else(PoisonError::into_inner);
        let taken = std::mem::take(&mut *comms);
        let Some(nb) = self.nccl.nonblocking.as_ref() else {
            // Without `ncclCommAbort` (before NCCL 2.14) nothing can end the parts: the
            // communicators stay, and are destroyed with this value.
            *comms = taken;
            return;
        };
        keeping_context(|| {
            for comm in taken {
                // SAFETY: `comm` is live, aborted once (it left the list under the write lock,
                // so no group is using it), and never used after.
                let _ = unsafe { (nb.abort)(comm) };
            }
        });
    }
}

/// An NCCL group opened by `ncclGroupStart`, closed once, holding the communicators' read lock
/// from its start to its end.
struct NcclGroup<'a> {
    owner: &'a NcclComms,
    /// Until the group is closed.
    comms: Option<RwLockReadGuard<'a, Vec<Comm>>>,
    /// How long its end waits for NCCL to queue the parts on non-blocking communicators.
    timeout: Duration,
}

impl NcclGroup<'_> {
    fn close(&mut self) -> Result<()> {
        let Some(comms) = self.comms.take() else {
            return Ok(());
        };
        // NCCL launches on every rank's device here: the caller's context is restored after.
        let ended = keeping_context(|| self.owner.group_end(&comms, self.timeout));
        drop(comms);
        if matches!(
            ended,
            Err(Error::Peer(PeerError::CollectiveTimedOut { .. }))
        ) {
            // The parts were never all queued: the abort ends those that were.
            self.owner.abort();
        }
        ended
    }
}

impl Drop for NcclGroup<'_> {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

impl Group for NcclGroup<'_> {
    unsafe fn queue(&mut self, rank: usize, part: &Part) -> Result<()> {
        let comms = self
            .comms
            .as_ref()
            .expect("an open group holds its communicators");
        let comm = *comms.get(rank).ok_or_else(|| {
            Error::Usage(UsageError::RootOutOfRange {
                root: rank,
                ranks: comms.len(),
            })
        })?;
        let nccl = self.owner.nccl;
        // NCCL may make the rank's device current: the caller's context is restored after.
        // SAFETY: the caller's contract: the buffers hold what the part names on the rank's
        // device and stay untouched until the part completes on its stream.
        keeping_context(|| unsafe { nccl.enqueue(part, comm) })
    }

    fn end(mut self: Box<Self>) -> Result<()> {
        self.close()
    }
}

impl Collectives for CudaDriver {
    fn unique_id(&self) -> Result<(u32, [u8; UNIQUE_ID_BYTES])> {
        let nccl = nccl()?;
        let mut id = [0u8; UNIQUE_ID_BYTES];
        // SAFETY: `ncclGetUniqueId` writes one `ncclUniqueId` (128 bytes) at the pointer.
        let status = unsafe { (nccl.get_unique_id)(&mut id) };
        nccl.check("ncclGetUniqueId", status)?;
        Ok((u32::try_from(nccl.version).unwrap_or(0), id))
    }

    fn join(
        &self,
        id: &[u8; UNIQUE_ID_BYTES],
        library: u32,
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    ) -> Result<Box<dyn Communicators>> {
        use cudarc::driver::sys;
        let nccl = nccl()?;
        let here = u32::try_from(nccl.version).unwrap_or(0);
        if library != here {
            return Err(crate::driver::collective::other_library(library, here));
        }
        let too_large = |what, value| {
            Error::Usage(UsageError::ExceedsLimit {
                operation: "Communicator::join",
                what,
                value,
                limit: c_int::MAX as usize,
            })
        };
        let n = c_int::try_from(world).map_err(|_| too_large("world", world))?;
        let r = c_int::try_from(rank).map_err(|_| too_large("rank", rank))?;
        let id = UniqueId { internal: *id };
        let mut comm: Comm = std::ptr::null_mut();
        let ctx = self.ctx;
        let start = std::time::Instant::now();
        // NCCL joins on the current device: the engine's context is made current for the call,
        // and the caller's restored after.
        let joined = keeping_context(|| -> Result<()> {
            // SAFETY: `ctx` is this driver's retained primary context.
            let bound = unsafe { sys::cuCtxSetCurrent(ctx) };
            if bound != sys::CUresult::CUDA_SUCCESS {
                return Err(Error::Driver {
                    call: "cuCtxSetCurrent",
                    source: crate::error::DriverError::from_raw(bound),
                });
            }
            let Some(nb) = &nccl.nonblocking else {
                // An NCCL before 2.14: the blocking join, which has no deadline.
                // SAFETY: `comm` is an out pointer for one communicator; the id is passed by
                // value, as `nccl.h` declares it; rank and world were checked to fit.
                let status = unsafe { (nccl.comm_init_rank)(&mut comm, n, id, r) };
                return nccl.check("ncclCommInitRank", status);
            };
            let mut config = Config {
                size: std::mem::size_of::<Config>(),
                magic: CONFIG_MAGIC,
                version: CONFIG_VERSION,
                blocking: 0,
            };
            // SAFETY: as above, and `config` is a configuration NCCL reads `size` bytes of.
            let status = unsafe { (nb.init_rank_config)(&mut comm, n, id, r, &mut config) };
            if status != IN_PROGRESS {
                nccl.check("ncclCommInitRankConfig", status)?;
            }
            // The join goes on inside NCCL until every rank has come, or the deadline passes.
            loop {
                let mut state: Status = 0;
                // SAFETY: `comm` was made by the call above; `state` is an out pointer.
                let asked = unsafe { (nb.get_async_error)(comm, &mut state) };
                let failed =
                    nccl.check("ncclCommGetAsyncError", asked)
                        .and_then(|()| match state {
                            IN_PROGRESS => Ok(false),
                            done => nccl.check("ncclCommInitRankConfig", done).map(|()| true),
                        });
                match failed {
                    Ok(true) => return Ok(()),
                    Ok(false) if start.elapsed() < timeout => {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    outcome => {
                        // SAFETY: `comm` is this join's, aborted once and never used after.
                        let _ = unsafe { (nb.abort)(comm) };
                        return match outcome {
                            Err(error) => Err(error),
                            // NCCL does not say which ranks never came.
                            _ => Err(crate::error::PeerError::Unjoined {
                                rank,
                                world,
                                waited: start.elapsed(),
                                missing: None,
                            }
                            .into()),
                        };
                    }
                }
            }
        });
        joined?;
        Ok(Box::new(NcclComms {
            nccl,
            comms: RwLock::new(vec![comm]),
            nonblocking: nccl.nonblocking.is_some(),
            joined: true,
            rank,
            world,
        }))
    }

    fn communicators(&self, devices: &[DeviceId]) -> Result<Box<dyn Communicators>> {
        let nccl = nccl()?;
        let ordinals = devices
            .iter()
            .map(|d| {
                c_int::try_from(d.ordinal()).map_err(|_| {
                    Error::Usage(UsageError::ExceedsLimit {
                        operation: "Communicator::new",
                        what: "device ordinal",
                        value: d.ordinal(),
                        limit: c_int::MAX as usize,
                    })
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // NCCL makes each device's primary context (the engines') current as it goes: the
        // caller's is restored after.
        let comms = keeping_context(|| nccl.comm_init_all(&ordinals))?;
        let world = comms.len();
        Ok(Box::new(NcclComms {
            nccl,
            comms: RwLock::new(comms),
            nonblocking: false,
            joined: false,
            rank: 0,
            world,
        }))
    }
}
