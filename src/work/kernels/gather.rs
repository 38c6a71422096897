//! The strided gather: a copy of a strided view of device memory into a new compact tensor.
//!
//! It exists for the interop that takes in tensors it did not lay out: a DLPack tensor may be a
//! transposed, permuted, broadcast (stride 0) or reversed (negative stride) view of its producer's
//! memory, and an import asked for a compact tensor copies that view, on the device, in row-major
//! order. A cast of the same element type would not do (it walks elements in memory order), nor
//! would a device-to-device copy (it copies one contiguous range).
//!
//! The copy moves bytes, so one kernel per element *size* (1, 2, 4 or 8 bytes) serves every
//! element type (`bool`, `f16` and `bf16` included), and per rank of the view's collapsed index
//! space: dimensions of extent 1 are dropped and a dimension is merged into the one outside it
//! where the two walk memory as one (the outer stride is the inner stride times the inner
//! extent), so a contiguous view is a rank-1 kernel and a broadcast of a row a rank-2 one. The
//! kernels are compiled with NVRTC once per engine and kept in the engine's kernel cache under
//! `(size, rank)`, as the broadcasting elementwise kernels are under their rank. Like those, a
//! launch passes the layout as 8-byte parameters, `(out, src, len, offset)` and then
//! `(extent, stride)` per collapsed dimension, outermost first: nothing is written to the device
//! before the launch, so the gather is one kernel launch and no allocation but its output.
//!
//! The device reads an element through a pointer of its size, so `src` must be aligned to it. A
//! view whose base is not (a DLPack byte offset may leave any alignment) is gathered in the
//! widest unit that divides both the element size and the base's alignment, each element being
//! that many units in a row: an innermost dimension the collapse usually merges away.
//!
//! Each kernel walks its index space with a grid stride, decomposing the output index innermost
//! first with 32-bit division when the element count fits in 32 bits (the common case, and much
//! cheaper on the device) and 64-bit division otherwise. On the simulated device each module
//! carries a [`GatherEmulation`] of its kernel, which copies the same elements on the device's
//! own memory when its stream reaches the launch.

// The DLPack import is built on the gather; until it is in place, only the tests reach it.

use super::cache::KernelCache;
use super::spec::{BLOCK, MAX_BLOCKS};
use crate::core::engine::{CudaEngine, State};
use crate::core::order::Use;
#[cfg(any(test, feature = "sim"))]
use crate::driver::launch::{DeviceMemory, Emulation};
use crate::driver::{DevicePtr, Lane};
use crate::dtype::DType;
use crate::error::{Error, Result, UsageError};
use crate::memory::any_tensor::AnyTensor;
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;

/// The highest rank of a view [`CudaEngine::gather_strided`] takes.
pub(crate) const MAX_RANK: usize = 8;

/// One dimension of a gather's collapsed index space: its extent in the output and the source's
/// stride along it, in units of the kernel's element size (negative or zero allowed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GatherDim {
    /// The number of indices along it (at least 2 once collapsed).
    pub(crate) extent: u64,
    /// How far the source address moves per index, in elements of the kernel's size.
    pub(crate) stride: i64,
}

/// A gather kernel: what it copies per element and how many dimensions it walks. It is the
/// kernel's identity (its name and the cache's key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct GatherKernel {
    /// Bytes per element: 1, 2, 4 or 8.
    pub(crate) size: u8,
    /// Dimensions of the collapsed index space; 0 copies one element to every output index.
    pub(crate) rank: u8,
}

/// The C type the kernel moves an element of `size` bytes as.
fn unit_type(size: u8) -> &'static str {
    match size {
        1 => "unsigned char",
        2 => "unsigned short",
        4 => "unsigned int",
        _ => "unsigned long long",
    }
}

impl GatherKernel {
    /// How many 8-byte parameters precede the per-dimension ones: `(out, src, len, offset)`.
    pub(crate) const FIXED_PARAMS: usize = 4;

    /// The kernel's exported name (and its module's).
    pub(crate) fn name(self) -> String {
        format!("cuferry_gather{}_r{}", self.size, self.rank)
    }

    /// The module's complete, self-contained CUDA C++ source.
    ///
    /// The kernel is `(out, src, n, off, d0, s0, d1, s1, ...)`: output element `i` (of `n`) is
    /// `src[off + sum_d c_d * s_d]`, where `c` is `i` decomposed over the extents `d`, outermost
    /// first (`d0` itself is never needed: the outermost coordinate is what is left).
    pub(crate) fn source(self) -> String {
        let rank = usize::from(self.rank);
        let t = unit_type(self.size);
        let params: String = (0..rank)
            .map(|d| format!(", unsigned long long d{d}, long long s{d}"))
            .collect();
        // The body of the grid-stride loop, decomposing `i` in the index type `index`.
        let walk = |index: &str| {
            let mut body =
                format!("            {index} r_ = ({index})i, c_ = 0; long long at = off;\n");
            for d in (1..rank).rev() {
                body.push_str(&format!(
                    "            c_ = r_ % ({index})d{d}; r_ /= ({index})d{d}; at += (long long)c_ * s{d};\n"
                ));
            }
            if rank > 0 {
                body.push_str("            at += (long long)r_ * s0;\n");
            }
            body.push_str("            (void)r_; (void)c_;\n            out[i] = src[at];\n");
            body
        };
        let unused_d0 = if rank > 0 { " (void)d0;" } else { "" };
        format!(
            r#"
extern "C" __global__ void {name}({t}* out, const {t}* src, unsigned long long n, long long off{params}) {{
   {unused_d0}
    unsigned long long first = (unsigned long long)blockIdx.x * (unsigned long long)blockDim.x + (unsigned long long)threadIdx.x;
    unsigned long long step = (unsigned long long)blockDim.x * (unsigned long long)gridDim.x;
    if (n <= 0xffffffffull) {{
        for (unsigned long long i = first; i < n; i += step) {{
{narrow}        }}
    }} else {{
        for (unsigned long long i = first; i < n; i += step) {{
{wide}        }}
    }}
}}
"#,
            name = self.name(),
            narrow = walk("unsigned int"),
            wide = walk("unsigned long long"),
        )
    }

    /// The launch's parameters, in the kernel's order: `(out, src, len, offset)`, then
    /// `(extent, stride)` per dimension of `dims` (as many as the kernel's rank), outermost first.
    /// Signed values travel as their two's complement bits.
    pub(crate) fn params(
        out: DevicePtr,
        src: DevicePtr,
        len: u64,
        offset: i64,
        dims: &[GatherDim],
    ) -> Vec<u64> {
        let mut params = Vec::with_capacity(Self::FIXED_PARAMS + 2 * dims.len());
        params.extend([out, src, len, offset as u64]);
        params.extend(dims.iter().flat_map(|d| [d.extent, d.stride as u64]));
        params
    }

    /// Blocks of [`BLOCK`] threads for `len` elements: one thread per element, up to
    /// [`MAX_BLOCKS`] (the kernel loops over the rest). At least one.
    pub(crate) fn grid(len: u64) -> u32 {
        let blocks = len
            .div_ceil(u64::from(BLOCK))
            .clamp(1, u64::from(MAX_BLOCKS));
        u32::try_from(blocks).unwrap_or(MAX_BLOCKS)
    }
}

/// The view's index space collapsed: dimensions of extent 1 dropped, and each dimension merged
/// into the one outside it when the outer stride is the inner stride times the inner extent (the
/// two then walk memory as one dimension). Outermost first. Every extent must be at least 1.
pub(crate) fn collapse(shape: &[usize], strides: &[i64]) -> Vec<GatherDim> {
    let mut dims: Vec<GatherDim> = Vec::with_capacity(shape.len());
    for (&extent, &stride) in shape.iter().zip(strides) {
        if extent == 1 {
            continue;
        }
        let extent = extent as u64;
        if let Some(outer) = dims.last_mut()
            && i64::try_from(extent)
                .ok()
                .and_then(|e| stride.checked_mul(e))
                == Some(outer.stride)
            && let Some(merged) = outer.extent.checked_mul(extent)
        {
            *outer = GatherDim {
                extent: merged,
                stride,
            };
            continue;
        }
        dims.push(GatherDim { extent, stride });
    }
    dims
}

/// The element offset output element `i` reads under `dims` from `offset`: `i` decomposed over
/// the extents innermost first, the outermost coordinate being the quotient left, exactly as the
/// kernel does (wrapping where it would).
#[cfg(any(test, feature = "sim"))]
pub(crate) fn element_offset(offset: i64, dims: &[GatherDim], i: u64) -> i64 {
    let mut rem = i;
    let mut at = offset;
    for (d, dim) in dims.iter().enumerate().rev() {
        let c = if d == 0 { rem } else { rem % dim.extent };
        rem /= dim.extent;
        at = at.wrapping_add((c as i64).wrapping_mul(dim.stride));
    }
    at
}

/// The host emulation of one gather kernel, registered with the module that holds it.
#[cfg(any(test, feature = "sim"))]
pub(crate) struct GatherEmulation {
    kernel: GatherKernel,
    /// The kernel's name, as the module exports it.
    name: String,
}

#[cfg(any(test, feature = "sim"))]
impl GatherEmulation {
    /// The emulation of `kernel`.
    pub(crate) fn new(kernel: GatherKernel) -> Self {
        GatherEmulation {
            kernel,
            name: kernel.name(),
        }
    }
}

#[cfg(any(test, feature = "sim"))]
impl Emulation for GatherEmulation {
    fn name(&self) -> &str {
        &self.name
    }

    /// Reads the range of source memory the view spans (one read: it lies in one allocation,
    /// as every element does), copies each output element's bytes from it in output order, and
    /// writes the output, as the kernel does with `(out, src, len, offset, extent/stride...)`.
    fn run(&self, memory: &mut dyn DeviceMemory, params: &[u64]) -> Result<(), String> {
        let kernel = self.kernel;
        let rank = usize::from(kernel.rank);
        let expected = GatherKernel::FIXED_PARAMS + 2 * rank;
        let &[out, src, len, offset, ..] = params else {
            return Err(format!(
                "{} launched with {} parameters, not {expected}",
                self.name,
                params.len()
            ));
        };
        if params.len() != expected {
            return Err(format!(
                "{} launched with {} parameters, not {expected}",
                self.name,
                params.len()
            ));
        }
        let offset = offset as i64;
        let dims: Vec<GatherDim> = params[GatherKernel::FIXED_PARAMS..]
            .chunks_exact(2)
            .map(|p| GatherDim {
                extent: p[0],
                stride: p[1] as i64,
            })
            .collect();
        if len == 0 {
            return Ok(());
        }
        let covered = dims
            .iter()
            .try_fold(1u64, |n, d| n.checked_mul(d.extent))
            .filter(|&n| rank == 0 || n == len);
        let Some(_) = covered else {
            return Err(format!(
                "{} launched over {len} elements with the layout {dims:?}",
                self.name
            ));
        };
        let size = i128::from(kernel.size);
        // The lowest and highest element the view reads, relative to `src`.
        let (mut lo, mut hi) = (i128::from(offset), i128::from(offset));
        for d in &dims {
            let reach = i128::from(d.extent - 1) * i128::from(d.stride);
            if reach < 0 {
                lo += reach;
            } else {
                hi += reach;
            }
        }
        let start = i128::from(src) + lo * size;
        let bytes = (hi - lo + 1) * size;
        let (Ok(start), Ok(bytes), Ok(count)) = (
            u64::try_from(start),
            usize::try_from(bytes),
            usize::try_from(len),
        ) else {
            return Err(format!("{} reads outside the address space", self.name));
        };
        let Some(span) = memory.read(start, bytes) else {
            return Err(format!(
                "{} reads unmapped device memory ({start:#x}+{bytes})",
                self.name
            ));
        };
        let unit = usize::from(kernel.size);
        let mut result = Vec::with_capacity(count * unit);
        for i in 0..len {
            // Inside the span by construction: `lo <= at <= hi`.
            let at = (i128::from(element_offset(offset, &dims, i)) - lo) as usize * unit;
            result.extend_from_slice(&span[at..at + unit]);
        }
        if memory.write(out, &result) {
            Ok(())
        } else {
            Err(format!(
                "{} writes unmapped device memory {out:#x}+{}",
                self.name,
                result.len()
            ))
        }
    }
}

/// A new uninitialised tensor of `T` and `shape` on `engine`'s compute lane, as an
/// [`AnyTensor`], with its device address.
fn alloc_typed<T: Element>(
    engine: &mut CudaEngine,
    shape: &[usize],
) -> Result<(AnyTensor, DevicePtr)> {
    let tensor = DeviceTensor::<T>::alloc(engine, shape)?;
    let ptr = tensor.raw_ptr();
    Ok((AnyTensor::from(tensor), ptr))
}

/// A new uninitialised tensor of `dtype` and `shape` on `engine`'s compute lane, with its device
/// address (0 when it has no elements: nothing is allocated then).
fn alloc_any(
    engine: &mut CudaEngine,
    dtype: DType,
    shape: &[usize],
) -> Result<(AnyTensor, DevicePtr)> {
    match dtype {
        DType::F32 => alloc_typed::<f32>(engine, shape),
        DType::F64 => alloc_typed::<f64>(engine, shape),
        DType::F16 => alloc_typed::<half::f16>(engine, shape),
        DType::BF16 => alloc_typed::<half::bf16>(engine, shape),
        DType::I8 => alloc_typed::<i8>(engine, shape),
        DType::I16 => alloc_typed::<i16>(engine, shape),
        DType::I32 => alloc_typed::<i32>(engine, shape),
        DType::I64 => alloc_typed::<i64>(engine, shape),
        DType::U8 => alloc_typed::<u8>(engine, shape),
        DType::U16 => alloc_typed::<u16>(engine, shape),
        DType::U32 => alloc_typed::<u32>(engine, shape),
        DType::U64 => alloc_typed::<u64>(engine, shape),
        DType::Bool => alloc_typed::<bool>(engine, shape),
    }
}

/// The refusal of a stride or offset whose byte distance does not fit in 64 bits.
fn too_far(value: i64) -> Error {
    Error::Usage(UsageError::ExceedsLimit {
        operation: "gather_strided",
        what: "stride or offset",
        value: usize::try_from(value.unsigned_abs()).unwrap_or(usize::MAX),
        limit: usize::try_from(i64::MAX).unwrap_or(usize::MAX),
    })
}

impl CudaEngine {
    /// Queues, on the compute lane, a copy of the strided view of `dtype` elements at `base` into
    /// a new compact (row-major) tensor of `shape`: element `i` (row-major multi-index `idx`) is
    /// read at `base + (offset + sum_d idx[d] * strides[d]) * dtype.size_bytes()`. Strides are in
    /// elements and may be zero or negative; the caller has checked that every element read lies
    /// inside the allocation. `source` is the allocation's base address for the engine's lane
    /// order (`Use::Read(source)`): the copy follows earlier writes of it on any lane, and later
    /// writes of it follow the copy.
    ///
    /// A zero-element shape allocates nothing and queues nothing. The copy moves bytes, so every
    /// element type is served (`bool` included: its bytes are copied as they are).
    ///
    /// # Errors
    /// [`UsageError::ExceedsLimit`] when `shape` has more than [`MAX_RANK`] dimensions (or a
    /// stride or offset is past 64 bits in bytes); [`UsageError::LengthMismatch`] when `strides`
    /// has not one entry per dimension; [`UsageError::ShapeOverflow`] or
    /// [`UsageError::SizeOverflow`] when the shape is too large;
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when NVRTC is missing,
    /// [`LibraryError::Compile`](crate::error::LibraryError::Compile) or [`Error::Driver`] when
    /// the kernel cannot be built, the output allocated or the launch queued. No copy is queued on
    /// any error (an output already allocated is freed).
    ///
    /// # Safety
    /// Every address read lies in live device memory the engine's driver reaches, which stays
    /// live until the copy completes (the caller orders its release after the compute lane).
    pub(crate) unsafe fn gather_strided(
        &mut self,
        source: DevicePtr,
        base: DevicePtr,
        dtype: DType,
        shape: &[usize],
        strides: &[i64],
        offset: i64,
    ) -> Result<AnyTensor> {
        if shape.len() > MAX_RANK {
            return Err(Error::Usage(UsageError::ExceedsLimit {
                operation: "gather_strided",
                what: "rank",
                value: shape.len(),
                limit: MAX_RANK,
            }));
        }
        if strides.len() != shape.len() {
            return Err(Error::Usage(UsageError::LengthMismatch {
                what: "gather_strided: strides, one per dimension of the shape",
                expected: shape.len(),
                found: strides.len(),
                shape: Some(shape.to_vec()),
            }));
        }
        // The widest unit that divides both the element size and the base's alignment: the
        // element size itself unless the base is misaligned, when each element is `ratio` units
        // in a row (an innermost dimension of stride 1).
        let size = dtype.size_bytes() as u64;
        let unit = [8u64, 4, 2, 1]
            .into_iter()
            .find(|&u| size.is_multiple_of(u) && base.is_multiple_of(u))
            .unwrap_or(1);
        let ratio = (size / unit) as i64;
        let mut unit_shape = shape.to_vec();
        let mut unit_strides = Vec::with_capacity(strides.len() + 1);
        for &stride in strides {
            unit_strides.push(stride.checked_mul(ratio).ok_or_else(|| too_far(stride))?);
        }
        let unit_offset = offset.checked_mul(ratio).ok_or_else(|| too_far(offset))?;
        if ratio > 1 {
            unit_shape.push(ratio as usize);
            unit_strides.push(1);
        }
        // Allocated (and its shape checked) before the kernel is built; dropped (freed, ordered)
        // when anything after fails.
        let (out, out_ptr) = alloc_any(self, dtype, shape)?;
        if out.is_empty() {
            return Ok(out);
        }
        let dims = collapse(&unit_shape, &unit_strides);
        let kernel = GatherKernel {
            size: unit as u8,
            rank: dims.len() as u8,
        };
        // The kernel's index space counts units: `ratio` per element.
        let len = out.len() as u64 * ratio as u64;
        let params = GatherKernel::params(out_ptr, base, len, unit_offset, &dims);
        let mut st = self.enter()?;
        let st: &mut State = &mut st;
        let function = st
            .parts
            .get_mut::<KernelCache>()
            .gather(st.driver.as_mut(), kernel)?;
        st.queue(
            Lane::Compute,
            &[Use::Read(source), Use::Write(out_ptr)],
            |driver| {
                // SAFETY: `function` is the cached kernel compiled for `kernel` (still loaded: the
                // cache unloads only at teardown), whose signature is the four fixed 8-byte
                // parameters plus two per dimension of `dims` (its rank), as `params` packs them;
                // the grid is between 1 and `MAX_BLOCKS` blocks of `BLOCK` threads. It writes
                // `len` units of `unit` bytes into `out`, fresh (so no other work touches it) and
                // of exactly that many bytes (its elements times `ratio` units each), which is
                // what the collapsed index space covers (the extents of `dims` multiply to
                // `len`, the dropped ones being 1); it reads, through `base` aligned to `unit`,
                // exactly the elements of the view, which the caller guarantees lie in live memory
                // the driver reaches until the copy completes; `out` is returned, so its free is
                // queued after the launch.
                unsafe { driver.launch(function, GatherKernel::grid(len), BLOCK, &params) }
                    .map_err(Error::driver("cuLaunchKernel"))
            },
        )?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimOp;

    /// A tensor of `data`, copied in on the upload lane and proven by a synchronize (the routes
    /// level does this for users; a level below it may not name the routes).
    fn upload_tensor<T: Element>(
        engine: &mut CudaEngine,
        data: &[T],
        shape: &[usize],
    ) -> Result<DeviceTensor<T>> {
        let tensor = DeviceTensor::<T>::alloc_on(engine, Lane::Upload, shape)?;
        // SAFETY: `data` stays borrowed, unchanged, until the synchronize below proves the copy
        // complete; the tensor holds its bytes.
        unsafe { queue_copy(engine, true, &tensor, data.as_ptr().cast_mut().cast()) }?;
        engine.synchronize()?;
        Ok(tensor)
    }

    /// The tensor's elements, copied out on the download lane and proven by a synchronize.
    fn download_tensor<T: Element>(
        engine: &mut CudaEngine,
        tensor: &DeviceTensor<T>,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); tensor.len()];
        // SAFETY: `out` is written only by the copy, which the synchronize below proves complete
        // before `out` is read; it holds the tensor's bytes.
        unsafe { queue_copy(engine, false, tensor, out.as_mut_ptr().cast()) }?;
        engine.synchronize()?;
        Ok(out)
    }

    /// Queues a copy of all of `tensor`'s bytes to or from `host`.
    ///
    /// # Safety
    /// As `State::queue_host_copy`: `host` holds the tensor's bytes and stays valid, untouched
    /// by the host, until the copy completes.
    unsafe fn queue_copy<T: Element>(
        engine: &mut CudaEngine,
        upload: bool,
        tensor: &DeviceTensor<T>,
        host: *mut u8,
    ) -> Result<()> {
        if tensor.is_empty() {
            return Ok(());
        }
        let ptr = tensor.raw_ptr();
        let mut st = engine.enter()?;
        // SAFETY: the caller's contract for `host`; `ptr..ptr + bytes` is the tensor.
        unsafe { st.queue_host_copy(upload, ptr, ptr, host, tensor.byte_len()) }.map(|_| ())
    }
    use half::{bf16, f16};

    /// What the gather must produce, computed on the host: the view's elements in row-major
    /// order, walking the multi-index directly. `data` is the allocation, `base` the element
    /// index of the view's base in it.
    fn reference<T: Copy>(
        data: &[T],
        base: usize,
        shape: &[usize],
        strides: &[i64],
        offset: i64,
    ) -> Vec<T> {
        let len: usize = shape.iter().product();
        let mut out = Vec::with_capacity(len);
        let mut idx = vec![0usize; shape.len()];
        for _ in 0..len {
            let at = base as i64
                + offset
                + idx
                    .iter()
                    .zip(strides)
                    .map(|(&i, &s)| i as i64 * s)
                    .sum::<i64>();
            out.push(data[usize::try_from(at).expect("inside the allocation")]);
            for d in (0..shape.len()).rev() {
                idx[d] += 1;
                if idx[d] < shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        out
    }

    fn engine() -> CudaEngine {
        CudaEngine::simulated(Default::default())
    }

    /// Uploads `data`, gathers the view (base at element `base` of it) and checks the result's
    /// type, shape and elements against [`reference`], then that the device saw no misuse.
    fn check<T: Element>(
        engine: &mut CudaEngine,
        data: &[T],
        base: usize,
        shape: &[usize],
        strides: &[i64],
        offset: i64,
    ) {
        let source = upload_tensor(engine, data, &[data.len()]).unwrap();
        let src = source.raw_ptr();
        let base_ptr = src + (base * T::DTYPE.size_bytes()) as u64;
        // SAFETY: `reference` indexes `data` at every element the view reads, so each lies in
        // `source`, which lives (borrowed below) until the download waited for the copy.
        let out = unsafe { engine.gather_strided(src, base_ptr, T::DTYPE, shape, strides, offset) }
            .unwrap();
        assert_eq!((out.dtype(), out.shape()), (T::DTYPE, shape));
        let got = download_tensor(engine, out.as_typed::<T>().unwrap()).unwrap();
        let want = reference(data, base, shape, strides, offset);
        assert_eq!(got, want, "{:?} {shape:?} {strides:?} +{offset}", T::DTYPE);
        drop(source);
        engine.synchronize().unwrap();
        if let Some(sim) = engine.sim() {
            assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        }
    }

    fn iota_f32(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32 * 1.25 - 7.0).collect()
    }

    fn transposed_matrix(engine: &mut CudaEngine) {
        // A column-major `[rows, cols]` matrix: element (r, c) at `r + c * rows`.
        let (rows, cols) = (3, 5);
        let data = iota_f32(rows * cols);
        check(engine, &data, 0, &[rows, cols], &[1, rows as i64], 0);
        // A larger one, past one block of threads.
        let (rows, cols) = (37, 29);
        let data: Vec<u32> = (0..(rows * cols) as u32).map(|i| i * 7 + 1).collect();
        check(engine, &data, 0, &[rows, cols], &[1, rows as i64], 0);
    }

    #[test]
    fn gather_copies_a_transposed_matrix() {
        transposed_matrix(&mut engine());
    }

    fn permutation(engine: &mut CudaEngine) {
        // A contiguous `[2, 3, 4]` tensor (strides `[12, 4, 1]`) seen as its permutation
        // `(2, 0, 1)`: shape `[4, 2, 3]`, strides `[1, 12, 4]`.
        let data: Vec<i16> = (0..24).map(|i| i * 11 - 100).collect();
        check(engine, &data, 0, &[4, 2, 3], &[1, 12, 4], 0);
        // `(1, 2, 0)` and `(2, 1, 0)`.
        check(engine, &data, 0, &[3, 4, 2], &[4, 1, 12], 0);
        check(engine, &data, 0, &[4, 3, 2], &[1, 4, 12], 0);
    }

    #[test]
    fn gather_copies_a_three_dimensional_permutation() {
        permutation(&mut engine());
    }

    fn broadcast(engine: &mut CudaEngine) {
        let row = [10i64, -20, 30];
        // The row repeated: `[4, 3]`, strides `[0, 1]`; the column repeated: `[3, 4]`, `[1, 0]`.
        check(engine, &row, 0, &[4, 3], &[0, 1], 0);
        check(engine, &row, 0, &[3, 4], &[1, 0], 0);
        // One element everywhere.
        check(engine, &row, 0, &[2, 5], &[0, 0], 2);
        // A broadcast between two walked dimensions.
        let data = iota_f32(6);
        check(engine, &data, 0, &[2, 4, 3], &[3, 0, 1], 0);
    }

    #[test]
    fn gather_copies_a_broadcast_with_zero_strides() {
        broadcast(&mut engine());
    }

    fn negative(engine: &mut CudaEngine) {
        // A `[3, 4]` matrix flipped along both axes: the first element read is the last.
        let data: Vec<i32> = (0..12).map(|i| i * 3 - 5).collect();
        check(engine, &data, 0, &[3, 4], &[-4, -1], 11);
        // Columns flipped only, and a base in the middle of the allocation with an offset
        // back to its start.
        check(engine, &data, 0, &[3, 4], &[4, -1], 3);
        check(engine, &data, 6, &[3, 4], &[4, 1], -6);
        check(engine, &data, 6, &[4, 3], &[-1, -4], 5);
        // Every other element, backwards.
        check(engine, &data, 0, &[6], &[-2], 11);
    }

    #[test]
    fn gather_walks_negative_strides_from_an_offset() {
        negative(&mut engine());
    }

    fn every_type(engine: &mut CudaEngine) {
        // A transposed `[3, 4]` view with every other column skipped, from an offset: strides
        // `[2, 8]`, on an allocation of 24 elements.
        let shape = [4, 3];
        let strides = [2, 8];
        let idx = || (0..24).map(|i: i32| i * 5 - 37);
        macro_rules! each {
            ($($t:ty => $make:expr),* $(,)?) => {$(
                let data: Vec<$t> = idx().map($make).collect();
                check(engine, &data, 0, &shape, &strides, 1);
            )*};
        }
        each!(
            f32 => |i| i as f32 * 0.5,
            f64 => |i| f64::from(i) * -0.25,
            f16 => |i| f16::from_f32(i as f32 * 0.5),
            bf16 => |i| bf16::from_f32(i as f32 * -1.5),
            i8 => |i| i as i8,
            i16 => |i| (i * 300) as i16,
            i32 => |i| i * 70_001,
            i64 => |i| i64::from(i) << 40,
            u8 => |i| i as u8,
            u16 => |i| (i * 999) as u16,
            u32 => |i| (i as u32).wrapping_mul(2_654_435_761),
            u64 => |i| (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            bool => |i| i % 3 == 0,
        );
    }

    #[test]
    fn gather_serves_every_element_type_and_size() {
        let mut engine = engine();
        every_type(&mut engine);
        // One kernel per element size (and rank), whatever the type.
        assert_eq!(engine.cached_kernels(), 4);
    }

    fn misaligned(engine: &mut CudaEngine) {
        // Bytes, read as wider elements at bases that are not aligned to them: the kernel
        // reads in narrower units.
        let bytes: Vec<u8> = (0..96u8).map(|b| b.wrapping_mul(37) ^ 0x5a).collect();
        let source = upload_tensor(engine, &bytes, &[bytes.len()]).unwrap();
        let src = source.raw_ptr();
        /// The element type, the base's distance from the allocation's start in bytes, the
        /// shape, the strides and the offset.
        type Case = (DType, u64, &'static [usize], &'static [i64], i64);
        let cases: [Case; 4] = [
            (DType::U32, 1, &[3, 2], &[2, -1], 1),
            (DType::F64, 2, &[2, 3], &[1, 2], 0),
            (DType::U16, 3, &[5, 2], &[2, 1], 0),
            (DType::I64, 4, &[3, 2], &[0, -3], 7),
        ];
        for (dtype, skew, shape, strides, offset) in cases {
            let size = dtype.size_bytes();
            let out =
                // SAFETY: every element read lies inside the 96 bytes of `source` (checked by the
                // reference below, which indexes them), live until the synchronize.
                unsafe { engine.gather_strided(src, src + skew, dtype, shape, strides, offset) }
                    .unwrap();
            engine.synchronize().unwrap();
            let sim = engine.sim().unwrap();
            let got = sim.peek(sim_address(&out), out.len() * size).unwrap();
            // The reference over whole elements: element `k` of the view starts at byte
            // `skew + k * size`.
            let elements: Vec<&[u8]> = (0..(bytes.len() - skew as usize) / size)
                .map(|k| &bytes[skew as usize + k * size..skew as usize + (k + 1) * size])
                .collect();
            let want: Vec<u8> = reference(&elements, 0, shape, strides, offset).concat();
            assert_eq!(got, want, "{dtype:?} at +{skew}: {:?}", sim.violations());
        }
        drop(source);
        engine.synchronize().unwrap();
        let sim = engine.sim().unwrap();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }

    /// The simulated device address of an [`AnyTensor`].
    fn sim_address(tensor: &AnyTensor) -> u64 {
        macro_rules! find {
            ($($t:ty),*) => {$(
                if let Some(t) = tensor.as_typed::<$t>() {
                    return t.sim_address();
                }
            )*};
        }
        find!(
            f32, f64, f16, bf16, i8, i16, i32, i64, u8, u16, u32, u64, bool
        );
        unreachable!("every element type is listed")
    }

    #[test]
    fn gather_reads_a_misaligned_base_in_narrower_units() {
        misaligned(&mut engine());
    }

    #[test]
    fn gather_of_zero_elements_allocates_and_queues_nothing() {
        let mut engine = engine();
        let sim = engine.sim().unwrap();
        let source = upload_tensor(&mut engine, &[1.0f32, 2.0], &[2]).unwrap();
        let src = source.raw_ptr();
        let before = (
            sim.calls(SimOp::Alloc),
            sim.calls(SimOp::Launch),
            sim.calls(SimOp::ModuleLoad),
            sim.queued(),
        );
        let cases: [(&[usize], &[i64]); 3] = [
            (&[0], &[1]),
            (&[3, 0, 2], &[-1, 5, 0]),
            (&[0, 1, 1, 1, 1, 1, 1, 1], &[0; 8]),
        ];
        for (shape, strides) in cases {
            let out =
                // SAFETY: no element is read.
                unsafe { engine.gather_strided(src, src, DType::BF16, shape, strides, 7) }.unwrap();
            assert_eq!(
                (out.dtype(), out.shape(), out.len()),
                (DType::BF16, shape, 0)
            );
        }
        assert_eq!(
            (
                sim.calls(SimOp::Alloc),
                sim.calls(SimOp::Launch),
                sim.calls(SimOp::ModuleLoad),
                sim.queued(),
            ),
            before,
            "nothing allocated, built or queued"
        );
        assert_eq!(engine.cached_kernels(), 0);
    }

    #[test]
    fn gather_refuses_rank_nine_and_mismatched_strides_before_anything_is_queued() {
        let mut engine = engine();
        let sim = engine.sim().unwrap();
        let source = upload_tensor(&mut engine, &[1u8, 2], &[2]).unwrap();
        let src = source.raw_ptr();
        let before = (sim.calls(SimOp::Alloc), sim.calls(SimOp::Launch));
        let shape = [1usize; 9];
        // SAFETY: refused before anything is read.
        let refused = unsafe { engine.gather_strided(src, src, DType::U8, &shape, &[1; 9], 0) };
        match refused {
            Err(Error::Usage(UsageError::ExceedsLimit {
                operation: "gather_strided",
                what: "rank",
                value: 9,
                limit: 8,
            })) => {}
            other => panic!("expected the rank refused, got {other:?}"),
        }
        // SAFETY: refused before anything is read.
        let refused = unsafe { engine.gather_strided(src, src, DType::U8, &[2, 1], &[1], 0) };
        assert!(
            matches!(
                refused,
                Err(Error::Usage(UsageError::LengthMismatch {
                    expected: 2,
                    found: 1,
                    ..
                }))
            ),
            "{refused:?}"
        );
        assert_eq!((sim.calls(SimOp::Alloc), sim.calls(SimOp::Launch)), before);
        // Rank 8 is served, and collapses (its dimensions of extent 1 dropped).
        let data: Vec<u8> = (0..16).collect();
        check(
            &mut engine,
            &data,
            0,
            &[2, 1, 2, 1, 2, 1, 2, 1],
            &[1, 9, 2, 9, 4, 9, 8, 9],
            0,
        );
    }

    #[test]
    fn gather_is_ordered_after_an_upload_in_flight_under_any_schedule() {
        // The source is written by an upload still in flight on the upload lane, gathered on
        // the compute lane and the result downloaded on the download lane: under every schedule
        // the engine's order makes them run as program order does, with no race.
        use crate::memory::pinned::PinnedHostBuffer;
        let data: Vec<u64> = (0..40).map(|i| i * 0x0101_0101 + 3).collect();
        let want = reference(&data, 0, &[5, 8], &[1, 5], 0);
        for seed in 0..12 {
            let mut engine = engine();
            let sim = engine.sim().unwrap();
            if seed > 0 {
                sim.set_schedule(crate::driver::sim::Schedule::Interleaved { seed });
            }
            let pinned = PinnedHostBuffer::from_slice(&mut engine, &data).unwrap();
            let destination = engine.alloc_tensor::<u64>(&[40]).unwrap();
            // SAFETY: the pinned buffer lives, unchanged, until after the synchronize below.
            unsafe {
                queue_copy(
                    &mut engine,
                    true,
                    &destination,
                    pinned.as_slice().as_ptr().cast_mut().cast(),
                )
            }
            .unwrap();
            let src = destination.raw_ptr();
            // SAFETY: every element read is one of the 40 of the upload's tensor, which lives
            // until after the download waited for the gather.
            let out = unsafe { engine.gather_strided(src, src, DType::U64, &[5, 8], &[1, 5], 0) }
                .unwrap();
            let got = download_tensor(&mut engine, out.as_typed::<u64>().unwrap()).unwrap();
            assert_eq!(got, want, "seed {seed}");
            drop((destination, pinned, out));
            engine.synchronize().unwrap();
            assert!(
                sim.violations().is_empty(),
                "seed {seed}: {:?}",
                sim.violations()
            );
            assert_eq!(sim.device_live().0, 0, "seed {seed}: memory left");
        }
    }

    #[test]
    fn gather_kernels_are_cached_by_element_size_and_collapsed_rank() {
        let mut engine = engine();
        let data = iota_f32(24);
        // Rank 2 after collapsing, twice with f32 and once with u32: one kernel.
        check(&mut engine, &data, 0, &[4, 6], &[1, 4], 0);
        check(&mut engine, &data, 0, &[6, 4], &[1, 6], 0);
        let words: Vec<u32> = (0..24).collect();
        check(&mut engine, &words, 0, &[2, 3, 4], &[1, 2, 6], 0);
        assert_eq!(engine.cached_kernels(), 2, "the 3-D view is rank 3");
        // A contiguous view collapses to rank 1; a single element to rank 0.
        check(&mut engine, &words, 0, &[2, 3, 4], &[12, 4, 1], 0);
        check(&mut engine, &words, 0, &[1, 1], &[5, 9], 23);
        assert_eq!(engine.cached_kernels(), 4);
    }

    #[test]
    fn collapse_drops_unit_dimensions_and_merges_those_that_walk_as_one() {
        let dim = |extent, stride| GatherDim { extent, stride };
        assert_eq!(collapse(&[2, 3, 4], &[12, 4, 1]), [dim(24, 1)]);
        assert_eq!(collapse(&[3, 5], &[1, 3]), [dim(3, 1), dim(5, 3)]);
        assert_eq!(collapse(&[4, 1, 3], &[0, 99, 1]), [dim(4, 0), dim(3, 1)]);
        assert_eq!(collapse(&[4, 3], &[0, 0]), [dim(12, 0)]);
        assert_eq!(collapse(&[3, 4], &[-4, -1]), [dim(12, -1)]);
        assert_eq!(collapse(&[1, 1], &[7, 7]), []);
        // A misaligned element's units: `[3]` of 4 bytes read as 4 bytes each, stride 2.
        assert_eq!(collapse(&[3, 4], &[8, 1]), [dim(3, 8), dim(4, 1)]);
        assert_eq!(collapse(&[3, 4], &[4, 1]), [dim(12, 1)]);
    }

    #[test]
    fn the_emulation_follows_the_index_math_and_refuses_bad_launches() {
        let dims = [
            GatherDim {
                extent: 3,
                stride: -4,
            },
            GatherDim {
                extent: 4,
                stride: 1,
            },
        ];
        let offsets: Vec<i64> = (0..12).map(|i| element_offset(8, &dims, i)).collect();
        assert_eq!(offsets, [8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3]);
        assert_eq!(element_offset(5, &[], 3), 5);

        /// One allocation of `bytes` at `base`.
        struct Block(u64, Vec<u8>);
        impl DeviceMemory for Block {
            fn read(&mut self, ptr: u64, bytes: usize) -> Option<Vec<u8>> {
                let off = usize::try_from(ptr.checked_sub(self.0)?).ok()?;
                self.1.get(off..off.checked_add(bytes)?).map(<[u8]>::to_vec)
            }
            fn write(&mut self, ptr: u64, data: &[u8]) -> bool {
                let Some(off) = ptr.checked_sub(self.0) else {
                    return false;
                };
                match self.1.get_mut(off as usize..off as usize + data.len()) {
                    Some(out) => {
                        out.copy_from_slice(data);
                        true
                    }
                    None => false,
                }
            }
        }
        let kernel = GatherKernel { size: 2, rank: 2 };
        let emulation = GatherEmulation::new(kernel);
        assert_eq!(emulation.name(), "cuferry_gather2_r2");
        // 12 u16 at 0x1000, then room for 12 more.
        let mut memory = Block(0x1000, (0..48u8).collect());
        let params = GatherKernel::params(0x1018, 0x1000, 12, 8, &dims);
        emulation.run(&mut memory, &params).unwrap();
        let got: Vec<u16> = memory.1[24..]
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let source: Vec<u16> = (0..12u16).map(|k| ((2 * k + 1) << 8) | (2 * k)).collect();
        let want: Vec<u16> = offsets.iter().map(|&o| source[o as usize]).collect();
        assert_eq!(got, want);

        let error = emulation.run(&mut memory, &params[..5]).unwrap_err();
        assert!(error.contains("5 parameters, not 8"), "{error}");
        let past = GatherKernel::params(0x1018, 0x1000, 12, 30, &dims);
        let error = emulation.run(&mut memory, &past).unwrap_err();
        assert!(error.contains("reads unmapped"), "{error}");
        let short = GatherKernel::params(0x1018, 0x1000, 11, 8, &dims);
        let error = emulation.run(&mut memory, &short).unwrap_err();
        assert!(error.contains("with the layout"), "{error}");
    }

    #[test]
    fn the_source_is_self_contained_and_has_both_index_widths() {
        let kernel = GatherKernel { size: 8, rank: 3 };
        let src = kernel.source();
        assert!(!src.contains("#include"));
        assert!(src.contains(
            "extern \"C\" __global__ void cuferry_gather8_r3(unsigned long long* out, const unsigned long long* src, unsigned long long n, long long off, unsigned long long d0, long long s0, unsigned long long d1, long long s1, unsigned long long d2, long long s2)"
        ));
        assert!(src.contains("c_ = r_ % (unsigned int)d2;"));
        assert!(src.contains("c_ = r_ % (unsigned long long)d1;"));
        assert!(
            !src.contains("% (unsigned int)d0"),
            "the outermost is what is left"
        );
        let scalar = GatherKernel { size: 1, rank: 0 }.source();
        assert!(scalar.contains("cuferry_gather1_r0(unsigned char* out, const unsigned char* src, unsigned long long n, long long off)"));
        assert_eq!(GatherKernel::grid(0), 1);
        assert_eq!(GatherKernel::grid(257), 2);
    }

    /// The same cases on a real device. `gather_strided` is crate-private, so they run here,
    /// ignored unless asked for.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn gather_on_the_gpu_matches_the_host_reference() {
        let mut engine = CudaEngine::open(0).expect("a CUDA device");
        transposed_matrix(&mut engine);
        permutation(&mut engine);
        broadcast(&mut engine);
        negative(&mut engine);
        every_type(&mut engine);
        // A large transposed view: the grid loops, and the narrow index math at its widest.
        let (rows, cols) = (1000usize, 3000usize);
        let data: Vec<u32> = (0..(rows * cols) as u32).collect();
        check(&mut engine, &data, 0, &[rows, cols], &[1, rows as i64], 0);
        // Misaligned bases, through downloads of the typed outputs.
        let bytes: Vec<u8> = (0..96u8).map(|b| b.wrapping_mul(37) ^ 0x5a).collect();
        let source = upload_tensor(&mut engine, &bytes, &[96]).unwrap();
        let src = source.raw_ptr();
        // SAFETY: every element read lies in the 96 bytes of `source`, live until the download.
        let out = unsafe { engine.gather_strided(src, src + 1, DType::U32, &[3, 2], &[2, -1], 1) }
            .unwrap();
        let got = download_tensor(&mut engine, out.as_typed::<u32>().unwrap()).unwrap();
        let words: Vec<u32> = (0..23)
            .map(|k| u32::from_le_bytes(bytes[1 + 4 * k..5 + 4 * k].try_into().unwrap()))
            .collect();
        assert_eq!(got, reference(&words, 0, &[3, 2], &[2, -1], 1));
        engine.synchronize().unwrap();
    }
}
