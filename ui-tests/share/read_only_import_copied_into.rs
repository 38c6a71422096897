// A read-only import is not a destination: a copy into it is refused at compile time.
use cuferry::share::ShareLink;
use cuferry::CudaEngine;

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let mut link = ShareLink::connect(&mut engine, "/tmp/weights.sock").unwrap();
    let weights = link.import_read::<f32>(&mut engine).unwrap();
    let update = engine.full::<f32>(&[4], 1.0).unwrap();
    engine.copy_into(&update, &mut *weights).unwrap();
}
