// An input cannot be written while an output borrows it: the borrowed output would change
// under the caller.
use cuferry::graph::{GraphCompiler, Input, TracedTensor};
use cuferry::sim::SimConfig;
use cuferry::{upload_tensor, CudaEngine, DType};

fn main() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let view = x.reshape(&[2, 2]);
    let program = GraphCompiler::new()
        .compile_with_input_specs(&[&view], &[(&x, DType::F32, &[4])])
        .unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    let mut input = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let outputs = engine.run(&mut prepared, &[Input::from(&input)]).unwrap();
    engine.fill(&mut input, 0.0).unwrap();
    assert_eq!(outputs[0].shape(), &[2, 2]);
}
