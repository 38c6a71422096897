// A group is queued once: submitting it again would queue its tensors into two collectives.
use cuferry::collective::{Communicator, ReduceOp};
use cuferry::sim::{SimConfig, SimDevice};
use cuferry::{upload_tensor, CudaEngine};

fn main() {
    let machine = SimDevice::new(SimConfig { devices: 2, ..SimConfig::default() });
    let mut gpu0 = CudaEngine::simulated_on_device(&machine, 0).unwrap();
    let mut gpu1 = CudaEngine::simulated_on_device(&machine, 1).unwrap();
    let comm = Communicator::new(&mut [&mut gpu0, &mut gpu1]).unwrap();
    let a = upload_tensor(&mut gpu0, &[1.0f32, 2.0], &[2]).unwrap();
    let b = upload_tensor(&mut gpu1, &[3.0f32, 4.0], &[2]).unwrap();
    let group = comm.group().all_reduce(vec![a, b], ReduceOp::Sum);
    let _first = group.submit(&mut [&mut gpu0, &mut gpu1]);
    let _second = group.submit(&mut [&mut gpu0, &mut gpu1]);
}
