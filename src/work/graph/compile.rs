//! Compiling a traced computation for fixed input shapes into a [`Program`] that knows no
//! engine.
//!
//! The compiler fixes every shape, then plans what a run does:
//!
//! 1. **Lowering with common-subexpression elimination.** Each traced node becomes a value;
//!    two nodes computing the same operation on the same values are one value. Casts to the
//!    same type, reshapes to the same shape and reshapes of reshapes fold away; a constant
//!    reshaped is a constant.
//! 2. **Fusion.** Every elementwise operation gets a level: the number of matrix products on the
//!    longest path that feeds it. Elementwise operations of the same level and the same element
//!    count form one group, which runs as one kernel (reshapes are free: they name the same
//!    elements in the same order). Grouping by level keeps the plan acyclic: a group reads only
//!    products of lower levels and groups of its own level over fewer elements (the operands
//!    it broadcasts, which run first), and a product only groups of its own level or lower.
//!    A broadcast operand is read from memory through its strides, which the fused kernel
//!    carries (see `FusedKernel::broadcast`); an operand with as many elements as the result
//!    is read at the kernel's own index. A broadcast of a non-empty operand to an empty result
//!    is an empty constant. Constants are inlined into every kernel that uses them.
//! 3. **Placement.** A value is written to memory only when something outside its kernel needs
//!    it: a product, another kernel, or the caller. A value the caller gets back is written
//!    straight into that output; every other one goes to an intermediate buffer in one arena,
//!    laid out by liveness (two buffers share bytes when one is dead before the other is
//!    written; the steps run in order on one stream, so that is safe).
//! 4. **Outputs.** Each output is classified: an input, a view of an input (a reshape of one),
//!    or new.

use super::trace::{Op, TracedTensor};
use crate::dtype::DType;
use crate::error::{Error, ProgramError, Result, UsageError};
use crate::memory::element::dtype_byte_len;
use crate::memory::tensor::shape_len;
use crate::work::kernels::broadcast;
use crate::work::kernels::fused::{FusedKernel, FusedOp};
use crate::work::kernels::spec::{Broadcast, BroadcastDim, ElementwiseOp};
use crate::work::libs::Transpose;
use std::collections::{BTreeMap, HashMap};

/// Intermediate buffers start at multiples of this many bytes in the arena, so every kernel
/// can use its vector loads on them.
const ALIGN: usize = 256;

/// Compiles traced computations into [`Program`]s.
///
/// ```
/// # fn main() -> Result<(), cuferry::Error> {
/// use cuferry::graph::{GraphCompiler, TracedTensor};
/// use cuferry::DType;
/// let x = TracedTensor::input_symbolic_shape(DType::F64, 1);
/// let y = (&x * &x)?;
/// let program = GraphCompiler::new().compile_with_input_specs(&[&y], &[(&x, DType::F64, &[4])])?;
/// assert_eq!(program.stats().fused_kernels, 1);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct GraphCompiler {
    _private: (),
}

/// What a program's output is, relative to its inputs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// Input `n` itself: a run hands it back borrowed.
    Input(usize),
    /// Input `n`'s elements with another shape: a run hands back a borrowed view.
    View(usize),
    /// A value the program computes: each run returns it as a new tensor.
    New,
}

/// Counts that describe a compiled program.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProgramStats {
    /// Distinct operations after common-subexpression elimination (inputs, constants and
    /// reshapes not counted).
    pub operations: usize,
    /// Fused elementwise kernels a run launches.
    pub fused_kernels: usize,
    /// Matrix products a run performs.
    pub matmuls: usize,
    /// Bytes of the intermediate arena a prepared program allocates once.
    pub intermediate_bytes: usize,
    /// Bytes the intermediates would take without sharing (the sum of their sizes, saturating at
    /// `usize::MAX`).
    pub unshared_intermediate_bytes: usize,
}

/// Where a value lives during a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Loc {
    /// The caller's input `n`.
    Input(usize),
    /// The new tensor of output `n`, allocated by each run.
    Output(usize),
    /// Intermediate buffer at this byte offset in the program's arena.
    Slot(usize),
}

/// One thing a run does, in order on the engine's compute stream.
#[derive(Clone, Debug)]
pub(crate) enum Step {
    /// A fused elementwise kernel over `len` elements.
    Fused {
        kernel: FusedKernel,
        /// Where each of the kernel's outputs is stored, in parameter order.
        outputs: Vec<Loc>,
        /// Where each of its inputs is read, in parameter order.
        inputs: Vec<Loc>,
        len: usize,
    },
    /// The row-major product `c[m×n] = a[m×k] · b[k×n]`, with `k > 0`.
    Matmul {
        dtype: DType,
        /// How `a` and `b` are read: as stored, or transposed (`op(a)` is `[m, k]`).
        trans: [Transpose; 2],
        m: usize,
        k: usize,
        n: usize,
        a: Loc,
        b: Loc,
        c: Loc,
    },
}

/// What a program returns at one output position.
#[derive(Clone, Debug)]
pub(crate) struct OutputSpec {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) kind: OutputKind,
}

/// A compiled computation: fixed shapes, a plan of fused kernels and matrix products, and the
/// layout of its intermediates. It knows no engine, so one program can be prepared on several;
/// it is `Send + Sync`.
#[derive(Clone, Debug)]
pub struct Program {
    pub(crate) inputs: Vec<(DType, Vec<usize>)>,
    pub(crate) steps: Vec<Step>,
    pub(crate) arena_bytes: usize,
    pub(crate) outputs: Vec<OutputSpec>,
    stats: ProgramStats,
}

impl Program {
    /// How many inputs a run takes, in the order of the compiler's input specifications.
    pub fn input_count(&self) -> usize {
        self.inputs.len()
    }

    /// The element type and shape input `index` must have.
    pub fn input_spec(&self, index: usize) -> Option<(DType, &[usize])> {
        self.inputs.get(index).map(|(d, s)| (*d, s.as_slice()))
    }

    /// How many outputs a run returns.
    pub fn output_count(&self) -> usize {
        self.outputs.len()
    }

    /// The element type and shape of output `index`.
    pub fn output_spec(&self, index: usize) -> Option<(DType, &[usize])> {
        self.outputs
            .get(index)
            .map(|o| (o.dtype, o.shape.as_slice()))
    }

    /// Whether output `index` is an input, a view of one, or new.
    pub fn output_kind(&self, index: usize) -> Option<&OutputKind> {
        self.outputs.get(index).map(|o| &o.kind)
    }

    /// Counts that describe the plan.
    pub fn stats(&self) -> ProgramStats {
        self.stats
    }
}

/// A value after lowering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Input(usize),
    Const(u64),
    Binary(ElementwiseOp, usize, usize),
    Neg(usize),
    Scale(usize, u64),
    Cast(usize),
    Matmul(usize, usize, [Transpose; 2]),
    Reshape(usize),
}

impl Kind {
    fn operands(&self) -> Vec<usize> {
        match *self {
            Kind::Input(_) | Kind::Const(_) => vec![],
            Kind::Binary(_, a, b) | Kind::Matmul(a, b, _) => vec![a, b],
            Kind::Neg(a) | Kind::Scale(a, _) | Kind::Cast(a) | Kind::Reshape(a) => vec![a],
        }
    }

    fn elementwise(&self) -> bool {
        matches!(
            self,
            Kind::Binary(..) | Kind::Neg(_) | Kind::Scale(..) | Kind::Cast(_)
        )
    }
}

#[derive(Clone, Debug)]
struct Value {
    kind: Kind,
    dtype: DType,
    shape: Vec<usize>,
    len: usize,
}

/// The lowered DAG: values in topological order (operands first), deduplicated.
#[derive(Default)]
struct Lowered {
    values: Vec<Value>,
    dedup: HashMap<(Kind, DType, Vec<usize>), usize>,
}

impl Lowered {
    fn add(&mut self, kind: Kind, dtype: DType, shape: Vec<usize>) -> Result<usize> {
        let key = (kind, dtype, shape);
        if let Some(&id) = self.dedup.get(&key) {
            return Ok(id);
        }
        let len = shape_len(&key.2)?;
        // Every value may live in memory (an input, an output, an intermediate): its bytes must
        // be addressable, so no later size computation of the plan or of a run overflows.
        let what = match kind {
            Kind::Input(_) => "program input",
            Kind::Matmul(..) => "program matrix product",
            _ => "program value",
        };
        dtype_byte_len(dtype, len, what)?;
        let id = self.values.len();
        self.values.push(Value {
            kind,
            dtype,
            shape: key.2.clone(),
            len,
        });
        self.dedup.insert(key, id);
        Ok(id)
    }

    /// The value whose memory `id` names: itself, or what it reshapes.
    fn root(&self, id: usize) -> usize {
        match self.values[id].kind {
            Kind::Reshape(a) => a,
            _ => id,
        }
    }

    fn spec_error(detail: String) -> Error {
        Error::Program(ProgramError::Spec { detail })
    }

    /// Lowers `t` and everything it depends on.
    fn lower(
        &mut self,
        t: &TracedTensor,
        inputs: &HashMap<u64, usize>,
        specs: &[(DType, Vec<usize>)],
        memo: &mut HashMap<u64, usize>,
    ) -> Result<usize> {
        // An explicit stack: traced chains can be deeper than the thread's stack.
        let mut stack: Vec<(TracedTensor, bool)> = vec![(t.clone(), false)];
        while let Some((node, expanded)) = stack.pop() {
            let id = node.node.id;
            if memo.contains_key(&id) {
                continue;
            }
            let operands: Vec<TracedTensor> = match &node.node.op {
                Op::Input => vec![],
                Op::Full { like, .. } => vec![like.clone()],
                Op::Binary { a, b, .. } | Op::Matmul { a, b, .. } => vec![a.clone(), b.clone()],
                Op::Neg(a) | Op::Scale { a, .. } | Op::Cast(a) | Op::Reshape { a, .. } => {
                    vec![a.clone()]
                }
            };
            if !expanded {
                stack.push((node.clone(), true));
                for o in operands.into_iter().rev() {
                    if !memo.contains_key(&o.node.id) {
                        stack.push((o, false));
                    }
                }
                continue;
            }
            let get = |o: &TracedTensor| memo[&o.node.id];
            let dtype = node.dtype();
            let value = match &node.node.op {
                Op::Input => {
                    let Some(&index) = inputs.get(&id) else {
                        return Err(Self::spec_error(format!(
                            "an output depends on a {dtype} input of rank {} that has no input specification",
                            node.rank()
                        )));
                    };
                    self.add(Kind::Input(index), dtype, specs[index].1.clone())?
                }
                Op::Full { like, bits } => {
                    let shape = self.values[get(like)].shape.clone();
                    self.add(Kind::Const(*bits), dtype, shape)?
                }
                Op::Binary { op, a, b, onto } => {
                    let (a, b) = (get(a), get(b));
                    let (sa, sb) = (&self.values[a].shape, &self.values[b].shape);
                    // The eager operation's rule and error (NumPy's broadcast).
                    let operation = onto.unwrap_or(op.name());
                    let joined = broadcast(operation, sa, sb)?;
                    if onto.is_some() && joined.shape != *sa {
                        // A bias may not grow the result (as the eager `linear` says).
                        return Err(Error::Usage(UsageError::NotBroadcastable {
                            operation,
                            left: sa.clone(),
                            right: sb.clone(),
                            dim: 0,
                        }));
                    }
                    let empty = shape_len(&joined.shape)? == 0;
                    if empty && (self.values[a].len != 0 || self.values[b].len != 0) {
                        // An empty result of a non-empty operand (`[0, N]` plus `[N]`): no
                        // element to compute, so no kernel reads the operand. As a constant
                        // it also keeps every group reading only groups of fewer elements.
                        self.add(Kind::Const(0), dtype, joined.shape)?
                    } else {
                        self.add(Kind::Binary(*op, a, b), dtype, joined.shape)?
                    }
                }
                Op::Neg(a) => {
                    let a = get(a);
                    self.add(Kind::Neg(a), dtype, self.values[a].shape.clone())?
                }
                Op::Scale { a, bits } => {
                    let a = get(a);
                    self.add(Kind::Scale(a, *bits), dtype, self.values[a].shape.clone())?
                }
                Op::Cast(a) => {
                    let a = get(a);
                    self.add(Kind::Cast(a), dtype, self.values[a].shape.clone())?
                }
                Op::Matmul { a, b, trans } => {
                    let (a, b) = (get(a), get(b));
                    let (&[ar, ac], &[br, bc]) =
                        (&self.values[a].shape[..], &self.values[b].shape[..])
                    else {
                        unreachable!("matmul operands are traced 2-D");
                    };
                    let ((m, k), (k2, n)) = (trans[0].apply([ar, ac]), trans[1].apply([br, bc]));
                    if k != k2 {
                        return Err(Self::spec_error(format!(
                            "matmul: inner dimensions differ: [{m}, {k}] times [{k2}, {n}] (after the transposes)"
                        )));
                    }
                    if k == 0 {
                        // An empty sum: zeros (the bits of 0.0 are 0 for f32 and f64).
                        self.add(Kind::Const(0), dtype, vec![m, n])?
                    } else {
                        self.add(Kind::Matmul(a, b, *trans), dtype, vec![m, n])?
                    }
                }
                Op::Reshape { a, shape } => {
                    let a = get(a);
                    let len = shape_len(shape)?;
                    let from = &self.values[a];
                    if len != from.len {
                        return Err(Self::spec_error(format!(
                            "reshape: {:?} holds {} elements, {shape:?} holds {len}",
                            from.shape, from.len
                        )));
                    }
                    if *shape == from.shape {
                        a
                    } else {
                        match from.kind {
                            Kind::Const(bits) => {
                                self.add(Kind::Const(bits), dtype, shape.clone())?
                            }
                            Kind::Reshape(base) => {
                                self.add(Kind::Reshape(base), dtype, shape.clone())?
                            }
                            _ if self.values[a].shape == *shape => a,
                            _ => self.add(Kind::Reshape(a), dtype, shape.clone())?,
                        }
                    }
                }
            };
            memo.insert(id, value);
        }
        Ok(memo[&t.node.id])
    }
}

impl GraphCompiler {
    /// A compiler with the default plan (fusion of elementwise runs, liveness-shared
    /// intermediates).
    pub fn new() -> Self {
        GraphCompiler::default()
    }

    /// Compiles `outputs` for inputs of the given element types and shapes. The program's inputs
    /// are the specifications' tensors, in order; each must be a symbolic input of that element
    /// type and rank.
    ///
    /// # Errors
    /// [`ProgramError::Spec`](crate::error::ProgramError::Spec) when a specification names a value that is not an input, names one
    /// twice, or disagrees with its element type or rank; when an output depends on an input
    /// without a specification; or when shapes do not fit an operation (elementwise operands of
    /// different shapes, matrix products whose inner dimensions differ, reshapes that change the
    /// element count), or when the intermediates live at once need more than `isize::MAX` bytes.
    /// [`UsageError::ShapeOverflow`](crate::error::UsageError::ShapeOverflow) when a shape's element count (an input's, or one an operation
    /// makes, as a product's) overflows `usize`; [`UsageError::SizeOverflow`](crate::error::UsageError::SizeOverflow) when a value's bytes
    /// exceed `isize::MAX`, the most one allocation can address.
    pub fn compile_with_input_specs(
        &self,
        outputs: &[&TracedTensor],
        input_specs: &[(&TracedTensor, DType, &[usize])],
    ) -> Result<Program> {
        let mut inputs = HashMap::new();
        let mut specs = Vec::with_capacity(input_specs.len());
        for (index, (t, dtype, shape)) in input_specs.iter().enumerate() {
            if !t.is_input() {
                return Err(Lowered::spec_error(format!(
                    "input specification {index} names a computed value, not a symbolic input"
                )));
            }
            if t.dtype() != *dtype || t.rank() != shape.len() {
                return Err(Lowered::spec_error(format!(
                    "input specification {index} is {dtype} {shape:?}, but the input was traced as {} of rank {}",
                    t.dtype(),
                    t.rank()
                )));
            }
            dtype_byte_len(*dtype, shape_len(shape)?, "program input")?;
            if inputs.insert(t.node.id, index).is_some() {
                return Err(Lowered::spec_error(format!(
                    "input specification {index} names an input that an earlier specification names"
                )));
            }
            specs.push((*dtype, shape.to_vec()));
        }
        let mut lowered = Lowered::default();
        let mut memo = HashMap::new();
        let mut roots = Vec::with_capacity(outputs.len());
        for t in outputs {
            roots.push(lowered.lower(t, &inputs, &specs, &mut memo)?);
        }
        plan(lowered, specs, &roots)
    }
}

/// A step while planning: a fused group (by level and element count) or one product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum StepKey {
    /// Ordered by `2 * level`, then element count.
    Group { rank: usize, len: usize },
    /// Ordered by `2 * level + 1`, then value.
    Product { rank: usize, value: usize },
}

impl StepKey {
    fn rank(&self) -> (usize, usize) {
        match *self {
            StepKey::Group { rank, len } => (rank, len),
            StepKey::Product { rank, value } => (rank, value),
        }
    }
}

/// The kernel of one fused group, as its members are added.
#[derive(Default)]
struct KernelBuilder {
    kernel: FusedKernel,
    /// The body index of each value already available in the kernel, by value and the
    /// broadcast it is read through (`None`: at the kernel's own index).
    index: HashMap<(usize, Option<Vec<BroadcastDim>>), usize>,
    /// The values loaded, and where, in parameter order.
    reads: Vec<usize>,
    read_locs: Vec<Loc>,
}

impl KernelBuilder {
    /// The body index of `r` (a root value) read through `through` (a broadcast, or `None`
    /// for the kernel's own index), inlining a constant or loading it from its home on first
    /// use.
    fn operand(
        &mut self,
        r: usize,
        through: Option<Vec<BroadcastDim>>,
        values: &[Value],
        home: &HashMap<usize, Loc>,
    ) -> usize {
        // A constant is the same in every element, however it is broadcast.
        let through = through.filter(|_| !matches!(values[r].kind, Kind::Const(_)));
        let key = (r, through);
        if let Some(&k) = self.index.get(&key) {
            return k;
        }
        let op = match values[r].kind {
            Kind::Const(bits) => FusedOp::Const {
                dtype: values[r].dtype,
                bits,
            },
            _ => {
                let p = self.reads.len();
                self.kernel.inputs.push(values[r].dtype);
                if let Some(dims) = &key.1 {
                    self.kernel.broadcast.insert(p, dims.clone());
                }
                self.reads.push(r);
                self.read_locs.push(home[&r]);
                FusedOp::Load(p)
            }
        };
        self.kernel.body.push(op);
        self.index.insert(key, self.kernel.body.len() - 1);
        self.kernel.body.len() - 1
    }
}

/// How value `id` (an elementwise result) reads its operand `o`: at its own index when the
/// operand has as many elements (then in the same order: a broadcast that adds no element only
/// adds leading 1s), else through the collapsed broadcast of `id`'s shape against `o`'s.
fn read_through(values: &[Value], id: usize, o: usize) -> Result<Option<Vec<BroadcastDim>>> {
    if values[o].len == values[id].len {
        return Ok(None);
    }
    Broadcast::of(&values[id].shape, &values[o].shape)
        .map(|layout| Some(layout.dims))
        .map_err(|dim| {
            Lowered::spec_error(format!(
                "{:?} does not broadcast onto {:?} at dimension {dim}",
                values[o].shape, values[id].shape
            ))
        })
}

fn plan(lowered: Lowered, inputs: Vec<(DType, Vec<usize>)>, roots: &[usize]) -> Result<Program> {
    let values = &lowered.values;
    let n = values.len();
    let root = |id: usize| lowered.root(id);

    // Levels: matrix products on the longest path that feeds each value.
    let mut level = vec![0usize; n];
    for id in 0..n {
        let kind = values[id].kind;
        if kind.elementwise() || matches!(kind, Kind::Matmul(..)) {
            level[id] = kind
                .operands()
                .into_iter()
                .map(|o| {
                    let r = root(o);
                    level[r] + usize::from(matches!(values[r].kind, Kind::Matmul(..)))
                })
                .max()
                .unwrap_or(0);
        }
    }
    let group_of = |id: usize| -> Option<StepKey> {
        let v = &values[id];
        (v.kind.elementwise() || matches!(v.kind, Kind::Const(_))).then_some(StepKey::Group {
            rank: 2 * level[id],
            len: v.len,
        })
    };

    // Which values must be written to memory, and where they are read.
    let mut output_roots: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut outputs = Vec::with_capacity(roots.len());
    for (k, &id) in roots.iter().enumerate() {
        let v = &values[id];
        let r = root(id);
        let kind = match values[r].kind {
            Kind::Input(i) if r == id => OutputKind::Input(i),
            Kind::Input(i) => OutputKind::View(i),
            _ => {
                output_roots.entry(r).or_default().push(k);
                OutputKind::New
            }
        };
        outputs.push(OutputSpec {
            dtype: v.dtype,
            shape: v.shape.clone(),
            kind,
        });
    }
    let mut needed = vec![false; n];
    for id in 0..n {
        let kind = values[id].kind;
        let here = group_of(id);
        for o in kind.operands() {
            let r = root(o);
            match values[r].kind {
                Kind::Input(_) => {}
                // Constants are inlined into kernels; a product needs them in memory.
                Kind::Const(_) => needed[r] |= matches!(kind, Kind::Matmul(..)),
                _ if matches!(kind, Kind::Reshape(_)) => {}
                _ => needed[r] |= here.is_none() || group_of(r) != here,
            }
        }
    }

    // Steps, in an order that respects every dependency (see `StepKey`).
    let mut groups: BTreeMap<StepKey, Vec<usize>> = BTreeMap::new();
    for id in 0..n {
        let v = &values[id];
        let materialised = needed[id] || output_roots.contains_key(&id);
        match v.kind {
            Kind::Matmul(..) => {
                groups.insert(
                    StepKey::Product {
                        rank: 2 * level[id] + 1,
                        value: id,
                    },
                    vec![id],
                );
            }
            Kind::Const(_) if !materialised => {}
            _ => {
                if let Some(key) = group_of(id) {
                    groups.entry(key).or_default().push(id);
                }
            }
        }
    }
    let mut order: Vec<(StepKey, Vec<usize>)> = groups.into_iter().collect();
    order.sort_by_key(|(key, members)| (key.rank(), members[0]));

    // Where each materialised value is read from: the caller's output when it is one, else an
    // intermediate (placed below). Products always write an intermediate; their outputs get a
    // copy kernel right after them.
    let mut home: HashMap<usize, Loc> = HashMap::new();
    for (id, value) in values.iter().enumerate() {
        if let Kind::Input(i) = value.kind {
            home.insert(id, Loc::Input(i));
        }
    }
    let mut slot_values: Vec<usize> = Vec::new();
    let mut planned: Vec<(Step, Vec<usize>, Vec<usize>)> = Vec::new(); // step, values read, values written
    let mut stats = ProgramStats::default();
    for (key, members) in &order {
        match key {
            StepKey::Product { value, .. } => {
                let id = *value;
                let Kind::Matmul(a, b, trans) = values[id].kind else {
                    unreachable!()
                };
                let (ra, rb) = (root(a), root(b));
                home.insert(id, Loc::Slot(id)); // placeholder: the slot's value id
                slot_values.push(id);
                let (m, k) = trans[0].apply([values[a].shape[0], values[a].shape[1]]);
                let nn = trans[1].apply([values[b].shape[0], values[b].shape[1]]).1;
                stats.matmuls += 1;
                planned.push((
                    Step::Matmul {
                        dtype: values[id].dtype,
                        trans,
                        m,
                        k,
                        n: nn,
                        a: home[&ra],
                        b: home[&rb],
                        c: Loc::Slot(id),
                    },
                    vec![ra, rb],
                    vec![id],
                ));
                if let Some(ks) = output_roots.get(&id) {
                    let kernel = FusedKernel {
                        inputs: vec![values[id].dtype],
                        body: vec![FusedOp::Load(0)],
                        outputs: vec![0; ks.len()],
                        broadcast: BTreeMap::new(),
                    };
                    stats.fused_kernels += 1;
                    planned.push((
                        Step::Fused {
                            kernel,
                            outputs: ks.iter().map(|&k| Loc::Output(k)).collect(),
                            inputs: vec![Loc::Slot(id)],
                            len: values[id].len,
                        },
                        vec![id],
                        vec![],
                    ));
                }
            }
            StepKey::Group { len, .. } => {
                let mut b = KernelBuilder::default();
                let mut stores = Vec::new();
                let mut written = Vec::new();
                for &id in members {
                    let k = match values[id].kind {
                        Kind::Const(_) => b.operand(id, None, values, &home),
                        kind => {
                            let mut ops = Vec::with_capacity(2);
                            for o in kind.operands() {
                                let through = read_through(values, id, o)?;
                                ops.push(b.operand(root(o), through, values, &home));
                            }
                            b.kernel.body.push(match kind {
                                Kind::Binary(op, ..) => FusedOp::Binary {
                                    op,
                                    a: ops[0],
                                    b: ops[1],
                                },
                                Kind::Neg(_) => FusedOp::Neg(ops[0]),
                                Kind::Scale(_, bits) => FusedOp::Scale { a: ops[0], bits },
                                Kind::Cast(_) => FusedOp::Cast {
                                    a: ops[0],
                                    to: values[id].dtype,
                                },
                                _ => unreachable!("only elementwise values are grouped"),
                            });
                            stats.operations += 1;
                            b.index.insert((id, None), b.kernel.body.len() - 1);
                            b.kernel.body.len() - 1
                        }
                    };
                    if let Some(ks) = output_roots.get(&id) {
                        for &o in ks {
                            b.kernel.outputs.push(k);
                            stores.push(Loc::Output(o));
                        }
                        home.insert(id, Loc::Output(ks[0]));
                    } else if needed[id] {
                        b.kernel.outputs.push(k);
                        stores.push(Loc::Slot(id));
                        home.insert(id, Loc::Slot(id));
                        slot_values.push(id);
                        written.push(id);
                    }
                }
                if b.kernel.outputs.is_empty() {
                    continue;
                }
                stats.fused_kernels += 1;
                planned.push((
                    Step::Fused {
                        kernel: b.kernel,
                        outputs: stores,
                        inputs: b.read_locs,
                        len: *len,
                    },
                    b.reads,
                    written,
                ));
            }
        }
    }

    // Liveness: an intermediate lives from the step that writes it to the last step that reads
    // it; a later value may take its bytes only after that.
    let mut last_use: HashMap<usize, usize> = HashMap::new();
    let mut def: HashMap<usize, usize> = HashMap::new();
    for (s, (_, reads, writes)) in planned.iter().enumerate() {
        for &r in reads {
            last_use.insert(r, s);
        }
        for &w in writes {
            def.entry(w).or_insert(s);
        }
    }
    let mut offset: HashMap<usize, usize> = HashMap::new();
    let mut placed: Vec<(usize, usize, usize)> = Vec::new(); // offset, bytes, last use
    let mut arena = 0usize;
    slot_values.sort_by_key(|v| def.get(v).copied().unwrap_or(0));
    for &v in &slot_values {
        // At most `isize::MAX` (checked when the value was lowered) rounded up to `ALIGN`: no
        // overflow, and neither has any end of a placed buffer (each at most `isize::MAX`).
        let bytes = (values[v].len * values[v].dtype.size_bytes()).next_multiple_of(ALIGN);
        stats.unshared_intermediate_bytes = stats.unshared_intermediate_bytes.saturating_add(bytes);
        let born = def.get(&v).copied().unwrap_or(0);
        let dies = last_use.get(&v).copied().unwrap_or(born).max(born);
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&(_, _, last)| last >= born)
            .map(|&(o, b, _)| (o, o + b))
            .collect();
        busy.sort_unstable();
        let mut at = 0;
        for (start, end) in busy {
            if at + bytes <= start {
                break;
            }
            at = at.max(end);
        }
        let end = at
            .checked_add(bytes)
            .filter(|&end| end <= isize::MAX as usize)
            .ok_or_else(|| {
                Lowered::spec_error(format!(
                    "the intermediates live at once need more than {} bytes: a {} intermediate \
                     of shape {:?} ({bytes} bytes) does not fit after {at} bytes",
                    isize::MAX,
                    values[v].dtype,
                    values[v].shape
                ))
            })?;
        placed.push((at, bytes, dies));
        offset.insert(v, at);
        arena = arena.max(end);
    }
    stats.intermediate_bytes = arena;
    let place = |loc: Loc| match loc {
        Loc::Slot(v) => Loc::Slot(offset[&v]),
        other => other,
    };
    let steps = planned
        .into_iter()
        .map(|(step, _, _)| match step {
            Step::Fused {
                kernel,
                outputs,
                inputs,
                len,
            } => Step::Fused {
                kernel,
                outputs: outputs.into_iter().map(place).collect(),
                inputs: inputs.into_iter().map(place).collect(),
                len,
            },
            Step::Matmul {
                dtype,
                trans,
                m,
                k,
                n,
                a,
                b,
                c,
            } => Step::Matmul {
                dtype,
                trans,
                m,
                k,
                n,
                a: place(a),
                b: place(b),
                c: place(c),
            },
        })
        .collect();
    stats.operations += stats.matmuls;
    Ok(Program {
        inputs,
        steps,
        arena_bytes: arena,
        outputs,
        stats,
    })
}
