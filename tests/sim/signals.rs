//! Signals between engines on the simulated device: work queued on one engine after
//! `wait_signal` runs after the signalled work of another, whatever order the device's streams
//! run in; a refused wait falls back to a host wait and is reported; signals between separate
//! simulated devices are refused; a signal of failed work reports the failure.

use cuferry::error::SetupError;
use cuferry::sim::{Schedule, SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, Error, Pending, PinnedHostBuffer, engine::Signal, error::DriverError,
    pending::Upload, upload_pending,
};

// Written once in `tests/bodies/signal.rs`, run here on the simulated device and by the GPU suite
// on device 0.
crate::bodies::signal::tests!(sim);

fn data(n: usize, salt: f32) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 0.5 + salt).collect()
}

/// A pending upload of `n` elements on `engine`.
fn upload(engine: &mut CudaEngine, n: usize, salt: f32) -> Pending<Upload<f32>> {
    let buffer = PinnedHostBuffer::from_slice(engine, &data(n, salt)).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[n]).unwrap();
    upload_pending(engine, buffer, tensor).unwrap()
}

/// On one simulated device with the clock held and the streams interleaved by `seed`: engine A
/// queues an upload and a kernel on it, B queues an upload, optionally after waiting for A's
/// signal. Steps the clock one job at a time and returns whether B's upload was ever seen
/// complete while A's work was not.
fn b_finished_first(seed: u64, wait: bool) -> bool {
    let sim = SimDevice::new(SimConfig::default());
    sim.set_schedule(Schedule::Interleaved { seed });
    let mut a = CudaEngine::simulated_on(&sim);
    let mut b = CudaEngine::simulated_on(&sim);
    sim.hold_clock(true);
    let mut first = upload(&mut a, 64, 1.0);
    let scaled = a.scale(first.tensor(), 2.0).unwrap();
    let signal = a.signal().unwrap();
    if wait {
        b.wait_signal(&signal).unwrap();
    }
    let mut second = upload(&mut b, 64, 2.0);
    let early = ran_early(&sim, &mut first, &mut second, &signal);
    sim.hold_clock(false);
    drop((
        first.wait().unwrap(),
        second.wait().unwrap(),
        scaled,
        signal,
    ));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    early
}

/// Steps the held clock until both uploads and the signal are done; whether `second` (the
/// waiting engine's) ever completed before `first` and the signal (the signalling engine's).
fn ran_early(
    sim: &SimDevice,
    first: &mut Pending<Upload<f32>>,
    second: &mut Pending<Upload<f32>>,
    signal: &Signal,
) -> bool {
    let mut early = false;
    for _ in 0..200 {
        let b_done = second.is_ready().unwrap();
        let a_done = signal.is_ready().unwrap() && first.is_ready().unwrap();
        early |= b_done && !a_done;
        if b_done && a_done {
            break;
        }
        sim.advance(1);
    }
    early
}
// Simulator-only: steps the held clock through interleaved streams.
#[test]
fn work_after_a_wait_runs_after_the_signalled_work_of_another_engine() {
    for seed in 0..64 {
        assert!(
            !b_finished_first(seed, true),
            "seed {seed}: B ran before A's signalled work"
        );
    }
    // The check can fail: without the wait, some interleaving finishes B first.
    assert!(
        (0..64).any(|seed| b_finished_first(seed, false)),
        "no interleaving finished B first without the wait"
    );
}

// Simulator-only: holds the clock and counts the stream waits queued.
#[test]
fn the_wait_is_on_the_device_not_the_host() {
    let sim = SimDevice::new(SimConfig::default());
    let mut a = CudaEngine::simulated_on(&sim);
    let mut b = CudaEngine::simulated_on(&sim);
    sim.hold_clock(true);
    let pending = upload(&mut a, 16, 1.0);
    let signal = a.signal().unwrap();
    let waits = sim.calls(SimOp::StreamWait);
    b.wait_signal(&signal).unwrap();
    // One wait per stream of B, queued while A's work is still pending: the host went on.
    assert_eq!(sim.calls(SimOp::StreamWait) - waits, 3);
    let ready = signal.is_ready().unwrap();
    sim.hold_clock(false);
    assert!(!ready, "the signalled upload was still queued");
    signal.wait().unwrap();
    drop(pending.wait().unwrap());
    // A signal already complete queues nothing.
    let signal = a.signal().unwrap();
    a.synchronize().unwrap();
    let waits = sim.calls(SimOp::StreamWait);
    b.wait_signal(&signal).unwrap();
    assert_eq!(sim.calls(SimOp::StreamWait), waits);
}

// Simulator-only: injects a refused stream wait.
#[test]
fn a_refused_wait_falls_back_to_the_host_and_is_reported() {
    let sim = SimDevice::new(SimConfig::default());
    let mut a = CudaEngine::simulated_on(&sim);
    let mut b = CudaEngine::simulated_on(&sim);
    sim.hold_clock(true);
    let mut pending = upload(&mut a, 16, 1.0);
    let signal = a.signal().unwrap();
    sim.fail_nth(SimOp::StreamWait, 1, DriverError::INVALID_VALUE);
    // The host wait needs the clock to run.
    sim.hold_clock(false);
    b.wait_signal(&signal).unwrap();
    sim.clear_faults();
    assert!(signal.is_ready().unwrap(), "the host waited for the signal");
    assert!(pending.is_ready().unwrap());
    match b.flush() {
        Err(Error::Deferred { count: 1, first }) => assert!(
            matches!(
                *first,
                Error::Driver {
                    call: "cuStreamWaitEvent",
                    ..
                }
            ),
            "{first:?}"
        ),
        other => panic!("the refusal was not reported: {other:?}"),
    }
    b.flush().unwrap();
    drop(pending.wait().unwrap());
}

// Simulator-only: two separate simulated devices.
#[test]
fn separate_simulated_devices_cannot_wait_for_each_other() {
    let mut a = CudaEngine::simulated(SimConfig::default());
    let mut b = CudaEngine::simulated(SimConfig::default());
    let sim_b = b.sim().unwrap();
    a.sim().unwrap().hold_clock(true);
    let pending = upload(&mut a, 16, 1.0);
    let signal = a.signal().unwrap();
    let refused = b.wait_signal(&signal);
    a.sim().unwrap().hold_clock(false);
    assert!(
        matches!(refused, Err(Error::Setup(SetupError::Unreachable { from, to, .. })) if from == a.device() && to == b.device()),
        "{refused:?}"
    );
    assert_eq!(sim_b.calls(SimOp::StreamWait), 0, "nothing was queued");
    drop(pending.wait().unwrap());
    drop(signal);
}

// Simulator-only: injects a failed event.
#[test]
fn a_signal_of_failed_work_reports_the_failure() {
    let sim = SimDevice::new(SimConfig::default());
    let mut a = CudaEngine::simulated_on(&sim);
    let mut b = CudaEngine::simulated_on(&sim);
    // The signals' own records are the next events recorded on the device.
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    sim.fail_event(2, DriverError::LAUNCH_FAILED);
    sim.hold_clock(true);
    let known = a.signal().unwrap();
    let unknown = a.signal().unwrap();
    // A failure already known is reported by the wait, which queues nothing.
    sim.advance(1);
    let waits = sim.calls(SimOp::StreamWait);
    let refused = b.wait_signal(&known);
    let queued = sim.calls(SimOp::StreamWait) - waits;
    // One the device has not reached yet is not: the wait is queued, and the host proof reports
    // it.
    let later = b.wait_signal(&unknown);
    let queued_later = sim.calls(SimOp::StreamWait) - waits - queued;
    sim.hold_clock(false);
    assert!(
        matches!(refused, Err(Error::DeviceFault { .. })),
        "{refused:?}"
    );
    assert_eq!(queued, 0);
    assert!(later.is_ok(), "{later:?}");
    assert_eq!(queued_later, 3);
    assert!(matches!(known.wait(), Err(Error::DeviceFault { .. })));
    assert!(matches!(unknown.wait(), Err(Error::DeviceFault { .. })));
    sim.clear_faults();
}

/// As [`b_finished_first`], but engine A is dropped after its signal and its teardown wait
/// fails, so nothing has proven A's work complete: B's wait must still order B's upload after
/// it (or be refused with a typed error). Returns whether B's upload was ever seen complete
/// while A's work was not.
fn b_ran_ahead_of_a_failed_teardown(seed: u64) -> bool {
    let sim = SimDevice::new(SimConfig::default());
    sim.set_schedule(Schedule::Interleaved { seed });
    let mut a = CudaEngine::simulated_on(&sim);
    let mut b = CudaEngine::simulated_on(&sim);
    sim.hold_clock(true);
    let mut first = upload(&mut a, 64, 1.0);
    let scaled = a.scale(first.tensor(), 2.0).unwrap();
    let signal = a.signal().unwrap();
    // A's teardown wait is its next stream synchronize.
    sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::LAUNCH_FAILED);
    drop(a);
    assert!(sim.queued() > 0, "seed {seed}: A's work is still queued");
    match b.wait_signal(&signal) {
        Ok(()) => {}
        Err(Error::DeviceFault { .. }) => {
            sim.hold_clock(false);
            drop((first.wait().unwrap(), scaled, signal));
            return false;
        }
        Err(other) => panic!("seed {seed}: not a typed refusal: {other:?}"),
    }
    let mut second = upload(&mut b, 64, 2.0);
    let early = ran_early(&sim, &mut first, &mut second, &signal);
    sim.hold_clock(false);
    let (first, second) = (first.wait().unwrap(), second.wait().unwrap());
    assert_eq!(first.buffer().as_slice(), &data(64, 1.0)[..]);
    assert_eq!(second.buffer().as_slice(), &data(64, 2.0)[..]);
    drop((first, second, scaled, signal));
    b.synchronize().unwrap();
    sim.advance_all();
    assert!(
        sim.violations().is_empty(),
        "seed {seed}: {:?}",
        sim.violations()
    );
    early
}

// Simulator-only: injects a failed teardown wait.
#[test]
fn a_failed_teardown_proves_nothing_to_a_waiting_engine() {
    let early: Vec<u64> = (0..64)
        .filter(|&seed| b_ran_ahead_of_a_failed_teardown(seed))
        .collect();
    assert!(
        early.is_empty(),
        "B ran before the work of A's failed teardown in seeds {early:?}"
    );
}
