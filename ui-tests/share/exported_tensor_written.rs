// A tensor shared read-only is read-only for its exporter too, until reclaimed.
use cuferry::CudaEngine;

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let tensor = engine.full::<f32>(&[4], 1.0).unwrap();
    let mut shared = engine.export_tensor(tensor).unwrap();
    engine.fill(&mut shared, 2.0).unwrap();
}
