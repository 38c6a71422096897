#!/usr/bin/env bash
# The test command: formatting, lints, documentation, every test that needs no GPU (unit tests,
# simulated-device tests, the proptest models, the trybuild cases, doctests), the loom models of
# the hand-written concurrency, the minimum supported Rust version, and the package.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step prints how long it took, and the total at the end, so a slow step shows in CI's log.
step() {
  local start=$SECONDS
  "$@"
  echo "test.sh: $((SECONDS - start)) s for: $*" >&2
}
trap 'echo "test.sh: $SECONDS s in all" >&2' EXIT
step cargo fmt --all --check
step cargo clippy --locked --all-targets --all-features -- -D warnings
# The library as a dependent builds it, without features: code only one feature uses must not
# warn there.
step cargo clippy --lib --no-default-features -- -D warnings
RUSTDOCFLAGS="-D warnings" step cargo doc --no-deps --all-features
step cargo test --all-features

# The Python module (python/, a Cargo workspace of its own): built with the simulated device, and
# its tests run with the standard library's unittest (no torch, no GPU). CUFERRY_EXPECT_SIM=1
# makes a build without the simulator a failure rather than a skip.
step bash python/build.sh --sim
PYTHONPATH=python CUFERRY_EXPECT_SIM=1 step python3 -m unittest discover -s python/tests

# The loom models (`loom_models` in src/sync/copy_pool.rs, src/routes/host/blocking.rs and
# src/lifecycle/fence_future.rs; see src/sync/mod.rs): the copy threads' hand-off, the blocking routes'
# claims and part publication, and the wake slot between a poll and the device's call, under every
# interleaving loom explores. The cfg changes every crate's build, so they get a
# target directory of their own (nothing above is rebuilt), and release, since loom runs each
# model thousands of times. From a cold target directory this took 2 min 8 s here (2 cores):
# 1 min 41 s to build, 27 s to run the models (up to 3.5 min to build while other builds ran
# beside it); a small part of CI's 90 minutes.
RUSTFLAGS="--cfg cuferry_loom" CARGO_TARGET_DIR=target/loom step cargo test --release --lib loom

# MSRV: Cargo.toml's `rust-version` is a claim only if something builds with it. Check every
# target with exactly that release (1.95 means 1.95.0). A missing toolchain is an error, not a
# skip: CI's image has it. On a machine without it, CUFERRY_SKIP_MSRV=1 skips this step, loudly
# (.ci/run never allows that).
msrv=$(sed -n 's/^rust-version = "\([0-9.]*\)"$/\1/p' Cargo.toml)
if [[ -z $msrv ]]; then
  echo "error: no rust-version in Cargo.toml" >&2
  exit 1
fi
toolchain=$msrv
[[ $toolchain =~ ^[0-9]+\.[0-9]+$ ]] && toolchain=$toolchain.0
installed=$(rustup toolchain list 2>/dev/null || true)
if grep -q "^$toolchain-" <<<"$installed"; then
  # When the default toolchain is that very compiler (the same version and commit), the clippy
  # step above has already checked every target with every feature, locked, with it: a second
  # check would repeat the same work in a cold cache of its own.
  if [[ $(rustc -vV) == "$(rustc "+$toolchain" -vV)" ]]; then
    echo "test.sh: MSRV $msrv: checked by the clippy step (the default toolchain is $toolchain)" >&2
  else
    step cargo "+$toolchain" check --locked --all-targets --all-features
  fi
elif [[ ${CUFERRY_SKIP_MSRV:-} == 1 ]]; then
  echo "warning: SKIPPED the MSRV check: toolchain $toolchain (rust-version $msrv) is not installed" >&2
else
  echo "error: rust-version is $msrv, but toolchain $toolchain is not installed, so it cannot be" >&2
  echo "checked: rustup toolchain install $toolchain --profile minimal" >&2
  echo "(or set CUFERRY_SKIP_MSRV=1 to skip this check on this machine)" >&2
  exit 1
fi

# The package: everything the README and the guide link to, name or include must be in it
# (scripts/check-package.sh), and it must build on its own from the packaged files with the
# locked dependencies. The verifying build takes about 10 s here (2 cores) after the steps above,
# which leave the dependencies built, and under 2 minutes from a cold target directory: well
# inside CI's 90-minute budget, so CI verifies rather than only listing.
step bash scripts/check-package.sh
step cargo package --locked --allow-dirty
