//! CUDA C++ source for the built-in elementwise kernels, generated per operation and element type.
//!
//! The source is self-contained (no `#include`), so NVRTC needs no include path: `f16` and `bf16`
//! are stored as 16-bit integers and converted to and from `float` by hand, rounding to nearest,
//! ties to even, exactly as the `half` crate does on the host. Every kernel has the same
//! signature, `(out, a, b, scalar_bits, len)` with five 8-byte parameters (a broadcasting binary
//! kernel adds `(extent, a_stride, b_stride)` per dimension of its collapsed index space), and
//! loops with a grid stride, so one launch path serves them all.
//!
//! Semantics, which the host reference in the tests mirrors:
//! - integers wrap (computed in 64-bit unsigned arithmetic, then truncated);
//! - `f16`/`bf16` arithmetic is computed in `f32` and rounded once to the storage type;
//! - float-to-integer casts truncate toward zero and saturate, NaN becoming 0 (Rust's `as`);
//! - casts to `f16`/`bf16` round through `f32`; casts to `bool` test `!= 0`; `bool` reads as 0/1.

use super::spec::{ElementwiseOp, ElementwiseSpec};
use crate::dtype::DType;

/// How a storage type computes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// `f32`, `f64`: native.
    Float,
    /// `f16`, `bf16`: stored as 16 bits, computed as `float`.
    Half,
    /// Signed integers.
    Signed,
    /// Unsigned integers.
    Unsigned,
    /// `bool`: one byte, read as `!= 0`, written as 0 or 1.
    Bool,
}

pub(super) fn kind(d: DType) -> Kind {
    match d {
        DType::F32 | DType::F64 => Kind::Float,
        DType::F16 | DType::BF16 => Kind::Half,
        DType::I8 | DType::I16 | DType::I32 | DType::I64 => Kind::Signed,
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => Kind::Unsigned,
        DType::Bool => Kind::Bool,
    }
}

/// The C type a tensor of `d` is stored as.
#[cfg(test)]
pub(crate) fn storage_name(d: DType) -> &'static str {
    storage(d)
}

pub(super) fn storage(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 | DType::BF16 | DType::U16 => "unsigned short",
        DType::I8 => "signed char",
        DType::I16 => "short",
        DType::I32 => "int",
        DType::I64 => "long long",
        DType::U8 | DType::Bool => "unsigned char",
        DType::U32 => "unsigned int",
        DType::U64 => "unsigned long long",
    }
}

/// The C type values of `d` are computed in.
pub(super) fn compute(d: DType) -> &'static str {
    match kind(d) {
        Kind::Half => "float",
        Kind::Bool => "bool",
        _ => storage(d),
    }
}

/// Reads a stored value as its compute type.
pub(super) fn load(d: DType, raw: &str) -> String {
    match d {
        DType::F16 => format!("cf_h2f({raw})"),
        DType::BF16 => format!("cf_b2f({raw})"),
        DType::Bool => format!("({raw} != 0)"),
        _ => raw.to_owned(),
    }
}

/// Writes a computed value as its storage type.
pub(super) fn store(d: DType, value: &str) -> String {
    match d {
        DType::F16 => format!("cf_f2h({value})"),
        DType::BF16 => format!("cf_f2b({value})"),
        DType::Bool => format!("(unsigned char)(({value}) ? 1 : 0)"),
        _ => format!("({})({value})", storage(d)),
    }
}

/// The scalar argument (the element's bits, zero-extended) as the compute type.
fn scalar(d: DType) -> String {
    match d {
        DType::F32 => "cf_bits_f32((unsigned int)s)".into(),
        DType::F64 => "cf_bits_f64(s)".into(),
        DType::F16 => "cf_h2f((unsigned short)s)".into(),
        DType::BF16 => "cf_b2f((unsigned short)s)".into(),
        DType::Bool => "(s != 0)".into(),
        _ => format!("({})s", storage(d)),
    }
}

/// The smallest and largest value of an integer type, as C expressions.
fn int_bounds(d: DType) -> (&'static str, &'static str) {
    match d {
        DType::I8 => ("-128", "127"),
        DType::I16 => ("-32768", "32767"),
        DType::I32 => ("(-2147483647 - 1)", "2147483647"),
        DType::I64 => ("(-9223372036854775807LL - 1)", "9223372036854775807LL"),
        DType::U8 => ("0", "255"),
        DType::U16 => ("0", "65535"),
        DType::U32 => ("0u", "4294967295u"),
        DType::U64 => ("0ull", "18446744073709551615ull"),
        _ => ("0", "0"),
    }
}

/// The kernel's exported name.
pub(crate) fn kernel_name(spec: ElementwiseSpec) -> String {
    if spec.op == ElementwiseOp::Cast {
        format!("cuferry_cast_{}_{}", spec.input.name(), spec.output.name())
    } else if spec.broadcast > 0 {
        format!(
            "cuferry_{}_{}_bc{}",
            spec.op.name(),
            spec.input.name(),
            spec.broadcast
        )
    } else {
        format!("cuferry_{}_{}", spec.op.name(), spec.input.name())
    }
}

/// Bit casts and the `f16`/`bf16` conversions, shared by every kernel.
pub(super) const PRELUDE: &str = r#"
__device__ __forceinline__ unsigned int cf_f32_bits(float f) { union { float f; unsigned int u; } c; c.f = f; return c.u; }
__device__ __forceinline__ float cf_bits_f32(unsigned int u) { union { float f; unsigned int u; } c; c.u = u; return c.f; }
__device__ __forceinline__ double cf_bits_f64(unsigned long long u) { union { double d; unsigned long long u; } c; c.u = u; return c.d; }
__device__ __forceinline__ float cf_h2f(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exp = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int man = (unsigned int)h & 0x3ffu;
    if (exp == 0x1fu) return cf_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0u) {
        if (man == 0u) return cf_bits_f32(sign);
        return cf_bits_f32(sign | cf_f32_bits((float)man * 5.9604644775390625e-8f));
    }
    return cf_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}
__device__ __forceinline__ unsigned short cf_f2h(float f) {
    unsigned int x = cf_f32_bits(f);
    unsigned int sign = (x >> 16) & 0x8000u;
    unsigned int exp = (x >> 23) & 0xffu;
    unsigned int man = x & 0x7fffffu;
    if (exp == 0xffu) return (unsigned short)(sign | 0x7c00u | (man != 0u ? (0x200u | (man >> 13)) : 0u));
    int e = (int)exp - 112;
    if (e >= 31) return (unsigned short)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (unsigned short)sign;
        man |= 0x800000u;
        unsigned int shift = (unsigned int)(14 - e);
        unsigned int hm = man >> shift;
        unsigned int rem = man & ((1u << shift) - 1u);
        unsigned int half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (hm & 1u) != 0u)) hm += 1u;
        return (unsigned short)(sign | hm);
    }
    unsigned int out = sign | ((unsigned int)e << 10) | (man >> 13);
    unsigned int rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (out & 1u) != 0u)) out += 1u;
    return (unsigned short)out;
}
__device__ __forceinline__ float cf_b2f(unsigned short b) { return cf_bits_f32(((unsigned int)b) << 16); }
__device__ __forceinline__ unsigned short cf_f2b(float f) {
    unsigned int x = cf_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(x >> 16);
}
"#;

/// The expression an operation computes from `x` (first operand), `y` (second) and `sc`
/// (scalar), all in the input's compute type; for casts, converted to the output's.
fn expression(spec: ElementwiseSpec) -> String {
    let d = spec.input;
    let wrap = |op: &str, rhs: &str| {
        format!(
            "({})((unsigned long long)x {op} (unsigned long long){rhs})",
            storage(d)
        )
    };
    let integer = matches!(kind(d), Kind::Signed | Kind::Unsigned);
    match spec.op {
        ElementwiseOp::Add if integer => wrap("+", "y"),
        ElementwiseOp::Sub if integer => wrap("-", "y"),
        ElementwiseOp::Mul if integer => wrap("*", "y"),
        ElementwiseOp::Scale if integer => wrap("*", "sc"),
        ElementwiseOp::Neg if integer => format!("({})(0ull - (unsigned long long)x)", storage(d)),
        ElementwiseOp::Add => "x + y".into(),
        ElementwiseOp::Sub => "x - y".into(),
        ElementwiseOp::Mul => "x * y".into(),
        ElementwiseOp::Div => "x / y".into(),
        ElementwiseOp::Neg => "-x".into(),
        ElementwiseOp::Scale => "x * sc".into(),
        ElementwiseOp::Fill => "sc".into(),
        ElementwiseOp::Cast => cast_expression(spec.input, spec.output, "x"),
    }
}

/// `x as to`, for `x` (an atomic C expression) of `from`'s compute type, as `to`'s compute type.
pub(super) fn cast_expression(from: DType, to: DType, x: &str) -> String {
    let (from_kind, to_kind) = (kind(from), kind(to));
    match (from_kind, to_kind) {
        _ if from == to => x.into(),
        (_, Kind::Bool) => format!("({x} != 0)"),
        (Kind::Bool, Kind::Half) => format!("({x} ? 1.0f : 0.0f)"),
        (Kind::Bool, _) => format!("({})({x} ? 1 : 0)", compute(to)),
        (Kind::Float | Kind::Half, Kind::Signed | Kind::Unsigned) => {
            format!("cf_sat_{}((double){x})", to.name())
        }
        _ => format!("({}){x}", compute(to)),
    }
}

/// Whether a cast from `from` to `to` needs [`saturate_function`]`(to)`.
pub(super) fn cast_saturates(from: DType, to: DType) -> bool {
    matches!(kind(from), Kind::Float | Kind::Half)
        && matches!(kind(to), Kind::Signed | Kind::Unsigned)
}

/// The saturating float-to-integer conversion a cast to `to` needs (Rust's `as`).
pub(super) fn saturate_function(to: DType) -> String {
    let (min, max) = int_bounds(to);
    let t = storage(to);
    format!(
        "__device__ __forceinline__ {t} cf_sat_{name}(double d) {{\n    if (d != d) return ({t})0;\n    if (d <= (double){min}) return ({t}){min};\n    if (d >= (double){max}) return ({t}){max};\n    return ({t})d;\n}}\n",
        name = to.name()
    )
}

/// The complete source of the module for `spec`.
pub(crate) fn module_source(spec: ElementwiseSpec) -> String {
    let name = kernel_name(spec);
    let (input, output) = (spec.input, spec.output);
    let mut src = String::from(PRELUDE);
    let needs_saturate = spec.op == ElementwiseOp::Cast && cast_saturates(input, output);
    if needs_saturate {
        src.push_str(&saturate_function(output));
    }
    let reads_a = spec.op != ElementwiseOp::Fill;
    let reads_b = matches!(
        spec.op,
        ElementwiseOp::Add | ElementwiseOp::Sub | ElementwiseOp::Mul | ElementwiseOp::Div
    );
    let reads_scalar = matches!(spec.op, ElementwiseOp::Scale | ElementwiseOp::Fill);
    let mut body = String::new();
    // A broadcasting kernel walks its collapsed index space: the output's flat index `i`,
    // decomposed innermost first, gives each operand's element by its strides (0 where it is
    // broadcast). The equal-shape kernel (`broadcast == 0`) indexes everything by `i`.
    let rank = usize::from(spec.broadcast);
    let (ia, ib) = if rank > 0 && reads_b {
        body.push_str("        unsigned long long r_ = i, ia = 0, ib = 0, c_;\n");
        for d in (0..rank).rev() {
            body.push_str(&format!(
                "        c_ = r_ % d{d}; r_ /= d{d}; ia += c_ * sa{d}; ib += c_ * sb{d};\n"
            ));
        }
        ("a[ia]", "b[ib]")
    } else {
        ("a[i]", "b[i]")
    };
    let broadcast_params: String = (0..if reads_b { rank } else { 0 })
        .map(|d| {
            format!(", unsigned long long d{d}, unsigned long long sa{d}, unsigned long long sb{d}")
        })
        .collect();
    if reads_a {
        body.push_str(&format!(
            "        {} x = {};\n",
            compute(input),
            load(input, ia)
        ));
    }
    if reads_b {
        body.push_str(&format!(
            "        {} y = {};\n",
            compute(input),
            load(input, ib)
        ));
    }
    if reads_scalar {
        body.push_str(&format!(
            "        {} sc = {};\n",
            compute(input),
            scalar(input)
        ));
    }
    body.push_str(&format!(
        "        out[i] = {};\n",
        store(output, &expression(spec))
    ));
    src.push_str(&format!(
        r#"
extern "C" __global__ void {name}({out_t}* out, const {in_t}* a, const {in_t}* b, unsigned long long s, unsigned long long n{broadcast_params}) {{
    (void)a; (void)b; (void)s;
    unsigned long long stride = (unsigned long long)blockDim.x * (unsigned long long)gridDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * (unsigned long long)blockDim.x + (unsigned long long)threadIdx.x; i < n; i += stride) {{
{body}    }}
}}
"#,
        out_t = storage(output),
        in_t = storage(input),
    ));
    src
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
    fn names_distinguish_operation_and_types() {
        assert_eq!(
            kernel_name(spec(ElementwiseOp::Add, DType::F32, DType::F32)),
            "cuferry_add_f32"
        );
        assert_eq!(
            kernel_name(spec(ElementwiseOp::Cast, DType::F16, DType::I8)),
            "cuferry_cast_f16_i8"
        );
    }

    #[test]
    fn sources_are_self_contained_and_export_the_kernel() {
        for op in [
            ElementwiseOp::Add,
            ElementwiseOp::Neg,
            ElementwiseOp::Scale,
            ElementwiseOp::Fill,
        ] {
            let s = spec(op, DType::I32, DType::I32);
            let src = module_source(s);
            assert!(!src.contains("#include"));
            assert!(src.contains(&format!("extern \"C\" __global__ void {}(", kernel_name(s))));
        }
    }

    #[test]
    fn broadcasting_kernels_have_their_own_name_and_index_math() {
        let equal = spec(ElementwiseOp::Add, DType::F32, DType::F32);
        let bc = ElementwiseSpec {
            broadcast: 2,
            ..equal
        };
        assert_eq!(kernel_name(bc), "cuferry_add_f32_bc2");
        assert_ne!(kernel_name(bc), kernel_name(equal));
        let src = module_source(bc);
        assert!(
            src.contains("unsigned long long d1, unsigned long long sa1, unsigned long long sb1)")
        );
        assert!(src.contains("b[ib]"));
        let plain = module_source(equal);
        assert!(
            !plain.contains("ia +=") && plain.contains("b[i]"),
            "no index math when equal"
        );
    }

    #[test]
    fn integer_arithmetic_wraps_through_unsigned() {
        let src = module_source(spec(ElementwiseOp::Mul, DType::U16, DType::U16));
        assert!(src.contains("(unsigned long long)x * (unsigned long long)y"));
    }

    #[test]
    fn float_to_integer_casts_saturate() {
        let src = module_source(spec(ElementwiseOp::Cast, DType::F32, DType::I64));
        assert!(src.contains("cf_sat_i64((double)x)"));
        assert!(src.contains("if (d != d) return (long long)0;"));
        let src = module_source(spec(ElementwiseOp::Cast, DType::I64, DType::F32));
        assert!(!src.contains("cf_sat_"));
    }
}
