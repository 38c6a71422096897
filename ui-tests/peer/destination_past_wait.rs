// A borrow of an in-flight peer copy's destination cannot outlive the wait that consumes the
// handle it comes from.
use cuferry::sim::{SimConfig, SimDevice};
use cuferry::{upload_tensor, CudaEngine, peer};

fn main() {
    let machine = SimDevice::new(SimConfig { devices: 2, ..SimConfig::default() });
    let mut gpu0 = CudaEngine::simulated_on_device(&machine, 0).unwrap();
    let mut gpu1 = CudaEngine::simulated_on_device(&machine, 1).unwrap();
    let x = upload_tensor(&mut gpu0, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let landing = gpu1.alloc_tensor::<f32>(&[3]).unwrap();
    let copy = peer::copy_pending(&mut gpu0, x, &mut gpu1, landing).unwrap();
    let there = copy.destination();
    let (_x, landing) = copy.wait().unwrap().into_parts();
    let _doubled = gpu1.add(there, there).unwrap();
    drop(landing);
}
