//! DLPack exchange: the bodies of `tests/bodies/dlpack.rs` on the GPU.

crate::bodies::dlpack::tests!(gpu);
