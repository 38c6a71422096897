//! Test support shared by the simulated-device tests and the GPU tests: a seeded PRNG, fresh
//! random (never all-zero) inputs for every element type, and a host reference for the
//! elementwise kernels written directly in Rust's own arithmetic.

#![allow(dead_code)]

pub(crate) mod any_tensor;
pub(crate) mod duplex;

use cuferry::error::UsageError;
use cuferry::{DType, Element, bf16, f16};

/// xorshift64*: small, seeded, deterministic.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// A value as the reference converts it between types (Rust's `as`, through `f32` for `f16` and
/// `bf16`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Hub {
    Float(f64),
    Int(i128),
    Bool(bool),
}

/// The host reference for one element type.
pub(crate) trait Reference: Element {
    /// A fresh random value: never zero for numbers (so a missed write shows), occasionally
    /// large (so casts saturate and integers wrap).
    fn random(rng: &mut Rng) -> Self;
    fn add(self, rhs: Self) -> Self;
    fn sub(self, rhs: Self) -> Self;
    fn mul(self, rhs: Self) -> Self;
    /// Only called for float types.
    fn div(self, rhs: Self) -> Self;
    /// Only called for float and signed types.
    fn neg(self) -> Self;
    fn hub(self) -> Hub;
    fn from_hub(h: Hub) -> Self;
    /// Equal, treating any two NaNs as equal.
    fn same(self, other: Self) -> bool {
        self == other
    }
}

fn random_float(rng: &mut Rng) -> f64 {
    let scale = if rng.next_u64().is_multiple_of(8) {
        1e9
    } else {
        100.0
    };
    let v = rng.unit() * scale;
    if v == 0.0 { 0.5 } else { v }
}

impl Reference for f32 {
    fn random(rng: &mut Rng) -> Self {
        random_float(rng) as f32
    }
    fn add(self, rhs: Self) -> Self {
        self + rhs
    }
    fn sub(self, rhs: Self) -> Self {
        self - rhs
    }
    fn mul(self, rhs: Self) -> Self {
        self * rhs
    }
    fn div(self, rhs: Self) -> Self {
        self / rhs
    }
    fn neg(self) -> Self {
        -self
    }
    fn hub(self) -> Hub {
        Hub::Float(self as f64)
    }
    fn from_hub(h: Hub) -> Self {
        match h {
            Hub::Float(f) => f as f32,
            Hub::Int(i) => i as f32,
            Hub::Bool(b) => b as u8 as f32,
        }
    }
    fn same(self, other: Self) -> bool {
        (self.is_nan() && other.is_nan()) || self.to_bits() == other.to_bits()
    }
}

impl Reference for f64 {
    fn random(rng: &mut Rng) -> Self {
        random_float(rng)
    }
    fn add(self, rhs: Self) -> Self {
        self + rhs
    }
    fn sub(self, rhs: Self) -> Self {
        self - rhs
    }
    fn mul(self, rhs: Self) -> Self {
        self * rhs
    }
    fn div(self, rhs: Self) -> Self {
        self / rhs
    }
    fn neg(self) -> Self {
        -self
    }
    fn hub(self) -> Hub {
        Hub::Float(self)
    }
    fn from_hub(h: Hub) -> Self {
        match h {
            Hub::Float(f) => f,
            Hub::Int(i) => i as f64,
            Hub::Bool(b) => b as u8 as f64,
        }
    }
    fn same(self, other: Self) -> bool {
        (self.is_nan() && other.is_nan()) || self.to_bits() == other.to_bits()
    }
}

macro_rules! half_reference {
    ($t:ty) => {
        impl Reference for $t {
            fn random(rng: &mut Rng) -> Self {
                let v = <$t>::from_f64(rng.unit() * 100.0);
                if v.to_f32() == 0.0 {
                    <$t>::from_f32(0.5)
                } else {
                    v
                }
            }
            // `half` computes in f32 and rounds once.
            fn add(self, rhs: Self) -> Self {
                self + rhs
            }
            fn sub(self, rhs: Self) -> Self {
                self - rhs
            }
            fn mul(self, rhs: Self) -> Self {
                self * rhs
            }
            fn div(self, rhs: Self) -> Self {
                self / rhs
            }
            fn neg(self) -> Self {
                -self
            }
            fn hub(self) -> Hub {
                Hub::Float(self.to_f64())
            }
            fn from_hub(h: Hub) -> Self {
                match h {
                    Hub::Float(f) => <$t>::from_f32(f as f32),
                    Hub::Int(i) => <$t>::from_f32(i as f32),
                    Hub::Bool(b) => <$t>::from_f32(b as u8 as f32),
                }
            }
            fn same(self, other: Self) -> bool {
                (self.is_nan() && other.is_nan()) || self.to_bits() == other.to_bits()
            }
        }
    };
}
half_reference!(f16);
half_reference!(bf16);

macro_rules! int_reference {
    ($t:ty) => {
        impl Reference for $t {
            fn random(rng: &mut Rng) -> Self {
                // Mostly small (so products are meaningful), sometimes full range (so they wrap).
                let raw = rng.next_u64();
                let v = if raw % 4 == 0 {
                    raw as $t
                } else {
                    ((raw >> 8) % 100) as $t
                };
                if v == 0 { 7 as $t } else { v }
            }
            fn add(self, rhs: Self) -> Self {
                self.wrapping_add(rhs)
            }
            fn sub(self, rhs: Self) -> Self {
                self.wrapping_sub(rhs)
            }
            fn mul(self, rhs: Self) -> Self {
                self.wrapping_mul(rhs)
            }
            fn div(self, _: Self) -> Self {
                unreachable!("integer division is not served")
            }
            fn neg(self) -> Self {
                (0 as $t).wrapping_sub(self)
            }
            fn hub(self) -> Hub {
                Hub::Int(self as i128)
            }
            fn from_hub(h: Hub) -> Self {
                match h {
                    Hub::Float(f) => f as $t,
                    Hub::Int(i) => i as $t,
                    Hub::Bool(b) => b as $t,
                }
            }
        }
    };
}
int_reference!(i8);
int_reference!(i16);
int_reference!(i32);
int_reference!(i64);
int_reference!(u8);
int_reference!(u16);
int_reference!(u32);
int_reference!(u64);

impl Reference for bool {
    fn random(rng: &mut Rng) -> Self {
        !rng.next_u64().is_multiple_of(3)
    }
    fn add(self, _: Self) -> Self {
        unreachable!("arithmetic on bool is not served")
    }
    fn sub(self, _: Self) -> Self {
        unreachable!("arithmetic on bool is not served")
    }
    fn mul(self, _: Self) -> Self {
        unreachable!("arithmetic on bool is not served")
    }
    fn div(self, _: Self) -> Self {
        unreachable!("arithmetic on bool is not served")
    }
    fn neg(self) -> Self {
        unreachable!("arithmetic on bool is not served")
    }
    fn hub(self) -> Hub {
        Hub::Bool(self)
    }
    fn from_hub(h: Hub) -> Self {
        match h {
            Hub::Float(f) => f != 0.0,
            Hub::Int(i) => i != 0,
            Hub::Bool(b) => b,
        }
    }
}

/// `n` fresh random values.
pub(crate) fn random_vec<T: Reference>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::random(rng)).collect()
}

/// Asserts two slices are equal elementwise (NaNs equal), naming the first difference.
pub(crate) fn assert_same<T: Reference>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.same(*w),
            "{what}: element {i} is {g:?}, expected {w:?} ({} of {})",
            i,
            got.len()
        );
    }
}

/// Whether an operation serves a type (the crate's documented support matrix).
pub(crate) fn serves(op: &str, d: DType) -> bool {
    let float = matches!(d, DType::F32 | DType::F64 | DType::F16 | DType::BF16);
    let signed = matches!(d, DType::I8 | DType::I16 | DType::I32 | DType::I64);
    match op {
        "fill" | "cast" => true,
        _ if d == DType::Bool => false,
        "div" => float,
        "neg" => float || signed,
        _ => true,
    }
}

/// Runs `$body` once per element type, with `$t` bound to it.
#[macro_export]
macro_rules! for_each_element {
    ($t:ident => $body:block) => {{
        {
            type $t = f32;
            $body
        }
        {
            type $t = f64;
            $body
        }
        {
            type $t = cuferry::f16;
            $body
        }
        {
            type $t = cuferry::bf16;
            $body
        }
        {
            type $t = i8;
            $body
        }
        {
            type $t = i16;
            $body
        }
        {
            type $t = i32;
            $body
        }
        {
            type $t = i64;
            $body
        }
        {
            type $t = u8;
            $body
        }
        {
            type $t = u16;
            $body
        }
        {
            type $t = u32;
            $body
        }
        {
            type $t = u64;
            $body
        }
        {
            type $t = bool;
            $body
        }
    }};
}

use cuferry::{CudaEngine, Error, download_tensor, upload_tensor};

fn expect_unsupported<R: std::fmt::Debug>(what: &str, result: Result<R, Error>) {
    match result {
        Err(Error::Usage(UsageError::UnsupportedElement { .. })) => {}
        other => panic!("{what}: expected UnsupportedElement, got {other:?}"),
    }
}

/// Checks every elementwise operation but `cast` on `n` fresh random elements of `T` against the
/// host reference; operations `T` is not served by must be refused with `UnsupportedElement`.
pub(crate) fn check_ops<T: Reference>(engine: &mut CudaEngine, rng: &mut Rng, n: usize) {
    let name = T::DTYPE.name();
    let a_host = random_vec::<T>(rng, n);
    let b_host = random_vec::<T>(rng, n);
    let shape = if n.is_multiple_of(2) && n > 0 {
        vec![2, n / 2]
    } else {
        vec![n]
    };
    let a = upload_tensor(engine, &a_host, &shape).unwrap();
    let b = upload_tensor(engine, &b_host, &shape).unwrap();

    type Binary<T> = fn(T, T) -> T;
    let binary: [(&str, Binary<T>); 4] = [
        ("add", T::add),
        ("sub", T::sub),
        ("mul", T::mul),
        ("div", T::div),
    ];
    for (op, reference) in binary {
        let result = match op {
            "add" => engine.add(&a, &b),
            "sub" => engine.sub(&a, &b),
            "mul" => engine.mul(&a, &b),
            _ => engine.div(&a, &b),
        };
        let what = format!("{op} {name} n={n}");
        if !serves(op, T::DTYPE) {
            expect_unsupported(&what, result);
            continue;
        }
        let out = result.unwrap();
        assert_eq!(out.shape(), &shape[..], "{what}: shape");
        let want: Vec<T> = a_host
            .iter()
            .zip(&b_host)
            .map(|(&x, &y)| reference(x, y))
            .collect();
        assert_same(&what, &download_tensor(engine, &out).unwrap(), &want);
    }

    let what = format!("neg {name} n={n}");
    if serves("neg", T::DTYPE) {
        let out = engine.neg(&a).unwrap();
        let want: Vec<T> = a_host.iter().map(|&x| x.neg()).collect();
        assert_same(&what, &download_tensor(engine, &out).unwrap(), &want);
    } else {
        expect_unsupported(&what, engine.neg(&a));
    }

    let factor = T::random(rng);
    let what = format!("scale {name} by {factor:?} n={n}");
    if serves("scale", T::DTYPE) {
        let out = engine.scale(&a, factor).unwrap();
        let want: Vec<T> = a_host.iter().map(|&x| x.mul(factor)).collect();
        assert_same(&what, &download_tensor(engine, &out).unwrap(), &want);
    } else {
        expect_unsupported(&what, engine.scale(&a, factor));
    }

    let value = T::random(rng);
    let what = format!("fill {name} with {value:?} n={n}");
    let mut target = engine.copy_tensor(&b).unwrap();
    engine.fill(&mut target, value).unwrap();
    assert_same(
        &what,
        &download_tensor(engine, &target).unwrap(),
        &vec![value; n],
    );
    let full = engine.full(&shape, value).unwrap();
    assert_same(
        &what,
        &download_tensor(engine, &full).unwrap(),
        &vec![value; n],
    );
}

/// Checks `cast` from `T` to every element type on `n` fresh random elements.
pub(crate) fn check_casts_from<T: Reference>(engine: &mut CudaEngine, rng: &mut Rng, n: usize) {
    let host = random_vec::<T>(rng, n);
    let a = upload_tensor(engine, &host, &[n]).unwrap();
    crate::for_each_element!(U => {
        let what = format!("cast {} -> {} n={n}", T::DTYPE.name(), U::DTYPE.name());
        let out = engine.cast::<U>(&a).unwrap();
        let want: Vec<U> = host.iter().map(|&x| U::from_hub(x.hub())).collect();
        assert_same(&what, &download_tensor(engine, &out).unwrap(), &want);
    });
}

use cuferry::error::DriverError;
use cuferry::sim::{SimConfig, SimDevice, SimOp};

/// An engine on a fresh simulated device, and the device.
pub(crate) fn sim_engine() -> (CudaEngine, SimDevice) {
    let engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().expect("a simulated engine");
    (engine, sim)
}

/// `n` per-index distinct `u32`s, never zero.
pub(crate) fn distinct_u32(n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) | 1)
        .collect()
}

/// `n` per-index distinct `u32`s, never zero, and different for each `salt`.
pub(crate) fn distinct_salted(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i ^ salt).wrapping_mul(2_654_435_761) | 1)
        .collect()
}

/// `n` per-index distinct `f32`s, exact in `f32`.
pub(crate) fn distinct_f32(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 1.5 + 0.25).collect()
}

/// How a fault is injected into one transfer.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Fault {
    /// The n-th call of an operation fails with the error.
    Call(SimOp, u64, DriverError),
    /// The n-th event record fails and so does the stream synchronize that would prove the copy
    /// complete without it: the chunk cannot be tracked.
    Untracked(u64),
    /// The event of the n-th record reports a failure when the device reaches it.
    Event(u64),
}

impl Fault {
    pub(crate) fn arm(self, sim: &SimDevice) {
        match self {
            Fault::Call(op, n, error) => sim.fail_nth(op, n, error),
            Fault::Untracked(n) => {
                sim.fail_nth(SimOp::EventRecord, n, DriverError::UNKNOWN);
                sim.fail_nth(SimOp::StreamSynchronize, 1, DriverError::LAUNCH_FAILED);
            }
            Fault::Event(n) => sim.fail_event(n, DriverError::LAUNCH_FAILED),
        }
    }

    /// The driver error the route reports.
    pub(crate) fn reported(self) -> DriverError {
        match self {
            Fault::Call(_, _, error) => error,
            Fault::Untracked(_) => DriverError::UNKNOWN,
            Fault::Event(_) => DriverError::LAUNCH_FAILED,
        }
    }

    /// Whether the fault leaves a chunk that nothing can prove complete (its slot is retained).
    pub(crate) fn retains(self) -> bool {
        matches!(
            self,
            Fault::Call(SimOp::EventSynchronize | SimOp::StreamSynchronize, ..)
                | Fault::Untracked(_)
                | Fault::Event(_)
        )
    }
}

/// A simulated machine of `devices` devices.
pub(crate) fn sim_machine(devices: usize) -> SimDevice {
    SimDevice::new(cuferry::sim::SimConfig {
        devices,
        ..cuferry::sim::SimConfig::default()
    })
}

/// Two engines of `sim`, on its devices `a` and `b`.
pub(crate) fn engines_on(sim: &SimDevice, a: usize, b: usize) -> (CudaEngine, CudaEngine) {
    (
        CudaEngine::simulated_on_device(sim, a).unwrap(),
        CudaEngine::simulated_on_device(sim, b).unwrap(),
    )
}

/// `n` integers from 0 to 4 as `T`: their sums, products, maxima and minima over a few ranks are
/// exact in every element type a collective takes.
pub(crate) fn small_values<T: Reference>(rng: &mut Rng, n: usize) -> Vec<T> {
    random_vec::<u8>(rng, n)
        .into_iter()
        .map(|v| T::from_hub(Hub::Int(i128::from(v % 5))))
        .collect()
}

/// `op` of two elements, as the reference computes it (the mean is checked on its own).
pub(crate) fn reduce_pair<T: Reference>(op: cuferry::collective::ReduceOp, p: T, q: T) -> T {
    let less = |x: T, y: T| match (x.hub(), y.hub()) {
        (Hub::Float(x), Hub::Float(y)) => x < y,
        (Hub::Int(x), Hub::Int(y)) => x < y,
        _ => unreachable!("no bool collectives"),
    };
    match op {
        cuferry::collective::ReduceOp::Sum => p.add(q),
        cuferry::collective::ReduceOp::Prod => p.mul(q),
        cuferry::collective::ReduceOp::Max if less(p, q) => q,
        cuferry::collective::ReduceOp::Min if !less(p, q) => q,
        _ => p,
    }
}

/// One `gemm` of each transpose combination, `m × n` from `k`, with leading dimensions past
/// the rows (so a read or write of the gaps shows) and the given scales.
pub(crate) fn gemm_configs(
    m: usize,
    n: usize,
    k: usize,
    alpha: f64,
    beta: f64,
) -> Vec<cuferry::libs::GemmConfig<f64>> {
    use cuferry::libs::{GemmConfig, Transpose};
    let both = [Transpose::No, Transpose::Yes];
    both.iter()
        .flat_map(|&transa| both.iter().map(move |&transb| (transa, transb)))
        .map(|(transa, transb)| {
            let a_rows = if transa == Transpose::No { m } else { k };
            let b_rows = if transb == Transpose::No { k } else { n };
            GemmConfig {
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                beta,
                lda: a_rows + 1,
                ldb: b_rows + 2,
                ldc: m + 1,
            }
        })
        .collect()
}

/// The stored shape (rows, columns) of `gemm`'s `A` and `B` under their transposes.
pub(crate) fn gemm_operands(config: &cuferry::libs::GemmConfig<f64>) -> [(usize, usize); 2] {
    use cuferry::libs::Transpose;
    let (m, n, k) = (config.m, config.n, config.k);
    [
        if config.transa == Transpose::No {
            (m, k)
        } else {
            (k, m)
        },
        if config.transb == Transpose::No {
            (k, n)
        } else {
            (n, k)
        },
    ]
}

/// Whether a bounded wait found the operation done.
pub(crate) fn returned<Op: cuferry::pending::Operation>(
    found: cuferry::pending::TryWait<Op>,
) -> bool {
    matches!(found, cuferry::pending::TryWait::Returned(_))
}

/// The tensor a bounded wait for a loan or a reclaim found back (it must have).
pub(crate) fn back<Op>(found: cuferry::pending::TryWait<Op>) -> cuferry::DeviceTensor<f32>
where
    Op: cuferry::pending::Operation<Parts = cuferry::DeviceTensor<f32>>,
{
    match found {
        cuferry::pending::TryWait::Returned(back) => back.into_parts(),
        cuferry::pending::TryWait::InFlight(op) => panic!("still in flight: {op:?}"),
    }
}
