//! Elementwise kernels on the GPU against the host reference, for every element type each
//! operation serves, and every cast.

use crate::engine;
use crate::reference::{Reference, Rng, check_casts_from, check_ops};
use cuferry::{download_tensor, upload_tensor};

fn ops_for<T: Reference>(seed: u64) {
    let mut engine = engine();
    let mut rng = Rng::new(seed);
    for n in [1, 2, 255, 256, 257, 100_003] {
        check_ops::<T>(&mut engine, &mut rng, n);
    }
    engine.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_operation_matches_the_host_reference_for_every_element() {
    let mut seed = 1000;
    crate::for_each_element!(T => {
        seed += 1;
        ops_for::<T>(seed);
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_cast_matches_the_host_reference() {
    let mut engine = engine();
    let mut rng = Rng::new(2000);
    crate::for_each_element!(T => {
        for n in [1, 4099] {
            check_casts_from::<T>(&mut engine, &mut rng, n);
        }
    });
    engine.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_chain_of_dependent_adds_runs_without_a_host_wait_and_in_order() {
    let mut engine = engine();
    let mut rng = Rng::new(3000);
    let n = 1 << 20;
    let host: Vec<f32> = (0..n).map(|_| (rng.unit() * 4.0) as f32).collect();
    let seed = upload_tensor(&mut engine, &host, &[n]).unwrap();
    let mut state = engine.add(&seed, &seed).unwrap();
    for _ in 0..9 {
        state = engine.add(&state, &state).unwrap();
    }
    engine.flush().unwrap();
    let got = download_tensor(&mut engine, &state).unwrap();
    let want: Vec<f32> = host.iter().map(|x| x * 1024.0).collect();
    assert_eq!(got, want);
    assert_eq!(engine.cached_kernels(), 1);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_launch_larger_than_one_grid_covers_every_element() {
    // 2^20 blocks of 256 threads cover 2^28 elements; the grid-stride loop covers the rest.
    let mut engine = engine();
    let n = (1usize << 28) + 4099;
    let mut t = engine.full(&[n], 3u8).unwrap();
    let ones = engine.full(&[n], 1u8).unwrap();
    t = engine.add(&t, &ones).unwrap();
    let got = download_tensor(&mut engine, &t).unwrap();
    assert!(got.iter().all(|&x| x == 4), "an element was not written");
}
