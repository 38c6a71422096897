//! Blocking transfers whose chunks all fit in the staging ring at once, on either device: the
//! host copies of the whole transfer run as one parallel region and each chunk is queued (or
//! copied out) as soon as it is ready. Both binaries size the copy pool at four threads
//! (`support::copy_threads`), so the parallel path runs whatever the machine's core count.

use super::Device;
use crate::support::{Rng, random_vec};
use cuferry::{
    CudaEngine, download_tensor, download_tensor_into, staging::StagingConfig, upload_tensor,
    upload_tensor_into,
};

pub(crate) const CHUNK: usize = 1 << 20;
pub(crate) const DEPTH: usize = 4;

/// An engine with 1 MiB chunks, a ring of [`DEPTH`] and four copy threads.
pub(crate) fn ring_engine(dev: Device) -> CudaEngine {
    // The binary runs with four copy threads (`support::copy_threads`).
    assert!(cuferry::staging::copy_threads() >= 2);
    let mut engine = dev.engine();
    let mut config = StagingConfig::default();
    config.chunk_bytes = CHUNK;
    config.cutoff_bytes = 64 << 10;
    config.ring_depth = DEPTH;
    config.copy_threads = 4;
    engine.set_staging_config(config).unwrap();
    engine
}

/// Element counts (of 4-byte elements) from two chunks to exactly the ring's depth, with
/// remainders, and one past it (the chunk-by-chunk pipeline).
pub(crate) fn sizes() -> Vec<usize> {
    let e = CHUNK / 4;
    vec![
        2 * e,
        2 * e + 1,
        3 * e + e / 2 + 1,
        4 * e - 1,
        4 * e,
        4 * e + 1,
    ]
}

pub(crate) fn every_direction_moves_the_right_bytes_around_the_ring_depth(dev: Device) {
    let mut engine = ring_engine(dev);
    assert_eq!(cuferry::staging::copy_threads(), 4);
    let mut rng = Rng::new(11);
    for n in sizes() {
        let data = random_vec::<u32>(&mut rng, n);
        let fresh = upload_tensor(&mut engine, &data, &[n]).unwrap();
        assert_eq!(download_tensor(&mut engine, &fresh).unwrap(), data, "n={n}");
        let mut kept = engine.alloc_tensor::<u32>(&[n]).unwrap();
        let again = random_vec::<u32>(&mut rng, n);
        upload_tensor_into(&mut engine, &mut kept, &again).unwrap();
        let out = download_tensor_into(&mut engine, &kept, Vec::new()).unwrap();
        assert_eq!(out, again, "n={n}");
        // bool: decoded byte by byte on the way down.
        let flags: Vec<bool> = (0..n).map(|i| i % 3 == 0).collect();
        let t = upload_tensor(&mut engine, &flags, &[n]).unwrap();
        assert_eq!(download_tensor(&mut engine, &t).unwrap(), flags, "n={n}");
        // f64: two chunks' worth of bytes per 4-byte count.
        let wide = random_vec::<f64>(&mut rng, n);
        let t = upload_tensor(&mut engine, &wide, &[n]).unwrap();
        let back = download_tensor(&mut engine, &t).unwrap();
        assert!(
            back.iter()
                .zip(&wide)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "n={n}"
        );
    }
    engine.synchronize().unwrap();
    assert_eq!(engine.staging_stats().leased, 0);
    Device::no_violations(&engine);
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; transfers::{
            every_direction_moves_the_right_bytes_around_the_ring_depth,
        });
    };
}
pub(crate) use tests;
