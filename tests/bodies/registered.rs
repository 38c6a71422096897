//! Registered buffers (a `Vec` page-locked in place) and the pending transfers over them, on
//! either device: round trips for every element type, the same allocation given back, refusals
//! that hand the `Vec` back, and a dropped in-flight transfer released after its copy.

use super::Device;
use crate::support::{Reference, Rng, assert_same, distinct_u32 as distinct, random_vec};
use cuferry::error::{DriverError, UsageError};
use cuferry::sim::SimOp;
use cuferry::{
    CudaEngine, Element, Error, RegisteredBuffer, SubmitError, download_pending, download_tensor,
    upload_pending, upload_tensor,
};

pub(crate) fn register_and_into_vec_give_back_the_same_vec(dev: Device) {
    let mut engine = dev.engine();
    let sim = engine.sim();
    let mut data = Vec::with_capacity(1000);
    data.extend(distinct(777));
    let (ptr, capacity) = (data.as_ptr(), data.capacity());
    let mut buffer = RegisteredBuffer::register(&mut engine, data).unwrap();
    assert_eq!((buffer.len(), buffer.byte_len()), (777, 777 * 4));
    assert!(!buffer.is_empty());
    // Simulator only: what the device has registered.
    if let Some(sim) = &sim {
        assert_eq!(sim.registered_live(), (1, 777 * 4), "only the elements");
        assert!(sim.is_registered(ptr.cast()));
    }
    assert_eq!(buffer.as_slice(), distinct(777));
    buffer.as_mut_slice()[5] = 5;
    let back = buffer.into_vec().unwrap();
    assert_eq!(
        (back.as_ptr(), back.len(), back.capacity()),
        (ptr, 777, capacity)
    );
    let mut expected = distinct(777);
    expected[5] = 5;
    assert_eq!(back, expected);
    if let Some(sim) = &sim {
        assert_eq!(sim.registered_live(), (0, 0));
        assert_eq!(
            (
                sim.calls(SimOp::HostRegister),
                sim.calls(SimOp::HostUnregister)
            ),
            (1, 1)
        );
        assert_eq!(sim.pinned_live(), (0, 0), "no pinned memory was involved");
    }
    Device::no_violations(&engine);
}

/// One upload and one download through registered buffers of `n` elements of `T`, data checked.
fn round_trip<T: Reference>(engine: &mut CudaEngine, rng: &mut Rng, n: usize) {
    let what = format!("{} n={n}", T::DTYPE.name());
    let data = random_vec::<T>(rng, n);
    let source = RegisteredBuffer::register(engine, data.clone()).unwrap();
    let dest = engine.alloc_tensor::<T>(&[n]).unwrap();
    let (source, tensor) = upload_pending(engine, source, dest)
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_same(
        &format!("upload {what}"),
        &download_tensor(engine, &tensor).unwrap(),
        &data,
    );
    assert_same(
        &format!("source {what}"),
        &source.into_vec().unwrap(),
        &data,
    );

    let other = random_vec::<T>(rng, n);
    let value = upload_tensor(engine, &other, &[n]).unwrap();
    let target = RegisteredBuffer::register(engine, data.clone()).unwrap();
    let submitted = download_pending(engine, value, target);
    if !T::DTYPE.any_bit_pattern() {
        // As for pinned buffers: raw device bytes need not be valid `bool`s.
        match submitted {
            Err(SubmitError::Rejected {
                input: package,
                error: Error::Usage(UsageError::UnsupportedElement { .. }),
            }) => assert_same(
                &format!("refused download {what}"),
                &package.1.into_vec().unwrap(),
                &data,
            ),
            other => panic!("{what}: expected UnsupportedElement, got {other:?}"),
        }
        return;
    }
    let (_, target) = submitted.unwrap().wait().unwrap().into_parts();
    assert_same(&format!("download {what}"), target.as_slice(), &other);
    assert_same(
        &format!("download {what}"),
        &target.into_vec().unwrap(),
        &other,
    );
}

pub(crate) fn round_trips_for_every_element_type_at_every_size(dev: Device) {
    let mut engine = dev.engine();
    let mut rng = Rng::new(12);
    crate::for_each_element!(T => {
        let size = T::DTYPE.size_bytes();
        for bytes in [1usize, 16, 17, (3 << 20) + 5] {
            round_trip::<T>(&mut engine, &mut rng, bytes.div_ceil(size));
        }
    });
    engine.synchronize().unwrap();
    if let Some(sim) = engine.sim() {
        assert_eq!(sim.registered_live(), (0, 0));
    }
    Device::no_violations(&engine);
}

pub(crate) fn resubmission_registers_nothing_more(dev: Device) {
    let mut engine = dev.engine();
    let sim = engine.sim();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(256)).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[256]).unwrap();
    let mut returned = upload_pending(&mut engine, buffer, dest)
        .unwrap()
        .wait()
        .unwrap();
    download_tensor(&mut engine, returned.tensor()).unwrap();
    // Simulator only: the driver calls are counted.
    let ops = [
        SimOp::HostRegister,
        SimOp::HostAlloc,
        SimOp::Alloc,
        SimOp::EventCreate,
    ];
    let calls = sim.as_ref().map(|sim| ops.map(|op| sim.calls(op)));
    for round in 0..4u32 {
        let data: Vec<u32> = (0..256).map(|i| i * 3 + round + 1).collect();
        returned.buffer_mut().as_mut_slice().copy_from_slice(&data);
        returned = returned.resubmit(&mut engine).unwrap().wait().unwrap();
        assert_eq!(
            download_tensor(&mut engine, returned.tensor()).unwrap(),
            data
        );
    }
    let after = sim.as_ref().map(|sim| ops.map(|op| sim.calls(op)));
    assert_eq!(after, calls);
}

pub(crate) fn an_empty_vec_is_refused_and_comes_back(dev: Device) {
    let mut engine = dev.engine();
    let empty: Vec<f32> = Vec::with_capacity(12);
    let ptr = empty.as_ptr();
    let refused = RegisteredBuffer::register(&mut engine, empty).unwrap_err();
    assert!(
        matches!(refused.error(), Error::Usage(UsageError::ZeroLength { .. })),
        "{refused}"
    );
    let back = refused.into_input().expect("handed back");
    assert_eq!((back.as_ptr(), back.capacity()), (ptr, 12));
    if let Some(sim) = engine.sim() {
        assert_eq!(sim.calls(SimOp::HostRegister), 0);
    }
}

pub(crate) fn rejected_submissions_give_the_buffer_back(dev: Device) {
    let mut engine = dev.engine();
    let sim = engine.sim();
    let buffer = RegisteredBuffer::register(&mut engine, distinct(10)).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[11]).unwrap();
    let queued = sim.as_ref().map(|sim| sim.queued());
    let package = match upload_pending(&mut engine, buffer, dest) {
        Err(SubmitError::Rejected {
            input: package,
            error:
                Error::Usage(UsageError::LengthMismatch {
                    found: 10,
                    expected: 11,
                    ..
                }),
        }) => package,
        other => panic!("expected a length mismatch, got {other:?}"),
    };
    assert_eq!(
        sim.as_ref().map(|sim| sim.queued()),
        queued,
        "nothing was queued"
    );
    assert_eq!(package.0.as_slice(), distinct(10));

    // A buffer of another engine.
    let mut other = dev.engine();
    let foreign = other.alloc_tensor::<u32>(&[10]).unwrap();
    let err = upload_pending(&mut other, package.0, foreign).unwrap_err();
    assert!(
        matches!(err.error(), Error::Usage(UsageError::WrongEngine { .. })),
        "{}",
        err.error()
    );
    let back = err.into_input().unwrap().0.into_vec().unwrap();
    assert_eq!(back, distinct(10));
}

/// Registers `data`, uploads it with a pending upload, overwrites the buffer, downloads the
/// tensor back into it with a pending download, and takes the `Vec` back: every step's data is
/// checked, and the `Vec` that comes back is the allocation that went in.
fn same_allocation_round_trip<T: Element>(engine: &mut CudaEngine, data: Vec<T>, poison: T) {
    let what = format!("{} x {}", data.len(), T::DTYPE.name());
    let expected = data.clone();
    let (ptr, len, capacity) = (data.as_ptr(), data.len(), data.capacity());
    let buffer = RegisteredBuffer::register(engine, data).unwrap();
    let dest = engine.alloc_tensor::<T>(&[len]).unwrap();
    let (mut buffer, tensor) = upload_pending(engine, buffer, dest)
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert!(
        download_tensor(engine, &tensor).unwrap() == expected,
        "{what}: the upload"
    );
    buffer.as_mut_slice().fill(poison);
    let sim = engine.sim();
    // Simulator only: the clock is held, so the download is surely still queued at the poll.
    if let Some(sim) = &sim {
        sim.hold_clock(true);
    }
    let mut pending = download_pending(engine, tensor, buffer).unwrap();
    if len * T::DTYPE.size_bytes() >= 64 << 20 {
        assert!(
            !pending.is_ready().unwrap(),
            "{what}: a 64 MiB copy cannot finish before the first poll"
        );
    }
    if let Some(sim) = &sim {
        sim.hold_clock(false);
    }
    let (_tensor, buffer) = pending.wait().unwrap().into_parts();
    assert!(buffer.as_slice() == expected, "{what}: the download");
    let back = buffer.into_vec().unwrap();
    assert_eq!(
        (back.as_ptr(), back.len(), back.capacity()),
        (ptr, len, capacity),
        "{what}: the same allocation"
    );
    assert!(back == expected, "{what}: the Vec that came back");
}

pub(crate) fn registered_vecs_round_trip_and_come_back_as_the_same_allocation(dev: Device) {
    let mut engine = dev.engine();
    // 16 B and 17 B, either side of the blocking routes' smallest band.
    same_allocation_round_trip(&mut engine, vec![1.5f32, -2.25, 3.0, 4.75], 0.0);
    same_allocation_round_trip(&mut engine, (1..=17u8).collect(), 0);
    for mib in [8usize, 64] {
        let n = (mib << 20) / 4;
        let data: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761) | 1)
            .collect();
        same_allocation_round_trip(&mut engine, data, 0);
        let data: Vec<f64> = (0..n / 2).map(|i| i as f64 * 0.25 + 1.0).collect();
        same_allocation_round_trip(&mut engine, data, -1.0);
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

/// A transfer dropped in flight keeps its registered buffer until the copy is proven complete:
/// the retirement queue releases it (unregisters and frees it) at the engine's next boundary
/// after the copy, and reports nothing.
pub(crate) fn a_dropped_in_flight_transfer_releases_its_registered_buffer_after_the_copy(
    dev: Device,
) {
    let mut engine = dev.engine();
    let n = (64 << 20) / 4;
    let data: Vec<u32> = (0..n as u32).map(|i| i ^ 0x5A5A_5A5A).collect();
    let buffer = RegisteredBuffer::register(&mut engine, data).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[n]).unwrap();
    drop(upload_pending(&mut engine, buffer, dest).unwrap());
    assert_eq!(engine.retirement_stats().pending, 1);
    engine.synchronize().unwrap();
    let stats = engine.retirement_stats();
    assert_eq!((stats.pending, stats.released, stats.retained), (0, 1, 0));
    engine.synchronize().unwrap();
    if let Some(sim) = engine.sim() {
        assert_eq!(sim.registered_live(), (0, 0));
    }
    Device::no_violations(&engine);
}

/// Two small `Vec`s usually share a page of the allocator's memory. The driver locks whole
/// pages, so registering the second may be refused; either way nothing is lost: a refusal is a
/// typed error that hands the `Vec` back.
pub(crate) fn two_small_vecs_registered_at_once(dev: Device) {
    let mut engine = dev.engine();
    let a = RegisteredBuffer::register(&mut engine, vec![1u8; 64]).unwrap();
    let b = vec![2u8; 64];
    let same_page = (a.as_slice().as_ptr() as usize >> 12) == (b.as_ptr() as usize >> 12);
    match RegisteredBuffer::register(&mut engine, b) {
        Ok(b) => {
            eprintln!("two 64 B Vecs registered at once (same page: {same_page})");
            assert_eq!(b.into_vec().unwrap(), vec![2u8; 64]);
        }
        Err(refused) => {
            eprintln!(
                "the second 64 B Vec was refused (same page: {same_page}): {}",
                refused.error()
            );
            assert!(matches!(
                refused.error(),
                Error::Driver {
                    call: "cuMemHostRegister",
                    source,
                } if *source != DriverError::UNKNOWN
            ));
            assert_eq!(refused.into_input(), Some(vec![2u8; 64]));
        }
    }
    assert_eq!(a.into_vec().unwrap(), vec![1u8; 64]);
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; registered::{
            register_and_into_vec_give_back_the_same_vec,
            round_trips_for_every_element_type_at_every_size,
            resubmission_registers_nothing_more,
            an_empty_vec_is_refused_and_comes_back,
            rejected_submissions_give_the_buffer_back,
            registered_vecs_round_trip_and_come_back_as_the_same_allocation,
            a_dropped_in_flight_transfer_releases_its_registered_buffer_after_the_copy,
            two_small_vecs_registered_at_once,
        });
    };
}
pub(crate) use tests;
