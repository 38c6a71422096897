//! Errors the engine and its routes report.
//!
//! Every failure names what was wrong and the values involved, so a caller can act on it without
//! reading the source. Driver failures keep the CUDA result code and the call that produced it.
//! The enums are `#[non_exhaustive]`: new failure modes are added without breaking matches.

use crate::element::DType;
use cudarc::driver::sys::CUresult;
use std::fmt;

/// A CUDA driver result code other than success.
///
/// It is a plain value: formatting it never calls into the driver, so it works on a machine with
/// no CUDA library and from the simulated device alike.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DriverError(CUresult);

impl DriverError {
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: Self = Self(CUresult::CUDA_ERROR_INVALID_VALUE);
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: Self = Self(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    /// `CUDA_ERROR_LAUNCH_FAILED`: an asynchronous failure of earlier work on the stream.
    pub const LAUNCH_FAILED: Self = Self(CUresult::CUDA_ERROR_LAUNCH_FAILED);
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`: a kernel or copy touched memory it must not.
    pub const ILLEGAL_ADDRESS: Self = Self(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
    /// `CUDA_ERROR_INVALID_CONTEXT`.
    pub const INVALID_CONTEXT: Self = Self(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: Self = Self(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    /// `CUDA_ERROR_UNKNOWN`.
    pub const UNKNOWN: Self = Self(CUresult::CUDA_ERROR_UNKNOWN);

    /// Wraps a raw driver result. `CUDA_SUCCESS` is mapped to `CUDA_ERROR_UNKNOWN`, since success
    /// is not an error.
    pub fn from_raw(code: CUresult) -> Self {
        if code == CUresult::CUDA_SUCCESS {
            Self::UNKNOWN
        } else {
            Self(code)
        }
    }

    /// The raw driver result.
    pub fn raw(self) -> CUresult {
        self.0
    }

    /// The numeric CUDA result code, as `cuGetErrorName` documents it.
    pub fn code(self) -> u32 {
        self.0 as u32
    }

    /// Converts a raw driver result: `Ok(())` for success.
    pub(crate) fn check(code: CUresult) -> Result<(), Self> {
        if code == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(Self(code))
        }
    }
}

impl fmt::Debug for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} ({})", self.0, self.code())
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for DriverError {}

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

/// Everything an engine operation can report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library (`libcuda`) could not be loaded: the machine has no NVIDIA driver.
    #[error("no CUDA driver on this machine: {detail}")]
    NoDriver {
        /// What the loader reported.
        detail: String,
    },
    /// The requested device ordinal does not exist.
    #[error(
        "CUDA device ordinal {ordinal} does not exist: this machine has {count} CUDA device(s)"
    )]
    NoSuchDevice {
        /// The ordinal that was asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A driver call failed.
    #[error("{call} failed: {source}")]
    Driver {
        /// The driver operation, for example `cuMemcpyHtoDAsync`.
        call: &'static str,
        /// The driver's result code.
        source: DriverError,
    },
    /// A shape does not describe the number of elements supplied.
    #[error("shape {shape:?} holds {expected} element(s) but {actual} were supplied")]
    ShapeMismatch {
        /// The requested shape.
        shape: Vec<usize>,
        /// The element count the shape implies.
        expected: usize,
        /// The element count supplied.
        actual: usize,
    },
    /// Two operands of one operation disagree in length.
    #[error("{what}: length {left} does not match length {right}")]
    LengthMismatch {
        /// Which operands.
        what: &'static str,
        /// The first length.
        left: usize,
        /// The second length.
        right: usize,
    },
    /// A size computation overflowed `usize`.
    #[error("{what} overflows: {count} element(s) of {element_bytes} byte(s)")]
    SizeOverflow {
        /// What was being sized.
        what: &'static str,
        /// The element count.
        count: usize,
        /// The size of one element.
        element_bytes: usize,
    },
    /// A value (tensor, pinned buffer, staging lease, pending transfer) belongs to another
    /// engine than the one it was given to. Engines have separate streams (and maybe separate
    /// devices), so using one engine's value on another would race with its pending work.
    #[error("the value belongs to engine #{found} on {found_device}, not to engine #{expected} on {expected_device} (each engine has its own stream)")]
    WrongEngine {
        /// The engine the operation ran on.
        expected: u64,
        /// That engine's device.
        expected_device: DeviceId,
        /// The engine that owns the value.
        found: u64,
        /// That engine's device.
        found_device: DeviceId,
    },
    /// The element type is not served by the operation.
    #[error("{operation} does not support element type {dtype}: {reason}")]
    UnsupportedElement {
        /// The operation.
        operation: &'static str,
        /// The element type.
        dtype: DType,
        /// Why not.
        reason: &'static str,
    },
    /// A zero-length request where at least one element is needed.
    #[error("{what} needs at least one element")]
    ZeroLength {
        /// What was requested.
        what: &'static str,
    },
    /// A vendor library is not installed on this machine.
    #[error("{library} is unavailable on this machine: {detail}")]
    Unavailable {
        /// The library, for example `cuTENSOR`.
        library: &'static str,
        /// What was looked for.
        detail: String,
    },
    /// A device event reported a failure: the work it covers did not complete. Everything that
    /// work may still touch is retained, never freed.
    #[error("the device reported a failure for {what}: {source}")]
    DeviceFault {
        /// The work the event covered.
        what: &'static str,
        /// The driver's result code.
        source: DriverError,
    },
    /// Failures recorded while dropping values, reported at the next boundary.
    #[error("{count} deferred failure(s) while releasing resources; first: {first}")]
    Deferred {
        /// How many failures were recorded.
        count: usize,
        /// The first one.
        first: Box<Error>,
    },
    /// Every slot of the engine's staging ring is leased.
    #[error("all {depth} staging slots of the engine's ring are leased")]
    StagingExhausted {
        /// The ring's depth.
        depth: usize,
    },
    /// The operands of an elementwise operation have different shapes.
    #[error("{operation}: operand shapes {left:?} and {right:?} differ")]
    ShapesDiffer {
        /// The operation.
        operation: &'static str,
        /// The first operand's shape.
        left: Vec<usize>,
        /// The second operand's shape.
        right: Vec<usize>,
    },
    /// Another GPU runtime sharing the device (CubeCL) reported a failure at the boundary.
    #[error("{runtime} failed during {what}: {detail}")]
    Interop {
        /// The runtime, for example `CubeCL`.
        runtime: &'static str,
        /// What the engine was doing.
        what: &'static str,
        /// The runtime's report.
        detail: String,
    },
    /// NVRTC could not compile a kernel. The log is NVRTC's own.
    #[error("NVRTC could not compile kernel {kernel}: {status}; log:\n{log}")]
    Compile {
        /// The kernel (or program) name.
        kernel: String,
        /// NVRTC's result code, by name.
        status: String,
        /// The compilation log.
        log: String,
    },
    /// A vendor library call (cuBLAS, cuSOLVER, cuTENSOR) returned a failure status.
    #[error("{library} call {call} failed with status {status} ({name})")]
    Vendor {
        /// The library, for example `cuBLAS`.
        library: &'static str,
        /// The call, for example `cublasSgemm_v2`.
        call: &'static str,
        /// The numeric status code.
        status: i64,
        /// The status, by name.
        name: String,
    },
    /// An argument of an operation is out of range or inconsistent with another.
    #[error("{operation}: {detail}")]
    InvalidArgument {
        /// The operation.
        operation: &'static str,
        /// What was wrong, naming the values involved.
        detail: String,
    },
    /// A factorisation found the matrix not positive definite.
    #[error("{operation}: the leading minor of order {order} is not positive definite")]
    NotPositiveDefinite {
        /// The operation, for example `cholesky_solve`.
        operation: &'static str,
        /// The order of the first leading minor that is not positive definite (1-based).
        order: i64,
    },
    /// An engine setting is out of range.
    #[error("invalid setting {setting} = {value}: {reason}")]
    InvalidSetting {
        /// The setting's name.
        setting: &'static str,
        /// The value supplied.
        value: usize,
        /// What range is accepted.
        reason: &'static str,
    },
}

impl Error {
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
        move |source| Error::Driver { call, source }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A refused or failed operation that hands back what it was given, as
/// [`TrySendError<T>`](std::sync::mpsc::TrySendError) does: nothing the caller owned is lost on
/// an error.
#[derive(thiserror::Error)]
#[error("{error}")]
pub struct Refused<V> {
    /// What went wrong.
    pub error: Error,
    /// The input, handed back.
    pub input: V,
}

impl<V> Refused<V> {
    /// What went wrong.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The error, dropping the input.
    pub fn into_error(self) -> Error {
        self.error
    }

    /// The input, dropping the error.
    pub fn into_input(self) -> V {
        self.input
    }
}

impl<V> fmt::Debug for Refused<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refused")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<V> From<Refused<V>> for Error {
    fn from(refused: Refused<V>) -> Error {
        refused.error
    }
}
