//! Blocking transfers whose chunks all fit in the staging ring at once, on the simulated device:
//! the host copies of the whole transfer run as one parallel region and each chunk is queued (or
//! copied out) as soon as it is ready. Correct bytes for every band boundary around the ring's
//! depth (a body shared with the GPU suite, `tests/bodies/transfers.rs`), and a driver fault at
//! every call of both directions loses nothing.
//!
//! The process's copy pool is set to four threads before anything uses it, so the parallel path
//! runs whatever the machine's core count.

use crate::support::{Fault, Rng, random_vec};
use cuferry::sim::{SimDevice, SimOp};
use cuferry::{
    CudaEngine, Error, download_tensor, download_tensor_into, error::DriverError, upload_tensor,
    upload_tensor_into,
};

// Written once in `tests/bodies/transfers.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::transfers::tests!(sim);

use crate::bodies::Device;
use crate::bodies::transfers::{CHUNK, DEPTH, ring_engine};

/// The bodies' engine (1 MiB chunks, a ring of [`DEPTH`], four copy threads), on a simulated
/// device, with that device.
fn engine() -> (CudaEngine, SimDevice) {
    let engine = ring_engine(Device::Sim);
    let sim = engine.sim().unwrap();
    (engine, sim)
}

/// One transfer of `n` `u32`s with `fault` armed: it fails, nothing is freed early or leaked,
/// and the same transfer succeeds afterwards.
fn fault_case(upload: bool, n: usize, faults: &[Fault]) {
    let what = format!("upload={upload} n={n} {faults:?}");
    let (mut engine, sim) = engine();
    let mut rng = Rng::new(n as u64);
    let data = random_vec::<u32>(&mut rng, n);
    let mut tensor = upload_tensor(&mut engine, &data, &[n]).unwrap();
    engine.synchronize().unwrap();
    faults.iter().for_each(|fault| fault.arm(&sim));
    let failed = if upload {
        upload_tensor_into(&mut engine, &mut tensor, &random_vec::<u32>(&mut rng, n)).is_err()
    } else {
        download_tensor_into(&mut engine, &tensor, Vec::new()).is_err()
    };
    assert!(failed, "{what}: the injected fault surfaces");
    assert!(
        sim.violations().is_empty(),
        "{what}: {:?}",
        sim.violations()
    );
    let _ = engine.synchronize();
    let _ = engine.synchronize();
    sim.clear_faults();
    let staging = engine.staging_stats();
    let retire = engine.retirement_stats();
    assert_eq!(retire.pending, 0, "{what}");
    assert!(
        staging.leased <= retire.retained,
        "{what}: {staging:?} {retire:?}"
    );
    assert_eq!(
        sim.device_live().0,
        1,
        "{what}: device memory beyond the tensor"
    );
    // Pinned: the ring's slots (some possibly retained) and the scalar slot; nothing else.
    assert!(
        sim.pinned_live().0 <= staging.slots + usize::from(staging.scalar_slot) + retire.retained,
        "{what}: pinned beyond the staging slots ({staging:?}, {retire:?})"
    );
    // The same transfer works again.
    let again = random_vec::<u32>(&mut rng, n);
    upload_tensor_into(&mut engine, &mut tensor, &again).unwrap();
    assert_eq!(
        download_tensor_into(&mut engine, &tensor, Vec::new()).unwrap(),
        again,
        "{what}"
    );
    drop(tensor);
    drop(engine);
    assert!(
        sim.violations().is_empty(),
        "{what}: {:?}",
        sim.violations()
    );
    assert_eq!(sim.device_live().0, 0, "{what}");
}

fn calls(upload: bool, n: usize, op: SimOp) -> u64 {
    let (mut engine, sim) = engine();
    let data = random_vec::<u32>(&mut Rng::new(3), n);
    let mut tensor = upload_tensor(&mut engine, &data, &[n]).unwrap();
    engine.synchronize().unwrap();
    let before = sim.calls(op);
    if upload {
        upload_tensor_into(&mut engine, &mut tensor, &data).unwrap();
    } else {
        download_tensor_into(&mut engine, &tensor, Vec::new()).unwrap();
    }
    sim.calls(op) - before
}

fn sweep(upload: bool, n: usize) -> usize {
    let copy = if upload {
        SimOp::CopyHtoD
    } else {
        SimOp::CopyDtoH
    };
    let faults = [
        (copy, DriverError::INVALID_VALUE),
        (SimOp::EventRecord, DriverError::UNKNOWN),
        (SimOp::EventSynchronize, DriverError::LAUNCH_FAILED),
    ];
    let mut runs = 0;
    for (op, error) in faults {
        let count = calls(upload, n, op);
        assert!(
            count >= 2,
            "upload={upload} n={n}: {op:?} called {count} times"
        );
        for nth in 1..=count {
            fault_case(upload, n, &[Fault::Call(op, nth, error)]);
            runs += 1;
        }
    }
    for nth in 1..=calls(upload, n, SimOp::EventRecord) {
        fault_case(upload, n, &[Fault::Untracked(nth)]);
        fault_case(upload, n, &[Fault::Event(nth)]);
        runs += 2;
    }
    runs
}

#[test]
fn a_fault_at_every_call_of_an_upload_that_fits_at_once_loses_nothing() {
    let n = 3 * CHUNK / 4 + 5;
    assert!(sweep(true, n) >= 12);
}

#[test]
fn a_fault_at_every_call_of_a_download_that_fits_at_once_loses_nothing() {
    let n = 3 * CHUNK / 4 + 5;
    assert!(sweep(false, n) >= 12);
}

/// Two faults in one download served at once: a failing event (a mark's or a chunk's) and a
/// refused host wait, at every pair of calls; nothing is freed early or leaked.
#[test]
fn two_faults_in_one_marked_download_lose_nothing() {
    let n = 3 * CHUNK / 4 + 5;
    let records = calls(false, n, SimOp::EventRecord);
    let waits = calls(false, n, SimOp::EventSynchronize);
    for event in 1..=records {
        for wait in 1..=waits {
            fault_case(
                false,
                n,
                &[
                    Fault::Event(event),
                    Fault::Call(SimOp::EventSynchronize, wait, DriverError::LAUNCH_FAILED),
                ],
            );
        }
    }
}

#[test]
fn a_slot_refused_up_front_leaves_nothing_leased() {
    let (mut engine, sim) = engine();
    let n = 3 * CHUNK / 4;
    let data = random_vec::<u32>(&mut Rng::new(5), n);
    let mut tensor = engine.alloc_tensor::<u32>(&[n]).unwrap();
    // The third slot's pinned allocation fails: the two leased before it go back.
    sim.fail_nth(SimOp::HostAlloc, 3, DriverError::OUT_OF_MEMORY);
    let refused = upload_tensor_into(&mut engine, &mut tensor, &data);
    assert!(matches!(refused, Err(Error::Driver { .. })), "{refused:?}");
    sim.clear_faults();
    assert_eq!(engine.staging_stats().leased, 0);
    upload_tensor_into(&mut engine, &mut tensor, &data).unwrap();
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), data);
}

/// Downloads that fit at once are queued in marked parts of 512 KiB and copied out part by
/// part: every element type, with totals one element either side of a part, of a chunk and of
/// the ring's depth, and a partial last part.
#[test]
fn marked_parts_copy_out_every_element_type_at_every_boundary() {
    fn case<T: crate::support::Reference + std::fmt::Debug>(
        engine: &mut CudaEngine,
        rng: &mut Rng,
    ) {
        const MARK: usize = 512 << 10;
        let size = std::mem::size_of::<T>();
        let (part, chunk) = (MARK / size, CHUNK / size);
        let totals = [
            chunk + 1,
            chunk + part - 1,
            chunk + part,
            chunk + part + 1,
            2 * chunk - 1,
            3 * chunk + part / 3,
            DEPTH * chunk,
        ];
        for n in totals {
            let data = random_vec::<T>(rng, n);
            let tensor = upload_tensor(engine, &data, &[n]).unwrap();
            let back = download_tensor(engine, &tensor).unwrap();
            crate::support::assert_same(&format!("{} n={n}", T::DTYPE), &back, &data);
            if T::DTYPE.any_bit_pattern() {
                let into = download_tensor_into(engine, &tensor, Vec::new()).unwrap();
                crate::support::assert_same(&format!("{} into n={n}", T::DTYPE), &into, &data);
            }
        }
    }
    let (mut engine, sim) = engine();
    let mut rng = Rng::new(29);
    case::<u8>(&mut engine, &mut rng);
    case::<bool>(&mut engine, &mut rng);
    case::<i16>(&mut engine, &mut rng);
    case::<half::f16>(&mut engine, &mut rng);
    case::<half::bf16>(&mut engine, &mut rng);
    case::<f32>(&mut engine, &mut rng);
    case::<i32>(&mut engine, &mut rng);
    case::<u64>(&mut engine, &mut rng);
    case::<f64>(&mut engine, &mut rng);
    engine.synchronize().unwrap();
    assert_eq!(engine.staging_stats().leased, 0);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// A driver that panics in the middle of a download served at once (while the calling thread
/// waits for a mark or a chunk) unwinds out of the route only after the copy threads have
/// stopped reading the slots, and nothing queued is released under the device.
#[test]
fn a_driver_panic_while_parts_are_copied_out_unwinds_cleanly() {
    let n = 3 * CHUNK / 4 + 5;
    let waits = calls(false, n, SimOp::EventSynchronize);
    assert!(waits >= 2, "{waits} waits");
    for nth in 1..=waits {
        let (mut engine, sim) = engine();
        let data = random_vec::<u32>(&mut Rng::new(nth), n);
        let tensor = upload_tensor(&mut engine, &data, &[n]).unwrap();
        engine.synchronize().unwrap();
        sim.panic_nth(SimOp::EventSynchronize, nth);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            download_tensor_into(&mut engine, &tensor, Vec::new())
        }));
        assert!(unwound.is_err(), "wait {nth}: the driver's panic surfaces");
        sim.clear_faults();
        let _ = engine.synchronize();
        assert!(
            sim.violations().is_empty(),
            "wait {nth}: {:?}",
            sim.violations()
        );
        // The engine still serves the same transfer.
        assert_eq!(
            download_tensor_into(&mut engine, &tensor, Vec::new()).unwrap(),
            data,
            "wait {nth}"
        );
        drop(tensor);
        drop(engine);
        assert!(
            sim.violations().is_empty(),
            "wait {nth}: {:?}",
            sim.violations()
        );
    }
}
