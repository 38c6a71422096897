//! The proof of completion under faults, threads, memory pressure, panics and foreign engines, on
//! the simulated device.

use crate::support::{distinct_u32 as distinct, sim_engine as engine};
use cuferry::error::UsageError;
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, Error, PinnedHostBuffer, SubmitError, download_pending, download_tensor,
    download_tensor_into, error::DriverError, libs::GemmConfig, upload_pending, upload_tensor,
};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::time::Duration;

// Written once in `tests/bodies/lifecycle.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::lifecycle::tests!(sim);

/// A staging chunk whose event record fails and whose fallback stream synchronize fails too
/// cannot be proven: the lease comes back `Untracked`, which can only be retired, and the slot's
/// memory is never reachable again (it used to come back `Unproven`, and `end_chunk` then waited
/// on the slot's previous event and handed the memory out while the copy was still queued).
#[test]
fn an_unprovable_chunk_is_retained_and_its_memory_is_never_reused() {
    let (mut engine, sim) = engine();
    let tensor = upload_tensor(&mut engine, &[7u8; 64], &[64]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let slot = lease.as_bytes().as_ptr();
    sim.fail_nth(SimOp::EventRecord, 1, DriverError::UNKNOWN);
    sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::UNKNOWN);
    match lease.begin_download(&mut engine, &tensor, 0, 64) {
        Err(SubmitError::Retained { error }) => {
            assert!(
                matches!(
                    error,
                    Error::Driver {
                        call: "cuEventRecord",
                        ..
                    }
                ),
                "{error}"
            );
        }
        other => panic!("expected a retained chunk, got {other:?}"),
    }
    assert_eq!(sim.queued(), 1, "the copy is still queued");
    let retirement = engine.retirement_stats();
    assert_eq!(retirement.retained, 1);
    assert_eq!(
        retirement.first_failure,
        Some(("staging chunk", DriverError::UNKNOWN))
    );
    // The slot is out of the ring for good: new leases never get it.
    for _ in 0..4 {
        let lease = engine.staging_lease().unwrap();
        assert_ne!(lease.as_bytes().as_ptr(), slot);
        lease.release();
    }
    sim.advance_all();
    engine.synchronize().unwrap();
    drop(engine);
    assert!(sim.is_pinned_live(slot), "retained, never freed");
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// A failed wait on a chunk retains its slot and says so; the lease is not handed back.
#[test]
fn a_chunk_whose_event_fails_is_retained_by_end_chunk() {
    let (mut engine, sim) = engine();
    let mut tensor = engine.alloc_tensor::<u8>(&[16]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let slot = lease.as_bytes().as_ptr();
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    let unproven = lease.begin_upload(&mut engine, &mut tensor, 0, 16).unwrap();
    match unproven.end_chunk() {
        Err(Error::DeviceFault {
            what: "staging chunk",
            source: DriverError::LAUNCH_FAILED,
        }) => {}
        other => panic!("expected the chunk's fault, got {other:?}"),
    }
    assert_eq!(engine.retirement_stats().retained, 1);
    assert_eq!(
        engine.staging_stats().user_leased,
        1,
        "a retained slot stays counted against the lease budget"
    );
    drop(engine);
    assert!(sim.is_pinned_live(slot));
    assert!(sim.violations().is_empty());
}

/// A thread waiting on a transfer holds no engine lock: with the device clock held, the owner
/// keeps allocating, submitting and polling while the other thread waits, and the device clock
/// has not moved when the owner is done (the owner never waited for the device).
#[test]
fn a_thread_waiting_on_a_transfer_never_blocks_the_engine_owner() {
    let (mut engine, sim) = engine();
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &distinct(256)).unwrap();
    let tensor = engine.alloc_tensor::<u32>(&[256]).unwrap();
    sim.hold_clock(true);
    let pending = upload_pending(&mut engine, buffer, tensor).unwrap();
    let (waited_tx, waited_rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let returned = pending.wait().unwrap();
        waited_tx.send(()).unwrap();
        returned
    });
    std::thread::sleep(Duration::from_millis(20)); // let the waiter block in its wait

    let (owner_tx, owner_rx) = mpsc::channel();
    let clock = sim.completed();
    let owner = std::thread::spawn(move || {
        let mut in_flight = Vec::new();
        for i in 0..64usize {
            let data = distinct(16 + i);
            let buffer = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
            let tensor = engine.alloc_tensor::<u32>(&[data.len()]).unwrap();
            let mut p = upload_pending(&mut engine, buffer, tensor).unwrap();
            assert!(!p.is_ready().unwrap(), "the clock is held");
            in_flight.push(p);
        }
        engine.flush().unwrap();
        owner_tx.send(()).unwrap();
        (engine, in_flight)
    });
    let owner_done = owner_rx.recv_timeout(Duration::from_secs(10)).is_ok();
    assert_eq!(sim.completed(), clock, "the device clock did not move");
    assert!(
        waited_rx.try_recv().is_err(),
        "the waiter is still waiting for the device"
    );
    sim.hold_clock(false);
    sim.advance_all();
    assert!(owner_done, "the owner was blocked by another thread's wait");
    let returned = waiter.join().unwrap();
    let (mut engine, in_flight) = owner.join().unwrap();
    let (_buffer, tensor) = returned.into_parts();
    assert_eq!(
        download_tensor(&mut engine, &tensor).unwrap(),
        distinct(256)
    );
    for p in in_flight {
        drop(p.wait().unwrap());
    }
    engine.synchronize().unwrap();
}

/// Dropped in-flight transfers come back when they are done: `flush` releases them without
/// waiting, and an allocation that runs out of device memory releases them and retries.
#[test]
fn device_memory_of_detached_transfers_comes_back_without_a_synchronize() {
    let mut engine = CudaEngine::simulated(SimConfig {
        memory_bytes: 64 << 10,
        ..SimConfig::default()
    });
    let sim = engine.sim().unwrap();
    let data = distinct(4096); // 16 KiB: four fit the device
    for round in 0..16 {
        let buffer = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
        let tensor = engine
            .alloc_tensor::<u32>(&[data.len()])
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        drop(upload_pending(&mut engine, buffer, tensor).unwrap()); // detached
        sim.advance_all(); // the device finishes; nobody synchronizes
    }
    assert_eq!(sim.calls(SimOp::StreamSynchronize), 0);
    // flush releases what is proven, without waiting.
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let tensor = engine.alloc_tensor::<u32>(&[data.len()]).unwrap();
    drop(upload_pending(&mut engine, buffer, tensor).unwrap());
    sim.advance_all();
    engine.flush().unwrap();
    assert_eq!(engine.retirement_stats().pending, 0);
    assert_eq!(sim.calls(SimOp::EventSynchronize), 0);
    assert!(sim.violations().is_empty());
}

/// Two engines whose values must not cross: on one simulated device, and on two.
fn pairs() -> Vec<(CudaEngine, CudaEngine)> {
    let a = CudaEngine::simulated(SimConfig::default());
    let b = CudaEngine::simulated_on(&a.sim().unwrap());
    let c = CudaEngine::simulated(SimConfig::default());
    let d = CudaEngine::simulated(SimConfig {
        ordinal: 1,
        ..SimConfig::default()
    });
    vec![(a, b), (c, d)]
}

/// What an engine and its device hold, to show that a refused call changed nothing.
#[derive(Debug, PartialEq)]
struct Snapshot {
    queued: usize,
    completed: u64,
    pinned: (usize, usize),
    device: (usize, usize),
    events: usize,
    retirement: cuferry::engine::RetirementStats,
    staging: cuferry::staging::StagingStats,
    pool: cuferry::engine::PinnedPoolStats,
}

fn snapshot(engine: &CudaEngine) -> Snapshot {
    let sim = engine.sim().unwrap();
    Snapshot {
        queued: sim.queued(),
        completed: sim.completed(),
        pinned: sim.pinned_live(),
        device: sim.device_live(),
        events: sim.events_live(),
        retirement: engine.retirement_stats(),
        staging: engine.staging_stats(),
        pool: engine.pinned_pool_stats(),
    }
}

fn wrong_engine<T: std::fmt::Debug>(result: Result<T, Error>, a: &CudaEngine, b: &CudaEngine) {
    match result {
        Err(e @ Error::Usage(UsageError::WrongEngine { .. })) => {
            let message = e.to_string();
            for engine in [a, b] {
                let named = format!("engine #{} on {}", engine.id(), engine.device());
                assert!(message.contains(&named), "{message} should name {named}");
            }
        }
        other => panic!("expected WrongEngine, got {other:?}"),
    }
}

/// Every value of engine A handed to every route and operation of engine B is refused with
/// `WrongEngine`, naming both engines and their devices, and nothing changes on either engine.
#[test]
fn values_of_another_engine_are_refused_and_change_nothing() {
    for (mut a, mut b) in pairs() {
        let x = upload_tensor(&mut a, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        let mut y = upload_tensor(&mut a, &[5.0f32, 6.0, 7.0, 8.0], &[2, 2]).unwrap();
        let own = upload_tensor(&mut b, &[1.0f32; 4], &[2, 2]).unwrap();
        let mut own_mut = b.alloc_tensor::<f32>(&[2, 2]).unwrap();
        let buffer = PinnedHostBuffer::from_slice(&mut a, &[1.0f32; 4]).unwrap();
        let buffer_ptr = buffer.as_slice().as_ptr();
        let lease = a.staging_lease().unwrap();
        a.synchronize().unwrap();
        b.synchronize().unwrap();
        let (before_a, before_b) = (snapshot(&a), snapshot(&b));

        wrong_engine(b.copy_tensor(&x), &a, &b);
        wrong_engine(b.copy_into(&x, &mut own_mut), &a, &b);
        wrong_engine(b.copy_into(&own, &mut y), &a, &b);
        wrong_engine(b.add(&x, &own), &a, &b);
        wrong_engine(b.sub(&own, &x), &a, &b);
        wrong_engine(b.mul(&x, &x), &a, &b);
        wrong_engine(b.div(&x, &own), &a, &b);
        wrong_engine(b.neg(&x), &a, &b);
        wrong_engine(b.scale(&x, 2.0), &a, &b);
        wrong_engine(b.cast::<f64>(&x), &a, &b);
        wrong_engine(b.fill(&mut y, 0.0), &a, &b);
        wrong_engine(b.matmul(&x, &own), &a, &b);
        wrong_engine(
            b.gemm(&GemmConfig::new(2, 2, 2, 1.0, 0.0), &own, &own, &mut y),
            &a,
            &b,
        );
        wrong_engine(download_tensor(&mut b, &x), &a, &b);
        let mut reused = vec![0.5f32; 3];
        let reused_ptr = reused.as_ptr();
        match download_tensor_into(&mut b, &x, reused) {
            Err(refused) => {
                assert!(matches!(
                    refused.error(),
                    Error::Usage(UsageError::WrongEngine { .. })
                ));
                reused = refused.into_input().expect("handed back");
            }
            Ok(_) => panic!("another engine's tensor was downloaded"),
        }
        assert_eq!(
            (reused.as_ptr(), &reused[..]),
            (reused_ptr, &[0.5f32; 3][..])
        );
        wrong_engine(
            b.with_raw(|raw| raw.device_ptr(&x).map(|p| p.bytes())),
            &a,
            &b,
        );

        // A pinned buffer of A, with a tensor of B, in both directions: rejected, returned.
        let refused = upload_pending(&mut b, buffer, own).unwrap_err();
        let SubmitError::Rejected {
            input: package,
            error,
        } = refused
        else {
            panic!("expected a rejection");
        };
        wrong_engine::<()>(Err(error), &a, &b);
        assert_eq!(package.0.as_slice().as_ptr(), buffer_ptr);
        let refused = download_pending(&mut b, package.1, package.0).unwrap_err();
        assert!(matches!(
            refused.error(),
            Error::Usage(UsageError::WrongEngine { .. })
        ));
        let package = refused.into_input().unwrap();

        // A staging lease of A used on B.
        let lease = match lease.begin_upload(&mut b, &mut own_mut, 0, 4) {
            Err(SubmitError::Rejected {
                input: lease,
                error,
            }) => {
                wrong_engine::<()>(Err(error), &a, &b);
                lease
            }
            other => panic!("expected a refusal, got {other:?}"),
        };
        let lease = match lease.begin_download(&mut b, &own_mut, 0, 4) {
            Err(SubmitError::Rejected {
                input: lease,
                error,
            }) => {
                wrong_engine::<()>(Err(error), &a, &b);
                lease
            }
            other => panic!("expected a refusal, got {other:?}"),
        };

        assert_eq!(snapshot(&a), before_a, "engine A changed");
        assert_eq!(snapshot(&b), before_b, "engine B changed");

        // A returned transfer of A resubmitted on B: rejected, its event back in A's pool.
        let refill = PinnedHostBuffer::from_slice(&mut a, &[2.0f32; 4]).unwrap();
        let returned = upload_pending(&mut a, refill, y).unwrap().wait().unwrap();
        a.synchronize().unwrap();
        let (before_a, before_b) = (snapshot(&a), snapshot(&b));
        let SubmitError::Rejected { input: back, error } = returned.resubmit(&mut b).unwrap_err()
        else {
            panic!("expected a rejection");
        };
        wrong_engine::<()>(Err(error), &a, &b);
        assert_eq!(snapshot(&a), before_a, "engine A changed");
        assert_eq!(snapshot(&b), before_b, "engine B changed");
        drop((package, back, lease, x));
        a.synchronize().unwrap();
    }
}

/// The workload the panic sweep runs: every route, detached values, resubmission, teardown.
fn workload(engine: &mut CudaEngine) -> Result<(), Error> {
    let data = distinct(3000);
    let t = upload_tensor(engine, &data, &[data.len()])?;
    let mut out = download_tensor(engine, &t)?;
    out = download_tensor_into(engine, &t, out).map_err(|e| e.into_error())?;
    assert_eq!(out, data);
    let buffer = PinnedHostBuffer::from_slice(engine, &data)?;
    let dest = engine.alloc_tensor::<u32>(&[data.len()])?;
    let returned = upload_pending(engine, buffer, dest)
        .map_err(|e| e.into_error())?
        .wait()?;
    let again = returned.resubmit(engine).map_err(|e| e.into_error())?;
    drop(again); // detached
    let buffer = PinnedHostBuffer::<u32>::new(engine, data.len())?;
    let pending = download_pending(engine, t, buffer).map_err(|e| e.into_error())?;
    let back = pending.wait()?;
    assert_eq!(back.buffer().as_slice(), &data[..]);
    let mut lease = engine.staging_lease()?;
    lease.as_mut_bytes()[..4].copy_from_slice(&[1, 2, 3, 4]);
    let mut small = engine.alloc_tensor::<u8>(&[4])?;
    let unproven = lease
        .begin_upload(engine, &mut small, 0, 4)
        .map_err(|e| match e {
            SubmitError::Rejected { error, .. }
            | SubmitError::Failed { error, .. }
            | SubmitError::Retained { error } => error,
        })?;
    drop(unproven); // retired
    engine.flush()?;
    engine.synchronize()
}

/// A panic inside any driver call, at any point of the workload, never releases memory a queued
/// copy may still touch and never deadlocks the engine: afterwards the engine still works, and
/// teardown completes.
#[test]
fn a_panic_inside_the_driver_never_releases_unproven_memory_or_deadlocks() {
    let ops = [
        SimOp::Alloc,
        SimOp::Free,
        SimOp::CopyHtoD,
        SimOp::CopyDtoH,
        SimOp::EventCreate,
        SimOp::EventRecord,
        SimOp::EventQuery,
        SimOp::EventSynchronize,
        SimOp::EventDestroy,
        SimOp::HostAlloc,
        SimOp::HostFree,
        SimOp::StreamSynchronize,
        SimOp::StreamQuery,
    ];
    // How often each operation runs in one clean pass of the workload and the teardown.
    let clean = {
        let (mut engine, sim) = engine();
        engine.set_pinned_pool_budget(0).unwrap();
        workload(&mut engine).unwrap();
        drop(engine);
        ops.map(|op| sim.calls(op))
    };
    let previous_hook = std::sync::Arc::new(std::panic::take_hook());
    let hook = std::sync::Arc::clone(&previous_hook);
    std::panic::set_hook(Box::new(move |info| {
        // The injected panics are expected; anything else is reported.
        if !info.to_string().contains("simulated driver panic") {
            hook(info);
        }
    }));
    let mut runs = 0;
    for (op, &count) in ops.iter().zip(&clean) {
        for n in 1..=count {
            let (done_tx, done_rx) = mpsc::channel();
            let sim = SimDevice::new(SimConfig::default());
            let device = sim.clone();
            let op = *op;
            std::thread::spawn(move || {
                let mut engine = CudaEngine::simulated_on(&device);
                // Released pinned memory is freed at once, so a release under a queued copy
                // shows as a violation.
                engine.set_pinned_pool_budget(0).unwrap();
                device.panic_nth(op, n);
                let in_workload = catch_unwind(AssertUnwindSafe(|| {
                    let _ = workload(&mut engine);
                }))
                .is_err();
                let panicked = if in_workload {
                    device.clear_faults();
                    // The engine is usable after the panic.
                    let data = distinct(100);
                    let t = upload_tensor(&mut engine, &data, &[100]).unwrap();
                    assert_eq!(download_tensor(&mut engine, &t).unwrap(), data);
                    drop(t);
                    let _ = engine.synchronize();
                    drop(engine);
                    true
                } else {
                    // The call to panic comes at teardown.
                    catch_unwind(AssertUnwindSafe(move || drop(engine))).is_err()
                };
                done_tx.send(panicked).unwrap();
            });
            let panicked = done_rx
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("deadlock or failure after a panic in {op:?} #{n}"));
            assert!(panicked, "{op:?} #{n} did not panic");
            assert!(
                sim.violations().is_empty(),
                "a panic in {op:?} #{n}: {:?}",
                sim.violations()
            );
            runs += 1;
        }
    }
    let _ = std::panic::take_hook();
    assert!(runs > 30, "only {runs} panic points");
}

/// Values that outlive their engine clean up in place: an unproven chunk retired after teardown
/// and an in-flight transfer dropped after it wait for their own event and release everything,
/// instead of joining a queue nobody drains.
#[test]
fn values_that_outlive_their_engine_clean_up_in_place() {
    let (mut engine, sim) = engine();
    let mut tensor = engine.alloc_tensor::<u8>(&[16]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let unproven = lease.begin_upload(&mut engine, &mut tensor, 0, 16).unwrap();
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &[1u8; 16]).unwrap();
    let dest = engine.alloc_tensor::<u8>(&[16]).unwrap();
    let pending = upload_pending(&mut engine, buffer, dest).unwrap();
    drop(engine);
    unproven.retire_with(tensor);
    drop(pending);
    sim.advance_all(); // the stream-ordered frees queued by the releases
    assert_eq!(sim.pinned_live().0, 0, "no pinned memory left");
    assert_eq!(sim.device_live().0, 0, "no device memory left");
    assert_eq!(sim.events_live(), 0, "no event left");
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// A zero-length chunk queues nothing, on an empty tensor too (it used to queue a 0-byte copy at
/// device address 0).
#[test]
fn a_zero_length_chunk_is_refused_and_queues_nothing() {
    let (mut engine, sim) = engine();
    let mut empty = engine.alloc_tensor::<u32>(&[0]).unwrap();
    let queued = sim.queued();
    let lease = engine.staging_lease().unwrap();
    let lease = match lease.begin_upload(&mut engine, &mut empty, 0, 0) {
        Err(SubmitError::Rejected {
            input: lease,
            error: Error::Usage(UsageError::ZeroLength { .. }),
        }) => lease,
        other => panic!("expected a zero-length refusal, got {other:?}"),
    };
    let lease = match lease.begin_download(&mut engine, &empty, 0, 0) {
        Err(SubmitError::Rejected {
            input: lease,
            error: Error::Usage(UsageError::ZeroLength { .. }),
        }) => lease,
        other => panic!("expected a zero-length refusal, got {other:?}"),
    };
    lease.release();
    assert_eq!(sim.queued(), queued, "nothing was queued");
    assert_eq!(sim.calls(SimOp::CopyHtoD) + sim.calls(SimOp::CopyDtoH), 0);
}

/// The simulator's own arithmetic never panics, and an allocation it cannot back is the
/// device's out-of-memory.
#[test]
fn the_simulator_reports_what_it_cannot_back_and_never_overflows() {
    let sim = SimDevice::new(SimConfig {
        memory_bytes: usize::MAX,
        ..SimConfig::default()
    });
    let mut engine = CudaEngine::simulated_on(&sim);
    sim.fail_nth(SimOp::Alloc, u64::MAX, DriverError::UNKNOWN);
    sim.fail_event(u64::MAX, DriverError::UNKNOWN);
    sim.panic_nth(SimOp::Free, u64::MAX);
    match engine.alloc_tensor::<u8>(&[isize::MAX as usize - 4096]) {
        Err(Error::OutOfMemory(oom)) if oom.asked == isize::MAX as usize - 4096 => {
            let memory = oom.memory.expect("the simulator reports its memory");
            assert_eq!(memory.total, usize::MAX as u64);
        }
        other => panic!("expected out-of-memory, got {other:?}"),
    }
    sim.clear_faults();
}

/// A background query of a detached transfer that fails once is retried, not taken as the
/// device's verdict: nothing is retained or reported, and the transfer is released once done.
#[test]
fn a_single_failed_background_query_is_retried() {
    let (mut engine, sim) = engine();
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &distinct(64)).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[64]).unwrap();
    drop(upload_pending(&mut engine, buffer, dest).unwrap()); // detached
    sim.advance_all();
    sim.fail_nth(SimOp::EventQuery, 1, DriverError::UNKNOWN);
    engine.flush().expect("one failed query is no failure");
    assert_eq!(
        engine.retirement_stats().pending,
        1,
        "kept for a later poll"
    );
    engine.synchronize().expect("the retry proves it done");
    let stats = engine.retirement_stats();
    assert_eq!((stats.pending, stats.retained, stats.released), (0, 0, 1));
}
