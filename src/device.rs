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

/// A device's memory as its driver reports it, and what an engine's memory pool holds of it:
/// [`CudaEngine::device_memory`](crate::CudaEngine::device_memory), and the figures an
/// out-of-memory error carries ([`OutOfMemory`](crate::error::OutOfMemory)).
///
/// An engine allocates from a stream-ordered pool of its own that keeps memory freed for
/// reuse rather than giving it back to the device at each free (a free and an allocation in a
/// loop then cost no driver release); so `pool_reserved` may exceed `pool_in_use`, and
/// [`CudaEngine::trim_device_pool`](crate::CudaEngine::trim_device_pool) gives the difference
/// back. On the simulator the pool keeps nothing unused: both are the bytes allocated on the
/// device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceMemory {
    /// The device's free bytes (`cuMemGetInfo`): what no process holds.
    pub free: u64,
    /// The device's bytes in all.
    pub total: u64,
    /// The bytes the engine's pool holds from the device: in tensors, and kept for reuse.
    pub pool_reserved: u64,
    /// The bytes of the pool's live allocations.
    pub pool_in_use: u64,
}

/// `bytes` for a person: in GiB, MiB or KiB with two decimals, or bytes.
pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    UNITS.iter().find(|&&(unit, _)| bytes >= unit).map_or_else(
        || format!("{bytes} B"),
        |&(unit, name)| format!("{:.2} {name}", bytes as f64 / unit as f64),
    )
}
