// An imported tensor owns its capsule: the capsule cannot be dropped (its producer's deleter
// called) while the tensor views its memory. The release comes with the tensor's drop, after
// the engine's last use is proven.
use cuferry::dlpack::{self, Capsule, Ready, Strides};
use cuferry::CudaEngine;

fn import(engine: &mut CudaEngine, capsule: Capsule) {
    let tensor =
        dlpack::import::<f32>(engine, capsule, Ready::OnEngineStream, Strides::Refuse).unwrap();
    drop(capsule);
    let _ = engine.add(&tensor, &tensor);
}

fn main() {}
