//! The Send/Sync design, asserted.
//!
//! - The engine and the values it hands out move between threads: an engine is held by one
//!   caller at a time (operations borrow it `&mut`), and its shared core is behind a mutex.
//! - Device tensors may be shared: `&DeviceTensor` exposes only metadata.
//! - An in-flight transfer can be moved to another thread and waited on there.
//! - Raw scope handles are tied to the thread on which the engine's context is current, so they
//!   are neither `Send` nor `Sync`.
//! - Errors travel: `Error` and `DriverError` cross threads and live as long as needed, so they
//!   fit `Box<dyn std::error::Error + Send + Sync>`, `anyhow` and a channel to another thread.

use cuferry::{
    CudaEngine, DeviceTensor, Download, DriverError, Error, InFlight, Pending, PinnedHostBuffer,
    RawContext, RawDevicePtr, RawScope, RawStream, Returned, Upload,
};
use static_assertions::{assert_impl_all, assert_not_impl_any};

assert_impl_all!(CudaEngine: Send);
assert_impl_all!(DeviceTensor<f32>: Send, Sync);
// `&PinnedHostBuffer` only reads through `as_slice`.
assert_impl_all!(PinnedHostBuffer<f32>: Send, Sync);
assert_impl_all!(Pending<Upload, f32, InFlight>: Send);
assert_impl_all!(Pending<Download, f32, InFlight>: Send);
assert_impl_all!(Pending<Upload, f32, Returned>: Send);

assert_not_impl_any!(RawScope<'static, 'static>: Send, Sync);
assert_not_impl_any!(RawStream<'static>: Send, Sync);
assert_not_impl_any!(RawContext<'static>: Send, Sync);
assert_not_impl_any!(RawDevicePtr<'static>: Send, Sync);

// `Any` is implemented exactly for `'static` types.
assert_impl_all!(Error: Send, Sync, std::any::Any, std::error::Error);
assert_impl_all!(DriverError: Send, Sync, std::any::Any, Copy, std::error::Error);
assert_impl_all!(Box<dyn std::error::Error + Send + Sync + 'static>: From<Error>, From<DriverError>);
