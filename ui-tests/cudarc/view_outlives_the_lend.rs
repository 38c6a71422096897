// A lent tensor's cudarc view borrows the lend: it cannot be used once the lend is dropped, when
// the engine may use the memory again.
use cuferry::raw::cudarc::driver::CudaContext;
use cuferry::{cudarc_interop, CudaEngine};

fn main() {
    let mut engine = CudaEngine::open(0).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut tensor = engine.full::<f32>(&[4], 1.0).unwrap();
    let lent = cudarc_interop::lend(&mut engine, &mut tensor, &stream).unwrap();
    let view = lent.view();
    drop(lent);
    let _ = view.len();
}
