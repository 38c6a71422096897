//! The graph half of the device seam: capturing queued work into a graph, instantiating it,
//! updating the parameters of its kernel nodes and replaying it on the compute stream.
//!
//! Like [`launch`](super::launch), it is a supertrait of [`Driver`](super::Driver) and names
//! device operations only. A graph is made by stream capture: between
//! [`Graphs::capture_begin`] and [`Graphs::capture_end`], what the caller queues on the compute
//! stream (kernel launches and library calls bound to it) is recorded into a graph instead of
//! running. [`Graphs::capture_last_node`] names the node the last queued operation became, so
//! its parameters can be replaced later in the instantiated graph without capturing again.
//!
//! A real device uses CUDA's stream capture (thread-local mode, so other threads' calls are never
//! affected) and `cuGraphExecKernelNodeSetParams`. The simulated device records the emulated
//! launches of the capture and queues them, in order, at each replay.

use super::launch::FunctionHandle;
use crate::error::DriverError;

/// A graph made by capture, as the raw handle value (`CUgraph` for CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GraphHandle(pub(crate) u64);

/// An instantiated graph, as the raw handle value (`CUgraphExec` for CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GraphExecHandle(pub(crate) u64);

/// A node of a graph, as the raw handle value (`CUgraphNode` for CUDA). Valid while its graph is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GraphNodeHandle(pub(crate) u64);

/// Capturing, instantiating, updating and replaying graphs on the driver's stream.
pub(crate) trait Graphs {
    /// Starts capturing the stream: until [`capture_end`](Self::capture_end), work queued on it
    /// is recorded into a graph instead of running. Only kernel launches and library calls may be
    /// queued meanwhile; anything else (copies, allocations, frees, event records, waits on the
    /// stream) fails and invalidates the capture.
    fn capture_begin(&mut self) -> Result<(), DriverError>;

    /// The node the operation queued last during the capture became.
    fn capture_last_node(&mut self) -> Result<GraphNodeHandle, DriverError>;

    /// Ends the capture and returns its graph. Must follow every successful
    /// [`capture_begin`](Self::capture_begin), also when a call during the capture failed: the
    /// stream is then usable again, and the error says the capture was invalidated.
    fn capture_end(&mut self) -> Result<GraphHandle, DriverError>;

    /// Instantiates a captured graph.
    fn graph_instantiate(&mut self, graph: GraphHandle) -> Result<GraphExecHandle, DriverError>;

    /// Replaces the function, grid, block and parameters of a kernel node in an instantiated
    /// graph; later replays use them. The graph itself is unchanged.
    ///
    /// # Safety
    /// `node` is a kernel node of the graph `exec` was instantiated from, and that graph is
    /// still alive; `function`, `grid`, `block` and `params` satisfy
    /// [`Launch::launch`](super::launch::Launch::launch)'s contract for every later replay; no
    /// replay of `exec` may be pending that has not yet started (CUDA applies the change to
    /// launches made after the call).
    unsafe fn exec_set_kernel_params(
        &mut self,
        exec: GraphExecHandle,
        node: GraphNodeHandle,
        function: FunctionHandle,
        grid: u32,
        block: u32,
        params: &[u64],
    ) -> Result<(), DriverError>;

    /// Queues one replay of `exec` on the stream.
    ///
    /// # Safety
    /// Every node's memory contract (as [`Launch::launch`](super::launch::Launch::launch)'s)
    /// holds for this replay with its current parameters.
    unsafe fn graph_launch(&mut self, exec: GraphExecHandle) -> Result<(), DriverError>;

    /// Destroys an instantiated graph. A replay still queued completes (CUDA frees the
    /// executable graph once it is done).
    ///
    /// # Safety
    /// `exec` came from [`graph_instantiate`](Self::graph_instantiate) on this driver and is
    /// destroyed once.
    unsafe fn exec_destroy(&mut self, exec: GraphExecHandle) -> Result<(), DriverError>;

    /// Destroys a captured graph.
    ///
    /// # Safety
    /// `graph` came from [`capture_end`](Self::capture_end) on this driver and is destroyed
    /// once; every executable graph instantiated from it whose nodes are still updated is
    /// destroyed first.
    unsafe fn graph_destroy(&mut self, graph: GraphHandle) -> Result<(), DriverError>;
}
