//! The kernel half of the seam on the simulated device.
//!
//! The simulator cannot run PTX. It accepts a module only when it holds one of the crate's
//! built-in elementwise kernels, and a launch queues a job that emulates the kernel on the
//! device's memory (`kernels::emulate`) when the device clock reaches it, so a kernel's output is
//! unwritten until then, exactly as on a GPU. Any other module is refused with a typed
//! [`Error::Unavailable`].

use super::{Job, SimDriver, SimOp, State};
use crate::driver::launch::{
    ElementwiseArgs, ElementwiseOp, ElementwiseSpec, FunctionHandle, Launch, ModuleHandle,
    ModuleSource,
};
use crate::error::{DriverError, Error};

impl State {
    /// Runs a queued elementwise kernel: reads its operands, computes, writes its output.
    pub(super) fn run_elementwise(&mut self, spec: ElementwiseSpec, args: &ElementwiseArgs) {
        let Ok(len) = usize::try_from(args.len) else {
            self.violations
                .push(format!("elementwise launch of {} elements", args.len));
            return;
        };
        let in_bytes = len * spec.input.size_bytes();
        let out_bytes = len * spec.output.size_bytes();
        let reads_a = spec.op != ElementwiseOp::Fill;
        let reads_b = matches!(
            spec.op,
            ElementwiseOp::Add | ElementwiseOp::Sub | ElementwiseOp::Mul | ElementwiseOp::Div
        );
        let mut operand = |used: bool, ptr| -> Option<Vec<u8>> {
            if !used {
                return Some(Vec::new());
            }
            self.block_mut(ptr, in_bytes).map(|s| s.to_vec())
        };
        let (Some(a), Some(b)) = (operand(reads_a, args.a), operand(reads_b, args.b)) else {
            self.violations.push(format!(
                "{:?} kernel reads unmapped device memory ({:#x}, {:#x}, {in_bytes} bytes)",
                spec, args.a, args.b
            ));
            return;
        };
        let Some(result) = crate::kernels::emulate::run(spec, &a, &b, args.scalar, len) else {
            self.violations
                .push(format!("{spec:?} is not a kernel the crate builds"));
            return;
        };
        match self.block_mut(args.out, out_bytes) {
            Some(out) => out.copy_from_slice(&result),
            None => self.violations.push(format!(
                "{spec:?} kernel writes unmapped device memory {:#x}+{out_bytes}",
                args.out
            )),
        }
    }
}

impl Launch for SimDriver {
    fn module_compile(&mut self, source: &ModuleSource<'_>) -> Result<ModuleHandle, Error> {
        let mut s = self.lock();
        s.enter(SimOp::ModuleLoad)
            .map_err(Error::driver("cuModuleLoadData"))?;
        let Some(spec) = source.builtin else {
            return Err(Error::Unavailable {
                library: "NVRTC",
                detail: format!(
                    "the simulated device cannot run PTX; it emulates only the crate's built-in kernels, not {}",
                    source.name
                ),
            });
        };
        let id = s.next_module;
        s.next_module += 1;
        s.modules
            .insert(id, (spec, crate::kernels::source::kernel_name(spec)));
        Ok(ModuleHandle(id))
    }

    fn module_function(
        &mut self,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError> {
        let s = self.lock();
        match s.modules.get(&module.0) {
            // One kernel per module: the function handle is the module's.
            Some((_, kernel)) if kernel == name => Ok(FunctionHandle(module.0)),
            _ => Err(DriverError::from_raw(
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_FOUND,
            )),
        }
    }

    unsafe fn module_unload(&mut self, module: ModuleHandle) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.modules
            .remove(&module.0)
            .map(|_| ())
            .ok_or(DriverError::INVALID_VALUE)
    }

    unsafe fn launch_elementwise(
        &mut self,
        function: FunctionHandle,
        args: &ElementwiseArgs,
    ) -> Result<(), DriverError> {
        let mut s = self.lock();
        s.enter(SimOp::Launch)?;
        let spec = s
            .modules
            .get(&function.0)
            .map(|(spec, _)| *spec)
            .ok_or(DriverError::INVALID_VALUE)?;
        s.push(Job::Elementwise { spec, args: *args });
        Ok(())
    }
}
