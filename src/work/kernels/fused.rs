//! Fused elementwise kernels: one kernel for a whole group of same-length elementwise
//! operations, generated from the group's canonical expression.
//!
//! A prepared program (`work::graph`) groups each maximal run of elementwise operations over the
//! same element count and describes it as a [`FusedKernel`]: a straight-line program over one
//! element index. This module turns that description into CUDA C++ (one NVRTC kernel per
//! description, cached by the engine's kernel cache under the description itself), into launch
//! parameters, and (for the simulated device) into a host emulation.
//!
//! Every operation keeps the eager kernels' semantics bit for bit (see [`kernels`](super)):
//! each intermediate value is rounded to its storage type exactly as if it had been written to
//! memory by the eager kernel, `f32`/`f64` arithmetic uses the `_rn` intrinsics so no multiply
//! and add are ever contracted into an FMA, and integers wrap.

#[cfg(any(test, feature = "sim"))]
use super::emulate::Scalar;
use super::source::{
    Kind, PRELUDE, cast_expression, cast_saturates, kind, load, saturate_function, storage, store,
};
use super::spec::{BroadcastDim, ElementwiseOp, MAX_BLOCKS, unsupported};
#[cfg(any(test, feature = "sim"))]
use super::spec::{broadcast_extent, broadcast_index};
#[cfg(any(test, feature = "sim"))]
use crate::driver::launch::{DeviceMemory, Emulation};
use crate::dtype::DType;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// One operation of a fused kernel. Operands name earlier values by their index in
/// [`FusedKernel::body`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum FusedOp {
    /// Element `i` of input parameter `n` (of type [`FusedKernel::inputs`]`[n]`).
    Load(usize),
    /// A constant of `dtype`: the element's bits, zero-extended.
    Const { dtype: DType, bits: u64 },
    /// `a op b` for `Add`, `Sub`, `Mul` or `Div`; both of the same type.
    Binary {
        op: ElementwiseOp,
        a: usize,
        b: usize,
    },
    /// `-a`.
    Neg(usize),
    /// `a * factor`, the factor's bits (of `a`'s type) zero-extended.
    Scale { a: usize, bits: u64 },
    /// `a as to` (Rust's `as`, as the eager `cast`).
    Cast { a: usize, to: DType },
}

/// A fused elementwise kernel, described by what it computes for one element index.
///
/// Its launch parameters are the output pointers (one per entry of `outputs`, in order), then
/// the input pointers (one per entry of `inputs`), then the element count: all 8-byte words.
///
/// An input is read at element `i` of the kernel's index space, unless it is in
/// [`broadcast`](Self::broadcast): then it holds fewer elements (a `[N]` bias of a `[B, N]`
/// group, say) and element `i` reads the element its broadcast strides name. The strides are
/// part of the description (and so of the kernel's name): a program's shapes are fixed when
/// it is compiled, so the kernel takes no more parameters than an equal-shape one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct FusedKernel {
    /// The element type of each input parameter.
    pub(crate) inputs: Vec<DType>,
    /// The operations, in order; value `k` is operation `k`'s result.
    pub(crate) body: Vec<FusedOp>,
    /// The values stored to the output parameters, in parameter order (one value may be stored
    /// to several outputs).
    pub(crate) outputs: Vec<usize>,
    /// The inputs read through a broadcast, by parameter index: the collapsed broadcast of the
    /// kernel's index space (`a`, the output shape) against the input's shape (`b`), as
    /// [`Broadcast::of`](super::spec::Broadcast::of) makes it. Element `i` of the kernel reads
    /// element [`broadcast_index`](super::spec::broadcast_index)`(dims, i).1` of the input;
    /// the extents multiply to the kernel's element count. Inputs not named here are read at
    /// `i`.
    pub(crate) broadcast: BTreeMap<usize, Vec<BroadcastDim>>,
}

/// The low `d.size_bytes()` bytes of `bits`: the element a constant or factor of `d` stands for.
fn element_bits(d: DType, bits: u64) -> u64 {
    match d.size_bytes() {
        8 => bits,
        n => bits & ((1u64 << (8 * n)) - 1),
    }
}

/// A constant of `d` with `bits`, as a C expression of `d`'s storage type.
fn literal(d: DType, bits: u64) -> String {
    let bits = element_bits(d, bits);
    match d {
        DType::F32 => format!("cf_bits_f32(0x{bits:08x}u)"),
        DType::F64 => format!("cf_bits_f64(0x{bits:016x}ull)"),
        DType::Bool => format!("(unsigned char){}", u8::from(bits != 0)),
        _ => format!("({})0x{bits:x}ull", storage(d)),
    }
}

/// `x op y` for `add`, `sub`, `mul` or `div` on values of `d`'s compute type (atomic C
/// expressions), as the eager kernel computes it before storing: `_rn` intrinsics for floats
/// (computed in `float` for `f16`/`bf16`), wrapping through 64-bit unsigned for integers.
fn arithmetic(d: DType, op: ElementwiseOp, x: &str, y: &str) -> String {
    let (symbol, name) = match op {
        ElementwiseOp::Add => ("+", "add"),
        ElementwiseOp::Sub => ("-", "sub"),
        ElementwiseOp::Div => ("/", "div"),
        _ => ("*", "mul"),
    };
    match kind(d) {
        Kind::Signed | Kind::Unsigned => format!(
            "({})((unsigned long long){x} {symbol} (unsigned long long){y})",
            storage(d)
        ),
        _ if d == DType::F64 => format!("__d{name}_rn({x}, {y})"),
        _ => format!("__f{name}_rn({x}, {y})"),
    }
}

/// The 64-bit FNV-1a hash of `bytes`: stable across runs, platforms and releases.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl FusedKernel {
    /// Threads per block of every fused kernel.
    pub(crate) const BLOCK: u32 = 256;

    /// How many consecutive elements one thread handles per iteration of the vector path.
    const VECTOR: u64 = 4;

    /// The element type of value `value`.
    ///
    /// # Panics
    /// If `value` is not a value of the body, or the body is not well formed (see
    /// [`check`](Self::check)).
    pub(crate) fn dtype_of(&self, value: usize) -> DType {
        let mut v = value;
        loop {
            match self.body[v] {
                FusedOp::Load(n) => return self.inputs[n],
                FusedOp::Const { dtype, .. } => return dtype,
                FusedOp::Cast { to, .. } => return to,
                FusedOp::Binary { a, .. } | FusedOp::Neg(a) | FusedOp::Scale { a, .. } => {
                    assert!(a < v, "value {v} uses value {a}, not an earlier one");
                    v = a;
                }
            }
        }
    }

    /// Whether the description is well formed: every operand names an earlier value, every
    /// load an input, both operands of a binary operation have one type, every operation
    /// serves its type as the eager kernel does (no arithmetic on `bool`, division only for
    /// floats, negation only for floats and signed integers), constants and factors fit their
    /// type, and every output names a value.
    ///
    /// # Errors
    /// What is wrong, for the first flaw found.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut types: Vec<DType> = Vec::with_capacity(self.body.len());
        for (k, &op) in self.body.iter().enumerate() {
            let operand = |v: usize| {
                types.get(v).copied().ok_or_else(|| {
                    format!("value {k} ({op:?}) uses value {v}, which is not an earlier value")
                })
            };
            let serves = |o: ElementwiseOp, d: DType| match unsupported(o, d) {
                Some(reason) => Err(format!("value {k} ({op:?}) on {d}: {reason}")),
                None => Ok(()),
            };
            let fits = |d: DType, bits: u64| {
                if element_bits(d, bits) == bits {
                    Ok(())
                } else {
                    Err(format!(
                        "value {k} ({op:?}): {bits:#x} has more bits than {d}"
                    ))
                }
            };
            let dtype = match op {
                FusedOp::Load(n) => *self.inputs.get(n).ok_or_else(|| {
                    format!("value {k} loads input {n} of {} inputs", self.inputs.len())
                })?,
                FusedOp::Const { dtype, bits } => {
                    fits(dtype, bits)?;
                    dtype
                }
                FusedOp::Binary { op: o, a, b } => {
                    let (ta, tb) = (operand(a)?, operand(b)?);
                    if !matches!(
                        o,
                        ElementwiseOp::Add
                            | ElementwiseOp::Sub
                            | ElementwiseOp::Mul
                            | ElementwiseOp::Div
                    ) {
                        return Err(format!("value {k} ({op:?}) is not a binary operation"));
                    }
                    if ta != tb {
                        return Err(format!("value {k} ({op:?}) combines {ta} with {tb}"));
                    }
                    serves(o, ta)?;
                    ta
                }
                FusedOp::Neg(a) => {
                    let t = operand(a)?;
                    serves(ElementwiseOp::Neg, t)?;
                    t
                }
                FusedOp::Scale { a, bits } => {
                    let t = operand(a)?;
                    serves(ElementwiseOp::Scale, t)?;
                    fits(t, bits)?;
                    t
                }
                FusedOp::Cast { a, to } => {
                    operand(a)?;
                    to
                }
            };
            types.push(dtype);
        }
        for (&n, dims) in &self.broadcast {
            if n >= self.inputs.len() {
                return Err(format!(
                    "a broadcast names input {n} of {} inputs",
                    self.inputs.len()
                ));
            }
            if dims.is_empty() || dims.iter().any(|d| d.extent == 0) {
                return Err(format!(
                    "input {n}'s broadcast {dims:?} has no dimension or an empty one"
                ));
            }
        }
        match self.outputs.iter().find(|&&v| v >= self.body.len()) {
            Some(v) => Err(format!(
                "an output stores value {v} of {} values",
                self.body.len()
            )),
            None => Ok(()),
        }
    }

    /// The description as text, one token per field, from which the name is hashed.
    fn canonical(&self) -> String {
        let mut text = String::from("fused1 in");
        for d in &self.inputs {
            let _ = write!(text, " {d}");
        }
        text.push_str(" body");
        for op in &self.body {
            let _ = match *op {
                FusedOp::Load(n) => write!(text, " load {n}"),
                FusedOp::Const { dtype, bits } => write!(text, " const {dtype} {bits:#x}"),
                FusedOp::Binary { op, a, b } => write!(text, " {} {a} {b}", op.name()),
                FusedOp::Neg(a) => write!(text, " neg {a}"),
                FusedOp::Scale { a, bits } => write!(text, " scale {a} {bits:#x}"),
                FusedOp::Cast { a, to } => write!(text, " cast {a} {to}"),
            };
            text.push(';');
        }
        text.push_str(" out");
        for v in &self.outputs {
            let _ = write!(text, " {v}");
        }
        // Only kernels that broadcast say so, so every other kernel keeps its name.
        for (n, dims) in &self.broadcast {
            let _ = write!(text, " bcast {n}");
            for d in dims {
                let _ = write!(text, " {}x{}/{}", d.extent, d.a_stride, d.b_stride);
            }
            text.push(';');
        }
        text
    }

    /// The C function `cf_bidx<n>` that maps an element of the kernel's index space to the
    /// element of broadcast input `n` it reads (the index math of
    /// [`broadcast_index`](super::spec::broadcast_index), with the extents and strides as
    /// constants).
    fn index_function(n: usize, dims: &[BroadcastDim]) -> String {
        let mut f = format!(
            "__device__ __forceinline__ unsigned long long cf_bidx{n}(unsigned long long r) {{\n    unsigned long long o = 0ull;\n"
        );
        for (k, d) in dims.iter().enumerate().rev() {
            if d.b_stride != 0 {
                let _ = writeln!(f, "    o += (r % {}ull) * {}ull;", d.extent, d.b_stride);
            }
            if k > 0 {
                let _ = writeln!(f, "    r /= {}ull;", d.extent);
            }
        }
        f.push_str("    (void)r;\n    return o;\n}\n");
        f
    }

    /// The kernel's exported name: `cuferry_fused_` and 16 hex digits of a stable hash of the
    /// description (the same in every run and on every machine).
    pub(crate) fn name(&self) -> String {
        format!("cuferry_fused_{:016x}", fnv1a(self.canonical().as_bytes()))
    }

    /// The element type of every value, in body order.
    fn types(&self) -> Vec<DType> {
        (0..self.body.len()).map(|v| self.dtype_of(v)).collect()
    }

    /// The body as C statements, one `v<k>` per value in its storage type, for one element:
    /// `load(n)` is the element of input `n` (raw storage), `store(m, value)` the statement
    /// that writes output `m`.
    fn statements(
        &self,
        types: &[DType],
        indent: &str,
        load_input: impl Fn(usize) -> String,
        store_output: impl Fn(usize, &str) -> String,
    ) -> String {
        let mut out = String::new();
        let value = |v: usize| load(types[v], &format!("v{v}"));
        for (k, &op) in self.body.iter().enumerate() {
            let d = types[k];
            let expr = match op {
                FusedOp::Load(n) if d == DType::Bool => store(d, &load(d, &load_input(n))),
                FusedOp::Load(n) => load_input(n),
                FusedOp::Const { dtype, bits } => literal(dtype, bits),
                FusedOp::Binary { op, a, b } => store(d, &arithmetic(d, op, &value(a), &value(b))),
                FusedOp::Neg(a) if matches!(kind(d), Kind::Signed) => {
                    format!("({})(0ull - (unsigned long long)v{a})", storage(d))
                }
                FusedOp::Neg(a) => store(d, &format!("(-{})", value(a))),
                FusedOp::Scale { a, bits } => {
                    let factor = load(d, &literal(d, bits));
                    store(d, &arithmetic(d, ElementwiseOp::Mul, &value(a), &factor))
                }
                FusedOp::Cast { a, to } if types[a] == to => format!("v{a}"),
                FusedOp::Cast { a, to } => store(to, &cast_expression(types[a], to, &value(a))),
            };
            let _ = writeln!(out, "{indent}const {} v{k} = {expr};", storage(d));
        }
        for (m, &v) in self.outputs.iter().enumerate() {
            let _ = writeln!(out, "{indent}{};", store_output(m, &format!("v{v}")));
        }
        out
    }

    /// The complete, self-contained CUDA C++ source of the module exporting the kernel
    /// [`name`](Self::name).
    ///
    /// The kernel takes one pointer per output (of the stored value's storage type), one
    /// `const` pointer per input, then `unsigned long long n`. When every pointer is aligned to
    /// four of its elements, each thread handles four consecutive elements per iteration with
    /// vector loads and stores over the first `n / 4 * 4` elements; the rest (or, when a
    /// pointer is misaligned, everything) takes a scalar grid-stride loop.
    ///
    /// # Panics
    /// If the description is not well formed (see [`check`](Self::check)).
    pub(crate) fn source(&self) -> String {
        debug_assert_eq!(self.check(), Ok(()));
        let types = self.types();
        let out_types: Vec<DType> = self.outputs.iter().map(|&v| types[v]).collect();
        let loaded: BTreeSet<usize> = self
            .body
            .iter()
            .filter_map(|op| match *op {
                FusedOp::Load(n) => Some(n),
                _ => None,
            })
            .collect();

        let mut src = String::from(PRELUDE);
        let saturated: BTreeSet<DType> = self
            .body
            .iter()
            .filter_map(|op| match *op {
                FusedOp::Cast { a, to } if cast_saturates(types[a], to) => Some(to),
                _ => None,
            })
            .collect();
        for &to in &saturated {
            src.push_str(&saturate_function(to));
        }
        // Broadcast inputs are gathered one element at a time, on both paths; the others are
        // loaded four at a time on the vector path.
        let gathered = |n: &usize| self.broadcast.contains_key(n);
        for (&n, dims) in &self.broadcast {
            if loaded.contains(&n) {
                src.push_str(&Self::index_function(n, dims));
            }
        }
        let streamed: BTreeSet<usize> = loaded.iter().copied().filter(|n| !gathered(n)).collect();
        let vectors: BTreeSet<DType> = streamed
            .iter()
            .map(|&n| self.inputs[n])
            .chain(out_types.iter().copied())
            .collect();
        for &d in &vectors {
            let _ = writeln!(
                src,
                "struct __align__({}) cf_v4_{} {{ {} v[4]; }};",
                d.size_bytes() * 4,
                d.name(),
                storage(d)
            );
        }

        let mut params: Vec<String> = out_types
            .iter()
            .enumerate()
            .map(|(m, &d)| format!("{}* o{m}", storage(d)))
            .collect();
        params.extend(
            self.inputs
                .iter()
                .enumerate()
                .map(|(n, &d)| format!("const {}* i{n}", storage(d))),
        );
        params.push("unsigned long long n".into());
        let unused: String = (0..self.inputs.len())
            .filter(|n| !loaded.contains(n))
            .map(|n| format!("    (void)i{n};\n"))
            .collect();
        let mut misaligned: Vec<String> = out_types
            .iter()
            .enumerate()
            .map(|(m, d)| format!("((unsigned long long)o{m} % {}ull)", d.size_bytes() * 4))
            .collect();
        misaligned.extend(streamed.iter().map(|&n| {
            format!(
                "((unsigned long long)i{n} % {}ull)",
                self.inputs[n].size_bytes() * 4
            )
        }));
        if misaligned.is_empty() {
            misaligned.push("0ull".into());
        }

        let mut vector = String::new();
        for &n in &streamed {
            let _ = writeln!(
                vector,
                "            const cf_v4_{t} l{n} = ((const cf_v4_{t}*)i{n})[c];",
                t = self.inputs[n].name()
            );
        }
        for (m, d) in out_types.iter().enumerate() {
            let _ = writeln!(vector, "            cf_v4_{} s{m};", d.name());
        }
        vector.push_str("#pragma unroll\n            for (int j = 0; j < 4; ++j) {\n");
        vector.push_str(&self.statements(
            &types,
            "                ",
            |n| {
                if gathered(&n) {
                    format!("i{n}[cf_bidx{n}(c * 4ull + (unsigned long long)j)]")
                } else {
                    format!("l{n}.v[j]")
                }
            },
            |m, v| format!("s{m}.v[j] = {v}"),
        ));
        vector.push_str("            }\n");
        for (m, d) in out_types.iter().enumerate() {
            let _ = writeln!(vector, "            ((cf_v4_{}*)o{m})[c] = s{m};", d.name());
        }
        let scalar = self.statements(
            &types,
            "        ",
            |n| {
                if gathered(&n) {
                    format!("i{n}[cf_bidx{n}(i)]")
                } else {
                    format!("i{n}[i]")
                }
            },
            |m, v| format!("o{m}[i] = {v}"),
        );

        let _ = write!(
            src,
            r#"
extern "C" __global__ void {name}({params}) {{
{unused}    const unsigned long long tid = (unsigned long long)blockIdx.x * (unsigned long long)blockDim.x + (unsigned long long)threadIdx.x;
    const unsigned long long stride = (unsigned long long)blockDim.x * (unsigned long long)gridDim.x;
    unsigned long long tail = 0ull;
    if (({misaligned}) == 0ull) {{
        const unsigned long long chunks = n / 4ull;
        for (unsigned long long c = tid; c < chunks; c += stride) {{
{vector}        }}
        tail = chunks * 4ull;
    }}
    for (unsigned long long i = tail + tid; i < n; i += stride) {{
{scalar}    }}
}}
"#,
            name = self.name(),
            params = params.join(", "),
            misaligned = misaligned.join(" | "),
        );
        src
    }

    /// Blocks of [`BLOCK`](Self::BLOCK) threads for `len` elements: one thread per four
    /// elements, at least one block and at most [`MAX_BLOCKS`] (the kernel loops over the rest).
    pub(crate) fn grid(len: u64) -> u32 {
        let blocks = len
            .div_ceil(Self::VECTOR)
            .div_ceil(u64::from(Self::BLOCK))
            .clamp(1, u64::from(MAX_BLOCKS));
        u32::try_from(blocks).unwrap_or(MAX_BLOCKS)
    }

    /// The kernel's parameters, in its order: the output pointers, the input pointers, the
    /// element count.
    pub(crate) fn params(outputs: &[u64], inputs: &[u64], len: u64) -> Vec<u64> {
        let mut params = Vec::with_capacity(outputs.len() + inputs.len() + 1);
        params.extend_from_slice(outputs);
        params.extend_from_slice(inputs);
        params.push(len);
        params
    }
}

/// The host emulation of a fused kernel, registered with the module that holds it.
#[cfg(any(test, feature = "sim"))]
pub(crate) struct FusedEmulation {
    kernel: FusedKernel,
    /// The kernel's name, as the module exports it.
    name: String,
}

#[cfg(any(test, feature = "sim"))]
impl FusedEmulation {
    pub(crate) fn new(kernel: FusedKernel) -> Self {
        let name = kernel.name();
        FusedEmulation { kernel, name }
    }

    /// The values the body computes for one element, given the inputs' bytes; `values` is
    /// scratch space.
    fn element(
        &self,
        inputs: &[Vec<u8>],
        i: usize,
        values: &mut Vec<Scalar>,
    ) -> Result<(), String> {
        let k = &self.kernel;
        values.clear();
        for (v, &op) in k.body.iter().enumerate() {
            let value = match op {
                FusedOp::Load(n) => {
                    let size = k.inputs[n].size_bytes();
                    let at = match k.broadcast.get(&n) {
                        Some(dims) => broadcast_index(dims, i as u64).1 as usize,
                        None => i,
                    };
                    Some(Scalar::read(
                        k.inputs[n],
                        &inputs[n][at * size..(at + 1) * size],
                    ))
                }
                FusedOp::Const { dtype, bits } => Some(Scalar::from_bits(dtype, bits)),
                FusedOp::Binary { op, a, b } => values[a].binary(op, values[b]),
                FusedOp::Neg(a) => values[a].neg(),
                FusedOp::Scale { a, bits } => {
                    let x = values[a];
                    x.binary(ElementwiseOp::Scale, Scalar::from_bits(x.dtype(), bits))
                }
                FusedOp::Cast { a, to } => Some(values[a].cast(to)),
            };
            values.push(value.ok_or_else(|| format!("value {v} ({op:?}) has no result"))?);
        }
        Ok(())
    }
}

#[cfg(any(test, feature = "sim"))]
impl Emulation for FusedEmulation {
    fn name(&self) -> &str {
        &self.name
    }

    /// Reads every input's `n` elements, evaluates the body per element with the eager
    /// kernels' semantics and writes every output, as the kernel does with the parameters
    /// `(outputs…, inputs…, n)`. Nothing is written unless every range is mapped.
    fn run(&self, memory: &mut dyn DeviceMemory, params: &[u64]) -> Result<(), String> {
        let k = &self.kernel;
        k.check()
            .map_err(|e| format!("{}: malformed fused kernel: {e}", self.name))?;
        let count = k.outputs.len() + k.inputs.len() + 1;
        if params.len() != count {
            return Err(format!(
                "{} launched with {} parameters, not {count}",
                self.name,
                params.len()
            ));
        }
        let (out_ptrs, rest) = params.split_at(k.outputs.len());
        let (in_ptrs, &[n]) = rest.split_at(k.inputs.len()) else {
            unreachable!("the count was checked");
        };
        let Ok(len) = usize::try_from(n) else {
            return Err(format!("{}: launch of {n} elements", self.name));
        };
        let bytes = |d: DType| {
            len.checked_mul(d.size_bytes())
                .ok_or_else(|| format!("{}: launch of {n} elements", self.name))
        };
        let mut inputs = Vec::with_capacity(k.inputs.len());
        for (p, (&ptr, &d)) in in_ptrs.iter().zip(&k.inputs).enumerate() {
            // A broadcast input spans one past the largest element its strides reach.
            let size = match k.broadcast.get(&p) {
                Some(dims) if len > 0 => {
                    let extents = dims
                        .iter()
                        .try_fold(1u64, |acc, d| acc.checked_mul(d.extent));
                    if extents != Some(n) {
                        return Err(format!(
                            "{}: input {p}'s broadcast {dims:?} does not cover the launch's {n} elements",
                            self.name
                        ));
                    }
                    usize::try_from(broadcast_extent(dims, false))
                        .ok()
                        .and_then(|e| e.checked_mul(d.size_bytes()))
                        .ok_or_else(|| {
                            format!("{}: input {p}'s broadcast {dims:?} overflows", self.name)
                        })?
                }
                Some(_) => 0,
                None => bytes(d)?,
            };
            inputs.push(memory.read(ptr, size).ok_or_else(|| {
                format!("{} reads unmapped device memory {ptr:#x}+{size}", self.name)
            })?);
        }
        let out_types: Vec<DType> = k.outputs.iter().map(|&v| k.dtype_of(v)).collect();
        for (&ptr, &d) in out_ptrs.iter().zip(&out_types) {
            let size = bytes(d)?;
            if memory.read(ptr, size).is_none() {
                return Err(format!(
                    "{} writes unmapped device memory {ptr:#x}+{size}",
                    self.name
                ));
            }
        }
        let mut results: Vec<Vec<u8>> = out_types
            .iter()
            .map(|d| Vec::with_capacity(len * d.size_bytes()))
            .collect();
        let mut values = Vec::with_capacity(k.body.len());
        for i in 0..len {
            self.element(&inputs, i, &mut values)?;
            for (result, &v) in results.iter_mut().zip(&k.outputs) {
                values[v].write(result);
            }
        }
        for (&ptr, result) in out_ptrs.iter().zip(&results) {
            if !memory.write(ptr, result) {
                return Err(format!(
                    "{} writes unmapped device memory {ptr:#x}+{}",
                    self.name,
                    result.len()
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::emulate;
    use super::super::spec::ElementwiseSpec;
    use super::*;

    /// A small deterministic generator.
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn pick<T: Copy>(&mut self, items: &[T]) -> T {
            items[self.below(items.len())]
        }
    }

    /// The bits of one random element of `d`: raw patterns, ordinary values and the special
    /// float values (zeros, infinities, NaNs, subnormals, huge and tiny values).
    pub(crate) fn random_bits(rng: &mut Rng, d: DType) -> u64 {
        let raw = rng.next();
        let choice = rng.below(8);
        let ordinary = (raw % 2001) as f64 / 8.0 - 125.0;
        let special = [
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            1e-40,
            -3.0e9,
            0.5,
        ][rng.below(8)];
        let float = match choice {
            0..=3 => Some(ordinary),
            4 => Some(special),
            _ => None,
        };
        match (d, float) {
            (DType::Bool, _) => u64::from(!raw.is_multiple_of(3)),
            (DType::F32, Some(f)) => u64::from((f as f32).to_bits()),
            (DType::F64, Some(f)) => f.to_bits(),
            (DType::F16, Some(f)) => u64::from(half::f16::from_f64(f).to_bits()),
            (DType::BF16, Some(f)) => u64::from(half::bf16::from_f64(f).to_bits()),
            (_, Some(f)) if choice < 3 => (f as i64) as u64 & mask(d),
            _ => raw & mask(d),
        }
    }

    fn mask(d: DType) -> u64 {
        element_bits(d, u64::MAX)
    }

    /// `len` random elements of `d`.
    pub(crate) fn random_input(rng: &mut Rng, d: DType, len: usize) -> Vec<u8> {
        (0..len)
            .flat_map(|_| random_bits(rng, d).to_le_bytes()[..d.size_bytes()].to_vec())
            .collect()
    }

    /// The operations that serve `d`, among add, sub, mul and div.
    fn binaries(d: DType) -> Vec<ElementwiseOp> {
        [
            ElementwiseOp::Add,
            ElementwiseOp::Sub,
            ElementwiseOp::Mul,
            ElementwiseOp::Div,
        ]
        .into_iter()
        .filter(|&op| unsupported(op, d).is_none())
        .collect()
    }

    /// A random well-formed kernel whose first input is `root`.
    pub(crate) fn random_kernel(rng: &mut Rng, root: DType) -> FusedKernel {
        let mut inputs = vec![root];
        for _ in 0..rng.below(3) {
            let d = if rng.below(2) == 0 {
                root
            } else {
                rng.pick(&DType::ALL)
            };
            inputs.push(d);
        }
        let mut body: Vec<FusedOp> = (0..inputs.len()).map(FusedOp::Load).collect();
        let mut types = inputs.clone();
        for _ in 0..1 + rng.below(12) {
            // Mostly operate on recent values, so chains get long.
            let a = types.len() - 1 - rng.below(types.len().min(3));
            let d = types[a];
            let same: Vec<usize> = (0..types.len()).filter(|&v| types[v] == d).collect();
            let op = match rng.below(10) {
                0 => FusedOp::Const {
                    dtype: d,
                    bits: random_bits(rng, d),
                },
                1..=4 if !binaries(d).is_empty() => FusedOp::Binary {
                    op: rng.pick(&binaries(d)),
                    a,
                    b: rng.pick(&same),
                },
                5 if unsupported(ElementwiseOp::Neg, d).is_none() => FusedOp::Neg(a),
                6 if unsupported(ElementwiseOp::Scale, d).is_none() => FusedOp::Scale {
                    a,
                    bits: random_bits(rng, d),
                },
                7 => FusedOp::Cast { a, to: root },
                _ => FusedOp::Cast {
                    a,
                    to: rng.pick(&DType::ALL),
                },
            };
            body.push(op);
            let kernel = FusedKernel {
                inputs: inputs.clone(),
                body: body.clone(),
                outputs: Vec::new(),
                ..Default::default()
            };
            types.push(kernel.dtype_of(body.len() - 1));
        }
        let mut outputs = vec![body.len() - 1];
        for _ in 0..rng.below(3) {
            outputs.push(rng.below(body.len()));
        }
        let kernel = FusedKernel {
            inputs,
            body,
            outputs,
            ..Default::default()
        };
        assert_eq!(kernel.check(), Ok(()), "{kernel:?}");
        kernel
    }

    /// The output shape of [`random_broadcast_kernel`]'s index space.
    pub(crate) const BROADCAST_SHAPE: [usize; 2] = [3, 13];

    /// A random kernel over the 39 elements of a `[3, 13]` index space, whose inputs are each,
    /// at random, read at the kernel's index or through a broadcast: a `[13]` row, a `[3, 1]`
    /// column or a `[]` scalar. Also the element each input reads for each output element,
    /// worked out from the shapes alone (a reference for the strides).
    pub(crate) fn random_broadcast_kernel(
        rng: &mut Rng,
        root: DType,
    ) -> (FusedKernel, Vec<Vec<usize>>) {
        let mut kernel = random_kernel(rng, root);
        let [rows, cols] = BROADCAST_SHAPE;
        let len = rows * cols;
        let mut reads = Vec::new();
        for n in 0..kernel.inputs.len() {
            let (shape, read): (&[usize], fn(usize) -> usize) = match rng.below(4) {
                0 => (&[13], |i| i % 13),
                1 => (&[3, 1], |i| i / 13),
                2 => (&[], |_| 0),
                _ => {
                    reads.push((0..len).collect());
                    continue;
                }
            };
            let dims = super::super::spec::Broadcast::of(&BROADCAST_SHAPE, shape)
                .unwrap()
                .dims;
            kernel.broadcast.insert(n, dims);
            reads.push((0..len).map(read).collect());
        }
        assert_eq!(kernel.check(), Ok(()), "{kernel:?}");
        (kernel, reads)
    }

    /// Each input's elements as the kernel reads them: element `reads[n][i]` of input `n` at
    /// output element `i`.
    pub(crate) fn gathered(
        kernel: &FusedKernel,
        inputs: &[Vec<u8>],
        reads: &[Vec<usize>],
    ) -> Vec<Vec<u8>> {
        inputs
            .iter()
            .zip(&kernel.inputs)
            .zip(reads)
            .map(|((input, d), read)| {
                let size = d.size_bytes();
                read.iter()
                    .flat_map(|&j| input[j * size..(j + 1) * size].to_vec())
                    .collect()
            })
            .collect()
    }

    /// What the eager kernels write, one kernel per operation: every value a column of
    /// `len` elements.
    fn eager(kernel: &FusedKernel, inputs: &[Vec<u8>], len: usize) -> Vec<Vec<u8>> {
        let mut columns: Vec<Vec<u8>> = Vec::new();
        for (k, &op) in kernel.body.iter().enumerate() {
            let run = |op, input, output, a: &[u8], b: &[u8], scalar| {
                emulate::run(
                    ElementwiseSpec {
                        op,
                        input,
                        output,
                        broadcast: 0,
                    },
                    a,
                    b,
                    scalar,
                    len,
                )
                .expect("the eager kernel exists")
            };
            let d = kernel.dtype_of(k);
            let column = match op {
                FusedOp::Load(n) => inputs[n].clone(),
                FusedOp::Const { dtype, bits } => {
                    run(ElementwiseOp::Fill, dtype, dtype, &[], &[], bits)
                }
                FusedOp::Binary { op, a, b } => run(op, d, d, &columns[a], &columns[b], 0),
                FusedOp::Neg(a) => run(ElementwiseOp::Neg, d, d, &columns[a], &[], 0),
                FusedOp::Scale { a, bits } => {
                    run(ElementwiseOp::Scale, d, d, &columns[a], &[], bits)
                }
                FusedOp::Cast { a, to } => run(
                    ElementwiseOp::Cast,
                    kernel.dtype_of(a),
                    to,
                    &columns[a],
                    &[],
                    0,
                ),
            };
            columns.push(column);
        }
        kernel.outputs.iter().map(|&v| columns[v].clone()).collect()
    }

    /// Device memory of separate allocations, for running an emulation without a device.
    #[derive(Default)]
    struct Blocks(Vec<(u64, Vec<u8>)>);

    impl Blocks {
        fn alloc(&mut self, bytes: Vec<u8>) -> u64 {
            let base = 0x10_0000 * (self.0.len() as u64 + 1);
            self.0.push((base, bytes));
            base
        }

        fn range(&mut self, ptr: u64, bytes: usize) -> Option<&mut [u8]> {
            self.0.iter_mut().find_map(|(base, data)| {
                let off = usize::try_from(ptr.checked_sub(*base)?).ok()?;
                data.get_mut(off..off.checked_add(bytes)?)
            })
        }

        fn get(&self, ptr: u64) -> &[u8] {
            &self.0.iter().find(|(base, _)| *base == ptr).unwrap().1
        }
    }

    impl DeviceMemory for Blocks {
        fn read(&mut self, ptr: u64, bytes: usize) -> Option<Vec<u8>> {
            self.range(ptr, bytes).map(|r| r.to_vec())
        }

        fn write(&mut self, ptr: u64, data: &[u8]) -> bool {
            match self.range(ptr, data.len()) {
                Some(out) => {
                    out.copy_from_slice(data);
                    true
                }
                None => false,
            }
        }
    }

    /// Runs `kernel`'s emulation on fresh allocations holding `inputs`; the outputs' bytes.
    pub(crate) fn emulated(kernel: &FusedKernel, inputs: &[Vec<u8>], len: usize) -> Vec<Vec<u8>> {
        let mut memory = Blocks::default();
        let ins: Vec<u64> = inputs.iter().map(|i| memory.alloc(i.clone())).collect();
        let outs: Vec<u64> = kernel
            .outputs
            .iter()
            .map(|&v| memory.alloc(vec![0xEE; len * kernel.dtype_of(v).size_bytes()]))
            .collect();
        let emulation = FusedEmulation::new(kernel.clone());
        emulation
            .run(&mut memory, &FusedKernel::params(&outs, &ins, len as u64))
            .unwrap();
        outs.iter().map(|&p| memory.get(p).to_vec()).collect()
    }

    #[test]
    fn the_emulation_matches_the_eager_kernels_one_operation_at_a_time() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let len = 29;
        for root in DType::ALL {
            for _ in 0..60 {
                let kernel = random_kernel(&mut rng, root);
                let inputs: Vec<Vec<u8>> = kernel
                    .inputs
                    .iter()
                    .map(|&d| random_input(&mut rng, d, len))
                    .collect();
                let want = eager(&kernel, &inputs, len);
                let got = emulated(&kernel, &inputs, len);
                assert_eq!(got, want, "{kernel:?}");
            }
        }
    }

    #[test]
    fn broadcast_inputs_are_gathered_through_their_strides() {
        // x[3, 13] + b[13], each input read its own way, against the eager kernels on the
        // inputs expanded by hand; and random kernels of every type the same way.
        let mut rng = Rng(0xb0ad_ca57);
        for root in DType::ALL {
            for _ in 0..40 {
                let (kernel, reads) = random_broadcast_kernel(&mut rng, root);
                let len = reads[0].len();
                let inputs: Vec<Vec<u8>> = kernel
                    .inputs
                    .iter()
                    .map(|&d| random_input(&mut rng, d, len))
                    .collect();
                let want = eager(&kernel, &gathered(&kernel, &inputs, &reads), len);
                // Each broadcast input holds only the elements it spans.
                let compact: Vec<Vec<u8>> = inputs
                    .iter()
                    .enumerate()
                    .map(|(n, input)| {
                        let size = kernel.inputs[n].size_bytes();
                        let span = reads[n].iter().max().map_or(0, |&m| m + 1);
                        input[..span * size].to_vec()
                    })
                    .collect();
                assert_eq!(emulated(&kernel, &compact, len), want, "{kernel:?}");
            }
        }
        // The source gathers broadcast inputs one element at a time, on both paths, and leaves
        // them out of the vector loads and the alignment test; the strides are in the name.
        let mut kernel = axpy();
        let plain = kernel.name();
        kernel.broadcast.insert(
            1,
            super::super::spec::Broadcast::of(&[3, 4], &[4])
                .unwrap()
                .dims,
        );
        assert_eq!(kernel.check(), Ok(()));
        assert_ne!(kernel.name(), plain);
        let src = kernel.source();
        assert!(
            src.contains("unsigned long long cf_bidx1(unsigned long long r)"),
            "{src}"
        );
        assert!(src.contains("o += (r % 4ull) * 1ull;"), "{src}");
        assert!(src.contains("i1[cf_bidx1(i)]"), "{src}");
        assert!(
            src.contains("i1[cf_bidx1(c * 4ull + (unsigned long long)j)]"),
            "{src}"
        );
        assert!(!src.contains("((const cf_v4_f32*)i1)[c]"), "{src}");
        assert!(!src.contains("((unsigned long long)i1 %"), "{src}");
        assert!(src.contains("((const cf_v4_f32*)i0)[c]"), "{src}");
        // A launch whose element count the broadcast does not cover is refused.
        let emulation = FusedEmulation::new(kernel.clone());
        let mut memory = Blocks::default();
        let x = memory.alloc(1.0f32.to_le_bytes().repeat(12));
        let b = memory.alloc(0.5f32.to_le_bytes().repeat(4));
        let out = memory.alloc(vec![0; 48]);
        let error = emulation
            .run(&mut memory, &FusedKernel::params(&[out], &[x, b], 8))
            .unwrap_err();
        assert!(error.contains("does not cover"), "{error}");
        emulation
            .run(&mut memory, &FusedKernel::params(&[out], &[x, b], 12))
            .unwrap();
        assert_eq!(memory.get(out), 2.5f32.to_le_bytes().repeat(12));
        // Ill-formed broadcasts are refused.
        let mut bad = kernel.clone();
        bad.broadcast.insert(2, vec![]);
        assert!(bad.check().unwrap_err().contains("input 2 of 2"));
        let mut bad = kernel;
        bad.broadcast.insert(0, vec![]);
        assert!(bad.check().unwrap_err().contains("no dimension"));
    }

    #[test]
    fn a_chain_rounds_every_intermediate_value_to_its_type() {
        // (x * 3) - x in f16 for x = 2047: 6141 rounds to 6140 (f16 steps by 4 there), and
        // 6140 - 2047 = 4093 to 4092; one rounding at the end would give 4094, then 4096.
        let kernel = FusedKernel {
            inputs: vec![DType::F16],
            body: vec![
                FusedOp::Load(0),
                FusedOp::Scale {
                    a: 0,
                    bits: u64::from(half::f16::from_f32(3.0).to_bits()),
                },
                FusedOp::Binary {
                    op: ElementwiseOp::Sub,
                    a: 1,
                    b: 0,
                },
            ],
            outputs: vec![2],
            ..Default::default()
        };
        let x = half::f16::from_f32(2047.0);
        let got = emulated(&kernel, &[x.to_le_bytes().to_vec()], 1);
        assert_eq!(got[0], half::f16::from_f32(4092.0).to_le_bytes());
        let kernel = FusedKernel {
            inputs: vec![DType::U8],
            body: vec![
                FusedOp::Load(0),
                FusedOp::Binary {
                    op: ElementwiseOp::Add,
                    a: 0,
                    b: 0,
                },
                FusedOp::Cast {
                    a: 1,
                    to: DType::U16,
                },
            ],
            outputs: vec![2, 1],
            ..Default::default()
        };
        let got = emulated(&kernel, &[vec![200]], 1);
        assert_eq!(
            got,
            [144u16.to_le_bytes().to_vec(), vec![144]],
            "u8 wraps before the cast"
        );
    }

    fn axpy() -> FusedKernel {
        FusedKernel {
            inputs: vec![DType::F32, DType::F32],
            body: vec![
                FusedOp::Load(0),
                FusedOp::Load(1),
                FusedOp::Scale {
                    a: 0,
                    bits: u64::from(2.0f32.to_bits()),
                },
                FusedOp::Binary {
                    op: ElementwiseOp::Add,
                    a: 2,
                    b: 1,
                },
            ],
            outputs: vec![3],
            ..Default::default()
        }
    }

    #[test]
    fn the_name_is_stable_and_tells_descriptions_apart() {
        let kernel = axpy();
        let name = kernel.name();
        assert_eq!(name, kernel.clone().name());
        assert!(name.starts_with("cuferry_fused_"));
        assert_eq!(name.len(), "cuferry_fused_".len() + 16);
        assert!(
            name["cuferry_fused_".len()..]
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        // The hash is FNV-1a of the canonical text, the same everywhere.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(
            name,
            format!(
                "cuferry_fused_{:016x}",
                fnv1a(kernel.canonical().as_bytes())
            )
        );

        let mut names = BTreeSet::new();
        let mut variants = vec![kernel.clone()];
        let mut other = kernel.clone();
        other.outputs = vec![2];
        variants.push(other);
        let mut other = kernel.clone();
        other.inputs[1] = DType::F64;
        variants.push(other);
        let mut other = kernel.clone();
        other.body[2] = FusedOp::Scale {
            a: 0,
            bits: u64::from(3.0f32.to_bits()),
        };
        variants.push(other);
        let mut other = kernel.clone();
        other.body[3] = FusedOp::Binary {
            op: ElementwiseOp::Sub,
            a: 2,
            b: 1,
        };
        variants.push(other);
        let mut other = kernel;
        other.outputs.push(3);
        variants.push(other);
        let mut rng = Rng(7);
        for d in DType::ALL {
            variants.push(random_kernel(&mut rng, d));
        }
        for v in &variants {
            assert!(names.insert(v.name()), "{v:?} shares its name");
        }
    }

    #[test]
    fn the_source_is_self_contained_and_has_the_vector_path() {
        let kernel = axpy();
        let src = kernel.source();
        assert!(!src.contains("#include"));
        assert!(src.contains(&format!(
            "extern \"C\" __global__ void {}(float* o0, const float* i0, const float* i1, unsigned long long n)",
            kernel.name()
        )));
        assert!(
            src.contains("__fmul_rn(v0, cf_bits_f32(0x40000000u))"),
            "{src}"
        );
        assert!(src.contains("__fadd_rn(v2, v1)"), "{src}");
        assert!(!src.contains(" + v"), "no plain float addition: {src}");
        assert!(src.contains("struct __align__(16) cf_v4_f32 { float v[4]; };"));
        assert!(src.contains("((const cf_v4_f32*)i0)[c]"));
        assert!(src.contains("((cf_v4_f32*)o0)[c] = s0;"));
        assert!(src.contains("((unsigned long long)o0 % 16ull)"));

        let mut rng = Rng(11);
        for d in DType::ALL {
            for _ in 0..20 {
                let kernel = random_kernel(&mut rng, d);
                let src = kernel.source();
                assert!(!src.contains("#include"));
                assert!(src.contains(&format!("__global__ void {}(", kernel.name())));
            }
        }
        let f64_kernel = FusedKernel {
            inputs: vec![DType::F64, DType::F64],
            body: vec![
                FusedOp::Load(0),
                FusedOp::Load(1),
                FusedOp::Binary {
                    op: ElementwiseOp::Mul,
                    a: 0,
                    b: 1,
                },
                FusedOp::Binary {
                    op: ElementwiseOp::Add,
                    a: 2,
                    b: 0,
                },
                FusedOp::Binary {
                    op: ElementwiseOp::Sub,
                    a: 3,
                    b: 1,
                },
                FusedOp::Binary {
                    op: ElementwiseOp::Div,
                    a: 4,
                    b: 1,
                },
            ],
            outputs: vec![5],
            ..Default::default()
        };
        let src = f64_kernel.source();
        for intrinsic in ["__dmul_rn", "__dadd_rn", "__dsub_rn", "__ddiv_rn"] {
            assert!(src.contains(intrinsic), "{intrinsic}: {src}");
        }
        assert!(src.contains("struct __align__(32) cf_v4_f64 { double v[4]; };"));
    }

    #[test]
    fn ill_formed_descriptions_are_refused() {
        let bad = |inputs: Vec<DType>, body: Vec<FusedOp>, outputs: Vec<usize>| {
            FusedKernel {
                inputs,
                body,
                outputs,
                ..Default::default()
            }
            .check()
            .unwrap_err()
        };
        let add = |a, b| FusedOp::Binary {
            op: ElementwiseOp::Add,
            a,
            b,
        };
        assert!(bad(vec![DType::F32], vec![FusedOp::Load(1)], vec![0]).contains("loads input 1"));
        assert!(
            bad(vec![DType::F32], vec![FusedOp::Load(0), add(0, 2)], vec![1])
                .contains("not an earlier value")
        );
        assert!(bad(vec![DType::F32], vec![FusedOp::Neg(0)], vec![0]).contains("not an earlier"));
        assert!(
            bad(
                vec![DType::F32, DType::F64],
                vec![FusedOp::Load(0), FusedOp::Load(1), add(0, 1)],
                vec![2]
            )
            .contains("combines f32 with f64")
        );
        assert!(
            bad(
                vec![DType::Bool],
                vec![FusedOp::Load(0), add(0, 0)],
                vec![1]
            )
            .contains("bool")
        );
        let div = FusedOp::Binary {
            op: ElementwiseOp::Div,
            a: 0,
            b: 0,
        };
        assert!(bad(vec![DType::I32], vec![FusedOp::Load(0), div], vec![1]).contains("division"));
        assert!(
            bad(
                vec![DType::U8],
                vec![FusedOp::Load(0), FusedOp::Neg(0)],
                vec![1]
            )
            .contains("negation")
        );
        assert!(
            bad(
                vec![DType::Bool],
                vec![FusedOp::Load(0), FusedOp::Scale { a: 0, bits: 1 }],
                vec![1]
            )
            .contains("bool")
        );
        let fill = FusedOp::Binary {
            op: ElementwiseOp::Fill,
            a: 0,
            b: 0,
        };
        assert!(
            bad(vec![DType::F32], vec![FusedOp::Load(0), fill], vec![1]).contains("not a binary")
        );
        assert!(
            bad(
                vec![],
                vec![FusedOp::Const {
                    dtype: DType::I8,
                    bits: 0x100
                }],
                vec![0]
            )
            .contains("more bits")
        );
        assert!(bad(vec![DType::F32], vec![FusedOp::Load(0)], vec![1]).contains("output"));
        // Casts serve every pair, and the result has the target type.
        let ok = FusedKernel {
            inputs: vec![DType::Bool],
            body: vec![
                FusedOp::Load(0),
                FusedOp::Cast {
                    a: 0,
                    to: DType::I8,
                },
                FusedOp::Neg(1),
                FusedOp::Const {
                    dtype: DType::I8,
                    bits: 0xff,
                },
                add(2, 3),
            ],
            outputs: vec![4, 0],
            ..Default::default()
        };
        assert_eq!(ok.check(), Ok(()));
        assert_eq!(ok.dtype_of(4), DType::I8);
        assert_eq!(ok.dtype_of(0), DType::Bool);
    }

    #[test]
    fn the_grid_gives_a_thread_per_four_elements_up_to_the_block_limit() {
        assert_eq!(FusedKernel::grid(0), 1);
        assert_eq!(FusedKernel::grid(1), 1);
        assert_eq!(FusedKernel::grid(1024), 1);
        assert_eq!(FusedKernel::grid(1025), 2);
        assert_eq!(FusedKernel::grid(16 << 20), 16384);
        assert_eq!(FusedKernel::grid(u64::MAX), MAX_BLOCKS);
        assert_eq!(FusedKernel::params(&[1, 2], &[3], 4), [1, 2, 3, 4]);
    }

    #[test]
    fn the_emulation_refuses_bad_launches_and_writes_nothing() {
        let kernel = axpy();
        let emulation = FusedEmulation::new(kernel.clone());
        assert_eq!(emulation.name(), kernel.name());
        let mut memory = Blocks::default();
        let x = memory.alloc(1.0f32.to_le_bytes().repeat(4));
        let y = memory.alloc(0.5f32.to_le_bytes().repeat(4));
        let out = memory.alloc(vec![0; 16]);
        let error = emulation.run(&mut memory, &[out, x, y]).unwrap_err();
        assert!(error.contains("3 parameters, not 4"), "{error}");
        let error = emulation
            .run(&mut memory, &FusedKernel::params(&[out], &[x, y], 5))
            .unwrap_err();
        assert!(error.contains("reads unmapped"), "{error}");
        let error = emulation
            .run(&mut memory, &FusedKernel::params(&[out + 4], &[x, y], 4))
            .unwrap_err();
        assert!(error.contains("writes unmapped"), "{error}");
        assert_eq!(memory.get(out), [0; 16], "failed runs write nothing");
        emulation
            .run(&mut memory, &FusedKernel::params(&[out], &[x, y], 4))
            .unwrap();
        assert_eq!(memory.get(out), 2.5f32.to_le_bytes().repeat(4));
        let malformed = FusedEmulation::new(FusedKernel {
            inputs: vec![],
            body: vec![FusedOp::Load(0)],
            outputs: vec![0],
            ..Default::default()
        });
        let error = malformed.run(&mut memory, &[out, 1]).unwrap_err();
        assert!(error.contains("malformed"), "{error}");
    }
}
