// The `Vec` of a registered buffer cannot be taken back while a transfer owns the buffer:
// unregistering and freeing it under the copy would let the DMA touch freed memory.
use cuferry::sim::SimConfig;
use cuferry::{upload_pending, CudaEngine, RegisteredBuffer};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let buffer = RegisteredBuffer::register(&mut engine, vec![1.0f32, 2.0, 3.0]).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[3]).unwrap();
    let pending = upload_pending(&mut engine, buffer, tensor).unwrap();
    let _data = buffer.into_vec();
    let _ = pending.wait();
}
