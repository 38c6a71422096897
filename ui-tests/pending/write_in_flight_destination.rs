// The device borrow of an in-flight transfer is shared: no operation can write the tensor while
// the copy may still touch it.
use cuferry::sim::SimConfig;
use cuferry::{download_pending, upload_tensor, CudaEngine, PinnedHostBuffer};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let tensor = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let buffer = PinnedHostBuffer::<f32>::new(&mut engine, 3).unwrap();
    let pending = download_pending(&mut engine, tensor, buffer).unwrap();
    engine.fill(pending.tensor(), 0.0).unwrap();
}
