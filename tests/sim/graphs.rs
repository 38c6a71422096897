//! Prepared programs on the simulated device: the rules of tracing, compiling, preparing and
//! running, each shown by what the device did (or did not do).

use cuferry::error::{ProgramError, UsageError};
use cuferry::graph::{GraphCompiler, Input, OutputKind, Program, TracedTensor};
use cuferry::sim::{SimConfig, SimOp};
use cuferry::{CudaEngine, DType, Error, download_tensor, upload_tensor};

static_assertions::assert_impl_all!(Program: Send, Sync, Clone);
static_assertions::assert_impl_all!(TracedTensor: Send, Sync, Clone);
static_assertions::assert_impl_all!(cuferry::graph::Prepared: Send);

// Written once in `tests/bodies/graphs.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::graphs::tests!(sim);

// Simulator-only: no device at all (tracing runs on the host); run once, here.
#[test]
fn tracing_refuses_mismatched_types_and_ranks() {
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let i = TracedTensor::input_symbolic_shape(DType::I32, 1);
    let m = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let u = TracedTensor::input_symbolic_shape(DType::U8, 1);
    let b = TracedTensor::input_symbolic_shape(DType::Bool, 1);
    assert!(matches!(
        &x * &i,
        Err(Error::Program(ProgramError::Trace {
            operation: "mul",
            ..
        }))
    ));
    assert!(matches!(
        &x - &i,
        Err(Error::Program(ProgramError::Trace {
            operation: "sub",
            ..
        }))
    ));
    // Ranks that differ broadcast (a `[N]` row onto `[B, N]`): their shapes are checked when
    // the program is compiled (tests/sim/broadcast.rs).
    assert_eq!((&x - &m).unwrap().rank(), 2);
    assert!(matches!(
        x.scale(1i32),
        Err(Error::Program(ProgramError::Trace {
            operation: "scale",
            ..
        }))
    ));
    assert!(matches!(
        -&u,
        Err(Error::Usage(UsageError::UnsupportedElement {
            operation: "neg",
            ..
        }))
    ));
    assert!(matches!(
        &i / &i,
        Err(Error::Usage(UsageError::UnsupportedElement {
            operation: "div",
            ..
        }))
    ));
    assert!(matches!(
        &b + &b,
        Err(Error::Usage(UsageError::UnsupportedElement {
            operation: "add",
            ..
        }))
    ));
    assert!(matches!(
        x.matmul(&m),
        Err(Error::Program(ProgramError::Trace {
            operation: "matmul",
            ..
        }))
    ));
    let mi = TracedTensor::input_symbolic_shape(DType::I32, 2);
    assert!(matches!(
        mi.matmul(&mi),
        Err(Error::Usage(UsageError::UnsupportedElement {
            operation: "matmul",
            ..
        }))
    ));
    assert!(
        x.cast(DType::F32).is_input(),
        "a cast to the same type is the value itself"
    );
}

// Simulator-only: no device at all (compiling runs on the host); run once, here.
#[test]
fn compilation_refuses_bad_specifications_and_shapes() {
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let z = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let y = (&x + &z).unwrap();
    let c = GraphCompiler::new();
    let spec = |r: Result<Program, Error>| match r {
        Err(Error::Program(ProgramError::Spec { detail })) => detail,
        other => panic!("expected ProgramError::Spec, got {other:?}"),
    };
    // z has no specification.
    assert!(
        spec(c.compile_with_input_specs(&[&y], &[(&x, DType::F32, &[4])]))
            .contains("no input specification")
    );
    // A computed value named as an input.
    assert!(
        spec(c.compile_with_input_specs(&[&y], &[(&y, DType::F32, &[4])]))
            .contains("computed value")
    );
    // Wrong element type, wrong rank, named twice.
    spec(c.compile_with_input_specs(&[&x], &[(&x, DType::F64, &[4])]));
    spec(c.compile_with_input_specs(&[&x], &[(&x, DType::F32, &[2, 2])]));
    spec(c.compile_with_input_specs(&[&x], &[(&x, DType::F32, &[4]), (&x, DType::F32, &[4])]));
    // Elementwise shapes that do not broadcast: the eager operations' error, naming both.
    let refused = c
        .compile_with_input_specs(&[&y], &[(&x, DType::F32, &[4]), (&z, DType::F32, &[5])])
        .unwrap_err();
    assert!(
        matches!(
            &refused,
            Error::Usage(UsageError::NotBroadcastable { operation: "add", left, right, dim: 0 })
                if left == &[4] && right == &[5]
        ),
        "{refused:?}"
    );
    // Inner dimensions of a product, element count of a reshape.
    let a = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let b = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let p = a.matmul(&b).unwrap();
    assert!(
        spec(c.compile_with_input_specs(
            &[&p],
            &[(&a, DType::F64, &[2, 3]), (&b, DType::F64, &[4, 2])]
        ))
        .contains("inner dimensions")
    );
    let r = x.reshape(&[3]);
    assert!(spec(c.compile_with_input_specs(&[&r], &[(&x, DType::F32, &[4])])).contains("reshape"));
    // A product with an empty inner dimension is zeros, computed by a fused kernel.
    let ok = c
        .compile_with_input_specs(
            &[&p],
            &[(&a, DType::F64, &[2, 0]), (&b, DType::F64, &[0, 2])],
        )
        .unwrap();
    assert_eq!((ok.stats().matmuls, ok.stats().fused_kernels), (0, 1));
}

// Simulator-only: no device at all (compiling runs on the host); run once, here.
#[test]
fn common_subexpressions_merge_and_elementwise_runs_fuse() {
    let x = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let a = (&x * &x).unwrap();
    let b = (&x * &x).unwrap();
    let y = (&(&a + &b).unwrap() - &x).unwrap().scale(2.0f32).unwrap();
    let p = GraphCompiler::new()
        .compile_with_input_specs(&[&y], &[(&x, DType::F32, &[8])])
        .unwrap();
    assert_eq!(p.stats().operations, 4);
    assert_eq!(p.stats().fused_kernels, 1);
    assert_eq!(
        p.stats().intermediate_bytes,
        0,
        "nothing leaves the kernel but the output"
    );
    // A product splits the elementwise work into levels; intermediates share the arena.
    let m = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let w = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let h1 = m.scale(0.5f32).unwrap().matmul(&w).unwrap();
    let h2 = h1.scale(0.5f32).unwrap().matmul(&w).unwrap();
    let h3 = h2.scale(0.5f32).unwrap().matmul(&w).unwrap();
    let p = GraphCompiler::new()
        .compile_with_input_specs(
            &[&h3],
            &[(&m, DType::F32, &[64, 64]), (&w, DType::F32, &[64, 64])],
        )
        .unwrap();
    let s = p.stats();
    assert_eq!(
        (s.matmuls, s.fused_kernels),
        (3, 4),
        "three scales, three products, one output copy"
    );
    assert!(
        s.intermediate_bytes < s.unshared_intermediate_bytes,
        "{s:?}"
    );
    assert_eq!(p.output_kind(0), Some(&OutputKind::New));
}

// Simulator-only: holds the device clock and reads the live memory and graphs.
#[test]
fn a_dropped_program_keeps_its_memory_until_its_last_run_is_proven_complete() {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().unwrap();
    let m = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let h = m
        .scale(2.0f32)
        .unwrap()
        .matmul(&m)
        .unwrap()
        .scale(0.5f32)
        .unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(&[&h], &[(&m, DType::F32, &[8, 8])])
        .unwrap();
    assert!(program.stats().intermediate_bytes > 0);
    let mut prepared = engine.prepare(&program).unwrap();
    let input = upload_tensor(&mut engine, &[1.0f32; 64], &[8, 8]).unwrap();
    engine.synchronize().unwrap();
    sim.hold_clock(true);
    let out = engine.run(&mut prepared, &[Input::from(&input)]).unwrap();
    let live = sim.device_live().0;
    drop(prepared);
    engine.flush().unwrap();
    // The run has not run: the arena and the graph are still held.
    assert_eq!(sim.device_live().0, live);
    assert!(sim.graphs_live() > 0);
    sim.advance_all();
    sim.hold_clock(false);
    let got = download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap();
    assert_eq!(got, vec![8.0f32; 64]);
    drop(out);
    drop(input);
    engine.synchronize().unwrap();
    engine.synchronize().unwrap();
    assert_eq!(sim.graphs_live(), 0);
    assert_eq!(sim.device_live(), (0, 0));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// Asserts `r` is [`UsageError::SizeOverflow`](crate::error::UsageError::SizeOverflow) naming `count` elements of `element_bytes` bytes.
fn assert_size_overflow(r: Result<Program, Error>, count: usize, element_bytes: usize) {
    match r {
        Err(e @ Error::Usage(UsageError::SizeOverflow { .. })) => {
            let message = e.to_string();
            assert!(message.contains(&count.to_string()), "{message}");
            assert!(
                message.contains(&format!("{element_bytes} byte")),
                "{message}"
            );
        }
        other => panic!("expected SizeOverflow, got {other:?}"),
    }
}

// Simulator-only: no device at all (compiling runs on the host); run once, here.
/// An input whose element count fits in usize but whose bytes do not (2^61 `f64`s) is refused
/// when compiled, whether its values stay in kernels or pass through an intermediate.
#[test]
fn an_input_past_the_addressable_limit_is_refused_when_compiled() {
    let c = GraphCompiler::new();
    let x = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let w = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let squared = (&x * &x).unwrap();
    let through_product = (&squared.matmul(&w).unwrap() + &x).unwrap();
    for y in [&through_product, &squared] {
        assert_size_overflow(
            c.compile_with_input_specs(
                &[y],
                &[(&x, DType::F64, &[1 << 61, 1]), (&w, DType::F64, &[1, 1])],
            ),
            1 << 61,
            8,
        );
    }
}

// Simulator-only: no device at all (compiling runs on the host); run once, here.
/// A product of two addressable inputs whose result is not ([2^31, 1] times [1, 2^31] `f64`s)
/// is refused when compiled; one whose element count overflows usize names its shape.
#[test]
fn a_product_past_the_addressable_limit_is_refused_when_compiled() {
    let c = GraphCompiler::new();
    let a = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let b = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let p = a.matmul(&b).unwrap();
    assert_size_overflow(
        c.compile_with_input_specs(
            &[&p],
            &[
                (&a, DType::F64, &[1 << 31, 1]),
                (&b, DType::F64, &[1, 1 << 31]),
            ],
        ),
        1 << 62,
        8,
    );
    let q = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let big = q.matmul(&q.reshape(&[1, 1 << 40])).unwrap();
    match c.compile_with_input_specs(&[&big], &[(&q, DType::F64, &[1 << 40, 1])]) {
        Err(Error::Usage(UsageError::ShapeOverflow { shape })) => {
            assert_eq!(shape, [1 << 40, 1 << 40])
        }
        other => panic!("expected ShapeOverflow, got {other:?}"),
    }
}

// Simulator-only: no device at all (compiling runs on the host); run once, here.
/// Intermediates that are each addressable but not together, being live at once, are refused
/// when compiled: four, then two, of 2^62 bytes, each read by a product after the one kernel
/// that writes them all.
#[test]
fn intermediates_live_at_once_past_the_addressable_limit_are_refused_when_compiled() {
    let c = GraphCompiler::new();
    let x = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let w = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let parts = [
        (&x * &x).unwrap(),
        (&x + &x).unwrap(),
        (&x - &x).unwrap(),
        (&x / &x).unwrap(),
    ];
    let products: Vec<TracedTensor> = parts.iter().map(|v| v.matmul(&w).unwrap()).collect();
    let outputs: Vec<&TracedTensor> = products.iter().collect();
    let specs = [
        (&x, DType::F64, &[1usize << 58, 2][..]),
        (&w, DType::F64, &[2, 1][..]),
    ];
    for live in [4, 2] {
        match c.compile_with_input_specs(&outputs[..live], &specs) {
            Err(Error::Program(ProgramError::Spec { detail })) => {
                assert!(detail.contains("intermediates"), "{live}: {detail}");
                assert!(detail.contains(&isize::MAX.to_string()), "{live}: {detail}");
            }
            other => panic!("{live} live at once: expected ProgramError::Spec, got {other:?}"),
        }
    }
    // One fits: its 2^62 bytes and the product's own 2^61 (a product writes an intermediate).
    let one = c.compile_with_input_specs(&outputs[..1], &specs).unwrap();
    assert_eq!(one.stats().intermediate_bytes, (1 << 62) + (1 << 61));
}

/// A program whose one graph captures three launches: a fused scale, a product of two
/// intermediates, and a fused scale of the product into the output.
fn scale_square_scale(n: usize) -> Program {
    let m = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let s = m.scale(0.5f32).unwrap();
    let t = s.matmul(&s).unwrap();
    let y = t.scale(2.0f32).unwrap();
    GraphCompiler::new()
        .compile_with_input_specs(&[&y], &[(&m, DType::F32, &[n, n])])
        .unwrap()
}

/// The reference: `2 * (m/2 · m/2)` for an `n×n` row-major `m`.
fn scale_square_scale_reference(m: &[f32], n: usize) -> Vec<f32> {
    let s: Vec<f32> = m.iter().map(|v| v * 0.5).collect();
    let mut out = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            let dot: f32 = (0..n).map(|k| s[i * n + k] * s[k * n + j]).sum();
            out[i * n + j] = dot * 2.0;
        }
    }
    out
}

// Simulator-only: injects a driver panic inside the capture.
/// A panic inside a driver call during `prepare`'s capture (at every launch in turn, and at the
/// capture's end) leaves the engine's stream not capturing: it synchronizes, round-trips a
/// tensor, prepares and runs the program right, and its teardown releases everything.
#[test]
fn a_driver_panic_inside_a_capture_ends_the_capture_and_the_engine_works_on() {
    let n = 4;
    let program = scale_square_scale(n);
    assert_eq!(program.stats().matmuls, 1);
    let host: Vec<f32> = (0..n * n).map(|i| i as f32 * 0.25 + 1.0).collect();
    let want = scale_square_scale_reference(&host, n);
    for (op, captured) in [(SimOp::Launch, 2), (SimOp::Gemm, 1), (SimOp::CaptureEnd, 1)] {
        let mut panicked = 0;
        for call in 1.. {
            let mut engine = CudaEngine::simulated(SimConfig::default());
            let sim = engine.sim().unwrap();
            let (begins, before) = (sim.calls(SimOp::CaptureBegin), sim.calls(op));
            sim.panic_nth(op, call);
            let prepared =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.prepare(&program)));
            let reached = sim.calls(op) - before >= call;
            sim.clear_faults();
            match prepared {
                Ok(prepared) => {
                    assert!(!reached, "{op:?} {call}: the panic was not raised");
                    drop(prepared.unwrap());
                    assert_eq!(panicked, captured, "{op:?} calls inside the capture");
                    break;
                }
                Err(_) => panicked += 1,
            }
            assert_eq!(sim.calls(SimOp::CaptureBegin) - begins, 1, "{op:?} {call}");
            // The stream is no longer capturing: a synchronize works, and so does the rest.
            engine
                .synchronize()
                .unwrap_or_else(|e| panic!("{op:?} {call}: {e}"));
            let x = upload_tensor(&mut engine, &host, &[n, n]).unwrap();
            assert_eq!(
                download_tensor(&mut engine, &x).unwrap(),
                host,
                "{op:?} {call}"
            );
            let mut prepared = engine.prepare(&program).unwrap();
            let out = engine.run(&mut prepared, &[Input::from(&x)]).unwrap();
            assert_eq!(
                download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap(),
                want,
                "{op:?} {call}"
            );
            drop((out, prepared));
            drop(x);
            engine.synchronize().unwrap();
            drop(engine);
            assert_eq!(sim.graphs_live(), 0, "{op:?} {call}");
            assert_eq!(sim.device_live(), (0, 0), "{op:?} {call}");
            assert_eq!(sim.events_live(), 0, "{op:?} {call}");
            assert!(
                sim.violations().is_empty(),
                "{op:?} {call}: {:?}",
                sim.violations()
            );
        }
    }
}
