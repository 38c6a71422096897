//! The element types a device tensor can hold.
//!
//! The set is closed (the trait is sealed) because every route depends on facts about the type
//! that the compiler cannot check: its size, its alignment, and whether every bit pattern is a
//! valid value. `bool` is the one member for which the last is false, and it has its own rules:
//! device bytes are decoded (`byte != 0`) rather than reinterpreted, and routes that would expose
//! raw device bytes as `bool` refuse it with a typed error.

use std::fmt;

/// The runtime tag of an [`Element`] type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// `f32`
    F32,
    /// `f64`
    F64,
    /// `f16` (IEEE half)
    F16,
    /// `bf16` (bfloat16)
    BF16,
    /// `i8`
    I8,
    /// `i16`
    I16,
    /// `i32`
    I32,
    /// `i64`
    I64,
    /// `u8`
    U8,
    /// `u16`
    U16,
    /// `u32`
    U32,
    /// `u64`
    U64,
    /// `bool`, one byte, 0 or 1 on the host.
    Bool,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The Rust name of the type.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
        }
    }

    /// Whether every bit pattern of the element's size is a valid value, so raw device bytes
    /// may be reinterpreted as it. False only for `bool`.
    pub const fn any_bit_pattern(self) -> bool {
        !matches!(self, DType::Bool)
    }

    /// Every element type, in declaration order.
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::Bool,
    ];
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
pub(crate) fn byte_len<T: Element>(count: usize, what: &'static str) -> crate::Result<usize> {
    count
        .checked_mul(T::DTYPE.size_bytes())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(crate::Error::SizeOverflow {
            what,
            count,
            element_bytes: T::DTYPE.size_bytes(),
        })
}
