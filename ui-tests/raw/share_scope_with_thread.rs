// A raw scope cannot be shared with another thread: the engine's context is current only on
// the thread that entered it.
use cuferry::sim::SimConfig;
use cuferry::{CudaEngine, Error};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    engine
        .with_raw(|raw| {
            std::thread::scope(|s| {
                s.spawn(|| raw.context().as_raw() as usize);
            });
            Ok::<_, Error>(())
        })
        .unwrap();
}
