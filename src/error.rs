//! Errors the engine and its routes report, on one axis: whose problem it is, and so what the
//! caller can do about it.
//!
//! [`Error`] is what every operation returns, whatever the feature (a transfer, a kernel, a
//! checkpoint, a collective, a share). The device's own failures are its variants: a driver call
//! that failed at once ([`Error::Driver`]), queued work that failed on the device
//! ([`Error::DeviceFault`]) and failures found later ([`Error::Deferred`]). The rest is one enum
//! per fault, each wrapped by one variant of [`Error`] and converted into it by `?`:
//!
//! - [`UsageError`]: what the caller passed (another engine's value, mismatched lengths, shapes
//!   or element types, an out-of-range setting, rank or argument, a name a checkpoint lacks, a
//!   call from a device callback): fix the call;
//! - [`SetupError`]: the machine or its launcher (no driver, no such device, a missing library,
//!   devices that cannot reach each other, a launcher variable, a handle of another host):
//!   fix the setup;
//! - [`LibraryError`]: a vendor library's status, NVRTC, the solver's verdict, CubeCL;
//! - [`ProgramError`]: tracing, compiling and feeding prepared programs;
//! - [`StagingError`]: the engine's staging ring;
//! - [`IoError`]: the operating system, on a file or a socket: perhaps retry;
//! - [`MalformedError`]: a file, a peer or a launcher said what is not so (a bad header, bytes
//!   that are not the protocol, a claim past what the driver or the kernel measures): distrust
//!   the source;
//! - [`PeerError`]: another process or rank did not do its part (refused, closed, exited, did
//!   not arrive, answer or release in time): the job, not this call, is at fault.
//!
//! Every failure names what was wrong and the values involved, in typed fields, so a caller can
//! act on it without reading the source or parsing a message; strings are kept only for text
//! that comes from outside the crate (a loader's, NVRTC's or a library's report). Driver
//! failures keep the CUDA result code and the call that produced it. Every enum is
//! `#[non_exhaustive]`: new failure modes are added without breaking matches.

use crate::device::DeviceId;
use crate::dtype::DType;
use std::fmt;

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
    /// `CUDA_ERROR_INVALID_HANDLE`: a handle (a stream's, an event's) that names nothing.
    pub const INVALID_HANDLE: Self = Self(400);
    /// `CUDA_ERROR_NOT_SUPPORTED` (801).
    pub const NOT_SUPPORTED: Self = Self(801);
    /// `CUDA_ERROR_UNKNOWN` (999).
    pub const UNKNOWN: Self = Self(999);

    /// The error with the numeric CUDA result code `code`, for example one a raw scope's own
    /// driver call returned. `0` (`CUDA_SUCCESS`) is mapped to [`UNKNOWN`](Self::UNKNOWN), since
    /// success is not an error. Numbers this crate does not know are kept as they are (their
    /// [`name`](Self::name) is `CUDA_ERROR_UNRECOGNIZED`).
    pub const fn from_code(code: u32) -> Self {
        if code == 0 { Self::UNKNOWN } else { Self(code) }
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

/// Everything an engine operation can report: a driver call that failed at once, queued work
/// that failed on the device, failures found later, or one of the faults' errors.
///
/// The variants say whose problem it is, whatever the feature: [`Usage`](Error::Usage) what the
/// caller passed, [`Setup`](Error::Setup) the machine, [`Library`](Error::Library) a vendor
/// library or another runtime, [`Program`](Error::Program) a traced or prepared program,
/// [`Staging`](Error::Staging) the engine's staging ring, [`Io`](Error::Io) the operating
/// system, [`Malformed`](Error::Malformed) a file or a peer that said what is not so,
/// [`Peer`](Error::Peer) another process that did not do its part. Each fault's enum converts
/// into this one with `?` (`From`), and its message is the fault's own.
///
/// ```
/// use cuferry::error::UsageError;
/// use cuferry::{upload_tensor, CudaEngine, Error};
///
/// let mut engine = CudaEngine::simulated(Default::default());
/// let refused = upload_tensor(&mut engine, &[1.0f32, 2.0, 3.0], &[2, 2]);
/// assert!(matches!(
///     refused,
///     Err(Error::Usage(UsageError::LengthMismatch { expected: 4, found: 3, .. }))
/// ));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A driver call failed when it was made; the work it was to queue was not queued. Returned
    /// by every operation that calls the driver.
    #[error("{call} failed: {source}")]
    Driver {
        /// The driver operation, for example `cuMemcpyHtoDAsync`.
        call: &'static str,
        /// The driver's result code.
        source: DriverError,
    },
    /// A device allocation the device could not serve, after the engine released what its
    /// retirement queue had proven complete and gave its pool's unused memory back to the
    /// device: what was asked, and where the memory is ([`OutOfMemory`]).
    #[error(transparent)]
    OutOfMemory(Box<OutOfMemory>),
    /// A device event reported a failure: the work it covers did not complete. Everything that
    /// work may still touch is retained, never freed. Returned by the waits (`wait`,
    /// `synchronize`, the blocking routes) and by `flush`.
    #[error("the device reported a failure for {what}: {source}")]
    DeviceFault {
        /// The work the event covered.
        what: &'static str,
        /// The driver's result code.
        source: DriverError,
    },
    /// Failures recorded while dropping values, reported at the next boundary (`flush`,
    /// `synchronize`, and the engine operations that begin with a flush).
    #[error("{count} deferred failure(s) while releasing resources; first: {first}")]
    Deferred {
        /// How many failures were recorded.
        count: usize,
        /// The first one.
        first: Box<Error>,
    },
    /// What the caller passed is wrong; nothing was queued.
    #[error(transparent)]
    Usage(#[from] UsageError),
    /// The machine cannot do what was asked: no driver, no such device, a missing library,
    /// devices that cannot reach each other.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// A vendor library, NVRTC or another runtime reported a failure.
    #[error(transparent)]
    Library(#[from] LibraryError),
    /// A traced computation, its compilation or the inputs of a prepared program are wrong.
    #[error(transparent)]
    Program(#[from] ProgramError),
    /// The engine's staging ring refused a lease or a chunk.
    #[error(transparent)]
    Staging(#[from] StagingError),
    /// The operating system failed an operation on a file or a socket: a checkpoint's, the
    /// rendezvous's, a sharing link's.
    #[error(transparent)]
    Io(#[from] IoError),
    /// What a file, a peer or a launcher sent is not so: bytes that are not the format or the
    /// protocol, a length past its bound or past what it describes, an identity the kernel
    /// contradicts. Nothing it claims was believed: nothing was allocated, mapped or counted for
    /// it.
    #[error(transparent)]
    Malformed(#[from] MalformedError),
    /// Another process or rank did not do its part: it refused, closed, exited, or did not
    /// arrive, answer or release by the deadline.
    #[error(transparent)]
    Peer(#[from] PeerError),
}

impl Error {
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
        move |source| Error::Driver { call, source }
    }
}

/// What the caller passed is wrong: another engine's value, an empty or mismatched operand, a
/// size that overflows, an element type or a setting the operation does not take, a call from
/// a device callback. Every operation checks its arguments before it queues anything, so a
/// usage error means nothing was queued; a refusal that takes values by value hands them back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// A value (tensor, pinned buffer, registered buffer, staging lease, pending transfer,
    /// communicator rank) belongs to another engine than the one it was given to. Engines have
    /// separate streams (and maybe separate devices), so using one engine's value on another
    /// would race with its pending work. Returned by every operation that takes an engine's
    /// values.
    #[error(
        "{what} belongs to engine #{found} on {found_device}, not to engine #{expected} on {expected_device} (each engine has its own streams)"
    )]
    WrongEngine {
        /// Which value, where the operation names it (for example `download_pending (device to
        /// host): the tensor`); `the value` otherwise.
        what: &'static str,
        /// The engine the operation ran on.
        expected: u64,
        /// That engine's device.
        expected_device: DeviceId,
        /// The engine that owns the value.
        found: u64,
        /// That engine's device.
        found_device: DeviceId,
    },
    /// A zero-length request where at least one element is needed: an empty pinned or
    /// registered buffer, pending transfer, peer copy, staging chunk, collective or CubeCL
    /// export.
    #[error("{what} needs at least one element")]
    ZeroLength {
        /// What was requested.
        what: &'static str,
    },
    /// Two element counts that must be equal differ: the data and the shape of
    /// `upload_tensor` and `reshape`, the data and the tensor of `upload_tensor_into` and
    /// `download_tensor_into`, the buffer and the tensor of a pending transfer, the source and
    /// the destination of a device or peer copy, the tensors of a collective's ranks.
    #[error(
        "{what}: expected {expected} element(s){}, found {found}",
        .shape.as_ref().map_or_else(String::new, |shape| format!(" (shape {shape:?})"))
    )]
    LengthMismatch {
        /// The operation and its operands: what was supplied for what, for example
        /// `upload_tensor_into: data for the tensor`.
        what: &'static str,
        /// The count the operation needs: the shape's, the destination's (tensor's), the first
        /// rank's.
        expected: usize,
        /// The count supplied: the data's, the buffer's, the source's, another rank's.
        found: usize,
        /// The shape whose count was expected, where the expected count is a shape's
        /// (`upload_tensor`, `reshape`).
        shape: Option<Vec<usize>>,
    },
    /// A tensor whose element type is known at run time ([`AnyTensor`](crate::AnyTensor): a
    /// checkpoint's tensor, a prepared program's output) was asked for as another element type:
    /// [`into_typed`](crate::AnyTensor::into_typed).
    #[error("{operation}: the tensor of shape {shape:?} holds {holds}, not the {asked} asked for")]
    ElementTypeMismatch {
        /// The operation.
        operation: &'static str,
        /// The element type asked for.
        asked: DType,
        /// The element type the tensor holds.
        holds: DType,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// The operands of an operation that needs equal shapes (the elementwise kernels) have
    /// different shapes.
    #[error("{operation}: operand shapes {expected:?} and {found:?} differ")]
    ShapeMismatch {
        /// The operation, for example `add`.
        operation: &'static str,
        /// The first operand's shape, which the others must have.
        expected: Vec<usize>,
        /// The shape of the operand that differs.
        found: Vec<usize>,
    },
    /// The operands of an elementwise operation do not broadcast (NumPy's rule: shapes aligned at
    /// their trailing dimensions, each pair equal or one of them 1).
    #[error(
        "{operation}: shapes {left:?} and {right:?} do not broadcast: dimension {dim} (counted from the left of the longer shape) is {} against {}; aligned from the trailing dimension, each pair must be equal or 1",
        broadcast_extent(left, right, *dim).0,
        broadcast_extent(left, right, *dim).1
    )]
    NotBroadcastable {
        /// The operation, for example `add`.
        operation: &'static str,
        /// The first operand's shape.
        left: Vec<usize>,
        /// The second operand's shape.
        right: Vec<usize>,
        /// The dimension that disagrees, an index into the longer shape.
        dim: usize,
    },
    /// A byte size is larger than memory can be addressed (`isize::MAX` bytes): a tensor, pinned
    /// buffer or transfer too large for its element type.
    #[error(
        "{what} of {count} element(s) of {element_bytes} byte(s) exceeds the addressable limit of {} bytes",
        isize::MAX
    )]
    SizeOverflow {
        /// What was being sized.
        what: &'static str,
        /// The element count.
        count: usize,
        /// The size of one element.
        element_bytes: usize,
    },
    /// A shape whose element count (the product of its dimensions, none of them zero) does not
    /// fit in `usize`: `upload_tensor`, `alloc_tensor`, `reshape`.
    #[error(
        "shape {shape:?} holds more elements than fit in usize ({})",
        usize::MAX
    )]
    ShapeOverflow {
        /// The shape.
        shape: Vec<usize>,
    },
    /// The element type is not served by the operation: `bool` for the arithmetic kernels, the
    /// downloads into `bool`, a library without that type, a traced operation.
    #[error("{operation} does not support element type {dtype}: {reason}")]
    UnsupportedElement {
        /// The operation.
        operation: &'static str,
        /// The element type.
        dtype: DType,
        /// Why not.
        reason: &'static str,
    },
    /// An engine or process setting is out of range, or can no longer change:
    /// [`StagingConfig`](crate::staging::StagingConfig)'s fields, [`set_copy_threads`](crate::staging::set_copy_threads).
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
    /// A number is larger than the library or the driver takes (a dimension, leading
    /// dimension, rank count or device ordinal past `int`): the vendor library calls
    /// (`gemm`, `cholesky_solve`, `contract`), `Communicator::new`.
    #[error("{operation}: {what} = {value} exceeds the limit of {limit}")]
    ExceedsLimit {
        /// The operation.
        operation: &'static str,
        /// The number, for example `m` or `lda`.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The largest value taken.
        limit: usize,
    },
    /// A matrix's leading dimension is below its row count: `gemm`.
    #[error(
        "{operation}: leading dimension of {matrix} is {leading_dimension}, below its {rows} row(s)"
    )]
    LeadingDimension {
        /// The operation.
        operation: &'static str,
        /// The matrix, `'A'`, `'B'` or `'C'`.
        matrix: char,
        /// The leading dimension given.
        leading_dimension: usize,
        /// The matrix's rows in storage.
        rows: usize,
    },
    /// A matrix's extent (`rows × cols` with its leading dimension) needs more elements than
    /// fit in `usize`: `gemm`.
    #[error(
        "{operation}: {matrix} of {rows}×{cols} with leading dimension {leading_dimension} needs more than usize::MAX elements"
    )]
    MatrixOverflow {
        /// The operation.
        operation: &'static str,
        /// The matrix, `'A'`, `'B'` or `'C'`.
        matrix: char,
        /// Its rows in storage.
        rows: usize,
        /// Its columns in storage.
        cols: usize,
        /// Its leading dimension.
        leading_dimension: usize,
    },
    /// A matrix's extent needs more elements than its tensor holds: `gemm`. A column-major
    /// `rows × cols` operand with leading dimension `ld` spans `ld × (cols - 1) + rows` elements.
    #[error(
        "{operation}: {matrix} with leading dimension {leading_dimension} needs {needed} element(s), but the tensor has {available}"
    )]
    MatrixExceedsTensor {
        /// The operation.
        operation: &'static str,
        /// The matrix, `'A'`, `'B'` or `'C'`.
        matrix: char,
        /// Its leading dimension.
        leading_dimension: usize,
        /// The elements its extent needs.
        needed: usize,
        /// The elements the tensor holds.
        available: usize,
    },
    /// An operand of a matrix operation is not 2-D: `matmul`.
    #[error("{operation}: {what} must be 2-D, got shape {shape:?}")]
    NotAMatrix {
        /// The operation.
        operation: &'static str,
        /// The operand, for example `A`.
        what: &'static str,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A matrix that must be square and non-empty is not: `cholesky_solve`'s `A`.
    #[error("{operation}: {what} must be square and non-empty, got shape {shape:?}")]
    NotSquare {
        /// The operation.
        operation: &'static str,
        /// The operand, for example `A`.
        what: &'static str,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// The inner dimensions of a matrix product differ: `matmul` of `[m, k]` and `[k2, n]`.
    #[error("{operation}: inner dimensions differ: {left:?} times {right:?}")]
    InnerDimensions {
        /// The operation.
        operation: &'static str,
        /// The left operand's shape, `[m, k]`.
        left: [usize; 2],
        /// The right operand's shape, `[k2, n]`.
        right: [usize; 2],
    },
    /// A right-hand side whose length is not a positive multiple of the matrix's order:
    /// `cholesky_solve`'s `B`.
    #[error(
        "{operation}: {what} has {len} element(s), which is not a positive multiple of n = {order}"
    )]
    NotAMultiple {
        /// The operation.
        operation: &'static str,
        /// The operand.
        what: &'static str,
        /// Its element count.
        len: usize,
        /// The order `n` it must be a multiple of.
        order: usize,
    },
    /// A contraction expression is malformed: `contract`.
    #[error("{operation}: expression {expression:?}: {reason}")]
    Expression {
        /// The operation.
        operation: &'static str,
        /// The expression, as given.
        expression: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A tensor's mode count in a contraction expression differs from its rank: `contract`.
    #[error("{operation}: {expression:?}: {modes} mode(s) for {operand}, a tensor of rank {rank}")]
    ModeCount {
        /// The operation.
        operation: &'static str,
        /// The expression, as given.
        expression: String,
        /// The operand, `'A'`, `'B'` or `'C'`.
        operand: char,
        /// The modes the expression gives it.
        modes: usize,
        /// Its rank (dimensions), which the mode count must equal.
        rank: usize,
    },
    /// One mode of a contraction expression has two extents: `contract`.
    #[error("{operation}: {expression:?}: mode '{mode}' has extents {first} and {second}")]
    ModeExtents {
        /// The operation.
        operation: &'static str,
        /// The expression, as given.
        expression: String,
        /// The mode.
        mode: char,
        /// Its extent where it first appears.
        first: usize,
        /// The extent that differs.
        second: usize,
    },
    /// A host buffer smaller than the shape it is to hold: CubeCL `export`.
    #[error(
        "{operation}: shape {shape:?} of {dtype} needs {needed} bytes, the buffer holds {available}"
    )]
    BufferTooSmall {
        /// The operation.
        operation: &'static str,
        /// The shape asked for.
        shape: Vec<usize>,
        /// Its element type.
        dtype: DType,
        /// The bytes the shape needs.
        needed: u64,
        /// The bytes the buffer holds.
        available: u64,
    },
    /// A single-element transfer whose host side is empty or longer than its 16-byte slot or
    /// than the tensor: the blocking routes' small-transfer path.
    #[error(
        "{operation}: {bytes} host byte(s) for a tensor of {tensor_bytes} byte(s) through a {slot_bytes}-byte slot"
    )]
    ScalarBytes {
        /// The operation.
        operation: &'static str,
        /// The host side's bytes.
        bytes: usize,
        /// The tensor's bytes.
        tensor_bytes: usize,
        /// The slot's bytes.
        slot_bytes: usize,
    },
    /// A communicator over no engines: `Communicator::new`.
    #[error("{operation} needs at least one engine")]
    NoEngines {
        /// The operation.
        operation: &'static str,
    },
    /// Two engines on one device given to one communicator (ranks are devices):
    /// `Communicator::new`.
    #[error("two engines on {device}: a collective takes one rank per device")]
    TwoRanksOnOneDevice {
        /// The device.
        device: DeviceId,
    },
    /// A collective given another number of engines or tensors than its communicator has
    /// ranks: `all_reduce`, `broadcast`.
    #[error("{engines} engine(s) and {tensors} tensor(s) for {ranks} rank(s)")]
    RankCount {
        /// The communicator's ranks.
        ranks: usize,
        /// The engines given.
        engines: usize,
        /// The tensors given.
        tensors: usize,
    },
    /// A broadcast's or a reduction's root past the last rank of the world: `broadcast`,
    /// `reduce`.
    #[error("root {root} of {ranks} rank(s)")]
    RootOutOfRange {
        /// The root given.
        root: usize,
        /// The world's ranks.
        ranks: usize,
    },
    /// A send's or a receive's peer past the last rank of the world: `send`, `recv`.
    #[error("peer {peer} of a world of {world} rank(s)")]
    PeerOutOfRange {
        /// The peer given.
        peer: usize,
        /// The world's ranks.
        world: usize,
    },
    /// A checkpoint's tensor asked for as an element type other than its own
    /// ([`Checkpoint::take`](crate::checkpoint::Checkpoint::take)); the tensor stays in the
    /// checkpoint.
    #[error(
        "{path}: tensor '{tensor}' holds {holds}, not the {asked} asked for",
        path = path.display()
    )]
    StoredElementType {
        /// The file the tensor came from.
        path: std::path::PathBuf,
        /// The tensor.
        tensor: String,
        /// The element type asked for.
        asked: crate::dtype::DType,
        /// The element type the tensor holds.
        holds: crate::dtype::DType,
    },
    /// A tensor asked of a checkpoint that holds none of that name.
    #[error("the checkpoint holds no tensor named '{tensor}'")]
    NoTensor {
        /// The name asked for.
        tensor: String,
    },
    /// A rank at or above the world size, or a world of no ranks.
    #[error("rank {rank} is not a rank of a world of {world}")]
    NotARank {
        /// The rank.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// A tensor-parallel split of a dimension that the world size does not divide, by a plan
    /// that does not allow uneven splits
    /// ([`TensorParallel::uneven`](crate::checkpoint::TensorParallel::uneven)).
    #[error(
        "tensor '{tensor}': dimension {dimension} of size {size} does not split evenly between \
         {world} ranks (a plan that allows uneven splits gives ranges that differ by one)"
    )]
    UnevenSplit {
        /// The tensor.
        tensor: String,
        /// The dimension split (0 for rows, the last for columns).
        dimension: usize,
        /// Its size.
        size: usize,
        /// The world size.
        world: usize,
    },
    /// A setting an operation does not take, with what to do instead.
    #[error("{operation} does not take {setting}: {instead}")]
    NotTaken {
        /// The operation.
        operation: &'static str,
        /// The setting given.
        setting: &'static str,
        /// What to do instead.
        instead: &'static str,
    },
    /// A slice a load was asked to take that its tensor does not have: a range of rows or
    /// columns past the end of its dimension or reversed, or rows or columns of a scalar.
    #[error(
        "tensor '{tensor}' of shape {shape:?} has no {what} {range:?} (rows are dimension 0, \
         columns the last, and a scalar has neither)"
    )]
    SliceOutOfRange {
        /// The tensor.
        tensor: String,
        /// Its shape in the file.
        shape: Vec<usize>,
        /// `"rows"` or `"columns"`.
        what: &'static str,
        /// The range asked for.
        range: std::ops::Range<usize>,
    },
    /// A number or a length from a launcher variable or a setting past the bound the bootstrap
    /// takes ([`MAX_WORLD`](crate::collective::MAX_WORLD),
    /// [`MAX_JOB_BYTES`](crate::collective::MAX_JOB_BYTES), a host name's 253 bytes,
    /// a local rank below the world's size): refused before it sizes anything.
    #[error("{what} = {value}: past its bound, {limit}")]
    PastBound {
        /// What was given: a launcher variable's name, or a setting's (`world`, `job`).
        what: &'static str,
        /// The value given (a long text by its length).
        value: String,
        /// The bound it is past, in words, with the number.
        limit: String,
    },
    /// The offer's element type is not the one asked for.
    #[error("an offer of {offered:?} elements, where {expected:?} was asked for")]
    OfferElementType {
        /// The element type asked for.
        expected: crate::dtype::DType,
        /// The element type offered, when it is one this crate knows.
        offered: Option<crate::dtype::DType>,
    },
    /// The offer's access is not the one asked for: a read-only share where an exclusive
    /// hand-off was asked for, or the other way round.
    #[error("an offer of {offered} access, where {expected} access was asked for")]
    OfferAccess {
        /// The access asked for: `read-only` or `exclusive`.
        expected: &'static str,
        /// The access offered.
        offered: &'static str,
    },
    /// A tensor offered for sharing with another process whose memory is not an allocation of
    /// its own: imported from another process (memory is shared by the process that allocated
    /// it), adopted from another library, or part of a larger allocation (a small tensor a
    /// checkpoint load packed with others). A copy of it (`CudaEngine::copy_tensor`) can be
    /// shared.
    #[error(
        "only a tensor in an allocation of its own can be shared with another process; this \
         one is imported, adopted, or part of a larger allocation: share a copy of it"
    )]
    Reexport,
    /// A DLPack tensor lives on another device than the engine's, or in memory that is not a
    /// device's (host, pinned host, managed): `dlpack::import`.
    #[error(
        "a DLPack tensor on device type {device_type} ordinal {device_id} (2 is CUDA), not on the engine's device {engine}"
    )]
    ForeignDevice {
        /// The tensor's DLPack device type (2: CUDA).
        device_type: u32,
        /// The tensor's device ordinal.
        device_id: i32,
        /// The engine's device.
        engine: crate::device::DeviceId,
    },
    /// A DLPack tensor whose strides do not describe a compact row-major layout, imported with
    /// `Strides::Refuse`: import it with `Strides::Copy` for a compact copy.
    #[error(
        "a DLPack tensor of shape {shape:?} with strides {strides:?} (in elements) is not compact row-major; import it with Strides::Copy"
    )]
    NotCompact {
        /// The shape.
        shape: Vec<usize>,
        /// The strides, in elements.
        strides: Vec<i64>,
    },
    /// A read-only tensor asked to be writable: a DLPack tensor flagged read-only imported with
    /// `dlpack::import` (use `dlpack::import_read_only`), or a shared tensor exported in the
    /// legacy ABI, which cannot say it is read-only.
    #[error("{what}")]
    ReadOnly {
        /// What was asked, and why it is refused.
        what: &'static str,
    },
    /// A writable DLPack import of memory that a live import of this engine already views
    /// (another view of the same allocation): two values of the engine would share memory
    /// that the engine orders as two. Read-only imports may share.
    #[error(
        "a writable DLPack import of bytes {start:#x}..{end:#x}, which a live import of this engine already views; import both read-only, or copy one first"
    )]
    Overlaps {
        /// The first byte of the new import.
        start: u64,
        /// One past its last byte.
        end: u64,
    },
    /// A cudarc stream or slice of another CUDA context than the engine's (its device's primary
    /// context, which `cudarc::driver::CudaContext::new` retains too): another device's, or a
    /// context of its own (`CudaContext::new_non_primary`). The engine's events cannot order
    /// work there. `cudarc_interop::lend`, `lend_mut` and `adopt`.
    #[error(
        "{what} belongs to CUDA context {found:#x}, not to the engine's ({expected:#x}, the primary context of {engine})"
    )]
    ForeignContext {
        /// Which value: the lend's stream, or the adopted slice.
        what: &'static str,
        /// The engine's context (a raw `CUcontext`).
        expected: u64,
        /// The value's context (a raw `CUcontext`).
        found: u64,
        /// The engine's device.
        engine: crate::device::DeviceId,
    },
    /// A cudarc stream that is the per-thread default stream (`per_thread_stream()`), for a lend
    /// or an adopted slice: its handle names another stream on every thread, so a wait queued on
    /// one thread orders nothing for work queued on another. Use a stream of the context's own
    /// (`new_stream()`) or its legacy default stream (`default_stream()`).
    #[error(
        "{what} is the per-thread default stream, which names another stream on every thread; use a stream of its own or the legacy default stream"
    )]
    PerThreadStream {
        /// Which value: the lend's stream, or the adopted slice.
        what: &'static str,
    },
}

/// The machine cannot do what was asked: it has no driver, no such device, not the library an
/// operation needs, or devices that cannot reach each other.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The CUDA driver library (`libcuda`) could not be loaded: the machine has no NVIDIA
    /// driver. Returned by `CudaEngine::open`.
    #[error("no CUDA driver on this machine: {detail}")]
    NoDriver {
        /// What the loader reported.
        detail: String,
    },
    /// The requested device ordinal does not exist: `CudaEngine::open`,
    /// `CudaEngine::simulated_on_device`.
    #[error(
        "CUDA device ordinal {ordinal} does not exist: this machine has {count} CUDA device(s)"
    )]
    NoSuchDevice {
        /// The ordinal that was asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A library an operation needs is not installed on this machine (NVRTC for the kernels,
    /// cuBLAS, cuSOLVER, cuTENSOR, NCCL), or the operation has no simulated form (PTX and CubeCL
    /// on the simulated device).
    #[error("{library} is unavailable on this machine: {detail}")]
    Unavailable {
        /// The library, for example `cuTENSOR`.
        library: &'static str,
        /// What was looked for.
        detail: String,
    },
    /// Work on one device cannot be ordered after, or reach, work or memory of another: separate
    /// simulated machines share no clock, a real and a simulated device share nothing at all, and
    /// devices without a peer link cannot copy between each other directly. Returned by
    /// `wait_signal`, the peer copies and `Communicator::new`.
    #[error("{to} cannot reach {from}: {reason}")]
    Unreachable {
        /// The device whose work was to be reached.
        from: DeviceId,
        /// The device that was to reach it.
        to: DeviceId,
        /// Why not.
        reason: &'static str,
    },
    /// A launcher variable (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
    /// `MASTER_ADDR`, `MASTER_PORT`) is missing or not what it must be (its value repeated cut
    /// to 64 bytes).
    #[error("launcher variable {variable}{}: {reason}", .value.as_ref().map_or_else(String::new, |v| format!(" = {v:?}")))]
    Environment {
        /// The variable.
        variable: &'static str,
        /// Its value, where it is set.
        value: Option<String>,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A handle made on another host: device memory is shared only between processes of one.
    #[error("a handle of another host")]
    OtherHost,
    /// A handle made before this host last booted.
    #[error("a handle of another boot of this host")]
    OtherBoot,
    /// The offer names a device this engine's streams cannot reach (neither its own nor a
    /// peer it accesses directly).
    #[error("the offer's device (UUID {uuid:02x?}) is not one this engine reaches")]
    UnreachableDevice {
        /// The UUID of the exporter's device.
        uuid: [u8; 16],
    },
    /// This process's identity (its host's id, the boot's id, its start time) cannot be read.
    #[error("cannot name this {what}: {reason}")]
    Identity {
        /// What: `host`, `boot` or `process`.
        what: &'static str,
        /// Why.
        reason: String,
    },
}

/// A vendor library, NVRTC or another runtime sharing the device reported a failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LibraryError {
    /// A vendor library call (cuBLAS, cuSOLVER, cuTENSOR, NCCL) returned a failure status:
    /// `gemm`, `matmul`, `cholesky_solve`, `contract`, the collectives.
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
    /// NVRTC could not compile a kernel (the elementwise kernels, a prepared program's fused
    /// kernels). The log is NVRTC's own.
    #[error("NVRTC could not compile kernel {kernel}: {status}; log:\n{log}")]
    Compile {
        /// The kernel (or program) name.
        kernel: String,
        /// NVRTC's result code, by name.
        status: String,
        /// The compilation log.
        log: String,
    },
    /// A factorisation found the matrix not positive definite: [`SolverStatus::check`](crate::libs::SolverStatus::check)
    /// after `cholesky_solve`.
    #[error("{operation}: the leading minor of order {order} is not positive definite")]
    NotPositiveDefinite {
        /// The operation, for example `cholesky_solve`.
        operation: &'static str,
        /// The order of the first leading minor that is not positive definite (1-based).
        order: i64,
    },
    /// A library reported one of its call's parameters invalid after the call was queued:
    /// [`SolverStatus::check`](crate::libs::SolverStatus::check) (cuSOLVER's `info < 0`).
    #[error("{operation}: {library} reports parameter {parameter} invalid")]
    InvalidParameter {
        /// The operation, for example `cholesky_solve`.
        operation: &'static str,
        /// The library, for example `cuSOLVER`.
        library: &'static str,
        /// The position of the invalid parameter (1-based), as the library counts them.
        parameter: i64,
    },
    /// A library asked for more workspace than can be addressed: `contract` (cuTENSOR).
    #[error("{operation}: {library} asks for {bytes} bytes of workspace")]
    Workspace {
        /// The operation.
        operation: &'static str,
        /// The library.
        library: &'static str,
        /// The bytes it asked for.
        bytes: u64,
    },
    /// Another GPU runtime sharing the device (CubeCL) reported a failure at the boundary:
    /// `CudaEngine::with_cubecl` and its scope's imports and exports.
    #[error("{runtime} failed during {what}: {detail}")]
    Interop {
        /// The runtime, for example `CubeCL`.
        runtime: &'static str,
        /// What the engine was doing.
        what: &'static str,
        /// The runtime's report.
        detail: String,
    },
}

/// A traced computation, its compilation for given input specifications, or the inputs handed
/// to a prepared program are wrong ([`graph`](crate::graph)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProgramError {
    /// A traced computation is ill-typed: operands of different element types or ranks, or a
    /// scalar of another type than its tensor. Returned when the operation is traced.
    #[error("{operation}: {detail}")]
    Trace {
        /// The traced operation.
        operation: &'static str,
        /// What did not match.
        detail: String,
    },
    /// A traced computation cannot be compiled for the given input specifications: an input
    /// without a specification, a specification that does not match its input, or shapes that
    /// do not fit the operations. Returned by `compile`.
    #[error("cannot compile the program: {detail}")]
    Spec {
        /// What was wrong, naming the values involved.
        detail: String,
    },
    /// An input handed to a prepared program does not match what the program was compiled for:
    /// `CudaEngine::run` and its variants. Nothing was run.
    #[error("input {index} of the prepared program: expected {expected}, got {found}")]
    Input {
        /// The input's position.
        index: usize,
        /// What the program was compiled for (element type and shape, or the input count).
        expected: String,
        /// What was given.
        found: String,
    },
}

/// The engine's staging ring refused: no slot is free, or a chunk does not fit its lease.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StagingError {
    /// Every slot of the engine's staging ring is leased: `CudaEngine::staging_lease`, and the
    /// blocking routes when the caller holds every slot.
    #[error("all {depth} staging slots of the engine's ring are leased")]
    Exhausted {
        /// The ring's depth.
        depth: usize,
    },
    /// A staging chunk's elements lie outside its tensor: the lease's `begin_upload` and
    /// `begin_download`.
    #[error(
        "staging chunk: elements {offset}..{offset}+{len} lie outside the tensor's {elements} element(s)"
    )]
    ChunkOutOfRange {
        /// The chunk's first element.
        offset: usize,
        /// The chunk's element count.
        len: usize,
        /// The tensor's element count.
        elements: usize,
    },
    /// A staging chunk larger than its slot: the lease's `begin_upload` and `begin_download`.
    #[error(
        "staging chunk: {len} element(s) of {element_bytes} byte(s) exceed the slot's {capacity} bytes"
    )]
    ChunkTooLarge {
        /// The chunk's element count.
        len: usize,
        /// The size of one element.
        element_bytes: usize,
        /// The slot's bytes.
        capacity: usize,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error of a call that took `P` by value (a submission of work to the device, or a
/// constructor or conversion that consumes its input), handing back what it can, as
/// [`TrySendError<T>`](std::sync::mpsc::TrySendError) does: nothing the caller owned is lost,
/// and nothing the device may still touch comes back.
///
/// There are exactly three outcomes, whatever the operation:
///
/// - [`Rejected`](Self::Rejected): refused before anything was queued; the input comes back
///   untouched. The error says what was wrong with it.
/// - [`Failed`](Self::Failed): the driver refused a step, or the work was queued and then proven
///   complete by other means; nothing is in flight, and the input comes back.
/// - [`Retained`](Self::Retained): the work was queued, but nothing can prove it complete, so
///   the device may still touch the input: its engine (each rank's engine, for a collective)
///   keeps it, releasing what a later proof covers and retaining the rest for its lifetime.
///   Nothing comes back.
///
/// ```
/// # use cuferry::sim::SimConfig;
/// use cuferry::{upload_pending, CudaEngine, PinnedHostBuffer, SubmitError};
/// # let mut engine = CudaEngine::simulated(SimConfig::default());
/// let buffer = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0])?;
/// let tensor = engine.alloc_tensor::<f32>(&[3])?; // one element too many
/// match upload_pending(&mut engine, buffer, tensor) {
///     Err(SubmitError::Rejected { input: (buffer, tensor), error }) => {
///         assert_eq!((buffer.len(), tensor.len()), (2, 3)); // both back, untouched
///         println!("refused: {error}");
///     }
///     other => panic!("expected a refusal, got {other:?}"),
/// }
/// # Ok::<(), cuferry::Error>(())
/// ```
// Not `#[non_exhaustive]`: the three outcomes are the whole story, so a match on them is
// exhaustive.
#[derive(thiserror::Error)]
pub enum SubmitError<P> {
    /// Refused before anything was queued: the input comes back untouched.
    #[error("rejected: {error}")]
    Rejected {
        /// What was given, untouched.
        input: P,
        /// What was wrong with it.
        error: Error,
    },
    /// The driver refused a step, or the queued work was proven complete by other means:
    /// nothing is in flight and the input comes back.
    #[error("not queued: {error}")]
    Failed {
        /// What was given.
        input: P,
        /// The failure.
        error: Error,
    },
    /// Queued, but its completion cannot be proven: the device may still touch the input, so
    /// its engine keeps it (for its lifetime, where no later proof covers it); nothing comes
    /// back.
    #[error("queued, but its completion cannot be proven; its memory is retained: {error}")]
    Retained {
        /// The failure.
        error: Error,
    },
}

impl<P> SubmitError<P> {
    /// The error, whatever became of the input.
    pub fn error(&self) -> &Error {
        match self {
            SubmitError::Rejected { error, .. }
            | SubmitError::Failed { error, .. }
            | SubmitError::Retained { error } => error,
        }
    }

    /// The error, dropping the input if it came back.
    pub fn into_error(self) -> Error {
        match self {
            SubmitError::Rejected { error, .. }
            | SubmitError::Failed { error, .. }
            | SubmitError::Retained { error } => error,
        }
    }

    /// The input, when it came back ([`Rejected`](Self::Rejected) or [`Failed`](Self::Failed)).
    pub fn into_input(self) -> Option<P> {
        match self {
            SubmitError::Rejected { input, .. } | SubmitError::Failed { input, .. } => Some(input),
            SubmitError::Retained { .. } => None,
        }
    }

    /// The same outcome with the input, if it came back, passed through `f`: for code that
    /// handles the refusals of several routes as one (a download's `(tensor, buffer)` and an
    /// upload's `(buffer, tensor)`, say).
    pub fn map_input<Q>(self, f: impl FnOnce(P) -> Q) -> SubmitError<Q> {
        match self {
            SubmitError::Rejected { input, error } => SubmitError::Rejected {
                input: f(input),
                error,
            },
            SubmitError::Failed { input, error } => SubmitError::Failed {
                input: f(input),
                error,
            },
            SubmitError::Retained { error } => SubmitError::Retained { error },
        }
    }
}

// Not derived: the input need not be `Debug` (a buffer's bytes say nothing useful), and the error
// carries the story.
impl<P> fmt::Debug for SubmitError<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, returned) = match self {
            SubmitError::Rejected { .. } => ("Rejected", true),
            SubmitError::Failed { .. } => ("Failed", true),
            SubmitError::Retained { .. } => ("Retained", false),
        };
        f.debug_struct(name)
            .field("input_returned", &returned)
            .field("error", self.error())
            .finish()
    }
}

impl<P> From<SubmitError<P>> for Error {
    fn from(e: SubmitError<P>) -> Error {
        e.into_error()
    }
}

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

/// The operating system failed an operation on a file or a socket: each variant names the
/// file, the address or the socket, the operation, and the operating system's error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// The operating system refused an operation on the file.
    #[error("{path}: {operation} failed: {source}", path = path.display())]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// What was asked of it: `open`, `stat`, `read`, `create`, `write`, `flush`, `rename`,
        /// `flush the directory` (the path is then the directory's) or `start a reader thread`
        /// (for a load whose first reader thread the system would not start).
        operation: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A socket operation of the rendezvous failed.
    #[error("rendezvous at {address}: {operation} failed: {source}")]
    Rendezvous {
        /// The rendezvous address.
        address: String,
        /// The operation: `bind`, `connect`, `accept`, `read`, `write`.
        operation: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A socket operation failed.
    #[error("sharing socket: {operation} failed: {source}")]
    Socket {
        /// The operation: `read`, `write`, `sendmsg`, `recvmsg`, `connect`, `bind`.
        operation: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// What a file, a peer or a launcher sent is not so: a checkpoint whose header or length is not
/// what the format allows, bytes on a socket that are not the protocol, a claim past what the
/// driver or the kernel measures. Found before anything is allocated, mapped or counted on its
/// word: nothing of what it claims is in use. (A checkpoint of small tensors may have begun to
/// land by then, in memory sized by the file's length as the kernel reports it; that memory is
/// freed after its copies.)
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MalformedError {
    /// A read came back short of what the file's length promised (the file shrank, or the
    /// storage under it failed quietly).
    #[error("{path}: a read at byte {offset} came back {missing} byte(s) short", path = path.display())]
    ShortRead {
        /// The file.
        path: std::path::PathBuf,
        /// Where the read began.
        offset: u64,
        /// How many bytes it lacked.
        missing: usize,
    },
    /// The file is shorter than its header says it must be.
    #[error("{path}: {len} bytes long, shorter than the {needed} its header needs", path = path.display())]
    Truncated {
        /// The file.
        path: std::path::PathBuf,
        /// The bytes its header needs.
        needed: u64,
        /// Its length.
        len: u64,
    },
    /// The header's length is beyond the format's limit.
    #[error(
        "{path}: a header of {length} bytes, above the limit of {limit} (the file is {file_len} bytes)",
        path = path.display()
    )]
    HeaderLength {
        /// The file.
        path: std::path::PathBuf,
        /// The length the header's prefix gives.
        length: u64,
        /// The limit.
        limit: u64,
        /// The file's length.
        file_len: u64,
    },
    /// The header (or, for a save, the tensors to write) is not what the format describes: not
    /// UTF-8, not JSON, a tensor entry that is not one, ranges that do not tile the data, a
    /// `bool` byte other than 0 or 1, a name given twice.
    #[error(
        "{path}: bad header{}: {reason}",
        tensor.as_ref().map(|t| format!(" at tensor '{t}'")).unwrap_or_default(),
        path = path.display()
    )]
    Header {
        /// The file.
        path: std::path::PathBuf,
        /// The tensor at fault, where one is.
        tensor: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// A tensor's element type is one the crate has no type for (the 8-bit and sub-byte floats,
    /// the complex types).
    #[error(
        "{path}: tensor '{tensor}' has element type {dtype}, which cuferry does not hold",
        path = path.display()
    )]
    Dtype {
        /// The file.
        path: std::path::PathBuf,
        /// The tensor.
        tensor: String,
        /// The element type, as the format names it.
        dtype: String,
    },
    /// The file's length changed while it was being read.
    #[error("{path}: {before} bytes long when the load began, {after} when it ended", path = path.display())]
    LengthChanged {
        /// The file.
        path: std::path::PathBuf,
        /// Its length when the load began.
        before: u64,
        /// Its length when it ended.
        after: u64,
    },
    /// A DLPack capsule says what cannot be so: a null tensor or data pointer, a major version
    /// this crate does not speak, a negative or overflowing shape, an element type with no
    /// element here, an offset that does not align the data to its element, a view that leaves
    /// the allocation the driver reports. The producer's deleter is still called, once.
    #[error("a DLPack capsule's {field}: {reason}")]
    Capsule {
        /// The field at fault (`version`, `dl_tensor.shape`, ...).
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A sharded checkpoint's index names a shard that is not there.
    #[error("{index}: names the shard {shard}, which is missing", index = index.display(), shard = shard.display())]
    MissingShard {
        /// The index file.
        index: std::path::PathBuf,
        /// The shard it names.
        shard: std::path::PathBuf,
    },
    /// The data after the header is not as long as the header's ranges say.
    #[error(
        "{path}: the header describes {header_says} bytes of data, the file holds {file_holds}",
        path = path.display()
    )]
    DataLength {
        /// The file.
        path: std::path::PathBuf,
        /// The data the header describes, in bytes.
        header_says: u64,
        /// The data the file holds after its header.
        file_holds: u64,
    },
    /// A byte range asked of a file that ends past the largest file offset.
    #[error(
        "{path}: {bytes} byte(s) at offset {offset} pass the largest file offset",
        path = path.display()
    )]
    RangeOverflow {
        /// The file.
        path: std::path::PathBuf,
        /// Where the range starts.
        offset: u64,
        /// Its length.
        bytes: usize,
    },
    /// A file the checkpoint code reads whole (an index) is longer than the limit it is read
    /// to: refused once that many bytes and one more are read, or at once where the file's
    /// length says so.
    #[error(
        "{path}: {what} is longer than the limit of {limit} bytes",
        path = path.display()
    )]
    TooLarge {
        /// The file.
        path: std::path::PathBuf,
        /// What it is: `the index`.
        what: &'static str,
        /// The limit, in bytes.
        limit: u64,
    },
    /// Bytes from rank 0's address that are not the rendezvous protocol.
    #[error("rendezvous at {address}: the answer is not the rendezvous protocol: {reason}")]
    Rendezvous {
        /// The rendezvous address.
        address: String,
        /// What was wrong.
        reason: String,
    },
    /// Bytes that are not a unique id of this crate's format, or one made by another version
    /// of the collective library.
    #[error("not a usable unique id: {reason}")]
    UniqueId {
        /// What is wrong with the bytes.
        reason: String,
    },
    /// Bytes that are not the sharing protocol: `reason` says what was wrong. Nothing they name
    /// was mapped, and a descriptor that came with them was closed.
    #[error("sharing socket: not the sharing protocol: {reason}")]
    Sharing {
        /// What was wrong.
        reason: String,
    },
    /// A peer whose greeting (or, for an exporter, whose first offer) names another process
    /// or user than the kernel reports at the socket's other end (`SO_PEERCRED`, and the
    /// process's start time in `/proc`): nothing of it is believed, and nothing is mapped or
    /// counted for it.
    #[error(
        "the peer says its {what} is {claimed}, where the kernel reports {kernel} for the \
         socket's other end"
    )]
    PeerIdentity {
        /// What disagrees: `pid`, `start time` or `user id`.
        what: &'static str,
        /// What the peer said.
        claimed: u64,
        /// What the kernel reports.
        kernel: u64,
    },
    /// An offer that claims more memory than the allocation it names holds, as the importing
    /// driver measures the mapping (`cuMemGetAddressRange`): its shape and element size, at its
    /// offset in the allocation, do not fit. Nothing of it is in use; the exporter is told.
    #[error(
        "an offer of {offered} bytes at offset {offset} of an allocation of {allocation} bytes"
    )]
    PastAllocation {
        /// The bytes the offer's shape and element type claim.
        offered: u64,
        /// Where the mapped address lies in its allocation.
        offset: u64,
        /// The allocation's true size, from the driver.
        allocation: u64,
    },
    /// The peer passed a bound on what it may make this side hold (offers waiting to be taken,
    /// descriptors): it is treated as hostile, and the link is closed.
    #[error("the peer passed the bound of {limit} {what}: the link is closed")]
    OverLimit {
        /// What it made this side hold too many of.
        what: &'static str,
        /// The bound.
        limit: usize,
    },
}

/// Another process or rank did not do its part: rank 0 refused this rank or never answered,
/// ranks did not arrive or join, a collective's peer hung or its communicator failed, a
/// sharing peer closed, exited, refused an offer, or did not release an import in time. A
/// collective's comes after its communicator was aborted: its queued parts end, the engine stays
/// usable, and the tensors the collective lent are released once their engines prove the parts
/// ended (or kept for the engine's lifetime where they cannot).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// Rank 0 waited its deadline and these ranks did not arrive (connections it refused are
    /// listed, each with why).
    #[error(
        "rendezvous at {address}: rank(s) {missing:?} never arrived by the deadline{}",
        if refused.is_empty() { String::new() } else { format!("; refused: {}", refused.join("; ")) }
    )]
    Missing {
        /// The rendezvous address.
        address: String,
        /// The ranks that did not arrive.
        missing: Vec<usize>,
        /// The connections refused meanwhile, each with its peer's address and why: at most
        /// [`MAX_LISTED_REFUSALS`](crate::collective::MAX_LISTED_REFUSALS), then
        /// one entry counting the rest.
        refused: Vec<String>,
    },
    /// A rank other than 0 could not reach rank 0, or had no answer from it, by its deadline.
    #[error("rendezvous at {address}: no answer from rank 0 by the deadline{}", .last.as_ref().map_or_else(String::new, |e| format!(" (last: {e})")))]
    NoRoot {
        /// The rendezvous address.
        address: String,
        /// The last failure seen, if any.
        last: Option<String>,
    },
    /// Rank 0 refused this rank: the reason is what rank 0 found wrong with its greeting.
    #[error("rendezvous at {address}: rank 0 refused rank {rank}: {reason}")]
    RankRefused {
        /// The rendezvous address.
        address: String,
        /// This rank.
        rank: usize,
        /// Why: a world of another size, a rank out of range or already taken, a peer of
        /// another job or protocol.
        reason: String,
    },
    /// A rank's join waited its deadline and the world did not form: a rank never came. The
    /// communicator begun was aborted; the engine is usable.
    #[error(
        "rank {rank} of a world of {world}: {} within {waited:?}",
        match missing {
            Some(missing) => format!("rank(s) {missing:?} never joined"),
            None => "not every rank joined (the collective library does not say which)".into(),
        }
    )]
    Unjoined {
        /// This rank.
        rank: usize,
        /// The world's size.
        world: usize,
        /// How long it waited.
        waited: std::time::Duration,
        /// The ranks that had not joined when it gave up, in order, where the collective
        /// library can tell (the simulated device can; NCCL cannot: `None`).
        missing: Option<Vec<usize>>,
    },
    /// The communicator's deadline passed before this rank's part completed: a peer died, hung,
    /// or never queued its part.
    #[error(
        "rank {rank} of a world of {world}: the collective did not complete within {timeout:?} \
         (a peer died, hangs or never queued its part); the communicator was aborted"
    )]
    CollectiveTimedOut {
        /// This rank.
        rank: usize,
        /// The world's size.
        world: usize,
        /// The communicator's deadline.
        timeout: std::time::Duration,
    },
    /// The collective library found the communicator failed (a peer's connection lost, a
    /// remote error): `reason` is its report.
    #[error("rank {rank} of a world of {world}: the communicator failed: {reason}; it was aborted")]
    CommunicatorFailed {
        /// This rank.
        rank: usize,
        /// The world's size.
        world: usize,
        /// The library's report.
        reason: String,
    },
    /// The communicator was aborted before (by a deadline, a failure or
    /// [`Communicator::abort`](crate::collective::Communicator::abort)): nothing more runs on
    /// it.
    #[error("rank {rank} of a world of {world}: the communicator was aborted")]
    Aborted {
        /// This rank.
        rank: usize,
        /// The world's size.
        world: usize,
    },
    /// The peer closed the socket before a message began.
    #[error("sharing socket: the peer closed it")]
    Closed,
    /// A handle of a process that has exited (or whose pid now names a later process).
    #[error("a handle of process {pid}, which has exited")]
    ProcessGone {
        /// The process id the handle names.
        pid: u32,
    },
    /// The importer refused an offer (reported at the exporter's next boundary): nothing of it
    /// was mapped there.
    #[error("process {pid} refused the offer: {reason}")]
    OfferRefused {
        /// The importer's process id.
        pid: u32,
        /// Why, as it said.
        reason: String,
    },
    /// A peer of another user than this process's, which the listener (or link) was not told
    /// to allow.
    #[error("a peer of user {uid}, where only users {allowed:?} may share with this process")]
    OtherUser {
        /// The peer's user id, as the kernel reports it.
        uid: u32,
        /// The users allowed: this process's and any allowed besides.
        allowed: Vec<u32>,
    },
    /// A greeting (or another message) that did not arrive whole within its limit: a peer that
    /// trickles it is refused however slowly each byte comes.
    #[error("{what} did not arrive whole within {within:?}")]
    TimedOut {
        /// What: `a greeting`, `a message`.
        what: &'static str,
        /// The limit, from the exchange's start.
        within: std::time::Duration,
    },
}

/// The extents of `left` and `right` at dimension `dim` of the longer shape, right-aligned (1
/// where a shape is too short to have it), for [`UsageError::NotBroadcastable`]'s message.
fn broadcast_extent(left: &[usize], right: &[usize], dim: usize) -> (usize, usize) {
    let rank = left.len().max(right.len());
    let at = |s: &[usize]| {
        (dim + s.len())
            .checked_sub(rank)
            .and_then(|i| s.get(i).copied())
            .unwrap_or(1)
    };
    (at(left), at(right))
}

/// Why a device allocation failed for want of memory ([`Error::OutOfMemory`]): the size asked,
/// the device's memory and the engine's pool when it failed, and what the engine still holds
/// for work not yet proven complete. Its message reads as a diagnosis: "out of device memory:
/// asked for 2.00 GiB; the device has 1.20 GiB free of 79.11 GiB; this engine's pool holds
/// 76.50 GiB, 76.50 GiB of it in live allocations; 3 retired operations still wait for their
/// proof of completion".
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutOfMemory {
    /// The bytes asked for.
    pub asked: usize,
    /// The device's memory and the engine's pool when the allocation failed; `None` when the
    /// driver could not say.
    pub memory: Option<crate::device::DeviceMemory>,
    /// Retired operations (a detached transfer, a dropped tensor's last uses, a failed
    /// pipeline's chunks) whose resources wait for their proof of completion; what they hold is
    /// released once it comes, at the next boundary or allocation.
    pub waiting: usize,
    /// The largest allocation that would succeed now, where the driver can say (the simulator
    /// can; CUDA does not, so it is `None` there).
    pub largest: Option<u64>,
    /// What the engine held when the allocation failed, by owner
    /// ([`CudaEngine::memory`](crate::CudaEngine::memory)).
    pub held: crate::ledger::MemoryUse,
    /// The engine's last allocations and frees, oldest first, when it keeps them
    /// ([`CudaEngine::record_allocations`](crate::CudaEngine::record_allocations)); else empty.
    pub history: Vec<crate::ledger::AllocationEvent>,
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::device::human;
        write!(
            f,
            "out of device memory: asked for {}",
            human(self.asked as u64)
        )?;
        match &self.memory {
            Some(m) => write!(
                f,
                "; the device has {} free of {}; this engine's pool holds {}, {} of it in live \
                 allocations",
                human(m.free),
                human(m.total),
                human(m.pool_reserved),
                human(m.pool_in_use)
            )?,
            None => write!(f, "; the driver could not report the device's memory")?,
        }
        match self.waiting {
            0 => write!(f, "; nothing waits for a proof of completion")?,
            1 => write!(
                f,
                "; 1 retired operation still waits for its proof of completion"
            )?,
            n => write!(
                f,
                "; {n} retired operations still wait for their proof of completion"
            )?,
        }
        if let Some(largest) = self.largest {
            write!(
                f,
                "; the largest allocation that would succeed: {}",
                human(largest)
            )?;
        }
        let owners: Vec<String> = crate::ledger::Owner::ALL
            .iter()
            .filter(|owner| owner.on_device() && self.held.of(**owner).in_use > 0)
            .map(|&owner| format!("{owner} {}", human(self.held.of(owner).in_use)))
            .collect();
        if !owners.is_empty() {
            write!(f, "; the engine's device memory: {}", owners.join(", "))?;
        }
        if !self.history.is_empty() {
            write!(
                f,
                "\nthe engine's last {} allocations and frees, oldest first:",
                self.history.len()
            )?;
            for event in &self.history {
                write!(f, "\n  {event}")?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for OutOfMemory {}
