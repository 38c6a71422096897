// A slot whose copy is unproven cannot take another chunk.
use cuferry::sim::SimConfig;
use cuferry::CudaEngine;

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut tensor = engine.alloc_tensor::<u8>(&[8]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let unproven = lease.begin_upload(&mut engine, &mut tensor, 0, 8).unwrap();
    let _again = unproven.begin_upload(&mut engine, &mut tensor, 0, 8);
}
