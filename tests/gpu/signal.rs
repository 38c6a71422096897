//! Signals between two engines on one GPU: the waiting engine's streams wait on the device.

use crate::common::open;
use cuferry::{PinnedHostBuffer, download_tensor, upload_pending, upload_tensor};

#[test]
#[ignore = "needs a CUDA device"]
fn a_wait_for_a_signal_orders_another_engines_streams_on_the_device() {
    let (mut a, mut b) = (open(), open());
    // Long work on A: a 256 MiB upload and eight kernels over it (tens of milliseconds).
    let n = 64 << 20;
    let x = upload_tensor(&mut a, &vec![1.0f32; n], &[n]).unwrap();
    a.synchronize().unwrap();
    let mut y = a.scale(&x, 2.0).unwrap();
    for _ in 0..7 {
        y = a.scale(&y, 1.0).unwrap();
    }
    let signal = a.signal().unwrap();
    b.wait_signal(&signal).unwrap();
    assert!(
        !signal.is_ready().unwrap(),
        "the host did not wait: A's kernels are still running"
    );
    let buffer = PinnedHostBuffer::from_slice(&mut b, &[3.0f32, 4.0]).unwrap();
    let tensor = b.alloc_tensor::<f32>(&[2]).unwrap();
    let pending = upload_pending(&mut b, buffer, tensor).unwrap();
    // B's upload waits on the device for A's kernels: once it is done, so are they.
    let returned = pending.wait().unwrap();
    assert!(
        signal.is_ready().unwrap(),
        "B's work ran before A's signalled work"
    );
    assert_eq!(
        download_tensor(&mut b, returned.tensor()).unwrap(),
        [3.0, 4.0]
    );
    let head = download_tensor(&mut a, &y).unwrap();
    assert!(head.iter().all(|&v| v == 2.0));
    signal.wait().unwrap();
}
