//! Blocking routes: ordinary host memory in, ordinary host memory out.
//!
//! Each route returns only when the caller's host memory is no longer touched by the device: an
//! upload has read its source, a download has written its destination. Device-side ordering is
//! the stream's: an upload is visible to every later operation on the engine.

use crate::element::{as_bytes, byte_len, DType, Element};
use crate::engine::CudaEngine;
use crate::error::{Error, Result};
use crate::tensor::{shape_len, DeviceTensor};

/// Uploads `data` into a new device tensor of the given shape, and returns once `data` has been
/// read.
///
/// # Errors
/// [`Error::ShapeMismatch`] when `shape` does not describe `data.len()` elements;
/// [`Error::Driver`] or [`Error::DeviceFault`] when the device refuses or fails.
pub fn upload_tensor<T: Element>(
    engine: &mut CudaEngine,
    data: &[T],
    shape: &[usize],
) -> Result<DeviceTensor<T>> {
    let expected = shape_len(shape)?;
    if expected != data.len() {
        return Err(Error::ShapeMismatch {
            shape: shape.to_vec(),
            expected,
            actual: data.len(),
        });
    }
    let tensor = DeviceTensor::alloc(engine, shape)?;
    if data.is_empty() {
        return Ok(tensor);
    }
    let bytes = as_bytes(data);
    let mut st = engine.enter()?;
    // SAFETY: `bytes` stays borrowed (and so unchanged and alive) until `wait_stream` below has
    // proven the copy complete; the tensor is a fresh allocation of exactly `bytes.len()` bytes.
    unsafe {
        st.driver
            .copy_htod(tensor.raw_ptr(), bytes.as_ptr(), bytes.len())
    }
    .map_err(Error::driver("cuMemcpyHtoDAsync"))?;
    st.wait_stream("blocking upload")?;
    drop(st);
    Ok(tensor)
}

/// Downloads a tensor into a new `Vec`, and returns once the data has arrived.
///
/// `bool` tensors are decoded byte by byte (`byte != 0`), since device bytes need not be 0 or 1.
///
/// # Errors
/// [`Error::WrongDevice`]/[`Error::WrongEngine`] when the tensor is not this engine's;
/// [`Error::Driver`] or [`Error::DeviceFault`] when the device refuses or fails.
pub fn download_tensor<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
) -> Result<Vec<T>> {
    tensor.check_engine(engine)?;
    if T::DTYPE == DType::Bool {
        let mut raw = Vec::<u8>::with_capacity(tensor.len());
        download_raw(engine, tensor, &mut raw)?;
        let decoded: Vec<bool> = raw.iter().map(|&b| b != 0).collect();
        // `T` is `bool` here (checked through the sealed `DTYPE` above).
        let any: Box<dyn std::any::Any> = Box::new(decoded);
        return Ok(*any.downcast::<Vec<T>>().expect("DTYPE Bool is bool"));
    }
    let mut out = Vec::with_capacity(tensor.len());
    download_raw(engine, tensor, &mut out)?;
    Ok(out)
}

/// Downloads a tensor into a caller-owned `Vec`, resized to the tensor's length without
/// reallocating when its capacity suffices, and returns it filled.
///
/// # Errors
/// [`Error::UnsupportedElement`] for `bool`, because raw device bytes need not be 0 or 1 (use
/// [`download_tensor`], which decodes them); otherwise as [`download_tensor`]. On error the
/// buffer is returned to nobody only when the device may still write it (it is then leaked,
/// never freed).
pub fn download_tensor_into<T: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
    mut buffer: Vec<T>,
) -> Result<Vec<T>> {
    if !T::DTYPE.any_bit_pattern() {
        return Err(Error::UnsupportedElement {
            operation: "download_tensor_into",
            dtype: T::DTYPE,
            reason:
                "raw device bytes are not guaranteed to be 0 or 1; download_tensor decodes them",
        });
    }
    tensor.check_engine(engine)?;
    buffer.clear();
    buffer.reserve_exact(tensor.len());
    download_raw(engine, tensor, &mut buffer)?;
    Ok(buffer)
}

/// Copies the tensor's bytes into `out`'s spare capacity (which must hold `tensor.len()`
/// elements of `U`, where `U` has `T`'s size and accepts any bit pattern) and sets its length.
fn download_raw<T: Element, U: Element>(
    engine: &mut CudaEngine,
    tensor: &DeviceTensor<T>,
    out: &mut Vec<U>,
) -> Result<()> {
    debug_assert!(U::DTYPE.any_bit_pattern() && U::DTYPE.size_bytes() == T::DTYPE.size_bytes());
    debug_assert!(out.is_empty() && out.capacity() >= tensor.len());
    let bytes = byte_len::<T>(tensor.len(), "download")?;
    if bytes == 0 {
        return Ok(());
    }
    let mut st = engine.enter()?;
    // SAFETY: `out` has capacity for `bytes` bytes and is exclusively borrowed until the wait
    // below proves the copy complete; the tensor is a live allocation of `bytes` bytes.
    unsafe {
        st.driver
            .copy_dtoh(out.as_mut_ptr().cast::<u8>(), tensor.raw_ptr(), bytes)
    }
    .map_err(Error::driver("cuMemcpyDtoHAsync"))?;
    if let Err(e) = st.wait_stream("blocking download") {
        // The device may still write the buffer: give its storage up rather than free it.
        std::mem::forget(std::mem::take(out));
        return Err(e);
    }
    // SAFETY: the copy wrote all `tensor.len()` elements, each a valid `U` (any bit pattern).
    unsafe { out.set_len(tensor.len()) };
    Ok(())
}
