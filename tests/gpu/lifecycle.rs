//! The lifecycles behind every route, on device 0: the bodies in `tests/bodies/lifecycle.rs`,
//! which the simulator binary runs too.

crate::bodies::lifecycle::tests!(gpu);
