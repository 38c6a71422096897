// An unproven lease cannot go back to the ring: a copy may still name its memory.
use cuferry::sim::SimConfig;
use cuferry::CudaEngine;

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut tensor = engine.alloc_tensor::<u8>(&[8]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let unproven = lease.begin_upload(&mut engine, &mut tensor, 0, 8).unwrap();
    unproven.release();
}
