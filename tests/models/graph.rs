//! Prepared programs against a host interpreter, on the simulated device.
//!
//! Random expression DAGs (up to a dozen operations, shared subexpressions, every element type
//! with casts between them, constants, matrix products, outputs that are inputs or views of
//! inputs) are traced, compiled, prepared and run several times with fresh inputs at new
//! addresses. Every output must equal, bit for bit, what a separate host interpreter computes
//! from the same recipe with Rust's own arithmetic (`tests/common`). Faults injected at every
//! step of `prepare` and `run` must surface as errors, leave the program usable or cleanly
//! dropped, and leak nothing: no device memory, no graph, no violation on the device.

use crate::support::{Reference, Rng, random_vec};
use cuferry::graph::{GraphCompiler, Input, Output, Prepared, TracedTensor};
use cuferry::sim::{SimConfig, SimOp};
use cuferry::{
    CudaEngine, DType, DeviceTensor, bf16, download_tensor, error::DriverError, f16, upload_tensor,
};
use proptest::prelude::*;
use std::any::Any;

/// Runs `$body` with `$t` bound to the Rust type of a `DType`.
macro_rules! typed {
    ($d:expr_2021, $t:ident => $body:expr_2021) => {
        match $d {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            DType::I8 => {
                type $t = i8;
                $body
            }
            DType::I16 => {
                type $t = i16;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
            DType::U16 => {
                type $t = u16;
                $body
            }
            DType::U32 => {
                type $t = u32;
                $body
            }
            DType::U64 => {
                type $t = u64;
                $body
            }
            DType::Bool => {
                type $t = bool;
                $body
            }
            other => unreachable!("no such element type {other:?}"),
        }
    };
}

/// A host value: `Vec<T>` for its element type.
struct Host {
    dtype: DType,
    shape: Vec<usize>,
    data: Box<dyn Any>,
}

impl Host {
    fn get<T: Reference>(&self) -> &Vec<T> {
        self.data
            .downcast_ref()
            .expect("host value of its own type")
    }
}

/// One operation of a recipe. Operands are positions in the value pool (inputs first).
#[derive(Clone, Debug)]
enum Step {
    Binary(&'static str, usize, usize),
    Neg(usize),
    /// Scale by the `seed`-th random value of the operand's type.
    Scale(usize, u64),
    Cast(usize, DType),
    /// A constant of `DType` (the `seed`-th random value) shaped like the operand.
    Full(usize, DType, u64),
    Matmul(usize, usize),
    Reshape(usize, Vec<usize>),
}

/// A random program: its inputs, its operations and which values it returns.
#[derive(Clone, Debug)]
struct Recipe {
    inputs: Vec<(DType, Vec<usize>)>,
    steps: Vec<Step>,
    outputs: Vec<usize>,
}

fn serves(op: &str, d: DType) -> bool {
    crate::support::serves(op, d)
}

fn value_of<T: Reference>(seed: u64) -> T {
    T::random(&mut Rng::new(seed))
}

impl Recipe {
    /// Draws a recipe from `rng`: dtypes and shapes of every value are tracked so each step is
    /// well typed.
    fn draw(rng: &mut Rng) -> Recipe {
        Recipe::draw_with(rng, true)
    }

    /// As `draw`; without matrix products when `products` is false (cuBLAS on a GPU sums in
    /// its own order, so only product-free programs are bit-exact against the interpreter there).
    fn draw_with(rng: &mut Rng, products: bool) -> Recipe {
        let pick = |rng: &mut Rng, n: usize| (rng.next_u64() % n as u64) as usize;
        let lens = [0usize, 1, 3, 4, 5, 16, 17, 33, 1027];
        let with_product = products && rng.next_u64().is_multiple_of(3);
        let (m, k, n) = (1 + pick(rng, 4), 1 + pick(rng, 4), 1 + pick(rng, 4));
        let len = if with_product {
            m * n
        } else {
            lens[pick(rng, lens.len())]
        };
        let mut inputs = Vec::new();
        for _ in 0..1 + pick(rng, 3) {
            inputs.push((DType::ALL[pick(rng, DType::ALL.len())], vec![len]));
        }
        if with_product {
            let d = if rng.next_u64().is_multiple_of(2) {
                DType::F32
            } else {
                DType::F64
            };
            inputs.push((d, vec![m, k]));
            inputs.push((d, vec![k, n]));
        }
        let mut pool: Vec<(DType, Vec<usize>)> = inputs.clone();
        let mut steps = Vec::new();
        let count = 1 + pick(rng, 12);
        while steps.len() < count {
            let a = pick(rng, pool.len());
            let (d, shape) = pool[a].clone();
            let step = match pick(rng, 8) {
                0 | 1 => {
                    let same: Vec<usize> =
                        (0..pool.len()).filter(|&i| pool[i] == pool[a]).collect();
                    let b = same[pick(rng, same.len())];
                    let ops: Vec<&str> = ["add", "sub", "mul", "div"]
                        .into_iter()
                        .filter(|o| serves(o, d))
                        .collect();
                    if ops.is_empty() {
                        Step::Cast(a, DType::F32)
                    } else {
                        Step::Binary(ops[pick(rng, ops.len())], a, b)
                    }
                }
                2 if serves("neg", d) => Step::Neg(a),
                3 if d != DType::Bool => Step::Scale(a, rng.next_u64()),
                4 => Step::Full(a, DType::ALL[pick(rng, DType::ALL.len())], rng.next_u64()),
                5 if with_product => {
                    let pd = inputs[inputs.len() - 1].0;
                    let (ia, ib) = (inputs.len() - 2, inputs.len() - 1);
                    // Sometimes a product of computed operands (captured into the graph),
                    // sometimes of the inputs (an eager call between graph launches).
                    let lhs = if rng.next_u64().is_multiple_of(2) {
                        pool.push((pd, vec![m, k]));
                        steps.push(Step::Scale(ia, rng.next_u64()));
                        pool.len() - 1
                    } else {
                        ia
                    };
                    let prod = Step::Matmul(lhs, ib);
                    pool.push((pd, vec![m, n]));
                    steps.push(prod);
                    Step::Reshape(pool.len() - 1, vec![len])
                }
                6 if shape.len() == 1 => Step::Reshape(a, vec![1, shape[0]]),
                7 if !steps.is_empty() => {
                    // A repeated subexpression: the same step again.
                    let again = steps[pick(rng, steps.len())].clone();
                    let out = result_of(&pool, &again);
                    steps.push(again);
                    pool.push(out);
                    continue;
                }
                _ => Step::Cast(a, DType::ALL[pick(rng, DType::ALL.len())]),
            };
            let out = result_of(&pool, &step);
            steps.push(step);
            pool.push(out);
        }
        let mut outputs = Vec::new();
        for _ in 0..1 + pick(rng, 3) {
            outputs.push(pick(rng, pool.len()));
        }
        outputs.push(pool.len() - 1);
        Recipe {
            inputs,
            steps,
            outputs,
        }
    }
}

fn result_of(pool: &[(DType, Vec<usize>)], step: &Step) -> (DType, Vec<usize>) {
    match step {
        Step::Binary(_, a, _) | Step::Neg(a) | Step::Scale(a, _) => pool[*a].clone(),
        Step::Cast(a, d) | Step::Full(a, d, _) => (*d, pool[*a].1.clone()),
        Step::Matmul(a, b) => (pool[*a].0, vec![pool[*a].1[0], pool[*b].1[1]]),
        Step::Reshape(a, shape) => (pool[*a].0, shape.clone()),
    }
}

/// Traces the recipe.
fn trace(recipe: &Recipe) -> (Vec<TracedTensor>, Vec<TracedTensor>) {
    let inputs: Vec<TracedTensor> = recipe
        .inputs
        .iter()
        .map(|(d, s)| TracedTensor::input_symbolic_shape(*d, s.len()))
        .collect();
    let mut pool = inputs.clone();
    for step in &recipe.steps {
        let t = match step {
            Step::Binary(op, a, b) => {
                let (a, b) = (&pool[*a], &pool[*b]);
                match *op {
                    "add" => a + b,
                    "sub" => a - b,
                    "mul" => a * b,
                    _ => a / b,
                }
                .unwrap()
            }
            Step::Neg(a) => (-&pool[*a]).unwrap(),
            Step::Scale(a, seed) => {
                let a = &pool[*a];
                typed!(a.dtype(), T => a.scale(value_of::<T>(*seed)).unwrap())
            }
            Step::Cast(a, d) => pool[*a].cast(*d),
            Step::Full(a, d, seed) => {
                typed!(*d, T => TracedTensor::full_like(&pool[*a], value_of::<T>(*seed)))
            }
            Step::Matmul(a, b) => pool[*a].matmul(&pool[*b]).unwrap(),
            Step::Reshape(a, shape) => pool[*a].reshape(shape),
        };
        pool.push(t);
    }
    let outputs = recipe.outputs.iter().map(|&i| pool[i].clone()).collect();
    (inputs, outputs)
}

fn cast_to<F: Reference, T: Reference>(a: &[F]) -> Vec<T> {
    a.iter().map(|x| T::from_hub(x.hub())).collect()
}

fn matmul<T: Reference + Default>(a: &[T], b: &[T], m: usize, k: usize, n: usize) -> Vec<T> {
    let mut c = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let mut acc = T::default();
            for q in 0..k {
                acc = acc.add(a[i * k + q].mul(b[q * n + j]));
            }
            c.push(acc);
        }
    }
    c
}

/// The host interpreter: evaluates the recipe on host values, with the reference arithmetic.
fn interpret(recipe: &Recipe, inputs: Vec<Host>) -> Vec<Host> {
    let mut pool = inputs;
    for step in &recipe.steps {
        let v = match step {
            Step::Binary(op, a, b) => {
                let (a, b) = (&pool[*a], &pool[*b]);
                typed!(a.dtype, T => {
                    let f: fn(T, T) -> T = match *op {
                        "add" => T::add,
                        "sub" => T::sub,
                        "mul" => T::mul,
                        _ => T::div,
                    };
                    let out: Vec<T> = a.get::<T>().iter().zip(b.get::<T>()).map(|(x, y)| f(*x, *y)).collect();
                    Host { dtype: a.dtype, shape: a.shape.clone(), data: Box::new(out) }
                })
            }
            Step::Neg(a) => {
                let a = &pool[*a];
                typed!(a.dtype, T => Host { dtype: a.dtype, shape: a.shape.clone(), data: Box::new(a.get::<T>().iter().map(|x| x.neg()).collect::<Vec<T>>()) })
            }
            Step::Scale(a, seed) => {
                let a = &pool[*a];
                typed!(a.dtype, T => {
                    let s = value_of::<T>(*seed);
                    Host { dtype: a.dtype, shape: a.shape.clone(), data: Box::new(a.get::<T>().iter().map(|x| x.mul(s)).collect::<Vec<T>>()) }
                })
            }
            Step::Cast(a, d) => {
                let a = &pool[*a];
                let data: Box<dyn Any> =
                    typed!(a.dtype, F => typed!(*d, T => Box::new(cast_to::<F, T>(a.get::<F>()))));
                Host {
                    dtype: *d,
                    shape: a.shape.clone(),
                    data,
                }
            }
            Step::Full(a, d, seed) => {
                let a = &pool[*a];
                let len: usize = a.shape.iter().product();
                let data: Box<dyn Any> = typed!(*d, T => Box::new(vec![value_of::<T>(*seed); len]));
                Host {
                    dtype: *d,
                    shape: a.shape.clone(),
                    data,
                }
            }
            Step::Matmul(a, b) => {
                let (a, b) = (&pool[*a], &pool[*b]);
                let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
                let data: Box<dyn Any> = match a.dtype {
                    DType::F32 => Box::new(matmul(a.get::<f32>(), b.get::<f32>(), m, k, n)),
                    _ => Box::new(matmul(a.get::<f64>(), b.get::<f64>(), m, k, n)),
                };
                Host {
                    dtype: a.dtype,
                    shape: vec![m, n],
                    data,
                }
            }
            Step::Reshape(a, shape) => {
                let a = &pool[*a];
                let data: Box<dyn Any> = typed!(a.dtype, T => Box::new(a.get::<T>().clone()));
                Host {
                    dtype: a.dtype,
                    shape: shape.clone(),
                    data,
                }
            }
        };
        pool.push(v);
    }
    recipe
        .outputs
        .iter()
        .map(|&i| {
            let h = &pool[i];
            let data: Box<dyn Any> = typed!(h.dtype, T => Box::new(h.get::<T>().clone()));
            Host {
                dtype: h.dtype,
                shape: h.shape.clone(),
                data,
            }
        })
        .collect()
}

/// Fresh random inputs: host values and their uploads.
fn fresh_inputs(
    engine: &mut CudaEngine,
    recipe: &Recipe,
    rng: &mut Rng,
) -> (Vec<Host>, Vec<Box<dyn Any>>) {
    let mut hosts = Vec::new();
    let mut tensors: Vec<Box<dyn Any>> = Vec::new();
    for (d, shape) in &recipe.inputs {
        let len: usize = shape.iter().product();
        typed!(*d, T => {
            let v = random_vec::<T>(rng, len);
            tensors.push(Box::new(upload_tensor(engine, &v, shape).unwrap()));
            hosts.push(Host { dtype: *d, shape: shape.clone(), data: Box::new(v) });
        });
    }
    (hosts, tensors)
}

fn as_input<'a>(d: DType, t: &'a dyn Any) -> Input<'a> {
    typed!(d, T => Input::from(t.downcast_ref::<DeviceTensor<T>>().expect("an input of its type")))
}

/// Runs once on fresh inputs and checks every output against the interpreter.
fn run_and_check(
    engine: &mut CudaEngine,
    prepared: &mut Prepared,
    recipe: &Recipe,
    rng: &mut Rng,
) -> Result<(), cuferry::Error> {
    let (hosts, tensors) = fresh_inputs(engine, recipe, rng);
    check_run(engine, prepared, recipe, hosts, tensors, || {})
}

/// Runs once on the given inputs (calling `arm` just before the run) and checks every output.
fn check_run(
    engine: &mut CudaEngine,
    prepared: &mut Prepared,
    recipe: &Recipe,
    hosts: Vec<Host>,
    tensors: Vec<Box<dyn Any>>,
    arm: impl FnOnce(),
) -> Result<(), cuferry::Error> {
    let inputs: Vec<Input<'_>> = recipe
        .inputs
        .iter()
        .zip(&tensors)
        .map(|((d, _), t)| as_input(*d, t.as_ref()))
        .collect();
    let expected = interpret(recipe, hosts);
    arm();
    let outputs = engine.run(prepared, &inputs);
    if let Some(sim) = engine.sim() {
        sim.clear_faults();
    }
    let outputs = outputs?;
    assert_eq!(outputs.len(), expected.len());
    for (k, (out, want)) in outputs.iter().zip(&expected).enumerate() {
        assert_eq!(out.dtype(), want.dtype, "output {k}: element type");
        assert_eq!(out.shape(), want.shape.as_slice(), "output {k}: shape");
        typed!(want.dtype, T => {
            let tensor = out.as_tensor::<T>().expect("output of its type");
            let got = download_tensor(engine, tensor)?;
            crate::support::assert_same(&format!("output {k} ({:?})", recipe), &got, want.get::<T>());
        });
        if let Output::Borrowed { input, .. } = out {
            assert!(*input < recipe.inputs.len());
        }
    }
    Ok(())
}

fn leak_free(engine: &mut CudaEngine, baseline: usize) {
    let sim = engine.sim().unwrap();
    // The first synchronize proves the last run complete and releases the program's arena,
    // whose free is queued then; the second runs that free.
    let _ = engine.synchronize();
    let _ = engine.synchronize();
    assert_eq!(sim.graphs_live(), 0, "graphs outlived their program");
    assert_eq!(
        sim.device_live().0,
        baseline,
        "device memory outlived its owner"
    );
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn prepared_programs_match_the_host_interpreter(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let recipe = Recipe::draw(&mut rng);
        let (inputs, outputs) = trace(&recipe);
        let specs: Vec<(&TracedTensor, DType, &[usize])> = inputs.iter().zip(&recipe.inputs).map(|(t, (d, s))| (t, *d, s.as_slice())).collect();
        let refs: Vec<&TracedTensor> = outputs.iter().collect();
        let program = GraphCompiler::new().compile_with_input_specs(&refs, &specs).unwrap();
        let mut engine = CudaEngine::simulated(SimConfig::default());
        let mut prepared = engine.prepare(&program).unwrap();
        for _ in 0..3 {
            run_and_check(&mut engine, &mut prepared, &recipe, &mut rng).unwrap();
        }
        prop_assert_eq!(prepared.stats().runs, 3);
        drop(prepared);
        leak_free(&mut engine, 0);
    }

    #[test]
    fn faults_in_prepare_and_run_are_reported_and_leak_nothing(seed in any::<u64>(), at_prepare in any::<bool>(), which in 0usize..7, nth in 1u64..4) {
        let mut rng = Rng::new(seed);
        let recipe = Recipe::draw(&mut rng);
        let (inputs, outputs) = trace(&recipe);
        let specs: Vec<(&TracedTensor, DType, &[usize])> = inputs.iter().zip(&recipe.inputs).map(|(t, (d, s))| (t, *d, s.as_slice())).collect();
        let refs: Vec<&TracedTensor> = outputs.iter().collect();
        let program = GraphCompiler::new().compile_with_input_specs(&refs, &specs).unwrap();
        let mut engine = CudaEngine::simulated(SimConfig::default());
        let sim = engine.sim().unwrap();
        let ops = [SimOp::ModuleLoad, SimOp::Alloc, SimOp::CaptureBegin, SimOp::CaptureEnd, SimOp::GraphInstantiate, SimOp::GraphSetParams, SimOp::GraphLaunch];
        let run_ops = [SimOp::Alloc, SimOp::GraphSetParams, SimOp::GraphLaunch, SimOp::Launch, SimOp::Alloc, SimOp::GraphLaunch, SimOp::GraphSetParams];
        if at_prepare {
            sim.fail_nth(ops[which], nth, DriverError::OUT_OF_MEMORY);
            match engine.prepare(&program) {
                Ok(mut prepared) => {
                    sim.clear_faults();
                    prop_assert!(sim.graphs_live() > 0 || prepared.stats().graphs == 0);
                    run_and_check(&mut engine, &mut prepared, &recipe, &mut rng).unwrap();
                }
                Err(_) => sim.clear_faults(),
            }
        } else {
            let mut prepared = engine.prepare(&program).unwrap();
            run_and_check(&mut engine, &mut prepared, &recipe, &mut rng).unwrap();
            let (hosts, tensors) = fresh_inputs(&mut engine, &recipe, &mut rng);
            let arm = || sim.fail_nth(run_ops[which], nth, DriverError::OUT_OF_MEMORY);
            // Either the fault hit the run (an error, nothing checked) or it came after it.
            let _ = check_run(&mut engine, &mut prepared, &recipe, hosts, tensors, arm);
            // The program stays usable after a failed run.
            run_and_check(&mut engine, &mut prepared, &recipe, &mut rng).unwrap();
        }
        let _ = engine.flush();
        leak_free(&mut engine, 0);
    }
}

fn compile(recipe: &Recipe) -> cuferry::graph::Program {
    let (inputs, outputs) = trace(recipe);
    let specs: Vec<(&TracedTensor, DType, &[usize])> = inputs
        .iter()
        .zip(&recipe.inputs)
        .map(|(t, (d, s))| (t, *d, s.as_slice()))
        .collect();
    let refs: Vec<&TracedTensor> = outputs.iter().collect();
    GraphCompiler::new()
        .compile_with_input_specs(&refs, &specs)
        .unwrap()
}

/// For every element type: a chain of every operation the type serves, fused into one kernel,
/// against the same operations run eagerly on the engine, bit for bit.
fn fused_matches_eager(engine: &mut CudaEngine) {
    fn chain<T: Reference>(engine: &mut CudaEngine, rng: &mut Rng) {
        let n = 4099;
        let (xv, yv) = (random_vec::<T>(rng, n), random_vec::<T>(rng, n));
        let factor = T::random(rng);
        let d = T::DTYPE;
        let x = TracedTensor::input_symbolic_shape(d, 1);
        let y = TracedTensor::input_symbolic_shape(d, 1);
        let xt = upload_tensor(engine, &xv, &[n]).unwrap();
        let yt = upload_tensor(engine, &yv, &[n]).unwrap();
        // Traced and eager, step by step.
        let mut t = x.clone();
        let mut e = engine.copy_tensor(&xt).unwrap();
        for op in ["add", "mul", "sub", "div"] {
            if !crate::support::serves(op, d) {
                continue;
            }
            t = match op {
                "add" => &t + &y,
                "mul" => &t * &y,
                "sub" => &t - &x,
                _ => &t / &y,
            }
            .unwrap();
            e = match op {
                "add" => engine.add(&e, &yt),
                "mul" => engine.mul(&e, &yt),
                "sub" => engine.sub(&e, &xt),
                _ => engine.div(&e, &yt),
            }
            .unwrap();
        }
        if crate::support::serves("scale", d) {
            t = t.scale(factor).unwrap();
            e = engine.scale(&e, factor).unwrap();
        }
        if crate::support::serves("neg", d) {
            t = (-&t).unwrap();
            e = engine.neg(&e).unwrap();
        }
        // Out through f16 and back: two roundings the fused kernel must keep.
        let t = t.cast(DType::F16).cast(d);
        let h = engine.cast::<f16>(&e).unwrap();
        let e = engine.cast::<T>(&h).unwrap();
        let program = GraphCompiler::new()
            .compile_with_input_specs(&[&t], &[(&x, d, &[n]), (&y, d, &[n])])
            .unwrap();
        assert_eq!(program.stats().fused_kernels, 1, "{d}: one fused kernel");
        let mut prepared = engine.prepare(&program).unwrap();
        let outputs = engine
            .run(&mut prepared, &[Input::from(&xt), Input::from(&yt)])
            .unwrap();
        let fused = download_tensor(engine, outputs[0].as_tensor::<T>().unwrap()).unwrap();
        let eager = download_tensor(engine, &e).unwrap();
        crate::support::assert_same(&format!("fused {d} against eager"), &fused, &eager);
    }
    let mut rng = Rng::new(77);
    cuferry_tests_each!(T => chain::<T>(engine, &mut rng));
    engine.synchronize().unwrap();
}

macro_rules! cuferry_tests_each {
    ($t:ident => $body:expr_2021) => {
        for d in DType::ALL {
            typed!(d, $t => $body);
        }
    };
}
use cuferry_tests_each;

#[test]
fn fused_kernels_match_the_eager_operations_for_every_element_type() {
    fused_matches_eager(&mut CudaEngine::simulated(SimConfig::default()));
}

#[test]
#[ignore = "needs a CUDA device"]
fn on_the_gpu_fused_kernels_match_the_eager_operations_for_every_element_type() {
    fused_matches_eager(&mut CudaEngine::open(0).unwrap());
}

#[test]
#[ignore = "needs a CUDA device"]
fn on_the_gpu_prepared_programs_match_the_host_interpreter() {
    let mut engine = CudaEngine::open(0).unwrap();
    for seed in 0..48u64 {
        let mut rng = Rng::new(seed + 5000);
        let recipe = Recipe::draw_with(&mut rng, false);
        let program = compile(&recipe);
        let mut prepared = engine.prepare(&program).unwrap();
        for _ in 0..3 {
            run_and_check(&mut engine, &mut prepared, &recipe, &mut rng).unwrap();
        }
    }
    engine.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn on_the_gpu_products_match_the_eager_matmul() {
    // Captured (product of computed operands) and eager (product of an input) cuBLAS calls,
    // against the engine's own `matmul`, which is the same cuBLAS call: identical bits.
    let mut engine = CudaEngine::open(0).unwrap();
    let (m, k, n) = (33, 65, 17);
    let mut rng = Rng::new(9);
    let av = random_vec::<f32>(&mut rng, m * k);
    let bv = random_vec::<f32>(&mut rng, k * n);
    let a = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let b = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let a2 = a.scale(0.5f32).unwrap();
    let captured = a2.matmul(&(&b + &b).unwrap()).unwrap();
    let eager = a.matmul(&b).unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(
            &[&captured, &eager],
            &[(&a, DType::F32, &[m, k]), (&b, DType::F32, &[k, n])],
        )
        .unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    let at = upload_tensor(&mut engine, &av, &[m, k]).unwrap();
    let bt = upload_tensor(&mut engine, &bv, &[k, n]).unwrap();
    let a2t = engine.scale(&at, 0.5f32).unwrap();
    let b2t = engine.add(&bt, &bt).unwrap();
    let want_captured = engine.matmul(&a2t, &b2t).unwrap();
    let want_eager = engine.matmul(&at, &bt).unwrap();
    for _ in 0..3 {
        let outputs = engine
            .run(&mut prepared, &[Input::from(&at), Input::from(&bt)])
            .unwrap();
        for (out, want) in outputs.iter().zip([&want_captured, &want_eager]) {
            let got = download_tensor(&mut engine, out.as_tensor::<f32>().unwrap()).unwrap();
            let want = download_tensor(&mut engine, want).unwrap();
            crate::support::assert_same("product", &got, &want);
        }
    }
    assert!(prepared.stats().graph_launches >= 3);
    assert_eq!(prepared.stats().eager_calls, 3);
    engine.synchronize().unwrap();
}
