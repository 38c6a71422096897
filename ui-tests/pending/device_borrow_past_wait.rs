// A device borrow of an in-flight destination cannot outlive the transfer's wait: the wait
// consumes the handle the borrow comes from.
use cuferry::sim::SimConfig;
use cuferry::{upload_pending, CudaEngine, PinnedHostBuffer};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let buffer = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0, 3.0]).unwrap();
    let tensor = engine.alloc_tensor::<f32>(&[3]).unwrap();
    let pending = upload_pending(&mut engine, buffer, tensor).unwrap();
    let on_device = pending.tensor();
    let returned = pending.wait().unwrap();
    let _sum = engine.add(on_device, on_device).unwrap();
    drop(returned);
}
