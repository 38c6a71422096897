//! The in-flight handoff on a real device: work queued on the engine reads the device side of a
//! transfer still in flight, with no host wait, and sees the data the copy lands.

use crate::engine;
use crate::reference::{Reference, Rng, assert_same, random_vec};
use cuferry::{
    CudaEngine, DType, Element, PinnedHostBuffer, download_pending, download_tensor, upload_pending,
};

// Written once in `tests/bodies/handoff.rs`, run here on device 0 and by the simulator binary.
crate::bodies::handoff::tests!(gpu);

/// Upload, device copy of the in-flight destination, pending download of the copy: the host
/// waits once, on the download.
fn chain<T: Reference + Element>(engine: &mut CudaEngine, rng: &mut Rng, n: usize) {
    let data: Vec<T> = random_vec(rng, n);
    let source = PinnedHostBuffer::from_slice(engine, &data).unwrap();
    let destination = engine.alloc_tensor::<T>(&[n]).unwrap();
    let buffer = PinnedHostBuffer::<T>::new(engine, n).unwrap();
    let upload = upload_pending(engine, source, destination).unwrap();
    let copy = engine.copy_tensor(upload.tensor()).unwrap();
    let download = download_pending(engine, copy, buffer).unwrap();
    let download = download.wait().unwrap();
    assert_same(
        &format!("{} n={n}", T::DTYPE),
        download.buffer().as_slice(),
        &data,
    );
    let upload = upload.wait().unwrap();
    drop((upload, download));
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_element_type_reads_an_in_flight_destination() {
    let mut engine = engine();
    let mut rng = Rng::new(0x4a4e);
    for bytes in [1usize, 16, 17, 4096, 4097, 1 << 20, (8 << 20) + 8] {
        crate::for_each_element!(T => {
            let n = bytes.div_ceil(std::mem::size_of::<T>());
            if T::DTYPE != DType::Bool {
                chain::<T>(&mut engine, &mut rng, n);
            }
        });
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_64_mib_chain_is_queued_without_waiting_and_lands_in_order() {
    let mut engine = engine();
    let n = 16 << 20; // 64 MiB of f32
    let data: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 - 500.0).collect();
    let source = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
    let destination = engine.alloc_tensor::<f32>(&[n]).unwrap();
    let buffer = PinnedHostBuffer::<f32>::new(&mut engine, n).unwrap();
    let upload = upload_pending(&mut engine, source, destination).unwrap();
    let doubled = engine.add(upload.tensor(), upload.tensor()).unwrap();
    let scaled = engine.scale(&doubled, 0.25f32).unwrap();
    let mut download = download_pending(&mut engine, scaled, buffer).unwrap();
    // Two 64 MiB copies over PCIe take milliseconds: had any step waited on the host, the chain
    // would be complete by now.
    assert!(
        !download.is_ready().unwrap(),
        "the chain was queued, not waited for"
    );
    let download = download.wait().unwrap();
    for (i, (g, v)) in download.buffer().as_slice().iter().zip(&data).enumerate() {
        assert_eq!(*g, (v + v) * 0.25, "element {i}");
    }
    let upload = upload.wait().unwrap();
    assert_eq!(
        download_tensor(&mut engine, upload.tensor()).unwrap()[..4],
        data[..4]
    );
}
