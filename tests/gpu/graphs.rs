//! Prepared programs on device 0: the bodies in `tests/bodies/graphs.rs`, which the simulator
//! binary runs too.

crate::bodies::graphs::tests!(gpu);
