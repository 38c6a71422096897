//! Registered buffers on device 0: `Vec`s page-locked in place, round-tripped through the
//! pending routes, and given back as the same allocation. The bodies are in
//! `tests/bodies/registered.rs`, which the simulator binary runs too.

crate::bodies::registered::tests!(gpu);
