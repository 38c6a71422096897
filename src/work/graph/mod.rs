//! Prepared graphs: describe a computation once, compile it for fixed shapes, prepare it for an
//! engine, and run it many times on new inputs for about the host cost of one graph launch.
//!
//! The flow has four steps, each with its own type:
//!
//! 1. **Trace** ([`TracedTensor`]): symbolic inputs with an element type and a rank, combined
//!    with operators and methods. Element-type mismatches are errors here; operands of
//!    different ranks broadcast as the eager operations do.
//! 2. **Compile** ([`GraphCompiler`] → [`Program`]): shapes are fixed, common subexpressions
//!    merged, shapes broadcast (or refused with the eager operations' error), each maximal
//!    run of same-length elementwise operations fused into one kernel (a broadcast operand
//!    read through its strides), intermediates laid out by liveness, and each output
//!    classified as an input, a view of one, or new. A program knows no engine and is `Send + Sync`.
//! 3. **Prepare** ([`CudaEngine::prepare`](crate::CudaEngine::prepare) → [`Prepared`]): kernels
//!    compiled with NVRTC (or found in the engine's cache, keyed by the fused expression and its
//!    element types), the intermediate arena allocated once, and the steps captured into one
//!    CUDA graph (split around the matrix products that read an input or an output, whose
//!    addresses change from run to run: those run as eager cuBLAS calls) and instantiated.
//! 4. **Run** ([`CudaEngine::run`](crate::CudaEngine::run)): inputs checked, new outputs
//!    allocated, only the kernel-node parameters whose addresses moved are rewritten, and the
//!    graph launched on the engine's compute stream. It returns once the work is queued.
//!
//! ```
//! # fn main() -> Result<(), cuferry::Error> {
//! use cuferry::graph::{GraphCompiler, Input, TracedTensor};
//! use cuferry::{download_tensor, upload_tensor, CudaEngine, DType};
//! # let mut engine = CudaEngine::simulated(Default::default());
//! # /*
//! let mut engine = CudaEngine::open(0)?;
//! # */
//! let x = TracedTensor::input_symbolic_shape(DType::F64, 1);
//! let y = (&x * &x)?;
//! let program = GraphCompiler::new().compile_with_input_specs(&[&y], &[(&x, DType::F64, &[4])])?;
//! let mut prepared = engine.prepare(&program)?;
//!
//! let seed = upload_tensor(&mut engine, &[1.0f64, 2.0, 3.0, 4.0], &[4])?;
//! let outputs = engine.run(&mut prepared, &[Input::from(&seed)])?;
//! assert_eq!(outputs.len(), 1);
//! let y = outputs[0].as_tensor::<f64>().expect("an f64 output");
//! assert_eq!(download_tensor(&mut engine, y)?, [1.0, 4.0, 9.0, 16.0]);
//! drop(outputs);
//! engine.synchronize()?;
//! # Ok(()) }
//! ```
//!
//! # The rules
//!
//! - A run's outputs that are inputs (or views of inputs) borrow those inputs: an input cannot be
//!   mutated or dropped while such an output is alive. Every other output is a new tensor the
//!   caller owns.
//! - A prepared program belongs to one engine; any other refuses it with
//!   [`UsageError::WrongEngine`](crate::error::UsageError::WrongEngine). `run` takes it `&mut`, so it is used by
//!   one run at a time.
//! - Inputs of the wrong element type or shape are refused with
//!   [`ProgramError::Input`](crate::error::ProgramError::Input) before anything is queued.
//! - Dropping a prepared program releases its arena and graphs only once its last run is proven
//!   complete.
//! - Fused kernels compute exactly what the eager operations compute, bit for bit: every
//!   intermediate is rounded to its element type, and no multiply and add are contracted.
//!
//! On the simulated device (feature `sim`) everything runs, including the graphs (the
//! simulator records and replays the emulated kernels) and matrix products (an emulated product
//! in place of cuBLAS).

mod compile;
mod prepare;
mod trace;

pub use compile::{GraphCompiler, OutputKind, Program, ProgramStats};
pub use prepare::{Input, Output, Prepared, PreparedStats};
pub use trace::TracedTensor;
