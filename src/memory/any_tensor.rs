//! One device tensor whose element type is known only at run time.
//!
//! A checkpoint's tensors and a prepared program's new outputs both have element types that a
//! file or a program decides, not the caller's code. Both are this one type: a
//! [`DeviceTensor<T>`] of one of the [`Element`] types, with its [`DType`] at hand, borrowed as
//! the typed tensor when the type is right ([`as_typed`](AnyTensor::as_typed)) and taken out as
//! it ([`into_typed`](AnyTensor::into_typed)), the refusal handing it back. It lives with the
//! tensors because it is one of them; the routes and the programs above make and take it.

use crate::dtype::DType;
use crate::error::{Error, SubmitError, UsageError};
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use std::any::Any;
use std::fmt;

/// What crate code does with the tensor inside an [`AnyTensor`], whatever its element type:
/// [`AnyTensor::visit`] calls [`visit`](Self::visit) with the typed tensor.
pub(crate) trait Visit {
    /// What the visit gives.
    type Out;
    /// Visits the typed tensor.
    fn visit<T: Element>(self, tensor: &DeviceTensor<T>) -> Self::Out;
}

macro_rules! typed {
    ($($variant:ident => $t:ty),* $(,)?) => {
        /// The typed tensor, one variant per element type.
        enum Typed {
            $($variant(DeviceTensor<$t>),)*
        }

        impl Typed {
            fn as_any(&self) -> &dyn Any {
                match self {
                    $(Typed::$variant(t) => t,)*
                }
            }

            fn as_any_mut(&mut self) -> &mut dyn Any {
                match self {
                    $(Typed::$variant(t) => t,)*
                }
            }

            fn into_any(self) -> Box<dyn Any> {
                match self {
                    $(Typed::$variant(t) => Box::new(t),)*
                }
            }

            fn shape(&self) -> &[usize] {
                match self {
                    $(Typed::$variant(t) => t.shape(),)*
                }
            }

            fn visit<V: Visit>(&self, visitor: V) -> V::Out {
                match self {
                    $(Typed::$variant(t) => visitor.visit(t),)*
                }
            }

            /// The variant of `tensor`'s element type.
            fn of<T: Element>(tensor: DeviceTensor<T>) -> Typed {
                let mut slot = Some(tensor);
                let any: &mut dyn Any = &mut slot;
                $(
                    if let Some(typed) = any.downcast_mut::<Option<DeviceTensor<$t>>>() {
                        return Typed::$variant(typed.take().expect("filled above"));
                    }
                )*
                unreachable!("`Element` is sealed to the types `Typed` has a variant for")
            }

            /// The tensor of `dtype` and `shape` over `bytes`; `None` when its elements do not
            /// fill them exactly.
            ///
            /// # Safety
            /// As [`DeviceTensor::reinterpret`]: the bytes are, or will be once the work queued
            /// into them completes, valid values of the type `dtype` names.
            #[cfg(any(feature = "safetensors", feature = "dlpack"))]
            unsafe fn from_bytes(
                bytes: DeviceTensor<u8>,
                dtype: DType,
                shape: &[usize],
            ) -> Option<Typed> {
                match dtype {
                    // SAFETY: forwarded from the caller, for the type `dtype` names.
                    $(DType::$variant => unsafe { bytes.reinterpret::<$t>(shape) }.map(Typed::$variant),)*
                }
            }
        }
    };
}

typed!(
    F32 => f32,
    F64 => f64,
    F16 => half::f16,
    BF16 => half::bf16,
    I8 => i8,
    I16 => i16,
    I32 => i32,
    I64 => i64,
    U8 => u8,
    U16 => u16,
    U32 => u32,
    U64 => u64,
    Bool => bool,
);

/// A device tensor whose element type is known at run time: a checkpoint's tensor, a prepared
/// program's new output, or any `DeviceTensor<T>` (`AnyTensor::from`).
///
/// It is one `DeviceTensor<T>` underneath, of the element type [`dtype`](Self::dtype) names, so
/// it is freed, ordered and retired as that tensor is. [`as_typed`](Self::as_typed) borrows it as
/// the `DeviceTensor<T>` when `T` is its type; [`into_typed`](Self::into_typed) takes it out,
/// handing it back in the refusal otherwise.
///
/// ```
/// # use cuferry::sim::SimConfig;
/// # use cuferry::{AnyTensor, CudaEngine, DType, upload_tensor};
/// # let mut engine = CudaEngine::simulated(SimConfig::default());
/// let tensor = AnyTensor::from(upload_tensor(&mut engine, &[1.0f32, 2.0], &[2])?);
/// assert_eq!((tensor.dtype(), tensor.shape()), (DType::F32, &[2][..]));
/// assert!(tensor.as_typed::<u32>().is_none());
/// let refused = tensor.into_typed::<u32>().unwrap_err();
/// assert!(refused.to_string().contains("holds f32, not the u32 asked for"), "{refused}");
/// let tensor = refused.into_input().unwrap(); // the tensor back, unchanged
/// let typed = tensor.into_typed::<f32>()?;
/// # Ok::<(), cuferry::Error>(())
/// ```
pub struct AnyTensor(Typed);

impl AnyTensor {
    /// The element type.
    pub fn dtype(&self) -> DType {
        struct Dtype;
        impl Visit for Dtype {
            type Out = DType;
            fn visit<T: Element>(self, _: &DeviceTensor<T>) -> DType {
                T::DTYPE
            }
        }
        self.0.visit(Dtype)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.0.shape()
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tensor as a `DeviceTensor<T>`, when `T` is its element type.
    pub fn as_typed<T: Element>(&self) -> Option<&DeviceTensor<T>> {
        self.0.as_any().downcast_ref()
    }

    /// The tensor as a mutable `DeviceTensor<T>`, when `T` is its element type.
    pub fn as_typed_mut<T: Element>(&mut self) -> Option<&mut DeviceTensor<T>> {
        self.0.as_any_mut().downcast_mut()
    }

    /// The tensor as a `DeviceTensor<T>`, when `T` is its element type; the tensor back
    /// otherwise, unchanged, in an error that `?` carries into a `cuferry::Error` or a
    /// `Box<dyn std::error::Error>`.
    ///
    /// # Errors
    /// [`SubmitError::Rejected`] with the tensor as its input and
    /// [`UsageError::ElementTypeMismatch`] (the type asked for, the type the tensor holds, its
    /// shape) as its error, when `T` is not its element type.
    // A refusal hands the tensor back by value, as every give-back error does.
    #[allow(clippy::result_large_err)]
    pub fn into_typed<T: Element>(self) -> Result<DeviceTensor<T>, SubmitError<AnyTensor>> {
        self.try_typed().map_err(|input| {
            let error = Error::Usage(UsageError::ElementTypeMismatch {
                operation: "into_typed",
                asked: T::DTYPE,
                holds: input.dtype(),
                shape: input.shape().to_vec(),
            });
            SubmitError::Rejected { input, error }
        })
    }

    /// The tensor as a `DeviceTensor<T>`, when `T` is its element type; itself otherwise.
    pub(crate) fn try_typed<T: Element>(self) -> Result<DeviceTensor<T>, AnyTensor> {
        if self.dtype() != T::DTYPE {
            return Err(self);
        }
        let boxed = self.0.into_any();
        Ok(*boxed
            .downcast::<DeviceTensor<T>>()
            .expect("the element type was checked above"))
    }

    /// Calls `visitor` with the typed tensor.
    #[cfg(any(feature = "safetensors", feature = "dlpack"))]
    pub(crate) fn visit<V: Visit>(&self, visitor: V) -> V::Out {
        self.0.visit(visitor)
    }

    /// The tensor of `dtype` and `shape` over `bytes`; `None` when its elements do not fill
    /// them exactly.
    ///
    /// # Safety
    /// As [`DeviceTensor::reinterpret`]: the bytes are, or will be once the work queued into
    /// them completes, valid values of the type `dtype` names (for `bool`, every byte 0 or 1).
    #[cfg(any(feature = "safetensors", feature = "dlpack"))]
    pub(crate) unsafe fn from_bytes(
        bytes: DeviceTensor<u8>,
        dtype: DType,
        shape: &[usize],
    ) -> Option<AnyTensor> {
        // SAFETY: forwarded from the caller.
        unsafe { Typed::from_bytes(bytes, dtype, shape) }.map(AnyTensor)
    }
}

impl<T: Element> From<DeviceTensor<T>> for AnyTensor {
    fn from(tensor: DeviceTensor<T>) -> AnyTensor {
        AnyTensor(Typed::of(tensor))
    }
}

impl fmt::Debug for AnyTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyTensor")
            .field("dtype", &self.dtype())
            .field("shape", &self.shape())
            .finish()
    }
}
