// An input cannot be dropped while an output borrows it.
use cuferry::graph::{GraphCompiler, Input, TracedTensor};
use cuferry::sim::SimConfig;
use cuferry::{upload_tensor, CudaEngine, DType};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let program = GraphCompiler::new()
        .compile_with_input_specs(&[&x], &[(&x, DType::F32, &[4])])
        .unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    let input = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let outputs = engine.run(&mut prepared, &[Input::from(&input)]).unwrap();
    drop(input);
    assert!(outputs[0].is_borrowed());
}
