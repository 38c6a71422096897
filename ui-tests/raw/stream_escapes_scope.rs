// The raw stream is valid only inside the raw scope: it cannot be returned out of it.
use cuferry::sim::SimConfig;
use cuferry::{CudaEngine, Error};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let stream = engine.with_raw(|raw| Ok::<_, Error>(raw.stream())).unwrap();
    let _ = stream.as_raw();
}
