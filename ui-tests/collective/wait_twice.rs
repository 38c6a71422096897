// `wait` consumes the collective in flight: there is nothing left to wait on a second time.
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
    let summed = comm.group().all_reduce(vec![a, b], ReduceOp::Sum).submit(&mut [&mut gpu0, &mut gpu1]).unwrap();
    let _first = summed.wait();
    let _second = summed.wait();
}
