// A chunk whose event could not be recorded, and whose stream could not be synchronized, has no
// proof to wait for: its lease can only be retired, never ended.
use cuferry::sim::SimConfig;
use cuferry::{BeginError, CudaEngine};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut tensor = engine.alloc_tensor::<u8>(&[8]).unwrap();
    let lease = engine.staging_lease().unwrap();
    if let Err(BeginError::Untracked { lease, .. }) =
        lease.begin_upload(&mut engine, &mut tensor, 0, 8)
    {
        let _proven = lease.end_chunk();
    }
}
