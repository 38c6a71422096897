//! A checkpoint's tensors, or any `AnyTensor`, read and copied whatever their element type: the
//! tests compare files bit for bit, so they read a tensor's bytes as the file holds them.

use cuferry::{AnyTensor, CudaEngine, DType, Error, download_tensor};

/// The little-endian bytes of a downloaded `Vec` of one of the element types.
macro_rules! bytes_of {
    ($engine:expr, $tensor:expr, $($d:ident => $t:ty),*) => {
        match $tensor.dtype() {
            $(DType::$d => download_tensor($engine, $tensor.as_typed::<$t>().expect("its dtype"))?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),)*
            DType::Bool => download_tensor($engine, $tensor.as_typed::<bool>().expect("its dtype"))?
                .iter()
                .map(|&v| u8::from(v))
                .collect(),
            other => panic!("no element type {other:?} in the tests"),
        }
    };
}

/// `tensor`'s elements as little-endian bytes, as a safetensors file holds them.
pub(crate) fn any_bytes(engine: &mut CudaEngine, tensor: &AnyTensor) -> Result<Vec<u8>, Error> {
    Ok(bytes_of!(engine, tensor,
        F32 => f32, F64 => f64, F16 => cuferry::f16, BF16 => cuferry::bf16,
        I8 => i8, I16 => i16, I32 => i32, I64 => i64,
        U8 => u8, U16 => u16, U32 => u32, U64 => u64))
}

/// A device copy of `tensor`, queued on `engine` at once.
pub(crate) fn copy_any(engine: &mut CudaEngine, tensor: &AnyTensor) -> Result<AnyTensor, Error> {
    macro_rules! copy {
        ($($t:ty),*) => {
            $(if let Some(t) = tensor.as_typed::<$t>() {
                return Ok(AnyTensor::from(engine.copy_tensor(t)?));
            })*
        };
    }
    copy!(
        f32,
        f64,
        cuferry::f16,
        cuferry::bf16,
        i8,
        i16,
        i32,
        i64,
        u8,
        u16,
        u32,
        u64,
        bool
    );
    unreachable!("every element type is listed above")
}
