// Only a returned transfer can be queued again: resubmitting one still in flight would let two
// copies touch the same buffer.
use cuferry::sim::SimConfig;
use cuferry::{upload_pending, CudaEngine, PinnedHostBuffer};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0, 3.0]).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[3]).unwrap();
    let pending = upload_pending(&mut engine, buffer, tensor).unwrap();
    let _again = pending.resubmit(&mut engine);
}
