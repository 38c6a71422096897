//! Pinned buffers and pending transfers, on either device: copies seen in flight then correct,
//! independent completions, refused packages handed back untouched, every element's bytes, and
//! an engine dropped with transfers in flight.

use super::Device;
use crate::support::distinct_u32 as distinct;
use cuferry::error::UsageError;
use cuferry::{
    CudaEngine, Element, Error, PinnedHostBuffer, SubmitError, bf16, download_pending,
    download_tensor, download_tensor_into, f16, upload_pending, upload_tensor,
};

const BIG: usize = 64 << 20; // bytes

/// Per-index distinct values: never zeros, never repeating within 2^24.
fn distinct_f32(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i % (1 << 24)) as f32 * 0.5 + 1.0).collect()
}

/// On the simulator, holds (or frees) its clock: a copy then surely stays queued until freed.
/// On a GPU, a 64 MiB copy is still running at the first poll.
fn hold_clock(engine: &CudaEngine, held: bool) {
    if let Some(sim) = engine.sim() {
        sim.hold_clock(held);
    }
}

pub(crate) fn a_64_mib_pending_download_is_seen_in_flight_then_correct(dev: Device) {
    let mut engine = dev.engine();
    let n = BIG / 4;
    let data = distinct_f32(n);
    let value = upload_tensor(&mut engine, &data, &[n]).unwrap();
    let mut buffer = PinnedHostBuffer::<f32>::new(&mut engine, n).unwrap();
    buffer.as_mut_slice().fill(-1.0); // poison
    hold_clock(&engine, true);
    let mut pending = download_pending(&mut engine, value, buffer).unwrap();
    let ready = pending.is_ready().unwrap();
    hold_clock(&engine, false);
    assert!(!ready, "a 64 MiB copy cannot finish before the first poll");
    let returned = pending.wait().unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..]);
    Device::no_violations(&engine);
}

pub(crate) fn a_64_mib_pending_upload_is_seen_in_flight_then_correct(dev: Device) {
    let mut engine = dev.engine();
    let n = BIG / 4;
    let data = distinct_f32(n);
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<f32>(&[n]).unwrap();
    hold_clock(&engine, true);
    let mut pending = upload_pending(&mut engine, source, dest).unwrap();
    let ready = pending.is_ready().unwrap();
    hold_clock(&engine, false);
    assert!(!ready);
    let (_, tensor) = pending.wait().unwrap().into_parts();
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), data);
    Device::no_violations(&engine);
}

pub(crate) fn two_transfers_in_flight_complete_independently(dev: Device) {
    let mut engine = dev.engine();
    let n = BIG / 4;
    let a = distinct_f32(n);
    let b: Vec<f32> = a.iter().map(|x| -x).collect();
    let ta = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let tb = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let pa = PinnedHostBuffer::from_slice(&mut engine, &a).unwrap();
    let pb = PinnedHostBuffer::from_slice(&mut engine, &b).unwrap();
    let first = upload_pending(&mut engine, pa, ta).unwrap();
    let mut second = upload_pending(&mut engine, pb, tb).unwrap();
    let first = first.wait().unwrap();
    // The second may or may not be done; either way it completes on its own wait.
    let _ = second.is_ready().unwrap();
    let second = second.wait().unwrap();
    assert_eq!(download_tensor(&mut engine, first.tensor()).unwrap(), a);
    assert_eq!(download_tensor(&mut engine, second.tensor()).unwrap(), b);
    Device::no_violations(&engine);
}

pub(crate) fn rejected_packages_come_back_untouched(dev: Device) {
    let mut engine = dev.engine();
    let sim = engine.sim();
    let data = distinct(10);
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<u32>(&[11]).unwrap();
    let queued = sim.as_ref().map(|sim| sim.queued());
    let err = upload_pending(&mut engine, buffer, dest).unwrap_err();
    assert_eq!(
        sim.as_ref().map(|sim| sim.queued()),
        queued,
        "nothing was queued"
    );
    let SubmitError::Rejected {
        input: package,
        error,
    } = err
    else {
        panic!("expected a rejection");
    };
    assert!(
        matches!(
            error,
            Error::Usage(UsageError::LengthMismatch {
                found: 10,
                expected: 11,
                ..
            })
        ),
        "{error}"
    );
    assert_eq!(package.0.as_slice(), &data[..]);
    assert_eq!(package.1.len(), 11);

    // Another engine's tensor.
    let mut other = dev.engine();
    let foreign = other.alloc_tensor::<u32>(&[10]).unwrap();
    let err = download_pending(&mut engine, foreign, package.0).unwrap_err();
    assert!(matches!(
        err,
        SubmitError::Rejected {
            error: Error::Usage(UsageError::WrongEngine { .. }),
            ..
        }
    ));
    let package = err.into_input().unwrap();
    assert_eq!(package.1.as_slice(), &data[..]);

    // bool downloads expose raw bytes: refused.
    let flags = upload_tensor(&mut engine, &[true, false], &[2]).unwrap();
    let bbuf = PinnedHostBuffer::<bool>::new(&mut engine, 2).unwrap();
    assert!(matches!(
        download_pending(&mut engine, flags, bbuf),
        Err(SubmitError::Rejected {
            error: Error::Usage(UsageError::UnsupportedElement { .. }),
            ..
        })
    ));

    // A longer buffer, then its tensor and buffer handed to another engine.
    let data = distinct_f32(1000);
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<f32>(&[999]).unwrap();
    let err = upload_pending(&mut engine, buffer, dest).unwrap_err();
    let SubmitError::Rejected {
        input: package,
        error,
    } = err
    else {
        panic!("expected a rejection, got {err}");
    };
    assert!(
        matches!(
            error,
            Error::Usage(UsageError::LengthMismatch {
                found: 1000,
                expected: 999,
                ..
            })
        ),
        "{error}"
    );
    assert_eq!(package.0.as_slice(), &data[..]);
    let err = download_pending(&mut other, package.1, package.0).unwrap_err();
    assert!(matches!(
        err,
        SubmitError::Rejected {
            error: Error::Usage(UsageError::WrongEngine { .. }),
            ..
        }
    ));
    assert_eq!(err.into_input().unwrap().1.as_slice(), &data[..]);
}

fn round_trip<T: Element>(engine: &mut CudaEngine, make: impl Fn(usize) -> T) {
    for n in [1usize, 3, 4096 + 5] {
        let data: Vec<T> = (0..n).map(&make).collect();
        let source = PinnedHostBuffer::from_slice(engine, &data).unwrap();
        let dest = engine.alloc_tensor::<T>(&[n]).unwrap();
        let (_, tensor) = upload_pending(engine, source, dest)
            .unwrap()
            .wait()
            .unwrap()
            .into_parts();
        if T::DTYPE.any_bit_pattern() {
            let buffer = PinnedHostBuffer::<T>::new(engine, n).unwrap();
            let back = download_pending(engine, tensor, buffer)
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(back.buffer().as_slice(), &data[..], "{} n={n}", T::DTYPE);
        } else {
            assert_eq!(
                download_tensor(engine, &tensor).unwrap(),
                data,
                "{} n={n}",
                T::DTYPE
            );
        }
    }
}

pub(crate) fn pinned_bytes_round_trip_for_every_element(dev: Device) {
    let mut e = dev.engine();
    round_trip(&mut e, |i| i as f32 * 0.75 + 1.0);
    round_trip(&mut e, |i| i as f64 * -1.25 + 3.0);
    round_trip(&mut e, |i| f16::from_f32((i % 1000) as f32 * 0.5 + 1.0));
    round_trip(&mut e, |i| bf16::from_f32((i % 1000) as f32 * 0.5 + 1.0));
    round_trip(&mut e, |i| ((i % 251) as i8).wrapping_sub(120));
    round_trip(&mut e, |i| (i * 7) as i16 - 1000);
    round_trip(&mut e, |i| (i * 13) as i32 - 100_000);
    round_trip(&mut e, |i| (i as i64) * -1_000_003 + 5);
    round_trip(&mut e, |i| (i * 3 + 1) as u8);
    round_trip(&mut e, |i| (i * 5 + 1) as u16);
    round_trip(&mut e, |i| (i as u32).wrapping_mul(2_654_435_761) | 1);
    round_trip(&mut e, |i| (i as u64) << 33 | 7);
    round_trip(&mut e, |i| i % 3 == 1);
    Device::no_violations(&e);
}

pub(crate) fn download_tensor_into_reuses_its_capacity(dev: Device) {
    let mut engine = dev.engine();
    let n = (8 << 20) / 4;
    let data = distinct_f32(n);
    let t = upload_tensor(&mut engine, &data, &[n]).unwrap();
    let mut out = Vec::with_capacity(n);
    out.push(-1.0f32);
    let ptr = out.as_ptr();
    for _ in 0..3 {
        out = download_tensor_into(&mut engine, &t, out).unwrap();
        assert_eq!(out, data);
        assert_eq!(out.as_ptr(), ptr);
    }
}

pub(crate) fn download_tensor_into_reuses_capacity(dev: Device) {
    let mut engine = dev.engine();
    let data = distinct(1000);
    let t = upload_tensor(&mut engine, &data, &[1000]).unwrap();
    let mut out = Vec::with_capacity(4096);
    out.extend_from_slice(&[7u32; 17]);
    let ptr = out.as_ptr();
    let out = download_tensor_into(&mut engine, &t, out).unwrap();
    assert_eq!(out, data);
    assert_eq!(out.as_ptr(), ptr, "no reallocation");
    let small = upload_tensor(&mut engine, &distinct(3), &[3]).unwrap();
    let out = download_tensor_into(&mut engine, &small, out).unwrap();
    assert_eq!(out, distinct(3));
    assert_eq!(out.as_ptr(), ptr);
}

pub(crate) fn an_engine_dropped_while_handles_are_in_flight(dev: Device) {
    let mut engine = dev.engine();
    let sim = engine.sim();
    let n = BIG / 4;
    let data = distinct_f32(n);
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let dest = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let kept = upload_pending(&mut engine, source, dest).unwrap();
    let value = upload_tensor(&mut engine, &data, &[n]).unwrap();
    let buffer = PinnedHostBuffer::<f32>::new(&mut engine, n).unwrap();
    let detached = download_pending(&mut engine, value, buffer).unwrap();
    drop(detached);
    drop(engine);
    let returned = kept.wait().unwrap();
    assert_eq!(returned.buffer().as_slice(), &data[..]);
    let (buffer, tensor) = returned.into_parts();
    drop(tensor);
    drop(buffer);
    if let Some(sim) = sim {
        sim.advance_all();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }
}

pub(crate) fn a_zero_length_pinned_buffer_is_a_typed_error(dev: Device) {
    let mut engine = dev.engine();
    assert!(matches!(
        PinnedHostBuffer::<f32>::new(&mut engine, 0),
        Err(Error::Usage(UsageError::ZeroLength { .. }))
    ));
}

pub(crate) fn a_download_hands_back_its_parts_source_first(dev: Device) {
    let mut engine = dev.engine();
    let tensor = upload_tensor(&mut engine, &distinct(5), &[5]).unwrap();
    let buffer = PinnedHostBuffer::<u32>::new(&mut engine, 5).unwrap();
    let download = download_pending(&mut engine, tensor, buffer).unwrap();
    let (tensor, buffer) = download.wait().unwrap().into_parts();
    assert_eq!(buffer.as_slice(), distinct(5));
    assert_eq!(tensor.shape(), [5]);
    let download = download_pending(&mut engine, tensor, buffer).unwrap();
    let returned = download.wait().unwrap();
    let (tensor, buffer) = returned
        .resubmit(&mut engine)
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_eq!((tensor.len(), buffer.as_slice()), (5, &distinct(5)[..]));
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; pending::{
            a_64_mib_pending_download_is_seen_in_flight_then_correct,
            a_64_mib_pending_upload_is_seen_in_flight_then_correct,
            two_transfers_in_flight_complete_independently,
            rejected_packages_come_back_untouched,
            pinned_bytes_round_trip_for_every_element,
            download_tensor_into_reuses_its_capacity,
            download_tensor_into_reuses_capacity,
            an_engine_dropped_while_handles_are_in_flight,
            a_zero_length_pinned_buffer_is_a_typed_error,
            a_download_hands_back_its_parts_source_first,
        });
    };
}
pub(crate) use tests;
