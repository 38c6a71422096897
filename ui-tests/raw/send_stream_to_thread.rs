// The engine's context is current only on the thread inside the raw scope, so the raw stream
// cannot be sent to another thread.
use cuferry::sim::SimConfig;
use cuferry::{CudaEngine, Error};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    engine
        .with_raw(|raw| {
            let stream = raw.stream();
            std::thread::scope(|s| {
                s.spawn(move || stream.as_raw() as usize);
            });
            Ok::<_, Error>(())
        })
        .unwrap();
}
