// A raw device pointer is valid only inside the raw scope: it cannot be kept past it.
use cuferry::sim::SimConfig;
use cuferry::{upload_tensor, CudaEngine};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let tensor = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let ptr = engine.with_raw(|raw| raw.device_ptr(&tensor)).unwrap();
    let _ = ptr.as_raw();
}
