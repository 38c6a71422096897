//! Broadcasting elementwise operations, transposed products and `linear` on the GPU, against
//! host references: the bodies of `tests/bodies/broadcast.rs`, which the simulator binary runs
//! too.

crate::bodies::broadcast::tests!(gpu);
