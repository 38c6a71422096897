//! The kernel half of the seam on the simulated device.
//!
//! The simulator cannot run PTX. It accepts a module only when the module carries an
//! [`Emulation`] of its kernel (the crate's elementwise kernels register theirs), and a launch
//! queues a job that runs the emulation against the device's memory when the device clock
//! reaches it, so a kernel's output is unwritten until then, exactly as on a GPU. What the
//! emulation touches outside every live allocation is recorded as a violation, and what it reads
//! and writes inside them is checked for races against the other lanes like any job's accesses.
//! Any other module is refused with a typed [`SetupError::Unavailable`](crate::error::SetupError::Unavailable). While the compute stream
//! captures, a launch is recorded into the capture instead of queued (see the graph half).

use super::{Job, SimDriver, SimOp, State};
use crate::driver::launch::{
    DeviceMemory, Emulation, FunctionHandle, Launch, ModuleHandle, ModuleSource,
};
use crate::driver::{DevicePtr, Lane};
use crate::error::{DriverError, Error, SetupError};
use std::sync::Arc;

impl State {
    /// The emulation a function handle runs (one kernel per module: the handle is the module's).
    pub(super) fn emulation(
        &self,
        function: FunctionHandle,
    ) -> Result<Arc<dyn Emulation>, DriverError> {
        self.modules
            .get(&function.0)
            .map(Arc::clone)
            .ok_or(DriverError::INVALID_VALUE)
    }
}

/// What an emulation reads and writes: the device's memory as of the jobs that have run. Each
/// access counts as one of the running launch's, for the race checker.
impl DeviceMemory for State {
    fn read(&mut self, ptr: DevicePtr, bytes: usize) -> Option<Vec<u8>> {
        self.access(ptr, false);
        self.block_mut(ptr, bytes).map(|s| s.to_vec())
    }

    fn write(&mut self, ptr: DevicePtr, data: &[u8]) -> bool {
        self.access(ptr, true);
        match self.block_mut(ptr, data.len()) {
            Some(out) => {
                out.copy_from_slice(data);
                true
            }
            None => false,
        }
    }
}

impl Launch for SimDriver {
    fn module_compile(&mut self, source: &ModuleSource<'_>) -> Result<ModuleHandle, Error> {
        let mut s = self.lock();
        s.enter(SimOp::ModuleLoad)
            .map_err(Error::driver("cuModuleLoadData"))?;
        let Some(emulation) = &source.emulation else {
            return Err(Error::Setup(SetupError::Unavailable {
                library: "NVRTC",
                detail: format!(
                    "the simulated device cannot run PTX; it runs only modules that carry an emulation, not {}",
                    source.name
                ),
            }));
        };
        let id = s.next_module;
        s.next_module += 1;
        s.modules.insert(id, Arc::clone(emulation));
        Ok(ModuleHandle(id))
    }

    fn module_function(
        &mut self,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError> {
        let s = self.lock();
        s.alive()?;
        match s.modules.get(&module.0) {
            // One kernel per module: the function handle is the module's.
            Some(emulation) if emulation.name() == name => Ok(FunctionHandle(module.0)),
            _ => Err(DriverError::from_raw(
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_FOUND,
            )),
        }
    }

    unsafe fn module_unload(&mut self, module: ModuleHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.alive()?;
        s.modules
            .remove(&module.0)
            .map(|_| ())
            .ok_or(DriverError::INVALID_VALUE)
    }

    unsafe fn launch(
        &mut self,
        function: FunctionHandle,
        _grid: u32,
        _block: u32,
        params: &[u64],
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::Launch)?;
        let emulation = s.emulation(function)?;
        let stream = self.stream(Lane::Compute);
        if s.capture_launch(stream, function, &emulation, params)? {
            return Ok(());
        }
        s.push(
            stream,
            Job::Launch {
                emulation,
                params: params.to_vec(),
            },
        );
        Ok(())
    }
}
