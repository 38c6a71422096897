//! The blocking routes' staging pipeline on the simulated device: correctness at every size
//! boundary for every element type, fault injection at every step, and concurrency.

use cuferry::error::StagingError;
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, Element, Error, bf16, download_tensor, download_tensor_into, error::DriverError,
    f16, staging::StagingConfig, upload_tensor,
};

const CHUNK: usize = 4096;
const CUTOFF: usize = 1024;
const DEPTH: usize = 3;

// Written once in `tests/bodies/staging.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::staging::tests!(sim);

fn engine() -> (CudaEngine, SimDevice) {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut config = StagingConfig::default();
    config.chunk_bytes = CHUNK;
    config.cutoff_bytes = CUTOFF;
    config.ring_depth = DEPTH;
    config.copy_threads = 2;
    engine.set_staging_config(config).unwrap();
    let sim = engine.sim().unwrap();
    (engine, sim)
}

/// Element counts on both sides of every boundary for an element of `size` bytes.
fn sizes(size: usize) -> Vec<usize> {
    let e = |bytes: usize| bytes / size;
    let mut v = vec![
        0,
        1,
        e(16),
        e(16) + 1,
        e(CUTOFF) - 1,
        e(CUTOFF),
        e(CUTOFF) + 1,
    ];
    v.extend([
        e(CHUNK) - 1,
        e(CHUNK),
        e(CHUNK) + 1,
        e(CHUNK) * 3 + e(CHUNK) / 2 + 1,
        e(CHUNK) * 7 + 3,
    ]);
    v.retain(|&n| n > 0 || size == 1);
    v.sort_unstable();
    v.dedup();
    v
}

fn check<T: Element>(make: impl Fn(usize) -> T) {
    let (mut engine, sim) = engine();
    for n in sizes(T::DTYPE.size_bytes()) {
        let data: Vec<T> = (0..n).map(&make).collect();
        let t = upload_tensor(&mut engine, &data, &[n]).unwrap();
        assert_eq!(
            download_tensor(&mut engine, &t).unwrap(),
            data,
            "{} n={n}",
            T::DTYPE
        );
        if T::DTYPE.any_bit_pattern() {
            let out = download_tensor_into(&mut engine, &t, Vec::with_capacity(n + 1)).unwrap();
            assert_eq!(out, data, "{} into n={n}", T::DTYPE);
        }
    }
    let stats = engine.staging_stats();
    assert_eq!(stats.leased, 0);
    assert!(stats.slots <= DEPTH, "the ring never exceeds its depth");
    assert!(sim.violations().is_empty());
}

#[test]
fn every_element_round_trips_at_every_boundary() {
    check(|i| i as f32 * 0.5 + 1.0);
    check(|i| i as f64 * -0.25 + 2.0);
    check(|i| f16::from_f32((i % 2000) as f32 + 1.0));
    check(|i| bf16::from_f32((i % 200) as f32 + 1.0));
    check(|i| ((i % 255) as i16 - 127) as i8);
    check(|i| (i % 30000) as i16 - 15000);
    check(|i| i as i32 * 3 - 7);
    check(|i| i as i64 * -5 + 11);
    check(|i| (i % 251) as u8 + 1);
    check(|i| (i % 60000) as u16 + 1);
    check(|i| (i as u32).wrapping_mul(2_654_435_761) | 1);
    check(|i| (i as u64) << 20 | 3);
    check(|i| i % 3 != 1);
}

#[test]
fn an_upload_is_read_when_the_route_returns() {
    // The route returns only after its chunks are proven: the sim has nothing of it left queued.
    let (mut engine, sim) = engine();
    let data: Vec<u32> = (0..(CHUNK / 4) * 5).map(|i| i as u32 + 1).collect();
    let t = upload_tensor(&mut engine, &data, &[data.len()]).unwrap();
    assert_eq!(sim.queued(), 0);
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), data);
}

/// Five chunks through a ring of three: the n-th call of each step, for the first, a middle and
/// the last chunk.
const CHUNKS: usize = 5;

fn fault_case(upload: bool, op: SimOp, nth: u64) {
    let (mut engine, sim) = engine();
    let n = CHUNKS * CHUNK / 4;
    let data: Vec<u32> = (0..n as u32).map(|i| i * 3 + 1).collect();
    let source = if upload {
        None
    } else {
        Some(upload_tensor(&mut engine, &data, &[n]).unwrap())
    };
    // Start from an empty ring, so slot acquisition allocates.
    let config = engine.staging_config();
    engine.set_staging_config(config).unwrap();
    let error = if op == SimOp::EventSynchronize {
        DriverError::LAUNCH_FAILED
    } else {
        DriverError::OUT_OF_MEMORY
    };
    sim.fail_nth(op, nth, error);
    let result = match &source {
        None => upload_tensor(&mut engine, &data, &[n]).map(|_| ()),
        Some(t) => download_tensor(&mut engine, t).map(|_| ()),
    };
    let err = result.expect_err("the injected fault surfaces");
    let code = match &err {
        Error::Driver { source, .. } | Error::DeviceFault { source, .. } => *source,
        other => panic!("{op:?} #{nth}: unexpected error {other}"),
    };
    assert_eq!(code, error, "{op:?} #{nth}");
    engine.synchronize().unwrap();
    let staging = engine.staging_stats();
    let retire = engine.retirement_stats();
    assert_eq!(retire.pending, 0, "{op:?} #{nth}: drained at synchronize");
    let expect_retained = usize::from(op == SimOp::EventSynchronize);
    assert_eq!(
        retire.retained, expect_retained,
        "{op:?} #{nth}: only a failed wait retains"
    );
    // Only a retained slot stays out of the ring, counted as leased.
    assert_eq!(
        staging.leased, retire.retained,
        "{op:?} #{nth}: no lease left out"
    );
    // Pinned accounting: ring slots (retained ones among them); nothing else is alive.
    assert_eq!(sim.pinned_live().0, staging.slots, "{op:?} #{nth}");
    assert!(
        sim.violations().is_empty(),
        "{op:?} #{nth}: {:?}",
        sim.violations()
    );
    // The engine still works.
    let t = upload_tensor(&mut engine, &data, &[n]).unwrap();
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), data);
}

#[test]
fn upload_faults_at_every_step_on_first_middle_and_last_chunk() {
    for (op, calls) in [
        (SimOp::HostAlloc, DEPTH as u64),
        (SimOp::CopyHtoD, CHUNKS as u64),
        (SimOp::EventRecord, CHUNKS as u64),
        (SimOp::EventSynchronize, CHUNKS as u64),
    ] {
        for nth in [1, calls.div_ceil(2), calls] {
            fault_case(true, op, nth);
        }
    }
}

#[test]
fn download_faults_at_every_step_on_first_middle_and_last_chunk() {
    for (op, calls) in [
        (SimOp::HostAlloc, DEPTH as u64),
        (SimOp::CopyDtoH, CHUNKS as u64),
        (SimOp::EventRecord, CHUNKS as u64),
        (SimOp::EventSynchronize, CHUNKS as u64),
    ] {
        for nth in [1, calls.div_ceil(2), calls] {
            fault_case(false, op, nth);
        }
    }
}

#[test]
fn a_staging_lease_can_drive_a_hand_built_pipeline() {
    let (mut engine, sim) = engine();
    let mut tensor = engine.alloc_tensor::<u8>(&[100]).unwrap();
    let mut lease = engine.staging_lease().unwrap();
    lease.as_mut_bytes()[..100].copy_from_slice(&(1..=100).collect::<Vec<u8>>());
    let unproven = lease
        .begin_upload(&mut engine, &mut tensor, 0, 100)
        .unwrap();
    assert_eq!(sim.queued(), 2);
    let proven = unproven.end_chunk().unwrap();
    proven.release();
    assert_eq!(
        download_tensor(&mut engine, &tensor).unwrap(),
        (1..=100).collect::<Vec<u8>>()
    );
    // The ring is exclusive and bounded.
    let leases: Vec<_> = (0..DEPTH)
        .map(|_| engine.staging_lease().unwrap())
        .collect();
    assert!(matches!(
        engine.staging_lease(),
        Err(Error::Staging(StagingError::Exhausted { depth: DEPTH }))
    ));
    drop(leases);
    assert_eq!(engine.staging_stats().leased, 0);
}

#[test]
fn a_dropped_unproven_lease_is_retired_and_comes_back_only_once_proven() {
    let (mut engine, sim) = engine();
    let mut tensor = engine.alloc_tensor::<u8>(&[10]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let ptr = lease.as_bytes().as_ptr();
    drop(lease.begin_upload(&mut engine, &mut tensor, 0, 10).unwrap());
    // Not proven yet: the slot is still out of the ring, and no other lease can get it.
    engine.flush().unwrap();
    assert_eq!(engine.retirement_stats().pending, 1);
    assert_eq!(engine.staging_stats().user_leased, 1);
    let other = engine.staging_lease().unwrap();
    assert_ne!(other.as_bytes().as_ptr(), ptr);
    other.release();
    // Once the device has run the copy, the next boundary gives the slot back.
    sim.advance_all();
    engine.flush().unwrap();
    assert_eq!(engine.retirement_stats().pending, 0);
    assert_eq!(engine.staging_stats().user_leased, 0);
    drop(engine);
    assert!(
        !sim.is_pinned_live(ptr),
        "freed at teardown, after its proof"
    );
    assert!(sim.violations().is_empty());
}

#[test]
fn four_threads_with_their_own_engines_on_one_device() {
    let device = SimDevice::new(SimConfig::default());
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let device = device.clone();
            s.spawn(move || {
                let mut engine = CudaEngine::simulated_on(&device);
                let mut config = engine.staging_config();
                config.chunk_bytes = CHUNK;
                config.cutoff_bytes = CUTOFF;
                engine.set_staging_config(config).unwrap();
                for round in 0..5u32 {
                    let data: Vec<u32> = (0..10_000).map(|i| i * 4 + t + round * 7 + 1).collect();
                    let x = upload_tensor(&mut engine, &data, &[10_000]).unwrap();
                    assert_eq!(download_tensor(&mut engine, &x).unwrap(), data);
                }
            });
        }
    });
    assert!(device.violations().is_empty());
}

#[test]
fn large_transfers_split_their_host_copies_across_the_copy_threads() {
    // Big enough for the parallel host copy (and the fresh-buffer prefault) to engage.
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut config = StagingConfig::default();
    config.chunk_bytes = 1 << 20;
    config.cutoff_bytes = 64 << 10;
    config.ring_depth = 3;
    config.copy_threads = 4;
    engine.set_staging_config(config).unwrap();
    let n = (3 << 20) / 4 + 5;
    let data: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) | 1)
        .collect();
    let t = upload_tensor(&mut engine, &data, &[n]).unwrap();
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), data);
    let reused = download_tensor_into(&mut engine, &t, Vec::with_capacity(n)).unwrap();
    assert_eq!(reused, data);
    let flags: Vec<bool> = (0..(5 << 20) + 3).map(|i| i % 7 == 2).collect();
    let f = upload_tensor(&mut engine, &flags, &[flags.len()]).unwrap();
    assert_eq!(download_tensor(&mut engine, &f).unwrap(), flags);
    assert!(engine.sim().unwrap().violations().is_empty());
}
