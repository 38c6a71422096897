// A proven lease has nothing to retire: it is released back to the ring.
use cuferry::sim::SimConfig;
use cuferry::CudaEngine;

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let lease = engine.staging_lease().unwrap();
    lease.retire();
}
