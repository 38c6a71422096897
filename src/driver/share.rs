//! The sharing half of the device seam: device memory and events that another process maps.
//!
//! An exporting driver hands out three kinds of names, each a few bytes or a descriptor that the
//! sharing route carries to another process: its memory pool's file descriptor
//! ([`Sharing::pool_descriptor`], exported once and kept), an allocation's export data
//! ([`Sharing::export_pointer`]), and an inter-process event's handle
//! ([`Sharing::ipc_event_create`]). An importing driver turns them back into a pool of its own
//! ([`Sharing::import_pool`]), a device address its streams can use
//! ([`Sharing::import_pointer`], until [`Sharing::release_import`]) and an event its streams can
//! wait for ([`Sharing::ipc_event_open`]).
//!
//! The driver keeps CUDA's rules and nothing more; the route above keeps the lifetimes: an
//! exporter frees an allocation only after every importer has released its import, and an
//! importer uses one only after the exporter's writes (an event of the exporter's, waited on by
//! the importer's streams). A process is named by [`Origin`], which the driver supplies
//! ([`Sharing::process`]) and judges ([`Sharing::process_ended`]): on a real device, the
//! operating system's process; in the simulator, each simulated driver is a process of its own,
//! which a test can kill (`SimDevice::kill_process`), so the lifecycle of an importer that dies
//! is tested without a GPU.
//!
//! A real device uses CUDA's stream-ordered pools exported as POSIX file descriptors
//! (`cuMemPoolExportToShareableHandle`, `cuMemPoolExportPointer`, `cuMemPoolImportPointer`) and
//! inter-process events (`cuIpcGetEventHandle`, `cuIpcOpenEventHandle`). The simulator keeps
//! exported pools, pointers and events in its machine's registry, keyed by a real descriptor's
//! inode and by the bytes it hands out, so forged names are refused as CUDA refuses them, and it
//! records a violation when an exporter's free runs while an importer still maps the memory.

use super::{DevicePtr, EventHandle, Lane};
use crate::error::{DriverError, Error, MalformedError, PeerError, SetupError};
use std::os::fd::RawFd;

/// The bytes of an allocation's export data (`CUmemPoolPtrExportData`) or of an inter-process
/// event's handle (`CUipcEventHandle`): 64 each.
pub(crate) const NAME_BYTES: usize = 64;

/// An exported name: an allocation's export data or an event's handle.
pub(crate) type Name = [u8; NAME_BYTES];

/// The process that holds a driver's context: its host, the host's boot, its pid and its start
/// time. It travels with every offer and with an importer's greeting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Origin {
    /// The host's machine id (or 128 bits of its name where it has none).
    pub(crate) host: [u8; 16],
    /// The id of the host's current boot.
    pub(crate) boot: [u8; 16],
    /// The process's id.
    pub(crate) pid: u32,
    /// The process's start, in clock ticks after the boot (`/proc/PID/stat`'s 22nd field), which
    /// tells a recycled pid apart.
    pub(crate) start: u64,
}

/// The sharing half of the seam. See the module docs.
pub(crate) trait Sharing {
    /// The process that holds this driver's context.
    ///
    /// # Errors
    /// [`SetupError::Identity`] when the host's, the boot's or the process's identity cannot be
    /// read.
    fn process(&self) -> Result<Origin, Error>;

    /// Whether the process `origin` names has ended and its contexts have been torn down, so no
    /// work of its can touch memory any more. A process of another host or boot counts as
    /// ended; a live one never does.
    fn process_ended(&self, origin: &Origin) -> bool;

    /// Checks that `claimed`, a peer's word for who it is, names the process the kernel
    /// reports at the socket's other end (`kernel_pid`, from `SO_PEERCRED`): on a real device,
    /// the same pid, running with the start time `/proc` gives it ([`peer_is_process`]).
    ///
    /// # Errors
    /// [`MalformedError::PeerIdentity`] saying which field disagrees.
    fn check_peer(&self, claimed: &Origin, kernel_pid: u32) -> Result<(), Error> {
        peer_is_process(claimed, kernel_pid)
    }

    /// This device's UUID, which an offer names the device by.
    fn uuid(&self) -> [u8; 16];

    /// Whether this driver's streams can reach memory of the device with `uuid` once imported:
    /// the same device, or a peer it accesses directly. `false` for a device this host does not
    /// have.
    fn reaches(&self, uuid: &[u8; 16]) -> Result<bool, DriverError>;

    /// The descriptor that names this driver's memory pool to other processes, exported on the
    /// first call and kept (and closed) by the driver. Refused where the device cannot export its
    /// pool (`CUDA_ERROR_NOT_SUPPORTED`).
    fn pool_descriptor(&mut self) -> Result<RawFd, DriverError>;

    /// The export data of `ptr`, an allocation of this driver's pool.
    fn export_pointer(&mut self, ptr: DevicePtr) -> Result<Name, DriverError>;

    /// Imports the pool that `fd` names (exported by a driver of the device `from`), and lets
    /// this device reach its memory when it is another device's. The driver keeps the imported
    /// pool until it is dropped; `fd` stays the caller's.
    fn import_pool(&mut self, fd: RawFd, from: &[u8; 16]) -> Result<u64, DriverError>;

    /// Maps the allocation `data` names, of the imported `pool`, into this context. The address
    /// is usable on every lane at once (the exporter's allocation completed before it was
    /// exported); it stays mapped until [`release_import`](Self::release_import).
    ///
    /// # Safety
    /// The exporter keeps the allocation until this import is released, and the import is
    /// released exactly once.
    unsafe fn import_pointer(&mut self, pool: u64, data: &Name) -> Result<DevicePtr, DriverError>;

    /// Unmaps an imported address, ordered on `lane` (`cuMemFreeAsync` on an imported pointer):
    /// the exporter's allocation lives on.
    ///
    /// # Safety
    /// `ptr` came from [`import_pointer`](Self::import_pointer) on this driver and is released
    /// once; no operation queued later uses it, and every operation on another lane that uses it
    /// is ordered before the release.
    unsafe fn release_import(&mut self, lane: Lane, ptr: DevicePtr) -> Result<(), DriverError>;

    /// The allocation that holds `ptr`, an address this driver's context reaches (an
    /// allocation of its own or a live import): its base and its size in bytes, as the driver
    /// records it (`cuMemGetAddressRange`). What an importer checks an offer's claimed size
    /// against: the size comes from the allocation, never from the exporter's word.
    fn address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize), DriverError>;

    /// Creates an event that other processes can open, and its handle.
    fn ipc_event_create(&mut self) -> Result<(EventHandle, Name), DriverError>;

    /// Opens another process's inter-process event, for this driver's streams to wait on
    /// ([`Driver::stream_wait`](super::Driver::stream_wait)): the wait is for that event's last
    /// record as of the wait.
    fn ipc_event_open(&mut self, handle: &Name) -> Result<EventHandle, DriverError>;

    /// Closes an event [`ipc_event_open`](Self::ipc_event_open) opened; the exporter's event
    /// lives on.
    ///
    /// # Safety
    /// `event` came from [`ipc_event_open`](Self::ipc_event_open) on this driver, is closed once,
    /// and no queued wait still names it (an earlier `stream_wait` has captured its record).
    unsafe fn ipc_event_close(&mut self, event: EventHandle) -> Result<(), DriverError>;
}

/// The start time of process `pid` while it runs: `None` once it has exited, a zombie included
/// (its files, the driver's among them, are closed before it becomes one, and the driver tears
/// its contexts down as they close).
pub(crate) fn start_of(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces and parentheses: the fields start after the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let field: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (the state); the start time is field 22.
    let start = field.get(22 - 3)?.parse().ok()?;
    (field.first() != Some(&"Z")).then_some(start)
}

/// Checks that `claimed` names operating-system process `kernel_pid`: its pid, and the start
/// time `/proc/PID/stat` gives it now (which tells a recycled pid apart).
///
/// # Errors
/// [`MalformedError::PeerIdentity`] for another pid, or another start time (0 for a process that
/// has exited).
pub(crate) fn peer_is_process(claimed: &Origin, kernel_pid: u32) -> Result<(), Error> {
    if claimed.pid != kernel_pid {
        return Err(MalformedError::PeerIdentity {
            what: "pid",
            claimed: claimed.pid.into(),
            kernel: kernel_pid.into(),
        }
        .into());
    }
    match start_of(kernel_pid) {
        Some(start) if start == claimed.start => Ok(()),
        other => Err(MalformedError::PeerIdentity {
            what: "start time",
            claimed: claimed.start,
            kernel: other.unwrap_or(0),
        }
        .into()),
    }
}

/// Sixteen bytes from the 32 hexadecimal digits of `text` (dashes and whitespace skipped).
fn id_bytes(text: &str) -> Option<[u8; 16]> {
    let digits: Vec<u8> = text
        .bytes()
        .filter(|b| !b.is_ascii_whitespace() && *b != b'-')
        .collect();
    if digits.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, pair) in digits.chunks(2).enumerate() {
        let pair = std::str::from_utf8(pair).ok()?;
        id[i] = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(id)
}

/// The 128-bit id in the first of `paths` that holds one.
fn read_id(what: &'static str, paths: &[&str]) -> Result<[u8; 16], Error> {
    for path in paths {
        if let Some(id) = std::fs::read_to_string(path)
            .ok()
            .as_deref()
            .and_then(id_bytes)
        {
            return Ok(id);
        }
    }
    Err(SetupError::Identity {
        what,
        reason: format!("none of {paths:?} holds a 128-bit id"),
    }
    .into())
}

/// The host's id: its machine id, or, on a host without one (a minimal container), 128 bits
/// of its name (two FNV-1a hashes), which tells hosts apart as far as their names do.
fn host_id() -> Result<[u8; 16], Error> {
    read_id("host", &["/etc/machine-id", "/var/lib/dbus/machine-id"]).or_else(|missing| {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname").map_err(|_| missing)?;
        let fnv = |seed: u64| {
            name.trim().bytes().fold(seed, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
        };
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&fnv(0xcbf2_9ce4_8422_2325).to_le_bytes());
        id[8..].copy_from_slice(&fnv(0x8422_2325_cbf2_9ce4).to_le_bytes());
        Ok(id)
    })
}

impl Origin {
    /// This process, as the operating system names it. Read once per process (a forked child,
    /// with a pid of its own, reads it again): it names the same process for its whole life.
    ///
    /// # Errors
    /// [`SetupError::Identity`] when the host's or the boot's id cannot be read.
    pub(crate) fn here() -> Result<Origin, Error> {
        static HERE: std::sync::Mutex<Option<Origin>> = std::sync::Mutex::new(None);
        let pid = std::process::id();
        let mut here = HERE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(origin) = *here
            && origin.pid == pid
        {
            return Ok(origin);
        }
        let origin = Origin {
            host: host_id()?,
            boot: read_id("boot", &["/proc/sys/kernel/random/boot_id"])?,
            pid,
            start: start_of(pid).ok_or(SetupError::Identity {
                what: "process",
                reason: format!("/proc/{pid}/stat has no start time"),
            })?,
        };
        *here = Some(origin);
        Ok(origin)
    }

    /// Checks that this names a process of `here`'s host and boot that has not `ended`.
    ///
    /// # Errors
    /// [`SetupError::OtherHost`], [`SetupError::OtherBoot`] or [`PeerError::ProcessGone`].
    pub(crate) fn check(&self, here: &Origin, ended: bool) -> Result<(), Error> {
        if self.host != here.host {
            return Err(SetupError::OtherHost.into());
        }
        if self.boot != here.boot {
            return Err(SetupError::OtherBoot.into());
        }
        if ended {
            return Err(PeerError::ProcessGone { pid: self.pid }.into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `origin` checked as a real device's driver judges it.
    fn check(origin: &Origin, here: &Origin) -> Result<(), Error> {
        origin.check(here, start_of(origin.pid) != Some(origin.start))
    }

    #[test]
    fn a_handle_of_another_host_boot_or_a_gone_process_is_refused() {
        let here = Origin::here().unwrap();
        assert!(check(&here, &here).is_ok());
        let other_host = Origin {
            host: [0xaa; 16],
            ..here
        };
        assert!(matches!(
            check(&other_host, &here),
            Err(Error::Setup(SetupError::OtherHost))
        ));
        let other_boot = Origin {
            boot: [0xbb; 16],
            ..here
        };
        assert!(matches!(
            check(&other_boot, &here),
            Err(Error::Setup(SetupError::OtherBoot))
        ));
        // A process that has exited, and a pid reused by a later process.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let alive = Origin {
            pid,
            start: start_of(pid).unwrap(),
            ..here
        };
        assert!(check(&alive, &here).is_ok());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(matches!(
            check(&alive, &here),
            Err(Error::Peer(PeerError::ProcessGone { pid: p })) if p == pid
        ));
        let reused = Origin {
            start: here.start + 1,
            ..here
        };
        assert!(matches!(
            check(&reused, &here),
            Err(Error::Peer(PeerError::ProcessGone { .. }))
        ));
    }

    #[test]
    fn ids_are_read_from_their_text_forms() {
        let id = id_bytes("0123456789abcdef0123456789ABCDEF\n").unwrap();
        assert_eq!(id[0], 0x01);
        assert_eq!(id[15], 0xef);
        assert_eq!(id_bytes("01234567-89ab-cdef-0123-456789abcdef"), Some(id));
        assert_eq!(id_bytes("0123"), None);
        assert_eq!(id_bytes("zz23456789abcdef0123456789abcdef"), None);
    }
}
