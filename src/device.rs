//! Which device an engine drives, named in its errors and its values alike: at the base, below
//! every level, so that the errors and the engine name devices with one type. Its public path is
//! `cuferry::engine::DeviceId`.

use std::fmt;

/// Which device an engine drives: the kind and its ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceId {
    pub(crate) kind: DeviceKind,
    pub(crate) ordinal: usize,
    /// Distinguishes simulated devices; zero for real ones (a real ordinal names one device).
    pub(crate) instance: u64,
}

impl DeviceId {
    /// The kind of device.
    pub fn kind(&self) -> DeviceKind {
        self.kind
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DeviceKind::Cuda => write!(f, "CUDA device {}", self.ordinal),
            DeviceKind::Simulated => {
                write!(f, "simulated device {} (#{})", self.ordinal, self.instance)
            }
        }
    }
}

/// The two implementations behind the device seam.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A real GPU through the CUDA driver.
    Cuda,
    /// The deterministic simulated device (feature `sim`).
    Simulated,
}
