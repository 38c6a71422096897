//! `upload_tensor_into` on the simulated device: every element type at every size boundary of
//! the staging bands, no device allocation on any path, the same driver calls as
//! `upload_tensor`, refusals that queue nothing and touch nothing, and a driver fault at every
//! call the route makes, after which nothing is freed early, nothing leaks and the same tensor
//! takes a correct upload again.

use crate::support::{Fault, Reference, Rng, assert_same, random_vec};
use cuferry::error::UsageError;
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, DeviceTensor, Element, Error, download_tensor, error::DriverError,
    staging::StagingConfig, upload_tensor, upload_tensor_into,
};

const CHUNK: usize = 4096;
const CUTOFF: usize = 1024;
const DEPTH: usize = 3;

/// Gives `engine` a small ring, so every band is reached with small transfers.
fn configure(engine: &mut CudaEngine) {
    let mut config = StagingConfig::default();
    config.chunk_bytes = CHUNK;
    config.cutoff_bytes = CUTOFF;
    config.ring_depth = DEPTH;
    config.copy_threads = 2;
    engine.set_staging_config(config).unwrap();
}

fn engine() -> (CudaEngine, SimDevice) {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    configure(&mut engine);
    let sim = engine.sim().unwrap();
    (engine, sim)
}

/// Element counts on both sides of every boundary for an element of `size` bytes: empty, one
/// element, the scalar slot's 16 bytes and one element past it, the single staged copy's cutoff
/// ± 1 element, one chunk ± 1 element, and several chunks with a remainder.
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
        e(CHUNK) - 1,
        e(CHUNK),
        e(CHUNK) + 1,
        e(CHUNK) * 3 + e(CHUNK) / 2 + 1,
        e(CHUNK) * 7 + 3,
    ];
    v.sort_unstable();
    v.dedup();
    v
}

/// A shape of `n` elements: two dimensions where `n` is even, so the kept shape is visible.
fn shape(n: usize) -> Vec<usize> {
    if n > 0 && n.is_multiple_of(2) {
        vec![2, n / 2]
    } else {
        vec![n]
    }
}

/// The driver calls a route makes, as counted by the device.
const ROUTE_OPS: [SimOp; 7] = [
    SimOp::HostAlloc,
    SimOp::EventCreate,
    SimOp::CopyHtoD,
    SimOp::EventRecord,
    SimOp::EventSynchronize,
    SimOp::StreamSynchronize,
    SimOp::Alloc,
];

fn counts(sim: &SimDevice, ops: &[SimOp]) -> Vec<u64> {
    ops.iter().map(|&op| sim.calls(op)).collect()
}

fn boundaries<T: Reference>(rng: &mut Rng) {
    let (mut engine, sim) = engine();
    let name = T::DTYPE.name();
    for n in sizes(T::DTYPE.size_bytes()) {
        let shape = shape(n);
        let mut tensor = engine.alloc_tensor::<T>(&shape).unwrap();
        // Twice into the same tensor: the second upload overwrites the first.
        for round in 0..2 {
            let what = format!("{name} n={n} round {round}");
            let data = random_vec::<T>(rng, n);
            let mut host = data.clone();
            let allocs = sim.calls(SimOp::Alloc);
            upload_tensor_into(&mut engine, &mut tensor, &host).unwrap();
            assert_eq!(
                sim.calls(SimOp::Alloc),
                allocs,
                "{what}: no device allocation"
            );
            // Read when the route returns: what the caller does with its memory afterwards does
            // not reach the device.
            host.reverse();
            host.extend(random_vec::<T>(rng, 1));
            drop(host);
            assert_eq!(tensor.shape(), &shape[..], "{what}: shape kept");
            assert_same(
                &what,
                &download_tensor(&mut engine, &tensor).unwrap(),
                &data,
            );
        }
    }
    let stats = engine.staging_stats();
    assert_eq!(stats.leased, 0, "{name}: every lease came back");
    assert!(
        stats.slots <= DEPTH,
        "{name}: the ring never exceeds its depth"
    );
    engine.synchronize().unwrap();
    assert!(
        sim.violations().is_empty(),
        "{name}: {:?}",
        sim.violations()
    );
}

#[test]
fn every_element_lands_in_place_at_every_boundary_without_a_device_allocation() {
    let mut rng = Rng::new(0x1_0ad);
    for_each_element!(T => {
        boundaries::<T>(&mut rng);
    });
}

#[test]
fn an_empty_upload_queues_nothing() {
    let (mut engine, sim) = engine();
    let mut tensor = engine.alloc_tensor::<f32>(&[0]).unwrap();
    let mut wide = engine.alloc_tensor::<u64>(&[3, 0]).unwrap();
    let before = counts(&sim, &ROUTE_OPS);
    upload_tensor_into(&mut engine, &mut tensor, &[]).unwrap();
    upload_tensor_into::<u64>(&mut engine, &mut wide, &[]).unwrap();
    assert_eq!(counts(&sim, &ROUTE_OPS), before);
    assert_eq!(sim.queued(), 0);
    assert_eq!(wide.shape(), &[3, 0]);
    let stats = engine.staging_stats();
    assert_eq!((stats.slots, stats.scalar_slot), (0, false));
}

/// The driver calls of `upload_tensor_into` for `n` elements of `T` on a fresh engine, and of
/// `upload_tensor` for the same data on another, less the latter's one device allocation.
fn route_calls<T: Reference>(rng: &mut Rng, n: usize) -> (Vec<u64>, Vec<u64>) {
    let data = random_vec::<T>(rng, n);
    let (mut first, sim) = engine();
    let mut tensor = first.alloc_tensor::<T>(&[n]).unwrap();
    let before = counts(&sim, &ROUTE_OPS);
    upload_tensor_into(&mut first, &mut tensor, &data).unwrap();
    let into: Vec<u64> = counts(&sim, &ROUTE_OPS)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    assert_same(
        "into",
        &download_tensor(&mut first, &tensor).unwrap(),
        &data,
    );

    let (mut second, sim) = engine();
    let before = counts(&sim, &ROUTE_OPS);
    let fresh = upload_tensor(&mut second, &data, &[n]).unwrap();
    let mut new: Vec<u64> = counts(&sim, &ROUTE_OPS)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    assert_same("new", &download_tensor(&mut second, &fresh).unwrap(), &data);
    let alloc = ROUTE_OPS.iter().position(|&op| op == SimOp::Alloc).unwrap();
    assert_eq!(new[alloc], u64::from(n > 0), "upload_tensor allocates once");
    new[alloc] = 0;
    (into, new)
}

#[test]
fn the_driver_calls_are_those_of_upload_tensor_less_the_allocation() {
    let mut rng = Rng::new(77);
    for_each_element!(T => {
        for n in sizes(T::DTYPE.size_bytes()) {
            let (into, new) = route_calls::<T>(&mut rng, n);
            assert_eq!(into, new, "{} n={n}: calls {ROUTE_OPS:?}", T::DTYPE.name());
        }
    });
}

#[test]
fn another_engines_tensor_is_refused_before_anything_is_queued() {
    let sim = SimDevice::new(SimConfig::default());
    let mut owner = CudaEngine::simulated_on(&sim);
    let mut other = CudaEngine::simulated_on(&sim);
    configure(&mut owner);
    configure(&mut other);
    let mut rng = Rng::new(5);
    for n in [0, 3, 200, 3000] {
        let original = random_vec::<u32>(&mut rng, n);
        let mut tensor = upload_tensor(&mut owner, &original, &[n]).unwrap();
        let data = random_vec::<u32>(&mut rng, n);
        let (before, queued) = (counts(&sim, &ROUTE_OPS), sim.queued());
        match upload_tensor_into(&mut other, &mut tensor, &data) {
            Err(Error::Usage(UsageError::WrongEngine {
                expected, found, ..
            })) => assert_ne!(expected, found),
            result => panic!("n={n}: expected WrongEngine, got {result:?}"),
        }
        assert_eq!(counts(&sim, &ROUTE_OPS), before, "n={n}: nothing called");
        assert_eq!(sim.queued(), queued, "n={n}: nothing queued");
        assert_eq!(download_tensor(&mut owner, &tensor).unwrap(), original);
        // The refusing engine still works.
        let mut own = other.alloc_tensor::<u32>(&[n]).unwrap();
        upload_tensor_into(&mut other, &mut own, &data).unwrap();
        assert_eq!(download_tensor(&mut other, &own).unwrap(), data);
    }
    owner.synchronize().unwrap();
    other.synchronize().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn a_length_mismatch_is_refused_before_anything_is_queued() {
    let (mut engine, sim) = engine();
    let mut rng = Rng::new(6);
    for (tensor_len, data_len) in [
        (4, 3),
        (4, 5),
        (0, 1),
        (1, 0),
        (300, 299),
        (3000, 3001),
        (3000, 0),
    ] {
        let original = random_vec::<f64>(&mut rng, tensor_len);
        let mut tensor = upload_tensor(&mut engine, &original, &shape(tensor_len)).unwrap();
        let data = random_vec::<f64>(&mut rng, data_len);
        let (before, queued) = (counts(&sim, &ROUTE_OPS), sim.queued());
        match upload_tensor_into(&mut engine, &mut tensor, &data) {
            Err(Error::Usage(UsageError::LengthMismatch {
                found, expected, ..
            })) => {
                assert_eq!((found, expected), (data_len, tensor_len));
            }
            result => panic!("{tensor_len} vs {data_len}: expected LengthMismatch, got {result:?}"),
        }
        assert_eq!(counts(&sim, &ROUTE_OPS), before, "nothing called");
        assert_eq!(sim.queued(), queued, "nothing queued");
        assert_same(
            "untouched",
            &download_tensor(&mut engine, &tensor).unwrap(),
            &original,
        );
    }
    assert_eq!(engine.staging_stats().leased, 0);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// A fresh engine with a tensor of `n` `u32`s and an empty ring (so slots are allocated and
/// events created during the upload).
fn fault_setup(n: usize) -> (CudaEngine, SimDevice, DeviceTensor<u32>) {
    let (mut engine, sim) = engine();
    let tensor = engine.alloc_tensor::<u32>(&[n]).unwrap();
    (engine, sim, tensor)
}

/// How often each operation runs in one clean upload of `n` elements.
fn clean_calls(n: usize, ops: &[SimOp]) -> Vec<u64> {
    let (mut engine, sim, mut tensor) = fault_setup(n);
    let data = random_vec::<u32>(&mut Rng::new(1), n);
    let before = counts(&sim, ops);
    upload_tensor_into(&mut engine, &mut tensor, &data).unwrap();
    counts(&sim, ops)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect()
}

fn fault_case(n: usize, fault: Fault) {
    let what = format!("n={n} {fault:?}");
    let (mut engine, sim, mut tensor) = fault_setup(n);
    let mut rng = Rng::new(n as u64 ^ 0xfa17);
    let data = random_vec::<u32>(&mut rng, n);
    let allocs = sim.calls(SimOp::Alloc);
    fault.arm(&sim);
    let error = upload_tensor_into(&mut engine, &mut tensor, &data)
        .expect_err(&format!("{what}: the injected fault surfaces"));
    let code = match &error {
        Error::Driver { source, .. } | Error::DeviceFault { source, .. } => *source,
        other => panic!("{what}: unexpected error {other}"),
    };
    assert_eq!(code, fault.reported(), "{what}");
    assert_eq!(
        sim.calls(SimOp::Alloc),
        allocs,
        "{what}: no device allocation"
    );
    assert!(
        sim.violations().is_empty(),
        "{what}: {:?}",
        sim.violations()
    );

    // Released frees run at the next stream run: the second boundary settles everything.
    let _ = engine.synchronize();
    engine.synchronize().unwrap();
    sim.clear_faults();
    let staging = engine.staging_stats();
    let retire = engine.retirement_stats();
    assert_eq!(retire.pending, 0, "{what}: drained at synchronize");
    if fault.retains() {
        assert!(
            retire.retained >= 1,
            "{what}: the unproven chunk is retained"
        );
    } else {
        assert_eq!(
            retire.retained, 0,
            "{what}: only an unprovable chunk retains"
        );
    }
    // A retained ring slot stays counted as leased; a retained scalar slot is outside the ring.
    assert!(
        staging.leased <= retire.retained,
        "{what}: no lease left out beyond the retained ({staging:?}, {retire:?})"
    );
    let scalar_retained = retire.retained - staging.leased;
    // Pinned: the ring's slots, the idle scalar slot and a retained scalar slot; nothing else.
    assert_eq!(
        sim.pinned_live().0,
        staging.slots + usize::from(staging.scalar_slot) + scalar_retained,
        "{what}: pinned memory beyond the staging slots ({staging:?}, {retire:?})"
    );
    // Device: the tensor, and nothing else.
    assert_eq!(
        sim.device_live().0,
        1,
        "{what}: device memory beyond the tensor"
    );
    assert!(
        sim.violations().is_empty(),
        "{what}: {:?}",
        sim.violations()
    );

    // A retry into the same tensor uploads correctly.
    let again = random_vec::<u32>(&mut rng, n);
    upload_tensor_into(&mut engine, &mut tensor, &again).unwrap();
    assert_eq!(
        sim.calls(SimOp::Alloc),
        allocs,
        "{what}: no device allocation"
    );
    assert_eq!(
        download_tensor(&mut engine, &tensor).unwrap(),
        again,
        "{what}: retry"
    );

    // At teardown nothing is left but what the engine retained.
    let retained = engine.retirement_stats().retained;
    drop(tensor);
    drop(engine);
    assert!(
        sim.violations().is_empty(),
        "{what}: {:?}",
        sim.violations()
    );
    assert!(
        sim.pinned_live().0 <= retained,
        "{what}: {} pinned allocations after teardown, {retained} retained",
        sim.pinned_live().0
    );
    assert_eq!(
        sim.device_live().0,
        0,
        "{what}: device memory after teardown"
    );
}

/// Every fault at every call of the route, for `n` elements.
fn sweep(n: usize) -> usize {
    // Chunks are fenced by events; 16 bytes or fewer are proven by a stream synchronize.
    const CHUNKED: [(SimOp, DriverError); 5] = [
        (SimOp::HostAlloc, DriverError::OUT_OF_MEMORY),
        (SimOp::EventCreate, DriverError::OUT_OF_MEMORY),
        (SimOp::CopyHtoD, DriverError::INVALID_VALUE),
        (SimOp::EventRecord, DriverError::UNKNOWN),
        (SimOp::EventSynchronize, DriverError::LAUNCH_FAILED),
    ];
    const SCALAR: [(SimOp, DriverError); 3] = [
        (SimOp::HostAlloc, DriverError::OUT_OF_MEMORY),
        (SimOp::CopyHtoD, DriverError::INVALID_VALUE),
        (SimOp::StreamSynchronize, DriverError::LAUNCH_FAILED),
    ];
    let scalar = n * std::mem::size_of::<u32>() <= 16;
    let faults: &[(SimOp, DriverError)] = if scalar { &SCALAR } else { &CHUNKED };
    let ops: Vec<SimOp> = faults.iter().map(|&(op, _)| op).collect();
    let calls = clean_calls(n, &ops);
    let mut runs = 0;
    for (&(op, error), &count) in faults.iter().zip(&calls) {
        assert!(count > 0, "n={n}: the route never calls {op:?}");
        for nth in 1..=count {
            fault_case(n, Fault::Call(op, nth, error));
            runs += 1;
        }
    }
    let records = ops
        .iter()
        .position(|&op| op == SimOp::EventRecord)
        .map_or(0, |i| calls[i]);
    for nth in 1..=records {
        fault_case(n, Fault::Untracked(nth));
        fault_case(n, Fault::Event(nth));
        runs += 2;
    }
    runs
}

#[test]
fn a_fault_in_the_scalar_slot_band_loses_nothing_and_the_tensor_takes_a_retry() {
    // 12 bytes: the 16-byte scalar slot, proven by a stream synchronize.
    assert!(sweep(3) >= 3);
}

#[test]
fn a_fault_in_the_single_copy_band_loses_nothing_and_the_tensor_takes_a_retry() {
    // 800 bytes: one staged copy through one ring slot.
    assert!(sweep(200) >= 7);
}

#[test]
fn a_fault_at_every_pipeline_call_loses_nothing_and_the_tensor_takes_a_retry() {
    // Five full chunks and a partial one through a ring of three.
    let n = 5 * CHUNK / 4 + 7;
    assert!(sweep(n) >= 6 * 5);
}

#[test]
fn large_uploads_split_their_host_copies_across_the_copy_threads() {
    // Big enough for the parallel host copy to engage, in the single-copy band and the pipeline.
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut config = StagingConfig::default();
    config.chunk_bytes = 1 << 20;
    config.cutoff_bytes = 1 << 20;
    config.ring_depth = 3;
    config.copy_threads = 4;
    engine.set_staging_config(config).unwrap();
    let sim = engine.sim().unwrap();
    let mut rng = Rng::new(8);
    for n in [(1 << 20) / 4, (3 << 20) / 4 + 5] {
        let mut tensor = engine.alloc_tensor::<u32>(&[n]).unwrap();
        let allocs = sim.calls(SimOp::Alloc);
        for _ in 0..2 {
            let data = random_vec::<u32>(&mut rng, n);
            upload_tensor_into(&mut engine, &mut tensor, &data).unwrap();
            assert_eq!(
                download_tensor(&mut engine, &tensor).unwrap(),
                data,
                "n={n}"
            );
        }
        assert_eq!(
            sim.calls(SimOp::Alloc),
            allocs,
            "n={n}: no device allocation"
        );
    }
    let flags = random_vec::<bool>(&mut rng, (5 << 20) + 3);
    let mut tensor = engine.alloc_tensor::<bool>(&[flags.len()]).unwrap();
    upload_tensor_into(&mut engine, &mut tensor, &flags).unwrap();
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), flags);
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}
