//! The kernel cache: the elementwise kernels an engine has compiled, by what they compute.
//!
//! Each kernel is compiled with NVRTC and loaded the first time an engine needs it, then kept
//! until the engine is dropped, so steady-state calls cost one launch. Every module carries the
//! emulation of its kernel, for devices that cannot run PTX. The cache is an engine part
//! (`core::parts`): the engine holds it behind its lock, made on first use, and unloads its
//! modules last at teardown, once the streams are idle. It knows only the driver seam, the part
//! trait and the kernels' own descriptions (`spec`, `source`, `emulate`, `fused`, `gather`).

#[cfg(any(test, feature = "sim"))]
use super::emulate::ElementwiseEmulation;
#[cfg(any(test, feature = "sim"))]
use super::fused::FusedEmulation;
use super::fused::FusedKernel;
#[cfg(all(any(test, feature = "sim"), any(test, feature = "dlpack")))]
use super::gather::GatherEmulation;
#[cfg(any(test, feature = "dlpack"))]
use super::gather::GatherKernel;
use super::source;
use super::spec::ElementwiseSpec;
use crate::core::parts::{Part, Teardown};
use crate::driver::Driver;
use crate::driver::launch::{FunctionHandle, ModuleHandle, ModuleSource};
use crate::error::{Error, Result};
use crate::ledger::Ledger;
use std::collections::HashMap;

/// The compiled elementwise kernels of one engine, by what they compute: the eager kernels by
/// spec, the fused kernels by description, the strided gathers by element size and rank.
#[derive(Default)]
pub(crate) struct KernelCache {
    entries: HashMap<ElementwiseSpec, (ModuleHandle, FunctionHandle)>,
    fused: HashMap<FusedKernel, (ModuleHandle, FunctionHandle)>,
    #[cfg(any(test, feature = "dlpack"))]
    gather: HashMap<GatherKernel, (ModuleHandle, FunctionHandle)>,
}

/// Compiles and loads `source` and looks up its kernel, named as the module.
fn load(
    driver: &mut dyn Driver,
    source: &ModuleSource<'_>,
) -> Result<(ModuleHandle, FunctionHandle)> {
    let module = driver.module_compile(source)?;
    match driver.module_function(module, source.name) {
        Ok(function) => Ok((module, function)),
        Err(error) => {
            // SAFETY: the module was loaded just above, nothing was launched from it, and it is
            // not cached, so it is unloaded exactly once.
            let _ = unsafe { driver.module_unload(module) };
            Err(Error::Driver {
                call: "cuModuleGetFunction",
                source: error,
            })
        }
    }
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
        let entry = load(
            driver,
            &ModuleSource {
                name: &name,
                cuda: &cuda,
                #[cfg(any(test, feature = "sim"))]
                emulation: Some(std::sync::Arc::new(ElementwiseEmulation::new(spec))),
            },
        )?;
        self.entries.insert(spec, entry);
        Ok(entry.1)
    }

    /// The fused kernel `kernel` describes, compiling and loading it the first time this
    /// description is asked for. Its launch takes [`FusedKernel::params`] over
    /// [`FusedKernel::grid`] blocks of [`FusedKernel::BLOCK`] threads.
    ///
    /// The description must be well formed ([`FusedKernel::check`]).
    pub(crate) fn fused(
        &mut self,
        driver: &mut dyn Driver,
        kernel: &FusedKernel,
    ) -> Result<FunctionHandle> {
        if let Some(&(_, function)) = self.fused.get(kernel) {
            return Ok(function);
        }
        debug_assert_eq!(kernel.check(), Ok(()));
        let name = kernel.name();
        let cuda = kernel.source();
        let entry = load(
            driver,
            &ModuleSource {
                name: &name,
                cuda: &cuda,
                #[cfg(any(test, feature = "sim"))]
                emulation: Some(std::sync::Arc::new(FusedEmulation::new(kernel.clone()))),
            },
        )?;
        self.fused.insert(kernel.clone(), entry);
        Ok(entry.1)
    }

    #[cfg(any(test, feature = "dlpack"))]
    /// The strided gather `kernel` names, compiling and loading it on first use. Its launch
    /// takes [`GatherKernel::params`] over [`GatherKernel::grid`] blocks of
    /// [`BLOCK`](super::spec::BLOCK) threads.
    pub(crate) fn gather(
        &mut self,
        driver: &mut dyn Driver,
        kernel: GatherKernel,
    ) -> Result<FunctionHandle> {
        if let Some(&(_, function)) = self.gather.get(&kernel) {
            return Ok(function);
        }
        let name = kernel.name();
        let cuda = kernel.source();
        let entry = load(
            driver,
            &ModuleSource {
                name: &name,
                cuda: &cuda,
                #[cfg(any(test, feature = "sim"))]
                emulation: Some(std::sync::Arc::new(GatherEmulation::new(kernel))),
            },
        )?;
        self.gather.insert(kernel, entry);
        Ok(entry.1)
    }

    /// How many kernels are cached, eager, fused and gathers.
    pub(crate) fn len(&self) -> usize {
        #[cfg(any(test, feature = "dlpack"))]
        let gathers = self.gather.len();
        #[cfg(not(any(test, feature = "dlpack")))]
        let gathers = 0;
        self.entries.len() + self.fused.len() + gathers
    }
}

impl Part for KernelCache {
    /// Last, after the library handles (which come after the core's events).
    const TEARDOWN: Teardown = Teardown::AfterEvents(1);

    /// Unloads every module; a refused unload leaves the module with the driver.
    fn teardown(&mut self, driver: &mut dyn Driver, _ledger: &mut Ledger) {
        let eager = self.entries.drain().map(|(_, entry)| entry);
        let fused = self.fused.drain().map(|(_, entry)| entry);
        #[cfg(any(test, feature = "dlpack"))]
        let fused = fused.chain(self.gather.drain().map(|(_, entry)| entry));
        for (module, _) in eager.chain(fused) {
            // SAFETY: each cached module is unloaded once (drained from the cache); a part is
            // torn down only once the streams are proven idle, so no launch of its kernel is
            // pending.
            let _ = unsafe { driver.module_unload(module) };
        }
    }
}
