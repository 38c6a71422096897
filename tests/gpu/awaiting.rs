//! Awaiting pending transfers on device 0: woken by the driver's stream callbacks, on tokio's
//! current-thread and multi-thread runtimes. The bodies are in `tests/bodies/awaiting.rs`, which
//! the simulator binary runs too.

crate::bodies::awaiting::tests!(gpu);
