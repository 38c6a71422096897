// A registered buffer handed to an upload belongs to the transfer until it comes back: the host
// cannot write the memory the copy may still be reading.
use cuferry::sim::SimConfig;
use cuferry::{upload_pending, CudaEngine, RegisteredBuffer};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut buffer = RegisteredBuffer::register(&mut engine, vec![1.0f32, 2.0, 3.0]).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[3]).unwrap();
    let pending = upload_pending(&mut engine, buffer, tensor).unwrap();
    buffer.as_mut_slice()[0] = 9.0;
    let _ = pending.wait();
}
