//! The blocking routes' staging pipeline on a real device.

use crate::common::open;
use crate::reference::{Reference, Rng, assert_same, random_vec};
use cuferry::{
    CudaEngine, Element, bf16, download_tensor, download_tensor_into, f16, upload_tensor,
    upload_tensor_into,
};

// Written once in `tests/bodies/staging.rs`, run here on device 0 and by the simulator binary.
crate::bodies::staging::tests!(gpu);

fn sizes(engine: &CudaEngine, size: usize) -> Vec<usize> {
    let c = engine.staging_config();
    let e = |bytes: usize| bytes / size;
    let mut v = vec![
        0,
        1,
        e(16),
        e(16) + 1,
        e(c.cutoff_bytes) - 1,
        e(c.cutoff_bytes),
        e(c.cutoff_bytes) + 1,
    ];
    // Transfers served at once, downloaded in marked parts of 512 KiB: a partial last part,
    // and one element either side of a whole number of parts.
    v.extend([e(3 << 19) + 1, e(8 << 20) - 1, e(8 << 20) + 3]);
    v.extend([e(c.chunk_bytes) - 1, e(c.chunk_bytes), e(c.chunk_bytes) + 1]);
    v.push(e(c.chunk_bytes) * (c.ring_depth * 2 + 1) + 5);
    v.retain(|&n| n > 0 || size == 1);
    v.sort_unstable();
    v.dedup();
    v
}

fn check<T: Element>(engine: &mut CudaEngine, make: impl Fn(usize) -> T) {
    for n in sizes(engine, T::DTYPE.size_bytes()) {
        let data: Vec<T> = (0..n).map(&make).collect();
        let t = upload_tensor(engine, &data, &[n]).unwrap();
        assert_eq!(
            download_tensor(engine, &t).unwrap(),
            data,
            "{} n={n}",
            T::DTYPE
        );
        if T::DTYPE.any_bit_pattern() {
            let out = download_tensor_into(engine, &t, Vec::new()).unwrap();
            assert_eq!(out, data, "{} into n={n}", T::DTYPE);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_element_round_trips_at_every_boundary() {
    let mut e = open();
    check(&mut e, |i| i as f32 * 0.5 + 1.0);
    check(&mut e, |i| i as f64 * -0.25 + 2.0);
    check(&mut e, |i| f16::from_f32((i % 2000) as f32 + 1.0));
    check(&mut e, |i| bf16::from_f32((i % 200) as f32 + 1.0));
    check(&mut e, |i| ((i % 255) as i16 - 127) as i8);
    check(&mut e, |i| ((i % 30000) as i32 - 15000) as i16);
    check(&mut e, |i| i as i32 * 3 - 7);
    check(&mut e, |i| i as i64 * -5 + 11);
    check(&mut e, |i| (i % 251) as u8 + 1);
    check(&mut e, |i| (i % 60000) as u16 + 1);
    check(&mut e, |i| (i as u32).wrapping_mul(2_654_435_761) | 1);
    check(&mut e, |i| (i as u64) << 20 | 3);
    check(&mut e, |i| i % 3 != 1);
    let stats = e.staging_stats();
    assert_eq!(stats.leased, 0);
    assert!(stats.slots <= e.staging_config().ring_depth);
}

/// Uploads fresh random values into one tensor per size, twice (the second overwrites the first),
/// and reads each back.
fn upload_into<T: Reference>(engine: &mut CudaEngine, rng: &mut Rng) {
    let mut counts = sizes(engine, T::DTYPE.size_bytes());
    if counts.first() != Some(&0) {
        counts.insert(0, 0);
    }
    for n in counts {
        let mut tensor = engine.alloc_tensor::<T>(&[n]).unwrap();
        for round in 0..2 {
            let what = format!("{} n={n} round {round}", T::DTYPE);
            let data = random_vec::<T>(rng, n);
            upload_tensor_into(engine, &mut tensor, &data).unwrap();
            assert_same(&what, &download_tensor(engine, &tensor).unwrap(), &data);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_element_uploads_into_an_existing_tensor_at_every_boundary() {
    let mut e = open();
    let mut rng = Rng::new(0x1_0ad);
    crate::for_each_element!(T => {
        upload_into::<T>(&mut e, &mut rng);
    });
    let stats = e.staging_stats();
    assert_eq!(stats.leased, 0);
    assert!(stats.slots <= e.staging_config().ring_depth);
    e.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn four_threads_each_with_its_own_engine() {
    std::thread::scope(|s| {
        for t in 0..4u32 {
            s.spawn(move || {
                let mut engine = open();
                for round in 0..3u32 {
                    let n = (48 << 20) / 4 + 7;
                    let data: Vec<u32> = (0..n as u32)
                        .map(|i| i.wrapping_mul(4) + t + round * 7 + 1)
                        .collect();
                    let x = upload_tensor(&mut engine, &data, &[n]).unwrap();
                    assert_eq!(
                        download_tensor(&mut engine, &x).unwrap(),
                        data,
                        "thread {t} round {round}"
                    );
                }
            });
        }
    });
}
