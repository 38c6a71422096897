//! Blocking transfers through the staging ring, on device 0: the bodies in
//! `tests/bodies/transfers.rs`, which the simulator binary runs too.

crate::bodies::transfers::tests!(gpu);
