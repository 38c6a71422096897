//! Fault injection and call counting.
//!
//! Every operation of the seam is named by a [`SimOp`] and enters the device through
//! [`State::enter`], which counts the call and fires what a test armed for it: a driver error
//! ([`SimDevice::fail_nth`]), a panic before the call takes effect ([`SimDevice::panic_nth`]) or
//! after ([`SimDevice::panic_after_nth`]). [`SimDevice::fail_event`] makes a recorded event fail
//! once the device reaches it instead (the record takes the fault; see `events.rs`).

use super::{DriverError, SimDevice, State, StreamId};

/// A device operation, as fault injection and call counting name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum SimOp {
    /// Stream-ordered device allocation.
    Alloc,
    /// Stream-ordered device free.
    Free,
    /// Host-to-device copy enqueue.
    CopyHtoD,
    /// Device-to-host copy enqueue.
    CopyDtoH,
    /// Device-to-device copy enqueue.
    CopyDtoD,
    /// Event creation.
    EventCreate,
    /// Event record.
    EventRecord,
    /// Event query.
    EventQuery,
    /// Event synchronize (a host wait).
    EventSynchronize,
    /// Event destruction.
    EventDestroy,
    /// Pinned host allocation.
    HostAlloc,
    /// Pinned host free.
    HostFree,
    /// Registration (page-locking) of existing host memory.
    HostRegister,
    /// Unregistration of registered host memory.
    HostUnregister,
    /// Stream synchronize (a host wait).
    StreamSynchronize,
    /// Stream query.
    StreamQuery,
    /// Module compile and load (the simulator accepts only modules that carry an emulation).
    ModuleLoad,
    /// Kernel launch.
    Launch,
    /// Start of a stream capture.
    CaptureBegin,
    /// End of a stream capture (it ends the capture even when it fails).
    CaptureEnd,
    /// Instantiation of a captured graph.
    GraphInstantiate,
    /// Replacement of a kernel node's parameters in an instantiated graph.
    GraphSetParams,
    /// Replay of an instantiated graph.
    GraphLaunch,
    /// Destruction of a captured or an instantiated graph.
    GraphDestroy,
    /// Registration of a wake called once an event's work has completed (what awaiting a
    /// pending transfer asks for).
    NotifyAfter,
    /// A lane's wait for an event recorded on another (`cuStreamWaitEvent`).
    StreamWait,
    /// Creation of an event that only orders lanes (see `Driver::ordering_event_create`).
    OrderEventCreate,
    /// A record of such an event.
    OrderRecord,
    /// Enabling a context's access to a peer device's memory, or a pool's to a peer device.
    PeerEnable,
    /// Peer copy enqueue (between engines, on one device or across a peer link).
    CopyPeer,
    /// A rank's part of a collective, added to its group (`ncclAllReduce`, `ncclBroadcast`).
    /// A refused part leaves the group's other parts to be launched by its end.
    Collective,
    /// The making of communicators (`ncclCommInitAll`).
    CommInit,
    /// The making of a communicator's unique id (`ncclGetUniqueId`).
    UniqueId,
    /// A query of a communicator's asynchronous state (`ncclCommGetAsyncError`), as every wait
    /// on a collective of ranks in other processes makes.
    CommHealth,
    /// The start of a collective's group (`ncclGroupStart`).
    GroupStart,
    /// The end of a collective's group, which launches its parts (`ncclGroupEnd`). A refused end
    /// launches none of them.
    GroupEnd,
    /// The making of a library's handle, bound to the compute stream (`cublasCreate_v2`,
    /// `cusolverDnCreate`, `cutensorCreate`).
    LibraryOpen,
    /// A matrix product's enqueue (`cublas?gemm_v2`).
    Gemm,
    /// The query of a Cholesky factorisation's workspace (`cusolverDn?potrf_bufferSize`).
    SolverWorkspace,
    /// A Cholesky factorisation's enqueue (`cusolverDn?potrf`).
    Potrf,
    /// A Cholesky solve's enqueue (`cusolverDn?potrs`).
    Potrs,
    /// The planning of a tensor contraction (`cutensorCreatePlan` and what precedes it).
    ContractionPlan,
    /// A tensor contraction's enqueue (`cutensorContract`).
    Contract,
    /// The export of a driver's memory pool as a file descriptor
    /// (`cuMemPoolExportToShareableHandle`), made on the first `pool_descriptor` call only.
    PoolExportToShareableHandle,
    /// An allocation's export data (`cuMemPoolExportPointer`).
    PoolExportPointer,
    /// The import of another process's pool from its descriptor
    /// (`cuMemPoolImportFromShareableHandle`).
    PoolImportFromShareableHandle,
    /// The import of an allocation of an imported pool (`cuMemPoolImportPointer`).
    PoolImportPointer,
    /// The measure of the allocation that holds an address (`cuMemGetAddressRange`), as an
    /// importer measures a fresh mapping against the offer's size.
    GetAddressRange,
    /// The stream-ordered release of an imported allocation (`cuMemFreeAsync` on an imported
    /// pointer).
    ImportFreeAsync,
    /// The creation of an inter-process event and its handle (`cuEventCreate` with
    /// `CU_EVENT_INTERPROCESS`, then `cuIpcGetEventHandle`).
    IpcGetEventHandle,
    /// The opening of another process's inter-process event (`cuIpcOpenEventHandle`).
    IpcOpenEventHandle,
    /// The closing of an opened inter-process event (`cuEventDestroy` on it).
    IpcEventDestroy,
    /// The query of the device's memory and the pool's (`cuMemGetInfo`,
    /// `cuMemPoolGetAttribute`).
    MemoryReport,
    /// The release of a pool's unused memory (`cuMemPoolTrimTo`).
    TrimPool,
}

impl SimDevice {
    /// Makes the `n`-th call of `op` from now (`n >= 1`) panic inside the driver, as a driver
    /// library with a missing symbol does, to test that no panic releases memory a queued copy
    /// may still touch.
    pub fn panic_nth(&self, op: SimOp, n: u64) {
        let mut s = self.lock();
        let at = s.nth_call_from_now(op, n);
        s.panics.push((op, at));
    }

    /// Makes the `n`-th call of `op` from now (`n >= 1`) take effect and then panic inside the
    /// driver, before it returns: a copy is queued (or memory allocated, an event recorded) and
    /// the caller never learns it. No panic may then release what the call's work may touch.
    pub fn panic_after_nth(&self, op: SimOp, n: u64) {
        let mut s = self.lock();
        let at = s.nth_call_from_now(op, n);
        s.panics_after.push((op, at));
    }

    /// Makes the `n`-th call of `op` from now (`n >= 1`) fail with `error`.
    pub fn fail_nth(&self, op: SimOp, n: u64, error: DriverError) {
        let mut s = self.lock();
        let at = s.nth_call_from_now(op, n);
        s.faults.push((op, at, error));
    }

    /// Makes the event of the `n`-th event record from now (`n >= 1`) report `error` once the
    /// device reaches it, as a failed kernel or copy before it would.
    pub fn fail_event(&self, n: u64, error: DriverError) {
        let mut s = self.lock();
        let at = s.nth_call_from_now(SimOp::EventRecord, n);
        s.event_faults.push((at, error));
    }

    /// Removes every pending fault.
    pub fn clear_faults(&self) {
        let mut s = self.lock();
        s.faults.clear();
        s.event_faults.clear();
        s.panics.clear();
        s.panics_after.clear();
        s.panic_on_release = None;
    }

    /// How many times `op` has been called.
    pub fn calls(&self, op: SimOp) -> u64 {
        self.lock().calls.get(&op).copied().unwrap_or(0)
    }
}

impl State {
    /// The number the `n`-th call of `op` from now (`n >= 1`) will have; saturates, never
    /// overflows.
    fn nth_call_from_now(&self, op: SimOp, n: u64) -> u64 {
        self.calls
            .get(&op)
            .copied()
            .unwrap_or(0)
            .saturating_add(n.max(1))
    }

    /// Counts a call of `op` and fires what a test armed for it: a panic now, a panic once the
    /// device's lock is released, or the injected error. A call of a killed process's driver
    /// fails first, uncounted (`CUDA_ERROR_CONTEXT_IS_DESTROYED`; see `share.rs`).
    pub(super) fn enter(&mut self, op: SimOp) -> Result<(), DriverError> {
        self.alive()?;
        let n = self.calls.entry(op).or_insert(0);
        *n += 1;
        let n = *n;
        if let Some(i) = self.panics.iter().position(|p| *p == (op, n)) {
            self.panics.remove(i);
            panic!("simulated driver panic in {op:?} (call {n})");
        }
        if let Some(i) = self.panics_after.iter().position(|p| *p == (op, n)) {
            self.panics_after.remove(i);
            self.panic_on_release = Some(format!("simulated driver panic after {op:?} (call {n})"));
        }
        if let Some(i) = self.faults.iter().position(|f| f.0 == op && f.1 == n) {
            return Err(self.faults.remove(i).2);
        }
        Ok(())
    }

    /// As [`enter`](Self::enter), for an operation on `stream` that a capture cannot record:
    /// while the stream captures, it fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and
    /// invalidates the capture, as CUDA does.
    pub(super) fn enter_stream(&mut self, op: SimOp, stream: StreamId) -> Result<(), DriverError> {
        self.enter(op)?;
        self.refuse_in_capture(stream)
    }
}
