//! The simulated device's own tests, through the seam as an engine drives it: the clock and
//! schedules, copies with pinned, registered and pageable memory, events, waits and wakes, fault
//! injection, stream-ordered allocation, kernel emulation and the race checker.

use super::memory::{HOST_MEMORY_ALREADY_REGISTERED, HOST_MEMORY_NOT_REGISTERED};
use super::*;

fn driver() -> (SimDriver, SimDevice) {
    let dev = SimDevice::new(SimConfig::default());
    (SimDriver::new(dev.clone()), dev)
}

/// Pinned host memory of the simulated device, filled with `fill(i)`.
fn pinned(d: &mut SimDriver, bytes: usize, fill: impl Fn(usize) -> u8) -> &'static mut [u8] {
    let ptr = d.host_alloc(bytes).unwrap();
    // SAFETY: a fresh allocation of `bytes` bytes, leaked for the test's duration.
    let slice = unsafe { std::slice::from_raw_parts_mut(ptr, bytes) };
    slice.iter_mut().enumerate().for_each(|(i, b)| *b = fill(i));
    slice
}

#[test]
fn copies_complete_only_when_the_clock_advances() {
    let (mut d, dev) = driver();
    let src = pinned(&mut d, 64, |i| (i as u8).wrapping_mul(7).wrapping_add(3));
    let back = pinned(&mut d, 64, |_| 0xEE);
    let ptr = d.alloc(Lane::Compute, 64).unwrap();
    let uploaded = d.event_create().unwrap();
    // SAFETY: both host ranges are live pinned allocations; the test runs the jobs before
    // reading them.
    unsafe {
        d.copy_htod(ptr, src.as_ptr(), 64).unwrap();
        d.event_record(Lane::Upload, uploaded).unwrap();
        d.stream_wait(Lane::Download, uploaded).unwrap();
        d.copy_dtoh(back.as_mut_ptr(), ptr, 64).unwrap();
    }
    assert_eq!(
        dev.queued(),
        3,
        "two copies and a record (a wait takes no device time)"
    );
    assert_eq!(back, &[0xEE; 64][..], "nothing ran yet");
    assert_eq!(dev.advance(1), 1);
    assert_eq!(dev.peek(ptr, 64).unwrap(), src, "the upload ran");
    assert_eq!(back, &[0xEE; 64][..], "the download did not");
    dev.advance(2);
    assert_eq!(back, src);
    assert_eq!(dev.advance(5), 0);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn an_upload_from_pinned_memory_reads_its_source_when_it_runs() {
    let (mut d, dev) = driver();
    let src = pinned(&mut d, 8, |_| 1);
    let ptr = d.alloc(Lane::Compute, 8).unwrap();
    // SAFETY: `src` is live pinned memory; the job runs below.
    unsafe { d.copy_htod(ptr, src.as_ptr(), 8).unwrap() };
    src.iter_mut().for_each(|b| *b = 9);
    dev.advance_all();
    assert_eq!(dev.peek(ptr, 8).unwrap(), vec![9; 8]);
}

#[test]
fn pageable_copies_behave_as_cuda_documents() {
    let (mut d, dev) = driver();
    let ptr = d.alloc(Lane::Compute, 8).unwrap();
    let mut src = [1u8; 8];
    // SAFETY: `src` is readable for the call, which stages it.
    unsafe { d.copy_htod(ptr, src.as_ptr(), 8).unwrap() };
    src.iter_mut().for_each(|b| *b = 9);
    assert_eq!(dev.queued(), 1, "the DMA itself is still queued");
    dev.advance_all();
    assert_eq!(
        dev.peek(ptr, 8).unwrap(),
        vec![1; 8],
        "the staged bytes, not the later ones"
    );
    let mut back = [0u8; 8];
    // SAFETY: `back` is writable for the call, which completes the copy before returning.
    unsafe { d.copy_dtoh(back.as_mut_ptr(), ptr, 8).unwrap() };
    assert_eq!(back, [1; 8]);
    assert_eq!(dev.queued(), 0);
}

#[test]
fn events_report_completion_in_stream_order() {
    let (mut d, dev) = driver();
    let a = d.event_create().unwrap();
    let b = d.event_create().unwrap();
    assert!(
        d.waits().event_query(a).unwrap(),
        "an unrecorded event is complete"
    );
    let ptr = d.alloc(Lane::Compute, 4).unwrap();
    let src = pinned(&mut d, 4, |i| i as u8 + 1);
    // SAFETY: `src` is live pinned memory.
    unsafe { d.copy_htod(ptr, src.as_ptr(), 4).unwrap() };
    d.event_record(Lane::Upload, a).unwrap();
    // SAFETY: as above.
    unsafe { d.copy_htod(ptr, src.as_ptr(), 4).unwrap() };
    d.event_record(Lane::Upload, b).unwrap();
    assert!(!d.waits().event_query(a).unwrap());
    assert!(!d.waits().event_query(b).unwrap());
    dev.advance(2);
    assert!(d.waits().event_query(a).unwrap());
    assert!(!d.waits().event_query(b).unwrap());
    d.waits().event_synchronize(b).unwrap();
    assert!(d.waits().event_query(b).unwrap());
    assert_eq!(dev.queued(), 0);
}

#[test]
fn event_synchronize_runs_only_up_to_its_event() {
    let (mut d, dev) = driver();
    let a = d.event_create().unwrap();
    d.event_record(Lane::Compute, a).unwrap();
    let ptr = d.alloc(Lane::Compute, 4).unwrap();
    // SAFETY: `ptr` is live; the free is the last use.
    unsafe { d.free(Lane::Compute, ptr).unwrap() };
    d.waits().event_synchronize(a).unwrap();
    assert_eq!(dev.queued(), 1, "the later free is still queued");
    assert_eq!(dev.device_live(), (1, 4));
    d.waits().stream_synchronize().unwrap();
    assert_eq!(dev.device_live(), (0, 0));
}

#[test]
fn the_nth_call_fails_with_the_injected_error() {
    let (mut d, dev) = driver();
    dev.fail_nth(SimOp::Alloc, 2, DriverError::OUT_OF_MEMORY);
    assert!(d.alloc(Lane::Compute, 8).is_ok());
    assert_eq!(d.alloc(Lane::Compute, 8), Err(DriverError::OUT_OF_MEMORY));
    assert!(d.alloc(Lane::Compute, 8).is_ok(), "a fault fires once");
    assert_eq!(dev.calls(SimOp::Alloc), 3);
}

#[test]
fn an_event_fault_is_reported_once_the_device_reaches_it() {
    let (mut d, dev) = driver();
    let e = d.event_create().unwrap();
    dev.fail_event(1, DriverError::LAUNCH_FAILED);
    d.event_record(Lane::Compute, e).unwrap();
    assert_eq!(
        d.waits().event_query(e),
        Ok(false),
        "not reached: not ready, not failed"
    );
    dev.advance_all();
    assert_eq!(d.waits().event_query(e), Err(DriverError::LAUNCH_FAILED));
    assert_eq!(
        d.waits().event_synchronize(e),
        Err(DriverError::LAUNCH_FAILED)
    );
    d.event_record(Lane::Compute, e).unwrap();
    d.waits().event_synchronize(e).unwrap();
}

/// A wake that counts, and reads the device (which takes its lock) when called.
fn counting_wake(dev: &SimDevice, count: &Arc<AtomicU64>) -> Wake {
    let (dev, count) = (dev.clone(), Arc::clone(count));
    Box::new(move || {
        let _ = dev.queued(); // would deadlock if called under the device's lock
        count.fetch_add(1, Ordering::SeqCst);
    })
}

#[test]
fn a_wake_is_called_once_when_the_clock_runs_its_record() {
    let (mut d, dev) = driver();
    dev.hold_clock(true);
    let ptr = d.alloc(Lane::Compute, 4).unwrap();
    let src = pinned(&mut d, 4, |i| i as u8 + 1);
    let e = d.event_create().unwrap();
    // SAFETY: `src` is live pinned memory and `ptr` a live allocation of 4 bytes.
    unsafe { d.copy_htod(ptr, src.as_ptr(), 4).unwrap() };
    d.event_record(Lane::Upload, e).unwrap();
    // SAFETY: as above; queued after the record, so the wake does not wait for it.
    unsafe { d.copy_htod(ptr, src.as_ptr(), 4).unwrap() };
    let count = Arc::new(AtomicU64::new(0));
    d.notify_after(e, counting_wake(&dev, &count)).unwrap();
    d.event_record(Lane::Upload, e).unwrap(); // a later record does not move the wake
    assert_eq!(dev.calls(SimOp::NotifyAfter), 1);
    assert_eq!(dev.advance(1), 1);
    assert_eq!(
        count.load(Ordering::SeqCst),
        0,
        "the copy ran, not the record"
    );
    assert_eq!(dev.advance(1), 1);
    assert_eq!(count.load(Ordering::SeqCst), 1, "called by the record");
    dev.advance_all();
    assert_eq!(count.load(Ordering::SeqCst), 1, "once");
}

#[test]
fn a_wake_on_a_reached_unrecorded_or_failed_event_is_called_at_once() {
    let (mut d, dev) = driver();
    dev.hold_clock(true);
    let count = Arc::new(AtomicU64::new(0));
    let never = d.event_create().unwrap();
    d.notify_after(never, counting_wake(&dev, &count)).unwrap();
    assert_eq!(count.load(Ordering::SeqCst), 1, "never recorded: complete");
    let failed = d.event_create().unwrap();
    dev.fail_event(1, DriverError::LAUNCH_FAILED);
    d.event_record(Lane::Download, failed).unwrap();
    dev.advance_all();
    d.notify_after(failed, counting_wake(&dev, &count)).unwrap();
    assert_eq!(count.load(Ordering::SeqCst), 2, "failed: due too");
    assert_eq!(
        d.waits().event_query(failed),
        Err(DriverError::LAUNCH_FAILED)
    );
}

#[test]
fn registering_a_wake_with_a_free_clock_runs_the_stream_up_to_its_event() {
    let (mut d, dev) = driver();
    let e = d.event_create().unwrap();
    d.event_record(Lane::Compute, e).unwrap();
    let ptr = d.alloc(Lane::Compute, 4).unwrap();
    // SAFETY: `ptr` is live; the free is its last use.
    unsafe { d.free(Lane::Compute, ptr).unwrap() };
    let count = Arc::new(AtomicU64::new(0));
    d.notify_after(e, counting_wake(&dev, &count)).unwrap();
    assert_eq!(count.load(Ordering::SeqCst), 1);
    assert_eq!(
        dev.queued(),
        1,
        "only up to the event: the free is still queued"
    );
}

#[test]
fn a_refused_registration_drops_its_wake_uncalled() {
    let (mut d, dev) = driver();
    dev.hold_clock(true);
    let e = d.event_create().unwrap();
    d.event_record(Lane::Compute, e).unwrap();
    let count = Arc::new(AtomicU64::new(0));
    dev.fail_nth(SimOp::NotifyAfter, 1, DriverError::INVALID_VALUE);
    let wake = counting_wake(&dev, &count);
    assert_eq!(d.notify_after(e, wake), Err(DriverError::INVALID_VALUE));
    let unknown = EventHandle(u64::MAX);
    let wake = counting_wake(&dev, &count);
    assert_eq!(
        d.notify_after(unknown, wake),
        Err(DriverError::INVALID_VALUE)
    );
    dev.advance_all();
    assert_eq!(count.load(Ordering::SeqCst), 0);
    assert_eq!(Arc::strong_count(&count), 1, "both wakes were dropped");
}

#[test]
fn freeing_pinned_memory_under_a_queued_copy_is_a_violation_and_keeps_it() {
    let (mut d, dev) = driver();
    let host = d.host_alloc(16).unwrap();
    let ptr = d.alloc(Lane::Compute, 16).unwrap();
    // SAFETY: `host` is a live sim allocation; the test checks the sim refuses to free it.
    unsafe {
        d.copy_dtoh(host, ptr, 16).unwrap();
        d.host_free(host).unwrap();
    }
    assert_eq!(dev.violations().len(), 1);
    assert!(dev.is_pinned_live(host));
    dev.advance_all();
    // SAFETY: the copy has run; nothing names the memory now.
    unsafe { d.host_free(host).unwrap() };
    assert!(!dev.is_pinned_live(host));
    assert_eq!(dev.pinned_live(), (0, 0));
}

#[test]
fn copies_with_registered_memory_run_when_the_clock_reaches_them() {
    let (mut d, dev) = driver();
    let mut up = vec![1u8; 32];
    let mut down = vec![0xEEu8; 32];
    let (up, down) = (up.as_mut_ptr(), down.as_mut_ptr());
    d.host_register(up, 32).unwrap();
    d.host_register(down, 32).unwrap();
    assert_eq!(dev.registered_live(), (2, 64));
    assert!(dev.is_registered(up));
    let ptr = d.alloc(Lane::Compute, 32).unwrap();
    let uploaded = d.event_create().unwrap();
    // SAFETY: both ranges are live, registered and only reached through these pointers
    // until the jobs have run.
    unsafe {
        d.copy_htod(ptr, up, 32).unwrap();
        d.event_record(Lane::Upload, uploaded).unwrap();
        d.stream_wait(Lane::Download, uploaded).unwrap();
        d.copy_dtoh(down, ptr, 32).unwrap();
        std::ptr::write_bytes(up, 9, 32);
    }
    assert_eq!(dev.queued(), 3, "neither copy ran at its call");
    // SAFETY: `down` holds 32 initialised bytes; the download has not run.
    assert_eq!(unsafe { std::slice::from_raw_parts(down, 32) }, [0xEE; 32]);
    dev.advance_all();
    // SAFETY: as above; both jobs have run.
    assert_eq!(unsafe { std::slice::from_raw_parts(down, 32) }, [9; 32]);
    // SAFETY: registered above; nothing queued names them now.
    unsafe {
        d.host_unregister(up).unwrap();
        d.host_unregister(down).unwrap();
    }
    assert_eq!(dev.registered_live(), (0, 0));
    assert!(dev.violations().is_empty());
}

#[test]
fn unregistering_under_a_queued_copy_is_a_violation_and_refused() {
    let (mut d, dev) = driver();
    let mut host = vec![3u8; 16];
    let host = host.as_mut_ptr();
    d.host_register(host, 16).unwrap();
    assert_eq!(
        d.host_register(host.wrapping_add(8), 4),
        Err(DriverError::from_code(HOST_MEMORY_ALREADY_REGISTERED)),
        "an overlapping registration is refused"
    );
    let ptr = d.alloc(Lane::Compute, 16).unwrap();
    // SAFETY: `host` is registered and outlives the job, which runs below.
    unsafe { d.copy_dtoh(host, ptr, 16).unwrap() };
    // SAFETY: the test checks that the simulator refuses this.
    assert!(unsafe { d.host_unregister(host) }.is_err());
    assert_eq!(dev.violations().len(), 1);
    assert!(dev.is_registered(host), "still registered");
    dev.advance_all();
    // SAFETY: the copy has run; nothing names the range now.
    unsafe { d.host_unregister(host).unwrap() };
    assert_eq!(
        // SAFETY: the test checks that an unknown range is refused.
        unsafe { d.host_unregister(host) },
        Err(DriverError::from_code(HOST_MEMORY_NOT_REGISTERED))
    );
    assert_eq!(dev.violations().len(), 2);
    assert_eq!(dev.calls(SimOp::HostRegister), 2);
    assert_eq!(dev.calls(SimOp::HostUnregister), 3);
}

#[test]
fn device_memory_is_bounded() {
    let dev = SimDevice::new(SimConfig {
        memory_bytes: 100,
        ..SimConfig::default()
    });
    let mut d = SimDriver::new(dev);
    let a = d.alloc(Lane::Compute, 60).unwrap();
    assert_eq!(d.alloc(Lane::Compute, 60), Err(DriverError::OUT_OF_MEMORY));
    // SAFETY: `a` is live and unused.
    unsafe { d.free(Lane::Compute, a).unwrap() };
    d.waits().stream_synchronize().unwrap();
    assert!(d.alloc(Lane::Compute, 60).is_ok());
}

#[test]
fn an_allocation_may_take_the_memory_of_a_queued_free_and_waits_for_it() {
    let dev = SimDevice::new(SimConfig {
        memory_bytes: 100,
        ..SimConfig::default()
    });
    let mut d = SimDriver::new(dev.clone());
    let mut other = SimDriver::new(dev.clone());
    let a = d.alloc(Lane::Compute, 60).unwrap();
    dev.hold_clock(true);
    // SAFETY: `a` is live and unused.
    unsafe { d.free(Lane::Compute, a).unwrap() };
    // Another driver's queued free makes no room for this one (another pool).
    assert_eq!(
        other.alloc(Lane::Upload, 60),
        Err(DriverError::OUT_OF_MEMORY)
    );
    // The free is still queued; an allocation on another lane takes its memory and its
    // lane waits for the free.
    let b = d.alloc(Lane::Upload, 60).unwrap();
    assert_eq!(dev.device_live(), (2, 120), "until the free runs");
    // A synchronize of the upload lane alone (only what it waits for runs) runs the free.
    dev.set_schedule(Schedule::Interleaved { seed: 1 });
    dev.hold_clock(false);
    d.waits().lane_synchronize(Lane::Upload).unwrap();
    assert_eq!(
        dev.device_live(),
        (1, 60),
        "the upload lane waited for the free"
    );
    assert!(dev.peek(b, 60).is_some());
    // Nothing more is queued to free: beyond capacity is out of memory again.
    assert_eq!(d.alloc(Lane::Compute, 60), Err(DriverError::OUT_OF_MEMORY));
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn contexts_are_per_thread() {
    let (d, _dev) = driver();
    set_thread_context(None);
    d.set_current_context(d.context()).unwrap();
    assert_eq!(thread_context(), Some(d.context().0));
    std::thread::spawn(|| assert_eq!(thread_context(), None))
        .join()
        .unwrap();
    set_thread_context(None);
}

/// A kernel the seam knows nothing about: copies `params[2]` bytes from `params[1]` to
/// `params[0]`.
struct CopyKernel;

impl crate::driver::launch::Emulation for CopyKernel {
    fn name(&self) -> &str {
        "copy"
    }

    fn run(
        &self,
        memory: &mut dyn crate::driver::launch::DeviceMemory,
        params: &[u64],
    ) -> Result<(), String> {
        let &[dst, src, bytes] = params else {
            return Err("copy takes three parameters".into());
        };
        let data = memory
            .read(src, bytes as usize)
            .ok_or("copy reads unmapped memory")?;
        if memory.write(dst, &data) {
            Ok(())
        } else {
            Err("copy writes unmapped memory".into())
        }
    }
}

#[test]
fn a_launch_runs_its_modules_emulation_when_the_clock_reaches_it() {
    use crate::driver::launch::{Launch, ModuleSource};
    let (mut d, dev) = driver();
    let refused = d.module_compile(&ModuleSource {
        name: "user",
        cuda: "",
        emulation: None,
    });
    assert!(
        matches!(
            refused,
            Err(crate::Error::Setup(
                crate::error::SetupError::Unavailable { .. }
            ))
        ),
        "{refused:?}"
    );
    let module = d
        .module_compile(&ModuleSource {
            name: "copy",
            cuda: "",
            emulation: Some(Arc::new(CopyKernel)),
        })
        .unwrap();
    assert!(d.module_function(module, "other").is_err());
    let function = d.module_function(module, "copy").unwrap();
    let src = pinned(&mut d, 4, |i| i as u8 + 1);
    let a = d.alloc(Lane::Compute, 4).unwrap();
    let b = d.alloc(Lane::Compute, 4).unwrap();
    let uploaded = d.event_create().unwrap();
    // SAFETY: `src` is live pinned memory, `a` and `b` live allocations of 4 bytes; the test
    // runs every job before reading.
    unsafe {
        d.copy_htod(a, src.as_ptr(), 4).unwrap();
        d.event_record(Lane::Upload, uploaded).unwrap();
        d.stream_wait(Lane::Compute, uploaded).unwrap();
        d.launch(function, 1, 1, &[b, a, 4]).unwrap();
        d.launch(function, 1, 1, &[b, 0x10, 4]).unwrap();
    }
    assert_eq!(
        dev.advance(3),
        3,
        "the copy, its record and a launch (not the wait)"
    );
    assert_eq!(dev.peek(b, 4).unwrap(), [1, 2, 3, 4]);
    assert!(dev.violations().is_empty());
    dev.advance_all();
    assert_eq!(
        dev.violations(),
        [Violation::KernelFailed {
            kernel: "copy".into(),
            message: "copy reads unmapped memory".into(),
        }]
    );
    assert_eq!(dev.calls(SimOp::Launch), 2);
    // SAFETY: loaded above, unloaded once, and both launches have run.
    unsafe { d.module_unload(module).unwrap() };
}

/// Queues an upload of `src` into `dst` on the upload lane.
fn upload(d: &mut SimDriver, dst: DevicePtr, src: &[u8]) {
    // SAFETY: every `src` in these tests is pinned memory of the device, leaked for the
    // test's duration, and `dst` a live allocation of at least its length.
    unsafe { d.copy_htod(dst, src.as_ptr(), src.len()).unwrap() };
}

/// Queues a download of `src` into `dst` on the download lane.
fn download(d: &mut SimDriver, dst: &mut [u8], src: DevicePtr) {
    // SAFETY: as `upload`, for the destination.
    unsafe { d.copy_dtoh(dst.as_mut_ptr(), src, dst.len()).unwrap() };
}

/// Queues a device-to-device copy on the compute lane.
fn copy(d: &mut SimDriver, dst: DevicePtr, src: DevicePtr, bytes: usize) {
    // SAFETY: the tests pass disjoint live allocations of at least `bytes` bytes.
    unsafe { d.copy_dtod(dst, src, bytes).unwrap() };
}

/// A driver on a fresh device with an interleaved schedule.
fn interleaved(seed: u64) -> (SimDriver, SimDevice) {
    let (d, dev) = driver();
    dev.set_schedule(Schedule::Interleaved { seed });
    (d, dev)
}

#[test]
fn a_wait_holds_its_stream_until_the_events_record_runs() {
    let mut overtaken = 0;
    for seed in 0..64 {
        let (mut d, dev) = interleaved(seed);
        let src = pinned(&mut d, 8, |i| i as u8 + 1);
        let back = pinned(&mut d, 8, |_| 0xEE);
        let ptr = d.alloc(Lane::Upload, 8).unwrap();
        let (x, y) = (
            d.alloc(Lane::Compute, 8).unwrap(),
            d.alloc(Lane::Compute, 8).unwrap(),
        );
        let e = d.event_create().unwrap();
        let fill = pinned(&mut d, 8, |i| i as u8 + 11);
        upload(&mut d, x, fill);
        d.waits().stream_synchronize().unwrap();
        upload(&mut d, ptr, src);
        upload(&mut d, ptr, src);
        d.event_record(Lane::Upload, e).unwrap();
        d.stream_wait(Lane::Download, e).unwrap();
        download(&mut d, back, ptr);
        copy(&mut d, y, x, 8);
        copy(&mut d, x, y, 8);
        let mut compute_ran_while_held = false;
        while dev.queued() > 0 {
            let recorded = d.waits().event_query(e).unwrap();
            let before = dev.completed();
            let copied = dev.peek(y, 8).unwrap() == fill;
            assert_eq!(dev.advance(1), 1);
            assert_eq!(dev.completed(), before + 1);
            if back[0] != 0xEE {
                assert!(recorded || d.waits().event_query(e).unwrap(), "seed {seed}");
            }
            if !recorded && !copied && dev.peek(y, 8).unwrap() == fill {
                compute_ran_while_held = true;
            }
        }
        assert_eq!(back, src, "seed {seed}");
        assert!(
            dev.violations().is_empty(),
            "seed {seed}: {:?}",
            dev.violations()
        );
        overtaken += usize::from(compute_ran_while_held);
    }
    assert!(
        overtaken > 0,
        "the compute lane runs while the download waits"
    );
}

/// A driver whose device interleaves its streams (only then does a lane run apart from
/// program order), with a 4-byte pinned source (1, 2, 3, 4) and a 4-byte landing buffer.
fn interleaved_with_buffers() -> (SimDriver, SimDevice, &'static mut [u8], &'static mut [u8]) {
    let (mut d, dev) = driver();
    dev.set_schedule(Schedule::Interleaved { seed: 1 });
    let src = pinned(&mut d, 4, |i| i as u8 + 1);
    let back = pinned(&mut d, 4, |_| 0xEE);
    (d, dev, src, back)
}

#[test]
fn a_wait_is_fixed_when_it_is_queued() {
    let (mut d, dev, src, back) = interleaved_with_buffers();
    let (a, b) = (
        d.alloc(Lane::Upload, 4).unwrap(),
        d.alloc(Lane::Upload, 4).unwrap(),
    );
    let e = d.event_create().unwrap();
    d.stream_wait(Lane::Download, e).unwrap();
    assert_eq!(
        dev.queued(),
        0,
        "a wait for an event never recorded waits for nothing"
    );
    upload(&mut d, a, src);
    d.event_record(Lane::Upload, e).unwrap();
    d.stream_wait(Lane::Download, e).unwrap();
    upload(&mut d, b, src);
    d.event_record(Lane::Upload, e).unwrap(); // a later record: the wait keeps the first
    download(&mut d, back, a);
    assert_eq!(
        dev.queued(),
        5,
        "three copies and two records (a wait takes no device time)"
    );
    d.waits().lane_synchronize(Lane::Download).unwrap();
    assert_eq!(back, src);
    assert_eq!(
        dev.queued(),
        2,
        "the second upload and its record are still queued"
    );
    assert!(
        !d.waits().event_query(e).unwrap(),
        "the event's last record has not run"
    );
    d.waits().stream_synchronize().unwrap();
    assert!(d.waits().event_query(e).unwrap());
    d.stream_wait(Lane::Compute, e).unwrap();
    assert_eq!(
        dev.queued(),
        0,
        "a wait for a record that has run waits for nothing"
    );
    dev.fail_nth(SimOp::StreamWait, 1, DriverError::INVALID_VALUE);
    upload(&mut d, a, src);
    d.event_record(Lane::Upload, e).unwrap();
    assert_eq!(
        d.stream_wait(Lane::Download, e),
        Err(DriverError::INVALID_VALUE)
    );
    assert_eq!(dev.queued(), 2, "a refused wait queues nothing");
    assert_eq!(dev.calls(SimOp::StreamWait), 4);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn a_lane_synchronize_runs_only_its_lane_and_what_it_waits_for() {
    let (mut d, dev, src, back) = interleaved_with_buffers();
    let (x, y) = (
        d.alloc(Lane::Compute, 4).unwrap(),
        d.alloc(Lane::Compute, 4).unwrap(),
    );
    let (a, c) = (
        d.alloc(Lane::Upload, 4).unwrap(),
        d.alloc(Lane::Upload, 4).unwrap(),
    );
    let e = d.event_create().unwrap();
    copy(&mut d, y, x, 4); // seq 0, compute
    upload(&mut d, a, src); // seq 1
    d.event_record(Lane::Upload, e).unwrap(); // seq 2
    upload(&mut d, c, src); // seq 3, after the record
    d.stream_wait(Lane::Download, e).unwrap(); // seq 4
    download(&mut d, back, a); // seq 5
    copy(&mut d, x, y, 4); // seq 6, compute
    d.waits().lane_synchronize(Lane::Download).unwrap();
    assert_eq!(back, src);
    assert_eq!(dev.queued(), 3, "both compute copies and the later upload");
    assert_eq!(
        dev.peek(c, 4).unwrap(),
        [0xA5; 4],
        "the later upload did not run"
    );
    assert_eq!(
        dev.peek(y, 4).unwrap(),
        [0xA5; 4],
        "the compute lane did not run"
    );
    assert!(!d.waits().stream_query().unwrap());
    d.waits().lane_synchronize(Lane::Upload).unwrap();
    assert_eq!(dev.queued(), 2);
    assert_eq!(dev.peek(c, 4).unwrap(), src);
    d.waits().lane_synchronize(Lane::Compute).unwrap();
    assert!(d.waits().stream_query().unwrap());
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn a_lane_synchronize_with_a_held_clock_waits_for_the_clock() {
    let (mut d, dev) = driver();
    let src = pinned(&mut d, 4, |i| i as u8 + 1);
    let a = d.alloc(Lane::Upload, 4).unwrap();
    dev.hold_clock(true);
    upload(&mut d, a, src);
    let waits = d.waits();
    let waiter = std::thread::spawn(move || waits.lane_synchronize(Lane::Upload));
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(dev.queued(), 1, "the wait does not run the clock");
    dev.advance_all();
    waiter.join().unwrap().unwrap();
    assert_eq!(dev.peek(a, 4).unwrap(), src);
}

#[test]
fn an_interleaved_schedule_lets_an_upload_overtake_earlier_compute_work() {
    let overtakes = |dev: &SimDevice, d: &mut SimDriver| {
        let src = pinned(d, 4, |i| i as u8 + 1);
        let (x, y) = (
            d.alloc(Lane::Compute, 4).unwrap(),
            d.alloc(Lane::Compute, 4).unwrap(),
        );
        let a = d.alloc(Lane::Upload, 4).unwrap();
        copy(d, y, x, 4);
        upload(d, a, src);
        assert_eq!(dev.advance(1), 1);
        let overtook = dev.peek(a, 4).unwrap() == src;
        assert_eq!(dev.advance_all(), 1);
        overtook
    };
    let (mut d, dev) = driver();
    assert!(
        !overtakes(&dev, &mut d),
        "in order, the compute copy runs first"
    );
    let seed = (0..64)
        .find(|&seed| {
            let (mut d, dev) = interleaved(seed);
            overtakes(&dev, &mut d)
        })
        .expect("some seed runs the upload first");
    let (mut d, dev) = interleaved(seed);
    assert!(overtakes(&dev, &mut d), "the same seed, the same order");
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

/// Uploads into a block and downloads it on the other copy lane, ordered by a wait when
/// `ordered`; returns whether the download ran first, the bytes it read and the violations.
fn upload_then_download(seed: u64, ordered: bool) -> (bool, Vec<u8>, Vec<Violation>, DevicePtr) {
    let (mut d, dev) = interleaved(seed);
    let src = pinned(&mut d, 4, |i| i as u8 + 1);
    let back = pinned(&mut d, 4, |_| 0xEE);
    let a = d.alloc(Lane::Upload, 4).unwrap();
    let e = d.event_create().unwrap();
    upload(&mut d, a, src);
    if ordered {
        d.event_record(Lane::Upload, e).unwrap();
        d.stream_wait(Lane::Download, e).unwrap();
    }
    download(&mut d, back, a);
    let mut download_first = false;
    while dev.queued() > 0 {
        let uploaded = dev.peek(a, 4).unwrap() == src;
        dev.advance(1);
        download_first |= !uploaded && back[0] != 0xEE;
    }
    (download_first, back.to_vec(), dev.violations(), a)
}

#[test]
fn the_race_checker_flags_an_unordered_write_and_read() {
    let seed = (0..64)
        .find(|&seed| upload_then_download(seed, false).0)
        .expect("some seed runs the download first");
    let (_, back, violations, a) = upload_then_download(seed, false);
    assert_eq!(
        back, [0xA5; 4],
        "the download read the block before the upload wrote it"
    );
    assert_eq!(
        violations,
        [Violation::Race {
            job: 0,
            kind: "host-to-device copy",
            driver: 0,
            lane: "Upload",
            block: a,
            later: 1,
            later_wrote: false,
        }]
    );
    assert_eq!(
        violations[0].to_string(),
        format!(
            "job #0 (host-to-device copy on the Upload lane of driver 0) used device block \
             {a:#x} after later job #1 read it: the two are not ordered"
        )
    );
    // Ordered by a wait, no schedule lets the download run first.
    for seed in 0..64 {
        let (download_first, back, violations, _) = upload_then_download(seed, true);
        assert!(!download_first, "seed {seed}");
        assert_eq!(back, [1, 2, 3, 4], "seed {seed}");
        assert!(violations.is_empty(), "seed {seed}: {violations:?}");
    }
}

#[test]
fn the_race_checker_sees_launches_and_frees() {
    use crate::driver::launch::{Launch, ModuleSource};
    let (mut d, dev) = driver();
    // Only an interleaved schedule runs a lane apart from program order.
    dev.set_schedule(Schedule::Interleaved { seed: 1 });
    let module = d
        .module_compile(&ModuleSource {
            name: "copy",
            cuda: "",
            emulation: Some(Arc::new(CopyKernel)),
        })
        .unwrap();
    let function = d.module_function(module, "copy").unwrap();
    let back = pinned(&mut d, 4, |_| 0xEE);
    let (a, b) = (
        d.alloc(Lane::Compute, 4).unwrap(),
        d.alloc(Lane::Compute, 4).unwrap(),
    );
    // SAFETY: `a` and `b` are live allocations of 4 bytes until the free runs, and the test
    // runs every job before reading.
    unsafe {
        d.launch(function, 1, 1, &[b, a, 4]).unwrap(); // seq 0: writes `b`
        d.copy_dtoh(back.as_mut_ptr(), b, 4).unwrap(); // seq 1: reads `b`, unordered
        d.free(Lane::Compute, b).unwrap(); // seq 2: frees `b`, unordered with the download
    }
    // The download's lane alone: it runs before the launch and the free.
    d.waits().lane_synchronize(Lane::Download).unwrap();
    assert!(dev.violations().is_empty(), "nothing ran out of order yet");
    d.waits().stream_synchronize().unwrap();
    assert_eq!(
        dev.violations(),
        [Violation::Race {
            job: 0,
            kind: "kernel launch",
            driver: 0,
            lane: "Compute",
            block: b,
            later: 1,
            later_wrote: false,
        }]
    );
    // A free that overtakes a download of its block: the download reads freed memory.
    let c = d.alloc(Lane::Compute, 4).unwrap();
    // SAFETY: `c` is live until the free runs; the test checks that the download, queued
    // before the free but not ordered before it, is reported.
    unsafe {
        d.copy_dtoh(back.as_mut_ptr(), c, 4).unwrap(); // seq 3
        d.free(Lane::Compute, c).unwrap(); // seq 4
    }
    d.waits().lane_synchronize(Lane::Compute).unwrap();
    assert_eq!(dev.device_live(), (1, 4), "the free ran");
    d.waits().stream_synchronize().unwrap();
    assert_eq!(
        dev.violations()[1..],
        [
            Violation::Race {
                job: 3,
                kind: "device-to-host copy",
                driver: 0,
                lane: "Download",
                block: c,
                later: 4,
                later_wrote: true,
            },
            Violation::UnmappedDownload { src: c, bytes: 4 },
        ]
    );
    // SAFETY: loaded above, unloaded once; the launch has run.
    unsafe { d.module_unload(module).unwrap() };
}

#[test]
fn two_drivers_on_one_device_have_separate_streams() {
    let (mut d, dev) = driver();
    // Only an interleaved schedule runs a lane apart from program order.
    dev.set_schedule(Schedule::Interleaved { seed: 1 });
    let mut other = SimDriver::new(dev.clone());
    let src = pinned(&mut d, 4, |i| i as u8 + 1);
    let (a, b) = (
        d.alloc(Lane::Upload, 4).unwrap(),
        other.alloc(Lane::Upload, 4).unwrap(),
    );
    assert_ne!(d.stream_handle(), other.stream_handle());
    upload(&mut d, a, src); // seq 0, the first driver's upload lane
    upload(&mut other, b, src); // seq 1, the other's
    assert!(!d.waits().stream_query().unwrap());
    assert!(!other.waits().stream_query().unwrap());
    other.waits().lane_synchronize(Lane::Upload).unwrap();
    assert_eq!(dev.peek(b, 4).unwrap(), src);
    assert_eq!(
        dev.peek(a, 4).unwrap(),
        [0xA5; 4],
        "not the first driver's upload"
    );
    assert!(other.waits().stream_query().unwrap());
    assert!(!d.waits().stream_query().unwrap());
    other.waits().stream_synchronize().unwrap();
    assert_eq!(
        dev.queued(),
        1,
        "the other driver's streams were already idle"
    );
    d.waits().stream_synchronize().unwrap();
    assert_eq!(dev.peek(a, 4).unwrap(), src);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}
