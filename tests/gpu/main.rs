//! Tests that need a CUDA device. Every test here is `#[ignore = "needs a CUDA device"]`: run
//! them on a GPU machine with `cargo test --test gpu -- --ignored --test-threads=1`.

mod common;
mod engine;
mod pending;
mod staging;
