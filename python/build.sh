#!/usr/bin/env bash
# Builds cuferry's Python extension with plain cargo (no maturin needed) and puts it where
# `import cuferry` finds it from python/: python/cuferry/_native.abi3.so. One build serves
# every CPython 3.9+ (the stable ABI). Linux.
#
#   bash python/build.sh          # the extension as users get it
#   bash python/build.sh --sim    # with `cuferry._native._use_simulator()`, for the tests
#
# The two builds keep target directories of their own (python/target/{plain,sim}), so
# switching between them rebuilds nothing. CARGO_BUILD_JOBS and the rest of cargo's
# environment apply as usual.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
  "") kind=plain; features=() ;;
  --sim) kind=sim; features=(--features sim) ;;
  *) echo "usage: $0 [--sim]" >&2; exit 2 ;;
esac
# An extension module does not link libpython: the interpreter that loads it provides it.
export PYO3_BUILD_EXTENSION_MODULE=1
cargo build --release --locked --manifest-path Cargo.toml --target-dir "target/$kind" "${features[@]}"
# Replaced, not written through: a running Python that mapped the old file keeps it intact.
cp "target/$kind/release/lib_native.so" cuferry/.native.tmp.so
mv -f cuferry/.native.tmp.so cuferry/_native.abi3.so
echo "built cuferry/_native.abi3.so ($kind)" >&2
