//! The DLPack ABI, as `dlpack.h` (version 1.x) lays it out: the versioned managed tensor and the
//! legacy one, the tensor they manage, its device and element type.
//!
//! Written from the header rather than generated, with every size and field offset checked at
//! compile time against the header's 64-bit layout, so a mistake here is a build failure, not a
//! consumer reading the wrong field.

use std::ffi::c_void;
use std::mem::{align_of, offset_of, size_of};

/// The DLPack major version this crate speaks.
pub const DLPACK_MAJOR_VERSION: u32 = 1;
/// The DLPack minor version the capsules this crate makes declare: 1.0, the oldest 1.x, so every
/// consumer of a 1.x tensor reads all of their fields.
pub const DLPACK_MINOR_VERSION: u32 = 0;
/// The flag of a tensor that must not be written (`DLPACK_FLAG_BITMASK_READ_ONLY`).
pub const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1;
/// The flag of a tensor the producer copied for the exchange (`DLPACK_FLAG_BITMASK_IS_COPIED`).
pub const DLPACK_FLAG_BITMASK_IS_COPIED: u64 = 2;

/// A DLPack version (`DLPackVersion`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLPackVersion {
    /// A new major version changes the ABI.
    pub major: u32,
    /// A new minor version adds values (device types, element types), not fields.
    pub minor: u32,
}

/// The CPU (`kDLCPU`).
pub const DL_CPU: u32 = 1;
/// A CUDA device (`kDLCUDA`).
pub const DL_CUDA: u32 = 2;
/// Page-locked host memory of CUDA (`kDLCUDAHost`).
pub const DL_CUDA_HOST: u32 = 3;
/// CUDA managed memory (`kDLCUDAManaged`).
pub const DL_CUDA_MANAGED: u32 = 13;

/// Where a tensor lives (`DLDevice`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    /// The kind of device (`DLDeviceType`): [`DL_CUDA`] for a CUDA device's memory.
    pub device_type: u32,
    /// The device's ordinal.
    pub device_id: i32,
}

/// Signed integers (`kDLInt`).
pub const DL_INT: u8 = 0;
/// Unsigned integers (`kDLUInt`).
pub const DL_UINT: u8 = 1;
/// IEEE floats (`kDLFloat`).
pub const DL_FLOAT: u8 = 2;
/// bfloat16 (`kDLBfloat`).
pub const DL_BFLOAT: u8 = 4;
/// Booleans, a byte each (`kDLBool`).
pub const DL_BOOL: u8 = 6;

/// An element type (`DLDataType`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    /// The kind of number (`DLDataTypeCode`): [`DL_INT`], [`DL_UINT`], [`DL_FLOAT`], ...
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes per element (vector types); 1 for a scalar.
    pub lanes: u16,
}

/// A tensor's description, not its ownership (`DLTensor`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLTensor {
    /// The start of the memory; the data begins `byte_offset` bytes on.
    pub data: *mut c_void,
    /// Where the memory is.
    pub device: DLDevice,
    /// The number of dimensions.
    pub ndim: i32,
    /// The element type.
    pub dtype: DLDataType,
    /// `ndim` extents.
    pub shape: *mut i64,
    /// `ndim` strides, in elements; null means compact row-major before DLPack 1.2.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// The legacy managed tensor (`DLManagedTensor`, DLPack before 1.0): no version, no flags.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when done with the tensor; frees `self` too.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// The versioned managed tensor (`DLManagedTensorVersioned`, DLPack 1.x).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// The version the producer made it in: a consumer that does not know the major version
    /// may only call the deleter.
    pub version: DLPackVersion,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when done with the tensor; frees `self` too.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// [`DLPACK_FLAG_BITMASK_READ_ONLY`], [`DLPACK_FLAG_BITMASK_IS_COPIED`].
    pub flags: u64,
    /// The tensor.
    pub dl_tensor: DLTensor,
}

// The header's layout on 64-bit targets, field by field.
const _: () = {
    assert!(size_of::<DLPackVersion>() == 8 && align_of::<DLPackVersion>() == 4);
    assert!(offset_of!(DLPackVersion, major) == 0 && offset_of!(DLPackVersion, minor) == 4);
    assert!(size_of::<DLDevice>() == 8 && align_of::<DLDevice>() == 4);
    assert!(offset_of!(DLDevice, device_type) == 0 && offset_of!(DLDevice, device_id) == 4);
    assert!(size_of::<DLDataType>() == 4 && align_of::<DLDataType>() == 2);
    assert!(offset_of!(DLDataType, code) == 0);
    assert!(offset_of!(DLDataType, bits) == 1);
    assert!(offset_of!(DLDataType, lanes) == 2);
    assert!(size_of::<DLTensor>() == 48 && align_of::<DLTensor>() == 8);
    assert!(offset_of!(DLTensor, data) == 0);
    assert!(offset_of!(DLTensor, device) == 8);
    assert!(offset_of!(DLTensor, ndim) == 16);
    assert!(offset_of!(DLTensor, dtype) == 20);
    assert!(offset_of!(DLTensor, shape) == 24);
    assert!(offset_of!(DLTensor, strides) == 32);
    assert!(offset_of!(DLTensor, byte_offset) == 40);
    assert!(size_of::<DLManagedTensor>() == 64 && align_of::<DLManagedTensor>() == 8);
    assert!(offset_of!(DLManagedTensor, dl_tensor) == 0);
    assert!(offset_of!(DLManagedTensor, manager_ctx) == 48);
    assert!(offset_of!(DLManagedTensor, deleter) == 56);
    assert!(size_of::<DLManagedTensorVersioned>() == 80);
    assert!(align_of::<DLManagedTensorVersioned>() == 8);
    assert!(offset_of!(DLManagedTensorVersioned, version) == 0);
    assert!(offset_of!(DLManagedTensorVersioned, manager_ctx) == 8);
    assert!(offset_of!(DLManagedTensorVersioned, deleter) == 16);
    assert!(offset_of!(DLManagedTensorVersioned, flags) == 24);
    assert!(offset_of!(DLManagedTensorVersioned, dl_tensor) == 32);
};
