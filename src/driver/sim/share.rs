//! Processes, and device memory and events shared between them: the sharing half of the seam
//! ([`Sharing`]) on the simulated device.
//!
//! Each [`SimDriver`] is a simulated process of its own: a pid from `0x4000_0000` on (never a
//! real one, whose pids stay below 2²²) and a start of its own, on this host and boot, so the
//! lifecycle of an exporter and its importers is tested on one machine, in one real process. A
//! process ends when its driver is dropped (it exits) or when a test kills it
//! ([`SimDevice::kill_process`], as the operating system kills a process): its context is torn
//! down, what it queued and has not run never comes, its imports are unmapped, and every later
//! call of its driver fails with `CUDA_ERROR_CONTEXT_IS_DESTROYED`.
//!
//! The names a driver hands out are CUDA's, checked as CUDA checks them:
//!
//! - **The pool's descriptor** is a real file descriptor (a `memfd`), made on the first
//!   [`pool_descriptor`](Sharing::pool_descriptor) and closed when the driver is dropped. Its inode
//!   is registered for every machine of the process to see, so a copy of it (`dup`, or one that
//!   travelled over a Unix socket with `SCM_RIGHTS`) names the pool, and any other descriptor is
//!   refused as a forged one.
//! - **An allocation's export data** and **an inter-process event's handle** are 64 bytes that
//!   the machine registers (a mark, the machine, the address or the event, a nonce, the
//!   exporting process): bytes it did not hand out are refused. As on a real driver, a pool
//!   exports its allocations only once it has been exported itself.
//!
//! An import maps the exporter's allocation at the same address (the machine's memory is one
//! address space here) until its release, which is stream-ordered like a free. CUDA requires
//! every importer's release to have completed before the exporter's free: a free that runs while
//! a live process still maps the memory is a [`Violation::FreedWhileImported`], and the memory
//! is kept until the last import is released (as imported memory outlives its exporter on a real
//! device), so the importer never touches freed memory. A job of an importer that uses the
//! memory after its release has run is a [`Violation::ImportUsedAfterRelease`]. An opened
//! event is an event of the importer's that shares the exporter's records; using it after the
//! exporter destroyed its own is a [`Violation::OpenedEventUsedAfterDestroy`] (CUDA leaves it
//! undefined), closing it is not.

use super::{
    DevicePtr, Driver, DriverError, EventHandle, Job, Lane, Running, SimDevice, SimDriver,
    SimEvent, SimOp, State, StreamId, Violation, driver_lane,
};
use crate::device::{DeviceId, DeviceKind};
use crate::driver::share::{NAME_BYTES, Name, Origin, Sharing, peer_is_process, start_of};
use crate::error::{Error, MalformedError};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// `CUDA_ERROR_CONTEXT_IS_DESTROYED`: every call of a killed process's driver.
pub(super) const CONTEXT_IS_DESTROYED: DriverError = DriverError::from_code(709);
/// `CUDA_ERROR_INVALID_DEVICE`: a pool of a device this driver cannot reach, or of another
/// machine.
const INVALID_DEVICE: DriverError = DriverError::from_code(101);

/// The first simulated pid: above every real one (Linux's `pid_max` is at most 2²²).
const FIRST_PID: u32 = 0x4000_0000;
static NEXT_PID: AtomicU32 = AtomicU32::new(FIRST_PID);
/// Simulated processes' starts, distinct for every process made.
static NEXT_START: AtomicU64 = AtomicU64::new(1);

/// The mark that opens a simulated device's UUID.
const UUID_MARK: &[u8; 4] = b"SIMD";
/// The mark that opens an allocation's export data.
const POINTER_MARK: &[u8; 8] = b"SIMXPTR1";
/// The mark that opens an inter-process event's handle.
const EVENT_MARK: &[u8; 8] = b"SIMIPCEV";
/// The tag of imported pools' handles, above any pool handle a driver gives out
/// (`Driver::pool`), so `alloc_from` refuses them.
const IMPORTED_POOL: u64 = 0x9000_0000_0000_0000;

/// A simulated process of the registry every machine sees: its start, and whether it was
/// killed. A process whose driver was dropped is removed: it has exited.
#[derive(Clone, Copy)]
struct Registered {
    start: u64,
    killed: bool,
}

/// Every simulated process of every machine of this (real) process that has not exited, by
/// pid, so a driver judges another machine's processes too.
static PROCESSES: Mutex<BTreeMap<u32, Registered>> = Mutex::new(BTreeMap::new());

/// A descriptor's inode: `fstat`'s device and inode number.
#[cfg(target_os = "linux")]
type Inode = (libc::dev_t, libc::ino_t);
/// A descriptor's inode (no descriptor is made where the simulator does not export pools).
#[cfg(not(target_os = "linux"))]
type Inode = (u64, u64);

/// An exported pool, as the registry of descriptors knows it.
#[derive(Clone, Copy)]
struct ExportedPool {
    /// The machine's instance.
    instance: u64,
    /// The exporting process.
    pid: u32,
    /// The device (index on the machine) whose memory the pool holds.
    index: usize,
}

/// Every exported pool of every machine of this process, by its descriptor's inode: the
/// descriptor an importer is given (a copy of the exporter's) names the same inode.
static POOLS: Mutex<BTreeMap<Inode, ExportedPool>> = Mutex::new(BTreeMap::new());

/// A registry's lock, even one poisoned by a panic.
fn registry<T>(lock: &Mutex<T>) -> MutexGuard<'_, T> {
    lock.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh descriptor for a pool: a `memfd`, an inode of its own.
#[cfg(target_os = "linux")]
fn new_descriptor() -> Result<OwnedFd, DriverError> {
    use std::os::fd::FromRawFd;
    // SAFETY: the name is a NUL-terminated string; the call makes a descriptor or fails.
    let fd = unsafe { libc::memfd_create(c"cuferry-sim-pool".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(DriverError::OUT_OF_MEMORY);
    }
    // SAFETY: the call just made `fd`, for this driver alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Where the simulator exports no pools: `CUDA_ERROR_NOT_SUPPORTED`.
#[cfg(not(target_os = "linux"))]
fn new_descriptor() -> Result<OwnedFd, DriverError> {
    Err(DriverError::NOT_SUPPORTED)
}

/// The inode `fd` names; `None` for a descriptor that is not open.
#[cfg(target_os = "linux")]
fn inode(fd: RawFd) -> Option<Inode> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: the out pointer is valid for one `stat`; `fstat` takes any number, failing with
    // `EBADF` for one that is not an open descriptor.
    if unsafe { libc::fstat(fd, stat.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: written by the successful call above.
    let stat = unsafe { stat.assume_init() };
    Some((stat.st_dev, stat.st_ino))
}

/// Where the simulator exports no pools, no descriptor names one.
#[cfg(not(target_os = "linux"))]
fn inode(_fd: RawFd) -> Option<Inode> {
    None
}

/// The UUID of device `ordinal` of machine `instance`: a mark, the instance, the ordinal.
fn uuid_of(instance: u64, ordinal: usize) -> [u8; 16] {
    let mut uuid = [0u8; 16];
    uuid[..4].copy_from_slice(UUID_MARK);
    uuid[4..12].copy_from_slice(&instance.to_le_bytes());
    uuid[12..].copy_from_slice(&u32::try_from(ordinal).unwrap_or(u32::MAX).to_le_bytes());
    uuid
}

/// The machine instance and the device ordinal a simulated device's UUID names.
fn parse_uuid(uuid: &[u8; 16]) -> Option<(u64, usize)> {
    if &uuid[..4] != UUID_MARK {
        return None;
    }
    let instance = u64::from_le_bytes(uuid[4..12].try_into().ok()?);
    let ordinal = u32::from_le_bytes(uuid[12..].try_into().ok()?);
    Some((instance, usize::try_from(ordinal).ok()?))
}

/// A name the machine hands out: `mark`, the machine, what it names, a nonce and the exporting
/// process, the rest zero.
fn name(mark: &[u8; 8], instance: u64, what: u64, nonce: u64, pid: u32) -> Name {
    let mut name = [0u8; NAME_BYTES];
    name[..8].copy_from_slice(mark);
    name[8..16].copy_from_slice(&instance.to_le_bytes());
    name[16..24].copy_from_slice(&what.to_le_bytes());
    name[24..32].copy_from_slice(&nonce.to_le_bytes());
    name[32..36].copy_from_slice(&pid.to_le_bytes());
    name
}

/// A driver's simulated process: its pid and its start.
#[derive(Clone, Copy, Debug)]
pub(super) struct Process {
    /// The simulated pid.
    pub(super) pid: u32,
    /// The simulated start (what tells a recycled pid apart).
    pub(super) start: u64,
}

/// Whether a simulated process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    /// Its driver is live.
    Live,
    /// Killed by [`SimDevice::kill_process`]: its context is torn down.
    Killed,
    /// Its driver was dropped.
    Exited,
}

/// A simulated process of the machine.
struct MachineProcess {
    /// Its driver's first stream.
    streams: StreamId,
    life: Life,
}

/// An exported allocation: its address and its exporting process.
struct Export {
    ptr: DevicePtr,
    pid: u32,
}

/// A pool a process imported.
struct ImportedPool {
    importer: u32,
    exporter: u32,
}

/// A process's import of one allocation.
#[derive(Default)]
struct Import {
    /// How many times it is mapped (each import maps it once more).
    mapped: usize,
    /// How many of those have a release queued and not run.
    releasing: usize,
}

/// An exported inter-process event: the event and its process.
struct IpcName {
    event: u64,
    pid: u32,
}

/// An inter-process event a process opened: the exporter's event it shares records with, and
/// the opening process.
struct Opened {
    /// The exporter's event.
    source: u64,
    /// The opening process.
    pid: u32,
}

/// The machine's processes and what they share (a part of the machine's [`State`]).
#[derive(Default)]
pub(super) struct ShareState {
    /// The machine's simulated processes (one per driver made on it), by pid.
    processes: BTreeMap<u32, MachineProcess>,
    /// Whether the machine's devices cannot export their pools (`set_pool_export(false)`).
    export_refused: bool,
    /// The process that allocated each live allocation, by address.
    owners: HashMap<DevicePtr, u32>,
    /// Exported allocations, by their export data.
    exports: HashMap<Name, Export>,
    /// Imported pools, by handle.
    pools: HashMap<u64, ImportedPool>,
    next_pool: u64,
    /// The next name's nonce.
    next_nonce: u64,
    /// Mapped imports, by importing process and address.
    imports: BTreeMap<(u32, DevicePtr), Import>,
    /// Imports whose release has run, not imported again since: a use of one is a violation.
    released: BTreeSet<(u32, DevicePtr)>,
    /// Allocations whose free ran (or whose process was killed) while another process mapped
    /// them: kept until their last import is released.
    kept: BTreeSet<DevicePtr>,
    /// Exported inter-process events, by handle.
    names: HashMap<Name, IpcName>,
    /// Opened inter-process events, by the opener's handle.
    opened: BTreeMap<u64, Opened>,
}

impl ShareState {
    /// Records that process `pid` allocated the block at `ptr`.
    pub(super) fn allocated(&mut self, ptr: DevicePtr, pid: u32) {
        self.owners.insert(ptr, pid);
    }

    /// Forgets the block at `ptr`, whose memory has returned to its device.
    pub(super) fn freed(&mut self, ptr: DevicePtr) {
        self.owners.remove(&ptr);
        self.kept.remove(&ptr);
        self.unexport(ptr);
    }

    /// Forgets the export data of the block at `ptr`: its free has run.
    fn unexport(&mut self, ptr: DevicePtr) {
        if !self.exports.is_empty() {
            self.exports.retain(|_, e| e.ptr != ptr);
        }
    }

    /// The processes that map the block at `ptr`, in pid order.
    fn importers(&self, ptr: DevicePtr) -> Vec<u32> {
        self.imports
            .keys()
            .filter(|&&(_, at)| at == ptr)
            .map(|&(pid, _)| pid)
            .collect()
    }

    /// A fresh nonce for a name.
    fn nonce(&mut self) -> u64 {
        self.next_nonce += 1;
        self.next_nonce
    }
}

impl State {
    /// Makes the simulated process of a driver whose first stream is `streams`.
    pub(super) fn start_process(&mut self, streams: StreamId) -> Process {
        let pid = NEXT_PID.fetch_add(1, Ordering::Relaxed);
        let start = NEXT_START.fetch_add(1, Ordering::Relaxed);
        registry(&PROCESSES).insert(
            pid,
            Registered {
                start,
                killed: false,
            },
        );
        self.share.processes.insert(
            pid,
            MachineProcess {
                streams,
                life: Life::Live,
            },
        );
        Process { pid, start }
    }

    /// Fails the call of a killed process's driver (`CUDA_ERROR_CONTEXT_IS_DESTROYED`).
    pub(super) fn alive(&self) -> Result<(), DriverError> {
        if self.killed(self.caller) {
            return Err(CONTEXT_IS_DESTROYED);
        }
        Ok(())
    }

    /// Whether `pid` names a killed process of this machine.
    pub(super) fn killed(&self, pid: Option<u32>) -> bool {
        pid.and_then(|pid| self.share.processes.get(&pid))
            .is_some_and(|p| p.life == Life::Killed)
    }

    /// Whether `pid` names a running process of this machine.
    fn process_live(&self, pid: u32) -> bool {
        self.share
            .processes
            .get(&pid)
            .is_some_and(|p| p.life == Life::Live)
    }

    /// The process whose driver owns `stream`.
    fn process_of(&self, stream: StreamId) -> Option<u32> {
        let first = stream - stream % Lane::ALL.len();
        self.share
            .processes
            .iter()
            .find(|(_, p)| p.streams == first)
            .map(|(&pid, _)| pid)
    }

    /// What a free of the live block at `ptr` does when it runs while other processes map it:
    /// a violation for each, and the memory kept until the last releases it. Its export data
    /// is forgotten either way. Returns whether the block is kept.
    pub(super) fn freed_while_imported(&mut self, ptr: DevicePtr) -> bool {
        self.share.unexport(ptr);
        let importers = self.share.importers(ptr);
        if importers.is_empty() {
            return false;
        }
        let bytes = self.mem.get(&ptr).map_or(0, Vec::len);
        for pid in importers {
            self.violations
                .push(Violation::FreedWhileImported { ptr, bytes, pid });
        }
        self.share.kept.insert(ptr);
        true
    }

    /// Releases the block at `ptr` if it was kept for its imports and none is left.
    fn unkeep(&mut self, ptr: DevicePtr) {
        if self.share.kept.contains(&ptr) && self.share.importers(ptr).is_empty() {
            self.release_block(ptr);
        }
    }

    /// Runs process `pid`'s release of its import at `ptr`: one mapping fewer.
    pub(super) fn run_release(&mut self, pid: u32, ptr: DevicePtr) {
        // None when the process ended meanwhile: its imports went with it.
        let Some(import) = self.share.imports.get_mut(&(pid, ptr)) else {
            return;
        };
        import.mapped = import.mapped.saturating_sub(1);
        import.releasing = import.releasing.saturating_sub(1);
        if import.mapped == 0 {
            self.share.imports.remove(&(pid, ptr));
            self.share.released.insert((pid, ptr));
            self.unkeep(ptr);
        }
    }

    /// Reports the running job's use of the block at `base` when its process has released its
    /// import of it.
    pub(super) fn check_released(&mut self, job: Running, base: DevicePtr) {
        if self.share.released.is_empty() {
            return;
        }
        let Some(pid) = self.process_of(job.stream) else {
            return;
        };
        if !self.share.released.contains(&(pid, base)) {
            return;
        }
        let (driver, lane) = driver_lane(job.stream);
        let violation = Violation::ImportUsedAfterRelease {
            job: job.seq,
            kind: job.kind,
            driver,
            lane,
            ptr: base,
        };
        if !self.violations.contains(&violation) {
            self.violations.push(violation);
        }
    }

    /// Reports a use of `event` when it is an opened inter-process event whose exporter has
    /// destroyed its own.
    pub(super) fn check_opened(&mut self, event: EventHandle) {
        let Some(opened) = self.share.opened.get(&event.0) else {
            return;
        };
        if self.events.contains_key(&opened.source) {
            return;
        }
        let violation = Violation::OpenedEventUsedAfterDestroy { event: event.0 };
        if !self.violations.contains(&violation) {
            self.violations.push(violation);
        }
    }

    /// Shares `event`'s record (just made) with the events that share its records: the
    /// exporter's event and every opened copy of it.
    pub(super) fn share_record(&mut self, event: EventHandle) {
        if self.share.opened.is_empty() {
            return;
        }
        let source = self
            .share
            .opened
            .get(&event.0)
            .map_or(event.0, |o| o.source);
        let members: Vec<u64> = std::iter::once(source)
            .chain(
                self.share
                    .opened
                    .iter()
                    .filter(|(_, o)| o.source == source)
                    .map(|(&id, _)| id),
            )
            .filter(|&id| id != event.0)
            .collect();
        if members.is_empty() {
            return;
        }
        let Some((recorded, fault)) = self.events.get(&event.0).map(|e| (e.recorded, e.fault))
        else {
            return;
        };
        for id in members {
            if let Some(member) = self.events.get_mut(&id) {
                member.recorded = recorded;
                member.fault = fault;
            }
        }
    }

    /// Forgets `event` as an opened inter-process event (it was destroyed).
    pub(super) fn forget_opened(&mut self, event: EventHandle) {
        self.share.opened.remove(&event.0);
    }

    /// Ends process `pid` as `life` says: its imports are unmapped and its imported pools and
    /// names forgotten; when killed, its queued work is dropped unrun, its opened events
    /// closed and its memory returned to the devices (what another process maps, once that is
    /// released). Nothing when it has already ended.
    fn end_process(&mut self, pid: u32, life: Life) {
        let Some(process) = self.share.processes.get_mut(&pid) else {
            return;
        };
        if process.life != Life::Live {
            return;
        }
        process.life = life;
        let streams = process.streams;
        let killed = life == Life::Killed;
        if killed {
            self.drop_jobs(streams);
        }
        let share = &mut self.share;
        let mapped: Vec<DevicePtr> = share
            .imports
            .range((pid, 0)..=(pid, DevicePtr::MAX))
            .map(|(&(_, ptr), _)| ptr)
            .collect();
        for ptr in &mapped {
            share.imports.remove(&(pid, *ptr));
        }
        share.released.retain(|&(p, _)| p != pid);
        share.pools.retain(|_, p| p.importer != pid);
        share.exports.retain(|_, e| e.pid != pid);
        share.names.retain(|_, n| n.pid != pid);
        if killed {
            let opened: Vec<u64> = share
                .opened
                .iter()
                .filter(|(_, o)| o.pid == pid)
                .map(|(&id, _)| id)
                .collect();
            for id in opened {
                share.opened.remove(&id);
                self.events.remove(&id);
            }
            let mut owned: Vec<DevicePtr> = self
                .share
                .owners
                .iter()
                .filter(|&(_, &owner)| owner == pid)
                .map(|(&ptr, _)| ptr)
                .collect();
            owned.sort_unstable();
            for ptr in owned {
                if self.share.importers(ptr).is_empty() {
                    self.release_block(ptr);
                } else {
                    self.share.kept.insert(ptr);
                }
            }
        }
        for ptr in mapped {
            self.unkeep(ptr);
        }
        if killed {
            // Waits for its records no longer wait: those records never come.
            self.run_ordering();
        }
    }

    /// Drops, unrun, every job queued on the three streams from `streams` on: wakes due on
    /// their records are called (the device will never reach them), and their sends and
    /// receives leave their channels.
    fn drop_jobs(&mut self, streams: StreamId) {
        let mut gone = BTreeSet::new();
        for stream in streams..streams + Lane::ALL.len() {
            for (seq, job) in self.streams.remove(&stream).into_iter().flatten() {
                self.pending.remove(&seq);
                if job.orders_only() {
                    self.ordering_pending -= 1;
                }
                if let Some(wakes) = self.wakes.remove(&seq) {
                    self.woken.extend(wakes);
                }
                gone.insert(seq);
            }
            self.failed_streams.remove(&stream);
            self.captures.remove(&stream);
        }
        self.p2p_sends.retain(|_, seq| !gone.contains(seq));
        self.p2p_posted.retain(|_, seq| !gone.contains(seq));
    }
}

impl SimDevice {
    /// Kills simulated process `pid` (each driver, so each simulated engine, is a process of its
    /// own, named by the pid its origin reports; see [`processes`](Self::processes)), as the
    /// operating system kills a process:
    /// its driver's context is torn down. Every job that driver queued and that has not run is
    /// dropped without touching memory, and every event it recorded counts as complete for
    /// other drivers' waits (a destroyed context's work never comes); its imports are unmapped
    /// and the events it opened closed; its device memory returns to the devices, except what
    /// another process maps, which lives until that process releases it (its page-locked host
    /// memory stays: the test may still reach it). From then on every call of that driver fails
    /// with `CUDA_ERROR_CONTEXT_IS_DESTROYED` (709), its waits and queries and those its
    /// teardown makes included; it never panics or blocks. Killing a process that has already
    /// ended does nothing.
    ///
    /// # Panics
    /// When `pid` is not a process of this machine.
    pub fn kill_process(&self, pid: u32) {
        let mut s = self.lock();
        assert!(
            s.share.processes.contains_key(&pid),
            "process {pid:#x} is not a process of this simulated machine"
        );
        if !s.process_live(pid) {
            return;
        }
        if let Some(process) = registry(&PROCESSES).get_mut(&pid) {
            process.killed = true;
        }
        s.end_process(pid, Life::Killed);
        drop(s);
        self.inner.progress.notify_all();
    }

    /// Whether simulated process `pid` of this machine runs: its driver is live and it was not
    /// killed.
    pub fn process_alive(&self, pid: u32) -> bool {
        self.lock().process_live(pid)
    }

    /// The simulated processes of this machine, one per driver made on it, in the order they
    /// were made, ended or not.
    pub fn processes(&self) -> Vec<u32> {
        self.lock().share.processes.keys().copied().collect()
    }

    /// How many imports of other processes' memory the machine's processes map (each import
    /// counted, until its release has run).
    pub fn imports_live(&self) -> usize {
        self.lock().share.imports.values().map(|i| i.mapped).sum()
    }

    /// Whether the machine's devices can export their memory pools to other processes (a
    /// device without `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED` cannot);
    /// `true` unless set otherwise. From then on a pool's export, and an allocation's of a pool
    /// not exported yet, is refused with `CUDA_ERROR_NOT_SUPPORTED`.
    pub fn set_pool_export(&self, supported: bool) {
        self.lock().share.export_refused = !supported;
    }
}

impl Sharing for SimDriver {
    /// This host's and boot's identity, with the simulated process's pid and start.
    fn process(&self) -> Result<Origin, Error> {
        Ok(Origin {
            pid: self.process.pid,
            start: self.process.start,
            ..Origin::here()?
        })
    }

    /// Another host's or boot's process has ended; a simulated one once it was killed or its
    /// driver dropped (or when the start is not its own); a real one as the operating system
    /// says.
    fn process_ended(&self, origin: &Origin) -> bool {
        let Ok(here) = Origin::here() else {
            // A host whose identity cannot be read cannot tell: it keeps what it holds.
            return false;
        };
        if origin.host != here.host || origin.boot != here.boot {
            return true;
        }
        if origin.pid < FIRST_PID {
            return start_of(origin.pid) != Some(origin.start);
        }
        registry(&PROCESSES)
            .get(&origin.pid)
            .is_none_or(|p| p.killed || p.start != origin.start)
    }

    /// A simulated process runs inside this real one (the registry is this process's): the
    /// kernel must name this process, and the start must be the simulated process's own. A
    /// real process is judged as a real device judges it.
    fn check_peer(&self, claimed: &Origin, kernel_pid: u32) -> Result<(), Error> {
        if claimed.pid < FIRST_PID {
            return peer_is_process(claimed, kernel_pid);
        }
        let host = std::process::id();
        if kernel_pid != host {
            return Err(MalformedError::PeerIdentity {
                what: "pid",
                claimed: claimed.pid.into(),
                kernel: kernel_pid.into(),
            }
            .into());
        }
        match registry(&PROCESSES).get(&claimed.pid) {
            Some(p) if p.start == claimed.start => Ok(()),
            other => Err(MalformedError::PeerIdentity {
                what: "start time",
                claimed: claimed.start,
                kernel: other.map_or(0, |p| p.start),
            }
            .into()),
        }
    }

    /// A mark, the machine's instance and the device's ordinal.
    fn uuid(&self) -> [u8; 16] {
        let id = self.device();
        uuid_of(id.instance, id.ordinal)
    }

    fn reaches(&self, uuid: &[u8; 16]) -> Result<bool, DriverError> {
        let s = self.lock();
        s.alive()?;
        let Some((instance, ordinal)) = parse_uuid(uuid) else {
            return Ok(false);
        };
        if instance == s.instance && ordinal == self.device().ordinal {
            return Ok(true);
        }
        let peer = DeviceId {
            kind: DeviceKind::Simulated,
            ordinal,
            instance,
        };
        Ok(self.linked(&s, peer).is_some())
    }

    fn pool_descriptor(&mut self) -> Result<RawFd, DriverError> {
        let mut s = self.lock();
        s.alive()?;
        if s.share.export_refused {
            return Err(DriverError::NOT_SUPPORTED);
        }
        if let Some(fd) = &self.pool_fd {
            return Ok(fd.as_raw_fd());
        }
        s.enter(SimOp::PoolExportToShareableHandle)?;
        let fd = new_descriptor()?;
        let inode = inode(fd.as_raw_fd()).ok_or(DriverError::OUT_OF_MEMORY)?;
        registry(&POOLS).insert(
            inode,
            ExportedPool {
                instance: s.instance,
                pid: self.process.pid,
                index: self.index(),
            },
        );
        drop(s);
        let raw = fd.as_raw_fd();
        self.pool_fd = Some(fd);
        Ok(raw)
    }

    fn export_pointer(&mut self, ptr: DevicePtr) -> Result<Name, DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::PoolExportPointer)?;
        let pid = self.process.pid;
        // As on a real driver, a pool exports its allocations only once it is exported itself.
        if s.share.export_refused && self.pool_fd.is_none() {
            return Err(DriverError::NOT_SUPPORTED);
        }
        let ours = s.mem.contains_key(&ptr) && s.share.owners.get(&ptr) == Some(&pid);
        if self.pool_fd.is_none() || !ours {
            return Err(DriverError::INVALID_VALUE);
        }
        let nonce = s.share.nonce();
        let data = name(POINTER_MARK, s.instance, ptr, nonce, pid);
        s.share.exports.insert(data, Export { ptr, pid });
        Ok(data)
    }

    fn import_pool(&mut self, fd: RawFd, from: &[u8; 16]) -> Result<u64, DriverError> {
        let exported = inode(fd).and_then(|inode| registry(&POOLS).get(&inode).copied());
        let mut s = self.lock();
        s.enter(SimOp::PoolImportFromShareableHandle)?;
        // A descriptor of no exported pool: a forged one (or one closed).
        let Some(pool) = exported else {
            return Err(DriverError::INVALID_VALUE);
        };
        if pool.instance != s.instance {
            return Err(INVALID_DEVICE);
        }
        if *from != uuid_of(s.instance, s.ordinal + pool.index) || !s.process_live(pool.pid) {
            return Err(DriverError::INVALID_VALUE);
        }
        let index = self.index();
        if pool.index != index && !s.peer_linked[index][pool.index] {
            return Err(INVALID_DEVICE);
        }
        s.share.next_pool += 1;
        let handle = IMPORTED_POOL | s.share.next_pool;
        s.share.pools.insert(
            handle,
            ImportedPool {
                importer: self.process.pid,
                exporter: pool.pid,
            },
        );
        Ok(handle)
    }

    unsafe fn import_pointer(&mut self, pool: u64, data: &Name) -> Result<DevicePtr, DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::PoolImportPointer)?;
        let pid = self.process.pid;
        let exporter = match s.share.pools.get(&pool) {
            Some(p) if p.importer == pid => p.exporter,
            _ => return Err(DriverError::INVALID_VALUE),
        };
        let ptr = match s.share.exports.get(data) {
            Some(e) if e.pid == exporter => e.ptr,
            _ => return Err(DriverError::INVALID_VALUE),
        };
        if !s.mem.contains_key(&ptr) || !s.process_live(exporter) {
            return Err(DriverError::INVALID_VALUE);
        }
        s.share.imports.entry((pid, ptr)).or_default().mapped += 1;
        s.share.released.remove(&(pid, ptr));
        Ok(ptr)
    }

    unsafe fn release_import(&mut self, lane: Lane, ptr: DevicePtr) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(lane);
        s.enter_stream(SimOp::ImportFreeAsync, stream)?;
        let pid = self.process.pid;
        match s.share.imports.get_mut(&(pid, ptr)) {
            Some(import) if import.mapped > import.releasing => import.releasing += 1,
            _ => return Err(DriverError::INVALID_VALUE),
        }
        s.push(stream, Job::Release { pid, ptr });
        Ok(())
    }

    /// The live block that holds `ptr`, from the machine's allocation table, when this process
    /// allocated it or maps it (an import whose release has not run); `CUDA_ERROR_INVALID_VALUE`
    /// otherwise, as CUDA refuses an address its context does not map.
    fn address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::GetAddressRange)?;
        let Some((&base, block)) = s.mem.range(..=ptr).next_back() else {
            return Err(DriverError::INVALID_VALUE);
        };
        let inside = usize::try_from(ptr - base).is_ok_and(|off| off < block.len());
        let pid = self.process.pid;
        let reached = s.share.owners.get(&base) == Some(&pid)
            || s.share
                .imports
                .get(&(pid, base))
                .is_some_and(|i| i.mapped > 0 && !s.share.released.contains(&(pid, base)));
        if !inside || !reached {
            return Err(DriverError::INVALID_VALUE);
        }
        Ok((base, block.len()))
    }

    fn ipc_event_create(&mut self) -> Result<(EventHandle, Name), DriverError> {
        let mut s = self.lock();
        let event = s.create_event(SimOp::IpcGetEventHandle, false)?;
        let pid = self.process.pid;
        let nonce = s.share.nonce();
        let handle = name(EVENT_MARK, s.instance, event.0, nonce, pid);
        s.share.names.insert(
            handle,
            IpcName {
                event: event.0,
                pid,
            },
        );
        Ok((event, handle))
    }

    fn ipc_event_open(&mut self, handle: &Name) -> Result<EventHandle, DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::IpcOpenEventHandle)?;
        let (source, exporter) = match s.share.names.get(handle) {
            Some(n) => (n.event, n.pid),
            None => return Err(DriverError::INVALID_VALUE),
        };
        if !s.process_live(exporter) {
            return Err(DriverError::INVALID_VALUE);
        }
        // An event the exporter has destroyed has no handle any more.
        let Some((recorded, fault)) = s.events.get(&source).map(|e| (e.recorded, e.fault)) else {
            return Err(DriverError::INVALID_VALUE);
        };
        let id = s.next_event;
        s.next_event += 1;
        let pid = self.process.pid;
        s.events.insert(
            id,
            SimEvent {
                ordering: false,
                recorded,
                fault,
                owner: Some(pid),
            },
        );
        s.share.opened.insert(id, Opened { source, pid });
        Ok(EventHandle(id))
    }

    unsafe fn ipc_event_close(&mut self, event: EventHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::IpcEventDestroy)?;
        match s.share.opened.get(&event.0) {
            Some(o) if o.pid == self.process.pid => {}
            _ => return Err(DriverError::INVALID_VALUE),
        }
        s.share.opened.remove(&event.0);
        s.events.remove(&event.0);
        Ok(())
    }
}

/// A dropped driver's process exits: its exported pool's descriptor is closed (and forgotten),
/// its imports unmapped; what it queued still runs, as a dropped driver's work does.
impl Drop for SimDriver {
    fn drop(&mut self) {
        if let Some(fd) = self.pool_fd.take()
            && let Some(inode) = inode(fd.as_raw_fd())
        {
            registry(&POOLS).remove(&inode);
        }
        let pid = self.process.pid;
        let mut s = self.device.lock();
        s.end_process(pid, Life::Exited);
        drop(s);
        registry(&PROCESSES).remove(&pid);
        self.device.inner.progress.notify_all();
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::super::{Schedule, SimConfig};
    use super::*;
    use std::os::fd::FromRawFd;
    use std::os::unix::net::UnixStream;

    fn machine(devices: usize) -> SimDevice {
        SimDevice::new(SimConfig {
            devices,
            ..SimConfig::default()
        })
    }

    /// An exporter and an importer: two drivers, two processes, on device 0 of one machine.
    fn pair() -> (SimDevice, SimDriver, SimDriver) {
        let dev = machine(1);
        let exporter = SimDriver::new(dev.clone());
        let importer = SimDriver::new(dev.clone());
        (dev, exporter, importer)
    }

    /// Queues an upload of `bytes` to `ptr` (from pageable memory: staged at the call).
    fn upload(d: &mut SimDriver, ptr: DevicePtr, bytes: &[u8]) {
        // SAFETY: `bytes` is readable for the call, which stages it.
        unsafe { d.copy_htod(ptr, bytes.as_ptr(), bytes.len()) }.unwrap();
    }

    /// `bytes` bytes at `ptr`, downloaded into pageable memory (complete when the call returns).
    fn download(d: &mut SimDriver, ptr: DevicePtr, bytes: usize) -> Vec<u8> {
        let mut out = vec![0u8; bytes];
        // SAFETY: `out` is writable for the call, which completes the copy before returning.
        unsafe { d.copy_dtoh(out.as_mut_ptr(), ptr, bytes) }.unwrap();
        out
    }

    /// What an exporter hands out for an allocation it wrote: its pool's descriptor, the
    /// allocation's export data, and an inter-process event recorded after its writes.
    struct Exported {
        ptr: DevicePtr,
        fd: RawFd,
        data: Name,
        event: EventHandle,
        handle: Name,
    }

    /// The exporter allocates `bytes.len()` bytes, writes `bytes` there and exports them.
    fn export(d: &mut SimDriver, bytes: &[u8]) -> Exported {
        let ptr = d.alloc(Lane::Compute, bytes.len()).unwrap();
        upload(d, ptr, bytes);
        let (event, handle) = d.ipc_event_create().unwrap();
        d.event_record(Lane::Upload, event).unwrap();
        let fd = d.pool_descriptor().unwrap();
        let data = d.export_pointer(ptr).unwrap();
        Exported {
            ptr,
            fd,
            data,
            event,
            handle,
        }
    }

    /// What an importer learns of an export: the exporter's origin and device, the export data
    /// and the event's handle.
    struct Offer {
        origin: Origin,
        device: [u8; 16],
        pointer: Name,
        event: Name,
    }

    /// Sends `bytes` with `fd` beside them (`SCM_RIGHTS`) on `tx`.
    fn send_with(tx: &UnixStream, bytes: &[u8], fd: RawFd) {
        let sent = crate::fd_passing::send_with_fds(tx.as_raw_fd(), bytes, &[&[fd]], 0);
        assert_eq!(sent.unwrap(), bytes.len());
    }

    /// Receives `len` bytes and the descriptor beside them on `rx`.
    fn recv_with(rx: &UnixStream, len: usize) -> (Vec<u8>, OwnedFd) {
        let mut bytes = vec![0u8; len];
        let got = crate::fd_passing::recv_with_fds(rx.as_raw_fd(), &mut bytes, 1, 0).unwrap();
        assert_eq!(got.bytes, len);
        let mut fds = got.fds.into_iter();
        let fd = fds.next().expect("a descriptor beside the bytes");
        assert!(fds.next().is_none() && !got.truncated);
        (bytes, fd)
    }

    /// The offer of `e`, its names sent with its pool's descriptor over a real Unix socket
    /// (`SCM_RIGHTS`), as received on the other end: a new descriptor of the same pool.
    fn carry(exporter: &SimDriver, e: &Exported) -> (OwnedFd, Offer) {
        let (tx, rx) = UnixStream::pair().unwrap();
        send_with(&tx, &[e.data, e.handle].concat(), e.fd);
        let (names, fd) = recv_with(&rx, 2 * NAME_BYTES);
        assert_ne!(fd.as_raw_fd(), e.fd, "a new descriptor, of the same pool");
        let offer = Offer {
            origin: exporter.process().unwrap(),
            device: exporter.uuid(),
            pointer: names[..NAME_BYTES].try_into().unwrap(),
            event: names[NAME_BYTES..].try_into().unwrap(),
        };
        (fd, offer)
    }

    /// The importer imports what `offer` names, from `fd`, and waits for the offer's event on
    /// its compute lane: the mapped address and the opened event.
    fn import(d: &mut SimDriver, fd: &OwnedFd, offer: &Offer) -> (DevicePtr, EventHandle) {
        let pool = d.import_pool(fd.as_raw_fd(), &offer.device).unwrap();
        // SAFETY: the test keeps the exporter's allocation until the release has run.
        let ptr = unsafe { d.import_pointer(pool, &offer.pointer) }.unwrap();
        let event = d.ipc_event_open(&offer.event).unwrap();
        d.stream_wait(Lane::Compute, event).unwrap();
        d.stream_wait(Lane::Download, event).unwrap();
        (ptr, event)
    }

    #[test]
    fn an_address_range_comes_from_the_allocation_table_for_what_the_process_reaches() {
        let (_dev, mut exporter, mut importer) = pair();
        let e = export(&mut exporter, &[7u8; 48]);
        // The exporter's own allocation, from its start and from inside it; not past its end.
        assert_eq!(exporter.address_range(e.ptr), Ok((e.ptr, 48)));
        assert_eq!(exporter.address_range(e.ptr + 20), Ok((e.ptr, 48)));
        assert_eq!(
            exporter.address_range(e.ptr + 48),
            Err(DriverError::INVALID_VALUE)
        );
        // Another process's memory is not reached before it maps it, nor after its release.
        assert_eq!(
            importer.address_range(e.ptr),
            Err(DriverError::INVALID_VALUE)
        );
        let (fd, offer) = carry(&exporter, &e);
        let (ptr, event) = import(&mut importer, &fd, &offer);
        assert_eq!(importer.address_range(ptr + 47), Ok((e.ptr, 48)));
        // SAFETY: the opened event's waits were queued before; no later wait names it.
        unsafe { importer.ipc_event_close(event) }.unwrap();
        // SAFETY: imported above, released once; nothing queued later uses it.
        unsafe { importer.release_import(Lane::Compute, ptr) }.unwrap();
        importer.waits().stream_synchronize().unwrap();
        assert_eq!(importer.address_range(ptr), Err(DriverError::INVALID_VALUE));
    }

    #[test]
    fn an_importer_reads_what_the_exporter_wrote_through_a_descriptor_sent_over_a_socket() {
        let (dev, mut exporter, mut importer) = pair();
        let bytes: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        let e = export(&mut exporter, &bytes);
        assert_eq!(
            exporter.pool_descriptor(),
            Ok(e.fd),
            "the pool is exported once and its descriptor kept"
        );
        assert_eq!(dev.calls(SimOp::PoolExportToShareableHandle), 1);
        let (fd, offer) = carry(&exporter, &e);
        assert_eq!(offer.origin.pid, exporter.process().unwrap().pid);
        assert!(!importer.process_ended(&offer.origin));
        assert!(importer.reaches(&offer.device).unwrap());
        let (ptr, event) = import(&mut importer, &fd, &offer);
        assert_eq!(ptr, e.ptr, "one address space: the same address");
        assert_eq!(dev.imports_live(), 1);
        // The importer's own copy of the shared bytes, after the exporter's event.
        let mine = importer.alloc(Lane::Compute, bytes.len()).unwrap();
        // SAFETY: both are live allocations the importer reaches; the copy is waited for below.
        unsafe { importer.copy_dtod(mine, ptr, bytes.len()) }.unwrap();
        let after = importer.event_create().unwrap();
        importer.event_record(Lane::Compute, after).unwrap();
        // SAFETY: the opened event's wait was queued before; no later wait names it.
        unsafe { importer.ipc_event_close(event) }.unwrap();
        // SAFETY: the import's only use (the copy) is on the release's lane, before it.
        unsafe { importer.release_import(Lane::Compute, ptr) }.unwrap();
        importer.waits().event_synchronize(after).unwrap();
        assert_eq!(dev.peek(mine, bytes.len()).unwrap(), bytes);
        importer.waits().stream_synchronize().unwrap();
        assert_eq!(dev.imports_live(), 0, "the release has run");
        // The exporter frees once the release has run: no violation.
        exporter.stream_wait(Lane::Compute, after).unwrap();
        // SAFETY: every use of the allocation is ordered before the free.
        unsafe { exporter.free(Lane::Compute, e.ptr) }.unwrap();
        exporter.waits().stream_synchronize().unwrap();
        assert_eq!(download(&mut importer, mine, bytes.len()), bytes);
        // SAFETY: made here, not used again.
        unsafe {
            exporter.event_destroy(e.event).unwrap();
            importer.event_destroy(after).unwrap();
            importer.free(Lane::Compute, mine).unwrap();
        }
        dev.advance_all();
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
        assert_eq!(dev.events_live(), 0);
        assert_eq!(dev.device_live(), (0, 0));
    }

    #[test]
    fn forged_descriptors_pointers_and_event_handles_are_refused() {
        let (dev, mut exporter, mut importer) = pair();
        let ptr = exporter.alloc(Lane::Compute, 16).unwrap();
        assert_eq!(
            exporter.export_pointer(ptr),
            Err(DriverError::INVALID_VALUE),
            "as on a real driver: not before the pool is exported"
        );
        let e = export(&mut exporter, &[7; 16]);
        let uuid = exporter.uuid();
        // A pipe's descriptor, and one that is not open.
        let mut pipe = [0; 2];
        // SAFETY: `pipe` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: just made by `pipe`, owned here.
        let pipe = pipe.map(|fd| unsafe { OwnedFd::from_raw_fd(fd) });
        for fd in [pipe[0].as_raw_fd(), -1] {
            assert_eq!(
                importer.import_pool(fd, &uuid),
                Err(DriverError::INVALID_VALUE)
            );
        }
        // The right descriptor from the wrong device.
        assert_eq!(
            importer.import_pool(e.fd, &[0; 16]),
            Err(DriverError::INVALID_VALUE)
        );
        // A copy of the right one (as `SCM_RIGHTS` makes) is the pool.
        // SAFETY: `dup` of an open descriptor; the copy is owned here.
        let copy = unsafe { OwnedFd::from_raw_fd(libc::dup(e.fd)) };
        let pool = importer.import_pool(copy.as_raw_fd(), &uuid).unwrap();
        // Export data that was never handed out: zeros, a byte changed, another pool's.
        let mut changed = e.data;
        changed[24] ^= 1;
        for data in [[0u8; NAME_BYTES], changed] {
            // SAFETY: refused, nothing is mapped.
            let got = unsafe { importer.import_pointer(pool, &data) };
            assert_eq!(got, Err(DriverError::INVALID_VALUE));
        }
        // SAFETY: as above: an imported pool handle the importer never got.
        let got = unsafe { importer.import_pointer(pool + 1, &e.data) };
        assert_eq!(got, Err(DriverError::INVALID_VALUE));
        // Only the allocating driver exports an allocation, and only a live one.
        let theirs = importer.alloc(Lane::Compute, 16).unwrap();
        assert_eq!(
            exporter.export_pointer(theirs),
            Err(DriverError::INVALID_VALUE)
        );
        assert_eq!(
            exporter.export_pointer(e.ptr + 1),
            Err(DriverError::INVALID_VALUE)
        );
        // Event handles never handed out.
        let mut changed = e.handle;
        changed[16] ^= 1;
        for handle in [[0u8; NAME_BYTES], changed, e.data] {
            assert_eq!(
                importer.ipc_event_open(&handle),
                Err(DriverError::INVALID_VALUE)
            );
        }
        // A release of what the importer did not import, a close of what it did not open.
        // SAFETY: refused.
        unsafe {
            assert_eq!(
                importer.release_import(Lane::Compute, e.ptr),
                Err(DriverError::INVALID_VALUE)
            );
            assert_eq!(
                importer.ipc_event_close(e.event),
                Err(DriverError::INVALID_VALUE)
            );
        }
        // Another machine's pool.
        let other = machine(1);
        let mut stranger = SimDriver::new(other.clone());
        assert_eq!(stranger.import_pool(e.fd, &uuid), Err(INVALID_DEVICE));
        assert_eq!(
            stranger.ipc_event_open(&e.handle),
            Err(DriverError::INVALID_VALUE)
        );
        assert_eq!(dev.imports_live(), 0);
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    #[test]
    fn an_allocation_whose_free_has_run_cannot_be_imported() {
        let (dev, mut exporter, mut importer) = pair();
        let e = export(&mut exporter, &[1; 32]);
        let pool = importer.import_pool(e.fd, &exporter.uuid()).unwrap();
        // SAFETY: nothing uses the allocation after its free.
        unsafe { exporter.free(Lane::Compute, e.ptr) }.unwrap();
        exporter.waits().stream_synchronize().unwrap();
        // SAFETY: refused: the free has run.
        let late = unsafe { importer.import_pointer(pool, &e.data) };
        assert_eq!(late, Err(DriverError::INVALID_VALUE));
        assert_eq!(
            exporter.export_pointer(e.ptr),
            Err(DriverError::INVALID_VALUE)
        );
        assert_eq!(dev.imports_live(), 0);
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    #[test]
    fn an_exporters_free_while_an_importer_maps_the_memory_is_a_violation_and_keeps_it() {
        let (dev, mut exporter, mut importer) = pair();
        let e = export(&mut exporter, &[9; 48]);
        let (fd, offer) = carry(&exporter, &e);
        let (ptr, event) = import(&mut importer, &fd, &offer);
        // SAFETY: (the violation under test) the importer has not released its import.
        unsafe { exporter.free(Lane::Compute, e.ptr) }.unwrap();
        exporter.waits().stream_synchronize().unwrap();
        let pid = importer.process().unwrap().pid;
        assert_eq!(
            dev.violations(),
            vec![Violation::FreedWhileImported {
                ptr: e.ptr,
                bytes: 48,
                pid
            }]
        );
        assert_eq!(dev.device_live(), (1, 48), "kept for the import");
        assert_eq!(
            download(&mut importer, ptr, 48),
            vec![9; 48],
            "the importer reads memory that is still there"
        );
        // SAFETY: the download completed; the event's wait was queued before.
        unsafe {
            importer.ipc_event_close(event).unwrap();
            importer.release_import(Lane::Compute, ptr).unwrap();
        }
        importer.waits().stream_synchronize().unwrap();
        assert_eq!(dev.device_live(), (0, 0), "released with the last import");
        assert_eq!(dev.violations().len(), 1);
        // SAFETY: the exporter's event, not used again.
        unsafe { exporter.event_destroy(e.event) }.unwrap();
    }

    #[test]
    fn a_free_after_the_release_has_run_is_no_violation_and_a_use_after_it_is_one() {
        let (dev, mut exporter, mut importer) = pair();
        let e = export(&mut exporter, &[3; 16]);
        let (fd, offer) = carry(&exporter, &e);
        let (ptr, event) = import(&mut importer, &fd, &offer);
        // SAFETY: no use of the import is queued; the event's wait was queued before.
        unsafe {
            importer.ipc_event_close(event).unwrap();
            importer.release_import(Lane::Compute, ptr).unwrap();
        }
        importer.waits().stream_synchronize().unwrap();
        // (A use after the release, the violation under test: the memory is still live.)
        download(&mut importer, ptr, 16);
        let released = dev.violations();
        assert!(
            matches!(
                released.as_slice(),
                [Violation::ImportUsedAfterRelease { kind: "device-to-host copy", ptr: at, .. }]
                    if *at == ptr
            ),
            "{released:?}"
        );
        // SAFETY: the import was released before.
        unsafe { exporter.free(Lane::Compute, e.ptr) }.unwrap();
        exporter.waits().stream_synchronize().unwrap();
        assert_eq!(dev.violations(), released, "the free itself is fine");
        assert_eq!(dev.device_live(), (0, 0));
        // SAFETY: the exporter's event, not used again.
        unsafe { exporter.event_destroy(e.event) }.unwrap();
    }

    #[test]
    fn a_killed_importers_work_never_comes_and_its_every_later_call_fails() {
        let (dev, mut exporter, mut importer) = pair();
        let e = export(&mut exporter, &[5; 32]);
        let (fd, offer) = carry(&exporter, &e);
        let (ptr, event) = import(&mut importer, &fd, &offer);
        let origin = importer.process().unwrap();
        let waits = importer.waits();
        // The importer's queued work: a write into the shared memory, a record of its own
        // inter-process event the exporter waits for, and a release.
        dev.hold_clock(true);
        upload(&mut importer, ptr, &[0xEE; 32]);
        let (done, done_handle) = importer.ipc_event_create().unwrap();
        importer.event_record(Lane::Upload, done).unwrap();
        let theirs = exporter.ipc_event_open(&done_handle).unwrap();
        exporter.stream_wait(Lane::Compute, theirs).unwrap();
        let queued = dev.queued();
        dev.kill_process(origin.pid);
        dev.hold_clock(false);
        assert!(!dev.process_alive(origin.pid));
        assert!(exporter.process_ended(&origin));
        assert_eq!(
            dev.queued(),
            queued - 2,
            "the upload and the record are gone"
        );
        assert_eq!(dev.imports_live(), 0, "unmapped with its context");
        // Every later call of the killed driver fails, its waits and teardown's included.
        let gone = Err(CONTEXT_IS_DESTROYED);
        assert_eq!(importer.alloc(Lane::Compute, 8).map(|_| ()), gone);
        assert_eq!(importer.event_create().map(|_| ()), gone);
        assert_eq!(importer.event_record(Lane::Compute, done), gone);
        assert_eq!(importer.stream_wait(Lane::Compute, done), gone);
        assert_eq!(importer.pool_descriptor().map(|_| ()), gone);
        assert_eq!(importer.reaches(&offer.device), gone.map(|()| false));
        assert_eq!(waits.event_query(done), gone.map(|()| false));
        assert_eq!(waits.event_synchronize(done), gone);
        assert_eq!(waits.stream_synchronize(), gone);
        assert_eq!(waits.stream_query(), gone.map(|()| false));
        // SAFETY: refused, as every call of the killed driver.
        unsafe {
            assert_eq!(importer.release_import(Lane::Compute, ptr), gone);
            assert_eq!(importer.ipc_event_close(event), gone);
            assert_eq!(importer.event_destroy(done), gone);
            assert_eq!(importer.free(Lane::Compute, ptr), gone);
        }
        let calls = dev.calls(SimOp::Alloc);
        assert_eq!(importer.alloc(Lane::Compute, 8).map(|_| ()), gone);
        assert_eq!(
            dev.calls(SimOp::Alloc),
            calls,
            "a dead process's call is not counted"
        );
        // The exporter's wait for the dead importer's record holds nothing.
        exporter.waits().stream_synchronize().unwrap();
        assert_eq!(
            dev.peek(e.ptr, 32).unwrap(),
            vec![5; 32],
            "the dropped upload never touched memory"
        );
        // SAFETY: the importer is gone, so nothing maps the allocation any more.
        unsafe {
            exporter.ipc_event_close(theirs).unwrap();
            exporter.free(Lane::Compute, e.ptr).unwrap();
            exporter.event_destroy(e.event).unwrap();
        }
        exporter.waits().stream_synchronize().unwrap();
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
        assert_eq!(
            dev.events_live(),
            0,
            "the dead process's events went with it"
        );
        drop(importer);
        assert!(exporter.process_ended(&origin));
        dev.kill_process(origin.pid);
        assert_eq!(dev.device_live(), (0, 0));
    }

    #[test]
    fn a_killed_exporters_memory_lives_while_an_importer_maps_it() {
        let (dev, mut exporter, mut importer) = pair();
        let e = export(&mut exporter, &[4; 24]);
        let (fd, offer) = carry(&exporter, &e);
        let (ptr, event) = import(&mut importer, &fd, &offer);
        // The exporter's writes have run; then it dies.
        exporter.waits().stream_synchronize().unwrap();
        dev.kill_process(exporter.process().unwrap().pid);
        assert!(importer.process_ended(&offer.origin));
        assert_eq!(download(&mut importer, ptr, 24), vec![4; 24]);
        // New imports from the dead exporter are refused.
        let pool = importer.import_pool(fd.as_raw_fd(), &offer.device);
        assert_eq!(pool, Err(DriverError::INVALID_VALUE));
        assert_eq!(
            importer.ipc_event_open(&offer.event),
            Err(DriverError::INVALID_VALUE)
        );
        assert_eq!(dev.device_live(), (1, 24));
        // SAFETY: the download completed; the event's waits were queued before.
        unsafe {
            importer.ipc_event_close(event).unwrap();
            importer.release_import(Lane::Compute, ptr).unwrap();
        }
        importer.waits().stream_synchronize().unwrap();
        assert_eq!(dev.device_live(), (0, 0));
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    #[test]
    fn process_ended_tells_live_killed_dropped_and_foreign_processes() {
        let (dev, exporter, importer) = pair();
        let here = Origin::here().unwrap();
        let live = importer.process().unwrap();
        assert_eq!((live.host, live.boot), (here.host, here.boot));
        assert!(live.pid >= FIRST_PID);
        assert_ne!(live.pid, exporter.process().unwrap().pid);
        assert_eq!(dev.processes().len(), 2);
        assert!(!exporter.process_ended(&live));
        assert!(!exporter.process_ended(&here), "the real process runs");
        for ended in [
            Origin {
                host: [0xaa; 16],
                ..live
            },
            Origin {
                boot: [0xbb; 16],
                ..live
            },
            Origin {
                start: live.start + 1,
                ..live
            },
            Origin {
                pid: u32::MAX,
                ..live
            },
        ] {
            assert!(exporter.process_ended(&ended), "{ended:?}");
        }
        // A real process that exited.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(exporter.process_ended(&Origin { pid, ..here }));
        // A dropped driver's process has exited; a killed one's ended, seen from any machine.
        let other = SimDriver::new(machine(1));
        let killed = exporter.process().unwrap();
        dev.kill_process(killed.pid);
        assert!(other.process_ended(&killed));
        assert!(importer.process_ended(&killed));
        drop(importer);
        assert!(other.process_ended(&live));
        assert!(!dev.process_alive(live.pid));
    }

    #[test]
    fn uuids_name_the_machine_and_the_device_and_reach_linked_peers() {
        let dev = machine(2);
        let mut on0 = SimDriver::on(dev.clone(), 0).unwrap();
        let mut on1 = SimDriver::on(dev.clone(), 1).unwrap();
        let mut also0 = SimDriver::on(dev.clone(), 0).unwrap();
        assert_eq!(on0.uuid(), also0.uuid());
        assert_ne!(on0.uuid(), on1.uuid());
        assert_eq!(on0.reaches(&on1.uuid()), Ok(true));
        let stranger = SimDriver::new(machine(2));
        assert_ne!(stranger.uuid(), on0.uuid());
        assert_eq!(on0.reaches(&stranger.uuid()), Ok(false));
        assert_eq!(on0.reaches(&[0x42; 16]), Ok(false));
        // A pool of device 1, imported on device 0 across the link, and not without it.
        let fd = on1.pool_descriptor().unwrap();
        assert!(on0.import_pool(fd, &on1.uuid()).is_ok());
        assert_eq!(
            on0.import_pool(fd, &on0.uuid()),
            Err(DriverError::INVALID_VALUE),
            "not the pool's device"
        );
        dev.set_peer_link(0, 1, false);
        assert_eq!(on0.reaches(&on1.uuid()), Ok(false));
        assert_eq!(on0.reaches(&also0.uuid()), Ok(true));
        assert_eq!(on0.import_pool(fd, &on1.uuid()), Err(INVALID_DEVICE));
        // A device that cannot export its pool.
        dev.set_pool_export(false);
        assert_eq!(also0.pool_descriptor(), Err(DriverError::NOT_SUPPORTED));
        assert_eq!(on1.pool_descriptor(), Err(DriverError::NOT_SUPPORTED));
        dev.set_pool_export(true);
        assert_eq!(on1.pool_descriptor(), Ok(fd), "kept");
        // A dropped driver's descriptor is closed and its pool forgotten.
        // SAFETY: `dup` of an open descriptor; the copy is owned here.
        let copy = unsafe { OwnedFd::from_raw_fd(libc::dup(fd)) };
        let uuid1 = on1.uuid();
        drop(on1);
        assert_eq!(
            on0.import_pool(copy.as_raw_fd(), &uuid1),
            Err(DriverError::INVALID_VALUE)
        );
    }

    #[test]
    fn an_opened_event_shares_the_exporters_records_and_outlives_its_destroy() {
        let (dev, mut exporter, mut importer) = pair();
        let (event, handle) = exporter.ipc_event_create().unwrap();
        let opened = importer.ipc_event_open(&handle).unwrap();
        assert_ne!(opened, event, "an event of the importer's own");
        assert_eq!(dev.events_live(), 2);
        dev.hold_clock(true);
        let ptr = exporter.alloc(Lane::Compute, 8).unwrap();
        upload(&mut exporter, ptr, &[1; 8]);
        exporter.event_record(Lane::Upload, event).unwrap();
        assert_eq!(importer.waits().event_query(opened), Ok(false));
        dev.advance_all();
        assert_eq!(importer.waits().event_query(opened), Ok(true));
        dev.hold_clock(false);
        // The exporter destroys its event: the importer still closes its own.
        // SAFETY: not used again by the exporter.
        unsafe { exporter.event_destroy(event) }.unwrap();
        assert!(dev.violations().is_empty());
        // (A wait on it now, the violation under test: CUDA leaves it undefined.)
        importer.stream_wait(Lane::Compute, opened).unwrap();
        assert_eq!(
            dev.violations(),
            vec![Violation::OpenedEventUsedAfterDestroy { event: opened.0 }]
        );
        // SAFETY: opened here, closed once.
        unsafe { importer.ipc_event_close(opened) }.unwrap();
        // SAFETY: closed already: refused.
        let again = unsafe { importer.ipc_event_close(opened) };
        assert_eq!(again, Err(DriverError::INVALID_VALUE));
        assert_eq!(
            importer.ipc_event_open(&handle),
            Err(DriverError::INVALID_VALUE),
            "a destroyed event has no handle"
        );
        assert_eq!(dev.events_live(), 0);
    }

    #[test]
    fn every_sharing_call_is_a_fault_point() {
        let (dev, mut exporter, mut importer) = pair();
        let e = export(&mut exporter, &[2; 16]);
        let (fd, offer) = carry(&exporter, &e);
        let fault = DriverError::UNKNOWN;
        let mut fresh = SimDriver::new(dev.clone());
        dev.fail_nth(SimOp::PoolExportToShareableHandle, 1, fault);
        assert_eq!(fresh.pool_descriptor(), Err(fault));
        let fresh_fd = fresh.pool_descriptor().unwrap();
        assert_ne!(fresh_fd, e.fd);
        dev.fail_nth(SimOp::PoolExportPointer, 1, fault);
        assert_eq!(exporter.export_pointer(e.ptr), Err(fault));
        dev.fail_nth(SimOp::PoolImportFromShareableHandle, 1, fault);
        assert_eq!(
            importer.import_pool(fd.as_raw_fd(), &offer.device),
            Err(fault)
        );
        let pool = importer.import_pool(fd.as_raw_fd(), &offer.device).unwrap();
        dev.fail_nth(SimOp::PoolImportPointer, 1, fault);
        // SAFETY: the first is refused; the second maps until the release below.
        unsafe {
            assert_eq!(importer.import_pointer(pool, &offer.pointer), Err(fault));
            importer.import_pointer(pool, &offer.pointer).unwrap();
        }
        dev.fail_nth(SimOp::GetAddressRange, 1, fault);
        assert_eq!(importer.address_range(e.ptr), Err(fault));
        assert_eq!(importer.address_range(e.ptr), Ok((e.ptr, 16)));
        dev.fail_nth(SimOp::ImportFreeAsync, 1, fault);
        // SAFETY: the first is refused (the import stays mapped); the second releases it.
        unsafe {
            assert_eq!(importer.release_import(Lane::Compute, e.ptr), Err(fault));
            importer.release_import(Lane::Compute, e.ptr).unwrap();
        }
        dev.fail_nth(SimOp::IpcGetEventHandle, 1, fault);
        assert_eq!(exporter.ipc_event_create().map(|_| ()), Err(fault));
        dev.fail_nth(SimOp::IpcOpenEventHandle, 1, fault);
        assert_eq!(importer.ipc_event_open(&offer.event), Err(fault));
        let opened = importer.ipc_event_open(&offer.event).unwrap();
        dev.fail_nth(SimOp::IpcEventDestroy, 1, fault);
        // SAFETY: the first is refused (the event stays open); the second closes it.
        unsafe {
            assert_eq!(importer.ipc_event_close(opened), Err(fault));
            importer.ipc_event_close(opened).unwrap();
        }
        for (op, calls) in [
            (SimOp::PoolExportToShareableHandle, 3),
            (SimOp::PoolExportPointer, 2),
            (SimOp::PoolImportFromShareableHandle, 2),
            (SimOp::PoolImportPointer, 2),
            (SimOp::GetAddressRange, 2),
            (SimOp::ImportFreeAsync, 2),
            (SimOp::IpcGetEventHandle, 2),
            (SimOp::IpcOpenEventHandle, 2),
            (SimOp::IpcEventDestroy, 2),
        ] {
            assert_eq!(dev.calls(op), calls, "{op:?}");
        }
        assert_eq!(
            dev.calls(SimOp::EventCreate),
            0,
            "an inter-process event is counted apart"
        );
        importer.waits().stream_synchronize().unwrap();
        // SAFETY: released above.
        unsafe { exporter.free(Lane::Compute, e.ptr) }.unwrap();
        exporter.waits().stream_synchronize().unwrap();
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    #[test]
    fn an_unordered_use_that_runs_after_the_release_is_caught_under_interleaving() {
        // The importer reads on the download lane and releases on the compute lane without
        // ordering the two: some schedule runs the read after the release.
        let caught = (0..64).any(|seed| {
            let (dev, mut exporter, mut importer) = pair();
            let e = export(&mut exporter, &[6; 16]);
            let (fd, offer) = carry(&exporter, &e);
            let (ptr, _event) = import(&mut importer, &fd, &offer);
            exporter.waits().stream_synchronize().unwrap();
            dev.set_schedule(Schedule::Interleaved { seed });
            let mine = importer.alloc(Lane::Compute, 16).unwrap();
            dev.hold_clock(true);
            // SAFETY: (the bug under test) the copy is not ordered before the release.
            unsafe {
                importer.copy_dtod(mine, ptr, 16).unwrap();
                importer
                    .release_import(Lane::Upload, ptr)
                    .unwrap_or_else(|_| unreachable!());
            }
            dev.advance_all();
            dev.violations()
                .iter()
                .any(|v| matches!(v, Violation::ImportUsedAfterRelease { .. }))
        });
        assert!(caught);
    }
}
