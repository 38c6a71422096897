// A prepared program is used by one run at a time: two threads cannot run it at once, on two
// engines or one.
use cuferry::graph::{GraphCompiler, Input, TracedTensor};
use cuferry::sim::SimConfig;
use cuferry::{upload_tensor, CudaEngine, DType};

fn main() {
    let mut a = CudaEngine::simulated(SimConfig::default());
    let mut b = CudaEngine::simulated(SimConfig::default());
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let y = (&x * &x).unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(&[&y], &[(&x, DType::F32, &[4])])
        .unwrap();
    let mut prepared = a.prepare(&program).unwrap();
    let xa = upload_tensor(&mut a, &[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let xb = upload_tensor(&mut b, &[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| a.run(&mut prepared, &[Input::from(&xa)]).map(drop));
        s.spawn(|| b.run(&mut prepared, &[Input::from(&xb)]).map(drop));
    });
}
