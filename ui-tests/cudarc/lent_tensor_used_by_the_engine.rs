// A tensor lent to cudarc is borrowed by the lend: the engine cannot use it until the lend is
// dropped, which orders the engine after cudarc's work.
use cuferry::raw::cudarc::driver::CudaContext;
use cuferry::{cudarc_interop, CudaEngine};

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut tensor = engine.full::<f32>(&[4], 1.0).unwrap();
    let lent = cudarc_interop::lend_mut(&mut engine, &mut tensor, &stream).unwrap();
    let doubled = engine.add(&tensor, &tensor).unwrap();
    drop((lent, doubled));
}
