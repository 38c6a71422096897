//! Broadcasting elementwise operations, transposed products and `linear` on the simulated
//! device: NumPy's rules (trailing dimensions aligned, each equal or 1), checked against a host
//! reference for every element family; shapes that do not broadcast get a typed error that
//! names both shapes and the dimension, and leak nothing; prepared programs broadcast and fuse
//! as the eager operations do. Every test is a body of `tests/bodies/broadcast.rs`, which the
//! GPU suite runs on device 0 too.

crate::bodies::broadcast::tests!(sim);
