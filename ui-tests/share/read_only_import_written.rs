// A read-only import dereferences to a shared tensor only: no kernel can write it.
use cuferry::share::ShareLink;
use cuferry::CudaEngine;

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let mut link = ShareLink::connect(&mut engine, "/tmp/weights.sock").unwrap();
    let mut weights = link.import_read::<f32>(&mut engine).unwrap();
    engine.fill(&mut weights, 0.0).unwrap();
}
