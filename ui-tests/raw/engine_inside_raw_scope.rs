// The engine is borrowed for the whole raw scope: it cannot queue work of its own (an upload, a
// flush) from inside the closure, so raw work and engine work never interleave unseen.
use cuferry::sim::SimConfig;
use cuferry::{upload_tensor, CudaEngine, Error};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    engine
        .with_raw(|raw| {
            let _stream = raw.stream();
            let _tensor = upload_tensor(&mut engine, &[1.0f32, 2.0], &[2])?;
            Ok::<_, Error>(())
        })
        .unwrap();
}
