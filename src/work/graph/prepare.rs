//! Preparing a program for one engine, and running it.
//!
//! [`CudaEngine::prepare`] binds a [`Program`] to the engine: it compiles (or finds in the
//! engine's cache) every fused kernel, allocates the intermediate arena once, and captures each
//! run of graph-safe steps into one CUDA graph on the engine's compute stream, which it instantiates.
//! A step is graph-safe when every address it uses is the same on every run: fused kernels
//! always are (their parameters are updated in the instantiated graph when an input or output
//! moves), and a matrix product is when its operands and result are intermediates. A product
//! that reads an input or an output address (which can change from run to run) runs as an eager
//! cuBLAS call between graph launches, on the same stream.
//!
//! [`CudaEngine::run`] validates the inputs (element type, shape, engine) before anything is
//! queued, allocates the new outputs, rewrites only the kernel-node parameters whose addresses
//! changed since the last run, and launches: one graph launch for a program of elementwise
//! operations. It returns as soon as the work is queued.
//!
//! A prepared program lends its arena and its graphs to the work it queued, so dropping it
//! fences them (the crate's one proof of completion): they are released once the last run is
//! proven complete, never before.

use super::compile::{Loc, OutputKind, Program, Step};
use crate::core::engine::{Charge, CudaEngine, Entered, Shared};
use crate::core::order::Use;
use crate::driver::graph::{GraphExecHandle, GraphHandle, GraphNodeHandle};
use crate::driver::launch::FunctionHandle;
use crate::driver::libs::Library;
use crate::driver::{DevicePtr, Lane};
use crate::dtype::DType;
use crate::error::{Error, ProgramError, Result};
use crate::ledger::Owner;
use crate::lifecycle::fence::{Fencing, fence};
use crate::memory::any_tensor::AnyTensor;
use crate::memory::element::Element;
use crate::memory::tensor::{DeviceTensor, Recycler, alloc_device};
use crate::work::kernels::cache::KernelCache;
use crate::work::kernels::fused::FusedKernel;
use crate::work::libs::Transpose;
use crate::work::libs::blas::row_major_product;
use std::any::Any;
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// An input of a run: a borrowed tensor of any element type.
///
/// Made from `&DeviceTensor<T>` with `From`, so `&[(&x).into()]` or [`Input::from`] builds a
/// run's inputs.
#[derive(Clone, Copy)]
pub struct Input<'i> {
    tensor: &'i (dyn Any + Send + Sync),
    ptr: DevicePtr,
    dtype: DType,
    shape: &'i [usize],
    owner: &'i Shared,
}

impl<'i, T: Element> From<&'i DeviceTensor<T>> for Input<'i> {
    fn from(tensor: &'i DeviceTensor<T>) -> Self {
        Input {
            tensor,
            ptr: tensor.raw_ptr(),
            dtype: T::DTYPE,
            shape: tensor.shape(),
            owner: tensor.owner(),
        }
    }
}

impl std::fmt::Debug for Input<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Input")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

/// One output of a run.
#[derive(Debug)]
pub enum Output<'i> {
    /// An input, or a view of one (a reshape), borrowed from that input: `input` is the input's
    /// position, `shape` the view's shape.
    Borrowed {
        /// The input's position in the run's inputs.
        input: usize,
        /// The tensor whose elements this output names.
        tensor: Input<'i>,
        /// The output's shape (the input's own, or the view's).
        shape: Vec<usize>,
    },
    /// A compact tensor the run wrote.
    New(AnyTensor),
}

impl<'i> Output<'i> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Output::Borrowed { tensor, .. } => tensor.dtype,
            Output::New(t) => t.dtype(),
        }
    }

    /// The output's shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            Output::Borrowed { shape, .. } => shape,
            Output::New(t) => t.shape(),
        }
    }

    /// Whether the output is borrowed from an input.
    pub fn is_borrowed(&self) -> bool {
        matches!(self, Output::Borrowed { .. })
    }

    /// The tensor holding the output's elements, if it is of element type `T`: the new tensor,
    /// or the input it borrows (whose shape is the input's; see [`shape`](Self::shape) for a
    /// view's).
    pub fn as_tensor<T: Element>(&self) -> Option<&DeviceTensor<T>> {
        match self {
            Output::Borrowed { tensor, .. } => tensor.tensor.downcast_ref(),
            Output::New(t) => t.as_typed(),
        }
    }

    /// The new tensor, if the output is new and of element type `T`; otherwise the output comes
    /// back unchanged.
    pub fn into_tensor<T: Element>(self) -> std::result::Result<DeviceTensor<T>, Self> {
        match self {
            Output::New(t) => t.try_typed().map_err(Output::New),
            other => Err(other),
        }
    }
}

/// A kernel node's parameter: fixed at prepare, or the address of an input or output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Param {
    Fixed(u64),
    Input(usize),
    Output(usize),
}

/// A fused kernel captured into a graph, and the parameters it was last given.
struct KernelNode {
    node: GraphNodeHandle,
    function: FunctionHandle,
    grid: u32,
    template: Vec<Param>,
    /// What the instantiated graph holds now; `None` when unknown (after a failed update).
    current: Option<Vec<u64>>,
}

/// What a run does, in order.
enum Segment {
    /// Launch the instantiated graph `graph` (an index into the resources' graphs) after
    /// updating its kernel nodes.
    Graph {
        graph: usize,
        nodes: Vec<KernelNode>,
    },
    /// A product outside any graph.
    Eager {
        dtype: DType,
        trans: [Transpose; 2],
        m: usize,
        k: usize,
        n: usize,
        a: Param,
        b: Param,
        c: Param,
    },
}

/// What the device may still touch after a run: released only once that is proven.
struct Lent {
    owner: Arc<Shared>,
    /// The intermediates. Only held: its memory must outlive every run, and is freed
    /// (stream-ordered) when this is released.
    _arena: Option<DeviceTensor<u8>>,
    graphs: Vec<(GraphHandle, GraphExecHandle)>,
}

/// The intermediates' bytes.
impl crate::core::retire::Held for Lent {
    fn held_bytes(&self) -> u64 {
        self._arena.held_bytes()
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if self.graphs.is_empty() {
            return; // the arena frees itself
        }
        let Some(mut st) = self.owner.enter_for_drop() else {
            return; // leaked: sound
        };
        for (graph, exec) in self.graphs.drain(..) {
            // SAFETY: each executable graph and graph is destroyed once, here; the executable
            // graph first. Dropping `Lent` happens only when no run can be queued any more.
            if let Err(source) = unsafe { st.driver.exec_destroy(exec) } {
                st.defer(Error::Driver {
                    call: "cuGraphExecDestroy",
                    source,
                });
            }
            // SAFETY: as above; the only executable graph made from it is destroyed.
            if let Err(source) = unsafe { st.driver.graph_destroy(graph) } {
                st.defer(Error::Driver {
                    call: "cuGraphDestroy",
                    source,
                });
            }
        }
    }
}

/// How many dropped outputs' blocks a prepared program keeps for reuse, per output.
const RECYCLED_PER_OUTPUT: usize = 4;

/// Counters of a prepared program, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PreparedStats {
    /// Runs queued.
    pub runs: u64,
    /// Graph launches queued.
    pub graph_launches: u64,
    /// Kernel-node parameter updates made (one per node whose addresses changed).
    pub parameter_updates: u64,
    /// Library calls made outside a graph.
    pub eager_calls: u64,
    /// Instantiated graphs the program holds.
    pub graphs: usize,
}

/// A [`Program`] prepared for one engine: its kernels loaded, its intermediates allocated, its
/// graphs instantiated. Run it with [`CudaEngine::run`] on that engine, as often as needed.
///
/// The new outputs a run returns are ordinary tensors. When one is dropped, its memory goes back
/// to the program (up to four blocks per output) and the next run reuses it, with no
/// stream-ordered free and allocation in between: the next run writes the block on the compute
/// stream after an event wait for whatever still uses it on a copy stream (a pending download of
/// the dropped output, say), so the reuse is as safe as a free and an allocation would be.
///
/// Dropping it releases the arena and the graphs once the last run is proven complete (they go
/// to the engine's retirement queue, like a dropped transfer), and frees the output memory it
/// kept; `mem::forget` leaks them, which is sound.
pub struct Prepared {
    owner: Arc<Shared>,
    inputs: Vec<(DType, Vec<usize>)>,
    /// Each output's element type, shape, element count and kind.
    outputs: Vec<(DType, Vec<usize>, usize, OutputKind)>,
    segments: Vec<Segment>,
    lent: Option<Lent>,
    /// Memory of dropped new outputs, reused by later runs.
    recycler: Arc<Recycler>,
    stats: PreparedStats,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("engine", &self.owner.engine_id)
            .field("inputs", &self.inputs)
            .field("stats", &self.stats)
            .finish()
    }
}

impl Prepared {
    /// Counters: runs, graph launches, parameter updates, eager library calls.
    pub fn stats(&self) -> PreparedStats {
        self.stats
    }

    /// The engine this program is prepared for, as [`DeviceTensor::engine_id`] names it.
    pub fn engine_id(&self) -> u64 {
        self.owner.engine_id
    }
}

impl Drop for Prepared {
    fn drop(&mut self) {
        let Some(lent) = self.lent.take() else {
            return;
        };
        // Runs queued earlier may still use it: from here until a proof, a panic leaks it.
        let lent = ManuallyDrop::new(lent);
        // Outputs dropped from now on free their own memory.
        let recycled = self.recycler.close();
        if self.stats.runs == 0 && recycled.is_empty() {
            drop(ManuallyDrop::into_inner(lent)); // nothing was ever queued with it
            return;
        }
        let Some(mut st) = self.owner.enter_for_drop() else {
            return; // left in `ManuallyDrop`: leaked, never released early
        };
        // Outputs of a run refused before its launch (a refused wait, say) were handed back
        // too: their blocks are freed like any other, though nothing was queued with `lent`.
        for (bytes, ptr) in recycled {
            let charge = Charge::new(Owner::Tensors, bytes);
            // SAFETY: each block came from this engine's driver for an output tensor that was
            // dropped and gave it back; it is freed once, here, and no later work names it.
            unsafe { st.free_device(&*self.owner.waits, ptr, charge) };
        }
        if self.stats.runs == 0 {
            drop(st);
            drop(ManuallyDrop::into_inner(lent)); // nothing was ever queued with it
            return;
        }
        let fencing = fence(
            &mut st,
            &self.owner,
            Lane::Compute,
            lent,
            None,
            "prepared program",
        );
        match fencing {
            Fencing::Fenced(fenced) => {
                drop(st);
                drop(fenced); // detaches into the retirement queue
            }
            Fencing::Proven(lent, error) => {
                st.defer(error);
                drop(st);
                drop(lent);
            }
            Fencing::Untracked(untracked, error) => {
                st.defer(error);
                drop(st);
                untracked.retain();
            }
        }
    }
}

/// Wraps memory allocated under the engine's lock in a tensor of a run-time element type, whose
/// memory goes back to `recycle` when it is dropped.
///
/// # Safety
/// As [`DeviceTensor::from_raw`], for the type `dtype` names.
unsafe fn wrap_any(
    ptr: DevicePtr,
    dtype: DType,
    shape: &[usize],
    len: usize,
    owner: &Arc<Shared>,
    recycle: &Arc<Recycler>,
) -> AnyTensor {
    /// # Safety
    /// As `wrap_any`.
    unsafe fn typed<T: Element>(
        ptr: DevicePtr,
        shape: &[usize],
        len: usize,
        owner: &Arc<Shared>,
        recycle: &Arc<Recycler>,
    ) -> AnyTensor {
        // SAFETY: forwarded from the caller.
        AnyTensor::from(unsafe {
            DeviceTensor::<T>::from_raw(ptr, shape, len, owner, Some(recycle))
        })
    }
    // SAFETY: forwarded from the caller, for the type `dtype` names.
    unsafe {
        match dtype {
            DType::F32 => typed::<f32>(ptr, shape, len, owner, recycle),
            DType::F64 => typed::<f64>(ptr, shape, len, owner, recycle),
            DType::F16 => typed::<half::f16>(ptr, shape, len, owner, recycle),
            DType::BF16 => typed::<half::bf16>(ptr, shape, len, owner, recycle),
            DType::I8 => typed::<i8>(ptr, shape, len, owner, recycle),
            DType::I16 => typed::<i16>(ptr, shape, len, owner, recycle),
            DType::I32 => typed::<i32>(ptr, shape, len, owner, recycle),
            DType::I64 => typed::<i64>(ptr, shape, len, owner, recycle),
            DType::U8 => typed::<u8>(ptr, shape, len, owner, recycle),
            DType::U16 => typed::<u16>(ptr, shape, len, owner, recycle),
            DType::U32 => typed::<u32>(ptr, shape, len, owner, recycle),
            DType::U64 => typed::<u64>(ptr, shape, len, owner, recycle),
            DType::Bool => typed::<bool>(ptr, shape, len, owner, recycle),
        }
    }
}

fn resolve(param: Param, inputs: &[DevicePtr], outputs: &[DevicePtr]) -> u64 {
    match param {
        Param::Fixed(v) => v,
        Param::Input(i) => inputs[i],
        Param::Output(o) => outputs[o],
    }
}

/// Whether a location's address is the same on every run.
fn fixed(loc: Loc) -> bool {
    matches!(loc, Loc::Slot(_))
}

impl CudaEngine {
    /// Prepares `program` for this engine: compiles its fused kernels (or finds them in the
    /// engine's kernel cache), allocates its intermediates once and captures its steps into
    /// CUDA graphs, instantiated and ready to replay. Queues nothing that runs.
    ///
    /// The engine is the runtime: a prepared program belongs to the engine it was prepared on,
    /// shares its compute stream, kernel cache and library handles, and is refused by any other.
    ///
    /// # Errors
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when NVRTC (or, for a program with matrix products, cuBLAS) is
    /// missing; [`LibraryError::Compile`](crate::error::LibraryError::Compile) or [`Error::Driver`] when a kernel cannot be built, memory
    /// cannot be allocated or a graph cannot be captured or instantiated. Nothing is kept, and
    /// a capture in progress is ended first, on an error and on a panic that unwinds through it
    /// alike, so the engine's stream is never left capturing.
    pub fn prepare(&mut self, program: &Program) -> Result<Prepared> {
        let arena = if program.arena_bytes > 0 {
            Some(DeviceTensor::<u8>::alloc(self, &[program.arena_bytes])?)
        } else {
            None
        };
        let base = arena.as_ref().map_or(0, |a| a.raw_ptr());
        let mut lent = Lent {
            owner: Arc::clone(&self.shared),
            _arena: arena,
            graphs: Vec::new(),
        };
        let param = |loc: Loc| match loc {
            Loc::Slot(offset) => Param::Fixed(base + offset as u64),
            Loc::Input(i) => Param::Input(i),
            Loc::Output(o) => Param::Output(o),
        };
        let mut segments = Vec::new();
        {
            let mut st = self.enter()?;
            let has_products = program
                .steps
                .iter()
                .any(|s| matches!(s, Step::Matmul { .. }));
            // Products need the library's handle, made before any capture begins.
            if has_products {
                st.driver.library_open(Library::Blas)?;
            }
            // Group the steps: runs of graph-safe steps, and eager products between them.
            let mut pending: Vec<&Step> = Vec::new();
            let flush = |pending: &mut Vec<&Step>,
                         st: &mut Entered<'_>,
                         lent: &mut Lent,
                         segments: &mut Vec<Segment>|
             -> Result<()> {
                if pending.is_empty() {
                    return Ok(());
                }
                let steps = std::mem::take(pending);
                if let Some(segment) = capture(st, lent, &steps, &param)? {
                    segments.push(segment);
                }
                Ok(())
            };
            for step in &program.steps {
                match step {
                    Step::Matmul {
                        dtype,
                        trans,
                        m,
                        k,
                        n,
                        a,
                        b,
                        c,
                    } if !(fixed(*a) && fixed(*b) && fixed(*c)) => {
                        flush(&mut pending, &mut st, &mut lent, &mut segments)?;
                        segments.push(Segment::Eager {
                            dtype: *dtype,
                            trans: *trans,
                            m: *m,
                            k: *k,
                            n: *n,
                            a: param(*a),
                            b: param(*b),
                            c: param(*c),
                        });
                    }
                    Step::Fused { len: 0, .. } => {}
                    Step::Matmul { m, n, .. } if *m == 0 || *n == 0 => {}
                    _ => pending.push(step),
                }
            }
            flush(&mut pending, &mut st, &mut lent, &mut segments)?;
        }
        let graphs = lent.graphs.len();
        Ok(Prepared {
            owner: Arc::clone(&self.shared),
            inputs: program.inputs.clone(),
            outputs: program
                .outputs
                .iter()
                .map(|o| {
                    (
                        o.dtype,
                        o.shape.clone(),
                        o.shape.iter().product(),
                        o.kind.clone(),
                    )
                })
                .collect(),
            segments,
            lent: Some(lent),
            recycler: Arc::new(Recycler::new(
                RECYCLED_PER_OUTPUT * program.outputs.len().max(1),
            )),
            stats: PreparedStats {
                graphs,
                ..PreparedStats::default()
            },
        })
    }

    /// Runs `prepared` on `inputs` (in the order of the program's input specifications) and
    /// returns its outputs, in the order they were compiled: each output that is an input, or a
    /// view of one, borrowed from that input; every other as a new compact tensor.
    ///
    /// Returns once the work is queued, without waiting for the device; later work on the
    /// engine runs after it in stream order, so the outputs can be used, downloaded or dropped
    /// at once. Steady state, a program of elementwise operations costs one graph launch, plus
    /// one parameter update per kernel whose input or output moved since the last run.
    ///
    /// # Errors
    /// [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine) when `prepared` or an input belongs to another engine;
    /// [`ProgramError::Input`](crate::error::ProgramError::Input) when the inputs are too few or too many, or one has another
    /// element type or shape than the program was compiled for. Nothing runs then. A driver or
    /// library failure while queueing is [`Error::Driver`] or [`LibraryError::Vendor`](crate::error::LibraryError::Vendor); work queued
    /// before it stays queued, and the new outputs are freed after it, stream-ordered.
    pub fn run<'i>(
        &mut self,
        prepared: &mut Prepared,
        inputs: &[Input<'i>],
    ) -> Result<Vec<Output<'i>>> {
        self.shared
            .check_owner(prepared.owner.device, prepared.owner.engine_id)?;
        if inputs.len() != prepared.inputs.len() {
            return Err(Error::Program(ProgramError::Input {
                index: inputs.len().min(prepared.inputs.len()),
                expected: format!("{} input(s)", prepared.inputs.len()),
                found: format!("{} input(s)", inputs.len()),
            }));
        }
        let mut input_ptrs = Vec::with_capacity(inputs.len());
        for (index, (input, (dtype, shape))) in inputs.iter().zip(&prepared.inputs).enumerate() {
            self.shared
                .check_owner(input.owner.device, input.owner.engine_id)?;
            if input.dtype != *dtype || input.shape != shape.as_slice() {
                return Err(Error::Program(ProgramError::Input {
                    index,
                    expected: format!("{dtype} {shape:?}"),
                    found: format!("{} {:?}", input.dtype, input.shape),
                }));
            }
            input_ptrs.push(input.ptr);
        }
        // Declared before the lock, so on an early return the lock is released before the new
        // outputs drop (their drops take it).
        let mut outputs = Vec::with_capacity(prepared.outputs.len());
        let mut output_ptrs = Vec::with_capacity(prepared.outputs.len());
        // The new outputs are allocated under the lock the launch takes too.
        let mut st = self.shared.enter()?;
        for (dtype, shape, len, kind) in &prepared.outputs {
            match kind {
                OutputKind::Input(i) | OutputKind::View(i) => {
                    output_ptrs.push(0);
                    outputs.push(Output::Borrowed {
                        input: *i,
                        tensor: inputs[*i],
                        shape: shape.clone(),
                    });
                }
                OutputKind::New => {
                    let bytes = len * dtype.size_bytes();
                    let ptr = if bytes == 0 {
                        0
                    } else if let Some(ptr) = prepared.recycler.take(bytes) {
                        ptr
                    } else {
                        match st.alloc_for(Lane::Compute, bytes, Owner::Tensors) {
                            Ok(ptr) => ptr,
                            Err(_) => {
                                // Out of memory, most likely: the allocator that releases what
                                // the retirement queue has proven complete, then retries.
                                drop(st);
                                let ptr = alloc_device(
                                    &self.shared,
                                    Lane::Compute,
                                    bytes,
                                    Owner::Tensors,
                                )?;
                                st = self.shared.enter()?;
                                ptr
                            }
                        }
                    };
                    // SAFETY: `ptr` was allocated on this engine's driver with exactly `len`
                    // elements of `dtype` (or is 0 for none): just now, or by an earlier run for
                    // an output of the same byte length, whose tensor was dropped and gave it
                    // back. Nothing else owns it.
                    let tensor = unsafe {
                        wrap_any(ptr, *dtype, shape, *len, &self.shared, &prepared.recycler)
                    };
                    output_ptrs.push(ptr);
                    outputs.push(Output::New(tensor));
                }
            }
        }
        let Prepared {
            segments,
            lent,
            stats,
            ..
        } = prepared;
        let lent = lent
            .as_ref()
            .expect("a live prepared program holds its resources");
        // The run reads its inputs and writes its new outputs on the compute lane: it waits for
        // their uses on the copy lanes first. The lock is held until every segment is queued,
        // so marking the uses now covers them all.
        let uses: Vec<Use> = (input_ptrs.iter().map(|&p| Use::Read(p)))
            .chain(output_ptrs.iter().map(|&p| Use::Write(p)))
            .filter(|u| !matches!(u, Use::Read(0) | Use::Write(0)))
            .collect();
        {
            let st = &mut *st;
            st.order.prepare(&mut *st.driver, Lane::Compute, &uses)?;
            st.order.mark(Lane::Compute, &uses);
        }
        stats.runs += 1;
        for segment in segments.iter_mut() {
            match segment {
                Segment::Graph { graph, nodes } => {
                    let (_, exec) = lent.graphs[*graph];
                    for node in nodes.iter_mut() {
                        let unchanged = node.current.as_ref().is_some_and(|current| {
                            node.template
                                .iter()
                                .zip(current)
                                .all(|(&p, &v)| resolve(p, &input_ptrs, &output_ptrs) == v)
                        });
                        if unchanged {
                            continue;
                        }
                        let params: Vec<u64> = node
                            .template
                            .iter()
                            .map(|&p| resolve(p, &input_ptrs, &output_ptrs))
                            .collect();
                        node.current = None;
                        // SAFETY: `node` is a kernel node of the graph `exec` was instantiated
                        // from, alive in `lent`; the function is the fused kernel it was
                        // captured with (cached until the engine's teardown), whose parameters
                        // are exactly these words; every address is a live allocation of this
                        // engine of the kernel's element count: inputs were checked above and
                        // stay borrowed for the call, outputs were just allocated, slots lie in
                        // the arena held by `lent`, which outlives every run (it is released
                        // only after a proof). Updates apply to later launches only.
                        unsafe {
                            st.driver.exec_set_kernel_params(
                                exec,
                                node.node,
                                node.function,
                                node.grid,
                                FusedKernel::BLOCK,
                                &params,
                            )
                        }
                        .map_err(Error::driver("cuGraphExecKernelNodeSetParams"))?;
                        node.current = Some(params);
                        stats.parameter_updates += 1;
                    }
                    // SAFETY: every kernel node now holds this run's addresses (updated above),
                    // valid as argued there; captured products use only the arena. Frees of the
                    // inputs and outputs are queued after this launch on the same stream.
                    unsafe { st.driver.graph_launch(exec) }
                        .map_err(Error::driver("cuGraphLaunch"))?;
                    stats.graph_launches += 1;
                }
                Segment::Eager {
                    dtype,
                    trans,
                    m,
                    k,
                    n,
                    a,
                    b,
                    c,
                } => {
                    let r = |p: Param| resolve(p, &input_ptrs, &output_ptrs);
                    // SAFETY: the operands hold `m×k`, `k×n` and `m×n` elements of `dtype`
                    // (the compiler sized them from the checked input shapes), in live
                    // allocations as argued for the graph's kernels above.
                    unsafe {
                        row_major_product(&mut st, *dtype, *trans, *m, *k, *n, r(*a), r(*b), r(*c))
                    }?;
                    stats.eager_calls += 1;
                }
            }
        }
        Ok(outputs)
    }
}

/// A stream capture in progress on the engine's compute stream, ended on every way out.
///
/// While the stream captures, every operation on it but a launch fails (CUDA refuses them with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), so a capture left open would turn every later
/// synchronize and free on the engine into a failure. [`end`](Self::end) ends it on the normal
/// path and on an error; a panic inside a driver call (or anywhere else) that unwinds through
/// the capture drops the guard, which ends the capture and destroys what it recorded. Nothing of
/// a capture has run or been instantiated, so discarding it releases nothing the device uses.
/// The end is the seam's own call, so this works alike on every driver.
struct Capturing<'c, 'e> {
    st: &'c mut Entered<'e>,
    /// Whether the capture still has to be ended (by the guard's drop).
    open: bool,
}

impl<'c, 'e> Capturing<'c, 'e> {
    /// Starts capturing the compute stream.
    fn begin(st: &'c mut Entered<'e>) -> Result<Self> {
        st.driver
            .capture_begin()
            .map_err(Error::driver("cuStreamBeginCapture"))?;
        Ok(Capturing { st, open: true })
    }

    /// Ends the capture and returns its graph (or why it failed: the capture is ended then
    /// too). A panic inside the end itself is not followed by a second end.
    fn end(mut self) -> std::result::Result<GraphHandle, crate::error::DriverError> {
        self.open = false;
        self.st.driver.capture_end()
    }
}

impl Drop for Capturing<'_, '_> {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        self.open = false;
        if let Ok(graph) = self.st.driver.capture_end() {
            // SAFETY: the graph was just captured, never instantiated, destroyed once.
            let _ = unsafe { self.st.driver.graph_destroy(graph) };
        }
    }
}

/// Captures `steps` into one graph and instantiates it.
fn capture(
    st: &mut Entered<'_>,
    lent: &mut Lent,
    steps: &[&Step],
    param: &dyn Fn(Loc) -> Param,
) -> Result<Option<Segment>> {
    // Compile (or find) every kernel first: nothing but launches may happen during a capture.
    let mut functions = Vec::new();
    for step in steps {
        if let Step::Fused { kernel, .. } = step {
            let crate::core::engine::State { driver, parts, .. } = &mut **st;
            functions.push(
                parts
                    .get_mut::<KernelCache>()
                    .fused(driver.as_mut(), kernel)?,
            );
        }
    }
    let capturing = Capturing::begin(st)?;
    let mut nodes = Vec::new();
    let captured = (|| -> Result<()> {
        let st = &mut *capturing.st;
        let mut functions = functions.iter();
        for step in steps {
            match step {
                Step::Fused {
                    outputs,
                    inputs,
                    len,
                    ..
                } => {
                    let function = *functions.next().expect("one function per fused step");
                    // In the kernel's parameter order (`FusedKernel::params`).
                    let template: Vec<Param> = outputs
                        .iter()
                        .chain(inputs)
                        .map(|&l| param(l))
                        .chain(std::iter::once(Param::Fixed(*len as u64)))
                        .collect();
                    // Inputs and outputs are unknown until the first run, which sets them.
                    let known = |l: &Loc| match param(*l) {
                        Param::Fixed(v) => v,
                        _ => 0,
                    };
                    let outs: Vec<u64> = outputs.iter().map(known).collect();
                    let ins: Vec<u64> = inputs.iter().map(known).collect();
                    let placeholder = FusedKernel::params(&outs, &ins, *len as u64);
                    debug_assert_eq!(template.len(), placeholder.len());
                    let grid = FusedKernel::grid(*len as u64);
                    // SAFETY: the stream is capturing, so nothing runs now; the node runs only
                    // after every parameter is set to a valid address by `run` (the
                    // placeholders differ from any live address, so the first run updates
                    // them). The function is the fused kernel for exactly these parameters.
                    unsafe {
                        st.driver
                            .launch(function, grid, FusedKernel::BLOCK, &placeholder)
                    }
                    .map_err(Error::driver("cuLaunchKernel"))?;
                    let node = st
                        .driver
                        .capture_last_node()
                        .map_err(Error::driver("cuStreamGetCaptureInfo"))?;
                    nodes.push(KernelNode {
                        node,
                        function,
                        grid,
                        template,
                        current: Some(placeholder),
                    });
                }
                Step::Matmul {
                    dtype,
                    trans,
                    m,
                    k,
                    n,
                    a,
                    b,
                    c,
                } => {
                    let fixed = |l: Loc| match param(l) {
                        Param::Fixed(v) => v,
                        _ => unreachable!("only products on intermediates are captured"),
                    };
                    // SAFETY: captured, not run; at each replay the operands are arena
                    // intermediates of the sizes the compiler planned, alive while the graph is.
                    unsafe {
                        row_major_product(
                            st,
                            *dtype,
                            *trans,
                            *m,
                            *k,
                            *n,
                            fixed(*a),
                            fixed(*b),
                            fixed(*c),
                        )
                    }?;
                }
            }
        }
        Ok(())
    })();
    let ended = capturing.end();
    let graph = match (captured, ended) {
        (Ok(()), Ok(graph)) => graph,
        (Err(error), Ok(graph)) => {
            // SAFETY: the graph was just captured, never instantiated, destroyed once.
            let _ = unsafe { st.driver.graph_destroy(graph) };
            return Err(error);
        }
        (Err(error), Err(_)) => return Err(error),
        (Ok(()), Err(source)) => {
            return Err(Error::Driver {
                call: "cuStreamEndCapture",
                source,
            });
        }
    };
    let exec = match st.driver.graph_instantiate(graph) {
        Ok(exec) => exec,
        Err(source) => {
            // SAFETY: as above: never instantiated, destroyed once.
            let _ = unsafe { st.driver.graph_destroy(graph) };
            return Err(Error::Driver {
                call: "cuGraphInstantiate",
                source,
            });
        }
    };
    lent.graphs.push((graph, exec));
    Ok(Some(Segment::Graph {
        graph: lent.graphs.len() - 1,
        nodes,
    }))
}
