// The destination of an upload in flight is only lent, shared, to the engine's next work: it
// cannot be taken until the transfer has returned.
use cuferry::sim::SimConfig;
use cuferry::{upload_pending, CudaEngine, DeviceTensor, PinnedHostBuffer};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0, 3.0]).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[3]).unwrap();
    let pending = upload_pending(&mut engine, buffer, tensor).unwrap();
    let _destination: DeviceTensor<f32> = *pending.tensor();
}
