// A read-only lend hands out a `CudaView` only: cudarc cannot write a tensor lent read-only.
use cuferry::raw::cudarc::driver::CudaContext;
use cuferry::{cudarc_interop, CudaEngine};

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut tensor = engine.full::<f32>(&[4], 1.0).unwrap();
    let mut lent = cudarc_interop::lend(&mut engine, &mut tensor, &stream).unwrap();
    let mut view = lent.view_mut();
    stream.memset_zeros(&mut view).unwrap();
}
