//! Checks of the generated CUDA source that need no GPU.
//!
//! - The source of every built-in kernel is compiled for the *host* with the system C++
//!   compiler (CUDA's qualifiers defined away, one thread covering the whole grid-stride loop)
//!   and run on random bit patterns; its output must match the simulator's Rust emulation bit
//!   for bit (NaNs compared as NaNs). This cross-checks two independent implementations of the
//!   documented semantics, including the hand-written `f16`/`bf16` conversions, in CI.
//! - An ignored test compiles every kernel with NVRTC (which needs no device, only the
//!   library) to catch anything the host compiler accepts but NVRTC does not.

use super::emulate;
use super::source::{kernel_name, module_source};
use super::spec::{ElementwiseOp, ElementwiseSpec};
use crate::dtype::DType;
use std::io::Write;
use std::process::{Command, Stdio};

const OPS: [ElementwiseOp; 7] = [
    ElementwiseOp::Add,
    ElementwiseOp::Sub,
    ElementwiseOp::Mul,
    ElementwiseOp::Div,
    ElementwiseOp::Neg,
    ElementwiseOp::Scale,
    ElementwiseOp::Fill,
];

/// Every kernel the crate can build.
fn all_specs() -> Vec<ElementwiseSpec> {
    let mut specs = Vec::new();
    for d in DType::ALL {
        for op in OPS {
            if super::unsupported(op, d).is_none() {
                specs.push(ElementwiseSpec {
                    op,
                    input: d,
                    output: d,
                    broadcast: 0,
                });
            }
        }
        for to in DType::ALL {
            specs.push(ElementwiseSpec {
                op: ElementwiseOp::Cast,
                input: d,
                output: to,
                broadcast: 0,
            });
        }
    }
    specs
}

const HOST_STUBS: &str = r#"
#include <cstdio>
#include <cstdlib>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
struct CfDim3 { unsigned long long x; };
static const CfDim3 blockIdx = {0}, threadIdx = {0}, blockDim = {1}, gridDim = {1};
static bool read_all(void* p, size_t n) { return n == 0 || fread(p, 1, n, stdin) == n; }
"#;

struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// Random bytes for `len` elements of `d`: raw bit patterns for most, "ordinary" values for
/// some, 0/1 for `bool` (a `DeviceTensor<bool>` the crate makes holds only those).
fn random_operand(rng: &mut Xorshift, d: DType, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len * d.size_bytes());
    for i in 0..len {
        let bits = rng.next();
        if d == DType::Bool {
            out.push(u8::from(!bits.is_multiple_of(3)));
            continue;
        }
        let ordinary = i % 3 == 0;
        let bytes: Vec<u8> = match d {
            DType::F32 if ordinary => ((bits % 2001) as f32 / 8.0 - 125.0).to_le_bytes().to_vec(),
            DType::F64 if ordinary => ((bits % 2001) as f64 / 8.0 - 125.0).to_le_bytes().to_vec(),
            DType::F16 if ordinary => half::f16::from_f32((bits % 2001) as f32 / 8.0 - 125.0)
                .to_le_bytes()
                .to_vec(),
            DType::BF16 if ordinary => half::bf16::from_f32((bits % 2001) as f32 / 8.0 - 125.0)
                .to_le_bytes()
                .to_vec(),
            _ => bits.to_le_bytes()[..d.size_bytes()].to_vec(),
        };
        out.extend_from_slice(&bytes);
    }
    out
}

/// Compiles the generated C++ `src` for the host as `dir/name` with `flags`, and returns the
/// executable's path; `what` names the source in the failure (`"fused "`, or empty).
fn compile_for_host(
    dir: &std::path::Path,
    name: &str,
    src: &str,
    flags: &[&str],
    what: &str,
) -> std::path::PathBuf {
    let cpp = dir.join(format!("{name}.cpp"));
    let exe = dir.join(name);
    std::fs::write(&cpp, src).unwrap();
    let compiled = Command::new("c++")
        .args(flags)
        .arg("-o")
        .arg(&exe)
        .arg(&cpp)
        .output()
        .expect("a host C++ compiler (`c++`) is needed to check the kernel source");
    assert!(
        compiled.status.success(),
        "the generated {what}source does not compile for the host:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    exe
}

/// Runs the host-compiled kernels at `exe`, feeding them `input` on standard input (from a
/// thread of its own, so a large input cannot fill the pipe while their output does), and
/// returns what they wrote once they exited successfully.
fn run_host_kernels(exe: &std::path::Path, input: Vec<u8>) -> Vec<u8> {
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(
        output.status.success(),
        "host kernels exited with {}",
        output.status
    );
    output.stdout
}

fn same_bits(d: DType, got: &[u8], want: &[u8]) -> bool {
    let nan = |b: &[u8]| match d {
        DType::F32 => f32::from_le_bytes(b.try_into().unwrap()).is_nan(),
        DType::F64 => f64::from_le_bytes(b.try_into().unwrap()).is_nan(),
        DType::F16 => half::f16::from_le_bytes(b.try_into().unwrap()).is_nan(),
        DType::BF16 => half::bf16::from_le_bytes(b.try_into().unwrap()).is_nan(),
        _ => false,
    };
    got == want || (nan(got) && nan(want))
}

#[test]
fn generated_cuda_source_compiled_for_the_host_matches_the_emulation() {
    let specs = all_specs();
    let dir = std::env::temp_dir().join(format!("cuferry-host-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut src = String::from(HOST_STUBS);
    for (i, &spec) in specs.iter().enumerate() {
        src.push_str(&format!("namespace k{i} {{\n{}\n}}\n", module_source(spec)));
    }
    // Typed trampolines: each kernel takes its own pointer types.
    for (i, &spec) in specs.iter().enumerate() {
        src.push_str(&format!(
            "static void call_{i}(void* o, const void* a, const void* b, unsigned long long s, unsigned long long n) {{ k{i}::{name}(({o}*)o, (const {a}*)a, (const {a}*)b, s, n); }}\n",
            name = kernel_name(spec),
            o = super::source::storage_name(spec.output),
            a = super::source::storage_name(spec.input),
        ));
    }
    src.push_str("int main() {\n");
    for (i, &spec) in specs.iter().enumerate() {
        let (isz, osz) = (spec.input.size_bytes(), spec.output.size_bytes());
        src.push_str(&format!(
            "  {{ unsigned long long n, s; if (!read_all(&n, 8) || !read_all(&s, 8)) return 2;\n    std::vector<unsigned char> a(n * {isz} + 8), b(n * {isz} + 8), o(n * {osz} + 8);\n    if (!read_all(a.data(), n * {isz}) || !read_all(b.data(), n * {isz})) return 3;\n    call_{i}(o.data(), a.data(), b.data(), s, n);\n    fwrite(o.data(), 1, n * {osz}, stdout); }}\n"
        ));
    }
    src.push_str("  return 0;\n}\n");

    let exe = compile_for_host(
        &dir,
        "kernels",
        &src,
        &["-O0", "-ffp-contract=off", "-w"],
        "",
    );

    let mut rng = Xorshift(0x1234_5678_9abc_def1);
    let mut input = Vec::new();
    let mut expected = Vec::new();
    for &spec in &specs {
        let len = 97usize;
        let scalar_bytes = random_operand(&mut rng, spec.input, 1);
        let mut scalar = [0u8; 8];
        scalar[..scalar_bytes.len()].copy_from_slice(&scalar_bytes);
        let scalar = u64::from_le_bytes(scalar);
        let a = random_operand(&mut rng, spec.input, len);
        let b = random_operand(&mut rng, spec.input, len);
        input.extend_from_slice(&(len as u64).to_le_bytes());
        input.extend_from_slice(&scalar.to_le_bytes());
        input.extend_from_slice(&a);
        input.extend_from_slice(&b);
        let reads_b = matches!(
            spec.op,
            ElementwiseOp::Add | ElementwiseOp::Sub | ElementwiseOp::Mul | ElementwiseOp::Div
        );
        let want = emulate::run(spec, &a, if reads_b { &b } else { &[] }, scalar, len)
            .expect("every spec is emulated");
        expected.push((spec, len, want));
    }
    let stdout = run_host_kernels(&exe, input);

    let mut at = 0;
    let mut failures = Vec::new();
    for (spec, len, want) in expected {
        let osz = spec.output.size_bytes();
        let got = &stdout[at..at + len * osz];
        at += len * osz;
        for i in 0..len {
            let (g, w) = (&got[i * osz..(i + 1) * osz], &want[i * osz..(i + 1) * osz]);
            if !same_bits(spec.output, g, w) {
                failures.push(format!(
                    "{spec:?} element {i}: CUDA source {g:02x?}, emulation {w:02x?}"
                ));
                break;
            }
        }
    }
    assert_eq!(at, stdout.len());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} kernel(s) differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Broadcasting binary kernels: every binary operation and element type it serves, over
/// collapsed layouts of rank 1 to 3 (operand `b` broadcast, `a` broadcast, and both), compiled
/// for the host and run on random operands; the output must match the emulation's.
#[test]
fn broadcasting_cuda_source_compiled_for_the_host_matches_the_emulation() {
    use super::emulate::ElementwiseEmulation;
    use super::spec::{Broadcast, ElementwiseArgs};
    use crate::driver::launch::{DeviceMemory, Emulation};
    let layouts: [(&[usize], &[usize]); 4] = [
        (&[5, 3], &[3]),
        (&[4, 1], &[4, 6]),
        (&[3, 1], &[1, 5]),
        (&[2, 1, 3, 1], &[1, 4, 1, 2]),
    ];
    let mut cases = Vec::new();
    for d in DType::ALL {
        for op in [
            ElementwiseOp::Add,
            ElementwiseOp::Sub,
            ElementwiseOp::Mul,
            ElementwiseOp::Div,
        ] {
            if super::unsupported(op, d).is_some() {
                continue;
            }
            for (sa, sb) in layouts {
                let layout = Broadcast::of(sa, sb).unwrap();
                let spec = ElementwiseSpec {
                    op,
                    input: d,
                    output: d,
                    broadcast: layout.dims.len() as u8,
                };
                cases.push((spec, sa, sb, layout));
            }
        }
    }
    let dir = std::env::temp_dir().join(format!("cuferry-bcast-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut src = String::from(HOST_STUBS);
    // One module per spec (its kernel is `extern "C"`), called with each layout of its rank.
    let mut modules: Vec<ElementwiseSpec> = Vec::new();
    for (i, (spec, _, _, layout)) in cases.iter().enumerate() {
        let m = match modules.iter().position(|s| s == spec) {
            Some(m) => m,
            None => {
                src.push_str(&format!(
                    "namespace m{} {{\n{}\n}}\n",
                    modules.len(),
                    module_source(*spec)
                ));
                modules.push(*spec);
                modules.len() - 1
            }
        };
        let extra: String = layout
            .params()
            .iter()
            .map(|p| format!(", {p}ull"))
            .collect();
        src.push_str(&format!(
            "static void call_{i}(void* o, const void* a, const void* b, unsigned long long n) {{ m{m}::{name}(({t}*)o, (const {t}*)a, (const {t}*)b, 0, n{extra}); }}\n",
            name = kernel_name(*spec),
            t = super::source::storage_name(spec.input),
        ));
    }
    src.push_str("int main() {\n");
    for (i, (spec, sa, sb, layout)) in cases.iter().enumerate() {
        let size = spec.input.size_bytes();
        let (la, lb): (usize, usize) = (sa.iter().product(), sb.iter().product());
        let n: usize = layout.shape.iter().product();
        src.push_str(&format!(
            "  {{ std::vector<unsigned char> a({la} * {size} + 8), b({lb} * {size} + 8), o({n} * {size} + 8);\n    if (!read_all(a.data(), {la} * {size}) || !read_all(b.data(), {lb} * {size})) return 3;\n    call_{i}(o.data(), a.data(), b.data(), {n});\n    fwrite(o.data(), 1, {n} * {size}, stdout); }}\n"
        ));
    }
    src.push_str("  return 0;\n}\n");
    let exe = compile_for_host(
        &dir,
        "bcast",
        &src,
        &["-O0", "-ffp-contract=off", "-w"],
        "broadcasting ",
    );

    /// Three allocations, `a`, `b` and the output, at fixed addresses.
    struct Blocks(Vec<(u64, Vec<u8>)>);
    impl DeviceMemory for Blocks {
        fn read(&mut self, ptr: u64, bytes: usize) -> Option<Vec<u8>> {
            let (base, data) = self.0.iter().find(|(b, _)| *b == ptr)?;
            let off = usize::try_from(ptr - base).ok()?;
            data.get(off..off + bytes).map(<[u8]>::to_vec)
        }
        fn write(&mut self, ptr: u64, data: &[u8]) -> bool {
            match self.0.iter_mut().find(|(b, _)| *b == ptr) {
                Some((_, out)) if out.len() == data.len() => {
                    out.copy_from_slice(data);
                    true
                }
                _ => false,
            }
        }
    }
    let mut rng = Xorshift(0x0bad_cafe_f00d_0001);
    let mut input = Vec::new();
    let mut expected = Vec::new();
    for (spec, sa, sb, layout) in &cases {
        let (la, lb): (usize, usize) = (sa.iter().product(), sb.iter().product());
        let n: usize = layout.shape.iter().product();
        let a = random_operand(&mut rng, spec.input, la);
        let b = random_operand(&mut rng, spec.input, lb);
        input.extend_from_slice(&a);
        input.extend_from_slice(&b);
        let mut memory = Blocks(vec![
            (0x1000, a),
            (0x10_0000, b),
            (0x20_0000, vec![0; n * spec.input.size_bytes()]),
        ]);
        let args = ElementwiseArgs {
            out: 0x20_0000,
            a: 0x1000,
            b: 0x10_0000,
            scalar: 0,
            len: n as u64,
        };
        let mut params = args.params().to_vec();
        params.extend(layout.params());
        ElementwiseEmulation::new(*spec)
            .run(&mut memory, &params)
            .unwrap();
        expected.push((*spec, n, memory.0.pop().unwrap().1));
    }
    let stdout = run_host_kernels(&exe, input);
    let mut at = 0;
    let mut failures = Vec::new();
    for (spec, n, want) in expected {
        let size = spec.input.size_bytes();
        let got = &stdout[at..at + n * size];
        at += n * size;
        if let Some(i) = (0..n).find(|&i| {
            !same_bits(
                spec.input,
                &got[i * size..(i + 1) * size],
                &want[i * size..(i + 1) * size],
            )
        }) {
            failures.push(format!("{spec:?} element {i}"));
        }
    }
    assert_eq!(at, stdout.len());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} kernel(s) differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Compiles every kernel with NVRTC. Needs the NVRTC library on the loader path (no GPU).
#[test]
#[ignore = "needs NVRTC (libnvrtc) on the library path"]
fn every_kernel_compiles_with_nvrtc() {
    assert!(
        crate::driver::cuda::nvrtc_present(),
        "NVRTC could not be loaded"
    );
    let broadcasting = all_specs()
        .into_iter()
        .filter(|s| s.op.reads_b())
        .flat_map(|s| (1..=3).map(move |broadcast| ElementwiseSpec { broadcast, ..s }));
    for spec in all_specs().into_iter().chain(broadcasting) {
        if let Err(e) = crate::driver::cuda::compile_check("kernel", &module_source(spec)) {
            panic!("{spec:?} does not compile: {e}");
        }
    }
}

/// What the host stubs add for the fused kernels: alignment and the `_rn` intrinsics, which on
/// the host are the plain operations (compiled without contraction).
const FUSED_HOST_STUBS: &str = r#"
#define __align__(n) alignas(n)
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static unsigned char* cf_alloc(size_t bytes) { return (unsigned char*)std::aligned_alloc(64, (bytes + 64) / 64 * 64 + 64); }
"#;

/// Random fused kernels for every element type, their source compiled for the host and run on
/// random inputs, both with every pointer aligned (vector path and scalar tail) and with every
/// pointer one element off (scalar path only): the outputs must match the fused emulation.
/// Some read inputs through a broadcast (a row, a column, a scalar of a `[3, 13]` index space).
#[test]
fn fused_cuda_source_compiled_for_the_host_matches_the_emulation() {
    use super::fused::FusedKernel;
    use super::fused::tests::{
        Rng, emulated, random_broadcast_kernel, random_input, random_kernel,
    };
    let mut rng = Rng(0x5eed_f00d_1234_5678);
    let mut kernels: Vec<FusedKernel> = DType::ALL
        .iter()
        .flat_map(|&d| {
            (0..12)
                .map(|_| random_kernel(&mut rng, d))
                .collect::<Vec<_>>()
        })
        .collect();
    let plain = kernels.len();
    for &d in &DType::ALL {
        for _ in 0..6 {
            kernels.push(random_broadcast_kernel(&mut rng, d).0);
        }
    }
    // Every broadcast kernel's index space is `[3, 13]`: 39 elements.
    let length = |k: usize| if k < plain { 37usize } else { 39 };
    let dir = std::env::temp_dir().join(format!("cuferry-fused-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut src = String::from(HOST_STUBS);
    src.push_str(FUSED_HOST_STUBS);
    for (i, kernel) in kernels.iter().enumerate() {
        src.push_str(&format!("namespace k{i} {{\n{}\n}}\n", kernel.source()));
    }
    src.push_str("int main() {\n");
    for (i, kernel) in kernels.iter().enumerate() {
        let out_types: Vec<DType> = kernel.outputs.iter().map(|&v| kernel.dtype_of(v)).collect();
        let mut args = Vec::new();
        src.push_str("  {\n    unsigned long long n, off; if (!read_all(&n, 8) || !read_all(&off, 8)) return 2;\n");
        for (m, d) in out_types.iter().enumerate() {
            src.push_str(&format!(
                "    unsigned char* o{m} = cf_alloc(n * {s}) + off * {s};\n",
                s = d.size_bytes()
            ));
            args.push(format!("({}*)o{m}", super::source::storage_name(*d)));
        }
        for (n, d) in kernel.inputs.iter().enumerate() {
            src.push_str(&format!(
                "    unsigned char* i{n} = cf_alloc(n * {s}) + off * {s}; if (!read_all(i{n}, n * {s})) return 3;\n",
                s = d.size_bytes()
            ));
            args.push(format!("(const {}*)i{n}", super::source::storage_name(*d)));
        }
        args.push("n".into());
        src.push_str(&format!(
            "    k{i}::{}({});\n",
            kernel.name(),
            args.join(", ")
        ));
        for (m, d) in out_types.iter().enumerate() {
            src.push_str(&format!(
                "    fwrite(o{m}, 1, n * {}, stdout);\n",
                d.size_bytes()
            ));
        }
        src.push_str("  }\n");
    }
    src.push_str("  return 0;\n}\n");
    let exe = compile_for_host(
        &dir,
        "fused",
        &src,
        &["-std=c++17", "-O1", "-ffp-contract=off", "-w"],
        "fused ",
    );

    let mut failures = Vec::new();
    for offset in [0u64, 1] {
        let mut input = Vec::new();
        let mut expected = Vec::new();
        for (k, kernel) in kernels.iter().enumerate() {
            let len = length(k);
            let inputs: Vec<Vec<u8>> = kernel
                .inputs
                .iter()
                .map(|&d| random_input(&mut rng, d, len))
                .collect();
            input.extend_from_slice(&(len as u64).to_le_bytes());
            input.extend_from_slice(&offset.to_le_bytes());
            for i in &inputs {
                input.extend_from_slice(i);
            }
            expected.push(emulated(kernel, &inputs, len));
        }
        let stdout = run_host_kernels(&exe, input);
        let mut at = 0;
        for (kernel, want) in kernels.iter().zip(expected) {
            for (&v, want) in kernel.outputs.iter().zip(want) {
                let d = kernel.dtype_of(v);
                let size = d.size_bytes();
                let got = &stdout[at..at + want.len()];
                at += want.len();
                let differs = (0..want.len() / size).find(|&i| {
                    !same_bits(
                        d,
                        &got[i * size..(i + 1) * size],
                        &want[i * size..(i + 1) * size],
                    )
                });
                if let Some(i) = differs {
                    failures.push(format!(
                        "{} (offset {offset}) value {v} element {i}: CUDA source {:02x?}, emulation {:02x?}\n{kernel:?}",
                        kernel.name(),
                        &got[i * size..(i + 1) * size],
                        &want[i * size..(i + 1) * size]
                    ));
                }
            }
        }
        assert_eq!(at, stdout.len());
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} output(s) differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Compiles fused kernels of every element type with NVRTC, as the engine does. Needs the NVRTC
/// library on the loader path (no GPU).
#[test]
#[ignore = "needs NVRTC (libnvrtc) on the library path"]
fn fused_kernels_compile_with_nvrtc() {
    use super::fused::tests::{Rng, random_kernel};
    assert!(
        crate::driver::cuda::nvrtc_present(),
        "NVRTC could not be loaded"
    );
    let mut rng = Rng(0xfeed_beef);
    for d in DType::ALL {
        for _ in 0..8 {
            let kernel = random_kernel(&mut rng, d);
            if let Err(e) = crate::driver::cuda::compile_check("fused", &kernel.source()) {
                panic!("{kernel:?} does not compile: {e}\n{}", kernel.source());
            }
        }
    }
}

/// The strided gathers: every element size at every rank from 0 to one past
/// [`MAX_RANK`](super::gather::MAX_RANK) (a misaligned base adds a dimension), over random layouts
/// with zero and negative strides, compiled for the host and run on random bytes; the output must
/// match the emulation's. Each kernel runs twice, as generated (its 32-bit index math) and with
/// the 32-bit path's bound set to 0 (its 64-bit index math).
#[test]
fn gather_cuda_source_compiled_for_the_host_matches_the_emulation() {
    use super::gather::{GatherDim, GatherEmulation, GatherKernel, MAX_RANK};
    use crate::driver::launch::{DeviceMemory, Emulation};

    /// One case: the kernel, its layout, and where the view starts in its source buffer.
    struct Case {
        kernel: GatherKernel,
        dims: Vec<GatherDim>,
        /// Elements before `src` in the buffer.
        pad: usize,
        /// The buffer's length in elements.
        buffer: usize,
        offset: i64,
        len: usize,
    }
    let mut rng = Xorshift(0x9a7e_5eed_0bad_f00d);
    let mut cases = Vec::new();
    for size in [1u8, 2, 4, 8] {
        for rank in 0..=MAX_RANK + 1 {
            let top = if rank <= 4 { 4 } else { 3 };
            let dims: Vec<GatherDim> = (0..rank)
                .map(|_| GatherDim {
                    extent: 2 + rng.next() % (top - 1),
                    stride: (rng.next() % 9) as i64 - 4,
                })
                .collect();
            let (mut lo, mut hi) = (0i64, 0i64);
            for d in &dims {
                let reach = (d.extent as i64 - 1) * d.stride;
                if reach < 0 {
                    lo += reach;
                } else {
                    hi += reach;
                }
            }
            let pad = (rng.next() % 3) as usize;
            let shift = (rng.next() % (pad as u64 + 1)) as i64;
            let buffer = (hi - lo + 1) as usize + pad;
            cases.push(Case {
                kernel: GatherKernel {
                    size,
                    rank: rank as u8,
                },
                len: dims.iter().map(|d| d.extent as usize).product(),
                offset: -lo - pad as i64 + shift,
                dims,
                pad,
                buffer,
            });
        }
    }
    let dir = std::env::temp_dir().join(format!("cuferry-gather-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut src = String::from(HOST_STUBS);
    for (i, case) in cases.iter().enumerate() {
        let source = case.kernel.source();
        // `extern "C"`: one symbol per name, so the second copy is renamed.
        let name = case.kernel.name();
        let wide = source
            .replace("n <= 0xffffffffull", "n <= 0ull")
            .replace(&name, &format!("{name}_wide"));
        assert!(
            !wide.contains("0xffffffffull"),
            "the 32-bit path's bound is where the check expects it"
        );
        src.push_str(&format!(
            "namespace n{i} {{\n{source}\n}}\nnamespace w{i} {{\n{wide}\n}}\n"
        ));
    }
    src.push_str("int main() {\n");
    for (i, case) in cases.iter().enumerate() {
        let size = usize::from(case.kernel.size);
        let t = match size {
            1 => "unsigned char",
            2 => "unsigned short",
            4 => "unsigned int",
            _ => "unsigned long long",
        };
        let layout: String = case
            .dims
            .iter()
            .map(|d| format!(", {}ull, {}ll", d.extent, d.stride))
            .collect();
        let (len, buffer, pad, offset) = (case.len, case.buffer, case.pad, case.offset);
        src.push_str(&format!(
            "  {{ std::vector<{t}> buf({buffer} + 1), o({len} + 1);\n    if (!read_all(buf.data(), {buffer} * {size})) return 3;\n    n{i}::{name}(o.data(), buf.data() + {pad}, {len}ull, {offset}ll{layout});\n    fwrite(o.data(), 1, {len} * {size}, stdout);\n    w{i}::{name}_wide(o.data(), buf.data() + {pad}, {len}ull, {offset}ll{layout});\n    fwrite(o.data(), 1, {len} * {size}, stdout); }}\n",
            name = case.kernel.name(),
        ));
    }
    src.push_str("  return 0;\n}\n");
    let exe = compile_for_host(&dir, "gather", &src, &["-O1", "-w"], "gather ");

    /// Allocations at fixed addresses; a range is read or written inside one of them.
    struct Blocks(Vec<(u64, Vec<u8>)>);
    impl DeviceMemory for Blocks {
        fn read(&mut self, ptr: u64, bytes: usize) -> Option<Vec<u8>> {
            self.0.iter().find_map(|(base, data)| {
                let off = usize::try_from(ptr.checked_sub(*base)?).ok()?;
                data.get(off..off.checked_add(bytes)?).map(<[u8]>::to_vec)
            })
        }
        fn write(&mut self, ptr: u64, data: &[u8]) -> bool {
            for (base, block) in &mut self.0 {
                let Some(off) = ptr.checked_sub(*base) else {
                    continue;
                };
                if let Some(out) = block.get_mut(off as usize..off as usize + data.len()) {
                    out.copy_from_slice(data);
                    return true;
                }
            }
            false
        }
    }
    let mut input = Vec::new();
    let mut expected = Vec::new();
    for case in &cases {
        let size = usize::from(case.kernel.size);
        let bytes: Vec<u8> = (0..case.buffer * size).map(|_| rng.next() as u8).collect();
        input.extend_from_slice(&bytes);
        let (source, out) = (0x1000u64, 0x1000_0000u64);
        let mut memory = Blocks(vec![(source, bytes), (out, vec![0; case.len * size])]);
        let params = GatherKernel::params(
            out,
            source + (case.pad * size) as u64,
            case.len as u64,
            case.offset,
            &case.dims,
        );
        GatherEmulation::new(case.kernel)
            .run(&mut memory, &params)
            .unwrap();
        expected.push(memory.0.pop().unwrap().1);
    }
    let stdout = run_host_kernels(&exe, input);
    let mut at = 0;
    let mut failures = Vec::new();
    for (case, want) in cases.iter().zip(expected) {
        for path in ["32-bit", "64-bit"] {
            let got = &stdout[at..at + want.len()];
            at += want.len();
            if got != want {
                failures.push(format!(
                    "{} ({path} index math) over {:?} from {}",
                    case.kernel.name(),
                    case.dims,
                    case.offset
                ));
            }
        }
    }
    assert_eq!(at, stdout.len());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} gather(s) differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Compiles the strided gathers of every element size and rank with NVRTC, as the engine does.
/// Needs the NVRTC library on the loader path (no GPU).
#[test]
#[ignore = "needs NVRTC (libnvrtc) on the library path"]
fn gather_kernels_compile_with_nvrtc() {
    use super::gather::{GatherKernel, MAX_RANK};
    assert!(
        crate::driver::cuda::nvrtc_present(),
        "NVRTC could not be loaded"
    );
    for size in [1u8, 2, 4, 8] {
        for rank in 0..=MAX_RANK as u8 + 1 {
            let kernel = GatherKernel { size, rank };
            if let Err(e) = crate::driver::cuda::compile_check("gather", &kernel.source()) {
                panic!("{kernel:?} does not compile: {e}\n{}", kernel.source());
            }
        }
    }
}
