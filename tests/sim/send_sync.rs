//! The Send/Sync design, asserted.
//!
//! - The engine and the values it hands out move between threads: an engine is held by one
//!   caller at a time (operations borrow it `&mut`), and its shared core is behind a mutex.
//! - Device tensors may be shared: `&DeviceTensor` exposes only metadata.
//! - An in-flight transfer can be moved to another thread and waited on there, or awaited on any
//!   executor: its future is `Send` and `Unpin`.
//! - Raw scope handles are tied to the thread on which the engine's context is current, so they
//!   are neither `Send` nor `Sync`.
//! - Errors travel: `Error`, each domain's error under it (`cuferry::error::*`) and
//!   `DriverError` cross threads and live as long as needed, so they fit
//!   `Box<dyn std::error::Error + Send + Sync>`, `anyhow` and a channel to another thread.

use cuferry::error::{LibraryError, ProgramError, SetupError, StagingError, UsageError};
use cuferry::upload_tensor;
use cuferry::{
    CudaEngine, DeviceTensor, Error, Pending, PinnedHostBuffer, RegisteredBuffer, SubmitError,
    collective::Collective,
    error::DriverError,
    peer::PeerCopy,
    pending::{Download, InFlight, PendingFuture, Returned, Upload},
    raw::{RawContext, RawDevicePtr, RawScope, RawStream},
    staging::{Proven, StagingLease, Unproven},
};
use static_assertions::{assert_impl_all, assert_not_impl_any};

assert_impl_all!(CudaEngine: Send);
assert_impl_all!(DeviceTensor<f32>: Send, Sync);
// `&PinnedHostBuffer` only reads through `as_slice`.
assert_impl_all!(PinnedHostBuffer<f32>: Send, Sync);
// A signal crosses to the thread that holds the engine that waits for it.
assert_impl_all!(cuferry::engine::Signal: Send, Sync);
assert_impl_all!(Pending<Upload<f32>, InFlight>: Send);
assert_impl_all!(Pending<Download<f32>, InFlight>: Send);
assert_impl_all!(Pending<Upload<f32>, Returned>: Send, Sync);
assert_impl_all!(Pending<Download<f32>, InFlight>: Sync);
// An awaited transfer moves between an executor's threads, and is polled without pinning.
assert_impl_all!(Pending<Upload<f32>, InFlight>: std::future::IntoFuture);
assert_impl_all!(PendingFuture<Upload<f32>>: Send, Sync, Unpin, std::future::Future);
assert_impl_all!(PendingFuture<Download<u8>>: Send, Sync, Unpin, std::future::Future);
assert_impl_all!(
    PendingFuture<Upload<f32, RegisteredBuffer<f32>>>: Send,
    Sync,
    Unpin,
    std::future::Future
);
// `&RegisteredBuffer` only reads through `as_slice`; transfers over one move like any other.
assert_impl_all!(RegisteredBuffer<f32>: Send, Sync);
assert_impl_all!(Pending<Upload<f32, RegisteredBuffer<f32>>, InFlight>: Send, Sync);
assert_impl_all!(Pending<Download<f32, RegisteredBuffer<f32>>, Returned>: Send, Sync);
// A pending peer copy crosses to the thread that drives its destination engine (the two-GPU
// pattern); a collective in flight and its communicator move like any other value.
assert_impl_all!(Pending<PeerCopy<f32>>: Send, Sync, std::future::IntoFuture);
assert_impl_all!(Pending<PeerCopy<f32>, Returned>: Send, Sync);
assert_impl_all!(PendingFuture<PeerCopy<f32>>: Send, Sync, Unpin, std::future::Future);
assert_impl_all!(Pending<Collective<f32>>: Send, Sync, std::future::IntoFuture);
assert_impl_all!(Pending<Collective<f32>, Returned>: Send, Sync);
assert_impl_all!(PendingFuture<Collective<f32>>: Send, Unpin, std::future::Future);
assert_impl_all!(cuferry::collective::Communicator: Send, Sync);
assert_impl_all!(StagingLease<Proven>: Send, Sync);
assert_impl_all!(StagingLease<Unproven>: Send, Sync);

// The one give-back error, whatever it hands back.
assert_impl_all!(SubmitError<(PinnedHostBuffer<f32>, DeviceTensor<f32>)>: Send, Sync, std::error::Error);
assert_impl_all!(SubmitError<(RegisteredBuffer<f32>, DeviceTensor<f32>)>: Send, Sync, std::error::Error);
assert_impl_all!(SubmitError<(DeviceTensor<f32>, DeviceTensor<f32>)>: Send, Sync, std::error::Error);
assert_impl_all!(SubmitError<Vec<DeviceTensor<f32>>>: Send, Sync, std::error::Error);
assert_impl_all!(SubmitError<StagingLease<Proven>>: Send, Sync, std::error::Error);
assert_impl_all!(SubmitError<Vec<f32>>: Send, Sync, std::error::Error);
assert_impl_all!(SubmitError<DeviceTensor<f32>>: Send, Sync, std::error::Error);

/// Every error converts into the boxed error type that crosses threads.
#[test]
fn errors_travel_as_boxed_errors() {
    fn boxed<E: std::error::Error + Send + Sync + 'static>(
        e: E,
    ) -> Box<dyn std::error::Error + Send + Sync> {
        Box::new(e)
    }
    let mut engine = CudaEngine::simulated(Default::default());
    let lease = engine.staging_lease().unwrap();
    let mut other = CudaEngine::simulated(Default::default());
    let mut tensor = other.alloc_tensor::<u8>(&[4]).unwrap();
    let refused = lease
        .begin_upload(&mut other, &mut tensor, 0, 4)
        .unwrap_err();
    let message = boxed(refused).to_string();
    assert!(message.contains("belongs to engine"), "{message}");
}

assert_not_impl_any!(RawScope<'static, 'static>: Send, Sync);
assert_not_impl_any!(RawStream<'static>: Send, Sync);
assert_not_impl_any!(RawContext<'static>: Send, Sync);
assert_not_impl_any!(RawDevicePtr<'static>: Send, Sync);

// `Any` is implemented exactly for `'static` types.
assert_impl_all!(Error: Send, Sync, std::any::Any, std::error::Error);
assert_impl_all!(DriverError: Send, Sync, std::any::Any, Copy, std::error::Error);
assert_impl_all!(Box<dyn std::error::Error + Send + Sync + 'static>: From<Error>, From<DriverError>);

// Each domain's error is `'static`, crosses threads, converts into `Error` (so `?` lifts it) and
// into the boxed error type.
assert_impl_all!(UsageError: Send, Sync, std::any::Any, std::error::Error, Into<Error>);
assert_impl_all!(SetupError: Send, Sync, std::any::Any, std::error::Error, Into<Error>);
assert_impl_all!(LibraryError: Send, Sync, std::any::Any, std::error::Error, Into<Error>);
assert_impl_all!(ProgramError: Send, Sync, std::any::Any, std::error::Error, Into<Error>);
assert_impl_all!(StagingError: Send, Sync, std::any::Any, std::error::Error, Into<Error>);
assert_impl_all!(
    Box<dyn std::error::Error + Send + Sync + 'static>: From<UsageError>,
    From<SetupError>,
    From<LibraryError>,
    From<ProgramError>,
    From<StagingError>
);

/// A domain's error, wrapped in `Error`, reads as the domain's own (its message and its source),
/// boxes into the error type that crosses threads, and comes back out by downcasting.
#[test]
fn domain_errors_box_and_keep_their_message() {
    fn boxed<E: std::error::Error + Send + Sync + 'static>(
        e: E,
    ) -> Box<dyn std::error::Error + Send + Sync> {
        Box::new(e)
    }
    fn wrapped(error: Error) -> (String, Box<dyn std::error::Error + Send + Sync>) {
        let inner = match &error {
            Error::Usage(e) => e.to_string(),
            Error::Setup(e) => e.to_string(),
            Error::Library(e) => e.to_string(),
            Error::Program(e) => e.to_string(),
            Error::Staging(e) => e.to_string(),
            other => panic!("not a domain's error: {other:?}"),
        };
        assert_eq!(error.to_string(), inner, "the message is the domain's");
        assert!(
            std::error::Error::source(&error).is_none(),
            "none of these has a source"
        );
        (inner, boxed(error))
    }

    // A refusal of the crate itself.
    let mut engine = CudaEngine::simulated(Default::default());
    let refused = upload_tensor(&mut engine, &[1u8; 3], &[2, 2]).unwrap_err();
    let (message, boxed_error) = wrapped(refused);
    assert_eq!(
        message,
        "upload_tensor: data for the shape: expected 4 element(s) (shape [2, 2]), found 3"
    );
    let back = boxed_error
        .downcast::<Error>()
        .expect("an Error in the box");
    assert!(matches!(
        *back,
        Error::Usage(UsageError::LengthMismatch {
            expected: 4,
            found: 3,
            ..
        })
    ));

    // One of each other domain, lifted by `From`.
    let errors: [Error; 4] = [
        SetupError::Unavailable {
            library: "cuTENSOR",
            detail: "libcutensor.so.2".into(),
        }
        .into(),
        LibraryError::NotPositiveDefinite {
            operation: "cholesky_solve",
            order: 3,
        }
        .into(),
        ProgramError::Input {
            index: 1,
            expected: "f32 [2, 2]".into(),
            found: "f32 [4]".into(),
        }
        .into(),
        StagingError::Exhausted { depth: 4 }.into(),
    ];
    for error in errors {
        let (message, boxed_error) = wrapped(error);
        assert_eq!(boxed_error.to_string(), message);
    }

    // The top-level variants keep their source: a driver call's result code.
    let driver = boxed(Error::Driver {
        call: "cuMemAllocAsync",
        source: DriverError::OUT_OF_MEMORY,
    });
    let source = driver.source().expect("the driver's code is the source");
    assert_eq!(source.to_string(), "CUDA_ERROR_OUT_OF_MEMORY (2)");
}
