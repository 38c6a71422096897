//! Test bodies written once and run on both devices: each body takes a [`Device`] and opens its
//! engines through it. The simulator binary (`tests/sim/main.rs`) runs every body as a plain
//! test on the simulated device; the GPU binary (`tests/gpu/main.rs`) runs the same body as an
//! `#[ignore = "needs a CUDA device"]` test on device 0. The [`bodies!`] macro writes the test
//! functions, named as the bodies are, so a test is found by one name on both sides. Tests that
//! need the simulator's fault injection or clock stay in `tests/sim/` and say so.

#![allow(dead_code)]

pub(crate) mod awaiting;
pub(crate) mod broadcast;
#[cfg(feature = "safetensors")]
pub(crate) mod checkpoint;
#[cfg(feature = "dlpack")]
pub(crate) mod dlpack;
pub(crate) mod engine;
pub(crate) mod graphs;
pub(crate) mod handoff;
pub(crate) mod kernels;
pub(crate) mod lifecycle;
pub(crate) mod peer;
pub(crate) mod pending;
pub(crate) mod registered;
pub(crate) mod signal;
pub(crate) mod staging;
pub(crate) mod transfers;
pub(crate) mod vendor;

use cuferry::CudaEngine;
use cuferry::sim::{SimConfig, SimDevice};

/// The device a body runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Device {
    /// A fresh simulated device (its default configuration) for each engine set.
    Sim,
    /// CUDA device 0.
    Gpu,
}

impl Device {
    /// One engine on this device.
    pub(crate) fn engine(self) -> CudaEngine {
        match self {
            Device::Sim => CudaEngine::simulated(SimConfig::default()),
            Device::Gpu => CudaEngine::open(0).expect("a CUDA device at ordinal 0"),
        }
    }

    /// `n` engines on one device (one simulated device, or CUDA device 0 opened `n` times).
    pub(crate) fn engines(self, n: usize) -> Vec<CudaEngine> {
        match self {
            Device::Sim => {
                let sim = SimDevice::new(SimConfig::default());
                (0..n)
                    .map(|_| CudaEngine::simulated_on_device(&sim, 0).unwrap())
                    .collect()
            }
            Device::Gpu => (0..n).map(|_| self.engine()).collect(),
        }
    }

    /// On the simulated device, asserts it saw no rule broken (`SimDevice::violations`); on a
    /// GPU there is nothing to read, and this checks nothing.
    pub(crate) fn no_violations(engine: &CudaEngine) {
        if let Some(sim) = engine.sim() {
            assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        }
    }
}

/// Writes one `#[test]` per body: `bodies!(sim; module::{name, ...})` on the simulated device,
/// `bodies!(gpu; module::{name, ...})` ignored unless a CUDA device is asked for. Each module
/// names its bodies once, in its own `tests!` macro, which both binaries call
/// (`crate::bodies::module::tests!(sim)`), so the two run the same list.
#[macro_export]
macro_rules! bodies {
    (sim; $module:ident :: { $($name:ident),* $(,)? }) => {
        $(
            #[test]
            fn $name() {
                $crate::bodies::$module::$name($crate::bodies::Device::Sim)
            }
        )*
    };
    (gpu; $module:ident :: { $($name:ident),* $(,)? }) => {
        $(
            #[test]
            #[ignore = "needs a CUDA device"]
            fn $name() {
                $crate::bodies::$module::$name($crate::bodies::Device::Gpu)
            }
        )*
    };
}
