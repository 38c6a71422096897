//! The graph half of the seam on the simulated device.
//!
//! A capture belongs to its driver's compute stream. It records each launch queued there (its
//! emulation, function and parameters) as a node instead of queueing it; any other operation on
//! the compute stream fails with
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the capture, so ending it reports
//! `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` and makes no graph. A graph is its list of nodes;
//! instantiating copies it into an executable graph, whose nodes' parameters can then be
//! replaced without touching the graph. A replay queues one launch job per node, in order, on the
//! compute stream, so the emulations run when the device clock reaches them, exactly as eager
//! launches do. The driver's upload and download lanes are not captured: copies on them are
//! queued as ever while the compute stream captures.
//!
//! Every operation is all or nothing: a call that fails (injected or not) leaves no graph, no
//! executable graph and no queued job behind.

use super::{Job, SimDevice, SimDriver, SimOp, State, StreamId, Violation};
use crate::driver::Lane;
use crate::driver::graph::{GraphExecHandle, GraphHandle, GraphNodeHandle, Graphs};
use crate::driver::launch::{Emulation, FunctionHandle};
use crate::error::DriverError;
use cudarc::driver::sys::CUresult;
use std::collections::HashMap;
use std::sync::Arc;

/// One kernel node: what a launch recorded during a capture.
#[derive(Clone)]
struct Node {
    /// The node's handle, unique on the device.
    id: u64,
    /// The function the node launches (the module's handle, on this device).
    function: u64,
    emulation: Arc<dyn Emulation>,
    params: Vec<u64>,
}

/// A capture in progress on a compute stream.
pub(super) struct Capture {
    nodes: Vec<Node>,
    /// Set by the first operation the capture could not record.
    invalidated: bool,
}

/// An executable graph: its own copy of the nodes, and the graph it was instantiated from.
struct Exec {
    graph: u64,
    nodes: Vec<Node>,
}

/// The device's captured and executable graphs.
#[derive(Default)]
pub(super) struct GraphTable {
    /// Captured graphs, by handle.
    captured: HashMap<u64, Vec<Node>>,
    /// Executable graphs, by handle.
    execs: HashMap<u64, Exec>,
    /// The last handle given out. Graphs, executable graphs and nodes share the numbering, so
    /// no handle of one kind is ever valid as another.
    last_id: u64,
    /// Replays queued since the device was made.
    launches: u64,
}

impl GraphTable {
    fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }
}

fn error(code: CUresult) -> DriverError {
    DriverError::from_raw(code)
}

impl State {
    /// While `stream` captures: invalidates the capture and fails with
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, for an operation a capture cannot record.
    pub(super) fn refuse_in_capture(&mut self, stream: StreamId) -> Result<(), DriverError> {
        match self.captures.get_mut(&stream) {
            Some(capture) => {
                capture.invalidated = true;
                Err(error(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED))
            }
            None => Ok(()),
        }
    }

    /// Records a launch on `stream` into its capture in progress. `Ok(false)` when the stream is
    /// not capturing, so the caller queues it; an error when the capture is already invalidated.
    pub(super) fn capture_launch(
        &mut self,
        stream: StreamId,
        function: FunctionHandle,
        emulation: &Arc<dyn Emulation>,
        params: &[u64],
    ) -> Result<bool, DriverError> {
        let Some(invalidated) = self.captures.get(&stream).map(|c| c.invalidated) else {
            return Ok(false);
        };
        if invalidated {
            return Err(error(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
        }
        let id = self.graphs.next_id();
        if let Some(capture) = self.captures.get_mut(&stream) {
            capture.nodes.push(Node {
                id,
                function: function.0,
                emulation: Arc::clone(emulation),
                params: params.to_vec(),
            });
        }
        Ok(true)
    }
}

impl SimDevice {
    /// How many graph replays have been queued (on any driver's compute stream) since the device
    /// was made.
    pub fn graph_launches(&self) -> u64 {
        self.lock().graphs.launches
    }

    /// Live graphs: captured graphs plus executable graphs, not yet destroyed. A correct engine
    /// brings this back to zero once it has released what it prepared.
    pub fn graphs_live(&self) -> usize {
        let s = self.lock();
        s.graphs.captured.len() + s.graphs.execs.len()
    }
}

impl Graphs for SimDriver {
    fn capture_begin(&mut self) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::CaptureBegin)?;
        let stream = self.stream(Lane::Compute);
        if s.captures.contains_key(&stream) {
            return Err(error(CUresult::CUDA_ERROR_ILLEGAL_STATE));
        }
        s.captures.insert(
            stream,
            Capture {
                nodes: Vec::new(),
                invalidated: false,
            },
        );
        Ok(())
    }

    fn capture_last_node(&mut self) -> Result<GraphNodeHandle, DriverError> {
        let s = self.lock();
        s.alive()?;
        let Some(capture) = s.captures.get(&self.stream(Lane::Compute)) else {
            return Err(error(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED));
        };
        if capture.invalidated {
            return Err(error(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
        }
        capture
            .nodes
            .last()
            .map(|node| GraphNodeHandle(node.id))
            .ok_or(DriverError::INVALID_VALUE)
    }

    fn capture_end(&mut self) -> Result<GraphHandle, DriverError> {
        let mut s = self.lock();
        // The capture ends whatever happens next, so the stream is usable again.
        let capture = s.captures.remove(&self.stream(Lane::Compute));
        s.enter(SimOp::CaptureEnd)?;
        let Some(capture) = capture else {
            return Err(error(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED));
        };
        if capture.invalidated {
            return Err(error(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
        }
        let id = s.graphs.next_id();
        s.graphs.captured.insert(id, capture.nodes);
        Ok(GraphHandle(id))
    }

    fn graph_instantiate(&mut self, graph: GraphHandle) -> Result<GraphExecHandle, DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::GraphInstantiate)?;
        let nodes = s
            .graphs
            .captured
            .get(&graph.0)
            .cloned()
            .ok_or(DriverError::INVALID_VALUE)?;
        let id = s.graphs.next_id();
        s.graphs.execs.insert(
            id,
            Exec {
                graph: graph.0,
                nodes,
            },
        );
        Ok(GraphExecHandle(id))
    }

    unsafe fn exec_set_kernel_params(
        &mut self,
        exec: GraphExecHandle,
        node: GraphNodeHandle,
        function: FunctionHandle,
        _grid: u32,
        _block: u32,
        params: &[u64],
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::GraphSetParams)?;
        let emulation = s.emulation(function)?;
        let State {
            graphs, violations, ..
        } = &mut *s;
        let Some(exec) = graphs.execs.get_mut(&exec.0) else {
            return Err(DriverError::INVALID_VALUE);
        };
        if !graphs.captured.contains_key(&exec.graph) {
            violations.push(Violation::NodeUpdatedAfterGraphDestroyed {
                node: node.0,
                graph: exec.graph,
            });
            return Err(DriverError::INVALID_VALUE);
        }
        let Some(target) = exec.nodes.iter_mut().find(|n| n.id == node.0) else {
            return Err(DriverError::INVALID_VALUE);
        };
        target.function = function.0;
        target.emulation = emulation;
        target.params = params.to_vec();
        Ok(())
    }

    unsafe fn graph_launch(&mut self, exec: GraphExecHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::GraphLaunch)?;
        let stream = self.stream(Lane::Compute);
        s.refuse_in_capture(stream)?;
        let Some(exec) = s.graphs.execs.get(&exec.0) else {
            return Err(DriverError::INVALID_VALUE);
        };
        // A node whose module was unloaded would launch a kernel that no longer exists (a
        // library call's node has no module).
        if exec.nodes.iter().any(|n| {
            n.function != super::libs::LIBRARY_FUNCTION.0 && !s.modules.contains_key(&n.function)
        }) {
            return Err(DriverError::INVALID_VALUE);
        }
        let jobs: Vec<Job> = exec
            .nodes
            .iter()
            .map(|n| Job::Launch {
                emulation: Arc::clone(&n.emulation),
                params: n.params.clone(),
            })
            .collect();
        for job in jobs {
            s.push(stream, job);
        }
        s.graphs.launches += 1;
        Ok(())
    }

    unsafe fn exec_destroy(&mut self, exec: GraphExecHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::GraphDestroy)?;
        // Jobs a replay queued hold their own copies, so they still run.
        s.graphs
            .execs
            .remove(&exec.0)
            .map(|_| ())
            .ok_or(DriverError::INVALID_VALUE)
    }

    unsafe fn graph_destroy(&mut self, graph: GraphHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::GraphDestroy)?;
        s.graphs
            .captured
            .remove(&graph.0)
            .map(|_| ())
            .ok_or(DriverError::INVALID_VALUE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::launch::{DeviceMemory, Launch, ModuleHandle, ModuleSource};
    use crate::driver::sim::SimConfig;
    use crate::driver::{DevicePtr, Driver};

    /// `dst = src + k` (or `src * k`) on one little-endian `u32`; params `[dst, src, k]`.
    struct Arith {
        name: &'static str,
        multiply: bool,
    }

    impl Emulation for Arith {
        fn name(&self) -> &str {
            self.name
        }

        fn run(&self, memory: &mut dyn DeviceMemory, params: &[u64]) -> Result<(), String> {
            let &[dst, src, k] = params else {
                return Err(format!("{} takes three parameters", self.name));
            };
            let bytes = memory.read(src, 4).ok_or("reads unmapped memory")?;
            let x = u32::from_le_bytes(bytes.try_into().map_err(|_| "short read")?);
            let k = k as u32;
            let y = if self.multiply {
                x.wrapping_mul(k)
            } else {
                x.wrapping_add(k)
            };
            if memory.write(dst, &y.to_le_bytes()) {
                Ok(())
            } else {
                Err("writes unmapped memory".into())
            }
        }
    }

    struct Setup {
        d: SimDriver,
        dev: SimDevice,
        add_module: ModuleHandle,
        add: FunctionHandle,
        mul: FunctionHandle,
        /// Three device words: `a`, `b`, `c`.
        a: DevicePtr,
        b: DevicePtr,
        c: DevicePtr,
    }

    fn module(
        d: &mut SimDriver,
        name: &'static str,
        multiply: bool,
    ) -> (ModuleHandle, FunctionHandle) {
        let module = d
            .module_compile(&ModuleSource {
                name,
                cuda: "",
                emulation: Some(Arc::new(Arith { name, multiply })),
            })
            .unwrap();
        (module, d.module_function(module, name).unwrap())
    }

    /// A device with the two kernels loaded and `a = 10`, `b = c = 0` on it.
    fn setup() -> Setup {
        let dev = SimDevice::new(SimConfig::default());
        let mut d = SimDriver::new(dev.clone());
        let (add_module, add) = module(&mut d, "add", false);
        let (_, mul) = module(&mut d, "mul", true);
        let a = d.alloc(Lane::Compute, 4).unwrap();
        let b = d.alloc(Lane::Compute, 4).unwrap();
        let c = d.alloc(Lane::Compute, 4).unwrap();
        let mut s = Setup {
            d,
            dev,
            add_module,
            add,
            mul,
            a,
            b,
            c,
        };
        s.set(a, 10);
        s.set(b, 0);
        s.set(c, 0);
        s
    }

    impl Setup {
        /// Writes `value` at `ptr` and runs the stream.
        fn set(&mut self, ptr: DevicePtr, value: u32) {
            let bytes = value.to_le_bytes();
            // SAFETY: pageable source, staged by the call; `ptr` is a live 4-byte allocation.
            unsafe { self.d.copy_htod(ptr, bytes.as_ptr(), 4).unwrap() };
            self.dev.advance_all();
        }

        fn get(&self, ptr: DevicePtr) -> u32 {
            u32::from_le_bytes(self.dev.peek(ptr, 4).unwrap().try_into().unwrap())
        }

        /// Captures `b = a + 1; c = b + 100` and returns the graph and the second node.
        fn capture(&mut self) -> (GraphHandle, GraphNodeHandle) {
            let (a, b, c, add) = (self.a, self.b, self.c, self.add);
            self.d.capture_begin().unwrap();
            // SAFETY: recorded, not run; every replay below keeps `a`, `b`, `c` live.
            unsafe {
                self.d.launch(add, 1, 1, &[b, a, 1]).unwrap();
                let first = self.d.capture_last_node().unwrap();
                self.d.launch(add, 1, 1, &[c, b, 100]).unwrap();
                assert_ne!(self.d.capture_last_node().unwrap(), first);
            }
            let last = self.d.capture_last_node().unwrap();
            let graph = self.d.capture_end().unwrap();
            (graph, last)
        }
    }

    fn capture_error(code: CUresult) -> DriverError {
        DriverError::from_raw(code)
    }

    #[test]
    fn a_replay_queues_the_captured_launches_in_order_and_updates_change_only_the_exec() {
        let mut s = setup();
        let (graph, second) = s.capture();
        assert_eq!(s.dev.queued(), 0, "a capture queues nothing");
        assert_eq!((s.get(s.b), s.get(s.c)), (0, 0), "nor runs anything");
        let exec = s.d.graph_instantiate(graph).unwrap();
        assert_eq!(s.dev.graphs_live(), 2);

        // SAFETY: `a`, `b`, `c` stay live through every replay.
        unsafe { s.d.graph_launch(exec).unwrap() };
        assert_eq!(s.dev.queued(), 2, "one job per node");
        assert_eq!(s.dev.graph_launches(), 1);
        assert_eq!(s.dev.advance(1), 1);
        assert_eq!(
            (s.get(s.b), s.get(s.c)),
            (11, 0),
            "the first node ran alone"
        );
        assert_eq!(s.dev.advance(1), 1);
        assert_eq!(s.get(s.c), 111, "the second read what the first wrote");

        // The update applies to later replays of this executable graph only.
        let (b, c, mul) = (s.b, s.c, s.mul);
        // SAFETY: `second` is a node of the live graph `exec` came from; nothing is queued.
        unsafe {
            s.d.exec_set_kernel_params(exec, second, mul, 1, 1, &[c, b, 3])
                .unwrap();
        }
        s.set(s.a, 20);
        // SAFETY: as above.
        unsafe { s.d.graph_launch(exec).unwrap() };
        assert_eq!(s.dev.graph_launches(), 2);
        assert_eq!(s.dev.queued(), 2);
        assert_eq!(s.get(s.c), 111, "nothing ran before the clock");
        s.dev.advance_all();
        assert_eq!((s.get(s.b), s.get(s.c)), (21, 63));

        // A fresh instantiation of the graph still has the captured parameters.
        let fresh = s.d.graph_instantiate(graph).unwrap();
        // SAFETY: as above.
        unsafe { s.d.graph_launch(fresh).unwrap() };
        s.dev.advance_all();
        assert_eq!((s.get(s.b), s.get(s.c)), (21, 121));
        assert!(s.dev.violations().is_empty(), "{:?}", s.dev.violations());

        // SAFETY: each handle is destroyed once; every replay has run.
        unsafe {
            s.d.exec_destroy(fresh).unwrap();
            s.d.exec_destroy(exec).unwrap();
            s.d.graph_destroy(graph).unwrap();
        }
        assert_eq!(s.dev.graphs_live(), 0);
        assert_eq!(s.dev.calls(SimOp::GraphLaunch), 3);
        assert_eq!(s.dev.calls(SimOp::GraphDestroy), 3);
    }

    #[test]
    fn replays_interleave_with_eager_work_in_stream_order() {
        let mut s = setup();
        let (graph, _) = s.capture();
        let exec = s.d.graph_instantiate(graph).unwrap();
        let two = 2u32.to_le_bytes();
        let uploaded = s.d.event_create().unwrap();
        // SAFETY: `a`, `b`, `c` stay live; the pageable source is staged by the call.
        unsafe {
            s.d.graph_launch(exec).unwrap();
            s.d.copy_htod(s.a, two.as_ptr(), 4).unwrap();
            s.d.event_record(Lane::Upload, uploaded).unwrap();
            s.d.stream_wait(Lane::Compute, uploaded).unwrap();
            s.d.graph_launch(exec).unwrap();
        }
        // The staged copy ran the device before it (as CUDA's pageable copy syncs first).
        assert_eq!(s.get(s.c), 111);
        assert_eq!(
            s.dev.queued(),
            4,
            "the copy, its record and the replay (a wait takes no device time)"
        );
        s.dev.advance_all();
        assert_eq!((s.get(s.b), s.get(s.c)), (3, 103));
        assert!(s.dev.violations().is_empty(), "{:?}", s.dev.violations());
        // SAFETY: destroyed once each; every replay has run.
        unsafe {
            s.d.exec_destroy(exec).unwrap();
            s.d.graph_destroy(graph).unwrap();
        }
        assert_eq!(s.dev.graphs_live(), 0);
    }

    /// Runs the `i`-th kind of compute-lane operation a capture cannot record.
    fn refused_op(
        s: &mut Setup,
        i: usize,
        ev: crate::driver::EventHandle,
    ) -> Result<(), DriverError> {
        let (a, b, d) = (s.a, s.b, &mut s.d);
        // SAFETY: every device pointer is a live 4-byte allocation; and while the compute
        // stream captures, each of these is refused before it queues anything (which the test
        // checks).
        unsafe {
            match i {
                0 => d.alloc(Lane::Compute, 4).map(|_| ()),
                1 => d.free(Lane::Compute, b),
                2 => d.copy_dtod(b, a, 4),
                3 => d.event_record(Lane::Compute, ev),
                4 => d.stream_wait(Lane::Compute, ev),
                5 => d.waits().stream_synchronize(),
                6 => d.waits().lane_synchronize(Lane::Compute),
                _ => d.waits().stream_query().map(|_| ()),
            }
        }
    }

    #[test]
    fn any_other_compute_operation_invalidates_the_capture() {
        let mut s = setup();
        let ev = s.d.event_create().unwrap();
        let (a, b, add) = (s.a, s.b, s.add);
        let names = [
            "alloc",
            "free",
            "dtod",
            "event record",
            "wait",
            "synchronize",
            "lane synchronize",
            "query",
        ];
        for (i, name) in names.iter().enumerate() {
            s.d.capture_begin().unwrap();
            // SAFETY: recorded, never replayed.
            unsafe { s.d.launch(add, 1, 1, &[b, a, 1]).unwrap() };
            assert_eq!(
                refused_op(&mut s, i, ev),
                Err(capture_error(
                    CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
                )),
                "{name}"
            );
            let invalidated = capture_error(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            // SAFETY: refused, never run.
            let relaunch = unsafe { s.d.launch(add, 1, 1, &[b, a, 1]) };
            assert_eq!(relaunch, Err(invalidated), "{name}");
            assert_eq!(s.d.capture_last_node(), Err(invalidated), "{name}");
            assert_eq!(s.d.capture_end(), Err(invalidated), "{name}");
            assert_eq!(s.dev.graphs_live(), 0, "{name}");
            assert_eq!(s.dev.queued(), 0, "{name}");
        }
        assert_eq!(
            s.dev.device_live(),
            (3, 12),
            "the refused free freed nothing"
        );
        assert_eq!(s.get(s.b), 0, "nothing ran");
        // The stream is usable again once the capture has ended.
        // SAFETY: `a` and `b` are live and disjoint.
        unsafe { s.d.copy_dtod(b, a, 4).unwrap() };
        s.d.waits().stream_synchronize().unwrap();
        assert_eq!(s.get(s.b), 10);
    }

    #[test]
    fn the_copy_lanes_are_not_captured() {
        let mut s = setup();
        let ev = s.d.event_create().unwrap();
        let (a, b, add) = (s.a, s.b, s.add);
        let mut host = [0u8; 4];
        s.d.capture_begin().unwrap();
        // SAFETY: recorded; the replay below keeps `a` and `b` live.
        unsafe { s.d.launch(add, 1, 1, &[b, a, 1]).unwrap() };
        // SAFETY: `a` is a live 4-byte allocation and `host` 4 writable bytes; the download
        // into pageable memory completes within its call.
        unsafe { s.d.copy_dtoh(host.as_mut_ptr(), a, 4).unwrap() };
        assert_eq!(u32::from_le_bytes(host), 10, "queued and run, not captured");
        let up = s.d.alloc(Lane::Upload, 4).unwrap();
        s.d.event_record(Lane::Upload, ev).unwrap();
        s.d.stream_wait(Lane::Download, ev).unwrap();
        s.d.waits().lane_synchronize(Lane::Download).unwrap();
        // SAFETY: recorded, as above.
        unsafe { s.d.launch(add, 1, 1, &[s.c, b, 100]).unwrap() };
        let graph = s.d.capture_end().unwrap();
        let exec = s.d.graph_instantiate(graph).unwrap();
        // SAFETY: `a`, `b`, `c` stay live until the replay has run.
        unsafe { s.d.graph_launch(exec).unwrap() };
        assert_eq!(s.dev.queued(), 2, "both launches were captured");
        s.d.waits().stream_synchronize().unwrap();
        assert_eq!((s.get(s.b), s.get(s.c)), (11, 111));
        // SAFETY: destroyed once each; the replay has run; `up` is unused.
        unsafe {
            s.d.exec_destroy(exec).unwrap();
            s.d.graph_destroy(graph).unwrap();
            s.d.free(Lane::Compute, up).unwrap();
        }
        assert!(s.dev.violations().is_empty(), "{:?}", s.dev.violations());
    }

    #[test]
    fn a_capture_belongs_to_its_drivers_compute_stream() {
        let mut s = setup();
        let mut other = SimDriver::new(s.dev.clone());
        let (a, b, add) = (s.a, s.b, s.add);
        s.d.capture_begin().unwrap();
        // The other driver (another engine on the device) is not capturing.
        other.capture_begin().unwrap();
        let empty = other.capture_end().unwrap();
        // SAFETY: `a` and `b` are live and disjoint; the copy runs below.
        unsafe { other.copy_dtod(b, a, 4).unwrap() };
        other.waits().stream_synchronize().unwrap();
        assert_eq!(s.get(b), 10, "the other driver's copy ran");
        // SAFETY: recorded, never replayed.
        unsafe { s.d.launch(add, 1, 1, &[b, a, 1]).unwrap() };
        let graph = s.d.capture_end().unwrap();
        // SAFETY: destroyed once each.
        unsafe {
            other.graph_destroy(empty).unwrap();
            s.d.graph_destroy(graph).unwrap();
        }
        assert_eq!(s.dev.graphs_live(), 0);
    }

    #[test]
    fn captures_begin_once_and_name_only_recorded_launches() {
        let mut s = setup();
        let unmatched = capture_error(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
        assert_eq!(s.d.capture_last_node(), Err(unmatched));
        assert_eq!(s.d.capture_end(), Err(unmatched));
        s.d.capture_begin().unwrap();
        assert!(s.d.capture_begin().is_err(), "a capture is in progress");
        assert_eq!(s.d.capture_last_node(), Err(DriverError::INVALID_VALUE));
        let empty = s.d.capture_end().unwrap();
        let exec = s.d.graph_instantiate(empty).unwrap();
        // SAFETY: an empty graph touches nothing.
        unsafe { s.d.graph_launch(exec).unwrap() };
        assert_eq!(s.dev.queued(), 0);
        // SAFETY: destroyed once each.
        unsafe {
            s.d.exec_destroy(exec).unwrap();
            s.d.graph_destroy(empty).unwrap();
        }
        assert_eq!(s.dev.graphs_live(), 0);
    }

    #[test]
    fn stale_handles_are_refused() {
        let mut s = setup();
        let (graph, node) = s.capture();
        let exec = s.d.graph_instantiate(graph).unwrap();
        let (b, c, add) = (s.b, s.c, s.add);
        // SAFETY: each call below either is refused or touches live memory only.
        unsafe {
            assert_eq!(
                s.d.graph_instantiate(GraphHandle(exec.0)),
                Err(DriverError::INVALID_VALUE),
                "an executable graph is no graph"
            );
            assert_eq!(
                s.d.exec_set_kernel_params(exec, GraphNodeHandle(graph.0), add, 1, 1, &[c, b, 1]),
                Err(DriverError::INVALID_VALUE),
                "not a node of the graph"
            );
            s.d.exec_destroy(exec).unwrap();
            assert_eq!(s.d.exec_destroy(exec), Err(DriverError::INVALID_VALUE));
            assert_eq!(s.d.graph_launch(exec), Err(DriverError::INVALID_VALUE));
            assert_eq!(
                s.d.exec_set_kernel_params(exec, node, add, 1, 1, &[c, b, 1]),
                Err(DriverError::INVALID_VALUE)
            );

            // An update after the graph is gone breaks the contract: refused and reported.
            let exec = s.d.graph_instantiate(graph).unwrap();
            s.d.graph_destroy(graph).unwrap();
            assert_eq!(s.d.graph_destroy(graph), Err(DriverError::INVALID_VALUE));
            assert_eq!(
                s.d.exec_set_kernel_params(exec, node, add, 1, 1, &[c, b, 1]),
                Err(DriverError::INVALID_VALUE)
            );
            assert_eq!(s.dev.violations().len(), 1, "{:?}", s.dev.violations());

            // A replay of a kernel whose module was unloaded is refused whole.
            s.d.module_unload(s.add_module).unwrap();
            assert_eq!(s.d.graph_launch(exec), Err(DriverError::INVALID_VALUE));
            assert_eq!(s.dev.queued(), 0);
            assert_eq!(s.dev.graph_launches(), 0);
            s.d.exec_destroy(exec).unwrap();
        }
        assert_eq!(s.dev.graphs_live(), 0);
    }

    #[test]
    fn a_fault_at_any_graph_operation_leaves_nothing_behind() {
        let ops = [
            SimOp::CaptureBegin,
            SimOp::CaptureEnd,
            SimOp::GraphInstantiate,
            SimOp::GraphSetParams,
            SimOp::GraphLaunch,
            SimOp::GraphDestroy,
        ];
        for op in ops {
            let mut s = setup();
            s.dev.fail_nth(op, 1, DriverError::OUT_OF_MEMORY);
            let (a, b, c, add) = (s.a, s.b, s.c, s.add);
            let begun = s.d.capture_begin();
            assert_eq!(begun.is_err(), op == SimOp::CaptureBegin, "{op:?}");
            if begun.is_err() {
                // No capture began, so there is none to end and nothing was made.
                assert_eq!(
                    s.d.capture_end(),
                    Err(capture_error(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED))
                );
                assert_eq!(s.dev.graphs_live(), 0);
                continue;
            }
            // SAFETY: recorded; replays below keep `a` and `b` live.
            unsafe { s.d.launch(add, 1, 1, &[b, a, 1]).unwrap() };
            let node = s.d.capture_last_node().unwrap();
            let graph = match s.d.capture_end() {
                Ok(graph) => graph,
                Err(e) => {
                    assert_eq!((op, e), (SimOp::CaptureEnd, DriverError::OUT_OF_MEMORY));
                    assert_eq!(s.dev.graphs_live(), 0);
                    // The capture ended anyway: the stream takes other work again.
                    // SAFETY: `a` and `b` are live and disjoint.
                    unsafe { s.d.copy_dtod(b, a, 4).unwrap() };
                    continue;
                }
            };
            let exec = match s.d.graph_instantiate(graph) {
                Ok(exec) => exec,
                Err(_) => {
                    assert_eq!(op, SimOp::GraphInstantiate);
                    assert_eq!(s.dev.graphs_live(), 1, "the graph only");
                    // SAFETY: destroyed once.
                    unsafe { s.d.graph_destroy(graph).unwrap() };
                    assert_eq!(s.dev.graphs_live(), 0);
                    continue;
                }
            };
            // SAFETY: `node` belongs to the live graph; nothing is queued.
            let set = unsafe {
                s.d.exec_set_kernel_params(exec, node, add, 1, 1, &[c, a, 5])
            };
            assert_eq!(set.is_err(), op == SimOp::GraphSetParams, "{op:?}");
            // SAFETY: `a`, `b`, `c` stay live.
            let launched = unsafe { s.d.graph_launch(exec) };
            assert_eq!(launched.is_err(), op == SimOp::GraphLaunch, "{op:?}");
            assert_eq!(s.dev.queued(), usize::from(launched.is_ok()), "{op:?}");
            assert_eq!(
                s.dev.graph_launches(),
                u64::from(launched.is_ok()),
                "{op:?}"
            );
            s.dev.advance_all();
            if launched.is_ok() {
                // A failed update left the captured parameters in place.
                let (dst, want) = if set.is_ok() { (c, 15) } else { (b, 11) };
                assert_eq!(s.get(dst), want, "{op:?}");
            }
            // SAFETY: destroyed once each (a failed destroy destroyed nothing); every replay
            // has run.
            unsafe {
                if s.d.exec_destroy(exec).is_err() {
                    assert_eq!(op, SimOp::GraphDestroy);
                    assert_eq!(s.dev.graphs_live(), 2, "the failed destroy kept it");
                    s.d.exec_destroy(exec).unwrap();
                }
                s.d.graph_destroy(graph).unwrap();
            }
            assert_eq!(s.dev.graphs_live(), 0, "{op:?}");
            assert!(s.dev.violations().is_empty(), "{op:?}");
        }
    }

    #[test]
    #[should_panic(expected = "simulated driver panic in GraphLaunch")]
    fn graph_operations_can_panic_on_request() {
        let mut s = setup();
        let (graph, _) = s.capture();
        let exec = s.d.graph_instantiate(graph).unwrap();
        s.dev.panic_nth(SimOp::GraphLaunch, 1);
        // SAFETY: `a`, `b`, `c` are live; the call panics before queueing.
        let _ = unsafe { s.d.graph_launch(exec) };
    }
}
