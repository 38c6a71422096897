//! The device seam's `Driver` for the simulated device.
//!
//! A [`SimDriver`] is one engine's view of the machine: a device of it, three streams of its own
//! (one per lane) and the contexts and peer links of its device. Each call enters the device
//! (counted, and failed or panicked as a test armed it; see `fault.rs`), then queues a job on
//! the lane's stream or does what its concern's file says: `memory.rs` for allocations and
//! page-locked host memory, `events.rs` for events, waits and wakes. The kernel and graph halves
//! of the seam are in `launch.rs` and `graph.rs`.

use super::{
    CURRENT, ContextHandle, DeviceId, DeviceKind, DevicePtr, Driver, DriverError, EventHandle, Job,
    Lane, Locked, SimDevice, SimOp, SimWaits, State, StreamId, Waits, Wake,
};
use std::cell::Cell;
use std::sync::Arc;

/// The driver half of a simulated device: what a simulated engine drives.
pub(crate) struct SimDriver {
    pub(super) device: SimDevice,
    id: DeviceId,
    /// Which device of the machine the driver drives.
    index: usize,
    /// The devices (indices) granted access to this driver's memory.
    granted: Vec<usize>,
    ctx: u64,
    /// The driver's first stream on the device: its lanes' streams are `streams + lane index`.
    streams: StreamId,
    /// The contraction plans made on this driver, by handle.
    pub(super) plans: crate::driver::libs::Plans<super::libs::Plan>,
    /// The simulated process this driver is (see `share.rs`): its pid and start.
    pub(super) process: super::share::Process,
    /// The pool's exported descriptor, once exported; closed when the driver is dropped.
    pub(super) pool_fd: Option<std::os::fd::OwnedFd>,
}

impl SimDriver {
    /// A driver on the first device of the machine `device`, with three streams of its own there.
    pub(crate) fn new(device: SimDevice) -> Self {
        Self::on(device, 0).expect("a simulated machine has at least one device")
    }

    /// A driver on device `index` of the machine `device`, with three streams of its own there;
    /// `None` when the machine has no such device.
    pub(crate) fn on(device: SimDevice, index: usize) -> Option<Self> {
        let (instance, ordinal, ctx, streams, process) = {
            let mut s = device.lock();
            let ctx = *s.ctxs.get(index)?;
            let streams = s.next_stream;
            s.next_stream += Lane::ALL.len();
            let process = s.start_process(streams);
            (s.instance, s.ordinal + index, ctx, streams, process)
        };
        Some(SimDriver {
            device,
            id: DeviceId {
                kind: DeviceKind::Simulated,
                ordinal,
                instance,
            },
            index,
            granted: Vec::new(),
            ctx,
            streams,
            plans: Default::default(),
            process,
            pool_fd: None,
        })
    }

    /// The device's lock, for a call of this driver: once its process is killed, the call
    /// fails as it enters the device.
    pub(super) fn lock(&self) -> Locked<'_> {
        self.device.lock_as(self.process.pid)
    }

    /// Which device of the machine the driver drives.
    pub(super) fn index(&self) -> usize {
        self.index
    }

    /// The index on the machine of device `peer`, when it is a device of this machine linked to
    /// this driver's (or this driver's own).
    pub(super) fn linked(&self, s: &State, peer: DeviceId) -> Option<usize> {
        let index = peer.ordinal.checked_sub(s.ordinal)?;
        let ours = peer.kind == DeviceKind::Simulated && peer.instance == s.instance;
        (ours && s.peer_linked.get(self.index)?.get(index) == Some(&true)).then_some(index)
    }

    /// The device stream of one of the driver's lanes.
    pub(super) fn stream(&self, lane: Lane) -> StreamId {
        self.streams + lane.index()
    }
}

impl Driver for SimDriver {
    fn device(&self) -> DeviceId {
        self.id
    }

    fn name(&self) -> &str {
        "cuferry simulated device"
    }

    fn context(&self) -> ContextHandle {
        ContextHandle(self.ctx)
    }

    fn stream_handle(&self) -> u64 {
        // Distinct for every driver's compute stream (the first driver's is `instance << 8 | 1`).
        (self.id.instance << 8 | 1) + ((self.streams as u64) << 32)
    }

    fn current_context(&self) -> Result<ContextHandle, DriverError> {
        Ok(ContextHandle(CURRENT.with(Cell::get)))
    }

    fn set_current_context(&self, ctx: ContextHandle) -> Result<(), DriverError> {
        CURRENT.with(|c| c.set(ctx.0));
        Ok(())
    }

    fn alloc(&mut self, lane: Lane, bytes: usize) -> Result<DevicePtr, DriverError> {
        self.alloc_on_device(lane, self.index, bytes)
    }

    fn pool(&self) -> u64 {
        // The machine's tag, and the device whose memory the pool holds.
        (self.id.instance << 16) | self.index as u64
    }

    fn trim_pool(&mut self, _keep: usize) -> Result<(), DriverError> {
        // Nothing unused to give back (see `memory_report`); the call is counted and may fail.
        self.lock().enter(SimOp::TrimPool)
    }

    fn alloc_from(
        &mut self,
        lane: Lane,
        pool: u64,
        bytes: usize,
    ) -> Result<DevicePtr, DriverError> {
        if pool >> 16 != self.id.instance {
            return Err(DriverError::INVALID_VALUE);
        }
        self.alloc_on_device(lane, (pool & 0xffff) as usize, bytes)
    }

    unsafe fn free(&mut self, lane: Lane, ptr: DevicePtr) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(lane);
        s.enter_stream(SimOp::Free, stream)?;
        s.push(stream, Job::Free(ptr));
        Ok(())
    }
    unsafe fn copy_htod(
        &mut self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(Lane::Upload);
        s.enter_stream(SimOp::CopyHtoD, stream)?;
        if s.is_page_locked(src as usize, bytes) {
            s.push(stream, Job::HtoD { dst, src, bytes });
        } else {
            // CUDA stages a pageable source before the call returns (after a sync), so the
            // caller may reuse it at once: model exactly that.
            while s.run_one() {}
            self.device.inner.progress.notify_all();
            // SAFETY: the seam's contract makes `src..src+bytes` readable for the call.
            let data = unsafe { std::slice::from_raw_parts(src, bytes) }.to_vec();
            s.push(stream, Job::HtoDStaged { dst, data });
        }
        Ok(())
    }

    unsafe fn copy_dtoh(
        &mut self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(Lane::Download);
        s.enter_stream(SimOp::CopyDtoH, stream)?;
        let pageable = !s.is_page_locked(dst as usize, bytes);
        let seq = s.push(stream, Job::DtoH { dst, src, bytes });
        if pageable {
            // CUDA returns from a copy into pageable memory only once it has completed.
            s.run_until(seq);
            self.device.inner.progress.notify_all();
        }
        Ok(())
    }

    unsafe fn copy_dtod(
        &mut self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(Lane::Compute);
        s.enter_stream(SimOp::CopyDtoD, stream)?;
        s.push(stream, Job::DtoD { dst, src, bytes });
        Ok(())
    }

    fn event_create(&mut self) -> Result<EventHandle, DriverError> {
        self.lock().create_event(SimOp::EventCreate, false)
    }

    fn ordering_event_create(&mut self) -> Result<EventHandle, DriverError> {
        self.lock().create_event(SimOp::OrderEventCreate, true)
    }

    fn event_record(&mut self, lane: Lane, event: EventHandle) -> Result<(), DriverError> {
        self.lock().record_event(self.stream(lane), event)
    }

    fn stream_wait(&mut self, lane: Lane, event: EventHandle) -> Result<(), DriverError> {
        self.lock().wait_event(self.stream(lane), event)
    }

    #[cfg(feature = "dlpack")]
    fn allocation_of(&self, ptr: DevicePtr) -> Result<crate::driver::Allocation, DriverError> {
        let s = self.lock();
        s.alive()?;
        let (&base, block) = s
            .mem
            .range(..=ptr)
            .next_back()
            .filter(|(base, block)| ptr - **base < block.len() as u64)
            .ok_or(DriverError::INVALID_VALUE)?;
        let device = s.touches.get(&base).map_or(0, |t| t.device);
        Ok(crate::driver::Allocation {
            base,
            bytes: block.len() as u64,
            ordinal: s.ordinal + device,
        })
    }

    unsafe fn foreign_record(
        &mut self,
        stream: u64,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = s.foreign_stream(stream)?;
        s.record_event(stream, event)
    }

    unsafe fn foreign_wait(&mut self, stream: u64, event: EventHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = s.foreign_stream(stream)?;
        s.wait_event(stream, event)
    }

    fn can_access_peer(&self, peer: DeviceId) -> Result<bool, DriverError> {
        let s = self.lock();
        s.alive()?;
        Ok(self.linked(&s, peer).is_some())
    }

    fn enable_peer_access(&mut self, peer: ContextHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::PeerEnable)?;
        match s.ctxs.iter().position(|&c| c == peer.0) {
            Some(index) if s.peer_linked[self.index][index] => Ok(()),
            _ => Err(DriverError::NOT_SUPPORTED),
        }
    }

    fn grant_peer_access(&mut self, peer: DeviceId) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.alive()?;
        let index = peer.ordinal.checked_sub(s.ordinal);
        if index == Some(self.index) || index.is_some_and(|i| self.granted.contains(&i)) {
            return Ok(());
        }
        s.enter(SimOp::PeerEnable)?;
        let granted = self.linked(&s, peer).ok_or(DriverError::NOT_SUPPORTED)?;
        drop(s);
        self.granted.push(granted);
        Ok(())
    }

    unsafe fn copy_peer(
        &mut self,
        lane: Lane,
        dst: DevicePtr,
        dst_ctx: ContextHandle,
        src: DevicePtr,
        src_ctx: ContextHandle,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        let stream = self.stream(lane);
        s.enter_stream(SimOp::CopyPeer, stream)?;
        let index = |ctx: ContextHandle| s.ctxs.iter().position(|&c| c == ctx.0);
        let (Some(d), Some(from)) = (index(dst_ctx), index(src_ctx)) else {
            return Err(DriverError::INVALID_CONTEXT);
        };
        if !s.peer_linked[d][from] || (d != self.index && from != self.index) {
            return Err(DriverError::NOT_SUPPORTED);
        }
        // Each side must lie on the device its context names.
        let on = |ptr: DevicePtr| s.touches.range(..=ptr).next_back().map(|(_, t)| t.device);
        if on(dst) != Some(d) || on(src) != Some(from) {
            return Err(DriverError::INVALID_VALUE);
        }
        s.push(stream, Job::DtoD { dst, src, bytes });
        Ok(())
    }

    unsafe fn event_destroy(&mut self, event: EventHandle) -> Result<(), DriverError> {
        self.lock().destroy_event(event)
    }

    fn notify_after(&mut self, event: EventHandle, wake: Wake) -> Result<(), DriverError> {
        let mut s = self.lock();
        if s.register_wake(event, wake)? {
            self.device.inner.progress.notify_all();
        }
        Ok(())
    }

    fn host_alloc(&mut self, bytes: usize) -> Result<*mut u8, DriverError> {
        self.lock().alloc_pinned(bytes)
    }

    unsafe fn host_free(&mut self, ptr: *mut u8) -> Result<(), DriverError> {
        // SAFETY: this call's contract is `free_pinned`'s.
        unsafe { self.lock().free_pinned(ptr) }
    }

    fn host_register(&mut self, ptr: *mut u8, bytes: usize) -> Result<(), DriverError> {
        self.lock().register_host(ptr, bytes)
    }

    unsafe fn host_unregister(&mut self, ptr: *mut u8) -> Result<(), DriverError> {
        self.lock().unregister_host(ptr)
    }

    fn waits(&self) -> Arc<dyn Waits> {
        Arc::new(SimWaits {
            device: self.device.clone(),
            streams: self.streams,
            pid: self.process.pid,
            index: self.index,
        })
    }

    #[cfg(feature = "cubecl")]
    fn hosts_cuda_runtimes(&self) -> bool {
        false
    }
}
