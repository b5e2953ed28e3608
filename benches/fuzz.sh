#!/usr/bin/env bash
# Fuzz the validate-and-plan path (and in-memory conversion of small inputs) for SECONDS.
#
#   benches/fuzz.sh SECONDS [extra libFuzzer flags...]    e.g. benches/fuzz.sh 600 -jobs=2
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain (`rustup toolchain
# install nightly`), or RUSTC_BOOTSTRAP=1 with stable, which this script falls back to.
# Built with AddressSanitizer, debug assertions and overflow checks. The repo's seed corpus
# (fuzz/corpus/validate) is read, never written: new inputs go to target/fuzz-corpus.
# libFuzzer's last line, "Done N runs in S second(s)", gives the execution count; a crash
# stops the run with exit 1 and the input is saved under fuzz/artifacts/validate/.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:?usage: benches/fuzz.sh SECONDS [libFuzzer flags...]}
shift

if rustup run nightly rustc --version >/dev/null 2>&1; then
    fuzz=(cargo +nightly fuzz)
else
    export RUSTC_BOOTSTRAP=1
    fuzz=(cargo fuzz)
fi
work=target/fuzz-corpus
mkdir -p "$work"
# fuzz/ is its own workspace; keep its build out of the main target folder's way.
export CARGO_TARGET_DIR="$PWD/fuzz/target"
"${fuzz[@]}" run --fuzz-dir fuzz validate "$work" fuzz/corpus/validate -- \
    -dict=fuzz/validate.dict -max_total_time="$secs" -print_final_stats=1 "$@"
