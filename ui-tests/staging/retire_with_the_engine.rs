// An engine handed to its own retirement queue would own itself and never be torn down; values
// whose drop runs the caller's code cannot be kept either. Only the crate's own values are.
use cuferry::sim::SimConfig;
use cuferry::CudaEngine;

struct Noisy;

impl Drop for Noisy {
    fn drop(&mut self) {
        panic!("would unwind inside the engine");
    }
}

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut tensor = engine.alloc_tensor::<u8>(&[8]).unwrap();
    let lease = engine.staging_lease().unwrap();
    let unproven = lease.begin_upload(&mut engine, &mut tensor, 0, 8).unwrap();
    unproven.retire_with(Noisy);
    let other = CudaEngine::simulated(SimConfig::default());
    let lease = engine.staging_lease().unwrap();
    let unproven = lease.begin_upload(&mut engine, &mut tensor, 0, 8).unwrap();
    unproven.retire_with(other);
}
