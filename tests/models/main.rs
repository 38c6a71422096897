//! The property-based models, in one binary: each drives the crate with random operation
//! sequences against the simulated device and checks every step against a model of what the
//! lifecycle rules allow. A model's regressions file sits next to it
//! (`<model>.proptest-regressions`). The staged routes run with four copy threads.

#[path = "../support/copy_threads.rs"]
mod copy_threads;
#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod duplex;
mod end_to_end;
mod faults;
mod graph;
mod kernels;
mod peer;
mod retirement;
mod staging;
