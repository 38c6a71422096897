//! NCCL, loaded at run time: the handful of entry points the collectives call.
//!
//! The library is opened on first use, by its versioned name (`libnccl.so.2`, what NCCL's
//! packages install) and then its development name (`libnccl.so`); `CUFERRY_NCCL` names a file
//! to try first. A machine without it gets a typed [`SetupError::Unavailable`](crate::error::SetupError::Unavailable), never a panic.
//! cudarc's `nccl` module is not used for this: it looks only for unversioned names and names
//! with the CUDA major version, so it misses `libnccl.so.2` where no development symlink is
//! installed, and it panics where it finds nothing.

use crate::error::{Error, LibraryError, Result, SetupError, UsageError};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// `ncclComm_t`: an opaque communicator.
pub(crate) type Comm = *mut c_void;
/// `ncclResult_t`.
type Status = c_int;
/// `cudaStream_t` (the driver's `CUstream`).
pub(crate) type Stream = *mut c_void;

/// The entry points, typed as `nccl.h` declares them (stable across NCCL 2).
pub(crate) struct Nccl {
    /// Keeps the library loaded for as long as the entry points are reachable (the process).
    _library: libloading::Library,
    /// NCCL's version, as `ncclGetVersion` reports it (`major * 10000 + minor * 100 + patch`).
    pub(crate) version: c_int,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Status,
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
pub(crate) fn keeping_context<R>(f: impl FnOnce() -> R) -> R {
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
pub(crate) fn nccl() -> Result<&'static Nccl> {
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
    pub(crate) fn comm_init_all(&self, devices: &[c_int]) -> Result<Vec<Comm>> {
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
    pub(crate) unsafe fn comm_destroy(&self, comm: Comm) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("ncclCommDestroy", unsafe { (self.comm_destroy)(comm) })
    }

    /// Opens a group: the calls up to [`group_end`](Self::group_end) are launched together.
    pub(crate) fn group_start(&self) -> Result<()> {
        // SAFETY: no arguments; groups nest.
        self.check("ncclGroupStart", unsafe { (self.group_start)() })
    }

    /// Closes the group and launches its calls.
    pub(crate) fn group_end(&self) -> Result<()> {
        // SAFETY: no arguments; called once per `group_start`.
        self.check("ncclGroupEnd", unsafe { (self.group_end)() })
    }

    /// Queues an in-place all-reduce of `count` elements at `buffer` on `stream`.
    ///
    /// # Safety
    /// `buffer` holds `count` elements of `dtype` on `comm`'s device and stays allocated, and
    /// untouched by other work, until the operation has completed on `stream`, a stream of that
    /// device's primary context.
    pub(crate) unsafe fn all_reduce(
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
    pub(crate) unsafe fn broadcast(
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
