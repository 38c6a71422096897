//! `.await` on pending transfers, on the simulated device: woken by the device's clock, on any
//! executor, cancel-safe, and with every failure typed and nothing freed early.

use crate::support::Fault;
use crate::support::distinct_salted as distinct;
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, Error, Pending, PinnedHostBuffer, download_pending,
    error::DriverError,
    pending::{PendingFuture, Upload},
    upload_pending, upload_tensor,
};
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

// Written once in `tests/bodies/awaiting.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::awaiting::tests!(sim);

fn engine() -> (CudaEngine, SimDevice) {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    // Every buffer released goes back to the device at once, so `is_pinned_live` tells
    // released from held.
    engine.set_pinned_pool_budget(0).unwrap();
    let sim = engine.sim().unwrap();
    (engine, sim)
}

/// A pending upload of `data`, with the address of its pinned buffer and of its tensor.
fn upload(engine: &mut CudaEngine, data: &[u32]) -> (Pending<Upload<u32>>, *const u8, u64) {
    let buffer = PinnedHostBuffer::from_slice(engine, data).unwrap();
    let host = buffer.as_slice().as_ptr().cast::<u8>();
    let tensor = engine.alloc_tensor::<u32>(&[data.len()]).unwrap();
    let device = tensor.sim_address();
    (
        upload_pending(engine, buffer, tensor).unwrap(),
        host,
        device,
    )
}

fn bytes(data: &[u32]) -> Vec<u8> {
    data.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// Holds the device clock until dropped. Made after the engine, it is dropped first, also when
/// an assertion fails: the engine's teardown waits for the stream, which a held clock would
/// block forever.
struct HeldClock(SimDevice);

impl HeldClock {
    fn new(sim: &SimDevice, held: bool) -> Self {
        sim.hold_clock(held);
        HeldClock(sim.clone())
    }
}

impl Drop for HeldClock {
    fn drop(&mut self) {
        self.0.hold_clock(false);
    }
}

/// A waker that counts its wakes.
#[derive(Default)]
struct Counter(AtomicUsize);

impl std::task::Wake for Counter {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Polls futures by hand with a waker that counts.
struct Probe {
    counter: Arc<Counter>,
    waker: Waker,
}

impl Probe {
    fn new() -> Self {
        let counter = Arc::new(Counter::default());
        let waker = Waker::from(Arc::clone(&counter));
        Probe { counter, waker }
    }

    fn wakes(&self) -> usize {
        self.counter.0.load(Ordering::SeqCst)
    }

    fn poll<F: Future + Unpin>(&self, future: &mut F) -> Poll<F::Output> {
        Pin::new(future).poll(&mut Context::from_waker(&self.waker))
    }
}

/// Waits (test side, with a deadline) until `done` holds.
fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

// Simulator-only: holds the device clock and counts the wake registrations.
#[test]
fn awaited_transfers_are_woken_in_device_clock_order_once_each() {
    let (mut engine, sim) = engine();
    let held_clock = HeldClock::new(&sim, true);
    let data: Vec<Vec<u32>> = (0..3).map(|k| distinct(64 + 16 * k, k as u32)).collect();
    let transfers: Vec<_> = data.iter().map(|d| upload(&mut engine, d)).collect();
    assert_eq!(sim.queued(), 6, "a copy and an event record per transfer");
    let mut futures: Vec<(PendingFuture<Upload<u32>>, u64)> = transfers
        .into_iter()
        .map(|(pending, _, device)| (pending.into_future(), device))
        .collect();
    let probes: Vec<Probe> = (0..3).map(|_| Probe::new()).collect();
    // Polled last first: the wakes still come in the device's order.
    for k in (0..3).rev() {
        assert!(probes[k].poll(&mut futures[k].0).is_pending());
    }
    assert_eq!(sim.calls(SimOp::NotifyAfter), 3, "one registration each");
    let mut results = Vec::new();
    for k in 0..3 {
        sim.advance(1); // transfer k's copy
        assert_eq!(
            probes.iter().map(Probe::wakes).collect::<Vec<_>>(),
            (0..3).map(|j| usize::from(j < k)).collect::<Vec<_>>(),
            "no wake before the event's record ran (transfer {k})"
        );
        sim.advance(1); // its event record
        assert_eq!(probes[k].wakes(), 1, "woken by its record (transfer {k})");
        for later in &probes[k + 1..] {
            assert_eq!(later.wakes(), 0, "a later transfer is not woken yet");
        }
        match probes[k].poll(&mut futures[k].0) {
            Poll::Ready(returned) => results.push(returned.unwrap()),
            Poll::Pending => panic!("transfer {k} was woken but is not done"),
        }
    }
    sim.advance_all();
    for (k, returned) in results.iter().enumerate() {
        assert_eq!(probes[k].wakes(), 1, "exactly one wake (transfer {k})");
        assert_eq!(returned.buffer().as_slice(), &data[k][..]);
        let device = futures[k].1;
        assert_eq!(
            sim.peek(device, data[k].len() * 4).unwrap(),
            bytes(&data[k])
        );
    }
    assert_eq!(
        sim.calls(SimOp::NotifyAfter),
        3,
        "no registration after the first"
    );
    drop(held_clock);
    drop(results);
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

// Simulator-only: holds the device clock and counts the wake registrations.
#[test]
fn a_later_poll_moves_the_wake_to_the_new_waker() {
    let (mut engine, sim) = engine();
    let held_clock = HeldClock::new(&sim, true);
    let data = distinct(32, 7);
    let (pending, _, _) = upload(&mut engine, &data);
    let mut future = pending.into_future();
    let (first, second) = (Probe::new(), Probe::new());
    assert!(first.poll(&mut future).is_pending());
    assert!(second.poll(&mut future).is_pending());
    assert!(
        second.poll(&mut future).is_pending(),
        "the same waker again"
    );
    assert_eq!(sim.calls(SimOp::NotifyAfter), 1, "registered once");
    sim.advance_all();
    assert_eq!((first.wakes(), second.wakes()), (0, 1));
    let Poll::Ready(returned) = second.poll(&mut future) else {
        panic!("woken and done");
    };
    assert_eq!(returned.unwrap().buffer().as_slice(), &data[..]);
    drop(held_clock);
}

// Simulator-only: runs the clock before the poll and counts registrations.
#[test]
fn a_copy_done_before_the_first_poll_resolves_without_a_registration() {
    let (mut engine, sim) = engine();
    let data = distinct(16, 1);
    let (pending, _, _) = upload(&mut engine, &data);
    sim.advance_all();
    let probe = Probe::new();
    let Poll::Ready(returned) = probe.poll(&mut pending.into_future()) else {
        panic!("the copy is done");
    };
    assert_eq!(returned.unwrap().buffer().as_slice(), &data[..]);
    assert_eq!(sim.calls(SimOp::NotifyAfter), 0);
    assert_eq!(probe.wakes(), 0);
}

// Simulator-only: the clock is advanced from a test thread; counts host waits.
#[test]
fn a_minimal_executor_is_woken_from_the_thread_that_runs_the_device() {
    let (mut engine, sim) = engine();
    let data = distinct(4096, 3);
    let value = upload_tensor(&mut engine, &data, &[4096]).unwrap();
    let buffer = PinnedHostBuffer::<u32>::new(&mut engine, 4096).unwrap();
    let held_clock = HeldClock::new(&sim, true);
    let waits = sim.calls(SimOp::EventSynchronize);
    let pending = download_pending(&mut engine, value, buffer).unwrap();
    let device = sim.clone();
    let clock = std::thread::spawn(move || {
        eventually("the registration", || device.calls(SimOp::NotifyAfter) == 1);
        device.advance_all();
    });
    let returned = futures_lite::future::block_on(pending.into_future()).unwrap();
    clock.join().unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..]);
    assert_eq!(sim.calls(SimOp::EventSynchronize), waits, "no host wait");
    drop(held_clock);
}

// Simulator-only: counts the driver calls (allocations, registrations, host waits).
#[test]
fn tokio_current_thread_awaits_transfers_in_sequence_and_resubmits_without_allocating() {
    let (mut engine, sim) = engine();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let data = distinct(256, 9);
        let (pending, _, device) = upload(&mut engine, &data);
        let mut returned = pending.await.unwrap();
        assert_eq!(sim.peek(device, 1024).unwrap(), bytes(&data));
        let (allocs, host, events) = (
            sim.calls(SimOp::Alloc),
            sim.calls(SimOp::HostAlloc),
            sim.calls(SimOp::EventCreate),
        );
        for round in 1..=4u32 {
            let next = distinct(256, 100 + round);
            returned.buffer_mut().as_mut_slice().copy_from_slice(&next);
            returned = returned.resubmit(&mut engine).unwrap().await.unwrap();
            assert_eq!(
                sim.peek(device, 1024).unwrap(),
                bytes(&next),
                "round {round}"
            );
        }
        assert_eq!(sim.calls(SimOp::Alloc), allocs);
        assert_eq!(sim.calls(SimOp::HostAlloc), host);
        assert_eq!(sim.calls(SimOp::EventCreate), events);
        // Each await found its copy queued, registered a wake, and was woken by the device.
        assert_eq!(sim.calls(SimOp::NotifyAfter), 5);
        assert_eq!(sim.calls(SimOp::EventSynchronize), 0, "no host wait");
    });
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty());
}

// Simulator-only: the clock is advanced from a test thread.
#[test]
fn tokio_current_thread_is_woken_by_a_device_clock_on_another_thread() {
    let (mut engine, sim) = engine();
    let held_clock = HeldClock::new(&sim, true);
    let data: Vec<Vec<u32>> = (0..3).map(|k| distinct(128, 20 + k)).collect();
    let pendings: Vec<_> = data.iter().map(|d| upload(&mut engine, d).0).collect();
    let device = sim.clone();
    let clock = std::thread::spawn(move || {
        eventually("the registration", || device.calls(SimOp::NotifyAfter) >= 1);
        while device.advance(1) == 1 {
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let returned = rt.block_on(async {
        let mut returned = Vec::new();
        for pending in pendings {
            returned.push(pending.await.unwrap());
        }
        returned
    });
    clock.join().unwrap();
    for (r, d) in returned.iter().zip(&data) {
        assert_eq!(r.buffer().as_slice(), &d[..]);
    }
    assert_eq!(sim.calls(SimOp::EventSynchronize), 0, "no host wait");
    drop(held_clock);
}

// Simulator-only: holds the device clock to order the completions.
#[test]
fn tokio_multi_thread_tasks_complete_in_device_clock_order() {
    let (mut engine, sim) = engine();
    let held_clock = HeldClock::new(&sim, true);
    let data: Vec<Vec<u32>> = (0..4).map(|k| distinct(512, 40 + k)).collect();
    let pendings: Vec<_> = data.iter().map(|d| upload(&mut engine, d).0).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let finished = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = pendings
        .into_iter()
        .enumerate()
        .rev()
        .map(|(k, pending)| {
            let finished = Arc::clone(&finished);
            rt.spawn(async move {
                let returned = pending.await.unwrap();
                finished.lock().unwrap().push(k);
                returned
            })
        })
        .collect();
    eventually("every registration", || sim.calls(SimOp::NotifyAfter) == 4);
    for k in 0..4 {
        sim.advance(2); // transfer k's copy and event record
        eventually("the woken task", || finished.lock().unwrap().len() == k + 1);
    }
    assert_eq!(*finished.lock().unwrap(), [0, 1, 2, 3]);
    let returned: Vec<_> = rt.block_on(async {
        let mut out = Vec::new();
        for task in tasks {
            out.push(task.await.unwrap());
        }
        out
    });
    for (r, k) in returned.iter().zip((0..4).rev()) {
        assert_eq!(r.buffer().as_slice(), &data[k][..]);
    }
    assert_eq!(sim.calls(SimOp::EventSynchronize), 0, "no host wait");
    drop(held_clock);
    drop(returned);
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty());
}

/// Where a future is dropped before it resolves.
#[derive(Clone, Copy, Debug)]
enum DropAt {
    BeforeFirstPoll,
    AfterRegistering,
    AfterTheWakeBeforeRepolling,
}

// Simulator-only: holds the device clock and reads which buffers are live.
#[test]
fn a_dropped_future_detaches_its_transfer_until_the_device_proves_it_complete() {
    for at in [
        DropAt::BeforeFirstPoll,
        DropAt::AfterRegistering,
        DropAt::AfterTheWakeBeforeRepolling,
    ] {
        let (mut engine, sim) = engine();
        let held_clock = HeldClock::new(&sim, true);
        let data = distinct(256, 60);
        let (pending, host, device) = upload(&mut engine, &data);
        let mut future = pending.into_future();
        let probe = Probe::new();
        match at {
            DropAt::BeforeFirstPoll => {}
            DropAt::AfterRegistering => assert!(probe.poll(&mut future).is_pending()),
            DropAt::AfterTheWakeBeforeRepolling => {
                assert!(probe.poll(&mut future).is_pending());
                sim.advance_all();
                assert_eq!(probe.wakes(), 1, "{at:?}");
            }
        }
        drop(future);
        assert_eq!(engine.retirement_stats().pending, 1, "{at:?}: detached");
        assert!(sim.is_pinned_live(host), "{at:?}: not released by the drop");
        assert_eq!(sim.device_live().0, 1, "{at:?}: the tensor is held too");
        engine.flush().unwrap();
        if !matches!(at, DropAt::AfterTheWakeBeforeRepolling) {
            assert!(
                sim.is_pinned_live(host),
                "{at:?}: not released before the copy ran"
            );
            sim.advance_all();
        }
        assert_eq!(sim.peek(device, 1024).unwrap(), bytes(&data), "{at:?}");
        drop(held_clock);
        engine.synchronize().unwrap();
        assert!(
            !sim.is_pinned_live(host),
            "{at:?}: released after completion"
        );
        let stats = engine.retirement_stats();
        assert_eq!(
            (stats.pending, stats.released, stats.retained),
            (0, 1, 0),
            "{at:?}"
        );
        sim.advance_all(); // the tensor's stream-ordered free
        assert_eq!(sim.device_live(), (0, 0), "{at:?}");
        let wakes = match at {
            DropAt::AfterTheWakeBeforeRepolling => 1,
            _ => 0,
        };
        assert_eq!(
            probe.wakes(),
            wakes,
            "{at:?}: a dropped future's wake reaches nobody"
        );
        assert!(
            sim.violations().is_empty(),
            "{at:?}: {:?}",
            sim.violations()
        );
    }
}

// Simulator-only: holds the device clock and reads which buffers are live.
#[test]
fn a_forgotten_future_never_releases() {
    let (mut engine, sim) = engine();
    let held_clock = HeldClock::new(&sim, true);
    let (pending, host, _) = upload(&mut engine, &distinct(64, 61));
    let mut future = pending.into_future();
    assert!(Probe::new().poll(&mut future).is_pending());
    std::mem::forget(future);
    drop(held_clock);
    engine.synchronize().unwrap();
    drop(engine);
    assert!(sim.is_pinned_live(host), "leaked in place, never freed");
    assert!(sim.violations().is_empty());
}

// Simulator-only: holds the device clock so the timer wins.
#[tokio::test(flavor = "current_thread")]
async fn a_timer_that_wins_a_select_leaves_the_transfer_to_the_engine() {
    let (mut engine, sim) = engine();
    let held_clock = HeldClock::new(&sim, true);
    let data = distinct(1024, 70);
    let (pending, host, device) = upload(&mut engine, &data);
    tokio::select! {
        returned = pending => panic!("the clock is held, the copy cannot be done: {returned:?}"),
        () = tokio::time::sleep(Duration::from_millis(20)) => {}
    }
    assert_eq!(
        sim.calls(SimOp::NotifyAfter),
        1,
        "the future was polled and registered"
    );
    assert_eq!(engine.retirement_stats().pending, 1);
    assert!(sim.is_pinned_live(host));
    sim.advance_all();
    assert_eq!(sim.peek(device, 4096).unwrap(), bytes(&data));
    drop(held_clock);
    engine.synchronize().unwrap();
    assert!(!sim.is_pinned_live(host));
    assert_eq!(engine.retirement_stats().released, 1);
    sim.advance_all(); // the tensor's stream-ordered free
    assert_eq!(sim.device_live(), (0, 0));
    assert!(sim.violations().is_empty());

    // The engine goes on: the next transfer wins its race.
    let next = distinct(16, 71);
    let (pending, _, _) = upload(&mut engine, &next);
    tokio::select! {
        returned = pending => assert_eq!(returned.unwrap().buffer().as_slice(), &next[..]),
        () = tokio::time::sleep(Duration::from_secs(20)) => panic!("the copy runs at once"),
    }
}

// Simulator-only: injects a failed event.
#[test]
fn a_failed_event_resolves_to_the_device_fault_and_retains_everything() {
    for held in [true, false] {
        let (mut engine, sim) = engine();
        let data = distinct(64, 80);
        let value = upload_tensor(&mut engine, &data, &[64]).unwrap();
        let buffer = PinnedHostBuffer::<u32>::new(&mut engine, 64).unwrap();
        let host = buffer.as_slice().as_ptr().cast::<u8>();
        let held_clock = HeldClock::new(&sim, held);
        sim.fail_event(1, DriverError::LAUNCH_FAILED);
        let mut future = download_pending(&mut engine, value, buffer)
            .unwrap()
            .into_future();
        let probe = Probe::new();
        let answer = match probe.poll(&mut future) {
            Poll::Ready(answer) => {
                assert!(!held, "with the clock held the fault is not reached yet");
                assert_eq!(probe.wakes(), 1, "woken at once by the failed record");
                answer
            }
            Poll::Pending => {
                assert!(held, "with a free clock the registration runs the stream");
                sim.advance_all();
                assert_eq!(probe.wakes(), 1, "a failed event wakes too");
                let Poll::Ready(answer) = probe.poll(&mut future) else {
                    panic!("woken by the failure, so resolved");
                };
                answer
            }
        };
        match answer {
            Err(Error::DeviceFault {
                what: "pending download",
                source: DriverError::LAUNCH_FAILED,
            }) => {}
            other => panic!("expected the device fault, got {other:?}"),
        }
        drop(held_clock);
        engine.synchronize().unwrap();
        let stats = engine.retirement_stats();
        assert_eq!(stats.retained, 1);
        assert_eq!(stats.first_failure.unwrap().1, DriverError::LAUNCH_FAILED);
        drop(future);
        drop(engine);
        assert!(
            sim.is_pinned_live(host),
            "retained for good, even at teardown"
        );
        assert_eq!(sim.device_live().0, 1, "the device value is retained too");
        assert!(sim.violations().is_empty());
    }
}

// Simulator-only: injects a refused wake registration.
#[test]
fn a_refused_registration_falls_back_to_a_wait_on_the_polling_thread() {
    for held in [true, false] {
        let (mut engine, sim) = engine();
        let held_clock = HeldClock::new(&sim, held);
        let data = distinct(300, 90);
        let (pending, _, device) = upload(&mut engine, &data);
        sim.fail_nth(SimOp::NotifyAfter, 1, DriverError::INVALID_VALUE);
        let clock = held.then(|| {
            let device = sim.clone();
            std::thread::spawn(move || {
                // The fallback is a host wait, which blocks until the clock reaches the event.
                eventually("the fallback wait", || {
                    device.calls(SimOp::EventSynchronize) == 1
                });
                device.advance_all();
            })
        });
        let probe = Probe::new();
        let Poll::Ready(returned) = probe.poll(&mut pending.into_future()) else {
            panic!("with no wake registered the first poll resolves by waiting");
        };
        if let Some(clock) = clock {
            clock.join().unwrap();
        }
        assert_eq!(returned.unwrap().buffer().as_slice(), &data[..]);
        assert_eq!(sim.peek(device, 1200).unwrap(), bytes(&data));
        assert_eq!(probe.wakes(), 0, "the refused wake is never called");
        assert_eq!(sim.calls(SimOp::NotifyAfter), 1);
        assert_eq!(sim.calls(SimOp::EventSynchronize), 1);
        drop(held_clock);
        engine.synchronize().unwrap();
        assert_eq!(engine.retirement_stats().retained, 0);
        assert!(sim.violations().is_empty());
    }
}

// Simulator-only: injects a failed event query.
#[test]
fn a_failed_event_query_resolves_to_a_fault_at_the_first_or_a_later_poll() {
    for first in [true, false] {
        let (mut engine, sim) = engine();
        let held_clock = HeldClock::new(&sim, true);
        let (pending, host, _) = upload(&mut engine, &distinct(64, 100));
        let mut future = pending.into_future();
        let probe = Probe::new();
        if !first {
            assert!(probe.poll(&mut future).is_pending());
            sim.advance_all();
            assert_eq!(probe.wakes(), 1);
        }
        sim.fail_nth(SimOp::EventQuery, 1, DriverError::LAUNCH_FAILED);
        match probe.poll(&mut future) {
            Poll::Ready(Err(Error::DeviceFault {
                what: "pending upload",
                source: DriverError::LAUNCH_FAILED,
            })) => {}
            other => panic!("expected the query's failure (first poll: {first}), got {other:?}"),
        }
        assert_eq!(
            sim.calls(SimOp::NotifyAfter),
            u64::from(!first),
            "a failed first query registers nothing"
        );
        drop(held_clock);
        engine.synchronize().unwrap();
        assert_eq!(
            engine.retirement_stats().retained,
            1,
            "as `try_wait`: retained"
        );
        drop(future);
        drop(engine);
        assert!(sim.is_pinned_live(host));
        assert!(sim.violations().is_empty());
    }
}

// Simulator-only: injects a fault at every step.
/// Every fault of the shared fault table that can strike an awaited transfer after its
/// submission: each resolves to a typed error or to correct data, and what is retained is what
/// the engine says it retained.
#[test]
fn faults_at_every_step_of_an_await_are_typed_and_lose_nothing() {
    let faults = [
        Fault::Event(1),
        Fault::Call(SimOp::NotifyAfter, 1, DriverError::INVALID_VALUE),
        Fault::Call(SimOp::EventQuery, 1, DriverError::LAUNCH_FAILED),
        Fault::Call(SimOp::EventQuery, 2, DriverError::LAUNCH_FAILED),
        Fault::Call(SimOp::EventSynchronize, 1, DriverError::LAUNCH_FAILED),
    ];
    for fault in faults {
        let (mut engine, sim) = engine();
        let data = distinct(128, 110);
        let buffer = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
        let host = buffer.as_slice().as_ptr().cast::<u8>();
        let tensor = engine.alloc_tensor::<u32>(&[128]).unwrap();
        fault.arm(&sim);
        let pending = upload_pending(&mut engine, buffer, tensor).unwrap();
        let answer = futures_lite::future::block_on(pending.into_future());
        let failed = match answer {
            Ok(returned) => {
                assert_eq!(returned.buffer().as_slice(), &data[..], "{fault:?}");
                false
            }
            Err(Error::DeviceFault { source, .. }) => {
                assert_eq!(source, fault.reported(), "{fault:?}");
                true
            }
            Err(other) => panic!("{fault:?}: an untyped failure {other}"),
        };
        // A refused registration or a failed wait that is never reached lets the await succeed.
        let expected_failure = match fault {
            Fault::Event(_) => true,
            Fault::Call(SimOp::EventQuery, n, _) => n <= 2,
            _ => false,
        };
        assert_eq!(failed, expected_failure, "{fault:?}");
        let _ = engine.synchronize();
        assert_eq!(
            engine.retirement_stats().retained,
            usize::from(failed),
            "{fault:?}"
        );
        drop(engine);
        assert_eq!(sim.is_pinned_live(host), failed, "{fault:?}");
        assert!(sim.violations().is_empty(), "{fault:?}");
    }
}

// Simulator-only: injects a failed teardown wait and counts registrations.
/// After the engine is dropped nothing registers a wake: its teardown waited for the stream, so
/// the first query answers; and should that wait have failed, the await waits for the event
/// itself.
#[test]
fn an_await_after_the_engine_was_dropped_resolves_without_a_registration() {
    for teardown_waited in [true, false] {
        let (mut engine, sim) = engine();
        let data = distinct(48, 120);
        let (pending, host, device) = upload(&mut engine, &data);
        if !teardown_waited {
            sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::LAUNCH_FAILED);
        }
        drop(engine);
        assert_eq!(sim.queued() == 0, teardown_waited);
        let returned = futures_lite::future::block_on(pending.into_future()).unwrap();
        assert_eq!(returned.buffer().as_slice(), &data[..]);
        assert_eq!(sim.peek(device, 192).unwrap(), bytes(&data));
        assert_eq!(
            sim.calls(SimOp::NotifyAfter),
            0,
            "teardown waited: {teardown_waited}"
        );
        assert_eq!(
            sim.calls(SimOp::EventSynchronize),
            u64::from(!teardown_waited),
            "the fallback waits only when the first query says not yet"
        );
        drop(returned);
        assert!(!sim.is_pinned_live(host));
        sim.advance_all();
        assert_eq!(sim.device_live(), (0, 0));
        assert!(sim.violations().is_empty());
    }
}

/// What a waker does with the engine when woken: polls another transfer's future inline (an
/// executor that polls from its wake), and drops a tensor it was given.
struct Meddler {
    future: Mutex<Option<PendingFuture<Upload<u32>>>>,
    tensor: Mutex<Option<cuferry::DeviceTensor<u32>>>,
    polled: Mutex<Option<String>>,
}

impl std::task::Wake for Meddler {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(mut future) = self.future.lock().unwrap().take() {
            let waker = Waker::from(Arc::new(Counter::default()));
            let polled = Pin::new(&mut future).poll(&mut Context::from_waker(&waker));
            *self.polled.lock().unwrap() = Some(match polled {
                Poll::Pending => "pending".to_owned(),
                Poll::Ready(Ok(_)) => "ready".to_owned(),
                Poll::Ready(Err(e)) => format!("{e}"),
            });
        }
        drop(self.tensor.lock().unwrap().take());
    }
}

// Simulator-only: the free clock runs the wake inside the registering call, so the wake surely runs.
/// A wake runs with no engine lock held, marked as the device's callback on both drivers: a waker
/// that calls into the engine gets a typed refusal (no deadlock), and a value it drops is
/// reported at the next boundary, never lost silently.
#[test]
fn a_waker_that_calls_the_engine_is_refused_and_what_it_drops_is_reported() {
    let (done, result) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut engine, sim) = engine();
        let (first, ..) = upload(&mut engine, &distinct(64, 1));
        let (second, ..) = upload(&mut engine, &distinct(64, 2));
        let tensor = engine.alloc_tensor::<u32>(&[16]).unwrap();
        let meddler = Arc::new(Meddler {
            future: Mutex::new(Some(second.into_future())),
            tensor: Mutex::new(Some(tensor)),
            polled: Mutex::new(None),
        });
        let waker = Waker::from(Arc::clone(&meddler));
        let mut future = first.into_future();
        // The clock is free: registering the wake runs the stream up to the copy's event, inside
        // the engine call that registers it, and the wake comes due there (the poll then finds
        // the copy done).
        let first_poll = Pin::new(&mut future).poll(&mut Context::from_waker(&waker));
        let polled = meddler.polled.lock().unwrap().take();
        let flushed = engine.flush();
        let resolved = match first_poll {
            Poll::Ready(answer) => answer.is_ok(),
            Poll::Pending => matches!(Probe::new().poll(&mut future), Poll::Ready(Ok(_))),
        };
        let _ = done.send((polled, flushed.map_err(|e| e.to_string()), resolved));
        drop(future);
        drop(engine);
        let _ = done.send((None, Ok(()), sim.violations().is_empty()));
    });
    let (polled, flushed, resolved) = result
        .recv_timeout(Duration::from_secs(20))
        .expect("a waker that calls the engine deadlocked");
    let polled = polled.expect("the wake ran");
    assert!(
        polled.contains("inside a wake"),
        "the inline poll was refused with a typed error, got {polled}"
    );
    let reported = flushed.expect_err("the tensor dropped in the wake is reported");
    assert!(reported.contains("inside a wake"), "{reported}");
    assert!(
        resolved,
        "the awaited transfer itself resolves (or had resolved)"
    );
    let (_, _, clean) = result.recv_timeout(Duration::from_secs(20)).unwrap();
    assert!(clean, "no violations");
}
