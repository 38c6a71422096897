// A shared tensor comes back for writing only through `reclaim`, once every importer released it:
// there is no conversion that takes it out early.
use cuferry::{CudaEngine, DeviceTensor};

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let tensor = engine.full::<f32>(&[4], 1.0).unwrap();
    let shared = engine.export_tensor(tensor).unwrap();
    let mut tensor = DeviceTensor::from(shared);
    engine.fill(&mut tensor, 2.0).unwrap();
}
