//! The kernel cache: the elementwise kernels an engine has compiled, by what they compute.
//!
//! Each kernel is compiled with NVRTC and loaded the first time an engine needs it, then kept
//! until the engine is dropped, so steady-state calls cost one launch. Every module carries the
//! emulation of its kernel, for devices that cannot run PTX. This is engine state, held by the
//! engine and locked with the driver; it knows only the driver seam and the kernels' own
//! descriptions (`spec`, `source`, `emulate`).

#[cfg(any(test, feature = "sim"))]
use super::emulate::ElementwiseEmulation;
use super::source;
use super::spec::ElementwiseSpec;
use crate::driver::launch::{FunctionHandle, ModuleHandle, ModuleSource};
use crate::driver::Driver;
use crate::error::{Error, Result};
use std::collections::HashMap;

/// The compiled elementwise kernels of one engine, by what they compute.
#[derive(Default)]
pub(crate) struct KernelCache {
    entries: HashMap<ElementwiseSpec, (ModuleHandle, FunctionHandle)>,
}

impl KernelCache {
    /// The kernel for `spec`, compiling and loading it on first use.
    pub(crate) fn function(
        &mut self,
        driver: &mut dyn Driver,
        spec: ElementwiseSpec,
    ) -> Result<FunctionHandle> {
        if let Some(&(_, function)) = self.entries.get(&spec) {
            return Ok(function);
        }
        let name = source::kernel_name(spec);
        let cuda = source::module_source(spec);
        let module = driver.module_compile(&ModuleSource {
            name: &name,
            cuda: &cuda,
            #[cfg(any(test, feature = "sim"))]
            emulation: Some(std::sync::Arc::new(ElementwiseEmulation::new(spec))),
        })?;
        let function = match driver.module_function(module, &name) {
            Ok(function) => function,
            Err(source) => {
                // SAFETY: the module was loaded just above, nothing was launched from it, and
                // it is not cached, so it is unloaded exactly once.
                let _ = unsafe { driver.module_unload(module) };
                return Err(Error::Driver {
                    call: "cuModuleGetFunction",
                    source,
                });
            }
        };
        self.entries.insert(spec, (module, function));
        Ok(function)
    }

    /// How many kernels are cached.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Unloads every module. Call only once the stream is idle (no launch pending).
    pub(crate) fn release(&mut self, driver: &mut dyn Driver) {
        for (_, (module, _)) in self.entries.drain() {
            // SAFETY: each cached module is unloaded once (drained from the cache); the caller
            // guarantees the stream is idle, so no launch of its kernel is pending.
            let _ = unsafe { driver.module_unload(module) };
        }
    }
}
