// A capsule imported read-only dereferences to its tensor for reading only: the engine cannot
// write what the producer lent read-only.
use cuferry::dlpack::{self, Capsule, Ready, Strides};
use cuferry::CudaEngine;

fn write(engine: &mut CudaEngine, capsule: Capsule) {
    let weights =
        dlpack::import_read_only::<f32>(engine, capsule, Ready::OnEngineStream, Strides::Refuse)
            .unwrap();
    engine.fill(&mut *weights, 0.0).unwrap();
}

fn main() {}
