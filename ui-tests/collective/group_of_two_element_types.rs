// A group's calls share one element type: an `i32` tensor in a group of `f32` calls would be
// queued with the wrong NCCL data type.
use cuferry::collective::{Communicator, ReduceOp};
use cuferry::sim::{SimConfig, SimDevice};
use cuferry::{upload_tensor, CudaEngine};

fn main() {
    let machine = SimDevice::new(SimConfig { devices: 1, ..SimConfig::default() });
    let mut gpu0 = CudaEngine::simulated_on_device(&machine, 0).unwrap();
    let comm = Communicator::new(&mut [&mut gpu0]).unwrap();
    let grads = upload_tensor(&mut gpu0, &[1.0f32, 2.0], &[2]).unwrap();
    let steps = upload_tensor(&mut gpu0, &[7i32], &[1]).unwrap();
    let _group = comm
        .group()
        .all_reduce(vec![grads], ReduceOp::Sum)
        .all_reduce(vec![steps], ReduceOp::Sum);
}
