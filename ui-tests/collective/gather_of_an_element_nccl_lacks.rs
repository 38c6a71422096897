// NCCL moves 8-, 32- and 64-bit integers and floats: a gather of `i16` has no NCCL data type.
use cuferry::collective::Communicator;
use cuferry::sim::{SimConfig, SimDevice};
use cuferry::{upload_tensor, CudaEngine};

fn main() {
    let machine = SimDevice::new(SimConfig { devices: 1, ..SimConfig::default() });
    let mut gpu0 = CudaEngine::simulated_on_device(&machine, 0).unwrap();
    let comm = Communicator::new(&mut [&mut gpu0]).unwrap();
    let input = upload_tensor(&mut gpu0, &[1i16, 2], &[2]).unwrap();
    let output = upload_tensor(&mut gpu0, &[0i16, 0], &[2]).unwrap();
    let _ = comm.group().all_gather(vec![input], vec![output]).submit(&mut [&mut gpu0]);
}
