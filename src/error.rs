//! Errors the engine and its routes report.
//!
//! Every failure names what was wrong and the values involved, so a caller can act on it without
//! reading the source. Driver failures keep the CUDA result code and the call that produced it.
//! The enums are `#[non_exhaustive]`: new failure modes are added without breaking matches.

use crate::dtype::DType;
use std::fmt;

mod submit;

pub use submit::SubmitError;

/// A CUDA driver result code other than success.
///
/// It is the crate's own type, not cudarc's: it holds the numeric `CUresult` value, so it is a
/// plain value that formats without calling into the driver. That works on a machine with no
/// CUDA library and from the simulated device alike, and the type does not change when the
/// crate moves to another cudarc release. [`code`](Self::code) gives the number and
/// [`name`](Self::name) the `CUDA_ERROR_*` name; `Display` and `Debug` print both, for example
/// `CUDA_ERROR_OUT_OF_MEMORY (2)`.
///
/// ```
/// use cuferry::error::DriverError;
///
/// let e = DriverError::from_code(2);
/// assert_eq!(e, DriverError::OUT_OF_MEMORY);
/// assert_eq!(e.name(), "CUDA_ERROR_OUT_OF_MEMORY");
/// assert_eq!(e.to_string(), "CUDA_ERROR_OUT_OF_MEMORY (2)");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DriverError(u32);

impl DriverError {
    /// `CUDA_ERROR_INVALID_VALUE` (1).
    pub const INVALID_VALUE: Self = Self(1);
    /// `CUDA_ERROR_OUT_OF_MEMORY` (2).
    pub const OUT_OF_MEMORY: Self = Self(2);
    /// `CUDA_ERROR_LAUNCH_FAILED` (719): an asynchronous failure of earlier work on the stream.
    pub const LAUNCH_FAILED: Self = Self(719);
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` (700): a kernel or copy touched memory it must not.
    pub const ILLEGAL_ADDRESS: Self = Self(700);
    /// `CUDA_ERROR_INVALID_CONTEXT` (201).
    pub const INVALID_CONTEXT: Self = Self(201);
    /// `CUDA_ERROR_NOT_SUPPORTED` (801).
    pub const NOT_SUPPORTED: Self = Self(801);
    /// `CUDA_ERROR_UNKNOWN` (999).
    pub const UNKNOWN: Self = Self(999);

    /// The error with the numeric CUDA result code `code`, for example one a raw scope's own
    /// driver call returned. `0` (`CUDA_SUCCESS`) is mapped to [`UNKNOWN`](Self::UNKNOWN), since
    /// success is not an error. Numbers this crate does not know are kept as they are (their
    /// [`name`](Self::name) is `CUDA_ERROR_UNRECOGNIZED`).
    pub const fn from_code(code: u32) -> Self {
        if code == 0 {
            Self::UNKNOWN
        } else {
            Self(code)
        }
    }

    /// The numeric CUDA result code, as `cuGetErrorName` documents it. Never `0`.
    pub const fn code(self) -> u32 {
        self.0
    }

    /// The result code's `CUDA_ERROR_*` name, for example `CUDA_ERROR_OUT_OF_MEMORY`, or
    /// `CUDA_ERROR_UNRECOGNIZED` for a number the crate does not know. The names cover every
    /// `CUresult` value of the CUDA headers the crate's cudarc release binds (CUDA 11.4 to 13.x).
    pub fn name(self) -> &'static str {
        match RESULT_NAMES.binary_search_by_key(&self.0, |&(code, _)| code) {
            Ok(i) => RESULT_NAMES[i].1,
            Err(_) => "CUDA_ERROR_UNRECOGNIZED",
        }
    }
}

impl fmt::Debug for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for DriverError {}

/// Every `CUresult` error value that cudarc 0.19's driver bindings know (the union over the CUDA
/// 11.4 to 13.x headers it binds), sorted by code for [`DriverError::name`]'s binary search.
/// Written out from cudarc's `cudaError_enum`; the unit tests check the order and compare samples
/// with cudarc's enum.
static RESULT_NAMES: [(u32, &str); 105] = [
    (1, "CUDA_ERROR_INVALID_VALUE"),
    (2, "CUDA_ERROR_OUT_OF_MEMORY"),
    (3, "CUDA_ERROR_NOT_INITIALIZED"),
    (4, "CUDA_ERROR_DEINITIALIZED"),
    (5, "CUDA_ERROR_PROFILER_DISABLED"),
    (6, "CUDA_ERROR_PROFILER_NOT_INITIALIZED"),
    (7, "CUDA_ERROR_PROFILER_ALREADY_STARTED"),
    (8, "CUDA_ERROR_PROFILER_ALREADY_STOPPED"),
    (34, "CUDA_ERROR_STUB_LIBRARY"),
    (36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER"),
    (46, "CUDA_ERROR_DEVICE_UNAVAILABLE"),
    (47, "CUDA_ERROR_MULTICAST_RESOURCE_FULL"),
    (100, "CUDA_ERROR_NO_DEVICE"),
    (101, "CUDA_ERROR_INVALID_DEVICE"),
    (102, "CUDA_ERROR_DEVICE_NOT_LICENSED"),
    (200, "CUDA_ERROR_INVALID_IMAGE"),
    (201, "CUDA_ERROR_INVALID_CONTEXT"),
    (202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT"),
    (205, "CUDA_ERROR_MAP_FAILED"),
    (206, "CUDA_ERROR_UNMAP_FAILED"),
    (207, "CUDA_ERROR_ARRAY_IS_MAPPED"),
    (208, "CUDA_ERROR_ALREADY_MAPPED"),
    (209, "CUDA_ERROR_NO_BINARY_FOR_GPU"),
    (210, "CUDA_ERROR_ALREADY_ACQUIRED"),
    (211, "CUDA_ERROR_NOT_MAPPED"),
    (212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY"),
    (213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER"),
    (214, "CUDA_ERROR_ECC_UNCORRECTABLE"),
    (215, "CUDA_ERROR_UNSUPPORTED_LIMIT"),
    (216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE"),
    (217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"),
    (218, "CUDA_ERROR_INVALID_PTX"),
    (219, "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT"),
    (220, "CUDA_ERROR_NVLINK_UNCORRECTABLE"),
    (221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND"),
    (222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
    (223, "CUDA_ERROR_JIT_COMPILATION_DISABLED"),
    (224, "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY"),
    (225, "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC"),
    (226, "CUDA_ERROR_CONTAINED"),
    (227, "CUDA_ERROR_INSUFFICIENT_LOADER_VERSION"),
    (300, "CUDA_ERROR_INVALID_SOURCE"),
    (301, "CUDA_ERROR_FILE_NOT_FOUND"),
    (302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND"),
    (303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED"),
    (304, "CUDA_ERROR_OPERATING_SYSTEM"),
    (400, "CUDA_ERROR_INVALID_HANDLE"),
    (401, "CUDA_ERROR_ILLEGAL_STATE"),
    (402, "CUDA_ERROR_LOSSY_QUERY"),
    (500, "CUDA_ERROR_NOT_FOUND"),
    (600, "CUDA_ERROR_NOT_READY"),
    (700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
    (701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"),
    (702, "CUDA_ERROR_LAUNCH_TIMEOUT"),
    (703, "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING"),
    (704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"),
    (705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED"),
    (708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE"),
    (709, "CUDA_ERROR_CONTEXT_IS_DESTROYED"),
    (710, "CUDA_ERROR_ASSERT"),
    (711, "CUDA_ERROR_TOO_MANY_PEERS"),
    (712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"),
    (713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"),
    (714, "CUDA_ERROR_HARDWARE_STACK_ERROR"),
    (715, "CUDA_ERROR_ILLEGAL_INSTRUCTION"),
    (716, "CUDA_ERROR_MISALIGNED_ADDRESS"),
    (717, "CUDA_ERROR_INVALID_ADDRESS_SPACE"),
    (718, "CUDA_ERROR_INVALID_PC"),
    (719, "CUDA_ERROR_LAUNCH_FAILED"),
    (720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"),
    (721, "CUDA_ERROR_TENSOR_MEMORY_LEAK"),
    (800, "CUDA_ERROR_NOT_PERMITTED"),
    (801, "CUDA_ERROR_NOT_SUPPORTED"),
    (802, "CUDA_ERROR_SYSTEM_NOT_READY"),
    (803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"),
    (804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"),
    (805, "CUDA_ERROR_MPS_CONNECTION_FAILED"),
    (806, "CUDA_ERROR_MPS_RPC_FAILURE"),
    (807, "CUDA_ERROR_MPS_SERVER_NOT_READY"),
    (808, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED"),
    (809, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED"),
    (810, "CUDA_ERROR_MPS_CLIENT_TERMINATED"),
    (811, "CUDA_ERROR_CDP_NOT_SUPPORTED"),
    (812, "CUDA_ERROR_CDP_VERSION_MISMATCH"),
    (900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
    (901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
    (902, "CUDA_ERROR_STREAM_CAPTURE_MERGE"),
    (903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED"),
    (904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED"),
    (905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"),
    (906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"),
    (907, "CUDA_ERROR_CAPTURED_EVENT"),
    (908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"),
    (909, "CUDA_ERROR_TIMEOUT"),
    (910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE"),
    (911, "CUDA_ERROR_EXTERNAL_DEVICE"),
    (912, "CUDA_ERROR_INVALID_CLUSTER_SIZE"),
    (913, "CUDA_ERROR_FUNCTION_NOT_LOADED"),
    (914, "CUDA_ERROR_INVALID_RESOURCE_TYPE"),
    (915, "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"),
    (916, "CUDA_ERROR_KEY_ROTATION"),
    (917, "CUDA_ERROR_STREAM_DETACHED"),
    (918, "CUDA_ERROR_GRAPH_RECAPTURE_FAILURE"),
    (919, "CUDA_ERROR_FABRIC_NOT_READY"),
    (999, "CUDA_ERROR_UNKNOWN"),
];

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
    /// A byte size is larger than memory can be addressed (`isize::MAX` bytes).
    #[error("{what} of {count} element(s) of {element_bytes} byte(s) exceeds the addressable limit of {} bytes", isize::MAX)]
    SizeOverflow {
        /// What was being sized.
        what: &'static str,
        /// The element count.
        count: usize,
        /// The size of one element.
        element_bytes: usize,
    },
    /// A shape whose element count (the product of its dimensions, none of them zero) does not
    /// fit in `usize`.
    #[error(
        "shape {shape:?} holds more elements than fit in usize ({})",
        usize::MAX
    )]
    ShapeOverflow {
        /// The shape.
        shape: Vec<usize>,
    },
    /// A value (tensor, pinned buffer, staging lease, pending transfer) belongs to another
    /// engine than the one it was given to. Engines have separate streams (and maybe separate
    /// devices), so using one engine's value on another would race with its pending work.
    #[error("the value belongs to engine #{found} on {found_device}, not to engine #{expected} on {expected_device} (each engine has its own streams)")]
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
    /// A traced computation is ill-typed: operands of different element types or ranks, or a
    /// scalar of another type than its tensor. Reported when the operation is traced.
    #[error("{operation}: {detail}")]
    Trace {
        /// The traced operation.
        operation: &'static str,
        /// What did not match.
        detail: String,
    },
    /// A traced computation cannot be compiled for the given input specifications: an input
    /// without a specification, a specification that does not match its input, or shapes that
    /// do not fit the operations.
    #[error("cannot compile the program: {detail}")]
    ProgramSpec {
        /// What was wrong, naming the values involved.
        detail: String,
    },
    /// An input handed to a prepared program does not match what the program was compiled for.
    /// Nothing was run.
    #[error("input {index} of the prepared program: expected {expected}, got {found}")]
    ProgramInput {
        /// The input's position.
        index: usize,
        /// What the program was compiled for (element type and shape, or the input count).
        expected: String,
        /// What was given.
        found: String,
    },
    /// Work on one device cannot be ordered after, or reach, work or memory of another: separate
    /// simulated machines share no clock, a real and a simulated device share nothing at all, and
    /// devices without a peer link cannot copy between each other directly.
    #[error("{to} cannot reach {from}: {reason}")]
    Unreachable {
        /// The device whose work was to be reached.
        from: DeviceId,
        /// The device that was to reach it.
        to: DeviceId,
        /// Why not.
        reason: &'static str,
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
    /// An engine call, or the release of one of its values, made inside a wake: the device's
    /// callback (on CUDA the driver's callback thread, where the driver refuses every call).
    /// Refused calls queue nothing; a value dropped there is leaked (never freed under the
    /// device) and this is reported at the engine's next `flush` or `synchronize`. A wake may
    /// only signal (wake a task, send on a channel, set a flag); the woken task calls the engine.
    #[error(
        "{what} inside a wake, the device's callback, where the driver refuses every call: a \
         wake may only signal, and the task it wakes calls the engine"
    )]
    InDeviceCallback {
        /// What was refused: an engine call, or a value's release (leaked).
        what: &'static str,
    },
}

impl Error {
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
        move |source| Error::Driver { call, source }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_names_are_sorted_unique_and_well_formed() {
        for pair in RESULT_NAMES.windows(2) {
            assert!(pair[0].0 < pair[1].0, "{:?} before {:?}", pair[0], pair[1]);
        }
        let mut names: Vec<_> = RESULT_NAMES.iter().map(|&(_, name)| name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), RESULT_NAMES.len(), "a name appears twice");
        assert!(names.iter().all(|name| name.starts_with("CUDA_ERROR_")));
    }

    #[test]
    fn every_listed_code_names_itself() {
        for &(code, name) in &RESULT_NAMES {
            let e = DriverError::from_code(code);
            assert_eq!((e.code(), e.name()), (code, name));
            assert_eq!(e.to_string(), format!("{name} ({code})"));
        }
    }

    #[test]
    fn constants_success_and_unknown_numbers() {
        let consts = [
            (DriverError::INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"),
            (DriverError::OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"),
            (DriverError::LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED"),
            (DriverError::ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"),
            (DriverError::INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"),
            (DriverError::NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"),
            (DriverError::UNKNOWN, "CUDA_ERROR_UNKNOWN"),
        ];
        for (e, name) in consts {
            assert_eq!(e.name(), name);
        }
        assert_eq!(
            DriverError::from_code(0),
            DriverError::UNKNOWN,
            "success is no error"
        );
        let odd = DriverError::from_code(123_456);
        assert_eq!(odd.code(), 123_456);
        assert_eq!(odd.name(), "CUDA_ERROR_UNRECOGNIZED");
        assert_eq!(format!("{odd:?}"), "CUDA_ERROR_UNRECOGNIZED (123456)");
        assert_eq!(
            format!("{:?}", DriverError::OUT_OF_MEMORY),
            "CUDA_ERROR_OUT_OF_MEMORY (2)"
        );
    }
}
