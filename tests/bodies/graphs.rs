//! Prepared programs, on either device: a program compiled once, prepared on an engine and run,
//! its kernels cached, its parameters rebound only where an input moved, and bad inputs refused
//! with nothing run.

use super::Device;
use cuferry::error::{ProgramError, UsageError};
use cuferry::graph::{GraphCompiler, Input, Program, TracedTensor};
use cuferry::sim::SimOp;
use cuferry::{DType, Error, download_tensor, upload_tensor};

fn square_plus(len: usize) -> (TracedTensor, Program) {
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let y = (&(&x * &x).unwrap() + &x).unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(&[&y], &[(&x, DType::F32, &[len])])
        .unwrap();
    (x, program)
}

pub(crate) fn a_second_program_with_the_same_group_compiles_nothing(dev: Device) {
    let mut engine = dev.engine();
    let sim = engine.sim();
    // Simulator only: the module loads are counted.
    let loads = || sim.as_ref().map(|sim| sim.calls(SimOp::ModuleLoad));
    let (_, first) = square_plus(16);
    let _a = engine.prepare(&first).unwrap();
    let (kernels, loaded) = (engine.cached_kernels(), loads());
    // Traced again from scratch, for another length: the same canonical expression.
    let (_, second) = square_plus(1000);
    let _b = engine.prepare(&second).unwrap();
    assert_eq!(engine.cached_kernels(), kernels);
    assert_eq!(loads(), loaded);
}

pub(crate) fn runs_rebind_only_what_moved_and_reuse_dropped_outputs(dev: Device) {
    let mut engine = dev.engine();
    let sim = engine.sim();
    // Simulator only: the allocations are counted and the live memory read.
    let allocs = || sim.as_ref().map(|sim| sim.calls(SimOp::Alloc));
    let (_, program) = square_plus(4);
    let mut prepared = engine.prepare(&program).unwrap();
    let x1 = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let x2 = upload_tensor(&mut engine, &[5.0f32, 6.0, 7.0, 8.0], &[4]).unwrap();
    let out = engine.run(&mut prepared, &[Input::from(&x1)]).unwrap();
    assert_eq!(
        download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap(),
        [2.0, 6.0, 12.0, 20.0]
    );
    assert_eq!(prepared.stats().parameter_updates, 1);
    drop(out);
    // Same input, the dropped output's memory again: nothing to update, nothing allocated.
    let before = allocs();
    let out = engine.run(&mut prepared, &[Input::from(&x1)]).unwrap();
    assert_eq!(prepared.stats().parameter_updates, 1);
    assert_eq!(allocs(), before);
    // A kept output forces a new one; a moved input one update.
    let kept = engine.run(&mut prepared, &[Input::from(&x2)]).unwrap();
    assert_eq!(allocs(), before.map(|n| n + 1));
    assert_eq!(prepared.stats().parameter_updates, 2);
    assert_eq!(
        download_tensor(&mut engine, kept[0].as_tensor::<f32>().unwrap()).unwrap(),
        [30.0, 42.0, 56.0, 72.0]
    );
    assert_eq!(
        download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap(),
        [2.0, 6.0, 12.0, 20.0]
    );
    assert_eq!(prepared.stats().graph_launches, 3);
    if let Some(sim) = &sim {
        assert_eq!(sim.graph_launches(), 3);
    }
    drop((out, kept));
    drop((prepared, x1, x2));
    engine.synchronize().unwrap();
    engine.synchronize().unwrap();
    if let Some(sim) = &sim {
        assert_eq!(sim.device_live(), (0, 0));
        assert_eq!(sim.graphs_live(), 0);
    }
}

pub(crate) fn bad_inputs_and_other_engines_are_refused_and_nothing_runs(dev: Device) {
    let mut engines = dev.engines(2);
    let (mut other, mut engine) = (engines.pop().unwrap(), engines.pop().unwrap());
    let device = engine.sim();
    // Simulator only: what was queued and allocated is counted.
    let counts = || {
        device
            .as_ref()
            .map(|device| (device.queued(), device.calls(SimOp::Alloc)))
    };
    let (_, program) = square_plus(4);
    let mut prepared = engine.prepare(&program).unwrap();
    let good = upload_tensor(&mut engine, &[1.0f32; 4], &[4]).unwrap();
    let long = upload_tensor(&mut engine, &[1.0f32; 5], &[5]).unwrap();
    let wide = upload_tensor(&mut engine, &[1.0f64; 4], &[4]).unwrap();
    let foreign = upload_tensor(&mut other, &[1.0f32; 4], &[4]).unwrap();
    engine.synchronize().unwrap();
    let before = counts();
    assert!(matches!(
        engine.run(&mut prepared, &[Input::from(&long)]),
        Err(Error::Program(ProgramError::Input { index: 0, .. }))
    ));
    assert!(matches!(
        engine.run(&mut prepared, &[Input::from(&wide)]),
        Err(Error::Program(ProgramError::Input { index: 0, .. }))
    ));
    assert!(matches!(
        engine.run(&mut prepared, &[]),
        Err(Error::Program(ProgramError::Input { .. }))
    ));
    assert!(matches!(
        engine.run(&mut prepared, &[Input::from(&good), Input::from(&good)]),
        Err(Error::Program(ProgramError::Input { .. }))
    ));
    assert!(matches!(
        engine.run(&mut prepared, &[Input::from(&foreign)]),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    assert!(matches!(
        other.run(&mut prepared, &[Input::from(&foreign)]),
        Err(Error::Usage(UsageError::WrongEngine { .. }))
    ));
    assert_eq!(counts(), before);
    assert_eq!(prepared.stats().runs, 0);
    if let Some(device) = &device {
        assert_eq!(device.graph_launches(), 0);
    }
    // And the program still runs.
    let out = engine.run(&mut prepared, &[Input::from(&good)]).unwrap();
    assert_eq!(
        download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap(),
        [2.0; 4]
    );
}

pub(crate) fn products_of_inputs_run_between_graph_launches(dev: Device) {
    let mut engine = dev.engine();
    let a = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let b = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let y = a.matmul(&b).unwrap().scale(3.0f64).unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(
            &[&y],
            &[(&a, DType::F64, &[2, 3]), (&b, DType::F64, &[3, 2])],
        )
        .unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    let at = upload_tensor(&mut engine, &[1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let bt = upload_tensor(&mut engine, &[1.0f64, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2]).unwrap();
    let out = engine
        .run(&mut prepared, &[Input::from(&at), Input::from(&bt)])
        .unwrap();
    assert_eq!(
        download_tensor(&mut engine, out[0].as_tensor::<f64>().unwrap()).unwrap(),
        [12.0, 15.0, 30.0, 33.0]
    );
    let s = prepared.stats();
    assert_eq!((s.eager_calls, s.graph_launches, s.graphs), (1, 1, 1));
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; graphs::{
            a_second_program_with_the_same_group_compiles_nothing,
            runs_rebind_only_what_moved_and_reuse_dropped_outputs,
            bad_inputs_and_other_engines_are_refused_and_nothing_runs,
            products_of_inputs_run_between_graph_launches,
        });
    };
}
pub(crate) use tests;
