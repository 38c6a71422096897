//! The simulated device: the device seam implemented in host memory, deterministically.
//!
//! It exists so that every route's lifecycle code runs in CI, which has no GPU, exactly as it
//! runs on a real device, and so users can test their own pipelines the same way. It models what
//! the lifecycle types must be right about:
//!
//! - **Asynchrony.** Copies, frees, launches, event records and waits are queued in call order
//!   and take effect only when the device clock advances ([`SimDevice::advance`]) or something
//!   waits (an event or stream synchronize). A copy that has not completed has not written its
//!   destination, and a host-to-device copy from page-locked memory (pinned, or registered with
//!   `host_register`) reads its source when it runs, not when it is queued. Copies with pageable
//!   host memory behave as CUDA documents: a host-to-device copy stages its source before the
//!   call returns, a device-to-host copy returns only once complete.
//! - **Streams.** Each driver (one per engine; several engines may share one device) owns three
//!   streams on the device, one per lane: host-to-device copies go on the upload stream,
//!   device-to-host copies on the download stream, everything else on the compute stream. Each
//!   stream runs its jobs in the order they were queued; nothing orders two streams but a wait:
//!   a `stream_wait` queues a wait on its lane that holds that stream until the event's
//!   last record (as of the call) has run, as `cuStreamWaitEvent` does. A wait for an event never
//!   recorded, or whose record has already run, holds nothing.
//! - **Schedules.** Each step of the clock runs the head of one stream whose head may run (its
//!   wait, if it is one, is satisfied). [`Schedule::InOrder`] (the default) picks the head queued
//!   first, which is exactly program order; [`Schedule::Interleaved`] picks one pseudo-randomly
//!   from a seed, as the copy engines and the SMs of a GPU run independently
//!   ([`SimDevice::set_schedule`]). A synchronize of one lane runs only that lane's stream and
//!   what it waits for.
//! - **Races.** Every job that runs records which device allocations it reads and writes (a copy
//!   its source and destination, a free its whole allocation, a launch whatever its emulation
//!   reads and writes). A job that writes an allocation a job queued after it has already read or
//!   written, or reads one that a job queued after it has already written, is a
//!   [violation](SimDevice::violations): the two were not ordered, so the device could run them
//!   either way round. A correct engine therefore computes, under any schedule, exactly what it
//!   computes with everything in program order on one stream.
//! - **Events.** A query reports completion only once the event's record has run, and a record
//!   runs only once everything queued before it on its stream (and what that waited for) has.
//! - **Faults.** [`SimDevice::fail_nth`] makes the n-th call of an operation return a driver
//!   error (a wait too: [`SimOp::StreamWait`]); [`SimDevice::fail_event`] makes a recorded event
//!   report an error once the device reaches it.
//! - **Wakes.** A wake registered on an event (what an awaited transfer asks for) is called when
//!   the device runs the event's record, or at once if it already has, failed or not; always
//!   after the device's lock is released, on the thread that ran the record. Registering one is
//!   a wait that does not block: unless the clock is held, it runs the device up to the event,
//!   as a host wait would.
//! - **Graphs.** A capture belongs to its driver's compute stream: between its begin and end,
//!   launches are recorded instead of queued, and any other operation on the compute lane fails
//!   and invalidates the capture; the upload and download lanes are not captured. A replay of
//!   an instantiated graph queues its launches in order on the compute stream, like eager
//!   launches ([`SimDevice::graph_launches`], [`SimDevice::graphs_live`]).
//! - **Stream-ordered allocation.** Device memory is allocated at the call and released when
//!   its queued free runs. An allocation that does not fit may take the memory of frees its
//!   driver has queued and the device has not run yet: its stream then waits for them, as CUDA's
//!   pools reuse memory through internal dependencies by default.
//! - **Libraries and collectives.** The vendor library calls (GEMM, Cholesky factor and solve,
//!   contraction) run as emulated launches on the compute stream, with BLAS's and LAPACK's
//!   semantics (`libs.rs`); collectives run as groups across the machine's devices with NCCL's
//!   rank rules and failure modes (`collective.rs`). Each call is fault-injectable by its
//!   [`SimOp`], and an injected fault is reported as the library's own failure.
//! - **Use-after-free of DMA memory.** Freeing pinned host memory that a queued copy still names
//!   is recorded as a [violation](SimDevice::violations) and the memory is kept (never freed), so
//!   a lifecycle bug is reported by the tests instead of corrupting memory. Unregistering a
//!   registered range that a queued copy still names is a violation too, and is refused, so the
//!   caller keeps (leaks) the memory instead of freeing it under the copy.
//! - **Processes and sharing.** Each driver is a simulated process of its own, with a pid of
//!   its own (from `0x4000_0000` on, never a real one); the sharing half of the seam (`share.rs`)
//!   exports its pool through a real file descriptor, its allocations and inter-process events
//!   through bytes the machine registers, so forged names are refused as CUDA refuses them. An
//!   exporter's free that runs while another process still maps the memory is a
//!   [violation](SimDevice::violations) (the memory is kept until the last import is released),
//!   and [`SimDevice::kill_process`] ends a process as the operating system would: its queued work
//!   never comes, its imports are unmapped, and its every later call fails.
//!
//! Contexts are modelled per thread, so the context-restoring rules of raw scopes are testable
//! too ([`thread_context`], [`set_thread_context`], [`SimDevice::foreign_context`]).
//!
//! The code is laid out by concern, one file each under `sim/`: `clock.rs` (the streams, the
//! [`Schedule`]s and running stream heads), `jobs.rs` (what a stream queues and what each job
//! does when it runs), `memory.rs` (device blocks, stream-ordered allocation, page-locked host
//! memory), `events.rs` (events, records, waits across streams, host waits and wakes),
//! `race.rs` (the race checker), `violation.rs` (the [`Violation`]s the device records),
//! `fault.rs` ([`SimOp`], fault injection and call counting), `state.rs` (the device's state and
//! its lock), `driver.rs` (the seam's `Driver` over all of them), `launch.rs` and `graph.rs` (the
//! kernel and graph halves of the seam), `libs.rs` (the library half), `collective.rs`
//! (collectives across the machine's devices) and `share.rs` (processes, and memory and events
//! shared between them).

mod clock;
mod collective;
mod driver;
mod events;
mod fault;
mod graph;
mod jobs;
mod launch;
mod libs;
mod memory;
mod race;
mod share;
mod state;
#[cfg(test)]
mod tests;
mod violation;

pub use clock::Schedule;
pub(crate) use driver::SimDriver;
pub use fault::SimOp;
pub use violation::Violation;

// What the concern files share, named here so that each reaches it as `super::…`.
use super::launch::Emulation;
use super::{ContextHandle, DevicePtr, Driver, EventHandle, Lane, Waits, Wake};
use crate::device::{DeviceId, DeviceKind};
use crate::error::DriverError;
use clock::{StreamId, lane_of};
use events::{SimEvent, SimWaits};
use jobs::Job;
use race::{Running, Touch};
use state::{Locked, State};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use violation::driver_lane;

/// How to build a simulated device.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The ordinal the device reports.
    pub ordinal: usize,
    /// Device memory capacity in bytes; allocations beyond it fail with
    /// `CUDA_ERROR_OUT_OF_MEMORY`. Memory whose free an engine has queued counts as available
    /// to that engine's allocations, which are then ordered after the free on the device (as
    /// CUDA's stream-ordered allocator reuses it).
    pub memory_bytes: usize,
    /// Page-locked host memory capacity in bytes, pinned allocations and registered ranges
    /// together; allocations and registrations beyond it fail likewise.
    pub pinned_bytes: usize,
    /// How many devices the simulated machine has (ordinals `ordinal`, `ordinal + 1`, ...), each
    /// with `memory_bytes` of its own, one clock for all, and every pair joined by a peer link
    /// unless [`SimDevice::set_peer_link`] removes it. An engine opens on one by its index
    /// (`simulated_on_device`).
    pub devices: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            ordinal: 0,
            memory_bytes: 4 << 30,
            pinned_bytes: 4 << 30,
            devices: 1,
        }
    }
}

static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(0x5100_0000);

thread_local! {
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

/// The simulated context current on this thread (`None` when none is).
pub fn thread_context() -> Option<u64> {
    let c = CURRENT.with(Cell::get);
    (c != 0).then_some(c)
}

/// Makes a simulated context current on this thread, or unbinds with `None`.
pub fn set_thread_context(ctx: Option<u64>) {
    CURRENT.with(|c| c.set(ctx.unwrap_or(0)));
}

/// A handle to a simulated device: its clock, its fault injection and its accounting.
///
/// Clones share the device. The engine that drives it holds one; tests hold another (from the
/// engine's `sim` method) to advance the clock and inject faults between engine operations.
#[derive(Clone)]
pub struct SimDevice {
    inner: Arc<Inner>,
}

/// The device's state, and a signal for waits blocked on a held clock.
struct Inner {
    state: Mutex<State>,
    progress: Condvar,
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("SimDevice")
            .field("instance", &s.instance)
            .field("ordinal", &s.ordinal)
            .field("queued", &s.pending.len())
            .finish()
    }
}

impl SimDevice {
    /// Creates a simulated device.
    pub fn new(config: SimConfig) -> Self {
        SimDevice {
            inner: Arc::new(Inner {
                state: Mutex::new(State::new(config)),
                progress: Condvar::new(),
            }),
        }
    }

    fn lock(&self) -> Locked<'_> {
        Locked::new(&self.inner.state)
    }

    /// The device's lock, taken for a call of the driver of simulated process `pid` (whose
    /// calls fail once the process is killed).
    fn lock_as(&self, pid: u32) -> Locked<'_> {
        Locked::of(&self.inner.state, pid)
    }

    /// A fresh context that belongs to no engine, for testing that raw scopes restore whatever
    /// was current before them.
    pub fn foreign_context() -> u64 {
        NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed)
    }

    /// This device's own context handle (the first device's, on a machine of several).
    pub fn context(&self) -> u64 {
        self.lock().ctxs[0]
    }

    /// How many devices the simulated machine has.
    pub fn devices(&self) -> usize {
        self.lock().ctxs.len()
    }

    /// Joins (or, with `linked` false, separates) devices `a` and `b` (indices on the machine):
    /// peer copies between engines on them are possible only while they are linked.
    ///
    /// # Panics
    /// When `a` or `b` is not a device of the machine.
    pub fn set_peer_link(&self, a: usize, b: usize, linked: bool) {
        let mut s = self.lock();
        let n = s.ctxs.len();
        assert!(a < n && b < n, "devices {a} and {b} of a machine of {n}");
        s.peer_linked[a][b] = linked;
        s.peer_linked[b][a] = linked;
    }
}
