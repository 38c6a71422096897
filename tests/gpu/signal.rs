//! Signals between two engines on one GPU: the waiting engine's streams wait on the device. The
//! bodies are in `tests/bodies/signal.rs`, which the simulator binary runs too.

crate::bodies::signal::tests!(gpu);
