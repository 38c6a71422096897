//! Blocking transfers through the staging ring, on device 0: the bodies in
//! `tests/bodies/transfers.rs`, which the simulator binary runs too.

crate::bodies!(gpu; transfers::{every_direction_moves_the_right_bytes_around_the_ring_depth});
