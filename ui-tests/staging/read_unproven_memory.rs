// Reading the staging memory of an unproven download races with the DMA writing it.
use cuferry::sim::SimConfig;
use cuferry::{upload_tensor, CudaEngine};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let tensor = upload_tensor(&mut engine, &[7u8; 8], &[8]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let unproven = lease.begin_download(&mut engine, &tensor, 0, 8).unwrap();
    let _first = unproven.as_bytes()[0];
}
