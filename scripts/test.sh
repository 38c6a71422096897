#!/usr/bin/env bash
# The test command: formatting, lints, documentation and every test that needs no GPU
# (unit tests, simulated-device tests, the proptest models, the trybuild cases, doctests).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
cargo clippy --all-targets --all-features -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --all-features
cargo test --all-features
