//! Signals between two engines on one GPU: the waiting engine's streams wait on the device. The
//! bodies are in `tests/bodies/signal.rs`, which the simulator binary runs too.

crate::bodies!(gpu; signal::{
    a_wait_for_a_signal_orders_another_engines_streams_on_the_device,
    signals_outlive_their_engine_and_leak_nothing,
});
