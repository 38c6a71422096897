//! Broadcasting elementwise operations, transposed products and `linear`, on either device:
//! NumPy's rules (trailing dimensions aligned, each equal or 1) against host references for
//! every element family, shapes that do not broadcast refused with a typed error that names
//! both shapes and the dimension, and prepared programs that broadcast and fuse as the eager
//! operations do.

use super::Device;
use cuferry::error::UsageError;
use cuferry::libs::Transpose;
use cuferry::{CudaEngine, Error, download_tensor, upload_tensor};

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

/// NumPy's broadcast shape of `a` and `b`, and the source index of each output element.
fn reference_broadcast(a: &[usize], b: &[usize]) -> (Vec<usize>, Vec<(usize, usize)>) {
    let rank = a.len().max(b.len());
    let pad = |s: &[usize]| {
        let mut v = vec![1; rank - s.len()];
        v.extend_from_slice(s);
        v
    };
    let (pa, pb) = (pad(a), pad(b));
    let out: Vec<usize> = pa
        .iter()
        .zip(&pb)
        .map(|(&x, &y)| if x == 1 { y } else { x })
        .collect();
    let len: usize = out.iter().product();
    let mut idx = Vec::with_capacity(len);
    for i in 0..len {
        let (mut rem, mut ia, mut ib, mut sa, mut sb) = (i, 0, 0, 1, 1);
        for d in (0..rank).rev() {
            let c = rem % out[d];
            rem /= out[d];
            if pa[d] != 1 {
                ia += c * sa;
            }
            if pb[d] != 1 {
                ib += c * sb;
            }
            sa *= pa[d];
            sb *= pb[d];
        }
        idx.push((ia, ib));
    }
    (out, idx)
}

/// Every op of the family on `a` (shape `sa`) and `b` (shape `sb`) against the reference.
macro_rules! check_all {
    ($engine:expr, $t:ty, $sa:expr, $sb:expr, $div:expr) => {{
        let (sa, sb): (&[usize], &[usize]) = ($sa, $sb);
        let la: usize = sa.iter().product();
        let lb: usize = sb.iter().product();
        let a: Vec<$t> = (0..la).map(|i| (i % 7 + 10) as u8 as $t).collect();
        let b: Vec<$t> = (0..lb).map(|i| (i % 5 + 2) as u8 as $t).collect();
        let ta = upload_tensor($engine, &a, sa).unwrap();
        let tb = upload_tensor($engine, &b, sb).unwrap();
        let (shape, idx) = reference_broadcast(sa, sb);
        let ops: Vec<(&str, fn($t, $t) -> $t)> = {
            let mut v: Vec<(&str, fn($t, $t) -> $t)> = vec![
                ("add", |x, y| x + y),
                ("sub", |x, y| x - y),
                ("mul", |x, y| x * y),
            ];
            if $div {
                v.push(("div", |x, y| x / y));
            }
            v
        };
        for (name, f) in ops {
            let out = match name {
                "add" => $engine.add(&ta, &tb),
                "sub" => $engine.sub(&ta, &tb),
                "mul" => $engine.mul(&ta, &tb),
                _ => $engine.div(&ta, &tb),
            }
            .unwrap();
            assert_eq!(out.shape(), &shape[..], "{name} {sa:?} {sb:?}");
            let got = download_tensor($engine, &out).unwrap();
            let want: Vec<$t> = idx.iter().map(|&(i, j)| f(a[i], b[j])).collect();
            assert_eq!(got, want, "{name} {sa:?} {sb:?} ({})", stringify!($t));
        }
    }};
}

const CASES: &[(&[usize], &[usize])] = &[
    (&[3, 4], &[4]),
    (&[4], &[3, 4]),
    (&[3, 4], &[1, 4]),
    (&[3, 4], &[3, 1]),
    (&[3, 1], &[3, 4]),
    (&[3, 4], &[1]),
    (&[3, 4], &[]),
    (&[], &[3, 4]),
    (&[3, 1], &[1, 4]),
    (&[2, 3, 4], &[3, 1]),
    (&[2, 1, 4], &[3, 1]),
    (&[2, 3, 4], &[2, 1, 4]),
    (&[5, 1, 3, 1], &[1, 2, 1, 6]),
    (&[0, 4], &[4]),
];

pub(crate) fn binary_ops_broadcast_a_trailing_shape_for_every_element_family(dev: Device) {
    let mut engine = dev.engine();
    for &(sa, sb) in CASES {
        check_all!(&mut engine, f32, sa, sb, true);
        check_all!(&mut engine, f64, sa, sb, true);
        check_all!(&mut engine, i32, sa, sb, false);
        check_all!(&mut engine, i64, sa, sb, false);
        check_all!(&mut engine, u8, sa, sb, false);
        check_all!(&mut engine, u32, sa, sb, false);
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn half_types_broadcast_a_bias_like_their_f32_result(dev: Device) {
    use cuferry::{bf16, f16};
    let mut engine = dev.engine();
    let x: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
    let bias: Vec<f32> = vec![0.25, -1.0, 3.0, 0.125];
    let want: Vec<f32> = (0..12).map(|i| x[i] + bias[i % 4]).collect();
    let h = |v: &[f32]| v.iter().map(|&f| f16::from_f32(f)).collect::<Vec<_>>();
    let b = |v: &[f32]| v.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
    let (tx, tb) = (
        upload_tensor(&mut engine, &h(&x), &[3, 4]).unwrap(),
        upload_tensor(&mut engine, &h(&bias), &[4]).unwrap(),
    );
    let out = engine.add(&tx, &tb).unwrap();
    assert_eq!(download_tensor(&mut engine, &out).unwrap(), h(&want));
    let (tx, tb) = (
        upload_tensor(&mut engine, &b(&x), &[3, 4]).unwrap(),
        upload_tensor(&mut engine, &b(&bias), &[4]).unwrap(),
    );
    let out = engine.add(&tx, &tb).unwrap();
    assert_eq!(download_tensor(&mut engine, &out).unwrap(), b(&want));
}

pub(crate) fn shapes_that_do_not_broadcast_get_a_typed_error_naming_both_and_leak_nothing(
    dev: Device,
) {
    let mut engine = dev.engine();
    let a = upload_tensor(&mut engine, &[0f32; 12], &[3, 4]).unwrap();
    let b = upload_tensor(&mut engine, &[0f32; 3], &[3]).unwrap();
    // The simulator counts live allocations; a GPU cannot, so there this checks nothing.
    let before = engine.sim().map(|sim| sim.device_live());
    let error = engine.add(&a, &b).unwrap_err();
    match &error {
        Error::Usage(UsageError::NotBroadcastable {
            operation,
            left,
            right,
            dim,
        }) => {
            assert_eq!(*operation, "add");
            assert_eq!(left, &[3, 4]);
            assert_eq!(right, &[3]);
            assert_eq!(*dim, 1);
        }
        other => panic!("{other:?}"),
    }
    let text = error.to_string();
    assert!(text.contains("[3, 4]") && text.contains("[3]"), "{text}");
    assert!(text.contains("equal or 1"), "{text}");
    assert_eq!(engine.sim().map(|sim| sim.device_live()), before);
    drop((a, b));
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn cast_infers_its_source_type(dev: Device) {
    let mut engine = dev.engine();
    let x = upload_tensor(&mut engine, &[1i32, -2, 3], &[3]).unwrap();
    let y = engine.cast::<f32>(&x).unwrap();
    assert_eq!(download_tensor(&mut engine, &y).unwrap(), [1.0, -2.0, 3.0]);
}

/// Row-major `op(a) · op(b)`.
fn reference_matmul(
    a: &[f64],
    [ar, ac]: [usize; 2],
    ta: Transpose,
    b: &[f64],
    [br, bc]: [usize; 2],
    tb: Transpose,
) -> Vec<f64> {
    let at = |i: usize, j: usize| match ta {
        Transpose::No => a[i * ac + j],
        Transpose::Yes => a[j * ac + i],
    };
    let bt = |i: usize, j: usize| match tb {
        Transpose::No => b[i * bc + j],
        Transpose::Yes => b[j * bc + i],
    };
    let (m, k) = if ta == Transpose::No {
        (ar, ac)
    } else {
        (ac, ar)
    };
    let n = if tb == Transpose::No { bc } else { br };
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
        }
    }
    c
}

fn values(n: usize, seed: usize) -> Vec<f64> {
    (0..n).map(|i| ((i * 7 + seed) % 11) as f64 - 5.0).collect()
}

pub(crate) fn matmul_t_takes_each_of_the_four_transpose_combinations(dev: Device) {
    let mut engine = dev.engine();
    let (m, k, n) = (3, 4, 5);
    for ta in [Transpose::No, Transpose::Yes] {
        for tb in [Transpose::No, Transpose::Yes] {
            let sa = if ta == Transpose::No { [m, k] } else { [k, m] };
            let sb = if tb == Transpose::No { [k, n] } else { [n, k] };
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let da = upload_tensor(&mut engine, &a, &sa).unwrap();
            let db = upload_tensor(&mut engine, &b, &sb).unwrap();
            let c = engine.matmul_t(&da, ta, &db, tb).unwrap();
            assert_eq!(c.shape(), &[m, n]);
            let got = download_tensor(&mut engine, &c).unwrap();
            assert_eq!(
                got,
                reference_matmul(&a, sa, ta, &b, sb, tb),
                "{ta:?} {tb:?}"
            );
        }
    }
    // Inner dimensions that disagree under the transposes: typed, with the shapes as used.
    let a = upload_tensor(&mut engine, &values(12, 0), &[3, 4]).unwrap();
    let error = engine
        .matmul_t(&a, Transpose::No, &a, Transpose::No)
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::Usage(UsageError::InnerDimensions {
                operation: "matmul",
                left: [3, 4],
                right: [3, 4],
            })
        ),
        "{error:?}"
    );
    let ok = engine
        .matmul_t(&a, Transpose::No, &a, Transpose::Yes)
        .unwrap();
    assert_eq!(ok.shape(), &[3, 3]);
}

pub(crate) fn linear_is_x_times_w_transposed_plus_bias_in_pytorchs_layout(dev: Device) {
    let mut engine = dev.engine();
    let (batch, seq, inf, outf) = (2, 3, 4, 5);
    let x = values(batch * seq * inf, 3);
    let w = values(outf * inf, 4);
    let bias = values(outf, 5);
    let dx = upload_tensor(&mut engine, &x, &[batch, seq, inf]).unwrap();
    let dw = upload_tensor(&mut engine, &w, &[outf, inf]).unwrap();
    let db = upload_tensor(&mut engine, &bias, &[outf]).unwrap();
    let plain = reference_matmul(
        &x,
        [batch * seq, inf],
        Transpose::No,
        &w,
        [outf, inf],
        Transpose::Yes,
    );
    let y = engine.linear(&dx, &dw, None).unwrap();
    assert_eq!(y.shape(), &[batch, seq, outf]);
    assert_eq!(download_tensor(&mut engine, &y).unwrap(), plain);
    let y = engine.linear(&dx, &dw, Some(&db)).unwrap();
    assert_eq!(y.shape(), &[batch, seq, outf]);
    let want: Vec<f64> = plain
        .iter()
        .enumerate()
        .map(|(i, v)| v + bias[i % outf])
        .collect();
    assert_eq!(download_tensor(&mut engine, &y).unwrap(), want);

    // Wrong widths are typed and say which.
    let bad_w = upload_tensor(&mut engine, &values(15, 0), &[5, 3]).unwrap();
    let error = engine.linear(&dx, &bad_w, None).unwrap_err();
    assert!(
        matches!(
            error,
            Error::Usage(UsageError::InnerDimensions {
                operation: "linear",
                ..
            })
        ),
        "{error:?}"
    );
    let bad_bias = upload_tensor(&mut engine, &values(4, 0), &[4]).unwrap();
    let error = engine.linear(&dx, &dw, Some(&bad_bias)).unwrap_err();
    assert!(
        matches!(
            error,
            Error::Usage(UsageError::NotBroadcastable {
                operation: "linear",
                ..
            })
        ),
        "{error:?}"
    );
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn prepared_matmul_t_and_linear_replay_the_eager_values(dev: Device) {
    use cuferry::DType;
    use cuferry::graph::{GraphCompiler, Input, TracedTensor};
    let mut engine = dev.engine();
    let (m, k, n) = (3, 4, 2);
    for ta in [Transpose::No, Transpose::Yes] {
        for tb in [Transpose::No, Transpose::Yes] {
            let sa = if ta == Transpose::No { [m, k] } else { [k, m] };
            let sb = if tb == Transpose::No { [k, n] } else { [n, k] };
            let a = TracedTensor::input_symbolic_shape(DType::F64, 2);
            let b = TracedTensor::input_symbolic_shape(DType::F64, 2);
            // Once on the inputs (an eager product between launches), once on intermediates
            // (a product captured in the graph).
            let direct = a.matmul_t(ta, &b, tb).unwrap();
            let (a2, b2) = (a.scale(2.0f64).unwrap(), b.scale(1.0f64).unwrap());
            let captured = a2.matmul_t(ta, &b2, tb).unwrap();
            let program = GraphCompiler::new()
                .compile_with_input_specs(
                    &[&direct, &captured],
                    &[(&a, DType::F64, &sa), (&b, DType::F64, &sb)],
                )
                .unwrap();
            let mut prepared = engine.prepare(&program).unwrap();
            let da = upload_tensor(&mut engine, &values(m * k, 6), &sa).unwrap();
            let db = upload_tensor(&mut engine, &values(k * n, 7), &sb).unwrap();
            let eager = engine.matmul_t(&da, ta, &db, tb).unwrap();
            let eager = download_tensor(&mut engine, &eager).unwrap();
            for _ in 0..2 {
                let out = engine
                    .run(&mut prepared, &[Input::from(&da), Input::from(&db)])
                    .unwrap();
                let got = download_tensor(&mut engine, out[0].as_tensor::<f64>().unwrap()).unwrap();
                assert_eq!(got, eager, "{ta:?} {tb:?} direct");
                let got = download_tensor(&mut engine, out[1].as_tensor::<f64>().unwrap()).unwrap();
                let twice: Vec<f64> = eager.iter().map(|v| v * 2.0).collect();
                assert_eq!(got, twice, "{ta:?} {tb:?} captured");
            }
        }
    }
    // Inner dimensions that disagree after the transposes are refused when compiled.
    let a = TracedTensor::input_symbolic_shape(DType::F64, 2);
    let bad = a.matmul_t(Transpose::No, &a, Transpose::No).unwrap();
    assert!(
        GraphCompiler::new()
            .compile_with_input_specs(&[&bad], &[(&a, DType::F64, &[3, 4])])
            .is_err()
    );

    // A traced `linear` without a bias: `x · wᵀ`, as the eager one.
    let x = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let w = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let y = x.linear(&w, None).unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(
            &[&y],
            &[(&x, DType::F32, &[3, 4]), (&w, DType::F32, &[5, 4])],
        )
        .unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    let xs: Vec<f32> = values(12, 1).into_iter().map(|v| v as f32).collect();
    let ws: Vec<f32> = values(20, 2).into_iter().map(|v| v as f32).collect();
    let dx = upload_tensor(&mut engine, &xs, &[3, 4]).unwrap();
    let dw = upload_tensor(&mut engine, &ws, &[5, 4]).unwrap();
    let eager = engine.linear(&dx, &dw, None).unwrap();
    let eager = download_tensor(&mut engine, &eager).unwrap();
    let out = engine
        .run(&mut prepared, &[Input::from(&dx), Input::from(&dw)])
        .unwrap();
    assert_eq!(out[0].shape(), &[3, 5]);
    let got = download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap();
    assert_eq!(got, eager);
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

/// The eager op `name` on `a` and `b`.
fn eager_op(
    engine: &mut CudaEngine,
    name: &str,
    a: &cuferry::DeviceTensor<f32>,
    b: &cuferry::DeviceTensor<f32>,
) -> Result<cuferry::DeviceTensor<f32>, Error> {
    match name {
        "add" => engine.add(a, b),
        "sub" => engine.sub(a, b),
        "mul" => engine.mul(a, b),
        _ => engine.div(a, b),
    }
}

/// The traced op `name` on `a` and `b`.
fn traced_op(
    name: &str,
    a: &cuferry::graph::TracedTensor,
    b: &cuferry::graph::TracedTensor,
) -> Result<cuferry::graph::TracedTensor, Error> {
    match name {
        "add" => a + b,
        "sub" => a - b,
        "mul" => a * b,
        _ => a / b,
    }
}

pub(crate) fn prepared_programs_broadcast_as_the_eager_ops_do_element_for_element(dev: Device) {
    use cuferry::DType;
    use cuferry::graph::{GraphCompiler, Input, TracedTensor};
    let mut engine = dev.engine();
    // The eager cases, plus a `[B, M, N]` batch with an `[M, N]` operand on either side.
    let extra: &[(&[usize], &[usize])] = &[(&[2, 3, 4], &[3, 4]), (&[3, 4], &[2, 3, 4])];
    for &(sa, sb) in CASES.iter().chain(extra) {
        let la: usize = sa.iter().product();
        let lb: usize = sb.iter().product();
        let a: Vec<f32> = (0..la).map(|i| (i % 7) as f32 * 1.25 - 3.0).collect();
        let b: Vec<f32> = (0..lb).map(|i| (i % 5) as f32 * 0.75 + 0.5).collect();
        let da = upload_tensor(&mut engine, &a, sa).unwrap();
        let db = upload_tensor(&mut engine, &b, sb).unwrap();
        for name in ["add", "sub", "mul", "div"] {
            let ta = TracedTensor::input_symbolic_shape(DType::F32, sa.len());
            let tb = TracedTensor::input_symbolic_shape(DType::F32, sb.len());
            let y = traced_op(name, &ta, &tb).unwrap();
            let program = GraphCompiler::new()
                .compile_with_input_specs(&[&y], &[(&ta, DType::F32, sa), (&tb, DType::F32, sb)])
                .unwrap();
            let eager = eager_op(&mut engine, name, &da, &db).unwrap();
            assert_eq!(
                program.output_spec(0).unwrap().1,
                eager.shape(),
                "{name} {sa:?} {sb:?}"
            );
            if !eager.is_empty() {
                // Fused into the program's one kernel: no copy of the broadcast operand.
                assert_eq!(program.stats().fused_kernels, 1, "{name} {sa:?} {sb:?}");
            }
            let eager_shape = eager.shape().to_vec();
            let eager = download_tensor(&mut engine, &eager).unwrap();
            let mut prepared = engine.prepare(&program).unwrap();
            for _ in 0..2 {
                let out = engine
                    .run(&mut prepared, &[Input::from(&da), Input::from(&db)])
                    .unwrap();
                assert_eq!(out[0].shape(), &eager_shape[..], "{name} {sa:?} {sb:?}");
                let got = download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&eager), "{name} {sa:?} {sb:?}");
            }
        }
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn a_fused_chain_broadcasts_computed_operands_and_one_value_two_ways(dev: Device) {
    use cuferry::DType;
    use cuferry::graph::{GraphCompiler, Input, TracedTensor};
    let mut engine = dev.engine();
    // `((x + 2b) * b as a column) - x`, with `b` a `[4]` row, doubled inside the program, and
    // the same `b` read as a `[4, 1]` column of the `[4, 4]` `x`.
    let x = TracedTensor::input_symbolic_shape(DType::F32, 2);
    let b = TracedTensor::input_symbolic_shape(DType::F32, 1);
    let b2 = b.scale(2.0f32).unwrap();
    let row = (&x + &b2).unwrap();
    let col = (&row * &b.reshape(&[4, 1])).unwrap();
    let y = (&col - &x).unwrap();
    let program = GraphCompiler::new()
        .compile_with_input_specs(
            &[&y, &row],
            &[(&x, DType::F32, &[4, 4]), (&b, DType::F32, &[4])],
        )
        .unwrap();
    let xs: Vec<f32> = (0..16).map(|i| i as f32 * 0.5 - 3.0).collect();
    let bs = [0.25f32, -1.5, 2.0, 3.0];
    let dx = upload_tensor(&mut engine, &xs, &[4, 4]).unwrap();
    let db = upload_tensor(&mut engine, &bs, &[4]).unwrap();
    let e_b2 = engine.scale(&db, 2.0).unwrap();
    let e_row = engine.add(&dx, &e_b2).unwrap();
    let e_colb = upload_tensor(&mut engine, &bs, &[4, 1]).unwrap();
    let e_col = engine.mul(&e_row, &e_colb).unwrap();
    let e_y = engine.sub(&e_col, &dx).unwrap();
    let want_y = download_tensor(&mut engine, &e_y).unwrap();
    let want_row = download_tensor(&mut engine, &e_row).unwrap();
    let mut prepared = engine.prepare(&program).unwrap();
    for _ in 0..2 {
        let out = engine
            .run(&mut prepared, &[Input::from(&dx), Input::from(&db)])
            .unwrap();
        let got = download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap();
        assert_eq!(got, want_y);
        let got = download_tensor(&mut engine, out[1].as_tensor::<f32>().unwrap()).unwrap();
        assert_eq!(got, want_row);
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn a_traced_broadcast_that_does_not_fit_is_refused_with_the_eager_error(dev: Device) {
    use cuferry::DType;
    use cuferry::graph::{GraphCompiler, TracedTensor};
    let mut engine = dev.engine();
    let da = upload_tensor(&mut engine, &[0f32; 12], &[3, 4]).unwrap();
    let db = upload_tensor(&mut engine, &[0f32; 3], &[3]).unwrap();
    for name in ["add", "sub", "mul", "div"] {
        let eager = eager_op(&mut engine, name, &da, &db).unwrap_err();
        let a = TracedTensor::input_symbolic_shape(DType::F32, 2);
        let b = TracedTensor::input_symbolic_shape(DType::F32, 1);
        let y = traced_op(name, &a, &b).unwrap();
        let traced = GraphCompiler::new()
            .compile_with_input_specs(&[&y], &[(&a, DType::F32, &[3, 4]), (&b, DType::F32, &[3])])
            .unwrap_err();
        match &traced {
            Error::Usage(UsageError::NotBroadcastable {
                operation,
                left,
                right,
                dim,
            }) => {
                assert_eq!(*operation, name);
                assert_eq!((&left[..], &right[..], *dim), (&[3, 4][..], &[3][..], 1));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(traced.to_string(), eager.to_string());
    }
}

pub(crate) fn a_traced_linear_with_a_bias_equals_the_eager_linear(dev: Device) {
    use cuferry::DType;
    use cuferry::graph::{GraphCompiler, Input, TracedTensor};
    let mut engine = dev.engine();
    let xs: Vec<f32> = values(12, 1).into_iter().map(|v| v as f32).collect();
    let ws: Vec<f32> = values(20, 2).into_iter().map(|v| v as f32 * 0.5).collect();
    let dx = upload_tensor(&mut engine, &xs, &[3, 4]).unwrap();
    let dw = upload_tensor(&mut engine, &ws, &[5, 4]).unwrap();
    // A `[5]` bias, a `[3, 1]` one, and a `[5]` one computed in the program.
    let biases: [(&[usize], bool); 3] = [(&[5], false), (&[3, 1], false), (&[5], true)];
    for (shape, computed) in biases {
        let len: usize = shape.iter().product();
        let bs: Vec<f32> = values(len, 3)
            .into_iter()
            .map(|v| v as f32 * 0.25)
            .collect();
        let db = upload_tensor(&mut engine, &bs, shape).unwrap();
        let x = TracedTensor::input_symbolic_shape(DType::F32, 2);
        let w = TracedTensor::input_symbolic_shape(DType::F32, 2);
        let bias = TracedTensor::input_symbolic_shape(DType::F32, shape.len());
        let used = if computed {
            bias.scale(1.0f32).unwrap()
        } else {
            bias.clone()
        };
        let y = x.linear(&w, Some(&used)).unwrap();
        let program = GraphCompiler::new()
            .compile_with_input_specs(
                &[&y],
                &[
                    (&x, DType::F32, &[3, 4]),
                    (&w, DType::F32, &[5, 4]),
                    (&bias, DType::F32, shape),
                ],
            )
            .unwrap();
        let eager = engine.linear(&dx, &dw, Some(&db)).unwrap();
        let eager = download_tensor(&mut engine, &eager).unwrap();
        let mut prepared = engine.prepare(&program).unwrap();
        for _ in 0..2 {
            let out = engine
                .run(
                    &mut prepared,
                    &[Input::from(&dx), Input::from(&dw), Input::from(&db)],
                )
                .unwrap();
            assert_eq!(out[0].shape(), &[3, 5]);
            let got = download_tensor(&mut engine, out[0].as_tensor::<f32>().unwrap()).unwrap();
            assert_eq!(got, eager, "bias {shape:?}");
        }
    }
    // A bias that does not broadcast, or that would grow the result, is refused as the eager
    // `linear` refuses it.
    for (xshape, shape) in [([3usize, 4usize], &[4usize][..]), ([1, 4], &[3, 5][..])] {
        let len: usize = shape.iter().product();
        let dx = upload_tensor(&mut engine, &vec![0f32; xshape[0] * 4], &xshape).unwrap();
        let db = upload_tensor(&mut engine, &vec![0f32; len], shape).unwrap();
        let eager = engine.linear(&dx, &dw, Some(&db)).unwrap_err();
        let x = TracedTensor::input_symbolic_shape(DType::F32, 2);
        let w = TracedTensor::input_symbolic_shape(DType::F32, 2);
        let bias = TracedTensor::input_symbolic_shape(DType::F32, shape.len());
        let y = x.linear(&w, Some(&bias)).unwrap();
        let traced = GraphCompiler::new()
            .compile_with_input_specs(
                &[&y],
                &[
                    (&x, DType::F32, &xshape),
                    (&w, DType::F32, &[5, 4]),
                    (&bias, DType::F32, shape),
                ],
            )
            .unwrap_err();
        assert!(
            matches!(
                traced,
                Error::Usage(UsageError::NotBroadcastable {
                    operation: "linear",
                    ..
                })
            ),
            "{traced:?}"
        );
        assert_eq!(traced.to_string(), eager.to_string());
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; broadcast::{
            a_bias_a_column_and_a_scalar_broadcast_on_either_side,
            matmul_t_in_each_combination_and_linear_with_a_bias,
            prepared_programs_broadcast_as_the_eager_ops_and_linear_takes_a_bias,
            binary_ops_broadcast_a_trailing_shape_for_every_element_family,
            half_types_broadcast_a_bias_like_their_f32_result,
            shapes_that_do_not_broadcast_get_a_typed_error_naming_both_and_leak_nothing,
            cast_infers_its_source_type,
            matmul_t_takes_each_of_the_four_transpose_combinations,
            linear_is_x_times_w_transposed_plus_bias_in_pytorchs_layout,
            prepared_matmul_t_and_linear_replay_the_eager_values,
            prepared_programs_broadcast_as_the_eager_ops_do_element_for_element,
            a_fused_chain_broadcasts_computed_operands_and_one_value_two_ways,
            a_traced_broadcast_that_does_not_fit_is_refused_with_the_eager_error,
            a_traced_linear_with_a_bias_equals_the_eager_linear,
        });
    };
}
pub(crate) use tests;
