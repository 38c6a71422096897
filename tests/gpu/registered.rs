//! Registered buffers on a real device: `Vec`s page-locked in place, round-tripped through the
//! pending routes, and given back as the same allocation.

use crate::common::open;
use cuferry::{
    CudaEngine, Element, Error, RegisteredBuffer, download_pending, download_tensor,
    error::DriverError, upload_pending,
};

/// Registers `data`, uploads it with a pending upload, overwrites the buffer, downloads the
/// tensor back into it with a pending download, and takes the `Vec` back: every step's data is
/// checked, and the `Vec` that comes back is the allocation that went in.
fn round_trip<T: Element>(engine: &mut CudaEngine, data: Vec<T>, poison: T) {
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
    let mut pending = download_pending(engine, tensor, buffer).unwrap();
    if len * T::DTYPE.size_bytes() >= 64 << 20 {
        assert!(
            !pending.is_ready().unwrap(),
            "{what}: a 64 MiB copy cannot finish before the first poll"
        );
    }
    let (buffer, _tensor) = pending.wait().unwrap().into_parts();
    assert!(buffer.as_slice() == expected, "{what}: the download");
    let back = buffer.into_vec().unwrap();
    assert_eq!(
        (back.as_ptr(), back.len(), back.capacity()),
        (ptr, len, capacity),
        "{what}: the same allocation"
    );
    assert!(back == expected, "{what}: the Vec that came back");
}

#[test]
#[ignore = "needs a CUDA device"]
fn registered_vecs_round_trip_and_come_back_as_the_same_allocation() {
    let mut engine = open();
    // 16 B and 17 B, either side of the blocking routes' smallest band.
    round_trip(&mut engine, vec![1.5f32, -2.25, 3.0, 4.75], 0.0);
    round_trip(&mut engine, (1..=17u8).collect(), 0);
    for mib in [8usize, 64] {
        let n = (mib << 20) / 4;
        let data: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761) | 1)
            .collect();
        round_trip(&mut engine, data, 0);
        let data: Vec<f64> = (0..n / 2).map(|i| i as f64 * 0.25 + 1.0).collect();
        round_trip(&mut engine, data, -1.0);
    }
    engine.synchronize().unwrap();
}

/// A transfer dropped in flight keeps its registered buffer until the copy is proven complete:
/// the retirement queue releases it (unregisters and frees it) at the engine's next boundary
/// after the copy, and reports nothing.
#[test]
#[ignore = "needs a CUDA device"]
fn a_dropped_in_flight_transfer_releases_its_registered_buffer_after_the_copy() {
    let mut engine = open();
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
}

/// Two small `Vec`s usually share a page of the allocator's memory. The driver locks whole
/// pages, so registering the second may be refused; either way nothing is lost: a refusal is a
/// typed error that hands the `Vec` back.
#[test]
#[ignore = "needs a CUDA device"]
fn two_small_vecs_registered_at_once() {
    let mut engine = open();
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
