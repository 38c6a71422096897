//! What the device records when it is misused: [`Violation`].
//!
//! The simulator does not fail a call or corrupt memory when the code driving it breaks a rule
//! the device can see (two jobs not ordered, a copy outside every allocation, page-locked memory
//! released under a queued copy, ...): it records a violation, does the safe thing (keeps or
//! refuses what it was asked to release), and goes on, so that a test can assert that a correct
//! engine leaves [`SimDevice::violations`] empty, and see everything that went wrong when it
//! does not. Each kind of misuse is a variant naming what is involved; its `Display` says it in a
//! sentence.

use super::{Lane, SimDevice, StreamId, lane_of};
use std::fmt;

/// The driver that owns a stream (by creation order on the machine), and the name of the
/// stream's lane.
pub(super) fn driver_lane(stream: StreamId) -> (usize, &'static str) {
    let lane = match lane_of(stream) {
        Lane::Compute => "Compute",
        Lane::Upload => "Upload",
        Lane::Download => "Download",
    };
    (stream / Lane::ALL.len(), lane)
}

/// A misuse of the simulated device that it observed (see [`SimDevice::violations`]); a correct
/// engine causes none.
///
/// Device addresses are as the device hands them out (and as [`SimDevice::peek`] takes them),
/// host addresses those of the host memory concerned. Jobs are named by their sequence numbers,
/// which follow the order of the calls that queued them, from 0 on each `SimDevice`, and streams by
/// the driver that owns them (one per engine, by creation order on the machine) and their lane:
/// `"Compute"` (kernels, library calls, device-to-device copies, frees, collectives, graph
/// replays), `"Upload"` (host-to-device copies) or `"Download"` (device-to-host copies).
/// `Display` gives the violation in a sentence.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Violation {
    /// Two jobs that use one device allocation were not ordered, and ran the other way round:
    /// job `job`, queued first, used the allocation after job `later`, queued after it, had
    /// written it, or, when `job` writes it, had read it.
    Race {
        /// The job that ran late.
        job: u64,
        /// What that job is, in words: `"host-to-device copy"`, `"kernel launch"`, `"free"`, ...
        kind: &'static str,
        /// The driver whose stream ran it.
        driver: usize,
        /// The lane of that stream.
        lane: &'static str,
        /// The allocation's base address.
        block: u64,
        /// The job queued after it that had already used the allocation.
        later: u64,
        /// Whether `later` wrote the allocation (else it read it).
        later_wrote: bool,
    },
    /// A host-to-device copy ran into device memory outside every live allocation.
    UnmappedUpload {
        /// The copy's destination.
        dst: u64,
        /// Its length in bytes.
        bytes: usize,
    },
    /// A device-to-host copy ran from device memory outside every live allocation.
    UnmappedDownload {
        /// The copy's source.
        src: u64,
        /// Its length in bytes.
        bytes: usize,
    },
    /// A device-to-device (or peer) copy ran with its source or its destination outside every
    /// live allocation.
    UnmappedDeviceCopy {
        /// The copy's source.
        src: u64,
        /// The copy's destination.
        dst: u64,
        /// Its length in bytes.
        bytes: usize,
    },
    /// A queued free ran for a device address that is not (or no longer) a live allocation.
    UnknownDeviceFree {
        /// The address freed.
        ptr: u64,
    },
    /// A kernel's emulation failed when its launch ran: it touched memory outside every live
    /// allocation, or was given parameters it does not take.
    KernelFailed {
        /// The kernel's name.
        kernel: String,
        /// What the emulation reported; the violation's `Display`.
        message: String,
    },
    /// A rank's part of a collective ran with its buffer outside every live allocation.
    UnmappedCollective {
        /// The driver whose stream ran the part.
        driver: usize,
        /// The lane of that stream.
        lane: &'static str,
        /// The rank's buffer.
        ptr: u64,
        /// Its length in bytes.
        bytes: usize,
    },
    /// A kernel node of an executable graph was updated after the graph it was instantiated
    /// from had been destroyed (the update is refused).
    NodeUpdatedAfterGraphDestroyed {
        /// The node's handle.
        node: u64,
        /// The destroyed graph's handle.
        graph: u64,
    },
    /// A free of pinned host memory at an address where no live pinned allocation starts (the
    /// free is refused).
    UnknownPinnedFree {
        /// The address freed.
        ptr: usize,
    },
    /// Pinned host memory freed while a queued copy still names it; the device keeps the memory
    /// (never frees it), so the copy cannot touch freed memory.
    PinnedFreedUnderCopy {
        /// The allocation's address.
        ptr: usize,
        /// Its length in bytes.
        bytes: usize,
    },
    /// An unregistration of a host range that is not registered (it is refused).
    UnknownUnregister {
        /// The address given.
        ptr: usize,
    },
    /// A registered host range unregistered while a queued copy still names it; the
    /// unregistration is refused, so the caller keeps the memory instead of freeing it under
    /// the copy.
    UnregisteredUnderCopy {
        /// The range's start.
        ptr: usize,
        /// Its length in bytes.
        bytes: usize,
    },
    /// An exporter's free of a device allocation ran while another process still mapped it (an
    /// import whose release had not run: CUDA requires every importer's release to complete
    /// before the exporter's free). One per process that mapped it; the device keeps the memory
    /// until the last of those imports is released, so the importer cannot touch freed memory.
    FreedWhileImported {
        /// The allocation's address.
        ptr: u64,
        /// Its length in bytes.
        bytes: usize,
        /// The simulated process that still mapped it.
        pid: u32,
    },
    /// A job of a process used device memory it had imported after its release of the import
    /// had run: the use was not ordered before the release.
    ImportUsedAfterRelease {
        /// The job.
        job: u64,
        /// What that job is, in words.
        kind: &'static str,
        /// The driver whose stream ran it.
        driver: usize,
        /// The lane of that stream.
        lane: &'static str,
        /// The allocation's address.
        ptr: u64,
    },
    /// An inter-process event opened from another process was used (recorded, waited on,
    /// queried) after its exporter had destroyed its own, which CUDA leaves undefined.
    OpenedEventUsedAfterDestroy {
        /// The opened event's handle.
        event: u64,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Race {
                job,
                kind,
                driver,
                lane,
                block,
                later,
                later_wrote,
            } => {
                let verb = if *later_wrote { "wrote" } else { "read" };
                write!(
                    f,
                    "job #{job} ({kind} on the {lane} lane of driver {driver}) used device block \
                     {block:#x} after later job #{later} {verb} it: the two are not ordered"
                )
            }
            Violation::UnmappedUpload { dst, bytes } => write!(
                f,
                "host-to-device copy into unmapped device range {dst:#x}+{bytes}"
            ),
            Violation::UnmappedDownload { src, bytes } => write!(
                f,
                "device-to-host copy from unmapped device range {src:#x}+{bytes}"
            ),
            Violation::UnmappedDeviceCopy { src, dst, bytes } => write!(
                f,
                "device-to-device copy {src:#x} -> {dst:#x} of {bytes} bytes touches unmapped memory"
            ),
            Violation::UnknownDeviceFree { ptr } => {
                write!(f, "free of unknown device pointer {ptr:#x}")
            }
            Violation::KernelFailed { message, .. } => f.write_str(message),
            Violation::UnmappedCollective {
                driver,
                lane,
                ptr,
                bytes,
            } => write!(
                f,
                "collective on the {lane} lane of driver {driver} reads unmapped device range \
                 {ptr:#x}+{bytes}"
            ),
            Violation::NodeUpdatedAfterGraphDestroyed { node, graph } => write!(
                f,
                "kernel node {node:#x} updated after its graph {graph:#x} was destroyed"
            ),
            Violation::UnknownPinnedFree { ptr } => {
                write!(f, "free of unknown pinned pointer {ptr:#x}")
            }
            Violation::PinnedFreedUnderCopy { ptr, bytes } => write!(
                f,
                "pinned buffer {ptr:#x} ({bytes} bytes) freed while a queued copy still names it"
            ),
            Violation::UnknownUnregister { ptr } => {
                write!(f, "unregister of unknown host range {ptr:#x}")
            }
            Violation::UnregisteredUnderCopy { ptr, bytes } => write!(
                f,
                "registered range {ptr:#x} ({bytes} bytes) unregistered while a queued copy still \
                 names it"
            ),
            Violation::FreedWhileImported { ptr, bytes, pid } => write!(
                f,
                "device block {ptr:#x} ({bytes} bytes) freed while process {pid} still maps it"
            ),
            Violation::ImportUsedAfterRelease {
                job,
                kind,
                driver,
                lane,
                ptr,
            } => write!(
                f,
                "job #{job} ({kind} on the {lane} lane of driver {driver}) used imported block \
                 {ptr:#x} after its release had run"
            ),
            Violation::OpenedEventUsedAfterDestroy { event } => write!(
                f,
                "opened inter-process event {event:#x} used after its exporter destroyed it"
            ),
        }
    }
}

impl SimDevice {
    /// Lifecycle violations the device observed, in the order it observed them, such as pinned
    /// memory freed while a queued copy still named it (see [`Violation`]). A correct engine
    /// leaves this empty.
    pub fn violations(&self) -> Vec<Violation> {
        self.lock().violations.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_violation_reads_as_a_sentence_naming_what_is_involved() {
        let cases = [
            (
                Violation::Race {
                    job: 3,
                    kind: "device-to-host copy",
                    driver: 1,
                    lane: "Download",
                    block: 0x7f00_0000_0100,
                    later: 4,
                    later_wrote: true,
                },
                "job #3 (device-to-host copy on the Download lane of driver 1) used device block \
                 0x7f0000000100 after later job #4 wrote it: the two are not ordered",
            ),
            (
                Violation::UnmappedUpload {
                    dst: 0x10,
                    bytes: 4,
                },
                "host-to-device copy into unmapped device range 0x10+4",
            ),
            (
                Violation::UnmappedDownload {
                    src: 0x10,
                    bytes: 4,
                },
                "device-to-host copy from unmapped device range 0x10+4",
            ),
            (
                Violation::UnmappedDeviceCopy {
                    src: 0x10,
                    dst: 0x20,
                    bytes: 8,
                },
                "device-to-device copy 0x10 -> 0x20 of 8 bytes touches unmapped memory",
            ),
            (
                Violation::UnknownDeviceFree { ptr: 0x10 },
                "free of unknown device pointer 0x10",
            ),
            (
                Violation::KernelFailed {
                    kernel: "copy".into(),
                    message: "copy reads unmapped memory".into(),
                },
                "copy reads unmapped memory",
            ),
            (
                Violation::UnmappedCollective {
                    driver: 2,
                    lane: "Compute",
                    ptr: 0x10,
                    bytes: 16,
                },
                "collective on the Compute lane of driver 2 reads unmapped device range 0x10+16",
            ),
            (
                Violation::NodeUpdatedAfterGraphDestroyed { node: 5, graph: 3 },
                "kernel node 0x5 updated after its graph 0x3 was destroyed",
            ),
            (
                Violation::UnknownPinnedFree { ptr: 0x1000 },
                "free of unknown pinned pointer 0x1000",
            ),
            (
                Violation::PinnedFreedUnderCopy {
                    ptr: 0x1000,
                    bytes: 16,
                },
                "pinned buffer 0x1000 (16 bytes) freed while a queued copy still names it",
            ),
            (
                Violation::UnknownUnregister { ptr: 0x1000 },
                "unregister of unknown host range 0x1000",
            ),
            (
                Violation::UnregisteredUnderCopy {
                    ptr: 0x1000,
                    bytes: 16,
                },
                "registered range 0x1000 (16 bytes) unregistered while a queued copy still names it",
            ),
            (
                Violation::FreedWhileImported {
                    ptr: 0x10,
                    bytes: 16,
                    pid: 0x4000_0001,
                },
                "device block 0x10 (16 bytes) freed while process 1073741825 still maps it",
            ),
            (
                Violation::ImportUsedAfterRelease {
                    job: 7,
                    kind: "device-to-device copy",
                    driver: 1,
                    lane: "Compute",
                    ptr: 0x10,
                },
                "job #7 (device-to-device copy on the Compute lane of driver 1) used imported \
                 block 0x10 after its release had run",
            ),
            (
                Violation::OpenedEventUsedAfterDestroy { event: 9 },
                "opened inter-process event 0x9 used after its exporter destroyed it",
            ),
        ];
        for (violation, text) in cases {
            assert_eq!(violation.to_string(), text, "{violation:?}");
        }
    }

    #[test]
    fn a_stream_is_named_by_its_driver_and_lane() {
        assert_eq!(driver_lane(0), (0, "Compute"));
        assert_eq!(driver_lane(4), (1, "Upload"));
        assert_eq!(driver_lane(8), (2, "Download"));
    }
}
