// A tensor exported by value belongs to the capsule (and to the consumer, who may write it): the
// engine cannot use it again.
use cuferry::dlpack::{self, Version};
use cuferry::CudaEngine;

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let tensor = engine.full::<f32>(&[4], 1.0).unwrap();
    let capsule = dlpack::export(&mut engine, tensor, None, Version::V1).unwrap();
    let doubled = engine.add(&tensor, &tensor).unwrap();
    drop((capsule, doubled));
}
