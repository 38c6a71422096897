//! The graph half of the seam on a real device: CUDA stream capture and executable graphs.
//!
//! Capture runs in thread-local mode, so only this thread's potentially unsafe calls (ones that
//! would implicitly synchronise with the capturing stream) are refused while it captures; other
//! threads are never affected. Like every other call of this driver, these run with the driver's
//! context current, which the code above the seam arranges.

use super::CudaDriver;
use super::launch::with_kernel_params;
use crate::driver::graph::{GraphExecHandle, GraphHandle, GraphNodeHandle, Graphs};
use crate::driver::launch::FunctionHandle;
use crate::error::DriverError;
use cudarc::driver::sys;
use std::mem::MaybeUninit;

impl Graphs for CudaDriver {
    fn capture_begin(&mut self) -> Result<(), DriverError> {
        // SAFETY: the stream belongs to this driver's context, which is current; the mode is a
        // valid enumerator.
        DriverError::check(unsafe {
            sys::cuStreamBeginCapture_v2(
                self.lane(crate::driver::Lane::Compute),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })
    }

    fn capture_last_node(&mut self) -> Result<GraphNodeHandle, DriverError> {
        let mut status = MaybeUninit::uninit();
        let mut dependencies: *const sys::CUgraphNode = std::ptr::null();
        let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
        let mut count: usize = 0;
        // SAFETY: the stream belongs to this driver's context, which is current; every out
        // pointer is valid for one write, and the ones passed as null (capture id, graph) are
        // optional outputs. Edge data is asked for too, so the query is never refused as lossy.
        DriverError::check(unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                self.lane(crate::driver::Lane::Compute),
                status.as_mut_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut dependencies,
                &mut edges,
                &mut count,
            )
        })?;
        // SAFETY: written by the successful call above.
        let status = unsafe { status.assume_init() };
        match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {}
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                return Err(DriverError::from_raw(
                    sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                ));
            }
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => {
                return Err(DriverError::from_raw(
                    sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
                ));
            }
        }
        // The last captured operation is the one node the stream's next work would depend on;
        // none (nothing captured yet) or several (a fork joined without a node) name no node.
        if count != 1 || dependencies.is_null() {
            return Err(DriverError::INVALID_VALUE);
        }
        // SAFETY: the driver returned an array of `count` (one) nodes, valid until the next call
        // on this stream; the node is copied out at once.
        let node = unsafe { *dependencies };
        Ok(GraphNodeHandle(node as u64))
    }

    fn capture_end(&mut self) -> Result<GraphHandle, DriverError> {
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        let stream = self.lane(crate::driver::Lane::Compute);
        // SAFETY: the stream belongs to this driver's context, which is current; the out pointer
        // is valid for one write. Ending the capture is what the caller must do after every
        // successful `capture_begin`, also when the capture was invalidated.
        let code = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
        match (DriverError::check(code), graph.is_null()) {
            (Ok(()), false) => Ok(GraphHandle(graph as u64)),
            (Ok(()), true) => Err(DriverError::UNKNOWN),
            (Err(e), null) => {
                if !null {
                    // An invalidated capture returns no graph; should a driver return one
                    // anyway, nobody else holds it, so destroy it rather than leak it.
                    // SAFETY: `graph` was just made by `cuStreamEndCapture` and is destroyed
                    // once, here; no executable graph was instantiated from it.
                    unsafe {
                        sys::cuGraphDestroy(graph);
                    }
                }
                Err(e)
            }
        }
    }

    fn graph_instantiate(&mut self, graph: GraphHandle) -> Result<GraphExecHandle, DriverError> {
        let mut exec = MaybeUninit::uninit();
        // SAFETY: graph handles reaching here were minted by `capture_end` and are live until
        // `graph_destroy` (the trait's contract for every handle it returns); the out pointer
        // is valid for one write; no flags.
        DriverError::check(unsafe {
            sys::cuGraphInstantiateWithFlags(exec.as_mut_ptr(), graph.0 as sys::CUgraph, 0)
        })?;
        // SAFETY: written by the successful call above.
        Ok(GraphExecHandle(unsafe { exec.assume_init() } as u64))
    }

    unsafe fn exec_set_kernel_params(
        &mut self,
        exec: GraphExecHandle,
        node: GraphNodeHandle,
        function: FunctionHandle,
        grid: u32,
        block: u32,
        params: &[u64],
    ) -> Result<(), DriverError> {
        with_kernel_params(params, |kernel_params| {
            let node_params = sys::CUDA_KERNEL_NODE_PARAMS {
                func: function.0 as sys::CUfunction,
                gridDimX: grid,
                gridDimY: 1,
                gridDimZ: 1,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: 0,
                kernelParams: kernel_params,
                extra: std::ptr::null_mut(),
                // Both are ignored when `func` is set.
                kern: std::ptr::null_mut(),
                ctx: std::ptr::null_mut(),
            };
            // SAFETY: the caller guarantees `node` is a kernel node of the live graph `exec`
            // was instantiated from, that `function`, `grid`, `block` and `params` satisfy the
            // launch contract for every later replay, and that no replay is pending unstarted;
            // `node_params` and the parameter pointers live through the call, which copies the
            // values.
            DriverError::check(unsafe {
                sys::cuGraphExecKernelNodeSetParams_v2(
                    exec.0 as sys::CUgraphExec,
                    node.0 as sys::CUgraphNode,
                    &node_params,
                )
            })
        })
    }

    unsafe fn graph_launch(&mut self, exec: GraphExecHandle) -> Result<(), DriverError> {
        // SAFETY: `exec` is live (minted by `graph_instantiate`, live until `exec_destroy`); the
        // caller guarantees every node's memory contract for this replay; the stream belongs to
        // the current context.
        DriverError::check(unsafe {
            sys::cuGraphLaunch(
                exec.0 as sys::CUgraphExec,
                self.lane(crate::driver::Lane::Compute),
            )
        })
    }

    unsafe fn exec_destroy(&mut self, exec: GraphExecHandle) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees `exec` came from `graph_instantiate` and is destroyed
        // once; a replay still queued completes (the driver frees it afterwards).
        DriverError::check(unsafe { sys::cuGraphExecDestroy(exec.0 as sys::CUgraphExec) })
    }

    unsafe fn graph_destroy(&mut self, graph: GraphHandle) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees `graph` came from `capture_end`, is destroyed once, and
        // outlives every executable graph whose nodes are still updated.
        DriverError::check(unsafe { sys::cuGraphDestroy(graph.0 as sys::CUgraph) })
    }
}
