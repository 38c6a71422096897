// A read-only export keeps its tensor behind an `Arc`: the engine, which shares it with the
// capsule, cannot write it either.
use cuferry::dlpack::{self, Version};
use cuferry::CudaEngine;
use std::sync::Arc;

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let tensor = Arc::new(engine.full::<f32>(&[4], 1.0).unwrap());
    let capsule = dlpack::export_shared(&mut engine, Arc::clone(&tensor), None, Version::V1).unwrap();
    engine.fill(&mut *tensor, 2.0).unwrap();
    drop(capsule);
}
