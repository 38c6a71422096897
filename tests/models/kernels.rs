//! A model test of the elementwise kernels on the simulated device: random chains of dependent
//! operations over a growing pool of tensors, with random drops and random advances of the
//! device clock between calls, checked against a pure host model. A free that overtook a kernel
//! still reading the memory, or a kernel that read an operand before its producer ran, would
//! show as a simulator violation or a wrong value.

use cuferry::sim::SimConfig;
use cuferry::{CudaEngine, DeviceTensor, download_tensor, upload_tensor};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Step {
    Add(usize, usize),
    Sub(usize, usize),
    Mul(usize, usize),
    Neg(usize),
    Scale(usize, i32),
    /// i32 → f64 → i32, exact for every i32.
    RoundTrip(usize),
    Fill(usize, i32),
    Drop(usize),
    Advance(usize),
}

fn step() -> impl Strategy<Value = Step> {
    let i = 0usize..64;
    prop_oneof![
        (i.clone(), i.clone()).prop_map(|(a, b)| Step::Add(a, b)),
        (i.clone(), i.clone()).prop_map(|(a, b)| Step::Sub(a, b)),
        (i.clone(), i.clone()).prop_map(|(a, b)| Step::Mul(a, b)),
        i.clone().prop_map(Step::Neg),
        (i.clone(), any::<i32>()).prop_map(|(a, s)| Step::Scale(a, s)),
        i.clone().prop_map(Step::RoundTrip),
        (i.clone(), any::<i32>()).prop_map(|(a, v)| Step::Fill(a, v)),
        i.clone().prop_map(Step::Drop),
        (0usize..6).prop_map(Step::Advance),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_chains_match_the_host_model(
        seed in proptest::collection::vec(any::<i32>(), 1..40),
        steps in proptest::collection::vec(step(), 1..40),
    ) {
        let mut engine = CudaEngine::simulated(SimConfig::default());
        let sim = engine.sim().unwrap();
        let n = seed.len();
        let mut model: Vec<Vec<i32>> = vec![seed.clone()];
        let mut pool: Vec<DeviceTensor<i32>> = vec![upload_tensor(&mut engine, &seed, &[n]).unwrap()];
        for s in steps {
            let pick = |i: usize| i % model.len();
            let (value, tensor) = match s {
                Step::Add(a, b) => {
                    let (a, b) = (pick(a), pick(b));
                    let v = model[a].iter().zip(&model[b]).map(|(x, y)| x.wrapping_add(*y)).collect();
                    (v, engine.add(&pool[a], &pool[b]).unwrap())
                }
                Step::Sub(a, b) => {
                    let (a, b) = (pick(a), pick(b));
                    let v = model[a].iter().zip(&model[b]).map(|(x, y)| x.wrapping_sub(*y)).collect();
                    (v, engine.sub(&pool[a], &pool[b]).unwrap())
                }
                Step::Mul(a, b) => {
                    let (a, b) = (pick(a), pick(b));
                    let v = model[a].iter().zip(&model[b]).map(|(x, y)| x.wrapping_mul(*y)).collect();
                    (v, engine.mul(&pool[a], &pool[b]).unwrap())
                }
                Step::Neg(a) => {
                    let a = pick(a);
                    let v = model[a].iter().map(|x| x.wrapping_neg()).collect();
                    (v, engine.neg(&pool[a]).unwrap())
                }
                Step::Scale(a, f) => {
                    let a = pick(a);
                    let v = model[a].iter().map(|x| x.wrapping_mul(f)).collect();
                    (v, engine.scale(&pool[a], f).unwrap())
                }
                Step::RoundTrip(a) => {
                    let a = pick(a);
                    let wide = engine.cast::<f64>(&pool[a]).unwrap();
                    let back = engine.cast::<i32>(&wide).unwrap();
                    drop(wide); // freed behind the cast that reads it
                    (model[a].clone(), back)
                }
                Step::Fill(a, v) => {
                    let a = pick(a);
                    engine.fill(&mut pool[a], v).unwrap();
                    model[a] = vec![v; n];
                    continue;
                }
                Step::Drop(a) => {
                    if model.len() > 1 {
                        let a = pick(a);
                        model.remove(a);
                        pool.remove(a); // freed behind every kernel queued before
                    }
                    continue;
                }
                Step::Advance(k) => {
                    sim.advance(k);
                    continue;
                }
            };
            model.push(value);
            pool.push(tensor);
        }
        for (i, (t, want)) in pool.iter().zip(&model).enumerate() {
            let got = download_tensor(&mut engine, t).unwrap();
            prop_assert_eq!(&got, want, "tensor {}", i);
        }
        prop_assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }
}
