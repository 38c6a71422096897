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
use crate::driver::collective::{
    CollectiveKind, Collectives, Communicators, Group, Part, Reduction, UNIQUE_ID_BYTES,
};
use crate::dtype::DType;
use crate::error::{DeviceId, Error, LibraryError, Result, SetupError, UsageError};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

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

    /// Closes the group and launches its calls.
    /// Queues an in-place all-reduce of `count` elements at `buffer` on `stream`.
    ///
    /// # Safety
    /// `buffer` holds `count` elements of `dtype` on `comm`'s device and stays allocated, and
    /// untouched by other work, until the operation has completed on `stream`, a stream of that
    /// device's primary context.
    unsafe fn all_reduce(
        &self,
        buffer: u64,
        count: usize,
        dtype: c_int,
        op: c_int,
        comm: Comm,
        stream: Stream,
    ) -> Result<()> {
        let ptr = buffer as *mut c_void;
        // SAFETY: the caller's contract; in place, as `nccl.h` allows (send == receive).
        let status = unsafe { (self.all_reduce)(ptr, ptr, count, dtype, op, comm, stream) };
        self.check("ncclAllReduce", status)
    }

    /// Queues an in-place broadcast of `count` elements at `buffer` from rank `root` on
    /// `stream`.
    ///
    /// # Safety
    /// As [`all_reduce`](Self::all_reduce).
    unsafe fn broadcast(
        &self,
        buffer: u64,
        count: usize,
        dtype: c_int,
        root: c_int,
        comm: Comm,
        stream: Stream,
    ) -> Result<()> {
        let ptr = buffer as *mut c_void;
        // SAFETY: the caller's contract; in place, as `nccl.h` allows.
        let status = unsafe { (self.broadcast)(ptr, ptr, count, dtype, root, comm, stream) };
        self.check("ncclBroadcast", status)
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

/// NCCL communicators, one per rank, destroyed on drop.
struct NcclComms {
    nccl: &'static Nccl,
    comms: Vec<Comm>,
    /// Whether the communicators were made non-blocking: NCCL's calls on them may then return
    /// `ncclInProgress`, and the group's end waits for the enqueue to finish.
    nonblocking: bool,
}

// SAFETY: NCCL communicators may be used from any thread as long as calls on one are not made
// concurrently; the engines serialise every collective over them (each call borrows every
// member engine exclusively), and the destroy runs once, from the last owner.
unsafe impl Send for NcclComms {}
// SAFETY: as above: the trait's calls are made only with every member engine borrowed
// exclusively, so never concurrently.
unsafe impl Sync for NcclComms {}

impl Drop for NcclComms {
    fn drop(&mut self) {
        // Any thread may drop the last reference: NCCL makes each communicator's device current
        // to destroy it, and the thread's own context is put back.
        keeping_context(|| {
            for &comm in &self.comms {
                // SAFETY: made by `ncclCommInitAll`, destroyed once; the owner keeps this value
                // alive until every collective queued on it has completed.
                let _ = unsafe { self.nccl.comm_destroy(comm) };
            }
        });
    }
}

impl NcclComms {
    /// Ends the group. On non-blocking communicators the end may return `ncclInProgress` while
    /// NCCL is still queuing the parts: it waits until each communicator's state has settled,
    /// so that what is recorded on the streams after the end follows the parts.
    fn group_end(&self) -> Result<()> {
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
        for &comm in &self.comms {
            loop {
                let mut state: Status = 0;
                // SAFETY: `comm` is live (this value owns it); `state` is an out pointer.
                let asked = unsafe { (nb.get_async_error)(comm, &mut state) };
                nccl.check("ncclCommGetAsyncError", asked)?;
                if state != IN_PROGRESS {
                    nccl.check("ncclGroupEnd", state)?;
                    break;
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }
}

impl Communicators for NcclComms {
    fn group(&self) -> Result<Box<dyn Group + '_>> {
        self.nccl.group_start()?;
        Ok(Box::new(NcclGroup {
            comms: self,
            open: true,
        }))
    }
}

/// An NCCL group opened by `ncclGroupStart`, closed once.
struct NcclGroup<'a> {
    comms: &'a NcclComms,
    /// Until `end` closes it (else the drop does).
    open: bool,
}

impl NcclGroup<'_> {
    fn close(&mut self) -> Result<()> {
        self.open = false;
        // NCCL launches on every rank's device here: the caller's context is restored after.
        keeping_context(|| self.comms.group_end())
    }
}

impl Drop for NcclGroup<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = self.close();
        }
    }
}

impl Group for NcclGroup<'_> {
    unsafe fn queue(&mut self, rank: usize, part: &Part) -> Result<()> {
        let comms = self.comms;
        let comm = *comms
            .comms
            .get(rank)
            .ok_or(Error::Usage(UsageError::RootOutOfRange {
                root: rank,
                ranks: comms.comms.len(),
            }))?;
        let dtype = data_type(part.dtype)?;
        let stream = part.stream as Stream;
        // NCCL may make the rank's device current: the caller's context is restored after.
        keeping_context(|| match part.kind {
            // SAFETY: the caller's contract: the buffer holds `count` elements on the rank's
            // device and stays untouched until the part completes on `stream`.
            CollectiveKind::AllReduce(op) => unsafe {
                comms
                    .nccl
                    .all_reduce(part.buffer, part.count, dtype, red_op(op), comm, stream)
            },
            CollectiveKind::Broadcast { root } => {
                let root = c_int::try_from(root).map_err(|_| {
                    Error::Usage(UsageError::RootOutOfRange {
                        root,
                        ranks: comms.comms.len(),
                    })
                })?;
                // SAFETY: as above.
                unsafe {
                    comms
                        .nccl
                        .broadcast(part.buffer, part.count, dtype, root, comm, stream)
                }
            }
        })
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
                            _ => Err(crate::error::BootstrapError::Unjoined {
                                rank,
                                world,
                                waited: start.elapsed(),
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
            comms: vec![comm],
            nonblocking: nccl.nonblocking.is_some(),
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
        Ok(Box::new(NcclComms {
            nccl,
            comms,
            nonblocking: false,
        }))
    }
}
