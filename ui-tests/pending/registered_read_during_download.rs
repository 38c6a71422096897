// A registered buffer handed to a download belongs to the transfer until it comes back: the host
// cannot read the memory the copy may still be writing.
use cuferry::sim::SimConfig;
use cuferry::{download_pending, upload_tensor, CudaEngine, RegisteredBuffer};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let tensor = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let buffer = RegisteredBuffer::register(&mut engine, vec![0.0f32; 3]).unwrap();
    let pending = download_pending(&mut engine, tensor, buffer).unwrap();
    let _early = buffer.as_slice()[0];
    let _ = pending.wait();
}
