//! Broadcasting elementwise operations, transposed products and `linear`, on either device,
//! against host references, and prepared programs that broadcast as the eager operations do.

use super::Device;
use cuferry::libs::Transpose;
use cuferry::{download_tensor, upload_tensor};

pub(crate) fn a_bias_a_column_and_a_scalar_broadcast_on_either_side(dev: Device) {
    let mut engine = dev.engine();
    let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let dx = upload_tensor(&mut engine, &x, &[3, 4]).unwrap();
    let bias = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let column = upload_tensor(&mut engine, &[10.0f32, 20.0, 30.0], &[3, 1]).unwrap();
    let scalar = upload_tensor(&mut engine, &[2.0f32], &[]).unwrap();
    let y = engine.add(&dx, &bias).unwrap();
    let want: Vec<f32> = (0..12).map(|i| x[i] + (i % 4 + 1) as f32).collect();
    assert_eq!(download_tensor(&mut engine, &y).unwrap(), want);
    let y = engine.sub(&column, &dx).unwrap();
    let want: Vec<f32> = (0..12).map(|i| (i / 4 + 1) as f32 * 10.0 - x[i]).collect();
    assert_eq!(download_tensor(&mut engine, &y).unwrap(), want);
    let y = engine.mul(&scalar, &dx).unwrap();
    let want: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
    assert_eq!(download_tensor(&mut engine, &y).unwrap(), want);
    let a = upload_tensor(&mut engine, &[1i32, 2, 3], &[3, 1]).unwrap();
    let b = upload_tensor(&mut engine, &[10i32, 20], &[1, 2]).unwrap();
    let y = engine.add(&a, &b).unwrap();
    assert_eq!(y.shape(), &[3, 2]);
    assert_eq!(
        download_tensor(&mut engine, &y).unwrap(),
        [11, 21, 12, 22, 13, 23]
    );
}

pub(crate) fn matmul_t_in_each_combination_and_linear_with_a_bias(dev: Device) {
    let mut engine = dev.engine();
    let x = upload_tensor(&mut engine, &[1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let w = upload_tensor(&mut engine, &[1.0f64, 0.0, 1.0, 0.0, 1.0, 0.0], &[2, 3]).unwrap();
    let y = engine
        .matmul_t(&x, Transpose::No, &w, Transpose::Yes)
        .unwrap();
    assert_eq!(
        download_tensor(&mut engine, &y).unwrap(),
        [4.0, 2.0, 10.0, 5.0]
    );
    let y = engine
        .matmul_t(&x, Transpose::Yes, &w, Transpose::No)
        .unwrap();
    assert_eq!(
        download_tensor(&mut engine, &y).unwrap(),
        [1.0, 4.0, 1.0, 2.0, 5.0, 2.0, 3.0, 6.0, 3.0]
    );
    let y = engine.matmul_t(&x, Transpose::Yes, &x, Transpose::Yes);
    assert!(y.is_err());
    let y = engine
        .matmul_t(&w, Transpose::Yes, &x, Transpose::No)
        .unwrap();
    assert_eq!(
        download_tensor(&mut engine, &y).unwrap(),
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.0, 2.0, 3.0]
    );
    let b = upload_tensor(&mut engine, &[0.5f64, -1.0], &[2]).unwrap();
    let y = engine.linear(&x, &w, Some(&b)).unwrap();
    assert_eq!(
        download_tensor(&mut engine, &y).unwrap(),
        [4.5, 1.0, 10.5, 4.0]
    );
}

/// A prepared program of one traced op on `a` (`sa`) and `b` (`sb`), run on the device: its
/// output's elements and the eager op's, as bits.
fn prepared_and_eager(
    engine: &mut cuferry::CudaEngine,
    name: &str,
    sa: &[usize],
    sb: &[usize],
) -> (Vec<u32>, Vec<u32>) {
    use cuferry::DType;
    use cuferry::graph::{GraphCompiler, Input, TracedTensor};
    let la: usize = sa.iter().product();
    let lb: usize = sb.iter().product();
    let a: Vec<f32> = (0..la).map(|i| (i % 7) as f32 * 1.25 - 3.0).collect();
    let b: Vec<f32> = (0..lb).map(|i| (i % 5) as f32 * 0.75 + 0.5).collect();
    let da = upload_tensor(engine, &a, sa).unwrap();
    let db = upload_tensor(engine, &b, sb).unwrap();
    let ta = TracedTensor::input_symbolic_shape(DType::F32, sa.len());
    let tb = TracedTensor::input_symbolic_shape(DType::F32, sb.len());
    let (y, eager) = match name {
        "add" => ((&ta + &tb).unwrap(), engine.add(&da, &db).unwrap()),
        "sub" => ((&ta - &tb).unwrap(), engine.sub(&da, &db).unwrap()),
        "mul" => ((&ta * &tb).unwrap(), engine.mul(&da, &db).unwrap()),
        _ => ((&ta / &tb).unwrap(), engine.div(&da, &db).unwrap()),
    };
    let program = GraphCompiler::new()
        .compile_with_input_specs(&[&y], &[(&ta, DType::F32, sa), (&tb, DType::F32, sb)])
        .unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    let eager = download_tensor(engine, &eager).unwrap();
    let mut got = Vec::new();
    for _ in 0..2 {
        let out = engine
            .run(&mut prepared, &[Input::from(&da), Input::from(&db)])
            .unwrap();
        got = download_tensor(engine, out[0].as_tensor::<f32>().unwrap()).unwrap();
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    (bits(&got), bits(&eager))
}

pub(crate) fn prepared_programs_broadcast_as_the_eager_ops_and_linear_takes_a_bias(dev: Device) {
    use cuferry::DType;
    use cuferry::error::UsageError;
    use cuferry::graph::{GraphCompiler, Input, TracedTensor};
    let mut engine = dev.engine();
    // `[B, N] + [N]`, `[B, M, N] + [M, N]` (and the other way round), a column, and a large
    // bias case whose output takes the kernels' vector path.
    let cases: &[(&[usize], &[usize])] = &[
        (&[3, 4], &[4]),
        (&[2, 3, 4], &[3, 4]),
        (&[3, 4], &[2, 3, 4]),
        (&[3, 1], &[3, 4]),
        (&[64, 1000], &[1000]),
    ];
    for &(sa, sb) in cases {
        for name in ["add", "sub", "mul", "div"] {
            let (got, want) = prepared_and_eager(&mut engine, name, sa, sb);
            assert_eq!(got, want, "{name} {sa:?} {sb:?}");
        }
    }
    // `[B, N] + [B]` is refused when compiled, as the eager op refuses it.
    let a = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let b = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let y = (&a + &b).unwrap();
    let error = GraphCompiler::new()
        .compile_with_input_specs(&[&y], &[(&a, DType::F32, &[3, 4]), (&b, DType::F32, &[3])])
        .unwrap_err();
    assert!(
        matches!(
            error,
            cuferry::Error::Usage(UsageError::NotBroadcastable { dim: 1, .. })
        ),
        "{error:?}"
    );
    // A traced `linear` with a `[out]` bias equals the eager one.
    let xs: Vec<f32> = (0..12).map(|i| (i % 5) as f32 - 2.0).collect();
    let ws: Vec<f32> = (0..20).map(|i| (i % 7) as f32 * 0.5 - 1.5).collect();
    let bs: Vec<f32> = (0..5).map(|i| i as f32 * 0.25 - 0.5).collect();
    let dx = upload_tensor(&mut engine, &xs, &[3, 4]).unwrap();
    let dw = upload_tensor(&mut engine, &ws, &[5, 4]).unwrap();
    let db = upload_tensor(&mut engine, &bs, &[5]).unwrap();
    let x = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let w = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let bias = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let y = x.linear(&w, Some(&bias)).unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(
            &[&y],
            &[
                (&x, DType::F32, &[3, 4]),
                (&w, DType::F32, &[5, 4]),
                (&bias, DType::F32, &[5]),
            ],
        )
        .unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    let eager = engine.linear(&dx, &dw, Some(&db)).unwrap();
    let eager = download_tensor(&mut engine, &eager).unwrap();
    for _ in 0..2 {
        let out = engine
            .run(
                &mut prepared,
                &[Input::from(&dx), Input::from(&dw), Input::from(&db)],
            )
            .unwrap();
        let got = download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap();
        assert_eq!(got, eager);
    }
    engine.synchronize().unwrap();
}
