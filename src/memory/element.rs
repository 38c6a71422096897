//! The element types a device tensor can hold.
//!
//! The set is closed (the trait is sealed) because every route depends on facts about the type
//! that the compiler cannot check: its size, its alignment, and whether every bit pattern is a
//! valid value. `bool` is the one member for which the last is false, and it has its own rules:
//! device bytes are decoded (`byte != 0`) rather than reinterpreted, and routes that would expose
//! raw device bytes as `bool` refuse it with a typed error.

use crate::dtype::DType;
use crate::error::{Error, Result, UsageError};
use std::fmt;

mod sealed {
    pub trait Sealed {}
}

/// A type a [`DeviceTensor`](crate::DeviceTensor) can hold. Sealed: implemented for `f32`,
/// `f64`, `half::f16`, `half::bf16`, the signed and unsigned integers from 8 to 64 bits, and
/// `bool`.
///
/// Implementors are plain-old-data with no padding; all but `bool` accept any bit pattern.
pub trait Element:
    sealed::Sealed + Copy + Send + Sync + PartialEq + fmt::Debug + Default + 'static
{
    /// The runtime tag.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
        const _: () = assert!(std::mem::size_of::<$t>() == DType::$d.size_bytes());
    )*};
}

element!(
    f32 => F32,
    f64 => F64,
    half::f16 => F16,
    half::bf16 => BF16,
    i8 => I8,
    i16 => I16,
    i32 => I32,
    i64 => I64,
    u8 => U8,
    u16 => U16,
    u32 => U32,
    u64 => U64,
    bool => Bool,
);

/// Views a slice of elements as its bytes.
pub(crate) fn as_bytes<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: every `Element` is plain data without padding (sealed set, sizes asserted above),
    // so its storage is `size_of_val(data)` initialised bytes; `u8` has alignment 1.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// Byte length of `count` elements of `T`, checked.
pub(crate) fn byte_len<T: Element>(count: usize, what: &'static str) -> Result<usize> {
    dtype_byte_len(T::DTYPE, count, what)
}

/// Byte length of `count` elements of `dtype`: [`UsageError::SizeOverflow`](crate::error::UsageError::SizeOverflow) past `isize::MAX` bytes,
/// the most one allocation can address.
pub(crate) fn dtype_byte_len(dtype: DType, count: usize, what: &'static str) -> Result<usize> {
    count
        .checked_mul(dtype.size_bytes())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::Usage(UsageError::SizeOverflow {
                what,
                count,
                element_bytes: dtype.size_bytes(),
            })
        })
}
