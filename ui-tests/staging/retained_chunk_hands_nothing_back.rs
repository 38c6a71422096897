// A chunk whose event could not be recorded, and whose stream could not be synchronized, has no
// proof to wait for: the engine retains its slot, and no lease comes back to end or reuse.
use cuferry::sim::SimConfig;
use cuferry::{CudaEngine, SubmitError};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut tensor = engine.alloc_tensor::<u8>(&[8]).unwrap();
    let lease = engine.staging_lease().unwrap();
    if let Err(SubmitError::Retained { input, .. }) =
        lease.begin_upload(&mut engine, &mut tensor, 0, 8)
    {
        let _proven = input.end_chunk();
    }
}
