//! Host emulation of the built-in elementwise kernels, for the simulated device.
//!
//! The simulator cannot run PTX. Every module the kernel cache compiles carries an
//! [`ElementwiseEmulation`] of its kernel, and when the simulator's stream reaches a launch it
//! runs that instead, on its own device memory, with the semantics `kernels::source` documents
//! for the CUDA kernels. The crate's tests check both this and the GPU against a separate host
//! reference.

use super::source::kernel_name;
use super::spec::{
    BroadcastDim, ElementwiseArgs, ElementwiseOp, ElementwiseSpec, broadcast_extent,
    broadcast_index,
};
use crate::driver::launch::{DeviceMemory, Emulation};
use crate::dtype::DType;
use half::{bf16, f16};

/// A value in transit between element types during a cast.
#[derive(Clone, Copy)]
enum Value {
    Float(f64),
    Int(i128),
    Bool(bool),
}

/// One element type's behaviour under the emulated kernels.
trait Emulated: Copy {
    const BYTES: usize;
    fn read(bytes: &[u8]) -> Self;
    fn write(self, out: &mut Vec<u8>);
    /// From a scalar argument's bits (zero-extended little-endian element bytes).
    fn from_scalar(bits: u64) -> Self {
        Self::read(&bits.to_le_bytes()[..Self::BYTES])
    }
    /// `op(self, rhs)` for the binary operations and `scale`; `None` where unsupported.
    fn arith(self, op: ElementwiseOp, rhs: Self) -> Option<Self>;
    fn neg(self) -> Option<Self>;
    fn to_value(self) -> Value;
    fn from_value(v: Value) -> Self;
    /// As an element of any type.
    fn into_scalar(self) -> Scalar;
    /// The element, if `s` is of this type.
    fn of(s: Scalar) -> Option<Self>;
}

/// Implements [`Emulated::into_scalar`] and [`Emulated::of`] for the type of `Scalar::$v`.
macro_rules! scalar_conversions {
    ($v:ident) => {
        fn into_scalar(self) -> Scalar {
            Scalar::$v(self)
        }
        fn of(s: Scalar) -> Option<Self> {
            match s {
                Scalar::$v(x) => Some(x),
                _ => None,
            }
        }
    };
}

macro_rules! float_emulated {
    ($t:ty, $v:ident) => {
        impl Emulated for $t {
            scalar_conversions!($v);
            const BYTES: usize = std::mem::size_of::<$t>();
            fn read(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element width"))
            }
            fn write(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn arith(self, op: ElementwiseOp, rhs: Self) -> Option<Self> {
                Some(match op {
                    ElementwiseOp::Add => self + rhs,
                    ElementwiseOp::Sub => self - rhs,
                    ElementwiseOp::Mul | ElementwiseOp::Scale => self * rhs,
                    ElementwiseOp::Div => self / rhs,
                    _ => return None,
                })
            }
            fn neg(self) -> Option<Self> {
                Some(-self)
            }
            fn to_value(self) -> Value {
                Value::Float(f64::from(self))
            }
            fn from_value(v: Value) -> Self {
                match v {
                    Value::Float(f) => f as $t,
                    Value::Int(i) => i as $t,
                    Value::Bool(b) => u8::from(b).into(),
                }
            }
        }
    };
}
float_emulated!(f32, F32);
float_emulated!(f64, F64);

macro_rules! half_emulated {
    ($t:ty, $v:ident) => {
        impl Emulated for $t {
            scalar_conversions!($v);
            const BYTES: usize = 2;
            fn read(bytes: &[u8]) -> Self {
                <$t>::from_bits(u16::from_le_bytes(bytes.try_into().expect("element width")))
            }
            fn write(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_bits().to_le_bytes());
            }
            fn arith(self, op: ElementwiseOp, rhs: Self) -> Option<Self> {
                let (x, y) = (self.to_f32(), rhs.to_f32());
                Some(<$t>::from_f32(match op {
                    ElementwiseOp::Add => x + y,
                    ElementwiseOp::Sub => x - y,
                    ElementwiseOp::Mul | ElementwiseOp::Scale => x * y,
                    ElementwiseOp::Div => x / y,
                    _ => return None,
                }))
            }
            fn neg(self) -> Option<Self> {
                Some(<$t>::from_f32(-self.to_f32()))
            }
            fn to_value(self) -> Value {
                Value::Float(self.to_f64())
            }
            fn from_value(v: Value) -> Self {
                <$t>::from_f32(match v {
                    Value::Float(f) => f as f32,
                    Value::Int(i) => i as f32,
                    Value::Bool(b) => f32::from(u8::from(b)),
                })
            }
        }
    };
}
half_emulated!(f16, F16);
half_emulated!(bf16, BF16);

macro_rules! int_emulated {
    ($t:ty, $v:ident, $signed:expr_2021) => {
        impl Emulated for $t {
            scalar_conversions!($v);
            const BYTES: usize = std::mem::size_of::<$t>();
            fn read(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element width"))
            }
            fn write(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn arith(self, op: ElementwiseOp, rhs: Self) -> Option<Self> {
                Some(match op {
                    ElementwiseOp::Add => self.wrapping_add(rhs),
                    ElementwiseOp::Sub => self.wrapping_sub(rhs),
                    ElementwiseOp::Mul | ElementwiseOp::Scale => self.wrapping_mul(rhs),
                    _ => return None,
                })
            }
            fn neg(self) -> Option<Self> {
                $signed.then(|| (0 as $t).wrapping_sub(self))
            }
            fn to_value(self) -> Value {
                Value::Int(self as i128)
            }
            fn from_value(v: Value) -> Self {
                match v {
                    Value::Float(f) => f as $t,
                    Value::Int(i) => i as $t,
                    Value::Bool(b) => u8::from(b) as $t,
                }
            }
        }
    };
}
int_emulated!(i8, I8, true);
int_emulated!(i16, I16, true);
int_emulated!(i32, I32, true);
int_emulated!(i64, I64, true);
int_emulated!(u8, U8, false);
int_emulated!(u16, U16, false);
int_emulated!(u32, U32, false);
int_emulated!(u64, U64, false);

impl Emulated for bool {
    const BYTES: usize = 1;
    scalar_conversions!(Bool);
    fn read(bytes: &[u8]) -> Self {
        bytes[0] != 0
    }
    fn write(self, out: &mut Vec<u8>) {
        out.push(u8::from(self));
    }
    fn arith(self, _: ElementwiseOp, _: Self) -> Option<Self> {
        None
    }
    fn neg(self) -> Option<Self> {
        None
    }
    fn to_value(self) -> Value {
        Value::Bool(self)
    }
    fn from_value(v: Value) -> Self {
        match v {
            Value::Float(f) => f != 0.0,
            Value::Int(i) => i != 0,
            Value::Bool(b) => b,
        }
    }
}

/// Runs `op` over `len` elements of one type; `None` when the operation does not apply.
fn same_type<T: Emulated>(
    op: ElementwiseOp,
    a: &[u8],
    b: &[u8],
    scalar: u64,
    len: usize,
) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(len * T::BYTES);
    let at = |bytes: &[u8], i: usize| T::read(&bytes[i * T::BYTES..(i + 1) * T::BYTES]);
    let s = T::from_scalar(scalar);
    for i in 0..len {
        let v = match op {
            ElementwiseOp::Fill => s,
            ElementwiseOp::Neg => at(a, i).neg()?,
            ElementwiseOp::Scale => at(a, i).arith(op, s)?,
            ElementwiseOp::Cast => at(a, i),
            _ => at(a, i).arith(op, at(b, i))?,
        };
        v.write(&mut out);
    }
    Some(out)
}

fn cast_to<I: Emulated, O: Emulated>(a: &[u8], len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len * O::BYTES);
    for i in 0..len {
        O::from_value(I::read(&a[i * I::BYTES..(i + 1) * I::BYTES]).to_value()).write(&mut out);
    }
    out
}

macro_rules! dispatch {
    ($dtype:expr_2021, $f:ident $(::<$($pre:ty),*>)? ($($arg:expr_2021),*)) => {
        match $dtype {
            DType::F32 => $f::<$($($pre,)*)? f32>($($arg),*),
            DType::F64 => $f::<$($($pre,)*)? f64>($($arg),*),
            DType::F16 => $f::<$($($pre,)*)? f16>($($arg),*),
            DType::BF16 => $f::<$($($pre,)*)? bf16>($($arg),*),
            DType::I8 => $f::<$($($pre,)*)? i8>($($arg),*),
            DType::I16 => $f::<$($($pre,)*)? i16>($($arg),*),
            DType::I32 => $f::<$($($pre,)*)? i32>($($arg),*),
            DType::I64 => $f::<$($($pre,)*)? i64>($($arg),*),
            DType::U8 => $f::<$($($pre,)*)? u8>($($arg),*),
            DType::U16 => $f::<$($($pre,)*)? u16>($($arg),*),
            DType::U32 => $f::<$($($pre,)*)? u32>($($arg),*),
            DType::U64 => $f::<$($($pre,)*)? u64>($($arg),*),
            DType::Bool => $f::<$($($pre,)*)? bool>($($arg),*),
        }
    };
}

/// One element of any type, for code that learns its types at run time (the fused kernels'
/// emulation). Its operations are the eager kernels' own per-element operations, so a chain of
/// them computes bit for bit what the chain of eager kernels writes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scalar {
    F32(f32),
    F64(f64),
    F16(f16),
    BF16(bf16),
    I8(i8),
    I16(i16),
    I32(i32),
    I64(i64),
    U8(u8),
    U16(u16),
    U32(u32),
    U64(u64),
    Bool(bool),
}

/// `$body` with `$x` bound to the element inside `$s`, whatever its type.
macro_rules! each {
    ($s:expr_2021, $x:ident => $body:expr_2021) => {
        match $s {
            Scalar::F32($x) => $body,
            Scalar::F64($x) => $body,
            Scalar::F16($x) => $body,
            Scalar::BF16($x) => $body,
            Scalar::I8($x) => $body,
            Scalar::I16($x) => $body,
            Scalar::I32($x) => $body,
            Scalar::I64($x) => $body,
            Scalar::U8($x) => $body,
            Scalar::U16($x) => $body,
            Scalar::U32($x) => $body,
            Scalar::U64($x) => $body,
            Scalar::Bool($x) => $body,
        }
    };
}

fn read_scalar<T: Emulated>(bytes: &[u8]) -> Scalar {
    T::read(bytes).into_scalar()
}

fn scalar_from_bits<T: Emulated>(bits: u64) -> Scalar {
    T::from_scalar(bits).into_scalar()
}

fn scalar_from_value<T: Emulated>(v: Value) -> Scalar {
    T::from_value(v).into_scalar()
}

impl Scalar {
    /// The element `bytes` (exactly `d.size_bytes()` of them) hold, as a kernel reads it.
    pub(crate) fn read(d: DType, bytes: &[u8]) -> Scalar {
        dispatch!(d, read_scalar(bytes))
    }

    /// A scalar argument of type `d` from its bits (the low `d.size_bytes()` bytes count).
    pub(crate) fn from_bits(d: DType, bits: u64) -> Scalar {
        dispatch!(d, scalar_from_bits(bits))
    }

    /// Its element type.
    pub(crate) fn dtype(self) -> DType {
        match self {
            Scalar::F32(_) => DType::F32,
            Scalar::F64(_) => DType::F64,
            Scalar::F16(_) => DType::F16,
            Scalar::BF16(_) => DType::BF16,
            Scalar::I8(_) => DType::I8,
            Scalar::I16(_) => DType::I16,
            Scalar::I32(_) => DType::I32,
            Scalar::I64(_) => DType::I64,
            Scalar::U8(_) => DType::U8,
            Scalar::U16(_) => DType::U16,
            Scalar::U32(_) => DType::U32,
            Scalar::U64(_) => DType::U64,
            Scalar::Bool(_) => DType::Bool,
        }
    }

    /// Appends the element's bytes as a kernel stores it.
    pub(crate) fn write(self, out: &mut Vec<u8>) {
        each!(self, x => x.write(out))
    }

    /// `self op rhs` for `add`, `sub`, `mul`, `div` and `scale` (whose `rhs` is the factor);
    /// `None` when the types differ or the operation does not serve the type.
    pub(crate) fn binary(self, op: ElementwiseOp, rhs: Scalar) -> Option<Scalar> {
        Some(each!(self, x => x.arith(op, Emulated::of(rhs)?)?.into_scalar()))
    }

    /// `-self`; `None` when negation does not serve the type.
    pub(crate) fn neg(self) -> Option<Scalar> {
        Some(each!(self, x => x.neg()?.into_scalar()))
    }

    /// `self as to`, as the eager `cast` kernel computes it (the identity when the types are
    /// equal).
    pub(crate) fn cast(self, to: DType) -> Scalar {
        if self.dtype() == to {
            return self;
        }
        each!(self, x => dispatch!(to, scalar_from_value(x.to_value())))
    }
}

fn cast_from<I: Emulated>(output: DType, a: &[u8], len: usize) -> Vec<u8> {
    dispatch!(output, cast_to::<I>(a, len))
}

/// Computes what the kernel for `spec` writes, given its operands' bytes (empty when unused).
/// `None` when the spec is not a kernel the crate builds.
pub(crate) fn run(
    spec: ElementwiseSpec,
    a: &[u8],
    b: &[u8],
    scalar: u64,
    len: usize,
) -> Option<Vec<u8>> {
    if spec.op == ElementwiseOp::Cast && spec.input != spec.output {
        return Some(dispatch!(spec.input, cast_from(spec.output, a, len)));
    }
    if spec.input != spec.output {
        return None;
    }
    dispatch!(spec.input, same_type(spec.op, a, b, scalar, len))
}

/// The emulation of one built-in elementwise kernel, registered with the module that holds it.
pub(crate) struct ElementwiseEmulation {
    spec: ElementwiseSpec,
    /// The kernel's name, as the module exports it.
    name: String,
}

impl ElementwiseEmulation {
    pub(crate) fn new(spec: ElementwiseSpec) -> Self {
        ElementwiseEmulation {
            spec,
            name: kernel_name(spec),
        }
    }
}

impl Emulation for ElementwiseEmulation {
    fn name(&self) -> &str {
        &self.name
    }

    /// Reads the operands the operation uses, computes, and writes the output, as the kernel
    /// does with the parameters `(out, a, b, scalar_bits, len)`.
    fn run(&self, memory: &mut dyn DeviceMemory, params: &[u64]) -> Result<(), String> {
        let spec = self.spec;
        let rank = if spec.op.reads_b() {
            usize::from(spec.broadcast)
        } else {
            0
        };
        let expected = ElementwiseArgs::PARAMS + 3 * rank;
        let args = (params.len() == expected)
            .then(|| ElementwiseArgs::from_params(&params[..ElementwiseArgs::PARAMS]))
            .flatten();
        let Some(args) = args else {
            return Err(format!(
                "{spec:?} kernel launched with {} parameters, not {expected}",
                params.len(),
            ));
        };
        let dims: Vec<BroadcastDim> = params[ElementwiseArgs::PARAMS..]
            .chunks_exact(3)
            .map(|d| BroadcastDim {
                extent: d[0],
                a_stride: d[1],
                b_stride: d[2],
            })
            .collect();
        let Ok(len) = usize::try_from(args.len) else {
            return Err(format!("elementwise launch of {} elements", args.len));
        };
        if dims.iter().map(|d| d.extent).product::<u64>() != args.len && rank > 0 {
            return Err(format!(
                "{spec:?} kernel launched over {} elements with a broadcast of {dims:?}",
                args.len
            ));
        }
        let size = spec.input.size_bytes();
        let in_bytes = len * size;
        let out_bytes = len * spec.output.size_bytes();
        // What each operand spans: all `len` elements, or under a broadcast one past its
        // largest index.
        let span = |first: bool| -> usize {
            if rank == 0 || len == 0 {
                in_bytes
            } else {
                broadcast_extent(&dims, first) as usize * size
            }
        };
        let (a_bytes, b_bytes) = (span(true), span(false));
        let mut operand = |used: bool, ptr, bytes| -> Option<Vec<u8>> {
            if !used {
                return Some(Vec::new());
            }
            memory.read(ptr, bytes)
        };
        let (Some(mut a), Some(mut b)) = (
            operand(spec.op.reads_a(), args.a, a_bytes),
            operand(spec.op.reads_b(), args.b, b_bytes),
        ) else {
            return Err(format!(
                "{:?} kernel reads unmapped device memory ({:#x}, {:#x}, {a_bytes}/{b_bytes} bytes)",
                spec, args.a, args.b
            ));
        };
        if rank > 0 {
            // Gather each operand's element for every output index, then compute as the
            // equal-shape kernel does.
            let (mut ea, mut eb) = (Vec::with_capacity(in_bytes), Vec::with_capacity(in_bytes));
            for i in 0..len as u64 {
                let (ia, ib) = broadcast_index(&dims, i);
                let (ia, ib) = (ia as usize * size, ib as usize * size);
                ea.extend_from_slice(&a[ia..ia + size]);
                eb.extend_from_slice(&b[ib..ib + size]);
            }
            (a, b) = (ea, eb);
        }
        let Some(result) = run(
            ElementwiseSpec {
                broadcast: 0,
                ..spec
            },
            &a,
            &b,
            args.scalar,
            len,
        ) else {
            return Err(format!("{spec:?} is not a kernel the crate builds"));
        };
        if memory.write(args.out, &result) {
            Ok(())
        } else {
            Err(format!(
                "{spec:?} kernel writes unmapped device memory {:#x}+{out_bytes}",
                args.out
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(op: ElementwiseOp, input: DType, output: DType) -> ElementwiseSpec {
        ElementwiseSpec {
            op,
            input,
            output,
            broadcast: 0,
        }
    }

    #[test]
    fn integer_arithmetic_wraps() {
        let a = [250u8, 3];
        let b = [10u8, 4];
        let out = run(spec(ElementwiseOp::Add, DType::U8, DType::U8), &a, &b, 0, 2).unwrap();
        assert_eq!(out, [4, 7]);
    }

    #[test]
    fn casts_saturate_like_rust() {
        let a: Vec<u8> = [1e10f32, -1e10, f32::NAN, -3.7]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        let out = run(
            spec(ElementwiseOp::Cast, DType::F32, DType::I16),
            &a,
            &[],
            0,
            4,
        )
        .unwrap();
        let got: Vec<i16> = out
            .chunks(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(got, [i16::MAX, i16::MIN, 0, -3]);
    }

    #[test]
    fn unsupported_operations_are_refused() {
        assert!(
            run(
                spec(ElementwiseOp::Neg, DType::U32, DType::U32),
                &[0; 4],
                &[],
                0,
                1
            )
            .is_none()
        );
        assert!(
            run(
                spec(ElementwiseOp::Add, DType::Bool, DType::Bool),
                &[1],
                &[1],
                0,
                1
            )
            .is_none()
        );
        assert!(
            run(
                spec(ElementwiseOp::Add, DType::F32, DType::F64),
                &[0; 4],
                &[0; 4],
                0,
                1
            )
            .is_none()
        );
    }

    #[test]
    fn fill_reads_the_scalar_bits() {
        let bits = u64::from(f16::from_f32(1.5).to_bits());
        let out = run(
            spec(ElementwiseOp::Fill, DType::F16, DType::F16),
            &[],
            &[],
            bits,
            2,
        )
        .unwrap();
        assert_eq!(out, [0x00, 0x3e, 0x00, 0x3e]);
    }

    /// Device memory of one allocation at `base`, for running an emulation without a device.
    struct OneBlock {
        base: u64,
        bytes: Vec<u8>,
    }

    impl DeviceMemory for OneBlock {
        fn read(&mut self, ptr: u64, bytes: usize) -> Option<Vec<u8>> {
            let off = usize::try_from(ptr.checked_sub(self.base)?).ok()?;
            self.bytes.get(off..off + bytes).map(<[u8]>::to_vec)
        }

        fn write(&mut self, ptr: u64, data: &[u8]) -> bool {
            let Some(off) = ptr.checked_sub(self.base) else {
                return false;
            };
            let off = off as usize;
            match self.bytes.get_mut(off..off + data.len()) {
                Some(out) => {
                    out.copy_from_slice(data);
                    true
                }
                None => false,
            }
        }
    }

    #[test]
    fn the_emulation_runs_the_kernel_on_device_memory_from_its_parameters() {
        let mut memory = OneBlock {
            base: 0x1000,
            bytes: vec![3, 4, 10, 20, 0xEE, 0xEE],
        };
        let add = ElementwiseEmulation::new(spec(ElementwiseOp::Add, DType::U8, DType::U8));
        assert_eq!(add.name(), kernel_name(add.spec));
        let args = ElementwiseArgs {
            out: 0x1004,
            a: 0x1000,
            b: 0x1002,
            scalar: 0,
            len: 2,
        };
        add.run(&mut memory, &args.params()).unwrap();
        assert_eq!(memory.bytes, [3, 4, 10, 20, 13, 24]);

        let unmapped = ElementwiseArgs { b: 0x2000, ..args };
        let error = add.run(&mut memory, &unmapped.params()).unwrap_err();
        assert!(error.contains("reads unmapped device memory"), "{error}");
        let unmapped = ElementwiseArgs {
            out: 0x1005,
            ..args
        };
        let error = add.run(&mut memory, &unmapped.params()).unwrap_err();
        assert!(error.contains("writes unmapped device memory"), "{error}");
        let error = add.run(&mut memory, &[0x1004]).unwrap_err();
        assert!(error.contains("1 parameters, not 5"), "{error}");

        // A broadcast: `[2]` plus a scalar `[]`, written over the output.
        let bc = ElementwiseEmulation::new(ElementwiseSpec {
            broadcast: 1,
            ..spec(ElementwiseOp::Add, DType::U8, DType::U8)
        });
        let scalar = ElementwiseArgs { b: 0x1003, ..args };
        let mut params = scalar.params().to_vec();
        params.extend([2, 1, 0]);
        let mut memory2 = OneBlock {
            base: 0x1000,
            bytes: vec![3, 4, 10, 20, 0xEE, 0xEE],
        };
        bc.run(&mut memory2, &params).unwrap();
        assert_eq!(memory2.bytes, [3, 4, 10, 20, 23, 24]);
        assert!(
            bc.run(&mut memory2, &args.params())
                .unwrap_err()
                .contains("not 8")
        );
        assert_eq!(
            memory.bytes,
            [3, 4, 10, 20, 13, 24],
            "failed runs write nothing"
        );
    }
}
