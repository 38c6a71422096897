// The staging memory of an unproven lease is unreachable: DMA may still read or write it.
use cuferry::sim::SimConfig;
use cuferry::CudaEngine;

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut tensor = engine.alloc_tensor::<u8>(&[8]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let mut unproven = lease.begin_upload(&mut engine, &mut tensor, 0, 8).unwrap();
    unproven.as_mut_bytes()[0] = 1;
}
