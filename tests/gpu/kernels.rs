//! Elementwise kernels on the GPU against the host reference, for every element type each
//! operation serves, and every cast.

use crate::engine;
use cuferry::download_tensor;

// Written once in `tests/bodies/kernels.rs`, run here on device 0 and by the simulator binary.
crate::bodies::kernels::tests!(gpu);

// GPU only: a launch past one grid's 2^28 elements is a CUDA grid limit, and 256 MiB tensors
// would take the simulator's host arithmetic long in a debug build.
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
