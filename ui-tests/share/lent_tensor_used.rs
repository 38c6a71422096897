// A tensor lent exclusively to another process is not this engine's to use until it is back.
use cuferry::share::ShareListener;
use cuferry::{download_tensor, CudaEngine};

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let listener = ShareListener::bind("/tmp/weights.sock").unwrap();
    let importer = listener.accept(&mut engine).unwrap();
    let tensor = engine.full::<f32>(&[4], 1.0).unwrap();
    let lent = importer.lend(&mut engine, tensor).unwrap();
    let _ = download_tensor(&mut engine, &lent);
}
