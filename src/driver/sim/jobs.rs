//! What a stream queues, and what each job does when the clock runs it.
//!
//! A [`Job`] is one queued operation: a copy, a free, an event record, a kernel launch, a wait
//! for another stream or one rank's part of a collective. The clock (`clock.rs`) decides when
//! each runs; [`State::execute`] is what it then does to the device's memory, every access
//! recorded for the race checker (`race.rs`) and every impossible one recorded as a violation.

use super::collective;
use super::{DevicePtr, Emulation, State, StreamId, Violation};
use std::sync::Arc;

/// A job queued on a stream, run when the device clock reaches it.
pub(super) enum Job {
    HtoD {
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
    },
    /// A host-to-device copy from pageable memory, whose bytes were staged at the call.
    HtoDStaged {
        dst: DevicePtr,
        data: Vec<u8>,
    },
    DtoH {
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
    },
    DtoD {
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    },
    Free(DevicePtr),
    Marker,
    /// The record of an event that only orders lanes: it takes no device time, so it runs as
    /// soon as it reaches its stream's head, outside the clock.
    OrderMarker,
    /// A kernel launch, run by its module's emulation when the stream reaches it.
    Launch {
        emulation: Arc<dyn Emulation>,
        params: Vec<u64>,
    },
    /// A wait for another stream: it may run only once the job `for_seq` (an event record's
    /// marker) has run, and holds its stream until then. It takes no device time: it runs as
    /// soon as it can, outside the clock.
    Wait {
        for_seq: u64,
    },
    /// Rank `rank`'s part of collective `group`: it runs, with every other rank's part, once
    /// each has reached the head of its stream.
    Collective(collective::Part),
    /// A rank's send or receive: it runs once its peer's matching call is there.
    P2p(collective::P2p),
    /// The release of simulated process `pid`'s import of the allocation at `ptr`: it unmaps
    /// the import when it runs, touching no memory (`share.rs`).
    Release {
        pid: u32,
        ptr: DevicePtr,
    },
}

impl Job {
    /// The host range this job touches, if any.
    pub(super) fn host_range(&self) -> Option<(usize, usize)> {
        match *self {
            Job::HtoD { src, bytes, .. } => Some((src as usize, bytes)),
            Job::DtoH { dst, bytes, .. } => Some((dst as usize, bytes)),
            _ => None,
        }
    }

    /// What the job is, for violations.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Job::HtoD { .. } | Job::HtoDStaged { .. } => "host-to-device copy",
            Job::DtoH { .. } => "device-to-host copy",
            Job::DtoD { .. } => "device-to-device copy",
            Job::Free(_) => "free",
            Job::Marker => "event record",
            Job::OrderMarker => "ordering event record",
            Job::Launch { .. } => "kernel launch",
            Job::Wait { .. } => "wait",
            Job::Collective(_) => "collective",
            Job::P2p(_) => "point-to-point",
            Job::Release { .. } => "release of an import",
        }
    }

    /// Whether the job only orders streams: it takes no device time and no step of the clock.
    pub(super) fn orders_only(&self) -> bool {
        matches!(self, Job::OrderMarker | Job::Wait { .. })
    }
}

impl State {
    /// Does what `job` (job `seq`, just taken from the head of `stream`) does, as the running
    /// job.
    pub(super) fn execute(&mut self, seq: u64, stream: StreamId, job: Job) {
        match job {
            Job::HtoDStaged { dst, data } => {
                self.access(dst, true);
                match self.block_mut(dst, data.len()) {
                    Some(d) => d.copy_from_slice(&data),
                    None => self.violations.push(Violation::UnmappedUpload {
                        dst,
                        bytes: data.len(),
                    }),
                }
            }
            Job::HtoD { dst, src, bytes } => {
                self.access(dst, true);
                match self.block_mut(dst, bytes) {
                    Some(d) => {
                        // SAFETY: the seam's contract keeps `src..src+bytes` readable until this
                        // job has run; `d` is device memory owned by the simulator, disjoint
                        // from it.
                        unsafe { std::ptr::copy_nonoverlapping(src, d.as_mut_ptr(), bytes) }
                    }
                    None => self
                        .violations
                        .push(Violation::UnmappedUpload { dst, bytes }),
                }
            }
            Job::DtoH { dst, src, bytes } => {
                self.access(src, false);
                match self.block_mut(src, bytes) {
                    Some(s) => {
                        // SAFETY: the seam's contract keeps `dst..dst+bytes` writable and
                        // untouched by the host until this job has run; `s` is simulator-owned
                        // memory.
                        unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), dst, bytes) }
                    }
                    None => self
                        .violations
                        .push(Violation::UnmappedDownload { src, bytes }),
                }
            }
            Job::DtoD { dst, src, bytes } => {
                self.access(src, false);
                self.access(dst, true);
                let data = self.block_mut(src, bytes).map(|s| s.to_vec());
                match (data, self.block_mut(dst, bytes)) {
                    (Some(data), Some(d)) => d.copy_from_slice(&data),
                    _ => self
                        .violations
                        .push(Violation::UnmappedDeviceCopy { src, dst, bytes }),
                }
            }
            Job::Free(ptr) => {
                self.access(ptr, true);
                if !self.mem.contains_key(&ptr) {
                    self.violations.push(Violation::UnknownDeviceFree { ptr });
                } else if !self.freed_while_imported(ptr) {
                    self.release_block(ptr);
                }
            }
            Job::Marker => self.report_stream_failure(seq, stream),
            Job::OrderMarker | Job::Wait { .. } => {}
            Job::Launch { emulation, params } => {
                if let Err(message) = emulation.run(self, &params) {
                    self.violations.push(Violation::KernelFailed {
                        kernel: emulation.name().to_owned(),
                        message,
                    });
                }
            }
            Job::Collective(part) => self.run_collective(seq, stream, part),
            Job::P2p(p) => self.run_p2p(stream, p),
            Job::Release { pid, ptr } => self.run_release(pid, ptr),
        }
    }
}
