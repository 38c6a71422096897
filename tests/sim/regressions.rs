//! Regression tests for lifecycle bugs, each reduced to the scenario that found it.

use crate::support::distinct_f32 as distinct;
use cuferry::error::UsageError;
use cuferry::sim::{SimConfig, SimOp};
use cuferry::{
    CudaEngine, Error, PinnedHostBuffer, SubmitError, download_tensor, error::DriverError,
    staging::StagingConfig, upload_pending, upload_tensor,
};

/// A returned transfer resubmitted on an engine of another device is refused; the transfer's
/// event belongs to the engine that made it and must go back to that engine's pool, not into
/// the refusing engine's, whose driver does not know it.
#[test]
fn a_refused_resubmission_does_not_hand_its_event_to_the_refusing_engine() {
    let mut a = CudaEngine::simulated(SimConfig::default());
    let mut b = CudaEngine::simulated(SimConfig::default());
    let buffer = PinnedHostBuffer::from_slice(&mut a, &distinct(4)).unwrap();
    let tensor = a.alloc_tensor::<f32>(&[4]).unwrap();
    let returned = upload_pending(&mut a, buffer, tensor)
        .unwrap()
        .wait()
        .unwrap();
    let refused = returned.resubmit(&mut b).unwrap_err();
    assert!(matches!(
        refused,
        SubmitError::Rejected {
            error: Error::Usage(UsageError::WrongEngine { .. }),
            ..
        }
    ));
    drop(refused);

    // The refusing engine's own transfers record events of its own device.
    let sim_b = b.sim().unwrap();
    let buffer = PinnedHostBuffer::from_slice(&mut b, &distinct(4)).unwrap();
    let tensor = b.alloc_tensor::<f32>(&[4]).unwrap();
    let pending = upload_pending(&mut b, buffer, tensor).expect("b's own upload is queued");
    assert_eq!(sim_b.calls(SimOp::EventCreate), 1, "b made its own event");
    let (_buffer, _tensor) = pending.wait().unwrap().into_parts();
}

/// The same, between two engines of one device (refused for the wrong engine): the event goes
/// back to the engine that made it, which reuses it.
#[test]
fn a_refused_resubmission_returns_its_event_to_its_own_engine() {
    let mut a = CudaEngine::simulated(SimConfig::default());
    let mut b = CudaEngine::simulated_on(&a.sim().unwrap());
    let buffer = PinnedHostBuffer::from_slice(&mut a, &distinct(4)).unwrap();
    let tensor = a.alloc_tensor::<f32>(&[4]).unwrap();
    let returned = upload_pending(&mut a, buffer, tensor)
        .unwrap()
        .wait()
        .unwrap();
    let refused = returned.resubmit(&mut b).unwrap_err();
    assert!(matches!(
        refused,
        SubmitError::Rejected {
            error: Error::Usage(UsageError::WrongEngine { .. }),
            ..
        }
    ));
    let package = refused.into_input().unwrap();
    let (_buffer, _tensor) = upload_pending(&mut a, package.0, package.1)
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_eq!(a.events_created(), 1, "a reused its own event");
    assert_eq!(b.events_created(), 0);
}

/// Runs `f` on another thread and fails if it has not returned within ten seconds (a deadlock
/// then leaves that thread blocked, but the test reports instead of hanging).
fn within_ten_seconds(f: impl FnOnce() + Send + 'static) {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = done.send(());
    });
    match finished.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("deadlocked"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("panicked (see above)"),
    }
}

/// Queues `n` uploads of 4 elements and drops their handles (detached into the retirement
/// queue), then runs the device until they are complete.
fn completed_detached_uploads(engine: &mut CudaEngine, n: usize) {
    for _ in 0..n {
        let buffer = PinnedHostBuffer::from_slice(engine, &distinct(4)).unwrap();
        let tensor = engine.alloc_tensor::<f32>(&[4]).unwrap();
        drop(upload_pending(engine, buffer, tensor).unwrap());
    }
    engine.sim().unwrap().advance_all();
    assert_eq!(engine.retirement_stats().pending, n);
}

/// A pinned allocation that fails after the retirement queue released completed records must
/// return its error. The pinned allocation (`src/memory/pinned.rs`) once returned early with `?`
/// while it held the released records and the caller held the engine's lock; dropping the
/// records there dropped their pinned buffers and tensors, whose `Drop` takes the same lock: a
/// deadlock.
///
/// Both allocation attempts fail and the released 4 KiB block cannot hold the 16 KiB asked for,
/// so the one right outcome is the allocation's error. The retry under pressure frees the idle
/// block first, so nothing pinned is left.
#[test]
fn a_failed_pinned_allocation_after_releasing_records_returns() {
    within_ten_seconds(|| {
        let mut engine = CudaEngine::simulated(SimConfig::default());
        completed_detached_uploads(&mut engine, 1);
        let sim = engine.sim().unwrap();
        let host_allocs = sim.calls(SimOp::HostAlloc);
        sim.fail_nth(SimOp::HostAlloc, 1, DriverError::OUT_OF_MEMORY);
        sim.fail_nth(SimOp::HostAlloc, 2, DriverError::OUT_OF_MEMORY);
        // A larger buffer than the released ones, so the pool cannot serve it.
        let err = PinnedHostBuffer::<f32>::new(&mut engine, 4096).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Driver {
                    call: "cuMemHostAlloc",
                    source: DriverError::OUT_OF_MEMORY,
                }
            ),
            "{err}"
        );
        assert_eq!(sim.calls(SimOp::HostAlloc), host_allocs + 2, "one retry");
        assert_eq!(engine.retirement_stats().released, 1);
        assert_eq!(sim.pinned_live(), (0, 0), "the released block was freed");
        assert!(sim.violations().is_empty());
        // The faults are spent: the same request now succeeds.
        PinnedHostBuffer::<f32>::new(&mut engine, 4096).unwrap();
    });
}

/// Under pinned-memory pressure `PinnedHostBuffer::new` releases completed detached transfers
/// and tries again; the memory those transfers held must serve that retry. The released records
/// are dropped outside the engine's lock before the retry, so their blocks are back (here, with
/// a budget of zero, freed) by the time it allocates.
#[test]
fn pinned_pressure_reuses_the_memory_of_completed_detached_transfers() {
    within_ten_seconds(|| {
        // Room for two 4 KiB pinned blocks, both held by completed detached uploads.
        let mut engine = CudaEngine::simulated(SimConfig {
            pinned_bytes: 8192,
            ..SimConfig::default()
        });
        engine.set_pinned_pool_budget(0).unwrap();
        completed_detached_uploads(&mut engine, 2);
        let buffer = PinnedHostBuffer::<f32>::new(&mut engine, 4);
        assert!(buffer.is_ok(), "{:?}", buffer.unwrap_err());
        assert_eq!(engine.retirement_stats().released, 2);
        let sim = engine.sim().unwrap();
        assert_eq!(
            sim.pinned_live(),
            (1, 4096),
            "only the new buffer holds pinned memory"
        );
        assert!(sim.violations().is_empty());
    });
}

/// A prepared program's run refused before its launch (here, its wait for an input still being
/// uploaded on the upload stream) hands its new output's block back to the program's recycler;
/// dropping the program must free that block even though no run was ever queued.
#[test]
fn a_run_refused_before_its_launch_frees_its_output_with_the_program() {
    use cuferry::DType;
    use cuferry::graph::{GraphCompiler, Input, TracedTensor};
    let sim = cuferry::sim::SimDevice::new(SimConfig::default());
    let mut engine = CudaEngine::simulated_on(&sim);
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let y = (&(&x * &x).unwrap() + &x).unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(&[&y], &[(&x, DType::F32, &[17])])
        .unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &distinct(17)).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[17]).unwrap();
    let pending = upload_pending(&mut engine, buffer, tensor).unwrap();
    sim.fail_nth(SimOp::StreamWait, 1, DriverError::LAUNCH_FAILED);
    let refused = engine.run(&mut prepared, &[Input::from(pending.tensor())]);
    assert!(matches!(refused, Err(Error::Driver { .. })), "{refused:?}");
    drop(refused);
    sim.clear_faults();
    drop(pending.wait().unwrap());
    drop(prepared);
    drop(engine);
    assert_eq!(sim.device_live().0, 0, "device memory left allocated");
}

/// The staging chunk of the out-of-memory cases below.
const SLOT: usize = 64 << 10;

/// An engine on a simulated device with `pinned_bytes` of page-locked memory and `memory_bytes`
/// of device memory, staging through 64 KiB chunks, four at a time, with the process's copy
/// pool set to four threads before any transfer.
fn tight_engine(pinned_bytes: usize, memory_bytes: usize) -> CudaEngine {
    // The binary runs with four copy threads (`support::copy_threads`).
    assert!(cuferry::staging::copy_threads() >= 2);
    let mut engine = CudaEngine::simulated(SimConfig {
        pinned_bytes,
        memory_bytes,
        ..SimConfig::default()
    });
    let mut config = StagingConfig::default();
    config.chunk_bytes = SLOT;
    config.cutoff_bytes = 16 << 10;
    config.ring_depth = 4;
    config.copy_threads = 4;
    engine.set_staging_config(config).unwrap();
    engine
}

/// `n` distinct `u32`s, never zero.
fn words(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ salt | 1)
        .collect()
}

/// A pipelined upload of six chunks (384 KiB) whose third chunk's copy is refused: the two
/// chunks before it are in flight, so their slots and the destination are retired. Then the
/// device runs them to completion; nothing proves that to the engine yet.
fn fail_a_pipelined_upload(engine: &mut CudaEngine) {
    let sim = engine.sim().unwrap();
    sim.fail_nth(SimOp::CopyHtoD, 3, DriverError::ILLEGAL_ADDRESS);
    let failed = upload_tensor(engine, &words(6 * SLOT / 4, 1), &[6 * SLOT / 4]);
    assert!(
        matches!(
            failed,
            Err(Error::Driver {
                source: DriverError::ILLEGAL_ADDRESS,
                ..
            })
        ),
        "{failed:?}"
    );
    sim.clear_faults();
    assert_eq!(engine.retirement_stats().pending, 2, "two chunks retired");
    sim.advance_all();
    assert_eq!(sim.queued(), 0, "the device has finished");
}

/// A 100 KB upload after a failed pipelined upload, with the device finished: its staging slots
/// need the pinned memory of the retired ones, which the slot request releases (no flush).
#[test]
fn a_staging_slot_request_releases_completed_retired_slots() {
    // Room for three slots: the two retired and the one the failed copy handed back.
    let mut engine = tight_engine(3 * SLOT, 4 << 30);
    fail_a_pipelined_upload(&mut engine);
    let data = words(100_000 / 4, 2);
    let tensor = upload_tensor(&mut engine, &data, &[data.len()]);
    let tensor = tensor.unwrap_or_else(|e| panic!("the 100 KB upload was refused: {e}"));
    assert_eq!(engine.retirement_stats().released, 2);
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), data);
    let sim = engine.sim().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// A device allocation after a failed pipelined upload, with the device finished: it needs the
/// memory of the retired destination, which the allocation releases (no flush).
#[test]
fn a_device_allocation_releases_completed_retired_tensors() {
    // Room for the failed upload's 384 KiB destination and 128 KiB more.
    let mut engine = tight_engine(4 << 30, 512 << 10);
    fail_a_pipelined_upload(&mut engine);
    let n = (256 << 10) / 4;
    let tensor = engine.alloc_tensor::<u32>(&[n]);
    let tensor = tensor.unwrap_or_else(|e| panic!("the device allocation was refused: {e}"));
    assert_eq!(engine.retirement_stats().released, 2);
    let data = words(n, 3);
    let mut tensor = tensor;
    cuferry::upload_tensor_into(&mut engine, &mut tensor, &data).unwrap();
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), data);
    let sim = engine.sim().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// A pinned buffer after a failed pipelined upload, with the device finished: it needs the
/// pinned memory of the retired slots, which the allocation releases (no flush).
#[test]
fn a_pinned_buffer_allocation_releases_completed_retired_slots() {
    let mut engine = tight_engine(3 * SLOT, 4 << 30);
    fail_a_pipelined_upload(&mut engine);
    let buffer = PinnedHostBuffer::<u32>::from_slice(&mut engine, &words(2 * SLOT / 4, 4));
    let buffer = buffer.unwrap_or_else(|e| panic!("the pinned buffer was refused: {e}"));
    assert_eq!(buffer.as_slice(), &words(2 * SLOT / 4, 4)[..]);
    assert_eq!(engine.retirement_stats().released, 2);
    let sim = engine.sim().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}
