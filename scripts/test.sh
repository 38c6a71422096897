#!/usr/bin/env bash
# The test command: formatting, lints, documentation, every test that needs no GPU (unit tests,
# simulated-device tests, the proptest models, the trybuild cases, doctests) and the package.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
cargo clippy --all-targets --all-features -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --all-features
cargo test --all-features

# The package: everything the README and the guide link to, name or include must be in it
# (scripts/check-package.sh), and it must build on its own from the packaged files with the
# locked dependencies. The verifying build takes about 10 s here (2 cores) after the steps above,
# which leave the dependencies built, and under 2 minutes from a cold target directory: well
# inside CI's 90-minute budget, so CI verifies rather than only listing.
bash scripts/check-package.sh
cargo package --locked --allow-dirty
